//! Reaping workers and deciding, through the restart policy, what becomes of each member whose
//! process ended: restarted after a delay, failed, shut down or stopped.

use super::*;

impl Supervisor {
    /// A member that ended `failed` or `shutdown` hands its in-progress tasks back to
    /// `pending` (each with a `task_updated` event), the lead hears which, and idle claimers
    /// are woken for them. A team stop (`stopped`) keeps them: the next `lead run` resumes it.
    /// A task it completed that still waits for `task_completed` hooks keeps its completion:
    /// passed, it is completed; sent back, the hook thread finds the owner ended (the roster
    /// says so by now) and leaves it pending (see `TaskStore::settle_completion`).
    fn hand_back_tasks(&self, name: &str, status: MemberStatus) {
        let released = match troupe::tasks::TaskStore::new(&self.team).release_owned_by(name) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("could not hand back {name}'s tasks: {e}");
                return;
            }
        };
        if released.is_empty() {
            return;
        }
        let ids: Vec<&str> = released.iter().map(|t| t.id.as_str()).collect();
        let note = Message::new(
            MessageType::StatusUpdate,
            name,
            LEAD,
            format!(
                "{name} ended {status}; its tasks {} are pending again",
                ids.join(", ")
            ),
        );
        if let Err(e) = Inbox::new(&self.team, &AgentName::lead()).append(&note, Durability::Sync) {
            tracing::warn!("could not tell the lead {name}'s tasks were handed back: {e}");
        }
        troupe::tasks::wake_claimers(&self.team, Some(name));
    }

    pub(super) fn reap(&mut self) -> anyhow::Result<()> {
        let mut exited = Vec::new();
        for (name, r) in &mut self.running {
            if let Some(st) = r.child.try_wait()? {
                exited.push((name.clone(), st));
            }
        }
        if exited.is_empty() {
            return Ok(());
        }
        // One read of the roster for all of them: what their workers wrote before exiting
        // (a `shutdown` of their own) is in it by now.
        self.refresh();
        for (name, st) in exited {
            let r = self.running.remove(&name).expect("reaped child is tracked");
            self.handle_exit(&name, r, st);
        }
        // Their exits in one roster write (a team stop reaps many at once).
        self.writer.flush();
        Ok(())
    }

    /// Whether incarnation `r` of `name` approved a shutdown request: it may have died (kill
    /// -9, a panic, a failed write) between recording the approval and exiting 0, and a
    /// restart could never finish that shutdown.
    pub(super) fn approved_shutdown(&self, name: &str, r: &Running) -> bool {
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

    pub(super) fn handle_exit(&mut self, name: &str, r: Running, st: ExitStatus) {
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
        if decision == ExitDecision::Superseded {
            tracing::warn!(
                name,
                "this worker was replaced by a newer incarnation (another host's supervisor \
                 took over); not restarted"
            );
            return;
        }
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
            ExitDecision::Superseded => unreachable!("returned above"),
        };
        let restart = restart_due.is_some();
        let last = info.clone();
        let why = reason.clone();
        let ended_itself = code == Some(0) || facts.approved_shutdown;
        // Written with the other exits of this reap (see `reap`), or at once for an end that
        // hands back tasks: the hook thread reads the roster to see that the owner ended.
        self.writer.member_later(name, None, move |m| {
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
        if matches!(status, MemberStatus::Failed | MemberStatus::Shutdown) {
            self.writer.flush();
            self.hand_back_tasks(name, status);
        }
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
}
