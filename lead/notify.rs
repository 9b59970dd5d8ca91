//! The systemd notification protocol (`sd_notify`): newline-separated `KEY=value` in one datagram
//! to the unix socket named by `NOTIFY_SOCKET` (a leading `@` is the abstract namespace).

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::{Duration, Instant};

/// A connection to systemd's notify socket; every call is a no-op without `NOTIFY_SOCKET`.
pub struct Notifier {
    target: Option<(UnixDatagram, SocketAddr)>,
    watchdog: Option<Duration>,
    last_ping: Instant,
    last_status: String,
}

impl Notifier {
    /// Reads `NOTIFY_SOCKET`, `WATCHDOG_USEC` and `WATCHDOG_PID` from the environment.
    pub fn from_env() -> Notifier {
        let target = std::env::var("NOTIFY_SOCKET").ok().and_then(|p| {
            let addr = match p.strip_prefix('@') {
                Some(abs) => SocketAddr::from_abstract_name(abs.as_bytes()).ok()?,
                None => SocketAddr::from_pathname(&p).ok()?,
            };
            Some((UnixDatagram::unbound().ok()?, addr))
        });
        let watchdog = ping_interval(
            std::env::var("WATCHDOG_USEC").ok().as_deref(),
            std::env::var("WATCHDOG_PID").ok().as_deref(),
            std::process::id(),
        );
        Notifier {
            target,
            watchdog,
            last_ping: Instant::now(),
            last_status: String::new(),
        }
    }

    fn send(&self, msg: &str) {
        if let Some((sock, addr)) = &self.target
            && let Err(e) = sock.send_to_addr(msg.as_bytes(), addr)
        {
            tracing::warn!("sd_notify failed: {e}");
        }
    }

    pub fn ready(&self, status: &str) {
        self.send(&format!("READY=1\nSTATUS={status}"));
    }

    pub fn stopping(&self) {
        self.send("STOPPING=1\nSTATUS=stopping the team");
    }

    /// Sends `STATUS=` when it changed.
    pub fn status(&mut self, status: &str) {
        if status != self.last_status {
            self.send(&format!("STATUS={status}"));
            self.last_status = status.to_owned();
        }
    }

    /// Sends `WATCHDOG=1` when half the watchdog interval has passed; returns the time until the
    /// next ping is due.
    pub fn watchdog(&mut self) -> Option<Duration> {
        let every = self.watchdog?;
        if self.last_ping.elapsed() >= every {
            self.send("WATCHDOG=1");
            self.last_ping = Instant::now();
        }
        Some(every.saturating_sub(self.last_ping.elapsed()))
    }
}

/// How often to send `WATCHDOG=1`: half of `WATCHDOG_USEC`, as `sd_watchdog_enabled` decides.
/// `None` when there is no watchdog, when it is `0` or unreadable, or when `WATCHDOG_PID` names
/// another process: the variables were meant for it (a parent that started us with its
/// environment), and systemd would ignore our pings or, with `NotifyAccess=all`, count them
/// for a process that may be hung.
fn ping_interval(usec: Option<&str>, pid: Option<&str>, our_pid: u32) -> Option<Duration> {
    if let Some(pid) = pid
        && pid.parse::<u32>().ok() != Some(our_pid)
    {
        return None;
    }
    usec.and_then(|u| u.parse::<u64>().ok())
        .filter(|&us| us > 0)
        .map(|us| Duration::from_micros(us / 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchdog_only_for_the_pid_systemd_named() {
        let half = Some(Duration::from_secs(5));
        assert_eq!(ping_interval(Some("10000000"), None, 42), half);
        assert_eq!(ping_interval(Some("10000000"), Some("42"), 42), half);
        // Meant for another process (a parent that exec'd us keeps its own watchdog).
        assert_eq!(ping_interval(Some("10000000"), Some("41"), 42), None);
        assert_eq!(ping_interval(Some("10000000"), Some("x"), 42), None);
        assert_eq!(ping_interval(None, Some("42"), 42), None);
        assert_eq!(ping_interval(Some("nope"), None, 42), None);
        // Zero is no watchdog (not a ping on every tick).
        assert_eq!(ping_interval(Some("0"), None, 42), None);
    }
}
