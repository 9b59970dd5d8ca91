//! Issue 23, review 3 (N11, m9): what a `task_completed` hook's verdict does when the task or its
//! owner changed while the hook ran. Real `lead run` supervisors run the hooks; a gate file the
//! test opens decides when a hook's verdict lands, so each race is staged, not hoped for.
//!
//! - N11: a task its owner completed is held `completing` while the owner ends (killed, no
//!   restarts left: `failed`). A hook that then sends it back must leave it `pending` for
//!   anyone, not `in_progress` under an owner that will never run again.
//! - m9: a task reopened and completed again while the hook runs on its first completion: the
//!   first run's verdict must not settle the second completion.

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Stopping, Team, lead_cmd, wait_until};
use troupe::config::{MemberStatus, Roster};
use troupe::hooks::{Hook, HookEvent};
use troupe::tasks::{NewTask, TaskStatus, TaskStore};

const T: Duration = Duration::from_secs(60);
const MODEL: &str = "m-alice";

fn run_lead(team: &Team, url: &str, extra: &[&str]) -> Stopping {
    let mut args = vec!["run", "--stop-timeout", "1", "--kill-grace", "1"];
    args.extend_from_slice(extra);
    Stopping(
        lead_cmd(team, url, &args)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A `task_completed` hook that appends its stdin to `log`, touches `started`, waits for `gate`
/// to exist, then sends back (exit 2, "tests fail") a completion whose result is "bad" and
/// passes any other.
fn gated_hook(team: &Team, started: &Path, gate: &Path, log: &Path) {
    let command = format!(
        "doc=$(cat); printf '%s\\n' \"$doc\" >> '{log}'; touch '{started}'; \
         while [ ! -e '{gate}' ]; do sleep 0.05; done; \
         case \"$doc\" in *'\"result\":\"bad\"'*) echo 'tests fail' >&2; exit 2;; esac; exit 0",
        log = log.display(),
        started = started.display(),
        gate = gate.display(),
    );
    let hook = Hook {
        event: HookEvent::TaskCompleted,
        command,
        timeout_secs: Some(120),
        sandbox: true,
    };
    Roster::new(&team.dir)
        .update(move |c| {
            c.hooks = vec![hook.clone()];
            Ok(())
        })
        .unwrap();
}

fn events(team: &Team) -> Vec<Value> {
    std::fs::read_to_string(team.dir.events())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

/// The events named `event` about task `id`.
fn task_events(team: &Team, event: &str, id: &str) -> Vec<Value> {
    events(team)
        .into_iter()
        .filter(|e| e["event"] == event && e["id"] == id)
        .collect()
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

/// How many hook runs ended with `outcome` on task `id`.
fn hook_runs(team: &Team, id: &str, outcome: &str) -> usize {
    events(team)
        .iter()
        .filter(|e| e["event"] == "hook_ran" && e["task"] == id && e["outcome"] == outcome)
        .count()
}

#[test]
fn a_task_sent_back_after_its_owner_ended_is_pending_for_anyone() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    // Alice's first activation: she says ok and goes idle (her worker stays up).
    fake.push_for(MODEL, Reply::ok(anthropic_text("ok")));
    let o = lead_cmd(
        &team,
        &url,
        &[
            "spawn", "alice", "--role", "coder", "--prompt", "wait", "--model", MODEL,
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (started, gate) = (team.workdir.join("started"), team.workdir.join("gate"));
    let log = team.workdir.join("stdin.jsonl");
    gated_hook(&team, &started, &gate, &log);
    let store = TaskStore::new(&team.dir);
    // `bad` is sent back by the hook, `good` passed; each has a dependent.
    let bad = new_task(&store, "write it", &[]);
    let good = new_task(&store, "test it", &[]);
    let after_bad = new_task(&store, "document it", &[&bad]);
    let after_good = new_task(&store, "ship it", &[&good]);
    let _lead = run_lead(&team, &url, &["--max-restarts", "0"]);
    let (pid, incarnation) = wait_until(T, "alice running", || {
        let m = team.member("alice");
        m.pid
            .filter(|_| m.status == MemberStatus::Idle)
            .map(|p| (p, m.incarnation))
    });
    for (id, result) in [(&bad, "bad"), (&good, "good")] {
        store.claim(Some(id), "alice", incarnation).unwrap();
        let t = store
            .update(id, "alice", TaskStatus::Completed, Some(result.into()))
            .unwrap();
        assert_eq!(t.status, TaskStatus::Completing);
    }
    // The hook runs on `bad`: alice ends meanwhile, and the supervisor handles her exit.
    wait_until(T, "the hook on the first completion", || {
        started.exists().then_some(())
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_until(T, "alice handled as failed", || {
        events(&team)
            .iter()
            .any(|e| e["event"] == "failed" && e["name"] == "alice")
            .then_some(())
    });
    assert_eq!(team.status("alice"), MemberStatus::Failed);
    std::fs::write(&gate, "").unwrap();
    wait_until(T, "both verdicts applied", || {
        let settled = |id: &str| {
            store
                .get(id)
                .is_ok_and(|t| t.status != TaskStatus::Completing)
        };
        (hook_runs(&team, &bad, "block") == 1
            && hook_runs(&team, &good, "proceed") == 1
            && settled(&bad)
            && settled(&good))
        .then_some(())
    });

    // Sent back with nobody to take it back: pending, no owner, claimable by anyone.
    let b = store.get(&bad).unwrap();
    assert_eq!(
        (b.status, b.owner.as_deref()),
        (TaskStatus::Pending, None),
        "{b:?}"
    );
    let claimable: Vec<String> = store
        .claimable(Some("bob"))
        .unwrap()
        .into_iter()
        .map(|t| t.id)
        .collect();
    assert!(
        claimable.contains(&bad),
        "{bad} not claimable: {claimable:?}"
    );
    assert!(!claimable.contains(&after_bad), "{claimable:?}");
    // An event says why.
    let back = task_events(&team, "task_sent_back", &bad);
    assert_eq!(back.len(), 1, "{back:?}");
    assert_eq!(back[0]["status"], "pending", "{back:?}");
    assert_eq!(back[0]["released_from"], "alice", "{back:?}");
    assert!(
        back[0]["why"].as_str().unwrap_or("").contains("alice"),
        "{back:?}"
    );
    // And the lead hears it, with the hook's stderr.
    let heard = team
        .lead_inbox()
        .iter()
        .any(|m| m.content.contains(&bad) && m.content.contains("tests fail"));
    assert!(heard, "{:?}", team.lead_inbox());
    // The passed completion stands though its owner ended: its dependent is free.
    let g = store.get(&good).unwrap();
    assert_eq!(
        (g.status, g.owner.as_deref()),
        (TaskStatus::Completed, Some("alice"))
    );
    assert!(claimable.contains(&after_good), "{claimable:?}");
}

#[test]
fn a_verdict_on_an_earlier_completion_does_not_settle_a_later_one() {
    let team = Team::new();
    let fake = FakeLlm::start([]);
    let url = fake.url();
    let (started, gate) = (team.workdir.join("started"), team.workdir.join("gate"));
    let log = team.workdir.join("stdin.jsonl");
    gated_hook(&team, &started, &gate, &log);
    let store = TaskStore::new(&team.dir);
    let a = new_task(&store, "write it", &[]);
    let _lead = run_lead(&team, &url, &[]);
    store.claim(Some(&a), "amy", 1).unwrap();
    store
        .update(&a, "amy", TaskStatus::Completed, Some("bad".into()))
        .unwrap();
    // While the hook judges the first completion (and will send it back), the lead reopens
    // the task and amy completes it again, well this time.
    wait_until(T, "the hook on the first completion", || {
        started.exists().then_some(())
    });
    store.reopen(&a).unwrap();
    store.claim(Some(&a), "amy", 1).unwrap();
    let again = store
        .update(&a, "amy", TaskStatus::Completed, Some("good".into()))
        .unwrap();
    assert_eq!(again.status, TaskStatus::Completing);
    std::fs::write(&gate, "").unwrap();
    wait_until(T, "a verdict on the second completion", || {
        (store.get(&a).ok()?.status != TaskStatus::Completing).then_some(())
    });

    let t = store.get(&a).unwrap();
    assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
    assert_eq!(t.result.as_deref(), Some("good"));
    assert!(task_events(&team, "task_sent_back", &a).is_empty());
    // The first run's verdict was dropped, and said so; the second run passed it.
    let stale = task_events(&team, "task_verdict_stale", &a);
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert_eq!(hook_runs(&team, &a, "block"), 1);
    assert_eq!(hook_runs(&team, &a, "proceed"), 1);
    let docs = std::fs::read_to_string(&log).unwrap();
    assert_eq!(docs.lines().count(), 2, "{docs}");
}

/// A `task_completed` hook with `command`, run on a task completed by `amy` (no member of the
/// roster, so a send-back leaves it pending for anyone and tells the lead), under a `lead run`
/// started with `extra`; `ready` runs once the supervisor is ready, before the completion.
/// Returns the task's `task_sent_back` events once its verdict is applied.
fn sent_back_by(command: &str, extra: &[&str], ready: impl FnOnce(&Team)) -> (Team, Vec<Value>) {
    let team = Team::new();
    let fake = FakeLlm::start([]);
    let url = fake.url();
    let hook = Hook {
        event: HookEvent::TaskCompleted,
        command: command.to_owned(),
        timeout_secs: Some(60),
        sandbox: true,
    };
    Roster::new(&team.dir)
        .update(move |c| {
            c.hooks = vec![hook.clone()];
            Ok(())
        })
        .unwrap();
    let store = TaskStore::new(&team.dir);
    let a = new_task(&store, "make the suite pass", &[]);
    let lead = run_lead(&team, &url, extra);
    wait_until(T, "the supervisor ready", || {
        std::fs::read_to_string(team.dir.lead_lock())
            .ok()
            .filter(|l| l.contains("ready"))
            .map(|_| ())
    });
    ready(&team);
    store.claim(Some(&a), "amy", 1).unwrap();
    let t = store
        .update(&a, "amy", TaskStatus::Completed, Some("done".into()))
        .unwrap();
    assert_eq!(t.status, TaskStatus::Completing);
    wait_until(T, "the verdict", || {
        (store.get(&a).ok()?.status != TaskStatus::Completing).then_some(())
    });
    drop(lead);
    let t = store.get(&a).unwrap();
    assert_eq!(
        t.status,
        TaskStatus::Pending,
        "the completion went through: {t:?}"
    );
    assert_eq!(hook_runs(&team, &a, "block"), 1);
    let back = task_events(&team, "task_sent_back", &a);
    assert_eq!(back.len(), 1, "{back:?}");
    (team, back)
}

/// What the lead was told of sent-back task work.
fn lead_heard(team: &Team) -> String {
    team.lead_inbox()
        .iter()
        .map(|m| m.content.clone())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Review 4, m8: `cargo test --quiet` fails with 101, not 2; the docs' own example let a
/// failing suite through. Any non-zero exit sends the task back now, with the hook's stderr.
#[test]
fn a_completion_hook_exiting_101_sends_the_task_back() {
    let (team, _) = sent_back_by(
        "echo 'test result: FAILED. 3 passed; 1 failed' >&2; exit 101",
        &[],
        |_| {},
    );
    let heard = lead_heard(&team);
    assert!(heard.contains("test result: FAILED"), "{heard}");
}

/// A hook naming a program that is not there (sh: 127) is no pass.
#[test]
fn a_completion_hook_naming_a_missing_program_sends_the_task_back() {
    let (team, _) = sent_back_by("no-such-test-runner --quiet", &[], |_| {});
    let heard = lead_heard(&team);
    assert!(heard.contains("no-such-test-runner"), "{heard}");
    assert!(heard.contains("not found"), "{heard}");
}

/// Review 4, R4-11's second half: a hook that cannot start at all (here its working dir is
/// gone, so its sandbox cannot be set up in it) sends the task back with the reason.
#[test]
fn a_completion_hook_that_cannot_start_sends_the_task_back() {
    let gone = tempfile::tempdir().unwrap();
    let wd = gone.path().join("wd");
    std::fs::create_dir_all(&wd).unwrap();
    let wd_arg = wd.display().to_string();
    let (team, _) = sent_back_by("true", &["--workdir", &wd_arg], |_| {
        std::fs::remove_dir(&wd).unwrap();
    });
    let heard = lead_heard(&team);
    assert!(heard.contains("could not start"), "{heard}");
    let ran: Vec<Value> = events(&team)
        .into_iter()
        .filter(|e| e["event"] == "hook_ran")
        .collect();
    assert!(ran[0]["error"].is_string(), "{ran:?}");
}
