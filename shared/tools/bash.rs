//! The `bash` tool: a command in the working directory, with a timeout and an output cap.
//!
//! The command runs in its own process group, dies with the worker (`PR_SET_PDEATHSIG`), and on
//! timeout the whole group is killed. Its output is read with poll(2) against a deadline: until
//! both pipes reach EOF, for at most [`GRACE`] after bash has exited (a daemon the command
//! started may hold the pipes as long as it lives), and never past the timeout. API keys and `NOTIFY_SOCKET` are removed from its
//! environment. There is no denylist of command strings: confinement is the working directory
//! and the process boundary, not substring matching.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use serde_json::Value;

use super::{ToolOutput, cap_output, check_input, input_str};
use crate::tools::fs::Workdir;

/// Default timeout of one command.
pub const BASH_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `bash{command}`. A non-zero exit is a normal result ending in `[exit code N]`; a
/// timeout is an error result with the partial output.
pub fn bash(wd: &Workdir, input: &Value, timeout: Duration) -> ToolOutput {
    let command = match check_input(input).and_then(|_| input_str(input, "command")) {
        Ok(c) => c,
        Err(e) => return ToolOutput::error(e),
    };
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(command)
        .current_dir(wd.root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .env_remove("NOTIFY_SOCKET")
        .process_group(0);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return ToolOutput::error(format!("failed to start bash: {e}")),
    };
    let pgid = nix::unistd::Pid::from_raw(child.id() as i32);
    let pipes = [
        child.stdout.take().map(OwnedFd::from),
        child.stderr.take().map(OwnedFd::from),
    ];
    let mut status = None;
    let mut wait_error = None;
    let [out, err] = collect(pipes, Instant::now() + timeout, &mut || {
        if status.is_none() && wait_error.is_none() {
            match child.try_wait() {
                Ok(s) => status = s,
                Err(e) => wait_error = Some(e),
            }
        }
        status.is_some() || wait_error.is_some()
    });
    if let Some(e) = wait_error {
        let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
        let _ = child.wait();
        return ToolOutput::error(format!("failed to wait for bash: {e}"));
    }
    let timed_out = status.is_none();
    // Whatever the command left running in its group goes with it (on a timeout, bash too).
    let _ = nix::sys::signal::killpg(pgid, nix::sys::signal::Signal::SIGKILL);
    if timed_out {
        status = child.wait().ok();
    }
    let mut outs = [out, err].into_iter();
    let stdout = String::from_utf8_lossy(&outs.next().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&outs.next().unwrap_or_default()).into_owned();
    let mut text = match (stdout.is_empty(), stderr.is_empty()) {
        (_, true) => stdout,
        (true, false) => stderr,
        (false, false) => format!("{stdout}\n[stderr]\n{stderr}"),
    };
    if timed_out {
        return ToolOutput::error(cap_output(format!(
            "command timed out after {} s and was killed; partial output:\n{text}",
            timeout.as_secs()
        )));
    }
    if let Some(code) = status.and_then(|s| s.code())
        && code != 0
    {
        text.push_str(&format!("\n[exit code {code}]"));
    }
    ToolOutput::ok(cap_output(text))
}

/// How long output is still read once bash has exited. A background job or a daemon the
/// command started may hold the pipes open for as long as it lives; output still in flight
/// gets this long to arrive, then the call returns what it has.
pub const GRACE: Duration = Duration::from_secs(2);

/// How often bash's exit is checked while its pipes are quiet.
const TICK: Duration = Duration::from_millis(20);

/// Reads a command's stdout and stderr until both reach EOF, but for at most [`GRACE`] after
/// `exited` first says bash has exited, and never past `deadline`. Reading goes on past the
/// cap (kept: 4x [`super::OUTPUT_CAP`] bytes per pipe) so the command never blocks on a full
/// pipe.
fn collect(
    pipes: [Option<OwnedFd>; 2],
    deadline: Instant,
    exited: &mut dyn FnMut() -> bool,
) -> [Vec<u8>; 2] {
    let mut bufs = [Vec::new(), Vec::new()];
    let mut open = pipes;
    let mut stop = deadline;
    let mut seen_exit = false;
    let mut chunk = [0u8; 8192];
    loop {
        if !seen_exit && exited() {
            seen_exit = true;
            stop = stop.min(Instant::now() + GRACE);
        }
        let now = Instant::now();
        if now >= stop {
            break;
        }
        let wait = if seen_exit {
            stop - now
        } else {
            TICK.min(stop - now)
        };
        if open.iter().all(Option::is_none) {
            if seen_exit {
                break;
            }
            // Both pipes closed (`exec >&-`) but bash runs on: wait for it.
            std::thread::sleep(wait);
            continue;
        }
        let mut fds: Vec<PollFd> = open
            .iter()
            .flatten()
            .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        match poll(
            &mut fds,
            PollTimeout::try_from(wait).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(_) | Err(Errno::EINTR) => {}
            Err(_) => break,
        }
        let mut ready = fds.iter().map(|p| p.any().unwrap_or(false));
        let ready: [bool; 2] =
            std::array::from_fn(|i| open[i].is_some() && ready.next() == Some(true));
        drop(fds);
        for (i, slot) in open.iter_mut().enumerate() {
            let Some(fd) = slot.as_ref().filter(|_| ready[i]) else {
                continue;
            };
            match nix::unistd::read(fd, &mut chunk) {
                Ok(0) => *slot = None,
                Ok(n) => {
                    if bufs[i].len() < 4 * super::OUTPUT_CAP {
                        bufs[i].extend_from_slice(&chunk[..n]);
                    }
                }
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                Err(_) => *slot = None,
            }
        }
    }
    bufs
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn wd() -> (tempfile::TempDir, Workdir) {
        let t = tempfile::tempdir().unwrap();
        let w = Workdir::new(t.path()).unwrap();
        (t, w)
    }

    #[test]
    fn runs_in_workdir_with_exit_code() {
        let (_t, w) = wd();
        let out = bash(&w, &json!({"command": "pwd; exit 3"}), BASH_TIMEOUT);
        assert!(!out.is_error);
        assert!(out.content.contains(w.root().to_str().unwrap()));
        assert!(out.content.ends_with("[exit code 3]"));
    }

    #[test]
    fn timeout_kills_the_group() {
        let (_t, w) = wd();
        let t0 = Instant::now();
        let out = bash(
            &w,
            &json!({"command": "echo started; sleep 30 & sleep 30"}),
            Duration::from_secs(1),
        );
        assert!(
            out.is_error && out.content.starts_with("command timed out after 1 s"),
            "{}",
            out.content
        );
        assert!(out.content.contains("started"));
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn output_is_capped_and_keys_are_hidden() {
        let (_t, w) = wd();
        let out = bash(
            &w,
            &json!({"command": "head -c 60000 /dev/zero | tr '\\0' a"}),
            BASH_TIMEOUT,
        );
        assert!(
            out.content
                .ends_with("[output truncated: 10000 more characters not shown]")
        );
        let out = Command::new("true").status();
        assert!(out.is_ok());
        // SAFETY: tests in this module do not read the environment concurrently.
        unsafe { std::env::set_var("ANTHROPIC_API_KEY", "sk-secret-test") };
        let out = bash(
            &w,
            &json!({"command": "echo key=${ANTHROPIC_API_KEY:-none}"}),
            BASH_TIMEOUT,
        );
        assert_eq!(out.content.trim(), "key=none");
    }
}

#[cfg(test)]
mod bounds {
    //! Finding 11: a command returns within about 2 s of bash ending, whatever still holds
    //! its pipes, and the timeout covers reading the output.
    use super::*;
    use serde_json::json;

    /// Runs `bash` on a thread; panics if it has not returned within `limit`.
    fn bash_within(command: &str, timeout: Duration, limit: Duration) -> (ToolOutput, Duration) {
        let t = tempfile::tempdir().unwrap();
        let w = Workdir::new(t.path()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let command = command.to_owned();
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let out = bash(&w, &json!({ "command": command }), timeout);
            let _ = tx.send((out, t0.elapsed()));
            drop(t);
        });
        rx.recv_timeout(limit)
            .unwrap_or_else(|_| panic!("bash did not return within {limit:?}"))
    }

    #[test]
    fn a_daemon_holding_the_pipes_does_not_block_the_call() {
        let (out, took) = bash_within(
            "echo started; setsid sleep 30 &",
            BASH_TIMEOUT,
            Duration::from_secs(10),
        );
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert!(!out.is_error, "{}", out.content);
        assert_eq!(out.content.trim(), "started");
    }

    #[test]
    fn a_lot_of_output_is_read_whole_up_to_the_cap() {
        let (out, _) = bash_within(
            "for i in $(seq 1 20000); do echo line$i; done; echo done >&2",
            BASH_TIMEOUT,
            Duration::from_secs(30),
        );
        assert!(!out.is_error, "{}", out.content);
        assert!(out.content.starts_with("line1\nline2\n"));
        assert!(
            out.content.contains("output truncated"),
            "{}",
            &out.content[out.content.len() - 200..]
        );
        let (out, _) = bash_within(
            "head -c 40000 /dev/zero | tr '\\0' a; sleep 0.5; echo; echo tail",
            BASH_TIMEOUT,
            Duration::from_secs(30),
        );
        assert_eq!(out.content.len(), 40006);
        assert!(out.content.ends_with("a\ntail\n"));
    }

    #[test]
    fn a_timeout_covers_a_daemon_and_keeps_the_partial_output() {
        let (out, took) = bash_within(
            "echo partial; setsid sleep 30 & sleep 30",
            Duration::from_secs(1),
            Duration::from_secs(10),
        );
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert!(
            out.is_error && out.content.starts_with("command timed out after 1 s"),
            "{}",
            out.content
        );
        assert!(out.content.contains("partial"));
    }
}
