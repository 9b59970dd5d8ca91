//! Hooks: the user's own commands, run by the supervisor when something happens on the team.
//!
//! A hook is declared in `config.json` (`hooks`, written by `lead up` from a team file or by
//! hand) for one event: `teammate_idle`, `task_created` or `task_completed` (the gates),
//! `request_pending` (a page) or `merge_check` (see [`crate::merge`]). The supervisor runs a
//! gate with `sh -c` in the working dir of the member the event is about, with the event as one
//! JSON document on stdin and a timeout, in the sandbox of that member's commands (or, for a
//! task the lead or a person created, a sandbox of the team's working dir with no member): the
//! command is the user's, but what it runs there (`cargo test`, a script in the tree) is what
//! the model wrote. Only a hook marked `sandbox = false` runs outside, and only one that `lead
//! up` applied from a team file ([`runs_outside`], [`trusted`]): a `config.json` as found may
//! have been written by someone other than the person.
//!
//! What a gate's run means is [`outcome`]: exit 0 lets the event take effect; anything else (a
//! non-zero exit such as `cargo test`'s 101, a signal, the timeout, a hook that could not
//! start) sends the event's work back with [`reason`]. A gate that cannot say yes says no.
//!
//! A paging hook runs outside the sandbox (it needs the person's environment and the network),
//! so it must run no file a member can write: see [`paging`].

pub mod paging;

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
    /// paged. Applied by `lead up`, it runs as the supervisor's user whatever `sandbox` says,
    /// from `/` with a PATH of system dirs, and only if it names no file a member can write
    /// (see [`paging`]); found in `config.json` otherwise, in a sandbox of the team's working
    /// dir. Its exit code is only logged.
    RequestPending,
    /// A worktree member's commit, merged onto the target branch in the merge queue's
    /// integration tree, waits to land (see [`crate::merge`]): runs there, in a sandbox whose
    /// only writable dirs are that tree and its kept `CARGO_TARGET_DIR`. Exit 0 lands the merge,
    /// any other exit sends it back with the stderr tail, and a timeout, a signal or a spawn
    /// error stops the queue.
    MergeCheck,
}

impl HookEvent {
    /// Whether the event's work waits for the hook's verdict ([`outcome`]): every event but
    /// `request_pending`, whose hooks only page.
    pub fn gates(self) -> bool {
        self != HookEvent::RequestPending
    }

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
    /// the supervisor's user with nothing hidden, which the team file must say in so many words:
    /// the supervisor honours it only for a hook `lead up` applied ([`trusted`]).
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

/// How a hook's run ended, as far as its verdict goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
    /// It ran past its timeout and was killed, with everything it started.
    TimedOut(std::time::Duration),
    /// It could not be started: no shell, a working dir that is gone, a sandbox that could not
    /// be set up. The text says why.
    NotStarted(String),
}

/// What a gate's run means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Exit 0: the event takes effect.
    Proceed,
    /// Anything else: the work is sent back, with [`reason`].
    Block,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Proceed => "proceed",
            Outcome::Block => "block",
        }
    }
}

/// The verdict of a gate that ended as `exit`: only a clean exit 0 passes. Exit 2 was once the
/// only way to block, and `cargo test --quiet` (101 on a failing suite) or a check that could
/// not start let the work through (review 4, m8 and R4-11); a gate fails closed instead, as
/// `merge_check` does.
pub fn outcome(exit: &Exit) -> Outcome {
    match exit {
        Exit::Code(0) => Outcome::Proceed,
        _ => Outcome::Block,
    }
}

/// What the work is sent back with: the hook's stderr (trimmed), after a sentence saying how it
/// ended when that is not a plain exit with something on stderr.
pub fn reason(exit: &Exit, stderr: &str) -> String {
    let said = stderr.trim();
    let how = match exit {
        Exit::Code(_) if !said.is_empty() => return said.to_owned(),
        Exit::Code(c) => format!("the hook exited with {c} and wrote nothing to stderr"),
        Exit::Signal(s) => format!("the hook was killed by signal {s}"),
        Exit::TimedOut(t) => format!("the hook timed out after {} s", t.as_secs()),
        Exit::NotStarted(why) => format!("the hook could not start: {why}"),
    };
    if said.is_empty() {
        how
    } else {
        format!("{how}; its stderr:\n{said}")
    }
}

/// Whether `hook` runs as the supervisor's user rather than in a sandbox when it is trusted:
/// one marked `sandbox = false`, and every `request_pending` hook (a page needs the person's
/// environment).
pub fn runs_outside(hook: &Hook) -> bool {
    !hook.sandbox || hook.event == HookEvent::RequestPending
}

/// Whether `hook` may run outside the sandbox: `applied` are the hooks `lead up` last wrote to
/// `config.json` from a team file that passed its trust check (recorded in the team dir, out of
/// every command's reach). A hook found only in `config.json` (written by hand, or by anything
/// else that could write that file) runs sandboxed; `lead up` is how a person applies it.
pub fn trusted(hook: &Hook, applied: &[Hook]) -> bool {
    !runs_outside(hook) || applied.contains(hook)
}

/// Whether any hook of `hooks` runs on `event`.
pub fn any_for(hooks: &[Hook], event: HookEvent) -> bool {
    hooks.iter().any(|h| h.event == event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_clean_exit_0_passes_a_gate() {
        assert_eq!(outcome(&Exit::Code(0)), Outcome::Proceed);
        for e in [
            Exit::Code(2),
            Exit::Code(1),
            Exit::Code(101),
            Exit::Code(127),
            Exit::Signal(9),
            Exit::TimedOut(std::time::Duration::from_secs(5)),
            Exit::NotStarted("no such dir".into()),
        ] {
            assert_eq!(outcome(&e), Outcome::Block, "{e:?}");
        }
        assert!(HookEvent::TaskCompleted.gates() && HookEvent::TeammateIdle.gates());
        assert!(!HookEvent::RequestPending.gates());
    }

    #[test]
    fn a_block_says_why() {
        assert_eq!(reason(&Exit::Code(2), " tests fail\n"), "tests fail");
        assert_eq!(
            reason(&Exit::Code(101), ""),
            "the hook exited with 101 and wrote nothing to stderr"
        );
        assert_eq!(
            reason(&Exit::NotStarted("sandbox: errno 2".into()), ""),
            "the hook could not start: sandbox: errno 2"
        );
        assert_eq!(
            reason(
                &Exit::TimedOut(std::time::Duration::from_secs(60)),
                "slow\n"
            ),
            "the hook timed out after 60 s; its stderr:\nslow"
        );
        assert_eq!(
            reason(&Exit::Signal(9), ""),
            "the hook was killed by signal 9"
        );
    }

    #[test]
    fn only_hooks_lead_up_applied_run_outside_the_sandbox() {
        let h = |event, sandbox| Hook {
            event,
            command: "x".into(),
            timeout_secs: None,
            sandbox,
        };
        let gate = h(HookEvent::TaskCompleted, true);
        let outside = h(HookEvent::TaskCompleted, false);
        let page = h(HookEvent::RequestPending, true);
        assert!(!runs_outside(&gate) && runs_outside(&outside) && runs_outside(&page));
        assert!(trusted(&gate, &[]));
        assert!(!trusted(&outside, &[]) && !trusted(&page, &[]));
        assert!(trusted(&outside, std::slice::from_ref(&outside)));
        assert!(trusted(&page, std::slice::from_ref(&page)));
        // The same command with another event or timeout is another hook.
        let longer = Hook {
            timeout_secs: Some(5),
            ..outside.clone()
        };
        assert!(!trusted(&longer, std::slice::from_ref(&outside)));
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
