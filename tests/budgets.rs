//! Budgets (issue 12, acceptance 3), driven through the real binaries against the fake LLM
//! server: a member over its budget is shut down by code with no further model call, stays
//! down across a `lead run` restart, is refused by `lead spawn` until its budget is raised, and
//! `lead status` says why; a team budget stops the whole team the same way and refuses spawns.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd as lead, wait_until};
use troupe::config::MemberStatus;
use troupe::requests::{Request, RequestKind, RequestStatus, RequestStore};

const T: Duration = Duration::from_secs(30);
/// 1000 input tokens: $0.01 at the test's price of $10 per million.
const USAGE: &str = r#"{"input_tokens":1000,"output_tokens":0}"#;
const PRICES: &str = r#"{"claude-fake": {"input": 10, "output": 10}}"#;

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn stdout_json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "{e}: stdout {:?}, stderr {:?}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        )
    })
}

/// A call that asks for `read_inbox` and costs $0.01.
fn step() -> Reply {
    Reply::ok(anthropic_message(
        &anthropic_tool_use_block("tu", "read_inbox", "{}"),
        "tool_use",
        USAGE,
    ))
}

fn done() -> Reply {
    Reply::ok(anthropic_text("done"))
}

fn prices(team: &Team) -> String {
    let p = team.tmp.path().join("prices.json");
    std::fs::write(&p, PRICES).unwrap();
    p.display().to_string()
}

/// `lead run` in the background with short timeouts and the test's prices.
fn supervise(team: &Team, url: &str, extra: &[&str]) -> Bg {
    let p = prices(team);
    let mut args = vec![
        "run",
        "--stop-timeout",
        "2",
        "--kill-grace",
        "1",
        "--prices",
        &p,
    ];
    args.extend_from_slice(extra);
    let bg = Bg(lead(team, url, &args)
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_until(T, "the supervisor ready", || {
        std::fs::read_to_string(team.dir.lead_lock())
            .ok()
            .filter(|t| t.contains("ready"))
    });
    bg
}

/// Stops a supervisor gracefully (SIGTERM) and waits for it.
fn stop(mut bg: Bg) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(bg.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let st = bg.0.wait().unwrap();
    assert!(st.success(), "lead run exited {st}");
}

fn budget_requests(team: &Team, name: &str) -> Vec<Request> {
    RequestStore::new(&team.dir)
        .list(None)
        .unwrap()
        .into_iter()
        .filter(|r| r.kind == RequestKind::Shutdown && r.to == name)
        .collect()
}

fn events(team: &Team, name: &str, who: &str) -> Vec<Value> {
    troupe::events::read_all(&team.dir)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == name && e["name"] == who)
        .collect()
}

/// Waits until `name` is shut down and its process reaped.
fn wait_down(team: &Team, name: &str) {
    wait_until(T, &format!("{name} shut down and reaped"), || {
        let m = team.member(name);
        (m.status == MemberStatus::Shutdown && m.pid.is_none() && m.last_exit.is_some())
            .then_some(())
    });
}

/// Checks the marks of a budget stop of `name`: one approved shutdown request with reason
/// `budget`, a `budget_exceeded` event, status `shutdown` with a reason that says budget, exit 0.
fn assert_budget_stop(team: &Team, name: &str, what: &str) {
    let reqs = budget_requests(team, name);
    assert_eq!(reqs.len(), 1, "{reqs:?}");
    assert_eq!(reqs[0].status, RequestStatus::Approved);
    assert_eq!(reqs[0].payload["reason"], "budget");
    assert_eq!(reqs[0].response.as_ref().unwrap()["reason"], "budget");
    assert_eq!(events(team, "budget_exceeded", name).len(), 1);
    let m = team.member(name);
    assert_eq!(m.status, MemberStatus::Shutdown);
    let reason = m.reason.unwrap_or_default();
    assert!(
        reason.starts_with("budget:") && reason.contains(what),
        "{reason}"
    );
    assert_eq!(m.last_exit.unwrap().code, Some(0));
}

#[test]
fn a_member_over_its_budget_is_shut_down_by_code_and_stays_down_until_raised() {
    let team = Team::new();
    let fake = FakeLlm::start([step(), step(), done()]).patient(T);
    let url = fake.url();
    let o = out(&mut lead(
        &team,
        &url,
        &[
            "spawn",
            "coder",
            "--role",
            "coder",
            "--prompt",
            "p",
            "--budget-usd",
            "0.015",
        ],
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let sup = supervise(&team, &url, &[]);
    wait_down(&team, "coder");
    // Two calls at $0.01: the second crossed $0.015; its step finished, and no third call.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(fake.request_count(), 2);
    assert_budget_stop(&team, "coder", "of its $0.0150 budget");
    let m = team.member("coder");
    assert!((m.cost_usd - 0.02).abs() < 1e-9, "{}", m.cost_usd);
    assert_eq!(m.calls, 2);
    assert_eq!(m.ledger.len(), 1);
    assert_eq!(m.ledger[0].incarnation, 1);
    assert_eq!(m.ledger[0].spend.usage.input_tokens, 2000);
    // Both steps are in the journal: the second tool result too.
    let results = team
        .transcript("coder")
        .iter()
        .filter(|e| matches!(e, troupe::transcript::Entry::ToolResults { .. }))
        .count();
    assert_eq!(results, 2);

    // `lead status` says why, in the table and in JSON.
    let o = out(&mut lead(&team, &url, &["status"]));
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.contains("COST") && table.contains("$0.0200"),
        "{table}"
    );
    assert!(table.contains("budget: coder spent $0.0200"), "{table}");
    let v = stdout_json(&out(&mut lead(&team, &url, &["status", "--json"])));
    let row = &v["members"][0];
    assert_eq!(row["status"], "shutdown");
    assert!(row["reason"].as_str().unwrap().contains("budget"));
    assert_eq!(row["budget_usd"], 0.015);
    assert_eq!(row["cache_read_share"], 0.0);
    assert!((v["team"]["cost_usd"].as_f64().unwrap() - 0.02).abs() < 1e-9);

    // A restarted supervisor does not resume it.
    stop(sup);
    let sup = supervise(&team, &url, &[]);
    std::thread::sleep(Duration::from_millis(800));
    let m = team.member("coder");
    assert_eq!(m.status, MemberStatus::Shutdown);
    assert_eq!(m.incarnation, 1);
    assert_eq!(fake.request_count(), 2);

    // `lead spawn` refuses it until its budget is raised above its spend.
    for extra in [&[][..], &["--budget-usd", "0.02"][..]] {
        let mut args = vec!["spawn", "coder", "--role", "coder", "--prompt", "again"];
        args.extend_from_slice(extra);
        let o = out(&mut lead(&team, &url, &args));
        assert_eq!(o.status.code(), Some(4), "{o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("budget: coder spent $0.0200") && err.contains("raise its budget"),
            "{err}"
        );
        assert_eq!(team.member("coder").status, MemberStatus::Shutdown);
    }
    let o = out(&mut lead(
        &team,
        &url,
        &[
            "spawn",
            "coder",
            "--role",
            "coder",
            "--prompt",
            "again",
            "--budget-usd",
            "1",
        ],
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    wait_until(T, "coder back at work and idle", || {
        let m = team.member("coder");
        (m.status == MemberStatus::Idle && m.incarnation == 2).then_some(())
    });
    assert_eq!(fake.request_count(), 3);
    drop(sup);
}

#[test]
fn a_team_over_its_budget_stops_every_teammate_and_refuses_spawns() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    fake.push_for("claude-fake-b", done_costing());
    fake.push_for("claude-fake-a", step());
    fake.push_for("claude-fake-a", step());
    fake.push_for("claude-fake-a", done());
    let spawn = |name: &str| {
        let model = format!("claude-fake-{name}");
        out(&mut lead(
            &team,
            &url,
            &[
                "spawn", name, "--role", "r", "--prompt", "p", "--model", &model,
            ],
        ))
    };
    assert!(spawn("b").status.success());
    let sup = supervise(&team, &url, &["--team-budget-usd", "0.025"]);
    wait_until(T, "b idle", || {
        (team.status("b") == MemberStatus::Idle).then_some(())
    });
    assert!(spawn("a").status.success());
    // a's second call takes the team to $0.03: a stops after its step, and idle b is woken
    // to stop too, neither with another model call.
    wait_down(&team, "a");
    wait_down(&team, "b");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(fake.requests_for("claude-fake-a"), 2);
    assert_eq!(fake.requests_for("claude-fake-b"), 1);
    assert_budget_stop(&team, "a", "the team spent $0.0300 of its $0.0250 budget");
    assert_budget_stop(&team, "b", "the team spent $0.0300 of its $0.0250 budget");

    // New spawns are refused, old and new names alike.
    for name in ["a", "c"] {
        let o = spawn(name);
        assert_eq!(o.status.code(), Some(4), "{o:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("team budget"), "{err}");
    }
    assert!(team.dir.root().join("config.json").exists());
    let v = stdout_json(&out(&mut lead(&team, &url, &["status", "--json"])));
    assert_eq!(v["team"]["budget_usd"], 0.025);
    assert!(
        v["team"]["over_budget"]
            .as_str()
            .unwrap()
            .contains("team spent")
    );
    assert_eq!(v["members"].as_array().unwrap().len(), 2);

    // The budget lives in config.json: a restart without the flag keeps it.
    stop(sup);
    let _sup = supervise(&team, &url, &[]);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(team.status("a"), MemberStatus::Shutdown);
    assert_eq!(team.status("b"), MemberStatus::Shutdown);
    assert_eq!(spawn("c").status.code(), Some(4));
}

/// A final answer that costs $0.01.
fn done_costing() -> Reply {
    Reply::ok(anthropic_message(
        r#"{"type":"text","text":"ready"}"#,
        "end_turn",
        USAGE,
    ))
}

#[test]
fn the_llm_leads_spend_counts_toward_the_team_budget() {
    let team = Team::new();
    // A team budget written by hand, as config.json allows.
    std::fs::write(
        team.dir.config(),
        r#"{"team_name":"t","members":[],"team_budget_usd":0.005}"#,
    )
    .unwrap();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    fake.push_for("m-lead", done_costing());
    let p = prices(&team);
    let o = out(&mut lead(
        &team,
        &url,
        &["chat", "-p", "hello", "--model", "m-lead", "--prices", &p],
    ));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("the lead spent $0.0100 this session") && err.contains("the team $0.0100"),
        "{err}"
    );
    let cfg = troupe::config::Roster::new(&team.dir).load().unwrap();
    let lead_spend = cfg.lead_spend.unwrap();
    assert_eq!(lead_spend.calls, 1);
    assert!((lead_spend.cost_usd - 0.01).abs() < 1e-9);
    let v = stdout_json(&out(&mut lead(&team, &url, &["status", "--json"])));
    assert!((v["team"]["lead"]["cost_usd"].as_f64().unwrap() - 0.01).abs() < 1e-9);
    // The lead alone took the team over its budget: no spawn.
    let o = out(&mut lead(
        &team,
        &url,
        &["spawn", "c", "--role", "r", "--prompt", "p"],
    ));
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("the team spent $0.0100"));
}
