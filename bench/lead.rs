//! The `lead` binary the bench drives, and the processes it starts: the lead is found beside this
//! executable (the same build), a supervisor is run from it as a child (`lead run`, ready when
//! it says so in `lead.lock`) and stopped gracefully, and every child dies with the bench.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use troupe::eprintln;

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use troupe::{AgentName, TeamDir, fsutil};

/// How long a supervisor may take to become ready.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// The `lead` binary of this build: the one beside this executable, where cargo puts both.
pub fn lead_exe() -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("failed to find the troupe-bench executable")?;
    let lead = me.with_file_name("lead");
    if !lead.is_file() {
        bail!(
            "no lead binary at {} (troupe-bench drives the lead and worker of its own build: \
             cargo build --release --bin lead --bin worker, or cargo build --release --workspace, \
             then run target/release/troupe-bench)",
            lead.display()
        );
    }
    Ok(lead)
}

/// Whether this build's `lead run` has `--restart-delay` (added alongside the bench).
pub fn supports_restart_delay(lead: &Path) -> bool {
    Command::new(lead)
        .args(["run", "--help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--restart-delay"))
}

/// A child that gets `signal` if this process dies (a bench killed midway leaves nothing).
fn die_with(c: &mut Command, signal: libc::c_int) {
    // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec. The bench
    // spawns from its main thread, which lives as long as the bench.
    unsafe {
        c.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, signal);
            Ok(())
        });
    }
}

/// A child that gets SIGKILL if this process dies.
pub fn die_with_parent(c: &mut Command) {
    die_with(c, libc::SIGKILL);
}

/// A supervisor started for the bench (`lead --team-dir TEAM run ARGS`); stopped gracefully
/// (SIGTERM) by [`Supervisor::stop`] or, on an error path, when dropped.
pub struct Supervisor {
    child: Option<Child>,
    pid: u32,
}

impl Supervisor {
    /// Starts `lead --team-dir TEAM run ARGS` with the extra environment `envs`, output to the
    /// team's `logs/lead.log`, in its own process group (a Ctrl-C at the bench's terminal does
    /// not reach it) and with SIGTERM, its graceful team stop, should the bench die. Returns
    /// once it is ready: it holds `lead.lock` and wrote `ready` there, having started every
    /// member that should run.
    pub fn start(
        lead: &Path,
        team: &TeamDir,
        args: &[String],
        envs: &[(String, String)],
    ) -> anyhow::Result<Supervisor> {
        let log_path = team.log(&AgentName::lead());
        let log = fsutil::open_append(&log_path)?;
        // Where this supervisor's own lines start: its reason, should it fail to start.
        let log_start = log.metadata().map_or(0, |m| m.len());
        let mut cmd = Command::new(lead);
        cmd.arg("--team-dir")
            .arg(team.root())
            .arg("run")
            .args(args)
            .envs(envs.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .process_group(0);
        die_with(&mut cmd, libc::SIGTERM);
        let child = cmd
            .spawn()
            .with_context(|| format!("failed to start {}", lead.display()))?;
        let pid = child.id();
        let mut sup = Supervisor {
            child: Some(child),
            pid,
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(st) = sup.child.as_mut().and_then(|c| c.try_wait().transpose()) {
                let st = st?;
                sup.child = None;
                // Its own one-line reason: the last `lead: ...` line it wrote.
                let log = appended(&log_path, log_start);
                match log.lines().rev().find_map(|l| l.strip_prefix("lead: ")) {
                    Some(why) => bail!(
                        "the supervisor exited during start-up ({st}): {why} (log: {})",
                        log_path.display()
                    ),
                    None => bail!(
                        "the supervisor exited during start-up ({st}); see {}",
                        log_path.display()
                    ),
                }
            }
            let ready = troupe::liveness::supervisor_ready(team, pid);
            if ready {
                // Its warnings (say, a stale `worker` it will not run) reach the person
                // running the bench, not only the log.
                for line in appended(&log_path, log_start).lines() {
                    if line.starts_with("lead: ") {
                        eprintln!("{line}");
                    }
                }
                return Ok(sup);
            }
            if Instant::now() >= deadline {
                // Dropping `sup` stops it.
                bail!(
                    "the supervisor did not become ready within {} s (log: {})",
                    READY_TIMEOUT.as_secs(),
                    log_path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The supervisor's process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// SIGTERM (the graceful team stop: every running teammate is asked to shut down), then
    /// waits for the supervisor to exit. Returns how long that took.
    pub fn stop(&mut self) -> anyhow::Result<Duration> {
        let Some(mut child) = self.child.take() else {
            return Ok(Duration::ZERO);
        };
        let t0 = Instant::now();
        let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
        let deadline = t0 + Duration::from_secs(120);
        loop {
            if let Some(st) = child.try_wait()? {
                if !st.success() {
                    bail!("the supervisor exited with {st}");
                }
                return Ok(t0.elapsed());
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("the supervisor did not stop within 120 s; killed it");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// What the log at `path` holds past its first `from` bytes, lossily decoded (empty if it
/// cannot be read: only a reason to show is wanted).
fn appended(path: &Path, from: u64) -> String {
    let bytes = fsutil::read_from(path, from)
        .ok()
        .flatten()
        .unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            eprintln!("troupe-bench: {e:#}");
        }
    }
}
