//! `lead chat -p` against the fake LLM server: the LLM lead spawns two teammates through its
//! tools, reviews a plan, receives their results through its inbox and shuts them down, with a
//! supervisor that `chat` starts itself. Assertions are on the team dir's files.
//!
//! Each agent has its own model id, so each gets its own script. The server is patient: a
//! request waits for its reply, and the test pushes a reply only once the state it answers
//! exists (a plan request file, the lead's previous call), so every process sees the same inbox
//! contents every run.

mod support;

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block, json_str,
};
use support::team::{Bg, Team, lead_cmd, wait_until};
use troupe::config::{MemberStatus, Roster};
use troupe::fsutil::HeldLock;
use troupe::inbox::Inbox;
use troupe::llm::Block;
use troupe::message::MessageType;
use troupe::requests::{NewRequest, RequestKind, RequestStatus, RequestStore};
use troupe::transcript::{Entry, read_entries};
use troupe::{AgentName, TeamDir};

const T: Duration = Duration::from_secs(30);
const USAGE: &str = r#"{"input_tokens":7,"output_tokens":3}"#;

/// One reply with these tool uses (each `(name, input JSON)`), numbered ids.
fn tools(calls: &[(&str, String)]) -> Reply {
    let blocks: Vec<String> = calls
        .iter()
        .enumerate()
        .map(|(i, (name, input))| anthropic_tool_use_block(&format!("tu_{i}"), name, input))
        .collect();
    Reply::ok(anthropic_message(&blocks.join(","), "tool_use", USAGE))
}

fn tool(name: &str, input: String) -> Reply {
    tools(&[(name, input)])
}

fn text(t: &str) -> Reply {
    Reply::ok(anthropic_text(t))
}

fn requests(team: &TeamDir, kind: RequestKind) -> Vec<troupe::requests::Request> {
    RequestStore::new(team)
        .list(None)
        .unwrap()
        .into_iter()
        .filter(|r| r.kind == kind)
        .collect()
}

/// Waits for the one pending request of `kind` to `to` and returns its id.
fn pending_request(team: &TeamDir, kind: RequestKind, to: &str) -> String {
    wait_until(T, &format!("a pending {kind} request to {to}"), || {
        requests(team, kind)
            .into_iter()
            .find(|r| r.status == RequestStatus::Pending && r.to == to)
            .map(|r| r.request_id)
    })
}

fn wait_calls(fake: &FakeLlm, model: &str, n: usize) {
    wait_until(T, &format!("{n} calls of {model}"), || {
        (fake.requests_for(model) >= n).then_some(())
    });
}

#[test]
fn chat_p_spawns_reviews_collects_results_and_shuts_the_team_down() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    let url = fake.url();
    let spawn = |name: &str, role: &str, model: &str, plan: bool| {
        (
            "spawn_teammate",
            json!({"name": name, "role": role, "prompt": format!("You are {name}; do what the lead asks."),
                   "model": model, "require_plan_approval": plan})
            .to_string(),
        )
    };
    fake.push_for(
        "m-lead",
        tools(&[
            spawn("ann", "coder", "m-ann", true),
            spawn("bob", "analyst", "m-bob", false),
        ]),
    );
    fake.push_for(
        "m-lead",
        text("Spawned ann and bob; waiting for ann's plan."),
    );
    fake.push_for("m-bob", text("bob ready"));
    let mut chat = lead_cmd(
        &team,
        &url,
        &[
            "chat",
            "-p",
            "Get ann.txt written and ask bob for 6*7.",
            "--model",
            "m-lead",
        ],
    );
    let chat = Bg(chat
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap());

    // ann submits a plan once the lead has finished its first turn.
    wait_calls(&fake, "m-lead", 2);
    fake.push_for(
        "m-ann",
        tool("plan_approval", r#"{"plan":"write ann.txt"}"#.into()),
    );
    fake.push_for("m-ann", text("plan submitted"));
    // The plan wakes the lead, which approves it.
    let plan = pending_request(&team.dir, RequestKind::PlanApproval, "lead");
    wait_calls(&fake, "m-lead", 3);
    fake.push_for(
        "m-lead",
        tool(
            "plan_approval",
            format!(r#"{{"request_id":"{plan}","approve":true,"feedback":"go ahead"}}"#),
        ),
    );
    fake.push_for("m-lead", text("Approved ann's plan."));
    // ann works (write_file is open now) and reports to the lead.
    wait_calls(&fake, "m-lead", 4);
    fake.push_for(
        "m-ann",
        tool(
            "write_file",
            r#"{"path":"ann.txt","content":"from ann\n"}"#.into(),
        ),
    );
    fake.push_for(
        "m-ann",
        tool(
            "send_message",
            r#"{"to":"lead","content":"ann: wrote ann.txt"}"#.into(),
        ),
    );
    fake.push_for("m-ann", text("done"));
    // Her report wakes the lead, which asks her to shut down; she approves.
    wait_calls(&fake, "m-lead", 5);
    fake.push_for(
        "m-lead",
        tool("shutdown_request", r#"{"teammate":"ann"}"#.into()),
    );
    fake.push_for("m-lead", text("Asked ann to shut down."));
    let ann_stop = pending_request(&team.dir, RequestKind::Shutdown, "ann");
    fake.push_for(
        "m-ann",
        tool(
            "shutdown_response",
            format!(r#"{{"request_id":"{ann_stop}","approve":true}}"#),
        ),
    );
    // Her answer wakes the lead, which gives bob his task.
    wait_calls(&fake, "m-lead", 7);
    fake.push_for(
        "m-lead",
        tool(
            "send_message",
            r#"{"to":"bob","content":"what is 6*7?"}"#.into(),
        ),
    );
    fake.push_for("m-lead", text("Asked bob."));
    wait_calls(&fake, "m-lead", 8);
    fake.push_for(
        "m-bob",
        tool(
            "send_message",
            r#"{"to":"lead","content":"bob: 42"}"#.into(),
        ),
    );
    fake.push_for("m-bob", text("answered"));
    // bob's result wakes the lead, which shuts him down.
    wait_calls(&fake, "m-lead", 9);
    fake.push_for(
        "m-lead",
        tool("shutdown_request", r#"{"teammate":"bob"}"#.into()),
    );
    fake.push_for("m-lead", text("Asked bob to shut down."));
    let bob_stop = pending_request(&team.dir, RequestKind::Shutdown, "bob");
    fake.push_for(
        "m-bob",
        tool(
            "shutdown_response",
            format!(r#"{{"request_id":"{bob_stop}","approve":true}}"#),
        ),
    );
    wait_calls(&fake, "m-lead", 11);
    fake.push_for(
        "m-lead",
        text("ann wrote ann.txt, bob says 42; both are shut down."),
    );

    let mut chat = chat;
    let out = wait_until(T, "lead chat -p to exit", || chat.0.try_wait().unwrap());
    let stdout = {
        use std::io::Read;
        let mut s = String::new();
        chat.0
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut s)
            .unwrap();
        s
    };
    assert_eq!(out.code(), Some(0), "stdout: {stdout}");
    assert!(stdout.contains("bob says 42"), "{stdout}");
    assert_eq!(
        fake.requests_for("m-lead"),
        11,
        "no lead call beyond the script"
    );

    // config.json: both shut down by the protocol, exit 0, once each.
    let cfg = Roster::new(&team.dir).load().unwrap();
    for (name, model, plan) in [("ann", "m-ann", true), ("bob", "m-bob", false)] {
        let m = cfg.require(name).unwrap();
        assert_eq!(m.status, MemberStatus::Shutdown, "{name}: {m:?}");
        assert_eq!(m.incarnation, 1, "{name}");
        assert_eq!(m.last_exit.as_ref().and_then(|e| e.code), Some(0), "{name}");
        assert_eq!(m.model.as_deref(), Some(model));
        assert_eq!(m.require_plan_approval, plan);
        assert!(m.pid.is_none());
    }
    // requests/: the plan approved with its feedback, both shutdowns approved, nothing pending.
    let plans = requests(&team.dir, RequestKind::PlanApproval);
    assert_eq!(plans.len(), 1);
    assert_eq!(plans[0].status, RequestStatus::Approved);
    assert_eq!(plans[0].response_text(), Some("go ahead"));
    let stops = requests(&team.dir, RequestKind::Shutdown);
    assert_eq!(stops.len(), 2, "{stops:?}");
    assert!(stops.iter().all(|r| r.status == RequestStatus::Approved));
    // Inboxes: everything consumed.
    for name in ["lead", "ann", "bob"] {
        let inbox = Inbox::new(&team.dir, &AgentName::any(name).unwrap());
        assert!(inbox.is_empty(), "{name}'s inbox still holds messages");
    }
    // The lead's transcript: the person's prompt, the plan, both results and both answers, each
    // consumed once; a final answer with no tool call.
    let journal = read_entries(&team.dir.transcript(&AgentName::lead())).unwrap();
    assert!(
        journal
            .iter()
            .any(|e| matches!(e, Entry::User { text, .. } if text.contains("ask bob for 6*7")))
    );
    let consumed: Vec<&troupe::message::Message> = journal
        .iter()
        .filter_map(|e| match e {
            Entry::Inbox { message, .. } => Some(message),
            _ => None,
        })
        .collect();
    let mut ids: Vec<&str> = consumed.iter().map(|m| m.id.as_str()).collect();
    ids.sort();
    let n = ids.len();
    ids.dedup();
    assert_eq!(ids.len(), n, "a message consumed twice");
    let has = |kind: MessageType, from: &str, text: &str| {
        consumed
            .iter()
            .any(|m| m.kind == kind && m.from == from && m.content.contains(text))
    };
    assert!(has(MessageType::PlanApproval, "ann", "write ann.txt"));
    assert!(has(MessageType::Message, "ann", "ann: wrote ann.txt"));
    assert!(has(MessageType::Message, "bob", "bob: 42"));
    assert_eq!(
        consumed
            .iter()
            .filter(|m| m.kind == MessageType::ShutdownResponse && m.approve == Some(true))
            .count(),
        2
    );
    let assistant = journal
        .iter()
        .filter(|e| matches!(e, Entry::Assistant { .. }))
        .count();
    assert_eq!(assistant, 11);
    // The teammates' transcripts: ann saw the approval and the shutdown request; bob the task.
    let ann = read_entries(&team.dir.transcript(&AgentName::teammate("ann").unwrap())).unwrap();
    assert!(ann.iter().any(|e| matches!(e, Entry::Inbox { message, .. }
        if message.kind == MessageType::PlanApprovalResponse && message.approve == Some(true))));
    let bob = read_entries(&team.dir.transcript(&AgentName::teammate("bob").unwrap())).unwrap();
    assert!(
        bob.iter().any(
            |e| matches!(e, Entry::Inbox { message, .. } if message.content == "what is 6*7?")
        )
    );
    // ann's work, in the working directory.
    assert_eq!(
        std::fs::read_to_string(team.workdir.join("ann.txt")).unwrap(),
        "from ann\n"
    );
    // The supervisor chat started is gone.
    assert!(!HeldLock::is_held(&team.dir.lead_lock()).unwrap());
    // The lead offered its tools and got ann's report as an <inbox> user turn.
    let lead_bodies: Vec<Value> = fake
        .requests()
        .iter()
        .filter(|r| r.body["model"] == "m-lead")
        .map(|r| r.body.clone())
        .collect();
    let names: Vec<&str> = lead_bodies[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    for t in [
        "spawn_teammate",
        "list_teammates",
        "send_message",
        "read_inbox",
        "broadcast",
        "shutdown_request",
        "shutdown_response",
        "plan_approval",
        "list_requests",
        "request_status",
        "bash",
        "read_file",
        "write_file",
        "edit_file",
    ] {
        assert!(names.contains(&t), "lead tools lack {t}: {names:?}");
    }
    let last_user = lead_bodies[4]["messages"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .to_string();
    assert!(
        last_user.contains("<inbox>") && last_user.contains("ann: wrote ann.txt"),
        "{last_user}"
    );
}

/// The lead's tools refuse bad input with an error result the model can read, and change
/// nothing.
#[test]
fn lead_tools_refuse_bad_input() {
    let team = Team::new();
    // Pretend a supervisor runs, so chat starts none and no worker starts for ann.
    let _sup = HeldLock::try_acquire(&team.dir.lead_lock())
        .unwrap()
        .unwrap();
    team.add_member("ann", 1, true);
    Roster::new(&team.dir)
        .update_member("ann", |m| m.status = MemberStatus::Working)
        .unwrap();
    let store = RequestStore::new(&team.dir);
    let new = |kind, from: &str, to: &str| NewRequest {
        kind,
        from: from.into(),
        to: to.into(),
        payload: json!({"plan": "p", "reason": "r"}),
        target_incarnation: Some(1),
        ttl: None,
    };
    let shutdown = store
        .create(new(RequestKind::Shutdown, "lead", "ann"))
        .unwrap();
    let decided = store
        .create(new(RequestKind::PlanApproval, "ann", "lead"))
        .unwrap();
    store
        .resolve(&decided.request_id, "lead", true, json!({"feedback": "ok"}))
        .unwrap();
    let pending = store
        .create(new(RequestKind::PlanApproval, "ann", "lead"))
        .unwrap();

    let fake = FakeLlm::start([]);
    let calls: Vec<(&str, String)> = vec![
        (
            "spawn_teammate",
            r#"{"name":"Bad Name","role":"r","prompt":"p"}"#.into(),
        ),
        (
            "spawn_teammate",
            r#"{"name":"../etc","role":"r","prompt":"p"}"#.into(),
        ),
        (
            "spawn_teammate",
            r#"{"name":"lead","role":"r","prompt":"p"}"#.into(),
        ),
        (
            "spawn_teammate",
            r#"{"name":"ann","role":"r","prompt":"again"}"#.into(),
        ),
        (
            "plan_approval",
            format!(
                r#"{{"request_id":"{}","approve":true}}"#,
                shutdown.request_id
            ),
        ),
        (
            "plan_approval",
            format!(
                r#"{{"request_id":"{}","approve":false,"feedback":"late"}}"#,
                decided.request_id
            ),
        ),
        (
            "plan_approval",
            format!(
                r#"{{"request_id":"{}","approve":false}}"#,
                pending.request_id
            ),
        ),
        (
            "plan_approval",
            r#"{"request_id":"../../x","approve":true}"#.into(),
        ),
        (
            "plan_approval",
            r#"{"request_id":"0badc0de","approve":true}"#.into(),
        ),
        ("send_message", r#"{"to":"nobody","content":"hi"}"#.into()),
        ("send_message", r#"{"to":"lead","content":"me"}"#.into()),
        ("shutdown_request", r#"{"teammate":"ann"}"#.into()),
        (
            "shutdown_response",
            format!(r#"{{"request_id":"{}"}}"#, pending.request_id),
        ),
        ("list_requests", r#"{"status":"bogus"}"#.into()),
        ("spawn_teammate", json_str("not an object")),
        ("no_such_tool", "{}".into()),
    ];
    fake.push_for("m-lead", tools(&calls));
    fake.push_for("m-lead", text("All refused."));
    let mut cmd = lead_cmd(
        &team,
        &fake.url(),
        &["chat", "-p", "try things", "--model", "m-lead"],
    );
    let mut chat = Bg(cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_calls(&fake, "m-lead", 2);
    // The tools have run: nothing they were refused may have moved.
    assert_eq!(
        store.get(&pending.request_id).unwrap().status,
        RequestStatus::Pending
    );
    assert_eq!(
        store.get(&shutdown.request_id).unwrap().status,
        RequestStatus::Pending
    );
    // ann "works" and owes a shutdown answer until the test lets her go; then the team is
    // quiet and chat ends.
    store.expire_now(&shutdown.request_id, "test").unwrap();
    Roster::new(&team.dir)
        .update_member("ann", |m| m.status = MemberStatus::Idle)
        .unwrap();
    let status = wait_until(T, "chat to exit", || chat.0.try_wait().unwrap());
    assert_eq!(status.code(), Some(0));

    let body = &fake.requests()[1].body;
    let results: Vec<(String, bool)> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter(|b| b["type"] == "tool_result")
        .map(|b| {
            (
                b["content"]
                    .as_str()
                    .map_or_else(|| b["content"].to_string(), str::to_owned),
                b["is_error"] == true,
            )
        })
        .collect();
    assert_eq!(results.len(), calls.len(), "{results:?}");
    let expect = [
        "invalid",
        "invalid",
        "reserved",
        "ann is working",
        "not a plan",
        "already approved",
        "feedback",
        "8 lower-case hex",
        "0badc0de",
        "nobody",
        "you are the lead",
        "already has a pending shutdown request",
        "not a shutdown",
        "bogus",
        "invalid tool arguments",
        "unknown tool",
    ];
    for (i, ((content, is_error), want)) in results.iter().zip(expect).enumerate() {
        assert!(
            *is_error,
            "call {i} ({}) was not refused: {content}",
            calls[i].0
        );
        assert!(
            content.to_lowercase().contains(&want.to_lowercase()),
            "call {i} ({}): {content:?} does not say {want:?}",
            calls[i].0
        );
    }
    // Nothing changed: the roster (but for the test's own idle flip), the requests, no inbox.
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert_eq!(cfg.members.len(), 1);
    let ann = cfg.require("ann").unwrap();
    assert_eq!(
        (ann.incarnation, ann.prompt.as_deref()),
        (1, Some("Do what the lead asks."))
    );
    assert_eq!(store.list(None).unwrap().len(), 3, "no request was created");
    assert!(Inbox::new(&team.dir, &AgentName::teammate("ann").unwrap()).is_empty());
    // The lead's journal says the same: one user turn, results all errors.
    let journal = read_entries(&team.dir.transcript(&AgentName::lead())).unwrap();
    let errors = journal
        .iter()
        .filter_map(|e| match e {
            Entry::ToolResults { results, .. } => Some(results),
            _ => None,
        })
        .flatten()
        .filter(|b| matches!(b, Block::ToolResult { is_error: true, .. }))
        .count();
    assert_eq!(errors, calls.len());
}
