//! The task board: `tasks/ID.json`, one record per task, moving
//! `pending -> in_progress -> completed`, with `cancelled` beside them and `reopen` back to
//! `pending`.
//!
//! A protocol request is not a task: a task says what the work is, who does it and what blocks
//! it. Every change happens under the task's sidecar lock (`tasks/ID.lock`) held across the read,
//! the check and the durable replace (temp, fsync, rename, fsync dir), as for requests, so of
//! processes racing to claim the same task exactly one wins and the others are told why they
//! lost. A task is claimable only when it is pending, unowned (or owned by the claimer: the lead
//! assigned it) and every task in its `blocked_by` is completed. An unknown blocker or a cycle is
//! refused at creation.
//!
//! What the rules check under one task's lock only: a claim reads its blockers without their
//! locks, and a cancel looks for dependents before it takes any lock. So a blocker reopened at
//! the instant a dependent is claimed, or a task created blocked by one being cancelled at that
//! instant, is not caught. Both need the lead to act against itself; neither loses a claim.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::events;
use crate::fsutil;
use crate::hooks::HookEvent;
use crate::records::Records;
use crate::teamdir::{AgentName, TeamDir, check_task_id};

/// Where a task stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    Pending,
    InProgress,
    /// Its owner marked it completed and the team's `task_completed` hooks have yet to pass
    /// it: it does not release its dependents until they do (see [`crate::hooks`]).
    Completing,
    Completed,
    Cancelled,
}

impl TaskStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            TaskStatus::Pending => "pending",
            TaskStatus::InProgress => "in_progress",
            TaskStatus::Completing => "completing",
            TaskStatus::Completed => "completed",
            TaskStatus::Cancelled => "cancelled",
        }
    }

    /// Whether someone still has to do it (pending or in progress).
    pub fn is_open(self) -> bool {
        matches!(self, TaskStatus::Pending | TaskStatus::InProgress)
    }
}

impl fmt::Display for TaskStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for TaskStatus {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<TaskStatus, String> {
        match s {
            "pending" => Ok(TaskStatus::Pending),
            "in_progress" => Ok(TaskStatus::InProgress),
            "completing" => Ok(TaskStatus::Completing),
            "completed" => Ok(TaskStatus::Completed),
            "cancelled" => Ok(TaskStatus::Cancelled),
            _ => Err(format!(
                "unknown task status {s:?} (expected pending, in_progress, completing, completed \
                 or cancelled)"
            )),
        }
    }
}

/// One task, as stored in `tasks/ID.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Task {
    pub id: String,
    pub subject: String,
    #[serde(default)]
    pub description: String,
    pub status: TaskStatus,
    /// Who does it: set by a claim, or by the lead's assignment of a pending task.
    #[serde(default)]
    pub owner: Option<String>,
    /// The owner's incarnation when it claimed the task.
    #[serde(default)]
    pub owner_incarnation: Option<u64>,
    /// Ids of the tasks that must be completed before this one can be claimed.
    #[serde(default)]
    pub blocked_by: Vec<String>,
    pub created_by: String,
    /// What the owner reported when it completed (or gave up) the task.
    #[serde(default)]
    pub result: Option<String>,
    pub created_at: f64,
    pub updated_at: f64,
    #[serde(default)]
    pub completed_at: Option<f64>,
    /// How many times an owner has completed it. A `task_completed` verdict names the completion
    /// it judged: one that lands after the task was reopened and completed again is stale.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub completion: u64,
    /// The team's `task_created` hooks have yet to run on it: nobody may claim it until they
    /// pass it (one that exits 2 cancels it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub created_hook_pending: bool,
    /// The task's own name in the team file it came from (`lead up`): a task with a key is
    /// created once, however often the file is applied. Unique on the board.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Fields written by other versions, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// What a new task needs.
#[derive(Debug, Clone, Default)]
pub struct NewTask {
    pub subject: String,
    pub description: String,
    pub blocked_by: Vec<String>,
    /// A teammate the task is assigned to from the start (only it may claim it).
    pub owner: Option<String>,
    pub created_by: String,
}

/// The task store of a team dir.
#[derive(Debug, Clone)]
pub struct TaskStore {
    team: TeamDir,
}

fn refused(id: &str, why: impl Into<String>) -> Error {
    Error::TaskRefused {
        id: id.to_owned(),
        why: why.into(),
    }
}

impl TaskStore {
    /// The store in `team`.
    pub fn new(team: &TeamDir) -> TaskStore {
        TaskStore { team: team.clone() }
    }

    /// Creates a pending task with a fresh, unique 8-hex id. Every blocker must exist and not be
    /// cancelled, and the blockers' own chains must hold no cycle.
    pub fn create(&self, new: NewTask) -> Result<Task> {
        self.create_as(new, None)
    }

    /// Creates the task named `key` (a team file's name for it) unless a task with that key is
    /// on the board already, which is returned as it is: `(task, created)`. The look-up and the
    /// creation happen under the board's key lock (`tasks/keys.lock`), so of two processes
    /// applying the same file at once exactly one creates it.
    pub fn create_keyed(&self, key: &str, new: NewTask) -> Result<(Task, bool)> {
        let _held = self
            .team
            .store()
            .lock("tasks:keys", &self.team.task_keys_lock())?;
        if let Some(t) = self.by_key(key)? {
            return Ok((t, false));
        }
        Ok((self.create_as(new, Some(key.to_owned()))?, true))
    }

    /// The task whose key is `key`, if there is one.
    pub fn by_key(&self, key: &str) -> Result<Option<Task>> {
        Ok(self
            .list(None)?
            .into_iter()
            .find(|t| t.key.as_deref() == Some(key)))
    }

    /// Changes the subject and description of a task that is still pending (a team file's
    /// edit). Returns whether it changed: a task someone has started, or closed, keeps what it
    /// said when it was taken.
    pub fn edit_pending(&self, id: &str, subject: &str, description: &str) -> Result<bool> {
        let subject = subject.trim();
        if subject.is_empty() {
            return Err(Error::InvalidTask("the subject is empty".to_owned()));
        }
        let mut changed = false;
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.status == TaskStatus::Pending
                && (t.subject != subject || t.description != description)
            {
                t.subject = subject.to_owned();
                t.description = description.to_owned();
                t.updated_at = fsutil::now();
                changed = true;
            }
            Ok(Some(t))
        })?;
        if changed {
            self.log("task_updated", &task, json!({"edited": true}));
        }
        Ok(changed)
    }

    fn create_as(&self, new: NewTask, key: Option<String>) -> Result<Task> {
        let subject = new.subject.trim();
        if subject.is_empty() {
            return Err(Error::InvalidTask("the subject is empty".to_owned()));
        }
        if let Some(owner) = &new.owner {
            AgentName::teammate(owner)?;
        }
        let mut blocked_by: Vec<String> = Vec::new();
        for b in &new.blocked_by {
            check_task_id(b)?;
            if !blocked_by.contains(b) {
                blocked_by.push(b.clone());
            }
        }
        let all: HashMap<String, Task> = self
            .list(None)?
            .into_iter()
            .map(|t| (t.id.clone(), t))
            .collect();
        for b in &blocked_by {
            match all.get(b) {
                None => return Err(Error::UnknownTask(format!("{b} (named as a blocker)"))),
                Some(t) if t.status == TaskStatus::Cancelled => {
                    return Err(Error::InvalidTask(format!(
                        "blocker {b} is cancelled: a task blocked by it could never start"
                    )));
                }
                Some(_) => {}
            }
        }
        let id = self.records().reserve_id()?;
        // A fresh id cannot be anyone's blocker yet, but a forged file might name it, or the
        // existing chains may already loop: refuse to hang a task on a cycle.
        if let Some(cycle) = find_cycle(&id, &blocked_by, &all) {
            let lock_path = self.team.task_lock(&id)?;
            let _ = std::fs::remove_file(lock_path);
            return Err(Error::InvalidTask(format!(
                "its blockers form a cycle: {}",
                cycle.join(" -> ")
            )));
        }
        let now = fsutil::now();
        let created_hook_pending = hooked(&self.team, HookEvent::TaskCreated);
        let task = Task {
            id: id.clone(),
            subject: subject.to_owned(),
            description: new.description,
            status: TaskStatus::Pending,
            owner: new.owner,
            owner_incarnation: None,
            blocked_by,
            created_by: new.created_by,
            result: None,
            created_at: now,
            updated_at: now,
            completed_at: None,
            completion: 0,
            created_hook_pending,
            key,
            extra: Map::new(),
        };
        let task = self.locked(&id, |_| Ok(Some(task.clone())))?;
        self.log(
            "task_created",
            &task,
            json!({"blocked_by": task.blocked_by, "by": task.created_by}),
        );
        Ok(task)
    }

    /// Reads one task.
    pub fn get(&self, id: &str) -> Result<Task> {
        self.records().get(id)
    }

    /// Every task (optionally only those in `status`), oldest first. Unreadable files are
    /// reported on stderr and skipped.
    pub fn list(&self, status: Option<TaskStatus>) -> Result<Vec<Task>> {
        let mut out: Vec<Task> = self.records().list()?;
        out.retain(|t| status.is_none_or(|s| t.status == s));
        out.sort_by(|a, b| {
            a.created_at
                .total_cmp(&b.created_at)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(out)
    }

    /// Every task, oldest first, reading only those that changed since the listing `cache`
    /// was last given to (for a poller such as `lead top`; see [`crate::store::Listing`]).
    pub fn list_cached(&self, cache: &mut crate::store::Listing<Task>) -> Result<Vec<Task>> {
        let mut out: Vec<Task> = self.records().list_cached(cache)?;
        out.sort_by(|a, b| {
            a.created_at
                .total_cmp(&b.created_at)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(out)
    }

    /// The tasks `who` could claim now, oldest first: pending, unowned or owned by `who`, every
    /// blocker completed. With `who` `None`, only unowned ones.
    pub fn claimable(&self, who: Option<&str>) -> Result<Vec<Task>> {
        let all = self.list(None)?;
        let status: HashMap<&str, TaskStatus> =
            all.iter().map(|t| (t.id.as_str(), t.status)).collect();
        Ok(all
            .iter()
            .filter(|t| {
                t.status == TaskStatus::Pending
                    && !t.created_hook_pending
                    && t.owner.as_deref().is_none_or(|o| Some(o) == who)
                    && t.blocked_by
                        .iter()
                        .all(|b| status.get(b.as_str()) == Some(&TaskStatus::Completed))
            })
            .cloned()
            .collect())
    }

    /// Claims a task for `who` (incarnation `incarnation`): `id`, or with `None` the oldest
    /// claimable one. Exactly one of racing claimers wins; the others get
    /// [`Error::TaskRefused`] saying why (or [`Error::NoClaimableTask`] when none is left).
    pub fn claim(&self, id: Option<&str>, who: &str, incarnation: u64) -> Result<Task> {
        if let Some(id) = id {
            return self.claim_one(id, who, incarnation);
        }
        for t in self.claimable(Some(who))? {
            match self.claim_one(&t.id, who, incarnation) {
                Ok(t) => return Ok(t),
                // Lost to another claimer (or changed under us): try the next one.
                Err(Error::TaskRefused { .. } | Error::UnknownTask(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::NoClaimableTask)
    }

    fn claim_one(&self, id: &str, who: &str, incarnation: u64) -> Result<Task> {
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            match t.status {
                TaskStatus::Pending => {}
                TaskStatus::InProgress => {
                    return Err(refused(
                        id,
                        format!(
                            "already in progress (owner {})",
                            t.owner.as_deref().unwrap_or("?")
                        ),
                    ));
                }
                s => return Err(refused(id, format!("is {s}; reopen it first"))),
            }
            if let Some(owner) = t.owner.as_deref().filter(|o| *o != who) {
                return Err(refused(id, format!("is assigned to {owner}")));
            }
            if t.created_hook_pending {
                return Err(refused(
                    id,
                    "waits for the team's task_created hooks to pass it",
                ));
            }
            let mut waiting = Vec::new();
            for b in &t.blocked_by {
                match self.get(b) {
                    Ok(bt) if bt.status == TaskStatus::Completed => {}
                    Ok(bt) => waiting.push(format!("{b} ({})", bt.status)),
                    Err(Error::UnknownTask(_)) => waiting.push(format!("{b} (missing)")),
                    Err(e) => return Err(e),
                }
            }
            if !waiting.is_empty() {
                return Err(refused(id, format!("is blocked by {}", waiting.join(", "))));
            }
            t.status = TaskStatus::InProgress;
            t.owner = Some(who.to_owned());
            t.owner_incarnation = Some(incarnation);
            t.updated_at = fsutil::now();
            Ok(Some(t))
        })?;
        self.log("task_claimed", &task, json!({"incarnation": incarnation}));
        Ok(task)
    }

    /// The owner's report on its in-progress task: `completed` (done, with `result`), or
    /// `pending` (it gives the task up: the owner is cleared and anyone may claim it). Only the
    /// owner may update. Where the team has `task_completed` hooks, or the owner works in a
    /// worktree, a completion is held as `completing` until the hooks pass it and its work
    /// lands ([`TaskStore::settle_completion`], [`crate::merge`]).
    pub fn update(
        &self,
        id: &str,
        who: &str,
        status: TaskStatus,
        result: Option<String>,
    ) -> Result<Task> {
        if !matches!(status, TaskStatus::Completed | TaskStatus::Pending) {
            return Err(Error::InvalidTask(format!(
                "an owner moves its task to completed or pending (gives it up), not {status}"
            )));
        }
        // Held for the hooks, and for the merge queue when the owner works in a worktree: its
        // dependents wait until its work has landed.
        let held = status == TaskStatus::Completed
            && (hooked(&self.team, HookEvent::TaskCompleted) || integrates(&self.team, who));
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.owner.as_deref() != Some(who) {
                let owner = t
                    .owner
                    .as_deref()
                    .map_or("nobody".to_owned(), str::to_owned);
                return Err(refused(
                    id,
                    format!("is owned by {owner}; {who} may not update it"),
                ));
            }
            if t.status != TaskStatus::InProgress {
                return Err(refused(
                    id,
                    format!("is {}, not in_progress; claim it first", t.status),
                ));
            }
            let now = fsutil::now();
            t.status = status;
            t.updated_at = now;
            if result.is_some() {
                t.result = result;
            }
            if status == TaskStatus::Completed {
                t.completion += 1;
            }
            if held {
                t.status = TaskStatus::Completing;
            } else if status == TaskStatus::Completed {
                t.completed_at = Some(now);
            } else {
                t.owner = None;
                t.owner_incarnation = None;
            }
            Ok(Some(t))
        })?;
        self.log("task_updated", &task, json!({"by": who}));
        Ok(task)
    }

    /// The lead assigns a pending task to teammate `to`: only `to` may claim it then.
    pub fn assign(&self, id: &str, to: &str) -> Result<Task> {
        AgentName::teammate(to)?;
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.status != TaskStatus::Pending {
                return Err(refused(
                    id,
                    format!("is {}; only a pending task can be assigned", t.status),
                ));
            }
            t.owner = Some(to.to_owned());
            t.owner_incarnation = None;
            t.updated_at = fsutil::now();
            Ok(Some(t))
        })?;
        self.log("task_updated", &task, json!({"assigned": true}));
        Ok(task)
    }

    /// Cancels a pending or in-progress task. Refused while open tasks wait on it (directly or
    /// through others) unless `cascade`, which cancels them too. Returns every task it
    /// cancelled, `id` first.
    pub fn cancel(&self, id: &str, cascade: bool) -> Result<Vec<Task>> {
        let target = self.get(id)?;
        if !target.status.is_open() {
            return Err(refused(id, format!("is already {}", target.status)));
        }
        let dependents = self.dependents(id)?;
        if !dependents.is_empty() && !cascade {
            return Err(refused(
                id,
                format!(
                    "open tasks wait on it: {} (cascade cancels them too)",
                    dependents.join(", ")
                ),
            ));
        }
        // Dependents first: a cancel cut short leaves the target open, so running it again
        // finishes the job instead of stranding tasks behind a cancelled blocker.
        let mut done = Vec::new();
        for d in dependents.iter().rev() {
            if let Some(t) = self.cancel_one(d, Some(id))? {
                done.push(t);
            }
        }
        let Some(t) = self.cancel_one(id, None)? else {
            return Err(refused(id, "was closed by someone else meanwhile"));
        };
        done.insert(0, t);
        Ok(done)
    }

    /// Cancels one open task; `None` if it was no longer open.
    fn cancel_one(&self, id: &str, cascade_of: Option<&str>) -> Result<Option<Task>> {
        let mut changed = false;
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.status.is_open() {
                t.status = TaskStatus::Cancelled;
                t.updated_at = fsutil::now();
                changed = true;
            }
            Ok(Some(t))
        })?;
        if !changed {
            return Ok(None);
        }
        self.log("task_cancelled", &task, json!({"cascade_of": cascade_of}));
        Ok(Some(task))
    }

    /// The open tasks that wait on `id`, directly or through other tasks, nearest first.
    fn dependents(&self, id: &str) -> Result<Vec<String>> {
        let all = self.list(None)?;
        let mut out: Vec<String> = Vec::new();
        let mut seen: HashSet<String> = HashSet::from([id.to_owned()]);
        let mut frontier = vec![id.to_owned()];
        while let Some(cur) = frontier.pop() {
            for t in &all {
                if t.status.is_open() && t.blocked_by.contains(&cur) && seen.insert(t.id.clone()) {
                    out.push(t.id.clone());
                    frontier.push(t.id.clone());
                }
            }
        }
        Ok(out)
    }

    /// Puts a completed or cancelled task back to `pending`, owner and result cleared.
    pub fn reopen(&self, id: &str) -> Result<Task> {
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.status.is_open() {
                return Err(refused(id, format!("is {}, not closed", t.status)));
            }
            t.status = TaskStatus::Pending;
            t.owner = None;
            t.owner_incarnation = None;
            t.result = None;
            t.completed_at = None;
            t.updated_at = fsutil::now();
            Ok(Some(t))
        })?;
        self.log("task_reopened", &task, json!({}));
        Ok(task)
    }

    /// Hands every in-progress task of `who` back to `pending` with no owner (a member that
    /// ended `failed` or `shutdown`, or was removed). Returns the tasks it released.
    ///
    /// A task `who` completed that waits for hooks keeps its completion: a verdict that passes
    /// it completes it, and one that sends it back finds its owner ended and leaves it pending
    /// ([`TaskStore::settle_completion`]). It is still looked at under its lock: a verdict
    /// that sent it back to `who` just before `who` was recorded as ended is undone here.
    pub fn release_owned_by(&self, who: &str) -> Result<Vec<Task>> {
        let mut out = Vec::new();
        for t in self.list(None)? {
            if t.owner.as_deref() != Some(who)
                || !matches!(t.status, TaskStatus::InProgress | TaskStatus::Completing)
            {
                continue;
            }
            let mut changed = false;
            let task = self.locked(&t.id, |cur| {
                let mut t = cur.ok_or_else(|| Error::UnknownTask(t.id.clone()))?;
                if t.status == TaskStatus::InProgress && t.owner.as_deref() == Some(who) {
                    t.status = TaskStatus::Pending;
                    t.owner = None;
                    t.owner_incarnation = None;
                    t.updated_at = fsutil::now();
                    changed = true;
                }
                Ok(Some(t))
            })?;
            if changed {
                self.log("task_updated", &task, json!({"released_from": who}));
                out.push(task);
            }
        }
        Ok(out)
    }

    /// The `task_completed` hooks' verdict on completion number `judged` of a task (its
    /// [`Task::completion`] when they started). Passed, it is completed (and releases its
    /// dependents). Sent back, it is `in_progress` with its owner again, unless `ended` says
    /// (asked under the task's lock, so after the last exit handled) that the owner has ended:
    /// then it is `pending` with no owner, for anyone, and the event says why.
    ///
    /// `None`, with a `task_verdict_stale` event, if the task no longer waits for this verdict:
    /// it is not completing (reopened, or settled by an earlier run), or it is completing again
    /// after a reopen, a later completion that its own run of the hooks judges.
    ///
    /// `before` runs under the task's lock, on the task as it is about to be written, just
    /// before it is (the supervisor tells the owner there, and may note why in its `result`): nobody can act on the change before
    /// it ran, and a crash between the two leaves the task completing, to be settled again.
    pub fn settle_completion(
        &self,
        id: &str,
        judged: u64,
        passed: bool,
        ended: impl FnOnce(&str) -> bool,
        before: impl FnOnce(&mut Task),
    ) -> Result<Option<Task>> {
        let mut changed = false;
        let mut released_from = None;
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.status != TaskStatus::Completing || t.completion != judged {
                return Ok(None);
            }
            let now = fsutil::now();
            t.updated_at = now;
            if passed {
                t.status = TaskStatus::Completed;
                t.completed_at = Some(now);
            } else if let Some(owner) = t.owner.clone().filter(|o| ended(o)) {
                t.status = TaskStatus::Pending;
                t.owner = None;
                t.owner_incarnation = None;
                released_from = Some(owner);
            } else {
                t.status = TaskStatus::InProgress;
            }
            before(&mut t);
            changed = true;
            Ok(Some(t))
        })?;
        let verdict = if passed { "passed" } else { "sent back" };
        if !changed {
            self.log(
                "task_verdict_stale",
                &task,
                json!({
                    "hook": HookEvent::TaskCompleted, "verdict": verdict, "judged": judged,
                    "completion": task.completion,
                }),
            );
            return Ok(None);
        }
        let mut more = json!({"hook": HookEvent::TaskCompleted, "completion": judged});
        if let Some(owner) = &released_from {
            more["released_from"] = json!(owner);
            more["why"] = json!(format!(
                "{owner} has ended and cannot take it back: it is pending for anyone"
            ));
        }
        let event = if passed {
            "task_completed"
        } else {
            "task_sent_back"
        };
        self.log(event, &task, more);
        Ok(Some(task))
    }

    /// The `task_created` hooks' verdict on a new task: passed, it may be claimed; refused, it
    /// is cancelled with `why` as its result (unless someone closed it meanwhile). `None` if
    /// its hooks were settled already.
    pub fn settle_created(&self, id: &str, passed: bool, why: &str) -> Result<Option<Task>> {
        let mut changed = false;
        let task = self.locked(id, |cur| {
            let mut t = cur.ok_or_else(|| Error::UnknownTask(id.to_owned()))?;
            if t.created_hook_pending {
                t.created_hook_pending = false;
                t.updated_at = fsutil::now();
                if !passed && t.status.is_open() {
                    t.status = TaskStatus::Cancelled;
                    t.result = Some(why.to_owned());
                }
                changed = true;
            }
            Ok(Some(t))
        })?;
        if !changed {
            return Ok(None);
        }
        if task.status == TaskStatus::Cancelled {
            self.log(
                "task_cancelled",
                &task,
                json!({"hook": HookEvent::TaskCreated}),
            );
        }
        Ok(Some(task))
    }

    fn log(&self, event: &str, t: &Task, more: Value) {
        let mut fields = json!({
            "id": t.id, "subject": t.subject, "owner": t.owner, "status": t.status,
        });
        if let (Value::Object(f), Value::Object(m)) = (&mut fields, more) {
            f.extend(m);
        }
        events::log(&self.team, event, fields);
    }

    /// Reads, decides and writes task `id` under its lock (see [`crate::records`]).
    fn locked(
        &self,
        id: &str,
        f: impl FnOnce(Option<Task>) -> Result<Option<Task>>,
    ) -> Result<Task> {
        self.records().locked(id, f)
    }

    fn records(&self) -> Records<'_> {
        Records {
            team: &self.team,
            dir: TeamDir::tasks_dir,
            file: TeamDir::task,
            lock: TeamDir::task_lock,
            unknown: Error::UnknownTask,
            noun: "task",
        }
    }
}

/// Whether the team has hooks on `event`. An unreadable config.json (a person's edit in
/// progress) counts as yes: a change held for hooks that turn out absent is released by the
/// supervisor, while one let through would have skipped them.
fn hooked(team: &TeamDir, event: HookEvent) -> bool {
    crate::config::Roster::new(team)
        .load_team()
        .map_or(true, |c| crate::hooks::any_for(&c.hooks, event))
}

/// Whether a completion by `who` goes through the merge queue: `who` works in its own worktree.
/// An unreadable roster counts as yes, as in [`hooked`].
fn integrates(team: &TeamDir, who: &str) -> bool {
    crate::config::Roster::new(team)
        .load_for(who)
        .map_or(true, |c| {
            c.member(who).is_some_and(|m| m.worktree.is_some())
        })
}

/// A cycle reachable from a new task `id` blocked by `blockers`, over the `blocked_by` links of
/// `all`: the ids along it, or `None`.
fn find_cycle(id: &str, blockers: &[String], all: &HashMap<String, Task>) -> Option<Vec<String>> {
    // 0 unvisited, 1 on the current path, 2 done.
    fn visit(
        node: &str,
        edges: &dyn Fn(&str) -> Vec<String>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(node).copied().unwrap_or(0) {
            1 => {
                let start = path.iter().position(|p| p == node).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            2 => return None,
            _ => {}
        }
        state.insert(node.to_owned(), 1);
        path.push(node.to_owned());
        for next in edges(node) {
            if let Some(c) = visit(&next, edges, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(node.to_owned(), 2);
        None
    }
    let edges = |n: &str| -> Vec<String> {
        if n == id {
            blockers.to_vec()
        } else {
            all.get(n).map(|t| t.blocked_by.clone()).unwrap_or_default()
        }
    };
    visit(id, &edges, &mut BTreeMap::new(), &mut Vec::new())
}

/// The content of the notice that wakes idle auto-claiming teammates when the board changed
/// (a task created, completed, reopened or handed back). Handled by the worker itself, never
/// shown to the model.
pub const BOARD_CHANGED: &str = "[the task board changed]";

/// Wakes every idle member with `auto_claim` (but `except`), so it looks for a claimable task
/// as soon as it would for a message. Best effort: a full inbox is skipped with a warning.
pub fn wake_claimers(team: &TeamDir, except: Option<&str>) {
    let Ok(cfg) = crate::config::Roster::new(team).load() else {
        return;
    };
    for m in &cfg.members {
        if !m.auto_claim
            || m.status != crate::config::MemberStatus::Idle
            || Some(m.name.as_str()) == except
        {
            continue;
        }
        let Ok(to) = crate::teamdir::AgentName::teammate(&m.name) else {
            continue;
        };
        let note = crate::message::Message::new(
            crate::message::MessageType::StatusUpdate,
            crate::teamdir::LEAD,
            &m.name,
            BOARD_CHANGED,
        );
        if let Err(e) =
            crate::inbox::Inbox::new(team, &to).append(&note, crate::inbox::Durability::Sync)
        {
            tracing::warn!("could not wake {}: {e}", m.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, TeamDir, TaskStore) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let s = TaskStore::new(&team);
        (tmp, team, s)
    }

    fn add(s: &TaskStore, subject: &str, blocked_by: &[&str]) -> Task {
        s.create(NewTask {
            subject: subject.into(),
            blocked_by: blocked_by.iter().map(|b| b.to_string()).collect(),
            created_by: "lead".into(),
            ..NewTask::default()
        })
        .unwrap()
    }

    fn ids(ts: &[Task]) -> Vec<&str> {
        ts.iter().map(|t| t.id.as_str()).collect()
    }

    #[test]
    fn status_names_round_trip() {
        for s in [
            TaskStatus::Pending,
            TaskStatus::InProgress,
            TaskStatus::Completed,
            TaskStatus::Cancelled,
        ] {
            assert_eq!(s.as_str().parse::<TaskStatus>().unwrap(), s);
            assert_eq!(serde_json::to_value(s).unwrap(), json!(s.as_str()));
        }
        let e = "done".parse::<TaskStatus>().unwrap_err();
        assert!(e.contains("expected pending, in_progress"), "{e}");
    }

    #[test]
    fn unknown_blocker_bad_id_and_empty_subject_are_refused() {
        let (_t, _team, s) = store();
        let mut n = NewTask {
            subject: "x".into(),
            blocked_by: vec!["deadbeef".into()],
            created_by: "lead".into(),
            ..NewTask::default()
        };
        assert_eq!(
            s.create(n.clone()).unwrap_err().to_string(),
            "no such task: deadbeef (named as a blocker)"
        );
        n.blocked_by = vec!["../../etc".into()];
        assert_eq!(s.create(n.clone()).unwrap_err().exit_code(), 3);
        n.blocked_by.clear();
        n.subject = "  ".into();
        assert_eq!(s.create(n).unwrap_err().exit_code(), 2);
        assert!(s.list(None).unwrap().is_empty());
        assert!(matches!(s.get("../../x1"), Err(Error::UnknownTask(_))));
        assert!(matches!(s.get("deadbeef"), Err(Error::UnknownTask(_))));
    }

    #[test]
    fn a_forged_cycle_is_refused_at_creation() {
        let (_t, team, s) = store();
        let a = add(&s, "a", &[]);
        let b = add(&s, "b", &[&a.id]);
        // Forge a -> b, closing the loop a -> b -> a.
        let mut forged = a.clone();
        forged.blocked_by = vec![b.id.clone()];
        std::fs::write(
            team.task(&a.id).unwrap(),
            serde_json::to_vec(&forged).unwrap(),
        )
        .unwrap();
        let before = s.list(None).unwrap().len();
        let e = s
            .create(NewTask {
                subject: "c".into(),
                blocked_by: vec![b.id.clone()],
                created_by: "lead".into(),
                ..NewTask::default()
            })
            .unwrap_err();
        assert!(e.to_string().contains("cycle"), "{e}");
        assert_eq!(s.list(None).unwrap().len(), before);
        // Nor is either task of the loop claimable.
        assert!(s.claimable(None).unwrap().is_empty());
    }

    #[test]
    fn claimability_follows_blockers_and_owners() {
        let (_t, team, s) = store();
        let a = add(&s, "a", &[]);
        let b = add(&s, "b", &[&a.id]);
        let c = add(&s, "c", &[]);
        s.assign(&c.id, "bob").unwrap();
        assert_eq!(ids(&s.claimable(None).unwrap()), [a.id.as_str()]);
        assert_eq!(
            ids(&s.claimable(Some("bob")).unwrap()),
            [a.id.as_str(), c.id.as_str()]
        );
        let e = s.claim(Some(&b.id), "alice", 1).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("task {}: is blocked by {} (pending)", b.id, a.id)
        );
        let e = s.claim(Some(&c.id), "alice", 1).unwrap_err();
        assert_eq!(e.to_string(), format!("task {}: is assigned to bob", c.id));
        // None = the oldest claimable.
        let got = s.claim(None, "alice", 3).unwrap();
        assert_eq!(got.id, a.id);
        assert_eq!(got.status, TaskStatus::InProgress);
        assert_eq!(got.owner_incarnation, Some(3));
        let e = s.claim(Some(&a.id), "bob", 1).unwrap_err();
        assert!(
            e.to_string().contains("already in progress (owner alice)"),
            "{e}"
        );
        assert!(matches!(
            s.claim(None, "alice", 3),
            Err(Error::NoClaimableTask)
        ));
        s.update(&a.id, "alice", TaskStatus::Completed, Some("ok".into()))
            .unwrap();
        assert_eq!(ids(&s.claimable(None).unwrap()), [b.id.as_str()]);
        let e = s.claim(Some(&a.id), "bob", 1).unwrap_err();
        assert!(e.to_string().contains("is completed"), "{e}");
        assert_eq!(s.claim(None, "bob", 1).unwrap().id, b.id);
        let kinds: Vec<_> = events::read_all(&team)
            .unwrap()
            .into_iter()
            .map(|e| e["event"].as_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            kinds,
            [
                "task_created",
                "task_created",
                "task_created",
                "task_updated",
                "task_claimed",
                "task_updated",
                "task_claimed"
            ]
        );
    }

    #[test]
    fn only_the_owner_updates_and_giving_up_frees_the_task() {
        let (_t, _team, s) = store();
        let a = add(&s, "a", &[]);
        let e = s
            .update(&a.id, "alice", TaskStatus::Completed, None)
            .unwrap_err();
        assert!(e.to_string().contains("owned by nobody"), "{e}");
        s.claim(Some(&a.id), "alice", 1).unwrap();
        let e = s
            .update(&a.id, "bob", TaskStatus::Completed, None)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("task {}: is owned by alice; bob may not update it", a.id)
        );
        assert_eq!(e.exit_code(), 4);
        assert_eq!(
            s.update(&a.id, "alice", TaskStatus::Cancelled, None)
                .unwrap_err()
                .exit_code(),
            2
        );
        let t = s
            .update(&a.id, "alice", TaskStatus::Pending, Some("stuck".into()))
            .unwrap();
        assert_eq!((t.status, t.owner.as_deref()), (TaskStatus::Pending, None));
        assert_eq!(t.result.as_deref(), Some("stuck"));
        s.claim(Some(&a.id), "bob", 2).unwrap();
        let t = s
            .update(&a.id, "bob", TaskStatus::Completed, Some("done".into()))
            .unwrap();
        assert!(t.completed_at.is_some());
        assert_eq!(t.owner.as_deref(), Some("bob"));
        let e = s
            .update(&a.id, "bob", TaskStatus::Completed, None)
            .unwrap_err();
        assert!(
            e.to_string().contains("is completed, not in_progress"),
            "{e}"
        );
    }

    #[test]
    fn cancel_refuses_stranding_dependents_unless_cascade() {
        let (_t, _team, s) = store();
        let a = add(&s, "a", &[]);
        let b = add(&s, "b", &[&a.id]);
        let c = add(&s, "c", &[&b.id]);
        let other = add(&s, "other", &[]);
        let e = s.cancel(&a.id, false).unwrap_err();
        assert_eq!(e.exit_code(), 4);
        assert!(
            e.to_string().contains(&b.id) && e.to_string().contains(&c.id),
            "{e}"
        );
        assert_eq!(s.get(&a.id).unwrap().status, TaskStatus::Pending);
        let done = s.cancel(&a.id, true).unwrap();
        assert_eq!(done[0].id, a.id);
        let mut got: Vec<_> = ids(&done).into_iter().map(str::to_owned).collect();
        got.sort();
        let mut want = vec![a.id.clone(), b.id.clone(), c.id.clone()];
        want.sort();
        assert_eq!(got, want);
        assert_eq!(
            s.list(Some(TaskStatus::Cancelled)).unwrap().len(),
            3,
            "the chain is cancelled"
        );
        assert_eq!(s.get(&other.id).unwrap().status, TaskStatus::Pending);
        let e = s.cancel(&a.id, true).unwrap_err();
        assert!(e.to_string().contains("already cancelled"), "{e}");
        // A leaf cancels without cascade; a cancelled task cannot be a new blocker.
        s.cancel(&other.id, false).unwrap();
        let e = s
            .create(NewTask {
                subject: "d".into(),
                blocked_by: vec![other.id.clone()],
                created_by: "lead".into(),
                ..NewTask::default()
            })
            .unwrap_err();
        assert!(e.to_string().contains("is cancelled"), "{e}");
    }

    #[test]
    fn reopen_puts_a_closed_task_back() {
        let (_t, _team, s) = store();
        let a = add(&s, "a", &[]);
        assert!(
            s.reopen(&a.id)
                .unwrap_err()
                .to_string()
                .contains("not closed")
        );
        s.claim(None, "alice", 1).unwrap();
        s.update(&a.id, "alice", TaskStatus::Completed, Some("r".into()))
            .unwrap();
        let t = s.reopen(&a.id).unwrap();
        assert_eq!(t.status, TaskStatus::Pending);
        assert_eq!((t.owner, t.result, t.completed_at), (None, None, None));
        s.cancel(&a.id, false).unwrap();
        assert_eq!(s.reopen(&a.id).unwrap().status, TaskStatus::Pending);
        assert_eq!(s.claim(None, "bob", 1).unwrap().id, a.id);
    }

    #[test]
    fn release_owned_by_hands_back_only_that_owners_work() {
        let (_t, _team, s) = store();
        let a = add(&s, "a", &[]);
        let b = add(&s, "b", &[]);
        let c = add(&s, "c", &[]);
        s.claim(Some(&a.id), "alice", 1).unwrap();
        s.claim(Some(&b.id), "bob", 1).unwrap();
        s.claim(Some(&c.id), "alice", 1).unwrap();
        s.update(&c.id, "alice", TaskStatus::Completed, None)
            .unwrap();
        let back = s.release_owned_by("alice").unwrap();
        assert_eq!(ids(&back), [a.id.as_str()]);
        let a = s.get(&a.id).unwrap();
        assert_eq!((a.status, a.owner), (TaskStatus::Pending, None));
        assert_eq!(s.get(&b.id).unwrap().status, TaskStatus::InProgress);
        assert_eq!(s.get(&c.id).unwrap().status, TaskStatus::Completed);
        assert!(s.release_owned_by("alice").unwrap().is_empty());
    }

    #[test]
    fn hooks_hold_completions_and_new_tasks_until_settled() {
        let (_tmp, team, s) = store();
        // No hooks: a completion is final at once.
        let plain = add(&s, "plain", &[]);
        s.claim(Some(&plain.id), "amy", 1).unwrap();
        let t = s
            .update(&plain.id, "amy", TaskStatus::Completed, None)
            .unwrap();
        assert_eq!(t.status, TaskStatus::Completed);
        assert!(!t.created_hook_pending);
        crate::config::Roster::new(&team)
            .update(|c| {
                for event in [HookEvent::TaskCreated, HookEvent::TaskCompleted] {
                    c.hooks.push(crate::hooks::Hook {
                        event,
                        command: "true".into(),
                        timeout_secs: None,
                        sandbox: true,
                    });
                }
                Ok(())
            })
            .unwrap();
        let a = add(&s, "a", &[]);
        let b = add(&s, "b", &[&a.id]);
        assert!(a.created_hook_pending);
        assert!(s.claimable(Some("amy")).unwrap().is_empty());
        assert!(s.claim(Some(&a.id), "amy", 1).is_err());
        assert!(s.settle_created(&a.id, true, "").unwrap().is_some());
        assert!(
            s.settle_created(&a.id, true, "").unwrap().is_none(),
            "settled twice"
        );
        s.settle_created(&b.id, true, "").unwrap();
        s.claim(Some(&a.id), "amy", 1).unwrap();
        let held = s.update(&a.id, "amy", TaskStatus::Completed, None).unwrap();
        assert_eq!(held.status, TaskStatus::Completing);
        assert!(held.completed_at.is_none());
        // A completing blocker releases nothing yet.
        assert!(ids(&s.claimable(Some("amy")).unwrap()).is_empty());
        assert_eq!(held.completion, 1);
        let live = |_: &str| false;
        let back = s
            .settle_completion(&a.id, 1, false, live, |_| ())
            .unwrap()
            .unwrap();
        assert_eq!(back.status, TaskStatus::InProgress);
        assert_eq!(back.owner.as_deref(), Some("amy"));
        assert!(
            s.settle_completion(&a.id, 1, true, live, |_| ())
                .unwrap()
                .is_none(),
            "not completing"
        );
        s.update(&a.id, "amy", TaskStatus::Completed, None).unwrap();
        let done = s
            .settle_completion(&a.id, 2, true, live, |_| ())
            .unwrap()
            .unwrap();
        assert_eq!(done.status, TaskStatus::Completed);
        assert!(done.completed_at.is_some());
        assert_eq!(ids(&s.claimable(Some("amy")).unwrap()), [b.id.as_str()]);
        // A refused new task is cancelled with the reason.
        let c = add(&s, "c", &[]);
        let c = s.settle_created(&c.id, false, "no").unwrap().unwrap();
        assert_eq!(c.status, TaskStatus::Cancelled);
        assert_eq!(c.result.as_deref(), Some("no"));
    }

    /// Makes `team` hold completions for `task_completed` hooks.
    fn hook_completions(team: &TeamDir) {
        crate::config::Roster::new(team)
            .update(|c| {
                c.hooks.push(crate::hooks::Hook {
                    event: HookEvent::TaskCompleted,
                    command: "true".into(),
                    timeout_secs: None,
                    sandbox: true,
                });
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn a_verdict_settles_only_the_completion_it_judged() {
        let (_tmp, team, s) = store();
        hook_completions(&team);
        let a = add(&s, "a", &[]);
        s.claim(Some(&a.id), "amy", 1).unwrap();
        let first = s.update(&a.id, "amy", TaskStatus::Completed, None).unwrap();
        assert_eq!(first.completion, 1);
        // Reopened and completed again while the hooks judged the first completion.
        s.reopen(&a.id).unwrap();
        s.claim(Some(&a.id), "amy", 1).unwrap();
        let second = s.update(&a.id, "amy", TaskStatus::Completed, None).unwrap();
        assert_eq!(second.completion, 2);
        let mut told = false;
        let stale = s
            .settle_completion(&a.id, first.completion, false, |_| false, |_| told = true)
            .unwrap();
        assert!(stale.is_none() && !told);
        let now = s.get(&a.id).unwrap();
        assert_eq!((now.status, now.completion), (TaskStatus::Completing, 2));
        let said: Vec<Value> = events::read_all(&team)
            .unwrap()
            .into_iter()
            .filter(|e| e["event"] == "task_verdict_stale")
            .collect();
        assert_eq!(said.len(), 1, "{said:?}");
        assert_eq!(
            (said[0]["judged"].as_u64(), said[0]["completion"].as_u64()),
            (Some(1), Some(2))
        );
        let done = s
            .settle_completion(&a.id, second.completion, true, |_| false, |_| ())
            .unwrap()
            .unwrap();
        assert_eq!(done.status, TaskStatus::Completed);
    }

    #[test]
    fn a_task_sent_back_to_an_owner_that_ended_is_pending() {
        let (_tmp, team, s) = store();
        hook_completions(&team);
        let a = add(&s, "a", &[]);
        s.claim(Some(&a.id), "amy", 4).unwrap();
        s.update(&a.id, "amy", TaskStatus::Completed, Some("r".into()))
            .unwrap();
        // Amy's exit is handled while the hooks run: her completion waits for its verdict.
        assert!(s.release_owned_by("amy").unwrap().is_empty());
        assert_eq!(s.get(&a.id).unwrap().status, TaskStatus::Completing);
        let mut seen = None;
        let back = s
            .settle_completion(&a.id, 1, false, |o| o == "amy", |t| seen = Some(t.status))
            .unwrap()
            .unwrap();
        assert_eq!(seen, Some(TaskStatus::Pending));
        assert_eq!(
            (back.status, back.owner.as_deref(), back.owner_incarnation),
            (TaskStatus::Pending, None, None)
        );
        assert_eq!(ids(&s.claimable(Some("bob")).unwrap()), [a.id.as_str()]);
        let ev = events::read_all(&team)
            .unwrap()
            .into_iter()
            .rfind(|e| e["event"] == "task_sent_back")
            .unwrap();
        assert_eq!(ev["released_from"], "amy");
        assert!(
            ev["why"].as_str().unwrap().contains("amy has ended"),
            "{ev}"
        );
        // Sent back to her while she was still live, just before her exit was handled: the
        // hand-back takes it.
        s.claim(Some(&a.id), "amy", 5).unwrap();
        s.update(&a.id, "amy", TaskStatus::Completed, None).unwrap();
        let back = s
            .settle_completion(&a.id, 2, false, |_| false, |_| ())
            .unwrap()
            .unwrap();
        assert_eq!(back.status, TaskStatus::InProgress);
        assert_eq!(ids(&s.release_owned_by("amy").unwrap()), [a.id.as_str()]);
    }

    #[test]
    fn unknown_fields_are_kept() {
        let (_t, team, s) = store();
        let a = add(&s, "a", &[]);
        let mut v = serde_json::to_value(&a).unwrap();
        v["hook_state"] = json!({"n": 1});
        std::fs::write(team.task(&a.id).unwrap(), v.to_string()).unwrap();
        s.claim(None, "alice", 1).unwrap();
        let raw: Value =
            serde_json::from_slice(&std::fs::read(team.task(&a.id).unwrap()).unwrap()).unwrap();
        assert_eq!(raw["hook_state"], json!({"n": 1}));
        assert_eq!(raw["status"], json!("in_progress"));
    }
}
