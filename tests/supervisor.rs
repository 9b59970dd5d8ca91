//! `lead run` with real workers against a fake LLM server: restart after kill -9, the restart
//! limit, no restart after exit 78, and a graceful stop that leaves no process behind.

mod support;

use std::process::Stdio;
use std::time::Duration;

use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Bg as Lead, Team, alive as alive_pid, lead_cmd, wait_until};

use troupe::config::MemberStatus;

fn alive(pid: u32) -> bool {
    alive_pid(u64::from(pid))
}

const T: Duration = Duration::from_secs(30);

/// `lead spawn NAME --role r --prompt PROMPT`, which must succeed.
fn spawn(team: &Team, url: &str, name: &str, prompt: &str) {
    let st = lead_cmd(
        team,
        url,
        &["spawn", name, "--role", "r", "--prompt", prompt],
    )
    .status()
    .unwrap();
    assert!(st.success(), "spawn {name}: {st}");
}

#[test]
fn restart_after_kill_then_graceful_stop() {
    let team = Team::new();
    let fake = FakeLlm::start((0..20).map(|i| Reply::ok(anthropic_text(&format!("done {i}")))));
    let ok = lead_cmd(
        &team,
        &fake.url(),
        &["spawn", "amy", "--role", "coder", "--prompt", "hi"],
    )
    .status()
    .unwrap();
    assert!(ok.success());
    let mut lead = Lead(
        lead_cmd(
            &team,
            &fake.url(),
            &["run", "--stop-timeout", "1", "--kill-grace", "1"],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let first = wait_until(T, "amy idle", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    assert_eq!(first.incarnation, 1);
    let pid = first.pid.unwrap();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let msg = team.send("amy", "are you back?");
    let second = wait_until(T, "amy restarted", || {
        let m = team.member("amy");
        (m.incarnation == 2
            && m.status == MemberStatus::Idle
            && team.consumed_ids("amy").contains(&msg.id))
        .then_some(m)
    });
    assert_eq!(second.restarts, 1);
    assert_eq!(second.last_exit.unwrap().signal.as_deref(), Some("SIGKILL"));
    let ids = team.consumed_ids("amy");
    assert_eq!(ids.iter().filter(|i| **i == msg.id).count(), 1);
    let pid2 = second.pid.unwrap();

    // A second supervisor is refused with exit 4.
    let o = lead_cmd(&team, &fake.url(), &["run"]).output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lead.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let st = wait_until(T, "lead exit", || lead.0.try_wait().unwrap());
    assert_eq!(st.code(), Some(0));
    assert_eq!(team.status("amy"), MemberStatus::Stopped);
    assert!(!alive(pid2), "worker left running");
}

#[test]
fn config_error_is_not_restarted_and_crash_loops_end_failed() {
    let team = Team::new();
    let fake = FakeLlm::start([]);
    spawn(&team, &fake.url(), "bo", "p");
    let _lead = Lead(
        lead_cmd(&team, &fake.url(), &["run"])
            .env("ANTHROPIC_API_KEY", "")
            .env("TROUPE_PROVIDER", "")
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let m = wait_until(T, "bo failed", || {
        let m = team.member("bo");
        (m.status == MemberStatus::Failed).then_some(m)
    });
    assert_eq!(m.incarnation, 1, "exit 78 must not be restarted");
    assert_eq!(m.last_exit.unwrap().code, Some(78));
    assert!(m.reason.unwrap().contains("configuration error"));
    // The lead is told, as a status update from the member.
    let note = wait_until(T, "the lead told of the failure", || {
        team.lead_inbox()
            .into_iter()
            .find(|m| m.kind == troupe::message::MessageType::StatusUpdate)
    });
    assert_eq!(note.from, "bo");
    assert!(note.content.contains("failed") && note.content.contains("configuration error"));
}

#[test]
fn repeated_kills_end_failed_with_the_reason_in_status() {
    let team = Team::new();
    let fake = FakeLlm::start((0..20).map(|i| Reply::ok(anthropic_text(&format!("done {i}")))));
    spawn(&team, &fake.url(), "cy", "p");
    let _lead = Lead(
        // Default policy: 5 restarts within 60 s; backoff 1+2+4+8+16 s keeps 6 kills inside it.
        lead_cmd(&team, &fake.url(), &["run"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for inc in 1..=6 {
        let m = wait_until(Duration::from_secs(40), "cy running", || {
            let m = team.member("cy");
            (m.incarnation == inc && m.pid.is_some() && m.status == MemberStatus::Idle).then_some(m)
        });
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(m.pid.unwrap() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    let m = wait_until(T, "cy failed", || {
        let m = team.member("cy");
        (m.status == MemberStatus::Failed).then_some(m)
    });
    assert_eq!(m.restarts, 5);
    assert_eq!(m.incarnation, 6);
    let o = lead_cmd(&team, &fake.url(), &["status"]).output().unwrap();
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("failed") && table.contains("gave up") && table.contains("SIGKILL"),
        "{table}"
    );
}

#[test]
fn systemd_notify_ready_and_stopping() {
    let team = Team::new();
    let fake = FakeLlm::start((0..5).map(|i| Reply::ok(anthropic_text(&format!("done {i}")))));
    spawn(&team, &fake.url(), "dee", "p");
    let sock_path = team.path().join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&sock_path).unwrap();
    sock.set_read_timeout(Some(T)).unwrap();
    let mut lead = Lead(
        lead_cmd(
            &team,
            &fake.url(),
            &["run", "--stop-timeout", "1", "--kill-grace", "1"],
        )
        .env("NOTIFY_SOCKET", &sock_path)
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let mut buf = [0u8; 4096];
    let n = sock.recv(&mut buf).unwrap();
    let first = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(first.starts_with("READY=1\nSTATUS=1 members"), "{first}");
    let pid = wait_until(T, "dee started", || team.member("dee").pid);
    // Workers do not inherit NOTIFY_SOCKET.
    let env = std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    assert!(!String::from_utf8_lossy(&env).contains("NOTIFY_SOCKET"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lead.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let mut seen = Vec::new();
    while !seen.iter().any(|m: &String| m.starts_with("STOPPING=1")) {
        let n = sock.recv(&mut buf).unwrap();
        seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    let st = wait_until(T, "lead exit", || lead.0.try_wait().unwrap());
    assert_eq!(st.code(), Some(0));
}

#[test]
fn detach_then_stop_from_another_shell() {
    let team = Team::new();
    let fake = FakeLlm::start((0..5).map(|i| Reply::ok(anthropic_text(&format!("done {i}")))));
    spawn(&team, &fake.url(), "eve", "p");
    let o = lead_cmd(
        &team,
        &fake.url(),
        &[
            "run",
            "--detach",
            "--stop-timeout",
            "1",
            "--kill-grace",
            "1",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let lead_pid: u32 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap();
    assert!(alive(lead_pid));
    let m = wait_until(T, "eve idle", || {
        let m = team.member("eve");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    let o = lead_cmd(&team, &fake.url(), &["stop"]).output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(team.status("eve"), MemberStatus::Stopped);
    wait_until(T, "processes gone", || {
        (!alive(m.pid.unwrap()) && !alive(lead_pid)).then_some(())
    });
    assert!(team.dir.log(&troupe::AgentName::lead()).exists());
    let o = lead_cmd(&team, &fake.url(), &["stop"]).output().unwrap();
    assert_eq!(o.status.code(), Some(4), "stop without a supervisor");
}

#[test]
fn kill_minus_nine_of_the_lead_takes_workers_down_and_a_new_lead_resumes() {
    let team = Team::new();
    let fake = FakeLlm::start((0..10).map(|i| Reply::ok(anthropic_text(&format!("done {i}")))));
    spawn(&team, &fake.url(), "fox", "p");
    let mut lead = Lead(
        lead_cmd(&team, &fake.url(), &["run"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let m = wait_until(T, "fox idle", || {
        let m = team.member("fox");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    lead.0.kill().unwrap();
    lead.0.wait().unwrap();
    let worker = m.pid.unwrap();
    wait_until(T, "orphan worker gone", || (!alive(worker)).then_some(()));
    let msg = team.send("fox", "sent while the lead was down");
    let _lead2 = Lead(
        lead_cmd(&team, &fake.url(), &["run"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until(T, "fox resumed", || {
        let m = team.member("fox");
        (m.incarnation == 2
            && m.status == MemberStatus::Idle
            && team.consumed_ids("fox").contains(&msg.id))
        .then_some(())
    });
    assert_eq!(
        team.consumed_ids("fox")
            .iter()
            .filter(|i| **i == msg.id)
            .count(),
        1
    );
}

#[test]
fn an_unanswered_shutdown_expires_and_escalates_but_a_stale_one_stops_nobody() {
    let team = Team::new();
    // The model never calls shutdown_response: it only ever answers with text.
    let fake = FakeLlm::start((0..20).map(|i| Reply::ok(anthropic_text(&format!("ignoring {i}")))));
    spawn(&team, &fake.url(), "gil", "p");
    let _lead = Lead(
        lead_cmd(&team, &fake.url(), &["run", "--kill-grace", "1"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_until(T, "gil idle", || {
        (team.status("gil") == MemberStatus::Idle).then_some(())
    });
    let o = lead_cmd(
        &team,
        &fake.url(),
        &["shutdown", "gil", "--timeout", "1", "--json"],
    )
    .output()
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let rid = v["request_id"].as_str().unwrap().to_owned();
    // A stop the lead asked for stays a stop: `shutdown` (with the reason), which `lead run`
    // does not resume, not the `stopped` of a team stop.
    wait_until(T, "gil stopped by escalation", || {
        (team.status("gil") == MemberStatus::Shutdown).then_some(())
    });
    assert!(team.member("gil").reason.unwrap().contains(&rid));
    let store = troupe::requests::RequestStore::new(&team.dir);
    assert_eq!(
        store.get(&rid).unwrap().status,
        troupe::requests::RequestStatus::Expired
    );
    let events = troupe::events::read_all(&team.dir).unwrap();
    assert!(
        events
            .iter()
            .any(|e| e["event"] == "shutdown_escalated" && e["request_id"] == rid)
    );

    // Respawn (incarnation 2); a stale pending request aimed at incarnation 1 expires without
    // touching it.
    let stale = store
        .create(troupe::requests::NewRequest {
            kind: troupe::requests::RequestKind::Shutdown,
            from: "lead".into(),
            to: "gil".into(),
            payload: serde_json::json!({"reason": "old"}),
            target_incarnation: Some(1),
            ttl: Some(Duration::from_secs(1)),
        })
        .unwrap();
    spawn(&team, &fake.url(), "gil", "again");
    let m = wait_until(T, "gil back", || {
        let m = team.member("gil");
        (m.incarnation == 2 && m.status == MemberStatus::Idle).then_some(m)
    });
    wait_until(T, "stale request expired", || {
        (store.get(&stale.request_id).unwrap().status == troupe::requests::RequestStatus::Expired)
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        alive(m.pid.unwrap()),
        "a stale request stopped the respawned teammate"
    );
    assert_eq!(team.status("gil"), MemberStatus::Idle);
}

#[test]
fn a_team_stop_leaves_no_process_a_command_started() {
    let m = support::team::marker();
    let team = Team::new();
    let tool_use = support::fake_llm::anthropic_tool_use_block(
        "tu_1",
        "bash",
        &serde_json::json!({
            "command": format!("setsid sleep 300.{m}1 & sleep 300.{m}2 & sleep 0.2; \
                        echo ready > pids; echo started")
        })
        .to_string(),
    );
    let mut script = vec![Reply::ok(support::fake_llm::anthropic_message(
        &tool_use,
        "tool_use",
        r#"{"input_tokens":1,"output_tokens":1}"#,
    ))];
    script.extend((0..20).map(|i| Reply::ok(anthropic_text(&format!("done {i}")))));
    let fake = FakeLlm::start(script);
    spawn(&team, &fake.url(), "amy", "start the servers");
    let mut lead = Lead(
        lead_cmd(
            &team,
            &fake.url(),
            &["run", "--stop-timeout", "1", "--kill-grace", "1"],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    // Found by marker: the command's own pids are those of its PID namespace.
    let pids: Vec<u64> = wait_until(T, "the command's processes", || {
        team.workdir.join("pids").exists().then_some(())?;
        let pids: Vec<u64> = ["1", "2"]
            .iter()
            .flat_map(|k| support::team::pids_with_arg(&format!("300.{m}{k}")))
            .collect();
        (pids.len() == 2).then_some(pids)
    });
    wait_until(T, "amy idle", || {
        (team.status("amy") == MemberStatus::Idle).then_some(())
    });
    assert!(
        pids.iter().all(|&p| alive_pid(p)),
        "background jobs live while the worker does"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lead.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let st = wait_until(T, "lead exit", || lead.0.try_wait().unwrap());
    assert_eq!(st.code(), Some(0));
    wait_until(
        Duration::from_secs(3),
        "the command's processes gone",
        || pids.iter().all(|&p| !alive_pid(p)).then_some(()),
    );
}

/// A burst of starts (issue 24): hundreds of members made due at once used to exec, set up
/// their sandboxes and write their first records all together, each start costing more the
/// larger the team. At most four workers per CPU are in their start at once; the others start
/// as those report, or once a start's grace (2 s) has run out. Here no worker ever reports (the
/// program `lead run` starts records its name and sleeps), so the starts come at most that
/// many in any 2 s, and still every member gets its worker.
#[test]
fn a_burst_of_starts_is_let_through_a_few_at_a_time() {
    use std::os::unix::fs::PermissionsExt;
    let limit = 4 * std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = limit + 3;
    let team = Team::new();
    let started = team.path().join("started");
    std::fs::create_dir(&started).unwrap();
    let script = team.path().join("silent-worker");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\n\
             if [ \"$1\" = --build-id ]; then exec '{}' --build-id; fi\n\
             while [ $# -gt 0 ]; do [ \"$1\" = --name ] && name=$2; shift; done\n\
             : > '{}'/\"$name\"\n\
             exec sleep 120\n",
            env!("CARGO_BIN_EXE_worker"),
            started.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let url = "http://127.0.0.1:9";
    for i in 0..n {
        spawn(&team, url, &format!("m{i:02}"), "hello");
    }
    let mut cmd = lead_cmd(&team, url, &["run", "--stop-timeout", "1"]);
    cmd.env("TROUPE_WORKER", &script);
    let lead = support::team::Stopping(
        cmd.stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let count = || std::fs::read_dir(&started).unwrap().count();
    let spawns = || -> Vec<f64> {
        troupe::events::read_all(&team.dir)
            .unwrap()
            .iter()
            .filter(|e| e["event"] == "spawn")
            .filter_map(|e| e["ts"].as_f64())
            .collect()
    };
    // A worker can record its name before the supervisor has logged its spawn: wait for both.
    wait_until(T, "every member to get a worker", || {
        (count() == n && spawns().len() >= n).then_some(())
    });
    let mut at = spawns();
    at.sort_by(f64::total_cmp);
    assert_eq!(at.len(), n, "one start per member: {at:?}");
    // Event times are the wall clock, the grace a monotonic one: 1.9 s leaves room for both.
    for (i, t) in at.iter().enumerate() {
        let within = at[i..].iter().take_while(|u| **u - t < 1.9).count();
        assert!(
            within <= limit,
            "{within} starts within 1.9 s of the one at {t} (at most {limit}): {at:?}"
        );
    }
    assert!(
        at[n - 1] - at[0] >= 1.9,
        "the last {} waited for room: {at:?}",
        n - limit
    );
    drop(lead);
}
