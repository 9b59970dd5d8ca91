//! Hosts of a team on a bus: which supervisor runs which host's members, and how `lead stop`
//! reaches supervisors on other machines.
//!
//! - **The lease** `troupe:{TEAM}:lease:HOST` holds the running supervisor's token for
//!   [`HOST_LEASE`], renewed twice a second, with an epoch ([`super::lease`]). A second
//!   supervisor for the same host waits for the lease to lapse and gives up if it does not, so
//!   two supervisors never run one host's members. A supervisor killed with `kill -9` leaves
//!   its lease to lapse: its successor starts within [`HOST_LEASE`], one epoch higher. A
//!   supervisor whose lease another took (it was stalled longer than the lease) finds its
//!   writes refused, kills its own workers and exits, writing nothing; its workers' own writes
//!   are refused too, since the successor's workers are newer incarnations.
//! - **The set** `troupe:{TEAM}:hosts` names every host that ever held a lease, so that the
//!   live ones can be listed (those whose lease is there).
//! - **A stop** is the key `troupe:{TEAM}:stop:HOST`, announced on the change feed: the host's
//!   supervisor sees it on its next tick and stops its team as SIGTERM would. It is cleared by
//!   the next supervisor of that host when it starts.

use std::time::Duration;

use super::RedisBus;
use super::lease::Lease;
use crate::error::{Error, Result};

/// How long a supervisor's lease outlives its last renewal.
pub const HOST_LEASE: Duration = Duration::from_secs(5);

/// Whether `host` is a usable host name: 1-64 of `A-Z a-z 0-9 . _ -`.
pub fn check_host(host: &str) -> Result<()> {
    let ok = (1..=64).contains(&host.len())
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(Error::Bus {
            what: format!("host {host:?}"),
            why: "a host name is 1-64 of A-Z, a-z, 0-9, '.', '_', '-'".to_owned(),
        })
    }
}

/// The refusal of a host (`what`: where it was given) on a team with no bus.
pub fn no_bus(what: String) -> Error {
    Error::Bus {
        what,
        why: "a host is where a member runs on a team spread over machines; it needs a bus \
              (--bus redis://... or TROUPE_BUS)"
            .to_owned(),
    }
}

/// This machine's host name (the default `--host`), or `localhost` when it has none usable.
pub fn this_host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| check_host(h).is_ok())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A supervisor's hold on its host: a [`Lease`] on `lease:HOST`, its epoch the fence of the
/// supervisor's writes.
pub struct HostLease {
    lease: Lease,
    host: String,
}

impl std::fmt::Debug for HostLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostLease")
            .field("host", &self.host)
            .field("epoch", &self.lease.epoch())
            .finish_non_exhaustive()
    }
}

impl HostLease {
    /// Takes the lease of `host`, waiting up to `patience` for another holder's to lapse, and
    /// fences this process's writes on `bus` by it. Clears a stop left for the host by `lead
    /// stop`.
    pub fn acquire(bus: &RedisBus, host: &str, patience: Duration) -> Result<HostLease> {
        check_host(host)?;
        let lease = Lease::acquire(
            bus,
            &format!("lease:{host}"),
            HOST_LEASE,
            Some(("hosts", host)),
            patience,
            "the host's lease (another `lead run` supervises this host's members)",
            format!("the supervisor of host {host}"),
        )?;
        bus.set_fence(lease.fence());
        clear_stop(bus, host)?;
        Ok(HostLease {
            lease,
            host: host.to_owned(),
        })
    }

    /// The host.
    pub fn host(&self) -> &str {
        &self.host
    }

    /// Renews the lease: `Ok(false)` when another supervisor took it (lost for good).
    pub fn renew(&self) -> Result<bool> {
        self.lease.renew()
    }

    /// Whether `lead stop` asked this host's supervisor to stop.
    pub fn stop_requested(&self) -> Result<bool> {
        let bus = self.lease.bus();
        let key = bus.key(&format!("stop:{}", self.host));
        bus.with_conn("look for a stop", |c| {
            redis::cmd("EXISTS").arg(&key).query::<bool>(c)
        })
    }

    /// Lets the lease go (at a clean exit), and the stop that asked for it.
    pub fn release(self) {
        self.lease.release();
        if let Err(e) = clear_stop(self.lease.bus(), &self.host) {
            tracing::warn!("{e}");
        }
    }
}

/// KEYS: fence, the stop. ARGV: fence value.
const CLEAR_STOP: &str = super::fenced_script!(
    r"
redis.call('DEL', KEYS[2])
return 1
"
);

/// Removes the stop `lead stop` left for `host` (its supervisor starts, or ends), fenced by
/// the supervisor's lease: one that was replaced clears no stop meant for its successor.
fn clear_stop(bus: &RedisBus, host: &str) -> Result<()> {
    let stop = bus.key(&format!("stop:{host}"));
    let (fence, fence_value) = bus.fence_args();
    bus.with_conn("clear a stop", |c| {
        redis::Script::new(CLEAR_STOP)
            .key(&fence)
            .key(&stop)
            .arg(&fence_value)
            .invoke::<i64>(c)
    })
    .map(drop)
}

/// The hosts whose supervisor holds its lease now, sorted.
pub fn live_hosts(bus: &RedisBus) -> Result<Vec<String>> {
    let hosts_key = bus.key("hosts");
    let mut hosts: Vec<String> = bus.with_conn("list hosts", |c| {
        redis::cmd("SMEMBERS").arg(&hosts_key).query(c)
    })?;
    hosts.retain(|h| check_host(h).is_ok());
    hosts.sort();
    let keys: Vec<String> = hosts.iter().map(|h| format!("lease:{h}")).collect();
    let leases = bus.get_docs(&keys)?;
    Ok(hosts
        .into_iter()
        .zip(leases)
        .filter_map(|(h, l)| l.map(|_| h))
        .collect())
}

/// Asks the supervisor of `host` to stop its team (see the module docs).
pub fn request_stop(bus: &RedisBus, host: &str) -> Result<()> {
    check_host(host)?;
    let key = bus.key(&format!("stop:{host}"));
    bus.with_conn("ask a host to stop", |c| {
        redis::cmd("SET").arg(&key).arg(1).query::<()>(c)
    })?;
    bus.announce(&format!("stop:{host}"))
}
