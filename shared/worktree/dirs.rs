//! What of git a member's commands may touch (the sandbox's git part), from what troupe
//! recorded.

use std::path::{Path, PathBuf};

use super::Worktree;

/// What of git a member's commands may touch, from what troupe recorded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GitDirs {
    /// The repository's git dir (`<repo>/.git`): read only, as a whole (the store reads the
    /// repository's objects through its alternates). Nothing in it is granted for writing, so
    /// nothing there can vanish under the sandbox (`git gc`, `git pack-refs`) either.
    pub common: Option<PathBuf>,
    /// Written: the member's store (`<repo>.troupe/.stores/NAME.git`), beside the working dir.
    pub writable: Vec<PathBuf>,
    /// Read-only although inside a writable tree: the working dir's `.git` (a main tree's git
    /// dir, or a worktree's `.git` file), and the store's `config`, `objects/info/alternates`
    /// and `hooks`, which troupe writes.
    pub read_only: Vec<PathBuf>,
}

impl GitDirs {
    /// The git dirs of a member working in `workdir`, with `worktree` as its roster entry
    /// records it (the roster lives in the team dir, which commands cannot reach). Nothing is
    /// read from `workdir`: its `.git` is only looked at to be kept read-only. A record of the
    /// old layout (its admin dir in the repository's git dir) is granted nothing to write: it
    /// is moved to a store before its worker starts.
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
        dirs.common = Some(common.clone());
        let Some(store) = wt
            .store()
            .and_then(|s| s.canonicalize().ok())
            .filter(|s| s.is_dir() && !s.starts_with(&canon) && !s.starts_with(&common))
        else {
            return dirs;
        };
        for f in ["config", "objects/info/alternates", "hooks"] {
            if store.join(f).exists() {
                dirs.read_only.push(store.join(f));
            }
        }
        dirs.writable.push(store);
        dirs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            admin: Some(fake.clone()),
        };
        let g = GitDirs::for_member(tmp.path(), Some(&wt));
        assert_eq!(g.common, None);
        assert!(g.writable.is_empty());
    }

    /// The store is written; the repository's git dir is read only, as a whole; the store's
    /// files troupe writes are read-only on top. A record of the old layout writes nothing.
    #[test]
    fn a_member_writes_its_store_and_nothing_of_the_repository() {
        let tmp = tempfile::tempdir().unwrap();
        let repo = tmp.path().join("repo");
        let wt_dir = tmp.path().join("repo.troupe/a");
        let store = tmp.path().join("repo.troupe/.stores/a.git");
        for d in [
            repo.join(".git/objects"),
            repo.join(".git/worktrees/a"),
            wt_dir.clone(),
            store.join("objects/info"),
            store.join("hooks"),
        ] {
            std::fs::create_dir_all(d).unwrap();
        }
        std::fs::write(store.join("config"), "").unwrap();
        std::fs::write(store.join("objects/info/alternates"), "").unwrap();
        std::fs::write(wt_dir.join(".git"), "gitdir: x\n").unwrap();
        let canon = |p: &Path| p.canonicalize().unwrap();
        let mut wt = Worktree {
            path: wt_dir.clone(),
            branch: "troupe/a".to_owned(),
            repo: repo.clone(),
            admin: Some(store.clone()),
        };
        let g = GitDirs::for_member(&wt_dir, Some(&wt));
        assert_eq!(g.common, Some(canon(&repo.join(".git"))));
        assert_eq!(g.writable, vec![canon(&store)]);
        assert_eq!(
            g.read_only,
            vec![
                wt_dir.join(".git"),
                canon(&store).join("config"),
                canon(&store).join("objects/info/alternates"),
                canon(&store).join("hooks"),
            ]
        );
        wt.admin = Some(repo.join(".git/worktrees/a"));
        let g = GitDirs::for_member(&wt_dir, Some(&wt));
        assert!(g.writable.is_empty(), "{g:?}");
    }
}
