//! Issue 27, the merge queue: worktree members complete tasks under the real `lead run` and
//! workers (the model faked), and their commits land on the team's target branch one at a
//! time, each after the `merge_check` hooks passed in the integration tree. Every command runs
//! as a user runs it: in the repository, with `.team` at its top found by itself (no
//! `--team-dir`, no `TROUPE_TEAM_DIR`).

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::git::{commit, git, git_ok, init_with};
use support::team::{Bg, Team, wait_until};
use troupe::TeamDir;
use troupe::config::Roster;
use troupe::hooks::{Hook, HookEvent};
use troupe::merge::{MergeEntry, MergeState, MergeStore};
use troupe::tasks::{NewTask, TaskStatus, TaskStore};

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

/// `lead run` in the repository, its stderr kept in the temp dir.
fn run(team: &Team, repo: &Path, url: &str, extra: &[&str]) -> Bg {
    run_with(team, repo, url, extra, &[])
}

/// [`run`] with variables `env` set besides.
fn run_with(team: &Team, repo: &Path, url: &str, extra: &[&str], env: &[(&str, &Path)]) -> Bg {
    let mut args = vec!["run", "--stop-timeout", "1", "--kill-grace", "1"];
    args.extend_from_slice(extra);
    let err = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(team.tmp.path().join("lead.stderr"))
        .unwrap();
    let mut cmd = lead(repo, url, &args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let bg = Bg(cmd.stdout(Stdio::null()).stderr(err).spawn().unwrap());
    wait_until(T, "the supervisor to hold lead.lock", || {
        troupe::fsutil::HeldLock::is_held(&team.dir.lead_lock())
            .unwrap()
            .then_some(())
    });
    bg
}

/// [`wait_until`], but a timeout says what the supervisors logged and the queue's events.
fn wait_for<R>(team: &Team, what: &str, mut f: impl FnMut() -> Option<R>) -> R {
    let deadline = std::time::Instant::now() + T;
    loop {
        if let Some(r) = f() {
            return r;
        }
        if std::time::Instant::now() > deadline {
            let log =
                std::fs::read_to_string(team.tmp.path().join("lead.stderr")).unwrap_or_default();
            let queue: Vec<String> = events(team)
                .iter()
                .filter(|e| {
                    let n = e["event"].as_str().unwrap_or("");
                    n.starts_with("merge") || n == "hook_ran" || n.starts_with("task")
                })
                .map(Value::to_string)
                .collect();
            panic!(
                "timed out waiting for {what}\nlead run said:\n{log}\nevents:\n{}\nentries: {:?}",
                queue.join("\n"),
                entries(team)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tool(id: &str, name: &str, input: Value) -> Reply {
    let block = anthropic_tool_use_block(id, name, &input.to_string());
    Reply::ok(anthropic_message(&block, "tool_use", USAGE))
}

fn bash(id: &str, command: &str) -> Reply {
    tool(id, "bash", json!({ "command": command }))
}

/// The model of member `name` claims `task`, runs `work` (bash), and completes the task.
fn script_task(fake: &FakeLlm, model: &str, task: &str, work: &str) {
    fake.push_for(
        model,
        tool("tu_claim", "task_claim", json!({"task_id": task})),
    );
    fake.push_for(model, bash("tu_work", work));
    fake.push_for(
        model,
        tool(
            "tu_done",
            "task_update",
            json!({"task_id": task, "status": "completed", "result": "done"}),
        ),
    );
    fake.push_for(model, Reply::ok(anthropic_text("done")));
}

/// A shell command that writes `text` to `file` and commits it.
fn commit_cmd(file: &str, text: &str) -> String {
    format!(
        "printf '{text}\\n' > {file} && git add {file} && git commit -q -m 'change {file}' && echo COMMITTED"
    )
}

fn new_task(team: &Team, subject: &str, owner: &str, blocked_by: &[&str]) -> String {
    TaskStore::new(&team.dir)
        .create(NewTask {
            subject: subject.into(),
            description: String::new(),
            blocked_by: blocked_by.iter().map(|s| (*s).to_owned()).collect(),
            owner: Some(owner.into()),
            created_by: "lead".into(),
        })
        .unwrap()
        .id
}

fn set_checks(team: &Team, commands: &[&str]) {
    Roster::new(&team.dir)
        .update(|cfg| {
            cfg.hooks = commands
                .iter()
                .map(|c| Hook {
                    event: HookEvent::MergeCheck,
                    command: (*c).to_owned(),
                    timeout_secs: Some(30),
                    sandbox: true,
                })
                .collect();
            Ok(())
        })
        .unwrap();
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
            "do your task",
            "--model",
            &model,
            "--worktree",
        ],
    );
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

fn entries(team: &Team) -> Vec<MergeEntry> {
    MergeStore::new(&team.dir).list().unwrap()
}

fn task_status(team: &Team, id: &str) -> TaskStatus {
    TaskStore::new(&team.dir).get(id).unwrap().status
}

/// Waits for task `id` to be completed (settled just after its `merge_landed` event).
fn completed(team: &Team, id: &str) -> TaskStatus {
    wait_until(T, "the task completed", || {
        let s = task_status(team, id);
        (s == TaskStatus::Completed).then_some(s)
    })
}

/// The files of `rev`'s tree.
fn files_at(repo: &Path, rev: &str) -> Vec<String> {
    git_ok(repo, &["ls-tree", "--name-only", rev])
        .lines()
        .map(str::to_owned)
        .collect()
}

fn show(repo: &Path, rev_path: &str) -> String {
    git_ok(repo, &["show", rev_path])
}

fn tip(repo: &Path, branch: &str) -> String {
    git_ok(repo, &["rev-parse", &format!("refs/heads/{branch}")])
        .trim()
        .to_owned()
}

/// Acceptance 1: three members change different files; all three land, in queue order, each
/// checked in a tree that holds the ones before it. A task blocked by one of them is released
/// only once that one has landed.
#[test]
fn three_members_land_in_queue_order_each_checked_on_the_ones_before() {
    let (team, repo) = repo_team();
    let main_head = tip(&repo, "main");
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    // The check lists the tree it runs in (its stderr is in the hook_ran event).
    set_checks(&team, &["ls >&2"]);
    let mut tasks = Vec::new();
    for name in ["ann", "bob", "cat"] {
        let id = new_task(&team, &format!("write {name}.txt"), name, &[]);
        script_task(
            &fake,
            &format!("m-{name}"),
            &id,
            &commit_cmd(&format!("{name}.txt"), name),
        );
        tasks.push((name, id));
    }
    let after = new_task(&team, "after ann", "ann", &[&tasks[0].1]);
    for (name, _) in &tasks {
        spawn(&repo, &url, name);
    }
    let _sup = run(&team, &repo, &url, &[]);

    let landed = wait_for(&team, "three landed", || {
        let l = named(&team, "merge_landed");
        (l.len() == 3).then_some(l)
    });
    let queued: Vec<String> = named(&team, "merge_queued")
        .iter()
        .map(|e| e["member"].as_str().unwrap().to_owned())
        .collect();
    let order: Vec<String> = landed
        .iter()
        .map(|e| e["member"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(order, queued, "landed in queue order");
    // Each check ran on a tree holding the files of the ones landed before it.
    let checks: Vec<Value> = named(&team, "hook_ran")
        .into_iter()
        .filter(|e| e["hook"] == "merge_check")
        .collect();
    assert_eq!(checks.len(), 3, "{checks:?}");
    for (i, c) in checks.iter().enumerate() {
        let listed = c["stderr"].as_str().unwrap();
        assert_eq!(c["member"], order[i].as_str(), "{checks:?}");
        for before in &order[..=i] {
            assert!(
                listed.contains(&format!("{before}.txt")),
                "check {i}: {listed}"
            );
        }
        for later in &order[i + 1..] {
            assert!(
                !listed.contains(&format!("{later}.txt")),
                "check {i}: {listed}"
            );
        }
    }
    // The target holds all three, each file as its member wrote it; main did not move.
    let target = tip(&repo, TARGET);
    for (name, id) in &tasks {
        assert!(files_at(&repo, &target).contains(&format!("{name}.txt")));
        assert_eq!(
            show(&repo, &format!("{target}:{name}.txt")),
            format!("{name}\n")
        );
        assert_eq!(completed(&team, id), TaskStatus::Completed);
    }
    assert_eq!(tip(&repo, "main"), main_head);
    assert!(
        entries(&team)
            .iter()
            .all(|e| e.state == MergeState::Landed && e.landed.is_some()),
        "{:?}",
        entries(&team)
    );
    // The task blocked by ann's is claimable once ann's work landed.
    let claimable = |who| {
        TaskStore::new(&team.dir)
            .claimable(Some(who))
            .unwrap()
            .iter()
            .any(|t| t.id == after)
    };
    assert!(claimable("ann"));
    let st: Value = serde_json::from_str(&lead_ok(&repo, &url, &["status", "--json"])).unwrap();
    let ann = st["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "ann")
        .unwrap()
        .clone();
    assert_eq!(ann["merge"]["state"], "landed", "{ann}");
    let top: Value =
        serde_json::from_str(&lead_ok(&repo, &url, &["top", "--once", "--json"])).unwrap();
    for r in top["rows"].as_array().unwrap() {
        assert!(
            r["merge"].as_str().unwrap().starts_with("landed at "),
            "{r}"
        );
    }
}

/// Acceptance 2: two members change the same line. The first lands; the second is sent back
/// naming the file, merges the target, resolves, completes again and lands.
#[test]
fn a_conflict_is_sent_back_resolved_by_its_owner_and_lands() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    let mut tasks = Vec::new();
    for name in ["ann", "bob"] {
        let id = new_task(&team, &format!("{name} rewrites README"), name, &[]);
        let model = format!("m-{name}");
        script_task(&fake, &model, &id, &commit_cmd("README", name));
        tasks.push((name, id));
    }
    for (name, _) in &tasks {
        spawn(&repo, &url, name);
    }
    let _sup = run(&team, &repo, &url, &[]);

    let sent = wait_until(T, "one sent back", || {
        named(&team, "merge_sent_back").into_iter().next()
    });
    let report = sent["report"].as_str().unwrap();
    assert!(report.contains("conflicts in README"), "{report}");
    let second = sent["member"].as_str().unwrap().to_owned();
    let first = if second == "ann" { "bob" } else { "ann" };
    let id = &tasks.iter().find(|(n, _)| *n == second).unwrap().1;
    // What the one sent back does then: merge the target, keep both lines, commit, and
    // complete again. Scripted only now: a member woken earlier (the board changed when the
    // first landed) would otherwise run it before it was sent back, on a tree still being
    // checked. Either one may be woken once more, for which it says nothing.
    let model = format!("m-{second}");
    fake.push_for(
        &model,
        bash(
            "tu_resolve",
            &format!(
                "git merge -q origin/{TARGET} >/dev/null 2>&1; printf 'ann\\nbob\\n' > README && \
                 git add README && git commit -q --no-edit && echo RESOLVED"
            ),
        ),
    );
    fake.push_for(
        &model,
        tool(
            "tu_done2",
            "task_update",
            json!({"task_id": id, "status": "completed", "result": "resolved"}),
        ),
    );
    for m in [second.as_str(), second.as_str(), first] {
        fake.push_for(
            &format!("m-{m}"),
            Reply::ok(anthropic_text("nothing to do")),
        );
    }
    wait_until(T, "both landed", || {
        (named(&team, "merge_landed").len() == 2).then_some(())
    });
    let landed: Vec<String> = named(&team, "merge_landed")
        .iter()
        .map(|e| e["member"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(landed, [first.to_owned(), second.clone()]);
    let target = tip(&repo, TARGET);
    assert_eq!(show(&repo, &format!("{target}:README")), "ann\nbob\n");
    for (_, id) in &tasks {
        assert_eq!(completed(&team, id), TaskStatus::Completed);
    }
    // The one sent back heard why, naming the file.
    let heard = team.transcript(&second).iter().any(|e| {
        matches!(e, troupe::transcript::Entry::Inbox { message, .. }
            if message.content.contains("conflicts in README"))
    });
    assert!(heard, "{second} was told about the conflict");
}

/// Acceptance 3: a failing check sends the task back with its stderr and the target does not
/// move; a check that rewrites the tree's files or its `.git` file changes nothing that lands.
#[test]
fn a_failing_check_sends_back_and_what_checks_write_never_lands() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    // ann's work fails the check; bob's passes it after the check scribbles over the tree.
    set_checks(
        &team,
        &[
            "if [ -f ann.txt ]; then echo 'ann.txt is not allowed here' >&2; exit 1; fi; \
             echo \"git dir: $(git rev-parse --absolute-git-dir 2>&1)\" >&2; echo evil > bob.txt; echo evil > planted.txt; git add -A 2>/dev/null; \
             echo 'gitdir: /nowhere' > .git 2>/dev/null; exit 0",
        ],
    );
    let ann_task = new_task(&team, "ann's file", "ann", &[]);
    script_task(&fake, "m-ann", &ann_task, &commit_cmd("ann.txt", "ann"));
    fake.push_for("m-ann", Reply::ok(anthropic_text("noted")));
    spawn(&repo, &url, "ann");
    let mut sup = run(&team, &repo, &url, &[]);
    let before = wait_until(T, "ann sent back", || {
        named(&team, "merge_sent_back").into_iter().next()
    });
    assert!(
        before["report"]
            .as_str()
            .unwrap()
            .contains("ann.txt is not allowed here"),
        "{before}"
    );
    let target_before = tip(&repo, TARGET);
    assert_eq!(target_before, tip(&repo, "main"), "the target did not move");
    wait_until(T, "ann's task back in progress", || {
        (task_status(&team, &ann_task) == TaskStatus::InProgress).then_some(())
    });
    drop(sup);

    let bob_task = new_task(&team, "bob's file", "bob", &[]);
    script_task(&fake, "m-bob", &bob_task, &commit_cmd("bob.txt", "bob"));
    spawn(&repo, &url, "bob");
    // Unsandboxed, so that the check's writes (the tree's files, its `.git` file) take.
    sup = run(&team, &repo, &url, &["--sandbox", "off"]);
    let landed = wait_until(T, "bob landed", || {
        named(&team, "merge_landed").into_iter().next()
    });
    assert_eq!(landed["member"], "bob");
    let target = tip(&repo, TARGET);
    assert_eq!(show(&repo, &format!("{target}:bob.txt")), "bob\n");
    assert!(!files_at(&repo, &target).contains(&"planted.txt".to_owned()));
    // What landed is the merge of bob's commit onto the old tip, nothing more.
    let parents = git_ok(&repo, &["rev-list", "--parents", "-n", "1", &target]);
    let bob_tip = entries(&team)
        .into_iter()
        .find(|e| e.member == "bob")
        .unwrap()
        .commit;
    assert_eq!(
        parents.split_whitespace().skip(1).collect::<Vec<_>>(),
        [target_before.as_str(), bob_tip.as_str()]
    );
    assert_eq!(completed(&team, &bob_task), TaskStatus::Completed);
    let integration = troupe::merge::git::integration_path(&repo.canonicalize().unwrap());
    assert_eq!(
        std::fs::read_to_string(integration.join(".git")).unwrap(),
        "gitdir: /nowhere\n",
        "the check rewrote the tree's .git file"
    );
    // The next entry: the queue's git never read that file, and the check finds it put right.
    let cat_task = new_task(&team, "cat's file", "cat", &[]);
    script_task(&fake, "m-cat", &cat_task, &commit_cmd("cat.txt", "cat"));
    spawn(&repo, &url, "cat");
    wait_until(T, "cat landed", || {
        (named(&team, "merge_landed").len() == 2).then_some(())
    });
    let target = tip(&repo, TARGET);
    assert_eq!(show(&repo, &format!("{target}:cat.txt")), "cat\n");
    assert_eq!(show(&repo, &format!("{target}:bob.txt")), "bob\n");
    let cat_check = named(&team, "hook_ran")
        .into_iter()
        .rfind(|e| e["hook"] == "merge_check" && e["member"] == "cat")
        .unwrap();
    assert!(
        cat_check["stderr"]
            .as_str()
            .unwrap()
            .contains("/.git/worktrees/"),
        "{cat_check}"
    );
    drop(sup);
}

/// Acceptance 4: `kill -9` of the supervisor during a check. The next `lead run` checks the
/// entry again, and the target moves once.
#[test]
fn a_supervisor_killed_during_a_check_checks_again_and_lands_once() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    set_checks(&team, &["sleep 2; ls >&2"]);
    let task = new_task(&team, "ann's file", "ann", &[]);
    script_task(&fake, "m-ann", &task, &commit_cmd("ann.txt", "ann"));
    spawn(&repo, &url, "ann");
    let sup = run(&team, &repo, &url, &[]);
    wait_until(T, "the check under way", || {
        entries(&team)
            .iter()
            .any(|e| e.state == MergeState::Checking && e.attempts == 1)
            .then_some(())
    });
    drop(sup); // SIGKILL
    let created = tip(&repo, TARGET);
    assert_eq!(entries(&team)[0].state, MergeState::Checking);
    let _sup = run(&team, &repo, &url, &[]);
    wait_for(&team, "landed", || {
        (!named(&team, "merge_landed").is_empty()).then_some(())
    });
    let e = &entries(&team)[0];
    assert_eq!((e.state, e.attempts), (MergeState::Landed, 2), "{e:?}");
    assert_eq!(completed(&team, &task), TaskStatus::Completed);
    let checks = named(&team, "hook_ran")
        .into_iter()
        .filter(|e| e["hook"] == "merge_check")
        .count();
    assert_eq!(
        checks, 1,
        "the killed check left no verdict; the second ran to its end"
    );
    // The target's reflog: made, then moved once.
    let log = git_ok(&repo, &["reflog", "show", "--format=%H %gs", TARGET]);
    assert_eq!(log.lines().count(), 2, "{log}");
    let landed = tip(&repo, TARGET);
    assert_ne!(landed, created);
    assert_eq!(e.landed.as_deref(), Some(landed.as_str()));
    assert_eq!(named(&team, "merge_landed").len(), 1);
}

/// Acceptance 5: the target is `main`, checked out in the main tree with a change of the
/// person's own: the entry waits and nothing in the tree changes; once the person commits,
/// the entry lands and the tree follows.
#[test]
fn a_checked_out_target_waits_for_a_clean_tree_and_the_tree_follows() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    set_checks(&team, &["ls >&2"]);
    let task = new_task(&team, "ann's file", "ann", &[]);
    let after = new_task(&team, "after ann's file", "bob", &[&task]);
    script_task(&fake, "m-ann", &task, &commit_cmd("ann.txt", "ann"));
    spawn(&repo, &url, "ann");
    let claimable = || {
        TaskStore::new(&team.dir)
            .claimable(Some("bob"))
            .unwrap()
            .iter()
            .any(|t| t.id == after)
    };
    // The person's own change, not committed yet.
    std::fs::write(repo.join("README"), "the person's edit\n").unwrap();
    let head = tip(&repo, "main");
    let _sup = run(&team, &repo, &url, &["--target", "main"]);
    let waiting = wait_until(T, "the entry waiting", || {
        entries(&team)
            .into_iter()
            .find(|e| e.state == MergeState::Waiting)
    });
    assert!(
        waiting
            .report
            .as_deref()
            .unwrap_or_default()
            .contains("changes of its own"),
        "{waiting:?}"
    );
    // Nothing in the tree moved: the branch, the person's edit, no new file.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(tip(&repo, "main"), head);
    assert_eq!(
        std::fs::read_to_string(repo.join("README")).unwrap(),
        "the person's edit\n"
    );
    assert!(!repo.join("ann.txt").exists());
    assert_eq!(task_status(&team, &task), TaskStatus::Completing);
    assert!(!claimable(), "what waits on ann's task waits for the land");
    let st = lead_ok(&repo, &url, &["status"]);
    assert!(st.contains("merge queue: waiting for a clean tree"), "{st}");

    // The person commits: the entry is merged onto the new tip, checked, and lands, and the
    // tree follows.
    git_ok(&repo, &["add", "README"]);
    commit(&repo, "the person's edit");
    let person = tip(&repo, "main");
    wait_until(T, "landed", || {
        (!named(&team, "merge_landed").is_empty()).then_some(())
    });
    let now = tip(&repo, "main");
    assert_ne!(now, person);
    assert!(
        git(&repo, &["merge-base", "--is-ancestor", &person, &now])
            .status
            .success()
    );
    assert_eq!(git_ok(&repo, &["rev-parse", "HEAD"]).trim(), now);
    assert_eq!(
        std::fs::read_to_string(repo.join("ann.txt")).unwrap(),
        "ann\n"
    );
    assert_eq!(
        std::fs::read_to_string(repo.join("README")).unwrap(),
        "the person's edit\n"
    );
    let dirty: Vec<String> = git_ok(&repo, &["status", "--porcelain", "--untracked-files=no"])
        .lines()
        .map(str::to_owned)
        .collect();
    assert!(dirty.is_empty(), "{dirty:?}");
    assert_eq!(completed(&team, &task), TaskStatus::Completed);
    assert!(claimable());
}

/// `lead merge` by hand, and a completion with nothing committed: queued, listed, cancelled and
/// retried from the CLI; unknown names and ids refused; a branch queued by hand lands; a task
/// completed with nothing beyond the target goes back with "commit your work".
#[test]
fn lead_merge_by_hand_and_a_completion_without_a_commit() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    fake.push_for("m-ann", Reply::ok(anthropic_text("ready")));
    spawn(&repo, &url, "ann");
    let o = lead(&repo, &url, &["merge", "nobody"]).output().unwrap();
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    // A person commits in ann's worktree, and queues it.
    let wt = team.member("ann").worktree.unwrap().path;
    std::fs::write(wt.join("by-hand.txt"), "by hand\n").unwrap();
    git_ok(&wt, &["add", "by-hand.txt"]);
    commit(&wt, "by hand");
    let q: Value =
        serde_json::from_str(&lead_ok(&repo, &url, &["merge", "ann", "--json"])).unwrap();
    assert_eq!(q["result"], "queued", "{q}");
    let id = q["entry"]["id"].as_str().unwrap().to_owned();
    let again: Value =
        serde_json::from_str(&lead_ok(&repo, &url, &["merge", "ann", "--json"])).unwrap();
    assert_eq!(again["result"], "already queued");
    let list: Value =
        serde_json::from_str(&lead_ok(&repo, &url, &["merge", "--list", "--json"])).unwrap();
    assert_eq!(list.as_array().unwrap().len(), 1, "{list}");
    assert_eq!(list[0]["state"], "queued");
    assert!(lead_ok(&repo, &url, &["merge", "--cancel", &id]).contains("cancelled"));
    let o = lead(&repo, &url, &["merge", "--cancel", &id])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(4), "a closed entry: {o:?}");
    let o = lead(&repo, &url, &["merge", "--retry", "0badc0de"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(3), "{o:?}");
    assert!(lead_ok(&repo, &url, &["merge", "--retry", &id]).contains("queued again"));

    let _sup = run(&team, &repo, &url, &[]);
    wait_until(T, "the hand-queued branch landed", || {
        (!named(&team, "merge_landed").is_empty()).then_some(())
    });
    let target = tip(&repo, TARGET);
    assert_eq!(show(&repo, &format!("{target}:by-hand.txt")), "by hand\n");
    assert!(lead_ok(&repo, &url, &["merge", "--list"]).contains("landed at"));

    // A completion with nothing new on the branch goes back.
    let task = new_task(&team, "forgot to commit", "ann", &[]);
    fake.push_for(
        "m-ann",
        tool("tu_claim", "task_claim", json!({"task_id": task})),
    );
    fake.push_for(
        "m-ann",
        tool(
            "tu_done",
            "task_update",
            json!({"task_id": task, "status": "completed", "result": "done"}),
        ),
    );
    fake.push_for("m-ann", Reply::ok(anthropic_text("done")));
    fake.push_for("m-ann", Reply::ok(anthropic_text("will commit")));
    lead_ok(&repo, &url, &["send", "ann", "do the task"]);
    let sent = wait_until(T, "sent back", || {
        named(&team, "merge_sent_back").into_iter().next()
    });
    assert!(
        sent["report"]
            .as_str()
            .unwrap()
            .contains("commit your work"),
        "{sent}"
    );
    wait_until(T, "the task back in progress", || {
        (task_status(&team, &task) == TaskStatus::InProgress).then_some(())
    });
}

/// A check that gives no verdict (here, its timeout) keeps its entry and stops the queue there,
/// with an event; the entries behind it wait; `lead merge --retry` puts it back.
#[test]
fn a_check_without_a_verdict_stops_the_queue_until_a_retry() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    Roster::new(&team.dir)
        .update(|cfg| {
            cfg.hooks = vec![Hook {
                event: HookEvent::MergeCheck,
                command: "if [ -f ann.txt ] && [ ! -f bob.txt ]; then sleep 30; fi; true".into(),
                timeout_secs: Some(1),
                sandbox: true,
            }];
            Ok(())
        })
        .unwrap();
    let ann = new_task(&team, "ann's file", "ann", &[]);
    script_task(&fake, "m-ann", &ann, &commit_cmd("ann.txt", "ann"));
    spawn(&repo, &url, "ann");
    let _sup = run(&team, &repo, &url, &[]);
    let stopped = wait_until(T, "the queue stopped", || {
        named(&team, "merge_stopped").into_iter().next()
    });
    assert!(
        stopped["why"].as_str().unwrap().contains("timed out"),
        "{stopped}"
    );
    // bob's entry waits behind the stopped one.
    let bob = new_task(&team, "bob's file", "bob", &[]);
    script_task(&fake, "m-bob", &bob, &commit_cmd("bob.txt", "bob"));
    spawn(&repo, &url, "bob");
    wait_until(T, "bob queued", || {
        entries(&team)
            .iter()
            .any(|e| e.member == "bob")
            .then_some(())
    });
    std::thread::sleep(Duration::from_millis(1500));
    assert!(named(&team, "merge_landed").is_empty());
    assert_eq!(task_status(&team, &ann), TaskStatus::Completing);
    let id = entries(&team)
        .into_iter()
        .find(|e| e.member == "ann")
        .unwrap()
        .id;
    assert_eq!(
        MergeStore::new(&team.dir).get(&id).unwrap().state,
        MergeState::Stopped
    );
    // The check is fixed, the entry retried: both land, in order.
    set_checks(&team, &["true"]);
    lead_ok(&repo, &url, &["merge", "--retry", &id]);
    wait_until(T, "both landed", || {
        (named(&team, "merge_landed").len() == 2).then_some(())
    });
    let order: Vec<String> = named(&team, "merge_landed")
        .iter()
        .map(|e| e["member"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(order, ["ann", "bob"]);
    assert_eq!(completed(&team, &ann), TaskStatus::Completed);
    assert_eq!(completed(&team, &bob), TaskStatus::Completed);
}

/// The team file names the target (`target_branch`), `lead up` keeps it in config.json, and a
/// name git would not take is refused before anything is written.
#[test]
fn the_team_file_names_the_target() {
    let (team, repo) = repo_team();
    let file = repo.join("team.toml");
    std::fs::write(&file, "target_branch = \"release/next\"\n").unwrap();
    lead_ok(
        &repo,
        "http://127.0.0.1:9",
        &["up", "team.toml", "--accept"],
    );
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert_eq!(cfg.target_branch.as_deref(), Some("release/next"));
    std::fs::write(&file, "target_branch = \"a..b\"\n").unwrap();
    let o = lead(
        &repo,
        "http://127.0.0.1:9",
        &["up", "team.toml", "--accept"],
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("target_branch"));
    let cfg = Roster::new(&team.dir).load().unwrap();
    assert_eq!(cfg.target_branch.as_deref(), Some("release/next"));
    let o = lead(&repo, "http://127.0.0.1:9", &["run", "--target=a..b"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{o:?}");
}

/// The entry of `member` sent back, once it is: its report.
fn sent_back_report(team: &Team, member: &str) -> String {
    wait_for(team, &format!("{member}'s entry sent back"), || {
        named(team, "merge_sent_back")
            .into_iter()
            .find(|e| e["member"] == member)
            .map(|e| e["report"].as_str().unwrap_or_default().to_owned())
    })
}

/// Issue 41, R4-1 (review 4's `merge_lands_into_team_dir.sh` and `merge_deletes_team_dir.sh`):
/// after a member's innocent commit that ignores `.team/` has landed, commits that write
/// `.team/config.json` (a `"sandbox": false` hook), a file named `.team`, or the `.env` the
/// person ignores are each sent back naming the path, and the team dir and `.env` stay as they
/// were. `target_main`: the target is `main`, checked out in the person's tree; else
/// `troupe/integration`, checked out nowhere (what lands there is what the person merges).
fn nothing_lands_over_the_persons_files(target_main: bool) {
    let (team, repo) = repo_team();
    let target = if target_main { "main" } else { TARGET };
    // The person's secret, which they ignore.
    std::fs::write(repo.join(".git/info/exclude"), ".env\n").unwrap();
    std::fs::write(repo.join(".env"), "SECRET=the person's\n").unwrap();
    let owned = team.tmp.path().join("OWNED");
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    let ann = new_task(&team, "tidy the ignore file", "ann", &[]);
    script_task(
        &fake,
        "m-ann",
        &ann,
        "printf '.team/\\n' >> .gitignore && git add .gitignore && git commit -q -m 'ignore the team dir' && echo COMMITTED",
    );
    spawn(&repo, &url, "ann");
    let extra: &[&str] = if target_main {
        &["--target", "main"]
    } else {
        &[]
    };
    let _sup = run(&team, &repo, &url, extra);
    wait_for(&team, "ann's .gitignore landed", || {
        (task_status(&team, &ann) == TaskStatus::Completed).then_some(())
    });
    assert_eq!(
        show(&repo, &format!("{}:.gitignore", tip(&repo, target))),
        ".team/\n"
    );
    let landed = tip(&repo, target);
    let head = tip(&repo, "main");

    let evil = format!(
        r#"{{"team_name":"default","members":[],"hooks":[{{"event":"teammate_idle","sandbox":false,"command":"touch {}"}}]}}"#,
        owned.display()
    );
    let work = [
        (
            "bob",
            format!(
                "mkdir -p .team && printf '%s\\n' '{evil}' > .team/config.json && git add -f .team/config.json && git commit -q -m 'add team notes' && echo COMMITTED"
            ),
            ".team/config.json",
        ),
        (
            "cat",
            "printf 'notes\\n' > .team && git add -f .team && git commit -q -m 'add team notes' && echo COMMITTED".to_owned(),
            ".team",
        ),
        (
            "dan",
            "printf 'SECRET=mine\\n' > .env && git add -f .env && git commit -q -m 'add env' && echo COMMITTED".to_owned(),
            ".env",
        ),
    ];
    for (name, cmd, _) in &work {
        let id = new_task(&team, &format!("{name}'s notes"), name, &[]);
        let model = format!("m-{name}");
        script_task(&fake, &model, &id, cmd);
        fake.push_for(&model, Reply::ok(anthropic_text("noted")));
        spawn(&repo, &url, name);
    }
    for (name, _, path) in &work {
        let report = sent_back_report(&team, name);
        assert!(
            report.contains(&format!("\"{path}\"")),
            "{name}'s report names {path}: {report}"
        );
    }
    // Nothing moved, nothing in the person's tree changed.
    assert_eq!(tip(&repo, target), landed);
    assert_eq!(tip(&repo, "main"), head);
    assert!(named(&team, "merge_landed").len() == 1, "only ann's landed");
    let cfg = std::fs::read_to_string(repo.join(".team/config.json")).unwrap();
    assert!(!cfg.contains("OWNED"), "{cfg}");
    assert!(repo.join(".team").is_dir());
    for f in ["transcripts/ann.jsonl", "members/ann.json", "lead.lock"] {
        assert!(repo.join(".team").join(f).exists(), "{f} is still there");
    }
    assert_eq!(
        std::fs::read_to_string(repo.join(".env")).unwrap(),
        "SECRET=the person's\n"
    );
    assert!(!owned.exists(), "no hook of a member's ran");
}

#[test]
fn a_land_on_a_checked_out_target_never_writes_the_team_dir_or_ignored_files() {
    nothing_lands_over_the_persons_files(true);
}

#[test]
fn a_land_on_troupe_integration_never_carries_the_team_dir_or_ignored_files() {
    nothing_lands_over_the_persons_files(false);
}

/// Issue 41, m9 and m10: the person's global git config defines a filter and a merge driver
/// that a member's `.gitattributes` names; the queue's git (the integration tree's merge, the
/// fast-forward of the person's tree) runs neither. The check's build cache lies outside the
/// tree and is gone once the entry is done.
#[test]
fn the_queue_runs_no_filter_of_the_persons_and_checks_build_apart() {
    use std::os::unix::fs::PermissionsExt;
    let (team, repo) = repo_team();
    let home = team.tmp.path().join("home");
    let marks = team.tmp.path().join("marks");
    for (d, mode) in [(&home, 0o755), (&marks, 0o777)] {
        std::fs::create_dir_all(d).unwrap();
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(mode)).unwrap();
    }
    let ran = marks.join("ran");
    let script = home.join("evil.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\necho \"$1 $(pwd)\" >> {}\n[ \"$1\" = merge ] && exit 0\ncat\n",
            ran.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let s = script.display();
    std::fs::write(
        home.join(".gitconfig"),
        format!(
            "[filter \"evil\"]\n\tclean = {s} clean\n\tsmudge = {s} smudge\n\
             [merge \"evil\"]\n\tdriver = {s} merge\n"
        ),
    )
    .unwrap();
    set_checks(
        &team,
        &["echo \"cache=$CARGO_TARGET_DIR\" >&2; touch \"$CARGO_TARGET_DIR/built\""],
    );
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    let task = new_task(&team, "attributes", "ann", &[]);
    script_task(
        &fake,
        "m-ann",
        &task,
        "printf '* filter=evil merge=evil\\n' > .gitattributes && printf 'x\\n' > x.txt && git add .gitattributes x.txt && git commit -q -m attributes && echo COMMITTED",
    );
    spawn(&repo, &url, "ann");
    let _sup = run_with(
        &team,
        &repo,
        &url,
        &["--target", "main"],
        &[("HOME", home.as_path())],
    );
    wait_for(&team, "ann's entry landed", || {
        (!named(&team, "merge_landed").is_empty()).then_some(())
    });
    assert_eq!(std::fs::read_to_string(repo.join("x.txt")).unwrap(), "x\n");
    let repo = repo.canonicalize().unwrap();
    let integration = troupe::merge::git::integration_path(&repo);
    let lines = std::fs::read_to_string(&ran).unwrap_or_default();
    for l in lines.lines() {
        let dir = Path::new(l.split_once(' ').map_or("", |x| x.1));
        assert!(
            dir != repo && dir != integration,
            "the person's filter ran in the queue's git: {lines}"
        );
    }
    // The filter is real: the person's own git in their tree runs it.
    std::fs::remove_file(repo.join("x.txt")).unwrap();
    let o = Command::new("git")
        .arg("-C")
        .arg(&repo)
        .args(["checkout", "--", "x.txt"])
        .env("HOME", &home)
        .output()
        .unwrap();
    assert!(o.status.success(), "{o:?}");
    let lines = std::fs::read_to_string(&ran).unwrap_or_default();
    assert!(
        lines.contains(&format!("smudge {}", repo.display())),
        "{lines}"
    );
    // The check's cache: outside the tree, and removed after the entry.
    let check = named(&team, "hook_ran")
        .into_iter()
        .find(|e| e["hook"] == "merge_check")
        .unwrap();
    let stderr = check["stderr"].as_str().unwrap();
    assert_eq!(check["code"], 0, "{check}");
    let cache = PathBuf::from(stderr.trim().strip_prefix("cache=").unwrap());
    assert!(!cache.starts_with(&integration), "{stderr}");
    assert!(!cache.starts_with(&repo), "{stderr}");
    wait_until(T, "the cache removed", || (!cache.exists()).then_some(()));
}

/// Issue 42, R4-10 (review 4's `merge_queue_stalled_by_member_checkout.sh`): a worktree member
/// checks the target out in its own worktree and leaves a change there. That tree is not the
/// person's: another member's entry still lands (by compare-and-swap of the ref).
#[test]
fn a_member_checking_out_the_target_does_not_stall_the_queue() {
    let (team, repo) = repo_team();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    fake.push_for(
        "m-alice",
        bash(
            "tu_co",
            &format!(
                "git checkout -q origin/{TARGET}; echo 'not committed' >> README && git status --short && git branch --show-current"
            ),
        ),
    );
    for _ in 0..3 {
        fake.push_for("m-alice", Reply::ok(anthropic_text("ok")));
    }
    spawn(&repo, &url, "alice");
    let _sup = run(&team, &repo, &url, &[]);
    wait_for(&team, "alice's command ran", || {
        (fake.requests_for("m-alice") >= 2).then_some(())
    });
    let before = tip(&repo, TARGET);
    let task = new_task(&team, "bob's feature", "bob", &[]);
    script_task(&fake, "m-bob", &task, &commit_cmd("feature.txt", "feature"));
    spawn(&repo, &url, "bob");
    wait_for(&team, "bob's entry landed", || {
        (task_status(&team, &task) == TaskStatus::Completed).then_some(())
    });
    let now = tip(&repo, TARGET);
    assert_ne!(now, before);
    assert_eq!(show(&repo, &format!("{now}:feature.txt")), "feature\n");
    // Alice's change is left as it was.
    let wt = team.member("alice").worktree.unwrap().path;
    assert!(
        std::fs::read_to_string(wt.join("README"))
            .unwrap()
            .contains("not committed")
    );
}
