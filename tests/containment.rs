//! Issue 22 (containment, round 2), the findings about paths and git: every test drives real
//! workers under `lead run` through the fake LLM server.
//!
//! - N8 and m5: a relative team dir (the default `.team`), key file and `--sandbox-read` dir
//!   reach workers that start in another directory (a worktree, `--workdir`) as the places
//!   the person named, from the repository root and from a sub-directory.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, wait_until};

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

fn git_ok(dir: &Path, args: &[&str]) -> String {
    let o = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "git {args:?} in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A fresh git repository `repo` (one commit) in a temp dir, with a sub-directory `sub`.
fn repository() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(repo.join("sub")).unwrap();
    git_ok(&repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join("sub/README"), "the main tree\n").unwrap();
    git_ok(&repo, &["add", "sub/README"]);
    git_ok(
        &repo,
        &[
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.invalid",
            "commit",
            "-q",
            "-m",
            "first",
        ],
    );
    (tmp, repo)
}

/// `lead ARGS` as a person types it in `cwd`: no `--team-dir`, no `TROUPE_TEAM_DIR`, the key
/// from a file named relatively to `cwd`.
fn lead_in(cwd: &Path, url: &str, key_file: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lead"));
    c.args(args)
        .current_dir(cwd)
        .env("TROUPE_PROVIDER", "anthropic")
        .env("ANTHROPIC_API_KEY_FILE", key_file)
        .env("ANTHROPIC_BASE_URL", url)
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::bus::BUS_ENV)
        .stdin(Stdio::null());
    c
}

fn ok(o: Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what}: exit {:?}: {}",
        o.status.code(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn call(id: &str, command: &str) -> Reply {
    let block = anthropic_tool_use_block(id, "bash", &json!({ "command": command }).to_string());
    Reply::ok(anthropic_message(&block, "tool_use", USAGE))
}

/// The text of every tool result `model` received, in order.
fn tool_results(fake: &FakeLlm, model: &str) -> Vec<String> {
    let mut out = Vec::new();
    for r in fake.requests() {
        if r.body["model"] != model {
            continue;
        }
        let Some(last) = r.body["messages"].as_array().and_then(|m| m.last()) else {
            continue;
        };
        for block in last["content"].as_array().into_iter().flatten() {
            if block["type"] == "tool_result" {
                out.push(block["content"].to_string());
            }
        }
    }
    out
}

fn member<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {status}"))
}

/// N8 and m5: in the default layout, `lead run` started in `run_from` (the repository root or
/// a sub-directory of it) with a relative key file and a relative `--sandbox-read` dir starts a
/// worktree member and a member working in `--workdir` elsewhere; both reach `idle`, each
/// command runs where it should and reads the extra dir.
fn default_layout_from(sub: &str) {
    let (tmp, repo) = repository();
    let run_from = repo.join(sub);
    // The key file and a read-only data dir beside the repository, named relatively.
    std::fs::create_dir(tmp.path().join("keys")).unwrap();
    std::fs::write(tmp.path().join("keys/anthropic.key"), "sk-test-relative\n").unwrap();
    std::fs::create_dir(tmp.path().join("data")).unwrap();
    std::fs::write(tmp.path().join("data/fact.txt"), "THE-EXTRA-DIR\n").unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let up = if sub.is_empty() { ".." } else { "../.." };
    let key = format!("{up}/keys/anthropic.key");
    let data = format!("{up}/data");
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    // Spawned from the repository root, as the README says: `.team` is made there.
    for (name, worktree) in [("alice", true), ("bob", false)] {
        let mut args = vec![
            "spawn",
            name,
            "--role",
            "coder",
            "--prompt",
            "p",
            "--model",
            if worktree { "m-alice" } else { "m-bob" },
        ];
        if worktree {
            args.push("--worktree");
        }
        ok(
            lead_in(&repo, &url, "../keys/anthropic.key", &args)
                .output()
                .unwrap(),
            &format!("lead spawn {name}"),
        );
        fake.push_for(
            if worktree { "m-alice" } else { "m-bob" },
            call(
                "tu_where",
                &format!(
                    "echo \"PWD=$(pwd)\"; cat {}/data/fact.txt",
                    tmp.path().display()
                ),
            ),
        );
        fake.push_for(
            if worktree { "m-alice" } else { "m-bob" },
            Reply::ok(anthropic_text("done")),
        );
    }
    assert!(repo.join(".team/config.json").is_file());
    // bob works in --workdir, given relatively too.
    let rel_elsewhere = format!("{up}/elsewhere");
    let stderr = tmp.path().join("lead.stderr");
    let _sup = Bg(lead_in(
        &run_from,
        &url,
        &key,
        &[
            "run",
            "--stop-timeout",
            "1",
            "--kill-grace",
            "1",
            "--sandbox-read",
            &data,
            "--workdir",
            &rel_elsewhere,
        ],
    )
    .stdout(Stdio::null())
    .stderr(std::fs::File::create(&stderr).unwrap())
    .spawn()
    .unwrap());
    let status = || {
        serde_json::from_str::<Value>(&ok(
            lead_in(&run_from, &url, &key, &["status", "--json"])
                .output()
                .unwrap(),
            "lead status --json",
        ))
        .unwrap()
    };
    for (name, model) in [("alice", "m-alice"), ("bob", "m-bob")] {
        wait_until(T, &format!("{name} idle after its two calls"), || {
            let s = status();
            let m = member(&s, name);
            assert_ne!(
                m["status"],
                "failed",
                "{name} failed: {m}\nits log: {}\nlead: {}",
                std::fs::read_to_string(repo.join(format!(".team/logs/{name}.log")))
                    .unwrap_or_default(),
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
            (m["status"] == "idle" && fake.requests_for(model) >= 2).then_some(())
        });
    }
    let alice = tool_results(&fake, "m-alice").join("\n");
    let worktree = tmp.path().join("repo.troupe/alice").canonicalize().unwrap();
    assert!(
        alice.contains(&format!("PWD={}", worktree.display())),
        "alice's command did not run in her worktree: {alice}"
    );
    let bob = tool_results(&fake, "m-bob").join("\n");
    assert!(
        bob.contains(&format!(
            "PWD={}",
            elsewhere.canonicalize().unwrap().display()
        )),
        "bob's command did not run in --workdir: {bob}"
    );
    for (name, text) in [("alice", &alice), ("bob", &bob)] {
        assert!(
            text.contains("THE-EXTRA-DIR"),
            "{name}'s command could not read the --sandbox-read dir: {text}"
        );
    }
    // Every request carried the key read from the relative file.
    for r in fake.requests() {
        assert_eq!(r.header("x-api-key"), Some("sk-test-relative"));
    }
}

#[test]
fn default_layout_from_the_repository_root() {
    default_layout_from("");
}

#[test]
fn default_layout_from_a_sub_directory() {
    default_layout_from("sub");
}
