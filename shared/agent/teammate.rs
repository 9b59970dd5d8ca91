//! The teammate agent: the loop one `worker` process runs until an approved shutdown.
//!
//! One activation: drain the inbox (journaled), show unseen messages to the model as one user
//! turn, call the model, run the tools it asks for, journal all results as one entry, repeat
//! until the model stops asking for tools or the call budget is spent. Then: an
//! `idle_notification` to the lead (journaled first, so that it is sent exactly once whatever
//! stops the process), status `idle`, and a blocking wait on the inbox. Every step is journaled
//! (fsynced) before the next, so a `kill -9` anywhere resumes from the journal.

use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::agent::compaction;
use crate::agent::conversation::{self, Rebuilt};
use crate::agent::outage::{self, OnFailure};
use crate::config::{Activity, ActivityState, MemberStatus, Roster, RosterWriter};
use crate::error::Result;
use crate::events;
use crate::fsutil;
use crate::inbox::{Durability, Inbox};
use crate::llm::{Block, ChatRequest, ChatResponse, LlmError, Provider, StopReason};
use crate::mail::{self, Stopped};
use crate::message::{Message, MessageType};
use crate::requests::{NewRequest, RequestKind, RequestStatus, RequestStore};
use crate::teamdir::{AgentName, LEAD, TeamDir};
use crate::tools::{self, ToolOutput};
use crate::transcript::{Entry, Journal, ToolTiming};
use crate::wait::{self, InboxWaiter, Wake};

/// Settings of one teammate process.
#[derive(Debug, Clone)]
pub struct Settings {
    pub team: TeamDir,
    pub name: AgentName,
    pub workdir: PathBuf,
    /// Model calls allowed per activation.
    pub max_calls: u64,
    /// The model's context size in tokens (`None`: the default of its family); the
    /// conversation is compacted to stay inside it (see [`compaction`]).
    pub context_tokens: Option<u64>,
    pub max_tokens: u32,
    pub bash_timeout: Duration,
    /// The sandbox of its `bash` commands.
    pub sandbox: std::sync::Arc<crate::sandbox::Sandbox>,
    /// The longest wait between tries while the model API is down (see [`outage`]).
    pub api_wait_max: Duration,
    /// What its calls cost (the ledger in its record; see [`crate::cost`]).
    pub prices: Arc<crate::cost::PriceTable>,
    /// Its worktree, as the roster recorded it when the worker started: its branch is taken
    /// into the repository before it says `idle` (see [`Teammate::take_own_branch`]).
    pub worktree: Option<crate::worktree::Worktree>,
}

/// How the loop ended.
#[derive(Debug)]
pub enum Outcome {
    /// An approved shutdown: exit 0.
    Shutdown,
    /// SIGTERM/SIGINT: the current step was finished and persisted.
    Terminated,
    /// The model provider failed for good.
    Llm(LlmError),
}

/// How old the roster this process's own latest write left may be for a look at the whole
/// roster (the budgets, its settings) to use it instead of reading it again. A budget check
/// looks at what other members spend meanwhile anyway; a look right after the write that
/// began an activation, or recorded a call, sees what a read would have seen a few
/// milliseconds earlier, and one after a longer step (a tool, a wait) reads.
const RECENT: Duration = Duration::from_millis(50);

/// A running teammate.
pub struct Teammate {
    s: Settings,
    provider: Box<dyn Provider>,
    /// This incarnation's heartbeat, for the supervisor's watchdog.
    beater: crate::store::beat::Beater,
    journal: Journal,
    conv: Rebuilt,
    inbox: Inbox,
    /// Writes to this member's record; they wait out an unreadable config.json.
    record: RosterWriter,
    requests: RequestStore,
    incarnation: u64,
    role: String,
    prompt: String,
    model: String,
    /// Whether mutating tools wait for an approved plan (`require_plan_approval`), as of the
    /// latest task assignment.
    plan_gate: bool,
    /// When the latest task was assigned: only a plan submitted after it opens the gate.
    task_at: Option<f64>,
    gate_open: bool,
    shutdown_approved: bool,
    /// The status this process last wrote, so an unchanged status costs no roster write.
    status: Option<MemberStatus>,
    /// The activity this process last wrote, for the same reason.
    shown: Option<Activity>,
    /// Claims tasks of the board by itself whenever it would go idle.
    auto_claim: bool,
    /// The model call for which a compaction was forced by a "prompt too long" answer.
    forced_compaction: Option<u64>,
    /// The wait before the previous retry, while the model API is down.
    outage_wait: Option<Duration>,
    /// When the model API went down, while it is down.
    outage_since: Option<f64>,
    /// Ids of the undelivered idle notifications ([`Rebuilt::undelivered`]) this process has
    /// put in the lead's inbox and whose hook mark it has handed to `record`: what is left of
    /// their idle step is the roster write and the journal entry saying it is done.
    idle_sent: Vec<String>,
    /// The last failure to send an idle notification, so that each distinct one is logged once.
    idle_error: Option<String>,
    term: Arc<AtomicBool>,
    /// The activation under way, as exported (a no-op when nothing is).
    span: crate::telemetry::Activation,
}

/// Has the rate governor's waits for a call slot show in this member's record as
/// `waiting_slot` (with the call waited for), and the activity they replaced come back after.
fn show_slot_waits(team: &crate::TeamDir, name: &str, incarnation: u64) {
    let team = team.clone();
    let name = name.to_owned();
    let replaced: Arc<std::sync::Mutex<Option<Activity>>> = Arc::default();
    crate::governor::on_wait(move |waiting| {
        let replaced = Arc::clone(&replaced);
        let mut w = RosterWriter::new(Roster::new(&team));
        w.member(&name, Some(incarnation), move |m| {
            let mut kept = replaced.lock().unwrap_or_else(|p| p.into_inner());
            let now = m.activity.as_ref().map(|a| a.state);
            if waiting && now != Some(ActivityState::WaitingSlot) {
                let call = m.activity.as_ref().and_then(|a| a.call);
                *kept = m.activity.take();
                m.activity = Some(Activity {
                    call,
                    ..Activity::now(ActivityState::WaitingSlot)
                });
            } else if !waiting && now == Some(ActivityState::WaitingSlot) {
                m.activity = kept.take();
            }
        });
    });
}

/// Has this member's waits at the rate governor's gate (a cooldown, a call slot) beat its
/// heartbeat, with its incarnation, as they go on (R4-6: a member waiting longer than its
/// call's allowance plus `--watchdog` was killed as hung). Each beat allows the rest of the
/// call after the wait (`longest_call`) and the gate's next look.
fn beat_while_gated(team: &crate::TeamDir, name: &str, incarnation: u64, longest_call: Duration) {
    let beater = std::sync::Mutex::new(crate::store::beat::Beater::new(
        team.store(),
        name,
        incarnation,
    ));
    let allowance = longest_call + crate::llm::gate::BEAT_EVERY * 5;
    crate::llm::gate::on_still_waiting(move || {
        beater
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .beat_doing(allowance, Some("waiting at the rate governor".into()));
    });
}

impl Teammate {
    /// Opens the journal, rebuilds the conversation and records the new session. `owner` is
    /// the teammate's liveness lock (`transcripts/NAME.lock`), held for the process's lifetime.
    pub fn open(
        s: Settings,
        provider: Box<dyn Provider>,
        term: Arc<AtomicBool>,
        owner: &fsutil::HeldLock,
    ) -> Result<Teammate> {
        let roster = Roster::new(&s.team);
        let member = roster
            .load_for_patiently(s.name.as_str(), &|| term.load(Ordering::SeqCst))?
            .require(s.name.as_str())?
            .clone();
        // From here on, a newer incarnation (a successor on another host) fences this one off.
        crate::fence::act_as_member(&s.team, s.name.as_str(), member.incarnation);
        let (journal, conv) = conversation::resume(&s.team, &s.name, member.incarnation, owner)?;
        let requests = RequestStore::new(&s.team);
        let mut t = Teammate {
            beater: crate::store::beat::Beater::new(
                s.team.store(),
                s.name.as_str(),
                member.incarnation,
            ),
            inbox: Inbox::new(&s.team, &s.name),
            model: member.model.clone().unwrap_or_default(),
            incarnation: member.incarnation,
            role: member.role.clone(),
            prompt: member.prompt.clone().unwrap_or_default(),
            plan_gate: member.require_plan_approval,
            auto_claim: member.auto_claim,
            task_at: member.task_at,
            gate_open: false,
            shutdown_approved: false,
            status: None,
            shown: None,
            outage_wait: None,
            forced_compaction: None,
            outage_since: None,
            idle_sent: Vec::new(),
            idle_error: None,
            s,
            provider,
            journal,
            conv,
            record: RosterWriter::keeping_recent(roster),
            requests,
            term,
            span: crate::telemetry::Activation::none(),
        };
        t.gate_open = t.plan_approved()?;
        show_slot_waits(&t.s.team, t.s.name.as_str(), t.incarnation);
        beat_while_gated(
            &t.s.team,
            t.s.name.as_str(),
            t.incarnation,
            t.provider.longest_call(),
        );
        // Written with the first status (one roster rewrite fewer for every start).
        let sandbox = t.s.sandbox.status().clone();
        t.record
            .member_later(t.s.name.as_str(), Some(t.incarnation), move |m| {
                m.sandbox = Some(sandbox.clone())
            });
        Ok(t)
    }

    /// The whole roster as it is now, for a look at it: as this process's own write left it
    /// within the last [`RECENT`] (most looks come right after one, and each read of a team of
    /// hundreds parses hundreds of records), else read. An unreadable roster is an error.
    fn roster_now(&self) -> Result<std::borrow::Cow<'_, crate::config::TeamConfig>> {
        match self.record.recent(RECENT) {
            Some(cfg) => Ok(std::borrow::Cow::Borrowed(cfg)),
            None => Roster::new(&self.s.team)
                .load_for(self.s.name.as_str())
                .map(std::borrow::Cow::Owned),
        }
    }

    /// Notes in the member's record why this process is giving up (shown by `lead status`).
    pub fn record_failure(&mut self, why: &str) {
        let why = why.to_owned();
        if !self.write(move |m| m.reason = Some(why.clone())) {
            tracing::warn!("failed to record the failure reason: config.json cannot be written");
        }
    }

    /// Changes this member's record while it still belongs to this incarnation (a process that
    /// a newer one replaced, say an orphan of a crashed lead finishing its step, writes
    /// nothing). Returns whether it is written now; otherwise it is written once config.json
    /// parses again.
    fn write(&mut self, f: impl Fn(&mut crate::config::Member) + Send + 'static) -> bool {
        self.record
            .member(self.s.name.as_str(), Some(self.incarnation), f)
    }

    /// Records what this process is doing now, unless the record already says so (same state
    /// and call: the time it began stays).
    fn set_activity(&mut self, activity: Activity) {
        let same = self.shown.as_ref().is_some_and(|a| {
            a.state == activity.state
                && a.call == activity.call
                && a.until == activity.until
                && a.error == activity.error
        });
        if same {
            return;
        }
        self.shown = Some(activity.clone());
        self.write(move |m| m.activity = Some(activity.clone()));
    }

    /// Whether a plan of this member submitted for its current task was approved.
    fn plan_approved(&self) -> Result<bool> {
        let since = self.task_at.unwrap_or(f64::NEG_INFINITY);
        Ok(self
            .requests
            .list(Some(RequestStatus::Approved))?
            .iter()
            .any(|r| {
                r.kind == RequestKind::PlanApproval
                    && r.from == self.s.name.as_str()
                    && r.created_at >= since
            }))
    }

    fn terminated(&self) -> bool {
        self.term.load(Ordering::SeqCst)
    }

    fn set_status(&mut self, status: MemberStatus) -> Result<()> {
        if self.status == Some(status) {
            return Ok(());
        }
        self.queue_status(status);
        self.record.flush();
        Ok(())
    }

    /// [`Teammate::set_status`], written with the next write or flush.
    fn queue_status(&mut self, status: MemberStatus) {
        let pid = std::process::id();
        // Working says which model call comes next, so the first call of an activation
        // costs no write of its own.
        let next_call = self.conv.calls + 1;
        let activity = match status {
            MemberStatus::Working => Some(Activity {
                call: Some(next_call),
                ..Activity::now(ActivityState::Working)
            }),
            MemberStatus::Idle => Some(Activity::now(ActivityState::Idle)),
            _ => None,
        };
        if status == MemberStatus::Idle {
            self.take_own_branch();
        }
        self.shown = activity.clone();
        self.record
            .member_later(self.s.name.as_str(), Some(self.incarnation), move |m| {
                m.status = status;
                m.pid = Some(pid);
                m.activity = activity.clone();
                if status == MemberStatus::Shutdown {
                    m.pid = None;
                }
            });
        self.status = Some(status);
    }

    /// A worktree member's commits taken into the repository's `troupe/NAME` when its store's
    /// tip moved past it, before the member says `idle`: whoever sees it idle finds its work
    /// on the person's branch. The same checked fetch as the queue's
    /// ([`crate::worktree::take_branch`]), run by this process and not by the member's
    /// commands; one that fails is logged, and the queue's own take at a completion says why.
    fn take_own_branch(&self) {
        let Some(wt) = &self.s.worktree else { return };
        let Some(tip) = crate::worktree::tip_in_store(wt) else {
            return;
        };
        let taken = crate::merge::git::branch_tip(&wt.repo, &wt.branch)
            .ok()
            .flatten();
        if taken.as_deref() == Some(tip.as_str()) {
            return;
        }
        if let Err(e) = crate::worktree::take_branch(wt) {
            tracing::warn!("branch {} not taken into the repository: {e}", wt.branch);
        }
    }

    /// Runs until an approved shutdown, a signal, or a fatal provider error. `wake` is a
    /// descriptor that becomes readable when a signal arrives.
    pub fn run(&mut self, wake: BorrowedFd<'_>) -> Result<Outcome> {
        let mut waiter = InboxWaiter::new(&self.inbox)?;
        loop {
            if self.terminated() {
                return Ok(Outcome::Terminated);
            }
            // Ends of activations not yet reported (a restart after a kill, a full lead inbox,
            // an unreadable roster) go out first, in order.
            self.report_idle(false)?;
            // `working` before the drain: whoever sees this teammate `idle` with an empty inbox
            // knows it has nothing left to do (the LLM lead's quiet-team check relies on it).
            if !self.inbox.is_empty() {
                self.set_status(MemberStatus::Working)?;
            }
            self.drain()?;
            // Between activations: settings `lead up` changed apply from the next one.
            self.refresh_settings();
            // A budget stop is made by code, before any further model call.
            if let Some(why) = self.over_budget() {
                return self.budget_stop(&why).map(|()| Outcome::Shutdown);
            }
            // Work to do: unseen messages, or an activation a restart cut short (finished or not:
            // `activation` goes idle at once if the model already answered everything).
            let pending_work =
                !self.conv.unseen.is_empty() || (!self.conv.idle && self.conv.calls > 0);
            if pending_work {
                match self.activation(wake)? {
                    Some(out) => return Ok(out),
                    None => continue,
                }
            }
            // Nothing to do (also right after a restart between activations): say so, once
            // the lead has every summary (see `go_idle`).
            if self.idle_all_sent() {
                self.set_status(MemberStatus::Idle)?;
            }
            // An auto-claimer then looks at the board: after saying it is idle, so that a task
            // completed from now on wakes it (only idle claimers are woken), and none is missed.
            if self.auto_claim && self.claim_next()? {
                continue;
            }
            // Writes that wait for config.json, and idle steps not complete, are retried every
            // second meanwhile.
            let retry = self.record.is_pending() || !self.conv.undelivered.is_empty();
            let timeout = retry.then_some(Duration::from_secs(1));
            self.record.flush();
            self.record.forget_recent();
            match self.wait_beating(&mut waiter, timeout, wake)? {
                Wake::External => return Ok(Outcome::Terminated),
                Wake::Message | Wake::Timeout => {}
            }
        }
    }

    /// Takes role, prompt, model, plan approval and auto-claim from the roster again: `lead up`
    /// changes them there without a message or a restart. Called between activations only, so
    /// an activation runs with one system prompt and one model from start to end. An unreadable
    /// roster (a person's edit in progress) keeps them as they were.
    fn refresh_settings(&mut self) {
        let read;
        let cfg = match self.record.recent(RECENT) {
            Some(cfg) => cfg,
            None => {
                let Ok(cfg) = Roster::new(&self.s.team).load_for(self.s.name.as_str()) else {
                    return;
                };
                read = cfg;
                &read
            }
        };
        let Some(me) = cfg.member(self.s.name.as_str()) else {
            return;
        };
        if me.incarnation != self.incarnation {
            return;
        }
        self.role.clone_from(&me.role);
        self.prompt = me.prompt.clone().unwrap_or_default();
        self.model = me.model.clone().unwrap_or_default();
        self.plan_gate = me.require_plan_approval;
        self.auto_claim = me.auto_claim;
    }

    /// Drains the inbox; a bus that does not answer (a server restarting, a network cut) is
    /// waited for, with a backoff from 100 ms to 2 s and the outage logged once, rather than
    /// ending the process (a restart would meet the same outage, and enough of them would mark
    /// the member `failed`). A signal meanwhile ends the wait with nothing drained: the loop
    /// then sees it.
    fn drain_patiently(&mut self) -> Result<Vec<Message>> {
        let mut backoff = Duration::ZERO;
        loop {
            match self.inbox.drain(&mut self.journal) {
                Err(e @ crate::Error::Bus { .. }) => {
                    if backoff.is_zero() {
                        tracing::warn!("{e}; waiting for the bus");
                    }
                    if self.terminated() {
                        return Ok(Vec::new());
                    }
                    backoff = crate::store::outage_backoff(backoff);
                    self.beater.beat(backoff);
                    let until = std::time::Instant::now() + backoff;
                    while std::time::Instant::now() < until && !self.terminated() {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                }
                other => {
                    if !backoff.is_zero() && other.is_ok() {
                        tracing::info!("the bus answers again; inbox drained");
                    }
                    return other;
                }
            }
        }
    }

    /// Drains the inbox into the journal; handles stale shutdown requests at once.
    fn drain(&mut self) -> Result<Vec<Message>> {
        let batch = self.drain_patiently()?;
        let mut handled = Vec::new();
        for m in &batch {
            self.conv.push_entry(&Entry::Inbox {
                message: m.clone(),
                at: None,
            });
            if self.note_message(m)? {
                handled.push(m.id.clone());
            }
        }
        if !handled.is_empty() {
            let entry = Entry::Handled {
                ids: handled,
                at: fsutil::now(),
            };
            self.journal.append(std::slice::from_ref(&entry))?;
            self.conv.push_entry(&entry);
        }
        Ok(batch)
    }

    /// Side effects of consuming a message: stale shutdowns are rejected (and hidden from the
    /// model: returns true), approvals open the gate.
    fn note_message(&mut self, m: &Message) -> Result<bool> {
        match m.kind {
            // A wake-up for auto-claimers: the loop looks at the board; the model never sees it.
            MessageType::StatusUpdate
                if m.from == LEAD && m.content == crate::tasks::BOARD_CHANGED =>
            {
                return Ok(true);
            }
            MessageType::ShutdownRequest => {
                let Some(rid) = m.request_id.as_deref() else {
                    return Ok(false);
                };
                let Ok(req) = self.requests.get(rid) else {
                    return Ok(false);
                };
                if let Some(target) = req.target_incarnation
                    && target < self.incarnation
                    && req.status == RequestStatus::Pending
                {
                    let reason = format!(
                        "stale request: addressed to incarnation {target}, this is incarnation {}",
                        self.incarnation
                    );
                    match self.requests.resolve(
                        rid,
                        self.s.name.as_str(),
                        false,
                        json!({"reason": reason}),
                    ) {
                        Ok(_) => {
                            self.respond_shutdown(rid, false, &reason)?;
                            events::log(
                                &self.s.team,
                                "shutdown_stale",
                                json!({"name": self.s.name, "request_id": rid, "target_incarnation": target, "incarnation": self.incarnation}),
                            );
                        }
                        Err(e) => tracing::warn!("stale shutdown {rid}: {e}"),
                    }
                    return Ok(true);
                }
            }
            // A new task (`lead spawn` of a live teammate) may change the gate: the roster has
            // its settings (written before the message was sent). An unreadable roster (a
            // person's edit in progress) leaves the gate as it was.
            MessageType::TaskAssignment => {
                let settings = self.roster_now().ok().and_then(|c| {
                    let me = c.member(self.s.name.as_str())?;
                    Some((me.require_plan_approval, me.auto_claim, me.task_at))
                });
                if let Some((gate, auto_claim, task_at)) = settings {
                    self.plan_gate = gate;
                    self.auto_claim = auto_claim;
                    self.task_at = task_at;
                    self.gate_open = self.plan_approved()?;
                }
            }
            MessageType::PlanApprovalResponse if m.approve == Some(true) => {
                self.gate_open = self.plan_approved()? || self.gate_open;
                if self.gate_open {
                    self.write(|mm| mm.plan_approved = true);
                }
            }
            _ => {}
        }
        Ok(false)
    }

    fn respond_shutdown(&self, rid: &str, approve: bool, reason: &str) -> Result<()> {
        let mut msg = Message::new(
            MessageType::ShutdownResponse,
            self.s.name.as_str(),
            LEAD,
            reason,
        )
        .with_request(rid);
        // A response re-sent after a restart keeps its id, so the lead consumes it once.
        msg.id = crate::ids::derived(&format!("shutdown_response:{rid}")).to_string();
        msg.approve = Some(approve);
        msg.reason = Some(reason.to_owned());
        Inbox::new(&self.s.team, &AgentName::lead()).append(&msg, Durability::Sync)
    }

    /// One activation. `Some(outcome)` ends the process. `wake` becomes readable on a signal.
    /// Exported as a trace of its own when the process exports traces (see
    /// [`crate::telemetry`]), linked to the message that woke it.
    fn activation(&mut self, wake: BorrowedFd<'_>) -> Result<Option<Outcome>> {
        self.span = crate::telemetry::Activation::woken_by(&self.conv.unseen);
        let out = self.activation_steps(wake);
        std::mem::replace(&mut self.span, crate::telemetry::Activation::none()).end(fsutil::now());
        out
    }

    fn activation_steps(&mut self, wake: BorrowedFd<'_>) -> Result<Option<Outcome>> {
        self.set_status(MemberStatus::Working)?;
        while self.conv.calls_this_activation < self.s.max_calls {
            if self.terminated() {
                return Ok(Some(Outcome::Terminated));
            }
            self.beater.beat(Duration::ZERO);
            self.drain()?;
            if let Some(why) = self.over_budget() {
                self.budget_stop(&why)?;
                return Ok(Some(Outcome::Shutdown));
            }
            self.conv.flush_unseen();
            let Some(last) = self.conv.messages.last() else {
                break;
            };
            if last.role == crate::llm::Role::Assistant {
                // The model already answered everything it was shown.
                break;
            }
            let call = self.conv.calls + 1;
            self.set_activity(Activity {
                call: Some(call),
                ..Activity::now(ActivityState::Working)
            });
            let force = self.forced_compaction == Some(call);
            match self.compact_if_needed(false)? {
                Err(e) => match self.ride_out(e, call, wake)? {
                    Some(outcome) => return Ok(Some(outcome)),
                    None => continue,
                },
                // The summary is a billed call: one that crossed a budget is followed by no
                // other model call.
                Ok(true) => {
                    if let Some(why) = self.over_budget() {
                        self.budget_stop(&why)?;
                        return Ok(Some(Outcome::Shutdown));
                    }
                }
                Ok(false) => {}
            }
            let started_at = fsutil::now();
            crate::llm::gate::take_waited();
            let response = match self.call_model() {
                Ok(r) => {
                    self.outage_wait = None;
                    self.outage_since = None;
                    r
                }
                // The API says the prompt is too long (the estimate was off): one compaction
                // and one more try, never a restart loop.
                Err(e) if compaction::too_long(&e) && !force => {
                    tracing::warn!("{e}; compacting and trying once more");
                    self.forced_compaction = Some(call);
                    if let Err(e) = self.compact_if_needed(true)? {
                        match self.ride_out(e, call, wake)? {
                            Some(outcome) => return Ok(Some(outcome)),
                            None => continue,
                        }
                    }
                    continue;
                }
                // Still too long after that compaction: the activation ends (an exit would be
                // restarted into the same answer); the lead hears why in the idle summary.
                Err(e) if compaction::too_long(&e) => {
                    tracing::error!("{e}, even after a compaction; ending this activation");
                    self.conv.last_text = format!(
                        "I stopped: the model API says my prompt is too long even after I \
                         compacted my conversation ({e})."
                    );
                    break;
                }
                Err(e) => match self.ride_out(e, call, wake)? {
                    Some(outcome) => return Ok(Some(outcome)),
                    // Drain what arrived meanwhile, then try again.
                    None => continue,
                },
            };
            let waited = crate::llm::gate::take_waited().as_secs_f64();
            let waited = (waited > 0.0).then_some(waited);
            let ended_at = fsutil::now();
            self.span.model_call(
                started_at,
                ended_at,
                &self.model,
                &response.model,
                &response.usage,
                waited,
            );
            let entry = Entry::Assistant {
                seq: self.conv.calls,
                response: response.clone(),
                at: ended_at,
                started_at: Some(started_at),
                waited,
            };
            self.journal.append(std::slice::from_ref(&entry))?;
            self.conv.push_entry(&entry);
            self.account(&response);
            let uses: Vec<(String, String, Value)> = response
                .content
                .iter()
                .filter_map(|b| match b {
                    Block::ToolUse { id, name, input } => {
                        Some((id.clone(), name.clone(), input.clone()))
                    }
                    _ => None,
                })
                .collect();
            if uses.is_empty() {
                break;
            }
            let mut results = Vec::new();
            let mut inbox_ids = Vec::new();
            let mut timings = Vec::new();
            let ctx = self.context();
            for (id, name, input) in uses {
                let started_at = fsutil::now();
                // A name no tool has is answered here: it reaches no heartbeat, event or
                // timing as the model wrote it (a person's terminal shows those).
                let checked = tools::check_tool_name(&name);
                let name = tools::recorded_name(&name);
                let tool_span = self.span.tool(&name, &id);
                let out = if let Err(e) = checked {
                    ToolOutput::error(e)
                } else if response.stop_reason == StopReason::MaxTokens {
                    ToolOutput::cut_short()
                } else {
                    self.run_tool(&name, &input, &mut inbox_ids)?
                };
                drop(tool_span);
                timings.push(ToolTiming {
                    tool_use_id: id.clone(),
                    name: name.clone(),
                    started_at,
                    ended_at: fsutil::now(),
                });
                results.push(Block::ToolResult {
                    tool_use_id: id,
                    content: compaction::cut_middle(&out.content, compaction::result_cap(ctx)),
                    is_error: out.is_error,
                });
            }
            let entry = Entry::ToolResults {
                results,
                inbox_ids,
                at: fsutil::now(),
                timings,
            };
            self.journal.append(std::slice::from_ref(&entry))?;
            self.conv.push_entry(&entry);
            if self.shutdown_approved {
                self.set_status(MemberStatus::Shutdown)?;
                events::log(
                    &self.s.team,
                    "shutdown_approved",
                    json!({"name": self.s.name, "incarnation": self.incarnation}),
                );
                return Ok(Some(Outcome::Shutdown));
            }
        }
        if let Some(why) = self.over_budget() {
            self.budget_stop(&why)?;
            return Ok(Some(Outcome::Shutdown));
        }
        self.go_idle()?;
        Ok(None)
    }

    /// After a model call failed through its retries: waits out an outage (`None`: try again),
    /// pauses for a spend cap until a message arrives (`None`), or ends the process.
    fn ride_out(
        &mut self,
        e: crate::llm::LlmError,
        call: u64,
        wake: BorrowedFd<'_>,
    ) -> Result<Option<Outcome>> {
        let error = Some(outage::one_line(&e));
        match outage::on_failure(&e) {
            OnFailure::Stop => Ok(Some(Outcome::Llm(e))),
            OnFailure::Wait => {
                let max = self.s.api_wait_max;
                let d = outage::next_wait(
                    self.outage_wait,
                    outage::first_wait(max),
                    max,
                    crate::llm::retry::random_unit(),
                );
                self.outage_wait = Some(d);
                let now = fsutil::now();
                let since = *self.outage_since.get_or_insert(now);
                tracing::warn!("{e}; trying again in {:.1} s", d.as_secs_f64());
                self.beater.beat(d);
                self.set_activity(Activity {
                    state: ActivityState::WaitingApi,
                    since,
                    call: Some(call),
                    until: Some(now + d.as_secs_f64()),
                    error,
                });
                if wait::sleep_unless(d, wake) || self.terminated() {
                    return Ok(Some(Outcome::Terminated));
                }
                Ok(None)
            }
            OnFailure::Pause => {
                tracing::warn!("{e}; paused: no model call until a new message arrives");
                self.set_activity(Activity {
                    call: Some(call),
                    error,
                    ..Activity::now(ActivityState::Paused)
                });
                events::log(
                    &self.s.team,
                    "paused",
                    json!({"name": self.s.name, "reason": e.to_string()}),
                );
                // The lead hears of it: a quota or a spend cap is a person's to raise.
                let note = Message::new(
                    MessageType::StatusUpdate,
                    self.s.name.as_str(),
                    LEAD,
                    format!(
                        "{} is paused: {e}. It makes no model call until a new message \
                         arrives.",
                        self.s.name
                    ),
                );
                if let Err(e) =
                    Inbox::new(&self.s.team, &AgentName::lead()).append(&note, Durability::Sync)
                {
                    tracing::warn!("could not tell the lead this member is paused: {e}");
                }
                let mut waiter = InboxWaiter::new(&self.inbox)?;
                loop {
                    let timeout = self.record.is_pending().then_some(Duration::from_secs(1));
                    self.record.flush();
                    match self.wait_beating(&mut waiter, timeout, wake)? {
                        Wake::External => return Ok(Some(Outcome::Terminated)),
                        Wake::Message => return Ok(None),
                        Wake::Timeout => {}
                    }
                }
            }
        }
    }

    /// Ends the activation: journals the end with the idle notification (the summary for the
    /// lead), then completes the idle step ([`Teammate::report_idle`]) and says `idle`.
    fn go_idle(&mut self) -> Result<()> {
        let summary: String = self.conv.last_text.chars().take(4000).collect();
        // A fresh id: a re-send takes the message, id and all, from the journal. (An id derived
        // from the call count would be that of the previous idle when an activation ends with
        // no model call of its own, a prompt too long to send: the lead would drop its summary.)
        let msg = Message::new(
            MessageType::IdleNotification,
            self.s.name.as_str(),
            LEAD,
            summary,
        );
        let entry = Entry::Idle {
            at: fsutil::now(),
            notification: Some(msg),
        };
        self.journal.append(std::slice::from_ref(&entry))?;
        self.conv.push_entry(&entry);
        self.report_idle(true)?;
        // Notified before the status flips, so whoever sees `idle` finds the summary waiting.
        if self.idle_all_sent() {
            self.set_status(MemberStatus::Idle)?;
        }
        Ok(())
    }

    /// Completes the idle steps journaled and not known done ([`Rebuilt::undelivered`]), oldest
    /// first: the notification goes to the lead's inbox, then the `teammate_idle` hook mark to
    /// the roster, then an [`Entry::IdleDelivered`] to the journal. A step cut short by a kill
    /// is done again by the restart, with the same message (same id: the lead's journal drops
    /// the copy). A notification the lead's inbox refuses (full, say) is kept and tried again
    /// every second; so is a mark while config.json does not parse. With `then_idle`, once every
    /// notification is in the lead's inbox, `idle` goes to the roster in the same write as the
    /// marks (one roster rewrite for the end of an activation). `Err` only when the journal
    /// fails.
    fn report_idle(&mut self, then_idle: bool) -> Result<()> {
        if self.conv.undelivered.is_empty() {
            return Ok(());
        }
        let lead = Inbox::new(&self.s.team, &AgentName::lead());
        for u in &self.conv.undelivered {
            if self.idle_sent.contains(&u.notification.id) {
                continue;
            }
            if let Err(e) = lead.append(&u.notification, Durability::Sync) {
                let e = e.to_string();
                if self.idle_error.as_ref() != Some(&e) {
                    tracing::warn!("idle notification not sent, trying again every second: {e}");
                    self.idle_error = Some(e);
                }
                // Later ones wait: the lead hears of its activations in order.
                break;
            }
            if self.idle_error.take().is_some() {
                tracing::info!("idle notification sent");
            }
            self.record.member_with_team_later(
                self.s.name.as_str(),
                idle_hook_mark(self.s.name.to_string(), self.incarnation, u.calls),
            );
            self.idle_sent.push(u.notification.id.clone());
        }
        if then_idle && self.idle_all_sent() && self.status != Some(MemberStatus::Idle) {
            self.queue_status(MemberStatus::Idle);
        }
        // Every mark handed over is in the roster only once nothing is pending.
        if self.idle_sent.is_empty() || !self.record.flush() {
            return Ok(());
        }
        let done: Vec<Entry> = self
            .idle_sent
            .iter()
            .map(|id| Entry::IdleDelivered {
                id: id.clone(),
                at: fsutil::now(),
            })
            .collect();
        self.journal.append(&done)?;
        for entry in &done {
            self.conv.push_entry(entry);
        }
        self.idle_sent.clear();
        Ok(())
    }

    /// Whether every idle notification journaled is in the lead's inbox (their hook marks may
    /// still wait for config.json: the roster gets them before any later status).
    fn idle_all_sent(&self) -> bool {
        self.conv
            .undelivered
            .iter()
            .all(|u| self.idle_sent.contains(&u.notification.id))
    }

    fn system_prompt(&self) -> String {
        let gate = if self.plan_gate && !self.gate_open {
            "\nBefore changing anything you must get a plan approved: submit it with plan_approval \
             and wait for the lead's plan_approval_response. bash, write_file and edit_file become \
             available once a plan is approved."
        } else {
            ""
        };
        // What git allows here (see `crate::worktree::GitDirs`): looked at, not read.
        let dot_git = std::fs::symlink_metadata(self.s.workdir.join(".git")).ok();
        let git = match dot_git {
            Some(m) if m.is_file() => format!(
                " It is your own git worktree, on branch troupe/{}: commit your work there.",
                self.s.name
            ),
            Some(m) if m.is_dir() => " Its git repository is read-only to you: edit files, \
                                      do not commit (the lead or a person does)."
                .to_owned(),
            _ => String::new(),
        };
        format!(
            "You are {name}, a {role} on a team of agents run by a lead. Your working directory \
             is {wd}; file tools are confined to it.{git}\n\nYour instructions:\n{prompt}\n\n\
             Messages from the lead and teammates arrive as <inbox> turns. Use send_message to \
             reply or report (the lead is \"lead\"). When you are asked to shut down, answer \
             with shutdown_response. When you have nothing left to do, end your turn with a short \
             summary of what you did.{gate}",
            name = self.s.name,
            role = self.role,
            wd = self.s.workdir.display(),
            prompt = self.prompt,
        )
    }

    /// The context size in tokens.
    fn context(&self) -> u64 {
        self.s
            .context_tokens
            .unwrap_or_else(|| compaction::default_context_tokens(&self.model))
    }

    /// Who this agent is, for the turn that replaces compacted ones.
    fn reminder(&self) -> String {
        let open: Vec<String> = self
            .requests
            .list(Some(RequestStatus::Pending))
            .unwrap_or_default()
            .into_iter()
            .filter(|r| r.from == self.s.name.as_str() || r.to == self.s.name.as_str())
            .map(|r| {
                format!(
                    "{} ({:?} from {} to {})",
                    r.request_id, r.kind, r.from, r.to
                )
            })
            .collect();
        let team = Roster::new(&self.s.team)
            .load_for(self.s.name.as_str())
            .map(|c| c.team_name)
            .unwrap_or_default();
        format!(
            "You are {name}, a {role} on team {team:?}, run by the lead (\"lead\"). Your task: \
             {prompt}\nOpen requests: {open}.",
            name = self.s.name,
            role = self.role,
            prompt = self.prompt,
            open = if open.is_empty() {
                "none".to_owned()
            } else {
                open.join(", ")
            }
        )
    }

    /// Compacts the conversation before a model call when its prompt is estimated past
    /// [`compaction::COMPACT_AT`] of the context (or at once, with a smaller recent part, when
    /// `force`: the API said the prompt is too long). The summary is a model call of its own;
    /// its failure is returned as the inner error, for the caller to ride out. `Ok(true)`: it
    /// compacted, with a billed call (the caller checks the budget again before the next).
    fn compact_if_needed(&mut self, force: bool) -> Result<std::result::Result<bool, LlmError>> {
        let ctx = self.context();
        let system = self.system_prompt();
        let specs = tools::teammate_specs(!self.plan_gate || self.gate_open);
        let before = compaction::estimate(&system, &specs, &self.conv.messages);
        if !force && !compaction::should_compact(before, ctx) {
            return Ok(Ok(false));
        }
        let share = if force {
            compaction::KEEP_RECENT / 2.0
        } else {
            compaction::KEEP_RECENT
        };
        let Some(at) = compaction::cut(&self.conv.messages, (ctx as f64 * share) as u64) else {
            return Ok(Ok(false));
        };
        let req = compaction::summary_call(
            &self.model,
            ctx,
            &self.conv.messages[..at],
            self.s.max_tokens,
            self.s.name.as_str(),
            self.conv.compactions,
        );
        let started_at = fsutil::now();
        self.beater
            .beat_doing(self.provider.longest_call(), Some("compaction".into()));
        let response = self.provider.complete(&req);
        // The call's allowance ends with it: a stop right after is seen as soon as any.
        self.beater.beat(Duration::ZERO);
        let response = match response {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        // A billed call like any other: in the ledger, against the budget.
        self.account(&response);
        self.span.model_call(
            started_at,
            fsutil::now(),
            &self.model,
            &response.model,
            &response.usage,
            None,
        );
        let summary = compaction::summary_of(&response);
        let entry = Entry::Compaction {
            summary: compaction::summary_turn(&self.reminder(), &summary, at),
            keep_from: at,
            tokens_before: before,
            at: fsutil::now(),
            started_at: Some(started_at),
        };
        self.journal.append(std::slice::from_ref(&entry))?;
        self.conv.push_entry(&entry);
        let after = compaction::estimate(&system, &specs, &self.conv.messages);
        tracing::info!(
            "compacted the conversation: {at} messages summarized, about {before} -> {after} tokens"
        );
        events::log(
            &self.s.team,
            "compacted",
            json!({"name": self.s.name, "replaced": at, "tokens_before": before, "tokens_after": after, "forced": force}),
        );
        Ok(Ok(true))
    }

    fn call_model(&mut self) -> std::result::Result<ChatResponse, LlmError> {
        // Compaction keeps the prompt under the context. What it always keeps, the last turn
        // and its tool results, is cut to fit when those results are too many together; the
        // bound is the last resort for a recent part that is itself too large (many large
        // messages in one inbox batch).
        let ctx = self.context();
        let max_bytes = (ctx * compaction::BYTES_PER_TOKEN) as usize;
        let system = self.system_prompt();
        let tools = tools::teammate_specs(!self.plan_gate || self.gate_open);
        let messages = compaction::fit_last_turn(&self.conv.messages, &system, &tools, ctx);
        let req = ChatRequest {
            model: self.model.clone(),
            system,
            messages: conversation::bound(&messages, max_bytes),
            tools,
            max_tokens: self.s.max_tokens,
            agent: self.s.name.to_string(),
            seq: self.conv.calls,
        };
        self.beater.beat_doing(
            self.provider.longest_call(),
            Some(format!("model call {}", self.conv.calls + 1)),
        );
        let response = self.provider.complete(&req);
        self.beater.beat(Duration::ZERO);
        response
    }

    /// [`InboxWaiter::wait`], beating at least every [`crate::store::beat::IDLE_BEAT`]
    /// meanwhile (the watchdog's proof that an idle worker is not stopped or stuck).
    fn wait_beating(
        &mut self,
        waiter: &mut InboxWaiter,
        timeout: Option<Duration>,
        wake: BorrowedFd<'_>,
    ) -> Result<Wake> {
        let until = timeout.map(|t| std::time::Instant::now() + t);
        loop {
            self.beater.beat(Duration::ZERO);
            // Refused by the fence: this process may not go on for the member.
            self.beater.refusal()?;
            let slice = until.map_or(crate::store::beat::IDLE_BEAT, |u| {
                u.saturating_duration_since(std::time::Instant::now())
                    .min(crate::store::beat::IDLE_BEAT)
            });
            match waiter.wait(Some(slice), &[wake])? {
                Wake::Timeout if until.is_none_or(|u| std::time::Instant::now() < u) => {}
                other => return Ok(other),
            }
        }
    }

    /// Runs one tool. `Err` only when the step cannot go on: the inbox drain of `read_inbox`
    /// failed (its journal write was undone, or the journal is unusable), which ends the process
    /// so that the restart's journal repair and drain take over.
    fn run_tool(
        &mut self,
        name: &str,
        input: &Value,
        inbox_ids: &mut Vec<String>,
    ) -> Result<ToolOutput> {
        // A command may take up to its timeout (and the moments its kill takes); the other
        // tools are quick.
        let allowance = if name == "bash" {
            self.s.bash_timeout + Duration::from_secs(10)
        } else {
            Duration::ZERO
        };
        self.beater
            .beat_doing(allowance, Some(format!("tool {name}")));
        let out = if name == "read_inbox" {
            self.tool_read_inbox(inbox_ids)?
        } else {
            self.dispatch_tool(name, input)
        };
        self.beater.beat(Duration::ZERO);
        tools::log_call(&self.s.team, self.s.name.as_str(), name, input, &out);
        Ok(out)
    }

    /// Every tool but `read_inbox` (see [`Teammate::run_tool`]).
    fn dispatch_tool(&mut self, name: &str, input: &Value) -> ToolOutput {
        let gated = self.plan_gate && !self.gate_open;
        if tools::MUTATING.contains(&name) && gated {
            return ToolOutput::error(format!(
                "{name} is not available until a plan of yours is approved: submit one with plan_approval"
            ));
        }
        let wd = match tools::fs::Workdir::for_agent(
            &self.s.workdir,
            &self.s.team,
            self.s.sandbox.owner(),
        ) {
            Ok(wd) => wd,
            Err(e) => return ToolOutput::error(format!("working directory unavailable: {e}")),
        };
        if let Some(out) = tools::tasks::run(
            &self.s.team,
            self.s.name.as_str(),
            self.incarnation,
            name,
            input,
        ) {
            // A member that needs plan approval needs it for each task it takes.
            if name == "task_claim" && !out.is_error && self.plan_gate {
                self.close_gate_for_new_task();
            }
            return out;
        }
        match name {
            "bash" => tools::bash::bash(&wd, &self.s.sandbox, input, self.s.bash_timeout),
            "read_file" => tools::fs::read_file(&wd, input),
            "write_file" => tools::fs::write_file(&wd, input),
            "edit_file" => tools::fs::edit_file(&wd, input),
            "send_message" => self.tool_send(input),
            "shutdown_response" => self.tool_shutdown_response(input),
            "plan_approval" => self.tool_plan(input),
            other => ToolOutput::error(format!(
                "unknown tool {other:?}; available: {}",
                tools::teammate_specs(!gated)
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        }
    }

    fn tool_send(&mut self, input: &Value) -> ToolOutput {
        let parsed = (|| -> std::result::Result<(String, String), String> {
            tools::check_input(input)?;
            Ok((
                tools::input_str(input, "to")?.to_owned(),
                tools::input_str(input, "content")?.to_owned(),
            ))
        })();
        let (to, content) = match parsed {
            Ok(v) => v,
            Err(e) => return ToolOutput::error(e),
        };
        if to == self.s.name.as_str() {
            return ToolOutput::error("you cannot send a message to yourself");
        }
        let msg = Message::new(MessageType::Message, self.s.name.as_str(), &to, content);
        match mail::send(&self.s.team, &msg, Stopped::Refuse, Durability::Sync) {
            Ok(()) => ToolOutput::ok(format!("sent to {to} (id {})", msg.id)),
            Err(e) => ToolOutput::error(format!("not sent: {e}")),
        }
    }

    fn tool_read_inbox(&mut self, inbox_ids: &mut Vec<String>) -> Result<ToolOutput> {
        let batch = self.drain_patiently()?;
        for m in &batch {
            if let Err(e) = self.note_message(m) {
                tracing::warn!("{e}");
            }
        }
        inbox_ids.extend(batch.iter().map(|m| m.id.clone()));
        Ok(if batch.is_empty() {
            ToolOutput::ok("no new messages")
        } else {
            ToolOutput::ok(conversation::render_inbox(&batch))
        })
    }

    fn tool_shutdown_response(&mut self, input: &Value) -> ToolOutput {
        let parsed = (|| -> std::result::Result<(String, bool, String), String> {
            tools::check_input(input)?;
            let rid = tools::input_str(input, "request_id")?.to_owned();
            let approve = tools::input_bool(input, "approve")?;
            let reason = tools::input_opt_str(input, "reason")?
                .unwrap_or_default()
                .to_owned();
            Ok((rid, approve, reason))
        })();
        let (rid, approve, reason) = match parsed {
            Ok(v) => v,
            Err(e) => return ToolOutput::error(e),
        };
        let req = match self.requests.get(&rid) {
            Ok(r) if r.kind == RequestKind::Shutdown => r,
            Ok(r) => {
                return ToolOutput::error(format!(
                    "request {rid} is a {} request, not a shutdown",
                    r.kind
                ));
            }
            Err(e) => return ToolOutput::error(e.to_string()),
        };
        if let Some(t) = req.target_incarnation
            && t < self.incarnation
        {
            return ToolOutput::error(format!(
                "request {rid} was for an earlier incarnation ({t}); it does not apply to you"
            ));
        }
        match self.requests.resolve(
            &rid,
            self.s.name.as_str(),
            approve,
            json!({"reason": reason}),
        ) {
            Ok(_) => {
                if let Err(e) = self.respond_shutdown(&rid, approve, &reason) {
                    return ToolOutput::error(format!(
                        "answer recorded but the lead was not told: {e}"
                    ));
                }
                events::log(
                    &self.s.team,
                    "shutdown_response",
                    json!({"name": self.s.name, "request_id": rid, "approve": approve}),
                );
                if approve {
                    self.shutdown_approved = true;
                    ToolOutput::ok("shutdown approved; this process exits after this step")
                } else {
                    ToolOutput::ok("shutdown rejected; keep working")
                }
            }
            Err(e) => ToolOutput::error(e.to_string()),
        }
    }

    fn tool_plan(&mut self, input: &Value) -> ToolOutput {
        let plan = match tools::check_input(input).and_then(|_| tools::input_str(input, "plan")) {
            Ok(p) => p.to_owned(),
            Err(e) => return ToolOutput::error(e),
        };
        let req = match self.requests.create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: self.s.name.to_string(),
            to: LEAD.to_owned(),
            payload: json!({"plan": plan}),
            target_incarnation: Some(self.incarnation),
            ttl: None,
        }) {
            Ok(r) => r,
            Err(e) => return ToolOutput::error(e.to_string()),
        };
        let mut msg = Message::new(
            MessageType::PlanApproval,
            self.s.name.as_str(),
            LEAD,
            plan.clone(),
        )
        .with_request(&req.request_id);
        msg.plan = Some(plan);
        if let Err(e) = Inbox::new(&self.s.team, &AgentName::lead()).append(&msg, Durability::Sync)
        {
            return ToolOutput::error(format!(
                "plan recorded as {} but the lead was not told: {e}",
                req.request_id
            ));
        }
        events::log(
            &self.s.team,
            "plan_submitted",
            json!({"name": self.s.name, "request_id": req.request_id}),
        );
        ToolOutput::ok(format!(
            "plan submitted as request {}; the lead's plan_approval_response will arrive in your inbox",
            req.request_id
        ))
    }
}

/// Claiming tasks by itself (`lead spawn --auto-claim`).
impl Teammate {
    /// Takes the next claimable task of the board, oldest first, and puts it in its own inbox
    /// as a `task_assignment` (its id derived from the task, so a restart between the claim and
    /// the message sends it again and the journal keeps it once). A task this member already
    /// owns whose assignment it has not seen (a kill between the two) comes first. Returns
    /// whether there is new work.
    fn claim_next(&mut self) -> Result<bool> {
        let store = crate::tasks::TaskStore::new(&self.s.team);
        let me = self.s.name.as_str();
        let owned = store
            .list(Some(crate::tasks::TaskStatus::InProgress))
            .unwrap_or_default()
            .into_iter()
            .find(|t| {
                t.owner.as_deref() == Some(me) && !self.journal.has_seen(&claim_id(&t.id, me))
            });
        let task = match owned {
            Some(t) => t,
            None => match store.claim(None, me, self.incarnation) {
                Ok(t) => t,
                Err(crate::error::Error::NoClaimableTask) => return Ok(false),
                Err(e) => {
                    tracing::warn!("could not claim a task: {e}");
                    return Ok(false);
                }
            },
        };
        let blockers = if task.blocked_by.is_empty() {
            String::new()
        } else {
            format!(" (after {}, all completed)", task.blocked_by.join(", "))
        };
        let mut msg = Message::new(
            MessageType::TaskAssignment,
            me,
            me,
            format!(
                "You claimed task {id}{blockers}: {subject}\n{description}\nWhen it is done, call \
                 task_update with task_id {id}, status completed and the result; to give it back, \
                 status pending.",
                id = task.id,
                subject = task.subject,
                description = task.description,
            ),
        );
        msg.id = claim_id(&task.id, me);
        // A member that needs plan approval needs it for each task it takes.
        if self.plan_gate && !self.journal.has_seen(&msg.id) {
            self.close_gate_for_new_task();
        }
        Inbox::new(&self.s.team, &self.s.name).append(&msg, Durability::Sync)?;
        Ok(true)
    }
}

impl Teammate {
    /// A new task begins: only a plan approved from now on opens the gate again.
    fn close_gate_for_new_task(&mut self) {
        let now = fsutil::now();
        self.task_at = Some(now);
        self.gate_open = false;
        self.write(move |m| {
            m.task_at = Some(now);
            m.plan_approved = false;
        });
        self.record.flush();
    }
}

/// The id of the `task_assignment` a member sends itself for a task it claimed.
fn claim_id(task: &str, member: &str) -> String {
    crate::ids::derived(&format!("claim:{task}:{member}")).to_string()
}

/// The roster write that marks an idle of member `name` (incarnation `incarnation`, after
/// `calls` model calls) for the team's `teammate_idle` hooks. Whether the team has any is read
/// from the roster it writes: while config.json does not parse the write waits (see
/// [`RosterWriter`]) rather than guess, so no hook is skipped and no mark is left for hooks
/// that are not there. A process that a newer incarnation replaced marks nothing.
fn idle_hook_mark(
    name: String,
    incarnation: u64,
    calls: u64,
) -> impl Fn(&mut crate::config::TeamConfig) + Send + 'static {
    move |cfg| {
        if !crate::hooks::any_for(&cfg.hooks, crate::hooks::HookEvent::TeammateIdle) {
            return;
        }
        if let Some(m) = cfg.member_mut(&name)
            && m.incarnation == incarnation
        {
            let now = fsutil::now();
            m.idle_hook_pending = Some(calls);
            m.updated_at = Some(now);
            m.last_seen = Some(now);
        }
    }
}

/// The ledger and the budget stop.
impl Teammate {
    /// Records one call in the member's ledger: what the API billed and what it cost. A call
    /// that takes the team over its budget wakes the other teammates, so the idle ones stop too.
    fn account(&mut self, response: &ChatResponse) {
        let usage = response.usage;
        let model = if !response.model.is_empty() {
            response.model.clone()
        } else if !self.model.is_empty() {
            self.model.clone()
        } else {
            std::env::var("MODEL_ID").unwrap_or_default()
        };
        let cost = self.s.prices.cost(&model, &usage);
        let incarnation = self.incarnation;
        self.write(move |m| crate::cost::record_call(m, incarnation, &usage, cost));
        if let Ok(cfg) = self.roster_now()
            && crate::cost::team_over_budget(&cfg).is_some()
        {
            crate::cost::wake_team(&self.s.team, &cfg, Some(self.s.name.as_str()));
        }
    }

    /// Why a budget stops this member now, if one does. Nothing stops it while its record
    /// cannot be read or has writes pending (a hand edit in progress).
    fn over_budget(&mut self) -> Option<String> {
        if !self.record.flush() {
            return None;
        }
        let cfg = self.roster_now().ok()?;
        let me = cfg.member(self.s.name.as_str())?;
        crate::cost::over_budget(&cfg, me)
    }

    /// Shuts this member down for its budget, by code: a shutdown request recorded approved
    /// with reason `budget`, a `budget_exceeded` event, a `status_update` to the lead, and status
    /// `shutdown` with the reason. The caller ends the process (exit 0).
    fn budget_stop(&mut self, why: &str) -> Result<()> {
        let req = self.requests.create_approved(
            NewRequest {
                kind: RequestKind::Shutdown,
                from: LEAD.to_owned(),
                to: self.s.name.to_string(),
                payload: json!({"reason": "budget", "detail": why}),
                target_incarnation: Some(self.incarnation),
                ttl: None,
            },
            json!({"reason": "budget", "detail": why, "by_code": true}),
        )?;
        events::log(
            &self.s.team,
            "budget_exceeded",
            json!({"name": self.s.name, "incarnation": self.incarnation, "reason": why, "request_id": req.request_id}),
        );
        let mut note = Message::new(
            MessageType::StatusUpdate,
            self.s.name.as_str(),
            LEAD,
            format!(
                "{} was shut down (request {}): {why}",
                self.s.name, req.request_id
            ),
        );
        note.id = crate::ids::derived(&format!("budget:{}", req.request_id)).to_string();
        if let Err(e) = Inbox::new(&self.s.team, &AgentName::lead()).append(&note, Durability::Sync)
        {
            tracing::warn!("could not tell the lead of the budget stop: {e}");
        }
        tracing::warn!("shut down by code: {why}");
        self.set_status(MemberStatus::Shutdown)?;
        let why = why.to_owned();
        self.write(move |m| m.reason = Some(why.clone()));
        self.record.flush();
        events::log(
            &self.s.team,
            "shutdown_approved",
            json!({"name": self.s.name, "incarnation": self.incarnation, "request_id": req.request_id, "reason": "budget"}),
        );
        Ok(())
    }
}
