//! The durable journal of what an agent consumed and said (`transcripts/NAME.jsonl`).
//!
//! The journal is the consumer half of the inbox protocol: [`crate::inbox::Inbox::drain`] records
//! every new message here (fsynced) before it truncates the inbox, and skips any id the journal
//! already holds. A crash between the two steps therefore neither loses nor repeats a message.
//! The worker also journals every model turn and tool result, and rebuilds its conversation from
//! the journal when restarted.
//!
//! Each line is one [`Entry`], written with a single `write_all` on an `O_APPEND` descriptor and
//! fdatasynced. A line cut short by a crash is ignored when read and cut off before the next
//! append.
//!
//! A journal has one writer: the process holding its owner lock (`transcripts/NAME.lock`, see
//! [`Journal::try_own`]), and only [`Journal::open`] with that lock in hand cuts a torn tail.
//! A reader without the lock ([`read_entries`]) never changes the file: the tail it sees
//! unterminated may be an append the owner is making at that moment, and cutting it would delete
//! an entry the owner has been told is durable.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil::{self, HeldLock};
use crate::ids::IdSet;
use crate::llm::{Block, ChatResponse};
use crate::message::Message;
use crate::teamdir::{AgentName, TeamDir};

/// One journal line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// A process took over the journal (worker start or restart).
    Session { incarnation: u64, pid: u32, at: f64 },
    /// A message consumed from the inbox, with its full envelope.
    Inbox {
        message: Message,
        /// When it was consumed (left out by journals older than the field, and in memory).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        at: Option<f64>,
    },
    /// One model call's answer.
    Assistant {
        seq: u64,
        response: ChatResponse,
        at: f64,
        /// When the call began, before any wait for the team's rate governor.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<f64>,
        /// How long of it went to waiting for a call slot or a cooldown, in seconds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        waited: Option<f64>,
    },
    /// The results of all tool uses of the preceding assistant turn (or some of them, when the
    /// worker was killed partway and fills in the rest on restart).
    ToolResults {
        results: Vec<Block>,
        /// Ids of inbox messages the tools delivered (through `read_inbox`): they are part of
        /// these results and are not shown again as an inbox turn.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        inbox_ids: Vec<String>,
        at: f64,
        /// When each tool call began and ended, in the order they ran.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        timings: Vec<ToolTiming>,
    },
    /// Inbox messages the agent handled by itself (a stale shutdown request answered
    /// automatically): never shown to the model.
    Handled { ids: Vec<String>, at: f64 },
    /// The agent finished an activation and went idle.
    ///
    /// Going idle is one step with effects outside the journal: `notification` (the
    /// activation's summary) goes to the lead's inbox, and the `teammate_idle` hook mark to the
    /// roster. The entry is written first, with the notification as it will be sent; an
    /// [`Entry::IdleDelivered`] with its id follows once both effects are done. A restart that
    /// finds the notification without it (a kill, a full lead inbox, an unreadable roster
    /// meanwhile) does them again with the same message: the lead's journal drops the id it
    /// holds, so the lead reads the summary once. Journals written before the notification was
    /// journaled have none: nothing is pending for them.
    Idle {
        at: f64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        notification: Option<Message>,
    },
    /// The notification of an [`Entry::Idle`] (by message id) is in the lead's inbox and the
    /// hook mark in the roster: that idle step is complete.
    IdleDelivered { id: String, at: f64 },
    /// What the person said to the LLM lead (`lead chat`): a user turn of its own.
    User { text: String, at: f64 },
    /// The conversation was compacted: every message before `keep_from` (an index into the
    /// conversation as rebuilt up to this entry, unseen inbox messages flushed first) is
    /// replaced by one user turn, `summary`. Replaying it rebuilds the same view.
    Compaction {
        summary: String,
        keep_from: usize,
        /// The estimated tokens of the prompt that made it compact.
        #[serde(default)]
        tokens_before: u64,
        at: f64,
        /// When the summary's model call began.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        started_at: Option<f64>,
    },
}

/// When one tool call of a turn ran.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolTiming {
    pub tool_use_id: String,
    pub name: String,
    pub started_at: f64,
    pub ended_at: f64,
}

/// An open journal: an append descriptor plus the set of inbox ids already recorded.
#[derive(Debug)]
pub struct Journal {
    path: PathBuf,
    file: File,
    /// Ids of every inbox message recorded so far, by anyone.
    seen: IdSet,
    /// Bytes of the file already scanned into `seen`.
    scanned: u64,
    /// A write failed and could not be undone: the file may end in a torn or unsynced batch
    /// that this journal's bookkeeping does not describe. Every later call fails until the
    /// journal is reopened (the process exits; the open-time repair cleans up).
    poisoned: bool,
}

impl Journal {
    /// Takes the owner lock of `name`'s journal (`transcripts/NAME.lock`) without waiting
    /// (beyond [`HeldLock::try_acquire_settled`]'s few milliseconds); `Ok(None)` while another
    /// process owns the journal.
    pub fn try_own(team: &TeamDir, name: &AgentName) -> Result<Option<HeldLock>> {
        fsutil::create_dir(&team.transcripts_dir())?;
        HeldLock::try_acquire_settled(&team.transcript_lock(name))
    }

    /// Opens (creating 0600) the journal of `name` as its owner, returning it with every entry
    /// it holds. A torn last line is dropped from the file. `owner` is the journal's owner lock
    /// ([`Journal::try_own`], or the worker's liveness lock, which is the same file).
    pub fn open(
        team: &TeamDir,
        name: &AgentName,
        owner: &HeldLock,
    ) -> Result<(Journal, Vec<Entry>)> {
        fsutil::create_dir(&team.transcripts_dir())?;
        Journal::open_path(team.transcript(name), owner)
    }

    /// Opens the journal at an explicit path as its owner (tests, tools). `owner` must be the
    /// lock beside it ([`owner_lock_path`]).
    pub fn open_path(path: PathBuf, owner: &HeldLock) -> Result<(Journal, Vec<Entry>)> {
        let want = owner_lock_path(&path);
        if owner.path() != want {
            return Err(Error::Protocol(format!(
                "refusing to open journal {} as its owner: the lock held is {}, not {}",
                path.display(),
                owner.path().display(),
                want.display()
            )));
        }
        let file = fsutil::open_append(&path)?;
        let mut journal = Journal {
            path,
            file,
            seen: IdSet::default(),
            scanned: 0,
            poisoned: false,
        };
        let entries = journal.scan(true)?;
        Ok((journal, entries))
    }

    /// The journal's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether an inbox message with this id has been recorded.
    pub fn has_seen(&self, id: &str) -> bool {
        self.seen.contains(id)
    }

    /// Number of distinct inbox messages recorded.
    pub fn seen_count(&self) -> usize {
        self.seen.len()
    }

    /// Reads whatever was appended since the last scan (by this process or another consumer of
    /// the same journal) and returns the complete entries found. With `repair`, an unterminated
    /// last line is cut off the file.
    fn scan(&mut self, repair: bool) -> Result<Vec<Entry>> {
        self.check_poisoned()?;
        let mut f = &self.file;
        let len = f.metadata().map_err(Error::io("stat", &self.path))?.len();
        if len <= self.scanned {
            return Ok(Vec::new());
        }
        f.seek(SeekFrom::Start(self.scanned))
            .map_err(Error::io("seek", &self.path))?;
        let mut buf = Vec::with_capacity((len - self.scanned) as usize);
        f.take(len - self.scanned)
            .read_to_end(&mut buf)
            .map_err(Error::io("read", &self.path))?;
        let complete = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
        let mut entries = Vec::new();
        for line in buf[..complete].split(|&b| b == b'\n') {
            if line.is_empty() {
                continue;
            }
            match parse_entry(line) {
                Ok(entry) => {
                    if let Entry::Inbox { message, .. } = &entry {
                        self.seen.insert(&message.id);
                    }
                    entries.push(entry);
                }
                Err(e) => {
                    tracing::warn!(path = %self.path.display(), "skipping unreadable journal line: {e}")
                }
            }
        }
        self.scanned += complete as u64;
        if repair && complete < buf.len() {
            tracing::warn!(
                path = %self.path.display(),
                bytes = buf.len() - complete,
                "cutting a torn last line left by a crash"
            );
            self.file
                .set_len(self.scanned)
                .map_err(Error::io("truncate torn tail of", &self.path))?;
        }
        Ok(entries)
    }

    /// Catches up with entries appended by another process since the last scan.
    pub(crate) fn refresh(&mut self) -> Result<()> {
        self.scan(false).map(drop)
    }

    /// Appends entries with one write and fdatasyncs them. After `Ok`, they survive any crash.
    pub fn append(&mut self, entries: &[Entry]) -> Result<()> {
        self.check_poisoned()?;
        if entries.is_empty() {
            return Ok(());
        }
        let mut buf = Vec::new();
        for entry in entries {
            serde_json::to_writer(&mut buf, entry)
                .map_err(|e| Error::Protocol(format!("failed to serialize journal entry: {e}")))?;
            buf.push(b'\n');
        }
        self.write_synced(&buf)?;
        for entry in entries {
            if let Entry::Inbox { message, .. } = entry {
                self.seen.insert(&message.id);
            }
        }
        Ok(())
    }

    /// Appends whole lines with one write and fdatasyncs them, keeping `scanned` at the end of
    /// what this journal has read.
    ///
    /// All or nothing: when the write or the sync fails (a full disk stops a write partway; a
    /// failed sync leaves whole lines that may not be on disk), the file is cut back to its
    /// length before the write. Otherwise a later scan would count the batch's complete lines
    /// as consumed (the drain would then skip and truncate messages the agent never got) and
    /// the next append would be glued to a torn line and lost. If the cut fails too, the
    /// journal is poisoned.
    fn write_synced(&mut self, buf: &[u8]) -> Result<()> {
        // Another consumer of this journal may have appended since our last scan; scan it first
        // so that `scanned` keeps pointing at the end of what we have read.
        self.refresh()?;
        self.write_scanned(buf)
    }

    /// [`Journal::write_synced`] for a caller that has just scanned.
    fn write_scanned(&mut self, buf: &[u8]) -> Result<()> {
        let before = self
            .file
            .metadata()
            .map_err(Error::io("stat", &self.path))?
            .len();
        let written = (&self.file)
            .write_all(buf)
            .map_err(Error::io("append to", &self.path))
            .and_then(|()| fsutil::sync_data(&self.file, &self.path));
        if let Err(e) = written {
            match self.file.set_len(before) {
                Ok(()) => tracing::warn!(
                    path = %self.path.display(),
                    "journal write failed and was undone: {e}"
                ),
                Err(cut) => {
                    self.poisoned = true;
                    tracing::error!(
                        path = %self.path.display(),
                        "journal write failed ({e}) and could not be undone ({cut}); \
                         refusing further use until reopened"
                    );
                }
            }
            return Err(e);
        }
        self.scanned += buf.len() as u64;
        Ok(())
    }

    /// The end of the journal as this process knows it, after reading what another consumer
    /// appended: where [`Journal::undo_inbox`] cuts back to.
    pub fn end(&mut self) -> Result<u64> {
        self.check_poisoned()?;
        self.refresh()?;
        Ok(self.scanned)
    }

    /// Takes inbox messages journaled since `end` (from [`Journal::end`]) out again: the file
    /// is cut back to `end` and `ids` are no longer seen. For a drain whose consumption the
    /// inbox refused after the journal had it (a newer incarnation of the member took over):
    /// the messages are the newer one's, not this journal's. A cut that fails poisons the
    /// journal.
    pub fn undo_inbox<'i>(&mut self, end: u64, ids: impl Iterator<Item = &'i str>) -> Result<()> {
        self.check_poisoned()?;
        if let Err(e) = self.file.set_len(end) {
            self.poisoned = true;
            return Err(Error::io("cut back", &self.path)(e));
        }
        fsutil::sync_data(&self.file, &self.path)?;
        self.scanned = self.scanned.min(end);
        for id in ids {
            self.seen.remove(id);
        }
        Ok(())
    }

    /// Fails once a write could not be undone (see [`Journal::write_synced`]).
    fn check_poisoned(&self) -> Result<()> {
        if self.poisoned {
            return Err(Error::JournalPoisoned {
                path: self.path.clone(),
            });
        }
        Ok(())
    }

    /// Journals consumed inbox messages from their raw lines, as [`Entry::Inbox`] entries, with
    /// one write and one fdatasync, skipping those it holds already (and the second of one id
    /// twice in `items`); returns, per item, whether it was new and so journaled. Each item is
    /// `(raw, id)`: `raw` is the message's JSON object exactly as it stood in the inbox
    /// (validated by the caller, no newline), so the journal keeps the full envelope and the
    /// drain does not serialize every message again.
    ///
    /// One look at the set of seen ids per message: each id goes in before the write, and the
    /// new ones come out again if the write fails, so a failure marks nothing seen.
    pub fn append_inbox_lines(&mut self, items: &[(&[u8], &str)]) -> Result<Vec<bool>> {
        self.check_poisoned()?;
        if items.is_empty() {
            return Ok(Vec::new());
        }
        // What another consumer of this journal wrote counts as seen.
        self.refresh()?;
        let fresh: Vec<bool> = items.iter().map(|(_, id)| self.seen.insert(id)).collect();
        // The time of consumption, as every line of the batch gives it.
        let head = format!("{{\"kind\":\"inbox\",\"at\":{},\"message\":", fsutil::now());
        let head = head.as_bytes();
        let mut buf = Vec::with_capacity(
            items
                .iter()
                .zip(&fresh)
                .filter(|(_, f)| **f)
                .map(|((raw, _), _)| raw.len() + head.len() + 2)
                .sum(),
        );
        if buf.capacity() == 0 {
            return Ok(fresh);
        }
        for ((raw, _), _) in items.iter().zip(&fresh).filter(|(_, f)| **f) {
            buf.extend_from_slice(head);
            buf.extend_from_slice(raw);
            buf.extend_from_slice(b"}\n");
        }
        if let Err(e) = self.write_scanned(&buf) {
            for ((_, id), _) in items.iter().zip(&fresh).filter(|(_, f)| **f) {
                self.seen.remove(id);
            }
            return Err(e);
        }
        Ok(fresh)
    }

    /// [`Journal::append_inbox_lines`] for parsed messages, each with its raw line: returns the
    /// messages that were new, in order (what a drain hands to its consumer).
    pub fn append_inbox_messages(&mut self, parsed: Vec<(&[u8], Message)>) -> Result<Vec<Message>> {
        // Borrowed ids: no copy per message.
        let raw: Vec<(&[u8], &str)> = parsed.iter().map(|(l, m)| (*l, m.id.as_str())).collect();
        let keep = self.append_inbox_lines(&raw)?;
        drop(raw);
        Ok(parsed
            .into_iter()
            .zip(keep)
            .filter_map(|((_, m), k)| k.then_some(m))
            .collect())
    }

    /// Reads the last byte of the file (used by tests to check termination).
    #[cfg(test)]
    fn last_byte(&self) -> Option<u8> {
        use std::os::unix::fs::FileExt;
        let len = self.file.metadata().ok()?.len();
        let mut b = [0u8; 1];
        self.file.read_exact_at(&mut b, len.checked_sub(1)?).ok()?;
        Some(b[0])
    }
}

/// The owner lock of the journal at `path`: `NAME.lock` beside `NAME.jsonl`, as
/// [`TeamDir::transcript_lock`] names it.
pub fn owner_lock_path(path: &Path) -> PathBuf {
    path.with_extension("lock")
}

/// Reads every complete entry of a journal without opening it for writing (and without
/// touching a torn tail: anyone may call it, owner or not).
pub fn read_entries(path: &Path) -> Result<Vec<Entry>> {
    let Some(bytes) = fsutil::read_optional(path)? else {
        return Ok(Vec::new());
    };
    let complete = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    Ok(bytes[..complete]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| parse_entry(l).ok())
        .collect())
}

/// How [`Journal::append_inbox_lines`] starts a line; `"at":TIME,` (in journals since it was
/// recorded), `"message":`, the raw message and `}` follow.
const INBOX_HEAD: &[u8] = b"{\"kind\":\"inbox\",";

/// Parses one journal line. A line that [`Journal::append_inbox_lines`] wrote around a raw inbox
/// line is read back the way the drain read that line when it fails as an [`Entry`]: a message
/// may carry unknown fields (nested deeper than serde_json's recursion limit, numbers out of
/// range, invalid UTF-8, lone surrogates) that the envelope skips but the internally tagged
/// `Entry`, which buffers every field, refuses; without this the consumed message would vanish
/// from the journal.
fn parse_entry(line: &[u8]) -> serde_json::Result<Entry> {
    serde_json::from_slice(line).or_else(|e| {
        let Some(rest) = line.strip_prefix(INBOX_HEAD) else {
            return Err(e);
        };
        let (at, rest) = match rest.strip_prefix(b"\"at\":") {
            Some(r) => {
                let end = r.iter().position(|&b| b == b',').unwrap_or(0);
                let at = std::str::from_utf8(&r[..end])
                    .ok()
                    .and_then(|t| t.parse::<f64>().ok());
                (at, &r[(end + 1).min(r.len())..])
            }
            None => (None, rest),
        };
        rest.strip_prefix(b"\"message\":")
            .and_then(|rest| rest.strip_suffix(b"}"))
            .and_then(|raw| Message::parse_line(raw).ok())
            .map(|message| Entry::Inbox { message, at })
            .ok_or(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::MessageType;

    /// The owner lock of `path`'s journal, which must be free.
    fn own(path: &Path) -> HeldLock {
        HeldLock::try_acquire(&owner_lock_path(path))
            .unwrap()
            .expect("the journal has no other owner")
    }

    #[test]
    fn reopen_rebuilds_seen_and_cuts_torn_tail() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.jsonl");
        let owner = own(&path);
        let m = Message::new(MessageType::Message, "lead", "alice", "hi");
        {
            let (mut j, entries) = Journal::open_path(path.clone(), &owner).unwrap();
            assert!(entries.is_empty());
            j.append(&[Entry::Inbox {
                message: m.clone(),
                at: None,
            }])
            .unwrap();
        }
        // A crash mid-append leaves half a line.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(b"{\"kind\":\"inb")
            .unwrap();
        let (mut j, entries) = Journal::open_path(path.clone(), &owner).unwrap();
        assert_eq!(
            entries,
            vec![Entry::Inbox {
                message: m.clone(),
                at: None
            }]
        );
        assert!(j.has_seen(&m.id));
        assert_eq!(j.last_byte(), Some(b'\n'));
        j.append(&[Entry::Idle {
            at: 1.0,
            notification: None,
        }])
        .unwrap();
        assert_eq!(read_entries(&path).unwrap().len(), 2);
    }

    /// Finding 6: a process that does not own a journal opens it while the owner appends large
    /// entries (each `Ok` after its fdatasync); every entry must survive. Without the owner lock
    /// the only way in is a reader that never repairs.
    #[test]
    fn a_non_owner_open_never_cuts_the_owners_appends() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicBool, Ordering};
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.jsonl");
        let lock = own(&path);
        let (mut owner, _) = Journal::open_path(path.clone(), &lock).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (stop, path) = (stop.clone(), path.clone());
            std::thread::spawn(move || {
                let mut refused = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match HeldLock::try_acquire(&owner_lock_path(&path)).unwrap() {
                        Some(l) => drop(Journal::open_path(path.clone(), &l).unwrap()),
                        None => {
                            refused += 1;
                            read_entries(&path).unwrap();
                        }
                    }
                    // A wrong lock does not open it either.
                    let other = HeldLock::try_acquire(&path.with_extension("other"))
                        .unwrap()
                        .unwrap();
                    assert!(Journal::open_path(path.clone(), &other).is_err());
                }
                refused
            })
        };
        for _ in 0..200 {
            let entry = Entry::User {
                text: "x".repeat(1 << 20),
                at: 0.0,
            };
            owner.append(&[entry]).unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        assert_eq!(read_entries(&path).unwrap().len(), 200);
    }

    /// Finding 7: a journal whose failed write could not be undone refuses every call (it
    /// cannot tell what the file holds) until it is reopened, which repairs the tail.
    #[test]
    fn a_poisoned_journal_refuses_everything_until_reopened() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.jsonl");
        let owner = own(&path);
        let (mut j, _) = Journal::open_path(path.clone(), &owner).unwrap();
        j.poisoned = true;
        let e = j
            .append(&[Entry::Idle {
                at: 1.0,
                notification: None,
            }])
            .unwrap_err();
        assert!(matches!(e, Error::JournalPoisoned { .. }), "{e}");
        assert!(j.append(&[]).is_err());
        assert!(j.append_inbox_lines(&[]).is_err());
        assert!(j.refresh().is_err());
        assert!(read_entries(&path).unwrap().is_empty());
        let (mut j, _) = Journal::open_path(path.clone(), &owner).unwrap();
        j.append(&[Entry::Idle {
            at: 1.0,
            notification: None,
        }])
        .unwrap();
        assert_eq!(read_entries(&path).unwrap().len(), 1);
    }

    /// An `idle` line of a journal written before idle notifications were journaled reads as
    /// an idle with nothing to deliver; the new lines read back as written.
    #[test]
    fn idle_lines_old_and_new_read_back() {
        let old: Entry = serde_json::from_str(r#"{"kind":"idle","at":1.5}"#).unwrap();
        assert_eq!(
            old,
            Entry::Idle {
                at: 1.5,
                notification: None
            }
        );
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"kind":"idle","at":1.5}"#
        );
        let m = Message::new(MessageType::IdleNotification, "alice", "lead", "done");
        for e in [
            Entry::Idle {
                at: 2.0,
                notification: Some(m.clone()),
            },
            Entry::IdleDelivered {
                id: m.id.clone(),
                at: 3.0,
            },
        ] {
            let line = serde_json::to_vec(&e).unwrap();
            assert_eq!(parse_entry(&line).unwrap(), e);
        }
    }

    #[test]
    fn refresh_sees_other_writers() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("t.jsonl");
        let owner = own(&path);
        let (mut a, _) = Journal::open_path(path.clone(), &owner).unwrap();
        let (mut b, _) = Journal::open_path(path.clone(), &owner).unwrap();
        let m = Message::new(MessageType::Message, "x", "lead", "1");
        b.append(&[Entry::Inbox {
            message: m.clone(),
            at: None,
        }])
        .unwrap();
        assert!(!a.has_seen(&m.id));
        a.append(&[Entry::Idle {
            at: 0.0,
            notification: None,
        }])
        .unwrap();
        assert!(a.has_seen(&m.id));
        assert_eq!(read_entries(&path).unwrap().len(), 2);
    }
}
