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
    /// `members/`, when the roster is watched.
    members: Option<WatchDescriptor>,
    /// Record directories watched.
    dirs: Vec<WatchDescriptor>,
    /// The members whose records changed since [`FileWatch::take_members`]; `None` when that
    /// is not known (events were lost).
    changed_members: std::cell::RefCell<Option<std::collections::HashSet<String>>>,
}

impl FileWatch {
    pub fn new(team: &TeamDir, what: &[Watched]) -> Result<FileWatch> {
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)
            .map_err(|e| Error::io("watch", team.root())(e.into()))?;
        // Replaced files land by rename; written ones close.
        let flags =
            AddWatchFlags::IN_CLOSE_WRITE | AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_CREATE;
        let mut root = None;
        let mut members = None;
        let mut dirs = Vec::new();
        for w in what {
            match w {
                Watched::Roster => {
                    root = inotify.add_watch(team.root(), flags).ok();
                    // The members' records (see `super::roster`).
                    let members_dir = super::roster::members_dir(team);
                    crate::fsutil::create_dir(&members_dir)?;
                    members = inotify.add_watch(&members_dir, flags).ok();
                }
                Watched::Requests => dirs.extend(inotify.add_watch(&team.requests_dir(), flags)),
                Watched::Tasks => dirs.extend(inotify.add_watch(&team.tasks_dir(), flags)),
            }
        }
        Ok(FileWatch {
            inotify,
            root,
            members,
            dirs,
            changed_members: std::cell::RefCell::new(Some(Default::default())),
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
            for e in &evs {
                // Events were lost (the queue overflowed): anything may have changed.
                if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    *self.changed_members.borrow_mut() = None;
                    changed = true;
                    continue;
                }
                let name = e.name.as_deref().and_then(|n| n.to_str()).unwrap_or("");
                if Some(e.wd) == self.root {
                    changed |= name == "config.json";
                } else if Some(e.wd) == self.members {
                    if let Some(member) = name.strip_suffix(".json")
                        && !member.starts_with('.')
                    {
                        if let Some(set) = self.changed_members.borrow_mut().as_mut() {
                            set.insert(member.to_owned());
                        }
                        changed = true;
                    }
                } else {
                    changed |= self.dirs.contains(&e.wd) && name.ends_with(".json");
                }
            }
        }
        changed
    }

    /// The members whose records changed since the last call, as far as the events read by
    /// [`FileWatch::changed`] tell; `None` when that is not known (events were lost).
    pub fn take_members(&self) -> Option<std::collections::HashSet<String>> {
        self.changed_members.replace(Some(Default::default()))
    }
}
