//! The merge queue's thread (see [`troupe::merge`]): takes the open entries of this host's
//! members in order, one at a time, and lands each on the team's target branch once it merges
//! cleanly and the `merge_check` hooks pass in the integration tree.
//!
//! For an entry: the integration tree is reset to the target's tip and the entry's commit is
//! merged onto it (`--no-ff`); the merge commit is recorded in the entry (`checking`) before
//! any check runs, and that commit is what lands, by compare-and-swap of the target ref from
//! the tip it was merged onto. A conflict, a failed check or a commit with nothing beyond the
//! target sends the entry back (its task to its owner, `in_progress`, or `pending` if the owner
//! has ended); a check that gives no verdict (a timeout, a signal, a spawn error) stops the
//! queue on that entry until `lead merge --retry`. A target checked out in a tree of the
//! person's moves only with that tree, by fast-forward when it is clean; otherwise the entry
//! waits. A tree troupe made (a member's worktree, which a member may have put on the target)
//! is not the person's: the ref moves by compare-and-swap, as when the target is checked out
//! nowhere, and the member is told.
//!
//! Whatever the target, a candidate that would write into the team dir, or create over,
//! overwrite or delete an untracked or ignored path of the person's tree, is sent back naming
//! the paths (see [`troupe::merge::contain`]): before its checks run, and again just before
//! the land.
//!
//! Nothing is kept in memory: a supervisor killed during a check finds the entry `checking` at
//! its next start and checks it again (a land it had made already is recognised: the target
//! holds the recorded merge commit), so the target moves at most once per entry.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use serde_json::json;
use troupe::TeamDir;
use troupe::config::{MemberStatus, Roster, TeamConfig};
use troupe::hooks::HookEvent;
use troupe::merge::contain::{self, PersonsTree};
use troupe::merge::git::{self as mgit, Integration, Merged};
use troupe::merge::{MergeEntry, MergeState, MergeStore};
use troupe::sandbox::{Sandbox, Settings as SandboxSettings};
use troupe::store::Watched;
use troupe::tasks::{TaskStatus, TaskStore};

/// The most of a check's stderr a report keeps (its tail).
const REPORT_TAIL: usize = 4000;

/// The running merge thread.
pub struct MergeQueue {
    thread: super::stoppable::Stoppable,
}

impl MergeQueue {
    /// Starts the thread for `team`. `host`: on a bus, this supervisor's (it integrates the
    /// entries of its own members: branches are host-local). `target`: `lead run --target`.
    pub fn start(
        team: TeamDir,
        host: Option<String>,
        sandbox: SandboxSettings,
        target: Option<String>,
    ) -> anyhow::Result<MergeQueue> {
        ensure_targets(&team, host.as_deref(), target.as_deref());
        let thread = super::stoppable::Stoppable::start("merge", move |stop, wake| {
            let q = Queue {
                store: MergeStore::new(&team),
                tasks: TaskStore::new(&team),
                team,
                host,
                sandbox,
                target,
                stop,
                sandboxes: Default::default(),
                followed: Default::default(),
            };
            q.run(&wake);
        })?;
        Ok(MergeQueue { thread })
    }

    /// Stops the thread: a check running now is killed, and its entry stays `checking`.
    pub fn stop(self) {
        self.thread.stop();
    }
}

struct Queue {
    team: TeamDir,
    store: MergeStore,
    tasks: TaskStore,
    host: Option<String>,
    sandbox: SandboxSettings,
    target: Option<String>,
    stop: Arc<AtomicBool>,
    /// The checks' sandboxes, by integration tree.
    sandboxes: std::sync::Mutex<Vec<(std::path::PathBuf, Arc<Sandbox>)>>,
    /// The store tip of each idle member last taken into the repository (or refused).
    followed: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

/// What the queue does after an entry.
enum After {
    /// Go on with the next entry.
    Next,
    /// Wait (for a clean tree, a retry, the next start): the entries behind it wait too.
    Hold,
}

/// Where the target is checked out.
enum Checkout {
    /// Nowhere.
    Nowhere,
    /// In a tree of the person's (the main tree, or a linked worktree troupe did not make).
    Persons(PathBuf),
    /// In a tree troupe made: member `member`'s worktree (`None`: not a member's, such as the
    /// integration tree or a left-over dir under `<repo>.troupe/`).
    Troupes {
        tree: PathBuf,
        member: Option<String>,
    },
}

/// The path `p` made canonical where it can be, else as it is.
fn canonical(p: &Path) -> PathBuf {
    p.canonicalize().unwrap_or_else(|_| p.to_path_buf())
}

/// Whether the tree at `tree` is one troupe made in the repository at `repo`, and whose: under
/// `<repo>.troupe/`, or the worktree the roster records for a member (in whatever layout).
fn troupes_tree(cfg: &TeamConfig, repo: &Path, tree: &Path) -> Option<Option<String>> {
    let tree = canonical(tree);
    let member = cfg.members.iter().find_map(|m| {
        let wt = m.worktree.as_ref()?;
        (canonical(&wt.path) == tree).then(|| m.name.clone())
    });
    if member.is_some() {
        return Some(member);
    }
    let kept = troupe::worktree::path_for(repo, "x");
    let kept = kept.parent().map(canonical)?;
    tree.starts_with(&kept).then_some(None)
}

/// A check's verdict.
enum Verdict {
    Passed,
    Failed(String),
    Undecided(String),
}

impl Queue {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn run(&self, wake: &std::os::unix::net::UnixStream) {
        let watch = self.team.store().watch(&[Watched::Tasks]).ok();
        while !self.stopped() {
            if let Err(e) = self.pass() {
                tracing::warn!("merge queue: {e:#}");
            }
            let mut fds = vec![PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
            if let Some(w) = &watch {
                fds.push(PollFd::new(w.fd(), PollFlags::POLLIN));
            }
            // `lead merge` writes no task: it is seen within the second.
            let _ = poll(&mut fds, PollTimeout::from(1000u16));
            drop(fds);
            if let Some(w) = &watch {
                let _ = w.changed();
            }
        }
    }

    /// The open entries of this host's members, in order, each until one holds the queue.
    fn pass(&self) -> anyhow::Result<()> {
        self.follow_idle_branches();
        let open = troupe::merge::open_in_order(self.store.list()?);
        if open.is_empty() {
            return Ok(());
        }
        let Ok(cfg) = Roster::new(&self.team).load() else {
            return Ok(());
        };
        for e in open {
            if self.stopped() {
                return Ok(());
            }
            if self.host.is_some() && e.host != self.host {
                continue;
            }
            if e.state == MergeState::Stopped {
                return Ok(());
            }
            match self.step(&cfg, e)? {
                After::Next => {}
                After::Hold => return Ok(()),
            }
        }
        Ok(())
    }

    fn target(&self, cfg: &TeamConfig) -> String {
        self.target
            .clone()
            .or_else(|| cfg.target_branch.clone())
            .unwrap_or_else(|| troupe::merge::DEFAULT_TARGET.to_owned())
    }

    fn step(&self, cfg: &TeamConfig, e: MergeEntry) -> anyhow::Result<After> {
        // A task that moved on (reopened, cancelled, completed again) is not this entry's to
        // settle any more.
        if let (Some(task), Some(completion)) = (&e.task, e.completion) {
            let t = self.tasks.get(task)?;
            if t.status != TaskStatus::Completing || t.completion != completion {
                self.close(
                    &e,
                    MergeState::Cancelled,
                    format!("task {task} is {} now", t.status),
                )?;
                return Ok(After::Next);
            }
        }
        let Some(wt) = cfg.member(&e.member).and_then(|m| m.worktree.clone()) else {
            self.send_back(cfg, &e, format!("{} has no worktree", e.member))?;
            return Ok(After::Next);
        };
        let repo = wt.repo.clone();
        // A repository that failed `git fsck` when its worktrees moved to their own stores is
        // landed on only once it passes again.
        if let Some(why) = troupe::worktree::fsck_hold(&repo) {
            self.store.update(&e.id, |x| {
                let new = x.report.as_deref() != Some(why.as_str());
                x.report = Some(why.clone());
                new
            })?;
            return Ok(After::Hold);
        }
        let target = self.target(cfg);
        let tip = mgit::ensure_target(&repo, &target)?;

        // Checked (or landed) by an earlier run: a land made just before a crash is not made
        // again; a checked merge still on the tip lands without checking again.
        if matches!(e.state, MergeState::Checking | MergeState::Waiting)
            && let Some(candidate) = &e.candidate
        {
            if mgit::is_ancestor(&repo, candidate, &tip)? {
                self.landed(cfg, &e, &repo, &tip)?;
                return Ok(After::Next);
            }
            if e.state == MergeState::Waiting && e.base.as_deref() == Some(tip.as_str()) {
                return self.land(cfg, &e, &repo, &target, &tip, candidate);
            }
        }

        if wt.branch != e.branch {
            self.send_back(cfg, &e, format!("{} works on {} now", e.member, wt.branch))?;
            return Ok(After::Next);
        }
        if troupe::worktree::is_dirty(&wt) == Some(true) && e.task.is_some() {
            self.send_back(
                cfg,
                &e,
                format!(
                    "your worktree {} has uncommitted changes: commit your work, then complete \
                     the task again",
                    wt.path.display()
                ),
            )?;
            return Ok(After::Next);
        }
        let commit_known =
            !e.commit.is_empty() && mgit::is_ancestor(&repo, &e.commit, &e.commit).unwrap_or(false);
        if !commit_known || mgit::is_ancestor(&repo, &e.commit, &tip)? {
            self.send_back(
                cfg,
                &e,
                format!(
                    "{} has no commit beyond {target}: commit your work, then complete the task \
                     again",
                    e.branch
                ),
            )?;
            return Ok(After::Next);
        }

        let tree = Integration::ensure(&repo, &tip)?;
        tree.reset(&tip)?;
        let message = match &e.task {
            Some(t) => format!("Merge {} into {target} (task {t})", e.branch),
            None => format!("Merge {} into {target}", e.branch),
        };
        let candidate = match tree.merge(&e.commit, &message)? {
            Merged::Clean(c) => c,
            Merged::Conflict(files) => {
                self.send_back(
                    cfg,
                    &e,
                    format!(
                        "{} does not merge cleanly into {target}: conflicts in {}. Merge {target} \
                         into your branch (git merge origin/{target}), resolve, commit, and complete the \
                         task again",
                        e.branch,
                        files.join(", ")
                    ),
                )?;
                return Ok(After::Next);
            }
        };
        // Refused before the checks spend their time on it.
        if let Some(why) = self.refusal(cfg, &e, &repo, &target, &tip, &candidate)? {
            self.send_back(cfg, &e, why)?;
            return Ok(After::Next);
        }
        let (now, moved) = self
            .store
            .update_checking(&e.id, &target, &tip, &candidate)?;
        if !moved {
            // Cancelled meanwhile.
            return Ok(if now.state.is_open() {
                After::Hold
            } else {
                After::Next
            });
        }
        let verdict = match self.check(cfg, &now, &tree) {
            Some(v) => v,
            // Stopped: the entry stays `checking`, for the next start.
            None => return Ok(After::Hold),
        };
        let (passed, tail) = match &verdict {
            Verdict::Passed => (Some(true), None),
            Verdict::Failed(t) => (Some(false), Some(t.clone())),
            Verdict::Undecided(t) => (None, Some(t.clone())),
        };
        self.store.log(
            "merge_checked",
            &now,
            json!({"passed": passed, "candidate": candidate, "base": tip, "target": target,
                   "stderr": tail}),
        );
        match verdict {
            Verdict::Passed => {
                let now = self.store.get(&e.id)?;
                if now.state != MergeState::Checking {
                    return Ok(After::Next);
                }
                self.land(cfg, &now, &repo, &target, &tip, &candidate)
            }
            Verdict::Failed(stderr) => {
                self.send_back(
                    cfg,
                    &now,
                    format!(
                        "a merge_check failed on {} merged into {target}; nothing landed. It \
                         said:\n{stderr}",
                        e.branch
                    ),
                )?;
                Ok(After::Next)
            }
            Verdict::Undecided(why) => {
                let (s, moved) = self.store.set_state(
                    &e.id,
                    &[MergeState::Checking],
                    MergeState::Stopped,
                    Some(why.clone()),
                )?;
                if moved {
                    self.store.log("merge_stopped", &s, json!({"why": why}));
                }
                Ok(After::Hold)
            }
        }
    }

    /// Lands `candidate` (checked, merged onto `base`) on `target`.
    fn land(
        &self,
        cfg: &TeamConfig,
        e: &MergeEntry,
        repo: &Path,
        target: &str,
        base: &str,
        candidate: &str,
    ) -> anyhow::Result<After> {
        // The person's tree may have gained files since the checks began.
        if let Some(why) = self.refusal(cfg, e, repo, target, base, candidate)? {
            self.send_back(cfg, e, why)?;
            return Ok(After::Next);
        }
        let checkout = self.checkout(cfg, repo, target)?;
        if let Checkout::Persons(tree) = &checkout {
            // A checked-out branch moves only with its tree, and only over a clean one.
            if mgit::tree_is_dirty(tree)? {
                let (s, moved) = self.store.set_state(
                    &e.id,
                    &[MergeState::Checking, MergeState::Waiting],
                    MergeState::Waiting,
                    Some(format!(
                        "{target} is checked out in {}, which has changes of its own: the \
                         merge lands once they are committed or put away",
                        tree.display()
                    )),
                )?;
                if moved && e.state != MergeState::Waiting {
                    self.store
                        .log("merge_waiting", &s, json!({"tree": tree, "target": target}));
                }
                return Ok(After::Hold);
            }
            if let Err(why) = mgit::fast_forward_tree(tree, candidate)? {
                if mgit::branch_tip(repo, target)?.as_deref() != Some(base) {
                    // The tree's branch moved meanwhile (a person's commit): merge again.
                    self.requeue(e)?;
                    return Ok(After::Next);
                }
                // Untracked files the merge would overwrite, say: it waits for the person.
                self.store.set_state(
                    &e.id,
                    &[MergeState::Checking, MergeState::Waiting],
                    MergeState::Waiting,
                    Some(format!(
                        "{target} is checked out in {}, and moving it there failed: {why}",
                        tree.display()
                    )),
                )?;
                return Ok(After::Hold);
            }
        } else {
            match mgit::compare_and_swap(repo, target, candidate, base)? {
                Ok(true) => {
                    if let Checkout::Troupes {
                        tree,
                        member: Some(member),
                    } = &checkout
                    {
                        self.tell_checked_out(cfg, e, member, tree, target);
                    }
                }
                Ok(false) => {
                    self.requeue(e)?;
                    return Ok(After::Next);
                }
                Err(why) => {
                    // Its lock is held: checked already, it lands at a next pass.
                    self.store.set_state(
                        &e.id,
                        &[MergeState::Checking, MergeState::Waiting],
                        MergeState::Waiting,
                        Some(format!("{target} could not be moved: {why}")),
                    )?;
                    return Ok(After::Hold);
                }
            }
        }
        self.landed(cfg, e, repo, candidate)?;
        Ok(After::Next)
    }

    /// Where `target` is checked out, and whose tree that is.
    fn checkout(&self, cfg: &TeamConfig, repo: &Path, target: &str) -> anyhow::Result<Checkout> {
        let Some(tree) = mgit::checked_out_at(repo, target)? else {
            return Ok(Checkout::Nowhere);
        };
        Ok(match troupes_tree(cfg, repo, &tree) {
            Some(member) => Checkout::Troupes { tree, member },
            None => Checkout::Persons(tree),
        })
    }

    /// Why `candidate` (merged onto `base` of `target`) may not land, if it may not: the paths
    /// it changes that meet the team dir or an untracked or ignored path of the person's main
    /// tree, or of the person's tree where the target is checked out if that is another.
    fn refusal(
        &self,
        cfg: &TeamConfig,
        e: &MergeEntry,
        repo: &Path,
        target: &str,
        base: &str,
        candidate: &str,
    ) -> anyhow::Result<Option<String>> {
        let changed = mgit::changed_paths(repo, base, candidate)?;
        if changed.is_empty() {
            return Ok(None);
        }
        let mut tops = vec![repo.to_path_buf()];
        if let Checkout::Persons(t) = self.checkout(cfg, repo, target)?
            && canonical(&t) != canonical(repo)
        {
            tops.push(t);
        }
        let team = canonical(self.team.root());
        let mut trees = Vec::new();
        for top in tops {
            let team_dir = team
                .strip_prefix(canonical(&top))
                .ok()
                .map(Path::to_path_buf);
            let untracked = mgit::untracked_paths(&top)?;
            trees.push(PersonsTree {
                top,
                team_dir,
                untracked,
            });
        }
        let clashes = contain::clashes(&changed, &trees);
        if clashes.is_empty() {
            return Ok(None);
        }
        Ok(Some(format!(
            "{} merged into {target} would write paths a land may not touch, {}; nothing \
             landed. Those are the team's and the person's, never a member's to change: take \
             them out of your branch (git rm -r --cached PATH, then commit), and complete the \
             task again",
            e.branch,
            contain::describe(&clashes)
        )))
    }

    /// Tells `member`, whose worktree at `tree` has `target` checked out, that the target moved
    /// under it.
    fn tell_checked_out(
        &self,
        cfg: &TeamConfig,
        e: &MergeEntry,
        member: &str,
        tree: &Path,
        target: &str,
    ) {
        if cfg
            .member(member)
            .is_none_or(|m| m.status.is_terminal() || m.host != self.host)
        {
            return;
        }
        let own = cfg
            .member(member)
            .and_then(|m| m.worktree.as_ref())
            .map_or_else(|| troupe::worktree::branch_of(member), |w| w.branch.clone());
        super::hooks::tell(
            &self.team,
            member,
            &format!("merge:checked_out:{}:{}", e.id, e.attempts),
            format!(
                "The merge queue landed {} on {target}, which your worktree {} has checked out: \
                 your files and index are now behind it. Work on your own branch: git checkout \
                 {own}",
                e.branch,
                tree.display()
            ),
        );
    }

    /// Back to `queued` (the target moved between the merge and the land).
    fn requeue(&self, e: &MergeEntry) -> anyhow::Result<()> {
        self.store.set_state(
            &e.id,
            &[MergeState::Checking, MergeState::Waiting],
            MergeState::Queued,
            Some("the target moved before the land: merged and checked again".to_owned()),
        )?;
        Ok(())
    }

    /// The entry's merge is on the target (`tip`): recorded, its task completed, and idle
    /// members' clean worktrees brought up to the target.
    fn landed(
        &self,
        cfg: &TeamConfig,
        e: &MergeEntry,
        repo: &Path,
        tip: &str,
    ) -> anyhow::Result<()> {
        let mut moved = false;
        let now = self.store.update(&e.id, |x| {
            if !x.state.is_open() {
                return false;
            }
            x.state = MergeState::Landed;
            x.landed = Some(tip.to_owned());
            x.report = None;
            moved = true;
            true
        })?;
        if !moved {
            return Ok(());
        }
        self.store.log("merge_landed", &now, json!({"landed": tip}));
        if let (Some(task), Some(completion)) = (&e.task, e.completion) {
            let settled =
                self.tasks
                    .settle_completion(task, completion, true, |_| false, |_| ())?;
            if settled.is_some() {
                troupe::tasks::wake_claimers(&self.team, None);
            }
        }
        // Idle members' clean worktrees follow the target, so that their next change does not
        // conflict with their last one.
        for m in &cfg.members {
            let Some(wt) = &m.worktree else { continue };
            if wt.repo != repo || m.status != MemberStatus::Idle {
                continue;
            }
            if self.host.is_some() && m.host != self.host {
                continue;
            }
            match mgit::fast_forward_member(wt, tip) {
                Ok(true) => troupe::events::log(
                    &self.team,
                    "worktree_fast_forwarded",
                    json!({"member": m.name, "branch": wt.branch, "to": tip}),
                ),
                Ok(false) => {}
                Err(err) => tracing::warn!("merge queue: {}'s worktree: {err}", m.name),
            }
        }
        Ok(())
    }

    /// Takes each idle worktree member's branch from its store into the repository's
    /// `troupe/NAME` (the same checked fetch as the queue's, see
    /// [`troupe::worktree::take_branch`]) when its tip moved since the last look, so that the
    /// person's `git log troupe/NAME` shows the work a member has committed and stopped at. A
    /// tip that cannot be taken (a rewritten object) is tried once, with a warning.
    fn follow_idle_branches(&self) {
        let Ok(cfg) = Roster::new(&self.team).load() else {
            return;
        };
        let mut followed = self.followed.lock().unwrap_or_else(|p| p.into_inner());
        for m in &cfg.members {
            let Some(wt) = &m.worktree else { continue };
            if m.status != MemberStatus::Idle || (self.host.is_some() && m.host != self.host) {
                continue;
            }
            let Some(tip) = troupe::worktree::tip_in_store(wt) else {
                continue;
            };
            if followed.get(&m.name) == Some(&tip) {
                continue;
            }
            if mgit::branch_tip(&wt.repo, &wt.branch)
                .ok()
                .flatten()
                .as_deref()
                != Some(&tip)
                && let Err(err) = troupe::worktree::take_branch(wt)
            {
                tracing::warn!("{}'s branch not taken into the repository: {err}", m.name);
            }
            followed.insert(m.name.clone(), tip);
        }
    }

    /// The repository's branches copied into every store of this host's worktree members, as
    /// `origin/NAME` (see [`troupe::worktree::offer_branches`]).
    fn offer_branches(&self, cfg: &TeamConfig) {
        for m in &cfg.members {
            let Some(wt) = &m.worktree else { continue };
            if self.host.is_some() && m.host != self.host {
                continue;
            }
            if let Err(err) = troupe::worktree::offer_branches(wt) {
                tracing::warn!("merge queue: {}'s store: {err}", m.name);
            }
        }
    }

    /// Closes entry `e` as `state` with `report` (no message to anyone).
    fn close(&self, e: &MergeEntry, state: MergeState, report: String) -> anyhow::Result<()> {
        let open = [
            MergeState::Queued,
            MergeState::Checking,
            MergeState::Waiting,
            MergeState::Stopped,
        ];
        let (s, moved) = self.store.set_state(&e.id, &open, state, Some(report))?;
        if moved {
            self.store.log(
                if state == MergeState::SentBack {
                    "merge_sent_back"
                } else {
                    "merge_cancelled"
                },
                &s,
                json!({"report": s.report}),
            );
        }
        Ok(())
    }

    /// Sends entry `e` back with `report`: its task back to its owner (`in_progress`), or to
    /// the board (`pending`) if the owner has ended; a hand-queued entry's member is told.
    fn send_back(&self, cfg: &TeamConfig, e: &MergeEntry, report: String) -> anyhow::Result<()> {
        self.close(e, MergeState::SentBack, report.clone())?;
        // Whoever is told to merge the target or this branch finds them in its store.
        self.offer_branches(cfg);
        let key = format!("merge:sent_back:{}:{}", e.id, e.attempts);
        let (Some(task), Some(completion)) = (&e.task, e.completion) else {
            if cfg
                .member(&e.member)
                .is_some_and(|m| !m.status.is_terminal())
            {
                super::hooks::tell(
                    &self.team,
                    &e.member,
                    &key,
                    format!("The merge queue sent back {}: {report}", e.branch),
                );
            }
            return Ok(());
        };
        let t = self.tasks.get(task)?;
        if t.completion != completion {
            return Ok(());
        }
        super::hooks::send_task_back(
            &self.team,
            &self.tasks,
            &t,
            &key,
            |next| {
                format!(
                    "The merge queue sent task {} ({}) back to you: it is in_progress and yours \
                     again. {report}",
                    next.id, next.subject
                )
            },
            |task, _| {
                format!(
                    "The merge queue sent task {} ({}) back, but {} has ended: it is pending for \
                     anyone, and its work so far is on {} (whoever claims it can merge that \
                     branch first). {report}",
                    task.id, task.subject, e.member, e.branch
                )
            },
            // For whoever claims it next: where the work so far is.
            Some(format!(
                "sent back by the merge queue after {} ended; its work so far is on branch {}: \
                 merge that branch into yours first (git merge origin/{}). {report}",
                e.member, e.branch, e.branch
            )),
        )
    }

    /// Runs the `merge_check` hooks in the integration tree, in order, until one fails;
    /// `None` when stopped meanwhile.
    fn check(&self, cfg: &TeamConfig, e: &MergeEntry, tree: &Integration) -> Option<Verdict> {
        let hooks: Vec<_> = cfg
            .hooks
            .iter()
            .filter(|h| h.event == HookEvent::MergeCheck)
            .collect();
        if hooks.is_empty() {
            return Some(Verdict::Passed);
        }
        let target_dir = tree.check_target_dir();
        let _cache = CheckCache::start(target_dir.clone(), cfg.shared_check_cache == Some(true));
        // The tree and the cache beside it are the only places the checks may write.
        let sandbox = self.sandbox_for(&tree.path, &target_dir);
        let input = json!({"event": HookEvent::MergeCheck, "entry": e}).to_string();
        let mut env = vec![
            ("TROUPE_HOOK_EVENT".to_owned(), "merge_check".to_owned()),
            ("TROUPE_MEMBER".to_owned(), e.member.clone()),
            (
                "CARGO_TARGET_DIR".to_owned(),
                target_dir.display().to_string(),
            ),
        ];
        if let Some(t) = &e.task {
            env.push(("TROUPE_TASK_ID".to_owned(), t.clone()));
        }
        for hook in hooks {
            let stopped = || self.stopped();
            let r = troupe::tools::confined::run_confined(&troupe::tools::confined::Confined {
                sandbox: &sandbox,
                workdir: &tree.path,
                command: &hook.command,
                env: &env,
                stdin: input.as_bytes(),
                timeout: hook.timeout(),
                stop: &stopped,
            });
            if r.stopped {
                return None;
            }
            let stderr = tail(&String::from_utf8_lossy(&r.stderr));
            troupe::events::log(
                &self.team,
                "hook_ran",
                json!({
                    "hook": HookEvent::MergeCheck, "command": hook.command, "member": e.member,
                    "task": e.task, "code": r.code, "signal": r.signal,
                    "timed_out": r.timed_out, "error": r.error, "stderr": stderr,
                }),
            );
            if let Some(err) = r.error {
                return Some(Verdict::Undecided(format!(
                    "the merge_check {:?} could not run: {err}",
                    hook.command
                )));
            }
            if r.timed_out {
                return Some(Verdict::Undecided(format!(
                    "the merge_check {:?} timed out after {} s",
                    hook.command,
                    hook.timeout().as_secs()
                )));
            }
            match r.code {
                Some(0) => {}
                Some(_) => return Some(Verdict::Failed(stderr)),
                None => {
                    return Some(Verdict::Undecided(format!(
                        "the merge_check {:?} was killed by signal {}",
                        hook.command,
                        r.signal.unwrap_or(0)
                    )));
                }
            }
        }
        Some(Verdict::Passed)
    }

    /// The sandbox of the checks in the integration tree at `tree`: the team's settings with
    /// `--sandbox-write` replaced by the checks' build cache `target_dir` (the tree and it are
    /// the only places they may write), prepared once per tree.
    fn sandbox_for(&self, tree: &Path, target_dir: &Path) -> Arc<Sandbox> {
        let mut cache = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, sb)) = cache.iter().find(|(p, _)| p == tree) {
            return sb.clone();
        }
        let mut settings = self.sandbox.clone();
        settings.write = vec![target_dir.to_path_buf()];
        let sb = Arc::new(Sandbox::prepare(
            &settings,
            tree,
            self.team.root(),
            "merge-check",
            None,
        ));
        cache.push((tree.to_path_buf(), sb.clone()));
        sb
    }
}

/// The checks' build cache for one entry: made empty when it starts and removed when it is
/// dropped, unless the team keeps one cache for all entries (`shared_check_cache`), so that
/// what one member's build leaves is not what another's check trusts.
struct CheckCache {
    dir: PathBuf,
    shared: bool,
}

impl CheckCache {
    fn start(dir: PathBuf, shared: bool) -> CheckCache {
        if !shared {
            remove_dir(&dir);
        }
        if let Err(e) = std::fs::create_dir_all(&dir) {
            tracing::warn!("merge queue: {}: {e}", dir.display());
        }
        CheckCache { dir, shared }
    }
}

impl Drop for CheckCache {
    fn drop(&mut self) {
        if !self.shared {
            remove_dir(&self.dir);
        }
    }
}

/// Removes `dir` and all in it, if it is there.
fn remove_dir(dir: &Path) {
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!("merge queue: remove {}: {e}", dir.display()),
    }
}

/// Makes the target branch in each repository this host's worktree members work in, before
/// their workers start: a member's sandbox lets it write its own branch's directory
/// (`refs/heads/troupe/`) but for the entries there when it starts, and the default target
/// lives there too.
pub fn ensure_targets(team: &TeamDir, host: Option<&str>, target: Option<&str>) {
    let Ok(cfg) = Roster::new(team).load() else {
        return;
    };
    let target = target
        .map(str::to_owned)
        .or_else(|| cfg.target_branch.clone())
        .unwrap_or_else(|| troupe::merge::DEFAULT_TARGET.to_owned());
    let mut done: Vec<&Path> = Vec::new();
    for m in &cfg.members {
        let Some(wt) = &m.worktree else { continue };
        if (host.is_some() && m.host.as_deref() != host) || done.contains(&wt.repo.as_path()) {
            continue;
        }
        done.push(&wt.repo);
        if let Err(e) = mgit::ensure_target(&wt.repo, &target) {
            tracing::warn!("merge queue: target {target} in {}: {e}", wt.repo.display());
        }
    }
}

/// The last [`REPORT_TAIL`] bytes of `text` (on a character boundary), trimmed.
fn tail(text: &str) -> String {
    let text = text.trim();
    let mut start = text.len().saturating_sub(REPORT_TAIL);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    text[start..].to_owned()
}
