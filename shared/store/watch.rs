//! Waiting for changes of the team's shared state (the roster, the requests, the tasks),
//! whatever the backend: a [`Watch`] has a descriptor to `poll(2)` beside the caller's own, and
//! says whether what it watches changed since it was last asked.

use std::os::fd::BorrowedFd;

/// A watch made by [`super::Store::watch`].
pub enum Watch {
    /// inotify on the team dir.
    Files(super::files::watch::FileWatch),
    /// A follower of the bus's change feed.
    Feed(super::redis::FeedWatch),
}

impl Watch {
    /// The descriptor that becomes readable on a change.
    pub fn fd(&self) -> BorrowedFd<'_> {
        match self {
            Watch::Files(w) => w.fd(),
            Watch::Feed(w) => w.fd(),
        }
    }

    /// Whether something watched changed since the last call (reads what is pending, without
    /// blocking).
    pub fn changed(&self) -> bool {
        match self {
            Watch::Files(w) => w.changed(),
            Watch::Feed(w) => w.changed(),
        }
    }

    /// The members whose records changed since the last call, as far as [`Watch::changed`]
    /// read; `None` when that is not known (on a bus, where the roster is one document).
    pub fn take_members(&self) -> Option<std::collections::HashSet<String>> {
        match self {
            Watch::Files(w) => w.take_members(),
            Watch::Feed(_) => None,
        }
    }
}
