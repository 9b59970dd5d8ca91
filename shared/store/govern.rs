//! What the team's rate governor shares, per model endpoint (a fingerprint of URL and key):
//! a soft state under a lock (the limits the team learned: outside the change feed, so it
//! wakes nobody; never fsynced, a lost or torn one reads as a fresh start), and a pool of
//! call slots, counted leases taken first come, first served.
//!
//! Waiters queue in order of a key: the LLM lead's before any teammate's, then by when each
//! began to wait. A waiter takes a slot only when fewer live waiters are ahead of it than
//! slots are free, so a late comer polling often never overtakes an early one. A try names
//! its [`Cap`]: the team's, which counts every call in flight, and the one of the call's own
//! group (a `[model_caps]` prefix), which counts that group's calls and waiters only; a waiter
//! that its group's cap holds back takes nobody else's place.
//!
//! Waiters and holders are leased. One that stops renewing its lease (a process stopped by
//! SIGSTOP or Ctrl-Z, or stuck) is passed over once the lease is stale, and holds nobody up
//! for longer; one that dies goes at once (files) or when its lease lapses (Redis). A waiter
//! renews with each try, so one sleeping out a cooldown may be passed over meanwhile (its
//! place comes back with its next try). A stopped holder that is continued finishes its call:
//! the cap is overshot by one call for as long as both run.
//!
//! - **files** (`govern/FP/` in the team dir): `state.json` under `state.lock`; a waiter is
//!   the flock of its file in `queue/` (named by its order key; it says the waiter's group),
//!   a holder the flock of its file in `holders/` (which says its group). A file's mtime is
//!   its lease: a waiter's tries renew it, a holder's thread every second; it is stale
//!   [`FILE_LEASE`] after, or when it is ahead of the clock by more than a second (a clock set
//!   back: stale until renewed, as after a step forward). A crash releases the flock; a file
//!   whose lock is free is a dead process's and is removed by the next try that looks. (A
//!   process stopped inside a look, under `state.lock`, still holds everyone up until it is
//!   continued: for microseconds of every try.)
//! - **Redis**: the key `govern:FP:state` under the bus's lock of that name; the slots'
//!   holders and the queue are sorted sets (a member names its group), changed by one script
//!   per try, with expiries on the server's clock. A holder's thread renews its lease (a
//!   crashed or stopped host's slots lapse within [`HOLD_LEASE`]), a waiter its place with
//!   each try (a dead or stopped one is passed over within [`WAIT_LEASE`]). Every write of
//!   them but a waiter's leaving and a slot's giving back is a script fenced by the writer's
//!   fence ([`super::redis::Fence`]): a member's worker that a newer incarnation replaced
//!   changes no limit, joins no queue, takes no slot and keeps none.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use serde::{Deserialize, Serialize};

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

/// The most calls in flight a try for a slot allows.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Cap {
    /// The cap of the call's own group (a `[model_caps]` prefix) and its name: counts that
    /// group's holders and waiters only.
    pub group: Option<(String, usize)>,
    /// The team's cap at the endpoint: counts every holder, whatever its group.
    pub team: Option<usize>,
}

impl From<usize> for Cap {
    /// The team's cap `n`, for a call of no group.
    fn from(n: usize) -> Cap {
        Cap {
            group: None,
            team: Some(n),
        }
    }
}

/// The holders of a pool that count: in all, and per group.
#[derive(Debug, Default)]
struct Holding {
    total: usize,
    by_group: HashMap<String, usize>,
}

impl Holding {
    fn add(&mut self, group: Option<&str>) {
        self.total += 1;
        if let Some(g) = group {
            *self.by_group.entry(g.to_owned()).or_default() += 1;
        }
    }

    fn of(&self, group: &str) -> usize {
        self.by_group.get(group).copied().unwrap_or(0)
    }
}

/// Whether a try under `cap` takes a slot, with `held` holding and `ahead` waiting ahead of it
/// (in order, each with its group and that group's cap; `None`: of no group). A waiter ahead
/// counts against the team's cap only while its own group's cap would let it go: one held back
/// by its group takes nobody else's place. The Redis backend's TAKE decides the same.
fn admits(cap: &Cap, held: &Holding, ahead: &[Option<(String, usize)>]) -> bool {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    let mut team_ahead = 0;
    for w in ahead {
        match w {
            None => team_ahead += 1,
            Some((g, n)) => {
                let s = seen.entry(g.as_str()).or_default();
                if held.of(g) + *s < *n {
                    team_ahead += 1;
                }
                *s += 1;
            }
        }
    }
    if let Some((g, n)) = &cap.group
        && held.of(g) + seen.get(g.as_str()).copied().unwrap_or(0) >= (*n).max(1)
    {
        return false;
    }
    if let Some(n) = cap.team
        && held.total + team_ahead >= n.max(1)
    {
        return false;
    }
    true
}

/// What a waiter's or a holder's file in a team dir says of it: its group, and (a waiter's)
/// that group's cap.
#[derive(Debug, Default, PartialEq, Serialize, Deserialize)]
struct Mark {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    group: Option<String>,
    #[serde(default, skip_serializing_if = "is_zero")]
    n: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl Mark {
    fn of(cap: &Cap, with_n: bool) -> Mark {
        match &cap.group {
            Some((g, n)) => Mark {
                group: Some(g.clone()),
                n: if with_n { (*n).max(1) } else { 0 },
            },
            None => Mark::default(),
        }
    }

    fn bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A waiter ahead as [`admits`] takes it.
    fn ahead(self) -> Option<(String, usize)> {
        match self.group {
            Some(g) if self.n > 0 => Some((g, self.n)),
            _ => None,
        }
    }
}

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

    /// How often a waiter tries again for a slot: each try is a few file operations in a team
    /// dir, a round trip on a bus.
    pub fn poll(&self) -> Duration {
        match &self.to {
            Target::Files(_) => Duration::from_millis(20),
            Target::Redis(..) => Duration::from_millis(50),
        }
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
                            .key(bus.key(ENDPOINTS))
                            .arg(&fence_value)
                            .arg(&bytes)
                            .arg(STATE_TTL_SECS)
                            .arg(base.strip_prefix("govern:").unwrap_or(base))
                            .invoke::<i64>(c)
                    })?;
                }
                Ok(out)
            }
        }
    }

    /// Whether each of the slots `ids` ([`Slot::id`]) is still held: by a process alive (a
    /// stopped one included, in a team dir) or, on a bus, within its lease. May be called from
    /// [`Pool::update`]'s `f`.
    pub fn alive(&self, ids: &[String]) -> Result<Vec<bool>> {
        match &self.to {
            Target::Files(dir) => {
                let holders = dir.join("holders");
                ids.iter()
                    .map(|id| {
                        // A slot's id is a file name of ours; anything else (a state file
                        // written by hand) names no holder.
                        if id.is_empty()
                            || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                        {
                            return Ok(false);
                        }
                        let path = holders.join(id);
                        Ok(match File::open(&path) {
                            Ok(file) => locked_by_another(&file, &path)?,
                            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                            Err(e) => return Err(crate::Error::io("open", &path)(e)),
                        })
                    })
                    .collect()
            }
            Target::Redis(bus, base) => {
                let holders = bus.key(&format!("{base}:holders"));
                let live: Vec<String> = bus.with_conn("read the call slots' holders", |c| {
                    redis::Script::new(LIVE).key(&holders).invoke(c)
                })?;
                Ok(ids.iter().map(|id| live.contains(id)).collect())
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
                let mark = Mark::default().bytes();
                Place::File {
                    lease: Leased::create(queue.join(&order), &mark)?,
                    mark,
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
                Place::Bus {
                    member: id.clone(),
                    id,
                }
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
    /// Makes `path`, locks it and marks it with `mark` (under the state's lock: nobody looks
    /// at it before it is locked).
    fn create(path: PathBuf, mark: &[u8]) -> Result<Leased> {
        let file = fsutil::open_rw(&path)?;
        loop {
            match file.lock() {
                Ok(()) => break,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(crate::Error::io("lock", &path)(e)),
            }
        }
        let leased = Leased { file, path };
        leased.mark(mark)?;
        Ok(leased)
    }

    /// Writes `mark` over what the file says, and renews the lease.
    fn mark(&self, mark: &[u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(mark, 0)
            .and_then(|()| self.file.set_len(mark.len() as u64))
            .map_err(crate::Error::io("write", &self.path))?;
        self.renew()
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
        /// What the file says now.
        mark: Vec<u8>,
        /// When its lease was last renewed.
        renewed: Instant,
    },
    Bus {
        /// This waiter's id.
        id: String,
        /// Its member of the queue now: the id, and its group's cap and name when it has one.
        member: String,
    },
}

/// A held call slot; given back when dropped.
pub struct Slot {
    id: String,
    _held: Held,
}

impl Slot {
    /// This slot's id among the pool's holders (see [`Pool::alive`]).
    pub fn id(&self) -> &str {
        &self.id
    }
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
    /// Takes a slot under `cap` (a team's cap of `n`: `n.into()`) if fewer live waiters are
    /// ahead of this one than slots are free; `None`: wait and try again (every try renews
    /// this waiter's lease).
    pub fn try_take(&mut self, cap: impl Into<Cap>) -> Result<Option<Slot>> {
        let cap = cap.into();
        match (&self.pool.to, &mut self.place) {
            (
                Target::Files(dir),
                Place::File {
                    lease,
                    mark,
                    renewed,
                },
            ) => {
                let _state = HeldLock::acquire(&dir.join("state.lock"))?;
                let now_mark = Mark::of(&cap, true).bytes();
                if *mark != now_mark {
                    lease.mark(&now_mark)?;
                    *mark = now_mark;
                    *renewed = Instant::now();
                } else if renewed.elapsed() >= FILE_REFRESH {
                    lease.renew()?;
                    *renewed = Instant::now();
                }
                let now = SystemTime::now();
                let holders = dir.join("holders");
                let held = holding(&holders, now)?;
                let ahead = waiters_ahead(&dir.join("queue"), &self.order, now)?;
                if !admits(&cap, &held, &ahead) {
                    return Ok(None);
                }
                fsutil::create_dir(&holders)?;
                let id = format!("{}-{}", std::process::id(), uuid::Uuid::new_v4().simple());
                let lease = Leased::create(holders.join(&id), &Mark::of(&cap, false).bytes())?;
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
                    id,
                    _held: Held::File { lease, _stop: stop },
                }))
            }
            (Target::Redis(bus, base), Place::Bus { id, member }) => {
                let holders = bus.key(&format!("{base}:holders"));
                let queue = bus.key(&format!("{base}:queue"));
                let alive = bus.key(&format!("{base}:alive"));
                // A member names its group after a tab: "ID\tCAP\tGROUP" in the queue,
                // "ID\tGROUP" among the holders.
                let (now_member, holder) = {
                    let hid = format!("{id}/{}", uuid::Uuid::new_v4().simple());
                    match &cap.group {
                        Some((g, n)) => {
                            (format!("{id}\t{}\t{g}", (*n).max(1)), format!("{hid}\t{g}"))
                        }
                        None => (id.clone(), hid),
                    }
                };
                let (group, group_n) = cap
                    .group
                    .as_ref()
                    .map_or(("", 0), |(g, n)| (g.as_str(), (*n).max(1)));
                let (fence, fence_value) = bus.fence_args();
                let taken: i64 = bus.with_conn("take a call slot", |c| {
                    redis::Script::new(TAKE)
                        .key(&fence)
                        .key(&holders)
                        .key(&queue)
                        .key(&alive)
                        .arg(&fence_value)
                        .arg(&*member)
                        .arg(&now_member)
                        .arg(order_score(&self.order))
                        .arg(WAIT_LEASE.as_millis() as u64)
                        .arg(HOLD_LEASE.as_millis() as u64)
                        .arg(&holder)
                        .arg(group)
                        .arg(group_n)
                        .arg(cap.team.map_or(0, |n| n.max(1)))
                        .invoke(c)
                })?;
                *member = now_member;
                if taken != 1 {
                    return Ok(None);
                }
                let (stop, stopped) = mpsc::channel::<()>();
                let renewer = (bus.clone(), holders.clone(), holder.clone());
                std::thread::Builder::new()
                    .name("slot-lease".into())
                    .spawn(move || renew(&renewer.0, &renewer.1, &renewer.2, &stopped))
                    .map_err(crate::Error::io("spawn", "a slot's lease renewal"))?;
                Ok(Some(Slot {
                    id: holder.clone(),
                    _held: Held::Bus {
                        bus: bus.clone(),
                        key: holders,
                        id: holder,
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
            (Target::Redis(bus, base), Place::Bus { member, .. }) => {
                let queue = bus.key(&format!("{base}:queue"));
                let alive = bus.key(&format!("{base}:alive"));
                let _ = bus.with_conn("leave the slots' queue", |c| {
                    redis::pipe()
                        .cmd("ZREM")
                        .arg(&queue)
                        .arg(member)
                        .cmd("ZREM")
                        .arg(&alive)
                        .arg(member)
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

/// What another process's file in `dir` (a waiter's, a holder's) says, by name, if it is alive
/// and its lease fresh at `now`; a file whose lock is free is a dead process's, and goes.
/// Called under the state's lock.
fn live_marks(
    dir: &Path,
    now: SystemTime,
    wanted: impl Fn(&str) -> bool,
) -> Result<Vec<(String, Mark)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(crate::Error::io("read", dir)(e)),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(crate::Error::io("read", dir))?;
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !wanted(name) {
            continue;
        }
        let path = e.path();
        let mut file = match File::open(&path) {
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
        if !fresh(renewed, now) {
            // Stopped, or stuck: passed over until it renews again.
            continue;
        }
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)
            .map_err(crate::Error::io("read", &path))?;
        // A mark that does not parse (torn, or of another version) is of no group.
        let mark = serde_json::from_slice(&bytes).unwrap_or_default();
        out.push((name.to_owned(), mark));
    }
    Ok(out)
}

/// The live holders of slots in `holders` whose lease is fresh.
fn holding(holders: &Path, now: SystemTime) -> Result<Holding> {
    let mut held = Holding::default();
    for (_, mark) in live_marks(holders, now, |_| true)? {
        held.add(mark.group.as_deref());
    }
    Ok(held)
}

/// The live waiters in `queue` whose lease is fresh ahead of `order`, in order.
fn waiters_ahead(
    queue: &Path,
    order: &str,
    now: SystemTime,
) -> Result<Vec<Option<(String, usize)>>> {
    let mut ahead = live_marks(queue, now, |name| name < order)?;
    ahead.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(ahead.into_iter().map(|(_, m)| m.ahead()).collect())
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

/// KEYS: fence, holders (member -> lease end, ms), queue (member -> order), alive (member ->
/// wait lease end). ARGV: fence value, the waiter's member before and now (they differ when
/// its group or its cap changed), order, wait lease, hold lease (ms), the holder's member,
/// group (empty: none), the group's cap (0: none), the team's cap (0: none).
///
/// Drops lapsed holders and waiters, queues the waiter (keeping its order), and takes a slot as
/// [`admits`] decides: a member's group follows its first tab ("ID\tGROUP" among the holders,
/// "ID\tCAP\tGROUP" in the queue; none without a tab). Returns 1 when taken.
const TAKE: &str = fenced_script!(
    r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local gone = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
for _, g in ipairs(gone) do redis.call('ZREM', KEYS[3], g) end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
if ARGV[2] ~= ARGV[3] then
  redis.call('ZREM', KEYS[3], ARGV[2])
  redis.call('ZREM', KEYS[4], ARGV[2])
end
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[5]), ARGV[3])
redis.call('ZADD', KEYS[3], 'NX', ARGV[4], ARGV[3])
local total, held = 0, {}
for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', '+inf')) do
  total = total + 1
  local tab = string.find(h, '\t', 1, true)
  if tab then
    local g = string.sub(h, tab + 1)
    held[g] = (held[g] or 0) + 1
  end
end
local rank = redis.call('ZRANK', KEYS[3], ARGV[3])
local seen, ahead = {}, 0
if rank > 0 then
  for _, w in ipairs(redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '+inf', 'LIMIT', 0, rank)) do
    local a = string.find(w, '\t', 1, true)
    local b = a and string.find(w, '\t', a + 1, true)
    local n = b and tonumber(string.sub(w, a + 1, b - 1))
    if n and n > 0 then
      local g = string.sub(w, b + 1)
      local s = seen[g] or 0
      if (held[g] or 0) + s < n then ahead = ahead + 1 end
      seen[g] = s + 1
    else
      ahead = ahead + 1
    end
  end
end
local group, gn, tn = ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10])
if gn > 0 and (held[group] or 0) + (seen[group] or 0) >= gn then return 0 end
if tn > 0 and total + ahead >= tn then return 0 end
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[7])
redis.call('ZREM', KEYS[3], ARGV[3])
redis.call('ZREM', KEYS[4], ARGV[3])
return 1
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

/// KEYS: holders. The holders whose lease has not lapsed (a read: not fenced).
const LIVE: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')
";

/// KEYS: fence, the soft state, the set of endpoints. ARGV: fence value, the state, its
/// expiry (s), the endpoint.
const STATE: &str = fenced_script!(
    r"
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('SADD', KEYS[3], ARGV[4])
return 1
"
);

/// The set of the endpoints whose soft state was written on a bus (listed by `lead status`;
/// the team's ACL has no SCAN).
const ENDPOINTS: &str = "govern:endpoints";

/// The endpoints (fingerprints) whose soft state `store` holds, for `lead status`.
pub fn endpoints(store: Store<'_>) -> Result<Vec<String>> {
    let mut out = match store {
        Store::Files(team) => {
            let dir = team.root().join("govern");
            match std::fs::read_dir(&dir) {
                Ok(entries) => entries
                    .filter_map(|e| e.ok())
                    .filter(|e| e.path().join("state.json").is_file())
                    .filter_map(|e| e.file_name().to_str().map(str::to_owned))
                    .collect(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
                Err(e) => return Err(crate::Error::io("read", &dir)(e)),
            }
        }
        Store::Redis(bus) => {
            let key = bus.key(ENDPOINTS);
            bus.with_conn("list the rate limits", |c| {
                redis::cmd("SMEMBERS").arg(&key).query::<Vec<String>>(c)
            })?
        }
    };
    out.sort();
    Ok(out)
}

/// What ends endpoint `fingerprint`'s learned limits by hand (its cooldown with them): the
/// soft state removed reads as a fresh start.
pub fn clear_hint(store: Store<'_>, fingerprint: &str) -> String {
    match store {
        Store::Files(team) => format!(
            "rm {}",
            team.root()
                .join("govern")
                .join(fingerprint)
                .join("state.json")
                .display()
        ),
        Store::Redis(bus) => format!(
            "redis-cli DEL {}",
            bus.key(&format!("govern:{fingerprint}:state"))
        ),
    }
}

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
            Place::Bus { .. } => unreachable!(),
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
    fn a_models_cap_counts_that_models_calls_and_the_teams_every_call() {
        // R4-9: with a team's cap of 5 and opus's of 1, three haiku calls in flight leave an
        // opus call free to go; a second opus waiter waits for the first, and takes no place of
        // a haiku waiter behind it; the team's cap counts the opus call.
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let opus = Cap {
            group: Some(("claude-opus".into(), 1)),
            team: Some(5),
        };
        let haiku = || Cap::from(5);
        let take = |who: &str, cap: Cap| pool.queue(who, false).unwrap().try_take(cap).unwrap();
        let _haikus: Vec<Slot> = (0..3)
            .map(|i| take(&format!("h{i}"), haiku()).expect("the team's cap is 5"))
            .collect();
        let pause = || std::thread::sleep(Duration::from_millis(2));
        let mut o1 = pool.queue("o1", false).unwrap();
        pause();
        let mut o2 = pool.queue("o2", false).unwrap();
        pause();
        let mut o3 = pool.queue("o3", false).unwrap();
        pause();
        let mut h3 = pool.queue("h3", false).unwrap();
        let first = o1.try_take(opus.clone()).unwrap();
        let first = first.expect("no opus call in flight, 3 of the team's 5");
        drop(o1);
        assert!(o3.try_take(opus.clone()).unwrap().is_none());
        assert!(
            o2.try_take(opus.clone()).unwrap().is_none(),
            "one opus call at once"
        );
        let h3_slot = h3.try_take(haiku()).unwrap();
        assert!(h3_slot.is_some(), "the opus waiters held a haiku call back");
        drop(h3);
        assert!(
            take("h4", haiku()).is_none(),
            "the team's cap counts the opus call"
        );
        drop(first);
        assert!(
            o3.try_take(opus.clone()).unwrap().is_none(),
            "o3 went ahead of o2"
        );
        let _second = o2.try_take(opus.clone()).unwrap().expect("o2 is next");
        drop(o2);
        drop(h3_slot);
        assert!(take("h5", haiku()).is_some());
    }

    #[test]
    fn admits_as_the_bus_does() {
        let held = |total: usize, opus: usize| {
            let mut h = Holding::default();
            for i in 0..total {
                h.add((i < opus).then_some("opus"));
            }
            h
        };
        let opus = |n: usize| Some(("opus".to_owned(), n));
        let cap = |g: Option<(String, usize)>, t: Option<usize>| Cap { group: g, team: t };
        // Waiters ahead of no group count against the team's cap.
        assert!(admits(&cap(None, Some(2)), &held(1, 0), &[]));
        assert!(!admits(&cap(None, Some(2)), &held(1, 0), &[None]));
        // One of a group that its cap holds back does not; one it lets go does.
        assert!(admits(&cap(None, Some(2)), &held(1, 1), &[opus(1)]));
        assert!(!admits(&cap(None, Some(2)), &held(1, 0), &[opus(1)]));
        // The group's cap counts its holders and its waiters ahead, the others not.
        assert!(admits(&cap(opus(2), None), &held(5, 1), &[None, None]));
        assert!(!admits(&cap(opus(2), None), &held(5, 1), &[opus(2)]));
        assert!(!admits(&cap(opus(2), Some(6)), &held(5, 0), &[None]));
        // A cap of 0 is a cap of 1.
        assert!(admits(&cap(opus(0), Some(0)), &held(0, 0), &[]));
    }

    #[test]
    fn a_slot_is_alive_while_its_holder_holds_it() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join("t")).unwrap();
        let pool = Pool::new(team.store(), "fp");
        let slot = pool
            .queue("a", false)
            .unwrap()
            .try_take(2)
            .unwrap()
            .unwrap();
        let id = slot.id().to_owned();
        let names = |ids: &[&str]| ids.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let asked = names(&[&id, "../state.json", "", "none-such"]);
        assert_eq!(pool.alive(&asked).unwrap(), [true, false, false, false]);
        // Stale (its holder stopped), it still holds its call.
        age_leases(&team.root().join("govern/fp"));
        assert_eq!(pool.alive(&names(&[&id])).unwrap(), [true]);
        drop(slot);
        assert_eq!(pool.alive(&names(&[&id])).unwrap(), [false]);
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
