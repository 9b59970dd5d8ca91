//! Where the bench runs: the machine, the commit of the code measured, and the scratch dir.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};
use troupe::fsutil;

/// A scratch dir of this run's own, `troupe-bench-PID` under `base` (default: the system temp
/// dir), for the throwaway team dirs.
pub fn scratch_dir(base: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let base = base.unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("troupe-bench-{}", std::process::id()));
    fsutil::create_dir(&dir)?;
    Ok(dir)
}

/// The head of every document: the machine, and the commit the binaries measured were built
/// from.
pub fn header(scratch: &Path) -> Value {
    json!({
        "machine": machine(scratch),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
    })
}

/// Cores, kernel, architecture and the scratch dir's filesystem.
fn machine(scratch: &Path) -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = nix::sys::utsname::uname()
        .map(|u| {
            format!(
                "{} {}",
                u.sysname().to_string_lossy(),
                u.release().to_string_lossy()
            )
        })
        .unwrap_or_default();
    json!({
        "cores": cores,
        "kernel": kernel,
        "arch": std::env::consts::ARCH,
        "scratch_fs": scratch_fs(scratch),
    })
}

/// The filesystem type of the mount holding `dir` (fsync costs differ: tmpfs makes it free).
fn scratch_fs(dir: &Path) -> Option<String> {
    let dir = dir.canonicalize().ok()?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_dev, mnt, fs) = (f.next()?, f.next()?, f.next()?);
            dir.starts_with(mnt).then(|| (mnt.len(), fs.to_owned()))
        })
        .max_by_key(|(len, _)| *len)
        .map(|(_, fs)| fs)
}

/// Whether the working tree differs from the commit (the binaries measured were built from it).
fn git_dirty() -> Option<bool> {
    let out = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()?;
    out.status.success().then_some(!out.stdout.is_empty())
}

/// The commit checked out in the current directory.
fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
