//! The restart policy of `lead run`, as pure functions: which exits are restarted, after how
//! long, when a member is given up on, and what a stop the lead asked for records.

use super::*;

/// Exit codes after which a worker is never restarted.
pub(super) const NO_RESTART: [i32; 3] = [0, 64, 78];

/// The exit code of a transient failure: restarted with backoff, but not counted toward the
/// restart limit (a worker waits out a model API outage itself; whatever still exits 75 is
/// worth trying again, not giving up on).
pub(super) const EX_TEMPFAIL: i32 = 75;

/// The longest a worker counts as starting (see [`still_starting`]): one that has not reported
/// by then (stopped, or stuck in its start) no longer holds back the next starts.
pub(super) const START_GRACE: Duration = Duration::from_secs(2);

/// At most this many workers of one supervisor are in their start at once: per CPU, four (a
/// start waits on the disk as much as it computes). Hundreds of members made due in one pass
/// (`lead spawn` in a loop, a restart of the whole team) otherwise all exec, load, set up their
/// sandboxes and write their first records at the same moment, and the CPU they take from one
/// another and from the `lead spawn` calls still coming made a start cost more the larger the
/// team (issue 24).
pub(super) fn start_limit(cpus: usize) -> usize {
    cpus.max(1) * 4
}

/// Whether a worker started `elapsed` ago still counts as starting: it has not reported its
/// first state (`reported`: its member's activity, for its own incarnation, is no longer
/// `starting`) and its grace has not run out.
pub(super) fn still_starting(elapsed: Duration, reported: bool) -> bool {
    !reported && elapsed < START_GRACE
}

/// How many of `due` members may start now, with `starting` of this supervisor's workers still
/// in their start and at most `limit` at once.
pub(super) fn start_room(limit: usize, starting: usize, due: usize) -> usize {
    due.min(limit.saturating_sub(starting))
}

/// What is known about a worker's exit when the supervisor decides what comes next.
#[derive(Debug, Clone, Default)]
pub(super) struct ExitFacts {
    pub(super) name: String,
    pub(super) code: Option<i32>,
    /// The lead asked it to stop (a team stop, or an escalated shutdown).
    pub(super) stopping: bool,
    /// The shutdown request that went unanswered and was escalated, if that is why it stopped.
    pub(super) escalated: Option<String>,
    /// During a team stop: it had shut down for a request of its own, not the team stop's.
    pub(super) on_its_own: bool,
    /// This incarnation approved a shutdown request (it may have died before exiting 0).
    pub(super) approved_shutdown: bool,
    /// Counted restarts within the restart window before this exit.
    pub(super) recent_restarts: usize,
    pub(super) max_restarts: usize,
    pub(super) window_secs: u64,
    /// How it ended, for reasons.
    pub(super) last_exit: String,
}

/// What becomes of a member whose worker exited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ExitDecision {
    /// Paused by a team stop: the next `lead run` resumes it.
    Stopped,
    /// Ended for good, as the lead wanted (an approved or an escalated shutdown).
    Shutdown(Option<String>),
    /// Given up on, with the reason.
    Failed(String),
    /// Started again after a delay; `counted` toward the restart limit.
    Restart { counted: bool },
    /// A newer incarnation of the member runs elsewhere (it exited
    /// [`troupe::fence::EXIT_SUPERSEDED`]): neither restarted nor recorded, since the member's
    /// record is the newer one's.
    Superseded,
}

/// The restart policy, as a pure function of the facts of one exit.
pub(super) fn decide_exit(f: &ExitFacts) -> ExitDecision {
    if f.code == Some(i32::from(troupe::fence::EXIT_SUPERSEDED)) {
        return ExitDecision::Superseded;
    }
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
pub(super) const HEALTHY_UPTIME: Duration = Duration::from_secs(60);

/// The wait before a restart: `first` after a healthy run (or the first exit), else twice the
/// previous wait; never more than `max` (so a `first` above `max` waits `max`).
pub(super) fn restart_delay(
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_wait_for_room_among_the_starting_and_the_stuck_free_theirs() {
        assert_eq!(start_limit(2), 8);
        assert_eq!(start_limit(0), 4);
        assert_eq!(start_room(8, 0, 300), 8);
        assert_eq!(start_room(8, 5, 300), 3);
        assert_eq!(start_room(8, 8, 300), 0);
        assert_eq!(start_room(8, 12, 1), 0);
        assert_eq!(start_room(8, 2, 1), 1);
        assert!(still_starting(Duration::from_millis(10), false));
        assert!(!still_starting(Duration::from_millis(10), true));
        assert!(!still_starting(START_GRACE, false));
    }

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
        // Replaced by a newer incarnation elsewhere: nothing to restart or record, even in a
        // team stop or after an escalation.
        let mut f = facts(Some(79));
        f.stopping = true;
        f.escalated = Some("a1b2c3d4".into());
        assert_eq!(decide_exit(&f), Superseded);
    }
}
