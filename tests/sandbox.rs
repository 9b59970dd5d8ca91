//! Issue 11, acceptance: the `bash` sandbox. A hostile model (the fake LLM server) makes the
//! calls of the issue through a real worker under `lead run`, through the LLM lead of
//! `lead chat -p`, and through a team run as an unprivileged uid, all in the default layout
//! (the team dir `.team` inside the working dir): the team files stay as they were, the lead
//! and the worker live on, the API key is in no file and no request the model received, the
//! `setsid` call returns at once and its daemon dies with the team. With `--sandbox off` the
//! behaviour is the documented one and `lead status` says so.
//!
//! Under `CI=true` the sandbox must be active (`lead status --json`); these tests never skip.

#[path = "support/hostile.rs"]
mod hostile;
mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hostile::{Site, Snapshot, T, drive, leaks, sleepers, steps, stop, within};
use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_message, anthropic_text};
use support::team::{Bg, alive};

const USAGE: &str = r#"{"input_tokens":3,"output_tokens":2}"#;

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// `lead run` with short stop timeouts, its stderr in `lead.stderr` beside the working dir.
fn run(site: &Site, url: &str, extra: &[&str], uid: Option<u32>) -> Bg {
    hostile::run_lead(site, url, extra, uid, &[])
}

/// The sandbox temp dir the member's status names, if any.
fn sandbox_tmp(status: &Value) -> Vec<PathBuf> {
    status["tmp"]
        .as_str()
        .map(|t| vec![PathBuf::from(t)])
        .unwrap_or_default()
}

/// Under `CI=true`, the member's sandbox must be active; elsewhere its status is only shown.
fn check_active(site: &Site, name: &str, problems: &mut Vec<String>) -> Value {
    let status = site.sandbox_status(name);
    eprintln!("{name}'s sandbox: {status}");
    if in_ci() && status["active"] != true {
        problems.push(format!(
            "CI=true and {name}'s sandbox is not active: {status}"
        ));
    }
    status
}

/// A worker under `lead run`, as `uid` when given: the hostile calls, then the checks.
fn hostile_team(uid: Option<u32>) {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    let abs_team = site.team_dir_from_status();
    if let Some(uid) = uid {
        site.chown_all(uid);
    }
    let mut lead = run(&site, &url, &[], uid);
    let lead_pid = lead.0.id();
    let worker = site.wait_status("amy", "working");
    // amy's first model call waits for its reply: the team files are all there now.
    support::team::wait_until(T, "amy's first model call", || {
        (fake.requests_for("m-amy") >= 1).then_some(())
    });
    if let Some(uid) = uid {
        let owner = std::fs::read_to_string(format!("/proc/{worker}/status"))
            .unwrap()
            .lines()
            .find_map(|l| {
                l.strip_prefix("Uid:")
                    .map(|u| u.split_whitespace().next().map(str::to_owned))
            })
            .flatten();
        assert_eq!(owner, Some(uid.to_string()), "the worker runs as {uid}");
    }
    let mut problems = Vec::new();
    let status = check_active(&site, "amy", &mut problems);
    let before = Snapshot::take(&site);
    problems.extend(drive(
        &site,
        &fake,
        "m-amy",
        steps(&site, &[worker, lead_pid], &abs_team),
        &[("the worker", worker), ("the lead", lead_pid)],
        &before,
    ));
    if problems.is_empty() {
        let idle = within(T, || {
            site.member("amy")
                .is_some_and(|m| m["status"] == "idle" && m["pid"] == worker)
        });
        if !idle {
            problems.push(format!(
                "amy did not go idle after the final text: {:?}",
                site.member("amy")
            ));
        }
    }
    problems.extend(stop(&mut lead.0, "lead run"));
    if !within(Duration::from_secs(10), || sleepers(&site).is_empty()) {
        problems.push(format!(
            "the setsid sleep outlived the team: pids {:?}",
            sleepers(&site)
        ));
    }
    problems.extend(leaks(&site, &fake, &sandbox_tmp(&status)));
    assert!(
        problems.is_empty(),
        "the hostile calls reached what they must not:\n  {}\nlead stderr:\n{}",
        problems.join("\n  "),
        site.read_log("lead.stderr")
    );
}

/// Acceptance 1: a real worker under `lead run`, in the default layout, run by the test's own
/// user (root in CI: the sandbox must then run commands unprivileged itself).
#[test]
fn hostile_calls_do_not_reach_the_team_the_lead_or_the_key() {
    hostile_team(None);
}

/// Acceptance 1, the unprivileged path: the whole team runs as uid 65534, so the sandbox is
/// set up without root (a user namespace). When the test is not run as root, the test above
/// already is this case.
#[test]
fn unprivileged_worker_is_sandboxed_too() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "skipped: not root, so hostile_calls_do_not_reach_the_team_the_lead_or_the_key \
             already runs the team unprivileged"
        );
        return;
    }
    hostile_team(Some(65534));
}

/// Acceptance 1 for the LLM lead of `lead chat -p`: its own `bash` makes the hostile calls,
/// with a supervisor and an idle teammate in the team.
#[test]
fn hostile_calls_of_the_chat_lead_do_not_reach_the_team_or_the_key() {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    fake.push_for("m-amy", Reply::ok(anthropic_text("amy ready")));
    let abs_team = site.team_dir_from_status();
    let mut lead = run(&site, &url, &[], None);
    let lead_pid = lead.0.id();
    let worker = site.wait_status("amy", "idle");
    // Take amy's idle notification out of the way, so that chat -p ends after its own turn.
    let o = site.lead(&url, &["inbox", "--json"]).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut chat = Bg(site
        .lead(
            &url,
            &[
                "chat",
                "-p",
                "Look around the machine.",
                "--model",
                "m-lead",
            ],
        )
        .stdout(site.log("chat.stdout"))
        .stderr(site.log("chat.stderr"))
        .spawn()
        .unwrap());
    let chat_pid = chat.0.id();
    support::team::wait_until(T, "the chat lead's first model call", || {
        (fake.requests_for("m-lead") >= 1).then_some(())
    });
    let lead_sandbox = site.lead_sandbox_status();
    if std::env::var_os("CI").is_some() {
        assert_eq!(
            lead_sandbox["active"], true,
            "CI=true and the chat lead's sandbox is not active: {lead_sandbox}"
        );
    }
    let before = Snapshot::take(&site);
    let mut problems = drive(
        &site,
        &fake,
        "m-lead",
        steps(&site, &[chat_pid, lead_pid, worker], &abs_team),
        &[
            ("lead chat", chat_pid),
            ("lead run", lead_pid),
            ("the worker", worker),
        ],
        &before,
    );
    // A spare last turn, should the lead be woken once more.
    fake.push_for("m-lead", Reply::ok(anthropic_text("Nothing more.")));
    if problems.is_empty() {
        let t0 = Instant::now();
        match within(T, || chat.0.try_wait().ok().flatten().is_some()) {
            true => {
                let code = chat.0.wait().unwrap();
                if !code.success() {
                    problems.push(format!("lead chat -p ended with {code}"));
                }
            }
            false => problems.push(format!(
                "lead chat -p did not finish within {:?}",
                t0.elapsed()
            )),
        }
        problems.extend(before.damage(&site));
        if !alive(u64::from(worker)) || !alive(u64::from(lead_pid)) {
            problems.push("the worker or lead run died".into());
        }
    }
    problems.extend(stop(&mut lead.0, "lead run"));
    if !within(Duration::from_secs(10), || sleepers(&site).is_empty()) {
        problems.push(format!(
            "the setsid sleep outlived lead chat: pids {:?}",
            sleepers(&site)
        ));
    }
    problems.extend(leaks(&site, &fake, &[]));
    assert!(
        problems.is_empty(),
        "the chat lead's hostile calls reached what they must not:\n  {}\nchat stderr:\n{}",
        problems.join("\n  "),
        site.read_log("chat.stderr")
    );
}

/// Acceptance 2: with `--sandbox off` a command may write into the team dir (the documented
/// behaviour: nothing confines it), and `lead status` says the tools run unsandboxed.
#[test]
fn sandbox_off_is_said_in_status() {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    fake.push_for(
        "m-amy",
        Reply::ok(anthropic_message(
            r#"{"type":"tool_use","id":"tu_1","name":"bash","input":{"command":"touch .team/owned_by_agent && echo made"}}"#,
            "tool_use",
            USAGE,
        )),
    );
    fake.push_for("m-amy", Reply::ok(anthropic_text("touched")));
    let mut lead = run(&site, &url, &["--sandbox", "off"], None);
    site.wait_status("amy", "idle");
    assert!(
        site.team_dir().join("owned_by_agent").exists(),
        "with --sandbox off the command could not write into the team dir; lead stderr:\n{}",
        site.read_log("lead.stderr")
    );
    let status = site.sandbox_status("amy");
    assert_eq!(status["mode"], "off", "amy's sandbox status: {status}");
    assert_eq!(status["active"], false, "amy's sandbox status: {status}");
    let text = site.status_text();
    assert!(
        text.contains("unsandboxed"),
        "lead status does not say the tools run unsandboxed:\n{text}"
    );
    assert_eq!(stop(&mut lead.0, "lead run"), None);
}

/// Best effort: what the sandbox could not set up is named, in `lead status --json` and in the
/// status for people; when nothing is missing, the sandbox is active.
#[test]
fn best_effort_reports_what_is_missing() {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    fake.push_for("m-amy", Reply::ok(anthropic_text("ready")));
    let mut lead = run(&site, &url, &["--sandbox", "best-effort"], None);
    site.wait_status("amy", "idle");
    let status = site.sandbox_status("amy");
    assert_eq!(status["mode"], "best-effort", "{status}");
    let missing: Vec<&str> = status["missing"]
        .as_array()
        .map(|m| m.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if status["active"] == true {
        assert!(
            missing.is_empty(),
            "active, yet something missing: {status}"
        );
        assert!(status["landlock_abi"].as_u64() > Some(0), "{status}");
    } else {
        assert!(
            !missing.is_empty() && missing.iter().all(|m| !m.trim().is_empty()),
            "the sandbox is not active and does not say what is missing: {status}"
        );
        let text = site.status_text();
        assert!(
            missing.iter().all(|m| text.contains(m)),
            "lead status does not name what the sandbox is missing ({missing:?}):\n{text}"
        );
    }
    assert!(
        status["refused"].is_null(),
        "best-effort never refuses: {status}"
    );
    assert!(!in_ci() || status["active"] == true, "CI=true: {status}");
    assert_eq!(stop(&mut lead.0, "lead run"), None);
}
