//! What a member is doing, as `lead status` shows it: derived from the member's record (its
//! status and the [`Activity`](crate::config::Activity) its process and the supervisor write), whether its recorded
//! process is alive, and the clock. The six statuses stay as DESIGN.md has them (scripts parse
//! them); this adds the detail: working on which call since when, waiting for the API until
//! when and why, restarting in how many seconds, or dead.

use serde::Serialize;

use crate::config::{ActivityState, Member, MemberStatus};

/// A member's liveness, as `lead status --json` prints it under `doing`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Doing {
    /// `starting`, `working`, `waiting_api`, `waiting_slot`, `paused`, `idle`, `restarting`, `spawning` (no
    /// process yet: waiting for a supervisor), `dead` (recorded running, process gone), or the
    /// status itself for members that are down (`shutdown`, `failed`, `stopped`).
    pub state: &'static str,
    pub pid: Option<u32>,
    /// When the state began.
    pub since: Option<f64>,
    /// The model call under way or waited for.
    pub call: Option<u64>,
    /// `waiting_api`: the next try; `restarting`: the restart.
    pub until: Option<f64>,
    /// `waiting_api`, `paused`: the last error.
    pub error: Option<String>,
    /// The last sign of life of the member's process: its last record write or journal entry.
    pub last_seen: Option<f64>,
}

/// What `m` is doing. `alive` says whether its recorded pid is a live process;
/// `journal_at` is when its transcript was last written.
pub fn doing(m: &Member, alive: bool, journal_at: Option<f64>) -> Doing {
    let act = m.activity.as_ref();
    let last_seen = match (m.last_seen, journal_at) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let mut d = Doing {
        state: m.status.as_str(),
        pid: m.pid,
        since: act.map(|a| a.since),
        call: act.and_then(|a| a.call),
        until: act.and_then(|a| a.until),
        error: act.and_then(|a| a.error.clone()),
        last_seen,
    };
    match m.status {
        MemberStatus::Shutdown | MemberStatus::Failed | MemberStatus::Stopped => {
            d.since = m.updated_at;
            d.call = None;
            d.until = None;
            d.error = None;
        }
        MemberStatus::Spawning => {
            d.state = match act.map(|a| a.state) {
                Some(ActivityState::Restarting) => "restarting",
                Some(ActivityState::Starting) if m.pid.is_some() && alive => "starting",
                _ if m.pid.is_some() && !alive => "dead",
                _ => "spawning",
            };
        }
        MemberStatus::Working | MemberStatus::Idle => {
            d.state = if m.pid.is_none() || !alive {
                "dead"
            } else {
                match act.map(|a| a.state) {
                    Some(s) => s.as_str(),
                    None => m.status.as_str(),
                }
            };
        }
    }
    d
}

/// `d` as a few words for the status table, times relative to `now`.
pub fn describe(d: &Doing, now: f64) -> String {
    let ago = |t: Option<f64>| t.map(|t| format!("{:.0}s", (now - t).max(0.0)));
    let within = |t: Option<f64>| t.map(|t| format!("{:.0}s", (t - now).max(0.0)));
    match d.state {
        "working" => match (d.call, ago(d.since)) {
            (Some(c), Some(a)) => format!("call {c}, {a}"),
            (_, Some(a)) => format!("working {a}"),
            _ => "working".into(),
        },
        "waiting_slot" => match (d.call, ago(d.since)) {
            (Some(c), Some(a)) => format!("call {c} waits for a call slot, {a}"),
            (_, Some(a)) => format!("waits for a call slot, {a}"),
            _ => "waits for a call slot".into(),
        },
        "waiting_api" => format!(
            "API down, retry in {}: {}",
            within(d.until).unwrap_or_else(|| "?".into()),
            d.error.as_deref().unwrap_or("")
        ),
        "paused" => format!(
            "paused until a message: {}",
            d.error.as_deref().unwrap_or("")
        ),
        "restarting" => format!(
            "restart in {}",
            within(d.until).unwrap_or_else(|| "?".into())
        ),
        "dead" => format!(
            "dead (pid {}), last seen {} ago",
            d.pid.map_or("-".into(), |p| p.to_string()),
            ago(d.last_seen).unwrap_or_else(|| "?".into())
        ),
        "idle" => ago(d.since).map_or("idle".into(), |a| format!("idle {a}")),
        // Down: STATUS and the reason say it all.
        "shutdown" | "failed" | "stopped" => "-".into(),
        other => other.to_owned(),
    }
}

/// Whether a supervisor runs the team: one holds `lead.lock` of this team dir, or, on a bus,
/// any host's supervisor holds its lease.
pub fn supervisor_running(team: &crate::TeamDir) -> crate::Result<bool> {
    if crate::fsutil::HeldLock::is_held(&team.lead_lock())? {
        return Ok(true);
    }
    Ok(team
        .store()
        .live_hosts()?
        .is_some_and(|hosts| !hosts.is_empty()))
}

/// The pid `lead.lock` names (its supervisor writes it there), if it names one.
pub fn lead_lock_pid(team: &crate::TeamDir) -> Option<u32> {
    std::fs::read_to_string(team.lead_lock())
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Whether `lead.lock` names a live supervisor, read without touching the lock (which a
/// starting supervisor must find free) and in constant time, whatever the number of locks on
/// the machine.
pub fn supervisor_named(team: &crate::TeamDir) -> bool {
    lead_lock_pid(team).is_some_and(pid_alive)
}

/// Whether the supervisor `pid` says in `lead.lock` that it is ready: it holds the lock and has
/// started every member that should run (it writes `PID ready` then; `PID` alone before).
pub fn supervisor_ready(team: &crate::TeamDir, pid: u32) -> bool {
    std::fs::read_to_string(team.lead_lock()).is_ok_and(|t| {
        let mut words = t.split_whitespace();
        words.next() == Some(pid.to_string().as_str()) && words.any(|w| w == "ready")
    })
}

/// Whether `pid` is a live process: it exists and is neither a zombie waiting for its reaper
/// nor dead.
pub fn pid_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        // The state follows the parenthesized command name, which may itself hold spaces.
        s.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|st| st != "Z" && st != "X")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Activity;

    fn member(status: MemberStatus, pid: Option<u32>, act: Option<Activity>) -> Member {
        let mut m = Member::new("a", "r");
        m.status = status;
        m.pid = pid;
        m.activity = act;
        m
    }

    fn act(state: ActivityState, since: f64) -> Activity {
        Activity {
            state,
            since,
            call: None,
            until: None,
            error: None,
        }
    }

    #[test]
    fn each_state_reads_as_it_should() {
        let now = 1000.0;
        let waiting = Activity {
            call: Some(4),
            until: Some(1008.0),
            error: Some("http 503".into()),
            ..act(ActivityState::WaitingApi, 990.0)
        };
        let m = member(MemberStatus::Working, Some(7), Some(waiting));
        let d = doing(&m, true, Some(995.0));
        assert_eq!(d.state, "waiting_api");
        assert_eq!(
            (d.call, d.until, d.last_seen),
            (Some(4), Some(1008.0), Some(995.0))
        );
        assert_eq!(describe(&d, now), "API down, retry in 8s: http 503");
        // The same record with the process gone is dead.
        let d = doing(&m, false, Some(995.0));
        assert_eq!(d.state, "dead");
        assert_eq!(describe(&d, now), "dead (pid 7), last seen 5s ago");
        let restarting = Activity {
            until: Some(1003.0),
            ..act(ActivityState::Restarting, 999.0)
        };
        let d = doing(
            &member(MemberStatus::Spawning, None, Some(restarting)),
            false,
            None,
        );
        assert_eq!(
            (d.state, describe(&d, now).as_str()),
            ("restarting", "restart in 3s")
        );
        let d = doing(&member(MemberStatus::Spawning, None, None), false, None);
        assert_eq!(d.state, "spawning");
        let working = Activity {
            call: Some(2),
            ..act(ActivityState::Working, 988.0)
        };
        let d = doing(
            &member(MemberStatus::Working, Some(7), Some(working)),
            true,
            None,
        );
        assert_eq!(describe(&d, now), "call 2, 12s");
        let d = doing(&member(MemberStatus::Failed, None, None), false, None);
        assert_eq!(d.state, "failed");
        assert_eq!(describe(&d, now), "-");
        // A record written before activities existed still reads.
        let d = doing(&member(MemberStatus::Idle, Some(7), None), true, None);
        assert_eq!(d.state, "idle");
    }
}
