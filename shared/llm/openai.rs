//! The OpenAI Chat Completions provider (`POST {base}/chat/completions`), which also speaks to
//! llama.cpp's server, vLLM and Ollama.
//!
//! Translation rules, request side:
//!
//! - The system prompt is the first message, `role: system`.
//! - An assistant turn becomes one message: its text (blocks joined by a blank line, or `null`
//!   when there is none) plus `tool_calls` whose `arguments` is the input as a JSON string. An
//!   input kept as a raw string (invalid arguments, see below) is sent back verbatim.
//! - A user turn becomes one `role: tool` message per `tool_result`, in order, then one user
//!   message with its text, if any. The API has no error flag on tool results: `is_error` results
//!   go out as their text, which the tools layer words as an error.
//! - `max_tokens` is always sent; `tools` and `tool_choice: "auto"` only when there are tools.
//!
//! Response side, tolerant of what local servers do:
//!
//! - `arguments` as a JSON string is parsed; when it is not a JSON object the raw text is kept
//!   as `input = Value::String(raw)` (see [`Block::invalid_tool_arguments`]) so the tools layer
//!   can tell the model its arguments were invalid. An object is taken as is; empty, missing or
//!   `null` arguments become `{}`.
//! - A tool call without an id gets `call_<uuid>`.
//! - `finish_reason`: `stop` -> EndTurn, `length` -> MaxTokens, `tool_calls` (and the legacy
//!   `function_call`) -> ToolUse, `content_filter` -> Refusal. Servers that say `stop` (or
//!   nothing) while returning tool calls get ToolUse, since the calls must be answered.
//!   A `message.refusal` text is kept as text and makes the reason Refusal.
//! - Usage: `input_tokens = prompt_tokens - cached_tokens`, `cache_read_input_tokens =
//!   cached_tokens` (so input + cache read = prompt, as in the Anthropic accounting),
//!   `output_tokens = completion_tokens`, no cache writes.
//! - Errors: `{"error":{"message","type","code"}}` with a string or numeric code, a bare
//!   `{"error":"text"}`, or vLLM's top-level `{"message","type","code"}`. The kind is the string
//!   code (`insufficient_quota` is never retried), else the type.

use std::fmt;

use reqwest::blocking::Client;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::error::LlmError;
use super::http::{ApiError, Endpoint, HttpConfig, build_client};
use super::{Block, ChatRequest, ChatResponse, Provider, Role, StopReason, Usage, normalize};

/// Used when `OPENAI_BASE_URL` is unset.
pub const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";
/// Used when neither `MODEL_ID` nor the request names a model.
pub const DEFAULT_MODEL: &str = "gpt-4o-mini";

/// Settings of the OpenAI provider.
#[derive(Clone, PartialEq)]
pub struct OpenAiConfig {
    /// `OPENAI_API_KEY`; `None` sends no `Authorization` header (local servers). Never printed.
    pub api_key: Option<String>,
    /// `OPENAI_BASE_URL`, with `/v1`; a trailing slash is ignored.
    pub base_url: String,
    /// `MODEL_ID`: the model when the request names none.
    pub model: String,
    pub http: HttpConfig,
}

impl OpenAiConfig {
    /// The defaults with this key: official endpoint, [`DEFAULT_MODEL`], SDK timeouts.
    pub fn new(api_key: Option<String>) -> Self {
        OpenAiConfig {
            api_key,
            base_url: DEFAULT_BASE_URL.to_string(),
            model: DEFAULT_MODEL.to_string(),
            http: HttpConfig::default(),
        }
    }
}

impl fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiConfig")
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("http", &self.http)
            .finish()
    }
}

/// The OpenAI-compatible provider: a configured client for one endpoint.
pub struct OpenAi {
    client: Client,
    url: String,
    headers: HeaderMap,
    model: String,
    config: HttpConfig,
}

impl fmt::Debug for OpenAi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAi")
            .field("url", &self.url)
            .field("model", &self.model)
            .finish_non_exhaustive()
    }
}

impl OpenAi {
    /// Builds the client. Fails with [`LlmError::Config`] for a key that cannot be an HTTP
    /// header value.
    pub fn new(config: OpenAiConfig) -> Result<Self, LlmError> {
        let mut headers = HeaderMap::new();
        if let Some(key) = config
            .api_key
            .as_deref()
            .map(str::trim)
            .filter(|k| !k.is_empty())
        {
            let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                LlmError::Config(
                    "OPENAI_API_KEY contains characters not allowed in an http header".to_string(),
                )
            })?;
            value.set_sensitive(true);
            headers.insert(AUTHORIZATION, value);
        }
        let url = format!(
            "{}/chat/completions",
            config.base_url.trim().trim_end_matches('/')
        );
        Ok(OpenAi {
            client: build_client(&config.http)?,
            url,
            headers,
            model: config.model,
            config: config.http,
        })
    }
}

impl Provider for OpenAi {
    fn name(&self) -> &'static str {
        "openai"
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

#[derive(Serialize)]
struct WireRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tools: Vec<WireTool<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_choice: Option<&'static str>,
}

#[derive(Serialize)]
struct WireTool<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireFunctionSpec<'a>,
}

#[derive(Serialize)]
struct WireFunctionSpec<'a> {
    name: &'a str,
    description: &'a str,
    parameters: &'a Value,
}

#[derive(Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    /// Serialized as `null` for an assistant message that only calls tools.
    content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<WireToolCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
}

impl WireMessage<'_> {
    fn plain(role: &'static str, content: String) -> Self {
        WireMessage {
            role,
            content: Some(content),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

#[derive(Serialize)]
struct WireToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: WireCall<'a>,
}

#[derive(Serialize)]
struct WireCall<'a> {
    name: &'a str,
    arguments: String,
}

/// The Chat Completions request body for `req`, with `model` already resolved.
pub fn request_body(req: &ChatRequest, model: &str) -> Value {
    serde_json::to_value(wire_request(req, model))
        .expect("a request of strings, numbers and JSON values always serializes")
}

fn wire_request<'a>(req: &'a ChatRequest, model: &'a str) -> WireRequest<'a> {
    let mut messages = Vec::with_capacity(req.messages.len() + 1);
    if !req.system.trim().is_empty() {
        messages.push(WireMessage::plain("system", req.system.clone()));
    }
    for turn in normalize(&req.messages) {
        let mut texts = Vec::new();
        match turn.role {
            Role::Assistant => {
                let mut calls = Vec::new();
                for block in turn.blocks {
                    match block {
                        Block::Text { text } => texts.push(text.as_str()),
                        Block::ToolUse { id, name, input } => calls.push(WireToolCall {
                            id,
                            kind: "function",
                            function: WireCall {
                                name,
                                arguments: match input {
                                    Value::String(raw) => raw.clone(),
                                    other => other.to_string(),
                                },
                            },
                        }),
                        // Not expected in an assistant turn; there is nowhere to put it.
                        Block::ToolResult { .. } => {}
                    }
                }
                let content = (!texts.is_empty()).then(|| texts.join("\n\n"));
                messages.push(WireMessage {
                    role: "assistant",
                    content: if content.is_none() && calls.is_empty() {
                        Some(String::new())
                    } else {
                        content
                    },
                    tool_calls: calls,
                    tool_call_id: None,
                });
            }
            Role::User => {
                for block in turn.blocks {
                    match block {
                        Block::ToolResult {
                            tool_use_id,
                            content,
                            ..
                        } => messages.push(WireMessage {
                            role: "tool",
                            content: Some(content.clone()),
                            tool_calls: Vec::new(),
                            tool_call_id: Some(tool_use_id.as_str()),
                        }),
                        Block::Text { text } => texts.push(text.as_str()),
                        // Not expected in a user turn; there is nowhere to put it.
                        Block::ToolUse { .. } => {}
                    }
                }
                if !texts.is_empty() {
                    messages.push(WireMessage::plain("user", texts.join("\n\n")));
                }
            }
        }
    }
    let tools: Vec<WireTool<'_>> = req
        .tools
        .iter()
        .map(|t| WireTool {
            kind: "function",
            function: WireFunctionSpec {
                name: &t.name,
                description: &t.description,
                parameters: &t.input_schema,
            },
        })
        .collect();
    let tool_choice = (!tools.is_empty()).then_some("auto");
    WireRequest {
        model,
        max_tokens: req.max_tokens,
        messages,
        tools,
        tool_choice,
    }
}

#[derive(Deserialize)]
struct WireResponse {
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    model: Option<String>,
}

#[derive(Deserialize)]
struct WireChoice {
    message: WireReply,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireReply {
    /// A string, `null`, or (some servers) an array of `{"type":"text","text":...}` parts.
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<WireReplyCall>>,
    #[serde(default)]
    refusal: Option<String>,
}

#[derive(Deserialize)]
struct WireReplyCall {
    #[serde(default)]
    id: Option<String>,
    function: WireReplyFunction,
}

#[derive(Deserialize)]
struct WireReplyFunction {
    name: String,
    #[serde(default)]
    arguments: Option<Value>,
}

#[derive(Deserialize, Default)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<WirePromptDetails>,
}

#[derive(Deserialize, Default)]
struct WirePromptDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

/// Parses a 200 body. `Err` says what is wrong (not JSON, no choices, a tool call without a
/// function name); the caller treats it as transient.
pub fn parse_response(text: &str, model: &str) -> Result<ChatResponse, String> {
    let wire: WireResponse =
        serde_json::from_str(text).map_err(|e| format!("body is not a chat completion: {e}"))?;
    let choice = wire
        .choices
        .into_iter()
        .next()
        .ok_or("response has no choices")?;
    let mut content = Vec::new();
    let text = match choice.message.content {
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    };
    if !text.is_empty() {
        content.push(Block::Text { text });
    }
    let refused = match choice.message.refusal.filter(|r| !r.is_empty()) {
        Some(refusal) => {
            content.push(Block::Text { text: refusal });
            true
        }
        None => false,
    };
    let calls = choice.message.tool_calls.unwrap_or_default();
    let has_calls = !calls.is_empty();
    for call in calls {
        let id = call
            .id
            .filter(|id| !id.trim().is_empty())
            .unwrap_or_else(|| format!("call_{}", uuid::Uuid::new_v4().simple()));
        content.push(Block::ToolUse {
            id,
            name: call.function.name,
            input: arguments(call.function.arguments),
        });
    }
    let stop_reason = match choice.finish_reason.as_deref() {
        _ if refused => StopReason::Refusal,
        Some("length") => StopReason::MaxTokens,
        Some("content_filter") => StopReason::Refusal,
        Some("tool_calls" | "function_call") => StopReason::ToolUse,
        Some("stop") | None if has_calls => StopReason::ToolUse,
        Some("stop") | None => StopReason::EndTurn,
        Some(other) => StopReason::Other(other.to_string()),
    };
    let usage = wire.usage.unwrap_or_default();
    let prompt = usage.prompt_tokens.unwrap_or(0);
    let cached = usage
        .prompt_tokens_details
        .and_then(|d| d.cached_tokens)
        .unwrap_or(0)
        .min(prompt);
    Ok(ChatResponse {
        content,
        stop_reason,
        usage: Usage {
            input_tokens: prompt - cached,
            output_tokens: usage.completion_tokens.unwrap_or(0),
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: cached,
        },
        model: wire
            .model
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| model.to_string()),
    })
}

/// Tool call arguments to a tool input: see the module docs.
fn arguments(raw: Option<Value>) -> Value {
    let empty = || Value::Object(serde_json::Map::new());
    match raw {
        None | Some(Value::Null) => empty(),
        Some(Value::Object(map)) => Value::Object(map),
        Some(Value::String(text)) => {
            if text.trim().is_empty() {
                return empty();
            }
            match serde_json::from_str::<Value>(&text) {
                Ok(Value::Object(map)) => Value::Object(map),
                Ok(Value::Null) => empty(),
                _ => Value::String(text),
            }
        }
        Some(other) => Value::String(other.to_string()),
    }
}

/// Parses the error body shapes of OpenAI and the local servers (module docs).
pub(crate) fn parse_error(text: &str) -> Option<ApiError> {
    let body: Value = serde_json::from_str(text).ok()?;
    let error = match body.get("error") {
        Some(Value::String(message)) => {
            return Some(ApiError {
                kind: None,
                message: message.clone(),
            });
        }
        Some(error @ Value::Object(_)) => error,
        _ if body.get("message").is_some() => &body,
        _ => return None,
    };
    let message = error
        .get("message")
        .and_then(Value::as_str)
        .unwrap_or("no message")
        .to_string();
    let kind = error
        .get("code")
        .and_then(Value::as_str)
        .filter(|c| !c.is_empty())
        .or_else(|| error.get("type").and_then(Value::as_str))
        .map(str::to_string);
    Some(ApiError { kind, message })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ChatMessage, ToolSpec};
    use serde_json::json;

    fn request() -> ChatRequest {
        ChatRequest {
            model: "gpt-test".into(),
            system: "You are bob.".into(),
            messages: vec![
                ChatMessage {
                    role: Role::User,
                    content: vec![Block::Text { text: "go".into() }],
                },
                ChatMessage {
                    role: Role::Assistant,
                    content: vec![
                        Block::Text {
                            text: "Two things.".into(),
                        },
                        Block::ToolUse {
                            id: "call_a".into(),
                            name: "read_file".into(),
                            input: json!({"path": "a.txt"}),
                        },
                        Block::ToolUse {
                            id: "call_b".into(),
                            name: "bash".into(),
                            input: Value::String("{\"command\": \"ls".into()),
                        },
                    ],
                },
                ChatMessage {
                    role: Role::User,
                    content: vec![
                        Block::Text {
                            text: "<inbox>x</inbox>".into(),
                        },
                        Block::ToolResult {
                            tool_use_id: "call_a".into(),
                            content: "hello".into(),
                            is_error: false,
                        },
                        Block::ToolResult {
                            tool_use_id: "call_b".into(),
                            content: "invalid tool arguments".into(),
                            is_error: true,
                        },
                    ],
                },
            ],
            tools: vec![ToolSpec {
                name: "bash".into(),
                description: "run".into(),
                input_schema: json!({"type": "object"}),
            }],
            max_tokens: 256,
            agent: "bob".into(),
            seq: 0,
        }
    }

    #[test]
    fn request_body_converts_turns() {
        let req = request();
        let body = request_body(&req, &req.model);
        assert_eq!(
            body,
            json!({
                "model": "gpt-test",
                "max_tokens": 256,
                "messages": [
                    {"role": "system", "content": "You are bob."},
                    {"role": "user", "content": "go"},
                    {"role": "assistant", "content": "Two things.", "tool_calls": [
                        {"id": "call_a", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"a.txt\"}"}},
                        {"id": "call_b", "type": "function", "function": {"name": "bash", "arguments": "{\"command\": \"ls"}}
                    ]},
                    {"role": "tool", "content": "hello", "tool_call_id": "call_a"},
                    {"role": "tool", "content": "invalid tool arguments", "tool_call_id": "call_b"},
                    {"role": "user", "content": "<inbox>x</inbox>"}
                ],
                "tools": [{"type": "function", "function": {"name": "bash", "description": "run", "parameters": {"type": "object"}}}],
                "tool_choice": "auto"
            })
        );
    }

    #[test]
    fn tool_only_assistant_turn_has_null_content_and_no_tools_means_no_tool_choice() {
        let mut req = request();
        req.messages[1].content.remove(0);
        req.tools.clear();
        let body = request_body(&req, "m");
        assert_eq!(body["messages"][2]["content"], Value::Null);
        assert!(body.get("tools").is_none());
        assert!(body.get("tool_choice").is_none());
    }

    #[test]
    fn parses_tool_calls_with_quirks() {
        let body = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"llama",
            "choices":[{"index":0,"finish_reason":"tool_calls","message":{"role":"assistant","content":null,
              "tool_calls":[
                {"id":"call_1","type":"function","function":{"name":"bash","arguments":"{\"command\":\"ls\"}"}},
                {"id":"call_2","type":"function","function":{"name":"bash","arguments":"{\"command\": \"ls"}},
                {"type":"function","function":{"name":"read_file","arguments":{"path":"x"}}},
                {"id":"","type":"function","function":{"name":"read_inbox","arguments":""}},
                {"id":"call_5","type":"function","function":{"name":"read_inbox"}},
                {"id":"call_6","type":"function","function":{"name":"bash","arguments":"[1,2]"}}
              ]}}],
            "usage":{"prompt_tokens":100,"completion_tokens":20,"prompt_tokens_details":{"cached_tokens":64}}}"#;
        let r = parse_response(body, "m").expect("parses");
        assert_eq!(r.stop_reason, StopReason::ToolUse);
        assert_eq!(r.model, "llama");
        let calls: Vec<(&str, &str, &Value)> = r
            .content
            .iter()
            .map(|b| match b {
                Block::ToolUse { id, name, input } => (id.as_str(), name.as_str(), input),
                other => panic!("unexpected {other:?}"),
            })
            .collect();
        assert_eq!(calls.len(), 6);
        assert_eq!(calls[0], ("call_1", "bash", &json!({"command": "ls"})));
        assert_eq!(calls[1].2, &Value::String("{\"command\": \"ls".into()));
        assert_eq!(
            r.content[1].invalid_tool_arguments(),
            Some("{\"command\": \"ls")
        );
        assert_eq!(calls[2].2, &json!({"path": "x"}));
        assert!(calls[2].0.starts_with("call_") && calls[2].0.len() > 20);
        assert!(calls[3].0.starts_with("call_") && calls[3].0 != calls[2].0);
        assert_eq!(calls[3].2, &json!({}));
        assert_eq!(calls[4].2, &json!({}));
        assert_eq!(calls[5].2, &Value::String("[1,2]".into()));
        assert_eq!(
            r.usage,
            Usage {
                input_tokens: 36,
                output_tokens: 20,
                cache_creation_input_tokens: 0,
                cache_read_input_tokens: 64
            }
        );
    }

    #[test]
    fn cached_prompt_tokens_are_cache_reads() {
        let usage = |u: &str| {
            let body = format!(
                r#"{{"choices":[{{"finish_reason":"stop","message":{{"content":"ok"}}}}],"usage":{u}}}"#
            );
            parse_response(&body, "m").expect("parses").usage
        };
        // What the server read from its prefix cache lands in the ledger as a cache read; the
        // rest of the prompt is plain input, and there is no write fee.
        assert_eq!(
            usage(
                r#"{"prompt_tokens":2048,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":1920}}"#
            ),
            Usage {
                input_tokens: 128,
                output_tokens: 7,
                cache_creation_input_tokens: 0,
                cache_read_input_tokens: 1920
            }
        );
        // Servers without the details (llama.cpp, older vLLM) or with null: nothing cached.
        for u in [
            r#"{"prompt_tokens":50,"completion_tokens":1}"#,
            r#"{"prompt_tokens":50,"completion_tokens":1,"prompt_tokens_details":null}"#,
            r#"{"prompt_tokens":50,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":null}}"#,
        ] {
            let got = usage(u);
            assert_eq!(
                (got.input_tokens, got.cache_read_input_tokens),
                (50, 0),
                "{u}"
            );
        }
        // A server claiming more cached than prompt tokens is capped, never a negative input.
        let got = usage(r#"{"prompt_tokens":10,"prompt_tokens_details":{"cached_tokens":64}}"#);
        assert_eq!((got.input_tokens, got.cache_read_input_tokens), (0, 10));
    }

    #[test]
    fn maps_finish_reasons() {
        let parse = |reason: &str, calls: bool| {
            let calls = if calls {
                r#","tool_calls":[{"id":"c","function":{"name":"bash","arguments":"{}"}}]"#
            } else {
                ""
            };
            let body = format!(
                r#"{{"choices":[{{"finish_reason":{reason},"message":{{"content":"hi"{calls}}}}}]}}"#
            );
            parse_response(&body, "m").expect("parses").stop_reason
        };
        assert_eq!(parse("\"stop\"", false), StopReason::EndTurn);
        assert_eq!(parse("\"length\"", false), StopReason::MaxTokens);
        assert_eq!(parse("\"length\"", true), StopReason::MaxTokens);
        assert_eq!(parse("\"tool_calls\"", true), StopReason::ToolUse);
        assert_eq!(parse("\"content_filter\"", false), StopReason::Refusal);
        assert_eq!(parse("\"stop\"", true), StopReason::ToolUse);
        assert_eq!(parse("null", false), StopReason::EndTurn);
        assert_eq!(parse("\"eos\"", false), StopReason::Other("eos".into()));
    }

    #[test]
    fn parses_text_parts_and_refusals() {
        let r = parse_response(
            r#"{"choices":[{"finish_reason":"stop","message":{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}}]}"#,
            "m",
        )
        .expect("parses");
        assert_eq!(r.content, vec![Block::Text { text: "ab".into() }]);
        let r = parse_response(
            r#"{"choices":[{"finish_reason":"stop","message":{"content":null,"refusal":"I can't help with that."}}]}"#,
            "m",
        )
        .expect("parses");
        assert_eq!(r.stop_reason, StopReason::Refusal);
        assert_eq!(r.model, "m");
    }

    #[test]
    fn rejects_broken_bodies() {
        assert!(parse_response(r#"{"choices":[]}"#, "m").is_err());
        assert!(parse_response(r#"{"choices":[{"message":{"content":"tr"#, "m").is_err());
        assert!(parse_response(r#"{"object":"list"}"#, "m").is_err());
    }

    #[test]
    fn parses_error_shapes() {
        let e = parse_error(r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#)
            .expect("error");
        assert_eq!(e.kind.as_deref(), Some("insufficient_quota"));
        let e = parse_error(
            r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
        )
        .expect("error");
        assert_eq!(e.kind.as_deref(), Some("unavailable_error"));
        assert_eq!(e.message, "Loading model");
        let e = parse_error(r#"{"error":"model \"x\" not found"}"#).expect("error");
        assert_eq!(e.kind, None);
        let e = parse_error(
            r#"{"object":"error","message":"bad","type":"BadRequestError","code":400}"#,
        )
        .expect("error");
        assert_eq!(e.kind.as_deref(), Some("BadRequestError"));
        assert!(parse_error("upstream connect error").is_none());
    }
}
