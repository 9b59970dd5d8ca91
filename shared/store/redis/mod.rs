//! The Redis backend of the store ([`crate::store`]): the team's shared state on a Redis 7 (or Valkey)
//! server, so that teammates on several machines (hosts) share one team.
//!
//! A bus is named by a URL, `redis://[USER@]HOST[:PORT][/DB][?team=NAME]` (or `rediss://`),
//! in `TROUPE_BUS` (`lead --bus` sets it for itself and the workers it starts); a
//! [`crate::TeamDir`] made while it is set keeps there what every host must see: the inboxes
//! ([`RedisInbox`]), the roster, each request and each task (documents, changed under a lock of
//! their own: `doc`), the events (a capped stream), the change feed supervisors wake on,
//! and the hosts' leases ([`hosts`]). What only the member's own host needs stays in its team
//! dir: transcripts (the consumers' journals), logs, set-aside lines, worktrees.
//!
//! The password is never part of the URL: a URL with one is
//! refused, so that it cannot end up in a shell history, a process list or a unit file. It is
//! read, in this order, from the file `TROUPE_BUS_PASSWORD_FILE` names, from the systemd
//! credential `troupe-bus-password` (`$CREDENTIALS_DIRECTORY`), or from `TROUPE_BUS_PASSWORD`;
//! a bus without one is refused too, because agents' tools can reach the server's port and the
//! password is what keeps them from forging approvals or wiping inboxes. Nothing here writes it
//! anywhere; [`RedisBus`]'s `Debug` and every error leave it out.
//!
//! Keys are `troupe:{TEAM}:...`, so teams can share a server.

mod doc;
pub mod hosts;
mod inbox;
pub mod lease;

pub use doc::{BusLock, ChangeFeed, FEED_LEN, FeedWatch, LEASE};
pub use inbox::{RedisInbox, RedisWaiter};

use std::fmt;
use std::time::Duration;

use redis::IntoConnectionInfo;

use crate::error::{Error, Result};

pub use crate::secrets::BUS_CREDENTIAL as CREDENTIAL;
pub use crate::secrets::{
    BUS_ENV, BUS_PASSWORD_ENV as PASSWORD_ENV, BUS_PASSWORD_FILE_ENV as PASSWORD_FILE_ENV,
};

/// A Redis bus: where it is, as whom, for which team.
#[derive(Clone)]
pub struct RedisBus {
    info: redis::ConnectionInfo,
    /// The URL as given (it holds no password).
    url: String,
    team: String,
    /// Idle connections, shared by clones (a process keeps a few open rather than connecting
    /// and authenticating per message).
    pool: std::sync::Arc<std::sync::Mutex<Vec<redis::Connection>>>,
    /// What this process's writes are fenced by, once it acts for a member, a host or the
    /// lead's inbox (shared by clones: one process, one identity).
    fence: std::sync::Arc<std::sync::RwLock<Option<Fence>>>,
    /// The server refused a write of this process as fenced off: a newer holder replaced it.
    replaced: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// A condition the server checks inside every script that writes for this process: the key
/// `key` holds `value`. A member's worker is fenced by `epoch:NAME` holding its incarnation; a
/// supervisor and the lead's inbox consumer by their lease's epoch record (`EPOCH:TOKEN`). A
/// newer holder changes the key, and the older one's writes are refused with `FENCED
/// <current>` ([`Error::Fenced`]). A key that is gone (a server restarted without its data, a
/// key deleted by hand) refuses too, with `UNFENCED` ([`Error::Unfenced`]): nothing says then
/// that this process is still the current holder, and passing would let every stale process
/// write until the next incarnation. Who set the key sets it again: a lease's holder at its
/// next renewal ([`lease`]), a member's supervisor when it starts the member's next
/// incarnation (the worker refused ends, and is restarted: see [`crate::fence`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fence {
    key: String,
    value: String,
    /// Who the process acts as, for messages ("member alice, incarnation 3").
    holder: String,
}

/// The first lines of every fenced script: KEYS[1] is the fence's key and ARGV[1] its value
/// (empty: not fenced, a process that acts for no member or host). Refuses with `FENCED
/// <current value>`, or `UNFENCED <key>` when the key is gone (a word alone would not be
/// read as an error code). The same decision as [`refusal`],
/// taken on the server.
macro_rules! fenced_script {
    ($body:literal) => {
        concat!(
            "if ARGV[1] ~= '' then\n",
            "  local cur = redis.call('GET', KEYS[1])\n",
            "  if not cur then\n",
            "    return redis.error_reply('UNFENCED ' .. KEYS[1])\n",
            "  end\n",
            "  if cur ~= ARGV[1] then\n",
            "    return redis.error_reply('FENCED ' .. cur)\n",
            "  end\n",
            "end\n",
            $body
        )
    };
}
pub(crate) use fenced_script;

/// Why a fence refuses a write (see [`Fence`]).
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// The key holds another value: a newer holder replaced this process.
    Stale(String),
    /// The key is gone.
    Missing,
}

/// Whether a process fenced by `value` (empty: not fenced) may write while its fence's key
/// holds `current` (`None`: gone). The fenced scripts decide the same on the server; a read
/// that checks its fence itself (an inbox drain's) asks this.
fn refusal(value: &str, current: Option<&str>) -> Option<Refusal> {
    match current {
        _ if value.is_empty() => None,
        None => Some(Refusal::Missing),
        Some(cur) if cur != value => Some(Refusal::Stale(cur.to_owned())),
        Some(_) => None,
    }
}

/// Idle connections kept per bus.
const POOL_MAX: usize = 8;

impl fmt::Debug for RedisBus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBus")
            .field("url", &self.url)
            .field("team", &self.team)
            .finish_non_exhaustive()
    }
}

fn bad(what: &str, why: impl Into<String>) -> Error {
    Error::Bus {
        what: what.to_owned(),
        why: why.into(),
    }
}

impl RedisBus {
    /// The bus at `url`, with its password from the places the module docs list.
    pub fn from_url(url: &str) -> Result<RedisBus> {
        let password = password_from_env()?;
        RedisBus::with_password(url, &password)
    }

    /// The bus at `url` with an explicit password (tests, and callers that read it elsewhere).
    pub fn with_password(url: &str, password: &str) -> Result<RedisBus> {
        let (base, team) = parse_url(url)?;
        if password.is_empty() {
            return Err(bad(
                "password",
                format!(
                    "a Redis bus needs a password (an ACL user's): put it in a file named by \
                     {PASSWORD_FILE_ENV}, in the systemd credential {CREDENTIAL}, or in \
                     {PASSWORD_ENV}"
                ),
            ));
        }
        let info = base
            .as_str()
            .into_connection_info()
            .map_err(|e| bad(url, format!("not a Redis URL: {e}")))?;
        let settings = info.redis_settings().clone().set_password(password);
        Ok(RedisBus {
            info: info.set_redis_settings(settings),
            url: url.to_owned(),
            team,
            pool: Default::default(),
            fence: Default::default(),
            replaced: Default::default(),
        })
    }

    /// The same server, for another team (keys apart).
    pub fn for_team(&self, team: &str) -> Result<RedisBus> {
        if !valid_team(team) {
            return Err(bad(team, "team names use 1-64 of a-z, 0-9, '-', '_'"));
        }
        Ok(RedisBus {
            team: team.to_owned(),
            fence: Default::default(),
            replaced: Default::default(),
            ..self.clone()
        })
    }

    /// The URL as given.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The team's name on the server.
    pub fn team(&self) -> &str {
        &self.team
    }

    /// A key of this team: `troupe:{TEAM}:` and `rest`.
    pub fn key(&self, rest: &str) -> String {
        format!("troupe:{{{}}}:{rest}", self.team)
    }

    /// From now on, every write of this process (clones of this bus included) is fenced by
    /// `fence` (see [`Fence`]).
    pub fn set_fence(&self, fence: Fence) {
        *self.fence.write().unwrap_or_else(|p| p.into_inner()) = Some(fence);
    }

    /// The fence of a member's incarnation: the key `epoch:NAME` holds it.
    pub fn member_fence(&self, name: &str, incarnation: u64) -> Fence {
        Fence {
            key: self.key(&format!("epoch:{name}")),
            value: incarnation.to_string(),
            holder: format!("member {name}, incarnation {incarnation}"),
        }
    }

    /// The fence key and value a fenced script takes first (an unused key and an empty value
    /// when this process is not fenced).
    pub(crate) fn fence_args(&self) -> (String, String) {
        match &*self.fence.read().unwrap_or_else(|p| p.into_inner()) {
            Some(f) => (f.key.clone(), f.value.clone()),
            None => (self.key("epoch:-"), String::new()),
        }
    }

    /// Whether the server has refused a write of this process because a newer holder of its
    /// fence replaced it (it stays replaced).
    pub fn replaced(&self) -> bool {
        self.replaced.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The refusal of a fenced write, with what the server said is current.
    fn fenced(&self, current: &str) -> Error {
        self.replaced
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let holder = self
            .fence
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map_or_else(|| "this process".to_owned(), |f| f.holder.clone());
        Error::Fenced {
            holder,
            current: current.to_owned(),
        }
    }

    /// The refusal of a fenced write whose fence key is gone. Unlike [`RedisBus::fenced`] it
    /// does not mark the process replaced: a lease's holder sets its key again at its next
    /// renewal and carries on.
    fn unfenced(&self) -> Error {
        let fence = self.fence.read().unwrap_or_else(|p| p.into_inner());
        let (holder, key) = match fence.as_ref() {
            Some(f) => (f.holder.clone(), f.key.clone()),
            None => ("this process".to_owned(), String::new()),
        };
        Error::Unfenced { holder, key }
    }

    /// The error for `refusal`.
    fn refused(&self, refusal: Refusal) -> Error {
        match refusal {
            Refusal::Stale(current) => self.fenced(&current),
            Refusal::Missing => self.unfenced(),
        }
    }

    /// An idle connection of this process, or a new one.
    pub(crate) fn take(&self) -> Result<redis::Connection> {
        let idle = self.pool.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(c) => Ok(c),
            None => self.connect(Duration::from_secs(5)),
        }
    }

    /// Gives back a connection that is in a clean state (no reply pending).
    pub(crate) fn give_back(&self, c: redis::Connection) {
        let mut pool = self.pool.lock().unwrap_or_else(|p| p.into_inner());
        if pool.len() < POOL_MAX {
            pool.push(c);
        }
    }

    /// Drops every idle connection (after one broke: the others most likely did too, with the
    /// server that went away).
    pub(crate) fn clear_pool(&self) {
        self.pool.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Runs `f` on a connection of the pool (opening one if needed); a failed call drops the
    /// pool (the next call opens a new connection) and is retried once when it failed on the
    /// connection itself, not on what the server said. So `f` must be safe to run twice.
    pub(crate) fn with_conn<T>(
        &self,
        what: &str,
        mut f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T> {
        for attempt in 0..2 {
            let mut conn = self.take()?;
            match f(&mut conn) {
                Ok(v) => {
                    self.give_back(conn);
                    return Ok(v);
                }
                Err(e) if e.code() == Some("FENCED") => {
                    self.give_back(conn);
                    return Err(self.fenced(e.detail().unwrap_or("").trim()));
                }
                Err(e) if e.code() == Some("UNFENCED") => {
                    self.give_back(conn);
                    return Err(self.unfenced());
                }
                Err(e) => {
                    // The server's own refusals leave the connection usable; anything else
                    // drops it (the next call opens a new one).
                    let broken = e.is_io_error() || e.is_connection_dropped() || e.is_timeout();
                    if broken {
                        self.clear_pool();
                    } else {
                        self.give_back(conn);
                    }
                    if attempt == 1 || !broken {
                        return Err(bad(what, e.to_string()));
                    }
                }
            }
        }
        unreachable!("two attempts")
    }

    /// A new connection (authenticated), with `timeout` for connecting.
    pub fn connect(&self, timeout: Duration) -> Result<redis::Connection> {
        let client =
            redis::Client::open(self.info.clone()).map_err(|e| bad(&self.url, e.to_string()))?;
        client
            .get_connection_with_timeout(timeout)
            .map_err(|e| bad(&self.url, format!("cannot connect: {e}")))
    }
}

/// Events kept in the team's event stream (approximately: `MAXLEN ~`); the file log is never
/// trimmed, but a server's memory is not a disk.
pub const EVENTS_LEN: u64 = 100_000;

/// KEYS: fence, the event stream. ARGV: fence value, the stream's cap, the event line.
const EVENT: &str = fenced_script!(
    r"
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'e', ARGV[3])
return 1
"
);

static EVENT_SCRIPT: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(EVENT));

/// Appends one event line (a JSON object) to the stream `troupe:{TEAM}:events`, fenced: a
/// process replaced while it was stalled adds nothing that `lead watch` or `lead trace` would
/// show.
pub(crate) fn log_event(bus: &RedisBus, line: &[u8]) -> Result<()> {
    let key = bus.key("events");
    let (fence, fence_value) = bus.fence_args();
    bus.with_conn("log an event", |c| {
        EVENT_SCRIPT
            .key(&fence)
            .key(&key)
            .arg(&fence_value)
            .arg(EVENTS_LEN)
            .arg(line)
            .invoke::<i64>(c)
    })
    .map(drop)
}

/// A position in the event stream as the stream id it stands for, `MS-SEQ` (see
/// [`read_events`]).
fn stream_id(pos: u64) -> String {
    format!("{}-{}", pos / 1_000_000, pos % 1_000_000)
}

/// The position of stream id `MS-SEQ`.
fn position(id: &str) -> Option<u64> {
    let (ms, seq) = id.split_once('-')?;
    Some(ms.parse::<u64>().ok()? * 1_000_000 + seq.parse::<u64>().ok()?)
}

/// The event lines after position `after` (0: from the first) up to position `until` (`None`:
/// the end), at most `max` of them (one `XRANGE ... COUNT`), and the position of the last one
/// read (or `after`). A position is the entry's stream id `MS-SEQ` as `MS * 1,000,000 + SEQ`
/// (a million events in one millisecond would be needed to confuse two); the events after
/// position `p` are those of ids above `p`'s, those before it the others.
pub(crate) fn read_events(
    bus: &RedisBus,
    after: u64,
    until: Option<u64>,
    max: usize,
) -> Result<(Vec<Vec<u8>>, u64)> {
    let key = bus.key("events");
    let start = if after == 0 {
        "-".to_owned()
    } else {
        format!("({}", stream_id(after))
    };
    let end = until.map_or_else(|| "+".to_owned(), stream_id);
    if until.is_some_and(|u| u <= after) || max == 0 {
        return Ok((Vec::new(), after));
    }
    let v: redis::Value = bus.with_conn("read events", |c| {
        let mut cmd = redis::cmd("XRANGE");
        cmd.arg(&key).arg(&start).arg(&end);
        if max < usize::MAX {
            cmd.arg("COUNT").arg(max);
        }
        cmd.query(c)
    })?;
    let mut last = after;
    let mut lines = Vec::new();
    for (id, line) in inbox::range_entries(&v, "e") {
        if let Some(p) = position(id) {
            last = p;
        }
        if let Some(l) = line {
            lines.push(l.to_vec());
        }
    }
    Ok((lines, last))
}

/// Up to `n` event lines before position `before` (`None`: the stream's end), oldest first,
/// with one `XREVRANGE ... COUNT n`: what is older is not sent.
pub(crate) fn read_events_back(
    bus: &RedisBus,
    before: Option<u64>,
    n: usize,
) -> Result<crate::store::EventsBack> {
    let key = bus.key("events");
    if n == 0
        && let Some(to) = before
    {
        return Ok(crate::store::EventsBack {
            lines: Vec::new(),
            from: to,
            to,
            at_start: to == 0,
        });
    }
    let end = before.map_or_else(|| "+".to_owned(), stream_id);
    let count = n.max(1);
    let v: redis::Value = bus.with_conn("read events", |c| {
        redis::cmd("XREVRANGE")
            .arg(&key)
            .arg(&end)
            .arg("-")
            .arg("COUNT")
            .arg(count)
            .query(c)
    })?;
    let entries = inbox::range_entries(&v, "e");
    let newest = entries.first().and_then(|(id, _)| position(id));
    let to = before.or(newest).unwrap_or(0);
    if n == 0 {
        return Ok(crate::store::EventsBack {
            lines: Vec::new(),
            from: to,
            to,
            at_start: newest.is_none(),
        });
    }
    let at_start = entries.len() < count;
    let oldest = entries.last().and_then(|(id, _)| position(id));
    let lines = entries
        .iter()
        .rev()
        .filter_map(|(_, l)| l.map(<[u8]>::to_vec))
        .collect();
    Ok(crate::store::EventsBack {
        lines,
        from: if at_start {
            0
        } else {
            oldest.map_or(to, |p| p - 1)
        },
        to,
        at_start,
    })
}

/// Splits the team name off a bus URL and refuses one that carries a password or is not Redis.
fn parse_url(url: &str) -> Result<(String, String)> {
    let rest = url
        .strip_prefix("redis://")
        .or_else(|| url.strip_prefix("rediss://"))
        .ok_or_else(|| {
            bad(
                url,
                "expected redis://HOST[:PORT][/DB][?team=NAME] or rediss://",
            )
        })?;
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    if let Some((userinfo, _)) = authority.rsplit_once('@')
        && userinfo.contains(':')
    {
        return Err(bad(
            "URL",
            format!(
                "it holds a password, which would show in process lists and shell histories; \
                 give the password in a file ({PASSWORD_FILE_ENV}), a systemd credential \
                 ({CREDENTIAL}) or {PASSWORD_ENV} instead"
            ),
        ));
    }
    let mut team = "default".to_owned();
    for pair in query.into_iter().flat_map(|q| q.split('&')) {
        match pair.split_once('=') {
            Some(("team", t)) if valid_team(t) => team = t.to_owned(),
            Some(("team", t)) => {
                return Err(bad(
                    url,
                    format!("team name {t:?}: use 1-64 of a-z, 0-9, '-', '_'"),
                ));
            }
            _ => {
                return Err(bad(
                    url,
                    format!("unknown parameter {pair:?} (only team=NAME)"),
                ));
            }
        }
    }
    Ok((base.to_owned(), team))
}

fn valid_team(t: &str) -> bool {
    (1..=64).contains(&t.len())
        && t.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// The password from the file, the systemd credential or the environment (in that order).
fn password_from_env() -> Result<String> {
    let first_line = |text: String| text.lines().next().unwrap_or("").trim_end().to_owned();
    if let Some(path) = std::env::var_os(PASSWORD_FILE_ENV) {
        let text = std::fs::read_to_string(&path).map_err(|e| {
            bad(
                "password",
                format!(
                    "cannot read {PASSWORD_FILE_ENV} ({}): {e}",
                    path.to_string_lossy()
                ),
            )
        })?;
        return Ok(first_line(text));
    }
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        let path = std::path::Path::new(&dir).join(CREDENTIAL);
        if let Ok(text) = std::fs::read_to_string(path) {
            return Ok(first_line(text));
        }
    }
    Ok(std::env::var(PASSWORD_ENV).unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_with_a_password_are_refused_and_the_team_is_read() {
        for url in [
            "redis://:secret@localhost:6379",
            "redis://troupe:secret@localhost/0?team=a",
            "rediss://u:p@h",
        ] {
            let e = RedisBus::with_password(url, "pw").unwrap_err().to_string();
            assert!(e.contains("holds a password"), "{url}: {e}");
            assert!(!e.contains("secret"), "{e}");
        }
        let b = RedisBus::with_password("redis://troupe@127.0.0.1:7000/2?team=blue", "pw").unwrap();
        assert_eq!(b.team(), "blue");
        assert_eq!(b.key("inbox:alice"), "troupe:{blue}:inbox:alice");
        assert_eq!(b.info.redis_settings().username(), Some("troupe"));
        assert_eq!(b.info.redis_settings().db(), 2);
        assert!(!format!("{b:?}").contains("pw"));
        let d = RedisBus::with_password("redis://127.0.0.1", "pw").unwrap();
        assert_eq!(d.team(), "default");
        for url in ["http://x", "redis://h?team=Bad!", "redis://h?db=1"] {
            assert!(RedisBus::with_password(url, "pw").is_err(), "{url}");
        }
        let e = RedisBus::with_password("redis://h", "")
            .unwrap_err()
            .to_string();
        assert!(e.contains("needs a password"), "{e}");
    }

    #[test]
    fn a_fence_refuses_a_stale_or_missing_key_and_an_unfenced_process_passes() {
        assert_eq!(refusal("3", Some("3")), None);
        assert_eq!(refusal("3", Some("4")), Some(Refusal::Stale("4".into())));
        assert_eq!(refusal("3", None), Some(Refusal::Missing));
        // Not fenced (a person's `lead send`): whatever the key holds, or none.
        assert_eq!(refusal("", None), None);
        assert_eq!(refusal("", Some("4")), None);
    }

    #[test]
    fn a_missing_key_does_not_mark_the_process_replaced() {
        let b = RedisBus::with_password("redis://127.0.0.1", "pw").unwrap();
        b.set_fence(b.member_fence("ann", 2));
        let e = b.refused(Refusal::Missing);
        assert!(
            matches!(&e, Error::Unfenced { key, .. } if key == "troupe:{default}:epoch:ann"),
            "{e}"
        );
        assert!(!b.replaced());
        let e = b.refused(Refusal::Stale("3".into()));
        assert!(
            matches!(&e, Error::Fenced { current, .. } if current == "3"),
            "{e}"
        );
        assert!(b.replaced());
    }
}
