//! Regression tests for the review findings (review-findings.md), each driven through the real
//! binaries: a shutdown asked of a member that has no process yet, a late rejection past a
//! request's expiry, a shutdown request or plan decision whose message could not be delivered, a
//! torn line in events.jsonl, and `lead run --detach` with a team dir named `run`.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd as lead, wait_until};
use troupe::config::MemberStatus;
use troupe::requests::{Request, RequestStatus, RequestStore};

const T: Duration = Duration::from_secs(30);
const USAGE: &str = r#"{"input_tokens":3,"output_tokens":2}"#;

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

fn tool(name: &str, input: &str) -> Reply {
    Reply::ok(anthropic_message(
        &anthropic_tool_use_block("tu", name, input),
        "tool_use",
        USAGE,
    ))
}

/// `lead spawn NAME --role r --prompt p`, which must succeed.
fn spawn(team: &Team, url: &str, name: &str) {
    let o = out(&mut lead(
        team,
        url,
        &["spawn", name, "--role", "r", "--prompt", "p"],
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// `lead run` in the background with short stop and kill timeouts.
fn supervise(team: &Team, url: &str) -> Bg {
    Bg(lead(
        team,
        url,
        &["run", "--stop-timeout", "1", "--kill-grace", "1"],
    )
    .stderr(Stdio::null())
    .spawn()
    .unwrap())
}

fn request(team: &Team, id: &str) -> Request {
    RequestStore::new(&team.dir).get(id).unwrap()
}

fn events(team: &Team, name: &str) -> Vec<Value> {
    troupe::events::read_all(&team.dir)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == name)
        .collect()
}

// Finding 9.

/// Finding 9: a shutdown asked of a member that has no process yet applies to the incarnation
/// that starts next, instead of being auto-rejected by it as stale.
#[test]
fn shutdown_of_a_member_not_started_yet_is_obeyed_by_the_next_incarnation() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    spawn(&team, &url, "bob");
    let o = out(&mut lead(
        &team,
        &url,
        &["shutdown", "bob", "--json", "--timeout", "60"],
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rid = stdout_json(&o)["request_id"].as_str().unwrap().to_owned();
    assert_eq!(request(&team, &rid).target_incarnation, None);
    // bob's first turn holds its task and the request; its model approves.
    fake.push(tool(
        "shutdown_response",
        &format!(r#"{{"request_id":"{rid}","approve":true,"reason":"ok"}}"#),
    ));
    fake.push(Reply::ok(anthropic_text("bye")));
    let _sup = supervise(&team, &url);
    let r = wait_until(T, "the request answered", || {
        let r = request(&team, &rid);
        (r.status != RequestStatus::Pending).then_some(r)
    });
    assert_eq!(
        r.status,
        RequestStatus::Approved,
        "response: {:?}",
        r.response
    );
    wait_until(T, "bob shut down", || {
        let m = team.member("bob");
        (m.status == MemberStatus::Shutdown && m.pid.is_none()).then_some(())
    });
    assert!(events(&team, "shutdown_stale").is_empty());
}

// Finding 15.

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use support::team::alive;

fn idle_pid(team: &Team, name: &str) -> u64 {
    wait_until(T, "the member idle", || {
        let m = team.member(name);
        (m.status == MemberStatus::Idle)
            .then_some(m.pid)
            .flatten()
            .map(u64::from)
    })
}

fn signal(pid: u64, sig: Signal) {
    kill(Pid::from_raw(pid as i32), sig).unwrap();
}

/// Finding 15: a rejection that arrives after the request's expiry, before the supervisor has
/// looked, must not take the escalation away: the supervisor expires it and stops the worker.
#[test]
fn a_rejection_after_the_expiry_is_still_escalated() {
    let team = Team::new();
    let fake = FakeLlm::start([Reply::ok(anthropic_text("ready"))]).patient(T);
    let url = fake.url();
    spawn(&team, &url, "bob");
    let sup = supervise(&team, &url);
    let pid = idle_pid(&team, "bob");
    let calls = fake.request_count();
    let o = out(&mut lead(
        &team,
        &url,
        &["shutdown", "bob", "--json", "--timeout", "1"],
    ));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rid = stdout_json(&o)["request_id"].as_str().unwrap().to_owned();
    // Hold the supervisor still, so that its next look at the request comes after the answer
    // (the window of the finding: an answer between `expires_at` and the supervisor's tick).
    let sup_pid = u64::from(sup.0.id());
    support::team::stop_between_writes(sup.0.id(), &team.dir);
    fake.push(
        tool(
            "shutdown_response",
            &format!(r#"{{"request_id":"{rid}","approve":false,"reason":"busy"}}"#),
        )
        .delay(Duration::from_millis(1500)),
    );
    fake.push(Reply::ok(anthropic_text("staying")));
    // The model was called again with the tool's result: the answer was tried.
    wait_until(T, "bob's late answer", || {
        (fake.request_count() >= calls + 2).then_some(())
    });
    let r = request(&team, &rid);
    assert!(r.expires_at.unwrap() <= troupe::fsutil::now());
    signal(sup_pid, Signal::SIGCONT);
    wait_until(Duration::from_secs(10), "shutdown_escalated", || {
        (!events(&team, "shutdown_escalated").is_empty()).then_some(())
    });
    wait_until(Duration::from_secs(10), "bob's worker gone", || {
        (!alive(pid)).then_some(())
    });
    assert_eq!(request(&team, &rid).status, RequestStatus::Expired);
}

// M2.

use troupe::AgentName;
use troupe::inbox::{self, Inbox};

fn inbox_of(team: &Team, name: &str) -> Inbox {
    Inbox::new(&team.dir, &AgentName::teammate(name).unwrap())
}

/// Grows `name`'s inbox to the cap with a sparse tail (nothing more can be appended); returns
/// its length before, for [`unfill`].
fn fill(team: &Team, name: &str) -> u64 {
    let path = inbox_of(team, name).path().to_owned();
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .unwrap();
    let before = f.metadata().unwrap().len();
    f.set_len(inbox::DEFAULT_CAP).unwrap();
    before
}

fn unfill(team: &Team, name: &str, len: u64) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(inbox_of(team, name).path())
        .unwrap();
    f.set_len(len).unwrap();
}

/// M2: a shutdown request whose message cannot be delivered (the inbox is full) is expired at
/// once, so it neither kills the teammate later nor blocks the next request.
#[test]
fn an_undelivered_shutdown_request_is_expired_at_once_and_kills_nobody() {
    let team = Team::new();
    let fake = FakeLlm::start([Reply::ok(anthropic_text("ready"))]).patient(T);
    let url = fake.url();
    spawn(&team, &url, "bob");
    let _sup = supervise(&team, &url);
    let pid = idle_pid(&team, "bob");
    // Stopped, bob cannot drain the inbox while it is full.
    signal(pid, Signal::SIGSTOP);
    let len = fill(&team, "bob");
    let o = out(&mut lead(
        &team,
        &url,
        &["shutdown", "bob", "--timeout", "1"],
    ));
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("full"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    unfill(&team, "bob", len);
    signal(pid, Signal::SIGCONT);
    let reqs = RequestStore::new(&team.dir).list(None).unwrap();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0].status, RequestStatus::Expired, "{:?}", reqs[0]);
    // Give the supervisor several ticks past the request's expiry (it ticks at least once a
    // second): nothing may stop bob.
    let until = reqs[0].expires_at.unwrap() + 3.0;
    while troupe::fsutil::now() < until {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(alive(pid), "bob was stopped");
    assert!(events(&team, "shutdown_escalated").is_empty());
    assert_eq!(team.member("bob").incarnation, 1);
}

// M3.

use serde_json::json;
use troupe::message::MessageType;
use troupe::requests::{NewRequest, RequestKind};

/// M3: a plan decision whose message could not be delivered is re-sent when the lead decides
/// the same way again; the retry still reports the request as already decided (exit 4).
#[test]
fn a_plan_decision_is_resent_when_repeated() {
    let team = Team::new();
    let url = "http://127.0.0.1:9";
    let req = RequestStore::new(&team.dir)
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "bob".into(),
            to: "lead".into(),
            payload: json!({"plan": "do it"}),
            target_incarnation: Some(1),
            ttl: None,
        })
        .unwrap();
    let id = req.request_id.as_str();
    fill(&team, "bob");
    let o = out(&mut lead(&team, url, &["approve", id, "--feedback", "go"]));
    assert!(!o.status.success());
    assert_eq!(request(&team, id).status, RequestStatus::Approved);
    unfill(&team, "bob", 0);
    let responses = || -> Vec<troupe::message::Message> {
        inbox_of(&team, "bob")
            .peek()
            .unwrap()
            .into_iter()
            .filter(|m| m.kind == MessageType::PlanApprovalResponse)
            .collect()
    };
    let o = out(&mut lead(
        &team,
        url,
        &["approve", id, "--feedback", "again"],
    ));
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let got = responses();
    assert_eq!(got.len(), 1, "{got:?}");
    let sent = &got[0];
    assert_eq!(sent.request_id.as_deref(), Some(id));
    assert_eq!(sent.approve, Some(true));
    // The recorded decision is what is sent, not the retry's words.
    assert_eq!(sent.feedback.as_deref(), Some("go"));
    // A different decision is refused and sends nothing.
    let o = out(&mut lead(&team, url, &["reject", id, "--feedback", "no"]));
    assert_eq!(o.status.code(), Some(4));
    assert_eq!(responses().len(), 1);
    // Another re-send carries the same id, so the teammate consumes it once.
    let o = out(&mut lead(&team, url, &["approve", id]));
    assert_eq!(o.status.code(), Some(4));
    let got = responses();
    assert_eq!(got.len(), 2);
    assert_eq!(got[1].id, got[0].id);
}

// M5.

/// M5: a fragment left in events.jsonl by a killed writer does not swallow the next event.
#[test]
fn a_torn_event_line_does_not_swallow_the_next_event() {
    let team = Team::new();
    std::fs::write(team.dir.events(), r#"{"ts":1,"eve"#).unwrap();
    spawn(&team, "http://127.0.0.1:9", "bob");
    let ev = events(&team, "spawn_requested");
    assert_eq!(ev.len(), 1, "{:?}", troupe::events::read_all(&team.dir));
    assert_eq!(ev[0]["name"], "bob");
}

// M9.

use std::time::Instant;

/// Kills a detached supervisor on drop if the test did not stop it.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = kill(Pid::from_raw(self.0), Signal::SIGKILL);
    }
}

/// M9: `lead --team-dir run run --detach` (a team dir named `run`) starts a supervisor on ./run.
#[test]
fn detach_with_a_team_dir_named_run() {
    let tmp = tempfile::tempdir().unwrap();
    let lead_in_tmp = |args: &[&str]| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lead"));
        c.args(args)
            .current_dir(tmp.path())
            .env_remove("TROUPE_TEAM_DIR")
            .env_remove("NOTIFY_SOCKET")
            .stdin(Stdio::null());
        c
    };
    let o = out(&mut lead_in_tmp(&[
        "--team-dir",
        "run",
        "run",
        "--detach",
        "--stop-timeout",
        "1",
    ]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pid: i32 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap();
    let _guard = KillOnDrop(pid);
    let lock = tmp.path().join("run").join("lead.lock");
    assert!(troupe::fsutil::HeldLock::is_held(&lock).unwrap());
    let t = Instant::now();
    let o = out(&mut lead_in_tmp(&["--team-dir", "run", "stop"]));
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(t.elapsed() < T);
    wait_until(T, "the supervisor gone", || {
        (!alive(pid as u64)).then_some(())
    });
}
