//! The git the merge queue runs: in the repository's main tree for refs, and in the
//! integration tree that troupe keeps beside the members' worktrees
//! (`<repo>.troupe/.integration`), always with that tree's admin dir and work tree named
//! explicitly (never read from its `.git` file, which the checks can write) and with hooks and
//! fsmonitor off (see [`crate::worktree`]).
//!
//! None of it reads the person's system or global git config ([`isolated`]): a filter or a
//! merge driver defined there would run on whatever `.gitattributes` a member's commit names.
//! The repository's own config still counts, and the queue adds only an identity for its merge
//! commits where the repository sets none.
//!
//! Integrating is a merge (`--no-ff`) of the member's commit onto the target's tip, not a
//! rebase: the member's commits land as they are, so its branch stays an ancestor of the target
//! and is fast-forwarded after the land, and a conflict is resolved once, on the member's branch,
//! by merging the target into it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::error::{Error, Result};
use crate::worktree::{SAFE, admin_of, git_in};

/// The integration tree of the repository whose main tree is `repo`.
pub fn integration_path(repo: &Path) -> PathBuf {
    crate::worktree::path_for(repo, ".integration")
}

/// The `CARGO_TARGET_DIR` of the `merge_check` hooks of the repository whose main tree is
/// `repo`: beside the integration tree, not in it, so that nothing a check builds is in the
/// tree that is merged and checked (or could be tracked there). It is emptied after each entry
/// unless the team keeps one cache for all (`shared_check_cache`).
pub fn check_cache_path(repo: &Path) -> PathBuf {
    crate::worktree::path_for(repo, ".check-target")
}

/// Makes `cmd` (a git) read no system or global config, nor config handed down in the
/// environment: only the repository's own, and the person's `safe.directory` entries (see
/// [`persons_safe_directories`]).
pub fn isolated(cmd: &mut Command) -> &mut Command {
    cmd.env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env_remove("GIT_CONFIG_SYSTEM")
        .env_remove("GIT_CONFIG_PARAMETERS")
        .env_remove("GIT_CONFIG");
    let safe = persons_safe_directories();
    cmd.env("GIT_CONFIG_COUNT", safe.len().to_string());
    for (i, dir) in safe.iter().enumerate() {
        cmd.env(format!("GIT_CONFIG_KEY_{i}"), "safe.directory")
            .env(format!("GIT_CONFIG_VALUE_{i}"), dir);
    }
    cmd
}

/// The `safe.directory` entries of the person's system and global config, read once: git
/// takes them only from there (or the command line), and a repository owned by another user
/// that the person allowed must stay usable to the queue. Reading config runs no program.
fn persons_safe_directories() -> &'static [String] {
    static SAFE_DIRS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    SAFE_DIRS.get_or_init(|| {
        let mut out = Vec::new();
        for scope in ["--system", "--global"] {
            let o = Command::new("git")
                .args(["config", scope, "--get-all", "safe.directory"])
                .env_remove("GIT_DIR")
                .env_remove("GIT_CONFIG_PARAMETERS")
                .env_remove("GIT_CONFIG_COUNT")
                .stdin(std::process::Stdio::null())
                .output();
            if let Ok(o) = o
                && o.status.success()
            {
                out.extend(
                    String::from_utf8_lossy(&o.stdout)
                        .lines()
                        .map(str::to_owned),
                );
            }
        }
        out
    })
}

/// `git -C dir ARGS` as the queue runs it: [`SAFE`], [`isolated`], no inherited repository
/// overrides, stdin closed.
fn git(dir: &Path, args: &[&str]) -> Result<Output> {
    let mut cmd = Command::new("git");
    cmd.arg("-C")
        .arg(dir)
        .args(SAFE)
        .args(args)
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        .env_remove("GIT_COMMON_DIR")
        .stdin(std::process::Stdio::null());
    isolated(&mut cmd).output().map_err(|source| Error::Io {
        op: "run git in",
        path: dir.to_path_buf(),
        source,
    })
}

/// [`git`], its stdout when it succeeds, else [`Error::Git`] with its stderr.
fn git_ok(dir: &Path, args: &[&str]) -> Result<String> {
    let o = git(dir, args)?;
    if !o.status.success() {
        return Err(Error::Git {
            op: format!("git {}", args.join(" ")),
            dir: dir.to_path_buf(),
            stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim_end().to_owned())
}

/// [`git`]'s raw stdout (for `-z` output), or [`Error::Git`].
fn git_bytes(dir: &Path, args: &[&str]) -> Result<Vec<u8>> {
    let o = git(dir, args)?;
    if !o.status.success() {
        return Err(Error::Git {
            op: format!("git {}", args.join(" ")),
            dir: dir.to_path_buf(),
            stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        });
    }
    Ok(o.stdout)
}

/// The paths that differ between commits `base` and `candidate` (what taking `candidate` over
/// `base` writes, creates or deletes), relative to the tree's top, each as git has it.
pub fn changed_paths(repo: &Path, base: &str, candidate: &str) -> Result<Vec<PathBuf>> {
    let out = git_bytes(
        repo,
        &[
            "diff-tree",
            "-r",
            "-z",
            "--name-only",
            "--no-renames",
            "--no-commit-id",
            base,
            candidate,
        ],
    )?;
    Ok(super::contain::nul_paths(&out))
}

/// The untracked and ignored paths of the tree at `dir`, relative to its top: a dir that is
/// untracked or ignored as a whole is one entry (`dir/`), not looked into.
pub fn untracked_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let out = git_bytes(
        dir,
        &[
            "--no-optional-locks",
            "status",
            "--porcelain",
            "-z",
            "--no-renames",
            "--untracked-files=normal",
            "--ignored=matching",
            "--ignore-submodules=all",
        ],
    )?;
    Ok(super::contain::untracked_of_status(&out))
}

/// The commit `refs/heads/BRANCH` points at, if the branch exists.
pub fn branch_tip(repo: &Path, branch: &str) -> Result<Option<String>> {
    let o = git(
        repo,
        &[
            "rev-parse",
            "--verify",
            "--quiet",
            &format!("refs/heads/{branch}^{{commit}}"),
        ],
    )?;
    Ok(o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned()))
}

/// Whether commit `a` is an ancestor of (or is) commit `b`.
pub fn is_ancestor(repo: &Path, a: &str, b: &str) -> Result<bool> {
    let o = git(repo, &["merge-base", "--is-ancestor", a, b])?;
    match o.status.code() {
        Some(0) => Ok(true),
        Some(1) => Ok(false),
        _ => Err(Error::Git {
            op: format!("git merge-base --is-ancestor {a} {b}"),
            dir: repo.to_path_buf(),
            stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        }),
    }
}

/// Makes `refs/heads/TARGET` at the main tree's `HEAD` unless it exists; its tip.
pub fn ensure_target(repo: &Path, target: &str) -> Result<String> {
    if let Some(tip) = branch_tip(repo, target)? {
        return Ok(tip);
    }
    let head = git_ok(repo, &["rev-parse", "--verify", "HEAD^{commit}"])?;
    // Created only if still absent (the zero old value): a racing creation is kept.
    let _ = git(
        repo,
        &[
            "update-ref",
            "-m",
            "troupe: the merge queue's target",
            &format!("refs/heads/{target}"),
            &head,
            "0000000000000000000000000000000000000000",
        ],
    )?;
    branch_tip(repo, target)?.ok_or_else(|| Error::Git {
        op: format!("create branch {target}"),
        dir: repo.to_path_buf(),
        stderr: "it is still missing".to_owned(),
    })
}

/// The tree checked out on `refs/heads/BRANCH`, if any (the main tree or a linked worktree).
pub fn checked_out_at(repo: &Path, branch: &str) -> Result<Option<PathBuf>> {
    let list = git_ok(repo, &["worktree", "list", "--porcelain"])?;
    let want = format!("branch refs/heads/{branch}");
    let mut path = None;
    for line in list.lines() {
        if let Some(p) = line.strip_prefix("worktree ") {
            path = Some(PathBuf::from(p));
        } else if line == want {
            return Ok(path);
        }
    }
    Ok(None)
}

/// Whether the tree at `dir` has changes of its own to tracked files, staged or not (untracked
/// files, such as the team dir, do not count: a fast-forward that would overwrite one fails
/// and the entry waits).
pub fn tree_is_dirty(dir: &Path) -> Result<bool> {
    let out = git_ok(
        dir,
        &[
            "--no-optional-locks",
            "status",
            "--porcelain",
            "--untracked-files=no",
        ],
    )?;
    Ok(!out.trim().is_empty())
}

/// Moves the branch checked out at `dir` (and the tree with it) to `commit` if that is a
/// fast-forward (`git merge --ff-only`), never over an ignored file (`--no-overwrite-ignore`:
/// a second wall behind [`super::contain`]): `Err` with git's stderr when it did not.
pub fn fast_forward_tree(dir: &Path, commit: &str) -> Result<std::result::Result<(), String>> {
    let o = git(
        dir,
        &[
            "merge",
            "--ff-only",
            "--no-overwrite-ignore",
            "--quiet",
            commit,
        ],
    )?;
    Ok(if o.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&o.stderr).trim().to_owned())
    })
}

/// How long a ref's lock file may stand before it is taken for one a killed git left: git holds
/// a ref's lock for the moment of one update.
const STALE_REF_LOCK: std::time::Duration = std::time::Duration::from_secs(60);

/// Moves `refs/heads/BRANCH` from `old` to `new` only if it still points at `old` (what
/// `git update-ref` checks under the ref's lock): `Ok(true)` if it moved, `Ok(false)` if the
/// branch had moved on, `Err` with git's stderr if it could not be updated at all (its lock
/// held). A lock file older than [`STALE_REF_LOCK`] (a git killed mid-update, say with its
/// supervisor) is removed and the update tried again.
pub fn compare_and_swap(
    repo: &Path,
    branch: &str,
    new: &str,
    old: &str,
) -> Result<std::result::Result<bool, String>> {
    for attempt in 0..2 {
        let o = update_ref(repo, branch, new, old)?;
        if o.status.success() {
            return Ok(Ok(true));
        }
        if branch_tip(repo, branch)?.as_deref() != Some(old) {
            return Ok(Ok(false));
        }
        let lock = repo.join(".git/refs/heads").join(format!("{branch}.lock"));
        let stale = std::fs::metadata(&lock)
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > STALE_REF_LOCK);
        if attempt == 0 && stale {
            tracing::warn!("removing {} left by a killed git", lock.display());
            let _ = std::fs::remove_file(&lock);
            continue;
        }
        return Ok(Err(String::from_utf8_lossy(&o.stderr).trim().to_owned()));
    }
    Ok(Ok(false))
}

fn update_ref(repo: &Path, branch: &str, new: &str, old: &str) -> Result<Output> {
    git(
        repo,
        &[
            "update-ref",
            "-m",
            "troupe: merge queue land",
            &format!("refs/heads/{branch}"),
            new,
            old,
        ],
    )
}

/// The integration tree of one repository.
pub struct Integration {
    pub repo: PathBuf,
    pub path: PathBuf,
    admin: PathBuf,
}

/// What merging a commit onto the target came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Merged {
    /// The merge commit that would land.
    Clean(String),
    /// The files that conflict.
    Conflict(Vec<String>),
}

impl Integration {
    /// The integration tree of `repo`, added (detached at `at`) if it is not there.
    pub fn ensure(repo: &Path, at: &str) -> Result<Integration> {
        let path = integration_path(repo);
        let mut admin = admin_of(repo, &path).filter(|_| path.is_dir());
        if admin.is_none() {
            if path.exists() {
                std::fs::remove_dir_all(&path).map_err(Error::io("remove", &path))?;
            }
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(Error::io("create", parent))?;
            }
            git_ok(repo, &["worktree", "prune"])?;
            let p = path.to_string_lossy();
            git_ok(repo, &["worktree", "add", "--quiet", "--detach", &p, at])?;
            admin = admin_of(repo, &path);
        }
        let admin = admin.ok_or_else(|| Error::Git {
            op: "find the integration tree's admin dir".to_owned(),
            dir: path.clone(),
            stderr: "git made the worktree but no admin dir names it".to_owned(),
        })?;
        Ok(Integration {
            repo: repo.to_path_buf(),
            path,
            admin,
        })
    }

    /// The `CARGO_TARGET_DIR` of the checks (see [`check_cache_path`]).
    pub fn check_target_dir(&self) -> PathBuf {
        check_cache_path(&self.repo)
    }

    /// `git ARGS` in the integration tree, with its git dir and work tree named, [`isolated`].
    fn git(&self, args: &[&str]) -> Result<Output> {
        let mut cmd = git_in(&self.admin, &self.path, &self.repo);
        isolated(&mut cmd).args(args);
        // Who made the merge commit, when the repository and the user name nobody.
        if git(&self.repo, &["config", "user.email"]).is_ok_and(|o| !o.status.success()) {
            for who in ["AUTHOR", "COMMITTER"] {
                cmd.env(format!("GIT_{who}_NAME"), "troupe merge queue");
                cmd.env(format!("GIT_{who}_EMAIL"), "merge-queue@troupe.invalid");
            }
        }
        cmd.output().map_err(|source| Error::Io {
            op: "run git in",
            path: self.path.clone(),
            source,
        })
    }

    fn git_ok(&self, args: &[&str]) -> Result<String> {
        let o = self.git(args)?;
        if !o.status.success() {
            return Err(Error::Git {
                op: format!("git {}", args.join(" ")),
                dir: self.path.clone(),
                stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            });
        }
        Ok(String::from_utf8_lossy(&o.stdout).trim_end().to_owned())
    }

    /// Puts the tree at `tip`, as git has it: tracked files reset, everything else removed (a
    /// check's cache of an older version included), and its `.git` file written again (a check
    /// may have changed it).
    pub fn reset(&self, tip: &str) -> Result<()> {
        let dot_git = self.path.join(".git");
        if std::fs::symlink_metadata(&dot_git).is_ok_and(|m| m.is_dir()) {
            std::fs::remove_dir_all(&dot_git).map_err(Error::io("remove", &dot_git))?;
        }
        crate::fsutil::atomic_write(
            &dot_git,
            format!("gitdir: {}\n", self.admin.display()).as_bytes(),
        )?;
        // Only the queue works in this tree (and its checks, which have ended): an index lock
        // is what a git killed with its supervisor left.
        let _ = std::fs::remove_file(self.admin.join("index.lock"));
        // A merge left half done by a crash.
        let _ = self.git(&["merge", "--abort"]);
        self.git_ok(&["reset", "--quiet", "--hard", tip])?;
        self.git_ok(&["clean", "--quiet", "-ffdx"])?;
        Ok(())
    }

    /// Merges `commit` onto the tree's `HEAD` (`--no-ff`, message `message`).
    pub fn merge(&self, commit: &str, message: &str) -> Result<Merged> {
        let o = self.git(&[
            "merge",
            "--quiet",
            "--no-ff",
            "--no-edit",
            "-m",
            message,
            commit,
        ])?;
        if o.status.success() {
            return Ok(Merged::Clean(self.git_ok(&["rev-parse", "HEAD"])?));
        }
        let conflicted = self.git_ok(&["diff", "--name-only", "--diff-filter=U"])?;
        let files: Vec<String> = conflicted.lines().map(str::to_owned).collect();
        let _ = self.git(&["merge", "--abort"]);
        if files.is_empty() {
            return Err(Error::Git {
                op: format!("git merge {commit}"),
                dir: self.path.clone(),
                stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
            });
        }
        Ok(Merged::Conflict(files))
    }
}

/// Fast-forwards a member's worktree (`wt`) to `commit` (a landed merge, in the repository's
/// objects, which its store reads through its alternates) when the store's `HEAD` is on its
/// branch, the branch is behind `commit` and the tree is clean: the store's branch and the tree
/// move, then the repository's branch is set to `commit` too. Whether it moved. git runs on the
/// store and work tree troupe recorded (a record of the old layout is left as it is: it is
/// moved to a store at its member's next start).
pub fn fast_forward_member(wt: &crate::worktree::Worktree, commit: &str) -> Result<bool> {
    let Some(store) = wt.store() else {
        return Ok(false);
    };
    if crate::worktree::is_dirty(wt) != Some(false) {
        return Ok(false);
    }
    let run = |args: &[&str]| -> Result<Output> {
        crate::worktree::git_member(store, &wt.path)
            .args(args)
            .output()
            .map_err(|source| Error::Io {
                op: "run git in",
                path: store.to_path_buf(),
                source,
            })
    };
    let own = format!("refs/heads/{}", wt.branch);
    let head = run(&["symbolic-ref", "--quiet", "HEAD"])?;
    if !head.status.success() || String::from_utf8_lossy(&head.stdout).trim() != own {
        return Ok(false);
    }
    let tip = run(&[
        "rev-parse",
        "--verify",
        "--quiet",
        &format!("{own}^{{commit}}"),
    ])?;
    if !tip.status.success() {
        return Ok(false);
    }
    let tip = String::from_utf8_lossy(&tip.stdout).trim().to_owned();
    if tip == commit
        || !run(&["merge-base", "--is-ancestor", &tip, commit])?
            .status
            .success()
    {
        return Ok(false);
    }
    if !run(&["merge", "--ff-only", "--quiet", commit])?
        .status
        .success()
    {
        return Ok(false);
    }
    git_ok(&wt.repo, &["update-ref", &own, commit])?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    fn run(dir: &Path, args: &[&str]) -> String {
        let o = Command::new("git")
            .arg("-C")
            .arg(dir)
            .args(["-c", "user.name=T", "-c", "user.email=t@t.invalid"])
            .args(args)
            .env_remove("GIT_DIR")
            .output()
            .unwrap();
        assert!(o.status.success(), "{args:?}: {o:?}");
        String::from_utf8_lossy(&o.stdout).trim().to_owned()
    }

    #[test]
    fn a_land_moves_the_target_only_from_its_old_tip_and_outlives_a_stale_lock() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path();
        run(repo, &["init", "-q", "-b", "main"]);
        run(repo, &["commit", "-q", "--allow-empty", "-m", "one"]);
        let one = run(repo, &["rev-parse", "HEAD"]);
        run(repo, &["commit", "-q", "--allow-empty", "-m", "two"]);
        let two = run(repo, &["rev-parse", "HEAD"]);
        assert_eq!(ensure_target(repo, "troupe/integration").unwrap(), two);
        // Not from a tip it no longer has.
        assert_eq!(
            compare_and_swap(repo, "troupe/integration", &one, &one).unwrap(),
            Ok(false)
        );
        // A fresh lock is someone's update under way: not taken.
        let lock = repo.join(".git/refs/heads/troupe/integration.lock");
        std::fs::write(&lock, "").unwrap();
        assert!(
            compare_and_swap(repo, "troupe/integration", &one, &two)
                .unwrap()
                .is_err()
        );
        // One a killed git left long ago is removed, and the land goes through.
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(120);
        std::fs::File::options()
            .write(true)
            .open(&lock)
            .unwrap()
            .set_modified(old)
            .unwrap();
        assert_eq!(
            compare_and_swap(repo, "troupe/integration", &one, &two).unwrap(),
            Ok(true)
        );
        assert_eq!(branch_tip(repo, "troupe/integration").unwrap(), Some(one));
        assert!(!lock.exists());
    }
}
