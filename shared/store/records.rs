//! The one-record-per-file directories of the team dir (`requests/`, `tasks/`): a record is
//! `ID.json`, its id an 8-hex name reserved by creating its sidecar `ID.lock` with `O_EXCL`, and
//! every change happens under that lock, held across the read, the check and the durable
//! replace (temp, fsync, rename, fsync dir). So of two processes racing to change a record,
//! exactly one wins and the other sees what it lost to. The stores ([`crate::requests`],
//! [`crate::tasks`]) decide what a change may be; this module only reads and writes.
//!
//! On a bus a record is the document `NOUN:ID` and its id a member of the set `NOUNs`, added
//! by a script fenced like every write ([`super::redis::Fence`]): a process replaced while it
//! was stalled reserves no id.

use std::collections::{HashMap, HashSet};
use std::io::ErrorKind;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Store;
use super::redis::fenced_script;
use crate::error::{Error, Result};
use crate::fsutil::{self, FILE_MODE};
use crate::teamdir::TeamDir;

/// KEYS: fence, the set of ids. ARGV: fence value, the id. 1 when the id is new to the set.
const RESERVE: &str = fenced_script!(
    r"
return redis.call('SADD', KEYS[2], ARGV[2])
"
);

/// Adds `id` to the set of ids `index` (a team key), fenced: true when it was not there.
fn reserve_on_bus(bus: &super::redis::RedisBus, index: &str, id: &str) -> Result<bool> {
    let index = bus.key(index);
    let (fence, fence_value) = bus.fence_args();
    let added: i64 = bus.with_conn("reserve an id", |c| {
        redis::Script::new(RESERVE)
            .key(&fence)
            .key(&index)
            .arg(&fence_value)
            .arg(id)
            .invoke(c)
    })?;
    Ok(added == 1)
}

/// One kind of record in one team dir.
pub(crate) struct Records<'a> {
    pub team: &'a TeamDir,
    /// The directory of the records.
    pub dir: fn(&TeamDir) -> PathBuf,
    /// `ID.json` (refusing ids that are not 8 lower-case hex characters).
    pub file: fn(&TeamDir, &str) -> Result<PathBuf>,
    /// `ID.lock`.
    pub lock: fn(&TeamDir, &str) -> Result<PathBuf>,
    /// The error for an id that names no record.
    pub unknown: fn(String) -> Error,
    /// What a record is, in error messages, and its keys on a bus (`NOUN:ID`, the index set
    /// `NOUNs`).
    pub noun: &'static str,
}

/// What a poller (`lead top`) keeps between two listings of one kind of record in one team,
/// so that each reads only the records that changed since the last ([`Records::list_cached`]):
/// records are never removed, and a team's history would otherwise be read again at every
/// pass (review 4, m7).
///
/// - **Files**: a record is read again only when its file is no longer the one it was read
///   from (inode, size, modification or change time differ): a change replaces the file
///   (rename), and an edit in place changes its times. A listing costs the directory's names
///   and a `stat` per record.
/// - **Bus**: a record is read again only when the change feed names its key after the
///   feed's entry that was newest at the last listing (every document write adds its key to
///   the feed in the same step). When the feed cannot say (the first listing, or the feed,
///   capped at about 1000 entries, no longer reaches back that far), every record is read.
pub struct Listing<T> {
    seen: HashMap<String, (Option<Stamp>, T)>,
    /// On a bus, the change feed's newest entry at the last listing.
    feed: Option<String>,
}

impl<T> Default for Listing<T> {
    fn default() -> Self {
        Listing {
            seen: HashMap::new(),
            feed: None,
        }
    }
}

/// Which file a record was read from, as far as `stat` tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(md: &std::fs::Metadata) -> Stamp {
        use std::os::unix::fs::MetadataExt;
        Stamp {
            dev: md.dev(),
            ino: md.ino(),
            len: md.len(),
            mtime: (md.mtime(), md.mtime_nsec()),
            ctime: (md.ctime(), md.ctime_nsec()),
        }
    }
}

impl Records<'_> {
    /// A fresh id, reserved by creating its lock file (a collision draws again).
    pub fn reserve_id(&self) -> Result<String> {
        if let Store::Redis(bus) = self.team.store() {
            loop {
                let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
                // SADD answers 1 for an id new to the set: reserved. (Run twice after a lost
                // reply, it answers 0 and a new id is drawn; the first stays unused.)
                if reserve_on_bus(bus, &self.index(), &id)? {
                    return Ok(id);
                }
            }
        }
        fsutil::create_dir(&(self.dir)(self.team))?;
        loop {
            let id = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
            let lock_path = (self.lock)(self.team, &id)?;
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(FILE_MODE)
                .open(&lock_path)
            {
                Ok(_) => return Ok(id),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(Error::io("create", &lock_path)(e)),
            }
        }
    }

    /// Reserves the id `id`, chosen by the caller (a record keyed by what it is about):
    /// `false` when it was reserved already.
    pub fn reserve_keyed(&self, id: &str) -> Result<bool> {
        (self.file)(self.team, id)?;
        if let Store::Redis(bus) = self.team.store() {
            return reserve_on_bus(bus, &self.index(), id);
        }
        fsutil::create_dir(&(self.dir)(self.team))?;
        let lock_path = (self.lock)(self.team, id)?;
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&lock_path)
        {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(Error::io("create", &lock_path)(e)),
        }
    }

    /// The record `id`, or `None` when its file is not there.
    pub fn read<T: DeserializeOwned>(&self, id: &str) -> Result<Option<T>> {
        let path = (self.file)(self.team, id)?;
        let bytes = match self.team.store() {
            Store::Redis(bus) => bus.get_doc(&self.key(id))?,
            Store::Files(_) => fsutil::read_optional(&path)?,
        };
        let Some(bytes) = bytes else {
            return Ok(None);
        };
        self.parse(id, &bytes).map(Some)
    }

    fn parse<T: DeserializeOwned>(&self, id: &str, bytes: &[u8]) -> Result<T> {
        serde_json::from_slice(bytes).map_err(|e| Error::Corrupt {
            path: match self.team.store() {
                Store::Redis(bus) => PathBuf::from(bus.key(&self.key(id))),
                Store::Files(_) => (self.file)(self.team, id).unwrap_or_default(),
            },
            why: e.to_string(),
        })
    }

    /// Record `id`'s key on a bus.
    fn key(&self, id: &str) -> String {
        format!("{}:{id}", self.noun)
    }

    /// The key of the set of ids on a bus.
    fn index(&self) -> String {
        format!("{}s", self.noun)
    }

    /// Every record on the bus.
    fn list_bus<T: DeserializeOwned>(&self, bus: &super::redis::RedisBus) -> Result<Vec<T>> {
        let index = bus.key(&self.index());
        let mut ids: Vec<String> =
            bus.with_conn("list", |c| redis::cmd("SMEMBERS").arg(&index).query(c))?;
        ids.retain(|id| (self.file)(self.team, id).is_ok());
        let keys: Vec<String> = ids.iter().map(|id| self.key(id)).collect();
        let mut out = Vec::new();
        for (id, bytes) in ids.iter().zip(bus.get_docs(&keys)?) {
            match bytes.map(|b| self.parse(id, &b)) {
                Some(Ok(r)) => out.push(r),
                Some(Err(e)) => tracing::warn!("skipping {}: {e}", self.noun),
                None => {}
            }
        }
        Ok(out)
    }

    /// The record `id`.
    pub fn get<T: DeserializeOwned>(&self, id: &str) -> Result<T> {
        self.read(id)?.ok_or_else(|| (self.unknown)(id.to_owned()))
    }

    /// Every record, in no order. Files that are not records are ignored; unreadable records
    /// are reported with a warning and skipped.
    pub fn list<T: DeserializeOwned>(&self) -> Result<Vec<T>> {
        if let Store::Redis(bus) = self.team.store() {
            return self.list_bus(bus);
        }
        let mut out = Vec::new();
        for (id, _) in self.files()? {
            match self.read(&id) {
                Ok(Some(r)) => out.push(r),
                Ok(None) => {}
                Err(e) => tracing::warn!("skipping {}: {e}", self.noun),
            }
        }
        Ok(out)
    }

    /// The ids of the record files in the directory, each with its path: `ID.json` files whose
    /// `ID` names a record (none when the directory is missing).
    fn files(&self) -> Result<Vec<(String, std::path::PathBuf)>> {
        let dir = (self.dir)(self.team);
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("list", &dir)(e)),
        };
        let mut out = Vec::new();
        for ent in rd {
            let ent = ent.map_err(Error::io("list", &dir))?;
            let name = ent.file_name();
            let Some(id) = name.to_str().and_then(|n| n.strip_suffix(".json")) else {
                continue;
            };
            if let Ok(path) = (self.file)(self.team, id) {
                out.push((id.to_owned(), path));
            }
        }
        Ok(out)
    }

    /// Every record, as [`Records::list`] has them, reading only those that changed since the
    /// listing `cache` was last given to (see [`Listing`]).
    pub fn list_cached<T: DeserializeOwned + Clone>(
        &self,
        cache: &mut Listing<T>,
    ) -> Result<Vec<T>> {
        if let Store::Redis(bus) = self.team.store() {
            return self.list_bus_cached(bus, cache);
        }
        let mut present = HashSet::new();
        let mut out = Vec::new();
        for (id, path) in self.files()? {
            let id = id.as_str();
            // The file's stamp before its bytes: a change between the two is read again next
            // time, never missed.
            let stamp = match std::fs::metadata(&path) {
                Ok(md) => Stamp::of(&md),
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(e) => return Err(Error::io("stat", &path)(e)),
            };
            present.insert(id.to_owned());
            if let Some((Some(was), r)) = cache.seen.get(id)
                && *was == stamp
            {
                out.push(r.clone());
                continue;
            }
            match self.read::<T>(id) {
                Ok(Some(r)) => {
                    cache.seen.insert(id.to_owned(), (Some(stamp), r.clone()));
                    out.push(r);
                }
                Ok(None) => {
                    cache.seen.remove(id);
                }
                Err(e) => {
                    cache.seen.remove(id);
                    tracing::warn!("skipping {}: {e}", self.noun);
                }
            }
        }
        cache.seen.retain(|id, _| present.contains(id));
        Ok(out)
    }

    /// [`Records::list_cached`] on a bus: the ids from their set, and the documents of those
    /// the change feed names since the last listing (all of them when it cannot tell).
    fn list_bus_cached<T: DeserializeOwned + Clone>(
        &self,
        bus: &super::redis::RedisBus,
        cache: &mut Listing<T>,
    ) -> Result<Vec<T>> {
        // The feed before the documents: a change between the two is read again next time.
        let (newest, changed) = bus.changes_after(cache.feed.as_deref())?;
        let prefix = bus.key(&format!("{}:", self.noun));
        let changed: Option<HashSet<&str>> = changed.as_ref().map(|keys| {
            keys.iter()
                .filter_map(|k| k.strip_prefix(&prefix))
                .collect()
        });
        let index = bus.key(&self.index());
        let mut ids: Vec<String> =
            bus.with_conn("list", |c| redis::cmd("SMEMBERS").arg(&index).query(c))?;
        ids.retain(|id| (self.file)(self.team, id).is_ok());
        let fetch: Vec<&String> = ids
            .iter()
            .filter(|id| {
                !cache.seen.contains_key(id.as_str())
                    || changed.as_ref().is_none_or(|c| c.contains(id.as_str()))
            })
            .collect();
        let keys: Vec<String> = fetch.iter().map(|id| self.key(id)).collect();
        for (id, bytes) in fetch.into_iter().zip(bus.get_docs(&keys)?) {
            match bytes.map(|b| self.parse::<T>(id, &b)) {
                Some(Ok(r)) => {
                    cache.seen.insert(id.clone(), (None, r));
                }
                Some(Err(e)) => {
                    cache.seen.remove(id.as_str());
                    tracing::warn!("skipping {}: {e}", self.noun);
                }
                None => {
                    cache.seen.remove(id.as_str());
                }
            }
        }
        let present: HashSet<&str> = ids.iter().map(String::as_str).collect();
        cache.seen.retain(|id, _| present.contains(id.as_str()));
        cache.feed = newest;
        Ok(ids
            .iter()
            .filter_map(|id| cache.seen.get(id.as_str()).map(|(_, r)| r.clone()))
            .collect())
    }

    /// Reads record `id` under its lock, lets `f` decide its next state (`None`: no change),
    /// and writes it durably if it changed. An id that was never reserved is unknown.
    pub fn locked<T>(&self, id: &str, f: impl FnOnce(Option<T>) -> Result<Option<T>>) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + PartialEq,
    {
        let path = (self.file)(self.team, id)?;
        if let Store::Redis(bus) = self.team.store() {
            return self.locked_bus(bus, id, f);
        }
        let lock_path = (self.lock)(self.team, id)?;
        if !lock_path.exists() && !path.exists() {
            return Err((self.unknown)(id.to_owned()));
        }
        let lock = fsutil::open_lock(&lock_path)?;
        let _guard = fsutil::lock_exclusive(&lock, &lock_path)?;
        let (changed, now) = self.decide(id, self.read(id)?, f)?;
        if changed {
            let mut bytes = serde_json::to_vec_pretty(&now).map_err(|e| self.unserializable(e))?;
            bytes.push(b'\n');
            fsutil::atomic_write(&path, &bytes)?;
        }
        Ok(now)
    }

    /// What `f` makes of record `id`, `before`: whether it changed, and the record as it
    /// stands after (`f` answering `None` leaves it as it was; an absent record stays unknown).
    fn decide<T>(
        &self,
        id: &str,
        before: Option<T>,
        f: impl FnOnce(Option<T>) -> Result<Option<T>>,
    ) -> Result<(bool, T)>
    where
        T: Clone + PartialEq,
    {
        match f(before.clone())? {
            Some(next) => Ok((Some(&next) != before.as_ref(), next)),
            None => before
                .map(|b| (false, b))
                .ok_or_else(|| (self.unknown)(id.to_owned())),
        }
    }

    fn unserializable(&self, e: serde_json::Error) -> Error {
        Error::Protocol(format!("failed to serialize {}: {e}", self.noun))
    }

    /// [`Records::locked`] on the bus: the record's lock is a lease on the server and the write
    /// is fenced by it (see [`super::redis`]).
    fn locked_bus<T>(
        &self,
        bus: &super::redis::RedisBus,
        id: &str,
        f: impl FnOnce(Option<T>) -> Result<Option<T>>,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned + Clone + PartialEq,
    {
        let index = bus.key(&self.index());
        let known: bool = bus.with_conn("look up", |c| {
            redis::cmd("SISMEMBER").arg(&index).arg(id).query(c)
        })?;
        if !known {
            return Err((self.unknown)(id.to_owned()));
        }
        bus.locked_doc(&self.key(id), |bytes| {
            let before: Option<T> = bytes.map(|b| self.parse(id, &b)).transpose()?;
            let (changed, now) = self.decide(id, before, f)?;
            let bytes = changed
                .then(|| serde_json::to_vec(&now).map_err(|e| self.unserializable(e)))
                .transpose()?;
            Ok((bytes, now))
        })
    }
}
