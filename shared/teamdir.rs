//! The team directory: its layout, its names, and every path inside it.
//!
//! [`TeamDir`] is the only place that joins paths inside the team dir. Paths to per-agent files
//! take an [`AgentName`], which can only be built from a validated name, so a name such as
//! `../x` can never reach the file system.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fsutil;

/// The reserved name of the lead agent.
pub const LEAD: &str = "lead";

/// Longest allowed name, in bytes.
pub const MAX_NAME_LEN: usize = 32;

/// A validated agent name: `lead`, or a teammate name matching `^[a-z][a-z0-9_-]{0,31}$`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct AgentName(String);

impl AgentName {
    /// Validates a teammate name; `lead` is refused because it is reserved for the lead.
    pub fn teammate(name: &str) -> Result<AgentName> {
        check_syntax(name)?;
        if name == LEAD {
            return Err(Error::InvalidName {
                name: name.to_owned(),
                why: "\"lead\" is reserved for the lead agent",
            });
        }
        Ok(AgentName(name.to_owned()))
    }

    /// Validates any agent name, the lead's included.
    pub fn any(name: &str) -> Result<AgentName> {
        check_syntax(name)?;
        Ok(AgentName(name.to_owned()))
    }

    /// The lead's name.
    pub fn lead() -> AgentName {
        AgentName(LEAD.to_owned())
    }

    /// Whether this is the lead.
    pub fn is_lead(&self) -> bool {
        self.0 == LEAD
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for AgentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(&self.0)
    }
}

impl TryFrom<String> for AgentName {
    type Error = Error;
    fn try_from(s: String) -> Result<AgentName> {
        AgentName::any(&s)
    }
}

impl From<AgentName> for String {
    fn from(n: AgentName) -> String {
        n.0
    }
}

impl PartialEq<str> for AgentName {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for AgentName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

fn check_syntax(name: &str) -> Result<()> {
    let bad = |why| {
        Err(Error::InvalidName {
            name: name.to_owned(),
            why,
        })
    };
    let mut chars = name.chars();
    match chars.next() {
        None => return bad("a name may not be empty"),
        Some(c) if !c.is_ascii_lowercase() => {
            return bad("a name must start with a lower-case letter a-z");
        }
        Some(_) => {}
    }
    if name.len() > MAX_NAME_LEN {
        return bad("a name may be at most 32 characters");
    }
    if !chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '-') {
        return bad("a name may contain only a-z, 0-9, '_' and '-'");
    }
    Ok(())
}

/// Whether `id` is exactly 8 lower-case hex characters: the shape of request and task ids, and
/// so never a path trick (`..`, `/`, an absolute path).
fn is_hex8(id: &str) -> bool {
    id.len() == 8
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Validates a merge queue entry's id: exactly 8 lower-case hex characters, as task ids.
pub fn check_merge_id(id: &str) -> Result<()> {
    if is_hex8(id) {
        Ok(())
    } else {
        Err(Error::UnknownMerge(format!(
            "{id:?} (an entry id is 8 lower-case hex characters)"
        )))
    }
}

/// Validates a task id: exactly 8 lower-case hex characters, as request ids.
pub fn check_task_id(id: &str) -> Result<()> {
    if is_hex8(id) {
        Ok(())
    } else {
        Err(Error::UnknownTask(format!(
            "{id:?} (a task id is 8 lower-case hex characters)"
        )))
    }
}

/// Validates a request id: exactly 8 lower-case hex characters.
pub fn check_request_id(id: &str) -> Result<()> {
    if is_hex8(id) {
        Ok(())
    } else {
        Err(Error::UnknownRequest(format!(
            "{id:?} (a request id is 8 lower-case hex characters)"
        )))
    }
}

/// A team directory (default `./.team`): the paths of its files. Where the team's shared state
/// lives (these files, or a Redis bus named by `TROUPE_BUS` when the `TeamDir` is made) is the
/// store's business ([`crate::store`]), which also opens it (`TeamDir::create`, `open`); this
/// module knows paths only.
#[derive(Debug, Clone)]
pub struct TeamDir {
    pub(crate) root: PathBuf,
    /// The store's remote backend, when the state is not in these files (set and read by
    /// [`crate::store`] only).
    pub(crate) remote: Option<std::sync::Arc<dyn std::any::Any + Send + Sync>>,
}

impl TeamDir {
    /// The team dir at `root`, made absolute against the current directory once, here: every
    /// path derived from it is handed to workers and hooks that start in other directories.
    /// Refuses a `root` that exists and is not a directory.
    pub(crate) fn at_path(root: impl Into<PathBuf>) -> Result<TeamDir> {
        let root = root.into();
        let root = std::path::absolute(&root).map_err(Error::io("resolve", &root))?;
        match std::fs::metadata(&root) {
            Ok(m) if !m.is_dir() => return Err(Error::NotADirectory(root)),
            _ => {}
        }
        Ok(TeamDir { root, remote: None })
    }

    /// Creates the layout (0700 directories) where missing.
    pub(crate) fn make_layout(&self) -> Result<()> {
        for sub in [
            self.root.clone(),
            self.inbox_dir(),
            self.requests_dir(),
            self.tasks_dir(),
            self.transcripts_dir(),
            self.logs_dir(),
        ] {
            fsutil::create_dir(&sub)?;
            fsutil::make_private(&sub)?;
        }
        Ok(())
    }

    /// The team dir itself.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// `config.json`.
    pub fn config(&self) -> PathBuf {
        self.root.join("config.json")
    }
    /// `config.lock`, the sidecar lock serializing roster updates.
    pub fn config_lock(&self) -> PathBuf {
        self.root.join("config.lock")
    }
    /// `lead.lock`, held by the one supervisor of this team dir.
    pub fn lead_lock(&self) -> PathBuf {
        self.root.join("lead.lock")
    }
    /// `events.jsonl`.
    pub fn events(&self) -> PathBuf {
        self.root.join("events.jsonl")
    }
    /// `events.lock`.
    pub fn events_lock(&self) -> PathBuf {
        self.root.join("events.lock")
    }
    /// `inbox/`.
    pub fn inbox_dir(&self) -> PathBuf {
        self.root.join("inbox")
    }
    /// `inbox/NAME.jsonl`.
    pub fn inbox(&self, name: &AgentName) -> PathBuf {
        self.inbox_dir().join(format!("{name}.jsonl"))
    }
    /// `inbox/NAME.lock`, the lock writers and the drainer share.
    pub fn inbox_lock(&self, name: &AgentName) -> PathBuf {
        self.inbox_dir().join(format!("{name}.lock"))
    }
    /// `inbox/NAME.offset`: how far the inbox file has been consumed (see [`crate::inbox`]).
    pub fn inbox_offset(&self, name: &AgentName) -> PathBuf {
        self.inbox_dir().join(format!("{name}.offset"))
    }
    /// `inbox/NAME.drain.lock`, which drainers of that inbox take one at a time.
    pub fn inbox_drain_lock(&self, name: &AgentName) -> PathBuf {
        self.inbox_dir().join(format!("{name}.drain.lock"))
    }
    /// `inbox/NAME.corrupt.jsonl`, where unparsable lines are set aside.
    pub fn inbox_corrupt(&self, name: &AgentName) -> PathBuf {
        self.inbox_dir().join(format!("{name}.corrupt.jsonl"))
    }
    /// `requests/`.
    pub fn requests_dir(&self) -> PathBuf {
        self.root.join("requests")
    }
    /// `requests/ID.json`. The id must be 8 lower-case hex characters.
    pub fn request(&self, id: &str) -> Result<PathBuf> {
        check_request_id(id)?;
        Ok(self.requests_dir().join(format!("{id}.json")))
    }
    /// `requests/ID.lock`.
    pub fn request_lock(&self, id: &str) -> Result<PathBuf> {
        check_request_id(id)?;
        Ok(self.requests_dir().join(format!("{id}.lock")))
    }
    /// `tasks/`.
    pub fn tasks_dir(&self) -> PathBuf {
        self.root.join("tasks")
    }
    /// `tasks/ID.json`. The id must be 8 lower-case hex characters.
    pub fn task(&self, id: &str) -> Result<PathBuf> {
        check_task_id(id)?;
        Ok(self.tasks_dir().join(format!("{id}.json")))
    }
    /// `tasks/ID.lock`.
    pub fn task_lock(&self, id: &str) -> Result<PathBuf> {
        check_task_id(id)?;
        Ok(self.tasks_dir().join(format!("{id}.lock")))
    }
    /// `merge/`: the merge queue's entries (see [`crate::merge`]).
    pub fn merge_dir(&self) -> PathBuf {
        self.root.join("merge")
    }
    /// `merge/ID.json`. The id must be 8 lower-case hex characters.
    pub fn merge_entry(&self, id: &str) -> Result<PathBuf> {
        check_merge_id(id)?;
        Ok(self.merge_dir().join(format!("{id}.json")))
    }
    /// `merge/ID.lock`.
    pub fn merge_lock(&self, id: &str) -> Result<PathBuf> {
        check_merge_id(id)?;
        Ok(self.merge_dir().join(format!("{id}.lock")))
    }
    /// `tasks/keys.lock`, held while a task with a key (from a team file) is looked up and
    /// created, so a key is on the board once.
    pub fn task_keys_lock(&self) -> PathBuf {
        self.tasks_dir().join("keys.lock")
    }
    /// `up.lock`, held by `lead up` while it applies a team file (two at once take turns).
    pub fn up_lock(&self) -> PathBuf {
        self.root.join("up.lock")
    }
    /// `transcripts/`.
    pub fn transcripts_dir(&self) -> PathBuf {
        self.root.join("transcripts")
    }
    /// `transcripts/NAME.jsonl`.
    pub fn transcript(&self, name: &AgentName) -> PathBuf {
        self.transcripts_dir().join(format!("{name}.jsonl"))
    }
    /// `transcripts/NAME.lock`: held exclusively by the live process that owns the transcript
    /// (the worker, for its whole life). The lead reads liveness from it.
    pub fn transcript_lock(&self, name: &AgentName) -> PathBuf {
        self.transcripts_dir().join(format!("{name}.lock"))
    }
    /// `logs/`.
    pub fn logs_dir(&self) -> PathBuf {
        self.root.join("logs")
    }
    /// `logs/NAME.log`.
    pub fn log(&self, name: &AgentName) -> PathBuf {
        self.logs_dir().join(format!("{name}.log"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_existing_team_dir_is_made_private() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("team");
        std::fs::create_dir_all(root.join("inbox")).unwrap();
        for d in [root.clone(), root.join("inbox")] {
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let team = TeamDir::create(&root).unwrap();
        for d in [team.root().to_path_buf(), team.inbox_dir()] {
            let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{}", d.display());
        }
    }

    fn why(name: &str) -> String {
        AgentName::teammate(name).unwrap_err().to_string()
    }

    #[test]
    fn names() {
        assert!(AgentName::teammate("alice").is_ok());
        assert!(AgentName::teammate("a1_b-c").is_ok());
        assert!(AgentName::teammate(&"a".repeat(32)).is_ok());
        assert_eq!(
            why("../x"),
            "invalid name \"../x\": a name must start with a lower-case letter a-z"
        );
        assert_eq!(
            why("Lead"),
            "invalid name \"Lead\": a name must start with a lower-case letter a-z"
        );
        assert_eq!(why(""), "invalid name \"\": a name may not be empty");
        assert_eq!(
            why(&"a".repeat(33)),
            format!(
                "invalid name \"{}\": a name may be at most 32 characters",
                "a".repeat(33)
            )
        );
        assert_eq!(
            why("lead"),
            "invalid name \"lead\": \"lead\" is reserved for the lead agent"
        );
        assert_eq!(
            why("a/b"),
            "invalid name \"a/b\": a name may contain only a-z, 0-9, '_' and '-'"
        );
        assert!(AgentName::any("lead").is_ok());
    }

    #[test]
    fn request_ids() {
        assert!(check_request_id("a1b2c3d4").is_ok());
        for bad in ["", "A1B2C3D4", "a1b2c3d", "../../x1", "a1b2c3d4e"] {
            assert!(check_request_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn task_ids() {
        assert!(check_task_id("a1b2c3d4").is_ok());
        for bad in [
            "",
            "A1B2C3D4",
            "a1b2c3d",
            "../../x1",
            "/etc/pas",
            "a1b2c3d4e",
        ] {
            assert!(check_task_id(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn team_dir_on_a_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("file");
        std::fs::write(&f, "x").unwrap();
        let e = TeamDir::create(&f).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("team dir {} is not a directory", f.display())
        );
    }
}
