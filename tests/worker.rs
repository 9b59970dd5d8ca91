//! The real `worker` binary against a fake Anthropic server: the agent loop, the protocols
//! through files, and resume after kill -9.

mod support;

use std::time::Duration;

use serde_json::json;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Team, bodies, wait_until};
use troupe::config::MemberStatus;
use troupe::message::{Message, MessageType};
use troupe::requests::{NewRequest, RequestKind, RequestStatus, RequestStore};

const T: Duration = Duration::from_secs(20);
const USAGE: &str = r#"{"input_tokens":100,"output_tokens":20,"cache_creation_input_tokens":50,"cache_read_input_tokens":7}"#;

fn tool_turn(blocks: &[String]) -> Reply {
    Reply::ok(anthropic_message(&blocks.join(","), "tool_use", USAGE))
}

fn shutdown_request(team: &Team, to: &str, incarnation: u64) -> String {
    let req = RequestStore::new(&team.dir)
        .create(NewRequest {
            kind: RequestKind::Shutdown,
            from: "lead".into(),
            to: to.into(),
            payload: json!({"reason": "work is done"}),
            target_incarnation: Some(incarnation),
            ttl: Some(Duration::from_secs(60)),
        })
        .unwrap();
    let mut m = Message::new(MessageType::ShutdownRequest, "lead", to, "work is done")
        .with_request(&req.request_id);
    m.reason = Some("work is done".into());
    team.deliver(&m);
    req.request_id
}

#[test]
fn tool_turn_then_idle_then_approved_shutdown() {
    let team = Team::new();
    team.add_member("alice", 1, false);
    let fake = FakeLlm::start([
        tool_turn(&[anthropic_tool_use_block(
            "tu_1",
            "write_file",
            r#"{"path":"hello.txt","content":"hi there"}"#,
        )]),
        Reply::ok(anthropic_text("wrote hello.txt")),
    ]);
    let first = team.send("alice", "write hello.txt");
    let mut w = team.worker("alice", &fake.url(), &[]);
    wait_until(T, "alice idle", || {
        (team.status("alice") == MemberStatus::Idle).then_some(())
    });
    assert_eq!(
        std::fs::read_to_string(team.workdir.join("hello.txt")).unwrap(),
        "hi there"
    );
    let reqs = bodies(&fake.requests());
    assert_eq!(reqs.len(), 2);
    let user0 = reqs[0]["messages"][0]["content"].to_string();
    assert!(
        user0.contains("<inbox>") && user0.contains("write hello.txt"),
        "{user0}"
    );
    // The second request carries the tool result right after its tool_use.
    assert_eq!(reqs[1]["messages"][2]["content"][0]["type"], "tool_result");
    assert_eq!(reqs[1]["messages"][2]["content"][0]["tool_use_id"], "tu_1");
    let idle = team.lead_inbox();
    assert_eq!(idle.len(), 1);
    assert_eq!(idle[0].kind, MessageType::IdleNotification);
    assert_eq!(idle[0].content, "wrote hello.txt");
    let m = team.member("alice");
    assert_eq!(m.usage.input_tokens, 110);
    assert_eq!(m.usage.cache_creation_input_tokens, 50);
    assert_eq!(m.usage.cache_read_input_tokens, 7);

    // Shutdown: the model approves.
    let rid = shutdown_request(&team, "alice", 1);
    fake.push(tool_turn(&[anthropic_tool_use_block(
        "tu_2",
        "shutdown_response",
        &format!(r#"{{"request_id":"{rid}","approve":true,"reason":"all done"}}"#),
    )]));
    let status = w.wait(T);
    assert_eq!(status.code(), Some(0), "{}", team.stderr("alice"));
    assert_eq!(
        RequestStore::new(&team.dir).get(&rid).unwrap().status,
        RequestStatus::Approved
    );
    assert_eq!(team.status("alice"), MemberStatus::Shutdown);
    let lead = team.lead_inbox();
    let resp = lead
        .iter()
        .find(|m| m.kind == MessageType::ShutdownResponse)
        .unwrap();
    assert_eq!(resp.request_id.as_deref(), Some(rid.as_str()));
    assert_eq!(resp.approve, Some(true));
    let ids = team.consumed_ids("alice");
    assert_eq!(ids.len(), 2);
    assert_eq!(ids[0], first.id);
    assert!(
        !std::fs::read_to_string(
            team.dir
                .transcript(&troupe::AgentName::any("alice").unwrap())
        )
        .unwrap()
        .contains("sk-test-key")
    );
}

#[test]
fn rejected_and_stale_shutdowns_keep_it_running() {
    let team = Team::new();
    team.add_member("bob", 2, false);
    let stale = shutdown_request(&team, "bob", 1);
    let fake = FakeLlm::start([]);
    let mut w = team.worker("bob", &fake.url(), &[]);
    wait_until(T, "stale request rejected", || {
        let r = RequestStore::new(&team.dir).get(&stale).unwrap();
        (r.status == RequestStatus::Rejected).then_some(r)
    });
    let live = shutdown_request(&team, "bob", 2);
    fake.push(tool_turn(&[anthropic_tool_use_block(
        "tu_1",
        "shutdown_response",
        &format!(r#"{{"request_id":"{live}","approve":false,"reason":"still testing"}}"#),
    )]));
    fake.push(Reply::ok(anthropic_text("kept working")));
    wait_until(T, "live request rejected", || {
        let r = RequestStore::new(&team.dir).get(&live).unwrap();
        (r.status == RequestStatus::Rejected).then_some(())
    });
    wait_until(T, "bob idle", || {
        (team.status("bob") == MemberStatus::Idle).then_some(())
    });
    assert!(w.try_status().is_none(), "bob must keep running");
    // The stale request never reached the model.
    assert_eq!(fake.request_count(), 2);
    let stale_req = RequestStore::new(&team.dir).get(&stale).unwrap();
    assert!(stale_req.response_text().unwrap().contains("stale request"));
    // SIGTERM: exits 143.
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait(T).code(), Some(143));
}

#[test]
fn plan_gate_hides_mutating_tools_until_approved() {
    let team = Team::new();
    team.add_member("carol", 1, true);
    let fake = FakeLlm::start([
        tool_turn(&[anthropic_tool_use_block(
            "tu_1",
            "plan_approval",
            r#"{"plan":"v1"}"#,
        )]),
        Reply::ok(anthropic_text("waiting for approval")),
    ]);
    team.send("carol", "plan then build");
    let _w = team.worker("carol", &fake.url(), &[]);
    let store = RequestStore::new(&team.dir);
    let first = wait_until(T, "plan submitted", || {
        store
            .list(Some(RequestStatus::Pending))
            .unwrap()
            .into_iter()
            .next()
    });
    wait_until(T, "carol idle", || {
        (team.status("carol") == MemberStatus::Idle).then_some(())
    });
    // Reject with feedback; the model resubmits.
    store
        .resolve(
            &first.request_id,
            "lead",
            false,
            json!({"feedback": "add tests"}),
        )
        .unwrap();
    let mut resp = Message::new(
        MessageType::PlanApprovalResponse,
        "lead",
        "carol",
        "add tests",
    )
    .with_request(&first.request_id);
    resp.approve = Some(false);
    resp.feedback = Some("add tests".into());
    fake.push(tool_turn(&[anthropic_tool_use_block(
        "tu_2",
        "plan_approval",
        r#"{"plan":"v2 with tests"}"#,
    )]));
    fake.push(Reply::ok(anthropic_text("resubmitted")));
    team.deliver(&resp);
    let second = wait_until(T, "second plan", || {
        store
            .list(Some(RequestStatus::Pending))
            .unwrap()
            .into_iter()
            .next()
    });
    assert_eq!(second.payload["plan"], "v2 with tests");
    wait_until(T, "carol idle again", || {
        (team.status("carol") == MemberStatus::Idle && fake.remaining() == 0).then_some(())
    });
    store
        .resolve(&second.request_id, "lead", true, json!({}))
        .unwrap();
    let mut ok = Message::new(MessageType::PlanApprovalResponse, "lead", "carol", "")
        .with_request(&second.request_id);
    ok.approve = Some(true);
    fake.push(tool_turn(&[anthropic_tool_use_block(
        "tu_3",
        "bash",
        r#"{"command":"echo built > out.txt"}"#,
    )]));
    fake.push(Reply::ok(anthropic_text("built")));
    team.deliver(&ok);
    wait_until(T, "out.txt", || {
        team.workdir.join("out.txt").exists().then_some(())
    });
    let reqs = bodies(&fake.requests());
    let names = |b: &serde_json::Value| -> Vec<String> {
        b["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let approved_at = reqs
        .iter()
        .position(|b| b["messages"].to_string().contains("APPROVED"))
        .unwrap();
    for b in &reqs[..approved_at] {
        for t in ["bash", "write_file", "edit_file"] {
            assert!(
                !names(b).contains(&t.to_owned()),
                "{t} offered before approval"
            );
        }
    }
    assert!(names(&reqs[approved_at]).contains(&"bash".to_owned()));
    let feedback_seen = reqs
        .iter()
        .any(|b| b["messages"].to_string().contains("add tests"));
    assert!(feedback_seen);
}
