//! Team operations of the lead, shared by the scripting CLI and the LLM lead's tools: spawn,
//! send, broadcast, shutdown requests and plan decisions. Each is the one place its rules live.

use std::time::Duration;

use serde_json::json;

use crate::config::{Member, MemberStatus, Roster};
use crate::error::{Error, Result};
use crate::events;
use crate::inbox::{Durability, Inbox};
use crate::mail::{self, Stopped};
use crate::message::{Message, MessageType};
use crate::requests::{NewRequest, Request, RequestKind, RequestStore};
use crate::teamdir::{AgentName, LEAD, TeamDir};

/// Default time a teammate has to answer a shutdown request.
pub const SHUTDOWN_TTL: Duration = Duration::from_secs(60);

/// What to spawn.
#[derive(Debug, Clone)]
pub struct SpawnSpec {
    pub name: String,
    pub role: String,
    pub prompt: String,
    pub model: Option<String>,
    pub require_plan_approval: bool,
    /// Claims tasks of the board by itself whenever it would go idle.
    pub auto_claim: bool,
    /// Sets the member's dollar budget (over its life); `None` keeps the one it has.
    pub budget_usd: Option<f64>,
    /// Sets the member's token budget (over its life); `None` keeps the one it has.
    pub budget_tokens: Option<u64>,
    /// Gives it its own git worktree (see [`crate::worktree`]); false keeps the one it has.
    pub worktree: bool,
    /// Places it on this host of a team on a bus (see [`crate::bus::hosts`]); `None` keeps
    /// the one it has (a new member goes to the first supervisor that starts it).
    pub host: Option<String>,
}

/// Adds a member (status `spawning`, for the supervisor to start) or reactivates a stopped,
/// shut-down or failed one (same name, transcript kept), and puts its task in its inbox as a
/// `task_assignment`. An idle member just receives the new task. A working or already spawning
/// member is refused.
///
/// Budgets given replace the member's. A member over its budget (it was, or would at once be,
/// shut down for it) is refused until its budget is raised above its spend, and everyone is
/// refused while the team is over the team budget: [`Error::OverBudget`], nothing changed.
pub fn spawn(team: &TeamDir, spec: &SpawnSpec) -> Result<Member> {
    let name = AgentName::teammate(&spec.name)?;
    if let Some(h) = &spec.host {
        team.store().check_host(h, || format!("--host {h}"))?;
    }
    let worktree = if spec.worktree {
        worktree_for(team, &name)?
    } else {
        None
    };
    let member = Roster::new(team).update_one(name.as_str(), |cfg| {
        // Under the roster's exclusive lock when a ceiling is set (`update_one` reads every
        // member then): two spawns at once cannot both take the last place.
        let now = crate::fsutil::now();
        if let Some(r) = crate::ceilings::refusal(cfg, name.as_str(), now) {
            return Err(Error::Ceiling {
                why: r.why,
                fix: r.fix,
            });
        }
        crate::ceilings::note_spawn(cfg, name.as_str(), now);
        let m = spawn_in(cfg, &name, spec)?;
        let m = match &worktree {
            Some(w) => {
                let rec = cfg
                    .member_mut(name.as_str())
                    .expect("spawn_in added or found it");
                rec.worktree = Some(w.clone());
                rec.clone()
            }
            None => m,
        };
        if let Some(why) = crate::cost::over_budget(cfg, &m) {
            let fix = if crate::cost::team_over_budget(cfg).is_some() {
                "no teammate is spawned until the team budget is raised above the team's spend \
                 (`lead run --team-budget-usd X`, or team_budget_usd in config.json)"
                    .to_owned()
            } else {
                format!(
                    "not spawned; raise its budget above its spend (`lead spawn {name} ... \
                     --budget-usd X` or `--budget-tokens N`)"
                )
            };
            return Err(Error::OverBudget { why, fix });
        }
        // The task goes in before the record says `spawning`: a supervisor starts the worker
        // the moment it does, and a worker resuming a half-done activation would otherwise
        // finish it with a model call of its own before the task arrives.
        let task = Message::new(
            MessageType::TaskAssignment,
            LEAD,
            name.as_str(),
            spec.prompt.clone(),
        );
        Inbox::new(team, &name).append(&task, Durability::Sync)?;
        Ok(m)
    })?;
    events::log(
        team,
        "spawn_requested",
        json!({"name": name, "role": spec.role, "status": member.status, "require_plan_approval": spec.require_plan_approval}),
    );
    Ok(member)
}

/// The worktree `name` is spawned with (made or reused now, before the roster records it);
/// `None` for a member that runs or is about to, which [`spawn_in`] refuses.
fn worktree_for(team: &TeamDir, name: &AgentName) -> Result<Option<crate::worktree::Worktree>> {
    let cfg = Roster::new(team).load()?;
    let current = cfg.member(name.as_str());
    if current.is_some_and(|m| matches!(m.status, MemberStatus::Working | MemberStatus::Spawning)) {
        return Ok(None);
    }
    let known = current.and_then(|m| m.worktree.as_ref());
    if let Some(m) = current
        && m.status == MemberStatus::Idle
        && m.pid.is_some_and(crate::liveness::pid_alive)
        && known.is_none()
    {
        // Its process works in the team's working dir; a worktree would apply only from its
        // next start, with this task half done elsewhere.
        return Err(Error::WorktreeRefused {
            name: name.to_string(),
            why: "it is idle in the team's working dir; shut it down first                   (`lead shutdown NAME --wait`), then spawn it with --worktree"
                .to_owned(),
        });
    }
    let w = crate::worktree::ensure(team.root(), name.as_str(), known)?;
    events::log(
        team,
        "worktree_ready",
        json!({"name": name, "path": w.path, "branch": w.branch}),
    );
    Ok(Some(w))
}

/// The roster change of [`spawn`], budgets aside.
fn spawn_in(
    cfg: &mut crate::config::TeamConfig,
    name: &AgentName,
    spec: &SpawnSpec,
) -> Result<Member> {
    match cfg.member_mut(name.as_str()) {
        Some(m) if matches!(m.status, MemberStatus::Working | MemberStatus::Spawning) => {
            Err(Error::MemberConflict {
                name: name.to_string(),
                status: m.status.to_string(),
                why: "it is already running or about to; send it a message instead",
            })
        }
        Some(m) => {
            if m.status != MemberStatus::Idle {
                m.status = MemberStatus::Spawning;
                m.reason = None;
            }
            m.role = spec.role.clone();
            m.prompt = Some(spec.prompt.clone());
            if spec.model.is_some() {
                m.model = spec.model.clone();
            }
            m.require_plan_approval = spec.require_plan_approval;
            m.auto_claim = spec.auto_claim;
            m.plan_approved = false;
            m.task_at = Some(crate::fsutil::now());
            if spec.budget_usd.is_some() {
                m.budget_usd = spec.budget_usd;
            }
            if spec.budget_tokens.is_some() {
                m.budget_tokens = spec.budget_tokens;
            }
            if spec.host.is_some() {
                m.host = spec.host.clone();
            }
            Ok(m.clone())
        }
        None => {
            let mut m = Member::new(name.as_str(), &spec.role);
            m.prompt = Some(spec.prompt.clone());
            m.model = spec.model.clone();
            m.require_plan_approval = spec.require_plan_approval;
            m.auto_claim = spec.auto_claim;
            m.task_at = Some(crate::fsutil::now());
            m.budget_usd = spec.budget_usd;
            m.budget_tokens = spec.budget_tokens;
            m.host = spec.host.clone();
            cfg.members.push(m.clone());
            Ok(m)
        }
    }
}

/// Sends a plain message from the lead; returns its id.
pub fn send(team: &TeamDir, to: &str, text: &str) -> Result<String> {
    let to = AgentName::teammate(to)?;
    let msg = Message::new(MessageType::Message, LEAD, to.as_str(), text);
    mail::send(team, &msg, Stopped::Accept, Durability::Sync)?;
    Ok(msg.id)
}

/// Sends a broadcast to every member that has (or should have) a process; returns the
/// `(name, id)` pairs.
pub fn broadcast(team: &TeamDir, text: &str) -> Result<Vec<(String, String)>> {
    let cfg = Roster::new(team).load()?;
    let mut sent = Vec::new();
    for m in cfg.members.iter().filter(|m| m.status.wants_process()) {
        let msg = Message::new(MessageType::Broadcast, LEAD, &m.name, text);
        mail::send(team, &msg, Stopped::Accept, Durability::Sync)?;
        sent.push((m.name.clone(), msg.id));
    }
    Ok(sent)
}

/// Asks a running teammate to shut down: a pending request aimed at its current incarnation,
/// and a `shutdown_request` message. Returns the request. If the message cannot be appended (for
/// example the inbox is full), the request is expired at once and the append's error returned.
///
/// A member with no process yet (`spawning`: brand new, reactivated, or waiting out a restart
/// backoff) has no current incarnation to aim at: the request is aimed at none, which means
/// whichever incarnation runs next. Aimed at the last one, it would be rejected as stale by the
/// very process it was meant for.
pub fn request_shutdown(
    team: &TeamDir,
    name: &str,
    reason: &str,
    ttl: Duration,
) -> Result<Request> {
    let name = AgentName::teammate(name)?;
    let cfg = Roster::new(team).load()?;
    request_shutdown_of(team, cfg.require(name.as_str())?, reason, ttl)
}

/// [`request_shutdown`] of member `m` as the caller read it from the roster: the supervisor's
/// team stop asks every member from one read, rather than reading the whole roster for each.
pub fn request_shutdown_of(
    team: &TeamDir,
    m: &Member,
    reason: &str,
    ttl: Duration,
) -> Result<Request> {
    let name = AgentName::teammate(&m.name)?;
    if !m.status.wants_process() {
        return Err(Error::MemberConflict {
            name: name.to_string(),
            status: m.status.to_string(),
            why: "it is not running",
        });
    }
    let target = if m.status == MemberStatus::Spawning && m.pid.is_none() {
        None
    } else {
        Some(m.incarnation)
    };
    let store = RequestStore::new(team);
    let req = store.create(NewRequest {
        kind: RequestKind::Shutdown,
        from: LEAD.to_owned(),
        to: name.to_string(),
        payload: json!({"reason": reason}),
        target_incarnation: target,
        ttl: Some(ttl),
    })?;
    let mut msg = Message::new(MessageType::ShutdownRequest, LEAD, name.as_str(), reason)
        .with_request(&req.request_id);
    msg.reason = Some(reason.to_owned());
    if let Err(e) = Inbox::new(team, &name).append(&msg, Durability::Sync) {
        // Undelivered, the request must not outlive this error: pending, it would expire and
        // have the supervisor stop a teammate that was never asked, and it would block the
        // next request. Whatever made the append fail, the caller hears of that.
        let why = format!("the request could not be delivered: {e}");
        match store.expire_now(&req.request_id, &why) {
            Ok(_) => events::log(
                team,
                "shutdown_undelivered",
                json!({"name": name, "request_id": req.request_id, "error": e.to_string()}),
            ),
            Err(e2) => tracing::warn!(
                "could not expire the undelivered shutdown request {}: {e2}",
                req.request_id
            ),
        }
        return Err(e);
    }
    events::log(
        team,
        "shutdown_requested",
        json!({"name": name, "request_id": req.request_id, "target_incarnation": target}),
    );
    Ok(req)
}

/// The lead's decision on a plan: resolves the request and tells the teammate.
///
/// The `plan_approval_response` has an id derived from the request, so it can be sent again
/// without being consumed twice. That is what a repeated decision does: if the lead already
/// decided this request the same way (a crash or a failed append may have kept the teammate
/// from hearing it), the recorded answer is sent again, and the call still fails with
/// `AlreadyResolved`. A different decision sends nothing.
pub fn decide_plan(team: &TeamDir, id: &str, approve: bool, feedback: &str) -> Result<Request> {
    let store = RequestStore::new(team);
    let req = store.get(id)?;
    if req.kind != RequestKind::PlanApproval {
        return Err(Error::NotAddressee {
            id: id.to_owned(),
            to: req.to,
            who: LEAD.to_owned(),
        });
    }
    let req = match store.resolve(id, LEAD, approve, json!({"feedback": feedback})) {
        Ok(req) => req,
        Err(e @ Error::AlreadyResolved { .. }) => {
            let cur = store.get(id)?;
            let decided_alike = cur.response.as_ref().is_some_and(|r| {
                r.get("by").and_then(|b| b.as_str()) == Some(LEAD)
                    && r.get("approve").and_then(|a| a.as_bool()) == Some(approve)
            });
            if decided_alike {
                send_plan_response(team, &cur, approve, cur.response_text().unwrap_or(""))?;
                events::log(
                    team,
                    "plan_response_resent",
                    json!({"name": cur.from, "request_id": id, "approve": approve}),
                );
            }
            return Err(e);
        }
        Err(e) => return Err(e),
    };
    send_plan_response(team, &req, approve, feedback)?;
    events::log(
        team,
        if approve {
            "plan_approved"
        } else {
            "plan_rejected"
        },
        json!({"name": req.from, "request_id": id, "feedback": feedback}),
    );
    Ok(req)
}

/// Tells the submitter of a plan request the lead's decision.
fn send_plan_response(team: &TeamDir, req: &Request, approve: bool, feedback: &str) -> Result<()> {
    let id = &req.request_id;
    let mut msg =
        Message::new(MessageType::PlanApprovalResponse, LEAD, &req.from, feedback).with_request(id);
    // Derived from the request: a re-sent decision is consumed once.
    msg.id = crate::ids::derived(&format!("plan_response:{id}")).to_string();
    msg.approve = Some(approve);
    msg.feedback = Some(feedback.to_owned());
    Inbox::new(team, &AgentName::teammate(&req.from)?).append(&msg, Durability::Sync)
}

/// The settings of a member that a team file declares (`lead up`), beside its name.
#[derive(Debug, Clone, PartialEq)]
pub struct MemberSettings {
    pub role: String,
    pub prompt: String,
    pub model: Option<String>,
    pub require_plan_approval: bool,
    pub auto_claim: bool,
    pub budget_usd: Option<f64>,
    pub budget_tokens: Option<u64>,
}

impl MemberSettings {
    /// The names of the settings in which member `m` differs from these, in a fixed order.
    pub fn changes(&self, m: &Member) -> Vec<&'static str> {
        let mut out = Vec::new();
        if m.role != self.role {
            out.push("role");
        }
        if m.prompt.as_deref() != Some(self.prompt.as_str()) {
            out.push("prompt");
        }
        if m.model != self.model {
            out.push("model");
        }
        if m.require_plan_approval != self.require_plan_approval {
            out.push("require_plan_approval");
        }
        if m.auto_claim != self.auto_claim {
            out.push("auto_claim");
        }
        if m.budget_usd != self.budget_usd {
            out.push("budget_usd");
        }
        if m.budget_tokens != self.budget_tokens {
            out.push("budget_tokens");
        }
        out
    }
}

/// Sets member `name`'s settings in the roster, without a task message and without a restart:
/// its worker takes role, prompt, model, plan approval and auto-claim from the roster again
/// between activations, so they apply from its next one (see `shared/agent/teammate.rs`), and
/// a budget is checked before its next model call. Returns the names of the settings that
/// changed; none changed, nothing is written and nothing logged.
pub fn update_settings(
    team: &TeamDir,
    name: &str,
    s: &MemberSettings,
) -> Result<Vec<&'static str>> {
    let name = AgentName::teammate(name)?;
    let changed = Roster::new(team).update_member(name.as_str(), |m| {
        let changed = s.changes(m);
        if !changed.is_empty() {
            m.role = s.role.clone();
            m.prompt = Some(s.prompt.clone());
            m.model = s.model.clone();
            m.require_plan_approval = s.require_plan_approval;
            m.auto_claim = s.auto_claim;
            m.budget_usd = s.budget_usd;
            m.budget_tokens = s.budget_tokens;
        }
        changed
    })?;
    if !changed.is_empty() {
        events::log(
            team,
            "member_updated",
            json!({"name": name, "changed": changed}),
        );
        if changed.contains(&"auto_claim") && s.auto_claim {
            crate::tasks::wake_claimers(team, None);
        }
    }
    Ok(changed)
}

/// Whether member `m` can be taken off the roster now: it has no process and none is coming.
/// `shutdown`, `failed` and `stopped` ones can; a `spawning` one only while no supervisor runs
/// (`supervisor_running`: someone holds `lead.lock`), else it may be starting right now.
pub fn removable(m: &Member, supervisor_running: bool) -> bool {
    match m.status {
        MemberStatus::Shutdown | MemberStatus::Failed | MemberStatus::Stopped => true,
        MemberStatus::Spawning => m.pid.is_none() && !supervisor_running,
        MemberStatus::Working | MemberStatus::Idle => false,
    }
}

/// Takes member `name` off the roster (`lead up --prune`). Only a member with no process and
/// none coming ([`removable`], checked under the roster lock); any other is refused with
/// [`Error::MemberConflict`]: shut it down first. Its in-progress tasks go back to `pending`;
/// its inbox, transcript and log stay on disk, and what it spent stays in the roster's
/// `retired_spend` ([`crate::config::TeamConfig::remove_member`]).
pub fn remove_member(team: &TeamDir, name: &str) -> Result<Member> {
    let name = AgentName::teammate(name)?;
    let running = crate::liveness::supervisor_running(team)?;
    let removed = Roster::new(team).update(|cfg| {
        let m = cfg.require(name.as_str())?;
        if !removable(m, running) {
            return Err(Error::MemberConflict {
                name: name.to_string(),
                status: m.status.to_string(),
                why: "it has (or is about to get) a process; shut it down first",
            });
        }
        // Its spend stays with the team and its name (`retired_spend`).
        Ok(cfg.remove_member(name.as_str()).expect("require found it"))
    })?;
    let released = crate::tasks::TaskStore::new(team).release_owned_by(name.as_str())?;
    events::log(
        team,
        "member_removed",
        json!({"name": name, "status": removed.status, "released_tasks": released.iter().map(|t| &t.id).collect::<Vec<_>>()}),
    );
    if !released.is_empty() {
        crate::tasks::wake_claimers(team, None);
    }
    Ok(removed)
}
