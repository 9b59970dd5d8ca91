//! The team's hooks (see [`troupe::hooks`]): a thread of the supervisor that runs the user's
//! commands on what is waiting for them, and applies their verdicts.
//!
//! Nothing is queued in memory. What waits for a hook is marked in the files it is about, in
//! the same write that made it happen: a task created while the team has `task_created` hooks
//! carries `created_hook_pending`, a completion is held as `completing`, and a teammate that goes
//! idle marks `idle_hook_pending` in its roster record. The thread looks for those marks when it
//! starts and whenever the team dir or the board changes, so an event that happened while no
//! supervisor ran is hooked by the next `lead run`. A verdict is applied only if the mark is
//! still there, and the mark goes with it: a hook runs at least once per event, and again only
//! if the supervisor dies between the hook's exit and the verdict. A `task_completed` verdict
//! is on one completion (the task's `completion` count when its hooks started): a task reopened
//! and completed again meanwhile is judged by a run of its own, and the old verdict is dropped.
//!
//! A hook runs with `sh -c` in the working dir of the member the event is about, with the event
//! as JSON on stdin, in that member's sandbox (the same as its commands': the team dir hidden,
//! no key, `--sandbox-read/-write` applied), or in a sandbox of the team's working dir with no
//! member for a task the lead or a person created; only a hook marked `sandbox = false` runs as
//! the supervisor's user, in its own process group, with the API key variables removed (its
//! stderr may go to a model). A stop of the supervisor kills the running one; its event stays
//! marked for the next start.
//!
//! Running outside the sandbox is honoured only for a hook `lead up` applied from a team file
//! that passed its trust check, as recorded in the team dir ([`troupe::hooks::trusted`]): any
//! other (a `config.json` written by hand, or by whatever could write it) runs sandboxed, with
//! a warning and a `hook_sandboxed` event saying why. A paging hook (`request_pending`) so
//! applied runs as the supervisor's user from `/`, with a PATH of system dirs, and only if its
//! command names no file a member can write ([`troupe::hooks::paging`]); otherwise it is not
//! run, and a `hook_refused` event says why.
//!
//! A gate's verdict is [`troupe::hooks::outcome`]: only exit 0 passes; a hook that could not
//! start sends the work back like any other failure, with the reason.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::AsFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};
use troupe::TeamDir;
use troupe::config::{MemberStatus, Roster, TeamConfig};
use troupe::events;
use troupe::hooks::{Exit, Hook, HookEvent, Outcome, outcome};
use troupe::inbox::Durability;
use troupe::mail::Stopped;
use troupe::message::{Message, MessageType};
use troupe::sandbox::{Sandbox, Settings as SandboxSettings};
use troupe::store::Watched;
use troupe::tasks::{Task, TaskStatus, TaskStore};
use troupe::teamdir::LEAD;

/// The most of a hook's stdout and stderr kept (each); the rest is read and dropped.
const OUTPUT_CAP: usize = 16 * 1024;

/// The dirs a paging hook's PATH is made of, less any that lies in a member-writable tree.
const SYSTEM_PATH: [&str; 6] = [
    "/usr/local/sbin",
    "/usr/local/bin",
    "/usr/sbin",
    "/usr/bin",
    "/sbin",
    "/bin",
];

/// Variables that make a shell or an interpreter load code from where they point: a paging
/// hook runs without them (a command that needs one names it: `PYTHONPATH=/opt/p python3 ...`,
/// which is checked like the rest of the command).
const LOADER_VARS: [&str; 16] = [
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "BASH_ENV",
    "ENV",
    "CDPATH",
    "PYTHONPATH",
    "PYTHONSTARTUP",
    "PYTHONHOME",
    "NODE_PATH",
    "NODE_OPTIONS",
    "PERL5LIB",
    "PERL5OPT",
    "PERLLIB",
    "RUBYLIB",
    "RUBYOPT",
    "LUA_PATH",
];

/// The running hook thread.
pub struct Hooks {
    thread: super::stoppable::Stoppable,
}

impl Hooks {
    /// Starts the thread for `team`, whose members work in `workdir` unless they have a dir of
    /// their own.
    /// On a bus, `host` is the supervisor's: a teammate's hooks run on its own host.
    /// With `escalate_after`, a request pending that long runs the `request_pending` hooks.
    pub fn start(
        team: TeamDir,
        workdir: PathBuf,
        host: Option<String>,
        sandbox: SandboxSettings,
        escalate_after: Option<Duration>,
    ) -> anyhow::Result<Hooks> {
        std::fs::create_dir_all(team.tasks_dir())?;
        let thread = super::stoppable::Stoppable::start("hooks", move |stop, wake| {
            let runner = Runner {
                store: TaskStore::new(&team),
                merges: troupe::merge::MergeStore::new(&team),
                team,
                workdir,
                host,
                stop,
                sandbox,
                sandboxes: Mutex::new(HashMap::new()),
                roster: Mutex::new(Default::default()),
                escalate_after,
                sandboxed_said: Mutex::new(Default::default()),
            };
            runner.run(&wake);
        })?;
        Ok(Hooks { thread })
    }

    /// Stops the thread: a hook running now is killed, and its event stays for the next start.
    pub fn stop(self) {
        self.thread.stop();
    }
}

struct Runner {
    team: TeamDir,
    store: TaskStore,
    merges: troupe::merge::MergeStore,
    workdir: PathBuf,
    host: Option<String>,
    stop: Arc<AtomicBool>,
    /// The sandbox settings of `lead run`, which its workers get too.
    sandbox: SandboxSettings,
    /// Sandboxes prepared for hooks, by member and working dir, with the worktree record each
    /// was prepared for.
    sandboxes: Mutex<SandboxCache>,
    /// The roster as the last pass read it, and what it read: a pass reads again only the
    /// members' records the watch saw change.
    roster: Mutex<(troupe::config::RosterSeen, TeamConfig)>,
    /// `lead run --escalate-after`.
    escalate_after: Option<Duration>,
    /// The hooks whose `sandbox = false` was not honoured, by event and command: warned of once
    /// per supervisor life, not at every run.
    sandboxed_said: Mutex<std::collections::HashSet<(HookEvent, String)>>,
}

type SandboxCache = HashMap<String, (Option<troupe::worktree::Worktree>, Arc<Sandbox>)>;

/// Where a hook runs and what it is about.
struct Place<'a> {
    cwd: &'a Path,
    member: Option<&'a str>,
    worktree: Option<&'a troupe::worktree::Worktree>,
    task: Option<&'a str>,
    /// A paging hook's PATH (system dirs only), given instead of the supervisor's; the
    /// [`LOADER_VARS`] are removed with it.
    path: Option<&'a str>,
}

/// How a hook's process ended.
struct Ended {
    code: Option<i32>,
    signal: Option<i32>,
    timed_out: bool,
    stdout_bytes: usize,
    stderr: String,
}

/// What one run of a hook came to.
struct Ran {
    outcome: Outcome,
    /// What the work is sent back with when it blocks ([`troupe::hooks::reason`]).
    reason: String,
}

/// How often requests are looked at for `request_pending` hooks.
const PAGE_EVERY: Duration = Duration::from_secs(1);

/// The shortest time between two passes of the hooks thread (see [`Runner::run`]): what a hook
/// may wait beyond the change that makes it due.
const PASS_GAP: Duration = Duration::from_millis(50);

impl Runner {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn run(&self, wake: &std::os::unix::net::UnixStream) {
        // The roster and the board: config.json and tasks/ID.json replaced in a team dir, or
        // the bus's change feed.
        let watch = self
            .team
            .store()
            .watch(&[Watched::Roster, Watched::Tasks])
            .map_err(|e| tracing::warn!("hooks: {e}; looking once a second instead"))
            .ok();
        if watch.is_some() {
            self.roster_seen().0.watched();
        }
        let mut due = true;
        let mut last_pass: Option<Instant> = None;
        let mut last_page: Option<Instant> = None;
        while !self.stopped() {
            // Pending requests grow old without a change to wake anyone: a look every second.
            if self.escalate_after.is_some() && last_page.is_none_or(|t| t.elapsed() >= PAGE_EVERY)
            {
                if let Err(e) = self.page_pending() {
                    tracing::warn!("hooks: {e:#}");
                }
                last_page = Some(Instant::now());
            }
            // Passes at most every PASS_GAP: each reads the whole roster and the board, and
            // a team of hundreds starting or stopping rewrites the roster hundreds of times a
            // second. The changes of a gap are looked at together in the next pass.
            let gap = last_pass.map_or(Duration::ZERO, |t| PASS_GAP.saturating_sub(t.elapsed()));
            if due && gap.is_zero() {
                if let Err(e) = self.pass() {
                    tracing::warn!("hooks: {e:#}");
                }
                last_pass = Some(Instant::now());
                due = false;
            }
            let mut fds = vec![PollFd::new(wake.as_fd(), PollFlags::POLLIN)];
            if let Some(w) = &watch {
                fds.push(PollFd::new(w.fd(), PollFlags::POLLIN));
            }
            // Still due (within the gap): until the gap is over; otherwise until a change.
            let timeout = if due {
                PollTimeout::try_from(gap.as_millis().clamp(1, 1000) as i32)
                    .unwrap_or(PollTimeout::MAX)
            } else {
                PollTimeout::from(1000u16)
            };
            let _ = poll(&mut fds, timeout);
            // Without a watch, a look every second.
            due |= watch.is_none();
            drop(fds);
            if let Some(w) = &watch {
                due |= w.changed();
                self.roster_seen().0.note_changes(w.take_members());
            }
        }
    }

    fn roster_seen(&self) -> std::sync::MutexGuard<'_, (troupe::config::RosterSeen, TeamConfig)> {
        self.roster.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The roster now, reading only what changed since the last call; `None` while it cannot
    /// be read (a person's edit of config.json in progress).
    fn roster_now(&self) -> Option<TeamConfig> {
        let mut kept = self.roster_seen();
        let (seen, cfg) = &mut *kept;
        // Read again once it parses: the unparsable view is not taken as seen.
        Roster::new(&self.team)
            .load_into(seen, cfg)
            .ok()
            .map(|_| cfg.clone())
    }

    /// Whether this supervisor runs the board's hooks (`task_created`, `task_completed`): on one
    /// machine, yes; on a bus, only the live host first in name order, so that each event's
    /// hooks run on one host (while hosts come and go two may both run one: at least once, as
    /// ever; the verdict is applied once).
    fn runs_task_hooks(&self) -> bool {
        let Some(me) = &self.host else {
            return true;
        };
        match self.team.store().live_hosts() {
            Ok(Some(live)) => live.first().is_none_or(|first| first == me),
            Ok(None) => true,
            Err(_) => false,
        }
    }

    /// Runs the `request_pending` hooks of each request pending longer than `--escalate-after`
    /// that has not had them (`paged_at`), oldest first; on a bus, on one host. The request
    /// is marked after its hooks exit: a restart between the two runs them again.
    fn page_pending(&self) -> anyhow::Result<()> {
        let Some(after) = self.escalate_after else {
            return Ok(());
        };
        let Some(cfg) = self.roster_now() else {
            return Ok(());
        };
        if !troupe::hooks::any_for(&cfg.hooks, HookEvent::RequestPending) || !self.runs_task_hooks()
        {
            return Ok(());
        }
        let store = troupe::requests::RequestStore::new(&self.team);
        let now = troupe::fsutil::now();
        let mut due: Vec<_> = store
            .list(Some(troupe::requests::RequestStatus::Pending))?
            .into_iter()
            .filter(|r| r.paged_at.is_none() && now - r.created_at >= after.as_secs_f64())
            .collect();
        due.sort_by(|a, b| a.created_at.total_cmp(&b.created_at));
        if due.is_empty() {
            return Ok(());
        }
        let applied = self.applied_hooks();
        let paging = self.paging_places(&cfg);
        for req in due {
            if self.stopped() {
                return Ok(());
            }
            // Answered or expired since the listing: nobody needs paging.
            if store.get(&req.request_id)?.status != troupe::requests::RequestStatus::Pending {
                continue;
            }
            let waited = now - req.created_at;
            let mut doc = serde_json::to_value(&req)?;
            doc["event"] = json!(HookEvent::RequestPending);
            doc["waited_secs"] = json!(waited);
            // A page that runs sandboxed (one `lead up` did not apply) finds no team dir.
            let sandboxed_doc = doc.to_string();
            doc["team_dir"] = json!(self.team.root());
            let in_workdir = Place {
                cwd: &self.workdir,
                member: None,
                worktree: None,
                task: None,
                path: None,
            };
            let from_root = Place {
                cwd: Path::new("/"),
                path: Some(paging.path.as_str()),
                ..in_workdir
            };
            for hook in cfg
                .hooks
                .iter()
                .filter(|h| h.event == HookEvent::RequestPending)
            {
                let ran = if !troupe::hooks::trusted(hook, &applied) {
                    self.sandboxed(hook);
                    let hook = Hook {
                        sandbox: true,
                        ..hook.clone()
                    };
                    self.run_one(&hook, &sandboxed_doc, &in_workdir)
                } else if let Some(why) = paging.refusal(&hook.command) {
                    self.refused(hook, &req.request_id, &why);
                    continue;
                } else {
                    // Outside the sandbox whatever the hook says: it pages a person.
                    let hook = Hook {
                        sandbox: false,
                        ..hook.clone()
                    };
                    self.run_one(&hook, &doc.to_string(), &from_root)
                };
                if ran.is_none() {
                    // Stopped meanwhile: the request is paged by the next start.
                    return Ok(());
                }
            }
            store.mark_paged(&req.request_id)?;
            events::log(
                &self.team,
                "request_pending",
                json!({
                    "request_id": req.request_id, "kind": req.kind, "from": req.from,
                    "to": req.to, "waited_secs": waited,
                }),
            );
        }
        Ok(())
    }

    /// Runs the hooks of everything marked as waiting for them, oldest first within each kind.
    fn pass(&self) -> anyhow::Result<()> {
        // An unreadable config.json (a person's edit in progress): the marks wait.
        let Some(cfg) = self.roster_now() else {
            return Ok(());
        };
        // One read of the board per pass (a pass follows every roster write). What changes
        // meanwhile changes a task file, which wakes the thread for another pass; each verdict
        // is checked against the task as it is then.
        let board = self.store.list(None)?;
        let task_hooks_here = self.runs_task_hooks();
        for t in board
            .iter()
            .filter(|t| task_hooks_here && t.created_hook_pending)
        {
            if self.stopped() {
                return Ok(());
            }
            self.task_created(&cfg, t)?;
        }
        for t in board
            .iter()
            .filter(|t| task_hooks_here && t.status == TaskStatus::Completing)
        {
            if self.stopped() {
                return Ok(());
            }
            // Passed already, and in the merge queue until it lands.
            let entry = troupe::merge::task_entry_id(&t.id, t.completion);
            if self.merges.find(&entry)?.is_some() {
                continue;
            }
            self.task_completed(&cfg, t)?;
        }
        for m in &cfg.members {
            if self.stopped() {
                return Ok(());
            }
            if self.host.is_some() && m.host != self.host {
                continue;
            }
            if let Some(calls) = m.idle_hook_pending {
                self.teammate_idle(&cfg, &m.name, calls)?;
            }
        }
        Ok(())
    }

    fn task_created(&self, cfg: &TeamConfig, t: &Task) -> anyhow::Result<()> {
        let creator = member_of(cfg, &t.created_by);
        let event = json!({"event": HookEvent::TaskCreated, "task": t});
        let Some(ran) = self.run_all(cfg, HookEvent::TaskCreated, &event, creator, Some(&t.id))
        else {
            return Ok(());
        };
        let passed = ran.outcome != Outcome::Block;
        let why = format!("refused by a task_created hook: {}", ran.reason);
        let Some(task) = self.store.settle_created(&t.id, passed, &why)? else {
            return Ok(());
        };
        if passed {
            troupe::tasks::wake_claimers(&self.team, None);
        } else if task.status == TaskStatus::Cancelled
            && let Some(creator) = creator
        {
            tell(
                &self.team,
                creator,
                &format!("hook:task_created:{}", t.id),
                format!(
                    "The task_created hook refused task {} ({}); it is cancelled. The hook said:\n{}",
                    t.id, t.subject, ran.reason
                ),
            );
        }
        Ok(())
    }

    fn task_completed(&self, cfg: &TeamConfig, t: &Task) -> anyhow::Result<()> {
        let owner = t.owner.as_deref().and_then(|o| member_of(cfg, o));
        let event = json!({"event": HookEvent::TaskCompleted, "task": t});
        let Some(ran) = self.run_all(cfg, HookEvent::TaskCompleted, &event, owner, Some(&t.id))
        else {
            return Ok(());
        };
        // The verdict is on this completion of the task (`t` as the hooks got it); the task
        // may have been reopened and completed again meanwhile.
        if ran.outcome != Outcome::Block {
            // A worktree member's work is integrated first: the task completes when it lands.
            if let Some(m) = owner.and_then(|o| cfg.member(o))
                && let Some(wt) = &m.worktree
            {
                // Taken from the member's store by a fetch that checks every object; a branch
                // that cannot be taken sends the task back, saying why.
                let commit = match troupe::worktree::take_branch(wt) {
                    Ok(c) => c.unwrap_or_default(),
                    Err(e) => {
                        let (why, branch) = (e.to_string(), &wt.branch);
                        return send_task_back(
                            &self.team,
                            &self.store,
                            t,
                            &format!("merge:take:{}:{}", t.id, t.completion),
                            |n| {
                                format!(
                                    "Task {} ({}) is back with you: the merge queue could not take your branch {branch}: {why}",
                                    n.id, n.subject
                                )
                            },
                            |n, o| {
                                format!(
                                    "Task {} ({}) is pending: the merge queue could not take {o}'s branch {branch}: {why}",
                                    n.id, n.subject
                                )
                            },
                            None,
                        );
                    }
                };
                self.merges.enqueue(&troupe::merge::NewEntry {
                    member: m.name.clone(),
                    branch: wt.branch.clone(),
                    commit,
                    task: Some((t.id.clone(), t.completion)),
                    host: m.host.clone(),
                })?;
                return Ok(());
            }
            let settled =
                self.store
                    .settle_completion(&t.id, t.completion, true, |_| false, |_| ())?;
            if settled.is_some() {
                troupe::tasks::wake_claimers(&self.team, None);
            }
            return Ok(());
        }
        let said = ran.reason.as_str();
        send_task_back(
            &self.team,
            &self.store,
            t,
            &format!("hook:task_completed:{}:{}", t.id, t.completion),
            |next| {
                format!(
                    "The task_completed hook sent task {} ({}) back to you: it is in_progress and \
                     yours again. Fix what it says, then call task_update with status completed \
                     again. The hook said:\n{said}",
                    next.id, next.subject,
                )
            },
            |task, owner| {
                format!(
                    "The task_completed hook sent task {} ({}) back, but {owner} has ended: it is \
                     pending for anyone. The hook said:\n{said}",
                    task.id, task.subject,
                )
            },
            None,
        )
    }

    fn teammate_idle(&self, cfg: &TeamConfig, name: &str, calls: u64) -> anyhow::Result<()> {
        let Some(me) = cfg.member(name) else {
            return Ok(());
        };
        let event = json!({
            "event": HookEvent::TeammateIdle,
            "member": {"name": me.name, "role": me.role, "status": me.status, "calls": calls},
        });
        let Some(ran) = self.run_all(cfg, HookEvent::TeammateIdle, &event, Some(name), None) else {
            return Ok(());
        };
        if ran.outcome == Outcome::Block && !me.status.is_terminal() {
            tell(
                &self.team,
                name,
                &format!("hook:teammate_idle:{name}:{calls}"),
                format!(
                    "A teammate_idle hook says you are not done yet:\n{}",
                    ran.reason
                ),
            );
        }
        Roster::new(&self.team).write_member(name, false, &mut |c| {
            if let Some(m) = c.member_mut(name)
                && m.idle_hook_pending == Some(calls)
            {
                m.idle_hook_pending = None;
            }
        })?;
        Ok(())
    }

    /// Runs every hook of `event` in order until one blocks; `None` if stopped meanwhile (the
    /// verdict is left for the next start).
    fn run_all(
        &self,
        cfg: &TeamConfig,
        event: HookEvent,
        doc: &Value,
        member: Option<&str>,
        task: Option<&str>,
    ) -> Option<Ran> {
        let record = member.and_then(|m| cfg.member(m));
        let worktree = record.and_then(|m| m.worktree.clone());
        let cwd = record
            .and_then(member_workdir)
            .unwrap_or_else(|| self.workdir.clone());
        let at = Place {
            cwd: &cwd,
            member,
            worktree: worktree.as_ref(),
            task,
            path: None,
        };
        let hooks: Vec<&Hook> = cfg.hooks.iter().filter(|h| h.event == event).collect();
        let applied = if hooks.iter().any(|h| troupe::hooks::runs_outside(h)) {
            self.applied_hooks()
        } else {
            Vec::new()
        };
        for hook in hooks {
            let hook = if troupe::hooks::trusted(hook, &applied) {
                hook.clone()
            } else {
                self.sandboxed(hook);
                Hook {
                    sandbox: true,
                    ..hook.clone()
                }
            };
            let mut doc = doc.clone();
            // Only a hook outside the sandbox can reach the team dir.
            if !hook.sandbox {
                doc["team_dir"] = json!(self.team.root());
            }
            let ran = self.run_one(&hook, &doc.to_string(), &at)?;
            if ran.outcome == Outcome::Block {
                return Some(ran);
            }
        }
        Some(Ran {
            outcome: Outcome::Proceed,
            reason: String::new(),
        })
    }

    /// The hooks `lead up` last applied that run outside the sandbox, as its record in the team
    /// dir says; none while that record cannot be read (then every hook runs sandboxed).
    fn applied_hooks(&self) -> Vec<Hook> {
        match crate::up_trust::Record::load(&self.team) {
            Ok(r) => r.hooks,
            Err(e) => {
                tracing::warn!(
                    "hooks: the record of what `lead up` applied cannot be read ({e:#}): every \
                     hook runs sandboxed"
                );
                Vec::new()
            }
        }
    }

    /// Says (once per supervisor life) that `hook`, which asks to run outside the sandbox, runs
    /// in it: no team file `lead up` applied holds it.
    fn sandboxed(&self, hook: &Hook) {
        let first = self
            .sandboxed_said
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert((hook.event, hook.command.clone()));
        if !first {
            return;
        }
        let why = "it is not a hook `lead up` applied from a team file, so it runs in the \
                   sandbox: outside it runs only what a person applied with `lead up FILE`";
        tracing::warn!("hook {:?} on {}: {why}", hook.command, hook.event);
        events::log(
            &self.team,
            "hook_sandboxed",
            json!({"hook": hook.event, "command": hook.command, "why": why}),
        );
    }

    /// Says that paging hook `hook` is not run for request `request_id`, and why.
    fn refused(&self, hook: &Hook, request_id: &str, why: &str) {
        let why = format!(
            "{why}: a paging hook runs as your user from /, with a PATH of system dirs, and must \
             name no file a teammate's commands can write (give its program by an absolute \
             path outside those trees)"
        );
        tracing::warn!("request_pending hook {:?} not run: {why}", hook.command);
        events::log(
            &self.team,
            "hook_refused",
            json!({
                "hook": hook.event, "command": hook.command, "request_id": request_id,
                "why": why,
            }),
        );
    }

    /// What the paging hooks of roster `cfg` are checked against: the trees the members'
    /// commands can write, and the PATH they get.
    fn paging_places(&self, cfg: &TeamConfig) -> Paging {
        let trees = crate::up_trust::member_trees(
            self.team.root(),
            cfg,
            &self.workdir,
            &self.sandbox.write,
        )
        .map_err(|e| format!("the trees teammates can write cannot be told ({e:#})"));
        let dirs: Vec<&str> = SYSTEM_PATH
            .into_iter()
            .filter(|d| {
                trees
                    .as_ref()
                    .is_ok_and(|t| crate::up_trust::locate(Path::new(d), t).is_none())
            })
            .collect();
        Paging {
            trees,
            path: dirs.join(":"),
            home: std::env::var_os("HOME").map(PathBuf::from),
        }
    }

    fn run_one(&self, hook: &Hook, input: &str, at: &Place<'_>) -> Option<Ran> {
        let started = Instant::now();
        let ended = if hook.sandbox {
            self.run_sandboxed(hook, input, at)
        } else {
            self.run_unsandboxed(hook, input, at)
        };
        let (exit, stderr, mut fields) = match ended? {
            Ok(e) => {
                let code = if e.timed_out { None } else { e.code };
                let exit = match (e.timed_out, code, e.signal) {
                    (true, ..) => Exit::TimedOut(hook.timeout()),
                    (false, Some(c), _) => Exit::Code(c),
                    (false, None, Some(sig)) => Exit::Signal(sig),
                    (false, None, None) => {
                        Exit::NotStarted("its exit status could not be read".to_owned())
                    }
                };
                let fields = json!({
                    "code": code,
                    "signal": e.signal,
                    "timed_out": e.timed_out,
                    "stdout_bytes": e.stdout_bytes,
                });
                (exit, e.stderr, fields)
            }
            Err(why) => (
                Exit::NotStarted(why.clone()),
                String::new(),
                json!({"error": why}),
            ),
        };
        let result = outcome(&exit);
        let reason = troupe::hooks::reason(&exit, &stderr);
        // A page's exit only says whether the page went out.
        let said = match (hook.event.gates(), result) {
            (true, r) => r.as_str(),
            (false, Outcome::Proceed) => "paged",
            (false, Outcome::Block) => "failed",
        };
        let tail: String = stderr.chars().take(2000).collect();
        if let Value::Object(f) = &mut fields {
            f.insert("sandbox".into(), json!(hook.sandbox));
            f.insert("outcome".into(), json!(said));
            f.insert("stderr".into(), json!(tail));
        }
        self.log(hook, at, fields, started);
        // A plain exit of a gate is its verdict; anything else is worth a line in the log.
        if !matches!(exit, Exit::Code(_)) || (!hook.event.gates() && result == Outcome::Block) {
            let then = if hook.event.gates() {
                "the work is sent back"
            } else {
                "nobody was paged by it"
            };
            tracing::warn!(
                "hook {:?} on {}: {}; {then}",
                hook.command,
                hook.event,
                reason.lines().next().unwrap_or_default()
            );
        }
        Some(Ran {
            outcome: result,
            reason,
        })
    }

    /// The sandbox of the member the event is about (or of the team's working dir with no
    /// member), prepared once per member and place, as its worker prepares its own.
    fn sandbox_for(&self, at: &Place<'_>) -> Arc<Sandbox> {
        let name = at.member.unwrap_or("hooks");
        let key = format!("{name}\0{}", at.cwd.display());
        let mut cache = self.sandboxes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((wt, sb)) = cache.get(&key)
            && wt.as_ref() == at.worktree
        {
            return sb.clone();
        }
        let sb = Arc::new(Sandbox::prepare(
            &self.sandbox,
            at.cwd,
            self.team.root(),
            name,
            at.worktree,
        ));
        cache.insert(key, (at.worktree.cloned(), sb.clone()));
        sb
    }

    /// `sh -c COMMAND` in the member's sandbox, through the keeper its commands run under:
    /// the team dir hidden, no key, no `TROUPE_TEAM_DIR`, everything it starts killed when it
    /// ends or times out. `None`: stopped meanwhile.
    fn run_sandboxed(
        &self,
        hook: &Hook,
        input: &str,
        at: &Place<'_>,
    ) -> Option<Result<Ended, String>> {
        let sb = self.sandbox_for(at);
        let mut env = vec![(
            "TROUPE_HOOK_EVENT".to_owned(),
            hook.event.as_str().to_owned(),
        )];
        if let Some(m) = at.member {
            env.push(("TROUPE_MEMBER".to_owned(), m.to_owned()));
        }
        if let Some(t) = at.task {
            env.push(("TROUPE_TASK_ID".to_owned(), t.to_owned()));
        }
        let stopped = || self.stopped();
        let r = troupe::tools::confined::run_confined(&troupe::tools::confined::Confined {
            sandbox: &sb,
            workdir: at.cwd,
            command: &hook.command,
            env: &env,
            stdin: input.as_bytes(),
            timeout: hook.timeout(),
            stop: &stopped,
        });
        if r.stopped {
            return None;
        }
        if let Some(e) = r.error {
            return Some(Err(e));
        }
        Some(Ok(Ended {
            code: r.code,
            signal: r.signal,
            timed_out: r.timed_out,
            stdout_bytes: r.stdout.len(),
            stderr: String::from_utf8_lossy(&r.stderr[..r.stderr.len().min(OUTPUT_CAP)])
                .into_owned(),
        }))
    }

    /// `sh -c COMMAND` as the supervisor's user, in its own process group (a hook the team
    /// file marks `sandbox = false`). `None`: stopped meanwhile.
    fn run_unsandboxed(
        &self,
        hook: &Hook,
        input: &str,
        at: &Place<'_>,
    ) -> Option<Result<Ended, String>> {
        let started = Instant::now();
        // The system's shell, not one a PATH entry could put first.
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(&hook.command)
            .current_dir(at.cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .env("TROUPE_HOOK_EVENT", hook.event.as_str())
            .env("TROUPE_TEAM_DIR", self.team.root())
            .env_remove("ANTHROPIC_API_KEY")
            .env_remove("OPENAI_API_KEY")
            .env_remove(troupe::secrets::BUS_PASSWORD_ENV)
            .env_remove(troupe::secrets::BUS_PASSWORD_FILE_ENV)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID");
        // The trace export's settings (its headers often hold a key) are not a hook's.
        for (k, _) in std::env::vars_os() {
            if troupe::telemetry::hidden_var(&k) {
                cmd.env_remove(k);
            }
        }
        if let Some(m) = at.member {
            cmd.env("TROUPE_MEMBER", m);
        }
        if let Some(t) = at.task {
            cmd.env("TROUPE_TASK_ID", t);
        }
        if let Some(path) = at.path {
            cmd.env("PATH", path);
            for v in LOADER_VARS {
                cmd.env_remove(v);
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return Some(Err(e.to_string())),
        };
        let pgid = Pid::from_raw(child.id() as i32);
        let feed = child.stdin.take().map(|mut w| {
            let input = input.to_owned();
            // A hook that does not read its stdin gets EPIPE here, not a stuck supervisor.
            std::thread::spawn(move || {
                let _ = w.write_all(input.as_bytes());
            })
        });
        let out = child.stdout.take().map(capture);
        let err = child.stderr.take().map(capture);
        let deadline = started + hook.timeout();
        let mut timed_out = false;
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break Some(s),
                Ok(None) => {}
                Err(_) => break None,
            }
            if self.stopped() || Instant::now() >= deadline {
                timed_out = !self.stopped();
                let _ = killpg(pgid, Signal::SIGKILL);
                let s = child.wait().ok();
                if !timed_out {
                    // Stopped: no verdict; the event stays marked for the next start.
                    return None;
                }
                break s;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        // Whatever the hook left behind in its group goes with it.
        let _ = killpg(pgid, Signal::SIGKILL);
        drop(feed);
        let text = |h: Option<std::sync::mpsc::Receiver<String>>| {
            h.and_then(|r| r.recv_timeout(Duration::from_secs(1)).ok())
                .unwrap_or_default()
        };
        let (stdout, stderr) = (text(out), text(err));
        Some(Ok(Ended {
            code: status.and_then(|s| s.code()),
            signal: status.and_then(|s| s.signal()),
            timed_out,
            stdout_bytes: stdout.len(),
            stderr,
        }))
    }

    fn log(&self, hook: &Hook, at: &Place<'_>, more: Value, started: Instant) {
        let mut fields = json!({
            "hook": hook.event, "command": hook.command, "member": at.member, "task": at.task,
            "ms": started.elapsed().as_millis() as u64,
        });
        if let (Value::Object(f), Value::Object(m)) = (&mut fields, more) {
            f.extend(m);
        }
        events::log(&self.team, "hook_ran", fields);
    }
}

/// What a paging hook's command is checked against ([`troupe::hooks::paging::refusal`]).
struct Paging {
    /// The trees the members' commands can write (an error: they cannot be told, and every
    /// paging hook is refused).
    trees: Result<Vec<crate::up_trust::Tree>, String>,
    /// The PATH it gets: [`SYSTEM_PATH`] less any dir in one of the trees.
    path: String,
    home: Option<PathBuf>,
}

impl Paging {
    /// Why `command` may not run as a paging hook, if it may not.
    fn refusal(&self, command: &str) -> Option<String> {
        let trees = match &self.trees {
            Ok(t) => t,
            Err(e) => return Some(e.clone()),
        };
        let writable = |p: &Path| crate::up_trust::locate(p, trees).map(|t| t.what);
        let on_path = |name: &str| {
            self.path
                .split(':')
                .map(|d| Path::new(d).join(name))
                .find(|p| p.is_file())
        };
        troupe::hooks::paging::refusal(
            command,
            &troupe::hooks::paging::Places {
                writable: &writable,
                on_path: &on_path,
                home: self.home.as_deref(),
            },
        )
    }
}

/// A message from the lead to teammate `to`, with an id derived from `key` (a repeat after a
/// crash is dropped by the recipient). Best effort: a failure is logged.
pub(super) fn tell(team: &TeamDir, to: &str, key: &str, text: String) {
    let mut msg = Message::new(MessageType::Message, LEAD, to, text);
    msg.id = troupe::ids::derived(key).to_string();
    if let Err(e) = troupe::mail::send(team, &msg, Stopped::Accept, Durability::Sync) {
        tracing::warn!("could not tell {to}: {e}");
    }
}

/// Sends completion `t.completion` of task `t` back ([`TaskStore::settle_completion`] with
/// its verdict "not passed"): to its owner, `in_progress`, told `to_owner(task)`; or, if the
/// owner has ended (read now, under the task's lock, not from a roster read earlier: it may
/// have ended meanwhile, after its exit handed back what it held), to the board, `pending`,
/// with `released_result` as its result when given, and the lead told `to_lead(task, owner)`.
/// The messages' ids derive from `key` (and `key:released`).
///
/// The owner is told under the task's lock, just before the task is back: it cannot find its
/// task still completing after it heard, and a crash between the two settles the task again
/// with the same message id, which its journal drops.
pub(super) fn send_task_back(
    team: &TeamDir,
    store: &TaskStore,
    t: &Task,
    key: &str,
    to_owner: impl FnOnce(&Task) -> String,
    to_lead: impl FnOnce(&Task, &str) -> String,
    released_result: Option<String>,
) -> anyhow::Result<()> {
    let ended = |name: &str| has_ended(team, name);
    let settled = store.settle_completion(&t.id, t.completion, false, ended, |next| {
        if next.status == TaskStatus::Pending {
            if let Some(r) = released_result {
                next.result = Some(r);
            }
            return;
        }
        if next.status != TaskStatus::InProgress {
            return;
        }
        if let Some(owner) = next.owner.as_deref() {
            tell(team, owner, key, to_owner(next));
        }
    })?;
    // An owner that ended cannot take it back: the board gets it, and the lead hears.
    if let Some(task) = settled.filter(|s| s.status == TaskStatus::Pending) {
        let owner = t.owner.as_deref().unwrap_or("its owner");
        let mut note = Message::new(
            MessageType::StatusUpdate,
            owner,
            LEAD,
            to_lead(&task, owner),
        );
        note.id = troupe::ids::derived(&format!("{key}:released")).to_string();
        if let Err(e) = troupe::mail::send(team, &note, Stopped::Accept, Durability::Sync) {
            tracing::warn!("could not tell the lead {} is pending again: {e}", task.id);
        }
        troupe::tasks::wake_claimers(team, None);
    }
    Ok(())
}

/// Whether member `name` has ended (`failed`, `shutdown`, or gone from the roster), read now:
/// what a verdict asks, under the task's lock, before it hands a task back to its owner. An
/// unreadable roster counts as live.
fn has_ended(team: &TeamDir, name: &str) -> bool {
    match Roster::new(team).load_for(name) {
        Ok(now) => now
            .member(name)
            .is_none_or(|m| matches!(m.status, MemberStatus::Failed | MemberStatus::Shutdown)),
        Err(e) => {
            tracing::warn!("could not read the roster: {e}; {name} is taken as live");
            false
        }
    }
}

/// `name` if it is a member of the team (a task's creator may be the lead).
fn member_of<'a>(cfg: &TeamConfig, name: &'a str) -> Option<&'a str> {
    cfg.member(name).map(|_| name)
}

/// A member's own working dir, where it has one (its worktree); else the team's.
fn member_workdir(m: &troupe::config::Member) -> Option<PathBuf> {
    m.worktree.as_ref().map(|w| w.path.clone())
}

/// Reads `r` to its end on a thread, keeping the first [`OUTPUT_CAP`] bytes (lossy UTF-8).
fn capture(mut r: impl Read + Send + 'static) -> std::sync::mpsc::Receiver<String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match r.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let room = OUTPUT_CAP.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                }
            }
        }
        let _ = tx.send(String::from_utf8_lossy(&kept).into_owned());
    });
    rx
}
