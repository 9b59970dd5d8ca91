//! Issue 41, review 4: what the hooks that run outside the sandbox may run.
//!
//! - R4-4: a `request_pending` hook written the way the docs once wrote hooks
//!   (`./scripts/page-oncall.sh`) ran the script a teammate had rewritten, as the supervisor's
//!   user. Paging hooks now run from `/` with a PATH of system dirs, and one that names a file a
//!   member can write is refused and said so; a system command and a script outside every tree
//!   still page.
//! - R4-1 (the hook half): a `sandbox: false` hook found in `config.json` ran as the user,
//!   whoever wrote it there. Only one `lead up` applied from a team file runs outside now; any
//!   other runs sandboxed, with an event saying why, until a person applies it with `lead up`.
//!
//! Real `lead` and `worker` processes; the teammate's model is the fake LLM server.

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Stopping, Team, lead_cmd, wait_until};
use troupe::config::Roster;
use troupe::hooks::{Hook, HookEvent};
use troupe::requests::{NewRequest, RequestKind, RequestStore};
use troupe::tasks::{NewTask, TaskStore};

const T: Duration = Duration::from_secs(60);
const MODEL: &str = "m-alice";
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

fn run_lead(team: &Team, url: &str, extra: &[&str]) -> Stopping {
    let mut args = vec!["run", "--stop-timeout", "1", "--kill-grace", "1"];
    args.extend_from_slice(extra);
    Stopping(
        lead_cmd(team, url, &args)
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

fn ok(o: Output) -> Output {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

fn events(team: &Team) -> Vec<Value> {
    std::fs::read_to_string(team.dir.events())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn named(team: &Team, event: &str) -> Vec<Value> {
    events(team)
        .into_iter()
        .filter(|e| e["event"] == event)
        .collect()
}

/// The `hook_ran` events of `command`.
fn runs_of(team: &Team, command: &str) -> Vec<Value> {
    named(team, "hook_ran")
        .into_iter()
        .filter(|e| e["command"] == command)
        .collect()
}

fn script(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

fn bash_turn(id: &str, command: &str) -> Reply {
    let call = anthropic_tool_use_block(id, "bash", &json!({"command": command}).to_string());
    Reply::ok(anthropic_message(&call, "tool_use", USAGE))
}

/// R4-4 as `request_pending_hook_runs_model_code.sh` stages it: the person pages with a script
/// of the project; alice rewrites it from her sandbox and submits a plan; the plan waits past
/// `--escalate-after`. The rewritten script must not run; what names no member-writable file
/// pages, as the user, from `/`, with a system PATH.
#[test]
fn a_paging_hook_runs_no_file_a_teammate_can_write() {
    let team = Team::new();
    let outside = tempfile::tempdir().unwrap();
    let out = outside.path();
    std::fs::create_dir_all(team.workdir.join("scripts")).unwrap();
    let in_tree = team.workdir.join("scripts/page-oncall.sh");
    script(&in_tree, "#!/bin/sh\necho \"paged: $(cat)\" >> page.log\n");
    // A script of the person's, outside every tree a member can write.
    script(
        &out.join("page.sh"),
        "#!/bin/sh\ncat > \"$(dirname \"$0\")/script-paged.json\"\n",
    );
    let system = format!(
        "/bin/sh -c 'cat > {o}/system-paged.json; pwd > {o}/cwd; printf %s \"$PATH\" > {o}/path; \
         id -u > {o}/uid'",
        o = out.display()
    );
    let by_script = out.join("page.sh").display().to_string();
    let absolute_in_tree = format!("bash {}", in_tree.display());
    let team_file = json!({
        "members": [{"name": "alice", "role": "coder", "prompt": "work", "model": MODEL}],
        "hooks": [
            {"event": "request_pending", "command": "./scripts/page-oncall.sh"},
            {"event": "request_pending", "command": system},
            {"event": "request_pending", "command": by_script},
            {"event": "request_pending", "command": absolute_in_tree},
        ],
    });
    std::fs::write(team.workdir.join("team.json"), team_file.to_string()).unwrap();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    ok(lead_cmd(&team, &url, &["up", "team.json"])
        .output()
        .unwrap());

    // Alice rewrites the paging script, then submits a plan and waits for the answer.
    let mark = out.join("PAGED-BY-ALICE");
    let rewrite = format!(
        "printf '#!/bin/sh\\n{{ id; grep -E \"^(NoNewPrivs|CapEff)\" /proc/self/status; }} > {}\\n' \
         > scripts/page-oncall.sh && echo rewrote",
        mark.display()
    );
    fake.push_for(MODEL, bash_turn("b1", &rewrite));
    let plan =
        anthropic_tool_use_block("p1", "plan_approval", r#"{"plan": "refactor the parser"}"#);
    fake.push_for(
        MODEL,
        Reply::ok(anthropic_message(&plan, "tool_use", USAGE)),
    );
    fake.push_for(MODEL, Reply::ok(anthropic_text("waiting for the lead")));
    let _lead = run_lead(&team, &url, &["--escalate-after", "2"]);

    let page = wait_until(T, "the page", || named(&team, "request_pending").pop());
    assert_eq!(page["from"], "alice", "{page}");
    // Alice did rewrite it (her commands can write there); it did not run.
    let rewritten = std::fs::read_to_string(&in_tree).unwrap();
    assert!(rewritten.contains("PAGED-BY-ALICE"), "{rewritten}");
    assert!(
        !mark.exists(),
        "the paging hook ran the script alice rewrote: {}",
        std::fs::read_to_string(&mark).unwrap_or_default()
    );
    assert!(!team.workdir.join("page.log").exists());
    // Each refused hook is said so, with why, and not run.
    let refused = named(&team, "hook_refused");
    let why = |command: &str| -> String {
        refused
            .iter()
            .find(|e| e["command"] == command)
            .unwrap_or_else(|| panic!("no hook_refused for {command}: {refused:?}"))["why"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    assert!(
        why("./scripts/page-oncall.sh").contains("relative"),
        "{refused:?}"
    );
    assert!(
        why(&absolute_in_tree).contains("where teammates' commands can write"),
        "{refused:?}"
    );
    assert!(runs_of(&team, "./scripts/page-oncall.sh").is_empty());
    assert!(runs_of(&team, &absolute_in_tree).is_empty());
    // The system command and the script outside paged, as the user, from /, with system dirs
    // only on the PATH.
    for command in [&system, &by_script] {
        let ran = runs_of(&team, command);
        assert_eq!(ran.len(), 1, "{command}: {ran:?}");
        assert_eq!(ran[0]["sandbox"], false, "{ran:?}");
        assert_eq!(ran[0]["outcome"], "paged", "{ran:?}");
    }
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("system-paged.json")).unwrap())
            .unwrap();
    assert_eq!(doc["event"], "request_pending");
    assert_eq!(doc["request_id"], page["request_id"]);
    let by_script_doc: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("script-paged.json")).unwrap())
            .unwrap();
    assert_eq!(by_script_doc["request_id"], page["request_id"]);
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap();
    assert_eq!(read("cwd").trim(), "/");
    let path = read("path");
    assert!(!path.is_empty());
    for dir in path.split(':') {
        assert!(
            [
                "/usr/local/sbin",
                "/usr/local/bin",
                "/usr/sbin",
                "/usr/bin",
                "/sbin",
                "/bin"
            ]
            .contains(&dir),
            "{path}"
        );
    }
    assert_eq!(
        read("uid").trim(),
        nix::unistd::geteuid().as_raw().to_string()
    );
}

fn set_hooks(team: &Team, hooks: Vec<Hook>) {
    Roster::new(&team.dir)
        .update(move |c| {
            c.hooks = hooks.clone();
            Ok(())
        })
        .unwrap();
}

fn new_task(team: &Team, subject: &str) -> String {
    TaskStore::new(&team.dir)
        .create(NewTask {
            subject: subject.into(),
            created_by: "lead".into(),
            ..NewTask::default()
        })
        .unwrap()
        .id
}

fn plan(team: &Team) -> String {
    RequestStore::new(&team.dir)
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "ann".into(),
            to: "lead".into(),
            payload: json!({"plan": "rewrite it all"}),
            target_incarnation: None,
            ttl: None,
        })
        .unwrap()
        .request_id
}

/// R4-1's hook half: hooks that ask to run outside the sandbox, written into `config.json` by
/// something other than `lead up` (here, by hand), run sandboxed and an event says why; once a
/// person applies the same hooks with `lead up`, they run outside.
#[test]
fn a_hook_outside_the_sandbox_comes_only_from_lead_up() {
    let team = Team::new();
    let outside = tempfile::tempdir().unwrap();
    let out = outside.path();
    let created = format!("touch {}/created-outside || true", out.display());
    let paged = format!("touch {}/paged-outside", out.display());
    let hooks = vec![
        Hook {
            event: HookEvent::TaskCreated,
            command: created.clone(),
            timeout_secs: Some(20),
            sandbox: false,
        },
        Hook {
            event: HookEvent::RequestPending,
            command: paged.clone(),
            timeout_secs: Some(20),
            sandbox: true,
        },
    ];
    set_hooks(&team, hooks);
    let fake = FakeLlm::start([]);
    let url = fake.url();
    let _lead = run_lead(&team, &url, &["--escalate-after", "1"]);
    let store = TaskStore::new(&team.dir);
    let requests = RequestStore::new(&team.dir);
    let first = new_task(&team, "first");
    let first_plan = plan(&team);
    wait_until(T, "the hooks of the first task and plan", || {
        let settled = !store.get(&first).ok()?.created_hook_pending;
        let paged = requests.get(&first_plan).ok()?.paged_at.is_some();
        (settled && paged).then_some(())
    });
    assert!(!out.join("created-outside").exists(), "ran outside");
    assert!(!out.join("paged-outside").exists(), "paged outside");
    for command in [&created, &paged] {
        let ran = runs_of(&team, command);
        assert_eq!(ran.len(), 1, "{ran:?}");
        assert_eq!(ran[0]["sandbox"], true, "{ran:?}");
    }
    let said = named(&team, "hook_sandboxed");
    assert_eq!(said.len(), 2, "{said:?}");
    assert!(
        said.iter()
            .all(|e| e["why"].as_str().unwrap().contains("lead up")),
        "{said:?}"
    );

    // The person applies them from a team file: now they run as the user.
    std::fs::write(
        team.workdir.join("team.toml"),
        format!(
            "[[hooks]]\nevent = \"task_created\"\ncommand = {created:?}\ntimeout_secs = 20\n\
             sandbox = false\n\n[[hooks]]\nevent = \"request_pending\"\ncommand = {paged:?}\n\
             timeout_secs = 20\n"
        ),
    )
    .unwrap();
    ok(lead_cmd(&team, &url, &["up", "team.toml"])
        .output()
        .unwrap());
    let second = new_task(&team, "second");
    let second_plan = plan(&team);
    wait_until(T, "the hooks of the second task and plan", || {
        let settled = !store.get(&second).ok()?.created_hook_pending;
        let paged = requests.get(&second_plan).ok()?.paged_at.is_some();
        (settled && paged).then_some(())
    });
    assert!(out.join("created-outside").exists());
    assert!(out.join("paged-outside").exists());
    for command in [&created, &paged] {
        let ran = runs_of(&team, command);
        assert_eq!(ran.len(), 2, "{ran:?}");
        assert_eq!(ran[1]["sandbox"], false, "{ran:?}");
    }
}
