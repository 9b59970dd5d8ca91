//! Cassettes: recorded model responses, played back without network, and the recorder that
//! writes them.
//!
//! A cassette is a JSONL file with one line per recorded call:
//! `{"agent": "...", "seq": N, "turn": T, "response": <ChatResponse>}`. Responses are keyed by
//! the calling agent and its call number ([`ChatRequest::seq`]), not by request content, so a
//! replayed run gets the same answers even when file contents or timestamps in its prompts differ.
//!
//! Several worker processes may record into one file. Each line is appended with one
//! `write_all` on an `O_APPEND` descriptor while holding an exclusive flock on the file itself,
//! so lines never interleave. A writer killed mid-write can leave an unterminated last line; the
//! next writer (holding the lock) cuts it off before appending, and readers ignore such a line.
//!
//! # Turns: replaying several processes in their recorded order
//!
//! Keying by `(agent, seq)` alone makes a multi-agent replay depend on timing: whether a message
//! reached an agent's inbox before or after its call decides what the agent does next, and an
//! agent that took another path asks for answers recorded for a different situation. So the
//! recorder also writes `turn`, the entry's place in the global order of calls across all agents:
//! the number of complete lines the cassette already held when the line was appended (counted
//! under the flock, after the tail repair). `turn` is optional; cassettes without it, or with it
//! on some lines only, still load.
//!
//! Ordered replay is switched on with [`ReplayProvider::with_progress`] (`TROUPE_REPLAY_PROGRESS`):
//! every process of the run names the same *progress file*, fresh (missing or empty) for the run.
//! When the entry answering a call has `turn = Some(t)`, the call first waits until every turn
//! `< t` that the cassette holds has been served, by this or any other process, then appends the
//! line `t\n` to the progress file (one `write_all` on an `O_APPEND` descriptor, so no lock is
//! needed; readers ignore an unterminated last line) and only then returns the response. Waiting
//! re-reads the file, sleeping 1 ms, doubling up to 20 ms, and gives up after the wait limit
//! ([`ReplayProvider::with_wait_limit`], `TROUPE_REPLAY_WAIT_SECS`, default 60 s) with
//! [`LlmError::ReplayOutOfOrder`] naming the call that waited and the turn it waited for. A turn
//! served twice (a restarted worker redoing a call) is answered at once and not appended again.
//! Entries without a turn, and every entry when no progress file is set, are answered at once.
//!
//! # Any agent
//!
//! An entry of agent `*` answers call `seq` of every agent that has no entry of its own for it:
//! one cassette, of constant size, for a team of any size (`troupe-bench` plays its teams of
//! hundreds with two such lines, so that no worker parses a line per member at start).
//!
//! # The `{{request_id}}` placeholder
//!
//! Protocol request ids (8 lowercase hex characters) are random, so the id a recorded tool call
//! names (`plan_approval{request_id: "ab12cd34"}`) does not exist in the replay. The *newest
//! request id* of a request is the last match, scanning [`ChatRequest::messages`] in order (text
//! blocks and tool result contents), of `request_id=` followed by exactly 8 lowercase hex
//! characters (and then no letter, digit or `_`). The recorder stores every string inside a
//! `tool_use` input that equals the newest request id of its request as `{{request_id}}` (the
//! live response keeps the real id); the replay provider replaces `{{request_id}}` in every string
//! inside a `tool_use` input by the newest request id of the replayed request, and leaves the
//! string alone when the request shows none.
//!
//! # The `{{task_id}}` placeholder
//!
//! Task ids (8 lowercase hex characters, [`crate::tasks`]) are random too, so a recorded
//! `task_update{task_id: "0a1b2c3d"}` names a task the replay does not have. The *newest task id*
//! of a request is the last match, scanning the same blocks in the same order, of 8 lowercase hex
//! characters (followed by no letter, digit or `_`) right after one of the ways the board shows a
//! task to a model: `task ` as a word (`You claimed task 0a1b2c3d`, `The task_completed hook
//! sent task 0a1b2c3d back`), `task_id ` (`call task_update with task_id 0a1b2c3d`), or a task
//! tool's JSON `"task_id": "` (with or without the space). Blockers named after a claimed task
//! (`You claimed task 0a1b2c3d (after 11111111, 22222222, ...)`) do not match, and the claim
//! message ends with `task_id 0a1b2c3d`, so the claimed task stays the newest. The recorder stores
//! tool call input strings equal to it as `{{task_id}}` (after the request id, which wins if the
//! two are the same string) and the replay fills `{{task_id}}` in as it does `{{request_id}}`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{debug, warn};

use super::error::LlmError;
use super::{Block, ChatMessage, ChatRequest, ChatResponse, Provider};

/// The text a recorded tool call input holds where the live call named the newest request id.
pub const REQUEST_ID_PLACEHOLDER: &str = "{{request_id}}";

/// The text a recorded tool call input holds where the live call named the newest task id.
pub const TASK_ID_PLACEHOLDER: &str = "{{task_id}}";

/// The agent of entries that answer any agent's call (see the module's doc).
pub const ANY_AGENT: &str = "*";

/// How long an ordered replay waits for earlier turns by default (`TROUPE_REPLAY_WAIT_SECS`).
pub const DEFAULT_REPLAY_WAIT: Duration = Duration::from_secs(60);

/// First and longest pause between two reads of the progress file.
const FIRST_PAUSE: Duration = Duration::from_millis(1);
const LONGEST_PAUSE: Duration = Duration::from_millis(20);

/// One line of a cassette.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CassetteEntry {
    pub agent: String,
    pub seq: u64,
    /// The entry's place in the global order of calls across all agents of the recording (see
    /// the module docs). `None` in cassettes written before turns existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u64>,
    pub response: ChatResponse,
}

/// The borrowed form of [`CassetteEntry`] the recorder writes, to avoid a copy per call.
#[derive(Serialize)]
struct EntryRef<'a> {
    agent: &'a str,
    seq: u64,
    turn: u64,
    response: &'a ChatResponse,
}

/// A recorded answer and its turn.
#[derive(Debug, Clone)]
struct Recorded {
    response: ChatResponse,
    turn: Option<u64>,
}

/// Plays a cassette: call `seq` of `agent` gets the response recorded for it, optionally in the
/// recorded order of turns (see the module docs).
#[derive(Debug, Clone)]
pub struct ReplayProvider {
    responses: HashMap<(String, u64), Recorded>,
    /// Which call each turn of the cassette belongs to, for the entries kept in `responses`.
    turns: BTreeMap<u64, (String, u64)>,
    /// The progress file shared by the processes of an ordered replay; `None` plays unordered.
    progress: Option<PathBuf>,
    /// How long a call waits for earlier turns before failing.
    wait: Duration,
    /// A pause before each answer, as if the model were thinking: `lead demo` uses it so that
    /// its timeline unfolds at a pace a person can follow.
    pace: Duration,
}

impl Default for ReplayProvider {
    fn default() -> Self {
        ReplayProvider {
            responses: HashMap::new(),
            turns: BTreeMap::new(),
            progress: None,
            pace: Duration::ZERO,
            wait: DEFAULT_REPLAY_WAIT,
        }
    }
}

impl ReplayProvider {
    /// Loads a cassette file. An unreadable file or a malformed line is a [`LlmError::Config`]
    /// naming the file (and line).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, LlmError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| {
            LlmError::Config(format!("failed to read cassette {}: {e}", path.display()))
        })?;
        Self::parse(&text, &format!("cassette {}", path.display()))
    }

    /// Loads a cassette from its text, e.g. one embedded in the binary with `include_str!`.
    /// The same as the [`FromStr`] impl, without the trait import.
    #[expect(
        clippy::should_implement_trait,
        reason = "FromStr is implemented as well; this keeps call sites free of a trait import"
    )]
    pub fn from_str(text: &str) -> Result<Self, LlmError> {
        Self::parse(text, "embedded cassette")
    }

    /// A provider playing these entries; a later entry for the same call replaces an earlier one.
    pub fn from_entries(entries: impl IntoIterator<Item = CassetteEntry>) -> Self {
        let mut replay = ReplayProvider::default();
        for entry in entries {
            replay.insert(entry);
        }
        replay
    }

    /// Plays in the recorded order of turns, coordinating through the progress file at `path`
    /// with every other provider (in this or other processes) given the same file. The file
    /// should be fresh (missing or empty) for each run; it is created on first use, mode 0600.
    pub fn with_progress(mut self, path: PathBuf) -> Self {
        self.progress = Some(path);
        self
    }

    /// How long an ordered call waits for earlier turns before failing with
    /// [`LlmError::ReplayOutOfOrder`]; [`DEFAULT_REPLAY_WAIT`] unless set.
    pub fn with_wait_limit(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// Waits `pace` before each answer (in an ordered replay, before the turn counts as served,
    /// so the whole run advances one paced step at a time).
    pub fn with_pace(mut self, pace: Duration) -> Self {
        self.pace = pace;
        self
    }

    /// How many calls the cassette answers.
    pub fn len(&self) -> usize {
        self.responses.len()
    }

    /// True when the cassette answers no call at all.
    pub fn is_empty(&self) -> bool {
        self.responses.is_empty()
    }

    /// Adds an entry; true when it replaced an earlier entry for the same call.
    fn insert(&mut self, entry: CassetteEntry) -> bool {
        let key = (entry.agent, entry.seq);
        let old = self.responses.insert(
            key.clone(),
            Recorded {
                response: entry.response,
                turn: entry.turn,
            },
        );
        // The replaced entry's turn is never served, so nobody may wait for it.
        if let Some(old_turn) = old.as_ref().and_then(|o| o.turn)
            && self.turns.get(&old_turn) == Some(&key)
        {
            self.turns.remove(&old_turn);
        }
        if let Some(turn) = entry.turn {
            self.turns.insert(turn, key);
        }
        old.is_some()
    }

    fn parse(text: &str, origin: &str) -> Result<Self, LlmError> {
        let mut replay = ReplayProvider::default();
        for (index, piece) in text.split_inclusive('\n').enumerate() {
            let terminated = piece.ends_with('\n');
            let line = piece.trim();
            if line.is_empty() {
                continue;
            }
            match serde_json::from_str::<CassetteEntry>(line) {
                Ok(entry) => {
                    let (agent, seq) = (entry.agent.clone(), entry.seq);
                    // A call recorded twice (a worker killed after recording, before saving its
                    // transcript, then redoing the call): the later one is what the run used.
                    if replay.insert(entry) {
                        debug!(agent, seq, "{origin}: later entry replaces earlier");
                    }
                }
                Err(e) if !terminated => {
                    warn!(
                        "{origin}: ignoring unterminated last line {}: {e}",
                        index + 1
                    );
                }
                Err(e) => {
                    return Err(LlmError::Config(format!(
                        "{origin} line {}: not a cassette entry: {e}",
                        index + 1
                    )));
                }
            }
        }
        Ok(replay)
    }

    /// Waits until every cassette turn before `turn` is in the progress file, then records
    /// `turn` there (unless it already is: a call served twice).
    fn take_turn(&self, progress: &Path, turn: u64, req: &ChatRequest) -> Result<(), LlmError> {
        let io_error = |source| LlmError::ReplayProgress {
            path: progress.to_path_buf(),
            source,
        };
        let started = Instant::now();
        let mut pause = FIRST_PAUSE;
        loop {
            let served = read_progress(progress).map_err(io_error)?;
            if served.contains(&turn) {
                debug!(
                    agent = req.agent,
                    seq = req.seq,
                    turn,
                    "turn already served"
                );
                return Ok(());
            }
            let missing = self.turns.range(..turn).find(|(t, _)| !served.contains(t));
            let Some((&missing_turn, (missing_agent, missing_seq))) = missing else {
                break;
            };
            let waited = started.elapsed();
            if waited >= self.wait {
                return Err(LlmError::ReplayOutOfOrder {
                    agent: req.agent.clone(),
                    seq: req.seq,
                    turn,
                    waited: self.wait,
                    missing_turn,
                    missing_agent: missing_agent.clone(),
                    missing_seq: *missing_seq,
                });
            }
            std::thread::sleep(pause.min(self.wait - waited));
            pause = (pause * 2).min(LONGEST_PAUSE);
        }
        if !self.pace.is_zero() {
            std::thread::sleep(self.pace);
        }
        append_progress(progress, turn).map_err(io_error)?;
        debug!(agent = req.agent, seq = req.seq, turn, "turn served");
        Ok(())
    }
}

impl FromStr for ReplayProvider {
    type Err = LlmError;

    fn from_str(text: &str) -> Result<Self, LlmError> {
        Self::parse(text, "embedded cassette")
    }
}

impl Provider for ReplayProvider {
    fn name(&self) -> &'static str {
        "replay"
    }

    fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let recorded = self
            .responses
            .get(&(req.agent.clone(), req.seq))
            .or_else(|| self.responses.get(&(ANY_AGENT.to_owned(), req.seq)))
            .ok_or_else(|| LlmError::CassetteExhausted {
                agent: req.agent.clone(),
                seq: req.seq,
            })?;
        if let (Some(turn), Some(progress)) = (recorded.turn, &self.progress) {
            self.take_turn(progress, turn, req)?;
        } else if !self.pace.is_zero() {
            std::thread::sleep(self.pace);
        }
        let mut response = recorded.response.clone();
        if let Some(id) = newest_request_id(&req.messages) {
            fill(&mut response, REQUEST_ID_PLACEHOLDER, id);
        }
        if let Some(id) = newest_task_id(&req.messages) {
            fill(&mut response, TASK_ID_PLACEHOLDER, id);
        }
        Ok(response)
    }
}

/// The turns listed in a progress file: one number per `\n`-terminated line. A missing file lists
/// none; an unterminated last line (a write in progress) and unreadable lines are ignored.
fn read_progress(path: &Path) -> io::Result<HashSet<u64>> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(HashSet::new()),
        Err(e) => return Err(e),
    };
    let Some(end) = bytes.iter().rposition(|&b| b == b'\n') else {
        return Ok(HashSet::new());
    };
    Ok(bytes[..end]
        .split(|&b| b == b'\n')
        .filter_map(|line| std::str::from_utf8(line).ok()?.trim().parse().ok())
        .collect())
}

/// Appends `turn\n` to the progress file with one write on an `O_APPEND` descriptor.
fn append_progress(path: &Path, turn: u64) -> io::Result<()> {
    let mut file = OpenOptions::new()
        .append(true)
        .create(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(format!("{turn}\n").as_bytes())
}

/// The newest request id a request shows the model: the last `request_id=` followed by exactly 8
/// lowercase hex characters, scanning the text blocks and tool result contents in order.
pub fn newest_request_id(messages: &[ChatMessage]) -> Option<&str> {
    newest(messages, last_request_id)
}

/// The newest task id a request shows the model (see the module docs): the last 8 lowercase hex
/// characters after `task `, `task_id ` or a JSON `"task_id": "`, scanning the text blocks and
/// tool result contents in order.
pub fn newest_task_id(messages: &[ChatMessage]) -> Option<&str> {
    newest(messages, last_task_id)
}

/// The last match of `last_in` over the text blocks and tool result contents of `messages`.
fn newest<'a>(
    messages: &'a [ChatMessage],
    last_in: fn(&'a str) -> Option<&'a str>,
) -> Option<&'a str> {
    // The last match overall is the last match of the last block that has one.
    messages
        .iter()
        .rev()
        .flat_map(|m| m.content.iter().rev())
        .find_map(|block| match block {
            Block::Text { text } => last_in(text),
            Block::ToolResult { content, .. } => last_in(content),
            Block::ToolUse { .. } => None,
        })
}

/// The last request id in `text` (see [`newest_request_id`]).
fn last_request_id(text: &str) -> Option<&str> {
    last_id_after(text, "request_id=", false)
}

/// The last task id in `text` (see [`newest_task_id`]).
fn last_task_id(text: &str) -> Option<&str> {
    // The id right after each key, and where it starts, for the one that comes last.
    ["task ", "task_id ", "\"task_id\": \"", "\"task_id\":\""]
        .iter()
        .filter_map(|key| {
            let id = last_id_after(text, key, key.starts_with('t'))?;
            // `id` borrows from `text`, so its offset is where it starts.
            Some((id.as_ptr() as usize - text.as_ptr() as usize, id))
        })
        .max_by_key(|(at, _)| *at)
        .map(|(_, id)| id)
}

/// The last exactly-8-lowercase-hex id right after `key` in `text` (and then no letter, digit or
/// `_`). With `word`, `key` must also start a word (no letter, digit or `_` before it).
fn last_id_after<'a>(text: &'a str, key: &str, word: bool) -> Option<&'a str> {
    const LEN: usize = 8;
    let word_byte = |b: &u8| b.is_ascii_alphanumeric() || *b == b'_';
    let bytes = text.as_bytes();
    let mut found = None;
    let mut from = 0;
    while let Some(pos) = text.get(from..).and_then(|rest| rest.find(key)) {
        let at = from + pos;
        let start = at + key.len();
        let hex = bytes
            .get(start..)
            .unwrap_or_default()
            .iter()
            .take(LEN + 1)
            .take_while(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b))
            .count();
        let ends_word = bytes.get(start + LEN).is_none_or(|b| !word_byte(b));
        let starts_word = !word || at == 0 || !word_byte(&bytes[at - 1]);
        if hex == LEN && ends_word && starts_word {
            // ASCII bytes, so these are char boundaries.
            found = text.get(start..start + LEN);
        }
        from = start;
    }
    found
}

/// Calls `f` on every string inside the `tool_use` inputs of `response`.
fn for_each_input_string(response: &mut ChatResponse, f: &mut impl FnMut(&mut String)) {
    fn walk(value: &mut Value, f: &mut impl FnMut(&mut String)) {
        match value {
            Value::String(s) => f(s),
            Value::Array(items) => items.iter_mut().for_each(|v| walk(v, f)),
            Value::Object(map) => map.values_mut().for_each(|v| walk(v, f)),
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    for block in &mut response.content {
        if let Block::ToolUse { input, .. } = block {
            walk(input, f);
        }
    }
}

/// Replaces `placeholder` by `id` in every string of the tool call inputs.
fn fill(response: &mut ChatResponse, placeholder: &str, id: &str) {
    for_each_input_string(response, &mut |s| {
        if s.contains(placeholder) {
            *s = s.replace(placeholder, id);
        }
    });
}

/// The copy of `response` to record: strings of the tool call inputs equal to the newest request
/// id of `req` become [`REQUEST_ID_PLACEHOLDER`], then those equal to its newest task id
/// [`TASK_ID_PLACEHOLDER`]. Borrowed when there is nothing to replace.
fn abstract_ids<'a>(req: &ChatRequest, response: &'a ChatResponse) -> Cow<'a, ChatResponse> {
    let ids = [
        (newest_request_id(&req.messages), REQUEST_ID_PLACEHOLDER),
        (newest_task_id(&req.messages), TASK_ID_PLACEHOLDER),
    ];
    let mut copy: Option<ChatResponse> = None;
    for (id, placeholder) in ids {
        let Some(id) = id else { continue };
        let mut candidate = copy.clone().unwrap_or_else(|| response.clone());
        let mut replaced = false;
        for_each_input_string(&mut candidate, &mut |s| {
            if s == id {
                *s = placeholder.to_string();
                replaced = true;
            }
        });
        if replaced {
            copy = Some(candidate);
        }
    }
    match copy {
        Some(c) => Cow::Owned(c),
        None => Cow::Borrowed(response),
    }
}

/// Wraps a provider and appends every successful call to a cassette file.
pub struct Recorder {
    inner: Box<dyn Provider>,
    path: PathBuf,
    /// The flock excludes other processes (other open file descriptions); this mutex excludes the
    /// other threads of this one, which share the descriptor and so its lock.
    cassette: Mutex<Cassette>,
}

/// The recorder's descriptor and what it knows of the file's lines.
struct Cassette {
    file: File,
    /// The file's first `bytes` bytes, ending at a line end, held `lines` lines when last looked
    /// at; counting resumes there instead of re-reading the whole file each call.
    counted: LineCount,
}

#[derive(Clone, Copy, Default)]
struct LineCount {
    bytes: u64,
    lines: u64,
}

impl Recorder {
    /// Opens (creating if needed) `path` for appending. Failing to open it is a
    /// [`LlmError::Config`]: the user asked for a recording that cannot be made.
    pub fn new(inner: Box<dyn Provider>, path: impl Into<PathBuf>) -> Result<Self, LlmError> {
        let path = path.into();
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(|e| {
                LlmError::Config(format!(
                    "failed to open cassette {} for recording: {e}",
                    path.display()
                ))
            })?;
        Ok(Recorder {
            inner,
            path,
            cassette: Mutex::new(Cassette {
                file,
                counted: LineCount::default(),
            }),
        })
    }

    /// The cassette file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn append(&self, req: &ChatRequest, response: &ChatResponse) -> io::Result<()> {
        let response = abstract_ids(req, response);
        let mut cassette = self
            .cassette
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        loop {
            match cassette.file.lock() {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let written = Self::append_locked(&mut cassette, &self.path, req, &response);
        let unlocked = cassette.file.unlock();
        written.and(unlocked)
    }

    /// Appends the entry; the caller holds the flock.
    fn append_locked(
        cassette: &mut Cassette,
        path: &Path,
        req: &ChatRequest,
        response: &ChatResponse,
    ) -> io::Result<()> {
        repair_tail(&cassette.file, path)?;
        let counted = count_lines(&cassette.file, cassette.counted)?;
        let entry = EntryRef {
            agent: &req.agent,
            seq: req.seq,
            turn: counted.lines,
            response,
        };
        let mut line = serde_json::to_vec(&entry)?;
        line.push(b'\n');
        // Until the write is known to be whole, count from the last known line end.
        cassette.counted = counted;
        (&cassette.file).write_all(&line)?;
        cassette.counted = LineCount {
            bytes: counted.bytes + line.len() as u64,
            lines: counted.lines + 1,
        };
        Ok(())
    }
}

impl Provider for Recorder {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let response = self.inner.complete(req)?;
        self.append(req, &response)
            .map_err(|source| LlmError::Record {
                path: self.path.clone(),
                source,
            })?;
        Ok(response)
    }
}

/// Counts the `\n`s of the whole file, resuming from `known` when the file still has a line end
/// there (other writers only append, and cut nothing before a line end). Must be called with the
/// file lock held, after [`repair_tail`], so every line counted is complete.
fn count_lines(file: &File, known: LineCount) -> io::Result<LineCount> {
    const CHUNK: usize = 64 * 1024;
    let len = file.metadata()?.len();
    let mut last = [0u8; 1];
    let resume = known.bytes == 0
        || (known.bytes <= len
            && file.read_exact_at(&mut last, known.bytes - 1).is_ok()
            && last[0] == b'\n');
    let mut count = if resume { known } else { LineCount::default() };
    let mut buf = vec![0u8; CHUNK];
    while count.bytes < len {
        let want = usize::try_from(len - count.bytes).map_or(CHUNK, |rest| rest.min(CHUNK));
        let chunk = &mut buf[..want];
        file.read_exact_at(chunk, count.bytes)?;
        count.lines += chunk.iter().filter(|&&b| b == b'\n').count() as u64;
        count.bytes += want as u64;
    }
    Ok(count)
}

/// Cuts an unterminated last line (left by a writer killed mid-write) so the next line starts
/// clean. Must be called with the file lock held.
fn repair_tail(file: &File, path: &Path) -> io::Result<()> {
    const CHUNK: u64 = 4096;
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(());
    }
    let mut last = [0u8; 1];
    file.read_exact_at(&mut last, len - 1)?;
    if last[0] == b'\n' {
        return Ok(());
    }
    let mut buf = vec![0u8; CHUNK as usize];
    let mut end = len;
    let keep = loop {
        if end == 0 {
            break 0;
        }
        let start = end.saturating_sub(CHUNK);
        let chunk = &mut buf[..(end - start) as usize];
        file.read_exact_at(chunk, start)?;
        if let Some(pos) = chunk.iter().rposition(|&b| b == b'\n') {
            break start + pos as u64 + 1;
        }
        end = start;
    };
    warn!(
        path = %path.display(),
        cut_bytes = len - keep,
        "cassette ends in an unterminated line; cutting it before appending"
    );
    file.set_len(keep)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{Block, StopReason, Usage};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    fn response(text: &str) -> ChatResponse {
        ChatResponse {
            content: vec![Block::Text { text: text.into() }],
            stop_reason: StopReason::EndTurn,
            usage: Usage {
                input_tokens: 1,
                output_tokens: 2,
                cache_creation_input_tokens: 3,
                cache_read_input_tokens: 4,
            },
            model: "m".into(),
        }
    }

    fn request(agent: &str, seq: u64) -> ChatRequest {
        ChatRequest {
            model: String::new(),
            system: String::new(),
            messages: Vec::new(),
            tools: Vec::new(),
            max_tokens: 16,
            agent: agent.into(),
            seq,
        }
    }

    fn temp_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "troupe-replay-{name}-{}.jsonl",
            uuid::Uuid::new_v4().simple()
        ))
    }

    /// Answers every call with "<agent>#<seq>" and counts the calls.
    struct Echo(AtomicU64);

    impl Provider for Echo {
        fn name(&self) -> &'static str {
            "echo"
        }
        fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(response(&format!("{}#{}", req.agent, req.seq)))
        }
    }

    #[test]
    fn plays_by_agent_and_seq() {
        let text = r#"{"agent":"alice","seq":0,"response":{"content":[{"type":"text","text":"a0"}],"stop_reason":"end_turn"}}
{"agent":"alice","seq":1,"response":{"content":[{"type":"tool_use","id":"t","name":"bash","input":{"command":"ls"}}],"stop_reason":"tool_use","usage":{"input_tokens":5}}}

{"agent":"bob","seq":0,"response":{"content":[],"stop_reason":"refusal"}}
"#;
        let replay = ReplayProvider::from_str(text).expect("parses");
        assert_eq!(replay.len(), 3);
        let r = replay.complete(&request("alice", 1)).expect("recorded");
        assert_eq!(r.stop_reason, StopReason::ToolUse);
        assert_eq!(r.usage.input_tokens, 5);
        let r = replay.complete(&request("bob", 0)).expect("recorded");
        assert_eq!(r.stop_reason, StopReason::Refusal);
        match replay.complete(&request("alice", 2)) {
            Err(LlmError::CassetteExhausted { agent, seq }) => {
                assert_eq!((agent.as_str(), seq), ("alice", 2));
            }
            other => panic!("unexpected {other:?}"),
        }
        let parsed: ReplayProvider = text.parse().expect("FromStr");
        assert_eq!(parsed.len(), 3);
    }

    #[test]
    fn an_entry_of_any_agent_answers_those_without_their_own() {
        let text = r#"{"agent":"*","seq":0,"response":{"content":[{"type":"text","text":"any"}],"stop_reason":"end_turn"}}
{"agent":"alice","seq":0,"response":{"content":[{"type":"text","text":"own"}],"stop_reason":"end_turn"}}
"#;
        let replay = ReplayProvider::from_str(text).expect("parses");
        let text_of = |r: ChatResponse| match &r.content[0] {
            Block::Text { text } => text.clone(),
            other => panic!("unexpected {other:?}"),
        };
        assert_eq!(
            text_of(replay.complete(&request("alice", 0)).unwrap()),
            "own"
        );
        assert_eq!(text_of(replay.complete(&request("zed", 0)).unwrap()), "any");
        assert!(matches!(
            replay.complete(&request("zed", 1)),
            Err(LlmError::CassetteExhausted { .. })
        ));
    }

    #[test]
    fn bad_lines_are_config_errors_but_a_cut_last_line_is_ignored() {
        let good = r#"{"agent":"a","seq":0,"response":{"content":[],"stop_reason":"end_turn"}}"#;
        let cut = format!("{good}\n{{\"agent\":\"a\",\"seq\":1,\"resp");
        let replay = ReplayProvider::from_str(&cut).expect("cut tail ignored");
        assert_eq!(replay.len(), 1);
        let unterminated_but_whole = format!("{good}\n{}", good.replace("\"seq\":0", "\"seq\":1"));
        assert_eq!(
            ReplayProvider::from_str(&unterminated_but_whole)
                .expect("parses")
                .len(),
            2
        );
        let bad = format!("not json\n{good}\n");
        let e = ReplayProvider::from_str(&bad).expect_err("bad line");
        assert!(e.to_string().contains("line 1"), "{e}");
        assert_eq!(e.exit_code(), 78);
    }

    #[test]
    fn missing_cassette_is_a_config_error() {
        let path = temp_path("missing");
        let e = ReplayProvider::open(&path).expect_err("missing");
        assert_eq!(e.exit_code(), 78);
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
    }

    #[test]
    fn recorder_round_trips_and_repairs_a_cut_tail() {
        let path = temp_path("roundtrip");
        std::fs::write(&path, "{\"agent\":\"x\",\"seq\":0,\"resp").expect("write");
        let recorder = Recorder::new(Box::new(Echo(AtomicU64::new(0))), &path).expect("recorder");
        assert_eq!(recorder.name(), "echo");
        let a = recorder.complete(&request("alice", 0)).expect("call");
        let b = recorder.complete(&request("bob", 4)).expect("call");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text.lines().count(), 2, "{text}");
        let replay = ReplayProvider::open(&path).expect("open");
        assert_eq!(replay.complete(&request("alice", 0)).expect("a"), a);
        assert_eq!(replay.complete(&request("bob", 4)).expect("b"), b);
        std::fs::remove_file(&path).ok();
    }

    #[test]
    fn concurrent_recorders_never_interleave_lines() {
        let path = temp_path("concurrent");
        // Separate recorders have separate open file descriptions, like separate processes, so
        // only the flock keeps them apart; the shared one also exercises the mutex.
        let shared =
            Arc::new(Recorder::new(Box::new(Echo(AtomicU64::new(0))), &path).expect("recorder"));
        let mut threads = Vec::new();
        for t in 0..6u64 {
            let recorder = if t % 2 == 0 {
                Arc::clone(&shared)
            } else {
                Arc::new(Recorder::new(Box::new(Echo(AtomicU64::new(0))), &path).expect("recorder"))
            };
            threads.push(std::thread::spawn(move || {
                let agent = format!("agent{t}-{}", "x".repeat(5000));
                for seq in 0..50 {
                    recorder.complete(&request(&agent, seq)).expect("call");
                }
            }));
        }
        for t in threads {
            t.join().expect("thread");
        }
        let replay = ReplayProvider::open(&path).expect("every line parses");
        assert_eq!(replay.len(), 300);
        let text = std::fs::read_to_string(&path).expect("read");
        let mut turns: Vec<u64> = text
            .lines()
            .map(|l| {
                let entry: CassetteEntry = serde_json::from_str(l).expect("entry");
                entry.turn.expect("turn")
            })
            .collect();
        turns.sort_unstable();
        assert_eq!(turns, (0..300).collect::<Vec<u64>>());
        std::fs::remove_file(&path).ok();
    }

    fn entry(agent: &str, seq: u64, turn: Option<u64>) -> CassetteEntry {
        CassetteEntry {
            agent: agent.into(),
            seq,
            turn,
            response: response(&format!("{agent}#{seq}")),
        }
    }

    fn text_of(r: &ChatResponse) -> &str {
        match r.content.first() {
            Some(Block::Text { text }) => text,
            other => panic!("unexpected {other:?}"),
        }
    }

    fn request_with(agent: &str, seq: u64, content: Vec<Block>) -> ChatRequest {
        let mut req = request(agent, seq);
        req.messages.push(ChatMessage {
            role: crate::llm::Role::User,
            content,
        });
        req
    }

    fn tool_use(input: Value) -> ChatResponse {
        ChatResponse {
            content: vec![
                Block::Text {
                    text: "ok {{request_id}}".into(),
                },
                Block::ToolUse {
                    id: "t1".into(),
                    name: "plan_approval".into(),
                    input,
                },
            ],
            stop_reason: StopReason::ToolUse,
            usage: Usage::default(),
            model: "m".into(),
        }
    }

    fn input_of(r: &ChatResponse) -> &Value {
        match r.content.get(1) {
            Some(Block::ToolUse { input, .. }) => input,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn ordered_replay_serves_turns_across_providers_in_recorded_order() {
        let progress = temp_path("progress");
        let entries = vec![
            entry("alice", 0, Some(0)),
            entry("bob", 0, Some(1)),
            entry("alice", 1, Some(2)),
            entry("bob", 1, Some(3)),
            entry("bob", 2, None),
        ];
        // Separate instances, like separate processes: only the progress file links them.
        let make = || {
            ReplayProvider::from_entries(entries.clone())
                .with_progress(progress.clone())
                .with_wait_limit(Duration::from_secs(20))
        };
        let (alice, bob) = (make(), make());
        // Bob, whose first turn comes second, starts first and must wait for alice.
        let bob_thread = std::thread::spawn(move || {
            let first = bob.complete(&request("bob", 0)).expect("bob 0");
            let second = bob.complete(&request("bob", 1)).expect("bob 1");
            (text_of(&first).to_string(), text_of(&second).to_string())
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(!bob_thread.is_finished(), "bob must wait for alice's turn");
        let alice_thread = std::thread::spawn(move || {
            let first = alice.complete(&request("alice", 0)).expect("alice 0");
            let second = alice.complete(&request("alice", 1)).expect("alice 1");
            // A turn served twice (a restarted worker redoing its call) answers at once.
            let again = alice.complete(&request("alice", 0)).expect("alice 0 again");
            assert_eq!(again, first);
            (text_of(&first).to_string(), text_of(&second).to_string())
        });
        assert_eq!(
            bob_thread.join().expect("bob"),
            ("bob#0".to_string(), "bob#1".to_string())
        );
        assert_eq!(
            alice_thread.join().expect("alice"),
            ("alice#0".to_string(), "alice#1".to_string())
        );
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&progress)
                .expect("progress")
                .permissions(),
        );
        assert_eq!(mode & 0o077, 0, "progress file is private: {mode:o}");
        let order = std::fs::read_to_string(&progress).expect("progress");
        assert_eq!(order, "0\n1\n2\n3\n");
        // An entry without a turn neither waits nor shows in the progress file.
        let replay = make();
        assert_eq!(
            text_of(&replay.complete(&request("bob", 2)).expect("b2")),
            "bob#2"
        );
        assert_eq!(std::fs::read_to_string(&progress).expect("progress"), order);
        std::fs::remove_file(&progress).ok();
    }

    #[test]
    fn a_missing_earlier_turn_stalls_with_a_named_error() {
        let progress = temp_path("stall");
        // A cut line from a writer in progress does not count as served.
        std::fs::write(&progress, "0").expect("write");
        let replay = ReplayProvider::from_entries(vec![
            entry("tester", 2, Some(0)),
            entry("coder", 3, Some(1)),
        ])
        .with_progress(progress.clone())
        .with_wait_limit(Duration::from_millis(50));
        let started = Instant::now();
        let e = replay.complete(&request("coder", 3)).expect_err("stalls");
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(
            e.to_string(),
            "replay out of order: coder call 3 (turn 1) waited 0.05 s for turn 0 (tester call 2)"
        );
        assert_eq!(e.exit_code(), 1);
        assert_eq!(std::fs::read_to_string(&progress).expect("progress"), "0");
        // Without a progress file the same call is answered at once.
        let unordered = ReplayProvider::from_entries(vec![entry("coder", 3, Some(1))]);
        assert!(unordered.complete(&request("coder", 3)).is_ok());
        std::fs::remove_file(&progress).ok();
    }

    #[test]
    fn a_replaced_entry_turn_is_not_waited_for() {
        let progress = temp_path("replaced");
        // Alice's call 0 was recorded twice; its first turn 0 is never served in the replay.
        let text = [
            entry("alice", 0, Some(0)),
            entry("bob", 0, Some(1)),
            entry("alice", 0, Some(2)),
        ]
        .iter()
        .map(|e| serde_json::to_string(e).expect("json") + "\n")
        .collect::<String>();
        let replay = ReplayProvider::from_str(&text)
            .expect("parses")
            .with_progress(progress.clone())
            .with_wait_limit(Duration::from_millis(500));
        assert_eq!(replay.len(), 2);
        replay.complete(&request("bob", 0)).expect("bob 0");
        replay.complete(&request("alice", 0)).expect("alice 0");
        assert_eq!(
            std::fs::read_to_string(&progress).expect("progress"),
            "1\n2\n"
        );
        std::fs::remove_file(&progress).ok();
    }

    #[test]
    fn request_ids_are_found_by_hand() {
        assert_eq!(
            last_request_id("x request_id=ab12cd34] y"),
            Some("ab12cd34")
        );
        assert_eq!(
            last_request_id("request_id=ab12cd34 request_id=00ff00ff"),
            Some("00ff00ff")
        );
        assert_eq!(last_request_id("request_id=ab12cd34"), Some("ab12cd34"));
        for none in [
            "request_id=ab12cd3",
            "request_id=ab12cd345",
            "request_id=AB12CD34",
            "request_id=ab12cd3g",
            "request_id=ab12cd34x",
            "request_id ab12cd34",
            "request_id=",
            "",
        ] {
            assert_eq!(last_request_id(none), None, "{none}");
        }
        assert_eq!(
            last_request_id("request_id=ab12cd34 then request_id=bad"),
            Some("ab12cd34")
        );
        assert_eq!(last_request_id("é request_id=ab12cd34é"), Some("ab12cd34"));
    }

    #[test]
    fn placeholder_gets_the_newest_request_id() {
        let recorded = tool_use(serde_json::json!({
            "request_id": "{{request_id}}",
            "nested": {"list": ["id {{request_id}}, again {{request_id}}", 7, {"deep": "{{request_id}}"}]},
            "other": "untouched",
        }));
        let replay = ReplayProvider::from_entries(vec![CassetteEntry {
            agent: "lead".into(),
            seq: 0,
            turn: None,
            response: recorded.clone(),
        }]);
        let req = request_with(
            "lead",
            0,
            vec![
                Block::Text {
                    text: "[plan_approval from coder request_id=aaaaaaaa] Plan: x".into(),
                },
                Block::ToolResult {
                    tool_use_id: "t0".into(),
                    content: "sent, request_id=bbbbbbbb".into(),
                    is_error: false,
                },
                Block::ToolUse {
                    id: "t2".into(),
                    name: "x".into(),
                    input: serde_json::json!({"q": "request_id=cccccccc"}),
                },
                Block::Text {
                    text: "request_id=ABCDEF12 request_id=dddddddd0".into(),
                },
            ],
        );
        let r = replay.complete(&req).expect("replayed");
        assert_eq!(
            input_of(&r),
            &serde_json::json!({
                "request_id": "bbbbbbbb",
                "nested": {"list": ["id bbbbbbbb, again bbbbbbbb", 7, {"deep": "bbbbbbbb"}]},
                "other": "untouched",
            })
        );
        assert_eq!(
            r.content[0], recorded.content[0],
            "text blocks stay as recorded"
        );
        // No request id in the request: the placeholder stays.
        let r = replay.complete(&request("lead", 0)).expect("replayed");
        assert_eq!(r, recorded);
    }

    #[test]
    fn task_ids_are_found_by_hand() {
        // The claim message names the claimed task first and last, its blockers in between.
        let claim = "You claimed task 0a1b2c3d (after 11111111, 22222222, all completed): docs\n\
                     When it is done, call task_update with task_id 0a1b2c3d, status completed";
        assert_eq!(last_task_id(claim), Some("0a1b2c3d"));
        assert_eq!(
            last_task_id("The task_completed hook sent task 00ff00ff (parse) back to you"),
            Some("00ff00ff")
        );
        let listed = "{\n  \"task_id\": \"aaaaaaaa\",\n  \"subject\": \"x\"\n}\n\
                      {\"task_id\":\"bbbbbbbb\"}";
        assert_eq!(last_task_id(listed), Some("bbbbbbbb"));
        // The last one wins whatever key names it.
        assert_eq!(
            last_task_id("\"task_id\": \"aaaaaaaa\" then task cccccccc"),
            Some("cccccccc")
        );
        assert_eq!(
            last_task_id("task cccccccc then \"task_id\": \"aaaaaaaa\""),
            Some("aaaaaaaa")
        );
        for none in [
            "task 0a1b2c3",
            "task 0a1b2c3d4",
            "task 0A1B2C3D",
            "task 0a1b2c3g",
            "task 0a1b2c3d_",
            "subtask 0a1b2c3d",
            "my_task 0a1b2c3d",
            "task_completed 0a1b2c3d",
            "tasks 0a1b2c3d",
            "after 0a1b2c3d",
            "request_id=0a1b2c3d",
            "task",
            "",
        ] {
            assert_eq!(last_task_id(none), None, "{none}");
        }
        assert_eq!(last_task_id("é task 0a1b2c3d é"), Some("0a1b2c3d"));
        assert_eq!(
            last_task_id("task 0a1b2c3d. task zzzzzzzz"),
            Some("0a1b2c3d")
        );
    }

    #[test]
    fn placeholder_gets_the_newest_task_id_and_leaves_request_ids_alone() {
        let mut recorded = tool_use(serde_json::json!({
            "task_id": "{{task_id}}",
            "status": "completed",
            "result": "done with {{task_id}}",
            "request_id": "{{request_id}}",
        }));
        recorded.content[1] = Block::ToolUse {
            id: "t1".into(),
            name: "task_update".into(),
            input: input_of(&recorded).clone(),
        };
        let replay = ReplayProvider::from_entries(vec![CassetteEntry {
            agent: "ana".into(),
            seq: 3,
            turn: None,
            response: recorded.clone(),
        }]);
        let req = request_with(
            "ana",
            3,
            vec![
                Block::Text {
                    text: "<inbox>\n[task_assignment from ana] You claimed task 11111111: x\n\
                           call task_update with task_id 11111111</inbox>"
                        .into(),
                },
                Block::ToolResult {
                    tool_use_id: "t0".into(),
                    content: "{\"task_id\": \"22222222\", \"status\": \"completing\"}".into(),
                    is_error: false,
                },
                Block::Text {
                    text: "[message from lead] The task_completed hook sent task 33333333 \
                           (x) back to you [shutdown_request from lead request_id=44444444]"
                        .into(),
                },
                Block::ToolResult {
                    tool_use_id: "t1".into(),
                    content: "edited settings.py".into(),
                    is_error: false,
                },
            ],
        );
        let r = replay.complete(&req).expect("replayed");
        assert_eq!(
            input_of(&r),
            &serde_json::json!({
                "task_id": "33333333",
                "status": "completed",
                "result": "done with 33333333",
                "request_id": "44444444",
            })
        );
        // No task id in the request: the placeholder stays.
        let r = replay.complete(&request("ana", 3)).expect("replayed");
        assert_eq!(input_of(&r)["task_id"], "{{task_id}}");
    }

    /// Answers with a task_update naming the newest task id of the request.
    struct TaskEcho;

    impl Provider for TaskEcho {
        fn name(&self) -> &'static str {
            "task-echo"
        }
        fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
            let id = newest_task_id(&req.messages).unwrap_or("none");
            Ok(tool_use(serde_json::json!({
                "task_id": id,
                "status": "completed",
                "result": format!("finished {id}"),
            })))
        }
    }

    #[test]
    fn recorder_abstracts_task_ids() {
        let path = temp_path("task-ids");
        let recorder = Recorder::new(Box::new(TaskEcho), &path).expect("recorder");
        let claimed = |id: &str| {
            request_with(
                "ana",
                1,
                vec![Block::Text {
                    text: format!("You claimed task {id} (after 99999999, all completed): x"),
                }],
            )
        };
        let live = recorder.complete(&claimed("0a1b2c3d")).expect("call");
        assert_eq!(input_of(&live)["task_id"], "0a1b2c3d", "live keeps the id");
        let text = std::fs::read_to_string(&path).expect("read");
        let entry: CassetteEntry =
            serde_json::from_str(text.lines().next().expect("a line")).expect("entry");
        assert_eq!(
            input_of(&entry.response),
            &serde_json::json!({
                "task_id": "{{task_id}}",
                "status": "completed",
                "result": "finished 0a1b2c3d",
            })
        );
        let replay = ReplayProvider::open(&path).expect("open");
        let r = replay.complete(&claimed("feedbeef")).expect("replayed");
        assert_eq!(input_of(&r)["task_id"], "feedbeef");
        std::fs::remove_file(&path).ok();
    }

    /// Answers with a tool call naming the newest request id of the request.
    struct IdEcho;

    impl Provider for IdEcho {
        fn name(&self) -> &'static str {
            "id-echo"
        }
        fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
            let id = newest_request_id(&req.messages).unwrap_or("none");
            Ok(tool_use(serde_json::json!({
                "request_id": id,
                "ids": [id, {"again": id}],
                "note": format!("for {id}"),
                "approve": true,
            })))
        }
    }

    fn with_id(agent: &str, seq: u64, id: &str) -> ChatRequest {
        request_with(
            agent,
            seq,
            vec![Block::Text {
                text: format!("[shutdown_request from lead request_id={id}] stop"),
            }],
        )
    }

    #[test]
    fn recorder_numbers_turns_and_abstracts_request_ids() {
        let path = temp_path("turns");
        let old = serde_json::to_string(&entry("old", 0, None)).expect("json");
        std::fs::write(&path, format!("{old}\n{{\"agent\":\"x\",\"resp")).expect("write");
        // Two recorders on one file, like two processes: turns count every writer's lines.
        let first = Recorder::new(Box::new(IdEcho), &path).expect("recorder");
        let second = Recorder::new(Box::new(IdEcho), &path).expect("recorder");
        let live = first
            .complete(&with_id("alice", 0, "aaaaaaaa"))
            .expect("call");
        assert_eq!(
            input_of(&live)["request_id"],
            "aaaaaaaa",
            "live answer keeps the id"
        );
        second
            .complete(&with_id("bob", 0, "aaaaaaaa"))
            .expect("call");
        first.complete(&request("alice", 1)).expect("call");

        let text = std::fs::read_to_string(&path).expect("read");
        let entries: Vec<CassetteEntry> = text
            .lines()
            .map(|l| serde_json::from_str(l).expect("entry"))
            .collect();
        let turns: Vec<Option<u64>> = entries.iter().map(|e| e.turn).collect();
        assert_eq!(turns, vec![None, Some(1), Some(2), Some(3)]);
        assert!(!text.contains("\"turn\":null"), "{text}");
        assert_eq!(
            input_of(&entries[1].response),
            &serde_json::json!({
                "request_id": "{{request_id}}",
                "ids": ["{{request_id}}", {"again": "{{request_id}}"}],
                "note": "for aaaaaaaa",
                "approve": true,
            })
        );
        assert_eq!(input_of(&entries[3].response)["request_id"], "none");

        let replay = ReplayProvider::open(&path).expect("open");
        let r = replay
            .complete(&with_id("alice", 0, "0123abcd"))
            .expect("replayed");
        assert_eq!(
            input_of(&r),
            &serde_json::json!({
                "request_id": "0123abcd",
                "ids": ["0123abcd", {"again": "0123abcd"}],
                "note": "for aaaaaaaa",
                "approve": true,
            })
        );
        std::fs::remove_file(&path).ok();
    }
}
