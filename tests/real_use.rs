//! Issue 10, real use: what breaks when a team meets an API outage, a hand-edited roster, a crash
//! at the wrong moment or a stop the lead asked for. Each test drives the real `lead run` and
//! `worker` binaries against a fake LLM server, and each reproduces a review finding (numbered
//! as in the review) that failed before its fix.

mod support;

use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_error, anthropic_message, anthropic_text};
use support::team::{Bg as Lead, Team, alive as alive_pid, lead_cmd, wait_until};
use troupe::config::MemberStatus;
use troupe::requests::{RequestStatus, RequestStore};

const T: Duration = Duration::from_secs(30);

fn alive(pid: u32) -> bool {
    alive_pid(u64::from(pid))
}

fn signal(pid: u32, sig: Signal) {
    let _ = kill(Pid::from_raw(pid as i32), sig);
}

/// `lead spawn NAME --role r --prompt PROMPT [extra]`, which must succeed.
fn spawn(team: &Team, url: &str, name: &str, extra: &[&str]) {
    let mut args = vec!["spawn", name, "--role", "r", "--prompt", "do the task"];
    args.extend_from_slice(extra);
    let o = lead_cmd(team, url, &args).output().unwrap();
    assert!(
        o.status.success(),
        "spawn {name}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `lead run ARGS` in the background, its stderr in `lead.stderr` beside the team dir.
fn run(team: &Team, url: &str, args: &[&str], env: &[(&str, &str)]) -> Lead {
    let mut all = vec!["run"];
    all.extend_from_slice(args);
    let mut c = lead_cmd(team, url, &all);
    c.stderr(log_file(team, "lead.stderr"));
    for (k, v) in env {
        c.env(k, v);
    }
    Lead(c.spawn().unwrap())
}

fn log_file(team: &Team, name: &str) -> Stdio {
    Stdio::from(
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(team.path().join(name))
            .unwrap(),
    )
}

/// `lead status --json`, parsed, with the exit code.
fn status_json(team: &Team) -> (Option<i32>, Value) {
    let o = lead_cmd(team, "http://127.0.0.1:9", &["status", "--json"])
        .output()
        .unwrap();
    let v = serde_json::from_slice(&o.stdout).unwrap_or(Value::Null);
    (o.status.code(), v)
}

/// The member's row of `lead status --json`.
fn row(team: &Team, name: &str) -> Value {
    let (_, v) = status_json(team);
    v["members"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["name"] == name).cloned())
        .unwrap_or(Value::Null)
}

fn events(team: &Team, kind: &str) -> Vec<Value> {
    troupe::events::read_all(&team.dir)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == kind)
        .collect()
}

fn text_replies(n: usize) -> impl Iterator<Item = Reply> {
    (0..n).map(|i| Reply::ok(anthropic_text(&format!("done {i}"))))
}

fn overloaded() -> Reply {
    Reply::json(503, anthropic_error("overloaded_error", "the API is down"))
        .header("retry-after-ms", "5")
}

/// Finding 14 and acceptance 2: an outage far longer than the restart policy tolerates (here
/// forty times the shortened wait cap) leaves every teammate alive, `working` and waiting for
/// the API, with the reason in `lead status`; when the API comes back they finish and go idle,
/// and a message sent meanwhile is consumed once.
#[test]
fn an_api_outage_keeps_teammates_waiting_instead_of_failed() {
    let team = Team::new();
    let fake = FakeLlm::start([]);
    fake.outage(Some(overloaded()));
    spawn(&team, &fake.url(), "amy", &[]);
    spawn(&team, &fake.url(), "bob", &[]);
    // A restart policy that gives up within a second or two of crash-looping.
    let _lead = run(
        &team,
        &fake.url(),
        &["--restart-delay", "0.05", "--restart-delay-max", "0.1"],
        &[("TROUPE_API_WAIT_MAX_SECS", "0.2")],
    );
    let pids: Vec<u32> = ["amy", "bob"]
        .iter()
        .map(|n| {
            wait_until(T, "waiting for the API in status", || {
                let r = row(&team, n);
                (r["doing"]["state"] == "waiting_api").then_some(r)
            })["pid"]
                .as_u64()
                .unwrap() as u32
        })
        .collect();
    let r = row(&team, "amy");
    assert_eq!(r["status"], "working", "{r}");
    assert!(r["doing"]["error"].as_str().unwrap().contains("503"), "{r}");
    assert!(r["doing"]["until"].as_f64().is_some(), "{r}");
    let during = team.send("amy", "sent during the outage");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(8) {
        for n in ["amy", "bob"] {
            let m = team.member(n);
            assert_ne!(
                m.status,
                MemberStatus::Failed,
                "{n} failed during the outage"
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let calls_during = fake.request_count();
    assert!(calls_during > 20, "only {calls_during} calls were tried");
    for reply in text_replies(10) {
        fake.push(reply);
    }
    fake.outage(None);
    for (n, pid) in ["amy", "bob"].iter().zip(&pids) {
        let m = wait_until(Duration::from_secs(60), "idle after the outage", || {
            let m = team.member(n);
            (m.status == MemberStatus::Idle).then_some(m)
        });
        assert_eq!(m.restarts, 0, "{n} was restarted");
        assert_eq!(m.pid, Some(*pid), "{n} is another process");
        assert_eq!(m.incarnation, 1);
    }
    let ids = team.consumed_ids("amy");
    assert_eq!(ids.iter().filter(|i| **i == during.id).count(), 1);
    assert!(row(&team, "amy")["doing"]["state"] == "idle");
}

/// A spend cap pauses the teammate: no retry loop, the reason in status, and a message from the
/// person (after they raised the cap) makes it try again.
#[test]
fn a_spend_cap_pauses_until_a_message_arrives() {
    let team = Team::new();
    let cap = Reply::json(
        429,
        r#"{"type":"error","error":{"type":"rate_limit_error","message":"You have reached your specified workspace API usage limits.","details":{"error_code":"enforced_spend_limit_reached"}},"request_id":"req_cap"}"#,
    );
    let fake = FakeLlm::start([cap]);
    spawn(&team, &fake.url(), "amy", &[]);
    let _lead = run(&team, &fake.url(), &[], &[]);
    let r = wait_until(T, "paused in status", || {
        let r = row(&team, "amy");
        (r["doing"]["state"] == "paused").then_some(r)
    });
    assert_eq!(r["status"], "working");
    assert!(
        r["doing"]["error"]
            .as_str()
            .unwrap()
            .contains("enforced_spend_limit_reached"),
        "{r}"
    );
    // The lead is told: raising a cap is a person's to do.
    let told = wait_until(T, "the lead told amy is paused", || {
        team.lead_inbox().into_iter().find(|m| {
            m.kind == troupe::message::MessageType::StatusUpdate
                && m.from == "amy"
                && m.content.contains("paused")
        })
    });
    assert!(
        told.content.contains("enforced_spend_limit_reached") || told.content.contains("limit"),
        "{}",
        told.content
    );
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(fake.request_count(), 1, "a spend cap was retried");
    let m = team.member("amy");
    assert_eq!((m.status, m.restarts), (MemberStatus::Working, 0));
    fake.push(Reply::ok(anthropic_text("back at it")));
    fake.push(Reply::ok(anthropic_text("done")));
    lead_cmd(&team, &fake.url(), &["send", "amy", "the cap is raised"])
        .status()
        .unwrap();
    wait_until(T, "idle after the cap was raised", || {
        (team.status("amy") == MemberStatus::Idle).then_some(())
    });
    assert!(fake.request_count() >= 2);
}

/// Finding 3: a half-written config.json does not kill the supervisor or the team; nobody
/// overwrites the user's half-made edit; writes made meanwhile are applied once it parses; and
/// a hand-added member with an invalid name is refused with an event.
#[test]
fn a_broken_roster_is_survived() {
    let team = Team::new();
    let fake = FakeLlm::start(text_replies(10));
    spawn(&team, &fake.url(), "amy", &[]);
    let mut lead = run(&team, &fake.url(), &[], &[]);
    let m = wait_until(T, "amy idle", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    let pid = m.pid.unwrap();
    let good = std::fs::read_to_string(team.dir.config()).unwrap();
    let broken = &good[..good.len() / 2];
    // Put in place whole (a plain write passes through an empty file, a second error).
    let tmp = team.path().join("config.half");
    std::fs::write(&tmp, broken).unwrap();
    std::fs::rename(&tmp, team.dir.config()).unwrap();
    // The teammate gets work while the file is broken: it must neither exit nor overwrite it.
    let msg = team.send("amy", "work while the roster is broken");
    wait_until(T, "the message consumed", || {
        team.consumed_ids("amy").contains(&msg.id).then_some(())
    });
    wait_until(T, "the config_unreadable event", || {
        (!events(&team, "config_unreadable").is_empty()).then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(
        lead.0.try_wait().unwrap().is_none(),
        "the supervisor exited"
    );
    assert!(alive(pid), "the worker died");
    assert_eq!(std::fs::read_to_string(team.dir.config()).unwrap(), broken);
    assert_eq!(
        events(&team, "config_unreadable").len(),
        1,
        "one event per error"
    );
    let (code, v) = status_json(&team);
    assert_ne!(code, Some(0));
    assert!(v["config_error"]["error"].as_str().is_some(), "{v}");
    assert!(v["config_error"]["since"].as_f64().is_some(), "{v}");
    let o = lead_cmd(&team, &fake.url(), &["status"]).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("config.json") && err.contains("since"),
        "{err}"
    );

    // Fixed again (with a hand-added member named `lead`): the deferred writes land.
    let mut cfg: Value = serde_json::from_str(&good).unwrap();
    cfg["members"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"name": "lead", "role": "x", "status": "spawning"}));
    std::fs::write(
        team.dir.config(),
        serde_json::to_string_pretty(&cfg).unwrap(),
    )
    .unwrap();
    wait_until(T, "the member_refused event", || {
        (!events(&team, "member_refused").is_empty()).then_some(())
    });
    let m = wait_until(T, "amy's usage recorded", || {
        let m = team.member("amy");
        (m.calls >= 2 && m.status == MemberStatus::Idle).then_some(m)
    });
    assert_eq!(m.pid, Some(pid));
    assert_eq!(m.restarts, 0);
    assert!(
        lead.0.try_wait().unwrap().is_none(),
        "the supervisor exited"
    );
    assert!(alive(pid));
}

/// Finding 2: a member that was restarted once and then failed can be spawned again at once
/// (it used to sit in `spawning` for an hour).
#[test]
fn a_failed_member_can_be_spawned_again() {
    let team = Team::new();
    let fake = FakeLlm::start(text_replies(20));
    spawn(&team, &fake.url(), "cy", &[]);
    let _lead = run(
        &team,
        &fake.url(),
        &["--max-restarts", "1", "--restart-delay", "0.1"],
        &[],
    );
    for _ in 0..2 {
        let m = wait_until(T, "cy up", || {
            let m = team.member("cy");
            (m.status == MemberStatus::Idle).then_some(m)
        });
        signal(m.pid.unwrap(), Signal::SIGKILL);
        wait_until(T, "cy reaped", || {
            (team.member("cy").pid != m.pid).then_some(())
        });
    }
    wait_until(T, "cy failed", || {
        (team.status("cy") == MemberStatus::Failed).then_some(())
    });
    spawn(&team, &fake.url(), "cy", &[]);
    wait_until(Duration::from_secs(10), "cy idle again", || {
        (team.status("cy") == MemberStatus::Idle).then_some(())
    });
}

/// Finding 1: a worker killed after it approved its shutdown and before it exited is recorded
/// `shutdown`, not restarted, and `lead shutdown --wait` returns 0.
#[test]
fn an_approved_shutdown_survives_a_kill_before_the_exit() {
    let team = Team::new();
    let fake = FakeLlm::start(text_replies(1)).patient(Duration::from_secs(20));
    spawn(&team, &fake.url(), "alice", &[]);
    let _lead = run(&team, &fake.url(), &["--restart-delay", "0.1"], &[]);
    let m = wait_until(T, "alice idle", || {
        let m = team.member("alice");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    let mut wait = lead_cmd(
        &team,
        &fake.url(),
        &["shutdown", "alice", "--json", "--timeout", "30", "--wait"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let rid = wait_until(T, "the request", || {
        RequestStore::new(&team.dir)
            .list(Some(RequestStatus::Pending))
            .unwrap()
            .first()
            .map(|r| r.request_id.clone())
    });
    fake.push(Reply::ok(anthropic_message(
        &format!(
            r#"{{"type":"tool_use","id":"t1","name":"shutdown_response","input":{{"request_id":"{rid}","approve":true}}}},{{"type":"tool_use","id":"t2","name":"bash","input":{{"command":"sleep 30"}}}}"#
        ),
        "tool_use",
        r#"{"input_tokens":1,"output_tokens":1}"#,
    )));
    wait_until(T, "the shutdown_response event", || {
        (!events(&team, "shutdown_response").is_empty()).then_some(())
    });
    signal(m.pid.unwrap(), Signal::SIGKILL);
    let st = wait_until(Duration::from_secs(40), "shutdown --wait returns", || {
        wait.try_wait().unwrap()
    });
    assert_eq!(st.code(), Some(0), "lead shutdown --wait");
    let m = wait_until(T, "alice recorded shut down", || {
        let m = team.member("alice");
        (m.status == MemberStatus::Shutdown).then_some(m)
    });
    assert_eq!(m.incarnation, 1, "restarted after an approved shutdown");
    assert_eq!(
        RequestStore::new(&team.dir).get(&rid).unwrap().status,
        RequestStatus::Approved
    );
}

/// Finding 13: after the lead is killed during a slow model call, the new supervisor's worker
/// waits for the old process to finish its step instead of exiting 75 until the member is
/// marked failed; the old process's late writes do not clobber the new one's record.
#[test]
fn a_slow_orphan_after_a_lead_crash_is_waited_for() {
    let team = Team::new();
    let fake = FakeLlm::start(text_replies(1));
    spawn(&team, &fake.url(), "amy", &[]);
    let mut lead = run(&team, &fake.url(), &[], &[]);
    let m = wait_until(T, "amy idle", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    let old = m.pid.unwrap();
    // Her next call takes 15 s; the lead dies meanwhile.
    fake.push(Reply::ok(anthropic_text("slow answer")).delay(Duration::from_secs(15)));
    fake.push(Reply::ok(anthropic_text("after the restart")));
    team.send("amy", "think hard");
    wait_until(T, "the slow call", || {
        (fake.request_count() == 2).then_some(())
    });
    signal(lead.0.id(), Signal::SIGKILL);
    let _ = lead.0.wait();
    let _lead2 = run(
        &team,
        &fake.url(),
        &["--max-restarts", "2", "--restart-delay", "0.1"],
        &[],
    );
    let t0 = Instant::now();
    while alive(old) && t0.elapsed() < Duration::from_secs(25) {
        assert_ne!(
            team.status("amy"),
            MemberStatus::Failed,
            "marked failed while the orphan finishes"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(!alive(old), "the orphan outlived its slow call");
    let m = wait_until(T, "amy idle under the new lead", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle && m.pid != Some(old)).then_some(m)
    });
    assert!(alive(m.pid.unwrap()));
    assert_eq!(m.incarnation, 2);
}

/// Review item 6: a teammate the lead forced off after an unanswered shutdown is recorded
/// `shutdown` with the reason, and the next `lead run` does not bring it back.
#[test]
fn an_escalated_shutdown_stays_a_stop() {
    let team = Team::new();
    let fake = FakeLlm::start(text_replies(10));
    spawn(&team, &fake.url(), "amy", &[]);
    let mut lead = run(&team, &fake.url(), &["--kill-grace", "1"], &[]);
    let m = wait_until(T, "amy idle", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    // She answers with text only: the request goes unanswered and expires.
    let st = lead_cmd(&team, &fake.url(), &["shutdown", "amy", "--timeout", "1"])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    wait_until(T, "amy's process gone", || {
        (!alive(m.pid.unwrap())).then_some(())
    });
    wait_until(T, "amy's exit handled", || {
        (!team.member("amy").status.wants_process()).then_some(())
    });
    let m2 = team.member("amy");
    assert_eq!(m2.status, MemberStatus::Shutdown, "{m2:?}");
    assert!(m2.reason.unwrap_or_default().contains("shutdown"));
    signal(lead.0.id(), Signal::SIGTERM);
    let st = wait_until(T, "lead exit", || lead.0.try_wait().unwrap());
    assert_eq!(st.code(), Some(0));
    let _lead2 = run(&team, &fake.url(), &[], &[]);
    std::thread::sleep(Duration::from_secs(2));
    let m3 = team.member("amy");
    assert_eq!(m3.status, MemberStatus::Shutdown);
    assert_eq!(m3.incarnation, 1, "resumed by the next lead run");
}

/// M1: a `lead spawn` that reactivates a member between its worker's own `shutdown` record and
/// the supervisor's reap is not overwritten back to `shutdown` (the supervisor is held with
/// SIGSTOP to open that window wide).
#[test]
fn a_reactivation_before_the_reap_is_kept() {
    let team = Team::new();
    let fake = FakeLlm::start(text_replies(1)).patient(Duration::from_secs(20));
    spawn(&team, &fake.url(), "amy", &[]);
    let lead = run(&team, &fake.url(), &[], &[]);
    let m = wait_until(T, "amy idle", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle).then_some(m)
    });
    let o = lead_cmd(&team, &fake.url(), &["shutdown", "amy", "--json"])
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rid = v["request_id"].as_str().unwrap().to_owned();
    support::team::stop_between_writes(lead.0.id(), &team.dir);
    fake.push(Reply::ok(anthropic_message(
        &format!(
            r#"{{"type":"tool_use","id":"t1","name":"shutdown_response","input":{{"request_id":"{rid}","approve":true}}}}"#
        ),
        "tool_use",
        r#"{"input_tokens":1,"output_tokens":1}"#,
    )));
    wait_until(T, "amy wrote shutdown", || {
        (team.status("amy") == MemberStatus::Shutdown && !alive(m.pid.unwrap())).then_some(())
    });
    fake.push(Reply::ok(anthropic_text("back again")));
    spawn(&team, &fake.url(), "amy", &[]);
    assert_eq!(team.status("amy"), MemberStatus::Spawning);
    signal(lead.0.id(), Signal::SIGCONT);
    let m2 = wait_until(T, "amy reactivated", || {
        let m = team.member("amy");
        (m.status == MemberStatus::Idle && m.incarnation == 2).then_some(m)
    });
    assert!(alive(m2.pid.unwrap()));
}

/// `lead chat -p` does not take a team that waits for the API for a quiet one: it exits only
/// once the teammate came back, finished, and its summary reached the lead.
#[test]
fn chat_p_waits_for_a_teammate_that_waits_for_the_api() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    spawn(&team, &fake.url(), "amy", &["--model", "m-amy"]);
    // Amy's first dozen tries meet an overloaded API (4 tries per wait at most: 3 attempts of
    // a call, then a wait), then she answers.
    for _ in 0..12 {
        fake.push_for("m-amy", overloaded());
    }
    fake.push_for("m-amy", Reply::ok(anthropic_text("amy: all done")));
    // The lead ends its turn at once, then answers amy's idle notification.
    fake.push_for("m-lead", Reply::ok(anthropic_text("waiting for amy")));
    fake.push_for("m-lead", Reply::ok(anthropic_text("amy is done")));
    let chat = lead_cmd(
        &team,
        &fake.url(),
        &["chat", "-p", "let amy finish", "--model", "m-lead"],
    )
    .env("TROUPE_API_WAIT_MAX_SECS", "0.3")
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // The team stop at the end asks amy to shut down: she approves.
    let rid = wait_until(T, "the team stop's request", || {
        RequestStore::new(&team.dir)
            .list(Some(RequestStatus::Pending))
            .unwrap()
            .into_iter()
            .find(|r| r.to == "amy")
            .map(|r| r.request_id)
    });
    fake.push_for(
        "m-amy",
        Reply::ok(anthropic_message(
            &format!(
                r#"{{"type":"tool_use","id":"t1","name":"shutdown_response","input":{{"request_id":"{rid}","approve":true}}}}"#
            ),
            "tool_use",
            r#"{"input_tokens":1,"output_tokens":1}"#,
        )),
    );
    let o = chat.wait_with_output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("amy is done"), "{out}");
    assert_eq!(team.member("amy").restarts, 0);
    // Every outage reply was used before the answer (and then the team stop's call).
    assert!(fake.requests_for("m-amy") >= 13);
}

/// The LLM lead waits out an outage of its own model API too, instead of ending `chat -p` with
/// exit 75 (which would also stop the team `chat` started).
#[test]
fn chat_p_waits_out_an_outage_of_its_own() {
    let team = Team::new();
    let fake = FakeLlm::start([]);
    for _ in 0..6 {
        fake.push_for("m-lead", overloaded());
    }
    fake.push_for("m-lead", Reply::ok(anthropic_text("all done")));
    let o = lead_cmd(
        &team,
        &fake.url(),
        &["chat", "-p", "hello", "--model", "m-lead"],
    )
    .env("TROUPE_API_WAIT_MAX_SECS", "0.2")
    .output()
    .unwrap();
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert_eq!(o.status.code(), Some(0), "{out}{err}");
    assert!(out.contains("all done"), "{out}");
    assert!(err.contains("tries again"), "{err}");
    assert_eq!(fake.requests_for("m-lead"), 7);
}
