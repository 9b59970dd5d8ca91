//! The rate governor's learned waits are bounded (review 4, R4-8): an answer whose reset header
//! names a far time (a proxy's placeholder, `2999-01-01T00:00:00Z`, `100000h`) does not set the
//! team's cooldown beyond the hour a `retry-after` may ask, and a state file that already holds
//! such a time (an older version wrote it, or a host whose clock runs far ahead) holds no member
//! of the next `lead run` longer than that. Real `lead` and `worker`, a fake model server.

mod support;

use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Bg, Team, lead_cmd as lead, start_supervisor, wait_until};

const T: Duration = Duration::from_secs(40);
/// Slack for the test's own clock against the governor's.
const SLACK: f64 = 60.0;

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn supervise(team: &Team, url: &str) -> Bg {
    let mut cmd = lead(
        team,
        url,
        &[
            "run",
            "--stop-timeout",
            "1",
            "--kill-grace",
            "1",
            "--sandbox",
            "off",
        ],
    );
    cmd.env("TROUPE_LLM_MAX_ATTEMPTS", "1");
    start_supervisor(team, cmd)
}

fn spawn(team: &Team, url: &str, name: &str) {
    let o = out(&mut lead(
        team,
        url,
        &[
            "spawn", name, "--role", "r", "--prompt", "p", "--model", "m-mate",
        ],
    ));
    assert!(o.status.success(), "{o:?}");
}

/// The governor's state files (one per endpoint).
fn states(team: &Team) -> Vec<PathBuf> {
    std::fs::read_dir(team.dir.root().join("govern"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("state.json"))
        .filter(|p| p.is_file())
        .collect()
}

fn state(path: &PathBuf) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap_or(Value::Null)
}

#[test]
fn a_reset_named_far_away_cools_the_team_down_for_an_hour_at_most() {
    for (remaining, reset, value) in [
        (
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
            "2999-01-01T00:00:00Z",
        ),
        (
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "100000h",
        ),
    ] {
        let team = Team::new();
        let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
        fake.push_for(
            "m-mate",
            Reply::json(
                429,
                r#"{"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}"#,
            )
            .header(remaining, "0")
            .header(reset, value),
        );
        fake.push_for("m-mate", Reply::ok(anthropic_text("done")));
        let url = fake.url();
        let _lead = supervise(&team, &url);
        spawn(&team, &url, "alice");
        // The 429 is seen and noted.
        wait_until(T, "the 429 to be answered", || {
            (!fake.requests().is_empty()).then_some(())
        });
        let limited = wait_until(T, "the governor's state after the 429", || {
            states(&team)
                .iter()
                .map(state)
                .find(|s| s["limited"].as_u64().unwrap_or(0) >= 1)
        });
        let now = troupe::fsutil::now();
        let until = limited["cooldown_until"].as_f64().unwrap_or(0.0);
        assert!(
            until <= now + 3600.0 + SLACK,
            "{reset}: {value} set the cooldown {:.0} s ahead: {limited}",
            until - now
        );
        let reset_at = limited["reset_at"].as_f64().unwrap_or(0.0);
        assert!(
            reset_at <= now + 3600.0 + SLACK,
            "{reset}: {value} set the window's reset {:.0} s ahead: {limited}",
            reset_at - now
        );
        // And the team goes on: the reset not taken, alice's next call is made.
        wait_until(T, "alice's next call after the 429", || {
            (fake.requests().len() >= 2).then_some(())
        });
    }
}

#[test]
fn a_far_cooldown_left_in_the_state_is_bounded_by_the_next_run() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
    fake.push_for("m-mate", Reply::ok(anthropic_text("ready")));
    let url = fake.url();
    // A first run learns the endpoint's state file.
    let first = supervise(&team, &url);
    spawn(&team, &url, "alice");
    let path = wait_until(T, "the governor's state", || {
        states(&team).into_iter().next()
    });
    drop(first);
    // The year 2999, as review 4 found it left by an uncapped reset.
    let mut s = state(&path);
    s["cooldown_until"] = serde_json::json!(32_472_144_000.0);
    s["reset_at"] = serde_json::json!(32_472_144_000.0);
    s["remaining"] = serde_json::json!(0);
    std::fs::write(&path, serde_json::to_vec(&s).unwrap()).unwrap();

    let _second = supervise(&team, &url);
    spawn(&team, &url, "bob");
    let bounded = wait_until(T, "the next run to bound the state", || {
        let s = state(&path);
        let now = troupe::fsutil::now();
        (s["cooldown_until"].as_f64().unwrap_or(f64::MAX) <= now + 3600.0 + SLACK
            && s["reset_at"].as_f64().unwrap_or(f64::MAX) <= now + 3600.0 + SLACK)
            .then_some(s)
    });
    eprintln!("bounded: {bounded}");
}

/// `lead status` shows a cooldown the team waits out (bounded to the hour, whatever the state
/// says) and how to end it; that done, it shows none.
#[test]
fn lead_status_shows_the_teams_cooldown_and_how_to_end_it() {
    let team = Team::new();
    let dir = team.dir.root().join("govern").join("fp0123");
    std::fs::create_dir_all(&dir).unwrap();
    let far = serde_json::json!({
        "cooldown_until": 32_472_144_000.0, "limit": 1.0, "halve_after": 0.0,
        "changed_at": 0.0, "remaining": null, "reset_at": 0.0, "limited": 1,
    });
    std::fs::write(dir.join("state.json"), far.to_string()).unwrap();
    let status = |json: bool| {
        let args: &[&str] = if json {
            &["status", "--json"]
        } else {
            &["status"]
        };
        let o = out(&mut lead(&team, "http://127.0.0.1:9", args));
        assert!(o.status.success(), "{o:?}");
        String::from_utf8(o.stdout).unwrap()
    };
    let v: Value = serde_json::from_str(&status(true)).unwrap();
    let c = &v["team"]["cooldowns"];
    assert_eq!(c.as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(c[0]["endpoint"], "fp0123");
    let now = troupe::fsutil::now();
    let until = c[0]["until"].as_f64().unwrap();
    assert!(until <= now + 3600.0 + SLACK && until > now + 3000.0, "{c}");
    let text = status(false);
    let clear = format!("rm {}", dir.join("state.json").display());
    assert!(
        text.contains("rate governor: every member waits") && text.contains(&clear),
        "{text}"
    );
    assert_eq!(c[0]["clear"], clear.as_str());
    std::fs::remove_file(dir.join("state.json")).unwrap();
    let v: Value = serde_json::from_str(&status(true)).unwrap();
    assert_eq!(v["team"]["cooldowns"], serde_json::json!([]), "{v}");
    assert!(!status(false).contains("rate governor:"));
}
