//! Leases with an epoch: how one process at a time acts for a host (its supervisor) or for the
//! lead's inbox (its consumer), across machines, with the writes of one that was replaced
//! refused by the server.
//!
//! - **The lease** `KEY` holds the holder's token for [`LEASE`](super::hosts::HOST_LEASE)-like
//!   spans, renewed by the holder well inside them.
//! - **The epoch record** `KEY-epoch` holds `EPOCH:TOKEN` and never expires. A process that
//!   takes a lease with a new token raises the epoch by one; the holder renewing a lease that
//!   lapsed while no one else took it (a Redis outage, a short stall) keeps its epoch: an
//!   outage is not a lost lease. Only a record naming another token means the lease was lost.
//! - **The fence** of a holder is its record, `EPOCH:TOKEN` ([`super::Fence`]): once another
//!   process took the lease, every fenced write of the old holder is refused, whatever it
//!   still believes. A record that is gone (a server restarted without its data, a key
//!   deleted by hand) refuses the holder's writes too, until its next renewal writes the
//!   record again with the holder's epoch (if nobody took the lease meanwhile).

use std::time::{Duration, Instant};

use super::{Fence, RedisBus};
use crate::error::{Error, Result};

/// KEYS: lease, epoch record, a set to name the holder in (or any key). ARGV: token, span in
/// ms, the name to add to the set ('' none), 'acquire' or 'renew', the caller's epoch ('0':
/// none). Returns the epoch held now, or 0 when another process holds the lease or took it
/// since (renew).
const HOLD: &str = r"
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then
  return 0
end
local rec = redis.call('GET', KEYS[2])
local epoch
if rec then
  local n, tok = string.match(rec, '^(%d+):(.+)$')
  if tok == ARGV[1] then
    epoch = tonumber(n)
  elseif ARGV[4] == 'renew' then
    return 0
  else
    epoch = (tonumber(n) or 0) + 1
  end
else
  epoch = math.max(tonumber(ARGV[5]) or 0, 1)
end
local want = epoch .. ':' .. ARGV[1]
if rec ~= want then
  redis.call('SET', KEYS[2], want)
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if ARGV[3] ~= '' then
  redis.call('SADD', KEYS[3], ARGV[3])
end
return epoch
";

/// A lease held with an epoch (see the module docs).
pub struct Lease {
    bus: RedisBus,
    key: String,
    record: String,
    set: Option<(String, String)>,
    span: Duration,
    token: String,
    epoch: std::sync::atomic::AtomicU64,
    /// Who holds it, for messages ("the supervisor of host h").
    holder: String,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("key", &self.key)
            .field("epoch", &self.epoch())
            .finish_non_exhaustive()
    }
}

impl Lease {
    /// Takes the lease at the team key `key` for `span`, waiting up to `patience` for another
    /// holder's to lapse (a zero patience tries once). `set`: a team set and a name to add to
    /// it on every renewal (the hosts that ever held a lease). Refused with
    /// [`Error::Locked`] (`what`) when it stays held.
    pub fn acquire(
        bus: &RedisBus,
        key: &str,
        span: Duration,
        set: Option<(&str, &str)>,
        patience: Duration,
        what: &'static str,
        holder: String,
    ) -> Result<Lease> {
        let lease = Lease {
            bus: bus.clone(),
            key: bus.key(key),
            record: bus.key(&format!("{key}-epoch")),
            set: set.map(|(s, n)| (bus.key(s), n.to_owned())),
            span,
            token: uuid::Uuid::new_v4().simple().to_string(),
            epoch: 0.into(),
            holder,
        };
        let started = Instant::now();
        let mut said = false;
        while lease.hold("acquire")? == 0 {
            if started.elapsed() >= patience {
                return Err(Error::Locked {
                    what,
                    path: std::path::PathBuf::from(&lease.key),
                });
            }
            if !said {
                tracing::info!(lease = %lease.key, "held by another process; waiting for it to lapse");
                said = true;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(lease)
    }

    fn hold(&self, mode: &str) -> Result<u64> {
        let (set_key, set_name) = match &self.set {
            Some((k, n)) => (k.as_str(), n.as_str()),
            None => (self.key.as_str(), ""),
        };
        let epoch: u64 = self.bus.with_conn("hold a lease", |c| {
            redis::Script::new(HOLD)
                .key(&self.key)
                .key(&self.record)
                .key(set_key)
                .arg(&self.token)
                .arg(self.span.as_millis() as u64)
                .arg(set_name)
                .arg(mode)
                .arg(self.epoch())
                .invoke(c)
        })?;
        if epoch != 0 {
            self.epoch.store(epoch, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(epoch)
    }

    /// Renews the lease: `Ok(false)` when another process took it (it is lost for good).
    pub fn renew(&self) -> Result<bool> {
        Ok(self.hold("renew")? != 0)
    }

    /// The epoch held (0 before the first hold).
    pub fn epoch(&self) -> u64 {
        self.epoch.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The fence of this holder: its epoch record as it wrote it.
    pub fn fence(&self) -> Fence {
        Fence {
            key: self.record.clone(),
            value: format!("{}:{}", self.epoch(), self.token),
            holder: self.holder.clone(),
        }
    }

    /// The bus it is held on.
    pub fn bus(&self) -> &RedisBus {
        &self.bus
    }

    /// Lets the lease go (only while it holds this token); the epoch record stays, so the next
    /// holder's epoch is higher.
    pub fn release(&self) {
        let r = self.bus.with_conn("let a lease go", |c| {
            redis::Script::new(super::doc::RELEASE)
                .key(&self.key)
                .arg(&self.token)
                .invoke::<i64>(c)
        });
        if let Err(e) = r {
            tracing::warn!("{e} (the lease lapses by itself)");
        }
    }
}

/// Renews a lease with `renew` every `every` (in 50 ms steps, so that `done` is seen at once)
/// until `done` is set or the lease is lost; `renewed` runs after each renewal. A bus that does
/// not answer is logged once per distinct error (`meanwhile`: what holds until it answers again)
/// and tried again. Returns whether the lease was lost.
pub fn keep_renewing(
    renew: impl Fn() -> Result<bool>,
    done: &std::sync::atomic::AtomicBool,
    every: Duration,
    meanwhile: &str,
    mut renewed: impl FnMut(),
) -> bool {
    use std::sync::atomic::Ordering;
    let mut failing: Option<String> = None;
    while !done.load(Ordering::SeqCst) {
        match renew() {
            Ok(false) => return true,
            Ok(true) => {
                if let Some(e) = failing.take() {
                    tracing::info!("the bus answers again (it did not: {e})");
                }
                renewed();
            }
            Err(e) => {
                let text = e.to_string();
                if failing.as_deref() != Some(text.as_str()) {
                    tracing::warn!(
                        "{text}; {meanwhile}, and the lease is renewed once the bus answers"
                    );
                    failing = Some(text);
                }
            }
        }
        for _ in 0..(every.as_millis() / 50) {
            if done.load(Ordering::SeqCst) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    false
}

/// How long the lease of the lead's inbox outlives its last renewal.
pub const CONSUMER_LEASE: Duration = Duration::from_secs(5);

/// The one consumer of the lead's inbox on a team (`lead chat`, or `lead inbox` for one
/// drain): the lease `consumer:lead`, renewed by a thread of its own every second while held.
/// Its holder's writes are fenced by it.
pub struct ConsumerLease {
    lease: std::sync::Arc<Lease>,
    done: std::sync::Arc<std::sync::atomic::AtomicBool>,
    renewer: Option<std::thread::JoinHandle<()>>,
}

impl ConsumerLease {
    /// Takes the lease of the lead's inbox, without waiting for a holder that renews it, and
    /// fences this process's writes by it.
    pub fn take(bus: &RedisBus) -> Result<ConsumerLease> {
        let lease = std::sync::Arc::new(Lease::acquire(
            bus,
            "consumer:lead",
            CONSUMER_LEASE,
            None,
            Duration::ZERO,
            "the lead's inbox (a `lead chat` or `lead inbox` on this team, on this host or \
             another, consumes it)",
            "the lead's inbox consumer".to_owned(),
        )?);
        bus.set_fence(lease.fence());
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (l, d) = (lease.clone(), done.clone());
        let renewer = std::thread::Builder::new()
            .name("consumer-lease".into())
            .spawn(move || {
                let lost = keep_renewing(
                    || l.renew(),
                    &d,
                    Duration::from_secs(1),
                    "this process's writes stay fenced by it",
                    || {},
                );
                if lost {
                    tracing::error!(
                        "another consumer took the lead's inbox (this one was stalled past its \
                         lease); this process's writes are refused from now on"
                    );
                }
            })
            .map_err(Error::io("spawn a thread", "consumer-lease"))?;
        Ok(ConsumerLease {
            lease,
            done,
            renewer: Some(renewer),
        })
    }
}

impl Drop for ConsumerLease {
    fn drop(&mut self) {
        self.done.store(true, std::sync::atomic::Ordering::SeqCst);
        // A renewal under way would take the lease again after the release.
        if let Some(h) = self.renewer.take() {
            let _ = h.join();
        }
        self.lease.release();
    }
}
