//! Issue 12, acceptance 2: a long activation stays inside the context. A real worker, with a
//! 30,000-token context, is fed 40 tool outputs of 50 KB in one activation by the fake LLM
//! server: no request exceeds the context (as estimated, and in bytes: 3 per token), the
//! conversation is compacted (journaled), and a worker `kill -9`ed after a compaction sends the
//! same compacted view when it comes back.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Team, wait_until};
use troupe::config::MemberStatus;
use troupe::transcript::Entry;

const T: Duration = Duration::from_secs(60);
const CONTEXT: u64 = 30_000;
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

fn big_output_step(i: usize) -> Reply {
    let call = anthropic_tool_use_block(
        &format!("tu_{i}"),
        "bash",
        &json!({"command": "head -c 50000 /dev/zero | tr '\\0' a"}).to_string(),
    );
    Reply::ok(anthropic_message(&call, "tool_use", USAGE))
}

fn compactions(team: &Team, name: &str) -> usize {
    team.transcript(name)
        .iter()
        .filter(|e| matches!(e, Entry::Compaction { .. }))
        .count()
}

/// The conversation of a request the server received (what the model was shown).
fn view(body: &Value) -> Value {
    json!({"system": body["system"], "messages": body["messages"]})
}

#[test]
fn a_long_activation_is_compacted_and_never_exceeds_the_context() {
    let team = Team::new();
    team.add_member("ida", 1, false);
    // Twelve steps, then a reply to the thirteenth call that comes too late: the worker is
    // killed while it waits, so the reply is lost with the connection.
    let late = big_output_step(99).delay(Duration::from_secs(30));
    let fake = FakeLlm::start((0..12).map(big_output_step).chain([late])).patient(T);
    fake.on_compaction(Reply::ok(anthropic_text(
        "I ran `head -c 50000 /dev/zero | tr '\\0' a` many times; each printed 50,000 a's.",
    )));
    team.send("ida", "print a lot, 40 times");
    let ctx = CONTEXT.to_string();
    let env = [("TROUPE_CONTEXT_TOKENS", ctx.as_str())];
    let mut w = team.worker("ida", &fake.url(), &env);
    // Twelve steps of 50 KB (cut to an eighth of the context each) pass the compaction
    // threshold; the thirteenth call waits for its late reply.
    let hung = wait_until(T, "the call after the scripted steps", || {
        let reqs = fake.requests();
        let normal: Vec<_> = reqs
            .iter()
            .filter(|r| !r.body.to_string().contains("[compaction]"))
            .collect();
        (normal.len() == 13).then(|| normal[12].body.clone())
    });
    assert!(compactions(&team, "ida") >= 1, "no compaction journaled");
    w.signal(nix::sys::signal::Signal::SIGKILL);
    let _ = w.wait(T);
    let before = fake.request_count();
    let w = team.worker("ida", &fake.url(), &env);
    let again = wait_until(T, "the restarted worker's call", || {
        let reqs = fake.requests();
        reqs[before..]
            .iter()
            .find(|r| !r.body.to_string().contains("[compaction]"))
            .map(|r| r.body.clone())
    });
    assert_eq!(
        view(&again),
        view(&hung),
        "the restarted worker shows the model another view"
    );
    for i in 12..40 {
        fake.push(big_output_step(i));
    }
    fake.push(Reply::ok(anthropic_text("done")));
    wait_until(T, "ida idle", || {
        (team.status("ida") == MemberStatus::Idle).then_some(())
    });
    let reqs = fake.requests();
    let tool_calls = team
        .transcript("ida")
        .iter()
        .filter(|e| matches!(e, Entry::ToolResults { .. }))
        .count();
    assert!(tool_calls >= 40, "{tool_calls} tool steps");
    assert!(
        compactions(&team, "ida") >= 3,
        "{}",
        compactions(&team, "ida")
    );
    for r in &reqs {
        let bytes = r.body.to_string().len() as u64;
        assert!(
            bytes <= CONTEXT * troupe::agent::compaction::BYTES_PER_TOKEN,
            "a request of {bytes} bytes exceeds the context of {CONTEXT} tokens"
        );
    }
    let events = std::fs::read_to_string(team.dir.events()).unwrap();
    assert!(events.contains("\"compacted\""), "no compacted event");
    drop(w);
}

/// Anthropic's answer to a request over the model's context window.
fn too_long() -> Reply {
    Reply::json(
        400,
        r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 212000 tokens > 200000 maximum"}}"#,
    )
}

#[test]
fn a_prompt_too_long_answer_compacts_once_and_retries() {
    let team = Team::new();
    team.add_member("jo", 1, false);
    let too_long = too_long();
    let fake = FakeLlm::start([
        big_output_step(0),
        big_output_step(1),
        too_long.clone(),
        Reply::ok(anthropic_text("done after compaction")),
    ])
    .patient(T);
    fake.on_compaction(Reply::ok(anthropic_text("two big outputs so far")));
    team.send("jo", "go");
    let _w = team.worker("jo", &fake.url(), &[]);
    wait_until(T, "jo idle", || {
        (team.status("jo") == MemberStatus::Idle).then_some(())
    });
    assert_eq!(compactions(&team, "jo"), 1);
    assert_eq!(team.member("jo").restarts, 0);
}

#[test]
fn too_long_even_after_compaction_ends_the_activation_without_a_restart() {
    let team = Team::new();
    team.add_member("kim", 1, false);
    let too_long = too_long();
    let fake = FakeLlm::start([
        big_output_step(0),
        big_output_step(1),
        too_long.clone(),
        too_long,
    ])
    .patient(T);
    fake.on_compaction(Reply::ok(anthropic_text("two big outputs so far")));
    team.send("kim", "go");
    let w = team.worker("kim", &fake.url(), &[]);
    wait_until(T, "kim idle", || {
        (team.status("kim") == MemberStatus::Idle).then_some(())
    });
    let note = team
        .lead_inbox()
        .into_iter()
        .find(|m| m.kind == troupe::message::MessageType::IdleNotification)
        .expect("an idle notification");
    assert!(note.content.contains("too long"), "{}", note.content);
    assert!(support::team::alive(w.pid() as u64), "the worker exited");
}
