//! `lead run`: the supervisor. It holds `lead.lock` for its life, starts one `worker` per member
//! that should run, reaps them, restarts unexpected exits with backoff and an intensity limit,
//! escalates expired shutdown requests, and stops the team gracefully on SIGTERM/SIGINT.
//!
//! Workers are forked from the main thread, which lives as long as the process, so their
//! `PR_SET_PDEATHSIG` fires only when the lead itself dies. Children are reaped with
//! `Child::try_wait` only (never `waitpid(-1)`), on every wake-up: SIGCHLD, a change in the team
//! dir (inotify), a signal, or the next timer.
//!
//! This file holds the loop and the supervisor's view of the roster (it carries on with the last
//! good copy while config.json does not parse); each job has a file of its own: [`spawn`]
//! (starting workers), [`exit`] (reaping them and applying the restart [`policy`]),
//! [`escalate`] (expired shutdown requests), [`hooks`] (the user's commands on team events, on a
//! thread of their own), [`team_stop`] (the graceful stop and `lead stop`) and [`background`] (a supervisor started for `--detach`, `chat` and `demo`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::AsFd;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::json;
use troupe::config::{
    Activity, ActivityState, ExitInfo, MemberStatus, Roster, RosterWriter, TeamConfig,
};
use troupe::events;
use troupe::fsutil::{self, HeldLock};
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::ops;
use troupe::requests::{RequestKind, RequestStatus, RequestStore};
use troupe::store::Watched;
use troupe::teamdir::LEAD;
use troupe::{AgentName, TeamDir};

mod background;
mod escalate;
mod exit;
mod hooks;
mod hung;
mod lease;
mod merge;
mod policy;
mod spawn;
mod stoppable;
mod team_stop;

pub use background::{Attach, detach, start_background};
use escalate::terminate;
use policy::*;
pub use team_stop::{StopArgs, stop};

#[derive(Debug, clap::Args)]
pub struct RunArgs {
    /// Run in the background (logs in logs/lead.log); returns once the supervisor is ready.
    #[arg(long)]
    pub detach: bool,
    /// Seconds to wait for teammates to approve the team-stop shutdown before SIGTERM.
    #[arg(long, default_value_t = 30)]
    stop_timeout: u64,
    /// Seconds between SIGTERM and SIGKILL for a worker that does not exit.
    #[arg(long, default_value_t = 5)]
    kill_grace: u64,
    /// Working directory of the teammates (default: the current directory).
    #[arg(long, value_parser = troupe::fsutil::absolute_arg)]
    workdir: Option<PathBuf>,
    /// Restarts allowed within --restart-window seconds before a member is marked failed.
    #[arg(long, default_value_t = 5)]
    max_restarts: usize,
    /// Seconds over which --max-restarts restarts mark a member failed.
    #[arg(long, default_value_t = 60)]
    restart_window: u64,
    /// Seconds before the first restart after an unexpected exit; each further restart waits
    /// twice as long as the one before, up to --restart-delay-max, and a member that stayed up
    /// a minute starts again from this delay.
    #[arg(long, default_value_t = 1.0, value_parser = parse_secs)]
    restart_delay: f64,
    /// The longest wait before a restart, in seconds.
    #[arg(long, default_value_t = 60.0, value_parser = parse_secs)]
    restart_delay_max: f64,
    /// The most the whole team (every member plus the LLM lead) may spend, in US dollars;
    /// kept in config.json, so it holds for every command and the next `lead run`.
    #[arg(long, value_parser = crate::commands::parse_usd)]
    team_budget_usd: Option<f64>,
    /// At most this many members that are not shut down or failed: a spawn beyond it (by the
    /// LLM lead, `lead spawn` or `lead up`) is refused. Kept in config.json, as the budget.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_members: Option<u32>,
    /// At most this many spawns that start a process in any minute (the supervisor's own
    /// restarts are not counted). Kept in config.json.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_spawns_per_minute: Option<u32>,
    /// Seconds a worker may go without a heartbeat (beyond what its model or tool call may
    /// take) before it is taken for hung, killed and restarted; 0 turns the watchdog off.
    #[arg(long, default_value_t = 120)]
    watchdog: u64,
    /// At most this many model calls in flight across the team (the LLM lead's included);
    /// kept in config.json.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_concurrent_calls: Option<u32>,
    /// The team's rate governor: a shared cooldown after a rate limit, a learned concurrency
    /// cap, pacing by the provider's remaining-requests headers. `off` leaves only an explicit
    /// cap. Kept in config.json.
    #[arg(long)]
    rate_governor: Option<troupe::governor::Mode>,
    /// Seconds a request may stay pending (a plan approval, a shutdown before its expiry)
    /// before the team's `request_pending` hooks run for it, once; off unless given.
    #[arg(long, value_parser = parse_secs)]
    escalate_after: Option<f64>,
    /// A price file (JSON: model-id prefix -> per-million prices) over the built-in prices,
    /// handed to every worker.
    #[arg(long, env = "TROUPE_PRICES")]
    prices: Option<PathBuf>,
    /// The branch the merge queue lands worktree members' work on, for this run (over the
    /// team file's `target_branch`; default `troupe/integration`, made at the main tree's
    /// `HEAD`).
    #[arg(long, value_name = "BRANCH", value_parser = parse_branch)]
    target: Option<String>,
    #[command(flatten)]
    pub sandbox: troupe::sandbox::Settings,
    /// On a team spread over machines (a bus): the host this supervisor runs the members of
    /// (default: this machine's host name). One supervisor per host holds its lease.
    #[arg(long)]
    pub host: Option<String>,
}

impl RunArgs {
    /// Sets the teammates' working dir to `dir` unless `--workdir` gave one.
    pub fn default_workdir(&mut self, dir: PathBuf) {
        self.workdir.get_or_insert(dir);
    }

    /// The arguments that parse back into these, without `--detach`: what `lead run --detach`
    /// gives the supervisor it starts. (Destructured whole, so a new flag must be added here.)
    pub fn to_args(&self) -> anyhow::Result<Vec<String>> {
        let RunArgs {
            detach: _,
            stop_timeout,
            kill_grace,
            workdir,
            max_restarts,
            restart_window,
            restart_delay,
            restart_delay_max,
            team_budget_usd,
            max_members,
            max_spawns_per_minute,
            watchdog,
            max_concurrent_calls,
            rate_governor,
            escalate_after,
            prices,
            target,
            sandbox,
            host,
        } = self;
        let mut args: Vec<String> = [
            ("--stop-timeout", stop_timeout.to_string()),
            ("--kill-grace", kill_grace.to_string()),
            ("--max-restarts", max_restarts.to_string()),
            ("--restart-window", restart_window.to_string()),
            ("--restart-delay", restart_delay.to_string()),
            ("--restart-delay-max", restart_delay_max.to_string()),
            ("--watchdog", watchdog.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect();
        if let Some(w) = workdir {
            let w = w.to_str().context("--workdir is not valid UTF-8")?;
            args.extend(["--workdir".to_owned(), w.to_owned()]);
        }
        if let Some(b) = team_budget_usd {
            args.extend(["--team-budget-usd".to_owned(), b.to_string()]);
        }
        if let Some(n) = max_concurrent_calls {
            args.extend(["--max-concurrent-calls".to_owned(), n.to_string()]);
        }
        if let Some(m) = rate_governor {
            let m = if *m == troupe::governor::Mode::Off {
                "off"
            } else {
                "on"
            };
            args.extend(["--rate-governor".to_owned(), m.to_owned()]);
        }
        if let Some(s) = escalate_after {
            args.extend(["--escalate-after".to_owned(), s.to_string()]);
        }
        if let Some(n) = max_members {
            args.extend(["--max-members".to_owned(), n.to_string()]);
        }
        if let Some(n) = max_spawns_per_minute {
            args.extend(["--max-spawns-per-minute".to_owned(), n.to_string()]);
        }
        if let Some(p) = prices {
            let p = std::path::absolute(p)?;
            let p = p.to_str().context("--prices is not valid UTF-8")?;
            args.extend(["--prices".to_owned(), p.to_owned()]);
        }
        if let Some(t) = target {
            args.extend(["--target".to_owned(), t.clone()]);
        }
        args.extend(sandbox.to_args().map_err(anyhow::Error::msg)?);
        if let Some(h) = host {
            args.extend(["--host".to_owned(), h.clone()]);
        }
        Ok(args)
    }
}

/// The longest delay accepted, in seconds (about 31 years): far beyond any use, and small
/// enough that adding it to an `Instant` cannot overflow.
const MAX_DELAY_SECS: f64 = 1e9;

/// A branch name git takes (see [`troupe::merge::check_branch_name`]).
fn parse_branch(s: &str) -> Result<String, String> {
    troupe::merge::check_branch_name(s).map(|()| s.to_owned())
}

/// A number of seconds (fractions allowed) from 0 to [`MAX_DELAY_SECS`].
fn parse_secs(s: &str) -> Result<f64, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("not a number of seconds: {e}"))?;
    if !(0.0..=MAX_DELAY_SECS).contains(&secs) {
        return Err(format!("must be from 0 to {MAX_DELAY_SECS} seconds"));
    }
    Ok(secs)
}

struct Running {
    child: Child,
    incarnation: u64,
    started: Instant,
    /// When it was started, on the wall clock (request files carry wall-clock times).
    started_at: f64,
    /// Its start as a beat: the watchdog's last sign of its life until its first beat.
    start_beat: troupe::store::beat::Beat,
    /// Set when the lead itself asked it to stop (expiry escalation or team stop).
    stopping: bool,
    /// The expired shutdown request it is being stopped for, if that is why.
    escalated: Option<String>,
    kill_at: Option<Instant>,
    /// Killed by the watchdog (see `hung`).
    hung: bool,
}

struct Supervisor {
    team: TeamDir,
    roster: Roster,
    /// The supervisor's roster writes; they wait out an unreadable config.json.
    writer: RosterWriter,
    /// The roster as last read successfully: while config.json does not parse (a person's
    /// edit in progress), the supervisor carries on with this copy.
    view: TeamConfig,
    /// Why config.json cannot be read now, if it cannot.
    config_error: Option<String>,
    /// What [`Supervisor::view`] was read from: config.json and the members' records. A
    /// wake-up that changed neither (an event appended, a lock taken, a request written) costs
    /// no read, and a record's change the read of that record alone.
    seen: troupe::config::RosterSeen,
    /// When config.json's view of the members is next brought up to date with their records
    /// (set when a record changed; see `troupe::store::files::roster`).
    view_due: Option<Instant>,
    /// When the watchdog next reads the running workers' heartbeats.
    beats_due: Option<Instant>,
    /// Changes of the roster and the requests (inotify on the team dir, or the bus's feed);
    /// `None` when it could not be set up (then every look reads every member's record).
    watch: Option<troupe::store::watch::Watch>,
    /// Whether a refresh read a change from the watch that the main loop has not seen (it
    /// still owes a tick for it: a request changed, say).
    watch_saw: bool,
    /// Whether the start-up reconciliation ran (it waits for a readable config.json).
    reconciled: bool,
    /// Members whose names are refused (hand-written `lead`, or invalid), reported once.
    refused: HashSet<String>,
    requests: RequestStore,
    worker_exe: crate::worker_exe::WorkerExe,
    workdir: PathBuf,
    args: RunArgs,
    running: HashMap<String, Running>,
    recent_restarts: HashMap<String, VecDeque<Instant>>,
    /// The delay before each member's latest restart (doubled on the next crash).
    last_delay: HashMap<String, Duration>,
    /// When each member waiting out a restart delay is due to start.
    restart_at: HashMap<String, Instant>,
    /// At most this many workers in their start at once ([`policy::start_limit`]).
    start_limit: usize,
    /// The shutdown request the team stop sent each member, by name.
    stop_requests: HashMap<String, String>,
    /// On a bus: the host whose members this supervisor runs (only those).
    host: Option<String>,
    /// Set by SIGCHLD: a tick looks for exited workers only then, rather than asking each of
    /// hundreds of running ones on every wake-up.
    exited: Arc<std::sync::atomic::AtomicBool>,
}

pub fn run(team_dir: &std::path::Path, args: RunArgs) -> anyhow::Result<u8> {
    let team = TeamDir::create(team_dir)?;
    let Some(lock) = HeldLock::try_acquire_settled(&team.lead_lock())? else {
        return Err(troupe::Error::Locked {
            what: "the supervisor lock (another `lead run` supervises this team dir)",
            path: team.lead_lock(),
        }
        .into());
    };
    std::fs::write(team.lead_lock(), format!("{}\n", std::process::id()))
        .context("failed to record the supervisor pid")?;
    // On a team spread over hosts: this host's lease, which fences this supervisor's writes.
    let lease = team.store().hold_host(
        args.host.as_deref(),
        troupe::store::HOST_LEASE + Duration::from_secs(2),
    )?;
    let workdir = match &args.workdir {
        Some(w) => w.clone(),
        None => std::env::current_dir().context("failed to read the current directory")?,
    };
    // The flags handed to every worker must be expressible (UTF-8 paths).
    args.to_args()?;
    // A price file the workers could not read would fail every one of them: say so now.
    troupe::cost::PriceTable::load(args.prices.as_deref())?;
    let worker_exe = crate::worker_exe::resolve(&team)?;
    refuse_root_commands(&args.sandbox, &workdir, &team)?;
    let signals = Arc::new(AtomicUsize::new(0));
    let (wake_r, wake_w) = std::os::unix::net::UnixStream::pair()?;
    wake_r.set_nonblocking(true)?;
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let s = signals.clone();
        // SAFETY: the handler only does an atomic add (async-signal-safe).
        unsafe {
            signal_hook::low_level::register(sig, move || {
                if s.fetch_add(1, Ordering::SeqCst) >= 1 && sig == signal_hook::consts::SIGINT {
                    // A second Ctrl-C: stop at once.
                    signal_hook::low_level::exit(130);
                }
            })?;
        }
        signal_hook::low_level::pipe::register(sig, wake_w.try_clone()?)?;
    }
    signal_hook::low_level::pipe::register(signal_hook::consts::SIGCHLD, wake_w.try_clone()?)?;
    let exited = Arc::new(std::sync::atomic::AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGCHLD, exited.clone())?;
    let mut sup = Supervisor {
        roster: Roster::new(&team),
        writer: RosterWriter::new(Roster::new(&team)),
        view: TeamConfig::default(),
        config_error: None,
        seen: troupe::config::RosterSeen::holding(),
        view_due: None,
        beats_due: None,
        watch: None,
        watch_saw: false,
        reconciled: false,
        refused: HashSet::new(),
        requests: RequestStore::new(&team),
        team,
        worker_exe,
        workdir,
        args,
        running: HashMap::new(),
        recent_restarts: HashMap::new(),
        last_delay: HashMap::new(),
        restart_at: HashMap::new(),
        start_limit: policy::start_limit(
            std::thread::available_parallelism().map_or(1, |n| n.get()),
        ),
        stop_requests: HashMap::new(),
        host: lease.as_ref().map(|l| l.host().to_owned()),
        exited,
    };
    // Which team and which working dir: from a sub-directory, the dir that holds `.team`.
    tracing::info!(
        "team dir {}, working dir {}",
        sup.team.root().display(),
        sup.workdir.display()
    );
    events::log(
        &sup.team,
        "lead_started",
        json!({"pid": std::process::id(), "host": sup.host(), "workdir": sup.workdir}),
    );
    let keeper = match lease {
        Some(l) => Some(lease::LeaseKeeper::start(l, wake_w.try_clone()?)),
        None => None,
    };
    if let Some(b) = sup.args.team_budget_usd {
        sup.writer.apply(move |c| c.team_budget_usd = Some(b));
        events::log(&sup.team, "team_budget", json!({"budget_usd": b}));
    }
    let (calls, governor) = (sup.args.max_concurrent_calls, sup.args.rate_governor);
    if calls.is_some() || governor.is_some() {
        sup.writer.apply(move |c| {
            if calls.is_some() {
                c.max_concurrent_calls = calls;
            }
            if governor.is_some() {
                c.rate_governor = governor;
            }
        });
    }
    let (max_members, max_spawns) = (sup.args.max_members, sup.args.max_spawns_per_minute);
    if max_members.is_some() || max_spawns.is_some() {
        sup.writer.apply(move |c| {
            if max_members.is_some() {
                c.max_members = max_members;
            }
            if max_spawns.is_some() {
                c.max_spawns_per_minute = max_spawns;
            }
        });
        events::log(
            &sup.team,
            "team_ceilings",
            json!({"max_members": max_members, "max_spawns_per_minute": max_spawns}),
        );
    }
    // Woken by changes of the roster and the requests (inotify on the files, or the bus's
    // change feed), a signal, or the next timer.
    let watch = sup
        .team
        .store()
        .watch(&[Watched::Roster, Watched::Requests])
        .map_err(|e| tracing::warn!("{e}; looking once a second instead"))
        .ok();
    if watch.is_some() {
        // Each refresh reads the records the watch saw change, not every member's.
        sup.seen.watched();
    }
    sup.watch = watch;
    let mut notifier = crate::notify::Notifier::from_env();
    // Before the first tick starts the workers: it makes the target branches (see
    // `merge::ensure_targets`).
    let merges = merge::MergeQueue::start(
        sup.team.clone(),
        sup.host().map(str::to_owned),
        sup.args.sandbox.clone(),
        sup.args.target.clone(),
    )?;
    sup.tick()?;
    let hooks = hooks::Hooks::start(
        sup.team.clone(),
        sup.workdir.clone(),
        sup.host().map(str::to_owned),
        sup.args.sandbox.clone(),
        sup.args
            .escalate_after
            .map(std::time::Duration::from_secs_f64),
    )?;
    // Ready: the lock is held and every member that should run has been started.
    std::fs::write(
        sup.team.lead_lock(),
        format!("{} ready\n", std::process::id()),
    )
    .context("failed to record the supervisor pid")?;
    notifier.ready(&sup.summary());
    // Another supervisor took this host's lease (this one was stalled past it): its writes
    // are refused now, and its workers are replaced.
    let mut lost = false;
    let mut due = true;
    loop {
        if signals.load(Ordering::SeqCst) > 0 {
            break;
        }
        if let Some(k) = &keeper {
            if k.lost() || troupe::fence::replaced(&sup.team) {
                lost = true;
                break;
            }
            if k.stop_requested() {
                break;
            }
        }
        if due {
            if let Err(e) = sup.tick() {
                if troupe::fence::replaced(&sup.team) {
                    lost = true;
                    break;
                }
                return Err(e);
            }
            notifier.status(&sup.summary());
        }
        let ping = notifier.watchdog().unwrap_or(Duration::from_secs(1));
        let timeout = sup
            .next_deadline()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1))
            .min(ping);
        let mut fds = vec![PollFd::new(wake_r.as_fd(), PollFlags::POLLIN)];
        if let Some(w) = &sup.watch {
            fds.push(PollFd::new(w.fd(), PollFlags::POLLIN));
        }
        let ms = timeout.as_millis().clamp(1, 1000) as i32;
        let ready = poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        );
        drop(fds);
        // A tick after a signal (SIGCHLD among them), a timer, or a change of the roster or of
        // a request (not after the team dir's other files: an event appended, a lock file
        // closed; with hundreds of workers those come by the thousand, and each tick looks at
        // every member).
        due = !matches!(ready, Ok(n) if n > 0) | drain_pipe(&wake_r);
        due |= sup.look_at_watch() | std::mem::take(&mut sup.watch_saw);
    }
    notifier.stopping();
    // A hook running now is killed; what it was run for stays marked for the next start. So is
    // a merge check: its entry is checked again by the next start.
    hooks.stop();
    merges.stop();
    if lost {
        let host = sup.host().unwrap_or_default().to_owned();
        sup.abandon_team();
        events::log(&sup.team, "lease_lost", json!({"host": host}));
        drop(keeper);
        drop(lock);
        return Err(crate::ExitError {
            code: 4,
            message: format!(
                "another supervisor took the lease of host {host} (this one was stalled past \
                 it): killed this host's workers here and wrote nothing; the other supervisor \
                 runs its members now"
            ),
        }
        .into());
    }
    sup.stop_team()?;
    sup.write_view();
    events::log(
        &sup.team,
        "lead_stopped",
        json!({"pid": std::process::id(), "host": sup.host()}),
    );
    if let Some(k) = keeper {
        k.release();
    }
    drop(lock);
    Ok(0)
}

/// Empties the wake-up pipe; returns whether anything was in it.
fn drain_pipe(r: &std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    let mut buf = [0u8; 64];
    let mut r = r;
    let mut any = false;
    while let Ok(n) = r.read(&mut buf) {
        if n == 0 {
            break;
        }
        any = true;
    }
    any
}

fn describe(status: &ExitStatus) -> ExitInfo {
    ExitInfo {
        code: status.code(),
        signal: status.signal().map(|s| {
            Signal::try_from(s).map_or(format!("signal {s}"), |sig| sig.as_str().to_owned())
        }),
    }
}

impl Supervisor {
    /// The host this supervisor runs, on a bus.
    fn host(&self) -> Option<&str> {
        self.host.as_deref()
    }

    /// On a bus: claims for this host the members placed nowhere yet that should run (the
    /// first supervisor to start one places it), and keeps only this host's members in `cfg`.
    fn place(&mut self, cfg: &mut TeamConfig) {
        let Some(host) = self.host().map(str::to_owned) else {
            return;
        };
        let unplaced: Vec<String> = cfg
            .members
            .iter()
            .filter(|m| {
                m.host.is_none() && (m.status.wants_process() || m.status == MemberStatus::Stopped)
            })
            .map(|m| m.name.clone())
            .collect();
        if !unplaced.is_empty() {
            let h = host.clone();
            self.writer.apply(move |c| {
                for m in c.members.iter_mut() {
                    if m.host.is_none() && unplaced.contains(&m.name) {
                        m.host = Some(h.clone());
                    }
                }
            });
            // Another host's supervisor may have placed them first: read who did.
            if let Ok(now) = self.roster.load() {
                *cfg = now;
            }
        }
        cfg.members
            .retain(|m| m.host.as_deref() == Some(host.as_str()));
    }

    /// Reads config.json into [`Supervisor::view`] if it changed since the last read. While it
    /// does not parse, the view stays the last good copy, and each distinct error is logged
    /// once (an event and a line).
    fn refresh(&mut self) {
        // What changed up to now (a worker's last write before it exited among them: inotify
        // queues the event before the rename returns).
        self.watch_saw |= self.look_at_watch();
        // Brought up to date in place: a change costs what changed, not the team's size.
        let mut cfg = std::mem::take(&mut self.view);
        let read = self.roster.load_into(&mut self.seen, &mut cfg);
        if matches!(read, Ok(true)) {
            if self.seen.take_records_changed() && self.view_due.is_none() {
                self.view_due = Some(Instant::now() + troupe::store::files::roster::VIEW_LAG);
            }
            if let Some(was) = self.config_error.take() {
                tracing::info!("config.json parses again (it did not: {was})");
                events::log(&self.team, "config_readable", json!({}));
            }
            self.place(&mut cfg);
        }
        self.view = cfg;
        match read {
            Ok(false) => {
                if self.config_error.is_none() && self.writer.is_pending() && self.writer.flush() {
                    self.refresh();
                }
            }
            Ok(true) => {
                if self.writer.is_pending() && self.writer.flush() {
                    self.refresh();
                }
            }
            Err(e) => {
                let text = e.to_string();
                if self.config_error.as_deref() != Some(text.as_str()) {
                    tracing::warn!(
                        "{text}; carrying on with the last good roster until it parses again"
                    );
                    events::log(&self.team, "config_unreadable", json!({"error": text}));
                    self.config_error = Some(text);
                }
            }
        }
    }

    /// Once config.json is readable: a team stopped by `lead stop` resumes (members recorded
    /// as running whose process is gone are started again by [`Supervisor::start_wanted`]).
    fn reconcile_at_start(&mut self) {
        for m in self.view.members.clone() {
            if m.status == MemberStatus::Stopped {
                self.writer.member(&m.name, None, |mm| {
                    if mm.status == MemberStatus::Stopped {
                        mm.status = MemberStatus::Spawning;
                    }
                });
            }
            if m.status.wants_process() || m.status == MemberStatus::Stopped {
                // An orphan of a dead lead still holding the teammate got SIGTERM through
                // PDEATHSIG and finishes its step; the new worker waits for its lock.
                events::log(
                    &self.team,
                    "reconcile",
                    json!({"name": m.name, "status": m.status, "pid": m.pid}),
                );
            }
        }
        self.reconciled = true;
        self.refresh();
    }

    /// One line for `STATUS=`: how many members are in each state.
    fn summary(&self) -> String {
        let cfg = &self.view;
        let mut counts: Vec<(String, usize)> = Vec::new();
        for m in &cfg.members {
            let k = m.status.to_string();
            match counts.iter_mut().find(|(s, _)| *s == k) {
                Some((_, n)) => *n += 1,
                None => counts.push((k, 1)),
            }
        }
        let parts: Vec<String> = counts.iter().map(|(s, n)| format!("{n} {s}")).collect();
        format!(
            "{}{} members: {}",
            if self.config_error.is_some() {
                "config.json unreadable; "
            } else {
                ""
            },
            cfg.members.len(),
            if parts.is_empty() {
                "none".into()
            } else {
                parts.join(", ")
            }
        )
    }

    fn tick(&mut self) -> anyhow::Result<()> {
        // Cleared before the look: an exit after it sets the flag again.
        if self.exited.swap(false, Ordering::SeqCst) {
            self.reap()?;
        }
        self.refresh();
        if !self.reconciled && self.config_error.is_none() {
            self.reconcile_at_start();
        }
        self.start_wanted();
        self.escalate_expired();
        self.kill_stragglers();
        if self.view_due.is_some_and(|at| at <= Instant::now()) {
            self.write_view();
        }
        self.watch_beats();
        Ok(())
    }

    /// Reads what the watch queued: whether something watched changed, and which members'
    /// records (for the next refresh to read those alone).
    fn look_at_watch(&mut self) -> bool {
        let Some(w) = &self.watch else {
            return false;
        };
        let changed = w.changed();
        self.seen.note_changes(w.take_members());
        changed
    }

    /// Brings config.json's view of the members up to date with their records. While
    /// config.json does not parse, it is left to the person (tried again after the next
    /// change).
    fn write_view(&mut self) {
        self.view_due = None;
        if let Err(e) = self.roster.refresh_view() {
            tracing::debug!("config.json's view not brought up to date: {e}");
        }
    }

    fn next_deadline(&self) -> Option<Duration> {
        let now = Instant::now();
        // A restart that is due but could not start (config.json unreadable) waits for the
        // next regular wake-up instead of spinning.
        self.restart_at
            .values()
            .copied()
            .filter(|at| *at > now)
            .chain(self.running.values().filter_map(|r| r.kill_at))
            .chain(self.view_due)
            .chain(self.beats_due.filter(|_| !self.running.is_empty()))
            .chain(self.start_room_at())
            .map(|t| t.saturating_duration_since(now))
            .min()
    }
}

/// As root, commands run as an unprivileged user (see `troupe::sandbox`), never as uid 0:
/// where this machine cannot arrange that for the team's working dir, `lead run` refuses to
/// start (exit 78) and says how to proceed, rather than start teammates whose `bash` refuses
/// every command. `--sandbox off` is the person's own choice, and is not checked.
fn refuse_root_commands(
    settings: &troupe::sandbox::Settings,
    workdir: &std::path::Path,
    team: &TeamDir,
) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() || settings.mode == troupe::sandbox::Mode::Off {
        return Ok(());
    }
    let sb =
        troupe::sandbox::Sandbox::prepare_quietly(settings, workdir, team.root(), "lead-run", None);
    let Some(why) = &sb.status().refused else {
        return Ok(());
    };
    Err(crate::ExitError {
        code: 78,
        message: format!(
            "running as root, commands must run as an unprivileged user, and that cannot be set \
             up for {}: {why}. Run troupe as an unprivileged user that owns the working dir \
             (the shipped units use User=troupe), or name one with --sandbox-user, or give that \
             user the working dir; --sandbox off runs commands unsandboxed, as root",
            workdir.display()
        ),
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_must_be_finite_and_not_negative() {
        assert_eq!(parse_secs("0.05"), Ok(0.05));
        assert_eq!(parse_secs("0"), Ok(0.0));
        assert_eq!(parse_secs("60"), Ok(60.0));
        assert_eq!(parse_secs("1e9"), Ok(1e9));
        for bad in ["-1", "-0.001", "NaN", "inf", "1e10", "soon", ""] {
            assert!(parse_secs(bad).is_err(), "{bad} accepted");
        }
    }
}
