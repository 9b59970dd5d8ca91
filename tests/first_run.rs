//! The README's first command on a fresh clone (issue 10): `cargo run --bin lead -- demo` builds
//! only `lead`, so the lead must run its team without a `worker` binary beside it, must not run
//! a stale one it finds there, and must refuse a `TROUPE_WORKER` that is not of its build with
//! one line that says how to fix it (exit 78, before READY).
//!
//! The lone-binary cases run a copy of `lead` alone in a temporary directory: what a fresh clone
//! has after `cargo run --bin lead`.

mod support;

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Bg, Team, wait_until};
use troupe::TeamDir;
use troupe::config::{MemberStatus, Roster};

const T: Duration = Duration::from_secs(30);

fn clean(cmd: &mut Command) -> &mut Command {
    for var in support::team::CLEARED_ENV {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null())
}

/// A copy of the `lead` binary alone in `dir/bin`, with nothing else built beside it.
fn lone_lead(dir: &Path) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let lead = bin.join("lead");
    std::fs::copy(env!("CARGO_BIN_EXE_lead"), &lead).unwrap();
    lead
}

/// `lead demo --pace-ms 0 --dir DIR` run by `lead`, without any provider settings.
fn demo(lead: &Path, dir: &Path) -> Output {
    run_out(clean(
        Command::new(lead)
            .args(["demo", "--pace-ms", "0", "--dir"])
            .arg(dir),
    ))
}

/// Runs `cmd` to completion, again while exec says the binary is busy: a copy this test just
/// wrote can still be open for writing in a child that another test thread forked and that
/// has not exec'd yet (ETXTBSY).
fn run_out(cmd: &mut Command) -> Output {
    for _ in 0..50 {
        match cmd.output() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r.unwrap(),
        }
    }
    cmd.output().unwrap()
}

/// [`run_out`] for a process left running.
fn run_bg(cmd: &mut Command) -> std::process::Child {
    for _ in 0..50 {
        match cmd.spawn() {
            Err(e) if e.raw_os_error() == Some(libc::ETXTBSY) => {
                std::thread::sleep(std::time::Duration::from_millis(20))
            }
            r => return r.unwrap(),
        }
    }
    cmd.spawn().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts that the demo in `dir` ended with every member `shutdown` after a clean exit.
fn assert_demo_done(out: &Output, dir: &Path) -> TeamDir {
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    let team = TeamDir::open(dir.join(".team")).unwrap();
    let cfg = Roster::new(&team).load().unwrap();
    assert_eq!(cfg.members.len(), 2, "{stdout}");
    for m in &cfg.members {
        assert_eq!(m.status, MemberStatus::Shutdown, "{}: {stdout}", m.name);
    }
    team
}

/// The `worker_exe` events of a team: which worker each supervisor chose.
fn worker_exe_events(team: &TeamDir) -> Vec<Value> {
    troupe::events::read_all(team)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == "worker_exe")
        .collect()
}

#[test]
fn the_demo_runs_from_a_lead_binary_alone() {
    let tmp = tempfile::tempdir().unwrap();
    let lead = lone_lead(tmp.path());
    let dir = tmp.path().join("demo");
    let out = demo(&lead, &dir);
    let team = assert_demo_done(&out, &dir);
    let chosen = worker_exe_events(&team);
    assert_eq!(chosen.len(), 1, "{chosen:?}");
    assert_eq!(chosen[0]["source"], "built-in", "{chosen:?}");
    assert!(
        !text(&out.stderr).contains("not using"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn a_stale_worker_beside_the_lead_is_not_run() {
    let tmp = tempfile::tempdir().unwrap();
    let lead = lone_lead(tmp.path());
    let marker = tmp.path().join("stale-worker-ran");
    let stale = lead.with_file_name("worker");
    std::fs::write(
        &stale,
        format!(
            "#!/bin/sh\nif [ \"$1\" = --build-id ]; then echo 0.0.1-00000000deadbeef; exit 0; fi\n\
             touch '{}'\nexit 1\n",
            marker.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&stale, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("demo");
    let out = demo(&lead, &dir);
    let team = assert_demo_done(&out, &dir);
    let stderr = text(&out.stderr);
    let warning: Vec<&str> = stderr.lines().filter(|l| l.contains("not using")).collect();
    assert_eq!(warning.len(), 1, "{stderr}");
    for want in [
        stale.to_str().unwrap(),
        "another build (0.0.1-00000000deadbeef",
        "built-in worker",
        "cargo build --bin worker",
    ] {
        assert!(warning[0].contains(want), "{want:?} not in {stderr}");
    }
    assert!(!marker.exists(), "the stale worker was run");
    assert_eq!(worker_exe_events(&team)[0]["source"], "built-in");
}

/// `TROUPE_WORKER` names a file that does not exist: `lead run` refuses to start, with exit 78
/// and one line, before it tells systemd it is ready.
#[test]
fn an_unusable_troupe_worker_stops_lead_run_before_ready() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nonexistent/worker");
    let sock_path = tmp.path().join("notify.sock");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    sock.set_nonblocking(true).unwrap();
    let team_dir = tmp.path().join(".team");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lead"));
    clean(&mut cmd)
        .arg("--team-dir")
        .arg(&team_dir)
        .arg("run")
        .current_dir(tmp.path())
        .env("TROUPE_WORKER", &missing)
        .env("NOTIFY_SOCKET", &sock_path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut sup = Bg(run_bg(&mut cmd));
    let status = wait_until(Duration::from_secs(10), "lead run to exit", || {
        sup.0.try_wait().unwrap()
    });
    let mut stderr = String::new();
    sup.0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert_eq!(status.code(), Some(78), "{stderr}");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stderr}");
    for want in [
        missing.to_str().unwrap(),
        "TROUPE_WORKER",
        "does not exist",
        "cargo build --bin worker",
        "unset TROUPE_WORKER",
    ] {
        assert!(lines[0].contains(want), "{want:?} not in {stderr}");
    }
    let mut buf = [0u8; 256];
    let got = sock.recv(&mut buf).map(|n| text(&buf[..n]));
    assert!(got.is_err(), "systemd was told {got:?}");
    let lock = std::fs::read_to_string(team_dir.join("lead.lock")).unwrap_or_default();
    assert!(!lock.contains("ready"), "{lock}");
}

#[test]
fn lead_run_detach_shows_why_the_supervisor_did_not_start() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nonexistent/worker");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lead"));
    clean(&mut cmd)
        .arg("--team-dir")
        .arg(tmp.path().join(".team"))
        .args(["run", "--detach"])
        .current_dir(tmp.path())
        .env("TROUPE_WORKER", &missing);
    let out = run_out(&mut cmd);
    let stdout = text(&out.stdout);
    if let Ok(pid) = stdout.trim().parse::<i32>() {
        // Started after all (the bug): do not leave it running.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stdout}\n{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    for want in [
        "the supervisor exited during start-up",
        missing.to_str().unwrap(),
        "does not exist",
        "cargo build --bin worker",
    ] {
        assert!(stderr.contains(want), "{want:?} not in {stderr}");
    }
}

#[test]
fn a_worker_started_for_a_lead_of_another_build_refuses_to_run() {
    let team = Team::new();
    team.add_member("alice", 1, false);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
    clean(&mut cmd)
        .arg("--team-dir")
        .arg(team.dir.root())
        .args(["--name", "alice"])
        .env("TROUPE_BUILD_ID", "0.0.1-00000000deadbeef")
        .env("TROUPE_PROVIDER", "replay")
        .env("TROUPE_CASSETTE", team.path().join("none.jsonl"));
    let out = run_out(&mut cmd);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    let line = stderr.trim_end();
    assert!(
        line.starts_with("worker: this worker is build 0.1.0-"),
        "{line}"
    );
    assert!(
        line.contains("but the lead that started it is build 0.0.1-00000000deadbeef"),
        "{line}"
    );
    assert!(
        line.ends_with("restart lead run after rebuilding"),
        "{line}"
    );
}

/// `worker --build-id` and the lead's built-in worker answer the same id: the package version
/// and 16 hex digits of the sources' hash.
#[test]
fn the_worker_and_the_leads_built_in_worker_have_one_build_id() {
    let answer = |cmd: &mut Command| {
        let out = run_out(clean(cmd.arg("--build-id")));
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        text(&out.stdout)
    };
    let worker = answer(&mut Command::new(env!("CARGO_BIN_EXE_worker")));
    let built_in = answer(Command::new(env!("CARGO_BIN_EXE_lead")).arg0("worker"));
    assert_eq!(worker, built_in);
    let id = worker.strip_suffix('\n').unwrap();
    let hash = id
        .strip_prefix(concat!(env!("CARGO_PKG_VERSION"), "-"))
        .unwrap_or_else(|| panic!("{id:?}"));
    assert_eq!(hash.len(), 16, "{id:?}");
    assert!(hash.bytes().all(|b| b.is_ascii_hexdigit()), "{id:?}");
}

/// A lone `lead run` starts its teammates as `worker` processes of its own binary, so `ps`
/// shows `worker --team-dir ...`.
#[test]
fn the_built_in_worker_shows_as_worker_in_ps() {
    let tmp = tempfile::tempdir().unwrap();
    let lead = lone_lead(tmp.path());
    let team = tmp.path().join(".team");
    let fake = FakeLlm::start([Reply::ok(anthropic_text("ready"))]);
    let cmd = |args: &[&str]| {
        let mut c = Command::new(&lead);
        clean(&mut c)
            .arg("--team-dir")
            .arg(&team)
            .args(args)
            .current_dir(tmp.path())
            .env("TROUPE_PROVIDER", "anthropic")
            .env("ANTHROPIC_API_KEY", "sk-test")
            .env("ANTHROPIC_BASE_URL", fake.url());
        c
    };
    let spawned = run_out(&mut cmd(&[
        "spawn", "alice", "--role", "coder", "--prompt", "hi",
    ]));
    assert_eq!(spawned.status.code(), Some(0), "{}", text(&spawned.stderr));
    let _sup = Bg(run_bg(cmd(&["run"]).stderr(Stdio::null())));
    let team = TeamDir::open(&team).unwrap();
    let pid = wait_until(T, "alice idle", || {
        let cfg = Roster::new(&team).load().ok()?;
        let m = cfg.member("alice")?;
        (m.status == MemberStatus::Idle).then_some(m.pid?)
    });
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let argv: Vec<String> = cmdline
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(text)
        .collect();
    assert_eq!(argv[0], "worker", "{argv:?}");
    assert_eq!(argv[1], "--team-dir", "{argv:?}");
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap();
    assert_eq!(exe, lead.canonicalize().unwrap());
}
