//! Cassettes: recorded model responses, played back without network, and the recorder that
//! writes them.
//!
//! A cassette is a JSONL file with one line per recorded call:
//! `{"agent": "...", "seq": N, "response": <ChatResponse>}`. Responses are keyed by the calling
//! agent and its call number ([`ChatRequest::seq`]), not by request content, so a replayed run
//! gets the same answers even when file contents or timestamps in its prompts differ.
//!
//! Several worker processes may record into one file. Each line is appended with one
//! `write_all` on an `O_APPEND` descriptor while holding an exclusive flock on the file itself,
//! so lines never interleave. A writer killed mid-write can leave an unterminated last line; the
//! next writer (holding the lock) cuts it off before appending, and readers ignore such a line.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};
use tracing::{debug, warn};

use super::error::LlmError;
use super::{ChatRequest, ChatResponse, Provider};

/// One line of a cassette.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CassetteEntry {
    pub agent: String,
    pub seq: u64,
    pub response: ChatResponse,
}

/// The borrowed form of [`CassetteEntry`] the recorder writes, to avoid a copy per call.
#[derive(Serialize)]
struct EntryRef<'a> {
    agent: &'a str,
    seq: u64,
    response: &'a ChatResponse,
}

/// Plays a cassette: call `seq` of `agent` gets the response recorded for it.
#[derive(Debug, Clone, Default)]
pub struct ReplayProvider {
    responses: HashMap<(String, u64), ChatResponse>,
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
        let responses = entries
            .into_iter()
            .map(|e| ((e.agent, e.seq), e.response))
            .collect();
        ReplayProvider { responses }
    }

    /// How many calls the cassette answers.
    pub fn len(&self) -> usize {
        self.responses.len()
    }

    /// True when the cassette answers no call at all.
    pub fn is_empty(&self) -> bool {
        self.responses.is_empty()
    }

    fn parse(text: &str, origin: &str) -> Result<Self, LlmError> {
        let mut responses = HashMap::new();
        for (index, piece) in text.split_inclusive('\n').enumerate() {
            let terminated = piece.ends_with('\n');
            let line = piece.trim();
            if line.is_empty() {
                continue;
            }
            match serde_json::from_str::<CassetteEntry>(line) {
                Ok(entry) => {
                    // A call recorded twice (a worker killed after recording, before saving its
                    // transcript, then redoing the call): the later one is what the run used.
                    if responses
                        .insert((entry.agent.clone(), entry.seq), entry.response)
                        .is_some()
                    {
                        debug!(
                            agent = entry.agent,
                            seq = entry.seq,
                            "{origin}: later entry replaces earlier"
                        );
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
        Ok(ReplayProvider { responses })
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
        self.responses
            .get(&(req.agent.clone(), req.seq))
            .cloned()
            .ok_or_else(|| LlmError::CassetteExhausted {
                agent: req.agent.clone(),
                seq: req.seq,
            })
    }
}

/// Wraps a provider and appends every successful call to a cassette file.
pub struct Recorder {
    inner: Box<dyn Provider>,
    path: PathBuf,
    /// The flock excludes other processes (other open file descriptions); this mutex excludes the
    /// other threads of this one, which share the descriptor and so its lock.
    file: Mutex<File>,
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
            file: Mutex::new(file),
        })
    }

    /// The cassette file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn append(&self, req: &ChatRequest, response: &ChatResponse) -> io::Result<()> {
        let entry = EntryRef {
            agent: &req.agent,
            seq: req.seq,
            response,
        };
        let mut line = serde_json::to_vec(&entry)?;
        line.push(b'\n');
        let file = self
            .file
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        loop {
            match file.lock() {
                Ok(()) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
        let written = repair_tail(&file, &self.path).and_then(|()| (&*file).write_all(&line));
        let unlocked = file.unlock();
        written.and(unlocked)
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
        std::fs::remove_file(&path).ok();
    }
}
