//! `lead demo` on the shipped cassette, as a new user runs it: no API key, no network. Every
//! step of the scenario must be in `events.jsonl` and in the printed timeline.

mod support;

use std::process::Command;

use serde_json::Value;
use troupe::TeamDir;
use troupe::config::{MemberStatus, Roster};
use troupe::requests::{RequestKind, RequestStatus, RequestStore};

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
