//! Hooks: the user's own commands, run by the supervisor when something happens on the team.
//!
//! A hook is declared in `config.json` (`hooks`, written by `lead up` from a team file or by
//! hand) for one event: `teammate_idle`, `task_created` or `task_completed`. The supervisor runs
//! it with `sh -c` in the working dir of the member the event is about, with the event as one
//! JSON document on stdin and a timeout, in the sandbox of that member's commands (or, for a
//! task the lead or a person created, a sandbox of the team's working dir with no member): the
//! command is the user's, but what it runs there (`cargo test`, a script in the tree) is what
//! the model wrote. Only a hook marked `sandbox = false` runs outside. What its exit status means is [`outcome`]: 0 goes on, 2 blocks (the event's work is
//! sent back with the hook's stderr), anything else is logged and ignored.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a hook is run for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HookEvent {
    /// A teammate finished an activation and has nothing left to do.
    TeammateIdle,
    /// A task was added to the board.
    TaskCreated,
    /// A task's owner marked it completed (it is held as `completing` until the hooks pass).
    TaskCompleted,
    /// A request has been `pending` longer than `lead run --escalate-after`: a person is
    /// paged. Runs as the supervisor's user whatever `sandbox` says (it pages people; its
    /// command comes from a team file no member can change), and its exit code is only logged.
    RequestPending,
    /// A worktree member's commit, merged onto the target branch in the merge queue's
    /// integration tree, waits to land (see [`crate::merge`]): runs there, in a sandbox whose
    /// only writable dirs are that tree and its kept `CARGO_TARGET_DIR`. Exit 0 lands the merge,
    /// any other exit sends it back with the stderr tail, and a timeout, a signal or a spawn
    /// error stops the queue.
    MergeCheck,
}

impl HookEvent {
    pub fn as_str(self) -> &'static str {
        match self {
            HookEvent::TeammateIdle => "teammate_idle",
            HookEvent::TaskCreated => "task_created",
            HookEvent::TaskCompleted => "task_completed",
            HookEvent::RequestPending => "request_pending",
            HookEvent::MergeCheck => "merge_check",
        }
    }
}

impl fmt::Display for HookEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl std::str::FromStr for HookEvent {
    type Err = String;
    fn from_str(s: &str) -> Result<HookEvent, String> {
        match s {
            "teammate_idle" => Ok(HookEvent::TeammateIdle),
            "task_created" => Ok(HookEvent::TaskCreated),
            "task_completed" => Ok(HookEvent::TaskCompleted),
            "request_pending" => Ok(HookEvent::RequestPending),
            "merge_check" => Ok(HookEvent::MergeCheck),
            _ => Err(format!(
                "unknown hook event {s:?} (expected teammate_idle, task_created, task_completed, \
                 request_pending or merge_check)"
            )),
        }
    }
}

/// The timeout of a hook that names none.
pub const DEFAULT_TIMEOUT_SECS: u64 = 60;

/// One hook, as stored in `config.json`'s `hooks` list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hook {
    pub event: HookEvent,
    /// Run with `sh -c`.
    pub command: String,
    /// Killed (with everything it started) after this many seconds; default 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
    /// Runs in the sandbox of the member the event is about (the default); `false` runs it as
    /// the supervisor's user with nothing hidden, which the team file must say in so many words.
    #[serde(default = "sandboxed", skip_serializing_if = "is_sandboxed")]
    pub sandbox: bool,
}

fn sandboxed() -> bool {
    true
}

fn is_sandboxed(b: &bool) -> bool {
    *b
}

impl Hook {
    pub fn timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.timeout_secs.unwrap_or(DEFAULT_TIMEOUT_SECS))
    }
}

/// What a hook's exit means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0: the event takes effect.
    Proceed,
    /// Exit 2: the work is sent back, with the hook's stderr as the reason.
    Block,
    /// Any other exit, a signal or a timeout: logged, and the event takes effect.
    Ignored,
}

/// The outcome of a hook that exited with `code` (`None`: killed by a signal or timed out).
pub fn outcome(code: Option<i32>) -> Outcome {
    match code {
        Some(0) => Outcome::Proceed,
        Some(2) => Outcome::Block,
        _ => Outcome::Ignored,
    }
}

/// Whether any hook of `hooks` runs on `event`.
pub fn any_for(hooks: &[Hook], event: HookEvent) -> bool {
    hooks.iter().any(|h| h.event == event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_map_to_outcomes() {
        assert_eq!(outcome(Some(0)), Outcome::Proceed);
        assert_eq!(outcome(Some(2)), Outcome::Block);
        assert_eq!(outcome(Some(1)), Outcome::Ignored);
        assert_eq!(outcome(Some(127)), Outcome::Ignored);
        assert_eq!(outcome(None), Outcome::Ignored);
    }

    #[test]
    fn hooks_parse_from_config_json() {
        let h: Hook = serde_json::from_str(
            r#"{"event":"task_completed","command":"make test","timeout_secs":5}"#,
        )
        .unwrap();
        assert_eq!(h.event, HookEvent::TaskCompleted);
        assert_eq!(h.timeout(), std::time::Duration::from_secs(5));
        let d: Hook =
            serde_json::from_str(r#"{"event":"teammate_idle","command":"true"}"#).unwrap();
        assert_eq!(d.timeout(), std::time::Duration::from_secs(60));
        assert!(serde_json::from_str::<Hook>(r#"{"event":"nope","command":"x"}"#).is_err());
        assert!(any_for(&[h], HookEvent::TaskCompleted));
    }
}
