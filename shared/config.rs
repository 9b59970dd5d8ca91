//! The roster: `config.json`, the team's members and their state.
//!
//! The file is a superset of the reference design's (`{"team_name", "members": [{name, role,
//! status}]}`), which loads unchanged; fields this version does not know are kept. Every change
//! goes through [`Roster::update`]: lock `config.lock`, read, change, durably replace, unlock, so
//! the lead and the workers, which all write member state, never lose each other's updates.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::doc::{Doc, Seen};
use crate::error::{Error, Result};
use crate::fsutil;
use crate::llm::Usage;
use crate::teamdir::TeamDir;

/// A member's lifecycle state (DESIGN.md section 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberStatus {
    /// Asked for; no process yet (waits for a supervisor).
    Spawning,
    /// Its process is running an activation.
    Working,
    /// Its process is alive and waiting for messages.
    Idle,
    /// Exited after an approved shutdown.
    Shutdown,
    /// Given up on: a config error or the restart limit.
    Failed,
    /// Stopped with the team.
    Stopped,
}

impl MemberStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            MemberStatus::Spawning => "spawning",
            MemberStatus::Working => "working",
            MemberStatus::Idle => "idle",
            MemberStatus::Shutdown => "shutdown",
            MemberStatus::Failed => "failed",
            MemberStatus::Stopped => "stopped",
        }
    }

    /// Whether a process should be running for a member in this state.
    pub fn wants_process(self) -> bool {
        matches!(
            self,
            MemberStatus::Spawning | MemberStatus::Working | MemberStatus::Idle
        )
    }

    /// Whether messages to the member will never be read (until it is spawned again).
    pub fn is_terminal(self) -> bool {
        matches!(self, MemberStatus::Shutdown | MemberStatus::Failed)
    }
}

impl fmt::Display for MemberStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `pad`, not `write_str`: `lead status` lines its columns up with `{:<9}`.
        f.pad(self.as_str())
    }
}

/// What a member's process is doing, in more detail than the six statuses (which scripts parse
/// and which therefore stay as they are). A `working` member may be thinking (a model call),
/// waiting for the API to come back, or paused by a spend cap; a `spawning` one may be waiting
/// out a restart delay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActivityState {
    /// A process was started and has not reported yet.
    Starting,
    /// In an activation: a model call (`call`) or the tools it asked for.
    Working,
    /// The model API failed through all its retries; the next try is at `until`.
    WaitingApi,
    /// A model call waits for one of the team's call slots (the rate governor's cap).
    WaitingSlot,
    /// A spend cap or exhausted quota: no call until a new message arrives.
    Paused,
    /// Waiting for messages.
    Idle,
    /// The process exited unexpectedly; the supervisor starts it again at `until`.
    Restarting,
}

impl ActivityState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ActivityState::Starting => "starting",
            ActivityState::Working => "working",
            ActivityState::WaitingApi => "waiting_api",
            ActivityState::WaitingSlot => "waiting_slot",
            ActivityState::Paused => "paused",
            ActivityState::Idle => "idle",
            ActivityState::Restarting => "restarting",
        }
    }
}

/// A member's [`ActivityState`] with when it began and what it waits for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Activity {
    pub state: ActivityState,
    /// When this state began (seconds since the epoch).
    pub since: f64,
    /// The model call under way or waited for, counted over the member's life from 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub call: Option<u64>,
    /// `waiting_api`: when the next try is due; `restarting`: when the restart is due.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<f64>,
    /// `waiting_api`, `paused`: the last error, on one line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Activity {
    /// `state`, beginning now.
    pub fn now(state: ActivityState) -> Activity {
        Activity {
            state,
            since: fsutil::now(),
            call: None,
            until: None,
            error: None,
        }
    }
}

/// How a member's last process ended.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ExitInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<i32>,
    /// Signal name (`SIGKILL`) when the process died by a signal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<String>,
}

impl fmt::Display for ExitInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Padded as a whole, for `lead status`'s `{:<9}` column.
        match (&self.code, &self.signal) {
            (Some(c), _) => f.pad(&format!("exit {c}")),
            (None, Some(s)) => f.pad(s),
            (None, None) => f.pad("-"),
        }
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_f64(n: &f64) -> bool {
    *n == 0.0
}

/// One member's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Member {
    pub name: String,
    #[serde(default)]
    pub role: String,
    pub status: MemberStatus,
    #[serde(default)]
    pub pid: Option<u32>,
    /// Bumped on every spawn of a process for this member.
    #[serde(default)]
    pub incarnation: u64,
    /// Unexpected exits that were restarted, over the member's life.
    #[serde(default)]
    pub restarts: u32,
    #[serde(default)]
    pub last_exit: Option<ExitInfo>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub require_plan_approval: bool,
    /// The teammate's instructions (its system prompt's task part).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt: Option<String>,
    /// Tokens used over the member's life, summed after every model call.
    #[serde(default)]
    pub usage: Usage,
    /// Model calls made over the member's life.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub calls: u64,
    /// What its calls cost over its life, in US dollars (see [`crate::cost`]).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub cost_usd: f64,
    /// What the API billed, per incarnation.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ledger: Vec<crate::cost::LedgerLine>,
    /// The most it may spend over its life, in US dollars (`lead spawn --budget-usd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_usd: Option<f64>,
    /// The most tokens (input, output, cache write and read) it may use over its life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_tokens: Option<u64>,
    /// Why the member is `failed` (or other human-readable status detail).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Whether a plan of this member has been approved (opens the plan gate).
    #[serde(default, skip_serializing_if = "is_false")]
    pub plan_approved: bool,
    /// When its latest task was assigned (`lead spawn`): only a plan submitted after it opens
    /// the plan gate, so an approval from an earlier task or life does not carry over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_at: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<f64>,
    /// What the process is doing now (see [`ActivityState`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activity: Option<Activity>,
    /// When the member's own process last wrote its record: its last sign of life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_seen: Option<f64>,
    /// It claims the next claimable task whenever it would go idle (`lead spawn --auto-claim`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub auto_claim: bool,
    /// The team's `teammate_idle` hooks have yet to run for the activation that ended with
    /// this many model calls (set by the teammate as it goes idle, cleared by the supervisor).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_hook_pending: Option<u64>,
    /// Its own git worktree (`lead spawn --worktree`), its working dir, kept across restarts
    /// until `lead worktree remove`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worktree: Option<crate::worktree::Worktree>,
    /// The host whose supervisor runs it, on a team spread over machines (a bus): set by `lead
    /// spawn --host`, or by the first supervisor that starts it. `None` on one machine.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// The sandbox its commands run in, as its process found it at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<crate::sandbox::Status>,
    /// Grows by one with every write of its record (`members/NAME.json` in a team dir): a
    /// view entry in config.json at the record's rev that differs from it is a person's edit.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub rev: u64,
    /// Fields written by other versions, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Member {
    /// A fresh record in `spawning`.
    pub fn new(name: &str, role: &str) -> Member {
        Member {
            name: name.to_owned(),
            role: role.to_owned(),
            status: MemberStatus::Spawning,
            pid: None,
            incarnation: 0,
            restarts: 0,
            last_exit: None,
            model: None,
            require_plan_approval: false,
            prompt: None,
            usage: Usage::default(),
            calls: 0,
            cost_usd: 0.0,
            ledger: Vec::new(),
            budget_usd: None,
            budget_tokens: None,
            reason: None,
            plan_approved: false,
            task_at: None,
            updated_at: None,
            activity: None,
            last_seen: None,
            auto_claim: false,
            idle_hook_pending: None,
            worktree: None,
            host: None,
            sandbox: None,
            rev: 0,
            extra: Map::new(),
        }
    }
}

fn default_team_name() -> String {
    "default".to_owned()
}

/// The whole of `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TeamConfig {
    #[serde(default = "default_team_name")]
    pub team_name: String,
    #[serde(default)]
    pub members: Vec<Member>,
    /// The sandbox of the LLM lead's own tools (`lead chat`, `lead demo`), as the latest one
    /// found it at start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lead_sandbox: Option<crate::sandbox::Status>,
    /// The most the whole team (members and the LLM lead) may spend, in US dollars
    /// (`lead run --team-budget-usd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub team_budget_usd: Option<f64>,
    /// What the LLM lead (`lead chat`, `lead demo`) spent over the team's life.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lead_spend: Option<crate::cost::Spend>,
    /// What members taken off the roster (`lead up --prune`) spent over their lives, by name.
    ///
    /// A member's spend lives in its record, which a removal drops; kept here, it still counts
    /// toward the team's spend and `team_budget_usd`. A name is one budget over its whole life:
    /// a member added again under a removed name counts this spend against its own
    /// `budget_usd` and `budget_tokens` as well (see [`crate::cost::life_spend`]), so pruning
    /// and re-adding a member does not give it a fresh budget. Its record's own totals (what
    /// `lead status` shows for it) count only the new life.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub retired_spend: BTreeMap<String, crate::cost::Spend>,
    /// The user's commands run on team events (see [`crate::hooks`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<crate::hooks::Hook>,
    /// At most this many members that are not `shutdown` or `failed` (`lead run
    /// --max-members`; see [`crate::ceilings`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_members: Option<u32>,
    /// The branch the merge queue lands worktree members' work on (team file
    /// `target_branch`; `lead run --target` overrides it; default `troupe/integration`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_branch: Option<String>,
    /// The `merge_check` hooks share one build cache (`CARGO_TARGET_DIR`) across entries, the
    /// members' alike (team file `shared_check_cache`); left out or false, each entry's checks
    /// start from an empty one, so that one member's build cannot leave what another's trusts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_check_cache: Option<bool>,
    /// At most this many spawns that start a process within a minute (`lead run
    /// --max-spawns-per-minute`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_spawns_per_minute: Option<u32>,
    /// When the spawns of the last minute were made (Unix seconds), while
    /// `max_spawns_per_minute` is set.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spawn_times: Vec<f64>,
    /// At most this many model calls in flight across the team (`lead run
    /// --max-concurrent-calls`; see [`crate::governor`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_concurrent_calls: Option<u32>,
    /// The same per model: model-id prefix -> calls in flight (the longest prefix applies).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub model_caps: BTreeMap<String, u32>,
    /// The rate governor, `on` (left out) or `off` (`lead run --rate-governor`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_governor: Option<crate::governor::Mode>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Default for TeamConfig {
    fn default() -> TeamConfig {
        TeamConfig {
            team_name: default_team_name(),
            members: Vec::new(),
            lead_sandbox: None,
            team_budget_usd: None,
            lead_spend: None,
            retired_spend: BTreeMap::new(),
            hooks: Vec::new(),
            max_members: None,
            target_branch: None,
            shared_check_cache: None,
            max_spawns_per_minute: None,
            spawn_times: Vec::new(),
            max_concurrent_calls: None,
            model_caps: BTreeMap::new(),
            rate_governor: None,
            extra: Map::new(),
        }
    }
}

impl TeamConfig {
    /// The member called `name`.
    pub fn member(&self, name: &str) -> Option<&Member> {
        self.members.iter().find(|m| m.name == name)
    }

    /// The member called `name`, mutably.
    pub fn member_mut(&mut self, name: &str) -> Option<&mut Member> {
        self.members.iter_mut().find(|m| m.name == name)
    }

    /// Takes member `name` off the roster (`lead up --prune`) and returns its record. What it
    /// spent stays: it is added to [`TeamConfig::retired_spend`] under its name.
    pub fn remove_member(&mut self, name: &str) -> Option<Member> {
        let i = self.members.iter().position(|m| m.name == name)?;
        let m = self.members.remove(i);
        self.retired_spend
            .entry(m.name.clone())
            .or_default()
            .add(&crate::cost::member_spend(&m));
        Some(m)
    }

    /// The member called `name`, or [`Error::UnknownMember`].
    pub fn require(&self, name: &str) -> Result<&Member> {
        self.member(name)
            .ok_or_else(|| Error::UnknownMember(name.to_owned()))
    }

    /// The member called `name`, mutably, or [`Error::UnknownMember`].
    pub fn require_mut(&mut self, name: &str) -> Result<&mut Member> {
        self.member_mut(name)
            .ok_or_else(|| Error::UnknownMember(name.to_owned()))
    }
}

/// `f` applied to a copy of `before`: the roster after it, whether `f` changed it (whether it
/// must be written), and what `f` returned.
fn apply<R>(
    before: TeamConfig,
    f: impl FnOnce(&mut TeamConfig) -> Result<R>,
) -> Result<(TeamConfig, bool, R)> {
    let mut cfg = before.clone();
    let out = f(&mut cfg)?;
    let changed = cfg != before;
    Ok((cfg, changed, out))
}

/// The roster in `bytes` of `doc` (an empty team when there are none).
fn parse(doc: &Doc<'_>, bytes: Option<&[u8]>) -> Result<TeamConfig> {
    bytes.map_or(Ok(TeamConfig::default()), |b| {
        serde_json::from_slice(b).map_err(|e| doc.corrupt(e))
    })
}

/// Access to a team's roster: in a team dir, `config.json` and one record per member (see
/// [`crate::store::files::roster`]); on a bus, one document.
#[derive(Debug, Clone)]
pub struct Roster {
    team: TeamDir,
}

/// What [`Roster::load_into`] last read.
#[derive(Debug, Default)]
pub struct RosterSeen {
    files: crate::store::files::roster::Seen,
    doc: Seen,
}

impl RosterSeen {
    /// From now on the caller says, with [`RosterSeen::note_changes`], which members' records
    /// changed (a watch of the team dir tells): a read looks at those only.
    pub fn watched(&mut self) {
        self.files.watched();
    }

    /// Members whose records changed, as a watch saw them (`None`: it cannot tell).
    pub fn note_changes(&mut self, names: Option<std::collections::HashSet<String>>) {
        self.files.note_changes(names);
    }

    /// Whether a member's record changed since the last call (in a team dir: the view in
    /// config.json is behind it then).
    pub fn take_records_changed(&mut self) -> bool {
        self.files.take_records_changed()
    }

    /// A reader that holds the file it read open (see [`Seen::holding`]): for one process
    /// that looks often.
    pub fn holding() -> RosterSeen {
        RosterSeen {
            files: crate::store::files::roster::Seen::holding(),
            doc: Seen::holding(),
        }
    }
}

/// The files backend of the roster.
use crate::store::files::roster as files;

impl Roster {
    /// The roster of `team`.
    pub fn new(team: &TeamDir) -> Roster {
        Roster { team: team.clone() }
    }

    fn doc(&self) -> Doc<'_> {
        Doc::roster(&self.team)
    }

    /// Whether the roster is the team dir's files (else one document on the bus).
    fn in_files(&self) -> bool {
        self.team.store().for_people()
    }

    /// Where the roster is, for messages: the path of `config.json`, or its key on the bus.
    fn place(&self) -> String {
        self.doc().place()
    }

    /// Reads the roster (an empty team if there is none). A file that does not parse is an
    /// error and is left as it is.
    pub fn load(&self) -> Result<TeamConfig> {
        if self.in_files() {
            return files::load(&self.team);
        }
        let doc = self.doc();
        parse(&doc, doc.read()?.as_deref())
    }

    /// The roster as member `name` needs it (its budget, its settings): the team's fields and
    /// its own record, without the other members' when it can (a team dir, no team budget);
    /// otherwise all of it.
    pub fn load_for(&self, name: &str) -> Result<TeamConfig> {
        if self.in_files() {
            return files::load_for(&self.team, name);
        }
        self.load()
    }

    /// The team's own fields (its hooks, budget, name), without the members when it can skip
    /// reading them (a team dir): `members` may be empty or hold everyone; do not look at it.
    pub fn load_team(&self) -> Result<TeamConfig> {
        if self.in_files() {
            return files::load_team(&self.team);
        }
        self.load()
    }

    /// Brings `cfg`, the roster as `seen` last left it (empty the first time), up to date,
    /// reading only what changed; returns whether anything did. In a team dir, only the members
    /// whose records changed are replaced in it (see [`files::load_into`]); on a bus, it is
    /// replaced whole when the roster changed. On an error `cfg` keeps what it had (in a team
    /// dir, with the members read before the error brought up to date).
    pub fn load_into(&self, seen: &mut RosterSeen, cfg: &mut TeamConfig) -> Result<bool> {
        if self.in_files() {
            return files::load_into(&self.team, &mut seen.files, cfg);
        }
        let doc = self.doc();
        match doc.read_if_changed(&mut seen.doc)? {
            Some(bytes) => {
                *cfg = parse(&doc, bytes.as_deref())?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Brings `config.json`'s view of the members up to date with their records (a no-op on
    /// a bus). Returns whether it wrote anything.
    pub fn refresh_view(&self) -> Result<bool> {
        if self.in_files() {
            return files::refresh_view(&self.team);
        }
        Ok(false)
    }

    /// Changes the roster as a whole under its lock (`config.lock`), durably. If `f` fails,
    /// nothing is written. Nothing is written either if `f` changed nothing.
    pub fn update<R>(&self, f: impl FnOnce(&mut TeamConfig) -> Result<R>) -> Result<R> {
        self.update_and_read(f).map(|(_, out)| out)
    }

    /// [`Roster::update`], returning also the roster as it stands after the change: a writer
    /// that needs the whole roster next (a worker's budget check) need not read it again.
    pub fn update_and_read<R>(
        &self,
        f: impl FnOnce(&mut TeamConfig) -> Result<R>,
    ) -> Result<(TeamConfig, R)> {
        if self.in_files() {
            return files::update(&self.team, f);
        }
        let doc = self.doc();
        doc.update(|bytes| {
            let (cfg, changed, out) = apply(parse(&doc, bytes.as_deref())?, f)?;
            let bytes = changed.then(|| doc.encode(&cfg)).transpose()?;
            Ok((bytes, (cfg, out)))
        })
    }

    /// Changes member `name` alone: in a team dir, its record only, whatever the team's size
    /// (the view in config.json follows within [`files::VIEW_LAG`] while a supervisor runs).
    /// `f` sees a roster holding that member alone, and the team's own fields when
    /// `with_team`; it may change nothing else. Returns the record as it is after `f`, `None`
    /// when there is no such member.
    pub fn write_member(
        &self,
        name: &str,
        with_team: bool,
        f: &mut dyn FnMut(&mut TeamConfig),
    ) -> Result<Option<Member>> {
        if self.in_files() {
            return Ok(
                match files::update_member(&self.team, name, with_team, f)? {
                    files::MemberWrite::Written(m) | files::MemberWrite::Unchanged(m) => Some(m),
                    files::MemberWrite::Missing => None,
                },
            );
        }
        self.update(|cfg| {
            let Some(i) = cfg.members.iter().position(|m| m.name == name) else {
                return Ok(None);
            };
            let mut one = TeamConfig {
                members: vec![cfg.members[i].clone()],
                ..cfg.clone()
            };
            f(&mut one);
            if let Some(m) = one.members.into_iter().find(|m| m.name == name) {
                cfg.members[i] = m;
            }
            Ok(Some(cfg.members[i].clone()))
        })
    }

    /// Changes each of `names` with `f`: in a team dir, each one's record alone ([`Roster::write_member`]:
    /// `f` sees a roster holding that member, without the team's fields), whatever the team's
    /// size; on a bus, one change of the whole roster (`f` sees every member). `f` must change
    /// only members of `names`. A failure stops it, and the records written before it stay.
    pub fn update_members(
        &self,
        names: &[String],
        f: &mut dyn FnMut(&mut TeamConfig),
    ) -> Result<()> {
        if !self.in_files() {
            return self.update(|cfg| {
                f(cfg);
                Ok(())
            });
        }
        for name in names {
            self.write_member(name, false, f)?;
        }
        Ok(())
    }

    /// Changes or adds member `name` alone (`lead spawn`): in a team dir, from the team's own
    /// fields and that member's record, without reading the others (see
    /// [`files::update_one`]); the whole roster when that cannot be. `f` sees a roster with
    /// the team's fields and, if it is on the team, that member; it changes nothing else. The
    /// view in config.json is brought up to date now unless a supervisor runs (it does so
    /// within [`files::VIEW_LAG`]).
    pub fn update_one<R>(
        &self,
        name: &str,
        f: impl FnOnce(&mut TeamConfig) -> Result<R>,
    ) -> Result<R> {
        if !self.in_files() {
            return self.update(f);
        }
        let mut f = Some(f);
        let once = |cfg: &mut TeamConfig| (f.take().expect("run once"))(cfg);
        let out = match files::update_one(&self.team, name, once)? {
            Some((_, out)) => out,
            None => return self.update(f.take().expect("not run yet")),
        };
        if !crate::liveness::supervisor_named(&self.team)
            && let Err(e) = self.refresh_view()
        {
            tracing::debug!("config.json's view not brought up to date: {e}");
        }
        Ok(out)
    }

    /// Reads the roster, waiting while config.json does not parse (a user's edit in progress)
    /// until it does or `stop()` says to give up (then the parse error is returned). The first
    /// error of each kind is logged once.
    pub fn load_patiently(&self, stop: &dyn Fn() -> bool) -> Result<TeamConfig> {
        self.patiently(None, stop)
    }

    /// [`Roster::load_patiently`] of what member `name` needs ([`Roster::load_for`]).
    pub fn load_for_patiently(&self, name: &str, stop: &dyn Fn() -> bool) -> Result<TeamConfig> {
        self.patiently(Some(name), stop)
    }

    fn patiently(&self, name: Option<&str>, stop: &dyn Fn() -> bool) -> Result<TeamConfig> {
        let mut said: Option<String> = None;
        loop {
            let read = match name {
                Some(n) => self.load_for(n),
                None => self.load(),
            };
            match read {
                Err(e @ Error::Corrupt { .. }) => {
                    let text = e.to_string();
                    if said.as_deref() != Some(text.as_str()) {
                        tracing::warn!("{text}; waiting until it parses");
                        said = Some(text);
                    }
                    if stop() {
                        return Err(e);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(100));
                }
                other => return other,
            }
        }
    }

    /// Changes one member's record (see [`Roster::write_member`]) and brings config.json's
    /// view up to date (for the CLI: a person reads the file next); `updated_at` is stamped
    /// only when something changed, and nothing is written otherwise.
    pub fn update_member<R>(&self, name: &str, f: impl FnOnce(&mut Member) -> R) -> Result<R> {
        let mut f = Some(f);
        let mut out = None;
        let written = self.write_member(name, false, &mut |c| {
            if let (Some(f), Some(m)) = (f.take(), c.members.first_mut()) {
                let before = m.clone();
                out = Some(f(m));
                if *m != before {
                    m.updated_at = Some(fsutil::now());
                }
            }
        })?;
        if written.is_none() {
            return Err(Error::UnknownMember(name.to_owned()));
        }
        // The record holds the change; a view that cannot be written now (config.json in a
        // person's hands) catches up later.
        if let Err(e) = self.refresh_view() {
            tracing::debug!("config.json's view not brought up to date: {e}");
        }
        Ok(out.expect("the change ran"))
    }
}

/// A roster change kept until it can be written; applied again on every try.
struct PendingWrite {
    change: Box<dyn Fn(&mut TeamConfig) + Send>,
    /// The one member it changes, if it changes only one (written to its record alone).
    member: Option<String>,
    /// Whether it reads the team's own fields.
    with_team: bool,
}

/// How long a [`RosterWriter`] dropped with writes pending (its process exiting: a stop, a
/// budget stop, a fatal error) keeps trying to write them. Shorter than the supervisor's
/// default `--kill-grace` (5 s), so a worker it stops is not killed while it waits.
pub const EXIT_FLUSH_WAIT: Duration = Duration::from_secs(3);

/// Roster writes that outlast an unreadable or unwritable config.json.
///
/// A person may be editing config.json by hand: while it does not parse (a typo, an editor that
/// truncates before it writes), nobody may overwrite it, and nobody may die of it. So a write
/// that finds the file unreadable (or that fails, say on a full disk) is kept, in order, and
/// applied with the next write or [`RosterWriter::flush`] once the file parses again. Each
/// distinct failure is logged once. The supervisor and the workers write through one of these.
///
/// Dropped with writes still pending, it tries again for up to [`EXIT_FLUSH_WAIT`] before it
/// gives them up (logged as an error): what a worker records last, such as the usage of its
/// last model call, is not lost to a stop that comes while a person fixes the file.
pub struct RosterWriter {
    roster: Roster,
    pending: Vec<PendingWrite>,
    last_error: Option<String>,
    /// With [`RosterWriter::keeping_recent`]: the roster as its latest write left it, and when.
    recent: Option<(Instant, TeamConfig)>,
    keep_recent: bool,
}

impl RosterWriter {
    /// A writer for `roster` with nothing pending.
    pub fn new(roster: Roster) -> RosterWriter {
        RosterWriter {
            roster,
            pending: Vec::new(),
            last_error: None,
            recent: None,
            keep_recent: false,
        }
    }

    /// A writer that keeps the roster as its latest write left it (see
    /// [`RosterWriter::recent`]): a worker reads the whole roster right after most of its
    /// writes (its budget, its settings), and with a team of hundreds, each read is a parse of
    /// hundreds of records.
    pub fn keeping_recent(roster: Roster) -> RosterWriter {
        let mut w = RosterWriter::new(roster);
        w.keep_recent = true;
        w
    }

    /// The roster as this writer's latest write left it, if that write was at most `within`
    /// ago: as good as a read that long ago. `None` otherwise, and while writes are pending.
    pub fn recent(&self, within: Duration) -> Option<&TeamConfig> {
        if self.is_pending() {
            return None;
        }
        self.recent
            .as_ref()
            .filter(|(at, _)| at.elapsed() <= within)
            .map(|(_, cfg)| cfg)
    }

    /// Drops the roster kept by [`RosterWriter::keeping_recent`] (before a long wait: it
    /// would be stale by then, and it holds memory).
    pub fn forget_recent(&mut self) {
        self.recent = None;
    }

    /// Applies `f` after the writes still pending. Returns whether everything is written now;
    /// `false` means it is kept for later (see [`RosterWriter::error`]).
    pub fn apply(&mut self, f: impl Fn(&mut TeamConfig) + Send + 'static) -> bool {
        self.defer(f);
        self.flush()
    }

    /// Keeps `f` to be written with the next write or [`RosterWriter::flush`], after the writes
    /// pending before it: one roster rewrite (and one `config.lock` hold) for changes that come
    /// together. The caller flushes before it waits for anything (a kill in between loses `f`,
    /// as it would lose a change not yet made).
    pub fn defer(&mut self, f: impl Fn(&mut TeamConfig) + Send + 'static) {
        self.pending.push(PendingWrite {
            change: Box::new(f),
            member: None,
            with_team: true,
        });
    }

    /// Changes member `name`'s record, stamping `updated_at`; with `incarnation`, only while the
    /// record is still that incarnation's (a process a newer one replaced writes nothing, and
    /// stamps `last_seen` when it does write). A member that is not in the roster is skipped.
    pub fn member(
        &mut self,
        name: &str,
        incarnation: Option<u64>,
        f: impl Fn(&mut Member) + Send + 'static,
    ) -> bool {
        self.member_later(name, incarnation, f);
        self.flush()
    }

    /// [`RosterWriter::member`], kept for the next write (see [`RosterWriter::defer`]).
    pub fn member_later(
        &mut self,
        name: &str,
        incarnation: Option<u64>,
        f: impl Fn(&mut Member) + Send + 'static,
    ) {
        self.pending.push(PendingWrite {
            change: Box::new(member_change(name, incarnation, f)),
            member: Some(name.to_owned()),
            with_team: false,
        });
    }

    /// Keeps `f`, a change of member `name` alone that reads the team's own fields (its hooks,
    /// say) but no other member, for the next write (see [`RosterWriter::defer`]).
    pub fn member_with_team_later(
        &mut self,
        name: &str,
        f: impl Fn(&mut TeamConfig) + Send + 'static,
    ) {
        self.pending.push(PendingWrite {
            change: Box::new(f),
            member: Some(name.to_owned()),
            with_team: true,
        });
    }

    /// The members the pending writes change, in the order they first come, when each write
    /// changes one member alone and those can be written to their records one by one: one
    /// member, or any number in a team dir (each record alone costs the same whatever the
    /// team's size, where a change of the whole roster reads and writes every member).
    fn members_alone(&self) -> Option<Vec<String>> {
        let mut names: Vec<String> = Vec::new();
        for p in &self.pending {
            let name = p.member.as_ref()?;
            if !names.contains(name) {
                names.push(name.clone());
            }
        }
        (names.len() == 1 || self.roster.in_files()).then_some(names)
    }

    /// Writes what is pending: changes of single members to their records alone (see
    /// [`RosterWriter::members_alone`]), anything else as a change of the whole roster. A
    /// failure keeps what is not written yet pending (a record written stays written: its
    /// changes, an incarnation's bump say, are not applied twice).
    fn write_pending(&mut self) -> Result<()> {
        if let Some(names) = self.members_alone() {
            for name in names {
                let pending = &self.pending;
                let mine = |p: &&PendingWrite| p.member.as_deref() == Some(name.as_str());
                let with_team = pending.iter().filter(mine).any(|p| p.with_team);
                let written = self.roster.write_member(&name, with_team, &mut |one| {
                    for p in pending.iter().filter(mine) {
                        (p.change)(one);
                    }
                })?;
                self.pending
                    .retain(|p| p.member.as_deref() != Some(name.as_str()));
                if let (Some(m), Some((_, cfg))) = (written, self.recent.as_mut())
                    && let Some(slot) = cfg.member_mut(&name)
                {
                    *slot = m;
                }
            }
            // With no supervisor to bring config.json's view up to date (a worker started by
            // hand on a team dir laid down from DESIGN.md), the writer does: a person or a
            // script reads the file next.
            if !crate::liveness::supervisor_named(&self.roster.team)
                && let Err(e) = self.roster.refresh_view()
            {
                tracing::debug!("config.json's view not brought up to date: {e}");
            }
            return Ok(());
        }
        let pending = &self.pending;
        let (cfg, ()) = self.roster.update_and_read(|cfg| {
            for p in pending {
                (p.change)(cfg);
            }
            Ok(())
        })?;
        if self.keep_recent {
            self.recent = Some((Instant::now(), cfg));
        }
        Ok(())
    }

    /// Tries to write what is pending. Returns whether nothing is left pending.
    pub fn flush(&mut self) -> bool {
        if self.pending.is_empty() {
            return true;
        }
        let written = self.write_pending();
        match written {
            Ok(()) => {
                self.pending.clear();
                if let Some(e) = self.last_error.take() {
                    tracing::info!(
                        "{} is writable again (after: {e}); pending changes written",
                        self.roster.place()
                    );
                }
                true
            }
            Err(e) => {
                self.recent = None;
                let text = e.to_string();
                if self.last_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(
                        "{text}; the change is kept and written once {} can be",
                        self.roster.place()
                    );
                    self.last_error = Some(text);
                }
                false
            }
        }
    }

    /// Tries to write what is pending until nothing is, or `wait` has passed, trying again
    /// every 100 ms. Returns whether nothing is left pending; what is still pending then is
    /// logged as an error, for the caller is about to drop it.
    pub fn flush_within(&mut self, wait: Duration) -> bool {
        if self.flush() {
            return true;
        }
        tracing::warn!(
            "{} change(s) to {} not written yet; trying for up to {:.1} s before exiting",
            self.pending.len(),
            self.roster.place(),
            wait.as_secs_f64()
        );
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100).min(deadline - Instant::now()));
            if self.flush() {
                return true;
            }
        }
        tracing::error!(
            "{} change(s) to {} lost: it could not be written in time ({})",
            self.pending.len(),
            self.roster.place(),
            self.last_error.as_deref().unwrap_or("unknown error")
        );
        false
    }

    /// Whether writes are waiting for config.json.
    pub fn is_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Why writes are pending, if they are.
    pub fn error(&self) -> Option<&str> {
        self.is_pending()
            .then_some(self.last_error.as_deref())
            .flatten()
    }
}

/// The change of [`RosterWriter::member`] as a roster write.
fn member_change(
    name: &str,
    incarnation: Option<u64>,
    f: impl Fn(&mut Member) + Send + 'static,
) -> impl Fn(&mut TeamConfig) + Send + 'static {
    let name = name.to_owned();
    move |cfg: &mut TeamConfig| {
        let Some(m) = cfg.member_mut(&name) else {
            return;
        };
        if incarnation.is_some_and(|i| i != m.incarnation) {
            return;
        }
        let now = fsutil::now();
        f(m);
        m.updated_at = Some(now);
        if incarnation.is_some() {
            m.last_seen = Some(now);
        }
    }
}

impl Drop for RosterWriter {
    fn drop(&mut self) {
        self.flush_within(EXIT_FLUSH_WAIT);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `lead status` lines its columns up with width specs, which `write_str` ignores.
    #[test]
    fn statuses_and_exits_fill_their_columns() {
        assert_eq!(format!("{:<9}|", MemberStatus::Idle), "idle     |");
        let exit = ExitInfo {
            code: Some(1),
            signal: None,
        };
        assert_eq!(format!("{exit:<9}|"), "exit 1   |");
        let killed = ExitInfo {
            code: None,
            signal: Some("SIGKILL".into()),
        };
        assert_eq!(format!("{killed:>9}|"), "  SIGKILL|");
        assert_eq!(
            format!("{:<12}|", crate::tasks::TaskStatus::Pending),
            "pending     |"
        );
    }

    fn roster() -> (tempfile::TempDir, TeamDir, Roster) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let r = Roster::new(&team);
        (tmp, team, r)
    }

    #[test]
    fn reference_shape_loads_unchanged() {
        let (_t, team, r) = roster();
        let text = r#"{"team_name":"default","members":[{"name":"alice","role":"coder","status":"idle"},{"name":"bob","role":"reviewer","status":"working"}]}"#;
        std::fs::write(team.config(), text).unwrap();
        let cfg = r.load().unwrap();
        assert_eq!(cfg.members.len(), 2);
        assert_eq!(cfg.members[0].status, MemberStatus::Idle);
        assert_eq!(cfg.members[1].role, "reviewer");
        // The older shape without team_name loads too.
        std::fs::write(
            team.config(),
            r#"{"members":[{"name":"a","role":"r","status":"shutdown"}]}"#,
        )
        .unwrap();
        assert_eq!(r.load().unwrap().team_name, "default");
    }

    #[test]
    fn garbage_is_an_error_and_untouched() {
        let (_t, team, r) = roster();
        std::fs::write(team.config(), "{not json").unwrap();
        let e = r.load().unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("failed to parse {}: ", team.config().display())),
            "{e}"
        );
        assert!(
            r.update(|c| {
                c.team_name = "x".into();
                Ok(())
            })
            .is_err()
        );
        assert_eq!(std::fs::read_to_string(team.config()).unwrap(), "{not json");
    }

    #[test]
    fn whole_writes_wait_for_an_unreadable_file_and_keep_their_order() {
        let (_t, team, r) = roster();
        r.update(|c| {
            c.members.push(Member::new("a", "r"));
            Ok(())
        })
        .unwrap();
        let mut w = RosterWriter::new(r.clone());
        assert!(w.member("a", None, |m| m.restarts = 1));
        std::fs::write(team.config(), "{\"members\": [").unwrap();
        // A member's own change goes on: it writes its record alone.
        assert!(w.member("a", None, |m| m.restarts += 1));
        // A change of the team waits, and so does everything after it, in order.
        assert!(!w.apply(|c| c.members[0].restarts += 10));
        assert!(!w.member("a", None, |m| m.restarts *= 2));
        assert!(w.error().unwrap().contains("config.json"));
        // Nobody overwrote the half-made edit.
        assert_eq!(
            std::fs::read_to_string(team.config()).unwrap(),
            "{\"members\": ["
        );
        std::fs::write(
            team.config(),
            r#"{"members":[{"name":"a","role":"r","status":"idle"}]}"#,
        )
        .unwrap();
        assert!(w.flush());
        assert!(!w.is_pending());
        assert_eq!(r.load().unwrap().members[0].restarts, 24);
        // A write for another incarnation is skipped; one for this one stamps last_seen.
        assert!(w.member("a", None, |m| m.incarnation = 2));
        assert!(w.member("a", Some(1), |m| m.restarts = 0));
        assert_eq!(r.load().unwrap().members[0].restarts, 24);
        assert!(w.member("a", Some(2), |m| m.restarts = 0));
        let m = r.load().unwrap().members[0].clone();
        assert_eq!(m.restarts, 0);
        assert!(m.last_seen.is_some());
    }

    #[test]
    fn deferred_changes_go_out_with_the_next_write() {
        let (_t, team, r) = roster();
        r.update(|c| {
            c.members.push(Member::new("a", "r"));
            Ok(())
        })
        .unwrap();
        let inode =
            || std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(team.config()).unwrap());
        let before = inode();
        let mut w = RosterWriter::new(r.clone());
        w.member_later("a", None, |m| m.restarts = 4);
        w.defer(|c| c.members[0].restarts *= 10);
        // Kept, not written.
        assert!(w.is_pending());
        assert_eq!(r.load().unwrap().members[0].restarts, 0);
        assert_eq!(inode(), before);
        // The next write carries them, in order.
        assert!(w.member("a", None, |m| m.restarts += 2));
        assert!(!w.is_pending());
        assert_eq!(r.load().unwrap().members[0].restarts, 42);
        assert_ne!(inode(), before);
        // A flush writes what was deferred alone.
        w.member_later("a", None, |m| m.restarts = 7);
        assert!(w.flush());
        assert_eq!(r.load().unwrap().members[0].restarts, 7);
    }

    #[test]
    fn a_writer_keeps_the_roster_it_wrote_only_while_it_is_recent() {
        let (_t, _team, r) = roster();
        r.update(|c| {
            c.members.push(Member::new("a", "r"));
            c.members.push(Member::new("b", "r"));
            Ok(())
        })
        .unwrap();
        let week = Duration::from_secs(7 * 86400);
        let mut plain = RosterWriter::new(r.clone());
        assert!(plain.apply(|c| c.members[0].calls = 1));
        assert!(plain.recent(week).is_none());
        let mut w = RosterWriter::keeping_recent(r.clone());
        assert!(w.recent(week).is_none());
        // A member's own write reads no other member: nothing to keep yet.
        assert!(w.member("a", None, |m| m.calls = 2));
        assert!(w.recent(week).is_none());
        assert!(w.apply(|c| c.members[1].calls = 5));
        // The whole roster as written: the other members too.
        let kept = w.recent(week).unwrap();
        assert_eq!(kept, &r.load().unwrap());
        assert_eq!(kept.members[0].calls, 2);
        assert_eq!(kept.members[1].name, "b");
        // A member's later write updates it in what was kept.
        assert!(w.member("a", None, |m| m.calls = 3));
        assert_eq!(w.recent(week).unwrap().members[0].calls, 3);
        std::thread::sleep(Duration::from_millis(5));
        assert!(w.recent(Duration::from_millis(1)).is_none());
        // Deferred changes make what was kept out of date.
        w.member_later("b", None, |m| m.calls = 3);
        assert!(w.recent(week).is_none());
        assert!(w.flush());
        assert_eq!(w.recent(week).unwrap().members[1].calls, 3);
        w.forget_recent();
        assert!(w.recent(week).is_none());
    }

    #[test]
    fn a_dropped_writer_writes_what_is_pending_once_the_file_parses() {
        let (_t, team, r) = roster();
        r.update(|c| {
            c.members.push(Member::new("a", "r"));
            Ok(())
        })
        .unwrap();
        let good = std::fs::read(team.config()).unwrap();
        std::fs::write(team.config(), "{\"members\": [").unwrap();
        let mut w = RosterWriter::new(r.clone());
        assert!(!w.apply(|c| c.members[0].calls = 7));
        // The writer goes with its process; the file is fixed meanwhile.
        let dropped = std::thread::spawn(move || drop(w));
        std::fs::write(team.config(), good).unwrap();
        dropped.join().unwrap();
        assert_eq!(r.load().unwrap().members[0].calls, 7);
        // With nothing pending, a drop writes nothing.
        let before = std::fs::read(team.config()).unwrap();
        drop(RosterWriter::new(r.clone()));
        assert_eq!(std::fs::read(team.config()).unwrap(), before);
    }

    #[test]
    fn unknown_fields_survive_an_update() {
        let (_t, team, r) = roster();
        std::fs::write(team.config(), r#"{"team_name":"t","flavour":1,"members":[{"name":"a","role":"r","status":"idle","colour":"red"}]}"#).unwrap();
        r.update_member("a", |m| m.restarts = 2).unwrap();
        let v: Value = serde_json::from_slice(&std::fs::read(team.config()).unwrap()).unwrap();
        assert_eq!(v["flavour"], 1);
        assert_eq!(v["members"][0]["colour"], "red");
        assert_eq!(v["members"][0]["restarts"], 2);
        assert_eq!(
            r.update_member("zed", |_| ()).unwrap_err().to_string(),
            "no such teammate: zed"
        );
    }
}
