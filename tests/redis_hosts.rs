//! Issue 15, placement: a team on a Redis bus spread over two hosts, each a `lead run --host H`
//! with its own team dir and working dir (here both on this machine), sharing only the server.
//! Each runs only its own host's members; a member spawned without `--host` goes to the first
//! supervisor that starts it; a second supervisor for a host that has one is refused; `lead stop
//! --host H` stops one host and `lead stop` every other; a supervisor killed with `kill -9` is
//! succeeded once its lease lapses; `lead logs` of another host's member says where its log is.

mod support;

use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::hosts::{Bus, Host, ok};
use support::redis_server::RedisServer;
use support::team::{alive, wait_until};

const T: Duration = Duration::from_secs(30);

/// `lead ARGS` in `host`'s team dir with no bus fails, saying a host needs one.
fn refused_without_a_bus(host: &Host, args: &[&str]) {
    let o = Command::new(env!("CARGO_BIN_EXE_lead"))
        .arg("--team-dir")
        .arg(&host.team)
        .args(args)
        .env_remove("TROUPE_BUS")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("needs a bus"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn two_hosts_split_a_team_and_stop_one_at_a_time() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(
        &server,
        "hosts",
        scratch.path(),
        &["a1", "a2", "b1", "b2", "c1"],
    );
    let (a, b) = (Host::new(), Host::new());
    refused_without_a_bus(
        &a,
        &["spawn", "x", "--role", "r", "--prompt", "p", "--host", "a"],
    );
    for (name, host) in [("a1", "ha"), ("a2", "ha"), ("b1", "hb"), ("b2", "hb")] {
        // Spawned from either host's CLI: the roster is on the bus.
        let from = if host == "ha" { &b } else { &a };
        ok(&bus.out(
            from,
            &[
                "spawn", name, "--role", "r", "--prompt", "ack", "--host", host,
            ],
        ));
    }
    let sup_a = bus.run(&a, "ha");
    let members = wait_until(T, "four idle members", || {
        let ms = bus.members(&a);
        (ms.iter().filter(|m| m["status"] == "idle").count() == 2).then_some(ms)
    });
    // Only host a's members run: b's wait for their own supervisor.
    for m in &members {
        let on_a = m["host"] == "ha";
        assert_eq!(m["status"] == "idle", on_a, "{m}");
    }
    let mut sup_b = bus.run(&b, "hb");
    let members = wait_until(T, "all four idle", || {
        let ms = bus.members(&b);
        (ms.iter().filter(|m| m["status"] == "idle").count() == 4).then_some(ms)
    });
    let pid_of = |ms: &[Value], n: &str| {
        ms.iter().find(|m| m["name"] == n).unwrap()["pid"]
            .as_u64()
            .unwrap()
    };
    // Each worker runs with its own host's team dir.
    for (n, host) in [("a1", &a), ("b1", &b)] {
        let cmdline =
            std::fs::read_to_string(format!("/proc/{}/cmdline", pid_of(&members, n))).unwrap();
        assert!(
            cmdline.contains(host.team.to_str().unwrap()),
            "{n}: {cmdline}"
        );
    }
    assert_eq!(bus.live_hosts(&a), ["ha", "hb"]);
    // A member spawned with no host goes to the first supervisor that starts it.
    ok(&bus.out(&a, &["spawn", "c1", "--role", "r", "--prompt", "ack"]));
    let c1 = wait_until(T, "c1 placed and idle", || {
        bus.members(&a)
            .into_iter()
            .find(|m| m["name"] == "c1" && m["status"] == "idle")
    });
    assert!(c1["host"] == "ha" || c1["host"] == "hb", "{c1}");
    // A second supervisor for host b is refused (after waiting out the lease: it is renewed).
    let c = Host::new();
    let o = bus.out(&c, &["run", "--host", "hb"]);
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("lease"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The log of a member of the other host is there, not here.
    let o = bus.out(&a, &["logs", "b1"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("runs on host hb"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    ok(&bus.out(&b, &["logs", "b1"]));
    // kill -9 of host b's supervisor: its workers die with it; a new one takes over once the
    // lease lapses, and restarts them.
    let b1_pid = pid_of(&members, "b1");
    sup_b.0.kill().unwrap();
    sup_b.0.wait().unwrap();
    wait_until(T, "b1's worker gone", || (!alive(b1_pid)).then_some(()));
    let _sup_b2 = bus.run(&b, "hb");
    let b1 = wait_until(T, "b1 restarted", || {
        bus.members(&a).into_iter().find(|m| {
            m["name"] == "b1"
                && m["status"] == "idle"
                && m["pid"].as_u64().is_some_and(|p| p != b1_pid && alive(p))
        })
    });
    assert_eq!(b1["host"], "hb");
    // Messages cross hosts: sent from host b's CLI to a member of host a, and back.
    ok(&bus.out(&b, &["send", "a1", "hello"]));
    // lead stop --host hb stops only host b.
    ok(&bus.out(&a, &["stop", "--host", "hb"]));
    let ms = bus.members(&a);
    for m in &ms {
        let want = if m["host"] == "hb" { "stopped" } else { "idle" };
        assert_eq!(m["status"], want, "{m}");
    }
    assert_eq!(bus.live_hosts(&a), ["ha"]);
    // lead stop: every host left.
    ok(&bus.out(&b, &["stop"]));
    assert!(bus.live_hosts(&a).is_empty());
    for m in bus.members(&a) {
        assert_eq!(m["status"], "stopped", "{m}");
    }
    drop(sup_a);
    let o = bus.out(&a, &["stop"]);
    assert_eq!(o.status.code(), Some(4), "nothing left to stop");
}

/// The board's hooks run on one host of a team on a bus: two supervisors, a `task_created`
/// hook that takes a while, five tasks added from the CLI: five runs, not up to ten.
#[test]
fn the_board_hooks_run_on_one_host() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "hooks", scratch.path(), &[]);
    let (a, b) = (Host::new(), Host::new());
    let log = scratch.path().join("hook.log");
    let on_bus = bus.team_dir(&a);
    // One log for both hosts, outside either's working dir: the count is what this test is
    // about, not the sandbox (a `sandbox = false` hook runs outside when `lead up` applied it).
    let file = scratch.path().join("team.toml");
    std::fs::write(
        &file,
        format!(
            "[[hooks]]\nevent = \"task_created\"\ncommand = \"cat >> {l}; echo >> {l}; sleep 0.6\"\n\
             timeout_secs = 20\nsandbox = false\n",
            l = log.display()
        ),
    )
    .unwrap();
    ok(&bus.out(&a, &["up", file.to_str().unwrap()]));
    let _sup_a = bus.run(&a, "ha");
    let _sup_b = bus.run(&b, "hb");
    wait_until(T, "both hosts up", || {
        (bus.live_hosts(&a).len() == 2).then_some(())
    });
    for i in 0..5 {
        ok(&bus.out(&b, &["task", "add", &format!("task {i}")]));
    }
    let store = troupe::tasks::TaskStore::new(&on_bus);
    wait_until(T, "every task_created hook settled", || {
        let tasks = store.list(None).unwrap();
        (tasks.len() == 5 && tasks.iter().all(|t| !t.created_hook_pending)).then_some(())
    });
    // A pass that started before the last verdict has had its chance to run twice.
    std::thread::sleep(Duration::from_millis(1500));
    let runs = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count();
    assert_eq!(runs, 5, "{}", std::fs::read_to_string(&log).unwrap());
}

/// `lead up` places members too: a team file's `host` lands in the roster on the bus, and a
/// file with a host is refused without a bus before anything changes.
#[test]
fn a_team_file_places_members_on_hosts() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "up", scratch.path(), &[]);
    let a = Host::new();
    let file = scratch.path().join("team.toml");
    std::fs::write(
        &file,
        "[[members]]\nname = \"gpu\"\nrole = \"ml\"\nprompt = \"train\"\nhost = \"gpu-1\"\n\n\
         [[members]]\nname = \"doc\"\nrole = \"docs\"\nprompt = \"write\"\n",
    )
    .unwrap();
    let file = file.to_str().unwrap();
    refused_without_a_bus(&a, &["up", file]);
    assert!(!a.team.join("config.json").exists(), "nothing changed");
    ok(&bus.out(&a, &["up", file]));
    let hosts: Vec<(String, Value)> = bus
        .members(&a)
        .into_iter()
        .map(|m| (m["name"].as_str().unwrap().to_owned(), m["host"].clone()))
        .collect();
    assert_eq!(
        hosts,
        [
            ("gpu".to_owned(), Value::from("gpu-1")),
            ("doc".to_owned(), Value::Null)
        ]
    );
}

/// The record of what `lead up` applied is the team's own state, on the bus with the rest: no
/// file in the host's team dir, and a team file in the project root changed since is refused
/// (exit 5) from the record on the bus.
#[test]
fn the_record_of_applied_team_files_lives_on_the_bus() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "record", scratch.path(), &[]);
    let h = Host::new();
    let file = h.team.parent().unwrap().join("team.toml");
    let first = "[[members]]\nname = \"amy\"\nrole = \"r\"\nprompt = \"p\"\n";
    std::fs::write(&file, first).unwrap();
    ok(&bus.out(&h, &["up", file.to_str().unwrap()]));
    assert!(
        !h.team.join("team-file.json").exists(),
        "the record is on the bus, not in the host's team dir"
    );
    std::fs::write(
        &file,
        format!("{first}\n[[hooks]]\nevent = \"teammate_idle\"\ncommand = \"true\"\n"),
    )
    .unwrap();
    let o = bus.out(&h, &["up", file.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(5), "{o:?}");
}
