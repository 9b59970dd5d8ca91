//! The scripting commands of the lead CLI (DESIGN.md section 8). Each prints its result on
//! stdout (a table, or one JSON document with `--json`) and leaves diagnostics to stderr.

use std::path::PathBuf;
use std::time::{Duration, Instant};
use troupe::{eprintln, println};

use anyhow::Context;
use serde_json::{Value, json};
use troupe::config::{MemberStatus, Roster};
use troupe::inbox::Inbox;
use troupe::liveness;
use troupe::message::Message;
use troupe::ops::{self, SpawnSpec};
use troupe::requests::{RequestStatus, RequestStore};
use troupe::term_text;
use troupe::transcript::Journal;
use troupe::{AgentName, TeamDir};

#[derive(Debug, clap::Args)]
pub struct SpawnArgs {
    /// Teammate name: `^[a-z][a-z0-9_-]{0,31}$`, not "lead".
    name: String,
    #[arg(long)]
    role: String,
    /// The teammate's task.
    #[arg(
        long,
        conflicts_with = "prompt_file",
        required_unless_present = "prompt_file"
    )]
    prompt: Option<String>,
    /// Read the task from a file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Model for this teammate (overrides MODEL_ID).
    #[arg(long)]
    model: Option<String>,
    /// Withhold bash/write_file/edit_file until a plan is approved.
    #[arg(long)]
    require_plan_approval: bool,
    /// Claim the next claimable task of the board whenever it would go idle.
    #[arg(long)]
    auto_claim: bool,
    /// The most it may spend over its life, in US dollars (replaces its budget; raise it to
    /// spawn a member shut down for budget again).
    #[arg(long, value_parser = parse_usd)]
    budget_usd: Option<f64>,
    /// The most tokens (input, output, cache write and read) it may use over its life.
    #[arg(long)]
    budget_tokens: Option<u64>,
    /// Give it its own git worktree on branch troupe/NAME, beside the repository holding the
    /// team dir (`<repo>.troupe/NAME`), as its working dir; kept across restarts.
    #[arg(long)]
    worktree: bool,
    /// On a team spread over machines (a bus): the host whose `lead run --host H` runs it
    /// (default: the first supervisor that starts it).
    #[arg(long)]
    host: Option<String>,
    #[arg(long)]
    json: bool,
}

/// A non-negative number of US dollars.
pub fn parse_usd(s: &str) -> Result<f64, String> {
    let x: f64 = s
        .parse()
        .map_err(|e| format!("not a number of dollars: {e}"))?;
    if !x.is_finite() || x < 0.0 {
        return Err("must be a non-negative number of dollars".to_owned());
    }
    Ok(x)
}

pub fn spawn(team_dir: &std::path::Path, a: SpawnArgs) -> anyhow::Result<u8> {
    // Validate before touching anything.
    AgentName::teammate(&a.name)?;
    term_text::check_one_line("--role", &a.role)
        .map_err(|message| crate::ExitError { code: 2, message })?;
    let prompt = match (a.prompt, a.prompt_file) {
        (Some(p), _) => p,
        (None, Some(f)) => std::fs::read_to_string(&f)
            .with_context(|| format!("failed to read prompt file {}", f.display()))?,
        (None, None) => anyhow::bail!("one of --prompt or --prompt-file is required"),
    };
    if a.worktree {
        // Outside a repository, refused before the team dir is touched.
        troupe::worktree::repository_of(team_dir)?;
    }
    let team = TeamDir::create(team_dir)?;
    let m = ops::spawn(
        &team,
        &SpawnSpec {
            name: a.name,
            role: a.role,
            prompt,
            model: a.model,
            require_plan_approval: a.require_plan_approval,
            auto_claim: a.auto_claim,
            budget_usd: a.budget_usd,
            budget_tokens: a.budget_tokens,
            worktree: a.worktree,
            host: a.host,
        },
    )?;
    if a.json {
        println!(
            "{}",
            json!({"name": m.name, "status": m.status, "worktree": m.worktree})
        );
    } else {
        println!("{} {}", m.name, m.status);
        if let Some(w) = &m.worktree {
            eprintln!(
                "lead: {} works in {} on branch {}",
                m.name,
                w.path.display(),
                w.branch
            );
        }
    }
    Ok(0)
}

#[derive(Debug, clap::Args)]
pub struct SendArgs {
    name: String,
    text: String,
    #[arg(long)]
    json: bool,
}

pub fn send(team: &TeamDir, a: SendArgs) -> anyhow::Result<u8> {
    let id = ops::send(team, &a.name, &a.text)?;
    print_id(a.json, "id", &id);
    Ok(0)
}

fn print_id(as_json: bool, key: &str, id: &str) {
    if as_json {
        println!("{}", json!({ key: id }));
    } else {
        println!("{id}");
    }
}

#[derive(Debug, clap::Args)]
pub struct BroadcastArgs {
    text: String,
    #[arg(long)]
    json: bool,
}

pub fn broadcast(team: &TeamDir, a: BroadcastArgs) -> anyhow::Result<u8> {
    let sent = ops::broadcast(team, &a.text)?;
    if a.json {
        let v: Vec<Value> = sent
            .iter()
            .map(|(n, id)| json!({"to": n, "id": id}))
            .collect();
        println!("{}", Value::Array(v));
    } else {
        for (n, id) in sent {
            println!("{n} {id}");
        }
    }
    Ok(0)
}

#[derive(Debug, clap::Args)]
pub struct InboxArgs {
    /// Show without consuming.
    #[arg(long)]
    peek: bool,
    #[arg(long)]
    json: bool,
}

pub fn inbox(team: &TeamDir, a: InboxArgs) -> anyhow::Result<u8> {
    let lead = AgentName::lead();
    let inbox = Inbox::new(team, &lead);
    let msgs: Vec<Message> = if a.peek {
        inbox.peek()?
    } else {
        // Draining writes the lead's journal, which a running `lead chat` owns: a second writer
        // could cut the entry chat is appending (taking it for a crash's torn tail).
        let Some(owner) = Journal::try_own(team, &lead)? else {
            return Err(crate::ExitError {
                code: 4,
                message: "`lead chat` is running on this team dir and consumes the lead's inbox: \
                          use /inbox in the chat, or `lead inbox --peek` to look without consuming"
                    .into(),
            }
            .into());
        };
        // On a bus, the one consumer across hosts: a `lead chat` on another host holds it.
        let _consumer = match troupe::fence::LeadInboxConsumer::take(team) {
            Ok(c) => c,
            Err(troupe::Error::Locked { .. }) => {
                return Err(crate::ExitError {
                    code: 4,
                    message: "another consumer of the lead's inbox runs on this team (`lead \
                              chat`, or `lead inbox`, on this host or another): use /inbox in \
                              the chat, or `lead inbox --peek` to look without consuming"
                        .into(),
                }
                .into());
            }
            Err(e) => return Err(e.into()),
        };
        let (mut journal, _) = Journal::open(team, &lead, &owner)?;
        inbox.drain(&mut journal)?
    };
    if a.json {
        println!("{}", serde_json::to_string(&msgs)?);
    } else {
        for m in &msgs {
            println!(
                "{}",
                term_text::lines(&troupe::agent::conversation::render_message(m))
            );
        }
    }
    Ok(0)
}

#[derive(Debug, clap::Args)]
pub struct ListArgs {
    #[arg(long)]
    json: bool,
}

pub fn status(team: &TeamDir, a: ListArgs) -> anyhow::Result<u8> {
    let cfg = match Roster::new(team).load() {
        Ok(cfg) => cfg,
        Err(e @ troupe::Error::Corrupt { .. }) => return config_unreadable(team, &e, a.json),
        Err(e) => return Err(e.into()),
    };
    let pending = RequestStore::new(team).list(Some(RequestStatus::Pending))?;
    let now = troupe::fsutil::now();
    let pending_of = |name: &str| -> Vec<&str> {
        pending
            .iter()
            .filter(|r| r.to == name || r.from == name)
            .map(|r| r.request_id.as_str())
            .collect()
    };
    // On a bus, the host this command runs on (pids are this machine's only).
    let here = team.store().this_host();
    // Each worktree member's place in the merge queue (its latest entry).
    let merges = troupe::merge::latest_by_member(
        &troupe::merge::MergeStore::new(team)
            .list()
            .unwrap_or_default(),
    );
    let merge_of = |name: &str| {
        merges.get(name).map(|e| {
            json!({
                "id": e.id, "state": e.state, "describe": troupe::merge::describe(e),
                "commit": e.commit, "task": e.task, "landed": e.landed, "report": e.report,
            })
        })
    };
    let doings: Vec<liveness::Doing> = cfg
        .members
        .iter()
        .map(|m| doing(team, m, here.as_deref()))
        .collect();
    if a.json {
        let rows: Vec<Value> = cfg
            .members
            .iter()
            .zip(&doings)
            .map(|(m, d)| {
                json!({
                    "name": m.name, "role": m.role, "status": m.status, "pid": m.pid,
                    "incarnation": m.incarnation, "restarts": m.restarts, "last_exit": m.last_exit,
                    "usage": m.usage, "calls": m.calls, "pending_requests": pending_of(&m.name),
                    "reason": m.reason, "doing": d, "sandbox": m.sandbox, "host": m.host,
                    "cost_usd": m.cost_usd,
                    "cache_read_share": troupe::cost::cache_read_share(&m.usage),
                    "budget_usd": m.budget_usd, "budget_tokens": m.budget_tokens,
                    "ledger": m.ledger,
                    "worktree": m.worktree.as_ref().map(|w| json!({
                        "path": w.path, "branch": w.branch,
                        "dirty": troupe::worktree::is_dirty(w),
                    })),
                    "merge": merge_of(&m.name),
                })
            })
            .collect();
        let team_spend = troupe::cost::team_spend(&cfg);
        println!(
            "{}",
            json!({
                "team_name": cfg.team_name, "team_dir": abs(team.root()), "members": rows,
                "bus": team.store().describe(),
                "lead_sandbox": cfg.lead_sandbox,
                "team": {
                    "cost_usd": team_spend.cost_usd, "calls": team_spend.calls,
                    "usage": team_spend.usage,
                    "cache_read_share": troupe::cost::cache_read_share(&team_spend.usage),
                    "budget_usd": cfg.team_budget_usd,
                    "over_budget": troupe::cost::team_over_budget(&cfg),
                    "lead": cfg.lead_spend.unwrap_or_default(),
                    "cooldowns": troupe::governor::cooldowns(team),
                },
            })
        );
        return Ok(0);
    }
    println!(
        "{:<16} {:<12} {:<9} {:>7} {:>4} {:>8} {:<9} {:>10} {:>9} {:>5}  {:<9} DOING",
        "NAME",
        "ROLE",
        "STATUS",
        "PID",
        "INC",
        "RESTARTS",
        "LAST_EXIT",
        "TOKENS",
        "COST",
        "CACHE",
        "PENDING"
    );
    for (m, d) in cfg.members.iter().zip(&doings) {
        // Every token billed: input, output, cache writes and reads (what --budget-tokens counts).
        let tokens = troupe::cost::total_tokens(&m.usage);
        let p = pending_of(&m.name);
        // The role, the reason and what it is doing come from files a model can fill.
        let row = format!(
            "{:<16} {:<12} {:<9} {:>7} {:>4} {:>8} {:<9} {:>10} {:>9} {:>5}  {:<9} {}{}",
            m.name,
            m.role,
            m.status,
            m.pid.map_or("-".to_owned(), |p| p.to_string()),
            m.incarnation,
            m.restarts,
            m.last_exit
                .as_ref()
                .map_or("-".to_owned(), |e| e.to_string()),
            tokens,
            troupe::cost::usd(m.cost_usd),
            share(&m.usage),
            if p.is_empty() {
                "-".to_owned()
            } else {
                p.join(",")
            },
            liveness::describe(d, now),
            m.reason
                .as_ref()
                .map_or(String::new(), |r| format!("  ({r})")),
        );
        println!("{}", term_text::line(&row));
    }
    // The team's spend: every member plus the LLM lead, and the budgets.
    let t = troupe::cost::team_spend(&cfg);
    let lead = cfg.lead_spend.unwrap_or_default();
    let mut line = format!(
        "\nteam: {} over {} model calls (lead {}), {} of input read from cache",
        troupe::cost::usd(t.cost_usd),
        t.calls,
        troupe::cost::usd(lead.cost_usd),
        share(&t.usage),
    );
    if let Some(b) = cfg.team_budget_usd {
        line.push_str(&format!(", team budget {}", troupe::cost::usd(b)));
        if troupe::cost::team_over_budget(&cfg).is_some() {
            line.push_str(" (spent: no teammate runs or is spawned)");
        }
    }
    println!("{line}");
    for c in troupe::governor::cooldowns(team) {
        println!(
            "rate governor: every member waits {:.0} s more before calling endpoint {} (a rate \
             limit's cooldown); to end it now: {}",
            (c.until - now).max(0.0),
            c.endpoint,
            c.clear
        );
    }
    for m in &cfg.members {
        let mut b = Vec::new();
        if let Some(x) = m.budget_usd {
            b.push(format!(
                "{} of {}",
                troupe::cost::usd(m.cost_usd),
                troupe::cost::usd(x)
            ));
        }
        if let Some(x) = m.budget_tokens {
            b.push(format!(
                "{} of {x} tokens",
                troupe::cost::total_tokens(&m.usage)
            ));
        }
        if !b.is_empty() {
            println!(
                "{}",
                term_text::line(&format!("budget of {}: {}", m.name, b.join(", ")))
            );
        }
    }
    // Each worktree: its branch and whether it has uncommitted changes.
    for m in &cfg.members {
        let Some(w) = &m.worktree else { continue };
        let state = match troupe::worktree::is_dirty(w) {
            Some(true) => "uncommitted changes",
            Some(false) => "clean",
            None => "missing (re-added at its next start)",
        };
        let queue = merges
            .get(&m.name)
            .map(|e| format!("; merge queue: {}", troupe::merge::describe(e)))
            .unwrap_or_default();
        println!(
            "{}",
            term_text::line(&format!(
                "worktree of {}: {} on {}, {state}{queue}",
                m.name,
                w.path.display(),
                w.branch
            ))
        );
    }
    // The sandbox of each member's tools, as its process found it; members alike on one line.
    let mut lines: Vec<(String, Vec<&str>)> = Vec::new();
    for m in &cfg.members {
        let Some(s) = &m.sandbox else { continue };
        let d = s.describe();
        match lines.iter_mut().find(|(k, _)| *k == d) {
            Some((_, names)) => names.push(&m.name),
            None => lines.push((d, vec![&m.name])),
        }
    }
    if let Some(s) = &cfg.lead_sandbox {
        lines.push((s.describe(), vec!["the lead (chat)"]));
    }
    if !lines.is_empty() {
        println!();
    }
    for (d, names) in lines {
        println!(
            "{}",
            term_text::line(&format!("sandbox of {}: {d}", names.join(", ")))
        );
    }
    Ok(0)
}

/// `path` made absolute (canonical when it exists), for output scripts can use from anywhere.
fn abs(path: &std::path::Path) -> String {
    path.canonicalize()
        .or_else(|_| std::path::absolute(path))
        .unwrap_or_else(|_| path.to_path_buf())
        .display()
        .to_string()
}

/// What member `m` is doing: its record, whether its process lives, and when its journal was
/// last written. `here`: on a bus, this machine's host name.
pub(crate) fn doing(
    team: &TeamDir,
    m: &troupe::config::Member,
    here: Option<&str>,
) -> liveness::Doing {
    // A pid is this machine's only: for a member of another host, its supervisor's record is
    // what there is to go by.
    let elsewhere = here.is_some_and(|here| m.host.as_deref().is_some_and(|h| h != here));
    let alive = if elsewhere {
        m.status.wants_process() && m.pid.is_some()
    } else {
        m.pid.is_some_and(liveness::pid_alive)
    };
    let journal_at = AgentName::teammate(&m.name)
        .ok()
        .and_then(|n| std::fs::metadata(team.transcript(&n)).ok())
        .and_then(|md| md.modified().ok())
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64());
    liveness::doing(m, alive, journal_at)
}

/// `lead status` when config.json does not parse: says so and since when (its last change),
/// on stderr and, with `--json`, as `config_error`; exits 1. A running supervisor carries on
/// with its last good copy meanwhile.
fn config_unreadable(team: &TeamDir, e: &troupe::Error, as_json: bool) -> anyhow::Result<u8> {
    let path = team.config();
    let since = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_secs_f64());
    let ago = since.map_or(String::new(), |t| {
        format!(" for {:.0} s", (troupe::fsutil::now() - t).max(0.0))
    });
    if as_json {
        println!(
            "{}",
            json!({"team_name": null, "team_dir": abs(team.root()), "members": [], "config_error": {
                "path": path, "error": e.to_string(), "since": since,
            }})
        );
    }
    eprintln!(
        "lead: config.json has been unreadable{ago} (since its last change): {e}; a running \
         supervisor carries on with its last good roster until the file parses"
    );
    Ok(1)
}

#[derive(Debug, clap::Args)]
pub struct RequestsArgs {
    /// Only requests in this status (pending, approved, rejected, expired).
    #[arg(long)]
    status: Option<RequestStatus>,
    #[arg(long)]
    json: bool,
}

pub fn requests(team: &TeamDir, a: RequestsArgs) -> anyhow::Result<u8> {
    let list = RequestStore::new(team).list(a.status)?;
    if a.json {
        println!("{}", serde_json::to_string(&list)?);
        return Ok(0);
    }
    println!(
        "{:<9} {:<14} {:<16} {:<16} {:<9}  DETAIL",
        "ID", "KIND", "FROM", "TO", "STATUS"
    );
    for r in list {
        let detail = r
            .payload
            .get("plan")
            .or_else(|| r.payload.get("reason"))
            .and_then(Value::as_str)
            .unwrap_or("")
            .replace('\n', " ");
        // Escaped before it is cut, so that the column keeps its width.
        let detail: String = term_text::line(&detail).chars().take(60).collect();
        let row = format!(
            "{:<9} {:<14} {:<16} {:<16} {:<9}  {detail}",
            r.request_id,
            r.kind.to_string(),
            r.from,
            r.to,
            r.status.to_string()
        );
        println!("{}", term_text::line(&row));
    }
    Ok(0)
}

#[derive(Debug, clap::Args)]
pub struct DecideArgs {
    id: String,
    #[arg(long)]
    feedback: Option<String>,
    #[arg(long)]
    json: bool,
}

pub fn decide(team: &TeamDir, a: DecideArgs, approve: bool) -> anyhow::Result<u8> {
    let fb = a.feedback.unwrap_or_default();
    if !approve && fb.trim().is_empty() {
        anyhow::bail!("reject needs --feedback TEXT: tell the teammate what to change");
    }
    let r = ops::decide_plan(team, &a.id, approve, &fb)?;
    if a.json {
        println!(
            "{}",
            json!({"request_id": r.request_id, "status": r.status})
        );
    } else {
        println!("{} {}", r.request_id, r.status);
    }
    Ok(0)
}

#[derive(Debug, clap::Args)]
pub struct ShutdownArgs {
    name: String,
    /// Wait until the teammate has answered (and, if it approved, exited).
    #[arg(long)]
    wait: bool,
    /// Seconds to wait with --wait, and the request's time to live.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    #[arg(long, default_value = "the lead asked you to shut down")]
    reason: String,
    #[arg(long)]
    json: bool,
}

pub fn shutdown(team: &TeamDir, a: ShutdownArgs) -> anyhow::Result<u8> {
    let ttl = Duration::from_secs(a.timeout);
    let req = ops::request_shutdown(team, &a.name, &a.reason, ttl)?;
    print_id(a.json, "request_id", &req.request_id);
    if !a.wait {
        return Ok(0);
    }
    let store = RequestStore::new(team);
    let roster = Roster::new(team);
    let deadline = Instant::now() + ttl;
    loop {
        let r = store.get(&req.request_id)?;
        match r.status {
            RequestStatus::Rejected => {
                eprintln!(
                    "lead: {} rejected the shutdown: {}",
                    a.name,
                    term_text::lines(r.response_text().unwrap_or("no reason given"))
                );
                return Ok(5);
            }
            RequestStatus::Approved => {
                let m = roster.load()?.require(&a.name)?.clone();
                if m.status == MemberStatus::Shutdown && !process_alive(team, &a.name) {
                    return Ok(0);
                }
            }
            RequestStatus::Expired => {
                eprintln!(
                    "lead: the shutdown request for {} expired unanswered",
                    a.name
                );
                return Ok(124);
            }
            RequestStatus::Pending => {}
        }
        if Instant::now() >= deadline {
            eprintln!("lead: timed out waiting for {} to shut down", a.name);
            return Ok(124);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn process_alive(team: &TeamDir, name: &str) -> bool {
    AgentName::teammate(name)
        .ok()
        .and_then(|n| troupe::fsutil::HeldLock::is_held(&team.transcript_lock(&n)).ok())
        .unwrap_or(false)
}

#[derive(Debug, clap::Args)]
pub struct LogsArgs {
    name: String,
    /// Keep printing what is appended.
    #[arg(long)]
    follow: bool,
}

pub fn logs(team: &TeamDir, a: LogsArgs) -> anyhow::Result<u8> {
    use std::io::{Read, Seek, Write};
    let name = AgentName::any(&a.name)?;
    let path = team.log(&name);
    if !name.is_lead() {
        let cfg = Roster::new(team).load()?;
        let m = cfg.require(name.as_str())?;
        if let Some(h) = &m.host
            && !path.exists()
        {
            anyhow::bail!(
                "{name} runs on host {h}: its log and transcript are in the team dir of that \
                 host's `lead run --host {h}`; run `lead logs {name}` there"
            );
        }
    }
    let mut out = std::io::stdout().lock();
    let mut pos = 0u64;
    loop {
        if let Ok(mut f) = std::fs::File::open(&path) {
            f.seek(std::io::SeekFrom::Start(pos))?;
            let mut buf = Vec::new();
            f.read_to_end(&mut buf)?;
            pos += buf.len() as u64;
            out.write_all(&buf)?;
            out.flush()?;
        }
        if !a.follow {
            return Ok(0);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The `lead status` table (the REPL's `/team`, the demo's closing table).
pub fn status_table(team: &TeamDir) -> anyhow::Result<()> {
    status(team, ListArgs { json: false }).map(drop)
}

/// The `lead requests` table (the REPL's `/requests`).
pub fn requests_table(team: &TeamDir) -> anyhow::Result<()> {
    requests(
        team,
        RequestsArgs {
            status: None,
            json: false,
        },
    )
    .map(drop)
}

/// The cache-read share of `u` for a table: `62%`, or `-` with no input.
fn share(u: &troupe::llm::Usage) -> String {
    troupe::cost::cache_read_share(u).map_or("-".to_owned(), |s| format!("{:.0}%", s * 100.0))
}

#[derive(Debug, clap::Args)]
pub struct WorktreeArgs {
    #[command(subcommand)]
    command: WorktreeCmd,
}

#[derive(Debug, clap::Subcommand)]
enum WorktreeCmd {
    /// Remove a teammate's worktree (its branch is kept); refused while the teammate runs, and
    /// with uncommitted changes unless --force.
    Remove {
        name: String,
        /// Remove it with its uncommitted changes.
        #[arg(long)]
        force: bool,
        #[arg(long)]
        json: bool,
    },
}

/// `lead worktree remove NAME [--force]`.
pub fn worktree(team: &TeamDir, a: WorktreeArgs) -> anyhow::Result<u8> {
    let WorktreeCmd::Remove { name, force, json } = a.command;
    let roster = Roster::new(team);
    let m = roster.load()?.require(&name)?.clone();
    let refuse = |why: String| troupe::Error::WorktreeRefused {
        name: name.clone(),
        why,
    };
    let Some(w) = m.worktree.clone() else {
        return Err(refuse("it has none".to_owned()).into());
    };
    if m.status.wants_process() && m.pid.is_some_and(liveness::pid_alive) {
        return Err(refuse(format!(
            "{name} is {} (pid {}): shut it down first (`lead shutdown {name} --wait`)",
            m.status,
            m.pid.unwrap_or_default()
        ))
        .into());
    }
    if !force && troupe::worktree::is_dirty(&w) == Some(true) {
        return Err(refuse(format!(
            "{} has uncommitted changes; commit them, or remove it with --force to lose them",
            w.path.display()
        ))
        .into());
    }
    troupe::worktree::remove(&w, force)?;
    roster.update_member(&name, |m| m.worktree = None)?;
    troupe::events::log(
        team,
        "worktree_removed",
        json!({"name": name, "path": w.path, "branch": w.branch, "force": force}),
    );
    if json {
        println!(
            "{}",
            json!({"name": name, "removed": w.path, "branch_kept": w.branch})
        );
    } else {
        println!(
            "removed {}; branch {} is kept (delete it with `git branch -D {}`)",
            w.path.display(),
            w.branch,
            w.branch
        );
    }
    Ok(0)
}
