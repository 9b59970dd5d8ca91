//! Documents on Redis: the roster, each request and each task, one string key each, changed
//! the way the files are (read, decide, write) under a lock of their own, so that of two
//! processes racing to change one exactly one wins and the other sees what it lost to.
//!
//! - **The lock** is the key `DOC:lock`, set to a fresh token with `NX` and a lease (`PX`): a
//!   holder killed with `kill -9` holds it at most [`LEASE`]. Taking it is a script that also
//!   accepts the caller's own token, so a reply lost with the connection and a retry do not lock
//!   the caller out of its own lock.
//! - **The write** is a script that sets the document only while the lock still holds the
//!   writer's token (a writer that outlived its lease, stopped or swapped out, writes nothing and
//!   is told so) and the writer is not fenced off ([`super::Fence`]: a replaced member
//!   incarnation or supervisor writes nothing), and adds the key to the team's change feed in
//!   the same step.
//! - **The change feed** is the stream `troupe:{TEAM}:changes`, capped at about
//!   [`FEED_LEN`] entries: a supervisor blocks on it instead of watching files with inotify.
//! - **Release** deletes the lock only while it holds the caller's token.

use std::time::{Duration, Instant};

use super::RedisBus;
use crate::error::{Error, Result};

/// How long a lock outlives a holder that died without releasing it.
pub const LEASE: Duration = Duration::from_secs(10);
/// The longest a caller waits for a lock before it gives up.
const PATIENCE: Duration = Duration::from_secs(30);
/// Entries kept in the change feed (approximately: `MAXLEN ~`).
pub const FEED_LEN: u64 = 1000;

/// KEYS: lock. ARGV: token, lease in ms. 1 when the caller holds the lock now.
const TAKE: &str = r"
local v = redis.call('GET', KEYS[1])
if v == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if v == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
";

/// KEYS: fence, document, lock, change feed. ARGV: fence value, token, the document, the
/// feed's cap. 0 when the lock is no longer the caller's (nothing written); refused when the
/// caller is fenced off.
const WRITE: &str = super::fenced_script!(
    r"
if redis.call('GET', KEYS[3]) ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[4], '*', 'k', KEYS[2])
return 1
"
);

/// KEYS: fence, a member's epoch key. ARGV: fence value, the incarnation.
const SET_EPOCH: &str = super::fenced_script!(
    r"
redis.call('SET', KEYS[2], ARGV[2])
return 1
"
);

/// KEYS: lock (or a host's lease). ARGV: token. Deletes it only while it holds the token.
pub(super) const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// A lock held on the bus; released when dropped (a failed release is left to the lease).
pub struct BusLock<'a> {
    bus: &'a RedisBus,
    key: String,
    token: String,
}

impl Drop for BusLock<'_> {
    fn drop(&mut self) {
        let r = self.bus.with_conn("release a lock", |c| {
            redis::Script::new(RELEASE)
                .key(&self.key)
                .arg(&self.token)
                .invoke::<i64>(c)
        });
        if let Err(e) = r {
            tracing::warn!("{e} (it lapses by itself within {} s)", LEASE.as_secs());
        }
    }
}

impl RedisBus {
    /// Takes the lock `KEY:lock` of the team's key `key` (`key` is the part after
    /// `troupe:{TEAM}:`), waiting while another process holds it.
    pub fn lock(&self, key: &str) -> Result<BusLock<'_>> {
        let key = format!("{}:lock", self.key(key));
        let token = uuid::Uuid::new_v4().simple().to_string();
        let started = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            let held: i64 = self.with_conn("take a lock", |c| {
                redis::Script::new(TAKE)
                    .key(&key)
                    .arg(&token)
                    .arg(LEASE.as_millis() as u64)
                    .invoke(c)
            })?;
            if held == 1 {
                return Ok(BusLock {
                    bus: self,
                    key,
                    token,
                });
            }
            if started.elapsed() > PATIENCE {
                return Err(Error::Bus {
                    what: key,
                    why: format!("held by another process for over {} s", PATIENCE.as_secs()),
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// The document `key`, if it exists.
    pub(crate) fn get_doc(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let key = self.key(key);
        self.with_conn("read", |c| {
            redis::cmd("GET").arg(&key).query::<Option<Vec<u8>>>(c)
        })
    }

    /// The documents `keys`, in order (`None` for one that does not exist).
    pub(crate) fn get_docs(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        self.with_conn("read", |c| {
            redis::cmd("MGET")
                .arg(&keys)
                .query::<Vec<Option<Vec<u8>>>>(c)
        })
    }

    /// Reads document `key` under its lock, lets `f` decide its next bytes (`None`: no change;
    /// the callers compare what they parsed, so an unchanged document is not written) and
    /// writes them, fenced by the lock (see the module docs).
    pub(crate) fn locked_doc<R>(
        &self,
        key: &str,
        f: impl FnOnce(Option<Vec<u8>>) -> Result<(Option<Vec<u8>>, R)>,
    ) -> Result<R> {
        let lock = self.lock(key)?;
        let (next, out) = f(self.get_doc(key)?)?;
        if let Some(bytes) = next {
            let doc = self.key(key);
            let feed = self.key("changes");
            let (fence, fence_value) = self.fence_args();
            let written: i64 = self.with_conn("write", |c| {
                redis::Script::new(WRITE)
                    .key(&fence)
                    .key(&doc)
                    .key(&lock.key)
                    .key(&feed)
                    .arg(&fence_value)
                    .arg(&lock.token)
                    .arg(&bytes)
                    .arg(FEED_LEN)
                    .invoke(c)
            })?;
            if written != 1 {
                return Err(Error::Bus {
                    what: doc,
                    why: format!(
                        "the lock lapsed before the write (held over {} s); nothing was \
                         written",
                        LEASE.as_secs()
                    ),
                });
            }
        }
        Ok(out)
    }

    /// Makes `incarnation` the current one of member `name` (`epoch:NAME`), fenced by this
    /// process's own fence (a supervisor's host lease): from now on an older incarnation's
    /// worker is refused every write. Set before the worker process exists.
    pub fn set_member_epoch(&self, name: &str, incarnation: u64) -> Result<()> {
        let (fence, fence_value) = self.fence_args();
        let key = self.key(&format!("epoch:{name}"));
        self.with_conn("set a member's epoch", |c| {
            redis::Script::new(SET_EPOCH)
                .key(&fence)
                .key(&key)
                .arg(&fence_value)
                .arg(incarnation)
                .invoke::<i64>(c)
        })
        .map(drop)
    }

    /// Adds `key` to the team's change feed (a change that is not a document write: a host's
    /// stop, say).
    pub(crate) fn announce(&self, key: &str) -> Result<()> {
        let feed = self.key("changes");
        let key = self.key(key);
        self.with_conn("announce a change", |c| {
            redis::cmd("XADD")
                .arg(&feed)
                .arg("MAXLEN")
                .arg("~")
                .arg(FEED_LEN)
                .arg("*")
                .arg("k")
                .arg(&key)
                .query::<()>(c)
        })
    }
}

/// Whether stream id `a` (`MS-SEQ`) comes after `b`.
fn id_after(a: &str, b: &str) -> bool {
    let parse = |id: &str| {
        let (ms, seq) = id.split_once('-')?;
        Some((ms.parse::<u64>().ok()?, seq.parse::<u64>().ok()?))
    };
    match (parse(a), parse(b)) {
        (Some(a), Some(b)) => a > b,
        _ => true,
    }
}

impl RedisBus {
    /// The change feed's newest entry now, and the keys it names after entry `last` (`None`
    /// when it cannot tell: no `last`, or the feed no longer holds every entry after it).
    pub(crate) fn changes_after(
        &self,
        last: Option<&str>,
    ) -> Result<(Option<String>, Option<Vec<String>>)> {
        let feed = self.key("changes");
        let ends = |c: &mut redis::Connection, cmd: &str, from: &str, to: &str| {
            redis::cmd(cmd)
                .arg(&feed)
                .arg(from)
                .arg(to)
                .arg("COUNT")
                .arg(1)
                .query::<redis::Value>(c)
        };
        let newest = self.with_conn("read the change feed", |c| ends(c, "XREVRANGE", "+", "-"))?;
        let newest = super::inbox::first_id(&newest);
        let Some(last) = last else {
            return Ok((newest, None));
        };
        let oldest = self.with_conn("read the change feed", |c| ends(c, "XRANGE", "-", "+"))?;
        match super::inbox::first_id(&oldest) {
            Some(o) if !id_after(&o, last) => {}
            // Emptied (a server that lost its data) or trimmed past `last`.
            _ => return Ok((newest, None)),
        }
        let after = format!("({last}");
        let v: redis::Value = self.with_conn("read the change feed", |c| {
            redis::cmd("XRANGE")
                .arg(&feed)
                .arg(&after)
                .arg("+")
                .query(c)
        })?;
        let keys = super::inbox::range_entries(&v, "k")
            .into_iter()
            .filter_map(|(_, k)| k.map(|k| String::from_utf8_lossy(k).into_owned()))
            .collect();
        Ok((newest, Some(keys)))
    }
}

/// A follower of the team's change feed: [`ChangeFeed::wait`] returns when something changed
/// after the follower started (or after its last wait), or when `timeout` passes.
pub struct ChangeFeed {
    bus: RedisBus,
    last: String,
}

impl ChangeFeed {
    /// Follows the feed of `bus` from now on.
    pub fn new(bus: &RedisBus) -> ChangeFeed {
        ChangeFeed {
            bus: bus.clone(),
            last: "$".to_owned(),
        }
    }

    /// Blocks until a change or `timeout`; true on a change. A broken server is an error (the
    /// caller sleeps and tries again).
    pub fn wait(&mut self, timeout: Duration) -> Result<bool> {
        let feed = self.bus.key("changes");
        if self.last == "$" {
            // Pin the start now, so a change between this call and the read is not missed.
            let v: redis::Value = self.bus.with_conn("read the change feed", |c| {
                redis::cmd("XREVRANGE")
                    .arg(&feed)
                    .arg("+")
                    .arg("-")
                    .arg("COUNT")
                    .arg(1)
                    .query(c)
            })?;
            self.last = super::inbox::first_id(&v).unwrap_or_else(|| "0-0".to_owned());
        }
        let ms = timeout.as_millis().clamp(1, 60_000) as u64;
        let last = self.last.clone();
        let v: redis::Value = self.bus.with_conn("wait on the change feed", |c| {
            redis::cmd("XREAD")
                .arg("COUNT")
                .arg(FEED_LEN)
                .arg("BLOCK")
                .arg(ms)
                .arg("STREAMS")
                .arg(&feed)
                .arg(&last)
                .query(c)
        })?;
        match super::inbox::last_stream_id(&v) {
            Some(id) => {
                self.last = id;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// A [`ChangeFeed`] followed by a thread of its own, which writes a byte to a socket on every
/// change: a descriptor to `poll(2)` (see [`crate::store::watch`]). The thread ends once the
/// watch is dropped (its next write fails).
pub struct FeedWatch {
    rx: std::os::unix::net::UnixStream,
}

impl FeedWatch {
    pub fn new(bus: RedisBus) -> Result<FeedWatch> {
        let (rx, mut tx) = std::os::unix::net::UnixStream::pair()
            .map_err(Error::io("make a socket pair", "change feed"))?;
        rx.set_nonblocking(true)
            .map_err(Error::io("configure", "change feed"))?;
        std::thread::Builder::new()
            .name("change-feed".into())
            .spawn(move || {
                use std::io::Write;
                let mut feed = ChangeFeed::new(&bus);
                loop {
                    match feed.wait(Duration::from_secs(5)) {
                        Ok(true) => {
                            if tx.write(&[0]).is_err() {
                                return;
                            }
                        }
                        Ok(false) => {}
                        Err(_) => std::thread::sleep(Duration::from_millis(500)),
                    }
                }
            })
            .map_err(Error::io("spawn a thread", "change feed"))?;
        Ok(FeedWatch { rx })
    }

    pub fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.rx)
    }

    pub fn changed(&self) -> bool {
        use std::io::Read;
        let mut buf = [0u8; 256];
        let mut any = false;
        while let Ok(n) = (&self.rx).read(&mut buf) {
            if n == 0 {
                break;
            }
            any = true;
        }
        any
    }
}
