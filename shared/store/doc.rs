//! One named document of a team, wherever the team's state lives: a file in the team dir
//! replaced under its sidecar lock (temp, fsync, rename, fsync dir), or a key on the bus
//! changed under its lock and written fenced by it (see [`super::redis`]). Callers read and
//! change bytes and never ask which backend holds them.
//!
//! The record of applied team files (`team-file.json`) lives here, so a team on a bus has one
//! record for every host.

use std::path::PathBuf;

use super::Store;
use crate::error::Result;
use crate::fsutil;
use crate::teamdir::TeamDir;

/// A document of `team`: `NAME.json` in the team dir (changed under `NAME.lock`), or the key
/// `NAME` on the team's bus.
pub struct Doc<'a> {
    team: &'a TeamDir,
    name: &'static str,
    /// Its key on a bus (`name` but for the roster, whose key is `roster`).
    key: &'static str,
}

impl<'a> Doc<'a> {
    pub fn new(team: &'a TeamDir, name: &'static str) -> Doc<'a> {
        Doc {
            team,
            name,
            key: name,
        }
    }

    /// The roster: `config.json` under `config.lock`, or the key `roster` on the bus.
    pub fn roster(team: &'a TeamDir) -> Doc<'a> {
        Doc {
            team,
            name: "config",
            key: "roster",
        }
    }

    /// Whether people read and edit it (a file in the team dir, rather than a key on a bus).
    fn is_file(&self) -> bool {
        self.team.store().for_people()
    }

    /// `value` as this document's bytes: indented JSON with a final newline in a file (people
    /// read and edit it), compact on a bus.
    pub fn encode<T: serde::Serialize>(&self, value: &T) -> Result<Vec<u8>> {
        let unserializable = |e: serde_json::Error| {
            crate::Error::Protocol(format!("failed to serialize {}: {e}", self.name))
        };
        if self.is_file() {
            let mut bytes = serde_json::to_vec_pretty(value).map_err(unserializable)?;
            bytes.push(b'\n');
            Ok(bytes)
        } else {
            serde_json::to_vec(value).map_err(unserializable)
        }
    }

    fn file(&self) -> PathBuf {
        self.team.root().join(format!("{}.json", self.name))
    }

    /// Where the document is, for messages: its file, or its key on the bus.
    pub fn place(&self) -> String {
        match self.team.store() {
            Store::Redis(bus) => bus.key(self.key),
            Store::Files(_) => self.file().display().to_string(),
        }
    }

    /// The error for bytes of it that do not parse (left as they are).
    pub fn corrupt(&self, why: impl std::fmt::Display) -> crate::Error {
        let why = if self.is_file() {
            format!("{why} (fix or remove the file; it was left untouched)")
        } else {
            why.to_string()
        };
        crate::Error::Corrupt {
            path: PathBuf::from(self.place()),
            why,
        }
    }

    /// Its bytes; `None` when it does not exist.
    pub fn read(&self) -> Result<Option<Vec<u8>>> {
        match self.team.store() {
            Store::Redis(bus) => bus.get_doc(self.key),
            Store::Files(_) => fsutil::read_optional(&self.file()),
        }
    }

    /// Its bytes if it changed since `seen` was last given to this call (`Some(None)`: it does
    /// not exist), or `None` when it is as it was then: what a reader that keeps its own copy
    /// (the supervisor's view, a worker's settings) needs, without parsing a document that did
    /// not change. On a bus it is read every time.
    ///
    /// A file is read and its bytes compared, by length and hash, with the last ones: reading
    /// costs far less than parsing. A [`Seen::holding`] reader (one process, the supervisor)
    /// skips the read too when the file has the same inode, size, and modification and change
    /// times as the one it read, which it holds open: its inode cannot be freed and reused by a
    /// later replacement (every writer replaces the file by a new one), so a replacement is
    /// always seen; an edit in place (a person's editor) is compared by content unless it kept
    /// the size and times.
    pub fn read_if_changed(&self, seen: &mut Seen) -> Result<Option<Option<Vec<u8>>>> {
        if !self.is_file() {
            return self.read().map(Some);
        }
        let path = self.file();
        let mut f = match std::fs::File::open(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let was_missing = seen.last.is_none() && seen.read_once;
                seen.last = None;
                seen.read_once = true;
                return Ok((!was_missing).then_some(None));
            }
            Err(e) => return Err(crate::Error::io("open", &path)(e)),
        };
        let meta = f
            .metadata()
            .map_err(crate::Error::io("read the metadata of", &path))?;
        let stamp = Stamp::of(&meta);
        if seen.hold
            && let Some(last) = &seen.last
            && last.file.is_some()
            && last.stamp == stamp
        {
            return Ok(None);
        }
        let mut bytes = Vec::with_capacity(meta.len() as usize);
        std::io::Read::read_to_end(&mut f, &mut bytes).map_err(crate::Error::io("read", &path))?;
        let digest = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            bytes.hash(&mut h);
            h.finish()
        };
        let same = seen
            .last
            .as_ref()
            .is_some_and(|l| l.len == bytes.len() && l.digest == digest);
        seen.read_once = true;
        seen.last = Some(LastRead {
            file: seen.hold.then_some(f),
            stamp,
            len: bytes.len(),
            digest,
        });
        Ok((!same).then_some(Some(bytes)))
    }

    /// Reads it under its lock, lets `f` decide its next bytes (`None`: no change, nothing
    /// written) and writes them durably before the lock goes.
    pub fn update<R>(
        &self,
        f: impl FnOnce(Option<Vec<u8>>) -> Result<(Option<Vec<u8>>, R)>,
    ) -> Result<R> {
        if let Store::Redis(bus) = self.team.store() {
            return bus.locked_doc(self.key, f);
        }
        let lock_path = self.team.root().join(format!("{}.lock", self.name));
        let lock = fsutil::open_lock(&lock_path)?;
        let _guard = fsutil::lock_exclusive(&lock, &lock_path)?;
        let (next, out) = f(fsutil::read_optional(&self.file())?)?;
        if let Some(bytes) = next {
            fsutil::atomic_write(&self.file(), &bytes)?;
        }
        Ok(out)
    }
}

/// What [`Doc::read_if_changed`] last read of a document in a file. Empty before the first
/// read, on a bus, and while the file is missing.
#[derive(Debug, Default)]
pub struct Seen {
    /// Whether the file read is held open, to skip reading it again while it is the same.
    hold: bool,
    read_once: bool,
    last: Option<LastRead>,
}

impl Seen {
    /// A reader that holds the file it read open (see [`Doc::read_if_changed`]): for one
    /// process that looks often, not for one per member (each would keep a replaced roster
    /// on disk).
    pub fn holding() -> Seen {
        Seen {
            hold: true,
            ..Seen::default()
        }
    }
}

#[derive(Debug)]
struct LastRead {
    file: Option<std::fs::File>,
    stamp: Stamp,
    len: usize,
    digest: u64,
}

/// A file's inode, size, and modification and change times (seconds and nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp([i64; 7]);

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp([
            m.dev() as i64,
            m.ino() as i64,
            m.size() as i64,
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec(),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_is_read_changed_and_left_alone_when_unchanged() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let doc = Doc::new(&team, "notes");
        assert_eq!(doc.read().unwrap(), None);
        doc.update(|before| {
            assert_eq!(before, None);
            Ok((Some(b"one".to_vec()), ()))
        })
        .unwrap();
        assert_eq!(doc.read().unwrap().as_deref(), Some(&b"one"[..]));
        let modified = || std::fs::metadata(tmp.path().join(".team/notes.json")).unwrap();
        let ino = std::os::unix::fs::MetadataExt::ino(&modified());
        doc.update(|before| Ok((None, before))).unwrap();
        assert_eq!(std::os::unix::fs::MetadataExt::ino(&modified()), ino);
        assert!(doc.place().ends_with("notes.json"));
    }

    #[test]
    fn a_reader_rereads_only_what_changed() {
        for mut seen in [Seen::default(), Seen::holding()] {
            rereads_only_what_changed(&mut seen);
        }
    }

    fn rereads_only_what_changed(seen: &mut Seen) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let doc = Doc::new(&team, "notes");
        assert_eq!(doc.read_if_changed(seen).unwrap(), Some(None));
        assert_eq!(doc.read_if_changed(seen).unwrap(), None);
        let write = |b: &'static [u8]| doc.update(|_| Ok((Some(b.to_vec()), ()))).unwrap();
        write(b"one");
        assert_eq!(
            doc.read_if_changed(seen).unwrap(),
            Some(Some(b"one".to_vec()))
        );
        assert_eq!(doc.read_if_changed(seen).unwrap(), None);
        // Every replacement is seen, even one of the same size within the same clock tick;
        // one with the same bytes changes nothing.
        for b in [&b"two"[..], b"owt", b"two"] {
            write(b);
            assert_eq!(doc.read_if_changed(seen).unwrap(), Some(Some(b.to_vec())));
            assert_eq!(doc.read_if_changed(seen).unwrap(), None);
        }
        write(b"two");
        assert_eq!(doc.read_if_changed(seen).unwrap(), None);
        // An edit in place that changes the size is seen too.
        std::fs::write(tmp.path().join(".team/notes.json"), b"longer").unwrap();
        assert_eq!(
            doc.read_if_changed(seen).unwrap(),
            Some(Some(b"longer".to_vec()))
        );
        std::fs::remove_file(tmp.path().join(".team/notes.json")).unwrap();
        assert_eq!(doc.read_if_changed(seen).unwrap(), Some(None));
        assert_eq!(doc.read_if_changed(seen).unwrap(), None);
    }
}
