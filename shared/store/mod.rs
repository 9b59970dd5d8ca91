//! The store: where a team keeps what its processes share, behind one seam.
//!
//! A team's shared state lives in one of two backends, chosen when its [`TeamDir`] is opened:
//!
//! - **files** ([`files`]): the team dir itself, as DESIGN.md lays it out (flock-protected
//!   files, one machine);
//! - **Redis** ([`redis`]): a Redis 7 server named by `TROUPE_BUS`, so that supervisors on
//!   several machines (hosts) share one team.
//!
//! What the team shares, and the one way each is reached whatever the backend:
//!
//! | state | seam |
//! | --- | --- |
//! | inboxes (append, drain, wait) | [`crate::inbox::Inbox`], [`crate::wait::InboxWaiter`] |
//! | documents under a lock (the roster, team files' record) | [`doc::Doc`] |
//! | records under a lock (requests, tasks) | [`records::Records`]; a poller's listing, [`Listing`] |
//! | the event log | [`Store::append_event`], [`Store::read_events`], [`Store::read_events_back`] (through [`crate::events`]) |
//! | the change feed | [`Store::watch`] |
//! | named locks | [`Store::lock`] |
//! | leases with an epoch, fencing | [`Store::hold_host`], [`fence`] |
//! | keys with an expiry (heartbeats), outside the change feed | [`beat`] |
//! | soft state and counted leases with a FIFO (the rate governor's limits and call slots) | [`govern`] |
//! | hosts | [`Store::live_hosts`], [`Store::request_stop`], [`Store::check_host`] |
//!
//! Callers get a [`Store`] from [`TeamDir::store`] and never ask which backend it is; only this
//! folder matches on it. What only one host needs (transcripts, logs, lines set aside,
//! worktrees) stays in the local team dir on either backend.

pub mod beat;
pub mod doc;
pub mod events;
pub mod fence;
pub mod files;
pub mod govern;
pub mod inbox;
pub(crate) mod records;
pub mod redis;
pub mod wait;
pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::teamdir::TeamDir;

pub use self::records::Listing;
pub use self::redis::hosts::{
    HOST_LEASE, HostLease, check_host as check_host_name, no_bus as no_hosts,
};

/// Whether the team dirs this process opens keep their state on a bus (`TROUPE_BUS` is set),
/// where a team is spread over hosts.
pub fn spread_over_hosts() -> bool {
    std::env::var_os(redis::BUS_ENV).is_some_and(|v| !v.is_empty())
}

/// Where a team's shared state lives (see the module docs).
#[derive(Clone, Copy)]
pub enum Store<'a> {
    /// The team dir's files.
    Files(&'a TeamDir),
    /// A Redis server shared by the team's hosts.
    Redis(&'a redis::RedisBus),
}

impl TeamDir {
    /// Opens the team dir at `root`, creating its layout (0700 directories) if missing, with
    /// its state where `TROUPE_BUS` says (the files, when it is unset). A `root` that exists
    /// but is not a directory is refused.
    pub fn create(root: impl Into<PathBuf>) -> Result<TeamDir> {
        let dir = TeamDir::at_path(root)?;
        dir.make_layout()?;
        with_env_backend(dir)
    }

    /// Opens an existing team dir without creating anything. Missing subdirectories are not an
    /// error here; the operations that need them create them.
    pub fn open(root: impl Into<PathBuf>) -> Result<TeamDir> {
        let dir = TeamDir::at_path(root)?;
        if !dir.root().exists() {
            return Err(Error::Io {
                op: "open team dir",
                path: dir.root().to_owned(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        }
        with_env_backend(dir)
    }

    /// The same team dir with its state on `bus` (or in its files, with `None`): for callers
    /// that name the bus themselves (tests, the bench).
    pub fn with_bus(mut self, bus: Option<redis::RedisBus>) -> TeamDir {
        self.remote = bus.map(|b| Arc::new(b) as Arc<dyn std::any::Any + Send + Sync>);
        self
    }

    /// Where this team's shared state lives.
    pub fn store(&self) -> Store<'_> {
        match self
            .remote
            .as_deref()
            .and_then(|r| r.downcast_ref::<redis::RedisBus>())
        {
            Some(bus) => Store::Redis(bus),
            None => Store::Files(self),
        }
    }
}

fn with_env_backend(dir: TeamDir) -> Result<TeamDir> {
    match std::env::var(redis::BUS_ENV) {
        Ok(url) if !url.is_empty() => Ok(dir.with_bus(Some(redis::RedisBus::from_url(&url)?))),
        _ => Ok(dir),
    }
}

/// The next pause of a process waiting for a store that does not answer (a server
/// restarting, a network cut), after `last` (zero at the first failure): 100 ms, doubling up
/// to 2 s.
pub fn outage_backoff(last: Duration) -> Duration {
    (last * 2).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

/// Default inbox cap: an inbox this large refuses new messages.
pub const DEFAULT_CAP: u64 = 64 * 1024 * 1024;

/// Where a drain can be cut short; see the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DrainPoint {
    /// The new bytes are read; nothing is journaled yet.
    Read,
    /// The new messages are in the journal (fsynced); the inbox does not say so yet.
    Journaled,
    /// The offset is 0; the file is about to be truncated.
    Reset,
    /// The drain is done: the offset or the truncate says what was consumed.
    Marked,
}

/// Why an inbox waiter ([`crate::wait::InboxWaiter::wait`]) returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The inbox holds data.
    Message,
    /// One of the extra descriptors became readable.
    External,
    /// The timeout passed.
    Timeout,
}

/// What [`Store::read_events_back`] read: the event lines just before a position, oldest
/// first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventsBack {
    pub lines: Vec<Vec<u8>>,
    /// The position a read goes on from to read these lines again, then the rest: also where
    /// to read back from for the lines before them.
    pub from: u64,
    /// The position just past them (the one asked for, or the log's end): a read goes on from
    /// here with what follows.
    pub to: u64,
    /// Whether nothing is before them (the log's start was reached).
    pub at_start: bool,
}

/// A lock taken through [`Store::lock`], released when dropped.
pub enum StoreLock<'a> {
    /// An flock of a sidecar file.
    File(#[allow(dead_code, reason = "held for its drop")] crate::fsutil::HeldLock),
    /// A lock key on the bus.
    Redis(#[allow(dead_code, reason = "held for its drop")] redis::BusLock<'a>),
}

/// What a [`Store::watch`] reports changes of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Watched {
    /// The roster.
    Roster,
    /// The requests.
    Requests,
    /// The tasks.
    Tasks,
}

impl<'a> Store<'a> {
    /// Whether people read and edit this store's documents (the files): they are then written
    /// indented, with a final newline, and a corrupt one is left for them to fix.
    pub fn for_people(&self) -> bool {
        matches!(self, Store::Files(_))
    }

    /// Takes the lock `name`, waiting for its holder: in a team dir the flock of the sidecar
    /// file `file` (its directory made if missing), on a bus the bus's lock `name` for every
    /// host.
    pub fn lock(&self, name: &str, file: &Path) -> Result<StoreLock<'a>> {
        match self {
            Store::Files(_) => {
                if let Some(dir) = file.parent() {
                    crate::fsutil::create_dir(dir)?;
                }
                Ok(StoreLock::File(crate::fsutil::HeldLock::acquire(file)?))
            }
            Store::Redis(bus) => Ok(StoreLock::Redis(bus.lock(name)?)),
        }
    }

    /// Appends one event line (a JSON object; `line` has no newline).
    pub fn append_event(&self, line: &[u8]) -> Result<()> {
        match self {
            Store::Files(team) => files::events::append(team, line),
            Store::Redis(bus) => redis::log_event(bus, line),
        }
    }

    /// The event lines after position `after` (0: from the first) up to position `until`
    /// (`None`: the end), at most `max` of them, and the position to read from next: a byte
    /// offset in `events.jsonl` (a line still being written is left for the next call), or a
    /// position in the bus's event stream. Positions grow with the log: of two, the greater is
    /// the later.
    pub fn read_events(
        &self,
        after: u64,
        until: Option<u64>,
        max: usize,
    ) -> Result<(Vec<Vec<u8>>, u64)> {
        match self {
            Store::Files(team) => files::events::read(team, after, until, max),
            Store::Redis(bus) => redis::read_events(bus, after, until, max),
        }
    }

    /// Up to `n` event lines before position `before` (`None`: the end of the log), read back
    /// from there: the log's end is found without reading the rest of it (`n` 0: only the
    /// end). See [`EventsBack`].
    pub fn read_events_back(&self, before: Option<u64>, n: usize) -> Result<EventsBack> {
        match self {
            Store::Files(team) => files::events::read_back(team, before, n),
            Store::Redis(bus) => redis::read_events_back(bus, before, n),
        }
    }

    /// Refuses a host name where there are no hosts (a team dir) or one that is not usable.
    pub fn check_host(&self, host: &str, given_as: impl FnOnce() -> String) -> Result<()> {
        match self {
            Store::Files(_) => Err(redis::hosts::no_bus(given_as())),
            Store::Redis(_) => redis::hosts::check_host(host),
        }
    }

    /// The host this process runs on, on a team spread over hosts (`None` in a team dir).
    pub fn this_host(&self) -> Option<String> {
        match self {
            Store::Files(_) => None,
            Store::Redis(_) => Some(redis::hosts::this_host()),
        }
    }

    /// The hosts whose supervisor holds its lease now, sorted (`None` in a team dir, which has
    /// no hosts).
    pub fn live_hosts(&self) -> Result<Option<Vec<String>>> {
        match self {
            Store::Files(_) => Ok(None),
            Store::Redis(bus) => redis::hosts::live_hosts(bus).map(Some),
        }
    }

    /// Asks the supervisor of `host` to stop its team (a team dir has no hosts: refused).
    pub fn request_stop(&self, host: &str) -> Result<()> {
        match self {
            Store::Files(_) => Err(redis::hosts::no_bus(format!("--host {host}"))),
            Store::Redis(bus) => redis::hosts::request_stop(bus, host),
        }
    }

    /// Takes the lease of `host` (default: this machine's), waiting up to `patience` for another
    /// holder's to lapse, and fences this process's writes by it; `None` in a team dir (where
    /// `lead.lock` makes the supervisor one), which refuses a host given.
    pub fn hold_host(&self, host: Option<&str>, patience: Duration) -> Result<Option<HostLease>> {
        match (self, host) {
            (Store::Files(_), None) => Ok(None),
            (Store::Files(_), Some(h)) => Err(redis::hosts::no_bus(format!("--host {h}"))),
            (Store::Redis(bus), host) => {
                let host = host.map_or_else(redis::hosts::this_host, str::to_owned);
                HostLease::acquire(bus, &host, patience).map(Some)
            }
        }
    }

    /// What `lead status --json` says of the store: on a bus its URL (no password), team name
    /// and live hosts; `None` for the files.
    pub fn describe(&self) -> Option<serde_json::Value> {
        match self {
            Store::Files(_) => None,
            Store::Redis(bus) => Some(serde_json::json!({
                "url": bus.url(),
                "team": bus.team(),
                "hosts": redis::hosts::live_hosts(bus).ok(),
            })),
        }
    }

    /// A watch of `what`, to wait on with `poll(2)`: inotify on the team dir's files, or a
    /// follower of the bus's change feed.
    pub fn watch(&self, what: &[Watched]) -> Result<watch::Watch> {
        match self {
            Store::Files(team) => Ok(watch::Watch::Files(files::watch::FileWatch::new(
                team, what,
            )?)),
            Store::Redis(bus) => Ok(watch::Watch::Feed(redis::FeedWatch::new((*bus).clone())?)),
        }
    }
}
