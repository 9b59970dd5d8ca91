//! Issue 23, install and shell integration: `lead completions bash|zsh|fish` and `lead man`,
//! run as a user runs them. The bash script is sourced into a real `bash` and its completion
//! function called as bash calls it on TAB; member names and task ids come from the team dir
//! through the hidden `lead complete-names`. The man pages are rendered by `man` itself
//! (skipped when it is missing, except under CI=true, where `.ci/run` installs it).

mod support;

use std::path::Path;
use std::process::{Command, Output};

use support::cli::{code, lead, stderr, stdout};
use support::team::Team;

/// `lead ARGS` in `cwd`, with no team dir from the environment.
fn lead_in(cwd: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lead"))
        .args(args)
        .current_dir(cwd)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::store::redis::BUS_ENV)
        .output()
        .unwrap()
}

/// Whether `tool` runs; `false` skips the test that needs it, except under CI=true.
fn have(tool: &str) -> bool {
    let found = Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "{tool} is missing under CI=true (.ci/run installs it)"
        );
        eprintln!("skipped: {tool} is not installed");
    }
    found
}

/// The words bash completes after sourcing `lead completions bash` in `cwd` (with `lead` on
/// PATH), calling `function` (default: the one `complete -p lead` names) on `words`, the last
/// being the word under the cursor.
fn complete(cwd: &Path, function: Option<&str>, words: &[&str]) -> Vec<String> {
    let script = cwd.join("lead.bash");
    let o = lead_in(cwd, &["completions", "bash"]);
    assert_eq!(code(&o), 0, "{o:?}");
    std::fs::write(&script, &o.stdout).unwrap();
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_lead")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let o = Command::new("bash")
        .arg("--norc")
        .arg("-c")
        .arg(
            r#"source "$1" || exit 90
f="$2"
if [[ -z $f ]]; then spec=$(complete -p lead) || exit 91; f=${spec##*-F }; f=${f%% *}; fi
shift 2
COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
COMPREPLY=()
"$f" lead "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"
printf '%s\n' "${COMPREPLY[@]}""#,
        )
        .arg("bash")
        .arg(&script)
        .arg(function.unwrap_or(""))
        .args(words)
        .current_dir(cwd)
        .env("PATH", path)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::store::redis::BUS_ENV)
        .output()
        .unwrap();
    assert!(o.status.success(), "bash: {o:?}");
    String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// `_lead` called by hand with no arguments after sourcing, as a script checking the completion
/// does (bash itself passes the command, the word and the previous word).
#[test]
fn bash_lead_called_by_hand_completes_spawn() {
    let tmp = tempfile::tempdir().unwrap();
    let o = lead_in(tmp.path(), &["completions", "bash"]);
    let script = tmp.path().join("lead.bash");
    std::fs::write(&script, &o.stdout).unwrap();
    let o = Command::new("bash")
        .arg("--norc")
        .arg("-c")
        .arg(r#"source "$1" && COMP_WORDS=(lead sp) && COMP_CWORD=1 && _lead && printf '%s\n' "${COMPREPLY[@]}""#)
        .arg("bash")
        .arg(&script)
        .current_dir(tmp.path())
        .output()
        .unwrap();
    assert!(o.status.success(), "bash: {o:?}");
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), "spawn", "{o:?}");
}

#[test]
fn bash_completes_subcommands_with_clap_function() {
    let tmp = tempfile::tempdir().unwrap();
    let got = complete(tmp.path(), Some("_lead"), &["lead", "sp"]);
    assert_eq!(got, ["spawn"]);
    // The function bash is told to call does the same, and hides the internal commands.
    let got = complete(tmp.path(), None, &["lead", "sp"]);
    assert_eq!(got, ["spawn"]);
    let got = complete(tmp.path(), None, &["lead", ""]);
    assert!(got.iter().any(|w| w == "completions"), "{got:?}");
    assert!(!got.iter().any(|w| w == "complete-names"), "{got:?}");
}

#[test]
fn bash_completes_member_names_and_task_ids_from_the_team() {
    let team = Team::new();
    let o = lead(&team, &["spawn", "alice", "--role", "r", "--prompt", "p"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = lead(&team, &["spawn", "bob", "--role", "r", "--prompt", "p"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let o = lead(&team, &["task", "add", "write the docs"]);
    assert_eq!(code(&o), 0, "{}", stderr(&o));
    let id = stdout(&o);
    let team_dir = team.dir.root().to_str().unwrap();

    // Found as every command finds it: the `.team` in the current directory...
    let top = team.path();
    assert_eq!(complete(top, None, &["lead", "logs", ""]), ["alice", "bob"]);
    assert_eq!(complete(top, None, &["lead", "logs", "al"]), ["alice"]);
    assert_eq!(
        complete(top, None, &["lead", "send", "--json", "b"]),
        ["bob"]
    );
    assert_eq!(
        complete(top, None, &["lead", "worktree", "remove", "a"]),
        ["alice"]
    );
    assert_eq!(
        complete(top, None, &["lead", "task", "show", ""]),
        [id.as_str()]
    );
    assert_eq!(
        complete(top, None, &["lead", "task", "add", "x", "--owner", "b"]),
        ["bob"]
    );
    assert_eq!(
        complete(top, None, &["lead", "task", "add", "x", "--blocked-by", ""]),
        [id.as_str()]
    );
    // ... or named on the command line, from anywhere.
    let elsewhere = tempfile::tempdir().unwrap();
    assert_eq!(
        complete(
            elsewhere.path(),
            None,
            &["lead", "--team-dir", team_dir, "logs", "a"]
        ),
        ["alice"]
    );
    // Past the name, clap's completion (the options) takes over again.
    let got = complete(top, None, &["lead", "send", "alice", "--j"]);
    assert_eq!(got, ["--json"]);

    // No team: nothing to offer, and nothing said.
    assert!(complete(elsewhere.path(), None, &["lead", "logs", ""]).is_empty());
    for kind in ["members", "tasks"] {
        let o = lead_in(elsewhere.path(), &["complete-names", kind]);
        assert_eq!(code(&o), 0, "{o:?}");
        assert!(o.stdout.is_empty() && o.stderr.is_empty(), "{o:?}");
    }
    let o = lead_in(top, &["complete-names", "members"]);
    assert_eq!(stdout(&o), "alice\nbob");
}

#[test]
fn man_pages_render_with_man() {
    let tmp = tempfile::tempdir().unwrap();
    let o = lead_in(tmp.path(), &["man"]);
    assert_eq!(code(&o), 0, "{o:?}");
    assert!(o.stderr.is_empty(), "{}", stderr(&o));
    let page = String::from_utf8(o.stdout).unwrap();
    assert!(page.contains(".TH lead 1"), "{page}");

    let dir = tmp.path().join("share/man/man1");
    let o = lead_in(tmp.path(), &["man", "--dir", dir.to_str().unwrap()]);
    assert_eq!(code(&o), 0, "{o:?}");
    for name in ["lead.1", "lead-spawn.1", "lead-task-show.1", "worker.1"] {
        assert!(dir.join(name).is_file(), "no {name} in {dir:?}");
        assert!(stdout(&o).contains(name), "{}", stdout(&o));
    }
    // Internal commands get no page.
    assert!(!dir.join("lead-complete-names.1").exists());
    assert_eq!(
        std::fs::read_to_string(dir.join("lead.1")).unwrap(),
        page,
        "lead man and lead man --dir wrote different lead(1)"
    );

    if !have("man") {
        return;
    }
    let render = |file: &Path| {
        let o = Command::new("man")
            .args(["-P", "cat", "-l"])
            .arg(file)
            .env("MANPAGER", "cat")
            .env("MANWIDTH", "100")
            .output()
            .unwrap();
        assert!(o.status.success(), "man -l {file:?}: {o:?}");
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let text = render(&dir.join("lead.1"));
    assert!(text.contains("lead"), "{text}");
    assert!(text.contains("spawn"), "{text}");
    assert!(text.contains("--team-dir"), "{text}");
    let text = render(&dir.join("lead-spawn.1"));
    assert!(text.contains("--role"), "{text}");
    let text = render(&dir.join("worker.1"));
    assert!(text.contains("--max-calls"), "{text}");
}

#[test]
fn zsh_and_fish_scripts_are_printed_and_parse() {
    let tmp = tempfile::tempdir().unwrap();
    for shell in ["zsh", "fish"] {
        let o = lead_in(tmp.path(), &["completions", shell]);
        assert_eq!(code(&o), 0, "{o:?}");
        assert!(
            !o.stdout.is_empty(),
            "lead completions {shell} printed nothing"
        );
        assert!(
            String::from_utf8_lossy(&o.stdout).contains("spawn"),
            "lead completions {shell}"
        );
        let file = tmp.path().join(format!("lead.{shell}"));
        std::fs::write(&file, &o.stdout).unwrap();
        // Not installed on every machine; CI does not install them either.
        let found = Command::new(shell)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if !found {
            eprintln!("skipped parsing: {shell} is not installed");
            continue;
        }
        let o = Command::new(shell).arg("-n").arg(&file).output().unwrap();
        assert!(o.status.success(), "{shell} -n: {o:?}");
    }
}

#[test]
fn an_unknown_shell_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let o = lead_in(tmp.path(), &["completions", "tcsh"]);
    assert_eq!(code(&o), 2, "{o:?}");
}
