//! `lead up FILE [--prune] [--json]`: brings a team up from one file a user can commit.
//!
//! The file (TOML, or the same schema as JSON when its name ends in `.json`) declares members,
//! tasks and hooks. Applying it makes the team dir say what the file says, and nothing else:
//!
//! - a member not in the roster is spawned ([`troupe::ops::spawn`]: `spawning`, its prompt as
//!   its first task, started by a supervisor, before or after `lead run`); one whose settings
//!   changed gets them in the roster without a message or a restart (they apply from its next
//!   activation); a member the file no longer lists is reported, and removed with `--prune`
//!   only if it has no process (a running one is refused: shut it down first);
//! - a task is created once per `key`: the key is stored on the task, and a task whose key is on
//!   the board is not added again (a pending one takes a changed subject or description);
//! - the hooks in `config.json` are replaced by the file's list.
//!
//! The work is split in three steps, the first two pure: [`parse`] reads the file, [`validate`]
//! checks everything that can be checked without the team dir (names, keys, blockers, cycles,
//! prompt files), [`diff`] compares the result with the roster and the board and decides every
//! change (or refuses: an unknown owner, a cancelled blocker, a prune of a running member).
//! Only then does [`apply`] write, so a bad file changes nothing. Applying the same file twice,
//! the second run finds nothing to change: no write, no event, no message.
//!
//! Once the diff is decided, before anything is written, [`crate::up_trust`] decides whether
//! the file may be applied without a person's `--accept`: one a teammate could have rewritten
//! since it was last applied is shown as a diff and refused (exit 5). Prompt files are read
//! only from under the file's directory. The hooks of a file so applied that run outside the
//! sandbox are recorded with it: the supervisor runs no other hook outside.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use troupe::println;

use anyhow::Context;
use serde::Deserialize;
use serde_json::{Value, json};
use troupe::config::{MemberStatus, Roster, TeamConfig};
use troupe::hooks::{Hook, HookEvent};
use troupe::ops::{self, MemberSettings, SpawnSpec};
use troupe::tasks::{NewTask, Task, TaskStatus, TaskStore};
use troupe::teamdir::LEAD;
use troupe::{AgentName, TeamDir};

use crate::{ExitError, up_trust};

#[derive(Debug, clap::Args)]
pub struct UpArgs {
    /// The team file: TOML, or JSON if its name ends in `.json`.
    file: PathBuf,
    /// Remove members the file no longer lists (refused for one that is running).
    #[arg(long)]
    prune: bool,
    /// Apply a file that lies where teammates' commands can write and changed since it was
    /// last applied (without it, `lead up` shows the changes and exits 5).
    #[arg(long)]
    accept: bool,
    #[arg(long)]
    json: bool,
}

/// The team file as written.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TeamFile {
    /// Sets `team_budget_usd` in config.json; left out, the team budget is left as it is.
    #[serde(default)]
    pub team_budget_usd: Option<f64>,
    /// Sets `max_members` in config.json (see `troupe::ceilings`); left out, left as it is.
    #[serde(default)]
    pub max_members: Option<u32>,
    /// Sets `target_branch` in config.json: where the merge queue lands worktree members'
    /// work (default `troupe/integration`); left out, left as it is.
    #[serde(default)]
    pub target_branch: Option<String>,
    /// Sets `shared_check_cache` in config.json: the `merge_check` hooks keep one build cache
    /// for every entry (default: one per entry); left out, left as it is.
    #[serde(default)]
    pub shared_check_cache: Option<bool>,
    /// Sets `max_spawns_per_minute` in config.json; left out, left as it is.
    #[serde(default)]
    pub max_spawns_per_minute: Option<u32>,
    /// Sets `max_concurrent_calls` in config.json (see `troupe::governor`).
    #[serde(default)]
    pub max_concurrent_calls: Option<u32>,
    /// Sets `model_caps` (model-id prefix -> calls in flight); left out, left as it is.
    #[serde(default)]
    pub model_caps: Option<std::collections::BTreeMap<String, u32>>,
    /// Sets `rate_governor` (`on` or `off`).
    #[serde(default)]
    pub rate_governor: Option<troupe::governor::Mode>,
    #[serde(default)]
    pub members: Vec<MemberDecl>,
    #[serde(default)]
    pub tasks: Vec<TaskDecl>,
    /// Replaces config.json's hooks (left out: no hooks).
    #[serde(default)]
    pub hooks: Vec<HookDecl>,
}

/// One member of the file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemberDecl {
    pub name: String,
    pub role: String,
    /// Its instructions; or `prompt_file`, relative to the team file's directory and read only
    /// from under it.
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub prompt_file: Option<PathBuf>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub require_plan_approval: bool,
    #[serde(default)]
    pub auto_claim: bool,
    /// Its own git worktree (`lead spawn --worktree`); applied when the member is spawned.
    #[serde(default)]
    pub worktree: bool,
    /// The host whose supervisor runs it, on a team across machines (`lead spawn --host`);
    /// applied when the member is spawned.
    #[serde(default)]
    pub host: Option<String>,
    #[serde(default)]
    pub budget_usd: Option<f64>,
    #[serde(default)]
    pub budget_tokens: Option<u64>,
}

/// One task of the file.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskDecl {
    /// The task's name in the file: it is created once per key.
    pub key: String,
    pub subject: String,
    #[serde(default)]
    pub description: String,
    /// Keys of other tasks of the file that must be completed first.
    #[serde(default)]
    pub blocked_by: Vec<String>,
    /// A member (of the file or the roster) the task is assigned to.
    #[serde(default)]
    pub owner: Option<String>,
}

/// One hook of the file (the schema of config.json's, refusing unknown keys).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HookDecl {
    pub event: HookEvent,
    pub command: String,
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// `false`: runs outside the sandbox, as the supervisor's user (see [`Hook::sandbox`]).
    #[serde(default = "yes")]
    pub sandbox: bool,
}

fn yes() -> bool {
    true
}

/// A file that does not parse or does not hold together: exit 2, nothing changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct Invalid(pub String);

fn invalid(msg: impl Into<String>) -> Invalid {
    Invalid(msg.into())
}

/// Parses the text of a team file; `json` for the JSON form.
pub fn parse(text: &str, json: bool) -> Result<TeamFile, Invalid> {
    if json {
        serde_json::from_str(text).map_err(|e| invalid(e.to_string()))
    } else {
        toml::from_str(text).map_err(|e| invalid(e.to_string().trim_end().to_owned()))
    }
}

/// A member as the file declares it, its prompt read.
#[derive(Debug, Clone, PartialEq)]
pub struct Declared {
    pub name: String,
    pub settings: MemberSettings,
    /// Its own git worktree (`lead spawn --worktree`), given when it is added.
    pub worktree: bool,
    /// Its host (`lead spawn --host`), given when it is added.
    pub host: Option<String>,
}

/// A validated file: what [`diff`] compares with the team dir.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub team_budget_usd: Option<f64>,
    pub max_members: Option<u32>,
    pub target_branch: Option<String>,
    pub shared_check_cache: Option<bool>,
    pub max_spawns_per_minute: Option<u32>,
    pub max_concurrent_calls: Option<u32>,
    pub model_caps: Option<std::collections::BTreeMap<String, u32>>,
    pub rate_governor: Option<troupe::governor::Mode>,
    pub members: Vec<Declared>,
    /// In an order where every task comes after its blockers.
    pub tasks: Vec<TaskDecl>,
    pub hooks: Vec<Hook>,
}

/// Whether `key` is a task key: 1 to 64 of `[A-Za-z0-9_.-]`, starting with a letter or digit.
fn valid_key(key: &str) -> bool {
    let mut chars = key.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && key.len() <= 64
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))
}

fn check_usd(what: &str, x: Option<f64>) -> Result<(), Invalid> {
    match x {
        Some(x) if !x.is_finite() || x < 0.0 => Err(invalid(format!(
            "{what}: must be a non-negative number of dollars, not {x}"
        ))),
        _ => Ok(()),
    }
}

/// Checks everything that does not depend on the team dir, reading prompt files with
/// `read_prompt` (given the path as written, relative to the file's directory). Every problem
/// is an [`Invalid`] naming the member, task or hook.
pub fn validate(
    file: TeamFile,
    read_prompt: &dyn Fn(&Path) -> Result<String, String>,
) -> Result<Plan, Invalid> {
    check_usd("team_budget_usd", file.team_budget_usd)?;
    if let Some(b) = &file.target_branch {
        troupe::merge::check_branch_name(b)
            .map_err(|why| invalid(format!("target_branch: {why}")))?;
    }
    for (what, n) in [
        ("max_members", file.max_members),
        ("max_spawns_per_minute", file.max_spawns_per_minute),
        ("max_concurrent_calls", file.max_concurrent_calls),
    ]
    .into_iter()
    .chain(
        file.model_caps
            .iter()
            .flatten()
            .map(|(_, n)| ("model_caps", Some(*n))),
    ) {
        if n == Some(0) {
            return Err(invalid(format!("{what}: must be 1 or more")));
        }
    }
    let mut members = Vec::new();
    let mut names = BTreeSet::new();
    for m in file.members {
        let who = format!("member {:?}", m.name);
        AgentName::teammate(&m.name).map_err(|e| invalid(format!("{who}: {e}")))?;
        if !names.insert(m.name.clone()) {
            return Err(invalid(format!("{who} is declared twice")));
        }
        if m.role.trim().is_empty() {
            return Err(invalid(format!("{who}: the role is empty")));
        }
        let prompt = match (m.prompt, &m.prompt_file) {
            (Some(p), None) => p,
            (None, Some(f)) => {
                read_prompt(f).map_err(|e| invalid(format!("{who}: prompt_file {e}")))?
            }
            (Some(_), Some(_)) => {
                return Err(invalid(format!(
                    "{who}: give prompt or prompt_file, not both"
                )));
            }
            (None, None) => {
                return Err(invalid(format!("{who}: prompt or prompt_file is required")));
            }
        };
        check_usd(&format!("{who}: budget_usd"), m.budget_usd)?;
        if let Some(h) = &m.host {
            troupe::store::check_host_name(h).map_err(|e| invalid(format!("{who}: {e}")))?;
        }
        members.push(Declared {
            name: m.name,
            worktree: m.worktree,
            host: m.host.clone(),
            settings: MemberSettings {
                role: m.role,
                prompt,
                model: m.model,
                require_plan_approval: m.require_plan_approval,
                auto_claim: m.auto_claim,
                budget_usd: m.budget_usd,
                budget_tokens: m.budget_tokens,
            },
        });
    }
    let mut by_key: BTreeMap<String, TaskDecl> = BTreeMap::new();
    let mut order_in_file = Vec::new();
    for mut t in file.tasks {
        let what = format!("task {:?}", t.key);
        if !valid_key(&t.key) {
            return Err(invalid(format!(
                "{what}: a key is 1 to 64 letters, digits, '_', '.' or '-', starting with a \
                 letter or digit"
            )));
        }
        if t.subject.trim().is_empty() {
            return Err(invalid(format!("{what}: the subject is empty")));
        }
        if let Some(o) = &t.owner {
            AgentName::teammate(o).map_err(|e| invalid(format!("{what}: owner: {e}")))?;
        }
        let mut seen = BTreeSet::new();
        t.blocked_by.retain(|b| seen.insert(b.clone()));
        if by_key.contains_key(&t.key) {
            return Err(invalid(format!("{what} is declared twice")));
        }
        order_in_file.push(t.key.clone());
        by_key.insert(t.key.clone(), t);
    }
    for t in by_key.values() {
        for b in &t.blocked_by {
            if !by_key.contains_key(b) {
                return Err(invalid(format!(
                    "task {:?}: blocked_by names {b:?}, which is no task of the file",
                    t.key
                )));
            }
        }
    }
    let tasks = topological(&order_in_file, &by_key)?;
    let mut hooks = Vec::new();
    for (i, h) in file.hooks.into_iter().enumerate() {
        if h.command.trim().is_empty() {
            return Err(invalid(format!(
                "hook {} ({}): the command is empty",
                i + 1,
                h.event
            )));
        }
        hooks.push(Hook {
            event: h.event,
            command: h.command,
            timeout_secs: h.timeout_secs,
            sandbox: h.sandbox,
        });
    }
    Ok(Plan {
        team_budget_usd: file.team_budget_usd,
        max_members: file.max_members,
        target_branch: file.target_branch,
        shared_check_cache: file.shared_check_cache,
        max_spawns_per_minute: file.max_spawns_per_minute,
        max_concurrent_calls: file.max_concurrent_calls,
        model_caps: file.model_caps,
        rate_governor: file.rate_governor,
        members,
        tasks,
        hooks,
    })
}

/// The tasks in an order where each comes after its blockers (else in file order), or the
/// cycle that makes one impossible.
fn topological(
    order: &[String],
    by_key: &BTreeMap<String, TaskDecl>,
) -> Result<Vec<TaskDecl>, Invalid> {
    // 1 on the current path, 2 placed.
    fn visit(
        key: &str,
        by_key: &BTreeMap<String, TaskDecl>,
        state: &mut HashMap<String, u8>,
        path: &mut Vec<String>,
        out: &mut Vec<TaskDecl>,
    ) -> Result<(), Invalid> {
        match state.get(key) {
            Some(2) => return Ok(()),
            Some(_) => {
                let start = path.iter().position(|p| p == key).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(key.to_owned());
                return Err(invalid(format!(
                    "the tasks' blockers form a cycle: {}",
                    cycle.join(" -> ")
                )));
            }
            None => {}
        }
        state.insert(key.to_owned(), 1);
        path.push(key.to_owned());
        let t = &by_key[key];
        for b in &t.blocked_by {
            visit(b, by_key, state, path, out)?;
        }
        path.pop();
        state.insert(key.to_owned(), 2);
        out.push(t.clone());
        Ok(())
    }
    let mut state = HashMap::new();
    let mut out = Vec::new();
    for key in order {
        visit(key, by_key, &mut state, &mut Vec::new(), &mut out)?;
    }
    Ok(out)
}

/// What happens to one member.
#[derive(Debug, Clone, PartialEq)]
pub enum MemberChange {
    Add(Declared),
    /// Settings that differ (by name), and the settings to write.
    Update(Declared, Vec<&'static str>),
    Unchanged(String, MemberStatus),
    /// In the roster, not in the file.
    Unlisted(String, MemberStatus),
    /// Unlisted, and removed by `--prune`.
    Prune(String, MemberStatus),
}

/// What happens to one task.
#[derive(Debug, Clone, PartialEq)]
pub enum TaskChange {
    Add(TaskDecl),
    /// Pending, with a new subject or description (the fields that differ).
    Update(TaskDecl, String, Vec<&'static str>),
    /// On the board already: its id, its status, and whether the file says otherwise than the
    /// board about a task that is no longer pending (then the board is kept).
    Unchanged(String, String, TaskStatus, bool),
}

/// Every change a file makes to a team dir.
#[derive(Debug, Clone, PartialEq)]
pub struct Changes {
    /// `Some(fields)` when the team's own settings are declared (`team_budget_usd`).
    pub team: Option<Vec<&'static str>>,
    pub hooks_changed: bool,
    pub members: Vec<MemberChange>,
    pub tasks: Vec<TaskChange>,
}

/// Why a diff is refused: a file that does not fit the team dir (exit 2), or a prune that may
/// not happen now (exit 4).
#[derive(Debug, Clone, PartialEq)]
pub enum Refusal {
    Invalid(Invalid),
    Conflict(String),
}

/// Compares a validated file with the roster `cfg` and the board `tasks`, and decides every
/// change. `supervisor_running`: a `lead run` holds the team dir (then a `spawning` member may
/// be starting, and is not pruned).
pub fn diff(
    plan: &Plan,
    cfg: &TeamConfig,
    tasks: &[Task],
    prune: bool,
    supervisor_running: bool,
) -> Result<Changes, Refusal> {
    let declared = plan.team_budget_usd.is_some()
        || plan.max_members.is_some()
        || plan.target_branch.is_some()
        || plan.shared_check_cache.is_some()
        || plan.max_spawns_per_minute.is_some()
        || plan.max_concurrent_calls.is_some()
        || plan.model_caps.is_some()
        || plan.rate_governor.is_some();
    let team = declared.then(|| {
        let mut fields = Vec::new();
        if plan.team_budget_usd.is_some() && cfg.team_budget_usd != plan.team_budget_usd {
            fields.push("team_budget_usd");
        }
        if plan.max_members.is_some() && cfg.max_members != plan.max_members {
            fields.push("max_members");
        }
        if plan.target_branch.is_some() && cfg.target_branch != plan.target_branch {
            fields.push("target_branch");
        }
        if plan.shared_check_cache.is_some() && cfg.shared_check_cache != plan.shared_check_cache {
            fields.push("shared_check_cache");
        }
        if plan.max_spawns_per_minute.is_some()
            && cfg.max_spawns_per_minute != plan.max_spawns_per_minute
        {
            fields.push("max_spawns_per_minute");
        }
        if plan.max_concurrent_calls.is_some()
            && cfg.max_concurrent_calls != plan.max_concurrent_calls
        {
            fields.push("max_concurrent_calls");
        }
        if plan
            .model_caps
            .as_ref()
            .is_some_and(|m| *m != cfg.model_caps)
        {
            fields.push("model_caps");
        }
        if plan.rate_governor.is_some() && cfg.rate_governor != plan.rate_governor {
            fields.push("rate_governor");
        }
        fields
    });
    let hooks_changed = cfg.hooks != plan.hooks;
    let mut members = Vec::new();
    for d in &plan.members {
        members.push(match cfg.member(&d.name) {
            None => MemberChange::Add(d.clone()),
            Some(m) => {
                let changed = d.settings.changes(m);
                if changed.is_empty() {
                    MemberChange::Unchanged(d.name.clone(), m.status)
                } else {
                    MemberChange::Update(d.clone(), changed)
                }
            }
        });
    }
    let mut refused = Vec::new();
    for m in &cfg.members {
        if plan.members.iter().any(|d| d.name == m.name) {
            continue;
        }
        if !prune {
            members.push(MemberChange::Unlisted(m.name.clone(), m.status));
        } else if ops::removable(m, supervisor_running) {
            members.push(MemberChange::Prune(m.name.clone(), m.status));
        } else {
            refused.push(format!(
                "{} is {} (run `lead shutdown {} --wait`, then `lead up --prune` again)",
                m.name, m.status, m.name
            ));
        }
    }
    let keyed: HashMap<&str, &Task> = tasks
        .iter()
        .filter_map(|t| t.key.as_deref().map(|k| (k, t)))
        .collect();
    let mut out_tasks = Vec::new();
    for t in &plan.tasks {
        let what = format!("task {:?}", t.key);
        if let Some(owner) = &t.owner
            && !plan.members.iter().any(|d| &d.name == owner)
            && cfg.member(owner).is_none()
        {
            return Err(Refusal::Invalid(invalid(format!(
                "{what}: owner {owner:?} is neither a member of the file nor of the team"
            ))));
        }
        match keyed.get(t.key.as_str()) {
            Some(cur) => {
                let mut fields = Vec::new();
                if cur.subject != t.subject.trim() {
                    fields.push("subject");
                }
                if cur.description != t.description {
                    fields.push("description");
                }
                if fields.is_empty() {
                    out_tasks.push(TaskChange::Unchanged(
                        t.key.clone(),
                        cur.id.clone(),
                        cur.status,
                        false,
                    ));
                } else if cur.status == TaskStatus::Pending {
                    out_tasks.push(TaskChange::Update(t.clone(), cur.id.clone(), fields));
                } else {
                    out_tasks.push(TaskChange::Unchanged(
                        t.key.clone(),
                        cur.id.clone(),
                        cur.status,
                        true,
                    ));
                }
            }
            None => {
                for b in &t.blocked_by {
                    if let Some(bt) = keyed.get(b.as_str())
                        && bt.status == TaskStatus::Cancelled
                    {
                        return Err(Refusal::Invalid(invalid(format!(
                            "{what}: its blocker {b:?} (task {}) is cancelled on the board, so \
                             it could never start (reopen it with `lead task reopen {}`)",
                            bt.id, bt.id
                        ))));
                    }
                }
                out_tasks.push(TaskChange::Add(t.clone()));
            }
        }
    }
    if !refused.is_empty() {
        return Err(Refusal::Conflict(format!(
            "--prune refused, nothing changed: members the file no longer lists are still \
             running: {}",
            refused.join("; ")
        )));
    }
    Ok(Changes {
        team,
        hooks_changed,
        members,
        tasks: out_tasks,
    })
}

/// One line of the report, and its entry in the `--json` document.
struct Item {
    /// `added`, `updated`, `unchanged`, `unlisted` or `pruned`.
    list: &'static str,
    line: String,
    json: Value,
}

fn refusal(r: Refusal, file: &Path) -> anyhow::Error {
    match r {
        Refusal::Invalid(e) => ExitError {
            code: 2,
            message: format!("{}: {e}; nothing was changed", file.display()),
        }
        .into(),
        Refusal::Conflict(m) => ExitError {
            code: 4,
            message: m,
        }
        .into(),
    }
}

/// The roster and the board of `team_dir` (empty for a team dir that does not exist yet).
fn state(team_dir: &Path) -> anyhow::Result<(TeamConfig, Vec<Task>, bool)> {
    if !team_dir.exists() {
        return Ok((TeamConfig::default(), Vec::new(), false));
    }
    let team = TeamDir::open(team_dir)?;
    let running = troupe::liveness::supervisor_running(&team)?;
    Ok((
        Roster::new(&team).load()?,
        TaskStore::new(&team).list(None)?,
        running,
    ))
}

pub fn run(team_dir: &Path, a: UpArgs) -> anyhow::Result<u8> {
    let text = std::fs::read_to_string(&a.file)
        .with_context(|| format!("failed to read team file {}", a.file.display()))?;
    // The path as given, made absolute (not resolved): the key of what is recorded.
    let file = std::path::absolute(&a.file)
        .with_context(|| format!("failed to resolve {}", a.file.display()))?;
    let is_json = a.file.extension().is_some_and(|x| x == "json");
    let base = file.parent().map(Path::to_path_buf).unwrap_or_default();
    let prompts = std::cell::RefCell::new(Vec::new());
    let read_prompt = |p: &Path| -> Result<String, String> {
        let read = up_trust::read_prompt(&base, p)?;
        let text = read.text.clone();
        prompts.borrow_mut().push(read);
        Ok(text)
    };
    let bad = |e: Invalid| refusal(Refusal::Invalid(e), &a.file);
    let plan = validate(parse(&text, is_json).map_err(bad)?, &read_prompt).map_err(bad)?;
    let prompts = prompts.into_inner();
    // Everything that can be refused is refused before the team dir is created or touched.
    let (cfg, tasks, running) = state(team_dir)?;
    diff(&plan, &cfg, &tasks, a.prune, running).map_err(|r| refusal(r, &a.file))?;
    up_trust::check(team_dir, &cfg, &file, &text, &prompts, a.accept)?;
    if let Some(h) = plan.members.iter().find_map(|m| m.host.as_deref()) {
        // Hosts are those of a team on a bus: refused now, not half way.
        if !troupe::store::spread_over_hosts() {
            return Err(
                troupe::store::no_hosts(format!("host {h:?} in {}", a.file.display())).into(),
            );
        }
    }
    if plan.members.iter().any(|m| m.worktree) {
        // Members with a worktree need a git repository: refused now, not half way.
        troupe::worktree::repository_of(team_dir)?;
    }
    let team = TeamDir::create(team_dir)?;
    // One `lead up` at a time: on a bus, across hosts too.
    let _held = team.store().lock("up", &team.up_lock())?;
    // Under the lock, against what is there now (another `lead up` may have gone first).
    let (cfg, tasks, running) = state(team_dir)?;
    let changes = diff(&plan, &cfg, &tasks, a.prune, running).map_err(|r| refusal(r, &a.file))?;
    up_trust::check(team_dir, &cfg, &file, &text, &prompts, a.accept)?;
    // The hooks it brings that run outside the sandbox are trusted because they passed that
    // check: recorded where commands cannot reach, before config.json holds them, and the old
    // ones dropped after (see `up_trust::Record::trust_hooks`).
    up_trust::Record::trust_hooks(&team, &plan.hooks, true)?;
    let items = apply(&team, &plan, &changes)?;
    up_trust::Record::trust_hooks(&team, &plan.hooks, false)?;
    up_trust::Record::store(&team, &file, up_trust::applied(&text, &prompts))?;
    report(&items, a.json)?;
    Ok(0)
}

/// Makes the changes, in this order: team settings and hooks, members, tasks (blockers
/// first), prunes. A failure part way (a full disk, a budget refusal of a spawn) leaves what
/// was done; applying the file again finishes the rest.
fn apply(team: &TeamDir, plan: &Plan, changes: &Changes) -> anyhow::Result<Vec<Item>> {
    let mut items = Vec::new();
    let team_fields = changes.team.clone().unwrap_or_default();
    if !team_fields.is_empty() || changes.hooks_changed {
        Roster::new(team).update(|cfg| {
            if let Some(b) = plan.team_budget_usd {
                cfg.team_budget_usd = Some(b);
            }
            if let Some(n) = plan.max_members {
                cfg.max_members = Some(n);
            }
            if let Some(b) = &plan.target_branch {
                cfg.target_branch = Some(b.clone());
            }
            if let Some(b) = plan.shared_check_cache {
                cfg.shared_check_cache = Some(b);
            }
            if let Some(n) = plan.max_spawns_per_minute {
                cfg.max_spawns_per_minute = Some(n);
            }
            if let Some(n) = plan.max_concurrent_calls {
                cfg.max_concurrent_calls = Some(n);
            }
            if let Some(m) = &plan.model_caps {
                cfg.model_caps.clone_from(m);
            }
            if let Some(m) = plan.rate_governor {
                cfg.rate_governor = Some(m);
            }
            cfg.hooks.clone_from(&plan.hooks);
            Ok(())
        })?;
        if changes.hooks_changed {
            troupe::events::log(
                team,
                "hooks_replaced",
                json!({"hooks": plan.hooks.len(), "by": "lead up"}),
            );
        }
    }
    if let Some(fields) = &changes.team {
        let (list, line) = if fields.is_empty() {
            ("unchanged", "team unchanged".to_owned())
        } else {
            ("updated", format!("team updated ({})", fields.join(", ")))
        };
        items.push(Item {
            list,
            line,
            json: json!({"kind": "team", "fields": fields}),
        });
    }
    let n = plan.hooks.len();
    let hooks = format!("{n} hook{}", if n == 1 { "" } else { "s" });
    items.push(if changes.hooks_changed {
        Item {
            list: "updated",
            line: format!("hooks updated ({hooks})"),
            json: json!({"kind": "hooks", "count": n}),
        }
    } else {
        Item {
            list: "unchanged",
            line: format!("hooks unchanged ({hooks})"),
            json: json!({"kind": "hooks", "count": n}),
        }
    });
    let mut prunes = Vec::new();
    for c in &changes.members {
        match c {
            MemberChange::Add(d) => {
                let s = &d.settings;
                let m = ops::spawn(
                    team,
                    &SpawnSpec {
                        name: d.name.clone(),
                        role: s.role.clone(),
                        prompt: s.prompt.clone(),
                        model: s.model.clone(),
                        require_plan_approval: s.require_plan_approval,
                        auto_claim: s.auto_claim,
                        budget_usd: s.budget_usd,
                        budget_tokens: s.budget_tokens,
                        worktree: d.worktree,
                        host: d.host.clone(),
                    },
                )
                .with_context(|| format!("failed to spawn member {}", d.name))?;
                items.push(Item {
                    list: "added",
                    line: format!("member {} added ({})", m.name, m.status),
                    json: json!({"kind": "member", "name": m.name, "status": m.status}),
                });
            }
            MemberChange::Update(d, _) => {
                let fields = ops::update_settings(team, &d.name, &d.settings)
                    .with_context(|| format!("failed to update member {}", d.name))?;
                items.push(if fields.is_empty() {
                    Item {
                        list: "unchanged",
                        line: format!("member {} unchanged", d.name),
                        json: json!({"kind": "member", "name": d.name}),
                    }
                } else {
                    Item {
                        list: "updated",
                        line: format!("member {} updated ({})", d.name, fields.join(", ")),
                        json: json!({"kind": "member", "name": d.name, "fields": fields}),
                    }
                });
            }
            MemberChange::Unchanged(name, status) => items.push(Item {
                list: "unchanged",
                line: format!("member {name} unchanged ({status})"),
                json: json!({"kind": "member", "name": name, "status": status}),
            }),
            MemberChange::Unlisted(name, status) => items.push(Item {
                list: "unlisted",
                line: format!(
                    "member {name} unlisted ({status}; not in the file, kept: --prune removes it)"
                ),
                json: json!({"kind": "member", "name": name, "status": status}),
            }),
            MemberChange::Prune(name, _) => prunes.push(name.clone()),
        }
    }
    let store = TaskStore::new(team);
    // Keys of the file to the ids of their tasks: those on the board, then those created.
    let mut ids: HashMap<String, String> = changes
        .tasks
        .iter()
        .filter_map(|c| match c {
            TaskChange::Update(t, id, _) => Some((t.key.clone(), id.clone())),
            TaskChange::Unchanged(key, id, ..) => Some((key.clone(), id.clone())),
            TaskChange::Add(_) => None,
        })
        .collect();
    let mut added_any = false;
    for c in &changes.tasks {
        match c {
            TaskChange::Add(t) => {
                let blocked_by = t
                    .blocked_by
                    .iter()
                    .map(|b| {
                        ids.get(b).cloned().with_context(|| {
                            format!("task {:?}: blocker {b:?} was not created", t.key)
                        })
                    })
                    .collect::<anyhow::Result<Vec<_>>>()?;
                let (task, created) = store
                    .create_keyed(
                        &t.key,
                        NewTask {
                            subject: t.subject.clone(),
                            description: t.description.clone(),
                            blocked_by,
                            owner: t.owner.clone(),
                            created_by: LEAD.to_owned(),
                        },
                    )
                    .with_context(|| format!("failed to create task {:?}", t.key))?;
                added_any |= created;
                ids.insert(t.key.clone(), task.id.clone());
                let list = if created { "added" } else { "unchanged" };
                items.push(Item {
                    list,
                    line: format!("task {} {list} ({})", t.key, task.id),
                    json: json!({"kind": "task", "key": t.key, "id": task.id, "status": task.status}),
                });
            }
            TaskChange::Update(t, id, fields) => {
                let changed = store
                    .edit_pending(id, &t.subject, &t.description)
                    .with_context(|| format!("failed to update task {:?}", t.key))?;
                items.push(if changed {
                    Item {
                        list: "updated",
                        line: format!("task {} updated ({id}: {})", t.key, fields.join(", ")),
                        json: json!({"kind": "task", "key": t.key, "id": id, "fields": fields}),
                    }
                } else {
                    Item {
                        list: "unchanged",
                        line: format!(
                            "task {} unchanged ({id}: no longer pending, the board's text is kept)",
                            t.key
                        ),
                        json: json!({"kind": "task", "key": t.key, "id": id}),
                    }
                });
            }
            TaskChange::Unchanged(key, id, status, differs) => items.push(Item {
                list: "unchanged",
                line: if *differs {
                    format!(
                        "task {key} unchanged ({id}, {status}: no longer pending, the board's \
                         text is kept)"
                    )
                } else {
                    format!("task {key} unchanged ({id}, {status})")
                },
                json: json!({"kind": "task", "key": key, "id": id, "status": status}),
            }),
        }
    }
    if added_any {
        troupe::tasks::wake_claimers(team, None);
    }
    for name in prunes {
        let m = ops::remove_member(team, &name)
            .with_context(|| format!("failed to prune member {name}"))?;
        items.push(Item {
            list: "pruned",
            line: format!("member {name} pruned (was {})", m.status),
            json: json!({"kind": "member", "name": name, "status": m.status}),
        });
    }
    Ok(items)
}

/// Prints the report: one line per item, or one JSON document with the items by list and
/// `changed` (whether anything was added, updated or pruned).
fn report(items: &[Item], as_json: bool) -> anyhow::Result<()> {
    if !as_json {
        for i in items {
            println!("{}", i.line);
        }
        return Ok(());
    }
    let mut doc = serde_json::Map::new();
    for list in ["added", "updated", "unchanged", "unlisted", "pruned"] {
        let v: Vec<Value> = items
            .iter()
            .filter(|i| i.list == list)
            .map(|i| i.json.clone())
            .collect();
        doc.insert(list.to_owned(), Value::Array(v));
    }
    let changed = items
        .iter()
        .any(|i| matches!(i.list, "added" | "updated" | "pruned"));
    doc.insert("changed".to_owned(), Value::Bool(changed));
    println!("{}", serde_json::to_string(&doc)?);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe::config::Member;

    const FILE: &str = r#"
[[members]]
name = "alice"
role = "coder"
prompt_file = "alice.md"
auto_claim = true

[[tasks]]
key = "b"
subject = "second"
blocked_by = ["a"]

[[tasks]]
key = "a"
subject = "first"

[[hooks]]
event = "teammate_idle"
command = "true"
"#;

    fn prompts(p: &Path) -> Result<String, String> {
        match p.to_str() {
            Some("alice.md") => Ok("Code.".to_owned()),
            _ => Err(format!("{}: No such file or directory", p.display())),
        }
    }

    fn plan(text: &str) -> Result<Plan, Invalid> {
        validate(parse(text, false)?, &prompts)
    }

    fn err(text: &str) -> String {
        plan(text).unwrap_err().0
    }

    #[test]
    fn a_file_parses_and_orders_tasks_after_their_blockers() {
        let p = plan(FILE).unwrap();
        assert_eq!(p.members[0].settings.prompt, "Code.");
        assert!(p.members[0].settings.auto_claim);
        let keys: Vec<&str> = p.tasks.iter().map(|t| t.key.as_str()).collect();
        assert_eq!(keys, ["a", "b"]);
        assert_eq!(p.hooks[0].event, HookEvent::TeammateIdle);
        // The JSON form is the same schema.
        let j = r#"{"members":[{"name":"alice","role":"coder","prompt_file":"alice.md","auto_claim":true}],
            "tasks":[{"key":"b","subject":"second","blocked_by":["a"]},{"key":"a","subject":"first"}],
            "hooks":[{"event":"teammate_idle","command":"true"}]}"#;
        assert_eq!(validate(parse(j, true).unwrap(), &prompts).unwrap(), p);
    }

    #[test]
    fn bad_files_are_refused_with_what_is_wrong() {
        for (text, needle) in [
            (
                FILE.replace("auto_claim", "autoclaim"),
                "unknown field `autoclaim`",
            ),
            (
                FILE.replace("[\"a\"]", "[\"z\"]"),
                "\"z\", which is no task of the file",
            ),
            (
                FILE.replace(
                    "subject = \"first\"",
                    "subject = \"first\"\nblocked_by = [\"b\"]",
                ),
                "cycle: b -> a -> b",
            ),
            (FILE.replace("[\"a\"]", "[\"b\"]"), "cycle: b -> b"),
            (
                FILE.replace("alice.md", "bob.md"),
                "prompt_file bob.md: No such file",
            ),
            (
                FILE.replace("teammate_idle", "idle"),
                "unknown variant `idle`",
            ),
            (FILE.replace("\"alice\"", "\"lead\""), "member \"lead\""),
            (
                FILE.replace("key = \"b\"", "key = \"a\""),
                "task \"a\" is declared twice",
            ),
            (
                FILE.replace("key = \"b\"", "key = \"b c\""),
                "a key is 1 to 64",
            ),
            (
                FILE.replace("subject = \"first\"", "subject = \" \""),
                "subject is empty",
            ),
            (
                FILE.replace("auto_claim = true", "prompt = \"x\""),
                "not both",
            ),
            (
                FILE.replace("command = \"true\"", "command = \"\""),
                "command is empty",
            ),
        ] {
            let e = plan(&text);
            assert!(e.is_err(), "accepted: {needle}");
            let e = e.unwrap_err().0;
            assert!(e.contains(needle), "{needle:?} not in {e:?}");
        }
        assert!(err("team_budget_usd = -1.0").contains("non-negative"));
        assert!(err("[[members]]\nname = \"a\"\nrole = \"r\"").contains("prompt or prompt_file"));
    }

    fn settings(prompt: &str) -> MemberSettings {
        MemberSettings {
            role: "coder".into(),
            prompt: prompt.into(),
            model: None,
            require_plan_approval: false,
            auto_claim: true,
            budget_usd: None,
            budget_tokens: None,
        }
    }

    fn member(name: &str, status: MemberStatus, s: &MemberSettings) -> Member {
        let mut m = Member::new(name, &s.role);
        m.status = status;
        m.prompt = Some(s.prompt.clone());
        m.auto_claim = s.auto_claim;
        m
    }

    fn task(key: &str, id: &str, status: TaskStatus, subject: &str) -> Task {
        serde_json::from_value(json!({
            "id": id, "key": key, "subject": subject, "status": status, "created_by": "lead",
            "created_at": 1.0, "updated_at": 1.0,
        }))
        .unwrap()
    }

    #[test]
    fn the_diff_of_an_applied_file_is_all_unchanged() {
        let p = plan(FILE).unwrap();
        let mut cfg = TeamConfig::default();
        let fresh = diff(&p, &cfg, &[], false, false).unwrap();
        assert!(matches!(fresh.members[0], MemberChange::Add(_)));
        assert!(fresh.tasks.iter().all(|t| matches!(t, TaskChange::Add(_))));
        assert!(fresh.hooks_changed);
        assert_eq!(fresh.team, None);
        // As `lead up` leaves it.
        cfg.members
            .push(member("alice", MemberStatus::Idle, &settings("Code.")));
        cfg.hooks = p.hooks.clone();
        let board = [
            task("a", "0000000a", TaskStatus::Completed, "first"),
            task("b", "0000000b", TaskStatus::Pending, "second"),
        ];
        let again = diff(&p, &cfg, &board, false, false).unwrap();
        assert!(!again.hooks_changed);
        assert_eq!(
            again.members,
            [MemberChange::Unchanged("alice".into(), MemberStatus::Idle)]
        );
        assert!(
            again
                .tasks
                .iter()
                .all(|t| matches!(t, TaskChange::Unchanged(_, _, _, false)))
        );
    }

    #[test]
    fn the_diff_of_an_edited_file_names_what_changed() {
        let p = plan(
            &FILE
                .replace("subject = \"first\"", "subject = \"First!\"")
                .replace("subject = \"second\"", "subject = \"Second!\""),
        )
        .unwrap();
        let mut cfg = TeamConfig::default();
        cfg.members
            .push(member("alice", MemberStatus::Idle, &settings("Old.")));
        cfg.members
            .push(member("bob", MemberStatus::Idle, &settings("x")));
        cfg.members
            .push(member("carl", MemberStatus::Shutdown, &settings("x")));
        let board = [
            task("a", "0000000a", TaskStatus::InProgress, "first"),
            task("b", "0000000b", TaskStatus::Pending, "second"),
        ];
        let d = diff(&p, &cfg, &board, false, false).unwrap();
        assert!(matches!(&d.members[0], MemberChange::Update(_, f) if f == &["prompt"]));
        assert_eq!(
            d.members[1..],
            [
                MemberChange::Unlisted("bob".into(), MemberStatus::Idle),
                MemberChange::Unlisted("carl".into(), MemberStatus::Shutdown)
            ]
        );
        // An in-progress task keeps its text; a pending one takes the new one.
        assert!(
            matches!(&d.tasks[0], TaskChange::Unchanged(k, _, TaskStatus::InProgress, true) if k == "a")
        );
        assert!(
            matches!(&d.tasks[1], TaskChange::Update(t, id, f) if t.key == "b" && id == "0000000b" && f == &["subject"])
        );
        // --prune: a running member refuses the whole diff; a shut-down one is pruned.
        match diff(&p, &cfg, &board, true, false) {
            Err(Refusal::Conflict(m)) => {
                assert!(m.contains("lead shutdown bob --wait"), "{m}");
                assert!(!m.contains("carl"), "{m}");
            }
            other => panic!("{other:?}"),
        }
        cfg.members.retain(|m| m.name != "bob");
        let d = diff(&p, &cfg, &board, true, false).unwrap();
        assert_eq!(
            d.members[1..],
            [MemberChange::Prune("carl".into(), MemberStatus::Shutdown)]
        );
        // A spawning member with no process is prunable only while no supervisor runs.
        cfg.members
            .push(member("dan", MemberStatus::Spawning, &settings("x")));
        assert!(diff(&p, &cfg, &board, true, false).is_ok());
        assert!(matches!(
            diff(&p, &cfg, &board, true, true),
            Err(Refusal::Conflict(_))
        ));
    }

    #[test]
    fn the_board_can_refuse_a_file() {
        let p = plan(&FILE.replace(
            "subject = \"second\"",
            "subject = \"second\"\nowner = \"zed\"",
        ))
        .unwrap();
        match diff(&p, &TeamConfig::default(), &[], false, false) {
            Err(Refusal::Invalid(e)) => assert!(e.0.contains("owner \"zed\""), "{e}"),
            other => panic!("{other:?}"),
        }
        // A new task blocked by a task cancelled on the board could never start.
        let p = plan(FILE).unwrap();
        let board = [task("a", "0000000a", TaskStatus::Cancelled, "first")];
        match diff(&p, &TeamConfig::default(), &board, false, false) {
            Err(Refusal::Invalid(e)) => assert!(e.0.contains("cancelled"), "{e}"),
            other => panic!("{other:?}"),
        }
    }
}
