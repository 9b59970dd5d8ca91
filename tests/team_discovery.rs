//! Every `lead` command finds the same team from any sub-directory of the working dir, as git
//! finds `.git`, and `lead status --json` prints the team dir's absolute path.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

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
