//! Git worktrees of teammates (`lead spawn NAME --worktree`): one per teammate, on branch
//! `troupe/NAME`, outside the main tree, made and removed with the `git` command.
//!
//! The repository is the one holding the team dir's parent directory (the project root; `.team`
//! normally lives at its top). A worktree lives beside the repository, in
//! `<parent of the repository's top>/<its dir name>.troupe/NAME`, so nothing of it shows in the
//! main tree. It is kept across restarts: [`ensure`] reuses the dir when it is there and adds it
//! again on the existing branch when it was removed.
//!
//! [`GitDirs::of_linked`] tells the sandbox what git needs to commit in a linked worktree: the
//! common git dir to read; its `objects`, `refs` and `logs` and the worktree's own admin dir
//! (`<common>/worktrees/<id>`) to write. Nothing else of the git dir is opened, so its `config`
//! and `hooks` stay read-only to the teammate.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A member's worktree, as recorded in its roster entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Worktree {
    /// The worktree's directory: the member's working dir.
    pub path: PathBuf,
    /// Its branch, `troupe/NAME`.
    pub branch: String,
    /// The top of the main tree of the repository it belongs to.
    pub repo: PathBuf,
}

/// The branch of member `name`'s worktree.
pub fn branch_of(name: &str) -> String {
    format!("troupe/{name}")
}

/// Runs `git -C dir ARGS` with no inherited repository overrides.
fn git(dir: &Path, args: &[&str]) -> Result<Output> {
    Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        .env_remove("GIT_COMMON_DIR")
        .output()
        .map_err(|source| Error::Io {
            op: "run git in",
            path: dir.to_path_buf(),
            source,
        })
}

/// `git -C dir ARGS`, its stdout when it succeeds, else [`Error::Git`] with its stderr.
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

/// The project root of a team: the team dir's parent, made absolute.
fn project_root(team_dir: &Path) -> PathBuf {
    let abs = std::path::absolute(team_dir).unwrap_or_else(|_| team_dir.to_path_buf());
    let parent = abs.parent().map_or_else(|| abs.clone(), Path::to_path_buf);
    parent.canonicalize().unwrap_or(parent)
}

/// The top of the main tree of the repository holding the team's project root; a dir that is
/// in no git repository is [`Error::NotARepository`].
pub fn repository_of(team_dir: &Path) -> Result<PathBuf> {
    let root = project_root(team_dir);
    let not_repo = || Error::NotARepository { dir: root.clone() };
    if !root.is_dir() {
        return Err(not_repo());
    }
    let o = git(
        &root,
        &["rev-parse", "--path-format=absolute", "--git-common-dir"],
    )?;
    if !o.status.success() {
        return Err(not_repo());
    }
    // The main tree of the repository, also when the project root is itself a linked worktree.
    let common = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    let top = match common.file_name() {
        Some(n) if n == ".git" => common.parent().map(Path::to_path_buf),
        _ => None,
    };
    match top {
        Some(t) => Ok(t),
        None => Err(Error::Git {
            op: "find the main tree of the repository".to_owned(),
            dir: root,
            stderr: format!(
                "{} is a bare repository or has a separate git dir; --worktree needs a main \
                 tree with its .git inside",
                common.display()
            ),
        }),
    }
}

/// Where member `name`'s worktree of the repository whose main tree is `repo` lives.
pub fn path_for(repo: &Path, name: &str) -> PathBuf {
    let dir_name = repo
        .file_name()
        .map_or_else(|| "repo".into(), |n| n.to_string_lossy().into_owned());
    repo.parent()
        .unwrap_or(repo)
        .join(format!("{dir_name}.troupe"))
        .join(name)
}

/// Makes sure member `name` has its worktree in the repository of the team at `team_dir`
/// (`known`: the one its record names, if any): reused when its dir is a worktree of the
/// repository, added again on its branch when the dir is gone, created with a new branch from
/// the main tree's `HEAD` the first time.
pub fn ensure(team_dir: &Path, name: &str, known: Option<&Worktree>) -> Result<Worktree> {
    let repo = match known {
        Some(w) => w.repo.clone(),
        None => repository_of(team_dir)?,
    };
    let path = known.map_or_else(|| path_for(&repo, name), |w| w.path.clone());
    let branch = known.map_or_else(|| branch_of(name), |w| w.branch.clone());
    let wt = Worktree { path, branch, repo };
    add(&wt)?;
    Ok(wt)
}

/// Adds `wt` to its repository unless it is there.
fn add(wt: &Worktree) -> Result<()> {
    let Worktree { path, branch, repo } = wt;
    if path.exists() {
        let top = git(path, &["rev-parse", "--show-toplevel"])?;
        let top = PathBuf::from(String::from_utf8_lossy(&top.stdout).trim());
        if top.canonicalize().ok() == path.canonicalize().ok() {
            return Ok(());
        }
        return Err(Error::Git {
            op: "reuse the worktree".to_owned(),
            dir: path.clone(),
            stderr: "the directory exists but is not a git worktree; move it away".to_owned(),
        });
    }
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|source| Error::Io {
            op: "create",
            path: parent.to_path_buf(),
            source,
        })?;
    }
    // A worktree whose dir was removed by hand is still registered: forget it first.
    git_ok(repo, &["worktree", "prune"])?;
    let p = path.to_string_lossy();
    let exists = git(
        repo,
        &[
            "rev-parse",
            "--verify",
            "--quiet",
            &format!("refs/heads/{branch}"),
        ],
    )?
    .status
    .success();
    if exists {
        git_ok(repo, &["worktree", "add", "--quiet", &p, branch])?;
    } else {
        git(repo, &["rev-parse", "--verify", "--quiet", "HEAD"])?
            .status
            .success()
            .then_some(())
            .ok_or_else(|| Error::Git {
                op: "branch from HEAD".to_owned(),
                dir: repo.clone(),
                stderr: "the repository has no commit yet; commit once before --worktree"
                    .to_owned(),
            })?;
        git_ok(
            repo,
            &["worktree", "add", "--quiet", "-b", branch, &p, "HEAD"],
        )?;
    }
    // Commits write reflogs under the common dir's `logs`; the sandbox opens it only if it is
    // there.
    let _ = std::fs::create_dir_all(repo.join(".git/logs"));
    Ok(())
}

/// Whether the worktree has uncommitted changes (`git status --porcelain` says anything);
/// `None` when it cannot be read (its dir is gone).
pub fn is_dirty(wt: &Worktree) -> Option<bool> {
    if !wt.path.is_dir() {
        return None;
    }
    // Without the index refresh's lock, which would make the teammate's own `git add` fail.
    git_ok(&wt.path, &["--no-optional-locks", "status", "--porcelain"])
        .ok()
        .map(|s| !s.trim().is_empty())
}

/// Removes the worktree (`force`: with its uncommitted changes); the branch stays. A dir
/// already gone is only forgotten by the repository.
pub fn remove(wt: &Worktree, force: bool) -> Result<()> {
    if !wt.path.exists() {
        git_ok(&wt.repo, &["worktree", "prune"])?;
        return Ok(());
    }
    let p = wt.path.to_string_lossy();
    let mut args = vec!["worktree", "remove"];
    if force {
        args.push("--force");
    }
    args.push(&p);
    git_ok(&wt.repo, &args)?;
    Ok(())
}

/// The environment git needs in the teammate's commands. `GIT_CONFIG_GLOBAL=/dev/null`: the
/// sandbox hides the user's home, and git stops at a `~/.gitconfig` it may not read, so the
/// teammate's git reads the repository's and the system's config only. And, when the
/// repository sets no identity of its own, `NAME <NAME@troupe.invalid>` as `GIT_AUTHOR_*` and
/// `GIT_COMMITTER_*`.
pub fn git_env(wt: &Worktree, name: &str) -> Vec<(String, String)> {
    let mut env = vec![("GIT_CONFIG_GLOBAL".to_owned(), "/dev/null".to_owned())];
    let has = |key: &str| {
        git_ok(&wt.path, &["config", "--local", "--get", key]).is_ok_and(|v| !v.is_empty())
    };
    if has("user.name") && has("user.email") {
        return env;
    }
    let email = format!("{name}@troupe.invalid");
    for who in ["AUTHOR", "COMMITTER"] {
        env.push((format!("GIT_{who}_NAME"), name.to_owned()));
        env.push((format!("GIT_{who}_EMAIL"), email.clone()));
    }
    env
}

/// What git needs of a linked worktree's git dirs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GitDirs {
    /// The repository's common git dir (`<main tree>/.git`): read only.
    pub common: PathBuf,
    /// Written: the common dir's `objects`, `refs` and `logs` (those that exist) and the
    /// worktree's admin dir `<common>/worktrees/<id>`.
    pub writable: Vec<PathBuf>,
}

impl GitDirs {
    /// The git dirs of `workdir` when it is the top of a linked worktree (its `.git` is a file
    /// naming an admin dir with a `commondir`); `None` otherwise, and for a main tree, whose
    /// `.git` lies inside the working dir anyway.
    pub fn of_linked(workdir: &Path) -> Option<GitDirs> {
        let dot_git = std::fs::read_to_string(workdir.join(".git")).ok()?;
        let admin = dot_git.lines().find_map(|l| l.strip_prefix("gitdir: "))?;
        let admin = workdir.join(admin.trim()).canonicalize().ok()?;
        let common = std::fs::read_to_string(admin.join("commondir")).ok()?;
        let common = admin.join(common.trim()).canonicalize().ok()?;
        let mut writable: Vec<PathBuf> = ["objects", "refs", "logs"]
            .iter()
            .map(|d| common.join(d))
            .filter(|d| d.is_dir())
            .collect();
        writable.push(admin);
        Some(GitDirs { common, writable })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worktrees_live_beside_the_repository() {
        assert_eq!(
            path_for(Path::new("/src/proj"), "alice"),
            PathBuf::from("/src/proj.troupe/alice")
        );
        assert_eq!(branch_of("bob"), "troupe/bob");
    }

    #[test]
    fn a_main_tree_is_not_a_linked_worktree() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join(".git")).unwrap();
        assert_eq!(GitDirs::of_linked(tmp.path()), None);
    }
}
