//! A tiny scripted HTTP/1.1 server standing in for an LLM API.
//!
//! It binds `127.0.0.1:0`, accepts connections on a background thread, and answers each request
//! with the next [`Reply`] of its script (or a 500 saying the script ran out). Every request is
//! recorded (method, path, headers, body) for assertions. One request per connection and
//! `Connection: close` keep the HTTP side trivial. Each connection is served on its own thread,
//! so a deliberately slow reply does not hold up the client's retry.
//!
//! Response bodies are written by hand as strings, in the documented wire formats, never built
//! from the library's own types: a mistake in those types must not be able to hide. The
//! `anthropic_*` and `openai_*` helpers below produce such hand-written bodies.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// One scripted answer.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    /// Extra response headers, in order.
    pub headers: Vec<(String, String)>,
    pub body: String,
    /// Wait this long after reading the request before answering.
    pub delay: Duration,
    /// Announce the full `Content-Length` but close after this many body bytes.
    pub truncate_after: Option<usize>,
    /// Read the request, then close the connection without answering.
    pub hang_up: bool,
}

impl Reply {
    /// A JSON reply with this status and hand-written body.
    pub fn json(status: u16, body: impl Into<String>) -> Self {
        Reply {
            status,
            headers: Vec::new(),
            body: body.into(),
            delay: Duration::ZERO,
            truncate_after: None,
            hang_up: false,
        }
    }

    /// A 200 with this body.
    pub fn ok(body: impl Into<String>) -> Self {
        Reply::json(200, body)
    }

    /// Closes the connection right after reading the request (a connection reset as the
    /// client sees it).
    pub fn hang_up() -> Self {
        Reply {
            hang_up: true,
            ..Reply::json(200, "")
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_string(), value.to_string()));
        self
    }

    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    pub fn truncate_after(mut self, bytes: usize) -> Self {
        self.truncate_after = Some(bytes);
        self
    }
}

/// A request as the server saw it.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    pub path: String,
    /// Header names lowercased, in arrival order.
    pub headers: Vec<(String, String)>,
    pub raw_body: String,
    /// The body parsed as JSON, `Null` when it is not JSON.
    pub body: serde_json::Value,
}

impl Recorded {
    /// The first value of a header (name case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Default)]
struct State {
    /// How long a request waits for a reply when the script is empty.
    patience: Duration,
    script: VecDeque<Reply>,
    routes: std::collections::HashMap<String, VecDeque<Reply>>,
    requests: Vec<Recorded>,
    /// While set, every request gets this reply and the script is left as it is (an outage).
    outage: Option<Reply>,
    /// While set, every compaction request (an agent asking for a summary of its older turns)
    /// gets this reply, and the script is left as it is.
    compaction: Option<Reply>,
}

/// The running server; stops accepting when dropped.
pub struct FakeLlm {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeLlm {
    /// Starts a server that will answer with `script`, in order.
    pub fn start(script: impl IntoIterator<Item = Reply>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State {
            patience: Duration::ZERO,
            routes: Default::default(),
            script: script.into_iter().collect(),
            requests: Vec::new(),
            outage: None,
            compaction: None,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let state = Arc::clone(&state);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let state = Arc::clone(&state);
                    std::thread::spawn(move || serve(stream, &state));
                }
            })
        };
        FakeLlm {
            addr,
            state,
            stop,
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`, no trailing slash.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Makes requests that find the script empty wait up to `d` for a [`FakeLlm::push`].
    pub fn patient(self, d: Duration) -> Self {
        self.lock().patience = d;
        self
    }

    /// Appends to the script of requests for `model`.
    pub fn push_for(&self, model: &str, reply: Reply) {
        self.lock()
            .routes
            .entry(model.to_owned())
            .or_default()
            .push_back(reply);
    }

    /// Requests received for `model`.
    pub fn requests_for(&self, model: &str) -> usize {
        self.lock()
            .requests
            .iter()
            .filter(|r| r.body["model"] == model)
            .count()
    }

    /// Starts (`Some`) or ends (`None`) an outage: while it lasts every request is answered
    /// with `reply`, and the scripts wait untouched for the API to come back.
    pub fn outage(&self, reply: Option<Reply>) {
        self.lock().outage = reply;
    }

    /// Answers every compaction request with `reply` (see `troupe::agent::compaction`).
    pub fn on_compaction(&self, reply: Reply) {
        self.lock().compaction = Some(reply);
    }

    /// Appends to the script.
    pub fn push(&self, reply: Reply) {
        self.lock().script.push_back(reply);
    }

    /// Every request received so far, in order of arrival.
    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().requests.clone()
    }

    pub fn request_count(&self) -> usize {
        self.lock().requests.len()
    }

    /// Scripted replies not used yet.
    pub fn remaining(&self) -> usize {
        self.lock().script.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn serve(stream: TcpStream, state: &Mutex<State>) {
    let Some(request) = read_request(&stream) else {
        return;
    };
    // A request whose model has a routed script is answered from it (several agents sharing
    // one server, each with its own model id); anything else from the main script.
    let model = request.body["model"].as_str().unwrap_or("").to_owned();
    let pop = |state: &mut State| match state.routes.get_mut(&model) {
        Some(q) => q.pop_front(),
        None => state.script.pop_front(),
    };
    let compaction = request
        .body
        .to_string()
        .contains("[compaction] Your conversation is about to be compacted");
    let (mut reply, patience) = {
        let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
        state.requests.push(request);
        match (state.outage.clone(), state.compaction.clone()) {
            (Some(r), _) => (Some(r), Duration::ZERO),
            (None, Some(r)) if compaction => (Some(r), Duration::ZERO),
            _ => (pop(&mut state), state.patience),
        }
    };
    // A patient server waits a while for the test to push the reply this request needs (for
    // replies that quote ids only known once the request exists).
    let deadline = std::time::Instant::now() + patience;
    while reply.is_none() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
        reply = pop(&mut state.lock().unwrap_or_else(|p| p.into_inner()));
    }
    let reply = reply.unwrap_or_else(|| {
        Reply::json(
            500,
            r#"{"type":"error","error":{"type":"api_error","message":"fake server: script exhausted"}}"#,
        )
        .header("x-should-retry", "false")
    });
    if !reply.delay.is_zero() {
        std::thread::sleep(reply.delay);
    }
    let mut stream = stream;
    if reply.hang_up {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    let mut head = format!(
        "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        reply.status,
        reason(reply.status),
        reply.body.len()
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    let body = reply.body.as_bytes();
    let body = match reply.truncate_after {
        Some(n) => &body[..n.min(body.len())],
        None => body,
    };
    // The client may have given up already (timeouts): write errors are expected then.
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(body);
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Both);
}

fn read_request(stream: &TcpStream) -> Option<Recorded> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let path = parts.next()?.to_string();
    let mut headers = Vec::new();
    let mut content_length = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        let (name, value) = line.split_once(':')?;
        let name = name.trim().to_ascii_lowercase();
        let value = value.trim().to_string();
        if name == "content-length" {
            content_length = value.parse().ok()?;
        }
        headers.push((name, value));
    }
    let mut body = vec![0u8; content_length];
    reader.read_exact(&mut body).ok()?;
    let raw_body = String::from_utf8_lossy(&body).into_owned();
    let body = serde_json::from_str(&raw_body).unwrap_or(serde_json::Value::Null);
    Some(Recorded {
        method,
        path,
        headers,
        raw_body,
        body,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        529 => "Overloaded",
        _ => "Whatever",
    }
}

/// Escapes a string for a hand-written JSON literal.
pub fn json_str(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A Messages API 200 body with these raw content blocks (a JSON array's inside).
pub fn anthropic_message(content: &str, stop_reason: &str, usage: &str) -> String {
    format!(
        r#"{{"id":"msg_01Fake","type":"message","role":"assistant","model":"claude-fake-1","content":[{content}],"stop_reason":"{stop_reason}","stop_sequence":null,"usage":{usage}}}"#
    )
}

/// A Messages API text turn.
pub fn anthropic_text(text: &str) -> String {
    anthropic_message(
        &format!(r#"{{"type":"text","text":{}}}"#, json_str(text)),
        "end_turn",
        r#"{"input_tokens":10,"output_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":0}"#,
    )
}

/// A raw `tool_use` block; `input` is a JSON object literal.
pub fn anthropic_tool_use_block(id: &str, name: &str, input: &str) -> String {
    format!(
        r#"{{"type":"tool_use","id":{},"name":{},"input":{input}}}"#,
        json_str(id),
        json_str(name)
    )
}

/// An Anthropic error body.
pub fn anthropic_error(kind: &str, message: &str) -> String {
    format!(
        r#"{{"type":"error","error":{{"type":"{kind}","message":{}}},"request_id":"req_fake"}}"#,
        json_str(message)
    )
}

/// A Chat Completions 200 body with this raw `message` object and finish reason.
pub fn openai_completion(message: &str, finish_reason: &str, usage: &str) -> String {
    format!(
        r#"{{"id":"chatcmpl-fake","object":"chat.completion","created":1700000000,"model":"gpt-fake","choices":[{{"index":0,"message":{message},"finish_reason":"{finish_reason}"}}],"usage":{usage}}}"#
    )
}

/// A Chat Completions text turn.
pub fn openai_text(text: &str) -> String {
    openai_completion(
        &format!(r#"{{"role":"assistant","content":{}}}"#, json_str(text)),
        "stop",
        r#"{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15}"#,
    )
}

/// The text of the last user turn of a request body.
pub fn last_user_text(body: &serde_json::Value) -> String {
    body["messages"]
        .as_array()
        .and_then(|m| m.last())
        .map(|m| m["content"].to_string())
        .unwrap_or_default()
}

/// The text of every tool result the model `model` was sent, in order (the results in the last
/// message of each of its requests).
pub fn tool_results(fake: &FakeLlm, model: &str) -> Vec<String> {
    let mut out = Vec::new();
    for r in fake.requests() {
        if r.body["model"] != model {
            continue;
        }
        let Some(last) = r.body["messages"].as_array().and_then(|m| m.last()) else {
            continue;
        };
        for block in last["content"].as_array().into_iter().flatten() {
            if block["type"] == "tool_result" {
                out.push(block["content"].to_string());
            }
        }
    }
    out
}
