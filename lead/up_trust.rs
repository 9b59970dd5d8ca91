//! Whether `lead up` may apply a team file without asking a person first.
//!
//! A team file installs hooks (commands the supervisor runs), sets budgets and writes every
//! member's prompt. One that lies in a tree the members' commands can write (the team's project
//! root, a member's worktree) may have been rewritten by a teammate since a person last applied
//! it (review 3, N5). So `lead up` records what it applied, per file ([`Record`], in the team
//! dir, which commands cannot reach), and refuses a file that lies in such a tree and differs
//! from what it applied there, showing the difference, until a person runs `lead up --accept`.
//! A file never applied is applied: the person who just wrote it is running `lead up` on it.
//! A file outside every such tree (`/etc/troupe/team.toml`) is applied as before.
//!
//! The prompt files a team file names are part of what it applies and are treated alike: they
//! are read only from under the team file's directory ([`read_prompt`]), recorded with it, and
//! a changed one in a writable tree is refused as the file is.
//!
//! The record also holds the hooks that run outside the sandbox (`sandbox = false`, and
//! `request_pending`) as `lead up` last applied them, after this check ([`Record::trust_hooks`]):
//! the supervisor runs a hook outside only if it is there, so a `config.json` written by
//! anything but `lead up` cannot make one (review 4, R4-1). The trees members can write are
//! also what a paging hook may not name ([`member_trees`]).
//!
//! The policy is in pure functions ([`tree_of`], [`unconfirmed`], [`line_diff`]); [`check`]
//! gathers what they need from the file system and the team dir.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::os::unix::io::AsRawFd as _;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};
use troupe::TeamDir;
use troupe::config::TeamConfig;
use troupe::doc::Doc;
use troupe::hooks::Hook;

use crate::ExitError;

/// The exit code of a refused file: "refused", as a shutdown a teammate rejected.
pub const REFUSED: u8 = 5;

/// FNV-1a, 64 bits: enough to tell two versions of a file apart at a glance (the record keeps
/// the text itself, which is what is compared).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// One file as it was applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    /// `fnv1a64:` and the hash of its bytes in hex.
    pub hash: String,
    pub text: String,
}

impl Snapshot {
    pub fn of(text: &str) -> Snapshot {
        Snapshot {
            hash: format!("fnv1a64:{:016x}", fnv1a64(text.as_bytes())),
            text: text.to_owned(),
        }
    }
}

/// What one team file brought to the team the last time it was applied.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Applied {
    pub hash: String,
    /// The file's text, so that a later change can be shown as a diff.
    pub text: String,
    /// The prompt files it named, by their path as written joined to the file's directory.
    #[serde(default)]
    pub prompt_files: BTreeMap<PathBuf, Snapshot>,
}

/// `team-file.json`: what `lead up` applied, per team file (a team may be brought up from
/// more than one), by the file's absolute path as given (not resolved: a file swapped for a
/// symlink is still that path, changed). A document of the team ([`troupe::doc`]): on a bus,
/// one record for every host.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub files: BTreeMap<PathBuf, Applied>,
    /// The hooks that run outside the sandbox ([`troupe::hooks::runs_outside`]) of the team file
    /// `lead up` applied last: the only ones the supervisor runs outside it
    /// ([`troupe::hooks::trusted`]). While a `lead up` replaces them, the old ones and the new.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hooks: Vec<Hook>,
}

impl Record {
    /// The team dir's record; empty when nothing was recorded (or the team dir is new).
    pub fn load(team: &TeamDir) -> anyhow::Result<Record> {
        let doc = Record::doc(team);
        Ok(Record::parse(doc.read()?.as_deref(), &doc)?)
    }

    /// Records `applied` for `file`, unless that is what the record says already.
    pub fn store(team: &TeamDir, file: &Path, applied: Applied) -> anyhow::Result<()> {
        let doc = Record::doc(team);
        doc.update(|bytes| {
            let mut rec = Record::parse(bytes.as_deref(), &doc)?;
            if rec.files.get(file) == Some(&applied) {
                return Ok((None, ()));
            }
            rec.files.insert(file.to_path_buf(), applied);
            let bytes = doc.encode(&rec)?;
            Ok((Some(bytes), ()))
        })?;
        Ok(())
    }

    /// Records the hooks of `hooks` that run outside the sandbox as applied by `lead up`: added
    /// to those recorded with `keep` (before config.json is written, so that neither the old
    /// hooks nor the new ones run sandboxed meanwhile), in their place without it (once it is).
    pub fn trust_hooks(team: &TeamDir, hooks: &[Hook], keep: bool) -> anyhow::Result<()> {
        let doc = Record::doc(team);
        doc.update(|bytes| {
            let mut rec = Record::parse(bytes.as_deref(), &doc)?;
            let mut now = if keep { rec.hooks.clone() } else { Vec::new() };
            for h in hooks.iter().filter(|h| troupe::hooks::runs_outside(h)) {
                if !now.contains(h) {
                    now.push(h.clone());
                }
            }
            if rec.hooks == now {
                return Ok((None, ()));
            }
            rec.hooks = now;
            let bytes = doc.encode(&rec)?;
            Ok((Some(bytes), ()))
        })?;
        Ok(())
    }

    fn doc(team: &TeamDir) -> Doc<'_> {
        Doc::new(team, "team-file")
    }

    /// The record in `bytes` (empty when there are none).
    fn parse(bytes: Option<&[u8]>, doc: &Doc<'_>) -> troupe::Result<Record> {
        bytes.map_or(Ok(Record::default()), |b| {
            serde_json::from_slice(b).map_err(|e| doc.corrupt(e))
        })
    }
}

/// A tree the members' commands can write, and what it is (for the message).
#[derive(Debug, Clone, PartialEq)]
pub struct Tree {
    /// Canonical.
    pub path: PathBuf,
    pub what: String,
}

/// The first of `trees` that holds one of `paths` (all canonical: a path is in a tree when the
/// tree is one of its ancestors, or itself).
pub fn tree_of<'a>(paths: &[PathBuf], trees: &'a [Tree]) -> Option<&'a Tree> {
    trees
        .iter()
        .find(|t| paths.iter().any(|p| p.starts_with(&t.path)))
}

/// One input of `lead up` (the team file or a prompt file) as it is now.
#[derive(Debug, Clone, PartialEq)]
pub struct Input {
    /// Its path as given (the key of the record).
    pub path: PathBuf,
    pub text: String,
    /// The writable tree it lies in, if any.
    pub writable: Option<Tree>,
}

/// An input that must be shown to a person before it is applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Unconfirmed {
    pub path: PathBuf,
    pub tree: Tree,
    /// As applied last (empty for a prompt file the file did not name then).
    pub before: String,
    pub now: String,
}

/// The inputs that lie in a writable tree and differ from what was applied, given the record
/// of this team file (`None`: never applied, so nothing to confirm: its author runs `lead up`).
pub fn unconfirmed(
    recorded: Option<&Applied>,
    file: &Input,
    prompts: &[Input],
) -> Vec<Unconfirmed> {
    let Some(rec) = recorded else {
        return Vec::new();
    };
    let was = |i: &Input| {
        rec.prompt_files
            .get(&i.path)
            .map(|s| s.text.clone())
            .unwrap_or_default()
    };
    std::iter::once((file, rec.text.clone()))
        .chain(prompts.iter().map(|i| (i, was(i))))
        .filter_map(|(i, before)| {
            let tree = i.writable.clone()?;
            (before != i.text).then(|| Unconfirmed {
                path: i.path.clone(),
                tree,
                before,
                now: i.text.clone(),
            })
        })
        .collect()
}

/// The refusal of `file`: one sentence, then each changed input as a unified diff.
pub fn refusal_message(file: &Path, changed: &[Unconfirmed]) -> String {
    let places: Vec<String> = changed
        .iter()
        .map(|c| format!("{} in {}", c.path.display(), c.tree.what))
        .collect();
    let mut msg = format!(
        "{} was changed since it was last applied, and what changed lies where teammates' \
         commands can write ({}), so a teammate may have written it: nothing was applied. Read \
         the changes below; if they are yours, apply them with `lead up --accept {}`.",
        file.display(),
        places.join("; "),
        file.display(),
    );
    for c in changed {
        let _ = write!(
            msg,
            "\n--- {p} (as last applied)\n+++ {p} (now)\n{}",
            line_diff(&c.before, &c.now, 3).trim_end_matches('\n'),
            p = c.path.display()
        );
    }
    msg
}

/// The trees a team's members can write: its project root (the team dir's parent, the working
/// dir `lead run` defaults to) and each member's worktree and the repository it was made from.
/// Canonical where they exist.
pub fn writable_trees(team_dir: &Path, cfg: &TeamConfig) -> anyhow::Result<Vec<Tree>> {
    let canon = |p: &Path| -> anyhow::Result<PathBuf> {
        let abs =
            std::path::absolute(p).with_context(|| format!("failed to resolve {}", p.display()))?;
        Ok(abs.canonicalize().unwrap_or(abs))
    };
    let mut trees = Vec::new();
    let team_dir = std::path::absolute(team_dir)
        .with_context(|| format!("failed to resolve {}", team_dir.display()))?;
    if let Some(root) = team_dir.parent() {
        trees.push(Tree {
            path: canon(root)?,
            what: "the team's project root".to_owned(),
        });
    }
    for m in &cfg.members {
        if let Some(wt) = &m.worktree {
            trees.push(Tree {
                path: canon(&wt.path)?,
                what: format!("member {}'s worktree", m.name),
            });
            trees.push(Tree {
                path: canon(&wt.repo)?,
                what: format!("the repository of member {}'s worktree", m.name),
            });
        }
    }
    Ok(trees)
}

/// The trees the members' commands of a running team can write: [`writable_trees`], and the
/// working dir `lead run` gives them (`workdir`), its `--sandbox-write` dirs (`writes`) and the
/// members' private temp dirs. What a paging hook may not name.
pub fn member_trees(
    team_dir: &Path,
    cfg: &TeamConfig,
    workdir: &Path,
    writes: &[PathBuf],
) -> anyhow::Result<Vec<Tree>> {
    let canon = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let mut trees = writable_trees(team_dir, cfg)?;
    trees.push(Tree {
        path: canon(workdir),
        what: "the team's working dir".to_owned(),
    });
    trees.extend(writes.iter().map(|w| Tree {
        path: canon(w),
        what: format!("{}, a --sandbox-write dir", w.display()),
    }));
    let euid = nix::unistd::geteuid().as_raw();
    trees.push(Tree {
        path: canon(&std::env::temp_dir().join(format!("troupe-{euid}"))),
        what: "the members' private temp dirs".to_owned(),
    });
    Ok(trees)
}

/// The writable tree `path` lies in: where it leads (if it exists) or where its name is (its
/// directory resolved), so that a file swapped for a symlink is judged by both.
pub fn locate(path: &Path, trees: &[Tree]) -> Option<Tree> {
    let mut paths = Vec::new();
    if let Ok(p) = path.canonicalize() {
        paths.push(p);
    }
    if let (Some(dir), Some(name)) = (path.parent(), path.file_name())
        && let Ok(d) = dir.canonicalize()
    {
        paths.push(d.join(name));
    }
    if paths.is_empty() {
        paths.push(path.to_path_buf());
    }
    tree_of(&paths, trees).cloned()
}

/// A prompt file as read: its path as written joined to the team file's directory, where it
/// really is, and its text.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptRead {
    pub path: PathBuf,
    pub real: PathBuf,
    pub text: String,
}

/// Reads prompt file `p` (as written in the team file) from under `base`, the team file's
/// directory, made absolute. A path that leads out of it (absolute, `..`, a symlink) is refused,
/// judged by the file actually opened (so a component swapped for a symlink meanwhile is
/// refused too). The error reads after "prompt_file " and never holds the file's content.
pub fn read_prompt(base: &Path, p: &Path) -> Result<PromptRead, String> {
    let path = base.join(p);
    let within = base
        .canonicalize()
        .map_err(|e| format!("{}: the team file's directory: {e}", base.display()))?;
    let outside = || {
        format!(
            "{}: lies outside {}, the team file's directory (a prompt file is read only from \
             under it)",
            p.display(),
            base.display()
        )
    };
    // Refused before anything outside is looked at: an absolute path or a `..` that leaves it.
    if !lexically_under(base, &path) {
        return Err(outside());
    }
    let lexical = path
        .canonicalize()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    // A symlink on the way that leads out.
    if !lexical.starts_with(&within) {
        return Err(outside());
    }
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let real = std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd()))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !real.starts_with(&within) {
        return Err(outside());
    }
    let meta = f
        .metadata()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{}: not a regular file", path.display()));
    }
    let mut text = String::new();
    f.read_to_string(&mut text)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(PromptRead { path, real, text })
}

/// Whether `path` is `base` or under it once its `.` and `..` are taken as written (symlinks
/// are judged after, by what they resolve to).
fn lexically_under(base: &Path, path: &Path) -> bool {
    let mut parts: Vec<std::path::Component> = Vec::new();
    for c in path.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                if matches!(parts.last(), Some(std::path::Component::Normal(_))) {
                    parts.pop();
                }
            }
            c => parts.push(c),
        }
    }
    parts.iter().collect::<PathBuf>().starts_with(base)
}

/// Checks `file` (its absolute path as given, and its text) and the prompt files it read
/// against the record of `team_dir`: `Ok` if it may be applied, else the refusal (exit
/// [`REFUSED`]) with the diff. `accept`: a person has read the diff.
pub fn check(
    team_dir: &Path,
    cfg: &TeamConfig,
    file: &Path,
    text: &str,
    prompts: &[PromptRead],
    accept: bool,
) -> anyhow::Result<()> {
    if accept || !team_dir.exists() {
        return Ok(());
    }
    let team = TeamDir::open(team_dir)?;
    let rec = Record::load(&team)?;
    let Some(applied) = rec.files.get(file) else {
        return Ok(());
    };
    let trees = writable_trees(team_dir, cfg)?;
    let input = Input {
        path: file.to_path_buf(),
        text: text.to_owned(),
        writable: locate(file, &trees),
    };
    let prompt_inputs: Vec<Input> = prompts
        .iter()
        .map(|p| Input {
            path: p.path.clone(),
            text: p.text.clone(),
            writable: locate(&p.path, &trees).or_else(|| locate(&p.real, &trees)),
        })
        .collect();
    let changed = unconfirmed(Some(applied), &input, &prompt_inputs);
    if changed.is_empty() {
        return Ok(());
    }
    Err(ExitError {
        code: REFUSED,
        message: refusal_message(file, &changed),
    }
    .into())
}

/// What to record for `file` once applied.
pub fn applied(text: &str, prompts: &[PromptRead]) -> Applied {
    let s = Snapshot::of(text);
    Applied {
        hash: s.hash,
        text: s.text,
        prompt_files: prompts
            .iter()
            .map(|p| (p.path.clone(), Snapshot::of(&p.text)))
            .collect(),
    }
}

/// One step of an edit script: a line of both, of the old text only, of the new text only.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Same,
    Del,
    Ins,
}

/// Past this many cells (old lines times new lines, after the common head and tail), the
/// middle is shown as all removed and all added instead of computing the longest common
/// subsequence. The table takes 2 bytes a cell (16 MiB at most), and a length fits in them:
/// it is at most the shorter side, under 2^12 within the bound.
const MAX_CELLS: usize = 8 << 20;

/// The edit script from `a` to `b` by longest common subsequence.
fn edit_script(a: &[&str], b: &[&str]) -> Vec<Op> {
    let head = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let tail = a[head..]
        .iter()
        .rev()
        .zip(b[head..].iter().rev())
        .take_while(|(x, y)| x == y)
        .count();
    let (ma, mb) = (&a[head..a.len() - tail], &b[head..b.len() - tail]);
    let mut ops = vec![Op::Same; head];
    let (n, m) = (ma.len(), mb.len());
    if n.saturating_mul(m) > MAX_CELLS {
        ops.extend(std::iter::repeat_n(Op::Del, n));
        ops.extend(std::iter::repeat_n(Op::Ins, m));
    } else {
        // lcs[i * (m + 1) + j]: the longest common subsequence of ma[i..] and mb[j..].
        let w = m + 1;
        let mut lcs = vec![0u16; (n + 1) * w];
        for i in (0..n).rev() {
            for j in (0..m).rev() {
                lcs[i * w + j] = if ma[i] == mb[j] {
                    lcs[(i + 1) * w + j + 1] + 1
                } else {
                    lcs[(i + 1) * w + j].max(lcs[i * w + j + 1])
                };
            }
        }
        let (mut i, mut j) = (0, 0);
        while i < n || j < m {
            if i < n && j < m && ma[i] == mb[j] {
                ops.push(Op::Same);
                i += 1;
                j += 1;
            } else if i < n && (j == m || lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
                // Removals before additions, as diff(1) shows them.
                ops.push(Op::Del);
                i += 1;
            } else {
                ops.push(Op::Ins);
                j += 1;
            }
        }
    }
    ops.extend(std::iter::repeat_n(Op::Same, tail));
    ops
}

/// A unified diff of two texts, line by line, with `context` lines around each change: hunks
/// with their `@@ -l,n +l,n @@` headers, lines prefixed by ` `, `-` or `+`, each ending in a
/// newline. Empty when the lines are the same.
pub fn line_diff(old: &str, new: &str, context: usize) -> String {
    let a: Vec<&str> = old.lines().collect();
    let b: Vec<&str> = new.lines().collect();
    let ops = edit_script(&a, &b);
    // Each op with the line numbers (0-based) it is at in a and in b.
    let mut at = Vec::with_capacity(ops.len());
    let (mut i, mut j) = (0, 0);
    for op in &ops {
        at.push((*op, i, j));
        match op {
            Op::Same => {
                i += 1;
                j += 1;
            }
            Op::Del => i += 1,
            Op::Ins => j += 1,
        }
    }
    let changes: Vec<usize> = (0..at.len()).filter(|&k| at[k].0 != Op::Same).collect();
    let mut out = String::new();
    let mut k = 0;
    while k < changes.len() {
        // A hunk: changes less than 2 * context + 1 lines apart, with their context.
        let first = changes[k];
        let mut last = first;
        while k + 1 < changes.len() && changes[k + 1] - last <= 2 * context + 1 {
            k += 1;
            last = changes[k];
        }
        k += 1;
        let from = first.saturating_sub(context);
        let to = (last + context + 1).min(at.len());
        let span = &at[from..to];
        let old_len = span.iter().filter(|s| s.0 != Op::Ins).count();
        let new_len = span.iter().filter(|s| s.0 != Op::Del).count();
        let start =
            |first_line: usize, len: usize| if len == 0 { first_line } else { first_line + 1 };
        let _ = writeln!(
            out,
            "@@ -{},{old_len} +{},{new_len} @@",
            start(span[0].1, old_len),
            start(span[0].2, new_len)
        );
        for &(op, i, j) in span {
            let _ = match op {
                Op::Same => writeln!(out, " {}", a[i]),
                Op::Del => writeln!(out, "-{}", a[i]),
                Op::Ins => writeln!(out, "+{}", b[j]),
            };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_published_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn a_line_diff_shows_hunks_with_context() {
        assert_eq!(line_diff("a\nb\n", "a\nb\n", 3), "");
        let old = "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n11\n12\n";
        let new = "1\n2\nthree\n4\n5\n6\n7\n8\n9\n10\n11\n";
        assert_eq!(
            line_diff(old, new, 1),
            "@@ -2,3 +2,3 @@\n 2\n-3\n+three\n 4\n@@ -11,2 +11,1 @@\n 11\n-12\n"
        );
        // Close changes share one hunk.
        assert_eq!(
            line_diff("a\nb\nc\nd\n", "A\nb\nc\nD\n", 1),
            "@@ -1,4 +1,4 @@\n-a\n+A\n b\n c\n-d\n+D\n"
        );
        // From and to nothing.
        assert_eq!(line_diff("", "x\ny\n", 3), "@@ -0,0 +1,2 @@\n+x\n+y\n");
        assert_eq!(line_diff("x\n", "", 3), "@@ -1,1 +0,0 @@\n-x\n");
        // An insertion in the middle keeps the lines around it as context.
        assert_eq!(
            line_diff("a\nb\nc\n", "a\nb\nnew\nc\n", 3),
            "@@ -1,3 +1,4 @@\n a\n b\n+new\n c\n"
        );
    }

    #[test]
    fn a_line_diff_is_minimal_and_rebuilds_both_texts() {
        // Every line shown as kept is kept: the diff of a reordering keeps the longest run.
        let d = line_diff("a\nb\nc\nd\ne\n", "b\nc\nd\ne\na\n", 0);
        assert_eq!(d, "@@ -1,1 +0,0 @@\n-a\n@@ -5,0 +5,1 @@\n+a\n");
        let old: Vec<String> = (0..300).map(|i| format!("line {}", i % 7)).collect();
        let mut new = old.clone();
        new.remove(10);
        new.insert(100, "inserted".into());
        new[200] = "changed".into();
        let (old, new) = (old.join("\n"), new.join("\n"));
        let d = line_diff(&old, &new, usize::MAX / 4);
        let minus: Vec<&str> = d
            .lines()
            .filter(|l| !l.starts_with('+') && !l.starts_with('@'))
            .map(|l| &l[1..])
            .collect();
        let plus: Vec<&str> = d
            .lines()
            .filter(|l| !l.starts_with('-') && !l.starts_with('@'))
            .map(|l| &l[1..])
            .collect();
        assert_eq!(minus, old.lines().collect::<Vec<_>>());
        assert_eq!(plus, new.lines().collect::<Vec<_>>());
        assert_eq!(d.lines().filter(|l| l.starts_with('-')).count(), 2, "{d}");
        assert_eq!(d.lines().filter(|l| l.starts_with('+')).count(), 2, "{d}");
    }

    #[test]
    fn a_middle_too_large_for_the_table_is_shown_removed_and_added() {
        let old: Vec<String> = (0..3000).map(|i| format!("old {i}")).collect();
        let new: Vec<String> = (0..3000).map(|i| format!("new {i}")).collect();
        let d = line_diff(&old.join("\n"), &new.join("\n"), 3);
        assert!(
            d.starts_with("@@ -1,3000 +1,3000 @@\n-old 0\n"),
            "{}",
            &d[..40]
        );
        assert_eq!(d.lines().filter(|l| l.starts_with('-')).count(), 3000);
        assert_eq!(d.lines().filter(|l| l.starts_with('+')).count(), 3000);
    }

    #[test]
    fn a_path_is_judged_where_it_leads_and_where_its_name_is() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, away) = (tmp.path().join("root"), tmp.path().join("away"));
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&away).unwrap();
        std::fs::write(away.join("team.toml"), "").unwrap();
        std::fs::write(root.join("real.toml"), "").unwrap();
        std::os::unix::fs::symlink(away.join("team.toml"), root.join("team.toml")).unwrap();
        std::os::unix::fs::symlink(root.join("real.toml"), away.join("in.toml")).unwrap();
        let trees = [Tree {
            path: root.canonicalize().unwrap(),
            what: "root".into(),
        }];
        let what = |p: PathBuf| locate(&p, &trees).map(|t| t.what);
        assert_eq!(what(root.join("real.toml")), Some("root".into()));
        assert_eq!(what(root.join("team.toml")), Some("root".into()));
        assert_eq!(what(away.join("in.toml")), Some("root".into()));
        assert_eq!(what(away.join("team.toml")), None);
        assert_eq!(what(root.join("missing.toml")), Some("root".into()));
        assert!(lexically_under(&root, &root.join("a/../b.md")));
        assert!(!lexically_under(&root, &root.join("a/../../b.md")));
        assert!(!lexically_under(&root, Path::new("/etc/passwd")));
    }

    fn tree(p: &str, what: &str) -> Tree {
        Tree {
            path: PathBuf::from(p),
            what: what.into(),
        }
    }

    #[test]
    fn only_hooks_that_run_outside_are_recorded_and_a_replace_keeps_the_old_meanwhile() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let hook = |event: &str, command: &str, sandbox: bool| Hook {
            event: event.parse().unwrap(),
            command: command.into(),
            timeout_secs: None,
            sandbox,
        };
        let old = hook("teammate_idle", "old", false);
        let page = hook("request_pending", "/usr/bin/pager", true);
        let gate = hook("task_completed", "cargo test", true);
        Record::trust_hooks(&team, &[old.clone(), gate.clone()], false).unwrap();
        assert_eq!(
            Record::load(&team).unwrap().hooks,
            std::slice::from_ref(&old)
        );
        Record::trust_hooks(&team, &[page.clone(), gate], true).unwrap();
        assert_eq!(
            Record::load(&team).unwrap().hooks,
            [old.clone(), page.clone()]
        );
        Record::trust_hooks(&team, std::slice::from_ref(&page), false).unwrap();
        assert_eq!(Record::load(&team).unwrap().hooks, [page]);
        // A record written before hooks were recorded reads as none.
        let r: Record = serde_json::from_str(r#"{"files": {}}"#).unwrap();
        assert!(r.hooks.is_empty());
    }

    #[test]
    fn a_path_is_in_a_tree_under_it_or_at_it() {
        let trees = [tree("/srv/app", "root"), tree("/srv/app.troupe/bob", "bob")];
        let at = |p: &[&str]| {
            let paths: Vec<PathBuf> = p.iter().map(PathBuf::from).collect();
            tree_of(&paths, &trees).map(|t| t.what.clone())
        };
        assert_eq!(at(&["/srv/app/team.toml"]), Some("root".into()));
        assert_eq!(at(&["/srv/app"]), Some("root".into()));
        assert_eq!(at(&["/srv/app.troupe/bob/x/team.toml"]), Some("bob".into()));
        // By component, not by prefix of the string.
        assert_eq!(at(&["/srv/app2/team.toml"]), None);
        assert_eq!(at(&["/etc/troupe/team.toml"]), None);
        // Either of the places it is judged by.
        assert_eq!(
            at(&["/etc/troupe/team.toml", "/srv/app/evil.toml"]),
            Some("root".into())
        );
    }

    fn input(path: &str, text: &str, writable: bool) -> Input {
        Input {
            path: PathBuf::from(path),
            text: text.into(),
            writable: writable.then(|| tree("/srv/app", "the team's project root")),
        }
    }

    #[test]
    fn only_a_changed_input_in_a_writable_tree_is_to_be_confirmed() {
        let applied = Applied {
            hash: String::new(),
            text: "v1".into(),
            prompt_files: [(PathBuf::from("/srv/app/a.md"), Snapshot::of("hi"))].into(),
        };
        let file = input("/srv/app/team.toml", "v1", true);
        let prompt = input("/srv/app/a.md", "hi", true);
        // Never applied: its author is applying it.
        assert!(unconfirmed(None, &input("/srv/app/team.toml", "v2", true), &[]).is_empty());
        // The same as applied.
        assert!(unconfirmed(Some(&applied), &file, std::slice::from_ref(&prompt)).is_empty());
        // Changed, in a writable tree.
        let c = unconfirmed(
            Some(&applied),
            &input("/srv/app/team.toml", "v2", true),
            &[],
        );
        assert_eq!(c.len(), 1);
        assert_eq!((c[0].before.as_str(), c[0].now.as_str()), ("v1", "v2"));
        // Changed, outside every writable tree.
        assert!(
            unconfirmed(
                Some(&applied),
                &input("/etc/troupe/team.toml", "v2", false),
                &[]
            )
            .is_empty()
        );
        // A prompt file changed, or new since, in a writable tree; not outside.
        let c = unconfirmed(
            Some(&applied),
            &file,
            &[input("/srv/app/a.md", "bye", true)],
        );
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].path, PathBuf::from("/srv/app/a.md"));
        let c = unconfirmed(
            Some(&applied),
            &file,
            &[input("/srv/app/b.md", "new", true)],
        );
        assert_eq!((c[0].before.as_str(), c[0].now.as_str()), ("", "new"));
        assert!(unconfirmed(Some(&applied), &file, &[input("/etc/b.md", "new", false)]).is_empty());
        // The message names each place and shows each diff.
        let c = unconfirmed(
            Some(&applied),
            &input("/srv/app/team.toml", "v2", true),
            &[input("/srv/app/a.md", "bye", true)],
        );
        let m = refusal_message(Path::new("/srv/app/team.toml"), &c);
        assert!(m.contains("teammates' commands can write"), "{m}");
        assert!(
            m.contains("/srv/app/a.md in the team's project root"),
            "{m}"
        );
        assert!(m.contains("--- /srv/app/team.toml (as last applied)\n+++ /srv/app/team.toml (now)\n@@ -1,1 +1,1 @@\n-v1\n+v2"), "{m}");
        assert!(m.ends_with("-hi\n+bye"), "{m}");
    }

    #[test]
    fn a_prompt_file_is_read_only_from_under_the_team_files_dir() {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().join("team");
        std::fs::create_dir_all(base.join("prompts")).unwrap();
        std::fs::write(base.join("prompts/a.md"), "inside").unwrap();
        std::fs::write(tmp.path().join("secret"), "KEY").unwrap();
        std::os::unix::fs::symlink(tmp.path().join("secret"), base.join("out.md")).unwrap();
        std::os::unix::fs::symlink("prompts/a.md", base.join("in.md")).unwrap();
        let r = read_prompt(&base, Path::new("prompts/a.md")).unwrap();
        assert_eq!(
            (r.text.as_str(), r.path.clone()),
            ("inside", base.join("prompts/a.md"))
        );
        assert_eq!(
            read_prompt(&base, Path::new("in.md")).unwrap().text,
            "inside"
        );
        let secret = tmp.path().join("secret");
        for p in [
            secret.as_path(),
            Path::new("../secret"),
            Path::new("prompts/../../secret"),
            Path::new("out.md"),
            Path::new("../nothing"),
            Path::new("/nothing"),
        ] {
            let e = read_prompt(&base, p).unwrap_err();
            assert!(e.contains("lies outside"), "{}: {e}", p.display());
            assert!(!e.contains("KEY"), "{e}");
        }
        let e = read_prompt(&base, Path::new("prompts/none.md")).unwrap_err();
        assert!(e.contains("No such file"), "{e}");
        let e = read_prompt(&base, Path::new("prompts")).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
    }
}
