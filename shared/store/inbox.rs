//! Inboxes: `inbox/NAME.jsonl`, one JSON message per line, shared by many writers and one
//! consumer. Writers serialize on an exclusive flock of the sidecar `inbox/NAME.lock` (the
//! *writers' lock*); drainers serialize on `inbox/NAME.drain.lock` and take the writers' lock
//! only for short moments. `inbox/NAME.offset` says how far the file has been consumed.
//!
//! - **Append** serializes the whole line first, then under the writers' lock writes it,
//!   preceded by a `\n`, with one `write` on an `O_APPEND` descriptor. A line is therefore either
//!   wholly in the file or (after a `kill -9` mid-write) a fragment; the next writer's leading
//!   `\n` ends the fragment, so it never swallows or interleaves with another line, and the
//!   drainer sets it aside as torn.
//! - **Drain** (under the drain lock):
//!   1. under the writers' lock, notes where the file ends (no writer is mid-write then, so an
//!      unterminated tail before that end can only be a dead writer's fragment), and reads the
//!      bytes from the consumed offset to that end after letting the lock go (only a drainer,
//!      holding the drain lock, ever cuts the file);
//!   2. with no lock of the writers', parses them, sets bad lines aside and records the new
//!      messages in the consumer's [`Journal`] (fsynced);
//!   3. under the writers' lock again, marks them consumed: if nothing arrived meanwhile, the
//!      offset is made 0 and the file truncated; if something did, the offset moves to
//!      where the read ended. Once the consumed part passes [`reclaim_at`], the drain instead
//!      consumes what arrived too, still under the lock, and truncates: under a steady stream the
//!      file still shrinks, at the cost of one journal sync under the lock per reclaim.
//!
//!   Crash points ([`DrainPoint`]): a drainer killed after the read, after the journal, after
//!   the offset reset or after the mark leaves an offset that is never past an unjournaled
//!   line, so the next drain reads again at most what the journal already holds, and skips it
//!   by id: nothing lost, nothing repeated. The offset is never synced: within one boot the
//!   page cache shows every process the offset and the truncate in the order they were made,
//!   and after a power loss (which also ends every drainer) a drainer's first drain reads from
//!   the start of the file whatever the offset says, as it does after any restart. So an
//!   offset that is stale, damaged, unreadable or past the end of the file (which counts as 0)
//!   costs a re-read that the journal dedups, never a message.
//! - **Bad lines** (not JSON, missing fields, unknown type) are moved to `NAME.corrupt.jsonl`
//!   with an event; the rest of the batch is still delivered. (A drainer killed between setting
//!   lines aside and marking them consumed sets them aside again.)
//! - **Back-pressure**: an inbox whose unconsumed bytes (from the offset to the end) are over
//!   its cap refuses new messages rather than losing old ones; consumed bytes never count.
//!
//! The inbox file is never replaced, only truncated, so descriptors held by writers stay valid.
//!
//! When the team's store is a Redis bus ([`crate::store`]), every operation goes to the inbox's
//! stream there instead ([`super::redis::RedisInbox`]), with the same guarantees.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::json;

use super::Store;
use super::files::aside::set_aside;
use super::redis::RedisInbox;
pub use super::{DEFAULT_CAP, DrainPoint};
use crate::error::{Error, Result};
use crate::fsutil::{self, LockGuard};
use crate::message::Message;
use crate::teamdir::{AgentName, TeamDir};
use crate::transcript::Journal;

/// An inbox, by name. Cheap to build; opens its files per operation (see [`InboxWriter`] for a
/// writer that keeps them open).
#[derive(Debug, Clone)]
pub struct Inbox {
    team: TeamDir,
    name: AgentName,
    path: PathBuf,
    lock_path: PathBuf,
    offset_path: PathBuf,
    drain_lock_path: PathBuf,
    cap: u64,
    /// Whether this drainer has drained once: its first drain reads from the start of the file
    /// whatever `NAME.offset` says, so a damaged offset file can only cost a re-read (which the
    /// journal dedups), never a skipped message. Shared by clones.
    drained_once: Arc<AtomicBool>,
    /// The inbox on the team's Redis bus, when it has one: every operation goes there instead.
    redis: Option<Arc<RedisInbox>>,
}

/// Whether an append waits for the data to reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Survives the death of any process (the page cache holds it); not a power loss.
    ProcessCrash,
    /// fdatasync before returning: survives a power loss too.
    Sync,
}

impl Inbox {
    /// The inbox of `name` in `team`, with the default cap.
    pub fn new(team: &TeamDir, name: &AgentName) -> Inbox {
        Inbox {
            team: team.clone(),
            name: name.clone(),
            path: team.inbox(name),
            lock_path: team.inbox_lock(name),
            offset_path: team.inbox_offset(name),
            drain_lock_path: team.inbox_drain_lock(name),
            cap: DEFAULT_CAP,
            drained_once: Arc::new(AtomicBool::new(false)),
            redis: match team.store() {
                Store::Redis(bus) => Some(Arc::new(RedisInbox::new(bus, team, name))),
                Store::Files(_) => None,
            },
        }
    }

    /// Sets the size cap in bytes.
    pub fn with_cap(mut self, cap: u64) -> Inbox {
        self.cap = cap;
        if let Store::Redis(bus) = self.team.store() {
            self.redis = Some(Arc::new(
                RedisInbox::new(bus, &self.team, &self.name).with_cap(cap),
            ));
        }
        self
    }

    /// The inbox on the team's Redis bus, if it has one (for the store's waiter).
    pub(crate) fn redis(&self) -> Option<&RedisInbox> {
        self.redis.as_deref()
    }

    /// The owner's name.
    pub fn name(&self) -> &AgentName {
        &self.name
    }

    /// The inbox file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens a writer that keeps the inbox and its lock open across appends.
    pub fn writer(&self) -> Result<InboxWriter> {
        let target = match &self.redis {
            Some(r) => Target::Redis(r.clone()),
            None => {
                fsutil::create_dir(&self.team.inbox_dir())?;
                Target::File {
                    lock: fsutil::open_lock(&self.lock_path)?,
                    file: fsutil::open_append(&self.path)?,
                }
            }
        };
        Ok(InboxWriter {
            inbox: self.clone(),
            target,
            buf: Vec::new(),
            unchecked: 0,
            checked_once: false,
        })
    }

    /// Appends one message (see the module docs). Refused if the message is over the size limit
    /// or the inbox is at its cap; nothing is written then.
    pub fn append(&self, msg: &Message, durability: Durability) -> Result<()> {
        self.writer()?.append(msg, durability)
    }

    /// Reads the inbox without changing it (shared lock). Bad lines are skipped, not moved.
    pub fn peek(&self) -> Result<Vec<Message>> {
        if let Some(r) = &self.redis {
            return r.peek();
        }
        let Some((lock, file)) = self.open_existing()? else {
            return Ok(Vec::new());
        };
        let _guard = fsutil::lock_shared(&lock, &self.lock_path)?;
        let size = file
            .metadata()
            .map_err(Error::io("stat inbox", &self.path))?
            .len();
        let buf = read_range(&file, consumed(&self.offset_path, size), size, &self.path)?;
        let complete = memchr::memrchr(b'\n', &buf).map_or(0, |i| i + 1);
        Ok(lines(&buf[..complete])
            .filter_map(|l| Message::parse_line(l).ok())
            .collect())
    }

    /// How many messages wait, without parsing them (`lead top` asks every second): the
    /// complete non-empty lines after the consumed offset (a bad line counts until a drain sets it
    /// aside), or on a bus the stream's length.
    pub fn depth(&self) -> Result<u64> {
        if let Some(r) = &self.redis {
            return r.depth();
        }
        let Some((lock, file)) = self.open_existing()? else {
            return Ok(0);
        };
        let _guard = fsutil::lock_shared(&lock, &self.lock_path)?;
        let size = file
            .metadata()
            .map_err(Error::io("stat inbox", &self.path))?
            .len();
        let buf = read_range(&file, consumed(&self.offset_path, size), size, &self.path)?;
        let complete = memchr::memrchr(b'\n', &buf).map_or(0, |i| i + 1);
        Ok(lines(&buf[..complete]).count() as u64)
    }

    /// Bytes not consumed yet: from the consumed offset to the end of the file (0 if it does
    /// not exist).
    pub fn len(&self) -> u64 {
        if let Some(r) = &self.redis {
            // Unknown (the bus is unreachable) reads as not empty: the drain then says why.
            return r.len().unwrap_or_else(|e| {
                tracing::warn!(inbox = %self.name, "{e}");
                1
            });
        }
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if size == 0 {
            return 0;
        }
        size - consumed(&self.offset_path, size)
    }

    /// Whether nothing is waiting in the inbox.
    pub fn is_empty(&self) -> bool {
        match &self.redis {
            Some(r) => r.is_empty().unwrap_or_else(|e| {
                tracing::warn!(inbox = %self.name, "{e}");
                false
            }),
            None => self.len() == 0,
        }
    }

    /// Drains the inbox into `journal` and returns the messages that are new to it, in file
    /// order. See the module docs for the protocol and its crash guarantees.
    pub fn drain(&self, journal: &mut Journal) -> Result<Vec<Message>> {
        self.drain_with(journal, |_, _| {})
    }

    /// [`Inbox::drain`] with a hook called at each [`DrainPoint`], with the messages journaled
    /// so far: the moments a crash could matter. Tests use it to die there.
    pub fn drain_with(
        &self,
        journal: &mut Journal,
        mut at: impl FnMut(DrainPoint, &[Message]),
    ) -> Result<Vec<Message>> {
        if let Some(r) = &self.redis {
            return r.drain_with(journal, at);
        }
        let Some((lock, file)) = self.open_existing()? else {
            return Ok(Vec::new());
        };
        let drain_lock = fsutil::open_lock(&self.drain_lock_path)?;
        let _drainer = fsutil::lock_exclusive(&drain_lock, &self.drain_lock_path)?;
        let mut offset = Offset::open(&self.offset_path)?;
        // 1. Where the file ends, under the writers' lock: no writer is mid-write then, so every
        // byte before that end is whole and stays as it is (only a drainer, holding the drain
        // lock as we do, ever cuts the file). It is read after the lock is let go.
        let (start, end) = {
            let _writers = fsutil::lock_exclusive(&lock, &self.lock_path)?;
            let size = file
                .metadata()
                .map_err(Error::io("stat inbox", &self.path))?
                .len();
            let start = if self.drained_once.load(Ordering::Relaxed) {
                offset.get(size)
            } else {
                0
            };
            if start == size {
                if size > 0 {
                    // All consumed, nothing new: reclaim the space now.
                    offset.reset()?;
                    at(DrainPoint::Reset, &[]);
                    file.set_len(0)
                        .map_err(Error::io("truncate inbox", &self.path))?;
                }
                return Ok(Vec::new());
            }
            (start, size)
        };
        let buf = read_range(&file, start, end, &self.path)?;
        at(DrainPoint::Read, &[]);
        // 2. Parsed and journaled with the writers free to append.
        let mut fresh = self.consume(&buf, journal)?;
        at(DrainPoint::Journaled, &fresh);
        // 3. Marked consumed, under the writers' lock.
        let _writers = fsutil::lock_exclusive(&lock, &self.lock_path)?;
        let size = file
            .metadata()
            .map_err(Error::io("stat inbox", &self.path))?
            .len();
        if size == end || end >= reclaim_at(self.cap) {
            if size > end {
                // Reclaim under a steady stream: what arrived meanwhile is consumed here too.
                let more = read_range(&file, end, size, &self.path)?;
                fresh.extend(self.consume(&more, journal)?);
                at(DrainPoint::Journaled, &fresh);
            }
            offset.reset()?;
            at(DrainPoint::Reset, &fresh);
            file.set_len(0)
                .map_err(Error::io("truncate inbox", &self.path))?;
        } else {
            offset.set(end)?;
        }
        at(DrainPoint::Marked, &fresh);
        self.drained_once.store(true, Ordering::Relaxed);
        Ok(fresh)
    }

    /// Parses `buf` (whole lines, then perhaps a dead writer's fragment), sets bad lines aside
    /// and journals the messages `journal` has not seen; returns them.
    fn consume(&self, buf: &[u8], journal: &mut Journal) -> Result<Vec<Message>> {
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        let complete = memchr::memrchr(b'\n', buf).map_or(0, |i| i + 1);
        let mut parsed: Vec<(&[u8], Message)> =
            Vec::with_capacity(memchr::memchr_iter(b'\n', &buf[..complete]).count());
        let mut corrupt: Vec<(&[u8], String)> = Vec::new();
        for line in lines(&buf[..complete]) {
            match Message::parse_line(line) {
                Ok(msg) => parsed.push((line, msg)),
                Err(why) => corrupt.push((line, describe_bad_line(line, why))),
            }
        }
        if complete < buf.len() {
            // Read under the writers' lock, so no writer was mid-write: an unterminated tail is
            // a fragment of a writer that died.
            corrupt.push((&buf[complete..], TORN.to_owned()));
        }
        if !corrupt.is_empty() {
            self.set_aside(&corrupt)?;
        }
        // New to the journal, and the same id twice in one batch (a sender that retried): the
        // first, as the journal tells.
        journal.append_inbox_messages(parsed)
    }

    fn open_existing(&self) -> Result<Option<(File, File)>> {
        let file = match std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Error::io("open inbox", &self.path)(e)),
        };
        Ok(Some((fsutil::open_lock(&self.lock_path)?, file)))
    }

    /// Appends unparsable lines to `NAME.corrupt.jsonl` (fsynced) and logs an event.
    fn set_aside(&self, lines: &[(&[u8], String)]) -> Result<()> {
        let records: Vec<serde_json::Value> = lines
            .iter()
            .map(|(raw, why)| json!({"reason": why, "line": String::from_utf8_lossy(raw)}))
            .collect();
        let file = self.team.inbox_corrupt(&self.name);
        let file = file.file_name().map(|n| n.to_string_lossy().into_owned());
        set_aside(&self.team, &self.name, records, json!({"file": file}))
    }
}

/// How many consumed bytes make a drain reclaim them under a steady stream: a 16th of the cap,
/// at most 4 MiB.
pub fn reclaim_at(cap: u64) -> u64 {
    (cap / 16).clamp(1, 4 * 1024 * 1024)
}

/// `inbox/NAME.offset`: the consumed offset as 20 decimal digits and a newline, always written
/// whole at position 0 (one `pwrite` of 21 bytes).
struct Offset {
    file: File,
    path: PathBuf,
    /// What the file says now, as this drainer last read or wrote it.
    value: u64,
}

const OFFSET_LEN: usize = 21;

impl Offset {
    fn open(path: &Path) -> Result<Offset> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(fsutil::FILE_MODE)
            .open(path)
            .map_err(Error::io("open", path))?;
        let value = read_offset(&file);
        Ok(Offset {
            file,
            path: path.to_owned(),
            value,
        })
    }

    /// The consumed offset for a file of `size` bytes (0 if it is past the end).
    fn get(&self, size: u64) -> u64 {
        if self.value > size { 0 } else { self.value }
    }

    /// Moves the offset forward (no sync: an older offset read after a power loss only makes
    /// the next drain read again what the journal holds).
    fn set(&mut self, to: u64) -> Result<()> {
        self.file
            .write_all_at(format!("{to:020}\n").as_bytes(), 0)
            .map_err(Error::io("write", &self.path))?;
        self.value = to;
        Ok(())
    }

    /// Makes the offset 0, before a truncate. No sync, as for [`Offset::set`]: after a power
    /// loss every drainer is a new one, whose first drain reads from the start of the file
    /// whatever this says. (Kept under the writers' lock, a sync here stalled every sender for
    /// a disk flush on each drain that found nothing new behind it.)
    fn reset(&mut self) -> Result<()> {
        if self.value == 0 {
            return Ok(());
        }
        self.file
            .write_all_at(format!("{:020}\n", 0).as_bytes(), 0)
            .map_err(Error::io("write", &self.path))?;
        self.value = 0;
        Ok(())
    }
}

fn read_offset(file: &File) -> u64 {
    let mut buf = [0u8; OFFSET_LEN];
    match file.read_at(&mut buf, 0) {
        Ok(n) if n == OFFSET_LEN && buf[OFFSET_LEN - 1] == b'\n' => std::str::from_utf8(&buf[..20])
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(0),
        _ => 0,
    }
}

/// The consumed offset of an inbox of `size` bytes, read from `path` (0 if missing, unreadable
/// or past the end).
fn consumed(path: &Path, size: u64) -> u64 {
    let v = File::open(path).map_or(0, |f| read_offset(&f));
    if v > size { 0 } else { v }
}

/// The bytes of `file` from `start` to `end`, read into a buffer of that size (one `pread` as
/// a rule, no growing and copying). Callers know the range is whole and stays so.
fn read_range(file: &File, start: u64, end: u64, path: &Path) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; end.saturating_sub(start) as usize];
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], start + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read inbox", path)(e)),
        }
    }
    buf.truncate(got);
    Ok(buf)
}

/// The non-empty `\n`-terminated lines of `buf` (whole lines only), without their `\n`.
fn lines(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut start = 0;
    memchr::memchr_iter(b'\n', buf)
        .map(move |end| {
            let line = &buf[start..end];
            start = end + 1;
            line
        })
        .filter(|l| !l.is_empty())
}

/// Why a torn fragment was set aside.
const TORN: &str = "torn line (writer died mid-write)";

/// The reason recorded for a line that is not a message: a fragment of a line cut short (a
/// writer killed mid-write, its fragment since terminated by the next writer's leading `\n`)
/// reads as JSON that ends too soon; anything else keeps its parse error.
fn describe_bad_line(line: &[u8], why: String) -> String {
    match serde_json::from_slice::<serde::de::IgnoredAny>(line) {
        Err(e) if e.is_eof() => TORN.to_owned(),
        _ => why,
    }
}

/// An inbox writer holding its descriptors open: the fast path for many appends to one inbox.
#[derive(Debug)]
pub struct InboxWriter {
    inbox: Inbox,
    target: Target,
    /// The line being written, with its leading `\n` (reused across appends).
    buf: Vec<u8>,
    /// Bytes this writer appended since it last looked at the inbox's size.
    unchecked: u64,
    /// Whether the size has been looked at since this writer opened.
    checked_once: bool,
}

/// Where an [`InboxWriter`] writes.
#[derive(Debug)]
enum Target {
    /// The inbox file and its writers' lock, kept open.
    File { lock: File, file: File },
    /// The team's Redis bus (durable as the server's `appendfsync` makes it).
    Redis(Arc<RedisInbox>),
}

impl InboxWriter {
    /// Appends one message (see [`Inbox::append`]).
    pub fn append(&mut self, msg: &Message, durability: Durability) -> Result<()> {
        if let Target::Redis(r) = &self.target {
            return r.append(msg);
        }
        // Serialized straight into the reused buffer, behind the leading `\n`.
        self.buf.clear();
        self.buf.push(b'\n');
        msg.write_line(&mut self.buf)?;
        self.write_buf(durability)
    }

    /// Appends one pre-serialized line, which must end with `\n` and hold exactly one message.
    ///
    /// Under the lock, the line goes out with ONE `write` on the `O_APPEND` descriptor, preceded
    /// by a `\n`: if a writer was killed mid-write, its unterminated fragment becomes a line of
    /// its own (which the drain sets aside as torn) instead of swallowing this one. So an append
    /// costs the lock, one write and the unlock, with no look at the tail. Readers skip the empty
    /// lines this leaves.
    ///
    /// The cap is checked against the file's size on the first append and then whenever this
    /// writer has added a 64th of the cap since it last looked, so the inbox can pass its cap by
    /// at most that much per writer.
    pub fn append_line(&mut self, line: &[u8], durability: Durability) -> Result<()> {
        debug_assert_eq!(line.last(), Some(&b'\n'));
        if let Target::Redis(r) = &self.target {
            return r.append_line(line);
        }
        self.buf.clear();
        self.buf.push(b'\n');
        self.buf.extend_from_slice(line);
        self.write_buf(durability)
    }

    /// Writes `buf` (a leading `\n`, then one line) as [`InboxWriter::append_line`] says.
    fn write_buf(&mut self, durability: Durability) -> Result<()> {
        let inbox = &self.inbox;
        let Target::File { lock, file } = &self.target else {
            unreachable!("Redis writes return before");
        };
        let guard: LockGuard<'_> = fsutil::lock_exclusive(lock, &inbox.lock_path)?;
        let len = self.buf.len() as u64;
        if !self.checked_once || self.unchecked + len > inbox.cap / 64 {
            let file_size = file
                .metadata()
                .map_err(Error::io("stat inbox", &inbox.path))?
                .len();
            // Consumed bytes waiting to be reclaimed are not the recipient's backlog.
            let size = file_size - consumed(&inbox.offset_path, file_size);
            if size + len > inbox.cap {
                return Err(Error::InboxFull {
                    name: inbox.name.to_string(),
                    size,
                    cap: inbox.cap,
                });
            }
            self.checked_once = true;
            self.unchecked = 0;
        }
        (&*file)
            .write_all(&self.buf)
            .map_err(Error::io("append to inbox", &inbox.path))?;
        self.unchecked += len;
        // The line is in the file: the lock has done its job. Waiting for the disk outside it
        // keeps the recipient's drain (and every other writer) from waiting for our sync too.
        drop(guard);
        if durability == Durability::Sync {
            fsutil::sync_data(file, &inbox.path)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::MessageType;
    use crate::transcript::Entry;

    fn setup() -> (tempfile::TempDir, TeamDir, Inbox, Journal) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let name = AgentName::teammate("alice").unwrap();
        let inbox = Inbox::new(&team, &name);
        let (journal, _) = Journal::open(&team, &name, &own(&team, &name)).unwrap();
        (tmp, team, inbox, journal)
    }

    /// The owner lock of `name`'s journal, taken for this test. Journals opened with it stay
    /// open after it is dropped; tests that reopen take it again.
    fn own(team: &TeamDir, name: &AgentName) -> crate::fsutil::HeldLock {
        Journal::try_own(team, name)
            .unwrap()
            .expect("no other owner")
    }

    fn msg(text: &str) -> Message {
        Message::new(MessageType::Message, "lead", "alice", text)
    }

    #[test]
    fn append_peek_drain() {
        let (_t, _team, inbox, mut j) = setup();
        assert!(inbox.drain(&mut j).unwrap().is_empty());
        let a = msg("a");
        let b = msg("b");
        inbox.append(&a, Durability::ProcessCrash).unwrap();
        inbox.append(&b, Durability::Sync).unwrap();
        assert_eq!(inbox.peek().unwrap(), vec![a.clone(), b.clone()]);
        assert_eq!(inbox.depth().unwrap(), 2);
        assert_eq!(inbox.drain(&mut j).unwrap(), vec![a, b]);
        assert!(inbox.is_empty());
        assert_eq!(inbox.depth().unwrap(), 0);
        assert!(inbox.drain(&mut j).unwrap().is_empty());
        assert_eq!(j.seen_count(), 2);
    }

    /// A sender that retried puts one id in the inbox twice: delivered and journaled once,
    /// within a batch and across batches.
    #[test]
    fn one_id_twice_is_delivered_once() {
        let (_t, team, inbox, mut j) = setup();
        let a = msg("a");
        let b = msg("b");
        for m in [&a, &b, &a] {
            inbox.append(m, Durability::ProcessCrash).unwrap();
        }
        assert_eq!(inbox.drain(&mut j).unwrap(), vec![a.clone(), b.clone()]);
        inbox.append(&b, Durability::ProcessCrash).unwrap();
        assert!(inbox.drain(&mut j).unwrap().is_empty());
        assert_eq!(j.seen_count(), 2);
        let journaled = crate::transcript::read_entries(&team.transcript(inbox.name())).unwrap();
        assert_eq!(journaled.len(), 2, "{journaled:?}");
    }

    #[test]
    fn bad_lines_are_set_aside_and_the_rest_delivered() {
        let (_t, team, inbox, mut j) = setup();
        let good = msg("ok");
        let mut bytes = b"not json\n{\"id\":\"1\",\"type\":\"gossip\",\"from\":\"a\",\"to\":\"b\",\"content\":\"\",\"timestamp\":1}\n".to_vec();
        bytes.extend(good.to_line().unwrap());
        bytes.extend(b"{\"id\":\"torn");
        std::fs::write(inbox.path(), &bytes).unwrap();
        assert_eq!(inbox.drain(&mut j).unwrap(), vec![good]);
        let corrupt = std::fs::read_to_string(team.inbox_corrupt(inbox.name())).unwrap();
        assert_eq!(corrupt.lines().count(), 3, "{corrupt}");
        assert!(corrupt.contains("torn line"));
        let events = crate::events::read_all(&team).unwrap();
        assert_eq!(events[0]["event"], "inbox_corrupt");
        assert_eq!(events[0]["lines"], 3);
    }

    #[test]
    fn append_repairs_a_torn_tail() {
        let (_t, team, inbox, mut j) = setup();
        let a = msg("a");
        let mut bytes = a.to_line().unwrap();
        bytes.extend(b"{\"id\":\"half-a-mess");
        std::fs::write(inbox.path(), &bytes).unwrap();
        let b = msg("b");
        inbox.append(&b, Durability::ProcessCrash).unwrap();
        assert_eq!(inbox.drain(&mut j).unwrap(), vec![a, b]);
        let corrupt = std::fs::read_to_string(team.inbox_corrupt(inbox.name())).unwrap();
        assert!(corrupt.contains("half-a-mess"));
    }

    #[test]
    fn cap_refuses_without_losing() {
        let (_t, _team, inbox, mut j) = setup();
        let inbox = inbox.with_cap(1000);
        let a = msg(&"x".repeat(600));
        inbox.append(&a, Durability::ProcessCrash).unwrap();
        let e = inbox
            .append(&msg(&"y".repeat(600)), Durability::ProcessCrash)
            .unwrap_err();
        assert!(e.to_string().starts_with("inbox of alice is full"), "{e}");
        assert_eq!(inbox.drain(&mut j).unwrap(), vec![a]);
        inbox
            .append(&msg("fits now"), Durability::ProcessCrash)
            .unwrap();
    }

    #[test]
    fn redrain_after_crash_before_truncate_repeats_nothing() {
        let (_t, team, inbox, mut j) = setup();
        let a = msg("a");
        inbox.append(&a, Durability::ProcessCrash).unwrap();
        // Simulate the crash: the batch is journaled, the inbox is not truncated.
        j.append(&[Entry::Inbox {
            message: a.clone(),
            at: None,
        }])
        .unwrap();
        let b = msg("b");
        inbox.append(&b, Durability::ProcessCrash).unwrap();
        let (mut j2, _) = Journal::open(&team, inbox.name(), &own(&team, inbox.name())).unwrap();
        assert_eq!(inbox.drain(&mut j2).unwrap(), vec![b]);
    }

    /// Finding 7: a drain whose journal write fails halfway (the file size limit stands in for
    /// a full disk) leaves the journal byte for byte as it was, marks nothing seen, keeps the
    /// inbox, and the next append still reads back. The failing part runs in a child process
    /// (this test binary again, running only [`fsize_child`]) whose RLIMIT_FSIZE is just above
    /// the journal's size.
    #[test]
    fn a_drain_that_fails_halfway_rolls_the_journal_back() {
        use std::os::unix::process::CommandExt;
        let (_t, team, inbox, mut j) = setup();
        j.append(&[Entry::Session {
            incarnation: 1,
            pid: 1,
            at: 0.0,
        }])
        .unwrap();
        drop(j);
        let (a, b) = (msg(&"x".repeat(300)), msg(&"y".repeat(300)));
        inbox.append(&a, Durability::ProcessCrash).unwrap();
        inbox.append(&b, Durability::ProcessCrash).unwrap();
        let path = team.transcript(inbox.name());
        let limit = std::fs::metadata(&path).unwrap().len() + 400;
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child
            .args(["--exact", "store::inbox::tests::fsize_child", "--nocapture"])
            .env("TROUPE_TEST_FSIZE_TEAM", team.root());
        // SAFETY: setrlimit and signal are async-signal-safe; nothing else runs in the child.
        unsafe {
            child.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: limit,
                    rlim_max: libc::RLIM_INFINITY,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // A write past the limit then fails with EFBIG instead of killing the process.
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
        let o = child.output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert!(o.status.success(), "{text}");
        assert!(text.contains("1 passed"), "the child ran no test: {text}");
        // What the child's failed drain left is the next drain's, whole.
        let owner = own(&team, inbox.name());
        let (mut j, entries) = Journal::open(&team, inbox.name(), &owner).unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
        assert!(matches!(entries[1], Entry::Idle { .. }), "{entries:?}");
        assert_eq!(inbox.drain(&mut j).unwrap(), vec![a, b]);
        assert!(inbox.is_empty());
    }

    /// The child half of [`a_drain_that_fails_halfway_rolls_the_journal_back`]; does nothing
    /// unless started by it.
    #[test]
    fn fsize_child() {
        let Some(root) = std::env::var_os("TROUPE_TEST_FSIZE_TEAM") else {
            return;
        };
        let team = TeamDir::open(std::path::Path::new(&root)).unwrap();
        let name = AgentName::teammate("alice").unwrap();
        let inbox = Inbox::new(&team, &name);
        let (mut j, _) = Journal::open(&team, &name, &own(&team, &name)).unwrap();
        let path = team.transcript(&name);
        let before = std::fs::read(&path).unwrap();
        let e = inbox.drain(&mut j).unwrap_err();
        assert!(e.to_string().contains("append to"), "{e}");
        let after = std::fs::read(&path).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&after),
            String::from_utf8_lossy(&before),
            "the torn batch stayed"
        );
        let ids: Vec<String> = inbox.peek().unwrap().into_iter().map(|m| m.id).collect();
        assert_eq!(ids.len(), 2);
        assert!(ids.iter().all(|id| !j.has_seen(id)));
        assert_eq!(j.seen_count(), 0);
        j.append(&[Entry::Idle {
            at: 1.0,
            notification: None,
        }])
        .unwrap();
        let entries = crate::transcript::read_entries(&path).unwrap();
        assert_eq!(entries.len(), 2, "{entries:?}");
    }

    #[test]
    fn waiter_wakes_on_append_and_times_out() {
        let (_t, team, inbox, mut j) = setup();
        let mut w = crate::wait::InboxWaiter::new(&inbox).unwrap();
        assert!(w.uses_inotify());
        let t0 = std::time::Instant::now();
        assert_eq!(
            w.wait(Some(std::time::Duration::from_millis(30)), &[])
                .unwrap(),
            crate::wait::Wake::Timeout
        );
        assert!(t0.elapsed() >= std::time::Duration::from_millis(30));
        let team2 = team.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(20));
            let i = Inbox::new(&team2, &AgentName::teammate("alice").unwrap());
            i.append(&msg("wake"), Durability::ProcessCrash).unwrap();
        });
        assert_eq!(w.wait(None, &[]).unwrap(), crate::wait::Wake::Message);
        h.join().unwrap();
        assert_eq!(inbox.drain(&mut j).unwrap().len(), 1);
    }
}
