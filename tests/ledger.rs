//! What a worker records and what it sends, at the edges (review 3, minor notes m2, m4, m10),
//! driven through the real `worker` against the fake LLM server: a compaction call that takes
//! the member over its budget is followed by no other call; usage recorded while config.json
//! does not parse survives the worker's exit; and a last turn whose many tool results do not fit
//! the context together is shrunk to fit rather than ending the activation.

mod support;

use std::time::Duration;

use serde_json::json;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Team, wait_until};
use troupe::config::MemberStatus;

const T: Duration = Duration::from_secs(60);

/// One assistant turn asking for `n` commands in parallel, each printing `bytes` bytes.
fn parallel_big_outputs(n: usize, bytes: usize) -> Reply {
    let calls: Vec<String> = (0..n)
        .map(|i| {
            anthropic_tool_use_block(
                &format!("tu_{i}"),
                "bash",
                &json!({"command": format!("head -c {bytes} /dev/zero | tr '\\0' {}", char::from(b'a' + i as u8))})
                    .to_string(),
            )
        })
        .collect();
    Reply::ok(anthropic_message(
        &calls.join(","),
        "tool_use",
        r#"{"input_tokens":10,"output_tokens":5}"#,
    ))
}

#[test]
fn many_large_results_of_one_turn_are_shrunk_to_fit_the_context() {
    const CONTEXT: u64 = 30_000;
    let team = Team::new();
    team.add_member("mel", 1, false);
    // Ten outputs of 50 KB, each cut to an eighth of the context when journaled: together
    // more than the whole context, which no compaction can help (they are the last turn).
    let fake = FakeLlm::start([
        parallel_big_outputs(10, 50_000),
        Reply::ok(anthropic_text("read them all")),
    ])
    .patient(T);
    fake.on_compaction(Reply::ok(anthropic_text("I was asked to print a lot.")));
    team.send("mel", "print ten big outputs at once");
    let ctx = CONTEXT.to_string();
    let _w = team.worker(
        "mel",
        &fake.url(),
        &[("TROUPE_CONTEXT_TOKENS", ctx.as_str())],
    );
    wait_until(T, "mel idle", || {
        (team.status("mel") == MemberStatus::Idle).then_some(())
    });
    let reqs: Vec<_> = fake
        .requests()
        .into_iter()
        .filter(|r| !r.body.to_string().contains("[compaction]"))
        .collect();
    assert_eq!(reqs.len(), 2, "{} requests", reqs.len());
    for r in &reqs {
        let bytes = r.raw_body.len() as u64;
        assert!(
            bytes <= CONTEXT * troupe::agent::compaction::BYTES_PER_TOKEN,
            "a request of {bytes} bytes exceeds the context of {CONTEXT} tokens"
        );
    }
    // The model was shown every result, each cut with a note saying how to see the rest.
    let last = reqs[1].body["messages"].as_array().unwrap().last().unwrap();
    let results: Vec<String> = last["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|b| b["type"] == "tool_result")
        .map(|b| b["content"].to_string())
        .collect();
    assert_eq!(results.len(), 10, "{last}");
    assert!(
        results.iter().all(|r| r.contains("bytes cut")),
        "{results:?}"
    );
    assert!(results.iter().all(|r| r.contains("re-read")), "{results:?}");
    let note = team
        .lead_inbox()
        .into_iter()
        .find(|m| m.kind == troupe::message::MessageType::IdleNotification)
        .expect("an idle notification");
    assert_eq!(note.content, "read them all");
}
