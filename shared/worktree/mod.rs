//! Git worktrees of teammates (`lead spawn NAME --worktree`): one per teammate, on branch
//! `troupe/NAME`, outside the main tree.
//!
//! The repository is the one holding the team dir's parent directory (the project root; `.team`
//! normally lives at its top). A member's worktree lives beside the repository, in
//! `<parent of the repository's top>/<its dir name>.troupe/NAME`, so nothing of it shows in the
//! main tree, and its git dir (its *store*, see [`store`]) beside that, in
//! `<repo>.troupe/.stores/NAME.git`: a git dir of its own, with its own refs, index and
//! objects, and the repository's object store as a read-only alternate. So a member owns its
//! branch and nothing else: no file of the repository's git dir is writable to it, and its
//! commits reach the repository only through [`take_branch`], a fetch that hashes every object
//! it takes. Both are kept across restarts: [`ensure`] reuses them when they are there, makes
//! them again when they were removed, and moves a worktree of the old layout (a linked worktree
//! of the repository, its admin dir under `.git/worktrees`) into a store of its own.
//!
//! [`GitDirs::for_member`] tells the sandbox what of git a member's commands may touch, from
//! what the lead recorded and never from a file inside a tree the commands can write.
//!
//! Every git troupe runs here names the git dir and work tree it recorded and turns off what
//! would run a program the repository's files name (`core.fsmonitor`, hooks).

mod dirs;
mod store;

pub use dirs::GitDirs;
pub(crate) use store::git_member;
pub use store::{Moved, fsck_hold, offer_branches, store_for, take_branch, tip_in_store};

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
    /// Its git dir: the member's store (`<repo>.troupe/.stores/NAME.git`, see [`store`]). In a
    /// record of the old layout, the linked worktree's admin dir in the repository's git dir
    /// (`<repo>/.git/worktrees/<id>`), which [`ensure`] moves to a store at the first start.
    /// Never read from the worktree's `.git` file, which the member's commands could rewrite.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<PathBuf>,
}

impl Worktree {
    /// The member's store, when the record names one (not an admin dir of the old layout,
    /// which lies in the repository's git dir).
    pub fn store(&self) -> Option<&Path> {
        self.admin
            .as_deref()
            .filter(|a| !a.starts_with(self.repo.join(".git")))
    }

    /// The admin dir of a record of the old layout (a linked worktree of the repository).
    fn old_admin(&self) -> Option<&Path> {
        self.admin
            .as_deref()
            .filter(|a| a.starts_with(self.repo.join(".git")))
    }
}

/// The branch of member `name`'s worktree.
pub fn branch_of(name: &str) -> String {
    format!("troupe/{name}")
}

/// What every git troupe runs is given first: no program named by the repository's config
/// runs (a member may have written that config before it was read-only to it, or a file git
/// consults), and no hook.
pub(crate) const SAFE: [&str; 4] = [
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.hooksPath=/dev/null",
];

/// Runs `git -C dir ARGS` with no inherited repository overrides.
pub(crate) fn git(dir: &Path, args: &[&str]) -> Result<Output> {
    Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(SAFE)
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
pub(crate) fn git_ok(dir: &Path, args: &[&str]) -> Result<String> {
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
/// (`known`: the one its record names, if any): see [`ensure_moving`].
pub fn ensure(team_dir: &Path, name: &str, known: Option<&Worktree>) -> Result<Worktree> {
    ensure_moving(team_dir, name, known).map(|(w, _)| w)
}

/// [`ensure`], and what it moved: its worktree and store are reused when they are there, made
/// again when one was removed (on the branch as the store, else the repository, has it), made
/// with a new branch from the main tree's `HEAD` the first time; a worktree of the old layout
/// is moved to a store of its own (`Some`, with what `git fsck` of the repository said then).
pub fn ensure_moving(
    team_dir: &Path,
    name: &str,
    known: Option<&Worktree>,
) -> Result<(Worktree, Option<Moved>)> {
    let repo = match known {
        Some(w) => w.repo.clone(),
        None => repository_of(team_dir)?,
    };
    let path = known.map_or_else(|| path_for(&repo, name), |w| w.path.clone());
    let branch = known.map_or_else(|| branch_of(name), |w| w.branch.clone());
    let mut wt = Worktree {
        path,
        branch,
        repo,
        admin: known.and_then(|w| w.admin.clone()),
    };
    if wt.path.exists() && !wt.path.join(".git").is_file() {
        return Err(Error::Git {
            op: "reuse the worktree".to_owned(),
            dir: wt.path.clone(),
            stderr: "the directory exists but is not a git worktree; move it away".to_owned(),
        });
    }
    let old = wt.old_admin().map(Path::to_path_buf);
    let store = match wt.store() {
        Some(s) => s.to_path_buf(),
        None => store_for(&wt.repo, name),
    };
    wt.admin = Some(store.clone());
    let moved = match old {
        Some(old) if wt.path.exists() && old.is_dir() => Some(store::move_old(&wt, &old)?),
        Some(_) => {
            // Its dir (or its admin dir) is gone: git forgets it, and it is made anew.
            git_ok(&wt.repo, &["worktree", "prune"])?;
            store::make(&wt)?;
            None
        }
        None => {
            store::make(&wt)?;
            None
        }
    };
    Ok((wt, moved))
}

/// The admin dir of the linked worktree at `path` in the repository whose main tree is `repo`:
/// the one of `<repo>/.git/worktrees/*` whose `gitdir` names `path/.git`. Read from the common
/// git dir, never from the worktree's own `.git` file. (The integration tree is one.)
pub(crate) fn admin_of(repo: &Path, path: &Path) -> Option<PathBuf> {
    let want = path.join(".git");
    let want = want.canonicalize().unwrap_or(want);
    let dirs = std::fs::read_dir(repo.join(".git/worktrees")).ok()?;
    dirs.flatten().map(|e| e.path()).find(|admin| {
        std::fs::read_to_string(admin.join("gitdir")).is_ok_and(|g| {
            let g = PathBuf::from(g.trim_end_matches(['\n', '\r']));
            g.canonicalize().unwrap_or(g) == want
        })
    })
}

/// Whether the worktree has uncommitted changes (`git status --porcelain` says anything);
/// `None` when it cannot be read (its dir or its git dir is gone, or not known).
///
/// git runs with the git dir and work tree troupe recorded, whatever the worktree's `.git`
/// file or a `commondir` in the store say now, and with `SAFE`.
pub fn is_dirty(wt: &Worktree) -> Option<bool> {
    let admin = wt.admin.as_ref()?;
    if !wt.path.is_dir() || !admin.is_dir() {
        return None;
    }
    let mut cmd = match wt.store() {
        Some(store) => git_member(store, &wt.path),
        None => git_in(admin, &wt.path, &wt.repo),
    };
    let o = cmd
        // Without the index refresh's lock, which would make the teammate's own `git add` fail.
        .args(["--no-optional-locks", "status", "--porcelain"])
        .output()
        .ok()?;
    o.status
        .success()
        .then(|| !String::from_utf8_lossy(&o.stdout).trim().is_empty())
}

/// `git` (its arguments to add) in the linked worktree at `work_tree` of the repository whose
/// main tree is `repo`, with the admin dir troupe recorded (`admin`): the git dir, common dir
/// and work tree named, whatever the worktree's `.git` file or the admin dir's `commondir` say
/// now; `SAFE`; no inherited repository overrides; stdin closed.
pub(crate) fn git_in(admin: &Path, work_tree: &Path, repo: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("--git-dir")
        .arg(admin)
        .arg("--work-tree")
        .arg(work_tree)
        .args(SAFE)
        .current_dir(repo)
        .env("GIT_COMMON_DIR", repo.join(".git"))
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        .env_remove("GIT_CONFIG_PARAMETERS")
        .stdin(std::process::Stdio::null());
    cmd
}

/// Removes the worktree and its store (`force`: with its uncommitted changes). Its branch is
/// taken into the repository first ([`take_branch`]), so that no commit is lost; when that
/// fails, nothing is removed unless `force`. A worktree of the old layout is removed by git.
pub fn remove(wt: &Worktree, force: bool) -> Result<()> {
    let Some(store) = wt.store() else {
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
        return Ok(());
    };
    if store.is_dir()
        && let Err(e) = take_branch(wt)
        && !force
    {
        return Err(e);
    }
    for dir in [wt.path.as_path(), store] {
        if std::fs::symlink_metadata(dir).is_ok() {
            std::fs::remove_dir_all(dir).map_err(Error::io("remove", dir))?;
        }
    }
    // The lock of its takes (see [`take_branch`]); harmless if left.
    let _ = std::fs::remove_file(store.with_extension("lock"));
    Ok(())
}

/// The environment git needs in the teammate's commands. `GIT_CONFIG_GLOBAL=/dev/null`: the
/// sandbox hides the user's home, and git stops at a `~/.gitconfig` it may not read, so the
/// teammate's git reads its store's and the system's config only. And as `GIT_AUTHOR_*` and
/// `GIT_COMMITTER_*`, the identity the repository sets (`user.name` and `user.email`), else
/// `NAME <NAME@troupe.invalid>`.
pub fn git_env(wt: &Worktree, name: &str) -> Vec<(String, String)> {
    let mut env = vec![("GIT_CONFIG_GLOBAL".to_owned(), "/dev/null".to_owned())];
    // Asked of the recorded repository, not of the worktree (whose `.git` file is the
    // member's to write). Handed down in the environment: the member's git reads its store's
    // config, not the repository's, so the identity the repository sets would not reach it.
    let get = |key: &str| {
        git_ok(&wt.repo, &["config", "--local", "--get", key])
            .ok()
            .filter(|v| !v.is_empty())
    };
    let (user, email) = match (get("user.name"), get("user.email")) {
        (Some(u), Some(e)) => (u, e),
        _ => (name.to_owned(), format!("{name}@troupe.invalid")),
    };
    for who in ["AUTHOR", "COMMITTER"] {
        env.push((format!("GIT_{who}_NAME"), user.clone()));
        env.push((format!("GIT_{who}_EMAIL"), email.clone()));
    }
    env
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
    fn a_record_names_a_store_or_an_admin_dir_of_the_old_layout() {
        let mut wt = Worktree {
            path: PathBuf::from("/src/proj.troupe/a"),
            branch: "troupe/a".to_owned(),
            repo: PathBuf::from("/src/proj"),
            admin: Some(PathBuf::from("/src/proj.troupe/.stores/a.git")),
        };
        assert_eq!(
            wt.store(),
            Some(Path::new("/src/proj.troupe/.stores/a.git"))
        );
        assert_eq!(wt.old_admin(), None);
        wt.admin = Some(PathBuf::from("/src/proj/.git/worktrees/a"));
        assert_eq!(wt.store(), None);
        assert_eq!(
            wt.old_admin(),
            Some(Path::new("/src/proj/.git/worktrees/a"))
        );
    }
}
