//! Changes of a team dir's shared files, through inotify: `config.json` replaced in the root
//! and `NAME.json` in `members/` (the roster), and `ID.json` replaced in `requests/` or
//! `tasks/`. Nothing else there (events, inboxes, locks) counts.

use std::os::fd::{AsFd, BorrowedFd};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use crate::error::{Error, Result};
use crate::store::Watched;
use crate::teamdir::TeamDir;

/// inotify watches of the roster and of record directories.
pub struct FileWatch {
    inotify: Inotify,
    /// The root (the roster), when watched.
    root: Option<WatchDescriptor>,
    /// Record directories watched.
    dirs: Vec<WatchDescriptor>,
}

impl FileWatch {
    pub fn new(team: &TeamDir, what: &[Watched]) -> Result<FileWatch> {
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)
            .map_err(|e| Error::io("watch", team.root())(e.into()))?;
        // Replaced files land by rename; written ones close.
        let flags =
            AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_CREATE;
        let mut root = None;
        let mut dirs = Vec::new();
        for w in what {
            match w {
                Watched::Roster => {
                    root = inotify.add_watch(team.root(), flags).ok();
                    // The members' records (see `super::roster`).
                    let members = super::roster::members_dir(team);
                    crate::fsutil::create_dir(&members)?;
                    dirs.extend(inotify.add_watch(&members, flags));
                }
                Watched::Requests => dirs.extend(inotify.add_watch(&team.requests_dir(), flags)),
                Watched::Tasks => dirs.extend(inotify.add_watch(&team.tasks_dir(), flags)),
            }
        }
        Ok(FileWatch {
            inotify,
            root,
            dirs,
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inotify.as_fd()
    }

    pub fn changed(&self) -> bool {
        let mut changed = false;
        while let Ok(evs) = self.inotify.read_events() {
            if evs.is_empty() {
                break;
            }
            changed |= evs.iter().any(|e| {
                // Events were lost (the queue overflowed): anything may have changed.
                if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    return true;
                }
                let name = e.name.as_deref().and_then(|n| n.to_str()).unwrap_or("");
                if Some(e.wd) == self.root {
                    name == "config.json"
                } else {
                    self.dirs.contains(&e.wd) && name.ends_with(".json")
                }
            });
        }
        changed
    }
}
