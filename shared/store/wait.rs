//! Blocking until an inbox has something in it, woken within milliseconds.
//!
//! The waiter puts an inotify watch on the inbox file itself (which is never replaced, only
//! truncated) and sleeps in `poll(2)` on the inotify descriptor plus any descriptor the caller
//! wants to be woken by (a signal pipe, say). Watching the file rather than the whole `inbox/`
//! directory keeps a write to one teammate's inbox from waking every other teammate.
//!
//! The watch exists only while the waiter sleeps: it is added when a wait finds the inbox
//! empty (which is then looked at again, so a message that arrived in between is not missed)
//! and removed when the wait returns. While its owner is busy (a model call, a drain), a watch
//! would make every sender's append queue an event nobody reads: a third of the cost of an
//! append's `write` under a steady stream.
//!
//! Where inotify is unavailable (for example `fs.inotify.max_user_instances` is exhausted by a
//! large team), it falls back to polling the file's size with a backoff from 1 ms to 50 ms, so a
//! wake-up is still quick and an idle agent still costs almost nothing.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};

use crate::error::Result;
use crate::fsutil;
use crate::inbox::Inbox;

pub use super::Wake;

/// Waits for an inbox to become non-empty.
#[derive(Debug)]
pub struct InboxWaiter {
    inbox: Inbox,
    path: PathBuf,
    notify: Option<Inotify>,
    /// The watch on the inbox, while a wait sleeps.
    watch: Option<WatchDescriptor>,
    /// For an inbox on a Redis bus: a blocking read there, instead of a watch.
    redis: Option<super::redis::RedisWaiter>,
}

const FALLBACK_MIN: Duration = Duration::from_millis(1);
const FALLBACK_MAX: Duration = Duration::from_millis(50);

impl InboxWaiter {
    /// Prepares a waiter for `inbox`, creating the inbox file if it is missing.
    pub fn new(inbox: &Inbox) -> Result<InboxWaiter> {
        if let Some(r) = inbox.redis() {
            return Ok(InboxWaiter {
                inbox: inbox.clone(),
                path: inbox.path().to_path_buf(),
                notify: None,
                watch: None,
                redis: Some(r.waiter()?),
            });
        }
        let path = inbox.path().to_path_buf();
        if let Some(dir) = path.parent() {
            fsutil::create_dir(dir)?;
        }
        drop(fsutil::open_append(&path)?);
        let mut waiter = InboxWaiter {
            inbox: inbox.clone(),
            path,
            notify: None,
            watch: None,
            redis: None,
        };
        if std::env::var_os("TROUPE_NO_INOTIFY").is_none() {
            match Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK) {
                Ok(n) => waiter.notify = Some(n),
                Err(e) => {
                    tracing::warn!("inotify unavailable ({e}); falling back to polling the inbox")
                }
            }
            // Tried once now, so that a file that cannot be watched falls back at once.
            waiter.add_watch();
            waiter.remove_watch();
        }
        Ok(waiter)
    }

    /// Puts the watch on the inbox (if inotify is in use and it is not there yet), then throws
    /// away queued events: whatever they announced, the caller looks at the inbox next. A
    /// file that cannot be watched turns the waiter to polling.
    fn add_watch(&mut self) {
        let Some(n) = &self.notify else { return };
        if self.watch.is_none() {
            let flags = AddWatchFlags::IN_MODIFY
                | AddWatchFlags::IN_CLOSE_WRITE
                | AddWatchFlags::IN_ATTRIB
                | AddWatchFlags::IN_DELETE_SELF
                | AddWatchFlags::IN_MOVE_SELF;
            match n.add_watch(&self.path, flags) {
                Ok(wd) => self.watch = Some(wd),
                Err(e) => {
                    tracing::warn!(
                        "cannot watch {} ({e}); falling back to polling",
                        self.path.display()
                    );
                    self.notify = None;
                    return;
                }
            }
        }
        while let Ok(evs) = n.read_events() {
            if evs.is_empty() {
                break;
            }
        }
    }

    /// Takes the watch off the inbox, so that appends stop queuing events while the owner is
    /// busy elsewhere.
    fn remove_watch(&mut self) {
        if let (Some(n), Some(wd)) = (&self.notify, self.watch.take()) {
            // Fails only if the watch is gone already (the file was deleted).
            let _ = n.rm_watch(wd);
        }
    }

    /// Whether inotify is in use (false: polling fallback).
    pub fn uses_inotify(&self) -> bool {
        self.notify.is_some()
    }

    /// Whether the inbox holds bytes not consumed yet (past its consumed offset).
    fn has_data(&self) -> bool {
        !self.inbox.is_empty()
    }

    /// Blocks until the inbox holds data, one of `extra` is readable, or `timeout` passes
    /// (`None`: no timeout). Returns at once if the inbox already holds data.
    pub fn wait(&mut self, timeout: Option<Duration>, extra: &[BorrowedFd<'_>]) -> Result<Wake> {
        if let Some(r) = &mut self.redis {
            return r.wait(timeout, extra);
        }
        if self.has_data() {
            return Ok(Wake::Message);
        }
        let woke = self.wait_watched(timeout, extra);
        self.remove_watch();
        woke
    }

    fn wait_watched(
        &mut self,
        timeout: Option<Duration>,
        extra: &[BorrowedFd<'_>],
    ) -> Result<Wake> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = FALLBACK_MIN;
        loop {
            self.add_watch();
            if self.has_data() {
                return Ok(Wake::Message);
            }
            let remaining = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(r) if !r.is_zero() => Some(r),
                    _ => return Ok(Wake::Timeout),
                },
                None => None,
            };
            let slice = match (&self.notify, remaining) {
                (Some(_), r) => r,
                (None, Some(r)) => Some(r.min(backoff)),
                (None, None) => Some(backoff),
            };
            let mut fds: Vec<PollFd<'_>> = extra
                .iter()
                .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
                .collect();
            if let Some(n) = &self.notify {
                fds.push(PollFd::new(n.as_fd(), PollFlags::POLLIN));
            }
            let t = match slice {
                // Round up so a sub-millisecond remainder does not spin.
                Some(d) => PollTimeout::try_from(d.as_millis().max(1).min(i32::MAX as u128) as i32)
                    .unwrap_or(PollTimeout::MAX),
                None => PollTimeout::NONE,
            };
            let mut poll_failed = false;
            match poll(&mut fds, t) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => {
                    tracing::warn!("poll failed ({e}); falling back to polling the inbox");
                    poll_failed = true;
                }
            }
            let external = fds[..extra.len()]
                .iter()
                .any(|p| p.revents().is_some_and(|r| !r.is_empty()));
            let mut rewatch = false;
            if let Some(n) = &self.notify {
                // Drain queued events; a deleted or moved inbox needs a fresh watch.
                while let Ok(evs) = n.read_events() {
                    if evs.is_empty() {
                        break;
                    }
                    rewatch |= evs.iter().any(|e| {
                        e.mask.intersects(
                            AddWatchFlags::IN_DELETE_SELF
                                | AddWatchFlags::IN_MOVE_SELF
                                | AddWatchFlags::IN_IGNORED,
                        )
                    });
                }
            }
            drop(fds);
            if poll_failed {
                self.watch = None;
                self.notify = None;
            } else if rewatch {
                // The file is gone or moved: a new one, watched on the next turn.
                self.remove_watch();
                drop(fsutil::open_append(&self.path)?);
            }
            if external {
                return Ok(Wake::External);
            }
            if self.notify.is_none() {
                backoff = (backoff * 2).min(FALLBACK_MAX);
            }
        }
    }
}

/// Sleeps for `d`, or less if `fd` becomes readable (a signal arrived). Returns whether it was
/// woken early.
pub fn sleep_unless(d: Duration, fd: BorrowedFd<'_>) -> bool {
    let deadline = Instant::now() + d;
    loop {
        let Some(left) = deadline
            .checked_duration_since(Instant::now())
            .filter(|l| !l.is_zero())
        else {
            return false;
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
        match poll(
            &mut fds,
            PollTimeout::try_from(ms).unwrap_or(PollTimeout::MAX),
        ) {
            Ok(n) if n > 0 => return true,
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(_) => {
                std::thread::sleep(left.min(Duration::from_millis(50)));
            }
        }
    }
}

/// SIGTERM and SIGINT as a flag plus a descriptor that becomes readable when one arrives, so a
/// wait (`InboxWaiter::wait` with [`Signals::fd`] among its extra descriptors) wakes at once and
/// the loop can finish its step. Used by the worker and by `lead chat`.
#[derive(Debug)]
pub struct Signals {
    /// Set by the handler; loops check it between steps.
    pub term: std::sync::Arc<std::sync::atomic::AtomicBool>,
    wake: std::os::unix::net::UnixStream,
}

impl Signals {
    /// Installs the handlers (for the life of the process).
    pub fn install() -> std::io::Result<Signals> {
        let term = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (wake, wake_w) = std::os::unix::net::UnixStream::pair()?;
        for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
            signal_hook::flag::register(sig, term.clone())?;
            signal_hook::low_level::pipe::register(sig, wake_w.try_clone()?)?;
        }
        Ok(Signals { term, wake })
    }

    /// Readable once a signal has arrived.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.wake.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::Durability;
    use crate::message::{Message, MessageType};
    use crate::teamdir::{AgentName, TeamDir};
    use std::os::fd::AsRawFd;

    /// The watches the kernel holds for the waiter's inotify descriptor (one `inotify wd:` line
    /// each in its fdinfo).
    fn watches(w: &InboxWaiter) -> usize {
        let fd = w
            .notify
            .as_ref()
            .expect("inotify in use")
            .as_fd()
            .as_raw_fd();
        std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}"))
            .unwrap()
            .lines()
            .filter(|l| l.starts_with("inotify wd:"))
            .count()
    }

    /// A busy owner's inbox is not watched: appends then cost its senders no event. The watch
    /// is there only while a wait sleeps, and a wait still wakes on an append.
    #[test]
    fn the_inbox_is_watched_only_while_a_wait_sleeps() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let name = AgentName::teammate("alice").unwrap();
        let inbox = Inbox::new(&team, &name);
        let mut w = InboxWaiter::new(&inbox).unwrap();
        assert!(w.uses_inotify());
        assert_eq!(watches(&w), 0);
        assert_eq!(
            w.wait(Some(Duration::from_millis(20)), &[]).unwrap(),
            Wake::Timeout
        );
        assert_eq!(watches(&w), 0, "a timed-out wait left its watch");
        let sender = {
            let inbox = inbox.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                let m = Message::new(MessageType::Message, "lead", "alice", "hi");
                inbox.append(&m, Durability::ProcessCrash).unwrap();
            })
        };
        let t0 = Instant::now();
        assert_eq!(
            w.wait(Some(Duration::from_secs(10)), &[]).unwrap(),
            Wake::Message
        );
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "woken by the timeout, not the append"
        );
        sender.join().unwrap();
        assert_eq!(watches(&w), 0, "a woken wait left its watch");
        // With data waiting, a wait returns at once and adds no watch.
        assert_eq!(w.wait(None, &[]).unwrap(), Wake::Message);
        assert_eq!(watches(&w), 0);
    }
}
