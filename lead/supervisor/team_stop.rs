//! Stopping the team: the graceful stop on SIGTERM/SIGINT (ask everyone, wait, SIGTERM, SIGKILL,
//! record `stopped`), and `lead stop`, which asks a supervisor for it from another shell.

use super::*;
use troupe::eprintln;

impl Supervisor {
    /// Whether a member that exited 0 during a team stop had shut down for a request of the
    /// lead's rather than the team stop's (a race: it approved just before the stop began).
    /// Such a member stays `shutdown`, not `stopped` (a later `lead run` must not resume it),
    /// and the team stop's request to it, unanswered, is expired. Reads the view, which `reap`
    /// refreshed after the exit.
    pub(super) fn shut_down_on_its_own(&mut self, name: &str) -> bool {
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

    /// After the host's lease was lost: SIGKILL every worker's group and reap them, writing
    /// nothing (the members are the successor's now; their records, requests and tasks too).
    pub(super) fn abandon_team(&mut self) {
        for (name, r) in &self.running {
            tracing::warn!(
                name,
                pid = r.child.id(),
                "killing a worker the successor replaced"
            );
            let _ = killpg(Pid::from_raw(r.child.id() as i32), Signal::SIGKILL);
        }
        for (_, mut r) in self.running.drain() {
            let _ = r.child.wait();
        }
    }

    /// The graceful team stop: ask everyone, wait, SIGTERM, SIGKILL, mark `stopped`.
    pub(super) fn stop_team(&mut self) -> anyhow::Result<()> {
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
            let m = cfg.member(name);
            if m.is_some_and(|m| m.status == MemberStatus::Shutdown) {
                continue;
            }
            r.stopping = true;
            // From the view just read: one read of the roster for the whole team.
            let asked = match m {
                Some(m) => ops::request_shutdown_of(
                    &self.team,
                    m,
                    "the team is stopping",
                    Duration::from_secs(self.args.stop_timeout),
                ),
                None => ops::request_shutdown(
                    &self.team,
                    name,
                    "the team is stopping",
                    Duration::from_secs(self.args.stop_timeout),
                ),
            };
            match asked {
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
        // On a bus, only this host's members: the others run on.
        let host = self.host.clone();
        let written = self.writer.apply(move |cfg| {
            for m in cfg
                .members
                .iter_mut()
                .filter(|m| m.status.wants_process() && (host.is_none() || m.host == host))
            {
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

#[derive(Debug, clap::Args)]
pub struct StopArgs {
    /// Seconds to wait for the supervisor to stop the team and exit.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// On a team spread over machines (a bus): stop only this host's supervisor (default:
    /// every host's).
    #[arg(long)]
    host: Option<String>,
}

/// `lead stop`: SIGTERM to the supervisor (the graceful team stop), and wait until it is gone.
/// On a bus: a stop for each host's supervisor (or `--host`'s), and a wait until every one of
/// them has let its lease go.
pub fn stop(team: &TeamDir, a: StopArgs) -> anyhow::Result<u8> {
    if let Some(live) = team.store().live_hosts()? {
        return stop_hosts(team, live, a);
    }
    if let Some(h) = &a.host {
        team.store().check_host(h, || format!("--host {h}"))?;
    }
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

/// `lead stop` on a team spread over hosts (`live`: those running now).
fn stop_hosts(team: &TeamDir, live: Vec<String>, a: StopArgs) -> anyhow::Result<u8> {
    let store = team.store();
    let targets: Vec<String> = match &a.host {
        Some(h) => {
            store.check_host(h, || format!("--host {h}"))?;
            if !live.contains(h) {
                return Err(troupe::Error::MemberConflict {
                    name: format!("lead --host {h}"),
                    status: "not running".into(),
                    why: "no supervisor holds this host's lease",
                }
                .into());
            }
            vec![h.clone()]
        }
        None if live.is_empty() => {
            return Err(troupe::Error::MemberConflict {
                name: "lead".into(),
                status: "not running".into(),
                why: "no supervisor holds a host's lease on this bus",
            }
            .into());
        }
        None => live,
    };
    for h in &targets {
        store.request_stop(h)?;
    }
    let deadline = Instant::now() + Duration::from_secs(a.timeout);
    loop {
        let left: Vec<String> = store
            .live_hosts()?
            .unwrap_or_default()
            .into_iter()
            .filter(|h| targets.contains(h))
            .collect();
        if left.is_empty() {
            return Ok(0);
        }
        if Instant::now() >= deadline {
            eprintln!(
                "lead: the supervisors of {} are still running after {} s",
                left.join(", "),
                a.timeout
            );
            return Ok(124);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
