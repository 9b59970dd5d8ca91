//! The roster in a team dir: one record per member, and `config.json` for the team.
//!
//! A change to one member must cost the same whatever the team's size, and a team of hundreds
//! changes members hundreds of times a second while it starts or stops. So:
//!
//! - **`members/NAME.json`** is member NAME's record: everything about it (settings and state),
//!   with a `rev` that grows by one on every write. One member's change (a worker's status, its
//!   usage, the supervisor's note of one exit) reads and durably replaces that file alone, under
//!   `members/NAME.lock`, taken while `config.lock` is held *shared*: changes of different
//!   members run side by side and none reads or writes the others. The write reuses the
//!   inode the record had before (kept as `.NAME.json.spare`), so a record costs two inodes
//!   for good rather than one made and freed per write; a reader holds the lock shared while
//!   it reads, for the spare it overwrites is what a reader may have opened one write ago.
//! - **`config.json`** keeps DESIGN.md's format: the team's own fields (which live only there)
//!   and `members[]`, a view of every record. What changes the team itself, takes a member
//!   off, or changes many members at once (`lead up`, a team stop, a pass of many starts)
//!   holds `config.lock` *exclusive*, reads every record and rewrites the view with its change.
//!   `lead spawn` changes or adds one member's record ([`update_one`], shared). One member's
//!   change leaves the view behind; the supervisor brings it up to date within [`VIEW_LAG`]
//!   (and when it exits), with the lock held shared and refreshers taking turns on
//!   `members/.view.lock`: on a busy team, members' own writes keep the shared lock taken,
//!   and flock lets an exclusive waiter wait behind them. The view is written one member per
//!   line after a first line with the team's fields, so a reader that wants only those reads
//!   one line.
//! - **Who is on the team**: every record, and every member of the view without one (a member a
//!   person added by hand, or a roster of an earlier version: it gets its record at its first
//!   change). A member leaves (`lead up --prune`) by a rewrite of the view without it, then the
//!   removal of its record.
//! - **A person's edit** of a member in `config.json` is an entry that differs from the record at
//!   the same `rev` (a view entry older than its record is only behind): it wins, and is copied
//!   into the record (under its lock) by the next exclusive write or view refresh. An edit of an
//!   entry the view had not caught up with yet is dropped (edit a busy team with `lead up`).
//! - While `config.json` does not parse, nothing that needs it is written (it stays as the person
//!   left it); members' own changes go on, for they do not touch it.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::config::{Member, TeamConfig};
use crate::doc::Doc;
use crate::error::{Error, Result};
use crate::fsutil;
use crate::teamdir::TeamDir;

/// How far the view in `config.json` may trail the members' records while a supervisor runs.
pub const VIEW_LAG: Duration = Duration::from_millis(200);

/// `members/`.
pub fn members_dir(team: &TeamDir) -> PathBuf {
    team.root().join("members")
}

/// Whether member `name` can have a record: a valid teammate name (a member with another name,
/// written by hand, is refused by the supervisor and stays in the view alone; its name never
/// becomes a path).
fn has_record_name(name: &str) -> bool {
    crate::teamdir::AgentName::teammate(name).is_ok()
}

fn record_path(team: &TeamDir, name: &str) -> PathBuf {
    members_dir(team).join(format!("{name}.json"))
}

fn record_lock(team: &TeamDir, name: &str) -> PathBuf {
    members_dir(team).join(format!("{name}.lock"))
}

/// `config.json` parsed; `None` when it does not exist. One that does not parse is an error.
fn read_view(team: &TeamDir) -> Result<Option<TeamConfig>> {
    let doc = Doc::roster(team);
    match fsutil::read_optional(&team.config())? {
        None => Ok(None),
        Some(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| doc.corrupt(e)),
    }
}

/// The error for a record that does not parse (left as it is).
fn corrupt_record(path: &Path, why: impl std::fmt::Display) -> Error {
    Error::Corrupt {
        path: path.to_owned(),
        why: format!("{why} (fix or remove the file; it was left untouched)"),
    }
}

/// Member `name`'s record; `None` when it has none. Its writers are kept out while it is read
/// (see [`write_record`]): a shared hold of its lock.
fn read_record(team: &TeamDir, name: &str) -> Result<Option<Member>> {
    let lock = record_lock(team, name);
    let file = match std::fs::File::open(&lock) {
        Ok(f) => Some(f),
        // Never written under its lock (made by hand), or being taken off: nothing to wait for.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("open", &lock)(e)),
    };
    let _shared = file
        .as_ref()
        .map(|f| fsutil::lock_shared(f, &lock))
        .transpose()?;
    read_record_held(team, name)
}

/// [`read_record`] by a writer of that record: its lock held exclusive, or `config.lock`.
fn read_record_held(team: &TeamDir, name: &str) -> Result<Option<Member>> {
    let path = record_path(team, name);
    match fsutil::read_optional(&path)? {
        None => Ok(None),
        Some(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| corrupt_record(&path, e)),
    }
}

/// The names of the members with a record.
fn record_names(team: &TeamDir) -> Result<Vec<String>> {
    let dir = members_dir(team);
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", &dir)(e)),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(Error::io("list", &dir))?;
        let file = entry.file_name();
        let Some(file) = file.to_str() else { continue };
        if let Some(name) = file.strip_suffix(".json")
            && has_record_name(name)
        {
            names.push(name.to_owned());
        }
    }
    Ok(names)
}

fn read_records(team: &TeamDir) -> Result<HashMap<String, Member>> {
    let mut out = HashMap::new();
    for name in record_names(team)? {
        if let Some(m) = read_record(team, &name)? {
            out.insert(name, m);
        }
    }
    Ok(out)
}

/// What member is, from its entry in the view and its record: the record, unless the entry is a
/// person's edit of it (same `rev`, other content); the entry alone when there is no record.
pub(crate) fn merge(view: Option<&Member>, record: Option<Member>) -> Option<Member> {
    match (view, record) {
        (Some(v), Some(r)) if v.rev == r.rev && *v != r => Some(v.clone()),
        (_, Some(r)) => Some(r),
        (Some(v), None) => Some(v.clone()),
        (None, None) => None,
    }
}

/// The roster from the view and the records: the view's members in its order, then members
/// with a record only (added since the view was written) in the order they were asked for.
pub(crate) fn assemble(
    view: Option<TeamConfig>,
    mut records: HashMap<String, Member>,
) -> TeamConfig {
    let mut cfg = view.unwrap_or_default();
    let listed = std::mem::take(&mut cfg.members);
    for v in &listed {
        if let Some(m) = merge(Some(v), records.remove(&v.name)) {
            cfg.members.push(m);
        }
    }
    let mut rest: Vec<Member> = records.into_values().collect();
    rest.sort_by(|a, b| {
        a.task_at
            .unwrap_or(0.0)
            .total_cmp(&b.task_at.unwrap_or(0.0))
            .then_with(|| a.name.cmp(&b.name))
    });
    cfg.members.extend(rest);
    cfg
}

/// The whole roster, read without a lock (every file is replaced whole).
pub fn load(team: &TeamDir) -> Result<TeamConfig> {
    let view = read_view(team)?;
    Ok(assemble(view, read_records(team)?))
}

/// The team's own fields from the first line of `config.json` (the members left out), when it
/// is written as [`encode_view`] writes it; `None` otherwise (a person's layout: read it all).
fn read_team_fields(team: &TeamDir) -> Result<Option<TeamConfig>> {
    let path = team.config();
    let f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Some(TeamConfig::default()));
        }
        Err(e) => return Err(Error::io("open", &path)(e)),
    };
    let mut first = String::new();
    std::io::BufReader::new(f)
        .read_line(&mut first)
        .map_err(Error::io("read", &path))?;
    let Some(head) = first.strip_suffix(MEMBERS_OPEN) else {
        return Ok(None);
    };
    if !head.starts_with('{') {
        return Ok(None);
    }
    Ok(serde_json::from_str(&format!("{head}\"members\":[]}}")).ok())
}

/// The roster as member `name` needs it: the team's fields and its own record only (members
/// holds it alone, or nothing when it is not on the team), without reading the other members;
/// all of them when the team has a budget (its spend is everyone's).
pub fn load_for(team: &TeamDir, name: &str) -> Result<TeamConfig> {
    let Some(mut cfg) = read_team_fields(team)? else {
        return load(team);
    };
    if cfg.team_budget_usd.is_some() {
        return load(team);
    }
    match read_record(team, name)? {
        Some(m) => {
            cfg.members = vec![m];
            Ok(cfg)
        }
        // Only in the view (added by hand, or before records): read it there.
        None => {
            let mut all = load(team)?;
            all.members.retain(|m| m.name == name);
            Ok(all)
        }
    }
}

/// The team's own fields: from the first line of `config.json` when it can, with no member
/// then; otherwise the whole roster.
pub fn load_team(team: &TeamDir) -> Result<TeamConfig> {
    match read_team_fields(team)? {
        Some(cfg) => Ok(cfg),
        None => load(team),
    }
}

/// The end of the first line of `config.json` as [`encode_view`] writes it.
const MEMBERS_OPEN: &str = "\"members\":[\n";

/// `config.json`'s bytes for `cfg`: a first line with the team's fields, then one member per
/// line (valid JSON in DESIGN.md's shape; `jq .` shows it indented).
pub(crate) fn encode_view(cfg: &TeamConfig) -> Result<Vec<u8>> {
    let unserializable =
        |e: serde_json::Error| Error::Protocol(format!("failed to serialize the roster: {e}"));
    let mut team = serde_json::to_value(TeamConfig {
        members: Vec::new(),
        ..cfg.clone()
    })
    .map_err(unserializable)?;
    if let Some(o) = team.as_object_mut() {
        o.remove("members");
    }
    let head = serde_json::to_string(&team).map_err(unserializable)?;
    let mut out = Vec::with_capacity(head.len() + cfg.members.len() * 1024);
    let open = head.strip_suffix('}').unwrap_or(&head);
    out.extend_from_slice(open.as_bytes());
    if open.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(MEMBERS_OPEN.as_bytes());
    for (i, m) in cfg.members.iter().enumerate() {
        serde_json::to_writer(&mut out, m).map_err(unserializable)?;
        if i + 1 < cfg.members.len() {
            out.push(b',');
        }
        out.push(b'\n');
    }
    out.extend_from_slice(b"]}\n");
    Ok(out)
}

/// Durably replaces member `m`'s record, with its lock held exclusive (see
/// [`fsutil::atomic_write_reusing`]: a team starting or stopping writes thousands of records,
/// and no inode is made or freed for them): its modification time is past the replaced one's,
/// `before`, so a reader that compares times never takes a new record for the one it read.
fn write_record(team: &TeamDir, m: &Member, before: Option<SystemTime>) -> Result<()> {
    let mut bytes = serde_json::to_vec_pretty(m)
        .map_err(|e| Error::Protocol(format!("failed to serialize {}: {e}", m.name)))?;
    bytes.push(b'\n');
    fsutil::atomic_write_reusing(&record_path(team, &m.name), &bytes, before)
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// What [`update_member`] did.
pub enum MemberWrite {
    /// Written; the record as it is now.
    Written(Member),
    /// `f` changed nothing; nothing written.
    Unchanged(Member),
    /// No such member.
    Missing,
}

/// Changes member `name` alone: its record, under its lock, with `config.lock` held shared.
/// `f` sees a roster holding that member alone, with the team's own fields when `with_team`
/// (then a config.json that does not parse is an error, as for a whole change); it changes
/// nothing else. The view is left behind (see the module's doc). A member only in the view
/// gets its record.
pub fn update_member(
    team: &TeamDir,
    name: &str,
    with_team: bool,
    f: &mut dyn FnMut(&mut TeamConfig),
) -> Result<MemberWrite> {
    if !has_record_name(name) {
        return Ok(MemberWrite::Missing);
    }
    let config_lock = team.config_lock();
    let cl = fsutil::open_lock(&config_lock)?;
    let _shared = fsutil::lock_shared(&cl, &config_lock)?;
    // The team's fields change only under the exclusive lock: as read now, they hold.
    let mut one = if with_team {
        match read_team_fields(team)? {
            Some(t) => t,
            None => TeamConfig {
                members: Vec::new(),
                ..read_view(team)?.unwrap_or_default()
            },
        }
    } else {
        TeamConfig::default()
    };
    fsutil::create_dir(&members_dir(team))?;
    let _own = fsutil::HeldLock::acquire(&record_lock(team, name))?;
    let path = record_path(team, name);
    let before_time = modified(&path);
    let base = match read_record_held(team, name)? {
        Some(r) => r,
        None => match read_view(team)?.and_then(|mut v| {
            let i = v.members.iter().position(|m| m.name == name)?;
            Some(v.members.swap_remove(i))
        }) {
            Some(m) => m,
            None => return Ok(MemberWrite::Missing),
        },
    };
    one.members = vec![base.clone()];
    f(&mut one);
    let Some(mut m) = one.members.into_iter().find(|m| m.name == base.name) else {
        return Ok(MemberWrite::Unchanged(base));
    };
    if m == base {
        return Ok(MemberWrite::Unchanged(m));
    }
    m.rev = base.rev + 1;
    write_record(team, &m, before_time)?;
    Ok(MemberWrite::Written(m))
}

/// Changes the roster as a whole under `config.lock` held exclusive: every record `f` changed is
/// written, then the view (with the team's fields), then the records of members `f` took off
/// are removed. Returns the roster after `f`, whether anything was written, and `f`'s result.
/// A person's edits found in the view are copied into their records on the way.
pub fn update<R>(
    team: &TeamDir,
    f: impl FnOnce(&mut TeamConfig) -> Result<R>,
) -> Result<(TeamConfig, R)> {
    let config_lock = team.config_lock();
    let cl = fsutil::open_lock(&config_lock)?;
    let _exclusive = fsutil::lock_exclusive(&cl, &config_lock)?;
    let view = read_view(team)?;
    let records = read_records(team)?;
    let before = assemble(view, records.clone());
    let mut after = before.clone();
    let out = f(&mut after)?;
    let (written, _) = write_all(team, &records, &before, after)?;
    Ok((written, out))
}

/// Changes or adds member `name` alone, under `config.lock` held exclusive (who is on the team
/// may change), reading the team's own fields and that member's record only: `f` sees a roster
/// holding the team's fields and the member, if it is on the team. `None`, with `f` not run,
/// when that cannot be done without reading every member (the team has a budget, config.json
/// is laid out by a person, or the member is in the view only): the caller changes the roster
/// as a whole then. `f` must change nothing but that member.
pub fn update_one<R>(
    team: &TeamDir,
    name: &str,
    f: impl FnOnce(&mut TeamConfig) -> Result<R>,
) -> Result<Option<(Member, R)>> {
    if !has_record_name(name) {
        return Ok(None);
    }
    // Shared: who is on the team changes under the exclusive lock only (a removal), and two
    // changes of this member take turns on its own lock. Exclusive would wait behind every
    // member's own writes, which keep the shared lock taken on a busy team.
    let config_lock = team.config_lock();
    let cl = fsutil::open_lock(&config_lock)?;
    let _shared = fsutil::lock_shared(&cl, &config_lock)?;
    fsutil::create_dir(&members_dir(team))?;
    let _own = fsutil::HeldLock::acquire(&record_lock(team, name))?;
    let Some(fields) = read_team_fields(team)? else {
        return Ok(None);
    };
    if fields.team_budget_usd.is_some() || crate::ceilings::any(&fields) {
        return Ok(None);
    }
    let record = read_record_held(team, name)?;
    if record.is_none() && view_lists(team, name)? {
        return Ok(None);
    }
    let mut one = fields.clone();
    one.members = record.clone().into_iter().collect();
    let out = f(&mut one)?;
    let Some(mut m) = one.members.into_iter().find(|m| m.name == name) else {
        return Err(Error::Protocol(format!("{name} was not added")));
    };
    if record.as_ref() != Some(&m) {
        m.rev = record.as_ref().map_or(0, |r| r.rev) + 1;
        write_record(team, &m, modified(&record_path(team, name)))?;
    }
    Ok(Some((m, out)))
}

/// Whether `config.json` lists member `name` (read for the names alone).
fn view_lists(team: &TeamDir, name: &str) -> Result<bool> {
    #[derive(serde::Deserialize)]
    struct Named {
        name: String,
    }
    #[derive(serde::Deserialize)]
    struct Names {
        #[serde(default)]
        members: Vec<Named>,
    }
    let Some(bytes) = fsutil::read_optional(&team.config())? else {
        return Ok(false);
    };
    // A name is written as a JSON string: where it is not, it is not listed (and the file is
    // not parsed, which costs with the team's size).
    let quoted = format!("\"{name}\"");
    if memchr::memmem::find(&bytes, quoted.as_bytes()).is_none() {
        return Ok(false);
    }
    let names: Names = serde_json::from_slice(&bytes).map_err(|e| Doc::roster(team).corrupt(e))?;
    Ok(names.members.iter().any(|m| m.name == name))
}

/// Brings the view in `config.json` up to date with the records (and copies a person's edits
/// into them), with `config.lock` held shared. Returns whether it wrote anything. A
/// `config.json` that does not parse is left alone (an error).
pub fn refresh_view(team: &TeamDir) -> Result<bool> {
    // Shared, beside the members' own writes (exclusive would wait behind them on a busy
    // team); refreshers take turns on `members/.view.lock`.
    let config_lock = team.config_lock();
    let cl = fsutil::open_lock(&config_lock)?;
    let _shared = fsutil::lock_shared(&cl, &config_lock)?;
    fsutil::create_dir(&members_dir(team))?;
    let _turn = fsutil::HeldLock::acquire(&members_dir(team).join(".view.lock"))?;
    let view = read_view(team)?;
    let mut records = read_records(team)?;
    let mut wrote = false;
    // A person's edits go into their records, each under its member's lock.
    for v in view.iter().flat_map(|v| &v.members) {
        let Some(r) = records.get(&v.name) else {
            continue;
        };
        if v.rev != r.rev || v == r || !has_record_name(&v.name) {
            continue;
        }
        let _own = fsutil::HeldLock::acquire(&record_lock(team, &v.name))?;
        let Some(now) = read_record_held(team, &v.name)? else {
            continue;
        };
        if now.rev == v.rev {
            let mut m = v.clone();
            m.rev = now.rev + 1;
            write_record(team, &m, modified(&record_path(team, &m.name)))?;
            records.insert(m.name.clone(), m);
            wrote = true;
        } else {
            records.insert(now.name.clone(), now);
        }
    }
    let now = assemble(view, records);
    let bytes = encode_view(&now)?;
    if fsutil::read_optional(&team.config())?.as_deref() != Some(bytes.as_slice()) {
        fsutil::atomic_write(&team.config(), &bytes)?;
        wrote = true;
    }
    Ok(wrote)
}

/// The writes of [`update`]: `after` against the roster `before` (assembled from the view and
/// `records`). Returns `after` as written (with the records' new revs), and whether anything
/// was written.
fn write_all(
    team: &TeamDir,
    records: &HashMap<String, Member>,
    before: &TeamConfig,
    mut after: TeamConfig,
) -> Result<(TeamConfig, bool)> {
    let mut wrote = false;
    fsutil::create_dir(&members_dir(team))?;
    for m in after.members.iter_mut() {
        if !has_record_name(&m.name) {
            // Kept in the view alone.
            continue;
        }
        let record = records.get(&m.name);
        if record == Some(m) {
            continue;
        }
        // New, changed by `f`, or a person's edit of the view not yet in its record.
        let rev = record
            .map(|r| r.rev)
            .max(before.member(&m.name).map(|b| b.rev))
            .unwrap_or(0);
        let unchanged = before.member(&m.name) == Some(m) && record.is_none();
        if unchanged {
            // Only in the view, untouched: it stays there until it changes.
            continue;
        }
        m.rev = rev + 1;
        // Readers hold it shared while they read; no other writer runs (config.lock).
        let _own = fsutil::HeldLock::acquire(&record_lock(team, &m.name))?;
        write_record(team, m, modified(&record_path(team, &m.name)))?;
        wrote = true;
    }
    let bytes = encode_view(&after)?;
    if fsutil::read_optional(&team.config())?.as_deref() != Some(bytes.as_slice()) {
        fsutil::atomic_write(&team.config(), &bytes)?;
        wrote = true;
    }
    for name in records.keys() {
        if after.member(name).is_none() {
            let path = record_path(team, name);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &path)(e)),
            }
            let _ = std::fs::remove_file(fsutil::spare_of(&path));
            let _ = std::fs::remove_file(record_lock(team, name));
        }
    }
    if records.keys().any(|n| after.member(n).is_none()) {
        fsutil::fsync_dir(&members_dir(team))?;
        wrote = true;
    }
    Ok((after, wrote))
}

/// What [`load_into`] last read: the view's bytes, and each record's time and size.
#[derive(Debug, Default)]
pub struct Seen {
    view: crate::doc::Seen,
    view_cfg: Option<TeamConfig>,
    records: HashMap<String, (RecordStamp, Member)>,
    read_once: bool,
    records_changed: bool,
    /// Whether a watch tells which records changed ([`Seen::note_changes`]).
    watched: bool,
    /// The records that may have changed since the last read; `None`: any of them.
    maybe_changed: Option<std::collections::HashSet<String>>,
}

impl Seen {
    /// From now on, the caller says which records changed (from inotify on `members/`): a
    /// read looks only at those, not at every member's.
    pub fn watched(&mut self) {
        self.watched = true;
    }

    /// Records that changed, as a watch saw them (`None`: it cannot tell, look at all).
    pub fn note_changes(&mut self, names: Option<std::collections::HashSet<String>>) {
        match (names, self.maybe_changed.as_mut()) {
            (Some(names), Some(set)) => set.extend(names),
            (Some(_), None) => {}
            (None, _) => self.maybe_changed = None,
        }
    }

    /// Whether a record changed since the last call.
    pub fn take_records_changed(&mut self) -> bool {
        std::mem::take(&mut self.records_changed)
    }

    /// A reader that holds `config.json` open (see [`crate::doc::Seen::holding`]).
    pub fn holding() -> Seen {
        Seen {
            view: crate::doc::Seen::holding(),
            ..Seen::default()
        }
    }
}

/// A record's inode, size and modification time: every write gives a later time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RecordStamp(u64, u64, i64, i64);

fn stamp(path: &Path) -> Option<RecordStamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(RecordStamp(m.ino(), m.size(), m.mtime(), m.mtime_nsec()))
}

/// Brings `cfg`, the roster as this `seen` last left it (empty the first time), up to date:
/// the members whose records changed are replaced in it, and it is assembled whole again only
/// when the view changed or a member left. Returns whether anything changed. A reader that
/// keeps its roster (the supervisor) pays for what changed, not for the team's size.
pub fn load_into(team: &TeamDir, seen: &mut Seen, cfg: &mut TeamConfig) -> Result<bool> {
    let doc = Doc::roster(team);
    let mut whole = !seen.read_once;
    if let Some(bytes) = doc.read_if_changed(&mut seen.view)? {
        let view = match bytes {
            None => None,
            Some(b) => Some(serde_json::from_slice(&b).map_err(|e| {
                // Read again next time: the person may fix it.
                seen.view = crate::doc::Seen::default();
                doc.corrupt(e)
            })?),
        };
        seen.view_cfg = view;
        whole = true;
    }
    let names: Vec<String> = match seen.maybe_changed.take() {
        Some(some) if seen.read_once => some.into_iter().filter(|n| has_record_name(n)).collect(),
        _ => {
            let names = record_names(team)?;
            if seen.records.len() != names.len()
                || names.iter().any(|n| !seen.records.contains_key(n))
            {
                seen.records.retain(|n, _| names.contains(n));
                seen.records_changed = true;
                whole = true;
            }
            names
        }
    };
    if seen.watched {
        seen.maybe_changed = Some(Default::default());
    }
    let mut changed_names = Vec::new();
    for name in names {
        let path = record_path(team, &name);
        let Some(st) = stamp(&path) else {
            if seen.records.remove(&name).is_some() {
                seen.records_changed = true;
                whole = true;
            }
            continue;
        };
        if seen.records.get(&name).is_some_and(|(s, _)| *s == st) {
            continue;
        }
        if let Some(m) = read_record(team, &name)? {
            seen.records.insert(name.clone(), (st, m));
            seen.records_changed = true;
            changed_names.push(name);
        }
    }
    seen.read_once = true;
    if whole {
        let records = seen
            .records
            .iter()
            .map(|(n, (_, m))| (n.clone(), m.clone()))
            .collect();
        *cfg = assemble(seen.view_cfg.clone(), records);
        return Ok(true);
    }
    for name in &changed_names {
        let view = seen.view_cfg.as_ref().and_then(|v| v.member(name));
        let record = seen.records.get(name).map(|(_, m)| m.clone());
        let Some(m) = merge(view, record) else {
            continue;
        };
        match cfg.members.iter_mut().find(|x| x.name == *name) {
            Some(slot) => *slot = m,
            // New since the last read: after the others, as [`assemble`] puts it.
            None => cfg.members.push(m),
        }
    }
    Ok(!changed_names.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MemberStatus;

    fn team() -> (tempfile::TempDir, TeamDir) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        (tmp, team)
    }

    /// The roster a reader keeping `cfg` sees if something changed, `None` if nothing did.
    fn look(team: &TeamDir, seen: &mut Seen, cfg: &mut TeamConfig) -> Result<Option<TeamConfig>> {
        Ok(load_into(team, seen, cfg)?.then(|| cfg.clone()))
    }

    fn set(team: &TeamDir, name: &str, f: impl Fn(&mut Member)) -> MemberWrite {
        update_member(team, name, false, &mut |c| {
            c.members.iter_mut().for_each(&f)
        })
        .unwrap()
    }

    fn add(team: &TeamDir, name: &str) {
        update(team, |c| {
            c.members.push(Member::new(name, "r"));
            Ok(())
        })
        .unwrap();
    }

    /// A team of `a` and `b`.
    fn two() -> (tempfile::TempDir, TeamDir) {
        let (t, team) = team();
        add(&team, "a");
        add(&team, "b");
        (t, team)
    }

    #[test]
    fn the_view_keeps_designs_shape_and_its_first_line_holds_the_team() {
        let (_t, team) = two();
        let text = std::fs::read_to_string(team.config()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["team_name"], "default");
        assert_eq!(v["members"][1]["name"], "b");
        assert_eq!(text.lines().count(), 4, "{text}");
        let fields = read_team_fields(&team).unwrap().unwrap();
        assert_eq!(fields.team_name, "default");
        assert!(fields.members.is_empty());
        // An empty team too.
        let empty = encode_view(&TeamConfig::default()).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&empty).unwrap();
        assert_eq!(v["members"], serde_json::json!([]));
    }

    #[test]
    fn one_members_change_writes_its_record_only_and_the_view_catches_up() {
        let (_t, team) = two();
        let view = std::fs::read(team.config()).unwrap();
        let b_record = std::fs::read(record_path(&team, "b")).unwrap();
        let w = set(&team, "a", |m| m.status = MemberStatus::Idle);
        assert!(matches!(w, MemberWrite::Written(ref m) if m.rev == 2));
        assert_eq!(std::fs::read(team.config()).unwrap(), view);
        assert_eq!(std::fs::read(record_path(&team, "b")).unwrap(), b_record);
        // Readers see it at once; the view after a refresh.
        assert_eq!(load(&team).unwrap().members[0].status, MemberStatus::Idle);
        assert_eq!(
            load_for(&team, "a").unwrap().members[0].status,
            MemberStatus::Idle
        );
        assert!(refresh_view(&team).unwrap());
        assert!(!refresh_view(&team).unwrap());
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(team.config()).unwrap()).unwrap();
        assert_eq!(v["members"][0]["status"], "idle");
        assert!(matches!(set(&team, "zed", |_| ()), MemberWrite::Missing));
    }

    #[test]
    fn a_persons_edit_of_the_view_wins_and_a_stale_entry_does_not() {
        let (_t, team) = team();
        add(&team, "a");
        // Edited by hand at the record's rev: it wins, and lands in the record.
        let text = std::fs::read_to_string(team.config()).unwrap();
        std::fs::write(
            team.config(),
            text.replace("\"role\":\"r\"", "\"role\":\"edited\""),
        )
        .unwrap();
        assert_eq!(load(&team).unwrap().members[0].role, "edited");
        refresh_view(&team).unwrap();
        assert_eq!(read_record(&team, "a").unwrap().unwrap().role, "edited");
        // A view entry behind its record is only behind.
        set(&team, "a", |m| m.restarts = 5);
        assert_eq!(load(&team).unwrap().members[0].restarts, 5);
    }

    #[test]
    fn a_member_added_by_hand_gets_its_record_at_its_first_change_and_leaves_whole() {
        let (_t, team) = team();
        std::fs::write(
            team.config(),
            r#"{"members":[{"name":"a","role":"r","status":"idle"}]}"#,
        )
        .unwrap();
        assert_eq!(load(&team).unwrap().members.len(), 1);
        set(&team, "a", |m| m.restarts = 1);
        assert_eq!(read_record(&team, "a").unwrap().unwrap().restarts, 1);
        update(&team, |c| {
            c.members.clear();
            Ok(())
        })
        .unwrap();
        assert!(load(&team).unwrap().members.is_empty());
        assert!(!record_path(&team, "a").exists());
    }

    #[test]
    fn a_watcher_reads_only_what_changed() {
        let (_t, team) = team();
        add(&team, "a");
        let mut seen = Seen::default();
        let mut kept = TeamConfig::default();
        assert!(look(&team, &mut seen, &mut kept).unwrap().is_some());
        assert!(look(&team, &mut seen, &mut kept).unwrap().is_none());
        // Two writes within one clock tick are still two changes.
        for n in 1..4 {
            set(&team, "a", |m| m.restarts = n);
            let now = look(&team, &mut seen, &mut kept).unwrap().unwrap();
            assert_eq!(now.members[0].restarts, n);
        }
        assert!(look(&team, &mut seen, &mut kept).unwrap().is_none());
        add(&team, "b");
        assert_eq!(
            look(&team, &mut seen, &mut kept)
                .unwrap()
                .unwrap()
                .members
                .len(),
            2
        );
    }

    #[test]
    fn a_watched_reader_reads_the_records_it_is_told_of() {
        let (_t, team) = two();
        let mut seen = Seen::default();
        let mut kept = TeamConfig::default();
        seen.watched();
        assert_eq!(
            look(&team, &mut seen, &mut kept)
                .unwrap()
                .unwrap()
                .members
                .len(),
            2
        );
        set(&team, "a", |m| m.restarts = 1);
        set(&team, "b", |m| m.restarts = 2);
        // Told of a's change only: b's is read once a watch tells of it, or cannot tell.
        seen.note_changes(Some(["a".to_owned()].into()));
        let now = look(&team, &mut seen, &mut kept).unwrap().unwrap();
        assert_eq!((now.members[0].restarts, now.members[1].restarts), (1, 0));
        assert!(look(&team, &mut seen, &mut kept).unwrap().is_none());
        seen.note_changes(None);
        let now = look(&team, &mut seen, &mut kept).unwrap().unwrap();
        assert_eq!(now.members[1].restarts, 2);
        // A member that left is noticed by its name.
        update(&team, |c| {
            c.members.retain(|m| m.name != "a");
            Ok(())
        })
        .unwrap();
        seen.note_changes(Some(["a".to_owned()].into()));
        let now = look(&team, &mut seen, &mut kept).unwrap().unwrap();
        assert_eq!(now.members.len(), 1);
    }

    #[test]
    fn an_unparsable_view_stops_team_writes_but_not_a_members() {
        let (_t, team) = team();
        add(&team, "a");
        set(&team, "a", |m| m.restarts = 1);
        std::fs::write(team.config(), "{\"members\": [").unwrap();
        assert!(update(&team, |_| Ok(())).is_err());
        assert!(refresh_view(&team).is_err());
        set(&team, "a", |m| m.restarts = 2);
        assert_eq!(
            std::fs::read_to_string(team.config()).unwrap(),
            "{\"members\": ["
        );
        assert_eq!(read_record(&team, "a").unwrap().unwrap().restarts, 2);
    }
}
