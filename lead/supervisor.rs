//! `lead run`: the supervisor. It holds `lead.lock` for its life, starts one `worker` per member
//! that should run, reaps them, restarts unexpected exits with backoff and an intensity limit,
//! escalates expired shutdown requests, and stops the team gracefully on SIGTERM/SIGINT.
//!
//! Workers are forked from the main thread, which lives as long as the process, so their
//! `PR_SET_PDEATHSIG` fires only when the lead itself dies. Children are reaped with
//! `Child::try_wait` only (never `waitpid(-1)`), on every wake-up: SIGCHLD, a change in the team
//! dir (inotify), a signal, or the next timer.

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
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
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
use troupe::teamdir::LEAD;
use troupe::{AgentName, TeamDir};

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
    #[arg(long)]
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
}

impl RunArgs {
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
        } = self;
        let mut args: Vec<String> = [
            ("--stop-timeout", stop_timeout.to_string()),
            ("--kill-grace", kill_grace.to_string()),
            ("--max-restarts", max_restarts.to_string()),
            ("--restart-window", restart_window.to_string()),
            ("--restart-delay", restart_delay.to_string()),
            ("--restart-delay-max", restart_delay_max.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect();
        if let Some(w) = workdir {
            let w = w.to_str().context("--workdir is not valid UTF-8")?;
            args.extend(["--workdir".to_owned(), w.to_owned()]);
        }
        Ok(args)
    }
}

/// The longest delay accepted, in seconds (about 31 years): far beyond any use, and small
/// enough that adding it to an `Instant` cannot overflow.
const MAX_DELAY_SECS: f64 = 1e9;

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

/// Exit codes after which a worker is never restarted.
const NO_RESTART: [i32; 3] = [0, 64, 78];

/// The exit code of a transient failure: restarted with backoff, but not counted toward the
/// restart limit (a worker waits out a model API outage itself; whatever still exits 75 is
/// worth trying again, not giving up on).
const EX_TEMPFAIL: i32 = 75;

/// What is known about a worker's exit when the supervisor decides what comes next.
#[derive(Debug, Clone, Default)]
struct ExitFacts {
    name: String,
    code: Option<i32>,
    /// The lead asked it to stop (a team stop, or an escalated shutdown).
    stopping: bool,
    /// The shutdown request that went unanswered and was escalated, if that is why it stopped.
    escalated: Option<String>,
    /// During a team stop: it had shut down for a request of its own, not the team stop's.
    on_its_own: bool,
    /// This incarnation approved a shutdown request (it may have died before exiting 0).
    approved_shutdown: bool,
    /// Counted restarts within the restart window before this exit.
    recent_restarts: usize,
    max_restarts: usize,
    window_secs: u64,
    /// How it ended, for reasons.
    last_exit: String,
}

/// What becomes of a member whose worker exited.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ExitDecision {
    /// Paused by a team stop: the next `lead run` resumes it.
    Stopped,
    /// Ended for good, as the lead wanted (an approved or an escalated shutdown).
    Shutdown(Option<String>),
    /// Given up on, with the reason.
    Failed(String),
    /// Started again after a delay; `counted` toward the restart limit.
    Restart { counted: bool },
}

/// The restart policy, as a pure function of the facts of one exit.
fn decide_exit(f: &ExitFacts) -> ExitDecision {
    if let Some(rid) = &f.escalated {
        return ExitDecision::Shutdown(Some(format!(
            "stopped by the lead: shutdown request {rid} went unanswered"
        )));
    }
    if f.stopping && !f.on_its_own {
        return ExitDecision::Stopped;
    }
    if f.code == Some(0) || f.approved_shutdown {
        return ExitDecision::Shutdown(None);
    }
    if let Some(c) = f.code.filter(|c| NO_RESTART.contains(c)) {
        return ExitDecision::Failed(format!(
            "worker exited {c} ({}); not restarted, see `lead logs {}`",
            if c == 64 {
                "usage error"
            } else {
                "configuration error"
            },
            f.name
        ));
    }
    if f.code == Some(EX_TEMPFAIL) {
        return ExitDecision::Restart { counted: false };
    }
    if f.recent_restarts >= f.max_restarts {
        return ExitDecision::Failed(format!(
            "{} restarts within {} s (last exit: {}); gave up",
            f.recent_restarts, f.window_secs, f.last_exit
        ));
    }
    ExitDecision::Restart { counted: true }
}

/// A member that stayed up this long before an unexpected exit restarts after the first delay
/// again, not after a doubled one.
const HEALTHY_UPTIME: Duration = Duration::from_secs(60);

/// The wait before a restart: `first` after a healthy run (or the first exit), else twice the
/// previous wait; never more than `max` (so a `first` above `max` waits `max`).
fn restart_delay(
    prev: Option<Duration>,
    healthy: bool,
    first: Duration,
    max: Duration,
) -> Duration {
    match prev {
        Some(d) if !healthy => d.saturating_mul(2).min(max),
        _ => first.min(max),
    }
}

struct Running {
    child: Child,
    incarnation: u64,
    started: Instant,
    /// When it was started, on the wall clock (request files carry wall-clock times).
    started_at: f64,
    /// Set when the lead itself asked it to stop (expiry escalation or team stop).
    stopping: bool,
    /// The expired shutdown request it is being stopped for, if that is why.
    escalated: Option<String>,
    kill_at: Option<Instant>,
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
    /// The shutdown request the team stop sent each member, by name.
    stop_requests: HashMap<String, String>,
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
    let workdir = match &args.workdir {
        Some(w) => w.clone(),
        None => std::env::current_dir().context("failed to read the current directory")?,
    };
    let worker_exe = crate::worker_exe::resolve(&team)?;
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
    let mut sup = Supervisor {
        roster: Roster::new(&team),
        writer: RosterWriter::new(Roster::new(&team)),
        view: TeamConfig::default(),
        config_error: None,
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
        stop_requests: HashMap::new(),
    };
    events::log(
        &sup.team,
        "lead_started",
        json!({"pid": std::process::id()}),
    );
    let notify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).ok();
    if let Some(n) = &notify {
        let flags =
            AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_CREATE;
        let _ = n.add_watch(sup.team.root(), flags);
        let _ = n.add_watch(&sup.team.requests_dir(), flags);
    }
    let mut notifier = crate::notify::Notifier::from_env();
    sup.tick()?;
    // Ready: the lock is held and every member that should run has been started.
    std::fs::write(
        sup.team.lead_lock(),
        format!("{} ready\n", std::process::id()),
    )
    .context("failed to record the supervisor pid")?;
    notifier.ready(&sup.summary());
    loop {
        if signals.load(Ordering::SeqCst) > 0 {
            break;
        }
        sup.tick()?;
        notifier.status(&sup.summary());
        let ping = notifier.watchdog().unwrap_or(Duration::from_secs(1));
        let timeout = sup
            .next_deadline()
            .unwrap_or(Duration::from_secs(1))
            .min(Duration::from_secs(1))
            .min(ping);
        let mut fds = vec![PollFd::new(wake_r.as_fd(), PollFlags::POLLIN)];
        if let Some(n) = &notify {
            fds.push(PollFd::new(n.as_fd(), PollFlags::POLLIN));
        }
        let ms = timeout.as_millis().clamp(1, 1000) as i32;
        let _ = poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        );
        drop(fds);
        drain_pipe(&wake_r);
        if let Some(n) = &notify {
            while let Ok(evs) = n.read_events() {
                if evs.is_empty() {
                    break;
                }
            }
        }
    }
    notifier.stopping();
    sup.stop_team()?;
    events::log(
        &sup.team,
        "lead_stopped",
        json!({"pid": std::process::id()}),
    );
    drop(lock);
    Ok(0)
}

fn drain_pipe(r: &std::os::unix::net::UnixStream) {
    use std::io::Read;
    let mut buf = [0u8; 64];
    let mut r = r;
    while let Ok(n) = r.read(&mut buf) {
        if n == 0 {
            break;
        }
    }
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
    /// Reads config.json into [`Supervisor::view`]. While it does not parse, the view stays
    /// the last good copy, and each distinct error is logged once (an event and a line).
    fn refresh(&mut self) {
        match self.roster.load() {
            Ok(cfg) => {
                if let Some(was) = self.config_error.take() {
                    tracing::info!("config.json parses again (it did not: {was})");
                    events::log(&self.team, "config_readable", json!({}));
                }
                self.view = cfg;
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
        self.reap()?;
        self.refresh();
        if !self.reconciled && self.config_error.is_none() {
            self.reconcile_at_start();
        }
        self.start_wanted();
        self.escalate_expired();
        self.kill_stragglers();
        Ok(())
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
            .map(|t| t.saturating_duration_since(now))
            .min()
    }

    fn reap(&mut self) -> anyhow::Result<()> {
        let mut exited = Vec::new();
        for (name, r) in &mut self.running {
            if let Some(st) = r.child.try_wait()? {
                exited.push((name.clone(), st));
            }
        }
        for (name, st) in exited {
            let r = self.running.remove(&name).expect("reaped child is tracked");
            self.handle_exit(&name, r, st);
        }
        Ok(())
    }

    /// Whether incarnation `r` of `name` approved a shutdown request: it may have died (kill
    /// -9, a panic, a failed write) between recording the approval and exiting 0, and a
    /// restart could never finish that shutdown.
    fn approved_shutdown(&self, name: &str, r: &Running) -> bool {
        match self.requests.list(Some(RequestStatus::Approved)) {
            Ok(list) => list.iter().any(|q| {
                q.kind == RequestKind::Shutdown
                    && q.to == name
                    && q.target_incarnation.is_none_or(|t| t == r.incarnation)
                    && q.updated_at >= r.started_at
            }),
            Err(e) => {
                tracing::warn!("could not list requests: {e}");
                false
            }
        }
    }

    fn handle_exit(&mut self, name: &str, r: Running, st: ExitStatus) {
        let info = describe(&st);
        let code = st.code();
        events::log(
            &self.team,
            "exit",
            json!({"name": name, "incarnation": r.incarnation, "code": code, "signal": info.signal, "pid": r.child.id()}),
        );
        let now = Instant::now();
        let window = Duration::from_secs(self.args.restart_window);
        let q = self.recent_restarts.entry(name.to_owned()).or_default();
        while q.front().is_some_and(|t| now.duration_since(*t) > window) {
            q.pop_front();
        }
        let recent = q.len();
        let facts = ExitFacts {
            name: name.to_owned(),
            code,
            stopping: r.stopping,
            escalated: r.escalated.clone(),
            on_its_own: r.stopping && code == Some(0) && self.shut_down_on_its_own(name),
            approved_shutdown: code != Some(0) && self.approved_shutdown(name, &r),
            recent_restarts: recent,
            max_restarts: self.args.max_restarts,
            window_secs: window.as_secs(),
            last_exit: info.to_string(),
        };
        let decision = decide_exit(&facts);
        let mut restart_due = None;
        match &decision {
            ExitDecision::Restart { counted } => {
                if *counted {
                    self.recent_restarts
                        .entry(name.to_owned())
                        .or_default()
                        .push_back(now);
                }
                let healthy = now.duration_since(r.started) >= HEALTHY_UPTIME;
                let delay = restart_delay(
                    self.last_delay.get(name).copied(),
                    healthy,
                    // Both were checked by `parse_secs`.
                    Duration::from_secs_f64(self.args.restart_delay),
                    Duration::from_secs_f64(self.args.restart_delay_max),
                );
                self.last_delay.insert(name.to_owned(), delay);
                self.restart_at.insert(name.to_owned(), now + delay);
                restart_due = Some(fsutil::now() + delay.as_secs_f64());
                events::log(
                    &self.team,
                    "restart_scheduled",
                    json!({"name": name, "in_secs": delay.as_secs_f64(), "last_exit": info}),
                );
            }
            // Not restarted: a later `lead spawn` starts it at once, with a fresh policy.
            _ => {
                self.last_delay.remove(name);
                self.restart_at.remove(name);
                self.recent_restarts.remove(name);
            }
        }
        let (status, reason) = match &decision {
            ExitDecision::Stopped => (MemberStatus::Stopped, None),
            ExitDecision::Shutdown(why) => (MemberStatus::Shutdown, why.clone()),
            ExitDecision::Failed(why) => (MemberStatus::Failed, Some(why.clone())),
            ExitDecision::Restart { .. } => (MemberStatus::Spawning, None),
        };
        let restart = restart_due.is_some();
        let last = info.clone();
        let why = reason.clone();
        let ended_itself = code == Some(0) || facts.approved_shutdown;
        self.writer.member(name, None, move |m| {
            // A member reactivated by `lead spawn` after its worker recorded its own shutdown
            // and before this reap stays reactivated; the supervisor starts it again.
            let reactivated = status == MemberStatus::Shutdown
                && ended_itself
                && m.status == MemberStatus::Spawning
                && m.pid.is_none();
            if !reactivated {
                m.status = status;
            }
            m.pid = None;
            m.last_exit = Some(last.clone());
            m.activity = restart_due.map(|until| Activity {
                until: Some(until),
                ..Activity::now(ActivityState::Restarting)
            });
            if restart {
                m.restarts += 1;
            }
            if why.is_some() {
                m.reason = why.clone();
            }
        });
        if status == MemberStatus::Failed {
            events::log(
                &self.team,
                "failed",
                json!({"name": name, "reason": reason}),
            );
            // The lead (a person's `lead inbox`, or the LLM lead, which takes a turn for it)
            // hears of it, instead of waiting for a teammate that will not come back.
            let why = reason.as_deref().unwrap_or("gave up");
            let note = Message::new(
                MessageType::StatusUpdate,
                name,
                LEAD,
                format!("{name} failed and will not be restarted: {why}"),
            );
            if let Err(e) =
                Inbox::new(&self.team, &AgentName::lead()).append(&note, Durability::Sync)
            {
                tracing::warn!("could not tell the lead that {name} failed: {e}");
            }
        }
    }

    /// Starts a worker for every member that should run and has none, unless it waits out a
    /// restart delay. Nothing starts while config.json cannot be read or written: a start must
    /// record the new incarnation first.
    fn start_wanted(&mut self) {
        if self.config_error.is_some() || !self.writer.flush() {
            return;
        }
        let now = Instant::now();
        let wanted: Vec<String> = self
            .view
            .members
            .iter()
            .filter(|m| m.status.wants_process())
            .map(|m| m.name.clone())
            .collect();
        // A member no longer wanted (edited by hand, removed) has no restart to wait for.
        self.restart_at.retain(|n, _| wanted.contains(n));
        for name in wanted {
            if self.running.contains_key(&name)
                || self.restart_at.get(&name).is_some_and(|at| *at > now)
            {
                continue;
            }
            if let Err(e) = AgentName::teammate(&name) {
                if self.refused.insert(name.clone()) {
                    tracing::warn!("not starting member {name:?} of config.json: {e}");
                    events::log(
                        &self.team,
                        "member_refused",
                        json!({"name": name, "reason": e.to_string()}),
                    );
                }
                continue;
            }
            self.start(&name);
        }
    }

    fn start(&mut self, name: &str) {
        let agent = match AgentName::teammate(name) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("{e}");
                return;
            }
        };
        let incarnation = match self.roster.update_member(name, |m| {
            m.incarnation += 1;
            m.activity = Some(Activity::now(ActivityState::Starting));
            m.incarnation
        }) {
            Ok(i) => i,
            Err(e) => {
                // Logged as a config error by the next refresh, or here for anything else.
                tracing::warn!("could not start {name}: {e}");
                return;
            }
        };
        self.restart_at.remove(name);
        let log = match fsutil::create_dir(&self.team.logs_dir())
            .and_then(|()| fsutil::open_append(&self.team.log(&agent)))
        {
            Ok(f) => Stdio::from(f),
            Err(e) => {
                tracing::warn!("{e}; {name}'s stderr is discarded");
                Stdio::null()
            }
        };
        let mut cmd = self.worker_exe.command();
        cmd.arg("--team-dir")
            .arg(self.team.root())
            .args(["--name", name])
            .arg("--workdir")
            .arg(&self.workdir)
            .current_dir(&self.workdir)
            .env("TROUPE_PARENT_PID", std::process::id().to_string())
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0);
        // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(child) => {
                let pid = child.id();
                self.writer.member(name, None, move |m| {
                    if m.incarnation == incarnation {
                        m.pid = Some(pid);
                    }
                });
                events::log(
                    &self.team,
                    "spawn",
                    json!({"name": name, "pid": pid, "incarnation": incarnation}),
                );
                self.running.insert(
                    name.to_owned(),
                    Running {
                        child,
                        incarnation,
                        started: Instant::now(),
                        started_at: fsutil::now(),
                        stopping: false,
                        escalated: None,
                        kill_at: None,
                    },
                );
            }
            Err(e) => {
                let why = format!("failed to start {}: {e}", self.worker_exe);
                let reason = why.clone();
                self.writer.member(name, None, move |m| {
                    m.status = MemberStatus::Failed;
                    m.activity = None;
                    m.reason = Some(reason.clone());
                });
                events::log(&self.team, "failed", json!({"name": name, "reason": why}));
            }
        }
    }

    /// Expired shutdown requests: mark them and SIGTERM the worker's group (SIGKILL later).
    /// A request file that cannot be read or written is logged and skipped, never fatal.
    fn escalate_expired(&mut self) {
        let now = fsutil::now();
        let pending = match self.requests.list(Some(RequestStatus::Pending)) {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("could not list requests: {e}");
                return;
            }
        };
        for req in pending {
            if req.kind != RequestKind::Shutdown || !req.is_due(now) {
                continue;
            }
            match self.requests.expire_if_due(&req.request_id) {
                Ok(Some(_)) => {}
                Ok(None) => continue,
                Err(e) => {
                    tracing::warn!("could not expire request {}: {e}", req.request_id);
                    continue;
                }
            }
            let Some(r) = self.running.get_mut(&req.to) else {
                continue;
            };
            if req.target_incarnation.is_some_and(|t| t != r.incarnation) {
                // Aimed at an earlier incarnation: never stops the respawned teammate.
                continue;
            }
            events::log(
                &self.team,
                "shutdown_escalated",
                json!({"name": req.to, "request_id": req.request_id, "signal": "SIGTERM"}),
            );
            r.escalated = Some(req.request_id.clone());
            terminate(r, Duration::from_secs(self.args.kill_grace));
        }
    }

    fn kill_stragglers(&mut self) {
        let now = Instant::now();
        for (name, r) in &mut self.running {
            if r.kill_at.is_some_and(|t| now >= t) {
                let _ = killpg(Pid::from_raw(r.child.id() as i32), Signal::SIGKILL);
                r.kill_at = None;
                events::log(
                    &self.team,
                    "killed",
                    json!({"name": name, "signal": "SIGKILL"}),
                );
            }
        }
    }

    /// Whether a member that exited 0 during a team stop had shut down for a request of the
    /// lead's rather than the team stop's (a race: it approved just before the stop began).
    /// Such a member stays `shutdown`, not `stopped` (a later `lead run` must not resume it),
    /// and the team stop's request to it, unanswered, is expired.
    fn shut_down_on_its_own(&mut self, name: &str) -> bool {
        self.refresh();
        let wrote_shutdown = self
            .view
            .member(name)
            .is_some_and(|m| m.status == MemberStatus::Shutdown);
        let Some(rid) = self.stop_requests.get(name) else {
            return wrote_shutdown;
        };
        let approved_stop = self
            .requests
            .get(rid)
            .is_ok_and(|r| r.status == RequestStatus::Approved);
        if !wrote_shutdown || approved_stop {
            return false;
        }
        if let Err(e) = self
            .requests
            .expire_now(rid, "the teammate had already shut down")
        {
            tracing::warn!("could not expire the stop request {rid} of {name}: {e}");
        }
        true
    }

    /// The graceful team stop: ask everyone, wait, SIGTERM, SIGKILL, mark `stopped`.
    fn stop_team(&mut self) -> anyhow::Result<()> {
        events::log(
            &self.team,
            "team_stop",
            json!({"running": self.running.len()}),
        );
        let deadline = Instant::now() + Duration::from_secs(self.args.stop_timeout);
        self.refresh();
        let cfg = self.view.clone();
        for (name, r) in self.running.iter_mut() {
            // One that approved a shutdown already is on its way out: asking again would leave
            // a request nobody answers.
            if cfg
                .member(name)
                .is_some_and(|m| m.status == MemberStatus::Shutdown)
            {
                continue;
            }
            r.stopping = true;
            match ops::request_shutdown(
                &self.team,
                name,
                "the team is stopping",
                Duration::from_secs(self.args.stop_timeout),
            ) {
                Ok(req) => {
                    self.stop_requests.insert(name.clone(), req.request_id);
                }
                Err(e) => tracing::warn!("could not ask {name} to shut down: {e}"),
            }
        }
        let mut termed = false;
        while !self.running.is_empty() {
            self.reap()?;
            if !termed && Instant::now() >= deadline {
                for r in self.running.values_mut() {
                    terminate(r, Duration::from_secs(self.args.kill_grace));
                }
                termed = true;
            }
            self.kill_stragglers();
            std::thread::sleep(Duration::from_millis(10));
        }
        // Requests of the team stop that nobody answered (the teammate was killed) are moot.
        for (name, rid) in &self.stop_requests {
            if let Err(e) = self.requests.expire_now(rid, "the team stopped") {
                tracing::warn!("could not expire the stop request {rid} of {name}: {e}");
            }
        }
        // Whoever did not approve is stopped; approvals already say `shutdown`. A config.json
        // that does not parse is left as the person made it: those members then look running
        // with no process, which the next `lead run` resumes just the same.
        let written = self.writer.apply(|cfg| {
            for m in cfg.members.iter_mut().filter(|m| m.status.wants_process()) {
                m.status = MemberStatus::Stopped;
                m.pid = None;
                m.activity = None;
            }
        });
        if !written {
            tracing::warn!(
                "the team stop could not be recorded: {}",
                self.writer
                    .error()
                    .unwrap_or("config.json cannot be written")
            );
        }
        Ok(())
    }
}

fn terminate(r: &mut Running, grace: Duration) {
    r.stopping = true;
    let _ = killpg(Pid::from_raw(r.child.id() as i32), Signal::SIGTERM);
    r.kill_at.get_or_insert(Instant::now() + grace);
}

#[derive(Debug, clap::Args)]
pub struct StopArgs {
    /// Seconds to wait for the supervisor to stop the team and exit.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

/// `lead stop`: SIGTERM to the supervisor (the graceful team stop), and wait until it is gone.
pub fn stop(team: &TeamDir, a: StopArgs) -> anyhow::Result<u8> {
    let lock = team.lead_lock();
    if !HeldLock::is_held(&lock)? {
        return Err(troupe::Error::MemberConflict {
            name: "lead".into(),
            status: "not running".into(),
            why: "no supervisor holds this team dir",
        }
        .into());
    }
    let text = std::fs::read_to_string(&lock).context("failed to read lead.lock")?;
    let pid: i32 = text
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .context("lead.lock holds no pid")?;
    nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGTERM)
        .with_context(|| format!("failed to signal the supervisor (pid {pid})"))?;
    let deadline = Instant::now() + Duration::from_secs(a.timeout);
    // Gone means both: the lock released and the process ended.
    while HeldLock::is_held(&lock)? || troupe::liveness::pid_alive(pid as u32) {
        if Instant::now() >= deadline {
            eprintln!(
                "lead: the supervisor (pid {pid}) is still running after {} s",
                a.timeout
            );
            return Ok(124);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(0)
}

/// `lead run --detach`: starts the supervisor in the background (its own session, output to
/// `logs/lead.log`) and returns once it is ready.
pub fn detach(team_dir: &std::path::Path, args: &[String]) -> anyhow::Result<u8> {
    let team = TeamDir::create(team_dir)?;
    let child = start_background(&team, args, &[], Attach::Detached)?;
    println!("{}", child.id());
    Ok(0)
}

/// How a supervisor started by [`start_background`] is tied to the process that starts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attach {
    /// Its own session: it outlives the caller (`lead run --detach`).
    Detached,
    /// Its own process group (a Ctrl-C at the caller's terminal does not reach it), and SIGTERM
    /// (a graceful team stop) when the caller dies: `lead chat`, `lead demo`.
    Child,
}

/// Starts `lead run ARGS` in the background with output to `logs/lead.log` and the extra
/// environment `envs`, and returns once it is ready (it holds `lead.lock` and has started every
/// member that should run).
pub fn start_background(
    team: &TeamDir,
    args: &[String],
    envs: &[(String, String)],
    attach: Attach,
) -> anyhow::Result<Child> {
    let log_path = team.log(&AgentName::lead());
    let log = fsutil::open_append(&log_path)?;
    // Where this supervisor's own lines will start: its reason, should it fail to start.
    let log_start = log.metadata().map_or(0, |m| m.len());
    let exe = std::env::current_exe().context("failed to find the lead binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg("--team-dir")
        .arg(team.root())
        .arg("run")
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log));
    match attach {
        // SAFETY: setsid is async-signal-safe; it runs in the child between fork and exec.
        Attach::Detached => unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                Ok(())
            });
        },
        // SAFETY: prctl is async-signal-safe; it runs in the child between fork and exec. The
        // caller spawns from its main thread, which lives as long as the caller.
        Attach::Child => unsafe {
            cmd.process_group(0).pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                Ok(())
            });
        },
    }
    let mut child = cmd.spawn().context("failed to start the supervisor")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(st) = child.try_wait()? {
            // Its own one-line reason (the last `lead: ...` line it wrote), with its exit code.
            let said = appended(&log_path, log_start);
            let message = match said.lines().rev().find_map(|l| l.strip_prefix("lead: ")) {
                Some(why) => format!(
                    "the supervisor exited during start-up ({st}): {why} (log: {})",
                    log_path.display()
                ),
                None => format!(
                    "the supervisor exited during start-up ({st}); see {}",
                    log_path.display()
                ),
            };
            let code = st.code().and_then(|c| u8::try_from(c).ok());
            return Err(crate::ExitError {
                code: code.filter(|c| *c != 0).unwrap_or(1),
                message,
            }
            .into());
        }
        let ready = std::fs::read_to_string(team.lead_lock()).is_ok_and(|t| {
            t.split_whitespace().next() == Some(&child.id().to_string()) && t.contains("ready")
        });
        if ready {
            // Its warnings (say, a stale `worker` it will not run) reach the person who
            // started it, not only the log.
            for line in appended(&log_path, log_start).lines() {
                if line.starts_with("lead: ") {
                    eprintln!("{line}");
                }
            }
            return Ok(child);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("the supervisor did not become ready within 30 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What the log at `path` holds past its first `from` bytes, lossily decoded (empty if it
/// cannot be read: the caller only wants a reason to show).
fn appended(path: &std::path::Path, from: u64) -> String {
    let bytes = fsutil::read_from(path, from)
        .ok()
        .flatten()
        .unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restart_delay_doubles_to_the_cap_and_resets_after_a_healthy_run() {
        let (first, max) = (Duration::from_millis(50), Duration::from_millis(500));
        let mut prev = None;
        let mut seen = Vec::new();
        for _ in 0..6 {
            let d = restart_delay(prev, false, first, max);
            seen.push(d.as_millis());
            prev = Some(d);
        }
        assert_eq!(seen, [50, 100, 200, 400, 500, 500]);
        assert_eq!(restart_delay(prev, true, first, max), first);
        // The defaults: 1 s doubling to 60 s.
        let (first, max) = (Duration::from_secs(1), Duration::from_secs(60));
        assert_eq!(
            restart_delay(Some(Duration::from_secs(32)), false, first, max),
            max
        );
        assert_eq!(restart_delay(None, false, first, max), first);
        // A first delay above the cap waits the cap; a zero delay stays zero.
        assert_eq!(restart_delay(None, false, max * 2, max), max);
        let zero = Duration::ZERO;
        assert_eq!(restart_delay(Some(zero), false, zero, max), zero);
    }

    fn facts(code: Option<i32>) -> ExitFacts {
        ExitFacts {
            name: "amy".into(),
            code,
            max_restarts: 5,
            window_secs: 60,
            last_exit: "SIGKILL".into(),
            ..ExitFacts::default()
        }
    }

    #[test]
    fn exits_are_decided_by_who_asked_and_how_it_ended() {
        use ExitDecision::*;
        assert_eq!(decide_exit(&facts(Some(0))), Shutdown(None));
        assert_eq!(decide_exit(&facts(None)), Restart { counted: true });
        assert_eq!(decide_exit(&facts(Some(1))), Restart { counted: true });
        // A transient failure is restarted without counting toward the limit.
        let mut f = facts(Some(75));
        f.recent_restarts = 9;
        assert_eq!(decide_exit(&f), Restart { counted: false });
        // The limit.
        let mut f = facts(None);
        f.recent_restarts = 5;
        assert_eq!(
            decide_exit(&f),
            Failed("5 restarts within 60 s (last exit: SIGKILL); gave up".into())
        );
        match decide_exit(&facts(Some(78))) {
            Failed(why) => {
                assert!(why.contains("configuration error") && why.contains("lead logs amy"))
            }
            other => panic!("{other:?}"),
        }
        // Killed after approving its shutdown: shut down, not restarted.
        let mut f = facts(None);
        f.approved_shutdown = true;
        assert_eq!(decide_exit(&f), Shutdown(None));
        // A team stop pauses; a shutdown of its own during the stop stays a shutdown.
        let mut f = facts(Some(143));
        f.stopping = true;
        assert_eq!(decide_exit(&f), Stopped);
        let mut f = facts(Some(0));
        f.stopping = true;
        f.on_its_own = true;
        assert_eq!(decide_exit(&f), Shutdown(None));
        // An escalated shutdown is a stop the lead asked for, whatever the exit.
        let mut f = facts(None);
        f.stopping = true;
        f.escalated = Some("a1b2c3d4".into());
        match decide_exit(&f) {
            Shutdown(Some(why)) => assert!(why.contains("a1b2c3d4")),
            other => panic!("{other:?}"),
        }
    }

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
