//! A supervisor in the background: `lead run --detach`, and the one `lead chat` and `lead demo`
//! start for themselves; each returns once the supervisor is ready.

use super::*;
use troupe::{eprintln, println};

/// `lead run --detach`: starts the supervisor in the background (its own session, output to
/// `logs/lead.log`) and returns once it is ready.
pub fn detach(team_dir: &std::path::Path, args: &[String]) -> anyhow::Result<u8> {
    let team = TeamDir::create(team_dir)?;
    let child = start_background(&team, args, &[], Attach::Detached)?;
    println!("{}", child.id());
    Ok(0)
}

/// How a supervisor started by [`start_background`] is tied to the process that starts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attach {
    /// Its own session: it outlives the caller (`lead run --detach`).
    Detached,
    /// Its own process group (a Ctrl-C at the caller's terminal does not reach it), and SIGTERM
    /// (a graceful team stop) when the caller dies: `lead chat`, `lead demo`.
    Child,
}

/// Starts `lead run ARGS` in the background with output to `logs/lead.log` and the extra
/// environment `envs`, and returns once it is ready (it holds `lead.lock` and has started every
/// member that should run).
pub fn start_background(
    team: &TeamDir,
    args: &[String],
    envs: &[(String, String)],
    attach: Attach,
) -> anyhow::Result<Child> {
    let log_path = team.log(&AgentName::lead());
    let log = fsutil::open_append(&log_path)?;
    // Where this supervisor's own lines will start: its reason, should it fail to start.
    let log_start = log.metadata().map_or(0, |m| m.len());
    let exe = std::env::current_exe().context("failed to find the lead binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg("--team-dir")
        .arg(team.root())
        .arg("run")
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log));
    match attach {
        // SAFETY: setsid is async-signal-safe; it runs in the child between fork and exec.
        Attach::Detached => unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        },
        // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec. The
        // caller spawns from its main thread, which lives as long as the caller.
        Attach::Child => unsafe {
            cmd.process_group(0).pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        },
    }
    let mut child = cmd.spawn().context("failed to start the supervisor")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = child.try_wait()? {
            // Its own one-line reason (the last `lead: ...` line it wrote), with its exit code.
            let said = appended(&log_path, log_start);
            let message = match said.lines().rev().find_map(|l| l.strip_prefix("lead: ")) {
                Some(why) => format!(
                    "the supervisor exited during start-up ({st}): {why} (log: {})",
                    log_path.display()
                ),
                None => format!(
                    "the supervisor exited during start-up ({st}); see {}",
                    log_path.display()
                ),
            };
            let code = st.code().and_then(|c| u8::try_from(c).ok());
            return Err(crate::ExitError {
                code: code.filter(|c| *c != 0).unwrap_or(1),
                message,
            }
            .into());
        }
        let ready = troupe::liveness::supervisor_ready(team, child.id());
        if ready {
            // Its warnings (say, a stale `worker` it will not run) reach the person who
            // started it, not only the log.
            for line in appended(&log_path, log_start).lines() {
                if line.starts_with("lead: ") {
                    eprintln!("{line}");
                }
            }
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the supervisor did not become ready within 30 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What the log at `path` holds past its first `from` bytes, lossily decoded (empty if it
/// cannot be read: the caller only wants a reason to show).
fn appended(path: &std::path::Path, from: u64) -> String {
    let bytes = fsutil::read_from(path, from)
        .ok()
        .flatten()
        .unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}
