//! The Anthropic Messages API provider (`POST {base}/v1/messages`).
//!
//! Translation rules:
//!
//! - Prompt caching: three breakpoints (`cache_control: ephemeral`), never more (the API allows
//!   4): on the last tool, on the system prompt (one text block), and on the last block of the
//!   conversation, moved to the newest block on every call. The API caches the prefix ending at
//!   each breakpoint and, on the next call, finds the previous call's prefix by looking back (up
//!   to 20 blocks) from the new last-block breakpoint: each call reads what the one before wrote
//!   and pays full price only for what was added since. For that the prefix must be re-sent byte
//!   for byte: tools in the order given, every struct's fields in a fixed order, JSON inputs and
//!   schemas with sorted keys (serde_json's map), no timestamps or per-call data anywhere in the
//!   body, and earlier turns rebuilt from the same blocks each time. The `cache_control` marker
//!   itself is not part of the cached content, so moving it does not change the prefix.
//! - Messages are normalized (see `llm::normalize`): roles alternate, blank text is dropped,
//!   `tool_result` blocks lead their user message.
//! - A `tool_use` whose input is not a JSON object (an invalid-arguments call recorded from an
//!   OpenAI-style server) is sent with input `{}`; its error result follows it anyway.
//! - Response blocks other than `text` and `tool_use` (thinking, server tools) are dropped.
//! - A 429 whose `error.details.error_code` is `enforced_spend_limit_reached` is a spend cap:
//!   reported as kind `enforced_spend_limit_reached` and never retried.

use std::fmt;

use reqwest::blocking::Client;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::LlmError;
use super::http::{ApiError, Endpoint, HttpConfig, build_client};
use super::{Block, ChatRequest, ChatResponse, Provider, Role, StopReason, Usage, normalize};

/// Used when `ANTHROPIC_BASE_URL` is unset.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
/// Used when neither `MODEL_ID` nor the request names a model.
pub const DEFAULT_MODEL: &str = "claude-sonnet-4-5";
/// The `anthropic-version` header value.
pub const API_VERSION: &str = "2023-06-01";

/// Settings of the Anthropic provider.
#[derive(Clone, PartialEq)]
pub struct AnthropicConfig {
    /// `ANTHROPIC_API_KEY`. Never printed (the `Debug` output redacts it).
    pub api_key: String,
    /// `ANTHROPIC_BASE_URL`, without `/v1`; a trailing slash is ignored.
    pub base_url: String,
    /// `MODEL_ID`: the model when the request names none.
    pub model: String,
    pub http: HttpConfig,
}

impl AnthropicConfig {
    /// The defaults with this key: official endpoint, [`DEFAULT_MODEL`], SDK timeouts.
    pub fn new(api_key: impl Into<String>) -> Self {
        AnthropicConfig {
            api_key: api_key.into(),
            base_url: DEFAULT_BASE_URL.to_string(),
            model: DEFAULT_MODEL.to_string(),
            http: HttpConfig::default(),
        }
    }
}

impl fmt::Debug for AnthropicConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AnthropicConfig")
            .field("api_key", &"<redacted>")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("http", &self.http)
            .finish()
    }
}

/// The Anthropic provider: a configured client for one endpoint.
pub struct Anthropic {
    client: Client,
    url: String,
    headers: HeaderMap,
    model: String,
    config: HttpConfig,
}

impl fmt::Debug for Anthropic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Anthropic")
            .field("url", &self.url)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl Anthropic {
    /// Builds the client. Fails with [`LlmError::Config`] for an empty key or one that cannot be
    /// an HTTP header value.
    pub fn new(config: AnthropicConfig) -> Result<Self, LlmError> {
        if config.api_key.trim().is_empty() {
            return Err(LlmError::Config("ANTHROPIC_API_KEY is empty".to_string()));
        }
        let mut key = HeaderValue::from_str(config.api_key.trim()).map_err(|_| {
            LlmError::Config(
                "ANTHROPIC_API_KEY contains characters not allowed in an http header".to_string(),
            )
        })?;
        key.set_sensitive(true);
        let mut headers = HeaderMap::new();
        headers.insert(HeaderName::from_static("x-api-key"), key);
        headers.insert(
            HeaderName::from_static("anthropic-version"),
            HeaderValue::from_static(API_VERSION),
        );
        let url = format!(
            "{}/v1/messages",
            config.base_url.trim().trim_end_matches('/')
        );
        Ok(Anthropic {
            client: build_client(&config.http)?,
            url,
            headers,
            model: config.model,
            config: config.http,
        })
    }
}

impl Provider for Anthropic {
    fn name(&self) -> &'static str {
        "anthropic"
    }

    fn longest_call(&self) -> std::time::Duration {
        self.config.longest_call()
    }

    fn complete(&self, req: &ChatRequest) -> Result<ChatResponse, LlmError> {
        let model = if req.model.trim().is_empty() {
            self.model.as_str()
        } else {
            req.model.as_str()
        };
        let body = serde_json::to_vec(&wire_request(req, model))
            .map_err(|e| LlmError::Config(format!("failed to serialize the request: {e}")))?;
        let endpoint = Endpoint {
            provider: self.name(),
            client: &self.client,
            url: &self.url,
            headers: &self.headers,
            retry: &self.config.retry,
            model,
        };
        endpoint.post_json(body, parse_error, |text| parse_response(text, model))
    }
}

#[derive(Serialize, Clone, Copy)]
struct CacheControl {
    #[serde(rename = "type")]
    kind: &'static str,
}

const EPHEMERAL: CacheControl = CacheControl { kind: "ephemeral" };

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    system: Vec<WireSystem<'a>>,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
}

#[derive(Serialize)]
struct WireSystem<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'a str,
    cache_control: CacheControl,
}

#[derive(Serialize)]
struct WireTool<'a> {
    name: &'a str,
    description: &'a str,
    input_schema: &'a Value,
    #[serde(skip_serializing_if = "Option::is_none")]
    cache_control: Option<CacheControl>,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: Vec<WireBlock<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireBlock<'a> {
    Text {
        text: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: &'a Value,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: &'a str,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        is_error: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        cache_control: Option<CacheControl>,
    },
}

impl WireBlock<'_> {
    /// Makes this block a cache breakpoint.
    fn mark(&mut self) {
        match self {
            WireBlock::Text { cache_control, .. }
            | WireBlock::ToolUse { cache_control, .. }
            | WireBlock::ToolResult { cache_control, .. } => *cache_control = Some(EPHEMERAL),
        }
    }
}

static EMPTY_OBJECT: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| Value::Object(serde_json::Map::new()));

/// The Messages API request body for `req`, with `model` already resolved.
pub fn request_body(req: &ChatRequest, model: &str) -> Value {
    serde_json::to_value(wire_request(req, model))
        .expect("a request of strings, numbers and JSON values always serializes")
}

fn wire_request<'a>(req: &'a ChatRequest, model: &'a str) -> WireRequest<'a> {
    let system = if req.system.trim().is_empty() {
        Vec::new()
    } else {
        vec![WireSystem {
            kind: "text",
            text: &req.system,
            cache_control: EPHEMERAL,
        }]
    };
    let last_tool = req.tools.len().saturating_sub(1);
    let tools = req
        .tools
        .iter()
        .enumerate()
        .map(|(i, t)| WireTool {
            name: &t.name,
            description: &t.description,
            input_schema: &t.input_schema,
            cache_control: (i == last_tool).then_some(EPHEMERAL),
        })
        .collect();
    let mut messages: Vec<WireMessage<'a>> = normalize(&req.messages)
        .into_iter()
        .map(|turn| WireMessage {
            role: match turn.role {
                Role::User => "user",
                Role::Assistant => "assistant",
            },
            content: turn.blocks.into_iter().map(wire_block).collect(),
        })
        .collect();
    // The moving breakpoint: the newest block, so the next call reads this whole prefix.
    if let Some(last) = messages.last_mut().and_then(|m| m.content.last_mut()) {
        last.mark();
    }
    WireRequest {
        model,
        max_tokens: req.max_tokens,
        system,
        messages,
        tools,
    }
}

fn wire_block(block: &Block) -> WireBlock<'_> {
    match block {
        Block::Text { text } => WireBlock::Text {
            text,
            cache_control: None,
        },
        Block::ToolUse { id, name, input } => WireBlock::ToolUse {
            id,
            name,
            input: if input.is_object() {
                input
            } else {
                &EMPTY_OBJECT
            },
            cache_control: None,
        },
        Block::ToolResult {
            tool_use_id,
            content,
            is_error,
        } => WireBlock::ToolResult {
            tool_use_id,
            content,
            is_error: *is_error,
            cache_control: None,
        },
    }
}

#[derive(Deserialize)]
struct WireResponse {
    content: Vec<Value>,
    stop_reason: Option<String>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize, Default)]
struct WireUsage {
    #[serde(default)]
    input_tokens: Option<u64>,
    #[serde(default)]
    output_tokens: Option<u64>,
    #[serde(default)]
    cache_creation_input_tokens: Option<u64>,
    #[serde(default)]
    cache_read_input_tokens: Option<u64>,
}

/// Parses a 200 body. `Err` says what is wrong (not JSON, missing `content` or `stop_reason`, a
/// malformed block); the caller treats it as transient.
pub fn parse_response(text: &str, model: &str) -> Result<ChatResponse, String> {
    let wire: WireResponse =
        serde_json::from_str(text).map_err(|e| format!("body is not a messages response: {e}"))?;
    let mut content = Vec::with_capacity(wire.content.len());
    for block in &wire.content {
        match block.get("type").and_then(Value::as_str) {
            Some("text") => {
                let text = block
                    .get("text")
                    .and_then(Value::as_str)
                    .ok_or("text block without text")?;
                content.push(Block::Text {
                    text: text.to_string(),
                });
            }
            Some("tool_use") => {
                let id = block
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or("tool_use block without id")?;
                let name = block
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or("tool_use block without name")?;
                let input = match block.get("input") {
                    None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
                    Some(v) => v.clone(),
                };
                content.push(Block::ToolUse {
                    id: id.to_string(),
                    name: name.to_string(),
                    input,
                });
            }
            other => tracing::debug!(block_type = ?other, "ignoring unknown content block"),
        }
    }
    let stop_reason = match wire.stop_reason.as_deref() {
        Some(reason) => stop_reason(reason),
        None => return Err("response has no stop_reason".to_string()),
    };
    let usage = wire.usage.unwrap_or_default();
    Ok(ChatResponse {
        content,
        stop_reason,
        usage: Usage {
            input_tokens: usage.input_tokens.unwrap_or(0),
            output_tokens: usage.output_tokens.unwrap_or(0),
            cache_creation_input_tokens: usage.cache_creation_input_tokens.unwrap_or(0),
            cache_read_input_tokens: usage.cache_read_input_tokens.unwrap_or(0),
        },
        model: wire
            .model
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| model.to_string()),
    })
}

fn stop_reason(reason: &str) -> StopReason {
    match reason {
        "end_turn" => StopReason::EndTurn,
        "tool_use" => StopReason::ToolUse,
        "max_tokens" => StopReason::MaxTokens,
        "stop_sequence" => StopReason::StopSequence,
        "pause_turn" => StopReason::PauseTurn,
        "refusal" => StopReason::Refusal,
        "model_context_window_exceeded" => StopReason::ContextWindowExceeded,
        other => StopReason::Other(other.to_string()),
    }
}

/// Parses `{"type":"error","error":{"type","message","details":{"error_code"}}}`. The kind is
/// `details.error_code` when present (this is how a spend cap shows), else `error.type`.
pub(crate) fn parse_error(text: &str) -> Option<ApiError> {
    let body: Value = serde_json::from_str(text).ok()?;
    let error = body.get("error")?;
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message")
        .to_string();
    let kind = error
        .get("details")
        .and_then(|d| d.get("error_code"))
        .and_then(Value::as_str)
        .or_else(|| error.get("type").and_then(Value::as_str))
        .map(str::to_string);
    Some(ApiError { kind, message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ChatMessage, ToolSpec};
    use serde_json::json;

    fn tool(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.into(),
            description: format!("the {name} tool"),
            input_schema: json!({"type": "object", "properties": {"x": {"type": "string"}}}),
        }
    }

    fn request() -> ChatRequest {
        ChatRequest {
            model: String::new(),
            system: "You are alice.".into(),
            messages: vec![
                ChatMessage {
                    role: Role::User,
                    content: vec![Block::Text {
                        text: "list files".into(),
                    }],
                },
                ChatMessage {
                    role: Role::Assistant,
                    content: vec![Block::ToolUse {
                        id: "toolu_1".into(),
                        name: "bash".into(),
                        input: json!({"command": "ls"}),
                    }],
                },
                ChatMessage {
                    role: Role::User,
                    content: vec![
                        Block::Text {
                            text: "<inbox>hi</inbox>".into(),
                        },
                        Block::ToolResult {
                            tool_use_id: "toolu_1".into(),
                            content: "a\nb".into(),
                            is_error: true,
                        },
                    ],
                },
            ],
            tools: vec![tool("bash"), tool("read_file")],
            max_tokens: 1024,
            agent: "alice".into(),
            seq: 3,
        }
    }

    #[test]
    fn request_body_has_cache_breakpoints_and_wire_blocks() {
        let body = request_body(&request(), "claude-test");
        assert_eq!(
            body,
            json!({
                "model": "claude-test",
                "max_tokens": 1024,
                "system": [{"type": "text", "text": "You are alice.", "cache_control": {"type": "ephemeral"}}],
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "list files"}]},
                    {"role": "assistant", "content": [
                        {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}}
                    ]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a\nb", "is_error": true},
                        {"type": "text", "text": "<inbox>hi</inbox>", "cache_control": {"type": "ephemeral"}}
                    ]}
                ],
                "tools": [
                    {"name": "bash", "description": "the bash tool", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}},
                    {"name": "read_file", "description": "the read_file tool", "input_schema": {"type": "object", "properties": {"x": {"type": "string"}}}, "cache_control": {"type": "ephemeral"}}
                ]
            })
        );
        // No agent or seq leaks onto the wire.
        assert!(body.get("agent").is_none() && body.get("seq").is_none());
    }

    #[test]
    fn serialization_is_stable() {
        let req = request();
        let a = serde_json::to_string(&wire_request(&req, "m")).expect("json");
        let b = serde_json::to_string(&wire_request(&req.clone(), "m")).expect("json");
        assert_eq!(a, b);
        // The bytes on the wire: tools last, in the given order, breakpoint on the last one.
        let tools = &a[a.find(",\"tools\":").expect("tools")..];
        let bash_at = tools.find("\"name\":\"bash\"").expect("bash");
        let read_at = tools.find("\"name\":\"read_file\"").expect("read_file");
        assert!(bash_at < read_at);
        assert_eq!(tools.matches("cache_control").count(), 1);
        assert!(
            tools.ends_with("\"cache_control\":{\"type\":\"ephemeral\"}}]}"),
            "{tools}"
        );
    }

    const MARK: &str = ",\"cache_control\":{\"type\":\"ephemeral\"}";

    /// `req` one step further: the model called a tool and its result came back.
    fn one_step_more(req: &ChatRequest, n: usize) -> ChatRequest {
        let mut next = req.clone();
        let id = format!("toolu_step{n}");
        next.messages.push(ChatMessage {
            role: Role::Assistant,
            content: vec![Block::ToolUse {
                id: id.clone(),
                name: "bash".into(),
                input: json!({"command": format!("echo {n}"), "b": 1, "a": [true, null]}),
            }],
        });
        next.messages.push(ChatMessage {
            role: Role::User,
            content: vec![Block::ToolResult {
                tool_use_id: id,
                content: format!("{n}\n"),
                is_error: false,
            }],
        });
        next
    }

    #[test]
    fn the_last_block_is_a_breakpoint_and_there_are_never_more_than_four() {
        let mut req = request();
        for n in 0..25 {
            let body = serde_json::to_string(&wire_request(&req, "m")).expect("json");
            // Tools, system, last block: 3 of the 4 the API allows.
            assert_eq!(body.matches("cache_control").count(), 3, "{body}");
            let v: Value = serde_json::from_str(&body).expect("json");
            let messages = v["messages"].as_array().expect("messages");
            let marked: Vec<(usize, usize)> = messages
                .iter()
                .enumerate()
                .flat_map(|(i, m)| {
                    let blocks = m["content"].as_array().expect("blocks");
                    blocks
                        .iter()
                        .enumerate()
                        .filter(|(_, b)| b.get("cache_control").is_some())
                        .map(move |(j, _)| (i, j))
                })
                .collect();
            let last = messages.len() - 1;
            let last_block = messages[last]["content"].as_array().expect("blocks").len() - 1;
            assert_eq!(marked, vec![(last, last_block)]);
            req = one_step_more(&req, n);
        }
        // Without tools or system only the conversation's breakpoint is left.
        req.system = String::new();
        req.tools.clear();
        let body = serde_json::to_string(&wire_request(&req, "m")).expect("json");
        assert_eq!(body.matches("cache_control").count(), 1);
        // No conversation: only tools and system.
        let mut req = request();
        req.messages.clear();
        let body = serde_json::to_string(&wire_request(&req, "m")).expect("json");
        assert_eq!(body.matches("cache_control").count(), 2);
    }

    #[test]
    fn earlier_turns_are_resent_byte_for_byte() {
        // The bytes of call n+1, with the breakpoint markers taken out, begin with the bytes of
        // call n up to the end of its last message: the prefix the API cached is found again.
        let mut req = request();
        let mut before = serde_json::to_string(&wire_request(&req, "m")).expect("json");
        for n in 0..10 {
            req = one_step_more(&req, n);
            let after = serde_json::to_string(&wire_request(&req, "m")).expect("json");
            let prev = before.replace(MARK, "");
            let end = prev.find("],\"tools\":").expect("messages end");
            let now = after.replace(MARK, "");
            assert!(now.starts_with(&prev[..end]), "{prev}\n{now}");
            assert!(now[end..].starts_with(",{\"role\":\"assistant\""));
            // The same request twice: the same bytes (no clock, no per-call state).
            let again = serde_json::to_string(&wire_request(&req.clone(), "m")).expect("json");
            assert_eq!(after, again);
            before = after;
        }
    }

    #[test]
    fn empty_system_and_tools_are_left_out() {
        let mut req = request();
        req.system = String::new();
        req.tools.clear();
        let body = request_body(&req, "m");
        assert!(body.get("system").is_none());
        assert!(body.get("tools").is_none());
    }

    #[test]
    fn non_object_tool_input_is_sent_as_empty_object() {
        let mut req = request();
        req.messages[1].content[0] = Block::ToolUse {
            id: "call_1".into(),
            name: "bash".into(),
            input: Value::String("{broken".into()),
        };
        let body = request_body(&req, "m");
        assert_eq!(body["messages"][1]["content"][0]["input"], json!({}));
    }

    #[test]
    fn parses_text_tool_use_and_usage() {
        let body = r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-x",
            "content":[{"type":"thinking","thinking":"hm","signature":"s"},
                       {"type":"text","text":"Let me look."},
                       {"type":"tool_use","id":"toolu_9","name":"bash","input":{"command":"ls -la"}}],
            "stop_reason":"tool_use","stop_sequence":null,
            "usage":{"input_tokens":12,"output_tokens":34,"cache_creation_input_tokens":2000,"cache_read_input_tokens":null}}"#;
        let r = parse_response(body, "fallback").expect("parses");
        assert_eq!(
            r.content,
            vec![
                Block::Text {
                    text: "Let me look.".into()
                },
                Block::ToolUse {
                    id: "toolu_9".into(),
                    name: "bash".into(),
                    input: json!({"command": "ls -la"})
                }
            ]
        );
        assert_eq!(r.stop_reason, StopReason::ToolUse);
        assert_eq!(
            r.usage,
            Usage {
                input_tokens: 12,
                output_tokens: 34,
                cache_creation_input_tokens: 2000,
                cache_read_input_tokens: 0
            }
        );
        assert_eq!(r.model, "claude-x");
    }

    #[test]
    fn parses_every_stop_reason() {
        for (wire, reason) in [
            ("end_turn", StopReason::EndTurn),
            ("max_tokens", StopReason::MaxTokens),
            ("stop_sequence", StopReason::StopSequence),
            ("pause_turn", StopReason::PauseTurn),
            ("refusal", StopReason::Refusal),
            (
                "model_context_window_exceeded",
                StopReason::ContextWindowExceeded,
            ),
            ("brand_new", StopReason::Other("brand_new".into())),
        ] {
            let body = format!(r#"{{"content":[],"stop_reason":"{wire}"}}"#);
            let r = parse_response(&body, "m").expect("parses");
            assert_eq!(r.stop_reason, reason);
            assert!(r.content.is_empty());
            assert_eq!(r.model, "m");
        }
    }

    #[test]
    fn rejects_broken_bodies() {
        assert!(parse_response(r#"{"content":[{"type":"text","te"#, "m").is_err());
        assert!(parse_response(r#"{"stop_reason":"end_turn"}"#, "m").is_err());
        assert!(parse_response(r#"{"content":[]}"#, "m").is_err());
        assert!(
            parse_response(
                r#"{"content":[{"type":"tool_use","name":"x"}],"stop_reason":"tool_use"}"#,
                "m"
            )
            .is_err()
        );
        assert!(parse_response("<html>", "m").is_err());
    }

    #[test]
    fn parses_errors_and_spend_caps() {
        let e = parse_error(r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},"request_id":"req_1"}"#)
            .expect("error");
        assert_eq!(e.kind.as_deref(), Some("overloaded_error"));
        assert_eq!(e.message, "Overloaded");
        let e = parse_error(r#"{"type":"error","error":{"type":"rate_limit_error","message":"You have reached your specified workspace API usage limits.","details":{"error_code":"enforced_spend_limit_reached"}}}"#)
            .expect("error");
        assert_eq!(e.kind.as_deref(), Some("enforced_spend_limit_reached"));
        assert!(parse_error("Bad Gateway").is_none());
    }

    #[test]
    fn bad_keys_are_config_errors() {
        let e = Anthropic::new(AnthropicConfig::new("  ")).expect_err("empty");
        assert_eq!(e.exit_code(), 78);
        let e = Anthropic::new(AnthropicConfig::new("sk-ant\nsecret")).expect_err("newline");
        assert!(!e.to_string().contains("secret"), "{e}");
    }
}
