//! The merge queue: worktree members' commits waiting to be integrated into the team's target
//! branch, one record per entry (`merge/ID.json`, or `merge:ID` on a bus), changed under the
//! entry's lock as tasks are (see [`crate::records`]).
//!
//! An entry is made when a worktree member's task completion has passed its `task_completed`
//! hooks (its id derived from the task and the completion, so a supervisor that dies between
//! making it and noting it makes the same one again), or by `lead merge NAME` (derived from the
//! member and the commit). The supervisor's merge thread (`lead/supervisor/merge.rs`) takes the
//! entries in order, one at a time, and moves each
//! `queued -> checking -> landed | sent_back`, or to `waiting` while the target is checked out
//! in the person's tree with changes of its own, or `stopped` when a check could not give a
//! verdict (a timeout, a signal, a spawn error): the queue waits behind a stopped entry until
//! `lead merge --retry`. `lead merge --cancel` takes an entry out. What a land may write is
//! decided in [`contain`].

pub mod contain;
pub mod git;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::events;
use crate::fsutil;
use crate::records::Records;
use crate::teamdir::TeamDir;

/// The target branch of a team that names none.
pub const DEFAULT_TARGET: &str = "troupe/integration";

/// Whether `name` may be a target branch: what `git check-ref-format --branch` takes, less
/// what would be an option or a path trick. The reason when not.
pub fn check_branch_name(name: &str) -> std::result::Result<(), String> {
    let bad = name.is_empty()
        || name.len() > 200
        || name.starts_with(['-', '/', '.'])
        || name.ends_with(['/', '.'])
        || name.ends_with(".lock")
        || name.contains("..")
        || name.contains("//")
        || name.contains("@{")
        || name.contains("/.")
        || name
            .chars()
            .any(|c| c.is_ascii_control() || " ~^:?*[\\".contains(c));
    if bad {
        return Err(format!("{name:?} is not a branch name git takes"));
    }
    Ok(())
}

/// Where an entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MergeState {
    /// Waiting for its turn.
    Queued,
    /// Merged in the integration tree; its checks run (or ran, and the land is under way).
    Checking,
    /// Checked and ready, but the target is checked out in a tree with changes of its own.
    Waiting,
    Landed,
    /// A conflict, a failed check or nothing to integrate: back to its author.
    SentBack,
    /// A check gave no verdict (timed out, killed, could not start): the queue waits behind it.
    Stopped,
    Cancelled,
}

impl MergeState {
    pub fn as_str(self) -> &'static str {
        match self {
            MergeState::Queued => "queued",
            MergeState::Checking => "checking",
            MergeState::Waiting => "waiting",
            MergeState::Landed => "landed",
            MergeState::SentBack => "sent_back",
            MergeState::Stopped => "stopped",
            MergeState::Cancelled => "cancelled",
        }
    }

    /// Whether the queue still has to do something with it (or waits behind it).
    pub fn is_open(self) -> bool {
        matches!(
            self,
            MergeState::Queued | MergeState::Checking | MergeState::Waiting | MergeState::Stopped
        )
    }
}

impl std::fmt::Display for MergeState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

/// One entry of the queue.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MergeEntry {
    pub id: String,
    /// The member whose branch it comes from.
    pub member: String,
    /// Its branch (`troupe/NAME`).
    pub branch: String,
    /// The commit to integrate: the branch's tip when the entry was made.
    pub commit: String,
    /// The task whose completion queued it, and which completion (none: `lead merge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion: Option<u64>,
    /// On a bus, the host whose repository holds the branch (branches are host-local).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    pub state: MergeState,
    pub queued_at: f64,
    pub updated_at: f64,
    /// The target branch it was checked against, the target's tip it was merged onto, and the
    /// merge commit that would land (recorded before the checks run: what lands is that commit,
    /// whatever the checks write).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<String>,
    /// The target's tip once it landed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub landed: Option<String>,
    /// Why it was sent back, stopped or waits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report: Option<String>,
    /// How many times its checks started.
    #[serde(default)]
    pub attempts: u32,
    /// Fields written by other versions, kept as they were.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// What a new entry is.
#[derive(Debug, Clone)]
pub struct NewEntry {
    pub member: String,
    pub branch: String,
    pub commit: String,
    /// `(task id, completion)` for a task's completion.
    pub task: Option<(String, u64)>,
    pub host: Option<String>,
}

impl NewEntry {
    /// The entry's id: derived from the task and its completion, or from the member and the
    /// commit for a hand-queued one, so that making it twice makes it once.
    pub fn id(&self) -> String {
        let key = match &self.task {
            Some((task, completion)) => format!("merge:task:{task}:{completion}"),
            None => format!("merge:hand:{}:{}", self.member, self.commit),
        };
        entry_id(&key)
    }
}

/// The 8-hex id of the entry keyed `key`.
fn entry_id(key: &str) -> String {
    crate::ids::derived(key).simple().to_string()[..8].to_owned()
}

/// The id the entry for completion `completion` of task `task` has (or would have).
pub fn task_entry_id(task: &str, completion: u64) -> String {
    entry_id(&format!("merge:task:{task}:{completion}"))
}

/// The entries the queue takes next, in order: the open ones (`queued`, `checking`, `waiting`,
/// `stopped`) by the time they were queued (then by id). The head is the one being worked on;
/// a stopped head holds the rest.
pub fn open_in_order(mut all: Vec<MergeEntry>) -> Vec<MergeEntry> {
    all.retain(|e| e.state.is_open());
    all.sort_by(|a, b| {
        a.queued_at
            .total_cmp(&b.queued_at)
            .then_with(|| a.id.cmp(&b.id))
    });
    all
}

/// Each member's latest entry (for `lead status` and `lead top`): the open one if it has one,
/// else the last updated.
pub fn latest_by_member(all: &[MergeEntry]) -> std::collections::BTreeMap<String, MergeEntry> {
    let mut out: std::collections::BTreeMap<String, MergeEntry> = Default::default();
    for e in all {
        let better = match out.get(&e.member) {
            None => true,
            Some(cur) => (e.state.is_open(), e.updated_at) > (cur.state.is_open(), cur.updated_at),
        };
        if better {
            out.insert(e.member.clone(), e.clone());
        }
    }
    out
}

/// How an entry's state reads in one short phrase (`landed at 1a2b3c4`).
pub fn describe(e: &MergeEntry) -> String {
    match (e.state, &e.landed) {
        (MergeState::Landed, Some(sha)) => format!("landed at {}", short(sha)),
        (MergeState::Waiting, _) => "waiting for a clean tree".to_owned(),
        (s, _) => s.as_str().replace('_', " "),
    }
}

/// The first 7 characters of a commit id, cut at a character (an entry edited by hand or torn
/// may hold anything: review 4, R4-13, found `lead merge --list`, `lead status --json` and `lead
/// top` panicking on a non-ASCII id cut inside a character).
pub fn short(sha: &str) -> &str {
    let end = sha.char_indices().nth(7).map_or(sha.len(), |(i, _)| i);
    &sha[..end]
}

/// The team's merge queue.
pub struct MergeStore {
    team: TeamDir,
}

impl MergeStore {
    pub fn new(team: &TeamDir) -> MergeStore {
        MergeStore { team: team.clone() }
    }

    /// Queues `new` unless an entry of the same key is there: the entry, and whether it is new
    /// (a `merge_queued` event then).
    pub fn enqueue(&self, new: &NewEntry) -> Result<(MergeEntry, bool)> {
        let id = new.id();
        self.records().reserve_keyed(&id)?;
        let mut made = false;
        let entry = self.records().locked(&id, |cur: Option<MergeEntry>| {
            if cur.is_some() {
                return Ok(None);
            }
            made = true;
            let now = fsutil::now();
            Ok(Some(MergeEntry {
                id: id.clone(),
                member: new.member.clone(),
                branch: new.branch.clone(),
                commit: new.commit.clone(),
                task: new.task.as_ref().map(|t| t.0.clone()),
                completion: new.task.as_ref().map(|t| t.1),
                host: new.host.clone(),
                state: MergeState::Queued,
                queued_at: now,
                updated_at: now,
                target: None,
                base: None,
                candidate: None,
                landed: None,
                report: None,
                attempts: 0,
                extra: Map::new(),
            }))
        })?;
        if made {
            self.log("merge_queued", &entry, json!({}));
        }
        Ok((entry, made))
    }

    /// Entry `id`.
    pub fn get(&self, id: &str) -> Result<MergeEntry> {
        self.records().get(id)
    }

    /// Entry `id`, or `None` if there is none.
    pub fn find(&self, id: &str) -> Result<Option<MergeEntry>> {
        self.records().read(id)
    }

    /// Every entry, in no order.
    pub fn list(&self) -> Result<Vec<MergeEntry>> {
        self.records().list()
    }

    /// Every entry, reading only those that changed since the listing `cache` was last given
    /// to (for a poller such as `lead top`; see [`crate::store::Listing`]).
    pub fn list_cached(
        &self,
        cache: &mut crate::store::Listing<MergeEntry>,
    ) -> Result<Vec<MergeEntry>> {
        self.records().list_cached(cache)
    }

    /// Changes entry `id` under its lock: `f` gets it and says whether it changed it; the
    /// entry as it stands after.
    pub fn update(&self, id: &str, f: impl FnOnce(&mut MergeEntry) -> bool) -> Result<MergeEntry> {
        self.records().locked(id, |cur: Option<MergeEntry>| {
            let mut e = cur.ok_or_else(|| Error::UnknownMerge(id.to_owned()))?;
            if !f(&mut e) {
                return Ok(None);
            }
            e.updated_at = fsutil::now();
            Ok(Some(e))
        })
    }

    /// Moves entry `id` to `state` with `report` if it is still in `from` (one of them): the
    /// entry as it is after, and whether this call moved it.
    pub fn set_state(
        &self,
        id: &str,
        from: &[MergeState],
        state: MergeState,
        report: Option<String>,
    ) -> Result<(MergeEntry, bool)> {
        let mut moved = false;
        let e = self.update(id, |e| {
            if !from.contains(&e.state) {
                return false;
            }
            e.state = state;
            e.report = report;
            moved = true;
            true
        })?;
        Ok((e, moved))
    }

    /// Records that entry `id` was merged onto `base` of `target` as `candidate` and that its
    /// checks start (`checking`), unless it was cancelled meanwhile: the entry after, and
    /// whether this call moved it.
    pub fn update_checking(
        &self,
        id: &str,
        target: &str,
        base: &str,
        candidate: &str,
    ) -> Result<(MergeEntry, bool)> {
        let mut moved = false;
        let e = self.update(id, |e| {
            if !matches!(
                e.state,
                MergeState::Queued | MergeState::Checking | MergeState::Waiting
            ) {
                return false;
            }
            e.state = MergeState::Checking;
            e.target = Some(target.to_owned());
            e.base = Some(base.to_owned());
            e.candidate = Some(candidate.to_owned());
            e.report = None;
            e.attempts += 1;
            moved = true;
            true
        })?;
        Ok((e, moved))
    }

    /// `lead merge --cancel`: an open entry is cancelled (one being checked right now is
    /// cancelled once its check ends: it does not land).
    pub fn cancel(&self, id: &str) -> Result<MergeEntry> {
        let (e, moved) = self.set_state(
            id,
            &[
                MergeState::Queued,
                MergeState::Checking,
                MergeState::Waiting,
                MergeState::Stopped,
            ],
            MergeState::Cancelled,
            Some("cancelled by hand".to_owned()),
        )?;
        if !moved {
            return Err(Error::MergeRefused {
                id: id.to_owned(),
                why: format!("it is {}; only an open entry can be cancelled", e.state),
            });
        }
        self.log("merge_cancelled", &e, json!({}));
        Ok(e)
    }

    /// `lead merge --retry`: a stopped, sent-back or cancelled entry is queued again, at its
    /// old place.
    pub fn retry(&self, id: &str) -> Result<MergeEntry> {
        let (e, moved) = self.set_state(
            id,
            &[
                MergeState::Stopped,
                MergeState::SentBack,
                MergeState::Cancelled,
            ],
            MergeState::Queued,
            None,
        )?;
        if !moved {
            return Err(Error::MergeRefused {
                id: id.to_owned(),
                why: format!(
                    "it is {}; only a stopped, sent back or cancelled entry can be retried",
                    e.state
                ),
            });
        }
        self.log("merge_queued", &e, json!({"retry": true}));
        Ok(e)
    }

    /// Logs `event` about entry `e` with `more` fields.
    pub fn log(&self, event: &str, e: &MergeEntry, more: Value) {
        let mut fields = json!({
            "id": e.id, "member": e.member, "branch": e.branch, "commit": e.commit,
            "task": e.task, "state": e.state,
        });
        if let (Value::Object(f), Value::Object(m)) = (&mut fields, more) {
            f.extend(m);
        }
        events::log(&self.team, event, fields);
    }

    fn records(&self) -> Records<'_> {
        Records {
            team: &self.team,
            dir: TeamDir::merge_dir,
            file: TeamDir::merge_entry,
            lock: TeamDir::merge_lock,
            unknown: Error::UnknownMerge,
            noun: "merge",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_id_is_cut_at_a_character_whatever_the_entry_holds() {
        assert_eq!(short("0123456789abcdef"), "0123456");
        assert_eq!(short("ééééééééé"), "ééééééé");
        assert_eq!(short("abc"), "abc");
        assert_eq!(short(""), "");
    }

    proptest::proptest! {
        #[test]
        fn short_never_panics(v in proptest::collection::vec(proptest::char::any(), 0..20)) {
            let s: String = v.into_iter().collect();
            let cut = short(&s);
            proptest::prop_assert!(s.starts_with(cut));
            proptest::prop_assert!(cut.chars().count() <= 7);
        }
    }

    fn entry(id: &str, member: &str, state: MergeState, at: f64) -> MergeEntry {
        MergeEntry {
            id: id.to_owned(),
            member: member.to_owned(),
            branch: format!("troupe/{member}"),
            commit: "c".repeat(40),
            task: None,
            completion: None,
            host: None,
            state,
            queued_at: at,
            updated_at: at,
            target: None,
            base: None,
            candidate: None,
            landed: None,
            report: None,
            attempts: 0,
            extra: Map::new(),
        }
    }

    #[test]
    fn the_queue_is_the_open_entries_oldest_first() {
        let all = vec![
            entry("0000000c", "c", MergeState::Queued, 3.0),
            entry("0000000a", "a", MergeState::Landed, 1.0),
            entry("0000000b", "b", MergeState::Stopped, 2.0),
            entry("0000000d", "d", MergeState::Queued, 2.0),
        ];
        let ids: Vec<String> = open_in_order(all).into_iter().map(|e| e.id).collect();
        assert_eq!(ids, ["0000000b", "0000000d", "0000000c"]);
    }

    #[test]
    fn a_member_shows_its_open_entry_before_a_newer_closed_one() {
        let mut landed = entry("00000002", "a", MergeState::Landed, 5.0);
        landed.landed = Some("1234567890".to_owned());
        let all = vec![
            entry("00000001", "a", MergeState::Queued, 1.0),
            landed.clone(),
        ];
        assert_eq!(latest_by_member(&all)["a"].id, "00000001");
        assert_eq!(describe(&landed), "landed at 1234567");
        let all = vec![entry("00000003", "a", MergeState::SentBack, 1.0), landed];
        assert_eq!(latest_by_member(&all)["a"].id, "00000002");
    }

    #[test]
    fn branch_names_are_checked() {
        for ok in ["main", "troupe/integration", "release-1.2"] {
            assert!(check_branch_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "-x", "a..b", "a b", "a/", ".a", "a.lock", "a~1", "a:b", "a@{1}",
        ] {
            assert!(check_branch_name(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ids_are_keyed_by_task_and_completion_or_by_member_and_commit() {
        let t = |c| NewEntry {
            member: "a".into(),
            branch: "troupe/a".into(),
            commit: "x".into(),
            task: Some(("12345678".into(), c)),
            host: None,
        };
        assert_eq!(t(1).id(), t(1).id());
        assert_ne!(t(1).id(), t(2).id());
        assert_eq!(t(1).id(), task_entry_id("12345678", 1));
        let hand = NewEntry { task: None, ..t(1) };
        assert_ne!(hand.id(), t(1).id());
        assert!(crate::teamdir::check_merge_id(&hand.id()).is_ok());
    }
}
