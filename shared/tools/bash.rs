//! The `bash` tool: a command in the working directory, with a timeout and an output cap.
//!
//! API keys, where key files are, `NOTIFY_SOCKET` and troupe's own build settings are removed
//! from the command's environment (so the tests of a troupe checkout, run by an agent, start
//! their own workers). There is no denylist of command strings: confinement is the working
//! directory and the process boundary, not substring matching.
//!
//! No process a command starts outlives the worker, and none blocks the call:
//!
//! - **A keeper per command.** The worker forks a small keeper process that forks bash and
//!   stays between the two. The keeper is a child subreaper (`PR_SET_CHILD_SUBREAPER`): every
//!   process the command starts, including daemons that double-fork or `setsid`, is re-parented
//!   to it when orphaned, so it can always find them (`/proc/self/task/PID/children`). It tells
//!   the worker bash's exit status over a socket pair and watches that socket: when the
//!   worker closes its end, or dies however it dies (kill -9 included, since the kernel closes
//!   a dead process's sockets), the keeper SIGKILLs every process under it, reaps them, and
//!   exits. Bash itself gets `PR_SET_PDEATHSIG` = SIGKILL against the keeper, and runs in a
//!   session of its own (`setsid`): its own process group, and no controlling terminal, so
//!   that no command can type into the terminal the team was started from (finding N6), in
//!   every sandbox mode.
//! - **Limits.** Each command's process sets its resource limits and an `oom_score_adj` of
//!   1000 before it execs bash (see [`crate::sandbox::Limits`]), in every sandbox mode; the
//!   keeper and the worker keep theirs.
//! - **Bounded reads.** Output is read with poll(2): until both pipes reach EOF, for at most
//!   [`GRACE`] after bash has exited (a background job or a daemon may hold the pipes as long
//!   as it lives), and never past the timeout.
//! - **Lifetimes.** A timeout ends the whole command: the worker closes the socket and the
//!   keeper kills bash and everything it started. When bash exits by itself, what it started in
//!   the background (`server &`) runs on: its keeper stays, and the worker keeps its end of the
//!   socket until the worker exits, at which point the keeper kills them. A keeper whose
//!   processes have all ended exits by itself and is reaped at the next call.
//!
//! The keeper's code is in the `keeper` module beside this one. Only a SIGKILL of the keeper
//! itself (no code runs) lets bash's descendants escape: bash dies with it, what bash started
//! is re-parented to init.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socketpair};
use serde_json::Value;

use super::keeper::{Confinement, Exec, start_keeper};
use super::{ToolOutput, cap_output, check_input, input_str};
use crate::sandbox::Sandbox;
use crate::tools::fs::Workdir;

/// Default timeout of one command.
pub const BASH_TIMEOUT: Duration = Duration::from_secs(120);

/// The longest argument Linux passes to a program, with its NUL (`MAX_ARG_STRLEN`).
const MAX_ARG_LEN: usize = 32 * 4096;

/// Environment variables a command never sees.
pub(super) const HIDDEN_ENV: [&str; 10] = [
    "ANTHROPIC_API_KEY",
    "OPENAI_API_KEY",
    "ANTHROPIC_API_KEY_FILE",
    "OPENAI_API_KEY_FILE",
    crate::secrets::BUS_PASSWORD_ENV,
    crate::secrets::BUS_PASSWORD_FILE_ENV,
    "CREDENTIALS_DIRECTORY",
    "NOTIFY_SOCKET",
    "TROUPE_BUILD_ID",
    "TROUPE_WORKER",
];

/// Runs `bash{command}`. A non-zero exit is a normal result ending in `[exit code N]`; a
/// timeout is an error result with the partial output.
pub fn bash(wd: &Workdir, sandbox: &Sandbox, input: &Value, timeout: Duration) -> ToolOutput {
    let command = match check_input(input).and_then(|_| input_str(input, "command")) {
        Ok(c) => c,
        Err(e) => return ToolOutput::error(e),
    };
    if command.len() >= MAX_ARG_LEN {
        return ToolOutput::error(format!(
            "command too long: {} bytes, and Linux passes at most {} in one argument; write \
             it to a file with write_file and run that file",
            command.len(),
            MAX_ARG_LEN - 1
        ));
    }
    let (mut keeper, link) = match start_confined(sandbox, wd.root(), Stdio::null(), |tmpdir| {
        Exec::new(command, tmpdir)
    }) {
        Ok(k) => k,
        Err(e) => return ToolOutput::error(e),
    };
    let pipes = [
        keeper.stdout.take().map(OwnedFd::from),
        keeper.stderr.take().map(OwnedFd::from),
    ];
    let mut report = Report::default();
    let [out, err] = collect(pipes, link.as_fd(), Instant::now() + timeout, &mut || {
        report.check(&link)
    });
    let status = report.status;
    if status.is_some() {
        // Bash has exited; its keeper holds what runs on until the worker exits.
        keep(keeper, link);
    } else {
        // A timeout (or a keeper that died): closing the socket makes the keeper kill all.
        drop(link);
        end_keeper(&mut keeper);
    }
    let stdout = String::from_utf8_lossy(&out).into_owned();
    let stderr = String::from_utf8_lossy(&err).into_owned();
    let mut text = match (stdout.is_empty(), stderr.is_empty()) {
        (_, true) => stdout,
        (true, false) => stderr,
        (false, false) => format!("{stdout}\n[stderr]\n{stderr}"),
    };
    let Some(status) = status else {
        if report.keeper_gone {
            return ToolOutput::error(cap_output(format!(
                "bash was killed before it finished; partial output:\n{text}"
            )));
        }
        return ToolOutput::error(cap_output(format!(
            "command timed out after {} s and was killed; partial output:\n{text}",
            timeout.as_secs()
        )));
    };
    if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) != 0 {
        text.push_str(&format!("\n[exit code {}]", libc::WEXITSTATUS(status)));
    } else if libc::WIFSIGNALED(status) {
        text.push_str(&format!("\n[killed by signal {}]", libc::WTERMSIG(status)));
    }
    ToolOutput::ok(cap_output(text))
}

/// Starts a keeper in `sandbox`'s confinement, in `workdir`, with `stdin`, running what
/// `exec` builds (given the command's `TMPDIR`, when the sandbox has one): the keeper and the
/// worker's end of its link. `Err` says why nothing runs, as the tool says it. Used by the
/// tool and by [`super::confined`].
pub(super) fn start_confined(
    sandbox: &Sandbox,
    workdir: &std::path::Path,
    stdin: Stdio,
    exec: impl FnOnce(Option<&std::path::Path>) -> Result<Exec, String>,
) -> Result<(Child, OwnedFd), String> {
    if let Some(why) = &sandbox.status().refused {
        return Err(format!(
            "not run: the sandbox is required (--sandbox required) but unavailable here: {why}"
        ));
    }
    let confined = sandbox
        .for_command()
        .map_err(|e| format!("not run: the sandbox failed: {e}"))?;
    let tmpdir = confined.as_ref().and_then(|c| c.tmpdir.clone());
    let exec = exec(tmpdir.as_deref())?;
    let (link, keeper_link) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
    )
    .map_err(|e| format!("failed to start bash: socketpair: {e}"))?;
    let keeper_fd = keeper_link.as_raw_fd();
    let mut cmd = Command::new("bash");
    cmd.current_dir(workdir)
        .stdin(stdin)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let limits = sandbox.rlimits();
    // SAFETY: the closure runs in the child of a fork of a multi-threaded process; it makes
    // only async-signal-safe system calls (clone, prctl, setsid, setrlimit, execvpe, open,
    // read, write, close, poll, waitpid, kill, _exit) and allocates nothing: `exec` was built
    // before the fork.
    unsafe {
        let plan = confined.as_ref().map(|c| c.plan.clone());
        let ruleset = confined
            .as_ref()
            .and_then(|c| c.ruleset.as_ref())
            .map_or(-1, |fd| fd.as_raw_fd());
        cmd.pre_exec(move || {
            let sandbox = plan.as_deref().map(|plan| Confinement { plan, ruleset });
            start_keeper(&exec, keeper_fd, sandbox, &limits)
        });
    }
    let keeper = cmd
        .spawn()
        .map_err(|e| format!("failed to start bash: {e}"))?;
    // The children hold their own copies of the link and the ruleset.
    drop(keeper_link);
    drop(confined);
    Ok((keeper, link))
}

/// Waits for a keeper told to end (its kill rounds take about 3 s at most); one that does not
/// end within 5 s is killed, which takes bash with it (its `PR_SET_PDEATHSIG`).
pub(super) fn end_keeper(keeper: &mut Child) {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        if !matches!(keeper.try_wait(), Ok(None)) {
            return;
        }
        std::thread::sleep(TICK);
    }
    let _ = keeper.kill();
    let _ = keeper.wait();
}

/// Keeps a keeper whose bash has exited but whose background processes may still run, with
/// this process's end of its socket, until it exits by itself (they all ended): a thread of
/// its own waits for it and reaps it at once, so no `<defunct>` keeper lingers (review 4: the
/// sandbox probe's keeper stayed a zombie of `lead run` and of every worker until the next
/// command, if any). The socket stays open as long as the keeper lives, so the keeper still
/// ends what runs on when this process exits and closes it.
fn keep(mut keeper: Child, link: OwnedFd) {
    let spawned = std::thread::Builder::new()
        .name("keeper-reaper".to_owned())
        .stack_size(64 * 1024)
        .spawn(move || {
            let _ = keeper.wait();
            drop(link);
        });
    if let Err(e) = spawned {
        // No thread to spare: the socket closed with the closure tells the keeper to end what
        // runs on now, rather than leave it unwatched.
        tracing::warn!("no thread to keep a command's background processes: {e}");
    }
}

/// What the keeper has said about bash so far.
#[derive(Default)]
pub(super) struct Report {
    bytes: Vec<u8>,
    /// bash's wait status, once it has exited.
    pub(super) status: Option<i32>,
    /// The keeper closed its end without a status: it was killed.
    pub(super) keeper_gone: bool,
}

impl Report {
    /// Reads what the keeper sent (without blocking); true once bash has exited or the
    /// keeper is gone.
    pub(super) fn check(&mut self, link: &OwnedFd) -> bool {
        let mut buf = [0u8; 16];
        while self.status.is_none() && !self.keeper_gone {
            match nix::unistd::read(link, &mut buf) {
                Ok(0) => self.keeper_gone = true,
                Ok(n) => {
                    self.bytes.extend_from_slice(&buf[..n]);
                    if let Some(s) = self.bytes.first_chunk::<4>() {
                        self.status = Some(i32::from_ne_bytes(*s));
                    }
                }
                Err(Errno::EINTR) => {}
                Err(Errno::EAGAIN) => break,
                Err(_) => self.keeper_gone = true,
            }
        }
        self.status.is_some() || self.keeper_gone
    }
}

/// How long output is still read once bash has exited. A background job or a daemon the
/// command started may hold the pipes open for as long as it lives; output still in flight
/// gets this long to arrive, then the call returns what it has.
pub const GRACE: Duration = Duration::from_secs(2);

/// How often bash's exit is checked while its pipes are quiet (the keeper's report on the link
/// wakes the wait at once; this bounds it should a wake-up be missed).
const TICK: Duration = Duration::from_millis(20);

/// Reads a command's stdout and stderr until both reach EOF, but for at most [`GRACE`] after
/// `exited` first says bash has exited, and never past `deadline`. `link` (where the keeper
/// reports bash's exit) wakes the wait until then. Reading goes on past the cap (kept: 4x
/// [`super::OUTPUT_CAP`] bytes per pipe) so the command never blocks on a full pipe.
pub(super) fn collect(
    pipes: [Option<OwnedFd>; 2],
    link: std::os::fd::BorrowedFd<'_>,
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
        if open.iter().all(Option::is_none) && seen_exit {
            break;
        }
        // Both pipes closed (`exec >&-`) but bash runs on: only the link is waited on.
        let mut fds: Vec<PollFd> = open
            .iter()
            .flatten()
            .map(|fd| PollFd::new(fd.as_fd(), PollFlags::POLLIN))
            .collect();
        if !seen_exit {
            fds.push(PollFd::new(link, PollFlags::POLLIN));
        }
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
        let out = bash(
            &w,
            &Sandbox::off(),
            &json!({"command": "pwd; exit 3"}),
            BASH_TIMEOUT,
        );
        assert!(!out.is_error);
        assert!(
            out.content.contains(w.root().to_str().unwrap()),
            "{}",
            out.content
        );
        assert!(out.content.ends_with("[exit code 3]"));
    }

    /// N6 and the limits hold with no sandbox at all: a session of its own, no terminal, the
    /// default limits (the process limit only as root here: otherwise it is not set).
    #[test]
    fn a_command_has_its_own_session_and_its_limits_unsandboxed() {
        let (_t, w) = wd();
        let out = bash(
            &w,
            &Sandbox::off(),
            &json!({"command": "read -r _ _ _ _ _ sid tty _ < /proc/$$/stat; \
                echo \"$$ $sid $tty\"; ulimit -n; ulimit -v; ulimit -t; \
                cat /proc/self/oom_score_adj"}),
            BASH_TIMEOUT,
        );
        let lines: Vec<&str> = out.content.lines().collect();
        let ids: Vec<&str> = lines[0].split(' ').collect();
        assert_eq!(ids[0], ids[1], "bash leads its session: {}", out.content);
        assert_eq!(ids[2], "0", "no controlling terminal: {}", out.content);
        assert_eq!(
            lines[1..],
            ["4096", "8388608", "600", "1000"],
            "{}",
            out.content
        );
    }

    #[test]
    fn timeout_kills_the_group() {
        let (_t, w) = wd();
        let t0 = Instant::now();
        let out = bash(
            &w,
            &Sandbox::off(),
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
            &Sandbox::off(),
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
            &Sandbox::off(),
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
            let out = bash(&w, &Sandbox::off(), &json!({ "command": command }), timeout);
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
    fn a_command_too_long_for_exec_is_an_error_that_says_so() {
        let long = format!("echo {}", "a".repeat(200_000));
        let (out, took) = bash_within(&long, BASH_TIMEOUT, Duration::from_secs(10));
        assert!(took < Duration::from_secs(3), "took {took:?}");
        assert!(
            out.is_error && out.content.contains("too long"),
            "{}",
            &out.content[..out.content.len().min(300)]
        );
    }

    #[test]
    fn a_timeout_kills_what_left_the_group_too() {
        let t = tempfile::tempdir().unwrap();
        let w = Workdir::new(t.path()).unwrap();
        let out = bash(
            &w,
            &Sandbox::off(),
            &json!({"command": "setsid sleep 30 & echo $! > pid; sleep 30"}),
            Duration::from_secs(1),
        );
        assert!(out.is_error, "{}", out.content);
        let pid = std::fs::read_to_string(t.path().join("pid")).unwrap();
        let gone = || !std::path::Path::new(&format!("/proc/{}", pid.trim())).exists();
        let t0 = Instant::now();
        while !gone() && t0.elapsed() < Duration::from_secs(3) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(gone(), "the daemon {} outlived the timeout", pid.trim());
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
