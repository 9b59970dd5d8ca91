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

/// Every assistant tool_use in a request body must be answered by a tool_result in the next
/// (user) message.
fn assert_tool_pairs(body: &serde_json::Value) {
    let msgs = body["messages"].as_array().unwrap();
    for (i, m) in msgs.iter().enumerate() {
        if m["role"] != "assistant" {
            continue;
        }
        let Some(blocks) = m["content"].as_array() else {
            continue;
        };
        for b in blocks.iter().filter(|b| b["type"] == "tool_use") {
            let next = msgs
                .get(i + 1)
                .unwrap_or_else(|| panic!("tool_use {} without a following message", b["id"]));
            let answered = next["content"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|r| r["type"] == "tool_result" && r["tool_use_id"] == b["id"])
            });
            assert!(answered, "tool_use {} without its tool_result", b["id"]);
        }
    }
}

#[test]
fn kill_minus_nine_at_random_points_resumes_exactly_once() {
    let team = Team::new();
    team.add_member("dave", 1, false);
    let mut script = Vec::new();
    for i in 0..30 {
        script.push(tool_turn(&[
            anthropic_tool_use_block(
                &format!("tu_{i}_a"),
                "bash",
                &format!(r#"{{"command":"echo step {i} >> log.txt"}}"#),
            ),
            anthropic_tool_use_block(&format!("tu_{i}_b"), "read_file", r#"{"path":"log.txt"}"#),
        ]));
    }
    for _ in 0..40 {
        script.push(Reply::ok(anthropic_text("all steps done")));
    }
    let fake = FakeLlm::start(script);
    let mut sent = vec![team.send("dave", "run the steps").id];
    let mut rng = support::child::Rng::seeded();
    for k in 0..20 {
        let w = team.worker("dave", &fake.url(), &[]);
        std::thread::sleep(Duration::from_millis(rng.range(5, 60)));
        if k % 4 == 0 {
            sent.push(team.send("dave", &format!("extra message {k}")).id);
        }
        w.signal(nix::sys::signal::Signal::SIGKILL);
        drop(w);
    }
    let mut last = team.worker("dave", &fake.url(), &[]);
    wait_until(
        Duration::from_secs(60),
        "dave idle after the last restart",
        || {
            if let Some(st) = last.try_status() {
                panic!("worker exited {st}: {}", team.stderr("dave"));
            }
            let idle = team.status("dave") == MemberStatus::Idle;
            let text_done = team.transcript("dave").iter().any(|e| match e {
                troupe::transcript::Entry::Assistant { response, .. } => {
                    response.stop_reason == troupe::llm::StopReason::EndTurn
                }
                _ => false,
            });
            (idle && text_done && team.consumed_ids("dave").len() == sent.len()).then_some(())
        },
    );
    let consumed = team.consumed_ids("dave");
    let mut sorted = consumed.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), consumed.len(), "a message was consumed twice");
    for id in &sent {
        assert!(consumed.contains(id), "message {id} lost");
    }
    let reqs = bodies(&fake.requests());
    assert!(
        reqs.len() > 20,
        "the conversation should span many turns, got {}",
        reqs.len()
    );
    for b in &reqs {
        assert_tool_pairs(b);
    }
    let sessions = team
        .transcript("dave")
        .iter()
        .filter(|e| matches!(e, troupe::transcript::Entry::Session { .. }))
        .count();
    assert!((2..=21).contains(&sessions), "{sessions} sessions");
}

#[test]
fn provider_failures_map_to_exit_codes() {
    use support::fake_llm::anthropic_error;
    // 401: exit 78, asked once.
    let team = Team::new();
    team.add_member("erin", 1, false);
    team.send("erin", "hello");
    let fake = FakeLlm::start([Reply::json(
        401,
        anthropic_error("authentication_error", "invalid x-api-key"),
    )]);
    let mut w = team.worker("erin", &fake.url(), &[]);
    assert_eq!(w.wait(T).code(), Some(78), "{}", team.stderr("erin"));
    assert_eq!(fake.request_count(), 1);
    assert!(
        !team.stderr("erin").contains("sk-test-key"),
        "the key leaked to stderr"
    );

    // 529 three times: after its 3 attempts the worker does not exit (that would count toward
    // the restart limit) but waits and tries again, saying so in its record; the API comes
    // back and the same process answers the message once.
    let overloaded = || {
        Reply::json(529, anthropic_error("overloaded_error", "Overloaded"))
            .header("retry-after-ms", "10")
    };
    let fake = FakeLlm::start([overloaded(), overloaded(), overloaded()]);
    let team = Team::new();
    team.add_member("fay", 1, false);
    let m = team.send("fay", "hello");
    let mut w = team.worker("fay", &fake.url(), &[("TROUPE_API_WAIT_MAX_SECS", "0.3")]);
    let act = wait_until(T, "fay waiting for the API", || {
        team.member("fay")
            .activity
            .filter(|a| a.state == troupe::config::ActivityState::WaitingApi)
    });
    assert!(act.error.unwrap().contains("529"));
    assert!(w.try_status().is_none(), "{}", team.stderr("fay"));
    fake.push(Reply::ok(anthropic_text("hi")));
    wait_until(T, "fay idle", || {
        (team.status("fay") == MemberStatus::Idle).then_some(())
    });
    assert!(w.try_status().is_none());
    assert_eq!(team.consumed_ids("fay"), vec![m.id]);
    // SIGTERM ends a wait for the API at once.
    fake.outage(Some(overloaded()));
    team.send("fay", "again");
    wait_until(T, "fay waiting again", || {
        team.member("fay")
            .activity
            .filter(|a| a.state == troupe::config::ActivityState::WaitingApi)
    });
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(5)).code(), Some(143));

    // No key at all: exit 78 with a message naming the variables.
    let team = Team::new();
    team.add_member("gus", 1, false);
    let mut w = team.worker(
        "gus",
        "http://127.0.0.1:9",
        &[("TROUPE_PROVIDER", ""), ("ANTHROPIC_API_KEY", "")],
    );
    assert_eq!(w.wait(T).code(), Some(78));
    let err = team.stderr("gus");
    assert!(
        err.contains("ANTHROPIC_API_KEY") && err.contains("OPENAI_API_KEY"),
        "{err}"
    );
}

#[test]
fn bad_tool_input_gives_the_model_an_error_and_it_keeps_going() {
    let team = Team::new();
    team.add_member("hal", 1, false);
    let fake = FakeLlm::start([
        tool_turn(&[
            anthropic_tool_use_block("tu_1", "read_file", r#"{"path":"../../etc/passwd"}"#),
            anthropic_tool_use_block("tu_2", "launch_rockets", r#"{}"#),
            anthropic_tool_use_block("tu_3", "send_message", r#"{"to":"nobody","content":"hi"}"#),
            anthropic_tool_use_block("tu_4", "write_file", r#"{"path":"x"}"#),
            anthropic_tool_use_block("tu_5", "bash", r#"{"command":"sleep 5"}"#),
        ]),
        Reply::ok(anthropic_text("recovered")),
    ]);
    team.send("hal", "try things");
    let _w = team.worker("hal", &fake.url(), &[("TROUPE_BASH_TIMEOUT_SECS", "1")]);
    wait_until(T, "hal idle", || {
        (team.status("hal") == MemberStatus::Idle).then_some(())
    });
    let reqs = bodies(&fake.requests());
    let results = reqs[1]["messages"][2]["content"]
        .as_array()
        .unwrap()
        .clone();
    let text = |i: usize| results[i]["content"].as_str().unwrap().to_owned();
    assert!(results.iter().all(|r| r["is_error"] == true), "{results:?}");
    assert_eq!(
        text(0),
        "path escapes the working directory: ../../etc/passwd"
    );
    assert!(
        text(1).starts_with("unknown tool \"launch_rockets\""),
        "{}",
        text(1)
    );
    assert_eq!(text(2), "not sent: no such teammate: nobody");
    assert_eq!(text(3), "missing required field \"content\" (string)");
    assert!(
        text(4).starts_with("command timed out after 1 s"),
        "{}",
        text(4)
    );
}

#[test]
fn a_recorded_cassette_replays_the_same_transcript_without_a_server() {
    use troupe::transcript::Entry;
    let run = |team: &Team, env: &[(&str, &str)], url: &str| {
        team.add_member("ivy", 1, false);
        team.send("ivy", "write notes");
        let _w = team.worker("ivy", url, env);
        wait_until(T, "ivy idle", || {
            (team.status("ivy") == MemberStatus::Idle).then_some(())
        });
        team.transcript("ivy")
            .into_iter()
            .filter_map(|e| match e {
                Entry::Assistant { seq, response, .. } => Some(format!("A{seq} {:?}", response)),
                Entry::ToolResults { results, .. } => Some(format!("R {results:?}")),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    let live = Team::new();
    let cassette = live.path().join("cassette.jsonl");
    let fake = FakeLlm::start([
        tool_turn(&[anthropic_tool_use_block(
            "tu_1",
            "write_file",
            r#"{"path":"notes.md","content":"- a"}"#,
        )]),
        tool_turn(&[anthropic_tool_use_block(
            "tu_2",
            "read_file",
            r#"{"path":"notes.md"}"#,
        )]),
        Reply::ok(anthropic_text("notes written")),
    ]);
    let recorded = run(
        &live,
        &[("TROUPE_RECORD", cassette.to_str().unwrap())],
        &fake.url(),
    );
    assert_eq!(recorded.len(), 5);
    drop(fake);

    let replay = Team::new();
    let replayed = run(
        &replay,
        &[
            ("TROUPE_PROVIDER", "replay"),
            ("TROUPE_CASSETTE", cassette.to_str().unwrap()),
            ("ANTHROPIC_API_KEY", ""),
        ],
        "http://127.0.0.1:9",
    );
    assert_eq!(replayed, recorded);
    assert_eq!(
        std::fs::read_to_string(replay.workdir.join("notes.md")).unwrap(),
        "- a"
    );
}

/// Runs one activation of a fresh teammate against `fake` and returns the request bodies once
/// it is idle.
fn one_activation(
    fake: &FakeLlm,
    env: &[(&str, &str)],
) -> (Team, Vec<serde_json::Value>, support::team::Worker) {
    let team = Team::new();
    team.add_member("kim", 1, false);
    team.send("kim", "go");
    let mut w = team.worker("kim", &fake.url(), env);
    wait_until(T, "kim idle", || {
        if let Some(st) = w.try_status() {
            panic!("worker exited {st}: {}", team.stderr("kim"));
        }
        (team.status("kim") == MemberStatus::Idle).then_some(())
    });
    let reqs = bodies(&fake.requests());
    (team, reqs, w)
}

#[test]
fn anthropic_scenarios_through_the_worker() {
    use support::fake_llm::anthropic_error;
    // max_tokens cut inside a tool call: the call is not run, the model is told why.
    let fake = FakeLlm::start([
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block("tu_1", "write_file", r#"{"path":"half.txt"}"#),
            "max_tokens",
            USAGE,
        )),
        Reply::ok(anthropic_text("ok, shorter")),
    ]);
    let (team, reqs, _w) = one_activation(&fake, &[]);
    assert!(!team.workdir.join("half.txt").exists());
    let r = &reqs[1]["messages"][2]["content"][0];
    assert_eq!(r["is_error"], true);
    assert!(r["content"].as_str().unwrap().contains("max_tokens"));

    // Refusal with empty content: idle, and the next request has a non-empty assistant turn.
    let fake = FakeLlm::start([Reply::ok(anthropic_message("", "refusal", USAGE))]);
    let (team, _, _w) = one_activation(&fake, &[]);
    fake.push(Reply::ok(anthropic_text("fine")));
    team.send("kim", "again");
    wait_until(T, "second call", || {
        (fake.request_count() == 2).then_some(())
    });
    let second = &bodies(&fake.requests())[1];
    assert!(
        second["messages"][1]["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("declined")
    );

    // 429 with retry-after, then success; 529 twice, then success.
    let fake = FakeLlm::start([
        Reply::json(429, anthropic_error("rate_limit_error", "slow down"))
            .header("retry-after", "1"),
        Reply::json(529, anthropic_error("overloaded_error", "Overloaded"))
            .header("retry-after-ms", "10"),
        Reply::json(529, anthropic_error("overloaded_error", "Overloaded"))
            .header("retry-after-ms", "10"),
        Reply::ok(anthropic_text("hi")),
    ]);
    let (_team, reqs, _w) = one_activation(&fake, &[("TROUPE_LLM_MAX_ATTEMPTS", "4")]);
    assert_eq!(reqs.len(), 4);

    // A slow response past the timeout, then a truncated body, then success.
    let fake = FakeLlm::start([
        Reply::ok(anthropic_text("too late")).delay(Duration::from_secs(3)),
        Reply::ok(anthropic_text("cut")).truncate_after(20),
        Reply::ok(anthropic_text("whole")),
    ]);
    let (team, reqs, _w) = one_activation(&fake, &[("TROUPE_LLM_TIMEOUT_SECS", "1")]);
    assert_eq!(reqs.len(), 3);
    assert_eq!(team.lead_inbox()[0].content, "whole");

    // Spend cap: one request, not retried; the worker pauses (it does not exit) until a new
    // message arrives.
    let fake = FakeLlm::start([Reply::json(
        429,
        r#"{"type":"error","error":{"type":"rate_limit_error","message":"spend limit","details":{"error_code":"enforced_spend_limit_reached"}}}"#,
    )]);
    let team = Team::new();
    team.add_member("kim", 1, false);
    team.send("kim", "go");
    let mut w = team.worker("kim", &fake.url(), &[]);
    wait_until(T, "kim paused", || {
        team.member("kim")
            .activity
            .filter(|a| a.state == troupe::config::ActivityState::Paused)
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(w.try_status().is_none());
    assert_eq!(fake.request_count(), 1);
}

#[test]
fn openai_wire_format_with_quirks() {
    let fake = FakeLlm::start([
        // Invalid arguments JSON, arguments as an object, a missing id.
        Reply::ok(support::fake_llm::openai_completion(
            r#"{"role":"assistant","content":null,"tool_calls":[
                {"id":"call_1","type":"function","function":{"name":"write_file","arguments":"{\"path\": \"a.txt\", \"content\": "}},
                {"id":"call_2","type":"function","function":{"name":"write_file","arguments":{"path":"b.txt","content":"bee"}}},
                {"type":"function","function":{"name":"read_file","arguments":"{\"path\":\"b.txt\"}"}}]}"#,
            "tool_calls",
            r#"{"prompt_tokens":30,"completion_tokens":9,"prompt_tokens_details":{"cached_tokens":12}}"#,
        )),
        Reply::json(
            503,
            r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
        ),
        Reply::ok(support::fake_llm::openai_text("done")),
    ]);
    let team = Team::new();
    team.add_member("lou", 1, false);
    team.send("lou", "go");
    let env = [
        ("TROUPE_PROVIDER", "openai"),
        ("OPENAI_BASE_URL", &*format!("{}/v1", fake.url())),
        ("OPENAI_API_KEY", ""),
        ("ANTHROPIC_API_KEY", ""),
    ];
    let _w = team.worker("lou", &fake.url(), &env);
    wait_until(T, "lou idle", || {
        (team.status("lou") == MemberStatus::Idle).then_some(())
    });
    assert_eq!(
        std::fs::read_to_string(team.workdir.join("b.txt")).unwrap(),
        "bee"
    );
    assert!(!team.workdir.join("a.txt").exists());
    let reqs = fake.requests();
    assert_eq!(reqs[0].path, "/v1/chat/completions");
    let last = &reqs.last().unwrap().body["messages"];
    let tool_msgs: Vec<_> = last
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_msgs.len(), 3, "one tool message per call: {last}");
    assert!(
        tool_msgs[0]["content"]
            .as_str()
            .unwrap()
            .starts_with("invalid tool arguments")
    );
    assert_eq!(tool_msgs[2]["content"], "bee");
    let m = team.member("lou");
    assert_eq!(m.usage.cache_read_input_tokens, 12);
    assert_eq!(m.usage.output_tokens, 9 + 5);
}

/// The pids a bash command wrote to `pids` in the working dir, once it has written `n`.
/// The machine's pids of the processes `daemon_command(m, _)` started: the daemon, the
/// background job and bash, once the command says they run.
fn recorded_pids(team: &Team, m: &str) -> Vec<u64> {
    wait_until(T, "the command's processes", || {
        team.workdir.join("pids").exists().then_some(())?;
        let daemon = support::team::pids_with_arg(&format!("300.{m}1"));
        let job = support::team::pids_with_arg(&format!("300.{m}2"));
        let bash = support::team::bash_pids_running(&format!("300.{m}2"));
        (daemon.len() == 1 && job.len() == 1 && bash.len() <= 1).then(|| {
            let mut pids = vec![daemon[0], job[0]];
            pids.extend(bash);
            pids
        })
    })
}

fn wait_all_gone(pids: &[u64]) {
    wait_until(
        Duration::from_secs(3),
        "the command's processes gone",
        || pids.iter().all(|&p| !support::team::alive(p)).then_some(()),
    );
}

/// A command that starts a daemon in its own session and a plain background job, records
/// that they run, then runs `tail`. Their sleeps carry the marker `m` (see
/// [`recorded_pids`]).
fn daemon_command(m: &str, tail: &str) -> String {
    let cmd =
        format!("setsid sleep 300.{m}1 & sleep 300.{m}2 & sleep 0.2; echo ready > pids; {tail}");
    json!({ "command": cmd }).to_string()
}

#[test]
fn a_killed_worker_takes_a_running_commands_processes_with_it() {
    let m = support::team::marker();
    let team = Team::new();
    team.add_member("erin", 1, false);
    let fake = FakeLlm::start([tool_turn(&[anthropic_tool_use_block(
        "tu_1",
        "bash",
        &daemon_command(&m, "wait"),
    )])]);
    team.send("erin", "start the servers");
    let w = team.worker("erin", &fake.url(), &[]);
    let pids = recorded_pids(&team, &m);
    assert_eq!(pids.len(), 3, "bash runs on: {pids:?}");
    w.signal(nix::sys::signal::Signal::SIGKILL);
    wait_all_gone(&pids);
}

#[test]
fn background_jobs_outlive_the_call_but_not_the_worker() {
    for sig in [
        nix::sys::signal::Signal::SIGTERM,
        nix::sys::signal::Signal::SIGKILL,
    ] {
        let m = support::team::marker();
        let team = Team::new();
        team.add_member("finn", 1, false);
        let fake = FakeLlm::start([
            tool_turn(&[anthropic_tool_use_block(
                "tu_1",
                "bash",
                &daemon_command(&m, "echo started"),
            )]),
            Reply::ok(anthropic_text("servers started")),
        ]);
        team.send("finn", "start the servers");
        let mut w = team.worker("finn", &fake.url(), &[]);
        wait_until(T, "finn idle", || {
            (team.status("finn") == MemberStatus::Idle).then_some(())
        });
        let pids = recorded_pids(&team, &m);
        // bash has ended; what it started in the background runs on while the worker lives.
        assert_eq!(pids.len(), 2, "bash has ended: {pids:?}");
        assert!(
            pids[..2].iter().all(|&p| support::team::alive(p)),
            "{sig}: background jobs must live until the worker exits"
        );
        w.signal(sig);
        if sig == nix::sys::signal::Signal::SIGTERM {
            assert_eq!(w.wait(T).code(), Some(143));
        }
        wait_all_gone(&pids[..2]);
    }
}
