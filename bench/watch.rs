//! Waiting on a team dir: waking when its top level changes, and counting the times
//! `config.json` is replaced.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

/// Wakes when something in the team dir's top level changes (`config.json` replaced,
/// `events.jsonl` appended), or after a short timeout; sleeps briefly without inotify.
pub struct RootWatch(Option<Inotify>);

impl RootWatch {
    pub fn new(dir: &Path) -> RootWatch {
        let n = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK).ok();
        let n = n.filter(|n| {
            let flags = AddWatchFlags::IN_MODIFY
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_CLOSE_WRITE;
            n.add_watch(dir, flags).is_ok()
        });
        RootWatch(n)
    }

    fn wait(&self) {
        let Some(n) = &self.0 else {
            std::thread::sleep(Duration::from_millis(2));
            return;
        };
        let mut fds = [PollFd::new(n.as_fd(), PollFlags::POLLIN)];
        let _ = poll(&mut fds, PollTimeout::from(50u8));
        while let Ok(evs) = n.read_events() {
            if evs.is_empty() {
                break;
            }
        }
    }

    /// Calls `check` until it returns `Some`, at most every `min_gap` (to keep a poller from
    /// stealing the CPU the workers need), failing after `timeout`.
    pub fn until<T>(
        &self,
        what: &str,
        timeout: Duration,
        min_gap: Duration,
        mut check: impl FnMut() -> anyhow::Result<Option<T>>,
    ) -> anyhow::Result<T> {
        let deadline = Instant::now() + timeout;
        loop {
            let at = Instant::now();
            if let Some(v) = check()? {
                return Ok(v);
            }
            if at >= deadline {
                bail!("timed out after {} s waiting for {what}", timeout.as_secs());
            }
            self.wait();
            if let Some(rest) = min_gap.checked_sub(at.elapsed()) {
                std::thread::sleep(rest);
            }
        }
    }
}

/// Counts the roster's writes from now on: the times `config.json` is replaced (a change of the
/// team, of who is on it, of several members, or the view caught up) and the times a member's
/// record in `members/` is, from the renames of their temporary files (each has a name of its
/// own; inotify merges repeated events about one file).
pub struct RewriteCount {
    inotify: Option<Inotify>,
    root: Option<WatchDescriptor>,
}

/// What [`RewriteCount`] counted.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rewrites {
    /// `config.json` replaced.
    pub config: u64,
    /// Member records replaced.
    pub records: u64,
}

impl Rewrites {
    pub fn total(&self) -> u64 {
        self.config + self.records
    }
}

impl RewriteCount {
    pub fn new(dir: &Path) -> RewriteCount {
        let Ok(n) = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC) else {
            return RewriteCount {
                inotify: None,
                root: None,
            };
        };
        let root = n.add_watch(dir, AddWatchFlags::IN_MOVED_FROM).ok();
        let members = dir.join("members");
        let _ = std::fs::create_dir_all(&members);
        let _ = n.add_watch(&members, AddWatchFlags::IN_MOVED_FROM);
        RewriteCount {
            inotify: root.is_some().then_some(n),
            root,
        }
    }

    /// The replaces so far (`None`: no inotify, or its queue overflowed).
    pub fn count(&self) -> Option<Rewrites> {
        let n = self.inotify.as_ref()?;
        let mut count = Rewrites::default();
        while let Ok(evs) = n.read_events() {
            if evs.is_empty() {
                break;
            }
            for e in evs {
                if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    return None;
                }
                let Some(name) = e.name.as_deref() else {
                    continue;
                };
                let name = name.as_encoded_bytes();
                if Some(e.wd) == self.root {
                    count.config += u64::from(name.starts_with(b".config.json.tmp"));
                } else {
                    count.records += u64::from(
                        name.starts_with(b".") && name.windows(9).any(|w| w == b".json.tmp"),
                    );
                }
            }
        }
        Some(count)
    }
}
