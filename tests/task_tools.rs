//! Issue 13: the task tools, driven by a real worker through the fake LLM server. The worker
//! claims a task, is refused a blocked one with a reason, and completes what it owns; the
//! board's files say so.

mod support;

use std::time::Duration;

use serde_json::json;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Team, wait_until};
use troupe::config::MemberStatus;
use troupe::tasks::{NewTask, TaskStatus, TaskStore};

const T: Duration = Duration::from_secs(30);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

fn call(id: &str, tool: &str, input: serde_json::Value) -> Reply {
    let block = anthropic_tool_use_block(id, tool, &input.to_string());
    Reply::ok(anthropic_message(&block, "tool_use", USAGE))
}

#[test]
fn a_teammate_claims_is_refused_a_blocked_task_and_completes_its_own() {
    let team = Team::new();
    team.add_member("ann", 1, false);
    let store = TaskStore::new(&team.dir);
    let new = |subject: &str, blocked_by: Vec<String>| NewTask {
        subject: subject.into(),
        description: String::new(),
        blocked_by,
        owner: None,
        created_by: "lead".into(),
    };
    let first = store.create(new("write the parser", vec![])).unwrap();
    let second = store
        .create(new("test the parser", vec![first.id.clone()]))
        .unwrap();
    let fake = FakeLlm::start([
        call("t1", "task_claim", json!({"task_id": second.id})),
        call("t2", "task_claim", json!({})),
        call(
            "t3",
            "task_update",
            json!({"task_id": first.id, "status": "completed", "result": "parser.rs written"}),
        ),
        Reply::ok(anthropic_text("done")),
    ]);
    team.send("ann", "take a task");
    let _w = team.worker("ann", &fake.url(), &[]);
    wait_until(T, "ann idle", || {
        (team.status("ann") == MemberStatus::Idle).then_some(())
    });
    let done = store.get(&first.id).unwrap();
    assert_eq!(done.status, TaskStatus::Completed);
    assert_eq!(done.owner.as_deref(), Some("ann"));
    assert_eq!(done.result.as_deref(), Some("parser.rs written"));
    let reqs = fake.requests();
    // The refusal of the blocked task reached the model, with the reason.
    let after_first = reqs[1].body.to_string();
    assert!(
        after_first.contains("is_error") && after_first.contains(&first.id),
        "{after_first}"
    );
    assert_eq!(store.get(&second.id).unwrap().status, TaskStatus::Pending);
}
