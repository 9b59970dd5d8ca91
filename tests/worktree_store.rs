//! Issue 41 (review 4, R4-2, R4-3, R4-11): a worktree member owns its branch and nothing else.
//! Worktree members run hostile git through their own `bash` (real `lead run` and workers, the
//! model faked): they rewrite an object of `main`'s files, through `git rev-parse
//! --git-common-dir` and through the repository's `.git/objects` directly, name a dir of their
//! own in the repository's `objects/info/alternates`, and move `main`, the merge queue's target
//! and another member's branch by `update-ref`, by a loose ref file and by `packed-refs`. None of
//! it reaches the person's repository: `git fsck --full` stays clean, only the member's own
//! branch moves, its `bash` still works after the person's `git gc` and a restart of the team,
//! and its own commits still land through the queue. A worktree made the old way (a linked
//! worktree of the repository) is moved to the new layout at the first start.

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block, tool_results,
};
use support::git::{commit, git, git_ok, init_with};
use support::team::{Bg, Team, member, wait_until};
use troupe::TeamDir;
use troupe::config::Roster;

const T: Duration = Duration::from_secs(60);
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;
const TARGET: &str = "troupe/integration";

/// A fresh repository (one commit adding `README`) with the team dir `.team` at its top.
fn repo_team() -> (Team, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
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

/// `lead ARGS` run in the repository, finding `.team` itself.
fn lead(repo: &Path, url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lead"));
    c.args(args)
        .current_dir(repo)
        .env("TROUPE_PROVIDER", "anthropic")
        .env("ANTHROPIC_API_KEY", "sk-test")
        .env("ANTHROPIC_BASE_URL", url)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::store::redis::BUS_ENV)
        .stdin(Stdio::null());
    c
}

fn lead_ok(repo: &Path, url: &str, args: &[&str]) -> String {
    let o = lead(repo, url, args).output().unwrap();
    assert!(
        o.status.success(),
        "lead {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `lead run` in the repository, its stderr appended to `lead.stderr` in the temp dir.
fn run(team: &Team, repo: &Path, url: &str) -> Bg {
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(team.tmp.path().join("lead.stderr"))
        .unwrap();
    let bg = Bg(lead(
        repo,
        url,
        &["run", "--stop-timeout", "1", "--kill-grace", "1"],
    )
    .stdout(Stdio::null())
    .stderr(err)
    .spawn()
    .unwrap());
    wait_until(T, "the supervisor to hold lead.lock", || {
        troupe::fsutil::HeldLock::is_held(&team.dir.lead_lock())
            .unwrap()
            .then_some(())
    });
    bg
}

/// Kills `lead run` (SIGKILL; its workers die with it) and waits for it: a restart of the team
/// with no team stop, so that no shutdown request leaves a model call of a killed worker
/// waiting at the fake server for the next reply scripted (which the new incarnation's call
/// would then miss).
fn kill_lead(sup: &mut Bg, team: &Team) {
    let _ = sup.0.kill();
    let _ = sup.0.wait();
    wait_until(T, "alice's worker to die with its lead", || {
        let pid = team.member("alice").pid?;
        (!support::team::alive(u64::from(pid))).then_some(())
    });
}

/// Stops `lead run` as a person would (SIGTERM) and waits for it.
fn stop(sup: &mut Bg) {
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sup.0.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    );
    wait_until(T, "lead run to stop", || sup.0.try_wait().unwrap());
}

fn lead_stderr(team: &Team) -> String {
    std::fs::read_to_string(team.tmp.path().join("lead.stderr")).unwrap_or_default()
}

fn bash(id: &str, command: &str) -> Reply {
    let block = anthropic_tool_use_block(id, "bash", &json!({ "command": command }).to_string());
    Reply::ok(anthropic_message(&block, "tool_use", USAGE))
}

fn spawn(repo: &Path, url: &str, name: &str) {
    let model = format!("m-{name}");
    lead_ok(
        repo,
        url,
        &[
            "spawn",
            name,
            "--role",
            "coder",
            "--prompt",
            "work",
            "--model",
            &model,
            "--worktree",
        ],
    );
}

fn status(repo: &Path, url: &str) -> Value {
    serde_json::from_str(&lead_ok(repo, url, &["status", "--json"])).unwrap()
}

/// Scripts one `bash` call of member `name` and its closing text, and waits until the member
/// ran it and is idle again: its result. `wake`: send it a message first (it is idle).
fn one_call(
    team: &Team,
    repo: &Path,
    url: &str,
    fake: &FakeLlm,
    name: &str,
    cmd: &str,
    wake: bool,
) -> String {
    let model = format!("m-{name}");
    let before = tool_results(fake, &model).len();
    fake.push_for(&model, bash(&format!("tu_{before}"), cmd));
    fake.push_for(&model, Reply::ok(anthropic_text("ok")));
    if wake {
        lead_ok(repo, url, &["send", name, "go on"]);
    }
    let deadline = std::time::Instant::now() + T;
    loop {
        let results = tool_results(fake, &model);
        if results.len() > before && member(&status(repo, url), name)["status"] == "idle" {
            return results[before].clone();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {name}'s command {cmd:?}\n{name}: {}\nits log:\n{}\nlead run \
             said:\n{}\nevents: {:?}",
            member(&status(repo, url), name),
            std::fs::read_to_string(
                team.dir
                    .log(&troupe::teamdir::AgentName::teammate(name).unwrap())
            )
            .unwrap_or_default(),
            lead_stderr(team),
            events(team)
                .iter()
                .rev()
                .take(15)
                .map(Value::to_string)
                .collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn events(team: &Team) -> Vec<Value> {
    std::fs::read_to_string(team.dir.root().join("events.jsonl"))
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

/// Every ref of the repository and the commit it names.
/// The repository's refs but alice's own branch, which the supervisor moves to what she
/// committed in her store (a checked fetch) once she is idle.
fn refs(repo: &Path) -> Vec<String> {
    git_ok(repo, &["for-each-ref", "--format=%(refname) %(objectname)"])
        .lines()
        .filter(|l| !l.starts_with("refs/heads/troupe/alice "))
        .map(str::to_owned)
        .collect()
}

fn tip(repo: &Path, branch: &str) -> String {
    git_ok(repo, &["rev-parse", &format!("refs/heads/{branch}")])
        .trim()
        .to_owned()
}

/// `git fsck --full` of the person's repository: it must be clean.
fn assert_fsck_clean(repo: &Path) {
    let o = git(repo, &["fsck", "--full", "--no-dangling"]);
    assert!(
        o.status.success(),
        "git fsck --full of the person's repository: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Queues member `name`'s branch by hand and waits until it lands: the target's tip.
fn lands(team: &Team, repo: &Path, url: &str, name: &str) -> String {
    let landed = named(team, "merge_landed").len();
    let q = lead(repo, url, &["merge", name]).output().unwrap();
    assert!(
        q.status.success(),
        "lead merge {name}: {}",
        String::from_utf8_lossy(&q.stderr)
    );
    wait_until(T, &format!("{name}'s branch to land"), || {
        if let Some(back) = named(team, "merge_sent_back").into_iter().next() {
            panic!("{name}'s entry was sent back: {back}");
        }
        (named(team, "merge_landed").len() > landed).then_some(())
    });
    tip(repo, TARGET)
}

/// The commands of `worktree_rewrites_shared_objects.sh` and its variants: `H` is the blob of
/// `main:app.sh` (read from the repository's git dir `G`), `N` a blob of the member's content;
/// each attempt prints its exit code.
fn rewrite_objects(g: &Path) -> String {
    let g = g.display();
    format!(
        r#"G={g}; H=$(git --git-dir=$G rev-parse main:app.sh); C=$(git rev-parse --git-common-dir)
N=$(printf 'echo PWNED\n' | git hash-object -w --stdin); O=$(git rev-parse --git-path objects)
n=$O/${{N:0:2}}/${{N:2}}
f=$C/objects/${{H:0:2}}/${{H:2}}; mkdir -p "${{f%/*}}"; rm -f "$f" && cp "$n" "$f"; echo "common=$?"
f=$G/objects/${{H:0:2}}/${{H:2}}; rm -f "$f" && cp "$n" "$f"; echo "direct=$?"
mkdir -p "$PWD/.evil-objects" && echo "$PWD/.evil-objects" >> "$G/objects/info/alternates"; echo "alternates=$?"
touch "$G/objects/pack/pack-0000000000000000000000000000000000000000.pack"; echo "pack=$?"
echo "$G/objects" >> "$O/info/alternates"; echo "own-alternates=$?"
git --git-dir=$G repack -a -d -q; echo "repack=$?"
echo done"#
    )
}

/// Acceptance 1 and 2 for `worktree_rewrites_shared_objects.sh`: the member's rewrites reach
/// only its own store; the person's `main:app.sh` is what the person committed, `git fsck
/// --full` is clean after a `git gc` and a restart, the member's `bash` still works and its
/// own commit lands.
#[test]
fn a_member_rewrites_no_object_of_the_repository() {
    let (team, repo) = repo_team();
    std::fs::write(repo.join("app.sh"), "echo safe\n").unwrap();
    git_ok(&repo, &["add", "app.sh"]);
    commit(&repo, "the person's app");
    let blob = git_ok(&repo, &["rev-parse", "main:app.sh"]);
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    spawn(&repo, &url, "alice");
    let mut sup = run(&team, &repo, &url);
    let said = one_call(
        &team,
        &repo,
        &url,
        &fake,
        "alice",
        &rewrite_objects(&repo.join(".git")),
        false,
    );
    assert!(said.contains("done"), "{said}\n{}", lead_stderr(&team));
    assert_refused(
        &said,
        &["direct", "alternates", "pack", "own-alternates", "repack"],
    );
    let person_view = |repo: &Path| {
        assert_eq!(git_ok(repo, &["show", "main:app.sh"]), "echo safe\n");
        assert_eq!(git_ok(repo, &["rev-parse", "main:app.sh"]), blob);
        std::fs::remove_file(repo.join("app.sh")).unwrap();
        git_ok(repo, &["checkout", "-q", "--", "app.sh"]);
        assert_eq!(
            std::fs::read_to_string(repo.join("app.sh")).unwrap(),
            "echo safe\n"
        );
        assert!(!repo.join(".git/objects/info/alternates").exists());
        assert_fsck_clean(repo);
    };
    person_view(&repo);

    // Her own work still commits and lands, checked out as the person committed app.sh.
    let said = one_call(
        &team,
        &repo,
        &url,
        &fake,
        "alice",
        "echo mine > mine.txt && git add mine.txt && git commit -qm mine && echo COMMITTED",
        true,
    );
    assert!(said.contains("COMMITTED"), "{said}");
    let landed = lands(&team, &repo, &url, "alice");
    assert_eq!(
        git_ok(&repo, &["show", &format!("{landed}:mine.txt")]),
        "mine\n"
    );
    assert_eq!(
        git_ok(&repo, &["show", &format!("{landed}:app.sh")]),
        "echo safe\n"
    );
    person_view(&repo);

    // The person's `git gc` and a restart of the team: her bash works, the repository is sound.
    kill_lead(&mut sup, &team);
    git_ok(&repo, &["gc", "--quiet", "--prune=now"]);
    let _sup = run(&team, &repo, &url);
    let said = one_call(
        &team,
        &repo,
        &url,
        &fake,
        "alice",
        "git log -1 --format=%s; echo works",
        true,
    );
    assert!(
        said.contains("works") && !said.contains("exit code 125"),
        "alice's bash after git gc and a restart: {said}"
    );
    person_view(&repo);
}

/// The ref moves of `worktree_moves_other_refs.sh` and its variants, with `E` the member's own
/// commit; each attempt prints its exit code.
fn move_refs(g: &Path) -> String {
    let g = g.display();
    format!(
        r#"G={g}; E=$(git rev-parse HEAD)
git update-ref refs/heads/troupe/bob $E; echo "own-bob=$?"
git --git-dir=$G update-ref refs/heads/troupe/bob $E; echo "bob=$?"
git --git-dir=$G update-ref refs/heads/troupe/integration $E; echo "integration=$?"
git --git-dir=$G update-ref refs/heads/main $E; echo "main=$?"
echo $E > $G/refs/heads/main; echo "loose-main=$?"
mkdir -p $G/refs/heads/troupe; echo $E > $G/refs/heads/troupe/integration; echo "loose-integration=$?"
echo $E > $G/refs/heads/troupe/bob; echo "loose-bob=$?"
echo "$E refs/heads/troupe/bob" >> $G/packed-refs; echo "packed=$?"
echo "$E refs/heads/troupe/integration" >> $(git rev-parse --git-common-dir)/packed-refs; echo "common-packed=$?"
echo done"#
    )
}

/// Whether each of `whats` printed a non-zero exit code (a line `WHAT=CODE`) in `said`.
fn assert_refused(said: &str, whats: &[&str]) {
    for what in whats {
        let code = said
            .split("\\n")
            .flat_map(|l| l.split('\n'))
            .find_map(|l| l.trim_matches('"').strip_prefix(&format!("{what}=")));
        assert!(
            code.is_some_and(|c| c != "0"),
            "{what} was not refused: {said}"
        );
    }
}

/// Acceptance 1 and 2 for `worktree_moves_other_refs.sh`: a member moves no ref but its own
/// branch, neither one made after its worker started (bob's), nor the target or `main`, before
/// or after the person's `git gc` and a restart; its `bash` keeps working through the `gc`,
/// and its own commit lands through the queue.
#[test]
fn a_member_moves_no_ref_but_its_own_branch() {
    let (team, repo) = repo_team();
    // An identity of the repository's own, as review 4's script sets: the member's git reads its
    // store's config, so it must be handed down (the commit below failed without).
    git_ok(&repo, &["config", "user.name", "person"]);
    git_ok(&repo, &["config", "user.email", "person@example.invalid"]);
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    spawn(&repo, &url, "alice");
    let mut sup = run(&team, &repo, &url);
    let said = one_call(
        &team,
        &repo,
        &url,
        &fake,
        "alice",
        "echo unchecked > evil.txt && git add evil.txt && git commit -qm unchecked && echo COMMITTED",
        false,
    );
    assert!(said.contains("COMMITTED"), "{said}\n{}", lead_stderr(&team));
    // By the time she says idle, her commit is on the person's troupe/alice: her worker took it
    // (review 4's script reads the branch at that moment, and the merge thread's look came
    // later, so it read the base and took every ref for moved).
    assert_eq!(
        git_ok(&repo, &["show", "troupe/alice:evil.txt"]),
        "unchecked\n",
        "troupe/alice once alice is idle"
    );
    // bob joins after alice's worker started.
    fake.push_for("m-bob", Reply::ok(anthropic_text("idle")));
    spawn(&repo, &url, "bob");
    wait_until(T, "bob idle", || {
        (member(&status(&repo, &url), "bob")["status"] == "idle").then_some(())
    });
    wait_until(T, "bob's branch", || {
        git(
            &repo,
            &["rev-parse", "-q", "--verify", "refs/heads/troupe/bob"],
        )
        .status
        .success()
        .then_some(())
    });
    let before = refs(&repo);
    let g = repo.join(".git");
    let said = one_call(&team, &repo, &url, &fake, "alice", &move_refs(&g), true);
    assert!(said.contains("done"), "{said}");
    let others = [
        "bob",
        "integration",
        "main",
        "loose-main",
        "loose-integration",
        "loose-bob",
        "packed",
    ];
    assert_refused(&said, &others);
    assert_eq!(refs(&repo), before, "a ref moved: {said}");
    assert_fsck_clean(&repo);

    // The person's `git gc` (which packs the refs) while alice runs: her next command works.
    git_ok(&repo, &["gc", "--quiet"]);
    let said = one_call(&team, &repo, &url, &fake, "alice", "echo after-gc", true);
    assert!(
        said.contains("after-gc") && !said.contains("exit code 125"),
        "alice's bash after git gc: {said}"
    );
    // A restart of the team: the same moves, now that no loose ref is left to guard.
    kill_lead(&mut sup, &team);
    let mut sup = run(&team, &repo, &url);
    let said = one_call(&team, &repo, &url, &fake, "alice", &move_refs(&g), true);
    assert!(said.contains("done"), "{said}");
    assert_refused(&said, &others);
    assert_eq!(
        refs(&repo),
        before,
        "a ref moved after gc and a restart: {said}"
    );
    assert_fsck_clean(&repo);

    // Her own commit lands through the queue (only the supervisor moves the target), and the
    // only refs that moved are her branch and the target.
    let landed = lands(&team, &repo, &url, "alice");
    assert_eq!(
        git_ok(&repo, &["show", &format!("{landed}:evil.txt")]),
        "unchecked\n"
    );
    let moved: Vec<String> = refs(&repo)
        .into_iter()
        .filter(|r| !before.contains(r))
        .map(|r| r.split(' ').next().unwrap_or_default().to_owned())
        .collect();
    assert!(
        moved
            .iter()
            .all(|r| r == "refs/heads/troupe/alice" || r == &format!("refs/heads/{TARGET}")),
        "refs that moved: {moved:?}"
    );
    assert_eq!(
        tip(&repo, "troupe/bob"),
        before_tip(&before, "refs/heads/troupe/bob")
    );
    assert_eq!(tip(&repo, "main"), before_tip(&before, "refs/heads/main"));
    assert_fsck_clean(&repo);
    stop(&mut sup);
}

fn before_tip(refs: &[String], name: &str) -> String {
    refs.iter()
        .find_map(|r| r.strip_prefix(&format!("{name} ")))
        .unwrap_or_default()
        .to_owned()
}

/// A worktree made the old way (`git worktree add`, its record naming its admin dir under
/// `.git/worktrees`) is moved at the first start: its commit and its staged work are kept, the
/// old admin dir is gone, the member's git has a store of its own, and its commit lands.
#[test]
fn an_old_worktree_moves_to_a_store_of_its_own_at_the_first_start() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    lead_ok(
        &repo,
        &url,
        &[
            "spawn", "alice", "--role", "coder", "--prompt", "work", "--model", "m-alice",
        ],
    );
    let path = repo.parent().unwrap().join("repo.troupe/alice");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    git_ok(
        &repo,
        &[
            "worktree",
            "add",
            "-q",
            "-b",
            "troupe/alice",
            path.to_str().unwrap(),
            "HEAD",
        ],
    );
    std::fs::write(path.join("old.txt"), "old work\n").unwrap();
    git_ok(&path, &["add", "old.txt"]);
    commit(&path, "old work");
    std::fs::write(path.join("staged.txt"), "staged\n").unwrap();
    git_ok(&path, &["add", "staged.txt"]);
    let old_admin = repo.join(".git/worktrees/alice");
    assert!(old_admin.is_dir());
    let old_tip = tip(&repo, "troupe/alice");
    Roster::new(&team.dir)
        .update_member("alice", |m| {
            m.worktree = Some(troupe::worktree::Worktree {
                path: path.clone(),
                branch: "troupe/alice".to_owned(),
                repo: repo.clone(),
                admin: Some(old_admin.clone()),
            });
        })
        .unwrap();
    let mut sup = run(&team, &repo, &url);
    let said = one_call(
        &team,
        &repo,
        &url,
        &fake,
        "alice",
        "git log -1 --format=%s; git diff --cached --name-only; git rev-parse --absolute-git-dir; echo works",
        false,
    );
    assert!(said.contains("works"), "{said}\n{}", lead_stderr(&team));
    assert!(
        said.contains("old work") && said.contains("staged.txt"),
        "{said}"
    );
    assert!(
        !said.contains("/.git/worktrees/"),
        "alice's git still uses the old admin dir: {said}"
    );
    assert!(!old_admin.exists(), "the old admin dir is still there");
    let wt = team.member("alice").worktree.unwrap();
    let admin = wt.admin.clone().unwrap();
    assert!(
        !admin.starts_with(repo.join(".git")),
        "the record names {}",
        admin.display()
    );
    assert!(
        std::fs::read_to_string(path.join(".git"))
            .unwrap()
            .contains(&admin.display().to_string()),
        "the worktree's .git does not name its store"
    );
    assert!(
        !named(&team, "worktree_migrated").is_empty(),
        "{:?}",
        events(&team)
    );
    assert_eq!(tip(&repo, "troupe/alice"), old_tip);
    // The old commit and then the staged file, committed now, land.
    let said = one_call(
        &team,
        &repo,
        &url,
        &fake,
        "alice",
        "git commit -qm staged && echo COMMITTED",
        true,
    );
    assert!(said.contains("COMMITTED"), "{said}");
    let landed = lands(&team, &repo, &url, "alice");
    assert_eq!(
        git_ok(&repo, &["show", &format!("{landed}:old.txt")]),
        "old work\n"
    );
    assert_eq!(
        git_ok(&repo, &["show", &format!("{landed}:staged.txt")]),
        "staged\n"
    );
    assert_fsck_clean(&repo);
    stop(&mut sup);
}

/// A repository that fails `git fsck` when an old worktree is moved is reported (an event) and
/// the queue holds its entries, with a report that says why, instead of landing them.
#[test]
fn a_repository_that_fails_fsck_at_the_move_is_not_landed_on() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    lead_ok(
        &repo,
        &url,
        &[
            "spawn", "alice", "--role", "coder", "--prompt", "work", "--model", "m-alice",
        ],
    );
    let path = repo.parent().unwrap().join("repo.troupe/alice");
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    git_ok(
        &repo,
        &[
            "worktree",
            "add",
            "-q",
            "-b",
            "troupe/alice",
            path.to_str().unwrap(),
            "HEAD",
        ],
    );
    std::fs::write(path.join("work.txt"), "work\n").unwrap();
    git_ok(&path, &["add", "work.txt"]);
    commit(&path, "work");
    // What the old layout let a member do: main's README blob swapped for another content.
    let h = git_ok(&repo, &["rev-parse", "main:README"])
        .trim()
        .to_owned();
    let f = repo.join(".git/objects").join(&h[..2]).join(&h[2..]);
    let n = String::from_utf8(
        Command::new("sh")
            .arg("-c")
            .arg("printf 'swapped\\n' | git hash-object -w --stdin")
            .current_dir(&repo)
            .output()
            .unwrap()
            .stdout,
    )
    .unwrap()
    .trim()
    .to_owned();
    let kept = std::fs::read(&f).unwrap();
    std::fs::remove_file(&f).unwrap();
    std::fs::copy(repo.join(".git/objects").join(&n[..2]).join(&n[2..]), &f).unwrap();
    Roster::new(&team.dir)
        .update_member("alice", |m| {
            m.worktree = Some(troupe::worktree::Worktree {
                path: path.clone(),
                branch: "troupe/alice".to_owned(),
                repo: repo.clone(),
                admin: Some(repo.join(".git/worktrees/alice")),
            });
        })
        .unwrap();
    let _sup = run(&team, &repo, &url);
    fake.push_for("m-alice", Reply::ok(anthropic_text("idle")));
    wait_until(T, "the fsck failure reported", || {
        named(&team, "repository_fsck_failed").into_iter().next()
    });
    lead_ok(&repo, &url, &["merge", "alice"]);
    let held = wait_until(T, "the entry held with a report", || {
        let list: Value =
            serde_json::from_str(&lead_ok(&repo, &url, &["merge", "--list", "--json"])).unwrap();
        list.as_array()
            .and_then(|a| a.first().cloned())
            .filter(|e| e["report"].as_str().is_some_and(|r| r.contains("fsck")))
    });
    assert!(named(&team, "merge_landed").is_empty(), "{held}");
    // The person repairs the object: the queue lands once fsck passes again.
    std::fs::remove_file(&f).unwrap();
    std::fs::write(&f, kept).unwrap();
    wait_until(
        Duration::from_secs(120),
        "the land once fsck passes",
        || (!named(&team, "merge_landed").is_empty()).then_some(()),
    );
    assert_eq!(
        git_ok(&repo, &["show", &format!("{TARGET}:work.txt")]),
        "work\n"
    );
}

/// Taking a member's branch from two places at once (the queue at a completion, the merge
/// thread following an idle member, `lead merge` by hand) never fails: before, two fetches
/// into the same `troupe/NAME` raced on its ref lock ("cannot lock ref ... is at X but
/// expected Y") and the loser sent a finished task back.
#[test]
fn a_branch_taken_from_several_places_at_once_is_taken_every_time() {
    let (team, repo) = repo_team();
    let wt = troupe::worktree::ensure(team.dir.root(), "ann", None).unwrap();
    let work = |n: usize| {
        std::fs::write(wt.path.join("ann.txt"), format!("{n}\n")).unwrap();
        git_ok(&wt.path, &["add", "ann.txt"]);
        commit(&wt.path, &format!("change {n}"));
    };
    work(0);
    std::thread::scope(|s| {
        let takers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| {
                    (0..15)
                        .filter_map(|_| troupe::worktree::take_branch(&wt).err())
                        .map(|e| e.to_string())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for n in 1..10 {
            work(n);
        }
        let failed: Vec<String> = takers.into_iter().flat_map(|t| t.join().unwrap()).collect();
        assert!(
            failed.is_empty(),
            "{} takes failed: {failed:?}",
            failed.len()
        );
    });
    troupe::worktree::take_branch(&wt).unwrap();
    let tip = git_ok(&repo, &["rev-parse", "troupe/ann"]);
    assert_eq!(tip, git_ok(&wt.path, &["rev-parse", "HEAD"]));
}
