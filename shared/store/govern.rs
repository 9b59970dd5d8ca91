//! What the team's rate governor shares, per model endpoint (a fingerprint of URL and key):
//! a soft state under a lock (the limits the team learned: outside the change feed, so it
//! wakes nobody; never fsynced, a lost or torn one reads as a fresh start), and a pool of
//! call slots, counted leases taken first come, first served.
//!
//! Waiters queue in order of a key: the LLM lead's before any teammate's, then by when each
//! began to wait. A waiter takes a slot only when fewer live waiters are ahead of it than
//! slots are free, so a late comer polling often never overtakes an early one.
//!
//! Waiters and holders are leased. One that stops renewing its lease (a process stopped by
//! SIGSTOP or Ctrl-Z, or stuck) is passed over once the lease is stale, and holds nobody up
//! for longer; one that dies goes at once (files) or when its lease lapses (Redis). A waiter
//! renews with each try, so one sleeping out a cooldown may be passed over meanwhile (its
//! place comes back with its next try). A stopped holder that is continued finishes its call:
//! the cap is overshot by one call for as long as both run.
//!
//! - **files** (`govern/FP/` in the team dir): `state.json` under `state.lock`; a waiter is
//!   the flock of its file in `queue/` (named by its order key), a holder the flock of its
//!   file in `holders/`. A file's mtime is its lease: a waiter's tries renew it, a holder's
//!   thread every second; it is stale [`FILE_LEASE`] after, or when it is ahead of the clock
//!   by more than a second (a clock set back: stale until renewed, as after a step forward).
//!   A crash releases the flock; a file whose lock is free is a dead process's and is removed
//!   by the next try that looks. (A process stopped inside a look, under `state.lock`, still
//!   holds everyone up until it is continued: for microseconds of every try.)
//! - **Redis**: the key `govern:FP:state` under the bus's lock of that name; the slots'
//!   holders and the queue are sorted sets, changed by one script per try, with expiries on
//!   the server's clock. A holder's thread renews its lease (a crashed or stopped host's slots
//!   lapse within [`HOLD_LEASE`]), a waiter its place with each try (a dead or stopped one is
//!   passed over within [`WAIT_LEASE`]). Every write of them but a waiter's leaving and a
//!   slot's giving back is a script fenced by the writer's fence ([`super::redis::Fence`]): a
//!   member's worker that a newer incarnation replaced changes no limit, joins no queue,
//!   takes no slot and keeps none.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use super::Store;
use super::redis::{RedisBus, fenced_script};
use crate::error::Result;
use crate::fsutil::{self, HeldLock};

/// How long a slot on a bus stays held without a renewal.
pub const HOLD_LEASE: Duration = Duration::from_secs(15);
/// How long a waiter on a bus stays queued without trying again (it tries every 50 ms).
pub const WAIT_LEASE: Duration = Duration::from_secs(3);
/// How long a waiter's or a holder's file in a team dir stays fresh without a renewal.
pub const FILE_LEASE: Duration = Duration::from_secs(3);
/// How often a holder in a team dir renews its file's lease.
const FILE_RENEW: Duration = Duration::from_secs(1);
/// How often, at most, a waiter's try in a team dir renews its file's lease.
const FILE_REFRESH: Duration = Duration::from_millis(500);
/// How far ahead of the clock a lease may be and still count (clocks of one host agree; a
/// clock set back makes leases look renewed in the future).
const FILE_AHEAD: Duration = Duration::from_secs(1);
/// How long the soft state on a bus is kept after its last change.
const STATE_TTL_SECS: u64 = 86_400;

/// One endpoint's shared limits and call slots.
pub struct Pool {
    to: Target,
}

enum Target {
    Files(PathBuf),
    Redis(Box<RedisBus>, String),
}

impl Pool {
    /// The pool of endpoint `fingerprint`, through `store`.
    pub fn new(store: Store<'_>, fingerprint: &str) -> Pool {
        let to = match store {
            Store::Files(team) => Target::Files(team.root().join("govern").join(fingerprint)),
            Store::Redis(bus) => {
                Target::Redis(Box::new(bus.clone()), format!("govern:{fingerprint}"))
            }
        };
        Pool { to }
    }

    /// Reads the soft state under its lock (`None`: none yet), lets `f` decide its next bytes
    /// (`None`: unchanged) and writes them.
    pub fn update<R>(&self, f: impl FnOnce(Option<&[u8]>) -> (Option<Vec<u8>>, R)) -> Result<R> {
        match &self.to {
            Target::Files(dir) => {
                use std::os::unix::fs::FileExt;
                fsutil::create_dir(dir)?;
                let _held = HeldLock::acquire(&dir.join("state.lock"))?;
                let path = dir.join("state.json");
                let now = fsutil::read_optional(&path)?;
                let (next, out) = f(now.as_deref());
                if let Some(bytes) = next {
                    let file = fsutil::open_rw(&path)?;
                    file.write_all_at(&bytes, 0)
                        .and_then(|()| file.set_len(bytes.len() as u64))
                        .map_err(crate::Error::io("write", &path))?;
                }
                Ok(out)
            }
            Target::Redis(bus, base) => {
                let name = format!("{base}:state");
                let _lock = bus.lock(&name)?;
                let key = bus.key(&name);
                let now: Option<Vec<u8>> = bus.with_conn("read the rate limits", |c| {
                    redis::cmd("GET").arg(&key).query(c)
                })?;
                let (next, out) = f(now.as_deref());
                if let Some(bytes) = next {
                    let (fence, fence_value) = bus.fence_args();
                    bus.with_conn("write the rate limits", |c| {
                        redis::Script::new(STATE)
                            .key(&fence)
                            .key(&key)
                            .arg(&fence_value)
                            .arg(&bytes)
                            .arg(STATE_TTL_SECS)
                            .invoke::<i64>(c)
                    })?;
                }
                Ok(out)
            }
        }
    }

    /// Joins the queue for a slot, as `holder` (who waits: for messages and the bus's
    /// records), the LLM lead's process ahead of every teammate with `first`.
    pub fn queue(&self, holder: &str, first: bool) -> Result<Waiter<'_>> {
        let order = order_key(first, fsutil::now(), std::process::id());
        let place = match &self.to {
            Target::Files(dir) => {
                let queue = dir.join("queue");
                fsutil::create_dir(&queue)?;
                // Made and locked under the state's lock, which every look at the queue holds:
                // nobody sees the file before it is locked.
                let _state = HeldLock::acquire(&dir.join("state.lock"))?;
                Place::File {
                    lease: Leased::create(queue.join(&order))?,
                    renewed: Instant::now(),
                }
            }
            Target::Redis(bus, base) => {
                let id = format!(
                    "{holder}/{}/{}",
                    std::process::id(),
                    uuid::Uuid::new_v4().simple()
                );
                let (fence, fence_value) = bus.fence_args();
                bus.with_conn("join the slots' queue", |c| {
                    redis::Script::new(JOIN)
                        .key(&fence)
                        .key(bus.key(&format!("{base}:queue")))
                        .key(bus.key(&format!("{base}:alive")))
                        .arg(&fence_value)
                        .arg(&id)
                        .arg(order_score(&order))
                        .arg(WAIT_LEASE.as_millis() as u64)
                        .invoke::<i64>(c)
                })?;
                Place::Bus(id)
            }
        };
        Ok(Waiter {
            pool: self,
            order,
            place,
        })
    }
}

/// The order of waiters: `first` (the LLM lead) before the rest, then by when each began to
/// wait; names sort as the order.
fn order_key(first: bool, now: f64, pid: u32) -> String {
    let micros = (now * 1e6) as u64;
    format!("{}{micros:020}.{pid}", if first { 0 } else { 1 })
}

/// The score of a waiter's order key in the bus's queue (a double holds it exactly: the
/// microseconds of the next centuries stay below 2^53 once the leading class is a
/// multiplier of 2^52).
fn order_score(order: &str) -> f64 {
    let class: f64 = if order.starts_with('0') { 0.0 } else { 1.0 };
    let micros: u64 = order[1..21].parse().unwrap_or(u64::MAX >> 12);
    class * (1u64 << 52) as f64 + (micros >> 1) as f64
}

/// A file of this process in a team dir's pool (a waiter's place, a held slot): under its
/// flock for as long as it is held; its mtime is its lease.
struct Leased {
    file: File,
    path: PathBuf,
}

impl Leased {
    /// Makes `path` and locks it (under the state's lock: nobody looks at it before it is
    /// locked); made, its lease is fresh.
    fn create(path: PathBuf) -> Result<Leased> {
        let file = fsutil::open_rw(&path)?;
        loop {
            match file.lock() {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(crate::Error::io("lock", &path)(e)),
            }
        }
        let leased = Leased { file, path };
        leased.renew()?;
        Ok(leased)
    }

    fn renew(&self) -> Result<()> {
        self.file
            .set_modified(SystemTime::now())
            .map_err(crate::Error::io("renew the lease of", &self.path))
    }
}

/// A place in a pool's queue; leaves it when dropped.
pub struct Waiter<'a> {
    pool: &'a Pool,
    order: String,
    place: Place,
}

enum Place {
    File {
        lease: Leased,
        /// When its lease was last renewed.
        renewed: Instant,
    },
    Bus(String),
}

/// A held call slot; given back when dropped.
pub struct Slot {
    _held: Held,
}

enum Held {
    File {
        lease: Leased,
        /// Dropped to stop the renewals.
        _stop: mpsc::Sender<()>,
    },
    Bus {
        bus: Box<RedisBus>,
        key: String,
        id: String,
        /// Dropped to stop the renewals.
        _stop: mpsc::Sender<()>,
    },
}

impl Drop for Held {
    fn drop(&mut self) {
        match self {
            // Removed while still locked: a file found unlocked is a dead holder's.
            Held::File { lease, .. } => {
                let _ = std::fs::remove_file(&lease.path);
            }
            Held::Bus { bus, key, id, .. } => {
                let r = bus.with_conn("give back a call slot", |c| {
                    redis::cmd("ZREM").arg(&*key).arg(&*id).query::<()>(c)
                });
                if let Err(e) = r {
                    tracing::debug!("{e} (the slot lapses by itself)");
                }
            }
        }
    }
}

impl Waiter<'_> {
    /// Takes one of `n` slots if fewer live waiters are ahead of this one than slots are
    /// free; `None`: wait and try again (every try renews this waiter's lease).
    pub fn try_take(&mut self, n: usize) -> Result<Option<Slot>> {
        let n = n.max(1);
        match (&self.pool.to, &mut self.place) {
            (Target::Files(dir), Place::File { lease, renewed }) => {
                let _state = HeldLock::acquire(&dir.join("state.lock"))?;
                if renewed.elapsed() >= FILE_REFRESH {
                    lease.renew()?;
                    *renewed = Instant::now();
                }
                let now = SystemTime::now();
                let holders = dir.join("holders");
                let held = live(&holders, now, |_| true)?;
                let ahead = live(&dir.join("queue"), now, |name| name < self.order.as_str())?;
                if held + ahead >= n {
                    return Ok(None);
                }
                fsutil::create_dir(&holders)?;
                let id = format!("{}-{}", std::process::id(), uuid::Uuid::new_v4().simple());
                let lease = Leased::create(holders.join(&id))?;
                let renewer = lease
                    .file
                    .try_clone()
                    .map_err(crate::Error::io("open", &lease.path))?;
                let (stop, stopped) = mpsc::channel::<()>();
                std::thread::Builder::new()
                    .name("slot-lease".into())
                    .spawn(move || {
                        while let Err(mpsc::RecvTimeoutError::Timeout) =
                            stopped.recv_timeout(FILE_RENEW)
                        {
                            let _ = renewer.set_modified(SystemTime::now());
                        }
                    })
                    .map_err(crate::Error::io("spawn", "a slot's lease renewal"))?;
                Ok(Some(Slot {
                    _held: Held::File { lease, _stop: stop },
                }))
            }
            (Target::Redis(bus, base), Place::Bus(id)) => {
                let id = &*id;
                let holders = bus.key(&format!("{base}:holders"));
                let queue = bus.key(&format!("{base}:queue"));
                let alive = bus.key(&format!("{base}:alive"));
                let (fence, fence_value) = bus.fence_args();
                let taken: i64 = bus.with_conn("take a call slot", |c| {
                    redis::Script::new(TAKE)
                        .key(&fence)
                        .key(&holders)
                        .key(&queue)
                        .key(&alive)
                        .arg(&fence_value)
                        .arg(id)
                        .arg(n)
                        .arg(order_score(&self.order))
                        .arg(WAIT_LEASE.as_millis() as u64)
                        .arg(HOLD_LEASE.as_millis() as u64)
                        .invoke(c)
                })?;
                if taken != 1 {
                    return Ok(None);
                }
                let (stop, stopped) = mpsc::channel::<()>();
                let renewer = (bus.clone(), holders.clone(), id.clone());
                std::thread::Builder::new()
                    .name("slot-lease".into())
                    .spawn(move || renew(&renewer.0, &renewer.1, &renewer.2, &stopped))
                    .map_err(crate::Error::io("spawn", "a slot's lease renewal"))?;
                Ok(Some(Slot {
                    _held: Held::Bus {
                        bus: bus.clone(),
                        key: holders,
                        id: id.clone(),
                        _stop: stop,
                    },
                }))
            }
            _ => unreachable!("a waiter's place matches its pool"),
        }
    }
}

impl Drop for Waiter<'_> {
    fn drop(&mut self) {
        match (&self.pool.to, &self.place) {
            (Target::Files(_), Place::File { lease, .. }) => {
                let _ = std::fs::remove_file(&lease.path);
            }
            (Target::Redis(bus, base), Place::Bus(id)) => {
                let queue = bus.key(&format!("{base}:queue"));
                let alive = bus.key(&format!("{base}:alive"));
                let _ = bus.with_conn("leave the slots' queue", |c| {
                    redis::pipe()
                        .cmd("ZREM")
                        .arg(&queue)
                        .arg(id)
                        .cmd("ZREM")
                        .arg(&alive)
                        .arg(id)
                        .query::<()>(c)
                });
            }
            _ => {}
        }
    }
}

/// Whether a lease renewed at `at` is fresh at `now` (see [`FILE_LEASE`], [`FILE_AHEAD`]).
fn fresh(at: SystemTime, now: SystemTime) -> bool {
    match now.duration_since(at) {
        Ok(age) => age < FILE_LEASE,
        Err(ahead) => ahead.duration() <= FILE_AHEAD,
    }
}

/// Whether another open file of the lock at `path` (`file`) holds it.
fn locked_by_another(file: &File, path: &Path) -> Result<bool> {
    loop {
        match file.try_lock() {
            Ok(()) => {
                let _ = file.unlock();
                return Ok(false);
            }
            Err(std::fs::TryLockError::WouldBlock) => return Ok(true),
            Err(std::fs::TryLockError::Error(e)) if e.kind() == std::io::ErrorKind::Interrupted => {
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(crate::Error::io("lock", path)(e));
            }
        }
    }
}

/// How many other processes' files in `dir` (waiters', holders') whose names `wanted` takes
/// are alive with a fresh lease at `now`: a file whose lock is free is a dead process's, and
/// goes; one whose lease is stale is a stopped or stuck one's, passed over until it renews.
/// Called under the state's lock.
fn live(dir: &Path, now: SystemTime, wanted: impl Fn(&str) -> bool) -> Result<usize> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(crate::Error::io("read", dir)(e)),
    };
    let mut n = 0;
    for e in entries {
        let e = e.map_err(crate::Error::io("read", dir))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !wanted(name) {
            continue;
        }
        let path = e.path();
        let file = match File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(crate::Error::io("open", &path)(e)),
        };
        if !locked_by_another(&file, &path)? {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let renewed = file
            .metadata()
            .and_then(|m| m.modified())
            .map_err(crate::Error::io("stat", &path))?;
        if fresh(renewed, now) {
            n += 1;
        }
    }
    Ok(n)
}

/// Renews a held slot's lease on the bus every third of it, until `stopped` is dropped.
fn renew(bus: &RedisBus, key: &str, id: &str, stopped: &mpsc::Receiver<()>) {
    while let Err(mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(HOLD_LEASE / 3) {
        let (fence, fence_value) = bus.fence_args();
        let r = bus.with_conn("renew a call slot", |c| {
            redis::Script::new(RENEW)
                .key(&fence)
                .key(key)
                .arg(&fence_value)
                .arg(id)
                .arg(HOLD_LEASE.as_millis() as u64)
                .invoke::<i64>(c)
        });
        if let Err(e) = r {
            tracing::debug!("{e}");
        }
    }
}

/// KEYS: fence, holders (id -> lease end, ms), queue (id -> order), alive (id -> wait lease
/// end). ARGV: fence value, id, slots, order, wait lease, hold lease (ms). Drops lapsed holders
/// and waiters, queues the id (keeping its order), and takes a slot when fewer waiters are
/// ahead than slots are free. Returns 1 when taken.
const TAKE: &str = fenced_script!(
    r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
for _, g in ipairs(gone) do redis.call('ZREM', KEYS[3], g) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[2])
redis.call('ZADD', KEYS[3], 'NX', ARGV[4], ARGV[2])
local ahead = redis.call('ZRANK', KEYS[3], ARGV[2])
local held = redis.call('ZCARD', KEYS[2])
if held + ahead < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[2])
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('ZREM', KEYS[4], ARGV[2])
  return 1
end
return 0
"
);

/// KEYS: fence, queue, alive. ARGV: fence value, id, order, wait lease (ms). Queues the id.
const JOIN: &str = fenced_script!(
    r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ARGV[2])
return redis.call('ZADD', KEYS[2], 'NX', ARGV[3], ARGV[2])
"
);

/// KEYS: fence, holders. ARGV: fence value, id, lease (ms). Extends a slot still held.
const RENEW: &str = fenced_script!(
    r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZADD', KEYS[2], 'XX', 'CH', now + tonumber(ARGV[3]), ARGV[2])
"
);

/// KEYS: fence, the soft state. ARGV: fence value, the state, its expiry (s).
const STATE: &str = fenced_script!(
    r"
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::teamdir::TeamDir;

    #[test]
    fn the_lead_queues_first_then_by_time() {
        let lead = order_key(true, 2000.0, 9);
        let early = order_key(false, 1000.0, 5);
        let late = order_key(false, 1000.5, 4);
        assert!(lead < early && early < late);
        assert!(order_score(&lead) < order_score(&early));
        assert!(order_score(&early) < order_score(&late));
        assert!(order_score(&order_key(true, 4e9, 1)) < order_score(&early));
    }

    #[test]
    fn slots_go_first_come_first_served_and_a_dead_waiter_is_passed() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let mut a = pool.queue("a", false).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let mut b = pool.queue("b", false).unwrap();
        // One slot: b is behind a, and may not take it while a waits.
        assert!(b.try_take(1).unwrap().is_none());
        let held = a.try_take(1).unwrap().expect("a is first");
        drop(a);
        assert!(b.try_take(1).unwrap().is_none(), "the slot is a's");
        drop(held);
        let held_b = b.try_take(1).unwrap().expect("b is next");
        drop(b);
        drop(held_b);
        // A waiter that died (its lock released, its file left) is passed over.
        let c = pool.queue("c", false).unwrap();
        let path = match &c.place {
            Place::File { lease, .. } => lease.path.clone(),
            Place::Bus(_) => unreachable!(),
        };
        std::mem::forget(c);
        assert!(path.exists());
        // (The forgotten lock is this process's own: stand in for its release.)
        let _ = std::fs::remove_file(&path);
        std::fs::write(&path, b"").unwrap();
        let mut d = pool.queue("d", false).unwrap();
        assert!(d.try_take(1).unwrap().is_some());
        assert!(!path.exists(), "the dead waiter's file went");
        // The lead goes ahead of a teammate waiting longer.
        let mut e = pool.queue("e", false).unwrap();
        let mut lead = pool.queue("lead", true).unwrap();
        assert!(e.try_take(1).unwrap().is_none());
        assert!(lead.try_take(1).unwrap().is_some());
    }

    /// Sets the mtime of every file of the pool's queue and slots (its leases) 10 s back, as
    /// if their processes had stopped then.
    fn age_leases(pool_dir: &std::path::Path) {
        let back = std::time::SystemTime::now() - Duration::from_secs(10);
        let mut dirs = vec![pool_dir.to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                if p.is_dir() {
                    dirs.push(p);
                } else if !p
                    .file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with("state.")
                {
                    std::fs::File::open(&p).unwrap().set_modified(back).unwrap();
                }
            }
        }
    }

    #[test]
    fn a_waiter_whose_lease_is_stale_is_passed_over() {
        // R4-7: a stopped waiter keeps its lock, but no longer renews its lease.
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let _stopped = pool.queue("a", false).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let mut b = pool.queue("b", false).unwrap();
        assert!(
            b.try_take(1).unwrap().is_none(),
            "a's lease is fresh: a goes first"
        );
        age_leases(&team.root().join("govern/fp"));
        assert!(
            b.try_take(1).unwrap().is_some(),
            "a stale waiter held b back"
        );
    }

    #[test]
    fn a_holder_whose_lease_is_stale_frees_its_slot() {
        // R4-7: a stopped holder keeps its lock, but its renewals stop with it.
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let mut a = pool.queue("a", false).unwrap();
        let _held = a.try_take(1).unwrap().expect("a is first");
        drop(a);
        let mut b = pool.queue("b", false).unwrap();
        assert!(b.try_take(1).unwrap().is_none(), "a holds the one slot");
        age_leases(&team.root().join("govern/fp"));
        assert!(
            b.try_take(1).unwrap().is_some(),
            "a stale holder kept its slot"
        );
    }

    #[test]
    fn a_live_holder_and_a_live_waiter_keep_their_places_beyond_a_lease() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let mut a = pool.queue("a", false).unwrap();
        let held = a.try_take(1).unwrap().expect("a is first");
        drop(a);
        let mut b = pool.queue("b", false).unwrap();
        std::thread::sleep(Duration::from_millis(2));
        let mut c = pool.queue("c", false).unwrap();
        // The holder's thread renews its lease, the waiter's tries renew its own.
        let until = Instant::now() + FILE_LEASE + Duration::from_secs(1);
        while Instant::now() < until {
            assert!(
                b.try_take(1).unwrap().is_none(),
                "a's slot was taken from it"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(held);
        assert!(c.try_take(1).unwrap().is_none(), "c went ahead of b");
        assert!(b.try_take(1).unwrap().is_some());
    }

    #[test]
    fn the_soft_state_reads_back_and_is_written_only_when_changed() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let seen = pool
            .update(|now| (Some(b"one".to_vec()), now.is_none()))
            .unwrap();
        assert!(seen);
        let back = pool.update(|now| (None, now.map(<[u8]>::to_vec))).unwrap();
        assert_eq!(back.as_deref(), Some(&b"one"[..]));
        pool.update(|_| (Some(b"2".to_vec()), ())).unwrap();
        let back = pool.update(|now| (None, now.map(<[u8]>::to_vec))).unwrap();
        assert_eq!(back.as_deref(), Some(&b"2"[..]));
    }
}
