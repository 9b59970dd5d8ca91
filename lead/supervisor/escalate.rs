//! Escalation: a shutdown request that expires unanswered gets the worker's group SIGTERM, and
//! SIGKILL after the grace period.

use super::*;

impl Supervisor {
    /// Expired shutdown requests: mark them and SIGTERM the worker's group (SIGKILL later).
    /// A request file that cannot be read or written is logged and skipped, never fatal.
    pub(super) fn escalate_expired(&mut self) {
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

    pub(super) fn kill_stragglers(&mut self) {
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
}

pub(super) fn terminate(r: &mut Running, grace: Duration) {
    r.stopping = true;
    let _ = killpg(Pid::from_raw(r.child.id() as i32), Signal::SIGTERM);
    r.kill_at.get_or_insert(Instant::now() + grace);
}
