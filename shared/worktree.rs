//! Git worktrees of teammates (`lead spawn NAME --worktree`): one per teammate, on branch
//! `troupe/NAME`, outside the main tree, made and removed with the `git` command.
//!
//! The repository is the one holding the team dir's parent directory (the project root; `.team`
//! normally lives at its top). A worktree lives beside the repository, in
//! `<parent of the repository's top>/<its dir name>.troupe/NAME`, so nothing of it shows in the
//! main tree. It is kept across restarts: [`ensure`] reuses the dir when it is there and adds it
//! again on the existing branch when it was removed.
//!
//! [`GitDirs::for_member`] tells the sandbox what of git a member's commands may touch, from
//! what the lead recorded (the repository it found, the worktree it made) and never from a file
//! inside a tree the commands can write (`.git`, `commondir`): the common git dir to read; its
//! `objects` and the member's own branch dir and its admin dir (`<common>/worktrees/<id>`) to
//! write; and what must stay read-only inside a writable tree (the main tree's `.git`, a
//! worktree's `.git` file, the admin dir's `commondir`, `gitdir` and `config.worktree`).
//!
//! Every git troupe runs here names the git dir and work tree it recorded and turns off what
//! would run a program the repository's files name (`core.fsmonitor`, hooks).

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
    /// Its admin dir in the repository's git dir (`<repo>/.git/worktrees/<id>`), found when the
    /// lead made or first reused it: never read again from the worktree's `.git` file, which
    /// the member's commands could rewrite.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<PathBuf>,
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
    let admin = known.and_then(|w| w.admin.clone());
    let mut wt = Worktree {
        path,
        branch,
        repo,
        admin,
    };
    add(&wt)?;
    if wt.admin.is_none() {
        wt.admin = admin_of(&wt.repo, &wt.path);
    }
    // The dirs a commit writes the branch and its reflog in (gone once refs are packed), made
    // here so the sandbox can grant them.
    for root in ["refs/heads", "logs/refs/heads"] {
        if let Some(dir) = wt.repo.join(".git").join(root).join(&wt.branch).parent() {
            let _ = std::fs::create_dir_all(dir);
        }
    }
    Ok(wt)
}

/// The admin dir of the worktree at `path` in the repository whose main tree is `repo`: the
/// one of `<repo>/.git/worktrees/*` whose `gitdir` names `path/.git`. Read from the common git
/// dir, never from the worktree's own `.git` file.
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

/// Adds `wt` to its repository unless it is there.
fn add(wt: &Worktree) -> Result<()> {
    let Worktree {
        path, branch, repo, ..
    } = wt;
    if path.exists() {
        // Not asked of git there: its `.git` file and config are the member's to write.
        if path.join(".git").is_file() {
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
/// `None` when it cannot be read (its dir is gone, or its admin dir is not known).
///
/// git runs with the git dir, common dir and work tree troupe recorded, whatever the
/// worktree's `.git` file or the admin dir's `commondir` say now, and with `SAFE`.
pub fn is_dirty(wt: &Worktree) -> Option<bool> {
    let admin = wt.admin.as_ref()?;
    if !wt.path.is_dir() || !admin.is_dir() {
        return None;
    }
    let o = git_in(admin, &wt.path, &wt.repo)
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
    // Asked of the recorded repository, not of the worktree (whose `.git` file is the
    // member's to write).
    let has = |key: &str| {
        git_ok(&wt.repo, &["config", "--local", "--get", key]).is_ok_and(|v| !v.is_empty())
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

/// What of git a member's commands may touch, from what troupe recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GitDirs {
    /// A worktree's common git dir (`<repo>/.git`): read only.
    pub common: Option<PathBuf>,
    /// Written: the common dir's `objects`, the member's branch dirs under `refs/heads` and
    /// `logs/refs/heads`, and the worktree's admin dir.
    pub writable: Vec<PathBuf>,
    /// Read-only although inside a writable tree: the working dir's `.git` (a main tree's git
    /// dir, or a worktree's `.git` file), and the admin dir's `commondir`, `gitdir` and
    /// `config.worktree`.
    pub read_only: Vec<PathBuf>,
}

impl GitDirs {
    /// The git dirs of a member working in `workdir`, with `worktree` as its roster entry
    /// records it (the roster lives in the team dir, which commands cannot reach). Nothing is
    /// read from `workdir`: its `.git` is only looked at to be kept read-only.
    pub fn for_member(workdir: &Path, worktree: Option<&Worktree>) -> GitDirs {
        let mut dirs = GitDirs::default();
        let dot_git = workdir.join(".git");
        // A symlink is the member's own making (a `.git` git would follow anywhere): left alone.
        if std::fs::symlink_metadata(&dot_git).is_ok_and(|m| !m.file_type().is_symlink()) {
            dirs.read_only.push(dot_git);
        }
        let Some(wt) = worktree else {
            return dirs;
        };
        let same = |a: &Path, b: &Path| a.canonicalize().ok() == b.canonicalize().ok();
        if !same(&wt.path, workdir) {
            return dirs;
        }
        let Ok(common) = wt.repo.join(".git").canonicalize() else {
            return dirs;
        };
        let canon = workdir
            .canonicalize()
            .unwrap_or_else(|_| workdir.to_path_buf());
        // A repository inside the working dir would be the member's to shape: none of it is
        // granted.
        if !common.is_dir() || common.starts_with(&canon) {
            return dirs;
        }
        let branch = |root: &str| common.join(root).join(&wt.branch);
        let mut writable = vec![common.join("objects")];
        // The branch's own dir: `troupe/NAME` lives in `refs/heads/troupe`, so that dir (the
        // finest a commit can be granted: git replaces a ref by renaming a lock file beside
        // it), with every other member's branch and reflog there bound read-only on top.
        for root in ["refs/heads", "logs/refs/heads"] {
            let own = branch(root);
            let Some(parent) = own.parent() else {
                continue;
            };
            writable.push(parent.to_path_buf());
            if let Ok(entries) = std::fs::read_dir(parent) {
                dirs.read_only.extend(
                    entries
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| *p != own && !p.to_string_lossy().ends_with(".lock")),
                );
            }
        }
        writable.retain(|d| d.is_dir());
        if let Some(admin) = wt
            .admin
            .as_ref()
            .and_then(|a| a.canonicalize().ok())
            .filter(|a| a.parent() == Some(common.join("worktrees").as_path()))
        {
            for f in ["commondir", "gitdir", "config.worktree"] {
                if admin.join(f).is_file() {
                    dirs.read_only.push(admin.join(f));
                }
            }
            writable.push(admin);
        }
        dirs.common = Some(common);
        dirs.writable = writable;
        dirs
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
    fn a_main_tree_gets_its_git_dir_read_only_and_nothing_more() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join(".git")).unwrap();
        assert_eq!(
            GitDirs::for_member(tmp.path(), None),
            GitDirs {
                read_only: vec![tmp.path().join(".git")],
                ..GitDirs::default()
            }
        );
    }

    #[test]
    fn grants_never_come_from_the_working_dir() {
        // A planted `.git` file naming `/` grants nothing: the roster records no worktree.
        let tmp = tempfile::tempdir().unwrap();
        let fake = tmp.path().join("fake");
        std::fs::create_dir(&fake).unwrap();
        std::fs::write(fake.join("commondir"), " /\n").unwrap();
        std::fs::write(
            tmp.path().join(".git"),
            format!("gitdir: {}\n", fake.display()),
        )
        .unwrap();
        let g = GitDirs::for_member(tmp.path(), None);
        assert_eq!(g.common, None);
        assert!(g.writable.is_empty());
        // A record whose repository lies inside the working dir grants nothing either.
        std::fs::create_dir_all(tmp.path().join("r/.git/objects")).unwrap();
        let wt = Worktree {
            path: tmp.path().to_path_buf(),
            branch: "troupe/a".to_owned(),
            repo: tmp.path().join("r"),
            admin: None,
        };
        let g = GitDirs::for_member(tmp.path(), Some(&wt));
        assert_eq!(g.common, None);
        assert!(g.writable.is_empty());
    }
}
