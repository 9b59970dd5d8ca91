//! Every `lead` command finds the same team from any sub-directory of the working dir, as git
//! finds `.git`, and `lead status --json` prints the team dir's absolute path. `lead run` in a
//! sub-directory works where the team is; with no team above, it makes `./.team` where it runs.

mod support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block, tool_results,
};
use support::team::{Bg, member, wait_until};

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

fn lead(cwd: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lead"))
        .args(args)
        .current_dir(cwd)
        .env_remove("TROUPE_TEAM_DIR")
        .output()
        .unwrap()
}

#[test]
fn commands_find_the_team_from_a_sub_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let top = tmp.path().canonicalize().unwrap();
    let o = lead(&top, &["spawn", "amy", "--role", "r", "--prompt", "p"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let deep = top.join("src/a/b");
    std::fs::create_dir_all(&deep).unwrap();
    let o = lead(&deep, &["status", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["members"][0]["name"], "amy", "{v}");
    assert_eq!(v["team_dir"], top.join(".team").display().to_string());
    // No team dir was made down there.
    assert!(!deep.join(".team").exists());
    // --team-dir still wins.
    let o = lead(&deep, &["--team-dir", "other", "status", "--json"]);
    assert!(!o.status.success());
}

/// `lead ARGS` run in `cwd` against the fake LLM, as a person types it: no `--team-dir`, no
/// `TROUPE_TEAM_DIR`.
fn lead_with_llm(cwd: &Path, url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lead"));
    c.args(args)
        .current_dir(cwd)
        .env("TROUPE_PROVIDER", "anthropic")
        .env("ANTHROPIC_API_KEY", "sk-test")
        .env("ANTHROPIC_BASE_URL", url)
        .env_remove("ANTHROPIC_API_KEY_FILE")
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::store::redis::BUS_ENV)
        .stdin(Stdio::null());
    c
}

/// Spawns `amy` (her model asks for `pwd` once) from `spawn_in`, runs `lead run` from `run_in`,
/// and returns where amy's command ran and what the lead said on stderr when it started.
fn where_amy_works(spawn_in: &Path, run_in: &Path) -> (String, String) {
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    let o = lead_with_llm(
        spawn_in,
        &url,
        &["spawn", "amy", "--role", "r", "--prompt", "p"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let block = anthropic_tool_use_block("tu_pwd", "bash", &json!({"command": "pwd"}).to_string());
    fake.push(Reply::ok(anthropic_message(&block, "tool_use", USAGE)));
    fake.push(Reply::ok(anthropic_text("done")));
    let stderr = run_in.join("lead.stderr");
    let sup = Bg(lead_with_llm(run_in, &url, &["run", "--stop-timeout", "1"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap());
    wait_until(T, "amy idle after her two calls", || {
        let o = lead_with_llm(run_in, &url, &["status", "--json"])
            .output()
            .unwrap();
        let v: Value = serde_json::from_slice(&o.stdout).ok()?;
        let m = member(&v, "amy");
        assert_ne!(m["status"], "failed", "{m}");
        (m["status"] == "idle" && fake.requests().len() >= 2).then_some(())
    });
    drop(sup);
    let results = tool_results(&fake, "claude-sonnet-4-5").join("\n");
    let said = std::fs::read_to_string(&stderr).unwrap();
    (results, said)
}

/// From a sub-directory of a working dir that holds `.team`, `lead run` supervises that team
/// and its members work in the dir that holds `.team` (not the sub-directory); the lead says
/// so when it starts.
#[test]
fn run_from_a_sub_directory_works_where_the_team_is() {
    let tmp = tempfile::tempdir().unwrap();
    let top = tmp.path().canonicalize().unwrap().join("project");
    let deep = top.join("src/a");
    std::fs::create_dir_all(&deep).unwrap();
    let (ran_in, said) = where_amy_works(&top, &deep);
    assert!(
        ran_in.contains(&format!("{}\\n", top.display())),
        "amy's command did not run in {}: {ran_in}",
        top.display()
    );
    assert!(
        !deep.join(".team").exists(),
        "a second team was made in {}",
        deep.display()
    );
    assert!(
        said.contains(&format!("working dir {}", top.display())),
        "the lead did not say its working dir: {said}"
    );
}

/// With no `.team` in the current directory or above it, `lead spawn` and `lead run` make
/// `./.team` in the current directory, which is the members' working dir.
#[test]
fn run_with_no_team_above_makes_one_here() {
    let tmp = tempfile::tempdir().unwrap();
    let here = tmp.path().canonicalize().unwrap().join("fresh/work");
    std::fs::create_dir_all(&here).unwrap();
    if let Some(d) = here
        .ancestors()
        .find(|d| d.join(".team/config.json").exists())
    {
        panic!(
            "this test needs no team above its temp dir, and {} has one",
            d.display()
        );
    }
    let (ran_in, said) = where_amy_works(&here, &here);
    assert!(here.join(".team/config.json").is_file());
    assert!(
        ran_in.contains(&format!("{}\\n", here.display())),
        "amy's command did not run in {}: {ran_in}",
        here.display()
    );
    assert!(
        said.contains(&format!("working dir {}", here.display())),
        "the lead did not say its working dir: {said}"
    );
}
