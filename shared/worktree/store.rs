//! A member's store: the git dir of its worktree, a normal (not linked) git dir of its own in
//! `<repo>.troupe/.stores/NAME.git`, outside the worktree.
//!
//! It holds the member's refs (`HEAD`, symbolic to `refs/heads/troupe/NAME`), its index and its
//! objects; `objects/info/alternates` names the repository's object store, so that what the
//! repository has is read from there and never copied, and a commit writes only into the
//! store. The worktree's `.git` is a file naming the store. troupe writes the store's `config`,
//! `objects/info/alternates` and `hooks` (empty), and the sandbox keeps them read-only to the
//! member (see [`super::GitDirs`]); nothing of the repository's git dir is writable to it.
//!
//! The member's commits reach the repository only through [`take_branch`]: a fetch from the
//! store that hashes every object it receives and checks that everything the branch names is
//! there. git names an object by its hash and never checks it when it reads one, so an object
//! the member rewrote in its store arrives under another name, and the fetch fails.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use super::{SAFE, Worktree, git, git_in, git_ok, path_for};
use crate::error::{Error, Result};

/// How long a failed `git fsck` of a repository holds the merge queue before it is run again.
const FSCK_AGAIN_AFTER: Duration = Duration::from_secs(15);

/// The store of member `name`'s worktree of the repository whose main tree is `repo`.
/// (Member names start with a letter: no member's worktree is called `.stores`.)
pub fn store_for(repo: &Path, name: &str) -> PathBuf {
    path_for(repo, ".stores").join(format!("{name}.git"))
}

/// What [`super::ensure_moving`] did to a worktree of the old layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Moved {
    /// The admin dir it had in the repository's git dir (now removed).
    pub from: PathBuf,
    /// What `git fsck` of the repository said, when it failed then: the merge queue holds on
    /// that repository until it passes (see [`fsck_hold`]).
    pub fsck_failed: Option<String>,
}

/// `git` (its arguments to add) on the store `store` with the work tree `work_tree`: both
/// named, and `GIT_COMMON_DIR` the store itself, so that a `commondir` the member planted in
/// it redirects nothing; `SAFE`; no system or global config; no inherited repository
/// overrides; stdin closed.
pub(crate) fn git_member(store: &Path, work_tree: &Path) -> Command {
    let mut cmd = Command::new("git");
    cmd.arg("--git-dir")
        .arg(store)
        .arg("--work-tree")
        .arg(work_tree)
        .args(SAFE)
        .current_dir(store)
        .env("GIT_COMMON_DIR", store)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .stdin(std::process::Stdio::null());
    for var in [
        "GIT_DIR",
        "GIT_WORK_TREE",
        "GIT_INDEX_FILE",
        "GIT_OBJECT_DIRECTORY",
        "GIT_ALTERNATE_OBJECT_DIRECTORIES",
        "GIT_CONFIG_PARAMETERS",
        "GIT_CONFIG_COUNT",
        "GIT_NAMESPACE",
    ] {
        cmd.env_remove(var);
    }
    cmd
}

/// [`git_member`] ARGS, its stdout when it succeeds, else [`Error::Git`] with its stderr.
fn member_ok(wt: &Worktree, store: &Path, args: &[&str]) -> Result<String> {
    let o = git_member(store, &wt.path)
        .args(args)
        .output()
        .map_err(Error::io("run git in", store))?;
    if !o.status.success() {
        return Err(Error::Git {
            op: format!("git {}", args.join(" ")),
            dir: store.to_path_buf(),
            stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&o.stdout).trim_end().to_owned())
}

/// The commit the member's branch names in its store, if it has a store and the branch.
pub fn tip_in_store(wt: &Worktree) -> Option<String> {
    store_tip(wt, wt.store()?)
}

/// The commit `refs/heads/BRANCH` of the store names, if the branch is there.
fn store_tip(wt: &Worktree, store: &Path) -> Option<String> {
    let want = format!("refs/heads/{}^{{commit}}", wt.branch);
    member_ok(wt, store, &["rev-parse", "--verify", "--quiet", &want]).ok()
}

/// The repository's object store as the store's alternate names it.
fn alternates_text(repo: &Path) -> String {
    let objects = repo.join(".git/objects");
    let objects = objects.canonicalize().unwrap_or(objects);
    format!("{}\n", objects.display())
}

/// The store's config: a non-bare git dir of the repository's object format, with the
/// repository as its `origin` (so the member can `git fetch origin main` into its store).
fn config_text(repo: &Path, object_format: &str) -> String {
    let (version, extension) = match object_format {
        "sha1" | "" => ("0", String::new()),
        other => ("1", format!("[extensions]\n\tobjectformat = {other}\n")),
    };
    format!(
        "[core]\n\trepositoryformatversion = {version}\n\tfilemode = true\n\tbare = false\n\t\
         logallrefupdates = true\n{extension}[remote \"origin\"]\n\turl = {}\n\tfetch = \
         +refs/heads/*:refs/remotes/origin/*\n",
        repo.display()
    )
}

/// Writes what troupe keeps of the store (its dirs, `config`, `objects/info/alternates`, an
/// empty `hooks`), again at each start: a member whose sandbox could not keep them read-only
/// may have changed them. `HEAD` (the member's to move) only when there is none.
fn write_files(wt: &Worktree, store: &Path) -> Result<()> {
    for dir in [
        "objects/info",
        "objects/pack",
        "refs/heads",
        "refs/tags",
        "hooks",
    ] {
        let d = store.join(dir);
        std::fs::create_dir_all(&d).map_err(Error::io("create", &d))?;
    }
    let format = git_ok(&wt.repo, &["rev-parse", "--show-object-format"])?;
    crate::fsutil::atomic_write(
        &store.join("config"),
        config_text(&wt.repo, format.trim()).as_bytes(),
    )?;
    crate::fsutil::atomic_write(
        &store.join("objects/info/alternates"),
        alternates_text(&wt.repo).as_bytes(),
    )?;
    if !store.join("HEAD").is_file() {
        let head = format!("ref: refs/heads/{}\n", wt.branch);
        crate::fsutil::atomic_write(&store.join("HEAD"), head.as_bytes())?;
    }
    Ok(())
}

/// Writes the worktree's `.git` file, naming its store.
fn write_dot_git(wt: &Worktree, store: &Path) -> Result<()> {
    let dot_git = wt.path.join(".git");
    if std::fs::symlink_metadata(&dot_git).is_ok_and(|m| m.is_dir()) {
        std::fs::remove_dir_all(&dot_git).map_err(Error::io("remove", &dot_git))?;
    }
    crate::fsutil::atomic_write(
        &dot_git,
        format!("gitdir: {}\n", store.display()).as_bytes(),
    )
}

/// The commit a new store's branch starts at: the repository's branch if it has one, else the
/// main tree's `HEAD`, on which the repository's branch is then made (so that the repository
/// keeps every object the store starts from).
fn base_of(wt: &Worktree) -> Result<String> {
    if let Some(tip) = crate::merge::git::branch_tip(&wt.repo, &wt.branch)? {
        return Ok(tip);
    }
    let head = git(
        &wt.repo,
        &["rev-parse", "--verify", "--quiet", "HEAD^{commit}"],
    )?;
    if !head.status.success() {
        return Err(Error::Git {
            op: "branch from HEAD".to_owned(),
            dir: wt.repo.clone(),
            stderr: "the repository has no commit yet; commit once before --worktree".to_owned(),
        });
    }
    let head = String::from_utf8_lossy(&head.stdout).trim().to_owned();
    git_ok(
        &wt.repo,
        &[
            "update-ref",
            &format!("refs/heads/{}", wt.branch),
            &head,
            "",
        ],
    )?;
    Ok(head)
}

/// Makes (or completes) the store and worktree of `wt`, whose record names its store: the
/// store from the repository's branch when it has none, the worktree checked out when its dir
/// is gone, the index read from the branch when the worktree is there but its store was not.
pub(super) fn make(wt: &Worktree) -> Result<()> {
    let store = wt.store().ok_or_else(|| Error::Git {
        op: "make the worktree's store".to_owned(),
        dir: wt.path.clone(),
        stderr: "the record names no store".to_owned(),
    })?;
    let fresh = !store.join("HEAD").is_file();
    let base = if fresh { Some(base_of(wt)?) } else { None };
    write_files(wt, store)?;
    if let Some(base) = &base {
        member_ok(
            wt,
            store,
            &["update-ref", &format!("refs/heads/{}", wt.branch), base],
        )?;
    }
    if !wt.path.exists() {
        std::fs::create_dir_all(&wt.path).map_err(Error::io("create", &wt.path))?;
        write_dot_git(wt, store)?;
        member_ok(wt, store, &["reset", "--quiet", "--hard"])?;
    } else {
        write_dot_git(wt, store)?;
        if fresh {
            // The files are the member's work: kept, the index read from the branch.
            member_ok(wt, store, &["reset", "--quiet"])?;
        }
    }
    Ok(())
}

/// Moves the worktree `wt` (the old layout: a linked worktree whose admin dir is `old`) to its
/// store: the branch from the repository, `HEAD` on it, the index copied (staged work stays
/// staged), the `.git` file naming the store; then the admin dir is removed and `git fsck` of
/// the repository run (a member may have rewritten its objects under the old layout).
pub(super) fn move_old(wt: &Worktree, old: &Path) -> Result<Moved> {
    let store = wt.store().ok_or_else(|| Error::Git {
        op: "move the worktree to a store".to_owned(),
        dir: wt.path.clone(),
        stderr: "the record names no store".to_owned(),
    })?;
    let tip = match crate::merge::git::branch_tip(&wt.repo, &wt.branch)? {
        Some(t) => t,
        None => {
            let o = git_in(old, &wt.path, &wt.repo)
                .args(["rev-parse", "--verify", "HEAD^{commit}"])
                .output()
                .map_err(Error::io("run git in", &wt.path))?;
            let head = String::from_utf8_lossy(&o.stdout).trim().to_owned();
            if !o.status.success() || head.is_empty() {
                // Neither the branch nor the worktree's HEAD: it starts again from the main
                // tree's.
                base_of(wt)?
            } else {
                git_ok(
                    &wt.repo,
                    &["update-ref", &format!("refs/heads/{}", wt.branch), &head],
                )?;
                head
            }
        }
    };
    write_files(wt, store)?;
    let head = format!("ref: refs/heads/{}\n", wt.branch);
    crate::fsutil::atomic_write(&store.join("HEAD"), head.as_bytes())?;
    member_ok(
        wt,
        store,
        &["update-ref", &format!("refs/heads/{}", wt.branch), &tip],
    )?;
    let index = old.join("index");
    if index.is_file() {
        std::fs::copy(&index, store.join("index")).map_err(Error::io("copy", &index))?;
    }
    write_dot_git(wt, store)?;
    std::fs::remove_dir_all(old).map_err(Error::io("remove", old))?;
    git_ok(&wt.repo, &["worktree", "prune"])?;
    let fsck_failed = match fsck(&wt.repo) {
        Ok(Ok(())) => {
            let _ = std::fs::remove_file(fsck_marker(&wt.repo));
            None
        }
        Ok(Err(said)) => {
            crate::fsutil::atomic_write(&fsck_marker(&wt.repo), said.as_bytes())?;
            Some(said)
        }
        Err(e) => {
            let said = e.to_string();
            crate::fsutil::atomic_write(&fsck_marker(&wt.repo), said.as_bytes())?;
            Some(said)
        }
    };
    Ok(Moved {
        from: old.to_path_buf(),
        fsck_failed,
    })
}

/// The member's name from its branch (`troupe/NAME`), for errors.
fn member_of(wt: &Worktree) -> String {
    wt.branch
        .strip_prefix("troupe/")
        .unwrap_or(&wt.branch)
        .to_owned()
}

/// Quotes `s` for `sh`.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Copies the repository's branches into the member's store as `refs/remotes/origin/NAME`, what
/// a `git fetch origin` would give it: the store has refs of its own only, and a teammate told
/// to merge the target or another member's branch (a conflict sent back, a task whose owner
/// ended) merges `origin/NAME`. Only the store is written; its own branches are left alone.
pub fn offer_branches(wt: &Worktree) -> Result<()> {
    let Some(store) = wt.store() else {
        return Ok(());
    };
    if !store.is_dir() {
        return Ok(());
    }
    let listed = git_ok(
        &wt.repo,
        &[
            "for-each-ref",
            "--format=%(objectname) %(refname)",
            "refs/heads/",
        ],
    )?;
    let mut lines = String::new();
    for line in listed.lines() {
        let Some((sha, name)) = line.split_once(' ') else {
            continue;
        };
        let Some(short) = name.strip_prefix("refs/heads/") else {
            continue;
        };
        lines.push_str(&format!("update refs/remotes/origin/{short} {sha}\n"));
    }
    if lines.is_empty() {
        return Ok(());
    }
    let mut child = git_member(store, &wt.path)
        .args(["update-ref", "--stdin"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(Error::io("run git in", store))?;
    if let Some(mut input) = child.stdin.take() {
        use std::io::Write as _;
        let _ = input.write_all(lines.as_bytes());
    }
    let o = child
        .wait_with_output()
        .map_err(Error::io("run git in", store))?;
    if !o.status.success() {
        return Err(Error::Git {
            op: "git update-ref --stdin (the repository's branches as origin/*)".to_owned(),
            dir: store.to_path_buf(),
            stderr: String::from_utf8_lossy(&o.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// Takes the member's branch into the repository: fetches `refs/heads/BRANCH` of its store
/// into the repository's `refs/heads/BRANCH` (forced: the branch is the member's to rewrite),
/// with every object received hashed and checked (`transfer.fsckObjects`) and the branch's
/// history checked complete; the fetched tip, or `None` when the store has no such branch.
///
/// Refused first, naming why: a record of the old layout (moved at the team's next start), a
/// store with a `commondir` (it would make git read another repository), or one whose
/// alternates are not what troupe wrote. The store's side of the fetch runs with
/// `GIT_COMMON_DIR` the store and `--strict` (no other dir is tried in its place). Takes of
/// one branch are one at a time (a flock on `.stores/NAME.lock`).
pub fn take_branch(wt: &Worktree) -> Result<Option<String>> {
    let refuse = |why: String| Error::WorktreeRefused {
        name: member_of(wt),
        why,
    };
    let Some(store) = wt.store() else {
        return Err(refuse(
            "its worktree is of the old layout (a linked worktree of the repository); it is \
             moved to a store of its own at the team's next start (`lead run`)"
                .to_owned(),
        ));
    };
    if std::fs::symlink_metadata(store.join("commondir")).is_ok() {
        return Err(refuse(format!(
            "its store {} holds a commondir, which troupe never writes: not taken",
            store.display()
        )));
    }
    let alternates =
        std::fs::read_to_string(store.join("objects/info/alternates")).unwrap_or_default();
    if alternates != alternates_text(&wt.repo) {
        return Err(refuse(
            "its store's objects/info/alternates is not what troupe wrote: not taken (it is \
             written again at the member's next start)"
                .to_owned(),
        ));
    }
    if store_tip(wt, store).is_none() {
        return Ok(None);
    }
    // One take of this branch at a time, whoever takes it (the queue at a completion, the
    // merge thread following an idle member, `lead merge` by hand): two fetches into the same
    // ref race on its lock, and the loser's "cannot lock ref" would send a finished task back.
    // The lock sits beside the store, in `.stores`, where no member's command may write.
    let lock_path = store.with_extension("lock");
    let lock = crate::fsutil::open_lock(&lock_path)?;
    let _taking = crate::fsutil::lock_exclusive(&lock, &lock_path)?;
    let upload = format!(
        "GIT_COMMON_DIR={} git -c core.fsmonitor=false -c core.hooksPath=/dev/null upload-pack \
         --strict",
        sh_quote(&store.to_string_lossy())
    );
    let spec = format!("+refs/heads/{b}:refs/heads/{b}", b = wt.branch);
    let store_arg = store.to_string_lossy();
    let args = [
        "-c",
        "transfer.fsckObjects=true",
        "-c",
        "fetch.fsckObjects=true",
        "fetch",
        "--quiet",
        "--no-tags",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        "--upload-pack",
        &upload,
        &store_arg,
        &spec,
    ];
    let o = Command::new("git")
        .arg("-C")
        .arg(&wt.repo)
        .args(SAFE)
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .env_remove("GIT_INDEX_FILE")
        .env_remove("GIT_COMMON_DIR")
        .env_remove("GIT_CONFIG_PARAMETERS")
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(Error::io("run git in", &wt.repo))?;
    if !o.status.success() {
        return Err(refuse(format!(
            "fetching {} from its store {} failed (every object is hashed and checked): {}",
            wt.branch,
            store.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        )));
    }
    crate::merge::git::branch_tip(&wt.repo, &wt.branch)
}

/// The marker of a failed `git fsck` of the repository whose main tree is `repo` (beside the
/// worktrees, where no member may write); it holds what fsck said.
fn fsck_marker(repo: &Path) -> PathBuf {
    path_for(repo, ".fsck-failed")
}

/// `git fsck` of the repository: `Err` with what it said when it fails.
fn fsck(repo: &Path) -> Result<std::result::Result<(), String>> {
    let o = git(repo, &["fsck", "--no-dangling", "--no-progress"])?;
    if o.status.success() {
        return Ok(Ok(()));
    }
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stderr),
        String::from_utf8_lossy(&o.stdout)
    );
    let lines: Vec<&str> = said.lines().take(20).collect();
    Ok(Err(lines.join("\n")))
}

/// Whether a failed fsck `age` old is run again now.
fn fsck_due(age: Duration) -> bool {
    age >= FSCK_AGAIN_AFTER
}

/// Why nothing may land on the repository whose main tree is `repo` now, if so: its `git fsck`
/// failed when troupe moved a worktree of the old layout, and has not passed since. Run again
/// at most every [`FSCK_AGAIN_AFTER`]; once it passes, the hold is lifted.
pub fn fsck_hold(repo: &Path) -> Option<String> {
    let marker = fsck_marker(repo);
    let meta = std::fs::metadata(&marker).ok()?;
    let age = meta
        .modified()
        .ok()
        .and_then(|m| m.elapsed().ok())
        .unwrap_or_default();
    let said = if fsck_due(age) {
        let said = match fsck(repo) {
            Ok(Ok(())) => {
                let _ = std::fs::remove_file(&marker);
                return None;
            }
            Ok(Err(said)) => said,
            Err(e) => e.to_string(),
        };
        // Written again: the next run is a while after this one.
        let _ = crate::fsutil::atomic_write(&marker, said.as_bytes());
        said
    } else {
        std::fs::read_to_string(&marker).unwrap_or_default()
    };
    Some(format!(
        "the repository {} failed `git fsck` when troupe moved its worktrees to stores of their \
         own (under the old layout a member could rewrite its objects): nothing lands on it \
         until fsck passes (checked again every {}s). git fsck said:\n{}",
        repo.display(),
        FSCK_AGAIN_AFTER.as_secs(),
        said.trim()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_live_beside_the_worktrees_where_no_member_is_named() {
        assert_eq!(
            store_for(Path::new("/src/proj"), "alice"),
            PathBuf::from("/src/proj.troupe/.stores/alice.git")
        );
        assert!(crate::teamdir::AgentName::teammate(".stores").is_err());
    }

    #[test]
    fn the_config_names_the_object_format_and_the_repository() {
        let c = config_text(Path::new("/src/proj"), "sha1");
        assert!(c.contains("repositoryformatversion = 0") && c.contains("bare = false"));
        assert!(c.contains("url = /src/proj") && !c.contains("objectformat"));
        let c = config_text(Path::new("/src/proj"), "sha256");
        assert!(c.contains("repositoryformatversion = 1"));
        assert!(c.contains("objectformat = sha256"));
    }

    #[test]
    fn a_failed_fsck_runs_again_only_after_a_while() {
        assert!(!fsck_due(Duration::ZERO));
        assert!(!fsck_due(FSCK_AGAIN_AFTER - Duration::from_secs(1)));
        assert!(fsck_due(FSCK_AGAIN_AFTER));
    }

    #[test]
    fn quoting_keeps_a_path_one_word() {
        assert_eq!(sh_quote("/a b/it's.git"), r"'/a b/it'\''s.git'");
    }
}
