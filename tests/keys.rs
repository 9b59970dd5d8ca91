//! API keys stay out of an agent's reach: a process of the worker's own uid (what its `bash`
//! runs as) cannot read the worker's environment through `/proc` (finding 4; the worker makes
//! itself non-dumpable). As root the worker is run as `nobody`, so the test means the same
//! whoever runs it.

mod support;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::team::{Team, wait_until};
use troupe::config::MemberStatus;

const KEY: &str = "sk-ant-secret-in-the-environment";

/// Gives every file under `dir` to `uid` (the test runs as root: the worker will not).
fn chown_tree(dir: &std::path::Path, uid: u32) {
    std::os::unix::fs::chown(dir, Some(uid), Some(uid)).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            chown_tree(&p, uid);
        } else {
            std::os::unix::fs::chown(&p, Some(uid), Some(uid)).unwrap();
        }
    }
}

#[test]
fn the_worker_environment_is_not_readable_by_its_own_uid() {
    let team = Team::new();
    team.add_member("amy", 1, false);
    let me = nix::unistd::geteuid().as_raw();
    let uid = if me == 0 { 65534 } else { me };
    if me == 0 {
        chown_tree(team.path(), uid);
    }
    let mut worker = Command::new(env!("CARGO_BIN_EXE_worker"));
    worker
        .args(["--name", "amy", "--team-dir"])
        .arg(team.dir.root())
        .arg("--workdir")
        .arg(&team.workdir)
        .current_dir(&team.workdir)
        .env("TROUPE_PROVIDER", "anthropic")
        .env("ANTHROPIC_API_KEY", KEY)
        .env("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .uid(uid)
        .gid(uid);
    let mut child = worker.spawn().unwrap();
    let pid = child.id();
    wait_until(Duration::from_secs(30), "amy idle", || {
        (team.status("amy") == MemberStatus::Idle).then_some(())
    });
    let read = Command::new("cat")
        .arg(format!("/proc/{pid}/environ"))
        .uid(uid)
        .gid(uid)
        .output()
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        !String::from_utf8_lossy(&read.stdout).contains(KEY),
        "a process of the worker's uid read its API key from /proc"
    );
    assert!(!read.status.success());
}
