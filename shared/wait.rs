//! Blocking until an inbox has something in it, woken within milliseconds.
//!
//! The waiter puts an inotify watch on the inbox file itself (which is never replaced, only
//! truncated) and sleeps in `poll(2)` on the inotify descriptor plus any descriptor the caller
//! wants to be woken by (a signal pipe, say). Watching the file rather than the whole `inbox/`
//! directory keeps a write to one teammate's inbox from waking every other teammate.
//!
//! Where inotify is unavailable (for example `fs.inotify.max_user_instances` is exhausted by a
//! large team), it falls back to polling the file's size with a backoff from 1 ms to 50 ms, so a
//! wake-up is still quick and an idle agent still costs almost nothing.

use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use crate::error::Result;
use crate::fsutil;
use crate::inbox::Inbox;

/// Why [`InboxWaiter::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The inbox holds data.
    Message,
    /// One of the extra descriptors became readable.
    External,
    /// The timeout passed.
    Timeout,
}

/// Waits for an inbox to become non-empty.
#[derive(Debug)]
pub struct InboxWaiter {
    inbox: Inbox,
    path: PathBuf,
    notify: Option<Inotify>,
}

const FALLBACK_MIN: Duration = Duration::from_millis(1);
const FALLBACK_MAX: Duration = Duration::from_millis(50);

impl InboxWaiter {
    /// Prepares a waiter for `inbox`, creating the inbox file if it is missing.
    pub fn new(inbox: &Inbox) -> Result<InboxWaiter> {
        let path = inbox.path().to_path_buf();
        if let Some(dir) = path.parent() {
            fsutil::create_dir(dir)?;
        }
        drop(fsutil::open_append(&path)?);
        let notify = if std::env::var_os("TROUPE_NO_INOTIFY").is_some() {
            None
        } else {
            Self::watch(&path)
        };
        Ok(InboxWaiter {
            inbox: inbox.clone(),
            path,
            notify,
        })
    }

    fn watch(path: &std::path::Path) -> Option<Inotify> {
        let notify = match Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("inotify unavailable ({e}); falling back to polling the inbox");
                return None;
            }
        };
        let flags = AddWatchFlags::IN_MODIFY
            | AddWatchFlags::IN_CLOSE_WRITE
            | AddWatchFlags::IN_ATTRIB
            | AddWatchFlags::IN_DELETE_SELF
            | AddWatchFlags::IN_MOVE_SELF;
        match notify.add_watch(path, flags) {
            Ok(_) => Some(notify),
            Err(e) => {
                tracing::warn!(
                    "cannot watch {} ({e}); falling back to polling",
                    path.display()
                );
                None
            }
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
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = FALLBACK_MIN;
        loop {
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
                self.notify = None;
            } else if rewatch {
                drop(fsutil::open_append(&self.path)?);
                self.notify = Self::watch(&self.path);
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
