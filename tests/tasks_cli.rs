//! `lead task ...` driven as a shell script would: exit codes, stdout, one line on stderr.

mod support;

use serde_json::Value;
use support::cli::{code, lead, stderr, stdout};
use support::team::Team;

/// Runs a command that must succeed and returns its stdout.
fn ok(team: &Team, args: &[&str]) -> String {
    let o = lead(team, args);
    assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
    stdout(&o)
}

/// Runs a `--json` command that must succeed and returns its one document.
fn json(team: &Team, args: &[&str]) -> Value {
    let out = ok(team, args);
    assert_eq!(out.lines().count(), 1, "{args:?}: one line: {out}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?}: {e}: {out}"))
}

/// Runs a command that must fail with `want` and one line on stderr holding `text`.
fn fails(team: &Team, args: &[&str], want: i32, text: &str) {
    let o = lead(team, args);
    let err = stderr(&o);
    assert_eq!(code(&o), want, "{args:?}: {err}");
    assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    assert!(err.contains(text), "{args:?}: {err}");
    assert!(stdout(&o).is_empty(), "{args:?}: nothing on stdout");
}

#[test]
fn add_list_show_cancel_reopen() {
    let team = Team::new();
    let a = ok(&team, &["task", "add", "design the schema"]);
    assert_eq!(a.len(), 8, "an id: {a}");
    let b = json(
        &team,
        &[
            "task",
            "add",
            "write the migration",
            "--description",
            "up and down",
            "--blocked-by",
            &a,
            "--json",
        ],
    );
    let b_id = b["id"].as_str().unwrap().to_owned();
    assert_eq!(b["status"], "pending");
    assert_eq!(b["blocked_by"], serde_json::json!([a]));
    assert_eq!(b["created_by"], "lead");
    assert_eq!(b["description"], "up and down");
    let c = ok(&team, &["task", "add", "review", "--blocked-by", &b_id]);
    assert!(team.dir.task(&c).unwrap().exists());

    let table = ok(&team, &["task", "list"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 4, "{table}");
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("SUBJECT"),
        "{table}"
    );
    assert!(lines[1].starts_with(&a) && lines[1].contains("design the schema"));
    assert!(
        lines[2].starts_with(&b_id) && lines[2].contains(&a),
        "{table}"
    );

    let all = json(&team, &["task", "list", "--json"]);
    assert_eq!(all.as_array().unwrap().len(), 3);
    let pending = json(&team, &["task", "list", "--status", "pending", "--json"]);
    assert_eq!(pending.as_array().unwrap().len(), 3);
    let none = json(&team, &["task", "list", "--status", "completed", "--json"]);
    assert_eq!(none, serde_json::json!([]));

    let shown = ok(&team, &["task", "show", &b_id]);
    assert!(shown.contains("write the migration") && shown.contains("up and down"));
    let shown = json(&team, &["task", "show", &b_id, "--json"]);
    assert_eq!(shown["id"], b_id.as_str());

    // b waits on a, c waits on b: cancelling a strands both unless --cascade.
    fails(&team, &["task", "cancel", &a], 4, "--cascade");
    let o = lead(&team, &["task", "cancel", &a]);
    assert!(stderr(&o).contains(&b_id) && stderr(&o).contains(&c));
    let done = json(&team, &["task", "cancel", &a, "--cascade", "--json"]);
    let done = done["cancelled"].as_array().unwrap();
    assert_eq!(done.len(), 3);
    assert_eq!(done[0]["id"], a.as_str());
    fails(&team, &["task", "cancel", &a], 4, "already cancelled");

    let out = ok(&team, &["task", "reopen", &c]);
    assert_eq!(out, format!("{c} pending"));
    fails(&team, &["task", "reopen", &c], 4, "not closed");
    let r = json(&team, &["task", "reopen", &a, "--json"]);
    assert_eq!(r["status"], "pending");
    ok(&team, &["task", "reopen", &b_id]);
    let out = ok(&team, &["task", "cancel", &a, "--cascade"]);
    assert_eq!(out.lines().count(), 3, "{out}");
    assert_eq!(out.lines().next().unwrap(), format!("{a} cancelled"));

    let kinds: Vec<String> = troupe::events::read_all(&team.dir)
        .unwrap()
        .iter()
        .filter_map(|e| e["event"].as_str().map(str::to_owned))
        .collect();
    for k in ["task_created", "task_cancelled", "task_reopened"] {
        assert!(kinds.iter().any(|x| x == k), "{k} in {kinds:?}");
    }
}

#[test]
fn bad_input_exit_codes_and_one_line_errors() {
    let team = Team::new();
    fails(
        &team,
        &["task", "show", "deadbeef"],
        3,
        "no such task: deadbeef",
    );
    fails(
        &team,
        &["task", "show", "../../etc/passwd"],
        3,
        "no such task",
    );
    fails(&team, &["task", "cancel", "../config"], 3, "no such task");
    fails(&team, &["task", "reopen", "deadbeef"], 3, "no such task");
    fails(
        &team,
        &["task", "add", "x", "--blocked-by", "deadbeef"],
        3,
        "no such task: deadbeef",
    );
    fails(
        &team,
        &["task", "add", "x", "--blocked-by", "../../x"],
        3,
        "no such task",
    );
    fails(&team, &["task", "add", " "], 2, "subject is empty");
    fails(
        &team,
        &["task", "add", "x", "--owner", "Bad"],
        2,
        "invalid name",
    );
    fails(
        &team,
        &["task", "add", "x", "--owner", "alice"],
        3,
        "no such teammate: alice",
    );
    let o = lead(&team, &["task", "list", "--status", "done"]);
    assert_eq!(code(&o), 2, "{}", stderr(&o));
    assert!(stderr(&o).contains("unknown task status"), "{}", stderr(&o));
    assert_eq!(
        json(&team, &["task", "list", "--json"]),
        serde_json::json!([])
    );

    // A member of the roster may own a task from the start.
    team.add_member("alice", 0, false);
    let t = json(&team, &["task", "add", "x", "--owner", "alice", "--json"]);
    assert_eq!(t["owner"], "alice");
    let table = ok(&team, &["task", "list", "--status", "pending"]);
    assert!(table.lines().nth(1).unwrap().contains("alice"), "{table}");
}
