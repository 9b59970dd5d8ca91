//! Issue 22: `lead sandbox check --json` runs the review's negative checks in a real command
//! sandbox (no network, no LLM) and reports each with what this kernel lacks. The checks that
//! hold on this kernel today must hold; those other changes of the issue are still fixing
//! (`/dev/tty`, `.git`, `/etc/shadow` as root, the fork bomb, the limits) are printed, not
//! asserted. Never skips, under `CI=true` or not.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

/// Every check, in the order they run; `root-only-file` only as root, `etc-shadow` only where
/// the file exists.
const NAMES: [&str; 18] = [
    "team-dir-hidden",
    "key-file-hidden",
    "own-proc",
    "worker-environ-hidden",
    "lead-environ-hidden",
    "no-signal-out",
    "no-tty",
    "git-config-read-only",
    "git-hooks-read-only",
    "git-dir-stays",
    "root-only-file",
    "etc-shadow",
    "no-nested-userns",
    "no-privileges",
    "private-tmp",
    "limits",
    "fork-bomb",
    "runs-after-fork-bomb",
];

/// The checks that hold here already, and must.
const MUST_HOLD: [&str; 7] = [
    "team-dir-hidden",
    "key-file-hidden",
    "own-proc",
    "worker-environ-hidden",
    "lead-environ-hidden",
    "no-signal-out",
    "no-privileges",
];

fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

/// `lead ARGS` in a fresh dir, with its own temp dir (0755, as /tmp lets others pass).
fn lead(args: &[&str], tmp: &Path) -> Output {
    let cwd = tempfile::tempdir().unwrap();
    Command::new(env!("CARGO_BIN_EXE_lead"))
        .args(args)
        .current_dir(cwd.path())
        .env("TMPDIR", tmp)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove("TROUPE_SANDBOX")
        .output()
        .unwrap()
}

/// What a run left in its temp dir, and the marker it made in the real `/tmp` if that is still
/// there (`marker_line`: the `private-tmp` detail, which names it; other tests' runs may have
/// theirs in `/tmp` meanwhile).
fn leftovers(tmp: &Path, marker_line: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(tmp)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("troupe-sandbox-check-"))
        .collect();
    let marker = marker_line
        .split_whitespace()
        .find(|w| w.starts_with("/tmp/troupe-sandbox-check-") && w.ends_with(".marker"))
        .unwrap_or_else(|| panic!("no marker named in {marker_line:?}"));
    if Path::new(marker).exists() {
        names.push(marker.to_owned());
    }
    names
}

#[test]
fn sandbox_check_reports_every_check_and_those_that_hold_today_hold() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = lead(&["sandbox", "check", "--json"], tmp.path());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("stderr:\n{stderr}");
    let doc: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not one JSON document ({e}):\n{stdout}"));

    let status = &doc["status"];
    for key in ["mode", "namespaces", "user"] {
        assert!(status[key].is_string(), "status.{key}: {status}");
    }
    assert!(status["active"].is_boolean() && status["team_dir_hidden"].is_boolean());
    assert_eq!(status["mode"], "best-effort");
    let checks = doc["checks"].as_array().expect("checks is an array");
    for c in checks {
        assert!(c["name"].is_string() && c["holds"].is_boolean(), "{c}");
        assert!(!c["detail"].as_str().unwrap().is_empty(), "{c}");
        eprintln!(
            "{:24} {:5} {}",
            c["name"].as_str().unwrap(),
            if c["holds"] == true { "yes" } else { "no" },
            c["detail"].as_str().unwrap()
        );
    }
    eprintln!("missing: {}", status["missing"]);
    let names: Vec<&str> = checks.iter().map(|c| c["name"].as_str().unwrap()).collect();
    let expected: Vec<&str> = NAMES
        .into_iter()
        .filter(|n| *n != "root-only-file" || is_root())
        .filter(|n| *n != "etc-shadow" || Path::new("/etc/shadow").exists())
        .collect();
    assert_eq!(names, expected);

    let holds = |name: &str| {
        checks
            .iter()
            .any(|c| c["name"] == name && c["holds"] == true)
    };
    let mut must: Vec<&str> = MUST_HOLD.to_vec();
    if is_root() {
        must.push("root-only-file");
    }
    for name in must {
        assert!(holds(name), "{name} does not hold:\n{stdout}");
    }

    let all = checks.iter().all(|c| c["holds"] == true);
    assert_eq!(doc["all_hold"], all);
    // On the CI machine (root, a kernel with everything) every check holds since issue 22.
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        assert!(all, "CI=true: a check does not hold:\n{stdout}");
    }
    assert_eq!(out.status.code(), Some(if all { 0 } else { 1 }), "{stderr}");

    // The fake key, and any real one of this environment, is in no output.
    let text = format!("{stdout}{stderr}");
    assert!(!text.contains("sk-ant-troupe-sandbox-check-"), "{text}");
    for var in ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"] {
        if let Ok(key) = std::env::var(var)
            && key.len() >= 8
        {
            assert!(!text.contains(&key), "{var} is in the output");
        }
    }
    // The scratch layout and the marker in the real /tmp are gone.
    let private_tmp = checks.iter().find(|c| c["name"] == "private-tmp").unwrap();
    let marker_line = private_tmp["detail"].as_str().unwrap();
    assert_eq!(leftovers(tmp.path(), marker_line), Vec::<String>::new());
}

#[test]
fn the_help_says_what_the_exit_status_means() {
    let tmp = tempfile::tempdir().unwrap();
    let help = lead(&["sandbox", "check", "--help"], tmp.path());
    let text = String::from_utf8_lossy(&help.stdout);
    assert_eq!(help.status.code(), Some(0));
    assert!(
        text.contains("Exit status: 0 when every check holds, 1 when one does not"),
        "{text}"
    );
    assert!(
        text.contains("--sandbox-user") && text.contains("--json"),
        "{text}"
    );
}

/// Without a sandbox the checks fail and say so: the table for people, the status line, exit 1.
#[test]
fn with_the_sandbox_off_the_table_shows_what_does_not_hold() {
    let tmp = tempfile::tempdir().unwrap();
    let out = lead(&["sandbox", "check", "--sandbox", "off"], tmp.path());
    let text = String::from_utf8_lossy(&out.stdout);
    eprintln!("{text}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1));
    let mut lines = text.lines();
    let header = lines.next().unwrap();
    assert!(
        header.starts_with("CHECK") && header.contains("HOLDS  DETAIL"),
        "{text}"
    );
    let row = |name: &str| {
        text.lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row {name}:\n{text}"))
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_owned()
    };
    assert_eq!(row("team-dir-hidden"), "no");
    assert_eq!(row("key-file-hidden"), "no");
    assert_eq!(row("private-tmp"), "no");
    assert_eq!(row("fork-bomb"), "no", "never run unbounded");
    assert!(
        text.contains("\nsandbox: off: tools run unsandboxed\n"),
        "{text}"
    );
    assert!(!text.contains("sk-ant-troupe-sandbox-check-"), "{text}");
    let marker_line = text.lines().find(|l| l.starts_with("private-tmp")).unwrap();
    assert_eq!(leftovers(tmp.path(), marker_line), Vec::<String>::new());
}
