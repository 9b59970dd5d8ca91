//! Small, careful file primitives: private modes, flock guards, durable atomic replace.
//!
//! Everything in the team dir is written through these helpers so that the durability rules of
//! DESIGN.md hold in one place: files are created 0600, locks are sidecar files that are never
//! replaced, and a replaced file goes temp -> fsync -> rename -> fsync(dir).

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
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

/// The environment variables that name a file or directory. They are made absolute as each
/// process starts ([`absolute_path_vars`]): a worker or a hook starts in another directory (its
/// worktree, `--workdir`) than the person who set them.
pub const PATH_VARS: [&str; 8] = [
    "TROUPE_TEAM_DIR",
    "ANTHROPIC_API_KEY_FILE",
    "OPENAI_API_KEY_FILE",
    "TROUPE_CASSETTE",
    "TROUPE_RECORD",
    "TROUPE_BUS_PASSWORD_FILE",
    "TROUPE_PRICES",
    "CREDENTIALS_DIRECTORY",
];

/// Rewrites each of [`PATH_VARS`] that is set to a relative path as the absolute path it names
/// from the current directory, so that every process started from here reads the same file.
///
/// # Safety
///
/// Changes the environment: call it before any other thread exists.
pub unsafe fn absolute_path_vars() {
    for var in PATH_VARS {
        let Some(v) = std::env::var_os(var) else {
            continue;
        };
        if v.is_empty() || Path::new(&v).is_absolute() {
            continue;
        }
        if let Ok(abs) = std::path::absolute(&v) {
            // SAFETY: the caller promises no other thread exists.
            unsafe { std::env::set_var(var, abs) };
        }
    }
}

/// A clap value parser for a path argument: the path made absolute against the current
/// directory, where the argument is read (a relative `--workdir` or `--sandbox-read` handed on
/// to a worker in another directory would name another place).
pub fn absolute_arg(s: &str) -> std::result::Result<PathBuf, String> {
    if s.is_empty() {
        return Err("an empty path".to_owned());
    }
    std::path::absolute(s).map_err(|e| format!("{s}: {e}"))
}

/// Creates `dir` (and parents) with mode 0700 if it does not exist.
pub fn create_dir(dir: &Path) -> Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .map_err(Error::io("create directory", dir))
}

/// Takes group and other permissions off a directory of ours that has them (an existing team
/// dir keeps whatever mode it was made with, and its listing shows who is on the team and what
/// they are asked). A directory of another owner is left alone, with a warning.
pub fn make_private(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = fs::metadata(dir).map_err(Error::io("stat", dir))?;
    if meta.mode() & 0o077 == 0 {
        return Ok(());
    }
    if meta.uid() != nix::unistd::geteuid().as_raw() {
        tracing::warn!(
            "{} is open to others (mode {:o}) and not ours to change",
            dir.display(),
            meta.mode() & 0o777
        );
        return Ok(());
    }
    let mode = meta.mode() & 0o700;
    fs::set_permissions(dir, fs::Permissions::from_mode(mode)).map_err(Error::io("chmod", dir))
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
    /// Where the lock file is, so that what the lock guards can check it got the right one.
    path: PathBuf,
}

impl HeldLock {
    /// Takes the lock at `path`, waiting for another holder to let it go.
    pub fn acquire(path: &Path) -> Result<HeldLock> {
        let file = open_lock(path)?;
        retry_eintr(|| file.lock()).map_err(Error::io("lock", path))?;
        Ok(HeldLock {
            _file: file,
            path: path.to_owned(),
        })
    }

    /// Tries to take the lock at `path`; `Ok(None)` if another process holds it.
    pub fn try_acquire(path: &Path) -> Result<Option<HeldLock>> {
        let file = open_lock(path)?;
        let held = match retry_eintr(|| file.try_lock().map_err(io::Error::from)) {
            Ok(()) => true,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => false,
            Err(e) => return Err(Error::io("lock", path)(e)),
        };
        Ok(held.then(|| HeldLock {
            _file: file,
            path: path.to_owned(),
        }))
    }

    /// The lock file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Like [`HeldLock::try_acquire`], but a lock found held is tried again a few times over
    /// about 10 ms before the answer is "held": a process that only probes it (the fallback of
    /// [`HeldLock::is_held`]) holds it for microseconds, and must not make, say, a starting
    /// `lead run` exit "locked".
    pub fn try_acquire_settled(path: &Path) -> Result<Option<HeldLock>> {
        for _ in 0..5 {
            if let Some(l) = HeldLock::try_acquire(path)? {
                return Ok(Some(l));
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        HeldLock::try_acquire(path)
    }

    /// Whether some process holds the lock at `path` right now, shared or exclusive.
    ///
    /// Looks for a `FLOCK` entry on the file's device and inode in `/proc/locks`, without
    /// touching the lock: a probe that takes the lock, even for an instant, makes a
    /// `try_acquire` at that instant fail (a `lead run` starting while `lead stop` polls would
    /// exit "locked"; acquirers that must not be fooled use
    /// [`HeldLock::try_acquire_settled`]). The probe is the fallback when `/proc/locks` cannot be
    /// read in one call (see `read_proc_locks`), and when it
    /// lists the file's inode on another device number (btrfs subvolumes and some stacked
    /// filesystems show `stat` a device that is not the one in `/proc/locks`). The kernel leaves
    /// out locks of processes outside the reader's pid namespace, so a holder in another
    /// container is not seen.
    pub fn is_held(path: &Path) -> Result<bool> {
        use std::os::unix::fs::MetadataExt;
        let meta = match fs::metadata(path) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(Error::io("stat", path)(e)),
        };
        let listed = read_proc_locks().and_then(|text| flock_listed(&text, meta.dev(), meta.ino()));
        match listed {
            Some(held) => Ok(held),
            None => Ok(HeldLock::try_acquire(path)?.is_none()),
        }
    }
}

/// `/proc/locks`, if one `read(2)` returns all of it; else `None`. The kernel lists the locks
/// under its lock for the length of one read call only (a page of text, about 80 locks), and a
/// listing read in several calls restarts from an offset each time, so a lock released between
/// two calls shifts the rest and one still held can be skipped (seen under load: `lead stop`
/// returned while the supervisor still ran). A longer listing makes the caller fall back to the
/// probe, which never misses a holder.
fn read_proc_locks() -> Option<String> {
    use std::io::Read;
    let mut f = File::open("/proc/locks").ok()?;
    let mut buf = vec![0u8; 1 << 16];
    let n = retry_eintr(|| f.read(&mut buf)).ok()?;
    let mut more = [0u8; 1];
    if retry_eintr(|| f.read(&mut more)).ok()? != 0 {
        return None;
    }
    buf.truncate(n);
    String::from_utf8(buf).ok()
}

/// Whether `/proc/locks` (its text) lists a flock on device `dev`, inode `ino`; `None` when it
/// cannot tell: an entry has that inode on another device, whose numbers may not be comparable.
///
/// A line reads `1: FLOCK  ADVISORY  WRITE 4242 fe:00:10010969 0 EOF`: major and minor in hex,
/// the inode in decimal. Waiters (`1: -> FLOCK ...`) hold nothing and are skipped.
fn flock_listed(text: &str, dev: u64, ino: u64) -> Option<bool> {
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let mut unsure = false;
    for line in text.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) != Some(&"FLOCK") {
            continue;
        }
        let Some(mut id) = fields.get(5).map(|f| f.splitn(3, ':')) else {
            continue;
        };
        let (Some(maj), Some(min), Some(i)) = (id.next(), id.next(), id.next()) else {
            continue;
        };
        if i.parse::<u64>().ok() != Some(ino) {
            continue;
        }
        let same_dev = u64::from_str_radix(maj, 16).ok() == Some(major)
            && u64::from_str_radix(min, 16).ok() == Some(minor);
        if same_dev {
            return Some(true);
        }
        unsure = true;
    }
    (!unsure).then_some(false)
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
    atomic_write_after(path, bytes, None)
}

/// [`atomic_write`], giving the new file a modification time later than `after` (the
/// replaced file's): a reader that compares times then never takes the new file for the one
/// it read, even when both are written within one tick of the clock.
pub fn atomic_write_after(
    path: &Path,
    bytes: &[u8],
    after: Option<std::time::SystemTime>,
) -> Result<()> {
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
        if let Some(after) = after {
            let now = std::time::SystemTime::now();
            let mtime = if after >= now {
                after + std::time::Duration::from_micros(1)
            } else {
                now
            };
            f.set_modified(mtime)
                .map_err(Error::io("set the time of", &tmp))?;
        }
        retry_eintr(|| f.sync_all()).map_err(Error::io("fsync", &tmp))?;
        fs::rename(&tmp, path).map_err(Error::io("rename into place", path))?;
        fsync_dir(dir)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// The file [`atomic_write_reusing`] keeps beside `path`: the inode `path` had before its last
/// write, to be written again at the next one.
pub fn spare_of(path: &Path) -> PathBuf {
    sibling(path, "spare")
}

fn sibling(path: &Path, what: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{what}"))
}

/// [`atomic_write_after`] for a file rewritten again and again (a member's record): the same
/// guarantees (old or new content, never a mix; durable on return; a later modification time
/// than `after`), but no inode is created or freed once the file has been written twice. The
/// new content goes into a spare (the inode `path` had before), which is then renamed over
/// `path` while a second link keeps the replaced inode as the next spare. A file system
/// without a journal pays for every inode freed in the last minute at each inode it allocates
/// (ext4 skips recently deleted ones one by one), so a write that creates and frees one grows
/// slower with everything written before it.
///
/// Writers must be serialized, and a reader must exclude them while it reads (a shared lock):
/// the spare it overwrites is the file a reader opened before the previous write.
pub fn atomic_write_reusing(
    path: &Path,
    bytes: &[u8],
    after: Option<std::time::SystemTime>,
) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    let dir = path.parent().unwrap_or(Path::new("."));
    let spare = spare_of(path);
    let prev = sibling(path, "prev");
    // What a write cut short left: the replaced inode under `prev`.
    if fs::symlink_metadata(&prev).is_ok() {
        if fs::symlink_metadata(&spare).is_ok() {
            fs::remove_file(&prev).map_err(Error::io("remove", &prev))?;
        } else {
            fs::rename(&prev, &spare).map_err(Error::io("rename", &prev))?;
        }
    }
    let open = || {
        OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(FILE_MODE)
            .open(&spare)
            .map_err(Error::io("open", &spare))
    };
    let mut f = open()?;
    let meta = f.metadata().map_err(Error::io("stat", &spare))?;
    if meta.nlink() != 1 || !meta.is_file() {
        // Linked elsewhere too (by hand): writing it would change that file as well.
        fs::remove_file(&spare).map_err(Error::io("remove", &spare))?;
        f = open()?;
    }
    // Written over, then cut to length: emptying it first would free its blocks only to
    // allocate them again.
    f.write_all(bytes).map_err(Error::io("write", &spare))?;
    f.set_len(bytes.len() as u64)
        .map_err(Error::io("truncate", &spare))?;
    let now = std::time::SystemTime::now();
    let mtime = match after {
        Some(after) if after >= now => after + std::time::Duration::from_micros(1),
        _ => now,
    };
    f.set_modified(mtime)
        .map_err(Error::io("set the time of", &spare))?;
    retry_eintr(|| f.sync_all()).map_err(Error::io("fsync", &spare))?;
    let kept = match fs::hard_link(path, &prev) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(e) => return Err(Error::io("link", path)(e)),
    };
    fs::rename(&spare, path).map_err(Error::io("rename into place", path))?;
    if kept {
        fs::rename(&prev, &spare).map_err(Error::io("rename", &prev))?;
    }
    // Durable before the replaced inode is written again: a crash must not find `path`
    // naming it.
    fsync_dir(dir)
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
    fn a_reused_write_replaces_with_two_inodes_for_good_and_recovers_a_cut_write() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("x.json");
        let ino = |p: &Path| fs::metadata(p).unwrap().ino();
        atomic_write_reusing(&p, b"one", None).unwrap();
        atomic_write_reusing(&p, b"two", None).unwrap();
        let pair = [ino(&p), ino(&spare_of(&p))];
        for n in 0..5 {
            let before = fs::metadata(&p).unwrap().modified().unwrap();
            let text = format!("write {n}");
            atomic_write_reusing(&p, text.as_bytes(), Some(before)).unwrap();
            assert_eq!(fs::read(&p).unwrap(), text.as_bytes());
            assert!(fs::metadata(&p).unwrap().modified().unwrap() > before);
            assert!(pair.contains(&ino(&p)), "a new inode was made");
            assert_ne!(ino(&p), ino(&spare_of(&p)));
        }
        let mode = fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        // Cut after the link (the replaced inode under `prev` too), then after the first
        // rename (the spare gone): the next write goes on from either.
        fs::hard_link(&p, sibling(&p, "prev")).unwrap();
        atomic_write_reusing(&p, b"after a cut", None).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"after a cut");
        fs::rename(spare_of(&p), sibling(&p, "prev")).unwrap();
        atomic_write_reusing(&p, b"after another", None).unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"after another");
        let mut names: Vec<_> = fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, [".x.json.spare", "x.json"]);
        // A spare linked elsewhere by hand is left as it was.
        let other = tmp.path().join("other");
        fs::hard_link(spare_of(&p), &other).unwrap();
        let kept = fs::read(&other).unwrap();
        atomic_write_reusing(&p, b"last", None).unwrap();
        assert_eq!(fs::read(&other).unwrap(), kept);
        assert_eq!(fs::read(&p).unwrap(), b"last");
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
        assert!(
            released(&p),
            "the lock is still held 2 s after its holder dropped it"
        );
    }

    /// Whether the lock at `p` is free within 2 s. Another test of this process that forks a
    /// child at the instant a lock is dropped gives the child a copy of every descriptor until
    /// its exec closes them, and a flock belongs to the open file, not to the descriptor: the
    /// lock may outlive its `drop` by that long (seen in CI).
    fn released(p: &Path) -> bool {
        (0..200).any(|_| {
            let held = HeldLock::is_held(p).unwrap();
            if held {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            !held
        })
    }

    #[test]
    fn is_held_sees_a_holder_in_this_and_another_process() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("b.lock");
        assert!(!HeldLock::is_held(&p).unwrap(), "missing file");
        open_lock(&p).unwrap();
        assert!(!HeldLock::is_held(&p).unwrap(), "nobody holds it");
        // A shared holder counts too.
        let f = open_lock(&p).unwrap();
        let g = lock_shared(&f, &p).unwrap();
        assert!(HeldLock::is_held(&p).unwrap());
        drop(g);
        assert!(released(&p));
        // Another process: flock(1) holds it (its `sleep` shares the descriptor) until their
        // process group is killed.
        let mut child = std::process::Command::new("flock");
        std::os::unix::process::CommandExt::process_group(&mut child, 0);
        let mut child = child.arg(&p).args(["sleep", "30"]).spawn().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !HeldLock::is_held(&p).unwrap() {
            assert!(
                std::time::Instant::now() < deadline,
                "flock(1) never held it"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(HeldLock::try_acquire(&p).unwrap().is_none());
        nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        child.wait().unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while HeldLock::is_held(&p).unwrap() {
            assert!(
                std::time::Instant::now() < deadline,
                "the lock outlived flock(1)"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(!HeldLock::is_held(&p).unwrap());
    }

    #[test]
    fn probing_a_lock_never_takes_it_from_under_an_acquirer() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("c.lock");
        open_lock(&p).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let prober = {
            let (p, stop) = (p.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    HeldLock::is_held(&p).unwrap();
                }
            })
        };
        let mut refused = 0;
        // Exact through /proc/locks while it fits in one read; a machine with more locks than
        // that falls back to a probe, which the settled acquire rides out.
        for _ in 0..20_000 {
            match HeldLock::try_acquire_settled(&p).unwrap() {
                Some(held) => drop(held),
                None => refused += 1,
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        prober.join().unwrap();
        assert_eq!(refused, 0, "a probe took the lock from under try_acquire");
    }

    #[test]
    fn proc_locks_lines() {
        let dev = nix::sys::stat::makedev(0xfe, 0);
        let text = "1: FLOCK  ADVISORY  WRITE 4242 fe:00:10010969 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 4243 fe:00:77 0 EOF\n\
                    3: POSIX  ADVISORY  WRITE 4244 fe:00:78 0 EOF\n\
                    4: FLOCK  ADVISORY  READ 4245 00:2d:79 0 EOF\n";
        assert_eq!(flock_listed(text, dev, 10010969), Some(true));
        assert_eq!(
            flock_listed(text, dev, 77),
            Some(false),
            "a waiter holds nothing"
        );
        assert_eq!(flock_listed(text, dev, 78), Some(false), "not a flock");
        assert_eq!(flock_listed(text, dev, 5), Some(false));
        assert_eq!(
            flock_listed(text, dev, 79),
            None,
            "same inode, other device"
        );
        assert_eq!(
            flock_listed(text, nix::sys::stat::makedev(0, 0x2d), 79),
            Some(true)
        );
    }
}
