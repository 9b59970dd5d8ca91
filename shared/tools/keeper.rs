//! The keeper: the process between the worker and each `bash` command (see [`super::bash`] for
//! what it guarantees). It is forked by the worker, forks bash, reports bash's exit status over
//! a socket pair, and kills every process under it when the worker closes that socket or dies.
//!
//! Everything here runs in a forked child of a multi-threaded process: only async-signal-safe
//! system calls on plain integers and on memory built before the fork ([`Exec`]), no
//! allocation, no locks.

use std::ffi::{CString, OsStr};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;

use nix::errno::Errno;

use super::bash::HIDDEN_ENV;
use crate::sandbox::enter::{self, Rlimits, SETUP_FAILED, digits, say};
use crate::sandbox::plan::{Namespaces, Plan};

/// `bash -c COMMAND` with the worker's environment minus [`HIDDEN_ENV`], as the C strings
/// `execvpe` takes, built before the fork (the child may not allocate).
pub(super) struct Exec {
    _strings: Vec<CString>,
    /// Null-terminated arrays of pointers into `_strings` (as `usize`, so the closure that
    /// owns them is `Send`).
    argv: Vec<usize>,
    envp: Vec<usize>,
}

impl Exec {
    /// `tmpdir`, when set, is the command's `TMPDIR`.
    pub(super) fn new(command: &str, tmpdir: Option<&std::path::Path>) -> Result<Exec, String> {
        // The tool call's span, when this process exports traces: the command's own tools
        // (an OpenTelemetry SDK) continue the trace.
        let trace: Vec<(String, String)> = crate::telemetry::current_traceparent()
            .map(|t| ("TRACEPARENT".to_owned(), t))
            .into_iter()
            .collect();
        Exec::with_env(command, tmpdir, &trace, &[])
    }

    /// [`Exec::new`] with `extra` variables set (over the inherited ones) and `hide` removed
    /// too.
    pub(super) fn with_env(
        command: &str,
        tmpdir: Option<&std::path::Path>,
        extra: &[(String, String)],
        hide: &[&str],
    ) -> Result<Exec, String> {
        let cstr = |b: &[u8]| CString::new(b).map_err(|_| "command contains a NUL byte".to_owned());
        let args = [cstr(b"bash")?, cstr(b"-c")?, cstr(command.as_bytes())?];
        let mut env = Vec::new();
        for (k, v) in std::env::vars_os() {
            if HIDDEN_ENV.iter().chain(hide).any(|h| OsStr::new(h) == k)
                || crate::telemetry::hidden_var(&k)
                || extra.iter().any(|(x, _)| OsStr::new(x) == k)
                || (tmpdir.is_some() && k == "TMPDIR")
            {
                continue;
            }
            let mut kv = k.as_bytes().to_vec();
            kv.push(b'=');
            kv.extend_from_slice(v.as_bytes());
            if let Ok(c) = CString::new(kv) {
                env.push(c);
            }
        }
        for (k, v) in extra {
            env.push(cstr(format!("{k}={v}").as_bytes())?);
        }
        if let Some(t) = tmpdir {
            let mut kv = b"TMPDIR=".to_vec();
            kv.extend_from_slice(t.as_os_str().as_bytes());
            env.push(cstr(&kv)?);
        }
        let ptrs = |v: &[CString]| {
            let mut p: Vec<usize> = v.iter().map(|c| c.as_ptr() as usize).collect();
            p.push(0);
            p
        };
        let argv = ptrs(&args);
        let envp = ptrs(&env);
        // Moved, not cloned: the pointers above point into these very buffers.
        let mut strings = Vec::from(args);
        strings.extend(env);
        Ok(Exec {
            _strings: strings,
            argv,
            envp,
        })
    }
}

/// The sandbox of one command, as the children see it: the plan and the Landlock ruleset the
/// worker built for this command (-1: none).
#[derive(Clone, Copy)]
pub(super) struct Confinement<'a> {
    pub plan: &'a Plan,
    pub ruleset: RawFd,
}

/// In the forked child: becomes the keeper and starts bash, confined by `sandbox` when given
/// and under `limits` in any case. Never returns in the keeper (it `_exit`s), nor in bash (it
/// execs or `_exit`s).
pub(super) fn start_keeper(
    exec: &Exec,
    link: RawFd,
    sandbox: Option<Confinement<'_>>,
    limits: &Rlimits,
) -> std::io::Result<()> {
    // SAFETY: async-signal-safe calls on plain integers and on memory built before the fork.
    unsafe {
        let me = libc::getpid();
        // Nothing inherited but the pipes (0-2), the link and the ruleset: not the spawn's
        // error pipe (spawn() waits for it to close), not another command's socket.
        let idmap_ns = sandbox
            .and_then(|s| s.plan.idmap.as_ref())
            .and_then(|i| i.userns.as_ref())
            .map_or(-1, |f| f.as_raw_fd());
        close_from(3, [link, sandbox.map_or(-1, |s| s.ruleset), idmap_ns]);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1);
        if let Some(sb) = sandbox
            && sb.plan.ns != Namespaces::None
        {
            namespaced(exec, link, me, sb, limits)
        }
        // A raw clone rather than fork(3): glibc's fork runs atfork handlers and takes
        // malloc's locks, which a thread of the worker that does not exist in this copy may
        // hold; that would hang here for good.
        let bash = clone(libc::SIGCHLD as libc::c_ulong);
        if bash < 0 {
            say(b"failed to start bash: fork failed\n");
            libc::_exit(127);
        }
        if bash == 0 {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            if libc::getppid() != me {
                libc::_exit(127);
            }
            run_bash(exec, sandbox, limits, true)
        }
        keep(me, bash, link, true)
    }
}

/// A raw clone(2) with `flags` (no stack: the child runs on a copy of this one).
///
/// # Safety
/// Only in the keeper or the namespace's init.
unsafe fn clone(flags: libc::c_ulong) -> libc::pid_t {
    // SAFETY: clone without CLONE_VM: the child gets its own copy of memory.
    unsafe { libc::syscall(libc::SYS_clone, flags, 0, 0, 0, 0) as libc::pid_t }
}

/// In bash's own process: gives it a session of its own, its limits (and, with `oom`, its
/// `oom_score_adj`: a namespace's init has it already), confines it, then execs bash.
///
/// The session makes bash the leader of a new process group, which the keeper kills, and
/// leaves it without a controlling terminal, in every sandbox mode, `off` included: opening
/// `/dev/tty` fails with ENXIO, and nothing a command does can reach the terminal `lead run`
/// was started from (TIOCSTI works only on one's own controlling terminal, and a session
/// leader cannot take one that another session holds).
///
/// # Safety
/// Only in the forked child that becomes bash.
unsafe fn run_bash(
    exec: &Exec,
    sandbox: Option<Confinement<'_>>,
    limits: &Rlimits,
    oom: bool,
) -> ! {
    // SAFETY: async-signal-safe calls on memory built before the fork.
    unsafe {
        if libc::setsid() < 0 {
            say(b"troupe-sandbox: setsid failed\n");
            libc::_exit(SETUP_FAILED);
        }
        if enter::set_limits(limits).is_err() || (oom && enter::oom_first(0).is_err()) {
            libc::_exit(SETUP_FAILED);
        }
        if let Some(sb) = sandbox
            && enter::confine(sb.plan, sb.ruleset).is_err()
        {
            libc::_exit(SETUP_FAILED);
        }
        libc::execvpe(
            exec.argv[0] as *const libc::c_char,
            exec.argv.as_ptr().cast(),
            exec.envp.as_ptr().cast(),
        );
        say(b"failed to start bash: exec failed (is bash installed and on PATH?)\n");
        libc::_exit(127)
    }
}

/// Sends a wait status on the link.
fn report(link: RawFd, status: i32) {
    let b = status.to_ne_bytes();
    // SAFETY: write(2) of a stack buffer.
    unsafe {
        libc::write(link, b.as_ptr().cast(), b.len());
    }
}

/// The keeper with namespaces: clones the namespace's init (PID 1 of the new PID namespace),
/// writes its id maps, and keeps it. The init builds the mount tree, starts bash, reports
/// bash's status on the link itself, reaps whatever is orphaned inside, and exits when
/// nothing is left. Killing the init (the keeper does, when the worker closes the link; the
/// kernel does, through `PR_SET_PDEATHSIG`, when the keeper dies) kills every process of the
/// namespace.
///
/// # Safety
/// Only in the keeper.
unsafe fn namespaced(
    exec: &Exec,
    link: RawFd,
    me: libc::pid_t,
    sb: Confinement<'_>,
    limits: &Rlimits,
) -> ! {
    // SAFETY: async-signal-safe calls on plain integers and memory built before the fork.
    unsafe {
        let setup_failed = || -> ! {
            report(link, SETUP_FAILED << 8);
            libc::_exit(SETUP_FAILED)
        };
        if enter::before_clone(sb.plan).is_err() {
            setup_failed();
        }
        let mut sync = [-1; 2];
        if libc::pipe2(sync.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            say(b"troupe-sandbox: pipe failed\n");
            setup_failed();
        }
        let user = if sb.plan.ns == Namespaces::UserPidMount {
            libc::CLONE_NEWUSER
        } else {
            0
        };
        let flags =
            (libc::CLONE_NEWPID | libc::CLONE_NEWNS | user | libc::SIGCHLD) as libc::c_ulong;
        // The worker is not dumpable, so a copy's /proc files belong to root, and an
        // unprivileged keeper could not write the init's maps: the init is born dumpable (set
        // here, before the clone, so no write can come first) until its maps are written.
        if user != 0 {
            libc::prctl(libc::PR_SET_DUMPABLE, 1);
        }
        let init = clone(flags);
        if init != 0 {
            // The keeper itself (the init clears its flag once its maps are written).
            libc::prctl(libc::PR_SET_DUMPABLE, 0);
        }
        if init < 0 {
            say(b"troupe-sandbox: creating the namespaces failed\n");
            setup_failed();
        }
        if init == 0 {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            libc::close(sync[1]);
            let mut b = [0u8; 1];
            // EOF: the keeper died or could not write the maps.
            if libc::read(sync[0], b.as_mut_ptr().cast(), 1) != 1 {
                libc::_exit(SETUP_FAILED);
            }
            libc::prctl(libc::PR_SET_DUMPABLE, 0);
            libc::close(sync[0]);
            init_main(exec, link, sb, limits)
        }
        libc::close(sync[0]);
        // The init's oom_score_adj, which everything in the namespace inherits, is written
        // here: a root keeper makes it the floor too (see `enter::oom_first`), and with a user
        // namespace the init is still dumpable, so an unprivileged keeper may write it.
        if (user != 0 && enter::write_maps(sb.plan, init).is_err())
            || enter::oom_first(init).is_err()
        {
            libc::kill(init, libc::SIGKILL);
            libc::waitpid(init, std::ptr::null_mut(), 0);
            setup_failed();
        }
        libc::write(sync[1], b"g".as_ptr().cast(), 1);
        libc::close(sync[1]);
        if sb.ruleset >= 0 {
            libc::close(sb.ruleset);
        }
        keep(me, init, link, false)
    }
}

/// PID 1 of the command's namespace.
///
/// # Safety
/// Only in the namespace's init.
unsafe fn init_main(exec: &Exec, link: RawFd, sb: Confinement<'_>, limits: &Rlimits) -> ! {
    // SAFETY: async-signal-safe calls on plain integers and memory built before the fork.
    unsafe {
        if enter::mount_all(sb.plan).is_err() {
            report(link, SETUP_FAILED << 8);
            libc::_exit(SETUP_FAILED);
        }
        let bash = clone(libc::SIGCHLD as libc::c_ulong);
        if bash < 0 {
            say(b"failed to start bash: fork failed\n");
            report(link, 127 << 8);
            libc::_exit(127);
        }
        if bash == 0 {
            run_bash(exec, Some(sb), limits, false)
        }
        to_dev_null();
        if sb.ruleset >= 0 {
            libc::close(sb.ruleset);
        }
        loop {
            let mut st = 0;
            let p = libc::waitpid(-1, &mut st, 0);
            if p == bash {
                report(link, st);
            } else if p < 0 && Errno::last() != Errno::EINTR {
                // Nothing left in the namespace.
                libc::_exit(0);
            }
        }
    }
}

/// Points 0-2 at /dev/null, off the worker's pipes, so their EOF depends on the command alone.
///
/// # Safety
/// Only in the keeper or the namespace's init.
unsafe fn to_dev_null() {
    // SAFETY: open/dup2/close on integers.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
        if null >= 0 {
            for fd in 0..3 {
                libc::dup2(null, fd);
            }
            if null > 2 {
                libc::close(null);
            }
        }
    }
}

/// Closes every descriptor from `from` up, except those in `keep` (-1: none).
///
/// # Safety
/// Only in a forked child: it closes descriptors other code may think it owns.
unsafe fn close_from<const N: usize>(from: RawFd, mut keep: [RawFd; N]) {
    // In place: no allocation.
    keep.sort_unstable();
    let close = |lo: RawFd, hi: RawFd| {
        if lo > hi {
            return;
        }
        // SAFETY: plain syscalls on integers.
        unsafe {
            if libc::syscall(
                libc::SYS_close_range,
                lo as libc::c_uint,
                hi as libc::c_uint,
                0,
            ) != 0
            {
                // Kernels before 5.9: close what a worker plausibly has open.
                for fd in lo..hi.min(4096) {
                    libc::close(fd);
                }
            }
        }
    };
    let mut lo = from;
    for k in keep {
        if k >= lo {
            close(lo, k - 1);
            lo = k + 1;
        }
    }
    close(lo, libc::c_int::MAX);
}

/// The keeper's life: reports bash's wait status on `link`, reaps whatever is re-parented to
/// it, and when the worker closes `link` (or dies) kills everything under it and exits.
/// If bash has exited and nothing else is left, it exits by itself. With `report` false
/// (namespaces) `bash` is the namespace's init, which reports bash's status itself.
///
/// # Safety
/// Only in the keeper (a forked child); async-signal-safe calls only.
unsafe fn keep(me: libc::pid_t, bash: libc::pid_t, link: RawFd, report: bool) -> ! {
    // SAFETY: async-signal-safe calls on plain integers and stack buffers.
    unsafe {
        to_dev_null();
        let status_to = if report { link } else { -1 };
        // The worker ends this process by closing the link, nothing else; a write to a closed
        // link must not kill it either.
        for sig in [
            libc::SIGTERM,
            libc::SIGINT,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGPIPE,
        ] {
            libc::signal(sig, libc::SIG_IGN);
        }
        // A child's exit interrupts the poll below (no SA_RESTART), so bash's status is
        // reported at once rather than at the next tick.
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_child as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(libc::SIGCHLD, &sa, std::ptr::null_mut());
        let mut status = 0;
        let mut bash_done = false;
        loop {
            let mut pfd = libc::pollfd {
                fd: link,
                events: libc::POLLIN,
                revents: 0,
            };
            let r = libc::poll(&mut pfd, 1, 20);
            let poll_errno = Errno::last();
            if reap(bash, &mut status, &mut bash_done, status_to) && bash_done {
                // Nothing left under the keeper.
                libc::_exit(exit_code(status));
            }
            if r > 0 {
                let mut buf = [0u8; 64];
                let n = libc::read(link, buf.as_mut_ptr().cast(), buf.len());
                if n == 0 || (n < 0 && !matches!(Errno::last(), Errno::EINTR | Errno::EAGAIN)) {
                    break;
                }
            } else if r < 0 && poll_errno != Errno::EINTR {
                break;
            }
        }
        kill_all(me, bash);
        libc::_exit(exit_code(status))
    }
}

/// The keeper's SIGCHLD handler: nothing but interrupting its poll.
extern "C" fn on_child(_: libc::c_int) {}

/// Reaps every child that has ended, sending bash's status on `link` (-1: not sent); true
/// when the keeper
/// has no children left.
///
/// # Safety
/// Only in the keeper.
unsafe fn reap(bash: libc::pid_t, status: &mut i32, bash_done: &mut bool, link: RawFd) -> bool {
    // SAFETY: waitpid and write on plain integers and stack buffers.
    unsafe {
        loop {
            let mut st = 0;
            let p = libc::waitpid(-1, &mut st, libc::WNOHANG);
            if p < 0 {
                return Errno::last() == Errno::ECHILD;
            }
            if p == 0 {
                return false;
            }
            if p == bash {
                *status = st;
                *bash_done = true;
                if link >= 0 {
                    report(link, st);
                }
            }
        }
    }
}

/// SIGKILLs every process under the keeper, round after round (a killed process's children
/// are re-parented to the keeper), until none is left or about 3 s have passed.
///
/// # Safety
/// Only in the keeper.
unsafe fn kill_all(me: libc::pid_t, bash: libc::pid_t) {
    // "/proc/self/task/<me>/children", built without allocating.
    let mut path = [0u8; 64];
    let mut len = 0;
    let (me_digits, me_len) = digits(me as u64);
    for part in [
        &b"/proc/self/task/"[..],
        &me_digits[..me_len],
        b"/children\0",
    ] {
        path[len..len + part.len()].copy_from_slice(part);
        len += part.len();
    }
    let mut done = false;
    let mut unused = 0;
    // SAFETY: async-signal-safe calls on plain integers and stack buffers.
    unsafe {
        for _ in 0..300 {
            libc::kill(-bash, libc::SIGKILL);
            let fd = libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd >= 0 {
                let mut buf = [0u8; 4096];
                let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
                libc::close(fd);
                let mut pid: libc::pid_t = 0;
                for &c in buf.iter().take(n.max(0) as usize) {
                    if c.is_ascii_digit() {
                        pid = pid * 10 + libc::pid_t::from(c - b'0');
                    } else {
                        if pid > 0 {
                            libc::kill(pid, libc::SIGKILL);
                        }
                        pid = 0;
                    }
                }
                if pid > 0 {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            if reap(bash, &mut unused, &mut done, -1) {
                return;
            }
            libc::poll(std::ptr::null_mut(), 0, 10);
        }
    }
}

/// The keeper's exit code for bash's wait status: bash's code, or 128 + the signal.
fn exit_code(status: i32) -> i32 {
    if libc::WIFSIGNALED(status) {
        128 + libc::WTERMSIG(status)
    } else {
        libc::WEXITSTATUS(status)
    }
}
