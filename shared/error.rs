//! The library's error type.
//!
//! Every variant that touches a file carries the operation and the path, so a message printed at
//! the binary's edge says what failed where without a backtrace. The binaries map variants to the
//! documented exit codes with [`Error::exit_code`].

use std::io;
use std::path::PathBuf;

/// Errors of the team-directory layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A system call on a file failed.
    #[error("failed to {op} {}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A teammate name does not match `^[a-z][a-z0-9_-]{0,31}$` or is reserved.
    #[error("invalid name {name:?}: {why}")]
    InvalidName { name: String, why: &'static str },
    /// A message type outside the protocol's list.
    #[error("unknown message type {0:?} (expected one of: {types})", types = crate::message::MessageType::ALL_NAMES)]
    UnknownMessageType(String),
    /// A serialized message over the per-message limit.
    #[error("message of {size} bytes is over the {limit}-byte limit")]
    MessageTooLarge { size: usize, limit: usize },
    /// The recipient's inbox is at its cap; the message was not written.
    #[error(
        "inbox of {name} is full ({size} bytes, cap {cap}): the recipient is not draining it; message not sent"
    )]
    InboxFull { name: String, size: u64, cap: u64 },
    /// No such teammate in the roster.
    #[error("no such teammate: {0}")]
    UnknownMember(String),
    /// A teammate exists but cannot receive or do what was asked.
    #[error("teammate {name} is {status}: {why}")]
    MemberConflict {
        name: String,
        status: String,
        why: &'static str,
    },
    /// A budget refuses what was asked (a spawn of a member, or of anyone, over budget).
    #[error("{why}; {fix}")]
    OverBudget { why: String, fix: String },
    /// A ceiling of the team refuses a spawn (see [`crate::ceilings`]).
    #[error("{why}; {fix}")]
    Ceiling { why: String, fix: String },
    /// No request with this id.
    #[error("no such request: {0}")]
    UnknownRequest(String),
    /// The request has already left `pending`.
    #[error("request {id} is already {status}")]
    AlreadyResolved { id: String, status: String },
    /// Someone other than the addressee tried to answer a request.
    #[error("request {id} is addressed to {to}; {who} may not answer it")]
    NotAddressee { id: String, to: String, who: String },
    /// No task with this id (or an id that cannot be one).
    #[error("no such task: {0}")]
    UnknownTask(String),
    /// No entry of the merge queue with this id.
    #[error("no such merge queue entry: {0}")]
    UnknownMerge(String),
    /// A change of a merge queue entry its state refuses (cancelling a closed one, retrying an
    /// open one).
    #[error("merge queue entry {id}: {why}")]
    MergeRefused { id: String, why: String },
    /// A task change the board's rules refuse (a claim of a blocked or taken task, an update by
    /// someone other than its owner, a cancel that would strand dependents, a cycle).
    #[error("task {id}: {why}")]
    TaskRefused { id: String, why: String },
    /// No task can be claimed now (none pending, or every pending one blocked or taken).
    #[error("no task is claimable now")]
    NoClaimableTask,
    /// A new task that is malformed (an empty subject, a task blocked by itself).
    #[error("invalid task: {0}")]
    InvalidTask(String),
    /// A file holds something that is not what it should be. The file is left untouched.
    #[error("failed to parse {}: {why}", path.display())]
    Corrupt { path: PathBuf, why: String },
    /// The team bus (Redis) is misconfigured, unreachable or answered with an error. Never
    /// carries the password.
    #[error("bus {what}: {why}")]
    Bus { what: String, why: String },
    /// A write for a member incarnation, a host's supervisor or the lead's inbox consumer that
    /// a newer one has replaced: the server refused it (see [`crate::fence`]).
    #[error(
        "{holder} was replaced (the current epoch is {current}); this process may not write for it any more"
    )]
    Fenced { holder: String, current: String },
    /// A write for a member incarnation, a host's supervisor or the lead's inbox consumer whose
    /// fence key is missing on the server (a server restarted without its data, a key deleted
    /// by hand): refused, since nothing says this process is still the current one, until the
    /// key's owner sets it again (see [`crate::fence`]).
    #[error(
        "{holder}: its fence {key} is missing on the bus (a server that lost its data, or a key deleted by hand); this process may not write for it until it is set again"
    )]
    Unfenced { holder: String, key: String },
    /// The team directory path exists but is not a directory.
    #[error("team dir {} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    /// Another process holds a lock this operation needs exclusively.
    #[error("{what} is held by another process ({})", path.display())]
    Locked { what: &'static str, path: PathBuf },
    /// A journal write failed and could not be undone; the journal refuses every call until it
    /// is reopened.
    #[error(
        "journal {} is unusable after a write that failed and could not be undone; restart to \
         repair it",
        path.display()
    )]
    JournalPoisoned { path: PathBuf },
    /// A protocol rule was broken (for example a teammate creating a shutdown request).
    #[error("{0}")]
    Protocol(String),
    /// `--worktree` asked for where the team's project root is in no git repository.
    #[error(
        "{} is not in a git repository: --worktree needs one (`git init` and commit once, or \
         spawn without --worktree)",
        dir.display()
    )]
    NotARepository { dir: PathBuf },
    /// A `git` command failed.
    #[error("failed to {op} in {}: {stderr}", dir.display())]
    Git {
        op: String,
        dir: PathBuf,
        stderr: String,
    },
    /// A worktree change refused: the member runs, the worktree has uncommitted changes, or
    /// there is no worktree.
    #[error("worktree of {name}: {why}")]
    WorktreeRefused { name: String, why: String },
}

impl Error {
    /// Wraps an io error with the operation and path it came from.
    pub fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }

    /// The CLI exit code of DESIGN.md section 8 for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::InvalidName { .. }
            | Error::UnknownMessageType(_)
            | Error::InvalidTask(_)
            | Error::NotARepository { .. } => 2,
            Error::UnknownMember(_)
            | Error::UnknownRequest(_)
            | Error::UnknownTask(_)
            | Error::UnknownMerge(_) => 3,
            Error::AlreadyResolved { .. }
            | Error::TaskRefused { .. }
            | Error::MergeRefused { .. }
            | Error::NoClaimableTask
            | Error::MemberConflict { .. }
            | Error::OverBudget { .. }
            | Error::Ceiling { .. }
            | Error::Locked { .. }
            | Error::Fenced { .. }
            | Error::Unfenced { .. }
            | Error::NotAddressee { .. }
            | Error::WorktreeRefused { .. } => 4,
            _ => 1,
        }
    }
}

/// Result alias of the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;
