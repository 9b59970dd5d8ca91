//! Issue 13, hooks: the user's commands on `task_completed`, `task_created` and `teammate_idle`,
//! run by the real supervisor (`lead run`) against teammates driven by the fake LLM server.
//! Acceptance 2: a `task_completed` hook that exits 2 once sends the task back with its stderr to
//! the owner, and the second completion sticks; the task's dependent is not claimed before.

mod support;

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block, last_user_text,
};
use support::team::{Stopping, Team, lead_cmd, wait_until};
use troupe::config::Roster;
use troupe::hooks::{Hook, HookEvent};
use troupe::tasks::{NewTask, TaskStatus, TaskStore};

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;
const MODEL: &str = "m-amy";

fn run_lead(team: &Team, url: &str) -> Stopping {
    Stopping(
        lead_cmd(
            team,
            url,
            &["run", "--stop-timeout", "1", "--kill-grace", "1"],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    )
}

fn set_hooks(team: &Team, hooks: Vec<Hook>) {
    Roster::new(&team.dir)
        .update(move |c| {
            c.hooks = hooks.clone();
            Ok(())
        })
        .unwrap();
}

fn hook(event: HookEvent, command: String) -> Hook {
    Hook {
        event,
        command,
        timeout_secs: Some(20),
        sandbox: true,
    }
}

/// A hook command that exits 2 with `why` on stderr the first time (marked by `mark`), 0 after;
/// each run appends its stdin (one JSON document) to `log`.
fn fails_once(mark: &Path, log: &Path, why: &str) -> String {
    format!(
        "cat >> '{log}'; echo >> '{log}'; if [ -e '{mark}' ]; then exit 0; fi; touch '{mark}'; \
         echo '{why}' >&2; exit 2",
        log = log.display(),
        mark = mark.display(),
    )
}

fn events(team: &Team) -> Vec<Value> {
    std::fs::read_to_string(team.dir.events())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// Answers the teammate as a diligent one would: a task it claimed, or one a hook sent back,
/// is completed at once; anything else gets a short text.
fn responder(fake: Arc<FakeLlm>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut done = 0;
        while !stop.load(Ordering::SeqCst) {
            let reqs = fake.requests();
            let mine: Vec<&Value> = reqs
                .iter()
                .map(|r| &r.body)
                .filter(|b| b["model"] == MODEL)
                .collect();
            while done < mine.len() {
                let text = last_user_text(mine[done]);
                let task = ["You claimed task ", "hook sent task "]
                    .iter()
                    .find_map(|p| text.find(p).map(|at| at + p.len()))
                    .filter(|_| !text.contains("tool_result"))
                    .map(|at| text[at..at + 8].to_owned());
                let reply = match task {
                    Some(id) => {
                        let call = anthropic_tool_use_block(
                            &format!("tu_{id}_{done}"),
                            "task_update",
                            &json!({"task_id": id, "status": "completed", "result": "done"})
                                .to_string(),
                        );
                        Reply::ok(anthropic_message(&call, "tool_use", USAGE))
                    }
                    None => Reply::ok(anthropic_text("ok")),
                };
                fake.push_for(MODEL, reply);
                done += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    })
}

fn spawn_amy(team: &Team, url: &str) {
    let o = lead_cmd(
        team,
        url,
        &[
            "spawn",
            "amy",
            "--role",
            "worker",
            "--prompt",
            "work the board",
            "--model",
            MODEL,
            "--auto-claim",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

fn new_task(store: &TaskStore, subject: &str, blocked_by: &[&str]) -> String {
    store
        .create(NewTask {
            subject: subject.into(),
            blocked_by: blocked_by.iter().map(|s| s.to_string()).collect(),
            created_by: "lead".into(),
            ..NewTask::default()
        })
        .unwrap()
        .id
}

#[test]
fn a_completion_hook_that_exits_2_sends_the_task_back_once() {
    let team = Team::new();
    let fake = Arc::new(FakeLlm::start([]).patient(T));
    let url = fake.url();
    spawn_amy(&team, &url);
    let mark = team.workdir.join("failed-once");
    let log = team.workdir.join("stdin.jsonl");
    set_hooks(
        &team,
        vec![hook(
            HookEvent::TaskCompleted,
            fails_once(&mark, &log, "tests fail: fix the parser"),
        )],
    );
    let store = TaskStore::new(&team.dir);
    let a = new_task(&store, "write the parser", &[]);
    let b = new_task(&store, "use the parser", &[&a]);
    let stop = Arc::new(AtomicBool::new(false));
    let answering = responder(fake.clone(), stop.clone());
    let _lead = run_lead(&team, &url);
    wait_until(T, "both tasks completed", || {
        let all = store.list(None).ok()?;
        all.iter()
            .all(|t| t.status == TaskStatus::Completed)
            .then_some(())
    });
    stop.store(true, Ordering::SeqCst);
    answering.join().unwrap();

    let evs = events(&team);
    let ran: Vec<&Value> = evs
        .iter()
        .filter(|e| e["event"] == "hook_ran" && e["task"] == a.as_str())
        .collect();
    assert_eq!(
        ran.len(),
        2,
        "the hook ran {} times on {a}: {ran:?}",
        ran.len()
    );
    assert_eq!(ran[0]["code"], 2);
    assert_eq!(ran[0]["outcome"], "block");
    assert_eq!(ran[1]["outcome"], "proceed");
    // Sent back once, to in_progress, owned by amy; then completed for good.
    let ts = |event: &str, id: &str| -> Vec<f64> {
        evs.iter()
            .filter(|e| e["event"] == event && e["id"] == id)
            .filter_map(|e| e["ts"].as_f64())
            .collect()
    };
    let back = ts("task_sent_back", &a);
    assert_eq!(back.len(), 1, "sent back {} times", back.len());
    let done = ts("task_completed", &a);
    assert_eq!(done.len(), 1);
    assert!(back[0] < done[0]);
    let b_claims = ts("task_claimed", &b);
    assert_eq!(b_claims.len(), 1);
    assert!(
        b_claims[0] > done[0],
        "{b} was claimed before the hook passed {a}"
    );
    // The owner's model saw the hook's stderr.
    let told = fake.requests().iter().any(|r| {
        r.body["model"] == MODEL && r.body.to_string().contains("tests fail: fix the parser")
    });
    assert!(told, "amy never saw the hook's stderr");
    // The hook got the event on stdin.
    let docs: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(docs.len() >= 3, "{docs:?}"); // a twice, b once
    assert_eq!(docs[0]["event"], "task_completed");
    assert_eq!(docs[0]["task"]["id"], a.as_str());
    assert_eq!(docs[0]["task"]["owner"], "amy");
    let a_now = store.get(&a).unwrap();
    assert_eq!(a_now.owner.as_deref(), Some("amy"));
    assert!(a_now.completed_at.is_some());
}

#[test]
fn events_without_a_supervisor_are_hooked_when_lead_run_starts() {
    let team = Team::new();
    let fake = Arc::new(FakeLlm::start([]).patient(T));
    let url = fake.url();
    let created_log = team.workdir.join("created.jsonl");
    let completed_log = team.workdir.join("completed.jsonl");
    set_hooks(
        &team,
        vec![
            // Refuses tasks whose subject says "forbidden".
            hook(
                HookEvent::TaskCreated,
                format!(
                    "tee -a '{}' | grep -q forbidden && {{ echo 'no forbidden work' >&2; exit 2; }}; \
                     echo >> '{}'; exit 0",
                    created_log.display(),
                    created_log.display()
                ),
            ),
            hook(
                HookEvent::TaskCompleted,
                format!("cat >> '{}'; exit 0", completed_log.display()),
            ),
        ],
    );
    let store = TaskStore::new(&team.dir);
    let ok = new_task(&store, "allowed work", &[]);
    let bad = new_task(&store, "forbidden work", &[]);
    // Held: nobody may claim them before their hooks ran.
    assert!(store.get(&ok).unwrap().created_hook_pending);
    assert!(store.claimable(None).unwrap().is_empty());
    let refused = store.claim(Some(&ok), "amy", 1).unwrap_err().to_string();
    assert!(refused.contains("task_created hooks"), "{refused}");
    // A completion with no supervisor running is held as completing.
    let done = new_task(&store, "done while nobody watched", &[]);
    store.settle_created(&done, true, "").unwrap();
    store.claim(Some(&done), "amy", 1).unwrap();
    let t = store
        .update(&done, "amy", TaskStatus::Completed, Some("r".into()))
        .unwrap();
    assert_eq!(t.status, TaskStatus::Completing);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(store.get(&done).unwrap().status, TaskStatus::Completing);

    let _lead = run_lead(&team, &url);
    wait_until(T, "the hooks of every event", || {
        let ok_t = store.get(&ok).ok()?;
        let bad_t = store.get(&bad).ok()?;
        let done_t = store.get(&done).ok()?;
        (!ok_t.created_hook_pending
            && bad_t.status == TaskStatus::Cancelled
            && done_t.status == TaskStatus::Completed)
            .then_some(())
    });
    assert_eq!(store.get(&ok).unwrap().status, TaskStatus::Pending);
    let bad_t = store.get(&bad).unwrap();
    assert!(
        bad_t
            .result
            .as_deref()
            .unwrap_or("")
            .contains("no forbidden work"),
        "{bad_t:?}"
    );
    assert!(
        std::fs::read_to_string(&completed_log)
            .unwrap()
            .contains(&done)
    );
}

#[test]
fn an_idle_hook_that_exits_2_keeps_the_teammate_working() {
    let team = Team::new();
    let fake = Arc::new(FakeLlm::start([]).patient(T));
    let url = fake.url();
    let o = lead_cmd(
        &team,
        &url,
        &[
            "spawn", "amy", "--role", "worker", "--prompt", "say hi", "--model", MODEL,
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mark = team.workdir.join("idle-once");
    let log = team.workdir.join("idle.jsonl");
    set_hooks(
        &team,
        vec![hook(
            HookEvent::TeammateIdle,
            fails_once(&mark, &log, "the changelog is not updated"),
        )],
    );
    // Two activations: the task, then the hook's feedback.
    fake.push_for(MODEL, Reply::ok(anthropic_text("hi")));
    fake.push_for(MODEL, Reply::ok(anthropic_text("changelog updated")));
    let _lead = run_lead(&team, &url);
    wait_until(T, "the second activation", || {
        (fake.requests_for(MODEL) >= 2).then_some(())
    });
    let second = &fake
        .requests()
        .iter()
        .filter(|r| r.body["model"] == MODEL)
        .nth(1)
        .unwrap()
        .body
        .clone();
    assert!(
        second.to_string().contains("the changelog is not updated"),
        "{second}"
    );
    // The second idle runs the hook again, which passes: the mark is cleared.
    wait_until(T, "the idle hook settled", || {
        let m = team.member("amy");
        (m.status == troupe::config::MemberStatus::Idle
            && m.idle_hook_pending.is_none()
            && events(&team)
                .iter()
                .filter(|e| e["event"] == "hook_ran" && e["outcome"] == "proceed")
                .count()
                == 1)
            .then_some(())
    });
    let docs = std::fs::read_to_string(&log).unwrap();
    assert!(
        docs.contains("\"teammate_idle\"") && docs.contains("\"amy\""),
        "{docs}"
    );
    assert_eq!(fake.requests_for(MODEL), 2, "a third activation happened");
}
