//! What a land may write: the policy that keeps a member's commit from reaching files the
//! person did not give the team.
//!
//! A land moves the target, and with a checked-out target it writes the person's tree; either
//! way what lands is what the person's tree gets when it takes the target. git treats ignored
//! files as expendable (a merge overwrites them, and deletes an ignored dir to write a file in
//! its place), so a commit could replace the team dir's `config.json` (its hooks run as the
//! person) or a `.env` the person ignores. A candidate is therefore refused when one of the
//! paths it changes, against the tip it was merged onto, lies on one line of descent with the
//! team dir (in it, the dir itself, or a parent dir of it) or with an untracked or ignored path
//! of the person's tree (the same path, a path inside an untracked or ignored dir, or a dir
//! that holds one): git would create over, overwrite or delete it.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// The most paths a report names; the rest are counted.
const NAMED: usize = 20;

/// Why a changed path may not land.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Clash {
    /// It lies in the team dir, is the team dir, or is a parent dir of it.
    TeamDir(PathBuf),
    /// It meets an untracked or ignored path of the person's tree at `tree`.
    Untracked { path: PathBuf, tree: PathBuf },
}

/// One of the person's trees as the land would meet it.
#[derive(Debug, Clone)]
pub struct PersonsTree {
    /// Its top.
    pub top: PathBuf,
    /// The team dir's path relative to `top`, if it lies inside it.
    pub team_dir: Option<PathBuf>,
    /// Its untracked and ignored paths, relative to `top` (a dir for all that lies in it).
    pub untracked: Vec<PathBuf>,
}

/// Whether `a` and `b` lie on one line of descent (one is `b`, inside it, or holds it), by
/// whole components.
fn related(a: &Path, b: &Path) -> bool {
    a.starts_with(b) || b.starts_with(a)
}

/// The changed paths (relative to the trees' tops) that may not land, each once, in the order
/// given: the team dir rule first, then the untracked and ignored paths of each tree.
pub fn clashes(changed: &[PathBuf], trees: &[PersonsTree]) -> Vec<Clash> {
    let mut out = Vec::new();
    for p in changed {
        if p.as_os_str().is_empty() {
            continue;
        }
        let team = trees
            .iter()
            .any(|t| t.team_dir.as_deref().is_some_and(|d| related(p, d)));
        if team {
            out.push(Clash::TeamDir(p.clone()));
            continue;
        }
        if let Some(t) = trees
            .iter()
            .find(|t| t.untracked.iter().any(|u| related(p, u)))
        {
            out.push(Clash::Untracked {
                path: p.clone(),
                tree: t.top.clone(),
            });
        }
    }
    out
}

/// The paths of NUL-separated git output (`-z`), as git wrote them: no quoting, any bytes.
pub fn nul_paths(out: &[u8]) -> Vec<PathBuf> {
    out.split(|b| *b == 0)
        .filter(|p| !p.is_empty())
        .map(|p| PathBuf::from(OsStr::from_bytes(p)))
        .collect()
}

/// The untracked (`??`) and ignored (`!!`) paths of `git status --porcelain -z --no-renames`
/// output (a dir ends with `/`); other entries are tracked files and are left out.
pub fn untracked_of_status(out: &[u8]) -> Vec<PathBuf> {
    out.split(|b| *b == 0)
        .filter_map(|rec| {
            let path = rec
                .strip_prefix(b"?? ")
                .or_else(|| rec.strip_prefix(b"!! "))?;
            (!path.is_empty()).then(|| PathBuf::from(OsStr::from_bytes(path)))
        })
        .collect()
}

/// `path` as it may be shown on a terminal: quoted, with control characters, invalid UTF-8
/// and the like escaped (a name is the member's to choose).
pub fn shown(path: &Path) -> String {
    let mut s = String::from("\"");
    for chunk in path.as_os_str().as_bytes().utf8_chunks() {
        for c in chunk.valid().chars() {
            s.extend(c.escape_debug());
        }
        for b in chunk.invalid() {
            s.push_str(&format!("\\x{b:02x}"));
        }
    }
    s.push('"');
    s
}

/// The sentence that names `clashes` (non-empty) in a report.
pub fn describe(clashes: &[Clash]) -> String {
    let mut team = Vec::new();
    let mut untracked: Vec<(&Path, Vec<&Path>)> = Vec::new();
    for c in clashes {
        match c {
            Clash::TeamDir(p) => team.push(p.as_path()),
            Clash::Untracked { path, tree } => {
                match untracked.iter_mut().find(|(t, _)| t == tree) {
                    Some((_, ps)) => ps.push(path),
                    None => untracked.push((tree, vec![path])),
                }
            }
        }
    }
    let list = |ps: &[&Path]| {
        let mut s: Vec<String> = ps.iter().take(NAMED).map(|p| shown(p)).collect();
        if ps.len() > NAMED {
            s.push(format!("and {} more", ps.len() - NAMED));
        }
        s.join(", ")
    };
    let mut parts = Vec::new();
    if !team.is_empty() {
        parts.push(format!("the team dir: {}", list(&team)));
    }
    for (tree, ps) in &untracked {
        parts.push(format!(
            "untracked or ignored files of {}: {}",
            shown(tree),
            list(ps)
        ));
    }
    parts.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(s)
    }

    fn tree(team: Option<&str>, untracked: &[&str]) -> PersonsTree {
        PersonsTree {
            top: p("/home/me/proj"),
            team_dir: team.map(p),
            untracked: untracked.iter().map(|u| p(u)).collect(),
        }
    }

    #[test]
    fn the_team_dir_its_contents_and_its_parents_are_refused() {
        let t = [tree(Some("work/.team"), &[])];
        let changed: Vec<PathBuf> = [
            "work/.team/config.json",
            "work/.team",
            "work",
            "work/.teamster",
            "work/src/lib.rs",
            ".team",
        ]
        .iter()
        .map(|s| p(s))
        .collect();
        assert_eq!(
            clashes(&changed, &t),
            vec![
                Clash::TeamDir(p("work/.team/config.json")),
                Clash::TeamDir(p("work/.team")),
                Clash::TeamDir(p("work")),
            ]
        );
        // Outside the tree, the rule has nothing to match.
        assert!(clashes(&changed[3..], &[tree(None, &[])]).is_empty());
    }

    #[test]
    fn what_would_create_over_overwrite_or_delete_an_untracked_path_is_refused() {
        let t = [tree(None, &[".env", "target/", "notes/todo.txt"])];
        let changed: Vec<PathBuf> = [
            ".env",          // overwritten
            "target/x",      // created inside an ignored dir
            "target",        // the dir deleted for a file
            "notes",         // a dir holding one, deleted for a file
            "notes/new.txt", // beside it: fine
            ".envrc",        // a longer name: fine
            "src/.env",      // elsewhere: fine
        ]
        .iter()
        .map(|s| p(s))
        .collect();
        let refused: Vec<PathBuf> = clashes(&changed, &t)
            .into_iter()
            .map(|c| match c {
                Clash::Untracked { path, .. } => path,
                Clash::TeamDir(_) => unreachable!(),
            })
            .collect();
        assert_eq!(refused, [p(".env"), p("target/x"), p("target"), p("notes")]);
    }

    #[test]
    fn git_output_with_odd_names_is_read_whole() {
        let out = b"README\0a b\nc\0-rf\0\xff\xfe.txt\0";
        assert_eq!(
            nul_paths(out),
            [
                p("README"),
                p("a b\nc"),
                p("-rf"),
                PathBuf::from(OsStr::from_bytes(b"\xff\xfe.txt")),
            ]
        );
        let status = b" M README\0?? new dir/\0!! .env\0A  staged\0!! odd\tname\0";
        assert_eq!(
            untracked_of_status(status),
            [p("new dir/"), p(".env"), p("odd\tname")]
        );
    }

    #[test]
    fn reports_escape_names_and_say_where() {
        let changed = [p(".team"), p("x\u{1b}]52;c;\u{7}"), p("ok")];
        let mut trees = vec![tree(Some(".team"), &["x\u{1b}]52;c;\u{7}"])];
        trees[0].top = p("/home/me/proj");
        let c = clashes(&changed, &trees);
        let d = describe(&c);
        assert_eq!(
            d,
            "the team dir: \".team\"; untracked or ignored files of \"/home/me/proj\": \
             \"x\\u{1b}]52;c;\\u{7}\""
        );
        assert!(!d.chars().any(|c| c.is_control()));
        let bytes = Path::new(OsStr::from_bytes(b"a\xffb\x9b"));
        assert_eq!(shown(bytes), "\"a\\xffb\\x9b\"");
        let many: Vec<PathBuf> = (0..25).map(|i| p(&format!(".team/{i}"))).collect();
        let d = describe(&clashes(&many, &trees));
        assert!(d.ends_with("\".team/19\", and 5 more"), "{d}");
    }
}
