//! Issue 13, acceptance 1: two auto-claiming teammates work a board of 20 tasks with
//! dependencies, through the real `lead` and workers and the fake LLM server, whose model
//! completes whatever task it is told it claimed: every task is claimed exactly once, none
//! before its blockers completed, all completed; the same with a `kill -9` of a claimer in the
//! middle of a task.

mod support;

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block, last_user_text,
};
use support::team::{Stopping, Team, lead_cmd, wait_until};
use troupe::tasks::{NewTask, TaskStatus, TaskStore};

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;
const MODELS: [&str; 2] = ["m-amy", "m-bob"];

/// Answers each model's requests as a diligent teammate would: a claimed task is completed at
/// once; anything else gets a short text. Runs until `stop`.
fn responder(fake: Arc<FakeLlm>, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut answered: HashMap<&str, usize> = HashMap::new();
        while !stop.load(Ordering::SeqCst) {
            let reqs = fake.requests();
            for model in MODELS {
                let mine: Vec<&Value> = reqs
                    .iter()
                    .map(|r| &r.body)
                    .filter(|b| b["model"] == model)
                    .collect();
                let done = answered.entry(model).or_default();
                while *done < mine.len() {
                    let text = last_user_text(mine[*done]);
                    // A claimed task is completed at once; and, as a careful model does, an
                    // update a restart cut short (its effect unknown) is made again.
                    let task = match text.find("You claimed task ") {
                        Some(at) if !text.contains("tool_result") => {
                            Some(text[at + 17..at + 25].to_owned())
                        }
                        _ if text.contains("the worker restarted before this tool finished") => {
                            last_update(mine[*done])
                        }
                        _ => None,
                    };
                    let reply = match task.as_deref() {
                        Some(id) => {
                            let call = anthropic_tool_use_block(
                                &format!("tu_{id}_{}", *done),
                                "task_update",
                                &json!({"task_id": id, "status": "completed", "result": format!("did {id}")})
                                    .to_string(),
                            );
                            Reply::ok(anthropic_message(&call, "tool_use", USAGE))
                        }
                        _ => Reply::ok(anthropic_text("ok")),
                    };
                    fake.push_for(model, reply);
                    *done += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    })
}

/// The task id of the last `task_update` the model asked for in a request's conversation.
fn last_update(body: &Value) -> Option<String> {
    body["messages"].as_array()?.iter().rev().find_map(|m| {
        m["content"].as_array()?.iter().rev().find_map(|b| {
            (b["type"] == "tool_use" && b["name"] == "task_update")
                .then(|| b["input"]["task_id"].as_str().map(str::to_owned))
                .flatten()
        })
    })
}

/// 20 tasks: 4 chains of 5, each task blocked by the one before it in its chain, and the
/// first of each chain after the 2nd's first, so the order is partly forced.
fn board(store: &TaskStore) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for chain in 0..4 {
        let mut prev: Option<String> = None;
        for step in 0..5 {
            let mut blocked_by: Vec<String> = prev.iter().cloned().collect();
            if step == 0 && chain > 0 {
                blocked_by.push(ids[0].clone());
            }
            let t = store
                .create(NewTask {
                    subject: format!("chain {chain} step {step}"),
                    description: String::new(),
                    blocked_by,
                    owner: None,
                    created_by: "lead".into(),
                })
                .unwrap();
            prev = Some(t.id.clone());
            ids.push(t.id);
        }
    }
    ids
}

fn run_board(kill_a_claimer: bool) {
    let team = Team::new();
    let fake = Arc::new(FakeLlm::start([]).patient(T));
    let url = fake.url();
    for (name, model) in [("amy", MODELS[0]), ("bob", MODELS[1])] {
        let o = lead_cmd(
            &team,
            &url,
            &[
                "spawn",
                name,
                "--role",
                "worker",
                "--prompt",
                "work the board",
                "--model",
                model,
                "--auto-claim",
            ],
        )
        .output()
        .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let store = TaskStore::new(&team.dir);
    let ids = board(&store);
    let stop = Arc::new(AtomicBool::new(false));
    let answering = responder(fake.clone(), stop.clone());
    let _lead = Stopping(
        lead_cmd(
            &team,
            &url,
            &[
                "run",
                "--restart-delay",
                "0.1",
                "--stop-timeout",
                "1",
                "--kill-grace",
                "1",
            ],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    if kill_a_claimer {
        // Kill amy while she owns a task in progress.
        let pid = wait_until(T, "amy working on a task", || {
            let owns = store
                .list(Some(TaskStatus::InProgress))
                .ok()?
                .iter()
                .any(|t| t.owner.as_deref() == Some("amy"));
            let pid = team.member("amy").pid?;
            owns.then_some(pid)
        });
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let tasks = store.list(None).unwrap();
        if tasks.iter().all(|t| t.status == TaskStatus::Completed) {
            break;
        }
        if std::time::Instant::now() > deadline {
            // What a rare hang looks like (seen twice under load, not reproduced since): the
            // board, the roster and the tails of the claimers' transcripts, inboxes and logs.
            for t in &tasks {
                eprintln!("{} {} {:?} {:?}", t.id, t.status, t.owner, t.blocked_by);
            }
            eprintln!("{}", std::fs::read_to_string(team.dir.config()).unwrap());
            for n in ["amy", "bob"] {
                let tr = std::fs::read_to_string(
                    team.dir
                        .transcript(&troupe::AgentName::teammate(n).unwrap()),
                )
                .unwrap_or_default();
                let tail: Vec<&str> = tr.lines().rev().take(8).collect();
                eprintln!(
                    "== {n} transcript tail:\n{}",
                    tail.into_iter()
                        .rev()
                        .map(|l| &l[..l.len().min(300)])
                        .collect::<Vec<_>>()
                        .join("\n")
                );
                let inbox = team.dir.inbox(&troupe::AgentName::teammate(n).unwrap());
                eprintln!(
                    "inbox {n}: {:?} offset {:?}",
                    std::fs::metadata(&inbox).map(|m| m.len()),
                    std::fs::read_to_string(inbox.with_extension("offset"))
                );
                eprintln!(
                    "log {n}: {}",
                    std::fs::read_to_string(team.dir.log(&troupe::AgentName::teammate(n).unwrap()))
                        .unwrap_or_default()
                        .lines()
                        .rev()
                        .take(5)
                        .collect::<Vec<_>>()
                        .join(" | ")
                );
            }
            panic!("timed out waiting for every task completed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::SeqCst);
    answering.join().unwrap();
    let events: Vec<Value> = std::fs::read_to_string(team.dir.events())
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let at = |event: &str, id: &str| -> Vec<f64> {
        events
            .iter()
            .filter(|e| e["event"] == event && e["id"] == id)
            .filter(|e| event != "task_updated" || e["status"] == "completed")
            .filter_map(|e| e["ts"].as_f64())
            .collect()
    };
    if std::env::var_os("AUTO_CLAIM_DEBUG").is_some() {
        let t0 = events[0]["ts"].as_f64().unwrap();
        for e in &events {
            eprintln!(
                "{:8.3} {} {} {}",
                e["ts"].as_f64().unwrap() - t0,
                e["event"],
                e["name"],
                e["id"]
            );
        }
    }
    // The event of a claim is written after the claim: a claimer killed between the two leaves
    // its task claimed (and finishes it after its restart) with no event. At most one such
    // task, amy's, and only when she was killed.
    let mut unlogged = 0;
    for id in &ids {
        let claims = at("task_claimed", id);
        let t = store.get(id).unwrap();
        if claims.is_empty() && kill_a_claimer && t.owner.as_deref() == Some("amy") {
            unlogged += 1;
            continue;
        }
        assert_eq!(claims.len(), 1, "task {id} claimed {} times", claims.len());
        // When the blocker completed is its `completed_at`, stamped under its lock before the
        // write a claimer reads: its `task_updated` event is appended after that write, and
        // may land after the claim's own event.
        for b in &t.blocked_by {
            let blocker = store.get(b).unwrap();
            assert!(
                !at("task_updated", b).is_empty()
                    && blocker.completed_at.is_some_and(|done| done <= claims[0]),
                "task {id} was claimed before its blocker {b} completed"
            );
        }
    }
    assert!(unlogged <= 1, "{unlogged} claims without their event");
    if kill_a_claimer {
        assert!(team.member("amy").restarts >= 1, "amy was not restarted");
    }
}

#[test]
fn two_claimers_work_a_board_with_dependencies() {
    run_board(false);
}

#[test]
fn a_claimer_killed_mid_task_finishes_it_after_its_restart() {
    run_board(true);
}
