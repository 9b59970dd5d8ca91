//! Issue 13, the team file: `lead up FILE` through the real `lead` binary (and, for a running
//! team, `lead run` with workers against the fake LLM). Applying a file twice changes nothing;
//! an edited file updates what changed and reports what it no longer lists; `--prune` removes
//! that; a bad file changes nothing; members declared after `lead run` started come up.

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Stopping, Team, lead_cmd, wait_until};

/// Makes the team's project root a git repository with one commit, for the members with
/// `worktree = true`; their worktrees, beside it, go when the guard drops.
struct Repo(PathBuf);

impl Drop for Repo {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn git_repo(team: &Team) -> Repo {
    let root = team.tmp.path();
    for args in [
        &["init", "-q"][..],
        &[
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.invalid",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "first",
        ],
    ] {
        let o = std::process::Command::new("git")
            .arg("-C")
            .arg(root)
            .args(args)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let name = root.file_name().unwrap().to_string_lossy().into_owned();
    Repo(root.with_file_name(format!("{name}.troupe")))
}
use troupe::config::{MemberStatus, Roster};
use troupe::inbox::Inbox;
use troupe::tasks::TaskStore;
use troupe::{AgentName, TeamDir};

const T: Duration = Duration::from_secs(60);

const FILE: &str = r#"
team_budget_usd = 5.0

[[members]]
name = "alice"
role = "coder"
prompt_file = "prompts/alice.md"
model = "m-alice"
auto_claim = true
budget_usd = 1.5

[[members]]
name = "bob"
role = "reviewer"
prompt = "Review what alice writes."
model = "m-bob"
require_plan_approval = true
worktree = true
budget_tokens = 100000

[[tasks]]
key = "schema"
subject = "Write the schema"
description = "Tables for users and orders."

[[tasks]]
key = "api"
subject = "Write the API"
blocked_by = ["schema"]
owner = "alice"

[[tasks]]
key = "review"
subject = "Review the API"
blocked_by = ["api", "schema"]

[[hooks]]
event = "task_completed"
command = "true"
timeout_secs = 30
"#;

/// Writes `text` as `team.toml` (and alice's prompt file) in the test's directory.
fn write_file(team: &Team, name: &str, text: &str) -> PathBuf {
    let dir = team.path().join("teamfile");
    std::fs::create_dir_all(dir.join("prompts")).unwrap();
    std::fs::write(dir.join("prompts/alice.md"), "Write the code.\n").unwrap();
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path
}

/// `lead up FILE`, with `--accept`: these tests are about what a file does, and the file lies in
/// the team's project root (tests/team_file_trust.rs is about when it needs `--accept`).
fn up(team: &Team, file: &Path, more: &[&str]) -> Output {
    let mut args = vec!["up", file.to_str().unwrap(), "--accept"];
    args.extend_from_slice(more);
    lead_cmd(team, "http://127.0.0.1:9", &args)
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout.clone()).unwrap()
}

/// Every file of the team dir that `lead up` may change, with its bytes (the lock files, which
/// hold no content, and the record of applied files, which each new file path adds to, left
/// out).
fn snapshot(dir: &TeamDir) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let root = dir.root();
    if !root.exists() {
        return out;
    }
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_none_or(|x| x != "lock")
                && p != dir.root().join("team-file.json")
            {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// Asserts two snapshots are the same, naming the files that differ.
#[track_caller]
fn assert_same(before: &BTreeMap<String, Vec<u8>>, after: &BTreeMap<String, Vec<u8>>, what: &str) {
    let differ: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|k| before.get(*k) != after.get(*k))
        .collect();
    assert!(differ.is_empty(), "{what}: these files changed: {differ:?}");
}

fn json_doc(o: &Output) -> Value {
    serde_json::from_str(&ok(o)).unwrap()
}

/// The `kind:name` labels of one list of the `--json` report.
fn labels(doc: &Value, list: &str) -> Vec<String> {
    let mut v: Vec<String> = doc[list]
        .as_array()
        .unwrap_or_else(|| panic!("no {list} in {doc}"))
        .iter()
        .map(|i| {
            let who = i["name"].as_str().or(i["key"].as_str()).unwrap_or("");
            format!("{}:{who}", i["kind"].as_str().unwrap())
        })
        .collect();
    v.sort();
    v
}

fn task_by_key(dir: &TeamDir, key: &str) -> troupe::tasks::Task {
    TaskStore::new(dir)
        .list(None)
        .unwrap()
        .into_iter()
        .find(|t| t.key.as_deref() == Some(key))
        .unwrap_or_else(|| panic!("no task with key {key}"))
}

fn inbox_len(dir: &TeamDir, name: &str) -> usize {
    Inbox::new(dir, &AgentName::teammate(name).unwrap())
        .peek()
        .unwrap()
        .len()
}

#[test]
fn applying_a_file_twice_changes_nothing_the_second_time() {
    let team = Team::new();
    let _repo = git_repo(&team);
    let file = write_file(&team, "team.toml", FILE);
    let first = json_doc(&up(&team, &file, &["--json"]));
    assert_eq!(first["changed"], true);
    assert_eq!(
        labels(&first, "added"),
        [
            "member:alice",
            "member:bob",
            "task:api",
            "task:review",
            "task:schema"
        ]
    );
    assert_eq!(labels(&first, "updated"), ["hooks:", "team:"]);

    // What it made: members waiting for a supervisor, with their settings and their task.
    let cfg = Roster::new(&team.dir).load().unwrap();
    let alice = cfg.require("alice").unwrap();
    assert_eq!(alice.status, MemberStatus::Spawning);
    assert_eq!(alice.prompt.as_deref(), Some("Write the code.\n"));
    assert_eq!(alice.model.as_deref(), Some("m-alice"));
    assert!(alice.auto_claim && !alice.require_plan_approval);
    assert_eq!(alice.budget_usd, Some(1.5));
    let bob = cfg.require("bob").unwrap();
    assert!(bob.require_plan_approval);
    assert_eq!(bob.budget_tokens, Some(100000));
    assert_eq!(cfg.team_budget_usd, Some(5.0));
    assert_eq!(cfg.hooks.len(), 1);
    assert_eq!(cfg.hooks[0].command, "true");
    assert_eq!(inbox_len(&team.dir, "alice"), 1);
    let (schema, api, review) = (
        task_by_key(&team.dir, "schema"),
        task_by_key(&team.dir, "api"),
        task_by_key(&team.dir, "review"),
    );
    assert_eq!(api.blocked_by, std::slice::from_ref(&schema.id));
    assert_eq!(api.owner.as_deref(), Some("alice"));
    let mut rb = review.blocked_by.clone();
    rb.sort();
    let mut want = vec![api.id.clone(), schema.id.clone()];
    want.sort();
    assert_eq!(rb, want);
    assert_eq!(schema.description, "Tables for users and orders.");

    // The second time: the same bytes everywhere (roster, tasks, events, inboxes).
    let before = snapshot(&team.dir);
    let text = ok(&up(&team, &file, &[]));
    assert_same(&before, &snapshot(&team.dir), "the second `lead up`");
    assert!(!text.is_empty());
    for line in text.lines() {
        assert!(line.contains("unchanged"), "not unchanged: {line}\n{text}");
    }
    assert_eq!(text.lines().count(), 7, "{text}");
    let again = json_doc(&up(&team, &file, &["--json"]));
    assert_same(&before, &snapshot(&team.dir), "applied again");
    assert_eq!(again["changed"], false);
    for list in ["added", "updated", "unlisted", "pruned"] {
        assert!(labels(&again, list).is_empty(), "{list}: {again}");
    }
    assert_eq!(labels(&again, "unchanged").len(), 7, "{again}");

    // The same team as JSON is the same file.
    let cfg_json = serde_json::json!({
        "team_budget_usd": 5.0,
        "members": [
            {"name": "alice", "role": "coder", "prompt_file": "prompts/alice.md", "model": "m-alice",
             "auto_claim": true, "budget_usd": 1.5},
            {"name": "bob", "role": "reviewer", "prompt": "Review what alice writes.", "model": "m-bob",
             "require_plan_approval": true, "worktree": true, "budget_tokens": 100000}
        ],
        "tasks": [
            {"key": "schema", "subject": "Write the schema", "description": "Tables for users and orders."},
            {"key": "api", "subject": "Write the API", "blocked_by": ["schema"], "owner": "alice"},
            {"key": "review", "subject": "Review the API", "blocked_by": ["api", "schema"]}
        ],
        "hooks": [{"event": "task_completed", "command": "true", "timeout_secs": 30}]
    });
    let jfile = write_file(&team, "team.json", &cfg_json.to_string());
    let doc = json_doc(&up(&team, &jfile, &["--json"]));
    assert_eq!(doc["changed"], false, "{doc}");
    assert_same(&before, &snapshot(&team.dir), "applied again");
}

#[test]
fn an_edited_file_updates_what_changed_and_prune_removes_the_unlisted() {
    let team = Team::new();
    let _repo = git_repo(&team);
    let file = write_file(&team, "team.toml", FILE);
    ok(&up(&team, &file, &[]));
    let inbox_before = inbox_len(&team.dir, "alice");
    let tasks_before = TaskStore::new(&team.dir).list(None).unwrap().len();

    // alice gets a new prompt, bob is gone, a pending task has a new description.
    let edited = FILE
        .replace(
            "prompt_file = \"prompts/alice.md\"",
            "prompt = \"Write the code, with tests.\"",
        )
        .replace(
            "[[members]]\nname = \"bob\"\nrole = \"reviewer\"\nprompt = \"Review what alice writes.\"\nmodel = \"m-bob\"\nrequire_plan_approval = true\nworktree = true\nbudget_tokens = 100000\n",
            "",
        )
        .replace("Tables for users and orders.", "Tables for users, orders and items.");
    assert!(!edited.contains("bob"));
    let file = write_file(&team, "team.toml", &edited);
    let text = ok(&up(&team, &file, &[]));
    assert!(text.contains("member alice updated (prompt)"), "{text}");
    assert!(text.contains("member bob unlisted"), "{text}");
    assert!(text.contains("task schema updated"), "{text}");
    assert!(text.contains("task api unchanged"), "{text}");
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert_eq!(
        cfg.require("alice").unwrap().prompt.as_deref(),
        Some("Write the code, with tests.")
    );
    // bob is reported, not removed; alice got no new task message; no task was added.
    assert!(cfg.member("bob").is_some());
    assert_eq!(inbox_len(&team.dir, "alice"), inbox_before);
    assert_eq!(
        TaskStore::new(&team.dir).list(None).unwrap().len(),
        tasks_before
    );
    assert_eq!(
        task_by_key(&team.dir, "schema").description,
        "Tables for users, orders and items."
    );

    // The edited file applied again: nothing.
    let before = snapshot(&team.dir);
    let doc = json_doc(&up(&team, &file, &["--json"]));
    assert_eq!(doc["changed"], false, "{doc}");
    assert_eq!(labels(&doc, "unlisted"), ["member:bob"]);
    assert_same(&before, &snapshot(&team.dir), "applied again");

    // --prune removes bob (he never ran: no supervisor).
    let doc = json_doc(&up(&team, &file, &["--prune", "--json"]));
    assert_eq!(labels(&doc, "pruned"), ["member:bob"], "{doc}");
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert!(cfg.member("bob").is_none());
    assert!(cfg.member("alice").is_some());
    let doc = json_doc(&up(&team, &file, &["--prune", "--json"]));
    assert_eq!(doc["changed"], false, "{doc}");
}

#[test]
fn a_bad_file_changes_nothing_and_says_why() {
    let team = Team::new();
    let _repo = git_repo(&team);
    let file = write_file(&team, "team.toml", FILE);
    ok(&up(&team, &file, &[]));
    let before = snapshot(&team.dir);
    let cases: &[(&str, String, &str)] = &[
        (
            "unknown blocker",
            FILE.replace("blocked_by = [\"schema\"]", "blocked_by = [\"shcema\"]"),
            "shcema",
        ),
        (
            "cycle",
            FILE.replace(
                "key = \"schema\"\nsubject = \"Write the schema\"",
                "key = \"schema\"\nsubject = \"Write the schema\"\nblocked_by = [\"review\"]",
            ),
            "cycle",
        ),
        (
            "unknown field",
            FILE.replace("auto_claim = true", "auto_claim = true\nautoclaim = true"),
            "autoclaim",
        ),
        (
            "missing prompt file",
            FILE.replace("prompts/alice.md", "prompts/nobody.md"),
            "nobody.md",
        ),
        (
            "bad hook event",
            FILE.replace("event = \"task_completed\"", "event = \"task_done\""),
            "task_done",
        ),
        (
            "bad name",
            FILE.replace("name = \"bob\"", "name = \"Bob\""),
            "Bob",
        ),
        (
            "duplicate key",
            FILE.replace("key = \"review\"", "key = \"api\""),
            "api",
        ),
        (
            "unknown owner",
            FILE.replace("owner = \"alice\"", "owner = \"carol\""),
            "carol",
        ),
        ("not toml", "[[members]\nname = ".to_owned(), "team.toml"),
    ];
    for (what, text, needle) in cases {
        let file = write_file(&team, "team.toml", text);
        let o = up(&team, &file, &["--prune"]);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{what}: accepted");
        assert_eq!(o.status.code(), Some(2), "{what}: {stderr}");
        assert!(o.stdout.is_empty(), "{what}: stdout {:?}", o.stdout);
        assert!(stderr.contains(needle), "{what}: {stderr}");
        assert_same(&before, &snapshot(&team.dir), what);
    }
    // A bad file on a fresh team dir does not even create it.
    let fresh = Team::new();
    let _repo = git_repo(&fresh);
    std::fs::remove_dir_all(fresh.dir.root()).unwrap();
    let file = write_file(
        &fresh,
        "team.toml",
        &FILE.replace("prompts/alice.md", "x.md"),
    );
    assert_eq!(up(&fresh, &file, &[]).status.code(), Some(2));
    assert!(!fresh.dir.root().exists());
    // A missing file is an error too.
    let o = up(&team, &team.path().join("nope.toml"), &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope.toml"));
}

/// The system prompt of the last request for `model`.
fn last_system(fake: &FakeLlm, model: &str) -> String {
    fake.requests()
        .iter()
        .rev()
        .find(|r| r.body["model"] == model)
        .map(|r| r.body["system"].to_string())
        .unwrap_or_default()
}

#[test]
fn up_before_and_after_lead_run_brings_members_up() {
    let team = Team::new();
    let _repo = git_repo(&team);
    let fake = FakeLlm::start((0..40).map(|_| Reply::ok(anthropic_text("ok"))));
    let url = fake.url();
    // Before `lead run`: bob waits in `spawning`.
    let only_bob = r#"
[[members]]
name = "bob"
role = "reviewer"
prompt = "Review things."
model = "m-bob"
"#;
    let file = write_file(&team, "team.toml", only_bob);
    ok(&up(&team, &file, &[]));
    assert_eq!(team.status("bob"), MemberStatus::Spawning);
    let _lead = Stopping(
        lead_cmd(
            &team,
            &url,
            &["run", "--stop-timeout", "2", "--kill-grace", "1"],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    wait_until(T, "bob idle", || {
        (team.status("bob") == MemberStatus::Idle).then_some(())
    });
    // After: alice is added to the running team and comes up.
    let both = format!(
        "{only_bob}\n[[members]]\nname = \"alice\"\nrole = \"coder\"\nprompt = \"Old prompt.\"\nmodel = \"m-alice\"\n"
    );
    let file = write_file(&team, "team.toml", &both);
    let text = ok(&up(&team, &file, &[]));
    assert!(text.contains("member alice added"), "{text}");
    assert!(text.contains("member bob unchanged"), "{text}");
    wait_until(T, "alice idle", || {
        (team.status("alice") == MemberStatus::Idle).then_some(())
    });
    assert!(last_system(&fake, "m-alice").contains("Old prompt."));
    let alice = team.member("alice");

    // A new prompt and model: no restart, no message; they apply from the next activation.
    let file = write_file(
        &team,
        "team.toml",
        &both
            .replace("Old prompt.", "New prompt.")
            .replace("m-alice", "m-alice-2"),
    );
    let inbox_before = inbox_len(&team.dir, "alice");
    let text = ok(&up(&team, &file, &[]));
    assert!(
        text.contains("member alice updated (prompt, model)"),
        "{text}"
    );
    assert_eq!(fake.requests_for("m-alice-2"), 0);
    assert_eq!(inbox_len(&team.dir, "alice"), inbox_before);
    let o = lead_cmd(&team, &url, &["send", "alice", "hello"])
        .output()
        .unwrap();
    assert!(o.status.success());
    wait_until(T, "alice's next activation", || {
        (fake.requests_for("m-alice-2") > 0).then_some(())
    });
    let system = last_system(&fake, "m-alice-2");
    assert!(system.contains("New prompt."), "{system}");
    assert!(!system.contains("Old prompt."), "{system}");
    wait_until(T, "alice idle again", || {
        (team.status("alice") == MemberStatus::Idle).then_some(())
    });
    let now = team.member("alice");
    assert_eq!(now.incarnation, alice.incarnation, "alice was restarted");
    assert_eq!(now.pid, alice.pid);

    // --prune of a running member is refused, and changes nothing.
    let file = write_file(&team, "team.toml", only_bob);
    let before = std::fs::read(team.dir.config()).unwrap();
    let o = up(&team, &file, &["--prune"]);
    assert_eq!(o.status.code(), Some(4));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.contains("lead shutdown alice"), "{stderr}");
    assert!(team.dir.config().exists());
    let after = std::fs::read(team.dir.config()).unwrap();
    let names = |b: &[u8]| -> Vec<String> {
        let v: Value = serde_json::from_slice(b).unwrap();
        v["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(names(&after), names(&before));
}

#[test]
fn a_keyed_task_is_created_once_by_racing_appliers() {
    let team = Team::new();
    let _repo = git_repo(&team);
    let store = TaskStore::new(&team.dir);
    let created: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let (_, created) = store
                        .create_keyed(
                            "build",
                            troupe::tasks::NewTask {
                                subject: "build it".into(),
                                created_by: "lead".into(),
                                ..Default::default()
                            },
                        )
                        .unwrap();
                    usize::from(created)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(created, 1);
    let all = store.list(None).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].key.as_deref(), Some("build"));
    // An unkeyed task does not carry the field at all (older readers see what they saw).
    let plain = store
        .create(troupe::tasks::NewTask {
            subject: "plain".into(),
            created_by: "lead".into(),
            ..Default::default()
        })
        .unwrap();
    let raw = std::fs::read_to_string(team.dir.task(&plain.id).unwrap()).unwrap();
    assert!(!raw.contains("\"key\""), "{raw}");
}

#[test]
fn settings_updates_write_only_changes_and_prune_only_members_without_a_process() {
    use troupe::ops::{self, MemberSettings};
    let team = Team::new();
    let _repo = git_repo(&team);
    team.add_member("amy", 0, false);
    let mut s = MemberSettings {
        role: "coder".into(),
        prompt: "Do what the lead asks.".into(),
        model: None,
        require_plan_approval: false,
        auto_claim: false,
        budget_usd: None,
        budget_tokens: None,
    };
    let before = snapshot(&team.dir);
    assert!(
        ops::update_settings(&team.dir, "amy", &s)
            .unwrap()
            .is_empty()
    );
    assert_same(
        &before,
        &snapshot(&team.dir),
        "an update that changes nothing",
    );
    s.prompt = "New.".into();
    s.model = Some("m".into());
    assert_eq!(
        ops::update_settings(&team.dir, "amy", &s).unwrap(),
        ["prompt", "model"]
    );
    assert_eq!(team.member("amy").prompt.as_deref(), Some("New."));
    assert_eq!(inbox_len(&team.dir, "amy"), 0, "an update sends no message");
    assert_eq!(team.status("amy"), MemberStatus::Spawning);

    // Idle (it has a process): refused. Stopped, with a task in progress: removed, task freed.
    Roster::new(&team.dir)
        .update_member("amy", |m| m.status = MemberStatus::Idle)
        .unwrap();
    let e = ops::remove_member(&team.dir, "amy").unwrap_err();
    assert_eq!(e.exit_code(), 4, "{e}");
    let store = TaskStore::new(&team.dir);
    let t = store
        .create(troupe::tasks::NewTask {
            subject: "x".into(),
            created_by: "lead".into(),
            ..Default::default()
        })
        .unwrap();
    store.claim(Some(&t.id), "amy", 1).unwrap();
    Roster::new(&team.dir)
        .update_member("amy", |m| m.status = MemberStatus::Stopped)
        .unwrap();
    ops::remove_member(&team.dir, "amy").unwrap();
    assert!(
        Roster::new(&team.dir)
            .load()
            .unwrap()
            .member("amy")
            .is_none()
    );
    assert_eq!(
        store.get(&t.id).unwrap().status,
        troupe::tasks::TaskStatus::Pending
    );
}
