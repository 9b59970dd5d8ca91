//! Waiting on a team dir: waking when its top level changes, and counting the times
//! `config.json` is replaced.

use std::os::fd::AsFd;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::bail;
use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

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

/// Counts the times `config.json` is replaced, from now on: the renames of its temporary files
/// (each has a name of its own; inotify merges repeated events about the one `config.json`).
pub struct RewriteCount(Option<Inotify>);

impl RewriteCount {
    pub fn new(dir: &Path) -> RewriteCount {
        let n = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .ok()
            .filter(|n| n.add_watch(dir, AddWatchFlags::IN_MOVED_FROM).is_ok());
        RewriteCount(n)
    }

    /// The replaces so far (`None`: no inotify, or its queue overflowed).
    pub fn count(&self) -> Option<u64> {
        let n = self.0.as_ref()?;
        let mut count = 0;
        while let Ok(evs) = n.read_events() {
            if evs.is_empty() {
                break;
            }
            for e in evs {
                if e.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    return None;
                }
                count += u64::from(
                    e.name
                        .as_deref()
                        .is_some_and(|f| f.as_encoded_bytes().starts_with(b".config.json.tmp")),
                );
            }
        }
        Some(count)
    }
}
