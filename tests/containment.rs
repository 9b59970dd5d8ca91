//! Issue 22 (containment, round 2), the findings about paths and git: every test drives real
//! workers under `lead run` through the fake LLM server.
//!
//! - N8 and m5: a relative team dir (the default `.team`), key file and `--sandbox-read` dir
//!   reach workers that start in another directory (a worktree, `--workdir`) as the places
//!   the person named, from the repository root and from a sub-directory.
//! - N1: what a command plants in `.git` or `commondir` (a member with or without a worktree)
//!   grants nothing after the worker starts again: a file outside every granted tree stays
//!   unreadable.
//! - N2: a worktree member's planted git dir and `core.fsmonitor` do not run when a person runs
//!   `lead status`.
//! - N3: the main working dir's `.git` (hooks, config, info, the dir itself) cannot be changed
//!   by `bash`, so the person's next `git commit` runs nothing of the model's.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::tool_results;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::git::{commit, git_ok, init_with};
use support::team::{Bg, member, wait_until};

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

/// A fresh git repository `repo` (one commit) in a temp dir, with a sub-directory `sub`.
fn repository() -> (tempfile::TempDir, PathBuf) {
    repository_in(&std::env::temp_dir())
}

/// [`repository`] in a temp dir under `base`.
fn repository_in(base: &Path) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir_in(base).unwrap();
    let repo = tmp.path().join("repo");
    init_with(&repo, "sub/README");
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
        .env_remove(troupe::store::redis::BUS_ENV)
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
    // Spawned from the repository root, as docs/worktrees.md says: `.team` is made there.
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

/// A team in the default layout at the top of a fresh repository, its supervisor running, with
/// the fake LLM; members are scripted by model name.
struct Scene {
    tmp: tempfile::TempDir,
    repo: PathBuf,
    fake: FakeLlm,
    url: String,
    _sup: Option<Bg>,
}

impl Scene {
    fn new() -> Scene {
        Scene::new_in(&std::env::temp_dir())
    }

    fn new_in(base: &Path) -> Scene {
        let (tmp, repo) = repository_in(base);
        std::fs::write(tmp.path().join("key"), "sk-test\n").unwrap();
        let fake = FakeLlm::start([]).patient(T);
        let url = fake.url();
        Scene {
            tmp,
            repo,
            fake,
            url,
            _sup: None,
        }
    }

    /// `lead ARGS` with the team dir named absolutely (these tests are about git, not
    /// paths: the tests above check the default layout).
    fn lead(&self, args: &[&str]) -> Command {
        let key = self.tmp.path().join("key");
        let mut c = lead_in(&self.repo, &self.url, key.to_str().unwrap(), &[]);
        c.arg("--team-dir").arg(self.repo.join(".team")).args(args);
        c
    }

    fn ok(&self, args: &[&str]) -> String {
        ok(self.lead(args).output().unwrap(), &format!("lead {args:?}"))
    }

    /// Spawns `name` (model `m-NAME`) whose first activation runs `commands` in turn.
    fn spawn(&self, name: &str, worktree: bool, commands: &[&str]) {
        let model = format!("m-{name}");
        let mut args = vec![
            "spawn", name, "--role", "coder", "--prompt", "p", "--model", &model,
        ];
        if worktree {
            args.push("--worktree");
        }
        self.ok(&args);
        self.script(name, commands);
    }

    /// The next activation of `name` runs `commands`, then ends its turn.
    fn script(&self, name: &str, commands: &[&str]) {
        let model = format!("m-{name}");
        for (i, c) in commands.iter().enumerate() {
            self.fake.push_for(&model, call(&format!("tu_{i}"), c));
        }
        self.fake
            .push_for(&model, Reply::ok(anthropic_text("done")));
    }

    fn run(&mut self, extra: &[&str]) {
        let stderr = self.tmp.path().join("lead.stderr");
        let mut args = vec!["run", "--stop-timeout", "1", "--kill-grace", "1"];
        args.extend_from_slice(extra);
        self._sup = Some(Bg(self
            .lead(&args)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(stderr).unwrap())
            .spawn()
            .unwrap()));
    }

    fn status(&self) -> Value {
        serde_json::from_str(&self.ok(&["status", "--json"])).unwrap()
    }

    /// Waits until `name` is idle having made `calls` model calls in all.
    fn idle_after(&self, name: &str, calls: usize) -> Value {
        let model = format!("m-{name}");
        wait_until(T, &format!("{name} idle after {calls} calls"), || {
            let s = self.status();
            let m = member(&s, name).clone();
            assert_ne!(m["status"], "failed", "{name} failed: {m}");
            (m["status"] == "idle" && self.fake.requests_for(&model) >= calls).then_some(m)
        })
    }

    /// Kills `name`'s worker with SIGKILL and waits for its successor to be idle.
    fn restart(&self, name: &str) {
        let m = member(&self.status(), name).clone();
        let pid = m["pid"].as_i64().expect("a pid");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        wait_until(T, &format!("{name} started again"), || {
            let s = self.status();
            let m = member(&s, name);
            (m["pid"].as_i64().is_some_and(|p| p != pid) && m["status"] == "idle").then_some(())
        });
    }

    fn results(&self, name: &str) -> Vec<String> {
        tool_results(&self.fake, &format!("m-{name}"))
    }
}

/// A file no sandbox grant names: outside `/tmp` (whose real contents commands never see) and
/// outside the system trees.
fn secret_outside() -> (tempfile::TempDir, PathBuf) {
    let base = if Path::new("/var/tmp").is_dir() {
        PathBuf::from("/var/tmp")
    } else {
        std::env::temp_dir()
    };
    let dir = tempfile::tempdir_in(base).unwrap();
    let f = dir.path().join("secret.txt");
    std::fs::write(&f, "OUT-OF-REACH\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    (dir, f)
}

/// N1 for `name`: its first activation runs `plant`; after its worker is killed and started
/// again, a command reads a file outside every grant, and cannot. Without a worktree the team
/// works in a plain dir (no repository: nothing of git is granted there).
fn planted_grants_grant_nothing(worktree: bool, plant: &str) {
    let (_outside, secret) = secret_outside();
    let mut scene = Scene::new();
    let plain = scene.tmp.path().join("plain");
    std::fs::create_dir(&plain).unwrap();
    scene.spawn("alice", worktree, &[plant]);
    if worktree {
        scene.run(&[]);
    } else {
        scene.run(&["--workdir", plain.to_str().unwrap()]);
    }
    scene.idle_after("alice", 2);
    scene.restart("alice");
    let read = format!("cat {} 2>&1; echo READ=$?", secret.display());
    scene.script("alice", &[&read]);
    scene.ok(&["send", "alice", "go on"]);
    scene.idle_after("alice", 4);
    let results = scene.results("alice");
    let all = results.join("\n");
    assert!(all.contains("READ="), "the read never ran: {all}");
    assert!(
        !all.contains("OUT-OF-REACH") && !all.contains("READ=0"),
        "after the plant ({plant}) and a restart, a command read {}: {all}",
        secret.display()
    );
}

#[test]
fn a_planted_git_file_grants_nothing_to_a_member_without_a_worktree() {
    planted_grants_grant_nothing(
        false,
        "mkdir -p fake && echo / > fake/commondir && echo \"gitdir: $PWD/fake\" > .git; \
         echo planted=$?",
    );
}

#[test]
fn a_planted_git_file_with_a_relative_path_grants_nothing_either() {
    // Another shape: a relative gitdir, a commondir climbing out with `..`.
    planted_grants_grant_nothing(
        false,
        "mkdir -p a/b && printf '../../../../../../../../..\\n' > a/b/commondir && \
         echo 'gitdir: a/b' > .git; echo planted=$?",
    );
}

#[test]
fn a_planted_commondir_grants_nothing_to_a_worktree_member() {
    planted_grants_grant_nothing(
        true,
        "printf ' /\\n' > \"$(git rev-parse --git-dir)/commondir\"; echo commondir=$?; \
         mkdir -p fake && echo / > fake/commondir; \
         echo \"gitdir: $PWD/fake\" > .git; echo gitfile=$?",
    );
}

#[test]
fn a_planted_git_dir_runs_nothing_when_lead_status_looks_at_the_worktree() {
    let mut scene = Scene::new();
    let marker = scene.tmp.path().join("FSMONITOR-RAN");
    let hook = format!("touch {}; exit 1", marker.display());
    // A git dir of the model's making, with fsmonitor set, named by the worktree's `.git`;
    // and the same config put where the admin dir's `commondir` would send git.
    let plant = format!(
        "git init -q --bare .g && git -C .g config core.fsmonitor '{hook}'; \
         echo \"gitdir: $PWD/.g\" > .git; echo gitfile=$?; \
         printf '%s\\n' \"$PWD/.g\" > \"$(git rev-parse --git-dir)/commondir\"; echo commondir=$?"
    );
    scene.spawn("alice", true, &[&plant]);
    scene.run(&[]);
    scene.idle_after("alice", 2);
    let planted = scene.results("alice").join("\n");
    for _ in 0..2 {
        let s = scene.status();
        assert!(
            member(&s, "alice")["worktree"]["branch"] == "troupe/alice",
            "{s}"
        );
        scene.ok(&["status"]);
    }
    assert!(
        !marker.exists(),
        "lead status ran the model's core.fsmonitor (the plant said: {planted})"
    );
    // The worktree still works for its member: its `.git` was not changed.
    scene.script("alice", &["git status --short >/dev/null && echo GIT-OK"]);
    scene.ok(&["send", "alice", "again"]);
    scene.idle_after("alice", 4);
    let all = scene.results("alice").join("\n");
    assert!(all.contains("GIT-OK"), "{all}");
}

#[test]
fn the_main_trees_git_dir_is_read_only_to_commands() {
    let mut scene = Scene::new();
    let repo = scene.repo.clone();
    let marker = scene.tmp.path().join("MODEL-HOOK-RAN");
    let config_before = std::fs::read(repo.join(".git/config")).unwrap();
    let listing = |dir: &Path| {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        v.sort();
        v
    };
    let git_before = listing(&repo.join(".git"));
    let hooks_before = listing(&repo.join(".git/hooks"));
    let attack = [
        format!(
            "printf '#!/bin/sh\\ntouch {}\\n' > .git/hooks/pre-commit; echo hook=$?; \
             chmod +x .git/hooks/pre-commit",
            marker.display()
        ),
        format!(
            "printf '[core]\\n\\tfsmonitor = touch {}\\n' >> .git/config; echo config=$?",
            marker.display()
        ),
        "mkdir -p .git/info; echo '* filter=x' > .git/info/attributes; echo info=$?".to_owned(),
        "mv .git .git-away; echo move=$?; rm -rf .git; echo remove=$?".to_owned(),
        "echo 'gitdir: /tmp' > .git; echo replace=$?".to_owned(),
    ];
    let attack: Vec<&str> = attack.iter().map(String::as_str).collect();
    scene.spawn("bob", false, &attack);
    scene.run(&[]);
    scene.idle_after("bob", attack.len() + 1);
    let all = scene.results("bob").join("\n");
    for what in ["hook", "config", "info", "move", "replace"] {
        assert!(all.contains(&format!("{what}=")), "{what} never ran: {all}");
        assert!(
            !all.contains(&format!("{what}=0")),
            "bash could {what} in the main tree's .git: {all}"
        );
    }
    assert_eq!(
        std::fs::read(repo.join(".git/config")).unwrap(),
        config_before
    );
    assert_eq!(listing(&repo.join(".git")), git_before);
    assert_eq!(listing(&repo.join(".git/hooks")), hooks_before);
    // The person commits: nothing of the model's runs.
    std::fs::write(repo.join("sub/change"), "x\n").unwrap();
    git_ok(&repo, &["add", "sub/change"]);
    commit(&repo, "the person's commit");
    git_ok(&repo, &["status", "--short"]);
    assert!(!marker.exists(), "the person's git ran the model's code");
}

/// N5: a hook the user declared runs a script in the working dir that the model rewrote: it
/// runs in the member's sandbox, so it cannot reach the team dir, and gets no
/// `TROUPE_TEAM_DIR`; a hook marked `sandbox = false` still runs as the supervisor's user.
#[test]
fn a_hook_runs_the_models_script_in_the_members_sandbox() {
    let mut scene = Scene::new();
    let team = scene.repo.join(".team");
    let outside = scene.tmp.path().join("unsandboxed-hook-ran");
    let script = format!(
        "printf '%s\\n' '#!/bin/sh' \
         'echo \"TEAM=${{TROUPE_TEAM_DIR:-unset}}\" > hook.out' \
         'ls {team}/inbox {team}/transcripts >> hook.out 2>&1' \
         'echo forged > {team}/OWNED-BY-MODEL; echo \"write=$?\" >> hook.out' \
         'exit 0' > check.sh && chmod +x check.sh && echo WROTE",
        team = team.display()
    );
    scene.spawn("alice", false, &[&script]);
    // The hooks, as a person applies them with `lead up` (a `sandbox = false` hook runs
    // outside only when it came so).
    let file = scene.tmp.path().join("team.json");
    let hooks = json!({"hooks": [
        {"event": "teammate_idle", "command": "./check.sh"},
        {"event": "teammate_idle", "command": format!("touch {}", outside.display()), "sandbox": false},
    ]});
    std::fs::write(&file, hooks.to_string()).unwrap();
    scene.ok(&["up", file.to_str().unwrap()]);
    scene.run(&[]);
    scene.idle_after("alice", 2);
    let out = scene.repo.join("hook.out");
    let text = wait_until(T, "the hook's output", || {
        std::fs::read_to_string(&out)
            .ok()
            .filter(|t| t.contains("write="))
    });
    assert!(
        !team.join("OWNED-BY-MODEL").exists(),
        "the hook wrote into the team dir: {text}"
    );
    assert!(text.contains("TEAM=unset"), "{text}");
    assert!(!text.contains("write=0"), "{text}");
    for f in ["alice.jsonl", "lead.jsonl"] {
        assert!(!text.contains(f), "the hook listed the team dir: {text}");
    }
    wait_until(T, "the unsandboxed hook", || outside.exists().then_some(()));
}

/// N7: run as root, commands never run as uid 0. In a working dir only root may use (a 0700
/// dir outside `/tmp`, as under `/root` or in most containers), they run as nobody through
/// idmapped mounts: they write there, what they make belongs to the owner on disk, and root's
/// 0600 files stay closed to them.
#[test]
fn as_root_commands_run_as_nobody_even_where_only_root_may_work() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("not root: commands run as this user; nothing to check here");
        return;
    }
    let base = if Path::new("/var/tmp").is_dir() {
        PathBuf::from("/var/tmp")
    } else {
        std::env::temp_dir()
    };
    let mut scene = Scene::new_in(&base);
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    for d in [scene.tmp.path(), scene.repo.as_path()] {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700)).unwrap();
    }
    let secret = scene.tmp.path().join("root-only");
    std::fs::write(&secret, "ROOT-ONLY\n").unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    scene.spawn(
        "alice",
        false,
        &[
            "echo \"UID=$(id -u)\"; echo made > sub/made.txt && echo wrote=$?; \
           cat /etc/shadow > /dev/null 2>&1; echo shadow=$?",
        ],
    );
    scene.run(&[]);
    let m = scene.idle_after("alice", 2);
    let all = scene.results("alice").join("\n");
    assert!(
        all.contains("UID=65534"),
        "{all}\nsandbox: {}",
        m["sandbox"]
    );
    assert!(all.contains("wrote=0"), "{all}");
    if Path::new("/etc/shadow").exists() {
        assert!(
            all.contains("shadow=") && !all.contains("shadow=0"),
            "{all}"
        );
    }
    let made = std::fs::metadata(scene.repo.join("sub/made.txt")).unwrap();
    assert_eq!(
        made.uid(),
        0,
        "what the command made belongs to the owner on disk"
    );
    assert!(
        m["sandbox"]["user"]
            .as_str()
            .is_some_and(|u| u.contains("65534")),
        "{}",
        m["sandbox"]
    );
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        assert_eq!(m["sandbox"]["active"], true, "{}", m["sandbox"]);
    }
}

/// N7: `--sandbox-user root` is refused: `lead run` exits 78 and says how to proceed.
#[test]
fn as_root_lead_run_refuses_to_run_commands_as_root() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("not root: --sandbox-user does not apply");
        return;
    }
    let scene = Scene::new();
    let stderr = scene.tmp.path().join("run.stderr");
    let mut run = Bg(scene
        .lead(&["run", "--sandbox-user", "root"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap());
    // A lead run that starts anyway is killed when `run` is dropped, after the wait fails.
    let status = wait_until(T, "lead run to exit", || run.0.try_wait().unwrap());
    let err = std::fs::read_to_string(&stderr).unwrap_or_default();
    assert_eq!(status.code(), Some(78), "{err}");
    assert!(
        err.contains("uid 0") && err.contains("--sandbox off"),
        "{err}"
    );
}
