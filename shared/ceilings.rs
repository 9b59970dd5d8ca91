//! Ceilings on how far a team grows: `max_members` (members that are not `shutdown` or
//! `failed`) and `max_spawns_per_minute` (spawns that start a process, by the LLM lead, `lead
//! spawn` or `lead up`; the supervisor's restarts are not spawns). Both live in config.json's
//! team fields (`lead run --max-members N --max-spawns-per-minute N`, or the team file), and a
//! spawn is checked against them under the roster's exclusive lock, so two spawns at once
//! cannot both take the last place. Pure functions over the roster; [`crate::ops::spawn`]
//! applies them.

use crate::config::{MemberStatus, TeamConfig};

/// The window `max_spawns_per_minute` counts over, in seconds.
pub const SPAWN_WINDOW_SECS: f64 = 60.0;

/// Why a spawn is refused, and what lifts the ceiling.
#[derive(Debug, Clone, PartialEq)]
pub struct Refused {
    pub why: String,
    pub fix: String,
}

/// Whether a ceiling is set (a spawn then reads and writes the whole roster).
pub fn any(cfg: &TeamConfig) -> bool {
    cfg.max_members.is_some() || cfg.max_spawns_per_minute.is_some()
}

/// Whether a member of this status counts toward `max_members`.
fn counts(status: MemberStatus) -> bool {
    !matches!(status, MemberStatus::Shutdown | MemberStatus::Failed)
}

/// What a spawn of `name` does: whether it adds a member to the count, and whether it starts
/// a process (an idle member only gets a task; a working or spawning one is refused anyway).
fn effect(cfg: &TeamConfig, name: &str) -> (bool, bool) {
    match cfg.member(name).map(|m| m.status) {
        None => (true, true),
        Some(MemberStatus::Idle | MemberStatus::Working | MemberStatus::Spawning) => (false, false),
        Some(s) => (!counts(s), true),
    }
}

/// The members counted toward `max_members`.
pub fn members_counted(cfg: &TeamConfig) -> usize {
    cfg.members.iter().filter(|m| counts(m.status)).count()
}

/// The spawns noted within the window before `now`.
pub fn spawns_in_window(cfg: &TeamConfig, now: f64) -> usize {
    cfg.spawn_times
        .iter()
        .filter(|&&t| now - t < SPAWN_WINDOW_SECS)
        .count()
}

/// Why a spawn of `name` at `now` would pass a ceiling; `None` when it may go ahead.
pub fn refusal(cfg: &TeamConfig, name: &str, now: f64) -> Option<Refused> {
    let (adds, starts) = effect(cfg, name);
    if let Some(max) = cfg.max_members
        && adds
    {
        let n = members_counted(cfg);
        if n >= max as usize {
            return Some(Refused {
                why: format!(
                    "{name} was not spawned: the team has {n} members (not shut down or \
                     failed), and max_members is {max}"
                ),
                fix: "shut one down first, or raise the ceiling (`lead run --max-members N`, \
                      max_members in the team file)"
                    .into(),
            });
        }
    }
    if let Some(max) = cfg.max_spawns_per_minute
        && starts
    {
        let n = spawns_in_window(cfg, now);
        if n >= max as usize {
            let oldest = cfg
                .spawn_times
                .iter()
                .copied()
                .filter(|&t| now - t < SPAWN_WINDOW_SECS)
                .fold(f64::INFINITY, f64::min);
            let wait = (oldest + SPAWN_WINDOW_SECS - now).max(0.0).ceil();
            return Some(Refused {
                why: format!(
                    "{name} was not spawned: {n} spawns in the last minute, and \
                     max_spawns_per_minute is {max}"
                ),
                fix: format!(
                    "try again in {wait} s, or raise the ceiling (`lead run \
                     --max-spawns-per-minute N`, max_spawns_per_minute in the team file)"
                ),
            });
        }
    }
    None
}

/// Notes a spawn of `name` at `now` that [`refusal`] let through, when it starts a process
/// and spawns are counted; spawns older than the window are dropped. Call before the spawn
/// changes the member.
pub fn note_spawn(cfg: &mut TeamConfig, name: &str, now: f64) {
    let (_, starts) = effect(cfg, name);
    cfg.spawn_times.retain(|&t| now - t < SPAWN_WINDOW_SECS);
    if starts && cfg.max_spawns_per_minute.is_some() {
        cfg.spawn_times.push(now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Member;

    fn team(statuses: &[(&str, MemberStatus)]) -> TeamConfig {
        let mut cfg = TeamConfig::default();
        for (name, s) in statuses {
            let mut m = Member::new(name, "r");
            m.status = *s;
            cfg.members.push(m);
        }
        cfg
    }

    #[test]
    fn max_members_counts_everyone_but_the_shut_down_and_the_failed() {
        let mut cfg = team(&[
            ("a", MemberStatus::Idle),
            ("b", MemberStatus::Stopped),
            ("c", MemberStatus::Shutdown),
            ("d", MemberStatus::Failed),
        ]);
        cfg.max_members = Some(2);
        let r = refusal(&cfg, "new", 0.0).expect("a third member is refused");
        assert!(r.why.contains("max_members is 2"), "{}", r.why);
        assert!(r.fix.contains("--max-members"), "{}", r.fix);
        // Bringing back a shut-down or failed one adds one too.
        assert!(refusal(&cfg, "c", 0.0).is_some());
        assert!(refusal(&cfg, "d", 0.0).is_some());
        // A stopped one is counted already; an idle one only gets a task.
        assert_eq!(refusal(&cfg, "b", 0.0), None);
        assert_eq!(refusal(&cfg, "a", 0.0), None);
        cfg.max_members = Some(3);
        assert_eq!(refusal(&cfg, "new", 0.0), None);
    }

    #[test]
    fn spawns_per_minute_count_the_last_minute_of_starts_only() {
        let mut cfg = team(&[("idle", MemberStatus::Idle)]);
        cfg.max_spawns_per_minute = Some(2);
        note_spawn(&mut cfg, "a", 100.0);
        // An idle member's new task starts nothing and is not counted.
        note_spawn(&mut cfg, "idle", 101.0);
        assert_eq!(refusal(&cfg, "b", 110.0), None);
        note_spawn(&mut cfg, "b", 110.0);
        let r = refusal(&cfg, "c", 120.0).expect("a third spawn within the minute");
        assert!(r.why.contains("2 spawns in the last minute"), "{}", r.why);
        assert!(r.fix.contains("try again in 40 s"), "{}", r.fix);
        assert_eq!(refusal(&cfg, "idle", 120.0), None);
        // A minute after the first, there is room again, and old times are dropped.
        assert_eq!(refusal(&cfg, "c", 160.0), None);
        note_spawn(&mut cfg, "c", 160.0);
        assert_eq!(cfg.spawn_times, vec![110.0, 160.0]);
    }

    #[test]
    fn without_ceilings_nothing_is_refused_or_noted() {
        let mut cfg = team(&[("a", MemberStatus::Idle)]);
        for i in 0..100 {
            let name = format!("m{i}");
            assert_eq!(refusal(&cfg, &name, 0.0), None);
            note_spawn(&mut cfg, &name, 0.0);
        }
        assert!(cfg.spawn_times.is_empty());
        assert!(!any(&cfg));
    }
}
