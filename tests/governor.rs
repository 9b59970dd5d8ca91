//! Issue 25's rate governor, with the real `lead` and `worker`: 8 teammates make 6 model calls
//! each against a stub that limits them as providers do (`bench/rate_stub.rs`), and every call
//! gets done. Under a cap of 3 calls in flight against a stub that serves 3 at once, no call is
//! refused; pacing by the remaining-requests headers meets no 429 either; and against a stub
//! that serves 6 requests a second (or 3 at once), the governor meets at least 3x (2x) fewer
//! 429s than `--rate-governor off`.
//! (`troupe-bench --governed-only` prints the same runs' numbers.)

mod support;

#[path = "../bench/rate_stub.rs"]
mod rate_stub;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use rate_stub::{Counts, Limit, RateStub};
use support::team::{Bg, Team, lead_cmd as lead, wait_until};
use troupe::config::{MemberStatus, Roster};

const T: Duration = Duration::from_secs(120);
const MATES: usize = 8;
const CALLS: usize = 6;

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

/// A team of 8 under `lead run EXTRA`, each given one task that takes 6 calls; returns what
/// the stub saw once all of them are done.
fn run(limit: Limit, extra: &[&str]) -> Counts {
    run_watching(limit, extra, LATENCY, &mut |_| ()).0
}

/// How long the stub takes to answer a call.
const LATENCY: Duration = Duration::from_millis(100);

/// [`run`], calling `watch` with the team while it waits, and returning the team too.
fn run_watching(
    limit: Limit,
    extra: &[&str],
    latency: Duration,
    watch: &mut dyn FnMut(&Team),
) -> (Counts, Team) {
    let stub = RateStub::start(limit, latency, CALLS - 1);
    let team = Team::new();
    let url = stub.url();
    let mut file = String::new();
    for i in 0..MATES {
        file.push_str(&format!(
            "[[members]]\nname = \"m{i}\"\nrole = \"r\"\nprompt = \"work\"\nmodel = \"m-stub\"\n\n"
        ));
    }
    std::fs::write(team.workdir.join("team.toml"), file).unwrap();
    let o = out(&mut lead(&team, &url, &["up", "team.toml"]));
    assert!(o.status.success(), "{o:?}");
    let mut args = vec!["run", "--sandbox", "off"];
    args.extend_from_slice(extra);
    let _sup = Bg(lead(&team, &url, &args)
        .env("TROUPE_API_WAIT_MAX_SECS", "2")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_until(T, "every teammate done with its 6 calls", || {
        watch(&team);
        let cfg = Roster::new(&team.dir).load().ok()?;
        (cfg.members.len() == MATES
            && cfg
                .members
                .iter()
                .all(|m| m.status == MemberStatus::Idle && m.calls >= CALLS as u64))
        .then_some(())
    });
    let counts = stub.counts();
    assert_eq!(counts.served, (MATES * CALLS) as u64, "{counts:?}");
    (counts, team)
}

#[test]
fn a_cap_of_3_against_a_stub_serving_3_at_once_meets_no_429() {
    // Members waiting for a slot say so in `lead status` (5 of 8 wait at any time). A wait
    // shows once it has lasted 200 ms: calls of 400 ms make the waits two to four times that,
    // where calls of 100 ms left the longest of them near it and the status could miss them.
    let mut waiting_seen = None;
    let (counts, _team) = run_watching(
        Limit::Concurrent { n: 3 },
        &["--max-concurrent-calls", "3"],
        Duration::from_millis(400),
        &mut |team| {
            if waiting_seen.is_some() {
                return;
            }
            let o = out(&mut lead(team, "http://127.0.0.1:9", &["status", "--json"]));
            let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            let members = status["members"].as_array().cloned().unwrap_or_default();
            waiting_seen = members
                .into_iter()
                .find(|m| m["doing"]["state"] == "waiting_slot");
        },
    );
    eprintln!("concurrent 3, --max-concurrent-calls 3: {counts:?}");
    assert_eq!(counts.limited, 0, "{counts:?}");
    assert!(counts.most_at_once <= 3);
    let seen = waiting_seen.expect("no member seen waiting_slot in lead status --json");
    assert_eq!(seen["status"], "working", "{seen}");
    assert!(seen["doing"]["call"].as_u64().is_some(), "{seen}");
}

#[test]
fn pacing_by_remaining_requests_meets_no_429() {
    let counts = run(
        Limit::Headers {
            n: 10,
            window: Duration::from_secs(1),
        },
        &[],
    );
    eprintln!("headers 10/s, default governor: {counts:?}");
    assert_eq!(counts.limited, 0, "{counts:?}");
}

#[test]
fn the_governor_meets_fewer_429s_than_none_against_a_window_limit() {
    let limit = Limit::Window {
        n: 6,
        window: Duration::from_secs(1),
    };
    let off = run(limit, &["--rate-governor", "off"]);
    let (on, team) = run_watching(limit, &[], LATENCY, &mut |_| ());
    eprintln!("window 6/s: governor off {off:?}, default {on:?}");
    assert!(on.limited * 3 <= off.limited, "off {off:?}, default {on:?}");
    // The lead was told the team is rate limited, once (the run is shorter than a minute).
    let told: Vec<_> = team
        .lead_inbox()
        .into_iter()
        .filter(|m| m.content.contains("rate limited"))
        .collect();
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0].kind, troupe::message::MessageType::StatusUpdate);
}

#[test]
fn the_learned_cap_meets_fewer_429s_than_none_against_a_concurrency_limit() {
    let limit = Limit::Concurrent { n: 3 };
    let off = run(limit, &["--rate-governor", "off"]);
    let on = run(limit, &[]);
    eprintln!("concurrent 3: governor off {off:?}, default {on:?}");
    assert!(on.limited * 2 <= off.limited, "off {off:?}, default {on:?}");
}
