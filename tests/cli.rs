//! The scripting CLI, driven as a shell script would: exit codes, stdout, one line on stderr.

mod support;

use std::process::Command;
use std::time::Duration;

use support::cli::{code, lead, stderr, stdout};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Team, wait_until};
use troupe::config::MemberStatus;

#[test]
fn bad_input_exit_codes_and_one_line_errors() {
    let team = Team::new();
    let cases: &[(&[&str], i32, &str)] = &[
        (
            &["spawn", "Bad", "--role", "x", "--prompt", "y"],
            2,
            "invalid name \"Bad\"",
        ),
        (
            &["spawn", "lead", "--role", "x", "--prompt", "y"],
            2,
            "reserved",
        ),
        (&["send", "nobody", "hi"], 3, "no such teammate: nobody"),
        (&["approve", "deadbeef"], 3, "no such request: deadbeef"),
        (&["shutdown", "nobody"], 3, "no such teammate: nobody"),
    ];
    for (args, want, text) in cases {
        let o = lead(&team, args);
        assert_eq!(code(&o), *want, "{args:?}: {}", stderr(&o));
        let err = stderr(&o);
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(text), "{args:?}: {err}");
    }
    assert!(
        !team.dir.config().exists(),
        "a refused command created nothing"
    );
    assert_eq!(
        code(&lead(
            &team,
            &["spawn", "alice", "--role", "coder", "--prompt", "t"]
        )),
        0
    );
    let o = lead(
        &team,
        &["spawn", "alice", "--role", "coder", "--prompt", "t"],
    );
    assert_eq!(code(&o), 4, "{}", stderr(&o));
    let file = team.path().join("afile");
    std::fs::write(&file, "x").unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_lead"))
        .args(["--team-dir", file.to_str().unwrap(), "status"])
        .output()
        .unwrap();
    assert_eq!(code(&o), 1);
    assert!(stderr(&o).ends_with("is not a directory"), "{}", stderr(&o));
}

#[test]
fn spawn_send_plan_review_and_shutdown_wait_through_the_cli() {
    let team = Team::new();
    let fake = FakeLlm::start([
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block("tu_1", "plan_approval", r#"{"plan":"write x.txt"}"#),
            "tool_use",
            r#"{"input_tokens":5,"output_tokens":5}"#,
        )),
        Reply::ok(anthropic_text("waiting for review")),
    ])
    .patient(Duration::from_secs(10));
    let o = lead(
        &team,
        &[
            "spawn",
            "ann",
            "--role",
            "coder",
            "--prompt",
            "write x.txt",
            "--require-plan-approval",
        ],
    );
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    // No supervisor yet: start the worker by hand, as `lead run` will.
    let mut w = team.worker("ann", &fake.url(), &[]);
    let o = wait_until(Duration::from_secs(20), "a pending plan", || {
        let o = lead(&team, &["requests", "--status", "pending", "--json"]);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v.as_array().unwrap().first().cloned()
    });
    let rid = o["request_id"].as_str().unwrap().to_owned();
    // One message at a time, each answered by one scripted turn, so the script stays in step.
    let settled = |consumed: usize| {
        wait_until(Duration::from_secs(20), "ann idle", || {
            let done = team.consumed_ids("ann").len() == consumed && fake.remaining() == 0;
            (done && team.status("ann") == MemberStatus::Idle).then_some(())
        })
    };
    settled(1);
    assert_eq!(
        code(&lead(&team, &["reject", &rid])),
        1,
        "reject needs feedback"
    );
    fake.push(Reply::ok(anthropic_text("will revise")));
    assert_eq!(
        code(&lead(&team, &["reject", &rid, "--feedback", "add a test"])),
        0
    );
    assert_eq!(code(&lead(&team, &["approve", &rid])), 4, "approving twice");
    settled(2);
    fake.push(Reply::ok(anthropic_text("still revising")));
    let o = lead(&team, &["send", "ann", "status?", "--json"]);
    let id: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(id["id"].as_str().is_some());
    settled(3);
    let o = lead(&team, &["status", "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["members"][0]["status"], "idle");
    assert!(v["members"][0]["usage"]["input_tokens"].as_u64().unwrap() > 0);
    let o = lead(&team, &["inbox", "--json"]);
    let msgs: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        msgs.as_array()
            .unwrap()
            .iter()
            .any(|m| m["type"] == "plan_approval")
    );
    assert_eq!(
        stdout(&lead(&team, &["inbox", "--json"])),
        "[]",
        "drained once"
    );

    // Shutdown with --wait: the model rejects once (exit 5), then approves (exit 0).
    let reject = |rid: &str| {
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block(
                "tu_r",
                "shutdown_response",
                &format!(r#"{{"request_id":"{rid}","approve":false,"reason":"busy"}}"#),
            ),
            "tool_use",
            r#"{"input_tokens":1,"output_tokens":1}"#,
        ))
    };
    // The request id is only known once created: answer from a thread that watches requests.
    let t = std::thread::scope(|s| {
        let h = s.spawn(|| lead(&team, &["shutdown", "ann", "--wait", "--timeout", "20"]));
        let rid = wait_until(Duration::from_secs(20), "shutdown request", || {
            troupe::requests::RequestStore::new(&team.dir)
                .list(Some(troupe::requests::RequestStatus::Pending))
                .unwrap()
                .into_iter()
                .find(|r| r.kind == troupe::requests::RequestKind::Shutdown)
        });
        fake.push(reject(&rid.request_id));
        fake.push(Reply::ok(anthropic_text("staying")));
        h.join().unwrap()
    });
    assert_eq!(code(&t), 5, "{}", stderr(&t));
    settled(4);
    let t = std::thread::scope(|s| {
        let h = s.spawn(|| lead(&team, &["shutdown", "ann", "--wait", "--timeout", "20"]));
        let rid = wait_until(Duration::from_secs(20), "second shutdown request", || {
            troupe::requests::RequestStore::new(&team.dir)
                .list(Some(troupe::requests::RequestStatus::Pending))
                .unwrap()
                .into_iter()
                .find(|r| r.kind == troupe::requests::RequestKind::Shutdown)
        });
        fake.push(Reply::ok(anthropic_message(
            &anthropic_tool_use_block(
                "tu_a",
                "shutdown_response",
                &format!(r#"{{"request_id":"{}","approve":true}}"#, rid.request_id),
            ),
            "tool_use",
            r#"{"input_tokens":1,"output_tokens":1}"#,
        )));
        h.join().unwrap()
    });
    assert_eq!(
        code(&t),
        0,
        "{} / worker: {} / status {:?} / remaining {}",
        stderr(&t),
        team.stderr("ann"),
        team.status("ann"),
        fake.remaining()
    );
    assert_eq!(w.wait(Duration::from_secs(10)).code(), Some(0));
    assert_eq!(team.status("ann"), MemberStatus::Shutdown);
}

#[test]
fn broadcast_peek_and_logs() {
    let team = Team::new();
    for n in ["ann", "ben"] {
        assert_eq!(
            code(&lead(&team, &["spawn", n, "--role", "r", "--prompt", "p"])),
            0
        );
    }
    let o = lead(&team, &["broadcast", "all hands", "--json"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let sent: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(sent.as_array().unwrap().len(), 2);
    for n in ["ann", "ben"] {
        let inbox = troupe::inbox::Inbox::new(&team.dir, &troupe::AgentName::teammate(n).unwrap());
        let msgs = inbox.peek().unwrap();
        assert!(
            msgs.iter()
                .any(|m| m.kind == troupe::message::MessageType::Broadcast
                    && m.content == "all hands")
        );
    }
    assert_eq!(stdout(&lead(&team, &["inbox", "--peek", "--json"])), "[]");
    std::fs::write(
        team.dir.log(&troupe::AgentName::teammate("ann").unwrap()),
        "line one\n",
    )
    .unwrap();
    assert_eq!(stdout(&lead(&team, &["logs", "ann"])), "line one");
    assert_eq!(code(&lead(&team, &["logs", "zed"])), 3);
    let mut follow = Command::new(env!("CARGO_BIN_EXE_lead"))
        .arg("--team-dir")
        .arg(team.dir.root())
        .args(["logs", "ann", "--follow"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::fs::OpenOptions::new()
        .append(true)
        .open(team.dir.log(&troupe::AgentName::teammate("ann").unwrap()))
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"line two\n"))
        .unwrap();
    let mut out = follow.stdout.take().unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while !String::from_utf8_lossy(&got).contains("line two") {
        let n = std::io::Read::read(&mut out, &mut buf).unwrap();
        assert!(n > 0, "logs --follow ended early");
        got.extend_from_slice(&buf[..n]);
    }
    follow.kill().unwrap();
    follow.wait().unwrap();
}
