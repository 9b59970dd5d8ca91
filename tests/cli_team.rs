//! The lead's acceptance scenario driven only through the CLI, as a shell script would, with
//! `lead run` supervising three real workers that talk to one fake LLM server (each teammate
//! has its own model id, so each gets its own script). It runs twice: on the team dir's files,
//! and with the team's state on a Redis bus (issue 15), where it reads state only through the
//! CLI and the library's seam.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::redis_server::RedisServer;
use support::team::{Bg, Team, alive, lead_cmd, wait_until};

const T: Duration = Duration::from_secs(30);
const USAGE: &str = r#"{"input_tokens":3,"output_tokens":2}"#;

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)))
}

fn tool(name: &str, input: &str) -> Reply {
    Reply::ok(anthropic_message(
        &anthropic_tool_use_block("tu", name, input),
        "tool_use",
        USAGE,
    ))
}

#[test]
fn three_teammates_plans_shutdowns_and_stop_through_the_cli() {
    scenario(None);
}

#[test]
fn the_same_scenario_on_a_redis_bus() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    scenario(Some((server.url("scenario"), server.password.clone())));
}

/// The scenario, on the files or on the bus `(URL, password)`.
fn scenario(bus: Option<(String, String)>) {
    let lead = |team: &Team, url: &str, args: &[&str]| {
        let mut c = lead_cmd(team, url, args);
        if let Some((bus, password)) = &bus {
            c.env(troupe::store::redis::BUS_ENV, bus)
                .env(troupe::store::redis::PASSWORD_ENV, password);
        }
        c
    };
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(15));
    fake.push_for("m-ann", tool("plan_approval", r#"{"plan":"v1"}"#));
    fake.push_for("m-ann", Reply::ok(anthropic_text("plan v1 submitted")));
    fake.push_for("m-bob", Reply::ok(anthropic_text("bob ready")));
    fake.push_for("m-cat", Reply::ok(anthropic_text("cat ready")));
    let url = fake.url();
    for (name, model, plan) in [
        ("ann", "m-ann", true),
        ("bob", "m-bob", false),
        ("cat", "m-cat", false),
    ] {
        let mut args = vec![
            "spawn", name, "--role", "coder", "--prompt", "help", "--model", model,
        ];
        if plan {
            args.push("--require-plan-approval");
        }
        assert_eq!(out(&mut lead(&team, &url, &args)).status.code(), Some(0));
    }
    let _sup = Bg(lead(
        &team,
        &url,
        &["run", "--stop-timeout", "1", "--kill-grace", "1"],
    )
    .stderr(Stdio::null())
    .spawn()
    .unwrap());
    let status = || json(&out(&mut lead(&team, &url, &["status", "--json"])));
    let all_idle = |n: usize| {
        wait_until(T, "the team idle", || {
            let v = status();
            let members = v["members"].as_array().unwrap().clone();
            let idle = members.iter().filter(|m| m["status"] == "idle").count();
            (idle == n).then_some(members)
        })
    };
    let members = all_idle(3);
    assert!(
        members
            .iter()
            .all(|m| m["pid"].as_u64().is_some() && m["incarnation"] == 1)
    );

    // Messages.
    fake.push_for("m-bob", Reply::ok(anthropic_text("hi from bob")));
    fake.push_for("m-cat", Reply::ok(anthropic_text("hi from cat")));
    for n in ["bob", "cat"] {
        let o = out(&mut lead(&team, &url, &["send", n, "hello", "--json"]));
        assert!(json(&o)["id"].is_string());
    }
    wait_until(T, "replies", || {
        (fake.requests_for("m-bob") == 2 && fake.requests_for("m-cat") == 2).then_some(())
    });
    all_idle(3);

    // Plan: reject with feedback, then approve the resubmission.
    let pending = |kind: &str| {
        wait_until(T, "a pending request", || {
            let v = json(&out(&mut lead(
                &team,
                &url,
                &["requests", "--status", "pending", "--json"],
            )));
            v.as_array()
                .unwrap()
                .iter()
                .find(|r| r["kind"] == kind)
                .cloned()
        })
    };
    let first = pending("plan_approval")["request_id"]
        .as_str()
        .unwrap()
        .to_owned();
    fake.push_for("m-ann", tool("plan_approval", r#"{"plan":"v2"}"#));
    fake.push_for("m-ann", Reply::ok(anthropic_text("plan v2 submitted")));
    assert_eq!(
        out(&mut lead(
            &team,
            &url,
            &["reject", &first, "--feedback", "add tests"]
        ))
        .status
        .code(),
        Some(0)
    );
    let second = wait_until(T, "second plan", || {
        let v = json(&out(&mut lead(
            &team,
            &url,
            &["requests", "--status", "pending", "--json"],
        )));
        v.as_array()
            .unwrap()
            .iter()
            .find(|r| r["request_id"] != first.as_str())
            .cloned()
    });
    assert_eq!(second["payload"]["plan"], "v2");
    fake.push_for("m-ann", Reply::ok(anthropic_text("building")));
    let sid = second["request_id"].as_str().unwrap();
    assert_eq!(
        out(&mut lead(&team, &url, &["approve", sid])).status.code(),
        Some(0)
    );
    wait_until(T, "ann saw the approval", || {
        (fake.requests_for("m-ann") >= 5).then_some(())
    });
    all_idle(3);

    // bob approves a shutdown (--wait: 0), cat rejects one (--wait: 5).
    // `lead shutdown NAME --wait`, answered by the teammate's model once the request exists.
    let shutdown_wait = |name: &str, model: &str, approve: bool| {
        std::thread::scope(|s| {
            let h = s.spawn(|| {
                out(&mut lead(
                    &team,
                    &url,
                    &["shutdown", name, "--wait", "--timeout", "20"],
                ))
            });
            let rid = wait_until(T, "shutdown request", || {
                let v = json(&out(&mut lead(
                    &team,
                    &url,
                    &["requests", "--status", "pending", "--json"],
                )));
                v.as_array()
                    .unwrap()
                    .iter()
                    .find(|r| r["kind"] == "shutdown")
                    .cloned()
            });
            let input = format!(
                r#"{{"request_id":"{}","approve":{approve},"reason":"because"}}"#,
                rid["request_id"].as_str().unwrap()
            );
            fake.push_for(model, tool("shutdown_response", &input));
            if !approve {
                fake.push_for(model, Reply::ok(anthropic_text("staying")));
            }
            h.join().unwrap()
        })
    };
    let bob_pid = members.iter().find(|m| m["name"] == "bob").unwrap()["pid"]
        .as_u64()
        .unwrap();
    let o = shutdown_wait("bob", "m-bob", true);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v = status();
    let bob = v["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "bob")
        .unwrap()
        .clone();
    assert_eq!(bob["status"], "shutdown");
    assert!(!alive(bob_pid));
    let o = shutdown_wait("cat", "m-cat", false);
    assert_eq!(
        o.status.code(),
        Some(5),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let approved = json(&out(&mut lead(
        &team,
        &url,
        &["requests", "--status", "approved", "--json"],
    )));
    assert!(
        approved
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["kind"] == "shutdown" && r["to"] == "bob")
    );

    // lead stop: everything down, the rest `stopped`, no process left.
    let pids: Vec<u64> = status()["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["pid"].as_u64())
        .collect();
    let o = out(&mut lead(&team, &url, &["stop"]));
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v = status();
    for m in v["members"].as_array().unwrap() {
        let want = if m["name"] == "bob" {
            "shutdown"
        } else {
            "stopped"
        };
        assert_eq!(m["status"], want, "{m}");
    }
    for p in pids {
        wait_until(T, "worker gone", || (!alive(p)).then_some(()));
    }
    let on = match &bus {
        Some((url, password)) => team.dir.clone().with_bus(Some(
            troupe::store::redis::RedisBus::with_password(url, password).unwrap(),
        )),
        None => team.dir.clone(),
    };
    let events = troupe::events::read_all(&on).unwrap();
    for e in [
        "spawn",
        "exit",
        "plan_submitted",
        "plan_rejected",
        "plan_approved",
        "shutdown_requested",
        "shutdown_response",
        "team_stop",
    ] {
        assert!(events.iter().any(|x| x["event"] == e), "no {e} event");
    }
    if bus.is_some() {
        // The state was on the bus: the team dir holds no roster, request or event.
        assert!(!team.dir.config().exists());
        assert!(!team.dir.events().exists());
        assert!(
            std::fs::read_dir(team.dir.requests_dir()).map_or(true, |d| d
                .filter_map(Result::ok)
                .all(|e| !e.file_name().to_string_lossy().ends_with(".json")))
        );
    }
}
