//! Finding 10: the plan gate follows re-spawns. `lead spawn --require-plan-approval` on an idle
//! teammate closes its gate for the new task, and a plan approved in an earlier life does not
//! open the gate of a reactivated one. Driven through `lead spawn` and a real worker against
//! the fake LLM server; the tools offered are read from the requests the server received.

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Team, lead_cmd, wait_until};
use troupe::config::MemberStatus;
use troupe::requests::{NewRequest, RequestKind, RequestStore};

const T: Duration = Duration::from_secs(30);

fn spawn(team: &Team, url: &str, args: &[&str]) {
    let mut all = vec!["spawn", "alice", "--role", "coder", "--prompt", "build it"];
    all.extend_from_slice(args);
    let o = lead_cmd(team, url, &all).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn tool_names(body: &Value) -> Vec<String> {
    body["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap().to_owned())
        .collect()
}

/// The tools offered in the `n`th request (from 1) the server received, once it has arrived.
fn offered(fake: &FakeLlm, n: usize) -> Vec<String> {
    wait_until(T, &format!("request {n}"), || {
        fake.requests().get(n - 1).map(|r| tool_names(&r.body))
    })
}

#[test]
fn requiring_a_plan_of_an_idle_teammate_closes_its_gate() {
    let team = Team::new();
    let fake = FakeLlm::start([
        Reply::ok(anthropic_text("done")),
        Reply::ok(anthropic_text("I will plan first")),
    ]);
    spawn(&team, &fake.url(), &[]);
    let _w = team.worker("alice", &fake.url(), &[]);
    assert!(offered(&fake, 1).contains(&"bash".to_owned()));
    wait_until(T, "alice idle", || {
        (team.status("alice") == MemberStatus::Idle).then_some(())
    });
    spawn(&team, &fake.url(), &["--require-plan-approval"]);
    let tools = offered(&fake, 2);
    assert!(!tools.contains(&"bash".to_owned()), "{tools:?}");
    assert!(tools.contains(&"plan_approval".to_owned()), "{tools:?}");
}

#[test]
fn a_plan_approved_in_an_earlier_life_does_not_open_the_gate() {
    let team = Team::new();
    let fake = FakeLlm::start([Reply::ok(anthropic_text("I will plan first"))]);
    spawn(&team, &fake.url(), &["--require-plan-approval"]);
    // A plan of hers was approved for an earlier task.
    let store = RequestStore::new(&team.dir);
    let old = store
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "alice".into(),
            to: "lead".into(),
            payload: json!({"plan": "the old task"}),
            target_incarnation: None,
            ttl: None,
        })
        .unwrap();
    store
        .resolve(&old.request_id, "lead", true, json!({"feedback": "ok"}))
        .unwrap();
    // Shut down since, then reactivated for a new task that needs a plan.
    troupe::config::Roster::new(&team.dir)
        .update_member("alice", |m| m.status = MemberStatus::Shutdown)
        .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    spawn(&team, &fake.url(), &["--require-plan-approval"]);
    let _w = team.worker("alice", &fake.url(), &[]);
    let tools = offered(&fake, 1);
    assert!(!tools.contains(&"bash".to_owned()), "{tools:?}");
}

/// Issue 13: a member that needs plan approval needs it for each task it claims with its own
/// `task_claim`, as for one the lead assigns: the claim closes an open gate.
#[test]
fn a_task_claimed_by_tool_closes_an_open_gate() {
    use support::fake_llm::{anthropic_message, anthropic_tool_use_block};
    let team = Team::new();
    let task = troupe::tasks::TaskStore::new(&team.dir)
        .create(troupe::tasks::NewTask {
            subject: "the next job".into(),
            created_by: "lead".into(),
            ..Default::default()
        })
        .unwrap();
    let claim = anthropic_tool_use_block(
        "tu_claim",
        "task_claim",
        &json!({"task_id": task.id}).to_string(),
    );
    let fake = FakeLlm::start([
        Reply::ok(anthropic_message(
            &claim,
            "tool_use",
            r#"{"input_tokens":10,"output_tokens":5}"#,
        )),
        Reply::ok(anthropic_text("I will plan the next job first")),
    ]);
    spawn(&team, &fake.url(), &["--require-plan-approval"]);
    // Her plan for the task she was spawned with is approved: the gate is open.
    std::thread::sleep(Duration::from_millis(20));
    let store = RequestStore::new(&team.dir);
    let plan = store
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "alice".into(),
            to: "lead".into(),
            payload: json!({"plan": "the first task"}),
            target_incarnation: None,
            ttl: None,
        })
        .unwrap();
    store
        .resolve(&plan.request_id, "lead", true, json!({"feedback": "ok"}))
        .unwrap();
    let _w = team.worker("alice", &fake.url(), &[]);
    let first = offered(&fake, 1);
    assert!(first.contains(&"bash".to_owned()), "{first:?}");
    let after_claim = offered(&fake, 2);
    assert!(
        !after_claim.contains(&"bash".to_owned()),
        "the claim left the gate open: {after_claim:?}"
    );
}
