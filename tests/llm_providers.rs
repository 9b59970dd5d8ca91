//! The HTTP providers against a scripted fake server, through the public library API and the
//! real reqwest client: wire format both ways, retry behaviour, error mapping, recording and
//! replay.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_error, anthropic_message, anthropic_text, anthropic_tool_use_block,
    openai_completion, openai_text,
};
use troupe::llm::{
    self, Anthropic, AnthropicConfig, Block, ChatMessage, ChatRequest, ChatResponse, HttpConfig,
    LlmError, OpenAi, OpenAiConfig, Provider, Recorder, ReplayProvider, RetryPolicy, Role,
    StopReason, ToolSpec, Usage,
};

const ANTHROPIC_KEY: &str = "sk-ant-test-0123456789";
const OPENAI_KEY: &str = "sk-test-9876543210";
const USAGE: &str = r#"{"input_tokens":10,"output_tokens":5}"#;

/// Real timeouts, tiny backoff: the retry tests take milliseconds.
fn fast_http() -> HttpConfig {
    HttpConfig {
        timeout: Duration::from_secs(10),
        connect_timeout: Duration::from_secs(2),
        retry: RetryPolicy {
            backoff_base: Duration::from_millis(10),
            backoff_cap: Duration::from_millis(40),
            ..RetryPolicy::default()
        },
    }
}

fn anthropic_with(server: &FakeLlm, http: HttpConfig) -> Anthropic {
    let mut config = AnthropicConfig::new(ANTHROPIC_KEY);
    // A trailing slash must not produce `//v1/messages`.
    config.base_url = format!("{}/", server.url());
    config.model = "claude-test".into();
    config.http = http;
    Anthropic::new(config).expect("anthropic provider")
}

fn anthropic(server: &FakeLlm) -> Anthropic {
    anthropic_with(server, fast_http())
}

fn openai_with(server: &FakeLlm, key: Option<&str>) -> OpenAi {
    let mut config = OpenAiConfig::new(key.map(str::to_string));
    config.base_url = format!("{}/v1/", server.url());
    config.model = "gpt-test".into();
    config.http = fast_http();
    OpenAi::new(config).expect("openai provider")
}

fn openai(server: &FakeLlm) -> OpenAi {
    openai_with(server, Some(OPENAI_KEY))
}

fn tools() -> Vec<ToolSpec> {
    ["bash", "read_file", "send_message"]
        .into_iter()
        .map(|name| ToolSpec {
            name: name.into(),
            description: format!("the {name} tool"),
            input_schema: json!({"type": "object", "properties": {"arg": {"type": "string"}}}),
        })
        .collect()
}

fn request(agent: &str, seq: u64, text: &str) -> ChatRequest {
    ChatRequest {
        model: String::new(),
        system: "You are a careful teammate.".into(),
        messages: vec![ChatMessage {
            role: Role::User,
            content: vec![Block::Text { text: text.into() }],
        }],
        tools: tools(),
        max_tokens: 2048,
        agent: agent.into(),
        seq,
    }
}

fn tool_uses(response: &ChatResponse) -> Vec<(String, String, Value)> {
    response
        .content
        .iter()
        .filter_map(|b| match b {
            Block::ToolUse { id, name, input } => Some((id.clone(), name.clone(), input.clone())),
            _ => None,
        })
        .collect()
}

/// Appends the assistant turn and one user turn with a result per tool call.
fn answer_tools(req: &mut ChatRequest, response: &ChatResponse) {
    req.messages.push(ChatMessage {
        role: Role::Assistant,
        content: response.content.clone(),
    });
    let results = tool_uses(response)
        .into_iter()
        .map(|(id, name, _)| Block::ToolResult {
            tool_use_id: id,
            content: format!("{name} done"),
            is_error: false,
        })
        .collect();
    req.messages.push(ChatMessage {
        role: Role::User,
        content: results,
    });
    req.seq += 1;
}

fn temp_file(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "troupe-test-{name}-{}.jsonl",
        uuid::Uuid::new_v4().simple()
    ))
}

fn overloaded() -> Reply {
    Reply::json(529, anthropic_error("overloaded_error", "Overloaded"))
}

// ---------------------------------------------------------------- Anthropic: happy paths

#[test]
fn anthropic_text_turn_sends_the_documented_request() {
    let server = FakeLlm::start([Reply::ok(anthropic_message(
        r#"{"type":"text","text":"Hello there."}"#,
        "end_turn",
        r#"{"input_tokens":25,"output_tokens":4,"cache_creation_input_tokens":0,"cache_read_input_tokens":0}"#,
    ))
    .header("request-id", "req_011")]);
    let response = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("call succeeds");
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "Hello there.".into()
        }]
    );
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    assert_eq!(response.usage.input_tokens, 25);
    assert_eq!(response.usage.output_tokens, 4);
    assert_eq!(response.model, "claude-fake-1");

    let requests = server.requests();
    assert_eq!(requests.len(), 1);
    let sent = &requests[0];
    assert_eq!(sent.method, "POST");
    assert_eq!(sent.path, "/v1/messages");
    assert_eq!(sent.header("x-api-key"), Some(ANTHROPIC_KEY));
    assert_eq!(sent.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(sent.header("content-type"), Some("application/json"));
    assert_eq!(sent.header("authorization"), None);
    let body = &sent.body;
    assert_eq!(body["model"], "claude-test");
    assert_eq!(body["max_tokens"], 2048);
    assert_eq!(
        body["system"],
        json!([{"type": "text", "text": "You are a careful teammate.", "cache_control": {"type": "ephemeral"}}])
    );
    assert_eq!(
        body["messages"],
        json!([{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}
        ]}])
    );
    let sent_tools = body["tools"].as_array().expect("tools");
    let names: Vec<&str> = sent_tools
        .iter()
        .map(|t| t["name"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(names, ["bash", "read_file", "send_message"]);
    assert!(sent_tools[0].get("cache_control").is_none());
    assert!(sent_tools[1].get("cache_control").is_none());
    assert_eq!(sent_tools[2]["cache_control"], json!({"type": "ephemeral"}));
    assert_eq!(sent_tools[0]["input_schema"]["type"], "object");
    assert!(body.get("agent").is_none() && body.get("seq").is_none());
}

#[test]
fn anthropic_request_model_overrides_the_configured_one() {
    let server = FakeLlm::start([Reply::ok(anthropic_text("ok"))]);
    let mut req = request("alice", 0, "hi");
    req.model = "claude-opus-test".into();
    anthropic(&server).complete(&req).expect("call succeeds");
    assert_eq!(server.requests()[0].body["model"], "claude-opus-test");
}

#[test]
fn anthropic_one_tool_use_then_its_result() {
    let server = FakeLlm::start([
        Reply::ok(anthropic_message(
            &format!(
                r#"{{"type":"text","text":"Listing."}},{}"#,
                anthropic_tool_use_block("toolu_01A", "bash", r#"{"command":"ls -la"}"#)
            ),
            "tool_use",
            USAGE,
        )),
        Reply::ok(anthropic_text("Two files.")),
    ]);
    let provider = anthropic(&server);
    let mut req = request("alice", 0, "what is here?");
    let first = provider.complete(&req).expect("first call");
    assert_eq!(first.stop_reason, StopReason::ToolUse);
    assert_eq!(
        tool_uses(&first),
        vec![(
            "toolu_01A".to_string(),
            "bash".to_string(),
            json!({"command": "ls -la"})
        )]
    );
    answer_tools(&mut req, &first);
    let second = provider.complete(&req).expect("second call");
    assert_eq!(second.stop_reason, StopReason::EndTurn);

    let body = &server.requests()[1].body;
    assert_eq!(
        body["messages"],
        json!([
            {"role": "user", "content": [{"type": "text", "text": "what is here?"}]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_01A", "name": "bash", "input": {"command": "ls -la"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "bash done",
                 "cache_control": {"type": "ephemeral"}}
            ]}
        ])
    );
}

#[test]
fn anthropic_parallel_tool_uses_get_all_results_in_one_message() {
    let blocks = [
        anthropic_tool_use_block("toolu_1", "read_file", r#"{"path":"a.txt"}"#),
        anthropic_tool_use_block("toolu_2", "read_file", r#"{"path":"b.txt"}"#),
        anthropic_tool_use_block("toolu_3", "send_message", r#"{"to":"bob","content":"hi"}"#),
    ]
    .join(",");
    let server = FakeLlm::start([
        Reply::ok(anthropic_message(&blocks, "tool_use", USAGE)),
        Reply::ok(anthropic_text("done")),
    ]);
    let provider = anthropic(&server);
    let mut req = request("alice", 0, "read both");
    let first = provider.complete(&req).expect("first call");
    let ids: Vec<String> = tool_uses(&first).into_iter().map(|(id, _, _)| id).collect();
    assert_eq!(ids, ["toolu_1", "toolu_2", "toolu_3"]);
    answer_tools(&mut req, &first);
    // An inbox note arriving with the results goes after them in the same message.
    req.messages[2].content.insert(
        0,
        Block::Text {
            text: "<inbox>bob: thanks</inbox>".into(),
        },
    );
    provider.complete(&req).expect("second call");

    let body = &server.requests()[1].body;
    let messages = body["messages"].as_array().expect("messages");
    assert_eq!(messages.len(), 3);
    let last = messages[2]["content"].as_array().expect("content");
    let kinds: Vec<(&str, &str)> = last
        .iter()
        .map(|b| {
            (
                b["type"].as_str().unwrap_or(""),
                b["tool_use_id"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("tool_result", "toolu_1"),
            ("tool_result", "toolu_2"),
            ("tool_result", "toolu_3"),
            ("text", "")
        ]
    );
}

#[test]
fn anthropic_max_tokens_mid_tool_call() {
    let server = FakeLlm::start([Reply::ok(anthropic_message(
        &format!(
            r#"{{"type":"text","text":"Writing the file"}},{}"#,
            anthropic_tool_use_block("toolu_cut", "write_file", "{}")
        ),
        "max_tokens",
        r#"{"input_tokens":100,"output_tokens":2048}"#,
    ))]);
    let response = anthropic(&server)
        .complete(&request("alice", 0, "write it"))
        .expect("call succeeds");
    assert_eq!(response.stop_reason, StopReason::MaxTokens);
    assert_eq!(tool_uses(&response).len(), 1);
    assert_eq!(response.usage.output_tokens, 2048);
}

#[test]
fn anthropic_refusal_with_empty_content() {
    let server = FakeLlm::start([Reply::ok(anthropic_message("", "refusal", USAGE))]);
    let response = anthropic(&server)
        .complete(&request("alice", 0, "do something bad"))
        .expect("a refusal is a response, not an error");
    assert_eq!(response.stop_reason, StopReason::Refusal);
    assert!(response.content.is_empty());
}

#[test]
fn anthropic_unknown_blocks_are_ignored() {
    let server = FakeLlm::start([Reply::ok(anthropic_message(
        r#"{"type":"thinking","thinking":"hmm","signature":"abc"},{"type":"server_tool_use","id":"srvtoolu_1","name":"web_search","input":{}},{"type":"text","text":"Answer."}"#,
        "end_turn",
        USAGE,
    ))]);
    let response = anthropic(&server)
        .complete(&request("alice", 0, "q"))
        .expect("call succeeds");
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "Answer.".into()
        }]
    );
}

#[test]
fn anthropic_cache_counters_reach_usage() {
    let server = FakeLlm::start([
        Reply::ok(anthropic_message(
            r#"{"type":"text","text":"first"}"#,
            "end_turn",
            r#"{"input_tokens":12,"output_tokens":7,"cache_creation_input_tokens":3100,"cache_read_input_tokens":0}"#,
        )),
        Reply::ok(anthropic_message(
            r#"{"type":"text","text":"second"}"#,
            "end_turn",
            r#"{"input_tokens":30,"output_tokens":9,"cache_creation_input_tokens":0,"cache_read_input_tokens":3100}"#,
        )),
    ]);
    let provider = anthropic(&server);
    let first = provider.complete(&request("alice", 0, "a")).expect("first");
    let second = provider
        .complete(&request("alice", 1, "b"))
        .expect("second");
    assert_eq!(
        first.usage,
        Usage {
            input_tokens: 12,
            output_tokens: 7,
            cache_creation_input_tokens: 3100,
            cache_read_input_tokens: 0
        }
    );
    assert_eq!(second.usage.cache_read_input_tokens, 3100);
    assert_eq!(second.usage.cache_creation_input_tokens, 0);
    let mut total = Usage::default();
    total.add(&first.usage);
    total.add(&second.usage);
    assert_eq!(total.input_tokens, 42);
    // Both calls sent byte-identical prefixes (tools and system), so the cache can hit.
    let requests = server.requests();
    assert_eq!(requests[0].body["tools"], requests[1].body["tools"]);
    assert_eq!(requests[0].body["system"], requests[1].body["system"]);
}

// ---------------------------------------------------------------- Anthropic: retries and errors

#[test]
fn rate_limit_honours_retry_after_then_succeeds() {
    let server = FakeLlm::start([
        Reply::json(
            429,
            anthropic_error(
                "rate_limit_error",
                "Number of requests has exceeded your rate limit",
            ),
        )
        .header("retry-after", "1"),
        Reply::ok(anthropic_text("finally")),
    ]);
    let started = Instant::now();
    let response = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("retried to success");
    assert_eq!(server.request_count(), 2);
    assert!(
        started.elapsed() >= Duration::from_millis(950),
        "waited only {:?}",
        started.elapsed()
    );
    assert_eq!(response.stop_reason, StopReason::EndTurn);
}

#[test]
fn spend_cap_is_not_retried() {
    let server = FakeLlm::start([Reply::json(
        429,
        r#"{"type":"error","error":{"type":"rate_limit_error","message":"You have reached your specified workspace API usage limits.","details":{"error_code":"enforced_spend_limit_reached"}},"request_id":"req_cap"}"#,
    )]);
    let error = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect_err("spend cap");
    assert_eq!(server.request_count(), 1);
    match &error {
        LlmError::Rejected { status, kind, .. } => {
            assert_eq!(*status, 429);
            assert_eq!(kind, "enforced_spend_limit_reached");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(error.is_quota());
    assert_eq!(error.exit_code(), 75);
}

#[test]
fn overloaded_twice_then_success() {
    let server = FakeLlm::start([
        overloaded(),
        overloaded().header("retry-after-ms", "10"),
        Reply::ok(anthropic_text("made it")),
    ]);
    let response = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("third attempt succeeds");
    assert_eq!(server.request_count(), 3);
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "made it".into()
        }]
    );
}

#[test]
fn overloaded_three_times_gives_up() {
    let server = FakeLlm::start([
        overloaded(),
        overloaded(),
        overloaded().header("request-id", "req_last"),
        Reply::ok(anthropic_text("never reached")),
    ]);
    let error = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect_err("gives up");
    assert_eq!(server.request_count(), 3);
    match &error {
        LlmError::Unavailable { attempts, last } => {
            assert_eq!(*attempts, 3);
            assert!(
                last.contains("529") && last.contains("overloaded_error"),
                "{last}"
            );
            assert!(last.contains("req_last"), "{last}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(error.exit_code(), 75);
}

#[test]
fn max_attempts_is_configurable() {
    let server = FakeLlm::start([overloaded(), overloaded(), overloaded(), overloaded()]);
    let mut http = fast_http();
    http.retry.max_attempts = 2;
    let error = anthropic_with(&server, http)
        .complete(&request("alice", 0, "hi"))
        .expect_err("gives up");
    assert!(matches!(error, LlmError::Unavailable { attempts: 2, .. }));
    assert_eq!(server.request_count(), 2);
}

#[test]
fn x_should_retry_false_stops_a_500() {
    let server = FakeLlm::start([
        Reply::json(500, anthropic_error("api_error", "Internal server error"))
            .header("x-should-retry", "false"),
        Reply::ok(anthropic_text("never reached")),
    ]);
    let error = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect_err("not retried");
    assert_eq!(server.request_count(), 1);
    assert!(
        matches!(error, LlmError::Unavailable { attempts: 1, .. }),
        "{error:?}"
    );
}

#[test]
fn x_should_retry_true_retries_an_unusual_status() {
    let server = FakeLlm::start([
        Reply::json(422, anthropic_error("invalid_request_error", "try again"))
            .header("x-should-retry", "true"),
        Reply::ok(anthropic_text("ok")),
    ]);
    anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("retried");
    assert_eq!(server.request_count(), 2);
}

#[test]
fn bad_key_is_an_auth_error_without_retry() {
    let server = FakeLlm::start([
        Reply::json(
            401,
            anthropic_error("authentication_error", "invalid x-api-key"),
        )
        .header("request-id", "req_auth"),
        Reply::ok(anthropic_text("never reached")),
    ]);
    let error = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect_err("auth");
    assert_eq!(server.request_count(), 1);
    assert!(
        matches!(error, LlmError::Auth { status: 401, .. }),
        "{error:?}"
    );
    assert_eq!(error.exit_code(), 78);
    let text = error.to_string();
    assert!(
        text.contains("invalid x-api-key") && text.contains("req_auth"),
        "{text}"
    );
    assert!(!text.contains(ANTHROPIC_KEY), "{text}");
    assert!(!format!("{error:?}").contains(ANTHROPIC_KEY));
}

#[test]
fn invalid_request_is_rejected_without_retry() {
    let server = FakeLlm::start([
        Reply::json(
            400,
            anthropic_error(
                "invalid_request_error",
                "messages.1: `tool_use` ids were found without `tool_result` blocks immediately after",
            ),
        )
        .header("x-should-retry", "true"),
        Reply::ok(anthropic_text("never reached")),
    ]);
    let error = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect_err("rejected");
    assert_eq!(server.request_count(), 1);
    match &error {
        LlmError::Rejected {
            status,
            kind,
            message,
        } => {
            assert_eq!(*status, 400);
            assert_eq!(kind, "invalid_request_error");
            assert!(message.contains("tool_result"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(error.exit_code(), 1);
}

#[test]
fn non_json_error_body_is_reported_verbatim() {
    let server = FakeLlm::start([
        Reply::json(502, "<html><body>Bad Gateway</body></html>"),
        Reply::ok(anthropic_text("ok")),
    ]);
    anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("502 is retried");
    assert_eq!(server.request_count(), 2);
}

#[test]
fn slow_response_times_out_and_is_retried() {
    let server = FakeLlm::start([
        Reply::ok(anthropic_text("too late")).delay(Duration::from_millis(1600)),
        Reply::ok(anthropic_text("on time")),
    ]);
    let mut http = fast_http();
    http.timeout = Duration::from_secs(1);
    let started = Instant::now();
    let response = anthropic_with(&server, http)
        .complete(&request("alice", 0, "hi"))
        .expect("second attempt in time");
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "on time".into()
        }]
    );
    assert_eq!(server.request_count(), 2);
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(950) && elapsed < Duration::from_millis(1500),
        "{elapsed:?}"
    );
}

#[test]
fn timeouts_that_persist_end_as_unavailable() {
    let server =
        FakeLlm::start([Reply::ok(anthropic_text("too late")).delay(Duration::from_millis(1500))]);
    let mut http = fast_http();
    http.timeout = Duration::from_secs(1);
    http.retry.max_attempts = 1;
    let error = anthropic_with(&server, http)
        .complete(&request("alice", 0, "hi"))
        .expect_err("times out");
    match &error {
        LlmError::Unavailable { attempts, last } => {
            assert_eq!(*attempts, 1);
            assert!(last.contains("timed out"), "{last}");
        }
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(error.exit_code(), 75);
}

#[test]
fn truncated_body_is_retried() {
    let full = anthropic_text("complete answer");
    let server = FakeLlm::start([
        Reply::ok(full.clone()).truncate_after(full.len() / 2),
        Reply::ok(full),
    ]);
    let response = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("second attempt succeeds");
    assert_eq!(server.request_count(), 2);
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "complete answer".into()
        }]
    );
}

#[test]
fn invalid_json_that_persists_ends_as_unavailable() {
    // Complete HTTP responses whose JSON is cut short (a broken proxy, say).
    let cut = r#"{"id":"msg_1","type":"message","content":[{"type":"text","text":"hal"#;
    let server = FakeLlm::start([Reply::ok(cut), Reply::ok(cut), Reply::ok(cut)]);
    let error = anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect_err("gives up");
    assert_eq!(server.request_count(), 3);
    match &error {
        LlmError::Unavailable { attempts: 3, last } => {
            assert!(last.contains("invalid response"), "{last}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn connection_reset_is_retried() {
    let server = FakeLlm::start([Reply::hang_up(), Reply::ok(anthropic_text("ok"))]);
    anthropic(&server)
        .complete(&request("alice", 0, "hi"))
        .expect("retried");
    assert_eq!(server.request_count(), 2);
}

#[test]
fn connect_errors_are_retried_then_unavailable() {
    // Bind and drop a listener to get a port with nobody listening.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port();
    let mut config = AnthropicConfig::new(ANTHROPIC_KEY);
    config.base_url = format!("http://127.0.0.1:{port}");
    config.http = fast_http();
    let error = Anthropic::new(config)
        .expect("provider")
        .complete(&request("alice", 0, "hi"))
        .expect_err("nobody listening");
    match &error {
        LlmError::Unavailable { attempts, last } => {
            assert_eq!(*attempts, 3);
            assert!(last.contains("connect"), "{last}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

// ---------------------------------------------------------------- OpenAI

#[test]
fn openai_text_turn_sends_the_documented_request() {
    let server = FakeLlm::start([Reply::ok(openai_text("Hi from GPT."))]);
    let response = openai(&server)
        .complete(&request("bob", 0, "hello"))
        .expect("call succeeds");
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "Hi from GPT.".into()
        }]
    );
    assert_eq!(response.stop_reason, StopReason::EndTurn);
    assert_eq!(response.model, "gpt-fake");

    let sent = &server.requests()[0];
    assert_eq!(sent.method, "POST");
    assert_eq!(sent.path, "/v1/chat/completions");
    assert_eq!(
        sent.header("authorization").map(str::to_string),
        Some(format!("Bearer {OPENAI_KEY}"))
    );
    assert_eq!(sent.header("x-api-key"), None);
    assert_eq!(sent.header("content-type"), Some("application/json"));
    let body = &sent.body;
    assert_eq!(body["model"], "gpt-test");
    assert_eq!(body["max_tokens"], 2048);
    assert_eq!(body["tool_choice"], "auto");
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "You are a careful teammate."},
            {"role": "user", "content": "hello"}
        ])
    );
    assert_eq!(
        body["tools"][0],
        json!({"type": "function", "function": {
            "name": "bash",
            "description": "the bash tool",
            "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}}
        }})
    );
}

#[test]
fn openai_tool_calls_and_results_round_trip() {
    let server = FakeLlm::start([
        Reply::ok(openai_completion(
            r#"{"role":"assistant","content":null,"tool_calls":[
                {"id":"call_A","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"a.txt\"}"}},
                {"id":"call_B","type":"function","function":{"name":"read_file","arguments":"{\"path\":\"b.txt\"}"}}]}"#,
            "tool_calls",
            r#"{"prompt_tokens":50,"completion_tokens":20}"#,
        )),
        Reply::ok(openai_text("read both")),
    ]);
    let provider = openai(&server);
    let mut req = request("bob", 0, "read a and b");
    req.tools.clear();
    let first = provider.complete(&req).expect("first call");
    assert_eq!(first.stop_reason, StopReason::ToolUse);
    answer_tools(&mut req, &first);
    req.messages[2].content.push(Block::Text {
        text: "<inbox>lead: hurry</inbox>".into(),
    });
    provider.complete(&req).expect("second call");

    let body = &server.requests()[1].body;
    assert!(body.get("tools").is_none() && body.get("tool_choice").is_none());
    assert_eq!(
        body["messages"],
        json!([
            {"role": "system", "content": "You are a careful teammate."},
            {"role": "user", "content": "read a and b"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_A", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"a.txt\"}"}},
                {"id": "call_B", "type": "function", "function": {"name": "read_file", "arguments": "{\"path\":\"b.txt\"}"}}
            ]},
            {"role": "tool", "tool_call_id": "call_A", "content": "read_file done"},
            {"role": "tool", "tool_call_id": "call_B", "content": "read_file done"},
            {"role": "user", "content": "<inbox>lead: hurry</inbox>"}
        ])
    );
}

#[test]
fn openai_quirks_are_tolerated() {
    let server = FakeLlm::start([Reply::ok(openai_completion(
        r#"{"role":"assistant","content":"","tool_calls":[
            {"id":"call_1","type":"function","function":{"name":"bash","arguments":"{\"command\": \"ls"}},
            {"type":"function","function":{"name":"read_file","arguments":{"path":"notes.md"}}},
            {"id":"call_3","type":"function","function":{"name":"read_inbox","arguments":""}},
            {"id":"call_4","type":"function","function":{"name":"list_teammates"}}]}"#,
        "tool_calls",
        r#"{"prompt_tokens":1200,"completion_tokens":80,"prompt_tokens_details":{"cached_tokens":1024}}"#,
    ))]);
    let response = openai(&server)
        .complete(&request("bob", 0, "go"))
        .expect("quirky response parses");
    let calls = tool_uses(&response);
    assert_eq!(calls.len(), 4);
    assert_eq!(calls[0].0, "call_1");
    assert_eq!(calls[0].2, Value::String("{\"command\": \"ls".into()));
    assert_eq!(
        response.content[0].invalid_tool_arguments(),
        Some("{\"command\": \"ls")
    );
    assert_eq!(calls[1].2, json!({"path": "notes.md"}));
    assert!(
        calls[1].0.starts_with("call_") && calls[1].0.len() > 10,
        "{}",
        calls[1].0
    );
    assert_eq!(calls[2].2, json!({}));
    assert_eq!(calls[3].2, json!({}));
    assert_eq!(
        response.usage,
        Usage {
            input_tokens: 176,
            output_tokens: 80,
            cache_creation_input_tokens: 0,
            cache_read_input_tokens: 1024
        }
    );
}

#[test]
fn openai_finish_reasons() {
    let server = FakeLlm::start([
        Reply::ok(openai_completion(
            r#"{"role":"assistant","content":"cut sh"}"#,
            "length",
            USAGE,
        )),
        Reply::ok(openai_completion(
            r#"{"role":"assistant","content":null}"#,
            "content_filter",
            USAGE,
        )),
    ]);
    let provider = openai(&server);
    let r = provider.complete(&request("bob", 0, "a")).expect("length");
    assert_eq!(r.stop_reason, StopReason::MaxTokens);
    let r = provider.complete(&request("bob", 1, "b")).expect("filter");
    assert_eq!(r.stop_reason, StopReason::Refusal);
    assert!(r.content.is_empty());
}

#[test]
fn openai_loading_503_is_retried() {
    let server = FakeLlm::start([
        Reply::json(
            503,
            r#"{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}"#,
        ),
        Reply::ok(openai_text("loaded")),
    ]);
    let response = openai(&server)
        .complete(&request("bob", 0, "hi"))
        .expect("retried");
    assert_eq!(server.request_count(), 2);
    assert_eq!(
        response.content,
        vec![Block::Text {
            text: "loaded".into()
        }]
    );
}

#[test]
fn openai_numeric_error_code_is_parsed() {
    let server = FakeLlm::start([Reply::json(
        400,
        r#"{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}"#,
    )]);
    let error = openai(&server)
        .complete(&request("bob", 0, "hi"))
        .expect_err("rejected");
    assert_eq!(server.request_count(), 1);
    match &error {
        LlmError::Rejected {
            status,
            kind,
            message,
        } => {
            assert_eq!(*status, 400);
            assert_eq!(kind, "exceed_context_size_error");
            assert!(message.contains("context size"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn openai_insufficient_quota_is_not_retried() {
    let server = FakeLlm::start([
        Reply::json(
            429,
            r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#,
        ),
        Reply::ok(openai_text("never reached")),
    ]);
    let error = openai(&server)
        .complete(&request("bob", 0, "hi"))
        .expect_err("quota");
    assert_eq!(server.request_count(), 1);
    assert!(
        matches!(&error, LlmError::Rejected { status: 429, kind, .. } if kind == "insufficient_quota"),
        "{error:?}"
    );
    assert_eq!(error.exit_code(), 75);
}

#[test]
fn openai_without_key_sends_no_authorization() {
    let server = FakeLlm::start([Reply::ok(openai_text("local"))]);
    openai_with(&server, None)
        .complete(&request("bob", 0, "hi"))
        .expect("call succeeds");
    assert_eq!(server.requests()[0].header("authorization"), None);
}

// ---------------------------------------------------------------- environment, recording, replay

fn vars(pairs: Vec<(&'static str, String)>) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<&str, String> = pairs.into_iter().collect();
    move |name| map.get(name).cloned()
}

#[test]
fn recorded_cassette_replays_identical_responses() {
    let server = FakeLlm::start([
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block("toolu_r1", "bash", r#"{"command":"echo hi"}"#),
            "tool_use",
            r#"{"input_tokens":40,"output_tokens":12,"cache_creation_input_tokens":2048,"cache_read_input_tokens":0}"#,
        )),
        Reply::ok(anthropic_text("bob's answer")),
        Reply::ok(anthropic_message("", "refusal", USAGE)),
    ]);
    let cassette = temp_file("cassette");
    let live = llm::from_env_with(&vars(vec![
        ("ANTHROPIC_API_KEY", ANTHROPIC_KEY.to_string()),
        ("ANTHROPIC_BASE_URL", server.url()),
        ("MODEL_ID", "claude-env".to_string()),
        ("TROUPE_RECORD", cassette.display().to_string()),
    ]))
    .expect("live provider");
    assert_eq!(live.name(), "anthropic");
    let calls = [
        request("alice", 0, "one"),
        request("bob", 0, "two"),
        request("alice", 1, "three"),
    ];
    let recorded: Vec<ChatResponse> = calls
        .iter()
        .map(|req| live.complete(req).expect("live call"))
        .collect();
    assert_eq!(server.requests()[0].body["model"], "claude-env");

    let text = std::fs::read_to_string(&cassette).expect("cassette written");
    assert_eq!(text.lines().count(), 3);
    // The key never reaches the cassette.
    assert!(!text.contains(ANTHROPIC_KEY));
    let first: Value = serde_json::from_str(text.lines().next().unwrap_or("")).expect("json line");
    assert_eq!(first["agent"], "alice");
    assert_eq!(first["seq"], 0);
    assert_eq!(first["response"]["stop_reason"], "tool_use");

    let replay = llm::from_env_with(&vars(vec![
        ("TROUPE_PROVIDER", "replay".to_string()),
        ("TROUPE_CASSETTE", cassette.display().to_string()),
    ]))
    .expect("replay provider");
    assert_eq!(replay.name(), "replay");
    // Any order: responses are keyed by agent and seq.
    for (req, expected) in calls.iter().zip(&recorded).rev() {
        assert_eq!(&replay.complete(req).expect("replayed"), expected);
    }
    assert_eq!(
        server.request_count(),
        3,
        "replay must not touch the network"
    );
    match replay.complete(&request("alice", 2, "four")) {
        Err(LlmError::CassetteExhausted { agent, seq }) => {
            assert_eq!((agent.as_str(), seq), ("alice", 2));
        }
        other => panic!("unexpected {other:?}"),
    }

    let embedded = ReplayProvider::from_str(&text).expect("embedded cassette");
    assert_eq!(embedded.complete(&calls[1]).expect("replayed"), recorded[1]);
    std::fs::remove_file(&cassette).ok();
}

#[test]
fn failed_calls_are_not_recorded() {
    let server = FakeLlm::start([Reply::json(
        401,
        anthropic_error("authentication_error", "invalid x-api-key"),
    )]);
    let cassette = temp_file("failed");
    let recorder = Recorder::new(Box::new(anthropic(&server)), &cassette).expect("recorder");
    recorder
        .complete(&request("alice", 0, "hi"))
        .expect_err("auth error");
    assert_eq!(std::fs::read_to_string(&cassette).expect("created"), "");
    std::fs::remove_file(&cassette).ok();
}

#[test]
fn openai_from_env_with_only_a_base_url() {
    let server = FakeLlm::start([Reply::ok(openai_text("local model"))]);
    let provider = llm::from_env_with(&vars(vec![
        ("OPENAI_BASE_URL", format!("{}/v1", server.url())),
        ("MODEL_ID", "qwen-local".to_string()),
        ("TROUPE_LLM_TIMEOUT_SECS", "5".to_string()),
    ]))
    .expect("openai provider");
    assert_eq!(provider.name(), "openai");
    provider
        .complete(&request("bob", 0, "hi"))
        .expect("call succeeds");
    let sent = &server.requests()[0];
    assert_eq!(sent.path, "/v1/chat/completions");
    assert_eq!(sent.header("authorization"), None);
    assert_eq!(sent.body["model"], "qwen-local");
}
