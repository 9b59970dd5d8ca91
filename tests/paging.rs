//! Issue 25's "a person paged": a request pending past `lead run --escalate-after` runs the
//! team's `request_pending` hooks once, with the request on stdin, and not again when `lead
//! run` restarts after the hook's record; an answered request pages nobody. A paging hook runs
//! from `/` and may name no file a member can write (see tests/hook_containment.rs), so the
//! page is written outside the team's trees.

mod support;

use std::process::{Command, Output};
use std::time::Duration;

use support::team::{Bg, Team, lead_cmd as lead, start_supervisor, wait_until};
use troupe::requests::{NewRequest, RequestKind, RequestStatus, RequestStore};

const T: Duration = Duration::from_secs(30);

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn supervise(team: &Team) -> Bg {
    start_supervisor(
        team,
        lead(
            team,
            "http://127.0.0.1:9",
            &["run", "--escalate-after", "2"],
        ),
    )
}

fn stop(mut sup: Bg) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sup.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let _ = sup.0.wait();
}

fn plan(store: &RequestStore) -> String {
    store
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "ann".into(),
            to: "lead".into(),
            payload: serde_json::json!({"plan": "rewrite it all"}),
            target_incarnation: None,
            ttl: None,
        })
        .unwrap()
        .request_id
}

fn pages(log: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_plan_waiting_past_escalate_after_pages_once_across_a_restart() {
    let team = Team::new();
    let outside = tempfile::tempdir().unwrap();
    let log = outside.path().join("paged.jsonl");
    std::fs::write(
        team.workdir.join("team.toml"),
        format!(
            "[[hooks]]\nevent = \"request_pending\"\ncommand = \"cat >> {l}; echo >> {l}\"\n",
            l = log.display()
        ),
    )
    .unwrap();
    let o = out(&mut lead(&team, "http://127.0.0.1:9", &["up", "team.toml"]));
    assert!(o.status.success(), "{o:?}");
    let store = RequestStore::new(&team.dir);
    let waiting = plan(&store);
    let answered = plan(&store);
    store
        .resolve(&answered, "lead", true, serde_json::json!({}))
        .unwrap();

    let sup = supervise(&team);
    wait_until(T, "the page", || (!pages(&log).is_empty()).then_some(()));
    wait_until(T, "the page recorded", || {
        store.get(&waiting).unwrap().paged_at.map(|_| ())
    });
    let p = &pages(&log)[0];
    assert_eq!(p["request_id"], waiting.as_str());
    assert_eq!(p["kind"], "plan_approval");
    assert_eq!(p["event"], "request_pending");
    assert!(p["waited_secs"].as_f64().unwrap() >= 2.0, "{p}");
    assert_eq!(store.get(&waiting).unwrap().status, RequestStatus::Pending);
    stop(sup);

    // Restarted after the record: no second page for it; a new request gets its own.
    let sup = supervise(&team);
    let later = plan(&store);
    wait_until(T, "the later request's page", || {
        store.get(&later).unwrap().paged_at.map(|_| ())
    });
    std::thread::sleep(Duration::from_millis(1500));
    let ids: Vec<String> = pages(&log)
        .iter()
        .map(|p| p["request_id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, vec![waiting.clone(), later.clone()]);
    let events: Vec<_> = troupe::events::read_all(&team.dir)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == "request_pending")
        .collect();
    assert_eq!(events.len(), 2, "{events:?}");
    stop(sup);
}
