//! Issue 12, caching that pays: a real `worker` runs a 30-step tool loop (each step a `bash`
//! command printing 1.8 KB) against a stand-in for the Anthropic API that bills prompt caching
//! by the documented rules (`bench/cache_stub.rs`: exact-byte prefixes, a 1,024-token minimum,
//! a 20-block lookback, at most 4 breakpoints or a 400). Most of each prompt must be read from
//! cache, and the member's ledger in config.json must be exactly what the stub billed.

mod support;

#[path = "../bench/cache_stub.rs"]
mod cache_stub;

use std::time::Duration;

use cache_stub::CacheStub;
use support::team::{Team, wait_until};
use troupe::config::MemberStatus;

const STEPS: usize = 30;

#[test]
fn a_thirty_step_loop_reads_most_of_its_prompt_from_cache() {
    let stub = CacheStub::start(STEPS).expect("start the caching stub");
    let team = Team::new();
    team.add_member("looper", 1, false);
    team.send(
        "looper",
        "Run the commands you are given, one step at a time.",
    );
    let mut worker = team.worker("looper", &stub.url(), &[]);
    // STEPS tool calls, then the final answer; the activation is over when the member is idle.
    let member = wait_until(Duration::from_secs(180), "the loop to finish", || {
        let m = team.member("looper");
        (m.status == MemberStatus::Idle && m.calls == STEPS as u64 + 1).then_some(m)
    });
    assert!(worker.try_status().is_none(), "{}", team.stderr("looper"));
    drop(worker);

    let calls = stub.calls();
    for (i, c) in calls.iter().enumerate() {
        eprintln!(
            "call {:2}: status {} request {:6} B  input {:6}  write {:6}  read {:6}",
            i + 1,
            c.status,
            c.request_bytes,
            c.billed.input_tokens,
            c.billed.cache_creation_input_tokens,
            c.billed.cache_read_input_tokens
        );
    }
    assert!(
        calls.iter().all(|c| c.status == 200),
        "the stub refused a request: {}",
        team.stderr("looper")
    );
    assert_eq!(calls.len(), STEPS + 1, "one request per step plus the last");

    let total = stub.total();
    let share = total.cache_read_share();
    eprintln!(
        "cache-read share over {} calls: {:.1} % ({} of {} prompt tokens; input {}, write {})",
        calls.len(),
        share * 100.0,
        total.cache_read_input_tokens,
        total.prompt_tokens(),
        total.input_tokens,
        total.cache_creation_input_tokens
    );
    assert!(
        share >= 0.85,
        "only {:.1} % of the prompt tokens were read from cache",
        share * 100.0
    );

    // The ledger is what the API billed, to the token.
    let u = member.usage;
    assert_eq!(
        (
            u.input_tokens,
            u.output_tokens,
            u.cache_creation_input_tokens,
            u.cache_read_input_tokens
        ),
        (
            total.input_tokens,
            total.output_tokens,
            total.cache_creation_input_tokens,
            total.cache_read_input_tokens
        )
    );
}
