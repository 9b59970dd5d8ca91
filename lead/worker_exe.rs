//! Which program `lead run` starts for each teammate, decided once, at start, before READY.
//!
//! `cargo run --bin lead` builds only `lead`, so a fresh clone has no `target/debug/worker`,
//! and after a pull the one there may be from an older build. So the lead carries the worker
//! itself (started with `argv[0]` = `worker`, `lead` runs the worker's `main`), and `lead run`
//! picks, in this order:
//!
//! 1. `TROUPE_WORKER=PATH`, if set: it must exist, be executable and answer `--build-id` with
//!    the lead's own [`troupe::BUILD_ID`]. Anything else is a configuration error: `lead run`
//!    exits 78 before READY with one line that says what is wrong and how to fix it (systemd's
//!    `RestartPreventExitStatus=64 78` then does not restart it in a loop).
//! 2. `worker` next to the lead's executable, if it answers with the lead's build id. One that
//!    answers another id (a stale build) or cannot run is not run: a warning says why, and the
//!    lead falls back to
//! 3. the built-in worker: the lead's own executable, started as `worker`, so `ps` shows
//!    `worker --team-dir ...`.
//!
//! Whatever runs, it gets `TROUPE_BUILD_ID` and refuses to start (exit 78) for a lead of
//! another build: a worker binary replaced while the lead runs never joins its team.

use std::ffi::OsString;
use std::fmt;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use troupe::eprintln;

use anyhow::Context;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::json;
use troupe::{BUILD_ID, TeamDir, events};

use crate::ExitError;

/// The variable that names the worker program to run.
pub const TROUPE_WORKER: &str = "TROUPE_WORKER";

/// The variable through which a worker learns its lead's build id.
pub const TROUPE_BUILD_ID: &str = "TROUPE_BUILD_ID";

/// How long a candidate may take to answer `--build-id`: a hanging binary must not block the
/// start of the team.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// The exit code of a configuration error (`EX_CONFIG`).
const EX_CONFIG: u8 = 78;

/// Where the worker program came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `TROUPE_WORKER`.
    Env,
    /// `worker` next to the lead's executable.
    Beside,
    /// The lead's own executable, started as `worker`.
    BuiltIn,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Env => "TROUPE_WORKER",
            Source::Beside => "beside",
            Source::BuiltIn => "built-in",
        }
    }
}

/// The program `lead run` starts for each teammate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerExe {
    /// What is executed.
    pub program: PathBuf,
    /// `argv[0]`, when it is not `program` (the built-in worker: `worker`).
    pub arg0: Option<OsString>,
    /// The file, as shown to people (for the built-in worker `program` is `/proc/self/exe`).
    pub path: PathBuf,
    pub source: Source,
}

impl WorkerExe {
    /// A command that runs this worker with the lead's build id in its environment; the caller
    /// adds the arguments.
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        if let Some(arg0) = &self.arg0 {
            cmd.arg0(arg0);
        }
        cmd.env(TROUPE_BUILD_ID, BUILD_ID);
        cmd
    }
}

impl fmt::Display for WorkerExe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.source {
            Source::BuiltIn => write!(f, "the built-in worker of {}", self.path.display()),
            _ => write!(f, "{}", self.path.display()),
        }
    }
}

/// What a candidate program answered to `--build-id`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Probe {
    /// No such file.
    Missing,
    /// Not a regular file with an execute bit.
    NotExecutable,
    /// It does not know `--build-id` (exit 64 or 2: a worker older than build ids).
    NoBuildId,
    /// It could not be run or gave no id: why.
    NoAnswer(String),
    /// The build id it printed.
    Build(String),
}

impl Probe {
    /// Why a candidate that gave this answer is not used, or `None` if it is of build `own`.
    fn unusable(&self, own: &str) -> Option<String> {
        Some(match self {
            Probe::Build(id) if id == own => return None,
            Probe::Build(id) => format!("it is from another build ({id}; this lead is {own})"),
            Probe::Missing => "it does not exist".to_owned(),
            Probe::NotExecutable => "it is not an executable file".to_owned(),
            Probe::NoBuildId => {
                format!(
                    "it is from an older build (it does not know --build-id; this lead is {own})"
                )
            }
            Probe::NoAnswer(why) => format!("it cannot run ({why})"),
        })
    }
}

/// `TROUPE_WORKER` names a program that cannot serve as this lead's worker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{TROUPE_WORKER}={} is not usable: {why}; build the worker with `cargo build --bin worker` \
     (and point {TROUPE_WORKER} at target/debug/worker), or unset {TROUPE_WORKER} to use the \
     lead's built-in worker",
    path.display()
)]
pub struct Unusable {
    pub path: PathBuf,
    pub why: String,
}

/// The decision and what to tell the person about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Choice {
    pub exe: WorkerExe,
    /// A `worker` beside the lead that is not used, and why (one line).
    pub warning: Option<String>,
}

/// Decides which worker to run (the order is in the module docs), given `TROUPE_WORKER`
/// (`named`), the `worker` beside the lead, the lead's own executable (`own_exe`, run as
/// `own_program`), the lead's build id and a way to ask a program for its build id.
pub fn choose(
    named: Option<&Path>,
    beside: &Path,
    own_exe: &Path,
    own_program: &Path,
    own_id: &str,
    probe: &mut dyn FnMut(&Path) -> Probe,
) -> Result<Choice, Unusable> {
    let plain = |path: &Path, source| WorkerExe {
        program: path.to_path_buf(),
        arg0: None,
        path: path.to_path_buf(),
        source,
    };
    if let Some(named) = named {
        return match probe(named).unusable(own_id) {
            None => Ok(Choice {
                exe: plain(named, Source::Env),
                warning: None,
            }),
            Some(why) => Err(Unusable {
                path: named.to_path_buf(),
                why,
            }),
        };
    }
    let answer = probe(beside);
    let warning = match answer.unusable(own_id) {
        None => {
            return Ok(Choice {
                exe: plain(beside, Source::Beside),
                warning: None,
            });
        }
        Some(_) if answer == Probe::Missing => None,
        Some(why) => Some(format!(
            "not using {}: {why}; using the lead's built-in worker; rebuild it with cargo build --bin worker",
            beside.display()
        )),
    };
    Ok(Choice {
        exe: WorkerExe {
            program: own_program.to_path_buf(),
            arg0: Some("worker".into()),
            path: own_exe.to_path_buf(),
            source: Source::BuiltIn,
        },
        warning,
    })
}

/// Asks `path --build-id` for its build id, waiting at most [`PROBE_TIMEOUT`].
pub fn probe(path: &Path) -> Probe {
    probe_within(path, PROBE_TIMEOUT)
}

fn probe_within(path: &Path, timeout: Duration) -> Probe {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Probe::Missing,
        Err(e) => return Probe::NoAnswer(format!("failed to inspect it: {e}")),
    };
    if !meta.is_file() || meta.permissions().mode() & 0o111 == 0 {
        return Probe::NotExecutable;
    }
    let mut child = match Command::new(path)
        .arg("--build-id")
        .env_remove(TROUPE_BUILD_ID)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
    {
        Ok(c) => c,
        Err(e) => return Probe::NoAnswer(format!("failed to start it: {e}")),
    };
    // Read on a thread: a grandchild that keeps the pipe open must not block us either.
    let (tx, rx) = mpsc::channel();
    if let Some(mut out) = child.stdout.take() {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = out.by_ref().take(4096).read_to_end(&mut buf);
            let _ = tx.send(buf);
        });
    }
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(2)),
            Ok(None) => {
                let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                let _ = child.wait();
                return Probe::NoAnswer(format!(
                    "no answer to --build-id within {} s",
                    timeout.as_secs()
                ));
            }
            Err(e) => return Probe::NoAnswer(format!("failed to wait for it: {e}")),
        }
    };
    if matches!(status.code(), Some(2 | 64)) {
        return Probe::NoBuildId;
    }
    if !status.success() {
        return Probe::NoAnswer(format!("--build-id ended with {status}"));
    }
    let out = rx
        .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        .unwrap_or_default();
    let out = String::from_utf8_lossy(&out);
    match out.trim() {
        id if id.is_empty() || id.contains(char::is_whitespace) => {
            Probe::NoAnswer("it printed no build id for --build-id".to_owned())
        }
        id => Probe::Build(id.to_owned()),
    }
}

/// Resolves the worker for `lead run` on `team`: prints the warning about a `worker` beside
/// the lead that is not used, logs the choice (event `worker_exe` and info), and fails with
/// exit code 78 when `TROUPE_WORKER` is not usable.
pub fn resolve(team: &TeamDir) -> anyhow::Result<WorkerExe> {
    let own = std::env::current_exe().context("failed to find the lead binary")?;
    // `/proc/self/exe` is the very file this lead runs from, even after a rebuild replaced
    // `target/debug/lead`: the built-in worker is always of the lead's own build.
    let proc_exe = Path::new("/proc/self/exe");
    let own_program = if proc_exe.exists() { proc_exe } else { &own };
    let named = match std::env::var_os(TROUPE_WORKER).filter(|v| !v.is_empty()) {
        // Absolute: workers start in the teammates' working dir, not here.
        Some(v) => Some(
            std::path::absolute(&v)
                .with_context(|| format!("failed to resolve {TROUPE_WORKER}={}", v.display()))?,
        ),
        None => None,
    };
    let beside = own.with_file_name("worker");
    match choose(
        named.as_deref(),
        &beside,
        &own,
        own_program,
        BUILD_ID,
        &mut probe,
    ) {
        Ok(choice) => {
            if let Some(w) = &choice.warning {
                eprintln!("lead: {w}");
            }
            tracing::info!("workers run {} (build {BUILD_ID})", choice.exe);
            events::log(
                team,
                "worker_exe",
                json!({
                    "path": choice.exe.path,
                    "source": choice.exe.source.as_str(),
                    "build_id": BUILD_ID,
                    "warning": choice.warning,
                }),
            );
            Ok(choice.exe)
        }
        Err(e) => {
            events::log(
                team,
                "worker_exe",
                json!({"path": e.path, "source": Source::Env.as_str(), "error": e.why}),
            );
            Err(ExitError {
                code: EX_CONFIG,
                message: e.to_string(),
            }
            .into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OWN: &str = "0.1.0-0123456789abcdef";

    fn decide(
        named: Option<&str>,
        answers: &[(&str, Probe)],
    ) -> (Result<Choice, Unusable>, Vec<PathBuf>) {
        let mut asked = Vec::new();
        let got = choose(
            named.map(Path::new),
            Path::new("/bin/worker"),
            Path::new("/bin/lead"),
            Path::new("/proc/self/exe"),
            OWN,
            &mut |p| {
                asked.push(p.to_path_buf());
                answers
                    .iter()
                    .find(|(q, _)| Path::new(q) == p)
                    .map_or(Probe::Missing, |(_, a)| a.clone())
            },
        );
        (got, asked)
    }

    fn built_in() -> WorkerExe {
        WorkerExe {
            program: "/proc/self/exe".into(),
            arg0: Some("worker".into()),
            path: "/bin/lead".into(),
            source: Source::BuiltIn,
        }
    }

    #[test]
    fn a_matching_troupe_worker_wins_and_the_one_beside_is_not_asked() {
        let (got, asked) = decide(
            Some("/opt/w"),
            &[
                ("/opt/w", Probe::Build(OWN.into())),
                ("/bin/worker", Probe::Build(OWN.into())),
            ],
        );
        let exe = got.unwrap().exe;
        assert_eq!((exe.source, exe.program), (Source::Env, "/opt/w".into()));
        assert_eq!(exe.arg0, None);
        assert_eq!(asked, [PathBuf::from("/opt/w")]);
    }

    #[test]
    fn an_unusable_troupe_worker_is_an_error_naming_it_and_the_fix() {
        for (answer, why) in [
            (Probe::Missing, "it does not exist"),
            (Probe::NotExecutable, "it is not an executable file"),
            (
                Probe::Build("0.0.9-ffffffffffffffff".into()),
                "it is from another build (0.0.9-ffffffffffffffff; this lead is 0.1.0-0123456789abcdef)",
            ),
            (Probe::NoBuildId, "it does not know --build-id"),
            (
                Probe::NoAnswer("timed out".into()),
                "it cannot run (timed out)",
            ),
        ] {
            // No fallback, even with a good worker beside the lead.
            let (got, _) = decide(
                Some("/opt/w"),
                &[
                    ("/opt/w", answer),
                    ("/bin/worker", Probe::Build(OWN.into())),
                ],
            );
            let err = got.unwrap_err();
            assert!(err.why.contains(why), "{err}");
            let line = err.to_string();
            assert!(!line.contains('\n'), "{line}");
            for want in [
                "TROUPE_WORKER=/opt/w is not usable",
                "cargo build --bin worker",
                "unset TROUPE_WORKER",
            ] {
                assert!(line.contains(want), "{want:?} not in {line}");
            }
        }
    }

    #[test]
    fn the_worker_beside_the_lead_is_used_when_it_is_of_this_build() {
        let (got, _) = decide(None, &[("/bin/worker", Probe::Build(OWN.into()))]);
        let choice = got.unwrap();
        assert_eq!(choice.exe.source, Source::Beside);
        assert_eq!(choice.exe.program, PathBuf::from("/bin/worker"));
        assert_eq!(choice.warning, None);
    }

    #[test]
    fn no_worker_beside_the_lead_means_the_built_in_one_silently() {
        let (got, asked) = decide(None, &[]);
        assert_eq!(
            got.unwrap(),
            Choice {
                exe: built_in(),
                warning: None
            }
        );
        assert_eq!(asked, [PathBuf::from("/bin/worker")]);
    }

    #[test]
    fn a_stale_or_broken_worker_beside_the_lead_is_skipped_with_a_warning() {
        for (answer, why) in [
            (
                Probe::Build("0.0.9-ffffffffffffffff".into()),
                "it is from another build (0.0.9-ffffffffffffffff; this lead is 0.1.0-0123456789abcdef)",
            ),
            (Probe::NoBuildId, "from an older build"),
            (Probe::NotExecutable, "not an executable file"),
            (
                Probe::NoAnswer("no answer within 5 s".into()),
                "no answer within 5 s",
            ),
        ] {
            let choice = decide(None, &[("/bin/worker", answer)]).0.unwrap();
            assert_eq!(choice.exe, built_in());
            let w = choice.warning.unwrap();
            assert!(w.starts_with("not using /bin/worker: "), "{w}");
            assert!(w.contains(why), "{why:?} not in {w}");
            assert!(
                w.ends_with(
                    "using the lead's built-in worker; rebuild it with cargo build --bin worker"
                ),
                "{w}"
            );
        }
    }

    #[test]
    fn the_built_in_worker_runs_as_worker_with_the_build_id() {
        let cmd = built_in().command();
        assert_eq!(cmd.get_program(), "/proc/self/exe");
        let envs: Vec<_> = cmd.get_envs().collect();
        assert!(envs.contains(&(TROUPE_BUILD_ID.as_ref(), Some(BUILD_ID.as_ref()))));
    }

    #[test]
    fn probing_real_programs() {
        let tmp = tempfile::tempdir().expect("temp dir");
        let script = |name: &str, body: &str| {
            let p = tmp.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).expect("write script");
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755))
                .expect("chmod script");
            p
        };
        let t = Duration::from_secs(5);
        assert_eq!(probe_within(&tmp.path().join("none"), t), Probe::Missing);
        assert_eq!(probe_within(tmp.path(), t), Probe::NotExecutable);
        let id = script("id", "echo 0.1.0-00000000000000aa");
        assert_eq!(
            probe_within(&id, t),
            Probe::Build("0.1.0-00000000000000aa".into())
        );
        assert_eq!(probe_within(&script("old", "exit 64"), t), Probe::NoBuildId);
        assert!(matches!(
            probe_within(&script("silent", "exit 0"), t),
            Probe::NoAnswer(_)
        ));
        let started = Instant::now();
        let hang = script("hang", "sleep 30");
        assert!(matches!(
            probe_within(&hang, Duration::from_millis(200)),
            Probe::NoAnswer(why) if why.contains("no answer")
        ));
        assert!(started.elapsed() < Duration::from_secs(5));
    }
}
