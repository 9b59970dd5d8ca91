//! Small, careful file primitives: private modes, flock guards, durable atomic replace.
//!
//! Everything in the team dir is written through these helpers so that the durability rules of
//! DESIGN.md hold in one place: files are created 0600, locks are sidecar files that are never
//! replaced, and a replaced file goes temp -> fsync -> rename -> fsync(dir).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};

/// Mode of every file troupe creates in the team dir.
pub const FILE_MODE: u32 = 0o600;
/// Mode of every directory troupe creates in the team dir.
pub const DIR_MODE: u32 = 0o700;

/// Seconds since the Unix epoch, with sub-second precision, as stored in the JSON files.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Creates `dir` (and parents) with mode 0700 if it does not exist.
pub fn create_dir(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(Error::io("create directory", dir))
}

/// Opens `path` for appending (`O_APPEND`), creating it 0600.
pub fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(FILE_MODE)
        .open(path)
        .map_err(Error::io("open for append", path))
}

/// Opens `path` read-write without truncating, creating it 0600.
pub fn open_rw(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(FILE_MODE)
        .open(path)
        .map_err(Error::io("open", path))
}

/// Opens (creating 0600) a sidecar lock file.
pub fn open_lock(path: &Path) -> Result<File> {
    open_rw(path)
}

/// Retries an operation interrupted by a signal.
fn retry_eintr<T>(mut f: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    loop {
        match f() {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            other => return other,
        }
    }
}

/// A held flock on a borrowed file; released on drop (the file stays open).
#[must_use = "the lock is released when the guard is dropped"]
pub struct LockGuard<'a> {
    file: &'a File,
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        // Unlock failing would mean a bad fd; closing the file releases the lock regardless.
        let _ = self.file.unlock();
    }
}

/// Takes an exclusive flock on `file`, waiting for it.
pub fn lock_exclusive<'a>(file: &'a File, path: &Path) -> Result<LockGuard<'a>> {
    retry_eintr(|| file.lock()).map_err(Error::io("lock", path))?;
    Ok(LockGuard { file })
}

/// Takes a shared flock on `file`, waiting for it.
pub fn lock_shared<'a>(file: &'a File, path: &Path) -> Result<LockGuard<'a>> {
    retry_eintr(|| file.lock_shared()).map_err(Error::io("lock", path))?;
    Ok(LockGuard { file })
}

/// Tries to take an exclusive flock without waiting; `Ok(None)` if another process holds it.
pub fn try_lock_exclusive<'a>(file: &'a File, path: &Path) -> Result<Option<LockGuard<'a>>> {
    match retry_eintr(|| file.try_lock().map_err(io::Error::from)) {
        Ok(()) => Ok(Some(LockGuard { file })),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        Err(e) => Err(Error::io("lock", path)(e)),
    }
}

/// An owned lock file held exclusively for as long as the value lives (a process-lifetime lock:
/// the kernel drops it when the process dies, even by `kill -9`).
#[derive(Debug)]
pub struct HeldLock {
    _file: File,
}

impl HeldLock {
    /// Tries to take the lock at `path`; `Ok(None)` if another process holds it.
    pub fn try_acquire(path: &Path) -> Result<Option<HeldLock>> {
        let file = open_lock(path)?;
        let held = match retry_eintr(|| file.try_lock().map_err(io::Error::from)) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(e) => return Err(Error::io("lock", path)(e)),
        };
        Ok(held.then_some(HeldLock { _file: file }))
    }

    /// Whether some process holds the lock at `path` right now (without keeping it).
    pub fn is_held(path: &Path) -> Result<bool> {
        if !path.exists() {
            return Ok(false);
        }
        Ok(HeldLock::try_acquire(path)?.is_none())
    }
}

/// fsyncs a directory so that a rename or create inside it is durable.
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let d = File::open(dir).map_err(Error::io("open directory", dir))?;
    retry_eintr(|| d.sync_all()).map_err(Error::io("fsync directory", dir))
}

/// Durably replaces `path` with `bytes`: temp file in the same directory, fsync, rename, fsync of
/// the directory. Readers see the old or the new content, never a mix; after return the new
/// content survives a crash. Callers serialize writers with a sidecar lock.
pub fn atomic_write(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(
        ".{name}.tmp.{}.{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(FILE_MODE)
            .open(&tmp)
            .map_err(Error::io("create temp file", &tmp))?;
        f.write_all(bytes).map_err(Error::io("write", &tmp))?;
        retry_eintr(|| f.sync_all()).map_err(Error::io("fsync", &tmp))?;
        fs::rename(&tmp, path).map_err(Error::io("rename into place", path))?;
        fsync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Reads a whole file; `Ok(None)` if it does not exist.
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(b) => Ok(Some(b)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("read", path)(e)),
    }
}

/// Reads what a file holds past its first `offset` bytes (what an appender wrote since then);
/// `Ok(None)` if it does not exist.
pub fn read_from(path: &Path, offset: u64) -> Result<Option<Vec<u8>>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open", path)(e)),
    };
    f.seek(SeekFrom::Start(offset))
        .map_err(Error::io("seek", path))?;
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes).map_err(Error::io("read", path))?;
    Ok(Some(bytes))
}

/// fdatasyncs a file, retrying on EINTR.
pub fn sync_data(file: &File, path: &Path) -> Result<()> {
    retry_eintr(|| file.sync_data()).map_err(Error::io("fsync", path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn read_from_returns_what_was_appended_after_an_offset() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("log");
        assert_eq!(read_from(&path, 0).unwrap(), None);
        fs::write(&path, b"old line\nnew line\n").unwrap();
        assert_eq!(read_from(&path, 9).unwrap().unwrap(), b"new line\n");
        assert_eq!(read_from(&path, 100).unwrap().unwrap(), b"");
    }

    #[test]
    fn atomic_write_replaces_and_is_private() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let p = dir.join("x.json");
        atomic_write(&p, b"one").unwrap();
        atomic_write(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let leftovers: Vec<_> = fs::read_dir(dir).unwrap().collect();
        assert_eq!(leftovers.len(), 1, "no temp file left behind");
    }

    #[test]
    fn held_lock_excludes_second_holder() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("a.lock");
        let first = HeldLock::try_acquire(&p).unwrap();
        assert!(first.is_some());
        assert!(HeldLock::try_acquire(&p).unwrap().is_none());
        assert!(HeldLock::is_held(&p).unwrap());
        drop(first);
        assert!(!HeldLock::is_held(&p).unwrap());
    }
}
