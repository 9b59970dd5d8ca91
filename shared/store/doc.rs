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
}
