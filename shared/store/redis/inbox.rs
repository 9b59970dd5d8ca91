//! An inbox on Redis Streams: the same guarantees as the file inbox (a message acknowledged to
//! its sender is consumed exactly once across `kill -9` of anyone; back-pressure refuses, it
//! never drops), on a server several machines share.
//!
//! - **Keys**: the stream `troupe:{TEAM}:inbox:NAME`, one entry per message (field `m`, the
//!   message's JSON line; field `o`, the bytes appended to the inbox up to and with this entry);
//!   `troupe:{TEAM}:inbox:NAME:consumed` holds the `o` of the last entry consumed.
//! - **Append**: one Lua script reads the last entry's `o` and the consumed offset (reads: not
//!   in the AOF), refuses if their difference (the bytes not consumed yet, exactly) and the line
//!   pass the cap, else adds the entry: one write per message. A refused message is not
//!   written. No `MAXLEN`: a stream is never trimmed. (An entry without `o`, written by hand or
//!   by an older troupe, counts for nothing against the cap.)
//! - **Drain**: reads the stream's entries (`XRANGE`, a read: nothing in the AOF), from the
//!   start when this process has not drained yet or its last drain failed, else after the last
//!   entry its drain read (consumed entries are deleted, so what the stream holds is exactly
//!   what is not consumed yet, but for a batch journaled and not yet marked); sets bad entries
//!   aside; records the new messages in the consumer's journal (fsynced; ids it holds already
//!   are skipped); then one Lua script deletes the batch (one `XDEL`) and raises the consumed
//!   offset to the batch's last `o` (a maximum: a script run twice after a lost reply changes
//!   nothing more): one write per drain batch. The inbox has one consumer at a time (the
//!   journal's owner lock on a host, the member's epoch across hosts), so no consumer group
//!   is kept: its pending list made every read a write too (an `XCLAIM` per entry in the
//!   AOF), where the journal already holds what a read delivered. The read and the mark are
//!   fenced by the consumer's epoch ([`super::Fence`]): the read is an `XRANGE` and then a `GET`
//!   of the fence in one round trip, checked by the reader, the mark a script that checks it
//!   on the server (a fence key that is gone refuses both). A worker whose member a newer
//!   incarnation runs (a successor on another host) is refused both, and a batch it read just
//!   before the successor began is taken out of its journal again when the mark is refused,
//!   so it is consumed once, by the successor (which reads it: it was not deleted). Crash
//!   points ([`crate::inbox::DrainPoint`]): killed after the read, or after the journal, the
//!   entries are still in the stream and the next drain (a new process's first) reads them
//!   again, the journal skipping them by id; the mark script is all or nothing.
//! - **Wait**: a blocking `XREAD` after the last id this process's drain read (an entry after it
//!   is not consumed yet, so it wakes the read at once); before a first drain, or after a
//!   failed one, from `0-0`: any entry the stream holds is not consumed yet (or was journaled
//!   and not marked, which the next drain marks), and a missing stream blocks the read until
//!   its first entry. In slices of at most 50 ms so that the caller's own descriptors (a
//!   signal pipe) are looked at too.
//!
//! Connections come from the bus's pool and go back to it; one that failed is dropped.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use redis::Value;
use serde_json::json;

use super::RedisBus;
use crate::error::{Error, Result};
use crate::message::Message;
use crate::store::{DEFAULT_CAP, DrainPoint, Wake};
use crate::teamdir::{AgentName, TeamDir};
use crate::transcript::Journal;

/// Entries read per `XRANGE`.
const BATCH: usize = 10_000;
/// The longest a blocking read lasts before the caller's descriptors are looked at.
const WAIT_SLICE: Duration = Duration::from_millis(50);
/// The least time from one drain's mark to the next drain of a busy inbox (see
/// [`drain_hold`]).
const DRAIN_GAP: Duration = Duration::from_millis(2);

/// KEYS: fence, stream, consumed offset. ARGV: fence value, line, its length, cap. The bytes
/// not consumed are the last entry's `o` less the consumed offset. Refuses with `FULL <bytes>`.
const APPEND: &str = super::fenced_script!(
    r"
local done = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
local top = done
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if last then
  local f = last[2]
  for i = 1, #f, 2 do
    if f[i] == 'o' then top = tonumber(f[i + 1]) or done end
  end
end
if top < done then top = done end
local used = top - done
local len = tonumber(ARGV[3])
if used + len > tonumber(ARGV[4]) then
  return redis.error_reply('FULL ' .. string.format('%d', used))
end
redis.call('XADD', KEYS[2], '*', 'm', ARGV[2], 'o', string.format('%d', top + len))
return used + len
"
);

/// KEYS: fence, stream, consumed offset. ARGV: fence value, the batch's last `o` (0: none),
/// then the entry ids. Deletes the entries (in slices: Lua's `unpack` is limited) and raises
/// the consumed offset: run again (a reply lost with the connection), it changes nothing more.
/// Refused to a replaced incarnation.
const MARK: &str = super::fenced_script!(
    r"
for i = 3, #ARGV, 1000 do
  local j = math.min(i + 999, #ARGV)
  redis.call('XDEL', KEYS[2], unpack(ARGV, i, j))
end
if tonumber(ARGV[2]) > (tonumber(redis.call('GET', KEYS[3]) or '0') or 0) then
  redis.call('SET', KEYS[3], ARGV[2])
end
return 0
"
);

/// What a drain leaves for the next one and for the waiter, shared by an inbox and its
/// waiters.
#[derive(Debug)]
struct DrainState {
    /// The last entry id a drain of this process read and marked: every entry the stream
    /// holds after it is not consumed yet, and every one up to it is deleted. `None` in a new
    /// process (its predecessor may have died between a journal and its mark) and after a
    /// failed drain: the next drain reads from the stream's start, and the waiter from `0-0`.
    last_read: Option<String>,
    /// When this process's last drain marked a batch.
    marked_at: Option<Instant>,
}

/// An inbox on a Redis bus.
pub struct RedisInbox {
    bus: RedisBus,
    team: TeamDir,
    name: AgentName,
    stream: String,
    /// The key of the consumed offset.
    consumed: String,
    cap: u64,
    state: std::sync::Arc<std::sync::Mutex<DrainState>>,
    append: redis::Script,
    mark: redis::Script,
}

impl std::fmt::Debug for RedisInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisInbox")
            .field("bus", &self.bus)
            .field("stream", &self.stream)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

impl RedisInbox {
    /// The inbox of `name` on `bus`; `team` is the local team dir (events, bad entries set
    /// aside).
    pub fn new(bus: &RedisBus, team: &TeamDir, name: &AgentName) -> RedisInbox {
        let stream = bus.key(&format!("inbox:{name}"));
        RedisInbox {
            bus: bus.clone(),
            team: team.clone(),
            name: name.clone(),
            consumed: format!("{stream}:consumed"),
            stream,
            cap: DEFAULT_CAP,
            state: std::sync::Arc::new(std::sync::Mutex::new(DrainState {
                last_read: None,
                marked_at: None,
            })),
            append: redis::Script::new(APPEND),
            mark: redis::Script::new(MARK),
        }
    }

    /// Sets the cap in bytes.
    pub fn with_cap(mut self, cap: u64) -> RedisInbox {
        self.cap = cap;
        self
    }

    /// The owner's name.
    pub fn name(&self) -> &AgentName {
        &self.name
    }

    fn with_conn<T>(
        &self,
        what: &str,
        f: impl FnMut(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T> {
        self.bus.with_conn(what, f)
    }

    fn state(&self) -> std::sync::MutexGuard<'_, DrainState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends one message: refused if it is too large or the inbox is at its cap, and then
    /// nothing is written. Durable as the server's `appendfsync` makes it.
    pub fn append(&self, msg: &Message) -> Result<()> {
        self.append_line(&msg.to_line()?)
    }

    /// Appends one serialized message line (its `\n` may end it or not).
    pub fn append_line(&self, line: &[u8]) -> Result<()> {
        let line = line.strip_suffix(b"\n").unwrap_or(line);
        let len = line.len() as u64;
        let (fence, fence_value) = self.bus.fence_args();
        // Ok(Err(bytes)) is the script's refusal: the inbox holds `bytes` already.
        let r = self.with_conn("append", |c| {
            match self
                .append
                .key(&fence)
                .key(&self.stream)
                .key(&self.consumed)
                .arg(&fence_value)
                .arg(line)
                .arg(len)
                .arg(self.cap)
                .invoke::<i64>(c)
            {
                Ok(_) => Ok(Ok(())),
                Err(e) if e.code() == Some("FULL") => Ok(Err(e
                    .detail()
                    .and_then(|d| d.trim().parse().ok())
                    .unwrap_or(self.cap))),
                Err(e) => Err(e),
            }
        })?;
        r.map_err(|size| Error::InboxFull {
            name: self.name.to_string(),
            size,
            cap: self.cap,
        })
    }

    /// Bytes not consumed yet: the last entry's `o` less the consumed offset.
    pub fn len(&self) -> Result<u64> {
        let (last, done): (Value, Option<u64>) = self.with_conn("read inbox size", |c| {
            redis::pipe()
                .cmd("XREVRANGE")
                .arg(&self.stream)
                .arg("+")
                .arg("-")
                .arg("COUNT")
                .arg(1)
                .cmd("GET")
                .arg(&self.consumed)
                .query(c)
        })?;
        let done = done.unwrap_or(0);
        let top = range_fields(&last)
            .first()
            .and_then(|e| e.offset)
            .unwrap_or(done);
        Ok(top.saturating_sub(done))
    }

    /// How many entries wait (consumed entries are deleted; a batch journaled and not yet
    /// marked still counts).
    pub fn depth(&self) -> Result<u64> {
        self.with_conn("read inbox length", |c| {
            redis::cmd("XLEN").arg(&self.stream).query::<u64>(c)
        })
    }

    /// Whether no entry waits (consumed entries are deleted).
    pub fn is_empty(&self) -> Result<bool> {
        self.with_conn("read inbox length", |c| {
            redis::cmd("XLEN").arg(&self.stream).query::<u64>(c)
        })
        .map(|n| n == 0)
    }

    /// The messages waiting, without consuming them. Bad entries are skipped.
    pub fn peek(&self) -> Result<Vec<Message>> {
        let v: Value = self.with_conn("peek", |c| {
            redis::cmd("XRANGE")
                .arg(&self.stream)
                .arg("-")
                .arg("+")
                .query(c)
        })?;
        Ok(entries(&v)
            .into_iter()
            .filter_map(|(_, line)| Message::parse_line(line?).ok())
            .collect())
    }

    /// Drains into `journal`, returning the messages new to it (see the module docs).
    pub fn drain(&self, journal: &mut Journal) -> Result<Vec<Message>> {
        self.drain_with(journal, |_, _| {})
    }

    /// [`RedisInbox::drain`] with a hook at each crash point (tests die there).
    pub fn drain_with(
        &self,
        journal: &mut Journal,
        mut at: impl FnMut(DrainPoint, &[Message]),
    ) -> Result<Vec<Message>> {
        let r = self.drain_batches(journal, &mut at);
        if r.is_err() {
            // Whatever this drain read and did not mark stays pending: the next one reads it,
            // and the waiter looks at the stream's length until then.
            self.state().last_read = None;
        }
        r
    }

    fn drain_batches(
        &self,
        journal: &mut Journal,
        at: &mut impl FnMut(DrainPoint, &[Message]),
    ) -> Result<Vec<Message>> {
        let (fence, fence_value) = self.bus.fence_args();
        let mut fresh = Vec::new();
        loop {
            let start = match self.state().last_read.as_deref() {
                Some(id) => format!("({id}"),
                None => "-".to_owned(),
            };
            // The entries, then the fence, in one round trip (reads: nothing of it reaches the
            // AOF), the fence checked here: still this incarnation's after the XRANGE, it was
            // before, so the read came before any successor's. Not a script: a script's reply
            // is every entry copied into Lua and back, which cost more than the rest of the
            // drain (84 us against 13 for a plain XRANGE of 40 entries).
            let (v, current): (Value, Option<String>) = self.with_conn("drain", |c| {
                redis::pipe()
                    .cmd("XRANGE")
                    .arg(&self.stream)
                    .arg(&start)
                    .arg("+")
                    .arg("COUNT")
                    .arg(BATCH)
                    .cmd("GET")
                    .arg(&fence)
                    .query(c)
            })?;
            if let Some(r) = super::refusal(&fence_value, current.as_deref()) {
                return Err(self.bus.refused(r));
            }
            let batch = range_fields(&v);
            let n = batch.len();
            if n == 0 {
                break;
            }
            at(DrainPoint::Read, &fresh);
            let before = journal.end()?;
            let kept = fresh.len();
            fresh.extend(self.consume(&batch, journal)?);
            at(DrainPoint::Journaled, &fresh);
            let upto = batch.iter().filter_map(|e| e.offset).max().unwrap_or(0);
            let marked = self.with_conn("mark consumed", |c| {
                let mut call = self.mark.key(&fence);
                call.key(&self.stream)
                    .key(&self.consumed)
                    .arg(&fence_value)
                    .arg(upto);
                for e in &batch {
                    call.arg(e.id);
                }
                call.invoke::<i64>(c)
            });
            if let Err(e @ (Error::Fenced { .. } | Error::Unfenced { .. })) = marked {
                // A newer incarnation took over between the read and the mark (or the fence
                // key went, and the next incarnation may run on another host): these entries
                // are its to consume (they are still in the stream, and it reads them), so
                // they are taken out of this journal again.
                journal.undo_inbox(before, fresh[kept..].iter().map(|m| m.id.as_str()))?;
                return Err(e);
            }
            marked?;
            at(DrainPoint::Marked, &fresh);
            let mut s = self.state();
            // XRANGE gives the entries in id order: the batch's last is its greatest.
            s.last_read = batch.last().map(|e| e.id.to_owned());
            s.marked_at = Some(Instant::now());
            drop(s);
            if n < BATCH {
                break;
            }
        }
        Ok(fresh)
    }

    /// Parses a batch, sets bad entries aside and journals the new messages; returns them.
    fn consume(&self, batch: &[Entry<'_>], journal: &mut Journal) -> Result<Vec<Message>> {
        let mut parsed: Vec<(&[u8], Message)> = Vec::with_capacity(batch.len());
        let mut bad = Vec::new();
        for Entry { id, line, .. } in batch {
            // An entry without its field was deleted under a pending read: nothing to deliver.
            let Some(line) = *line else { continue };
            match Message::parse_line(line) {
                Ok(m) => parsed.push((line, m)),
                Err(why) => bad.push(json!({
                    "entry": id,
                    "reason": why,
                    "line": String::from_utf8_lossy(line),
                })),
            }
        }
        if !bad.is_empty() {
            // In the local `inbox/NAME.corrupt.jsonl`, as the file inbox does.
            crate::store::files::aside::set_aside(
                &self.team,
                &self.name,
                bad,
                json!({"bus": "redis"}),
            )?;
        }
        journal.append_inbox_messages(parsed)
    }

    /// Removes the inbox's keys (its stream, group and consumed offset): for throwaway inboxes.
    pub fn destroy(&self) -> Result<()> {
        self.with_conn("remove inbox", |c| {
            redis::cmd("DEL")
                .arg(&self.stream)
                .arg(&self.consumed)
                .query::<()>(c)
        })
    }

    /// A waiter for this inbox, on a connection of its own (a blocking read holds it).
    pub fn waiter(&self) -> Result<RedisWaiter> {
        Ok(RedisWaiter {
            inbox: RedisInbox {
                state: self.state.clone(),
                ..RedisInbox::new(&self.bus, &self.team, &self.name)
            },
        })
    }
}

/// Blocks until a Redis inbox holds an entry (see the module docs).
#[derive(Debug)]
pub struct RedisWaiter {
    /// The inbox, sharing its drain state with the one it was made from.
    inbox: RedisInbox,
}

impl RedisWaiter {
    /// As [`crate::wait::InboxWaiter::wait`]: returns at once if the inbox holds an entry,
    /// but for a busy inbox's group commit: woken within [`DRAIN_GAP`] of the last drain's
    /// mark, it returns that long after the mark ([`drain_hold`]), watching the caller's
    /// descriptors meanwhile.
    ///
    /// A bus that cannot be reached (a server restarting, a network cut) does not end the
    /// wait: it is tried again with a backoff from 100 ms to 2 s, the caller's descriptors
    /// still watched, and a warning logged once per outage.
    pub fn wait(&mut self, timeout: Option<Duration>, extra: &[BorrowedFd<'_>]) -> Result<Wake> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut backoff = Duration::ZERO;
        loop {
            let remaining = match deadline {
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(r) if !r.is_zero() => Some(r),
                    _ => return Ok(Wake::Timeout),
                },
                None => None,
            };
            match self.look(remaining.map_or(WAIT_SLICE, |r| r.min(WAIT_SLICE))) {
                Ok(true) => {
                    let since = self.inbox.state().marked_at.map(|t| t.elapsed());
                    let hold = drain_hold(since);
                    if !hold.is_zero() && ready(extra, hold) {
                        return Ok(Wake::External);
                    }
                    return Ok(Wake::Message);
                }
                Ok(false) => {
                    if !backoff.is_zero() {
                        tracing::info!(inbox = %self.inbox.name, "the bus answers again");
                    }
                    backoff = Duration::ZERO;
                    if ready(extra, Duration::ZERO) {
                        return Ok(Wake::External);
                    }
                }
                Err(e) => {
                    if backoff.is_zero() {
                        tracing::warn!(inbox = %self.inbox.name, "{e}; waiting for the bus");
                    }
                    backoff = crate::store::outage_backoff(backoff);
                    let pause = remaining.map_or(backoff, |r| r.min(backoff));
                    if ready(extra, pause) {
                        return Ok(Wake::External);
                    }
                }
            }
        }
    }

    /// Whether an entry is there, or arrives within `slice`.
    fn look(&mut self, slice: Duration) -> Result<bool> {
        let from = self
            .inbox
            .state()
            .last_read
            .clone()
            .unwrap_or_else(|| "0-0".to_owned());
        let ib = &self.inbox;
        let got: Value = ib.with_conn("wait", |c| {
            redis::cmd("XREAD")
                .arg("COUNT")
                .arg(1)
                .arg("BLOCK")
                .arg(slice.as_millis().max(1) as u64)
                .arg("STREAMS")
                .arg(&ib.stream)
                .arg(&from)
                .query(c)
        })?;
        Ok(!matches!(got, Value::Nil) && !stream_entries(&got).is_empty())
    }
}

/// How long a waiter woken by an entry holds before its caller drains, `since` the last
/// drain's mark: what is left of [`DRAIN_GAP`], or nothing when the inbox was quiet that long
/// (or never drained). A group commit: every drain costs a write on the server (under
/// `appendfsync always`, an fsync) and an fsync of the journal, so a consumer that drains as
/// fast as one writer appends spends one of each per message; holding lets the entries that
/// arrive meanwhile share them. A first message after a quiet spell is not held; a busy inbox
/// is drained at most every 2 ms.
fn drain_hold(since: Option<Duration>) -> Duration {
    match since {
        Some(d) => DRAIN_GAP.saturating_sub(d),
        None => Duration::ZERO,
    }
}

/// Whether one of `fds` becomes readable within `within` (zero: just look).
fn ready(fds: &[BorrowedFd<'_>], within: Duration) -> bool {
    if fds.is_empty() {
        if !within.is_zero() {
            std::thread::sleep(within);
        }
        return false;
    }
    let mut polled: Vec<PollFd<'_>> = fds
        .iter()
        .map(|fd| PollFd::new(*fd, PollFlags::POLLIN))
        .collect();
    let t = PollTimeout::try_from(within.as_millis().min(i32::MAX as u128) as i32)
        .unwrap_or(PollTimeout::MAX);
    matches!(poll(&mut polled, t), Ok(n) if n > 0)
}

fn text(v: &Value) -> Option<&str> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok(),
        Value::SimpleString(s) => Some(s),
        _ => None,
    }
}

/// The entries of an `XREAD` reply for one stream, as `(id, fields)`.
fn stream_items(v: &Value) -> Vec<(&str, &[Value])> {
    // RESP2 (as scripts return it too): [[key, [entries]]]; RESP3: {key: [entries]}.
    match v {
        Value::Array(streams) => streams
            .iter()
            .filter_map(|s| match s {
                Value::Array(kv) => kv.get(1),
                _ => None,
            })
            .flat_map(range_items)
            .collect(),
        Value::Map(m) => m.iter().flat_map(|(_, e)| range_items(e)).collect(),
        _ => Vec::new(),
    }
}

/// The entries of an `XRANGE`/`XREVRANGE` reply, `[[id, [field, value, ...]], ...]`, as
/// `(id, [field, value, ...])`; an entry deleted while pending comes back with no fields.
fn range_items(v: &Value) -> Vec<(&str, &[Value])> {
    let Value::Array(items) = v else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|e| {
            let Value::Array(pair) = e else { return None };
            let id = text(pair.first()?)?;
            let fields: &[Value] = match pair.get(1) {
                Some(Value::Array(f)) => f,
                _ => &[],
            };
            Some((id, fields))
        })
        .collect()
}

/// The value of field `name` among an entry's `[field, value, ...]`.
fn field<'v>(fields: &'v [Value], name: &str) -> Option<&'v [u8]> {
    fields
        .chunks(2)
        .find(|f| f.first().and_then(text) == Some(name))
        .and_then(|f| match f.get(1) {
            Some(Value::BulkString(b)) => Some(&b[..]),
            _ => None,
        })
}

/// The entries of an `XREAD` reply for one stream: `(id, field m)`.
fn stream_entries(v: &Value) -> Vec<(&str, Option<&[u8]>)> {
    stream_items(v)
        .into_iter()
        .map(|(id, f)| (id, field(f, "m")))
        .collect()
}

/// `[[id, [field, value, ...]], ...]` as `(id, value of m)`; an entry deleted while pending
/// comes back with no fields.
fn entries(v: &Value) -> Vec<(&str, Option<&[u8]>)> {
    range_entries(v, "m")
}

/// An inbox entry as read: its id, its line (field `m`) and its offset (field `o`); an entry
/// deleted while pending comes back with neither.
struct Entry<'v> {
    id: &'v str,
    line: Option<&'v [u8]>,
    offset: Option<u64>,
}

impl<'v> Entry<'v> {
    fn of((id, fields): (&'v str, &'v [Value])) -> Entry<'v> {
        Entry {
            id,
            line: field(fields, "m"),
            offset: field(fields, "o")
                .and_then(|o| std::str::from_utf8(o).ok())
                .and_then(|o| o.parse().ok()),
        }
    }
}

/// The entries of an `XRANGE`/`XREVRANGE` reply, with their fields.
fn range_fields(v: &Value) -> Vec<Entry<'_>> {
    range_items(v).into_iter().map(Entry::of).collect()
}

/// `[[id, [field, value, ...]], ...]` as `(id, value of field)`.
pub(super) fn range_entries<'v>(v: &'v Value, name: &str) -> Vec<(&'v str, Option<&'v [u8]>)> {
    range_items(v)
        .into_iter()
        .map(|(id, f)| (id, field(f, name)))
        .collect()
}

/// The id of the first entry of an `XRANGE`/`XREVRANGE` reply.
pub(super) fn first_id(v: &Value) -> Option<String> {
    entries(v).first().map(|(id, _)| (*id).to_owned())
}

/// The id of the last entry of an `XREAD` reply.
pub(super) fn last_stream_id(v: &Value) -> Option<String> {
    stream_entries(v).last().map(|(id, _)| (*id).to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn a_read_gives_each_entry_its_line_and_offset() {
        let entry = |id: &str, fields: &[&str]| {
            Value::Array(vec![
                bulk(id),
                Value::Array(fields.iter().map(|f| bulk(f)).collect()),
            ])
        };
        // As XRANGE returns them: [entries].
        let reply = Value::Array(vec![
            entry("9-5", &["m", "{}", "o", "120"]),
            entry("10-0", &["m", "x"]),
            entry("10-1", &[]),
        ]);
        let got = range_fields(&reply);
        let ids: Vec<&str> = got.iter().map(|e| e.id).collect();
        let lines: Vec<Option<&[u8]>> = got.iter().map(|e| e.line).collect();
        let offsets: Vec<Option<u64>> = got.iter().map(|e| e.offset).collect();
        assert_eq!(ids, ["9-5", "10-0", "10-1"]);
        assert_eq!(lines, [Some(&b"{}"[..]), Some(&b"x"[..]), None]);
        assert_eq!(offsets, [Some(120), None, None]);
    }

    #[test]
    fn a_busy_inbox_is_drained_at_most_every_gap_and_a_quiet_one_at_once() {
        assert_eq!(drain_hold(None), Duration::ZERO);
        assert_eq!(drain_hold(Some(Duration::ZERO)), DRAIN_GAP);
        assert_eq!(
            drain_hold(Some(Duration::from_micros(500))),
            DRAIN_GAP - Duration::from_micros(500)
        );
        assert_eq!(drain_hold(Some(DRAIN_GAP)), Duration::ZERO);
        assert_eq!(drain_hold(Some(Duration::from_secs(1))), Duration::ZERO);
    }
}
