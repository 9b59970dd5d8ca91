//! Issue 25's watchdog: a worker that stops beating (SIGSTOP, idle or in a model call) is
//! killed and restarted with an event `hung`, and what was sent to it meanwhile is consumed
//! once; a long bash command is progress up to its timeout. Real `lead` and `worker`, real
//! signals, a fake model server.

mod support;

use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd as lead, start_supervisor, wait_until};
use troupe::config::MemberStatus;
use troupe::message::MessageType;
use troupe::transcript::Entry;

const T: Duration = Duration::from_secs(40);

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn text(t: &str) -> Reply {
    Reply::ok(anthropic_text(t))
}

fn bash(command: &str) -> Reply {
    Reply::ok(anthropic_message(
        &anthropic_tool_use_block(
            "toolu_b",
            "bash",
            &serde_json::json!({ "command": command }).to_string(),
        ),
        "tool_use",
        r#"{"input_tokens":1,"output_tokens":1}"#,
    ))
}

fn supervise(team: &Team, url: &str, env: &[(&str, &str)]) -> Bg {
    let mut cmd = lead(
        team,
        url,
        &[
            "run",
            "--watchdog",
            "5",
            "--restart-delay",
            "0.2",
            "--stop-timeout",
            "2",
            "--kill-grace",
            "1",
            "--sandbox",
            "off",
        ],
    );
    for (k, v) in env {
        cmd.env(k, v);
    }
    start_supervisor(team, cmd)
}

fn spawn(team: &Team, url: &str, name: &str) {
    let o = out(&mut lead(
        team,
        url,
        &[
            "spawn", name, "--role", "r", "--prompt", "p", "--model", "m-mate",
        ],
    ));
    assert!(o.status.success(), "{o:?}");
}

fn events(team: &Team, event: &str, who: &str) -> Vec<Value> {
    troupe::events::read_all(&team.dir)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == event && e["name"] == who)
        .collect()
}

fn stop(pid: u32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
}

/// How many times the transcript of `name` holds the message with this content.
fn consumed(team: &Team, name: &str, content: &str) -> usize {
    team.transcript(name)
        .iter()
        .filter(|e| {
            matches!(e, Entry::Inbox { message, .. }
                if message.kind == MessageType::Message && message.content == content)
        })
        .count()
}

/// Waits for `name`'s incarnation `n` to be idle with a live process.
fn idle_as(team: &Team, name: &str, n: u64) -> u32 {
    wait_until(T, &format!("{name} idle as incarnation {n}"), || {
        let m = team.member(name);
        (m.status == MemberStatus::Idle && m.incarnation == n)
            .then_some(m.pid)
            .flatten()
    })
}

#[test]
fn a_stopped_idle_worker_is_killed_and_restarted_and_gets_what_was_sent_meanwhile_once() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
    fake.push_for("m-mate", text("ready"));
    fake.push_for("m-mate", text("got it"));
    let url = fake.url();
    let _sup = supervise(&team, &url, &[]);
    spawn(&team, &url, "ann");
    let pid = idle_as(&team, "ann", 1);
    let t0 = Instant::now();
    stop(pid);
    team.send("ann", "sent while stopped");
    wait_until(T, "ann's hung event", || {
        (!events(&team, "hung", "ann").is_empty()).then_some(())
    });
    let new_pid = idle_as(&team, "ann", 2);
    wait_until(T, "the message consumed by the new incarnation", || {
        (consumed(&team, "ann", "sent while stopped") > 0).then_some(())
    });
    eprintln!(
        "idle worker: SIGSTOP -> restarted and idle again in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert_ne!(new_pid, pid);
    assert!(
        !support::team::alive(pid as u64),
        "the stopped worker still lives"
    );
    let hung = &events(&team, "hung", "ann")[0];
    assert_eq!(hung["incarnation"], 1);
    assert_eq!(hung["pid"], pid);
    // Once: in the transcript, and in the model's view.
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(consumed(&team, "ann", "sent while stopped"), 1);
    assert_eq!(fake.requests_for("m-mate"), 2);
    assert_eq!(events(&team, "hung", "ann").len(), 1);
}

#[test]
fn a_worker_stopped_in_a_model_call_is_killed_once_the_call_could_have_ended() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
    // The first call never answers in time: the worker is stopped while it waits.
    fake.push_for("m-mate", text("too late").delay(Duration::from_secs(60)));
    fake.push_for("m-mate", text("done"));
    let url = fake.url();
    let _sup = supervise(
        &team,
        &url,
        &[
            ("TROUPE_LLM_TIMEOUT_SECS", "2"),
            ("TROUPE_LLM_MAX_ATTEMPTS", "1"),
        ],
    );
    spawn(&team, &url, "bob");
    wait_until(T, "bob's first call", || {
        (fake.requests_for("m-mate") >= 1).then_some(())
    });
    let m = team.member("bob");
    assert_eq!(m.status, MemberStatus::Working);
    let pid = m.pid.unwrap();
    let t0 = Instant::now();
    stop(pid);
    wait_until(T, "bob's hung event", || {
        (!events(&team, "hung", "bob").is_empty()).then_some(())
    });
    idle_as(&team, "bob", 2);
    eprintln!(
        "working worker: SIGSTOP -> restarted and idle again in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let hung = &events(&team, "hung", "bob")[0];
    assert!(hung["allowance_secs"].as_f64().unwrap() >= 2.0, "{hung}");
    assert!(!support::team::alive(pid as u64));
}

#[test]
fn a_bash_command_longer_than_the_watchdog_is_progress_not_a_hang() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
    fake.push_for("m-mate", bash("sleep 12"));
    fake.push_for("m-mate", text("slept"));
    let url = fake.url();
    let _sup = supervise(&team, &url, &[]);
    spawn(&team, &url, "cy");
    idle_as(&team, "cy", 1);
    assert!(events(&team, "hung", "cy").is_empty());
    assert_eq!(fake.requests_for("m-mate"), 2);
    // And idle, it keeps beating: still incarnation 1 well past the watchdog.
    std::thread::sleep(Duration::from_secs(7));
    assert!(events(&team, "hung", "cy").is_empty());
    assert_eq!(team.member("cy").incarnation, 1);
}

/// Review 4, R4-6: a member waiting out the team's cooldown at the rate governor's gate is
/// not hung. Scaled as the review's script runs it: a call's allowance of 3 s (one attempt),
/// `--watchdog 5`, and a `retry-after` of 25 s that both members wait out in the gate.
#[test]
fn a_member_waiting_out_the_teams_cooldown_at_the_gate_is_not_hung() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(60));
    let url = fake.url();
    fake.push_for(
        "m-ann",
        Reply::json(
            429,
            support::fake_llm::anthropic_error("rate_limit_error", "slow down"),
        )
        .header("retry-after", "25"),
    );
    fake.push_for("m-ann", text("done after the cooldown"));
    fake.push_for("m-bo", text("done after the cooldown"));
    let env = [
        ("TROUPE_LLM_TIMEOUT_SECS", "3"),
        ("TROUPE_LLM_MAX_ATTEMPTS", "1"),
    ];
    let _sup = supervise(&team, &url, &env);
    for (name, model) in [("ann", "m-ann"), ("bo", "m-bo")] {
        let o = out(&mut lead(
            &team,
            &url,
            &[
                "spawn", name, "--role", "r", "--prompt", "p", "--model", model,
            ],
        ));
        assert!(o.status.success(), "{o:?}");
        if name == "ann" {
            wait_until(T, "the rate limit", || {
                troupe::events::read_all(&team.dir)
                    .unwrap()
                    .iter()
                    .any(|e| e["event"] == "rate_limited")
                    .then_some(())
            });
        }
    }
    let began = Instant::now();
    // Both wait some 25 s at the gate, five times the watchdog past their calls' allowance.
    wait_until(
        Duration::from_secs(90),
        "both done after the cooldown",
        || (fake.requests_for("m-bo") == 1 && fake.requests_for("m-ann") == 2).then_some(()),
    );
    eprintln!(
        "the cooldown ended {:.1} s after bo's spawn",
        began.elapsed().as_secs_f64()
    );
    for name in ["ann", "bo"] {
        idle_as(&team, name, 1);
        assert!(
            events(&team, "hung", name).is_empty(),
            "{name} was killed as hung while waiting at the gate: {:?}",
            events(&team, "hung", name)
        );
    }
}
