//! `lead demo --story board`: the task board, offline like the first story, on the cassette
//! `scripts/demo-board.cassette.jsonl` (embedded in the binary).
//!
//! The story: the demo, acting as the person, writes a `task_completed` hook into config.json
//! (a completed task's result names its files, and they must hold no `TODO`), spawns two
//! teammates with `--auto-claim` (ana, a coder; ben, a tester) and puts three tasks on the board:
//! "write the parser" for ana, "write the tests" for ben, and "update the docs" for ben, blocked
//! by both. Each teammate claims its task when it goes idle; ben finds the docs blocked and waits.
//! Ana's parser still holds a TODO, so the hook sends her completion back with its stderr; she
//! fixes the file and completes again, the hook passes it, and only then can ben claim the docs.
//! When the board is done the demo asks both to shut down. It prints the timeline from
//! `events.jsonl` as the first story does, then the status table and the task list.
//!
//! # What could race, and why it does not decide the story
//!
//! The cassette is replayed in its recorded order of turns (see [`troupe::llm::replay`]), which
//! orders the model calls of all processes but nothing that happens between them:
//!
//! - *Who claims what.* Every task is assigned (`owner`) when it is created, so only its owner
//!   may claim it; the claims are still made by the teammates' auto-claim, when they go idle or
//!   are woken by a board change. A wake-up is handled by the worker and never reaches the model,
//!   and every activation of the story ends with the model's own end of turn, so the resume a
//!   wake-up causes finds nothing to answer: however many arrive, and whenever, they cost no
//!   model call. (This is also why the story does not cap the calls per activation to end one
//!   right after a `task_update`: a wake-up would resume the cut-off activation with a call.)
//! - *The ids.* Task ids and request ids are random; the cassette names them as `{{task_id}}`
//!   and `{{request_id}}`.
//! - *The hook's verdict.* The supervisor runs the hook on its own thread as soon as ana's
//!   `task_update` holds the task as completing, while ana goes on with her activation. Her
//!   recorded answers are written to fit wherever the verdict lands: she checks her inbox
//!   (`read_inbox`) for it, then fixes the file, completes again and ends her turn, and the hook's
//!   message is the same to her whether it comes in the turn before the check, in the check's
//!   result or in a turn after it. What the story needs is that the verdict lands before her
//!   second `task_update` (until then the task is still completing and the update is refused),
//!   which the turn order puts five model calls after the first: two of ben's and three of hers.
//!   That is a margin, not a guarantee: the verdict (a `grep`, polled every 10 ms) came 10 to
//!   120 ms after the completion in runs under heavy load, five paced calls take half a second at
//!   the default pace, and the pace is kept at [`MIN_PACE_MS`] or more for this story. (The
//!   worker has no way to wait for a verdict, and the supervisor tells the owner before it puts
//!   the task back to `in_progress`, so no order of calls closes the gap.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use troupe::{eprintln, println};

use anyhow::Context;
use serde_json::Value;
use troupe::TeamDir;
use troupe::config::{MemberStatus, Roster};
use troupe::hooks::{Hook, HookEvent};
use troupe::ops::{self, SpawnSpec};
use troupe::requests::RequestStore;
use troupe::tasks::{NewTask, TaskStatus, TaskStore};
use troupe::teamdir::LEAD;
use troupe::wait::Signals;

use crate::chat::{self, OwnSupervisor};
use crate::demo::{self, DemoArgs, Line, Setup};

/// The cassette the board story replays.
const CASSETTE: &str = include_str!("../scripts/demo-board.cassette.jsonl");

/// The least "thinking" time per replayed call for this story: five of them are the margin the
/// hook's verdict has to land in (see the module docs).
pub const MIN_PACE_MS: u64 = 50;

/// The rule the team's `task_completed` hook enforces, as the hook prints it.
pub const RULE: &str = "board rule: a completed task leaves no TODO in the files its result names";

/// The `task_completed` hook: the files a completed task's result names (`*.py`, `*.md`) must
/// hold no `TODO`; otherwise it prints the offending lines and the rule and exits 2, which sends
/// the completion back to its owner.
fn hook_command() -> String {
    format!(
        "files=$(grep -o '\"result\":\"[^\"]*\"' | grep -oE '[A-Za-z0-9_./-]+[.](py|md)'); \
         [ -n \"$files\" ] || exit 0; \
         if grep -Hn TODO $files >&2; then echo '{RULE}' >&2; exit 2; fi"
    )
}

/// The teammates: name, role, prompt.
const MEMBERS: [(&str, &str, &str); 2] = [
    (
        "ana",
        "coder",
        "You work tasks from the team's board. A task you claim arrives as \"You claimed task \
         ...\": do it in the working directory, then call task_update with status completed and \
         a result that names the files you changed. If the team's hook sends a task back, fix \
         what it says and complete the task again.",
    ),
    (
        "ben",
        "tester",
        "You write tests and docs from the team's board. A task you claim arrives as \"You \
         claimed task ...\": do it in the working directory, then call task_update with status \
         completed and a result that names the files you changed. If the team's hook sends a \
         task back, fix what it says and complete the task again.",
    ),
];

/// The board: subject, description, owner, and the indexes (in this list) of its blockers.
const TASKS: [(&str, &str, &str, &[usize]); 3] = [
    (
        "write the parser",
        "settings.py: parse(text) turns `key = value` lines into a dict; blank lines and lines \
         starting with # are skipped.",
        "ana",
        &[],
    ),
    (
        "write the tests",
        "test_settings.py: unittest cases for parse(text) in settings.py, including blank and \
         comment lines.",
        "ben",
        &[],
    ),
    (
        "update the docs",
        "README.md: say what settings.py does and how to run the tests.",
        "ben",
        &[0, 1],
    ),
];

/// The exit code of a demo stopped by SIGINT or SIGTERM, as `lead chat -p`'s.
const EXIT_INTERRUPTED: u8 = 130;

/// How long the team has to work the board, and then to shut down.
const WORK_DEADLINE: Duration = Duration::from_secs(90);
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(30);

pub fn run(mut a: DemoArgs) -> anyhow::Result<u8> {
    a.pace_ms = a.pace_ms.max(MIN_PACE_MS);
    let setup = Setup::new(&a, "demo-board.cassette.jsonl", CASSETTE)?;
    // Fail early, with the documented exit code, when no provider is configured.
    if let Err(e) = setup.env.provider() {
        eprintln!("lead: {e}");
        return Ok(e.exit_code());
    }
    setup.announce(a.live);
    let Setup {
        dir,
        team,
        workdir,
        env,
    } = setup;
    println!(
        "the person sets a task_completed hook ({RULE}), spawns two auto-claiming teammates and \
         puts three tasks on the board\n"
    );
    let started = Instant::now();
    let signals = Signals::install().context("failed to install signal handlers")?;
    let stop = Arc::new(AtomicBool::new(false));
    // Nobody else speaks in this story: the timeline is the event log.
    let (_said, heard) = mpsc::channel::<Line>();
    let tail = {
        let (team, stop) = (team.clone(), stop.clone());
        let t0 = troupe::fsutil::now();
        std::thread::spawn(move || {
            let timeline = Timeline::new(&team);
            demo::follow(&team, t0, &heard, &stop, &|e, r| timeline.line(e, r));
        })
    };
    let result = (|| -> anyhow::Result<()> {
        set_up_board(&team)?;
        let own = OwnSupervisor::start_if_needed(&team, &workdir, &a.sandbox, &env)?;
        let worked = work_and_shut_down(&team, &signals);
        if let Some(own) = own {
            own.stop()?;
        }
        worked
    })();
    stop.store(true, Ordering::SeqCst);
    let _ = tail.join();
    println!();
    crate::commands::status_table(&team)?;
    println!();
    let tasks = TaskStore::new(&team).list(None)?;
    crate::tasks::table(&tasks);
    println!("\nfiles in {}", dir.display());
    if let Err(e) = result {
        eprintln!("lead: the board demo did not finish: {e:#}");
        return Ok(if signals.term.load(Ordering::SeqCst) {
            EXIT_INTERRUPTED
        } else {
            1
        });
    }
    let cfg = Roster::new(&team).load()?;
    if let Some(what) = demo::unfinished(&cfg.members) {
        eprintln!("lead: the demo did not end with every teammate shut down ({what})");
        return Ok(1);
    }
    if let Some(t) = tasks.iter().find(|t| t.status != TaskStatus::Completed) {
        eprintln!(
            "lead: the demo ended with task {} ({}) {}",
            t.id, t.subject, t.status
        );
        return Ok(1);
    }
    println!("demo complete in {:.1} s", started.elapsed().as_secs_f64());
    Ok(0)
}

/// The hook, the teammates and the tasks, before any supervisor runs: the teammates wait in
/// `spawning`, and find their tasks on the board when they first go idle.
fn set_up_board(team: &TeamDir) -> anyhow::Result<()> {
    let hook = Hook {
        event: HookEvent::TaskCompleted,
        command: hook_command(),
        timeout_secs: Some(20),
        sandbox: true,
    };
    Roster::new(team).update(move |c| {
        c.hooks = vec![hook];
        Ok(())
    })?;
    for (name, role, prompt) in MEMBERS {
        ops::spawn(
            team,
            &SpawnSpec {
                name: name.into(),
                role: role.into(),
                prompt: prompt.into(),
                model: None,
                require_plan_approval: false,
                auto_claim: true,
                budget_usd: None,
                budget_tokens: None,
                worktree: false,
                host: None,
            },
        )?;
    }
    let store = TaskStore::new(team);
    let mut ids: Vec<String> = Vec::new();
    for (subject, description, owner, blockers) in TASKS {
        let t = store.create(NewTask {
            subject: subject.into(),
            description: description.into(),
            blocked_by: blockers.iter().map(|&i| ids[i].clone()).collect(),
            owner: Some(owner.into()),
            created_by: LEAD.into(),
        })?;
        ids.push(t.id);
    }
    Ok(())
}

/// Waits until every task is completed and every teammate idle, asks each to shut down, and
/// waits until they have. Fails on a signal, a failed teammate or a deadline.
fn work_and_shut_down(team: &TeamDir, signals: &Signals) -> anyhow::Result<()> {
    let store = TaskStore::new(team);
    let roster = Roster::new(team);
    wait_for(signals, WORK_DEADLINE, "the board to be done", || {
        let cfg = roster.load().ok()?;
        let tasks = store.list(None).ok()?;
        let done = tasks.iter().all(|t| t.status == TaskStatus::Completed);
        let idle = cfg.members.iter().all(|m| m.status == MemberStatus::Idle);
        Some(done && idle)
    })?;
    for (name, _, _) in MEMBERS {
        ops::request_shutdown(
            team,
            name,
            "The board is done: every task is completed.",
            ops::SHUTDOWN_TTL,
        )?;
    }
    // Shut down by their own hand, then reaped by the supervisor (which records the exit).
    wait_for(
        signals,
        SHUTDOWN_DEADLINE,
        "the teammates to shut down",
        || {
            let cfg = roster.load().ok()?;
            Some(
                cfg.members
                    .iter()
                    .all(|m| m.status.is_terminal() && m.last_exit.is_some()),
            )
        },
    )
}

/// Polls `done` every 20 ms until it says `Some(true)`; fails on a signal, when a teammate has
/// failed, or after `limit`.
fn wait_for(
    signals: &Signals,
    limit: Duration,
    what: &str,
    mut done: impl FnMut() -> Option<bool>,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        if done() == Some(true) {
            return Ok(());
        }
        if signals.term.load(Ordering::SeqCst) {
            anyhow::bail!("interrupted while waiting for {what}");
        }
        if Instant::now() >= deadline {
            anyhow::bail!("gave up waiting for {what} after {} s", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The board story's timeline: the task and hook events in words, the rest as in the first
/// story.
struct Timeline {
    store: TaskStore,
    /// The stderr of the last hook that blocked each task, for the line that sends it back
    /// (`hook_ran` is logged before `task_sent_back`).
    blocked: Mutex<std::collections::HashMap<String, String>>,
}

impl Timeline {
    fn new(team: &TeamDir) -> Timeline {
        Timeline {
            store: TaskStore::new(team),
            blocked: Mutex::new(Default::default()),
        }
    }

    /// `task ID "subject"`.
    fn task(e: &Value) -> String {
        let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("?");
        format!("task {} \"{}\"", s("id"), s("subject"))
    }

    fn line(&self, e: &Value, requests: &RequestStore) -> Option<(String, String)> {
        let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
        let owner = e
            .get("owner")
            .and_then(Value::as_str)
            .unwrap_or(LEAD)
            .to_owned();
        let (who, text) = match s("event").as_str() {
            "spawn_requested" => (
                s("name"),
                format!("joins as {}, claiming its tasks on its own", s("role")),
            ),
            "task_created" => {
                let blockers: Vec<&str> = e
                    .get("blocked_by")
                    .and_then(Value::as_array)
                    .map(|b| b.iter().filter_map(Value::as_str).collect())
                    .unwrap_or_default();
                let waits = if blockers.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", BLOCKED by {}: nobody can claim it before they are completed",
                        blockers.join(" and ")
                    )
                };
                (
                    s("by"),
                    format!("adds {} for {owner}{waits}", Self::task(e)),
                )
            }
            "task_claimed" => {
                let blocked = self
                    .store
                    .get(&s("id"))
                    .is_ok_and(|t| !t.blocked_by.is_empty());
                (
                    owner,
                    format!(
                        "claims {}{}",
                        Self::task(e),
                        if blocked {
                            " now that its blockers are completed"
                        } else {
                            ""
                        }
                    ),
                )
            }
            "task_updated" => {
                let what = match s("status").as_str() {
                    "completing" => {
                        "marks {} completed (held as completing until the hook passes it)"
                    }
                    "completed" => "completes {}",
                    "pending" => "gives {} back",
                    _ => return None,
                };
                (s("by"), what.replace("{}", &Self::task(e)))
            }
            "hook_ran" => {
                if s("outcome") == "block" {
                    self.blocked
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(s("task"), s("stderr"));
                    return None;
                }
                if s("outcome") == "ignored" {
                    return Some((
                        "hook".into(),
                        format!(
                            "{} hook failed (ignored): {}",
                            s("hook"),
                            s("stderr").trim()
                        ),
                    ));
                }
                return None;
            }
            "task_sent_back" => {
                let said = self
                    .blocked
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&s("id"))
                    .unwrap_or_default();
                (
                    "hook".into(),
                    format!(
                        "exits 2: SENDS {} BACK to {owner}, in_progress again. The hook said:\n{}",
                        Self::task(e),
                        said.lines()
                            .take(6)
                            .map(|l| chat::one_line(l, 120))
                            .collect::<Vec<_>>()
                            .join("\n")
                    ),
                )
            }
            "task_completed" => (
                "hook".into(),
                format!("passes {}: COMPLETED", Self::task(e)),
            ),
            // The hook's message to the owner: the line above says it.
            "message" if s("text").starts_with("The task_completed hook sent task") => {
                return None;
            }
            _ => return demo::event_line(e, requests),
        };
        Some((who, text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};

    /// Runs the hook in `dir` on a `task_completed` event whose task has `result`, as the
    /// supervisor does (the event as one JSON document on stdin); returns (exit code, stderr).
    fn run_hook(dir: &std::path::Path, result: Option<&str>) -> (Option<i32>, String) {
        let event = serde_json::json!({
            "event": "task_completed",
            "task": {"id": "0a1b2c3d", "subject": "write the parser", "status": "completing",
                     "description": "settings.py: parse(text)", "result": result},
            "team_dir": "/x/.team",
        });
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(hook_command())
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(event.to_string().as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    #[test]
    fn the_hook_blocks_a_todo_in_the_files_the_result_names_only() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(
            tmp.path().join("settings.py"),
            "x = 1\n    # TODO: comments\n",
        )
        .unwrap();
        std::fs::write(tmp.path().join("README.md"), "# settings\n").unwrap();
        let (code, stderr) = run_hook(tmp.path(), Some("settings.py: parse(text) reads lines."));
        assert_eq!(code, Some(2), "{stderr}");
        assert_eq!(
            stderr,
            format!("settings.py:2:    # TODO: comments\n{RULE}\n")
        );
        // A file the result does not name, no file named, no result: it passes.
        for result in [Some("README.md: the docs"), Some("nothing to name"), None] {
            let (code, stderr) = run_hook(tmp.path(), result);
            assert_eq!(code, Some(0), "{result:?}: {stderr}");
        }
        // Fixed, it passes too.
        std::fs::write(tmp.path().join("settings.py"), "x = 1\n").unwrap();
        let (code, stderr) = run_hook(tmp.path(), Some("README.md: what settings.py is for"));
        assert_eq!((code, stderr.as_str()), (Some(0), ""));
    }
}
