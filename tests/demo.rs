//! `lead demo` on the shipped cassettes, as a new user runs it: no API key, no network. Every
//! step of each story must be in `events.jsonl` and in the printed timeline.

mod support;

use std::process::Command;

use serde_json::Value;
use troupe::TeamDir;
use troupe::config::{MemberStatus, Roster};
use troupe::requests::{RequestKind, RequestStatus, RequestStore};
use troupe::tasks::{TaskStatus, TaskStore};

#[test]
fn demo_runs_the_whole_scenario_offline() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lead"));
    cmd.args(["demo", "--dir"]).arg(&dir);
    for var in support::team::CLEARED_ENV {
        cmd.env_remove(var);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");

    let team = TeamDir::open(dir.join(".team")).unwrap();
    let events = troupe::events::read_all(&team).unwrap();
    let count = |pred: &dyn Fn(&Value) -> bool| events.iter().filter(|e| pred(e)).count();
    let is = |e: &Value, event: &str, name: &str| e["event"] == event && e["name"] == name;
    // The lead spawns a coder (plan approval required) and a tester.
    assert_eq!(
        count(&|e| is(e, "spawn_requested", "coder") && e["require_plan_approval"] == true),
        1
    );
    assert_eq!(count(&|e| is(e, "spawn_requested", "tester")), 1);
    assert_eq!(count(&|e| e["event"] == "spawn"), 2);
    // Plan rejected with feedback, resubmitted, approved.
    assert_eq!(count(&|e| is(e, "plan_submitted", "coder")), 2);
    assert_eq!(
        count(&|e| is(e, "plan_rejected", "coder")
            && e["feedback"]
                .as_str()
                .is_some_and(|f| f.contains("fizzbuzz(n)"))),
        1
    );
    assert_eq!(count(&|e| is(e, "plan_approved", "coder")), 1);
    // The coder writes the file with its tools and tells the tester, who reads it and reports.
    assert_eq!(
        count(&|e| is(e, "tool", "coder")
            && e["tool"] == "write_file"
            && e["detail"] == "fizzbuzz.py"
            && e["ok"] == true),
        1
    );
    assert_eq!(
        count(&|e| e["event"] == "message" && e["from"] == "coder" && e["to"] == "tester"),
        1
    );
    assert_eq!(
        count(&|e| is(e, "tool", "tester") && e["tool"] == "read_file" && e["ok"] == true),
        1
    );
    assert_eq!(
        count(&|e| e["event"] == "message" && e["from"] == "tester" && e["to"] == "lead"),
        1
    );
    // Shutdowns: the coder approves; the tester rejects once, then approves. Both exit 0.
    assert_eq!(count(&|e| e["event"] == "shutdown_requested"), 3);
    assert_eq!(
        count(&|e| is(e, "shutdown_response", "coder") && e["approve"] == true),
        1
    );
    assert_eq!(
        count(&|e| is(e, "shutdown_response", "tester") && e["approve"] == false),
        1
    );
    assert_eq!(
        count(&|e| is(e, "shutdown_response", "tester") && e["approve"] == true),
        1
    );
    assert_eq!(count(&|e| e["event"] == "exit" && e["code"] == 0), 2);
    assert_eq!(count(&|e| e["event"] == "exit"), 2, "no other exit");

    // The files agree.
    let src = std::fs::read_to_string(dir.join("work/fizzbuzz.py")).unwrap();
    assert!(src.contains("def fizzbuzz(n)"), "{src}");
    let cfg = Roster::new(&team).load().unwrap();
    for name in ["coder", "tester"] {
        let m = cfg.require(name).unwrap();
        assert_eq!(m.status, MemberStatus::Shutdown, "{name}");
        assert_eq!(m.last_exit.as_ref().and_then(|e| e.code), Some(0), "{name}");
    }
    let reqs = RequestStore::new(&team).list(None).unwrap();
    let by = |kind: RequestKind, status: RequestStatus| {
        reqs.iter()
            .filter(|r| r.kind == kind && r.status == status)
            .count()
    };
    assert_eq!(by(RequestKind::PlanApproval, RequestStatus::Rejected), 1);
    assert_eq!(by(RequestKind::PlanApproval, RequestStatus::Approved), 1);
    assert_eq!(by(RequestKind::Shutdown, RequestStatus::Rejected), 1);
    assert_eq!(by(RequestKind::Shutdown, RequestStatus::Approved), 2);
    assert_eq!(reqs.len(), 5, "nothing else, nothing pending: {reqs:?}");

    // The printed timeline shows the same steps, then the status table.
    for want in [
        "asked for by the lead as coder, plan approval required",
        "REJECTS plan",
        "APPROVES plan",
        "write_file fizzbuzz.py",
        "-> tester:",
        "read_file fizzbuzz.py",
        "-> lead:",
        "REJECTS shutdown",
        "APPROVES shutdown",
        "process exited with code 0",
        "demo complete",
    ] {
        assert!(stdout.contains(want), "timeline lacks {want:?}:\n{stdout}");
    }
    assert!(stdout.contains("NAME") && stdout.contains("shutdown"));
}

#[test]
fn the_board_story_blocks_a_task_and_sends_one_completion_back() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lead"));
    cmd.args(["demo", "--story", "board", "--dir"]).arg(&dir);
    for var in support::team::CLEARED_ENV {
        cmd.env_remove(var);
    }
    let started = std::time::Instant::now();
    let out = cmd.output().unwrap();
    let took = started.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    eprintln!("lead demo --story board took {:.2} s", took.as_secs_f64());

    let team = TeamDir::open(dir.join(".team")).unwrap();
    let events = troupe::events::read_all(&team).unwrap();
    let tasks = TaskStore::new(&team).list(None).unwrap();
    let by_subject = |subject: &str| {
        tasks
            .iter()
            .find(|t| t.subject == subject)
            .unwrap_or_else(|| panic!("no task {subject:?}: {tasks:?}"))
    };
    let (parser, tests, docs) = (
        by_subject("write the parser"),
        by_subject("write the tests"),
        by_subject("update the docs"),
    );
    assert_eq!(tasks.len(), 3, "{tasks:?}");
    for t in &tasks {
        assert_eq!(t.status, TaskStatus::Completed, "{t:?}");
    }
    assert_eq!(parser.owner.as_deref(), Some("ana"));
    assert_eq!(tests.owner.as_deref(), Some("ben"));
    assert_eq!(docs.owner.as_deref(), Some("ben"));
    assert_eq!(docs.blocked_by, vec![parser.id.clone(), tests.id.clone()]);

    // The times of `event` on task `id`.
    let ts = |event: &str, id: &str| -> Vec<f64> {
        events
            .iter()
            .filter(|e| e["event"] == event && e["id"] == id)
            .filter_map(|e| e["ts"].as_f64())
            .collect()
    };
    // Each task claimed once, by its owner; the docs only after both blockers completed.
    for t in &tasks {
        assert_eq!(ts("task_claimed", &t.id).len(), 1, "{}", t.subject);
        assert_eq!(ts("task_completed", &t.id).len(), 1, "{}", t.subject);
    }
    let docs_claimed = ts("task_claimed", &docs.id)[0];
    for blocker in [parser, tests] {
        let done = ts("task_completed", &blocker.id)[0];
        assert!(
            docs_claimed > done,
            "the docs were claimed before {:?} completed",
            blocker.subject
        );
    }
    // The hook sent the parser back once, with its stderr, and passed the second completion.
    let back = ts("task_sent_back", &parser.id);
    assert_eq!(back.len(), 1, "sent back {} times", back.len());
    assert!(back[0] < ts("task_completed", &parser.id)[0]);
    let sent_back: usize = events
        .iter()
        .filter(|e| e["event"] == "task_sent_back")
        .count();
    assert_eq!(sent_back, 1, "only the parser is sent back");
    let blocked: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "hook_ran" && e["outcome"] == "block")
        .collect();
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    assert_eq!(blocked[0]["task"], parser.id.as_str());
    let said = blocked[0]["stderr"].as_str().unwrap();
    assert!(
        said.contains("settings.py:8:") && said.contains("TODO"),
        "{said}"
    );
    assert_eq!(
        events
            .iter()
            .filter(|e| e["event"] == "hook_ran" && e["outcome"] == "proceed")
            .count(),
        3,
        "the hook passes the other completions"
    );
    // Ana's model heard why: the hook's words reached her transcript.
    let journal = std::fs::read_to_string(team.root().join("transcripts/ana.jsonl")).unwrap();
    assert!(journal.contains("sent task") && journal.contains("# TODO: skip comment lines"));

    // The files: the fix landed, the docs exist.
    let src = std::fs::read_to_string(dir.join("work/settings.py")).unwrap();
    assert!(
        !src.contains("TODO") && src.contains("startswith(\"#\")"),
        "{src}"
    );
    assert!(dir.join("work/test_settings.py").exists());
    assert!(dir.join("work/README.md").exists());
    // Both teammates shut down through the protocol, exit 0.
    let cfg = Roster::new(&team).load().unwrap();
    for name in ["ana", "ben"] {
        let m = cfg.require(name).unwrap();
        assert_eq!(m.status, MemberStatus::Shutdown, "{name}");
        assert_eq!(m.last_exit.as_ref().and_then(|e| e.code), Some(0), "{name}");
    }
    assert_eq!(events.iter().filter(|e| e["event"] == "exit").count(), 2);

    // The printed timeline tells the same story, then the status table and the task list.
    for want in [
        "BLOCKED by",
        "marks task",
        "held as completing",
        &format!("SENDS task {} \"write the parser\" BACK to ana", parser.id),
        "# TODO: skip comment lines starting with #",
        "board rule: a completed task leaves no TODO",
        "edit_file settings.py",
        &format!(
            "claims task {} \"update the docs\" now that its blockers",
            docs.id
        ),
        "COMPLETED",
        "APPROVES shutdown",
        "demo complete",
    ] {
        assert!(stdout.contains(want), "timeline lacks {want:?}:\n{stdout}");
    }
    let sent_at = stdout.find("BACK to ana").unwrap();
    let claimed_at = stdout.find("\"update the docs\" now that").unwrap();
    assert!(sent_at < claimed_at, "{stdout}");
    assert!(
        stdout.contains("NAME") && stdout.contains("BLOCKED_BY"),
        "{stdout}"
    );
}
