//! A command run to its end in a sandbox, for callers other than the model: the team's hooks.
//!
//! It takes the path a `bash` tool call takes (the keeper, the sandbox's plan and Landlock
//! ruleset, the hidden environment), with what a hook needs besides: its own variables, a
//! document on stdin, stdout and stderr apart, the exit code, and a stop that ends it early.
//! Unlike a tool call, nothing it starts outlives it: once it exits (or times out, or is
//! stopped) the keeper kills everything under it.

use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use super::bash::{Report, collect, end_keeper, start_confined};
use super::keeper::Exec;
use crate::sandbox::Sandbox;

/// What to run, where, and with what.
pub struct Confined<'a> {
    pub sandbox: &'a Sandbox,
    /// Where it starts (inside the sandbox's working dir).
    pub workdir: &'a Path,
    /// Run as `bash -c COMMAND`.
    pub command: &'a str,
    /// Variables it gets besides the worker's environment (less the hidden ones).
    pub env: &'a [(String, String)],
    /// Written to its stdin, which is then closed.
    pub stdin: &'a [u8],
    pub timeout: Duration,
    /// Polled while it runs: true ends it at once, with no verdict.
    pub stop: &'a dyn Fn() -> bool,
}

/// How it ended.
#[derive(Debug, Default)]
pub struct Finished {
    /// Its exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that killed it, when one did.
    pub signal: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub timed_out: bool,
    /// Ended by `stop`.
    pub stopped: bool,
    /// It could not be started (or its keeper died): why.
    pub error: Option<String>,
}

/// Variables a confined command never gets, besides the tool's hidden ones: where the team dir
/// is (it is hidden from it anyway).
const ALSO_HIDDEN: [&str; 3] = ["TROUPE_TEAM_DIR", "WATCHDOG_USEC", "WATCHDOG_PID"];

/// Runs `c` to its end (see the module's documentation).
pub fn run_confined(c: &Confined<'_>) -> Finished {
    let failed = |why: String| Finished {
        error: Some(why),
        ..Finished::default()
    };
    let (mut keeper, link) = match start_confined(c.sandbox, c.workdir, Stdio::piped(), |tmpdir| {
        Exec::with_env(c.command, tmpdir, c.env, &ALSO_HIDDEN)
    }) {
        Ok(k) => k,
        Err(e) => return failed(e),
    };
    // A command that does not read its stdin gets EPIPE here, not a stuck caller.
    let feed = keeper.stdin.take().map(|mut w| {
        let input = c.stdin.to_owned();
        std::thread::spawn(move || {
            let _ = w.write_all(&input);
        })
    });
    let pipes = [
        keeper.stdout.take().map(OwnedFd::from),
        keeper.stderr.take().map(OwnedFd::from),
    ];
    let started = Instant::now();
    let mut report = Report::default();
    let mut stopped = false;
    let [stdout, stderr] = collect(pipes, link.as_fd(), started + c.timeout, &mut || {
        if (c.stop)() {
            stopped = true;
            return true;
        }
        report.check(&link)
    });
    // Whatever it leaves running goes now: closing the link makes the keeper kill it all.
    drop(link);
    end_keeper(&mut keeper);
    if let Some(f) = feed {
        let _ = f.join();
    }
    let mut out = Finished {
        stdout,
        stderr,
        stopped: stopped && report.status.is_none(),
        ..Finished::default()
    };
    match report.status {
        Some(s) if libc::WIFEXITED(s) => out.code = Some(libc::WEXITSTATUS(s)),
        Some(s) if libc::WIFSIGNALED(s) => out.signal = Some(libc::WTERMSIG(s)),
        Some(_) => {}
        None if out.stopped => {}
        None if report.keeper_gone => {
            out.error = Some("its keeper was killed before it finished".to_owned());
        }
        None => out.timed_out = true,
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(command: &str, stdin: &[u8], timeout: Duration) -> Finished {
        let t = tempfile::tempdir().unwrap();
        let sb = Sandbox::off();
        let env = vec![("HOOK_VAR".to_owned(), "from-the-caller".to_owned())];
        run_confined(&Confined {
            sandbox: &sb,
            workdir: t.path(),
            command,
            env: &env,
            stdin,
            timeout,
            stop: &|| false,
        })
    }

    #[test]
    fn stdin_env_streams_and_the_exit_code_come_back_apart() {
        let f = run(
            "read line; echo \"got $line $HOOK_VAR\"; echo oops >&2; exit 2",
            b"the-doc\n",
            Duration::from_secs(20),
        );
        assert_eq!(f.code, Some(2), "{f:?}");
        assert_eq!(
            String::from_utf8_lossy(&f.stdout),
            "got the-doc from-the-caller\n"
        );
        assert_eq!(String::from_utf8_lossy(&f.stderr), "oops\n");
        assert!(!f.timed_out && !f.stopped && f.error.is_none());
    }

    #[test]
    fn a_timeout_ends_it_and_everything_it_started() {
        let f = run("sleep 30 & sleep 30", b"", Duration::from_millis(300));
        assert!(f.timed_out, "{f:?}");
        assert_eq!(f.code, None);
    }
}
