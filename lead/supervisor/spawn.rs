//! Starting workers: every member that should run and has none gets one, unless it waits out a
//! restart delay or config.json cannot record its new incarnation.
//!
//! The members due in one pass start together: their incarnations are bumped durably before
//! any of their processes exists (each fences an older process), and their pids recorded once
//! they are forked. In a team dir each of those is a write of the member's own record, so a
//! start costs the same whatever the team's size; on a bus each is one change of the roster.

use super::*;

impl Supervisor {
    /// Starts a worker for every member that should run and has none, unless it waits out a
    /// restart delay. Nothing starts while config.json cannot be read or written: a start must
    /// record the new incarnation first.
    pub(super) fn start_wanted(&mut self) {
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
        let mut due = Vec::new();
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
            due.push(name);
        }
        // A bounded number at once (policy::start_limit); the others start as those report
        // (their records' changes wake this loop) or their grace runs out (a deadline).
        let room = policy::start_room(self.start_limit, self.starting(), due.len());
        due.truncate(room);
        self.start(&due);
    }

    /// This supervisor's workers still in their start (see [`policy::still_starting`]).
    pub(super) fn starting(&self) -> usize {
        self.running
            .iter()
            .filter(|(name, r)| policy::still_starting(r.started.elapsed(), self.reported(name, r)))
            .count()
    }

    /// When the first of the workers still in their start stops counting as starting, if one
    /// is and starts wait for room.
    pub(super) fn start_room_at(&self) -> Option<Instant> {
        if self.starting() < self.start_limit {
            return None;
        }
        self.running
            .iter()
            .filter(|(name, r)| policy::still_starting(r.started.elapsed(), self.reported(name, r)))
            .map(|(_, r)| r.started + policy::START_GRACE)
            .min()
    }

    /// Whether the worker `r` of `name` has reported a state of its own: its member's record
    /// holds its incarnation with an activity other than `starting`.
    fn reported(&self, name: &str, r: &Running) -> bool {
        self.view.member(name).is_some_and(|m| {
            m.incarnation == r.incarnation
                && m.activity
                    .as_ref()
                    .is_some_and(|a| a.state != ActivityState::Starting)
        })
    }

    /// Starts a worker for each of `names` (see the module's doc).
    pub(super) fn start(&mut self, names: &[String]) {
        if names.is_empty() {
            return;
        }
        // A member with a worktree works there: re-added first if its dir was removed.
        let mut ready = Vec::new();
        for name in names {
            match self.worktree_of(name) {
                Ok(w) => ready.push((name.clone(), w)),
                Err(why) => self.start_failed(name, why),
            }
        }
        let bump: Vec<String> = ready.iter().map(|(n, _)| n.clone()).collect();
        let bump_all = |cfg: &mut TeamConfig| {
            let now = fsutil::now();
            let mut out = HashMap::new();
            for name in &bump {
                // Taken off the roster since it was read: nothing to start.
                let Some(m) = cfg.member_mut(name) else {
                    continue;
                };
                m.incarnation += 1;
                m.activity = Some(Activity::now(ActivityState::Starting));
                m.updated_at = Some(now);
                out.insert(name.clone(), m.incarnation);
            }
            out
        };
        // Each member's record alone (on a bus, one change of the whole roster): a pass of
        // many starts costs as many record writes, not a read and write of every member.
        let mut incarnations_of = HashMap::new();
        let bumped = self
            .roster
            .update_members(&bump, &mut |cfg| incarnations_of.extend(bump_all(cfg)))
            .map(|()| incarnations_of);
        let incarnations = match bumped {
            Ok(i) => i,
            Err(e) => {
                // Logged as a config error by the next refresh, or here for anything else.
                tracing::warn!("could not start {}: {e}", bump.join(", "));
                return;
            }
        };
        for (name, (workdir, git_env)) in ready {
            if let Some(&incarnation) = incarnations.get(&name) {
                self.start_one(&name, incarnation, workdir, git_env);
            }
        }
        // The pids, in one write: a kill before it loses nothing (each worker writes its own
        // pid with its first status, and the next supervisor restarts whoever is gone).
        self.writer.flush();
    }

    /// Forks the worker of `name`, whose `incarnation` is recorded already.
    fn start_one(
        &mut self,
        name: &str,
        incarnation: u64,
        workdir: std::path::PathBuf,
        git_env: Vec<(String, String)>,
    ) {
        let agent = match AgentName::teammate(name) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!("{e}");
                return;
            }
        };
        // The new incarnation fences the old one off before it exists (on a bus: a worker of
        // this member that a stalled supervisor elsewhere still runs).
        if let Err(e) = troupe::fence::begin_incarnation(&self.team, name, incarnation) {
            tracing::warn!("could not start {name}: {e}");
            return;
        }
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
            .arg(&workdir)
            // Checked to be UTF-8 when `lead run` started.
            .args(self.args.sandbox.to_args().unwrap_or_default())
            .args(
                self.args
                    .prices
                    .as_deref()
                    .and_then(|p| std::path::absolute(p).ok())
                    .map(|p| vec!["--prices".into(), p.into_os_string()])
                    .unwrap_or_default(),
            )
            .current_dir(&workdir)
            .envs(git_env)
            .env("TROUPE_PARENT_PID", std::process::id().to_string())
            .env_remove("NOTIFY_SOCKET")
            .env_remove("WATCHDOG_USEC")
            .env_remove("WATCHDOG_PID")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .process_group(0);
        // No `pre_exec`: the worker sets its own PR_SET_PDEATHSIG first thing and exits if its
        // parent is no longer TROUPE_PARENT_PID (worker/main.rs). Without one, std starts the
        // child with posix_spawn (a vfork), whose cost does not grow with this process's
        // memory as a fork's page-table copy does: a pass starting hundreds of workers paid
        // for the supervisor's size at each.
        match cmd.spawn() {
            Ok(child) => {
                let pid = child.id();
                self.writer.member_later(name, None, move |m| {
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
                        start_beat: troupe::store::beat::Beat::now(incarnation, 0.0, None),
                        stopping: false,
                        escalated: None,
                        kill_at: None,
                        hung: false,
                    },
                );
            }
            Err(e) => {
                let why = format!("failed to start {}: {e}", self.worker_exe);
                self.start_failed(name, why);
            }
        }
    }

    /// A member that could not be started is `failed`, with `why` as its reason and an event.
    fn start_failed(&mut self, name: &str, why: String) {
        let reason = why.clone();
        self.writer.member(name, None, move |m| {
            m.status = MemberStatus::Failed;
            m.activity = None;
            m.reason = Some(reason.clone());
        });
        events::log(&self.team, "failed", json!({"name": name, "reason": why}));
    }

    /// The working dir of member `name` and the environment its worker adds for git: its
    /// worktree (made again if its dir or store is gone, moved to a store of its own if it is of
    /// the old layout) with the git settings of [`troupe::worktree::git_env`], or the team's
    /// working dir and nothing.
    fn worktree_of(
        &mut self,
        name: &str,
    ) -> Result<(std::path::PathBuf, Vec<(String, String)>), String> {
        let Some(known) = self.view.member(name).and_then(|m| m.worktree.clone()) else {
            return Ok((self.workdir.clone(), Vec::new()));
        };
        let (w, moved) = troupe::worktree::ensure_moving(self.team.root(), name, Some(&known))
            .map_err(|e| format!("its worktree could not be set up: {e}"))?;
        if let Some(moved) = moved {
            tracing::info!(
                "{name}'s worktree moved from {} to its own store {}",
                moved.from.display(),
                w.admin.as_deref().unwrap_or(w.path.as_path()).display()
            );
            events::log(
                &self.team,
                "worktree_migrated",
                json!({"name": name, "from": moved.from, "store": w.admin, "path": w.path}),
            );
            if let Some(said) = moved.fsck_failed {
                tracing::error!(
                    "git fsck of {} failed: the merge queue lands nothing on it until it passes: \
                     {said}",
                    w.repo.display()
                );
                events::log(
                    &self.team,
                    "repository_fsck_failed",
                    json!({"repo": w.repo, "said": said}),
                );
            }
        }
        if w != known {
            // Its store, made now for a record of the old layout (or of none).
            let found = w.clone();
            self.writer.member(name, None, move |m| {
                m.worktree = Some(found.clone());
            });
        }
        // The merge queue's target exists before a member's sandbox is drawn (see
        // `merge::ensure_targets`).
        let target = self
            .args
            .target
            .clone()
            .or_else(|| self.view.target_branch.clone())
            .unwrap_or_else(|| troupe::merge::DEFAULT_TARGET.to_owned());
        if let Err(e) = troupe::merge::git::ensure_target(&w.repo, &target) {
            tracing::warn!("merge queue: target {target} in {}: {e}", w.repo.display());
        }
        if let Err(e) = troupe::worktree::offer_branches(&w) {
            tracing::warn!("{name}'s store: the repository's branches not copied in: {e}");
        }
        let env = troupe::worktree::git_env(&w, name);
        Ok((w.path, env))
    }
}
