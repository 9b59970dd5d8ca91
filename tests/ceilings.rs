//! Issue 25's ceilings: `max_members` and `max_spawns_per_minute` refuse spawns beyond them,
//! from `lead spawn` (exit 4, naming the ceiling) and from the LLM lead's spawn_teammate (a
//! tool error), with the real `lead` and `worker` against a fake model server.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd as lead, start_supervisor, wait_until};
use troupe::config::{MemberStatus, Roster};

const T: Duration = Duration::from_secs(30);

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn text(t: &str) -> Reply {
    Reply::ok(anthropic_text(t))
}

fn spawn(team: &Team, url: &str, name: &str) -> Output {
    out(&mut lead(
        team,
        url,
        &[
            "spawn", name, "--role", "r", "--prompt", "p", "--model", "m-mate",
        ],
    ))
}

fn supervise(team: &Team, url: &str, extra: &[&str]) -> Bg {
    let mut args = vec!["run", "--stop-timeout", "2", "--kill-grace", "1"];
    args.extend_from_slice(extra);
    start_supervisor(team, lead(team, url, &args))
}

#[test]
fn a_spawn_beyond_max_members_exits_4_naming_the_ceiling_and_changes_nothing() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    for _ in 0..3 {
        fake.push_for("m-mate", text("done"));
    }
    let url = fake.url();
    let _sup = supervise(&team, &url, &["--max-members", "3"]);
    wait_until(T, "the ceiling in config.json", || {
        (Roster::new(&team.dir).load().unwrap().max_members == Some(3)).then_some(())
    });
    for name in ["a", "b", "c"] {
        let o = spawn(&team, &url, name);
        assert!(o.status.success(), "{o:?}");
    }
    let o = spawn(&team, &url, "d");
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("max_members is 3"), "{err}");
    assert!(err.contains("--max-members"), "{err}");
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert!(cfg.member("d").is_none(), "d was added: {cfg:?}");
    assert!(
        !team
            .dir
            .inbox(&troupe::teamdir::AgentName::teammate("d").unwrap())
            .exists()
    );
    // A member shut down leaves a place. (Everyone idle first: the replies queued next are
    // a's alone.)
    for name in ["a", "b", "c"] {
        wait_until(T, &format!("{name} idle"), || {
            (team.status(name) == MemberStatus::Idle).then_some(())
        });
    }
    let o = out(&mut lead(&team, &url, &["shutdown", "a"]));
    assert!(o.status.success(), "{o:?}");
    let id = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    fake.push_for(
        "m-mate",
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block(
                "toolu_s",
                "shutdown_response",
                &format!(r#"{{"request_id":"{id}","approve":true}}"#),
            ),
            "tool_use",
            r#"{"input_tokens":1,"output_tokens":1}"#,
        )),
    );
    fake.push_for("m-mate", text("done"));
    wait_until(T, "a shut down", || {
        (team.status("a") == MemberStatus::Shutdown).then_some(())
    });
    let o = spawn(&team, &url, "d");
    assert!(o.status.success(), "{o:?}");
    // a coming back would be a fourth again.
    let o = spawn(&team, &url, "a");
    assert_eq!(o.status.code(), Some(4), "{o:?}");
}

#[test]
fn spawns_per_minute_refuse_the_next_start_but_not_a_task_for_an_idle_member() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    for _ in 0..4 {
        fake.push_for("m-mate", text("done"));
    }
    let url = fake.url();
    std::fs::write(
        team.workdir.join("team.toml"),
        "max_spawns_per_minute = 2\n",
    )
    .unwrap();
    let o = out(&mut lead(&team, &url, &["up", "team.toml"]));
    assert!(o.status.success(), "{o:?}");
    let _sup = supervise(&team, &url, &[]);
    for name in ["a", "b"] {
        assert!(spawn(&team, &url, name).status.success());
    }
    let o = spawn(&team, &url, "c");
    assert_eq!(o.status.code(), Some(4), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("2 spawns in the last minute"), "{err}");
    assert!(err.contains("try again in"), "{err}");
    // An idle member's new task starts nothing: not a spawn.
    wait_until(T, "a idle", || {
        (team.status("a") == MemberStatus::Idle).then_some(())
    });
    let o = spawn(&team, &url, "a");
    assert!(o.status.success(), "{o:?}");
}

#[test]
fn an_llm_lead_asked_for_20_teammates_under_max_members_5_gets_5_and_15_tool_errors() {
    let team = Team::new();
    std::fs::write(team.workdir.join("team.toml"), "max_members = 5\n").unwrap();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    let url = fake.url();
    let o = out(&mut lead(&team, &url, &["up", "team.toml"]));
    assert!(o.status.success(), "{o:?}");
    let blocks: Vec<String> = (0..20)
        .map(|i| {
            anthropic_tool_use_block(
                &format!("toolu_{i}"),
                "spawn_teammate",
                &format!(r#"{{"name":"m{i}","role":"r","prompt":"p","model":"m-mate"}}"#),
            )
        })
        .collect();
    fake.push_for(
        "m-lead",
        Reply::ok(anthropic_message(
            &blocks.join(","),
            "tool_use",
            r#"{"input_tokens":10,"output_tokens":10}"#,
        )),
    );
    for _ in 0..10 {
        fake.push_for("m-lead", text("ok"));
    }
    for _ in 0..5 {
        fake.push_for("m-mate", text("done"));
    }
    let mut chat = Bg(lead(
        &team,
        &url,
        &["chat", "-p", "start 20 teammates", "--model", "m-lead"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap());
    wait_until(T, "the lead's second call", || {
        (fake.requests_for("m-lead") >= 2).then_some(())
    });
    let body = fake
        .requests()
        .into_iter()
        .filter(|r| r.body["model"] == "m-lead")
        .nth(1)
        .unwrap()
        .body;
    let results: Vec<(String, bool)> = body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
        .filter(|b| b["type"] == "tool_result")
        .map(|b| {
            (
                b["content"]
                    .as_str()
                    .map_or_else(|| b["content"].to_string(), str::to_owned),
                b["is_error"] == Value::Bool(true),
            )
        })
        .collect();
    assert_eq!(results.len(), 20, "{results:?}");
    let refused: Vec<&(String, bool)> = results.iter().filter(|r| r.1).collect();
    assert_eq!(refused.len(), 15, "{results:?}");
    for (content, _) in &refused {
        assert!(content.contains("max_members is 5"), "{content}");
    }
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert_eq!(cfg.members.len(), 5, "{:?}", cfg.members);
    let _ = chat.0.kill();
}
