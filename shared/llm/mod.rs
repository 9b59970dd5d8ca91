//! Provider-neutral LLM types and the [`Provider`] trait.
//!
//! The agent loop speaks only these types; `anthropic`, `openai` and `replay` translate them to
//! and from their wire formats. Keeping one neutral shape means a transcript recorded against one
//! provider replays against any other, and a cassette is just a list of [`ChatResponse`]s.

use serde::{Deserialize, Serialize};
use serde_json::Value;

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
