//! Issue 13, acceptance 3: worktrees. Two teammates spawned with `--worktree` write and commit
//! the same path through their own `bash`, run by real workers under `lead run` with the LLM
//! faked: each change lands on its own branch (`troupe/NAME`), the main tree is untouched, and
//! the sandbox lets the commit through while `git config` writes and writes into `.git/hooks`
//! fail. `lead status --json` shows each worktree's branch and whether it is dirty; `lead
//! worktree remove` refuses a running member and a dirty worktree without `--force`, keeps the
//! branch, and a respawn re-adds the worktree on it. Outside a git repository the flag is
//! refused and nothing is written.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use std::os::unix::process::CommandExt;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};

use support::fake_llm::tool_results;
use support::git::{git_ok, init_with};
use support::team::{Bg, Team, lead_cmd, member, wait_until};
use troupe::TeamDir;

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

/// A team whose dir is `.team` at the top of a fresh git repository (one commit, no identity of
/// its own), and whose working dir is that repository.
fn repo_team() -> (Team, PathBuf) {
    repo_team_in(&std::env::temp_dir())
}

/// [`repo_team`] in a temp dir under `base`.
fn repo_team_in(base: &Path) -> (Team, PathBuf) {
    let tmp = tempfile::tempdir_in(base).unwrap();
    let repo = tmp.path().join("repo");
    init_with(&repo, "README");
    let dir = TeamDir::create(repo.join(".team")).unwrap();
    let team = Team {
        tmp,
        dir,
        workdir: repo.clone(),
    };
    (team, repo)
}

fn call(id: &str, command: &str) -> Reply {
    let block = anthropic_tool_use_block(id, "bash", &json!({ "command": command }).to_string());
    Reply::ok(anthropic_message(&block, "tool_use", USAGE))
}

fn spawn_args<'a>(name: &'a str, model: &'a str) -> Vec<&'a str> {
    vec![
        "spawn",
        name,
        "--role",
        "coder",
        "--prompt",
        "write same.txt and commit it",
        "--model",
        model,
        "--worktree",
    ]
}

/// `lead ARGS` on `team`, as `uid` when given (with the temp dir as its home).
fn lead(team: &Team, url: &str, args: &[&str], uid: Option<u32>) -> Command {
    let mut c = lead_cmd(team, url, args);
    if let Some(uid) = uid {
        c.uid(uid).gid(uid).env("HOME", team.tmp.path());
    }
    c
}

fn status_json(team: &Team, url: &str) -> Value {
    status_as(team, url, None)
}

fn status_as(team: &Team, url: &str, uid: Option<u32>) -> Value {
    let o = lead(team, url, &["status", "--json"], uid)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

fn run_lead(team: &Team, url: &str) -> Bg {
    run_lead_as(team, url, None)
}

fn run_lead_as(team: &Team, url: &str, uid: Option<u32>) -> Bg {
    Bg(lead(
        team,
        url,
        &["run", "--stop-timeout", "1", "--kill-grace", "1"],
        uid,
    )
    .stdout(Stdio::null())
    .stderr(
        std::fs::File::create(team.tmp.path().join("lead.stderr"))
            .unwrap()
            .try_clone()
            .unwrap(),
    )
    .spawn()
    .unwrap())
}

fn lead_stderr(team: &Team) -> String {
    std::fs::read_to_string(team.tmp.path().join("lead.stderr")).unwrap_or_default()
}

fn stop(lead: &mut Bg) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lead.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    wait_until(T, "lead run to stop", || lead.0.try_wait().unwrap());
}

#[test]
fn two_teammates_commit_the_same_path_on_their_own_branches() {
    commit_on_own_branches(None, &std::env::temp_dir());
}

/// The same with the repository outside `/tmp`, where the git dir is not bound back over the
/// private `/tmp`: Landlock alone keeps its config and hooks read-only.
#[test]
fn outside_tmp_the_git_dir_stays_read_only_too() {
    let base = Path::new("/var/tmp");
    if !base.is_dir() {
        eprintln!("skipped: no /var/tmp");
        return;
    }
    commit_on_own_branches(None, base);
}

/// The same with the whole team run by an unprivileged user (as root, the test above runs
/// commands as root of their own user namespace; this one as the worker's own user, with the
/// git dir remounted read-only in a user namespace it does not own).
#[test]
fn unprivileged_teammates_commit_on_their_own_branches_too() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: not root, so the test above already runs the team unprivileged");
        return;
    }
    commit_on_own_branches(Some(65534), &std::env::temp_dir());
}

fn commit_on_own_branches(uid: Option<u32>, base: &Path) {
    let (team, repo) = repo_team_in(base);
    if let Some(uid) = uid {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(team.tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        chown_tree(team.tmp.path(), uid);
    }
    let main_head = git_ok(&repo, &["rev-parse", "HEAD"]);
    // The team dir is untracked in the main tree; nothing else may change there.
    let main_status = || {
        git_ok(&repo, &["status", "--porcelain"])
            .lines()
            .filter(|l| *l != "?? .team/")
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(main_status(), Vec::<String>::new());
    let config_before = std::fs::read_to_string(repo.join(".git/config")).unwrap();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    for (name, model) in [("alice", "m-alice"), ("bob", "m-bob")] {
        let o = lead(&team, &url, &spawn_args(name, model), uid)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "spawn {name} --worktree: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        fake.push_for(
            model,
            call(
                "tu_commit",
                &format!(
                    "pwd && echo {name} > same.txt && git add same.txt && \
                     git commit -q -m 'from {name}' && echo COMMITTED"
                ),
            ),
        );
        fake.push_for(
            model,
            call(
                "tu_config",
                &format!(
                    "git config user.name evil; echo \"config=$?\"; \
                     echo 'exit 0' > \"$(git rev-parse --git-common-dir)/hooks/pre-commit\"; \
                     echo \"hooks=$?\"; echo 'exit 0' > {git}/hooks/pre-commit; \
                     echo \"repo-hooks=$?\"; E=$(git rev-parse HEAD); \
                     git --git-dir={git} update-ref refs/heads/troupe/{other} $E; \
                     echo \"sibling=$?\"; git --git-dir={git} update-ref refs/heads/main $E; \
                     echo \"main=$?\"",
                    other = if name == "alice" { "bob" } else { "alice" },
                    git = repo.join(".git").display()
                ),
            ),
        );
        fake.push_for(model, Reply::ok(anthropic_text("committed")));
    }
    let mut sup = run_lead_as(&team, &url, uid);
    for name in ["alice", "bob"] {
        wait_until(T, &format!("{name} idle"), || {
            let s = status_as(&team, &url, uid);
            (member(&s, name)["status"] == "idle" && fake.requests_for(&format!("m-{name}")) >= 3)
                .then_some(())
        });
    }
    for name in ["alice", "bob"] {
        let results = tool_results(&fake, &format!("m-{name}"));
        let all = results.join("\n");
        let wt = repo
            .parent()
            .unwrap()
            .join("repo.troupe")
            .join(name)
            .canonicalize()
            .unwrap_or_else(|e| panic!("{name}'s worktree: {e}; tool results: {all}"));
        assert!(
            results
                .first()
                .is_some_and(|r| r.contains("COMMITTED") && r.contains(&wt.display().to_string())),
            "{name}'s commit did not succeed in {}: {all}\nlead stderr:\n{}",
            wt.display(),
            lead_stderr(&team)
        );
        let second = results.get(1).cloned().unwrap_or_default();
        let sandbox = member(&status_as(&team, &url, uid), name)["sandbox"].clone();
        if let Some(uid) = uid {
            assert!(
                sandbox["user"]
                    .as_str()
                    .is_some_and(|u| u.contains(&uid.to_string())),
                "{name}'s commands do not run as {uid}: {sandbox}"
            );
        }
        if std::env::var("CI").is_ok_and(|v| v == "true") {
            assert_eq!(sandbox["active"], true, "CI=true: {sandbox}");
        }
        assert!(
            !second.contains("config=0") && second.contains("config="),
            "{name}'s `git config` write was not refused: {second}\nsandbox: {sandbox}"
        );
        for what in ["hooks", "repo-hooks"] {
            assert!(
                !second.contains(&format!("{what}=0")) && second.contains(&format!("{what}=")),
                "{name}'s write into a hooks dir ({what}) was not refused: {second}"
            );
        }
        for what in ["sibling", "main"] {
            assert!(
                !second.contains(&format!("{what}=0")) && second.contains(&format!("{what}=")),
                "{name} could move another branch ({what}): {second}"
            );
        }
        // The commit is in the member's own store; the repository gets it only through a
        // checked fetch (its worker's before it says idle, the merge queue's, `lead worktree
        // remove`'s).
        assert_eq!(
            git_ok(&wt, &["show", &format!("troupe/{name}:same.txt")]),
            format!("{name}\n")
        );
        let store = repo
            .parent()
            .unwrap()
            .join(format!("repo.troupe/.stores/{name}.git"));
        assert_eq!(
            git_ok(&wt, &["rev-parse", "--absolute-git-dir"]).trim(),
            store.canonicalize().unwrap().display().to_string()
        );
        // Idle, so taken: the repository's troupe/NAME is what it committed, and its other
        // moves (the sibling's branch, main) were refused above.
        assert_eq!(
            git_ok(&repo, &["rev-parse", &format!("troupe/{name}")]).trim(),
            git_ok(&wt, &["rev-parse", &format!("troupe/{name}")]).trim(),
            "the repository's troupe/{name} is not what {name} committed"
        );
        assert_ne!(
            git_ok(&repo, &["rev-parse", &format!("troupe/{name}")]).trim(),
            main_head.trim()
        );
    }
    // The main tree, its branch and the repository's settings and hooks are as they were.
    assert!(!repo.join("same.txt").exists(), "same.txt in the main tree");
    assert_eq!(git_ok(&repo, &["rev-parse", "HEAD"]), main_head);
    assert_eq!(main_status(), Vec::<String>::new());
    assert_eq!(
        std::fs::read_to_string(repo.join(".git/config")).unwrap(),
        config_before
    );
    assert!(!repo.join(".git/hooks/pre-commit").exists());

    // Status: branch, clean, then dirty.
    let s = status_as(&team, &url, uid);
    let w = &member(&s, "alice")["worktree"];
    assert_eq!(w["branch"], "troupe/alice", "{s}");
    assert_eq!(w["dirty"], false, "{s}");
    let alice_wt = PathBuf::from(w["path"].as_str().unwrap());
    std::fs::write(alice_wt.join("scratch.txt"), "uncommitted\n").unwrap();
    let s = status_as(&team, &url, uid);
    assert_eq!(member(&s, "alice")["worktree"]["dirty"], true, "{s}");
    assert_eq!(member(&s, "bob")["worktree"]["dirty"], false, "{s}");
    let text = lead(&team, &url, &["status"], uid).output().unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("troupe/alice") && text.contains("uncommitted"),
        "lead status does not show alice's branch and changes:\n{text}"
    );

    // Remove: refused while alice runs.
    let o = lead(
        &team,
        &url,
        &["worktree", "remove", "alice", "--force"],
        uid,
    )
    .output()
    .unwrap();
    assert_eq!(
        o.status.code(),
        Some(4),
        "remove of a running member's worktree: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(alice_wt.exists());
    stop(&mut sup);
    // Refused while dirty, done with --force; the branch stays.
    let o = lead(&team, &url, &["worktree", "remove", "alice"], uid)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(
        o.status.code(),
        Some(4),
        "remove of a dirty worktree: {err}"
    );
    assert!(err.contains("--force"), "{err}");
    assert!(alice_wt.join("scratch.txt").exists());
    let o = lead(
        &team,
        &url,
        &["worktree", "remove", "alice", "--force"],
        uid,
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("troupe/alice"),
        "remove does not say the branch is kept"
    );
    assert!(!alice_wt.exists(), "the worktree dir is still there");
    assert_eq!(git_ok(&repo, &["show", "troupe/alice:same.txt"]), "alice\n");
    let s = status_as(&team, &url, uid);
    assert!(member(&s, "alice")["worktree"].is_null(), "{s}");
    // A clean one goes without --force.
    let o = lead(&team, &url, &["worktree", "remove", "bob"], uid)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));

    // A respawn re-adds the worktree on the kept branch, with the teammate's commit.
    let o = lead(&team, &url, &spawn_args("alice", "m-alice"), uid)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(alice_wt.join("same.txt")).unwrap(),
        "alice\n"
    );
    assert_eq!(
        git_ok(&alice_wt, &["rev-parse", "--abbrev-ref", "HEAD"]).trim(),
        "troupe/alice"
    );
}

#[test]
fn a_restart_reuses_the_worktree_and_re_adds_a_removed_dir() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    let o = lead_cmd(&team, &url, &spawn_args("cat", "m-cat"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let wt = repo.parent().unwrap().join("repo.troupe/cat");
    assert!(wt.join("README").exists());
    std::fs::write(wt.join("kept.txt"), "still here\n").unwrap();
    // Spawned again (it never ran): the same worktree, untouched.
    let o = lead_cmd(&team, &url, &spawn_args("cat", "m-cat"))
        .output()
        .unwrap();
    assert!(
        o.status.success() || o.status.code() == Some(4),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(wt.join("kept.txt").exists());
    // The dir removed by hand: the supervisor re-adds it on the branch before starting cat.
    std::fs::remove_dir_all(&wt).unwrap();
    // cat's hooks run in its worktree too (in its sandbox: they may write there).
    let hook_cwd = wt.join("hook_cwd");
    troupe::config::Roster::new(&team.dir)
        .update(|c| {
            c.hooks = vec![troupe::hooks::Hook {
                event: troupe::hooks::HookEvent::TeammateIdle,
                command: "pwd > hook_cwd".to_owned(),
                timeout_secs: None,
                sandbox: true,
            }];
            Ok(())
        })
        .unwrap();
    fake.push_for(
        "m-cat",
        call("tu_pwd", "pwd; git rev-parse --abbrev-ref HEAD"),
    );
    fake.push_for("m-cat", Reply::ok(anthropic_text("here")));
    let mut lead = run_lead(&team, &url);
    wait_until(T, "cat idle", || {
        let s = status_json(&team, &url);
        (member(&s, "cat")["status"] == "idle" && fake.requests_for("m-cat") >= 2).then_some(())
    });
    let results = tool_results(&fake, "m-cat").join("\n");
    assert!(
        results.contains("troupe/cat") && results.contains("repo.troupe/cat"),
        "cat did not work in its re-added worktree: {results}\n{}",
        lead_stderr(&team)
    );
    assert!(wt.join("README").exists());
    // The shell creates hook_cwd before pwd writes it: wait for the whole line.
    let ran_in = wait_until(T, "cat's teammate_idle hook", || {
        std::fs::read_to_string(&hook_cwd)
            .ok()
            .filter(|s| s.ends_with('\n'))
    });
    assert_eq!(
        PathBuf::from(ran_in.trim()),
        wt.canonicalize().unwrap(),
        "cat's hook did not run in its worktree"
    );
    stop(&mut lead);
}

#[test]
fn worktree_outside_a_git_repository_is_refused() {
    let team = Team::new();
    let url = "http://127.0.0.1:9";
    let o = lead_cmd(&team, url, &spawn_args("dan", "m-dan"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("git repository"), "{err}");
    let s = status_json(&team, url);
    assert!(
        s["members"].as_array().unwrap().is_empty(),
        "a member was added: {s}"
    );
    assert!(
        !team.dir.root().join("inbox/dan.jsonl").exists(),
        "dan's task was delivered"
    );
}

fn chown_tree(dir: &Path, uid: u32) {
    std::os::unix::fs::lchown(dir, Some(uid), Some(uid)).unwrap();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.symlink_metadata().unwrap().is_dir() {
            chown_tree(&p, uid);
        } else {
            std::os::unix::fs::lchown(&p, Some(uid), Some(uid)).unwrap();
        }
    }
}

#[test]
fn an_idle_teammate_in_the_main_tree_is_not_moved_into_a_worktree_under_its_feet() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    let mut plain = spawn_args("eve", "m-eve");
    plain.pop();
    let o = lead_cmd(&team, &url, &plain).output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    fake.push_for("m-eve", Reply::ok(anthropic_text("ready")));
    let mut sup = run_lead(&team, &url);
    wait_until(T, "eve idle", || {
        (member(&status_json(&team, &url), "eve")["status"] == "idle").then_some(())
    });
    let o = lead_cmd(&team, &url, &spawn_args("eve", "m-eve"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(4), "{err}");
    assert!(err.contains("shut it down first"), "{err}");
    assert!(!repo.parent().unwrap().join("repo.troupe/eve").exists());
    assert!(member(&status_json(&team, &url), "eve")["worktree"].is_null());
    stop(&mut sup);
}

#[test]
fn a_team_file_member_with_worktree_gets_one_and_outside_a_repository_the_file_is_refused() {
    let file = "[[members]]\nname = \"fay\"\nrole = \"coder\"\nprompt = \"p\"\nworktree = true\n";
    let (team, repo) = repo_team();
    let path = team.tmp.path().join("team.toml");
    std::fs::write(&path, file).unwrap();
    let url = "http://127.0.0.1:9";
    let o = lead_cmd(&team, url, &["up", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let s = status_json(&team, url);
    let w = &member(&s, "fay")["worktree"];
    assert_eq!(w["branch"], "troupe/fay", "{w}");
    assert!(
        repo.parent()
            .unwrap()
            .join("repo.troupe/fay/README")
            .exists()
    );

    let plain = Team::new();
    let path = plain.tmp.path().join("team.toml");
    std::fs::write(&path, file).unwrap();
    let o = lead_cmd(&plain, url, &["up", path.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("git repository"), "{err}");
    assert!(
        status_json(&plain, url)["members"]
            .as_array()
            .unwrap()
            .is_empty()
    );
}
