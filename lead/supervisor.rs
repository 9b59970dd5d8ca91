//! `lead run`: the supervisor. It holds `lead.lock` for its life, starts one `worker` per member
//! that should run, reaps them, restarts unexpected exits with backoff and an intensity limit,
//! escalates expired shutdown requests, and stops the team gracefully on SIGTERM/SIGINT.
//!
//! Workers are forked from the main thread, which lives as long as the process, so their
//! `PR_SET_PDEATHSIG` fires only when the lead itself dies. Children are reaped with
//! `Child::try_wait` only (never `waitpid(-1)`), on every wake-up: SIGCHLD, a change in the team
//! dir (inotify), a signal, or the next timer.

use std::collections::{HashMap, VecDeque};
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
use troupe::config::{ExitInfo, MemberStatus, Roster};
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
    /// Set when the lead itself asked it to stop (expiry escalation or team stop).
    stopping: bool,
    kill_at: Option<Instant>,
}

struct Supervisor {
    team: TeamDir,
    roster: Roster,
    requests: RequestStore,
    worker_exe: crate::worker_exe::WorkerExe,
    workdir: PathBuf,
    args: RunArgs,
    running: HashMap<String, Running>,
    recent_restarts: HashMap<String, VecDeque<Instant>>,
    backoff: HashMap<String, (Duration, Instant)>,
    /// The shutdown request the team stop sent each member, by name.
    stop_requests: HashMap<String, String>,
}

pub fn run(team_dir: &std::path::Path, args: RunArgs) -> anyhow::Result<u8> {
    let team = TeamDir::create(team_dir)?;
    let Some(lock) = HeldLock::try_acquire(&team.lead_lock())? else {
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
        requests: RequestStore::new(&team),
        team,
        worker_exe,
        workdir,
        args,
        running: HashMap::new(),
        recent_restarts: HashMap::new(),
        backoff: HashMap::new(),
        stop_requests: HashMap::new(),
    };
    sup.reconcile_at_start()?;
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
    /// Members recorded as running whose process is gone are started again (new incarnation);
    /// a team stopped by `lead stop` resumes.
    fn reconcile_at_start(&mut self) -> anyhow::Result<()> {
        let cfg = self.roster.load()?;
        for m in &cfg.members {
            if m.status == MemberStatus::Stopped {
                self.roster
                    .update_member(&m.name, |mm| mm.status = MemberStatus::Spawning)?;
            }
            if m.status.wants_process() || m.status == MemberStatus::Stopped {
                // An orphan of a dead lead still holding the teammate dies of PDEATHSIG; the new
                // worker waits for its lock.
                events::log(
                    &self.team,
                    "reconcile",
                    json!({"name": m.name, "status": m.status, "pid": m.pid}),
                );
            }
        }
        Ok(())
    }

    /// One line for `STATUS=`: how many members are in each state.
    fn summary(&self) -> String {
        let Ok(cfg) = self.roster.load() else {
            return "config.json unreadable".to_owned();
        };
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
            "{} members: {}",
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
        self.start_wanted()?;
        self.escalate_expired()?;
        self.kill_stragglers();
        Ok(())
    }

    fn next_deadline(&self) -> Option<Duration> {
        let now = Instant::now();
        self.backoff
            .values()
            .map(|(_, at)| *at)
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
            self.handle_exit(&name, r, st)?;
        }
        Ok(())
    }

    fn handle_exit(&mut self, name: &str, r: Running, st: ExitStatus) -> anyhow::Result<()> {
        let info = describe(&st);
        let code = st.code();
        events::log(
            &self.team,
            "exit",
            json!({"name": name, "incarnation": r.incarnation, "code": code, "signal": info.signal, "pid": r.child.id()}),
        );
        let now = Instant::now();
        let window = Duration::from_secs(self.args.restart_window);
        let on_its_own = r.stopping && code == Some(0) && self.shut_down_on_its_own(name)?;
        let (status, reason, restart) = if r.stopping && !on_its_own {
            // The lead asked (team stop or an expired shutdown): whatever the code, it stopped.
            (MemberStatus::Stopped, None, false)
        } else if code == Some(0) {
            (MemberStatus::Shutdown, None, false)
        } else if let Some(c) = code.filter(|c| NO_RESTART.contains(c)) {
            (
                MemberStatus::Failed,
                Some(format!(
                    "worker exited {c} ({}); not restarted, see `lead logs {name}`",
                    if c == 64 {
                        "usage error"
                    } else {
                        "configuration error"
                    }
                )),
                false,
            )
        } else {
            let q = self.recent_restarts.entry(name.to_owned()).or_default();
            while q.front().is_some_and(|t| now.duration_since(*t) > window) {
                q.pop_front();
            }
            if q.len() >= self.args.max_restarts {
                (
                    MemberStatus::Failed,
                    Some(format!(
                        "{} restarts within {} s (last exit: {info}); gave up",
                        q.len(),
                        window.as_secs()
                    )),
                    false,
                )
            } else {
                q.push_back(now);
                (MemberStatus::Spawning, None, true)
            }
        };
        if restart {
            let healthy = now.duration_since(r.started) >= HEALTHY_UPTIME;
            let prev = self.backoff.get(name).map(|(d, _)| *d);
            let delay = restart_delay(
                prev,
                healthy,
                // Both were checked by `parse_secs`.
                Duration::from_secs_f64(self.args.restart_delay),
                Duration::from_secs_f64(self.args.restart_delay_max),
            );
            self.backoff.insert(name.to_owned(), (delay, now + delay));
            events::log(
                &self.team,
                "restart_scheduled",
                json!({"name": name, "in_secs": delay.as_secs_f64(), "last_exit": info}),
            );
        }
        let last = info.clone();
        self.roster.update_member(name, |m| {
            // A worker that approved a shutdown already wrote `shutdown`.
            m.status = status;
            m.pid = None;
            m.last_exit = Some(last);
            if restart {
                m.restarts += 1;
            }
            if reason.is_some() {
                m.reason = reason.clone();
            }
        })?;
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
        Ok(())
    }

    fn start_wanted(&mut self) -> anyhow::Result<()> {
        let cfg = self.roster.load()?;
        let now = Instant::now();
        for m in cfg.members.iter().filter(|m| m.status.wants_process()) {
            if self.running.contains_key(&m.name) {
                continue;
            }
            if let Some((_, at)) = self.backoff.get(&m.name)
                && *at > now
            {
                continue;
            }
            self.start(&m.name)?;
        }
        Ok(())
    }

    fn start(&mut self, name: &str) -> anyhow::Result<()> {
        let agent = AgentName::teammate(name)?;
        let incarnation = self.roster.update_member(name, |m| {
            m.incarnation += 1;
            m.incarnation
        })?;
        fsutil::create_dir(&self.team.logs_dir())?;
        let log = fsutil::open_append(&self.team.log(&agent))?;
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
            .stderr(Stdio::from(log))
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
                self.roster.update_member(name, |m| m.pid = Some(pid))?;
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
                        stopping: false,
                        kill_at: None,
                    },
                );
                // A member that stays up a minute resets its backoff (see handle_exit).
                if let Some((d, _)) = self.backoff.get(name).copied() {
                    self.backoff.insert(
                        name.to_owned(),
                        (d, Instant::now() + Duration::from_secs(3600)),
                    );
                }
            }
            Err(e) => {
                let why = format!("failed to start {}: {e}", self.worker_exe);
                self.roster.update_member(name, |m| {
                    m.status = MemberStatus::Failed;
                    m.reason = Some(why.clone());
                })?;
                events::log(&self.team, "failed", json!({"name": name, "reason": why}));
            }
        }
        Ok(())
    }

    /// Expired shutdown requests: mark them and SIGTERM the worker's group (SIGKILL later).
    fn escalate_expired(&mut self) -> anyhow::Result<()> {
        let now = fsutil::now();
        for req in self.requests.list(Some(RequestStatus::Pending))? {
            if req.kind != RequestKind::Shutdown || !req.is_due(now) {
                continue;
            }
            if self.requests.expire_if_due(&req.request_id)?.is_none() {
                continue;
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
            terminate(r, Duration::from_secs(self.args.kill_grace));
        }
        Ok(())
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
    fn shut_down_on_its_own(&self, name: &str) -> anyhow::Result<bool> {
        let wrote_shutdown = self
            .roster
            .load()?
            .member(name)
            .is_some_and(|m| m.status == MemberStatus::Shutdown);
        let Some(rid) = self.stop_requests.get(name) else {
            return Ok(wrote_shutdown);
        };
        if !wrote_shutdown || self.requests.get(rid)?.status == RequestStatus::Approved {
            return Ok(false);
        }
        self.requests
            .expire_now(rid, "the teammate had already shut down")?;
        Ok(true)
    }

    /// The graceful team stop: ask everyone, wait, SIGTERM, SIGKILL, mark `stopped`.
    fn stop_team(&mut self) -> anyhow::Result<()> {
        events::log(
            &self.team,
            "team_stop",
            json!({"running": self.running.len()}),
        );
        let deadline = Instant::now() + Duration::from_secs(self.args.stop_timeout);
        let cfg = self.roster.load()?;
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
        // Whoever did not approve is stopped; approvals already say `shutdown`.
        self.roster.update(|cfg| {
            for m in cfg.members.iter_mut().filter(|m| m.status.wants_process()) {
                m.status = MemberStatus::Stopped;
                m.pid = None;
            }
            Ok(())
        })?;
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
    while HeldLock::is_held(&lock)? {
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
