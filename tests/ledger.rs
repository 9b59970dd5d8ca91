//! What the team records and what a worker sends, at the edges (review 3, minor notes m2, m3,
//! m4 and m10), through the real `worker` and `lead` against the fake LLM server: a compaction
//! call that takes the member over its budget is followed by no other call; a member pruned by
//! `lead up --prune` still counts toward the team's spend, and toward its name's budget when it
//! is added again; usage recorded while config.json does not parse survives the worker's exit;
//! and a last turn whose many tool results do not fit the context together is shrunk to fit
//! rather than ending the activation.

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

/// `lead up FILE --accept` in the team's working dir; its output.
fn up(team: &Team, text: &str, more: &[&str]) -> std::process::Output {
    let file = team.path().join("team.toml");
    std::fs::write(&file, text).unwrap();
    let mut args = vec!["up", file.to_str().unwrap(), "--accept"];
    args.extend_from_slice(more);
    support::team::lead_cmd(team, "http://127.0.0.1:9", &args)
        .output()
        .unwrap()
}

#[test]
fn a_pruned_members_spend_stays_in_the_team_total_and_with_its_name() {
    let team = Team::new();
    let ann = "[[members]]\nname = \"ann\"\nrole = \"coder\"\nprompt = \"p\"\n";
    let bob = "[[members]]\nname = \"bob\"\nrole = \"coder\"\nprompt = \"p\"\nbudget_usd = 0.015\n";
    let o = up(&team, &format!("{ann}{bob}"), &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // bob spent $0.02 over two incarnations, and is shut down.
    troupe::config::Roster::new(&team.dir)
        .update(|cfg| {
            let m = cfg.require_mut("bob")?;
            let u = troupe::llm::Usage {
                input_tokens: 1000,
                ..Default::default()
            };
            troupe::cost::record_call(m, 1, &u, 0.01);
            troupe::cost::record_call(m, 2, &u, 0.01);
            m.status = MemberStatus::Shutdown;
            Ok(())
        })
        .unwrap();
    let team_cost = || {
        let o = support::team::lead_cmd(&team, "http://127.0.0.1:9", &["status", "--json"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["team"]["cost_usd"].as_f64().unwrap()
    };
    assert!((team_cost() - 0.02).abs() < 1e-9);
    let o = up(&team, ann, &["--prune"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(team.dir.config().exists());
    let cfg = troupe::config::Roster::new(&team.dir).load().unwrap();
    assert!(cfg.member("bob").is_none());
    // The team still counts what bob spent.
    assert!((team_cost() - 0.02).abs() < 1e-9, "{}", team_cost());
    // bob added again under his name, with the same budget: his earlier life counts.
    let o = up(&team, &format!("{ann}{bob}"), &[]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("budget: bob spent $0.0200"), "{err}");
}

/// Prices of the fake model: $10 per million tokens, so 1000 input tokens cost $0.01.
const PRICES: &str = r#"{"claude-fake": {"input": 10, "output": 10}}"#;

/// The environment of a worker with the test's prices (and `more`).
fn priced<'a>(team: &Team, more: &[(&'a str, &'a str)]) -> Vec<(&'a str, String)> {
    let p = team.path().join("prices.json");
    std::fs::write(&p, PRICES).unwrap();
    let mut env = vec![("TROUPE_PRICES", p.display().to_string())];
    env.extend(more.iter().map(|(k, v)| (*k, (*v).to_owned())));
    env
}

fn non_compaction_requests(fake: &FakeLlm) -> usize {
    fake.requests()
        .iter()
        .filter(|r| !r.body.to_string().contains("[compaction]"))
        .count()
}

#[test]
fn a_compaction_call_that_crosses_the_budget_is_followed_by_no_other_call() {
    let team = Team::new();
    team.add_member("max", 1, false);
    troupe::config::Roster::new(&team.dir)
        .update_member("max", |m| m.budget_usd = Some(0.015))
        .unwrap();
    // Seven outputs of 50 KB, cut to an eighth of the context each: the next prompt is past
    // the compaction threshold, and the summary call costs $0.02.
    let fake = FakeLlm::start([
        parallel_big_outputs(7, 50_000),
        Reply::ok(anthropic_text("one call too many")),
    ])
    .patient(T);
    fake.on_compaction(Reply::ok(anthropic_message(
        r#"{"type":"text","text":"I printed a lot."}"#,
        "end_turn",
        r#"{"input_tokens":2000,"output_tokens":0}"#,
    )));
    team.send("max", "print seven big outputs at once");
    let env = priced(&team, &[("TROUPE_CONTEXT_TOKENS", "30000")]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut w = team.worker("max", &fake.url(), &env);
    let st = w.wait(T);
    assert!(st.success(), "{st}: {}", team.stderr("max"));
    let m = team.member("max");
    assert_eq!(m.status, MemberStatus::Shutdown);
    assert!(
        m.reason.as_deref().unwrap_or_default().contains("budget"),
        "{:?}",
        m.reason
    );
    // The step's call and the compaction's, both in the ledger; no call after the compaction.
    assert_eq!(m.calls, 2);
    assert!((m.cost_usd - 0.02015).abs() < 1e-9, "{}", m.cost_usd);
    assert_eq!(
        fake.requests().len() - non_compaction_requests(&fake),
        1,
        "one compaction"
    );
    assert_eq!(
        non_compaction_requests(&fake),
        1,
        "a call after the compaction"
    );
}

#[test]
fn usage_recorded_while_config_json_does_not_parse_survives_the_workers_exit() {
    let team = Team::new();
    team.add_member("ned", 1, false);
    let fake = FakeLlm::start([]).patient(T);
    team.send("ned", "say hello");
    let env = priced(&team, &[]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut w = team.worker("ned", &fake.url(), &env);
    wait_until(T, "ned's model call", || {
        (fake.request_count() == 1).then_some(())
    });
    // A person's edit in progress: config.json does not parse while the call is answered.
    let good = std::fs::read(team.dir.config()).unwrap();
    std::fs::write(team.dir.config(), "{\"members\": [").unwrap();
    fake.push(Reply::ok(anthropic_message(
        r#"{"type":"text","text":"hello"}"#,
        "end_turn",
        r#"{"input_tokens":1000,"output_tokens":0}"#,
    )));
    wait_until(T, "ned's write kept for later", || {
        team.stderr("ned")
            .contains("the change is kept")
            .then_some(())
    });
    // Stopped meanwhile: it exits, or waits a little for config.json before it does.
    w.signal(nix::sys::signal::Signal::SIGTERM);
    wait_until(T, "ned exiting", || {
        (w.try_status().is_some() || team.stderr("ned").contains("not written yet")).then_some(())
    });
    std::fs::write(team.dir.config(), good).unwrap();
    let st = w.wait(T);
    assert_eq!(st.code(), Some(143), "{}", team.stderr("ned"));
    let m = team.member("ned");
    assert_eq!(
        m.calls,
        1,
        "the call's usage was lost: {}",
        team.stderr("ned")
    );
    assert_eq!(m.usage.input_tokens, 1000);
    assert!((m.cost_usd - 0.01).abs() < 1e-9, "{}", m.cost_usd);
    assert_eq!(m.ledger.len(), 1);
}
