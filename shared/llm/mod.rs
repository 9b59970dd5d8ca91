//! Provider-neutral LLM types and the [`Provider`] trait.
//!
//! The agent loop speaks only these types; `anthropic`, `openai` and `replay` translate them to
//! and from their wire formats. Keeping one neutral shape means a transcript recorded against one
//! provider replays against any other, and a cassette is just a list of [`ChatResponse`]s.
//!
//! [`from_env`] picks and configures the provider from the environment (DESIGN.md section 9):
//!
//! | variable | meaning |
//! | --- | --- |
//! | `TROUPE_PROVIDER` | `anthropic`, `openai` or `replay`; when unset, the first key found wins |
//! | `ANTHROPIC_API_KEY`, `ANTHROPIC_BASE_URL` | Messages API key; base URL without `/v1` |
//! | `OPENAI_API_KEY`, `OPENAI_BASE_URL` | Chat Completions key; base URL with `/v1`. The key may be omitted when the base URL is set (local servers) |
//! | `MODEL_ID` | default model (`claude-sonnet-4-5` / `gpt-4o-mini`); a non-empty [`ChatRequest::model`] overrides it |
//! | `TROUPE_CASSETTE` | the cassette file played by `replay` |
//! | `TROUPE_REPLAY_PROGRESS` | with `replay`: play in the recorded order of turns, coordinating through this progress file, shared by all processes of the run and fresh for each run (see [`replay`]) |
//! | `TROUPE_REPLAY_PACE_MS` | with `replay`: pause this long before each answer, as if the model were thinking (default 0) |
//! | `TROUPE_REPLAY_WAIT_SECS` | with `TROUPE_REPLAY_PROGRESS`: how long a call waits for earlier turns before failing, default 60 |
//! | `TROUPE_RECORD` | append every successful call to this cassette file |
//! | `TROUPE_LLM_TIMEOUT_SECS` | whole-request timeout, default 600 |
//! | `TROUPE_LLM_MAX_ATTEMPTS` | attempts per call, default 3 |
//!
//! Empty values count as unset. Keys are held only in request headers marked sensitive and never
//! reach a log, an error message or a file.

pub mod anthropic;
pub mod error;
pub mod gate;
mod http;
pub mod openai;
pub mod replay;
pub mod retry;

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::info;

pub use anthropic::{Anthropic, AnthropicConfig};
pub use error::LlmError;
pub use http::HttpConfig;
pub use openai::{OpenAi, OpenAiConfig};
pub use replay::{CassetteEntry, DEFAULT_REPLAY_WAIT, Recorder, ReplayProvider};
pub use retry::RetryPolicy;

/// A tool offered to the model: name, human description and JSON schema of its input.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// A JSON schema with `"type": "object"` at the top.
    pub input_schema: Value,
}

/// Who said a message. Tool results travel in `User` messages, as in the Anthropic API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    User,
    Assistant,
}

/// One content block of a message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Block {
    Text {
        text: String,
    },
    ToolUse {
        id: String,
        name: String,
        input: Value,
    },
    ToolResult {
        tool_use_id: String,
        content: String,
        #[serde(default)]
        is_error: bool,
    },
}

/// One conversation message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: Vec<Block>,
}

/// Everything a provider needs for one model call.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    /// Model id; providers fall back to their own default when empty.
    pub model: String,
    /// The system prompt. Kept free of timestamps so prompt caching can hit.
    pub system: String,
    pub messages: Vec<ChatMessage>,
    pub tools: Vec<ToolSpec>,
    pub max_tokens: u32,
    /// The agent making the call (`lead` or a teammate name). Used by the replay provider and by
    /// cassette recording; never sent over the wire.
    pub agent: String,
    /// How many model calls this agent had completed before this one, over its whole life
    /// (restarts included, as rebuilt from its transcript). The replay provider plays response
    /// number `seq` of the agent's recording; HTTP providers ignore it.
    pub seq: u64,
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndTurn,
    ToolUse,
    MaxTokens,
    StopSequence,
    PauseTurn,
    Refusal,
    ContextWindowExceeded,
    /// A reason this version does not know, kept verbatim.
    #[serde(untagged)]
    Other(String),
}

/// Token counts of one call (or, summed, of a member's life).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub input_tokens: u64,
    #[serde(default)]
    pub output_tokens: u64,
    #[serde(default)]
    pub cache_creation_input_tokens: u64,
    #[serde(default)]
    pub cache_read_input_tokens: u64,
}

impl Usage {
    /// Adds another call's counts to this one (saturating: counters never wrap).
    pub fn add(&mut self, other: &Usage) {
        self.input_tokens = self.input_tokens.saturating_add(other.input_tokens);
        self.output_tokens = self.output_tokens.saturating_add(other.output_tokens);
        self.cache_creation_input_tokens = self
            .cache_creation_input_tokens
            .saturating_add(other.cache_creation_input_tokens);
        self.cache_read_input_tokens = self
            .cache_read_input_tokens
            .saturating_add(other.cache_read_input_tokens);
    }
}

/// The model's answer, provider-neutral.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatResponse {
    /// Only `Text` and `ToolUse` blocks; unknown wire blocks are dropped.
    pub content: Vec<Block>,
    pub stop_reason: StopReason,
    #[serde(default)]
    pub usage: Usage,
    #[serde(default)]
    pub model: String,
}

impl Block {
    /// The raw text of a tool call whose arguments were not a JSON object.
    ///
    /// OpenAI-style servers send tool arguments as a JSON string that may be invalid. The
    /// `openai` provider then keeps the raw text as `input = Value::String(raw)` instead of
    /// guessing; the tools layer should answer such a call with an error `tool_result` ("invalid
    /// tool arguments: ...") so the model can try again. Returns `None` for every other block.
    pub fn invalid_tool_arguments(&self) -> Option<&str> {
        match self {
            Block::ToolUse {
                input: Value::String(raw),
                ..
            } => Some(raw),
            _ => None,
        }
    }
}

/// A model API: one blocking call from a neutral request to a neutral response.
///
/// Implementations retry transient failures themselves, so an `Err` is final for this call.
pub trait Provider: Send + Sync {
    /// Short provider name for logs and status (`anthropic`, `openai`, `replay`).
    fn name(&self) -> &'static str;
    /// Makes one model call.
    fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError>;
    /// The longest one call of [`Provider::complete`] may take, its retries and their waits
    /// included: the allowance of a worker's heartbeat while it waits for the model.
    fn longest_call(&self) -> std::time::Duration {
        http::HttpConfig::default().longest_call()
    }
}

/// Builds the provider the process environment asks for; see the module docs for the variables.
pub fn from_env() -> Result<Box<dyn Provider>, LlmError> {
    from_env_with(&|name| std::env::var(name).ok())
}

/// [`from_env`] with the variables read through `vars`, so tests need not touch the process
/// environment.
pub fn from_env_with(vars: &dyn Fn(&str) -> Option<String>) -> Result<Box<dyn Provider>, LlmError> {
    let get = |name: &str| vars(name).filter(|v| !v.trim().is_empty());
    let anthropic_key = secret(vars, "ANTHROPIC_API_KEY")?;
    let openai_key = secret(vars, "OPENAI_API_KEY")?;
    let choice = match get("TROUPE_PROVIDER") {
        Some(name) => name.trim().to_ascii_lowercase(),
        None if anthropic_key.is_some() => "anthropic".to_string(),
        None if openai_key.is_some() || get("OPENAI_BASE_URL").is_some() => "openai".to_string(),
        None => {
            return Err(LlmError::Config(format!(
                "no llm provider configured; {HOW_TO_CONFIGURE}"
            )));
        }
    };
    let provider: Box<dyn Provider> = match choice.as_str() {
        "anthropic" => {
            let api_key = anthropic_key.ok_or_else(|| {
                LlmError::Config(format!(
                    "TROUPE_PROVIDER=anthropic needs ANTHROPIC_API_KEY; {HOW_TO_CONFIGURE}"
                ))
            })?;
            let mut config = AnthropicConfig::new(api_key.trim());
            if let Some(url) = get("ANTHROPIC_BASE_URL") {
                config.base_url = url.trim().to_string();
            }
            if let Some(model) = get("MODEL_ID") {
                config.model = model.trim().to_string();
            }
            config.http = HttpConfig::from_vars(&get)?;
            Box::new(Anthropic::new(config)?)
        }
        "openai" => {
            let api_key = openai_key.map(|k| k.trim().to_string());
            let base_url = get("OPENAI_BASE_URL").map(|u| u.trim().to_string());
            if api_key.is_none() && base_url.is_none() {
                return Err(LlmError::Config(format!(
                    "TROUPE_PROVIDER=openai needs OPENAI_API_KEY, or OPENAI_BASE_URL for a local server; {HOW_TO_CONFIGURE}"
                )));
            }
            let mut config = OpenAiConfig::new(api_key);
            if let Some(url) = base_url {
                config.base_url = url;
            }
            if let Some(model) = get("MODEL_ID") {
                config.model = model.trim().to_string();
            }
            config.http = HttpConfig::from_vars(&get)?;
            Box::new(OpenAi::new(config)?)
        }
        "replay" => {
            let path = get("TROUPE_CASSETTE").ok_or_else(|| {
                LlmError::Config(
                    "TROUPE_PROVIDER=replay needs TROUPE_CASSETTE=FILE, a cassette recorded with TROUPE_RECORD or --record"
                        .to_string(),
                )
            })?;
            let mut replay = ReplayProvider::open(path.trim())?;
            if let Some(raw) = get("TROUPE_REPLAY_WAIT_SECS") {
                let secs = raw
                    .trim()
                    .parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or_else(|| {
                        LlmError::Config(format!(
                            "TROUPE_REPLAY_WAIT_SECS must be a positive whole number, got {raw:?}"
                        ))
                    })?;
                replay = replay.with_wait_limit(Duration::from_secs(secs));
            }
            if let Some(raw) = get("TROUPE_REPLAY_PACE_MS") {
                let ms = raw.trim().parse::<u64>().map_err(|_| {
                    LlmError::Config(format!(
                        "TROUPE_REPLAY_PACE_MS must be a whole number of milliseconds, got {raw:?}"
                    ))
                })?;
                replay = replay.with_pace(Duration::from_millis(ms));
            }
            if let Some(progress) = get("TROUPE_REPLAY_PROGRESS") {
                replay = replay.with_progress(PathBuf::from(progress.trim()));
            }
            Box::new(replay)
        }
        other => {
            return Err(LlmError::Config(format!(
                "unknown TROUPE_PROVIDER {other:?}: expected anthropic, openai or replay"
            )));
        }
    };
    info!(provider = provider.name(), "llm provider selected");
    match get("TROUPE_RECORD") {
        Some(path) => Ok(Box::new(Recorder::new(provider, path.trim())?)),
        None => Ok(provider),
    }
}

/// An API key: the variable `name` itself, else the file named by `name_FILE`, else systemd's
/// credential `$CREDENTIALS_DIRECTORY/name` in lower case (`LoadCredential=anthropic_api_key:...`
/// in the unit), so a key need not sit in any environment. A key file inside the current
/// directory (a teammate's working dir, where its tools could read it) is refused.
fn secret(vars: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<String>, LlmError> {
    let get = |n: &str| vars(n).filter(|v| !v.trim().is_empty());
    if let Some(v) = get(name) {
        return Ok(Some(v));
    }
    let Some(path) = key_file_with(vars, name) else {
        return Ok(None);
    };
    if let (Ok(real), Ok(cwd)) = (
        path.canonicalize(),
        std::env::current_dir().and_then(|d| d.canonicalize()),
    ) && real.starts_with(&cwd)
    {
        return Err(LlmError::Config(format!(
            "the key file {} of {name} lies inside the working directory {}, where the agents' \
             tools could read it; move it outside",
            path.display(),
            cwd.display()
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| {
        LlmError::Config(format!(
            "cannot read the key file {} of {name}: {e}",
            path.display()
        ))
    })?;
    let key = text.trim().to_owned();
    Ok((!key.is_empty()).then_some(key))
}

/// The key file that [`secret`] would read for `name`, if any.
fn key_file_with(vars: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<PathBuf> {
    let get = |n: &str| vars(n).filter(|v| !v.trim().is_empty());
    if let Some(f) = get(&format!("{name}_FILE")) {
        return Some(PathBuf::from(f.trim()));
    }
    let cred = PathBuf::from(get("CREDENTIALS_DIRECTORY")?.trim()).join(name.to_ascii_lowercase());
    cred.exists().then_some(cred)
}

/// Makes this process non-dumpable: its `/proc/PID/environ` (which may hold an API key), `mem`
/// and `fd` become readable by root only, not by other processes of the same uid, such as the
/// commands its agents run (finding 4 of the review). It also forgoes core dumps. A process of
/// root is not stopped by it; the `bash` sandbox is what keeps a root-run command away.
pub fn protect_keys() {
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!("could not make the process non-dumpable: {e}");
    }
}

/// The key files named in the environment (see [`from_env`]), and the Redis bus's password
/// file: the file tools refuse them and the sandbox hides them.
pub fn key_files() -> Vec<PathBuf> {
    let vars = |n: &str| std::env::var(n).ok();
    ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"]
        .iter()
        .filter_map(|n| key_file_with(&vars, n))
        .chain(std::env::var_os(crate::secrets::BUS_PASSWORD_FILE_ENV).map(PathBuf::from))
        .collect()
}

/// The tail of every "no provider" error: which variables to set.
const HOW_TO_CONFIGURE: &str = "set ANTHROPIC_API_KEY (or ANTHROPIC_API_KEY_FILE; and optionally ANTHROPIC_BASE_URL) for Anthropic, \
or OPENAI_API_KEY and/or OPENAI_BASE_URL for OpenAI or a local OpenAI-compatible server, \
optionally MODEL_ID for the model; TROUPE_PROVIDER=anthropic|openai picks one explicitly, \
and TROUPE_PROVIDER=replay with TROUPE_CASSETTE=FILE plays a recording without network";

/// A message as providers send it: see [`normalize`].
pub(crate) struct WireTurn<'a> {
    pub role: Role,
    pub blocks: Vec<&'a Block>,
}

/// Puts a conversation into the shape the APIs accept: blank text blocks dropped (the Messages
/// API rejects them), messages left empty dropped, consecutive messages of one role merged (roles
/// must alternate), and in user messages the `tool_result` blocks moved first, in their order
/// (they must directly follow the `tool_use` turn).
pub(crate) fn normalize(messages: &[ChatMessage]) -> Vec<WireTurn<'_>> {
    let mut turns: Vec<WireTurn<'_>> = Vec::with_capacity(messages.len());
    for message in messages {
        let blocks: Vec<&Block> = message
            .content
            .iter()
            .filter(|b| !matches!(b, Block::Text { text } if text.trim().is_empty()))
            .collect();
        if blocks.is_empty() {
            continue;
        }
        match turns.last_mut() {
            Some(last) if last.role == message.role => last.blocks.extend(blocks),
            _ => turns.push(WireTurn {
                role: message.role,
                blocks,
            }),
        }
    }
    for turn in &mut turns {
        if turn.role == Role::User {
            // A stable sort: results keep their order, other blocks theirs.
            turn.blocks
                .sort_by_key(|b| !matches!(b, Block::ToolResult { .. }));
        }
    }
    turns
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> + use<> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn keys_come_from_files_and_credentials_too() {
        let tmp = tempfile::tempdir().unwrap();
        let key = tmp.path().join("anthropic.key");
        std::fs::write(&key, "sk-from-file\n").unwrap();
        let p = from_env_with(&vars(&[("ANTHROPIC_API_KEY_FILE", key.to_str().unwrap())])).unwrap();
        assert_eq!(p.name(), "anthropic");
        std::fs::write(tmp.path().join("openai_api_key"), "sk-cred").unwrap();
        let p = from_env_with(&vars(&[(
            "CREDENTIALS_DIRECTORY",
            tmp.path().to_str().unwrap(),
        )]))
        .unwrap();
        assert_eq!(p.name(), "openai");
        let e = from_env_with(&vars(&[("ANTHROPIC_API_KEY_FILE", "/nonexistent/key")]))
            .err()
            .unwrap();
        assert!(e.to_string().contains("cannot read the key file"), "{e}");
        // A key file where the agents' tools could read it is refused.
        let inside = std::env::current_dir()
            .unwrap()
            .join("target/troupe-test-key-inside");
        std::fs::create_dir_all(inside.parent().unwrap()).unwrap();
        std::fs::write(&inside, "sk-inside").unwrap();
        let e = from_env_with(&vars(&[(
            "ANTHROPIC_API_KEY_FILE",
            inside.to_str().unwrap(),
        )]))
        .err()
        .unwrap();
        let _ = std::fs::remove_file(&inside);
        assert!(
            e.to_string().contains("inside the working directory"),
            "{e}"
        );
        assert_eq!(e.exit_code(), 78);
    }

    fn text(t: &str) -> Block {
        Block::Text { text: t.into() }
    }

    fn result(id: &str) -> Block {
        Block::ToolResult {
            tool_use_id: id.into(),
            content: "ok".into(),
            is_error: false,
        }
    }

    fn msg(role: Role, content: Vec<Block>) -> ChatMessage {
        ChatMessage { role, content }
    }

    #[test]
    fn normalize_merges_roles_and_puts_results_first() {
        let messages = vec![
            msg(Role::User, vec![text("hi")]),
            msg(Role::Assistant, vec![text("")]),
            msg(Role::User, vec![text("inbox"), result("a")]),
            msg(Role::User, vec![result("b"), text("more")]),
            msg(Role::Assistant, vec![text("done")]),
        ];
        let turns = normalize(&messages);
        assert_eq!(turns.len(), 2);
        assert_eq!(turns[0].role, Role::User);
        let blocks: Vec<Block> = turns[0].blocks.iter().map(|b| (*b).clone()).collect();
        assert_eq!(
            blocks,
            vec![
                result("a"),
                result("b"),
                text("hi"),
                text("inbox"),
                text("more")
            ]
        );
        assert_eq!(turns[1].role, Role::Assistant);
    }

    #[test]
    fn invalid_arguments_are_recognised() {
        let bad = Block::ToolUse {
            id: "c".into(),
            name: "bash".into(),
            input: Value::String("{\"command\": ".into()),
        };
        assert_eq!(bad.invalid_tool_arguments(), Some("{\"command\": "));
        let good = Block::ToolUse {
            id: "c".into(),
            name: "bash".into(),
            input: serde_json::json!({"command": "ls"}),
        };
        assert_eq!(good.invalid_tool_arguments(), None);
    }

    #[test]
    fn no_configuration_says_what_to_set() {
        let e = from_env_with(&vars(&[])).err().expect("must fail");
        assert_eq!(e.exit_code(), 78);
        let text = e.to_string();
        for name in [
            "TROUPE_PROVIDER",
            "ANTHROPIC_API_KEY",
            "ANTHROPIC_BASE_URL",
            "OPENAI_API_KEY",
            "OPENAI_BASE_URL",
            "MODEL_ID",
            "TROUPE_PROVIDER=replay",
            "TROUPE_CASSETTE=FILE",
        ] {
            assert!(text.contains(name), "{name} missing from {text}");
        }
    }

    #[test]
    fn provider_chosen_by_key() {
        let p = from_env_with(&vars(&[
            ("ANTHROPIC_API_KEY", "sk-ant-x"),
            ("OPENAI_API_KEY", "sk-x"),
        ]))
        .expect("anthropic");
        assert_eq!(p.name(), "anthropic");
        let p = from_env_with(&vars(&[("OPENAI_API_KEY", "sk-x")])).expect("openai");
        assert_eq!(p.name(), "openai");
        let p = from_env_with(&vars(&[("OPENAI_BASE_URL", "http://127.0.0.1:8080/v1")]))
            .expect("local openai");
        assert_eq!(p.name(), "openai");
        let p = from_env_with(&vars(&[
            ("TROUPE_PROVIDER", "OpenAI"),
            ("ANTHROPIC_API_KEY", "sk-ant-x"),
            ("OPENAI_API_KEY", "sk-x"),
        ]))
        .expect("explicit");
        assert_eq!(p.name(), "openai");
    }

    #[test]
    fn explicit_provider_without_its_key_is_a_config_error() {
        let e = from_env_with(&vars(&[
            ("TROUPE_PROVIDER", "anthropic"),
            ("OPENAI_API_KEY", "sk-x"),
        ]))
        .err()
        .expect("must fail");
        assert!(e.to_string().contains("ANTHROPIC_API_KEY"), "{e}");
        assert_eq!(e.exit_code(), 78);
        let e = from_env_with(&vars(&[("TROUPE_PROVIDER", "openai")]))
            .err()
            .expect("must fail");
        assert!(e.to_string().contains("OPENAI_BASE_URL"), "{e}");
        let e = from_env_with(&vars(&[("TROUPE_PROVIDER", "replay")]))
            .err()
            .expect("must fail");
        assert!(e.to_string().contains("TROUPE_CASSETTE"), "{e}");
        let e = from_env_with(&vars(&[("TROUPE_PROVIDER", "gemini")]))
            .err()
            .expect("must fail");
        assert!(e.to_string().contains("gemini"), "{e}");
        assert_eq!(e.exit_code(), 78);
    }

    #[test]
    fn bad_knobs_are_config_errors() {
        let e = from_env_with(&vars(&[
            ("ANTHROPIC_API_KEY", "sk-ant-secret"),
            ("TROUPE_LLM_MAX_ATTEMPTS", "lots"),
        ]))
        .err()
        .expect("must fail");
        assert_eq!(e.exit_code(), 78);
        assert!(!e.to_string().contains("sk-ant-secret"));
    }

    #[test]
    fn replay_progress_and_wait_come_from_the_environment() {
        let dir =
            std::env::temp_dir().join(format!("troupe-llm-env-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let cassette = dir.join("cassette.jsonl");
        let progress = dir.join("progress");
        std::fs::write(
            &cassette,
            "{\"agent\":\"tester\",\"seq\":2,\"turn\":0,\"response\":{\"content\":[],\"stop_reason\":\"end_turn\"}}\n\
             {\"agent\":\"coder\",\"seq\":3,\"turn\":1,\"response\":{\"content\":[],\"stop_reason\":\"end_turn\"}}\n",
        )
        .expect("write");
        let (cassette_s, progress_s) = (
            cassette.display().to_string(),
            progress.display().to_string(),
        );
        let base = [
            ("TROUPE_PROVIDER", "replay"),
            ("TROUPE_CASSETTE", cassette_s.as_str()),
        ];
        let call = ChatRequest {
            model: String::new(),
            system: String::new(),
            messages: Vec::new(),
            tools: Vec::new(),
            max_tokens: 16,
            agent: "coder".into(),
            seq: 3,
        };
        // Without a progress file, turns are ignored.
        let p = from_env_with(&vars(&base)).expect("replay");
        assert!(p.complete(&call).is_ok());
        let mut ordered = base.to_vec();
        ordered.push(("TROUPE_REPLAY_PROGRESS", progress_s.as_str()));
        ordered.push(("TROUPE_REPLAY_WAIT_SECS", "1"));
        let p = from_env_with(&vars(&ordered)).expect("replay");
        let e = p.complete(&call).expect_err("turn 0 never served");
        assert!(matches!(e, LlmError::ReplayOutOfOrder { .. }), "{e:?}");
        assert!(e.to_string().contains("waited 1 s for turn 0"), "{e}");
        ordered.pop();
        ordered.push(("TROUPE_REPLAY_WAIT_SECS", "soon"));
        let e = from_env_with(&vars(&ordered)).err().expect("must fail");
        assert_eq!(e.exit_code(), 78);
        assert!(e.to_string().contains("TROUPE_REPLAY_WAIT_SECS"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let mut config = AnthropicConfig::new("sk-ant-secret");
        config.base_url = "http://127.0.0.1:1".into();
        let text = format!("{config:?}");
        assert!(!text.contains("sk-ant-secret"), "{text}");
        let config = OpenAiConfig::new(Some("sk-secret".to_string()));
        let text = format!("{config:?}");
        assert!(!text.contains("sk-secret"), "{text}");
    }
}
