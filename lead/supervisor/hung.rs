//! The watchdog: a worker whose heartbeat (see `troupe::store::beat`) is older than
//! `--watchdog` seconds past its step's allowance is hung (stopped, deadlocked, spinning
//! outside its main loop): it gets an event `hung` and SIGKILL, and its exit goes through the
//! usual restart accounting.

use super::*;
use troupe::store::beat;

/// How often the heartbeats are read.
const EVERY: Duration = Duration::from_secs(1);

impl Supervisor {
    /// Reads the running workers' beats when due, and kills the hung ones.
    pub(super) fn watch_beats(&mut self) {
        let watchdog = self.args.watchdog;
        if watchdog == 0 || self.running.is_empty() {
            self.beats_due = None;
            return;
        }
        let now = Instant::now();
        match self.beats_due {
            Some(at) if at > now => return,
            _ => self.beats_due = Some(now + EVERY),
        }
        // Ages on the boot clock: a step of the wall clock kills nobody (review 4, m2).
        let clocks = troupe::clock::Now::read();
        let store = self.team.store();
        for (name, r) in &mut self.running {
            if r.stopping || r.hung {
                continue;
            }
            // Until its first beat, the worker's start is its last sign of life.
            let started = r.start_beat.clone();
            let last = match beat::last(store, name) {
                Ok(Some(b))
                    if b.epoch == r.incarnation && b.age(&clocks) <= started.age(&clocks) =>
                {
                    b
                }
                Ok(_) => started,
                Err(e) => {
                    tracing::debug!("could not read {name}'s heartbeat: {e}");
                    continue;
                }
            };
            if !last.overdue(&clocks, watchdog as f64) {
                continue;
            }
            let pid = r.child.id();
            events::log(
                &self.team,
                "hung",
                json!({
                    "name": name,
                    "pid": pid,
                    "incarnation": r.incarnation,
                    "silent_secs": last.age(&clocks).max(0.0),
                    "allowance_secs": last.allowance,
                    "watchdog_secs": watchdog,
                }),
            );
            tracing::warn!(
                "{name} (pid {pid}) has shown no progress for {:.0} s: killed, to be restarted",
                last.age(&clocks)
            );
            r.hung = true;
            // SIGKILL: a stopped or deadlocked process would sit on a SIGTERM.
            let _ = killpg(Pid::from_raw(pid as i32), Signal::SIGKILL);
        }
    }
}
