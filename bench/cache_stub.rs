//! A stand-in for the Anthropic Messages API that bills prompt caching as the API documents it
//! (`shared/REFERENCE.md`, "Prompt caching"), for `troupe-bench` and `tests/caching.rs` (which
//! includes this file with `#[path]`). It is measuring code, so it lives in the bench, not in
//! the library or the binaries.
//!
//! It listens on `127.0.0.1:0` (std `TcpListener`, one thread per connection, one request per
//! connection, `Connection: close`) and answers `POST /v1/messages`.
//!
//! **Caching rules.** A request is a sequence of blocks in cache order: each tool, then each
//! system block, then each content block of each message (a string content is one block). A
//! block with a `cache_control` member is a breakpoint.
//!
//! - More than [`MAX_BREAKPOINTS`] breakpoints: HTTP 400 `invalid_request_error`.
//! - A cache entry is the exact bytes of the prefix (the model, then every block up to and
//!   including the breakpoint's, each as the raw bytes the client sent, with only the
//!   `cache_control` member taken out, since moving the marker does not change the content). A
//!   re-ordered key, a changed timestamp or a trimmed first turn is another prefix.
//! - Tokens are estimated as bytes / 4: a prefix holds (sum of its blocks' raw bytes) / 4
//!   tokens, the request (all blocks) / 4. Keys and punctuation outside the blocks are not
//!   counted.
//! - Read: for each breakpoint, the stub looks for an entry ending at the breakpoint's block or
//!   at one of the [`LOOKBACK`] - 1 blocks before it (20 blocks in all); the longest prefix
//!   found over all breakpoints is read.
//! - Write: every breakpoint after the read point whose prefix holds at least
//!   [`MIN_CACHE_TOKENS`] tokens is written; below that it is silently ignored.
//! - Entries live [`TTL`] (5 minutes) and each hit refreshes them.
//! - `usage`: `cache_read_input_tokens` = the prefix read, `cache_creation_input_tokens` = from
//!   there to the last breakpoint written, `input_tokens` = the rest (after the last read or
//!   write point), `output_tokens` = the reply's content bytes / 4.
//!
//! **Script.** The replies drive a `steps`-step tool loop with no state of their own: a request
//! whose conversation holds fewer than `steps` `tool_result` blocks is answered with one more
//! `bash` call printing [`STEP_OUTPUT_BYTES`] bytes; the next one with an `end_turn` text.
//!
//! Every reply's usage is recorded, so a test can compare what was billed with what the client
//! recorded. Bodies are written by hand with `serde_json::json!`, never from troupe's types.

#![allow(
    dead_code,
    reason = "troupe-bench and the test binary each use a part of the stub"
)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Most breakpoints a request may carry.
pub const MAX_BREAKPOINTS: usize = 4;
/// Fewest tokens a cached prefix holds (the documented minimum of Sonnet and Opus).
pub const MIN_CACHE_TOKENS: u64 = 1024;
/// How many blocks, the breakpoint's own included, a breakpoint looks back for an entry.
pub const LOOKBACK: usize = 20;
/// How long an entry lives without a hit (the default 5-minute TTL).
pub const TTL: Duration = Duration::from_secs(300);
/// Bytes each scripted `bash` step prints.
pub const STEP_OUTPUT_BYTES: usize = 1800;

/// What one reply billed, as the API reports it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Billed {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_creation_input_tokens: u64,
    pub cache_read_input_tokens: u64,
}

impl Billed {
    /// Input + cache write + cache read: every prompt token.
    pub fn prompt_tokens(&self) -> u64 {
        self.input_tokens + self.cache_creation_input_tokens + self.cache_read_input_tokens
    }

    /// The share of prompt tokens read from cache, 0 when there were none.
    pub fn cache_read_share(&self) -> f64 {
        match self.prompt_tokens() {
            0 => 0.0,
            p => self.cache_read_input_tokens as f64 / p as f64,
        }
    }

    fn add(&mut self, o: &Billed) {
        self.input_tokens += o.input_tokens;
        self.output_tokens += o.output_tokens;
        self.cache_creation_input_tokens += o.cache_creation_input_tokens;
        self.cache_read_input_tokens += o.cache_read_input_tokens;
    }
}

/// The prefix cache: exact prefix bytes -> when the entry expires.
#[derive(Default)]
pub struct Cache {
    entries: HashMap<Vec<u8>, Instant>,
}

/// A request's blocks in cache order.
struct Blocks {
    /// Prefix bytes (model, then each block tagged with its place) ending after block i.
    ends: Vec<usize>,
    prefix: Vec<u8>,
    /// Estimated tokens of the prefix ending after block i.
    tokens: Vec<u64>,
    breakpoints: Vec<usize>,
    total_tokens: u64,
}

impl Cache {
    /// Bills one request body as the API would, updating the cache. `Err` is the message of a
    /// 400 `invalid_request_error`.
    pub fn bill(&mut self, body: &[u8], now: Instant) -> Result<Billed, String> {
        let blocks = blocks(body)?;
        if blocks.breakpoints.len() > MAX_BREAKPOINTS {
            return Err(format!(
                "A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be provided. Found {}.",
                blocks.breakpoints.len()
            ));
        }
        self.entries.retain(|_, until| *until > now);
        let key = |i: usize| &blocks.prefix[..blocks.ends[i]];
        // The longest entry found looking back from any breakpoint.
        let hit = blocks
            .breakpoints
            .iter()
            .filter_map(|&b| {
                (b.saturating_sub(LOOKBACK - 1)..=b)
                    .rev()
                    .find(|&j| self.entries.contains_key(key(j)))
            })
            .max();
        if let Some(h) = hit {
            self.entries.insert(key(h).to_vec(), now + TTL);
        }
        let written: Vec<usize> = blocks
            .breakpoints
            .iter()
            .copied()
            .filter(|&b| hit.is_none_or(|h| b > h) && blocks.tokens[b] >= MIN_CACHE_TOKENS)
            .collect();
        for &w in &written {
            self.entries.insert(key(w).to_vec(), now + TTL);
        }
        let read = hit.map_or(0, |h| blocks.tokens[h]);
        let write_end = written.iter().max().map(|&w| blocks.tokens[w]);
        let cached_end = write_end.unwrap_or(read).max(read);
        Ok(Billed {
            input_tokens: blocks.total_tokens - cached_end,
            output_tokens: 0,
            cache_creation_input_tokens: write_end.map_or(0, |w| w - read),
            cache_read_input_tokens: read,
        })
    }
}

/// Splits a Messages request body into its blocks, in cache order, as raw bytes.
fn blocks(body: &[u8]) -> Result<Blocks, String> {
    let top = members(body, value_span(body, 0)?)?;
    let get = |k: &str| top.iter().find(|(key, _)| key == k).map(|(_, s)| *s);
    let model = get("model").ok_or("model: Field required")?;
    let mut out = Blocks {
        ends: Vec::new(),
        prefix: body[model.0..model.1].to_vec(),
        tokens: Vec::new(),
        breakpoints: Vec::new(),
        total_tokens: 0,
    };
    let mut raw_bytes = 0u64;
    let mut push = |tag: &[u8], span: Span| -> Result<(), String> {
        let (bytes, marked) = without_cache_control(body, span)?;
        if marked {
            out.breakpoints.push(out.ends.len());
        }
        out.prefix.push(b'\n');
        out.prefix.extend_from_slice(tag);
        out.prefix.push(b'\n');
        out.prefix.extend_from_slice(&bytes);
        raw_bytes += bytes.len() as u64;
        out.ends.push(out.prefix.len());
        out.tokens.push(raw_bytes / 4);
        Ok(())
    };
    if let Some(tools) = get("tools") {
        for t in elements(body, tools)? {
            push(b"tool", t)?;
        }
    }
    if let Some(system) = get("system") {
        if body[system.0] == b'[' {
            for s in elements(body, system)? {
                push(b"system", s)?;
            }
        } else {
            push(b"system", system)?;
        }
    }
    let messages = get("messages").ok_or("messages: Field required")?;
    for m in elements(body, messages)? {
        let fields = members(body, m)?;
        let field = |k: &str| fields.iter().find(|(key, _)| key == k).map(|(_, s)| *s);
        let role = field("role").ok_or("messages: role: Field required")?;
        let tag = body[role.0..role.1].to_vec();
        let content = field("content").ok_or("messages: content: Field required")?;
        if body[content.0] == b'[' {
            for b in elements(body, content)? {
                push(&tag, b)?;
            }
        } else {
            push(&tag, content)?;
        }
    }
    out.total_tokens = raw_bytes / 4;
    Ok(out)
}

/// The raw bytes of the value at `span` with a top-level `cache_control` member left out, and
/// whether there was one. Anything but an object is returned as is.
fn without_cache_control(body: &[u8], span: Span) -> Result<(Vec<u8>, bool), String> {
    if body[span.0] != b'{' {
        return Ok((body[span.0..span.1].to_vec(), false));
    }
    let mut kept = Vec::new();
    let mut marked = false;
    for (key, (start, end)) in member_spans(body, span)? {
        if key == "cache_control" {
            marked = true;
        } else {
            kept.push(&body[start..end]);
        }
    }
    let mut out = vec![b'{'];
    out.extend_from_slice(&kept.join(&b","[..]));
    out.push(b'}');
    Ok((out, marked))
}

/// Where a value lies in the body: (start, end), end exclusive.
type Span = (usize, usize);
/// An object's members: key and span.
type Members = Vec<(String, Span)>;

// A minimal scanner of raw JSON: it finds where values start and end without re-serializing
// anything, so the bytes compared are the bytes sent (serde_json's map would sort the keys).

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The span (start, end) of the value starting at or after `i`.
fn value_span(b: &[u8], i: usize) -> Result<Span, String> {
    let start = skip_ws(b, i);
    let bad = || format!("body is not valid JSON at byte {start}");
    match b.get(start) {
        None => Err(bad()),
        Some(b'"') => {
            let mut j = start + 1;
            while j < b.len() {
                match b[j] {
                    b'\\' => j += 2,
                    b'"' => return Ok((start, j + 1)),
                    _ => j += 1,
                }
            }
            Err(bad())
        }
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = start;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = value_span(b, j)?.1;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Ok((start, j + 1));
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            Err(bad())
        }
        Some(_) => {
            let mut j = start;
            while j < b.len() && !matches!(b[j], b',' | b'}' | b']') && !b[j].is_ascii_whitespace()
            {
                j += 1;
            }
            if j == start {
                Err(bad())
            } else {
                Ok((start, j))
            }
        }
    }
}

/// The members of the object at `span`: key (raw, unescaped is not needed for the keys used
/// here) and the span from the key's opening quote to the end of its value.
fn member_spans(b: &[u8], span: Span) -> Result<Members, String> {
    if b[span.0] != b'{' {
        return Err(format!("expected an object at byte {}", span.0));
    }
    let mut out = Vec::new();
    let mut i = skip_ws(b, span.0 + 1);
    if b[i] == b'}' {
        return Ok(out);
    }
    loop {
        let key = value_span(b, i)?;
        if b[key.0] != b'"' {
            return Err(format!("expected a key at byte {}", key.0));
        }
        let colon = skip_ws(b, key.1);
        if b.get(colon) != Some(&b':') {
            return Err(format!("expected ':' at byte {colon}"));
        }
        let value = value_span(b, colon + 1)?;
        let name = String::from_utf8_lossy(&b[key.0 + 1..key.1 - 1]).into_owned();
        out.push((name, (key.0, value.1)));
        i = skip_ws(b, value.1);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b'}') => return Ok(out),
            _ => return Err(format!("expected ',' or '}}' at byte {i}")),
        }
    }
}

/// The members of the object at `span`, each with the span of its value.
fn members(b: &[u8], span: Span) -> Result<Members, String> {
    member_spans(b, span)?
        .into_iter()
        .map(|(k, (start, end))| {
            let colon = b[start..end]
                .iter()
                .position(|&c| c == b':')
                .map(|p| start + p)
                .ok_or("expected ':'")?;
            Ok((k, (skip_ws(b, colon + 1), end)))
        })
        .collect()
}

/// The spans of the elements of the array at `span`.
fn elements(b: &[u8], span: Span) -> Result<Vec<Span>, String> {
    if b[span.0] != b'[' {
        return Err(format!("expected an array at byte {}", span.0));
    }
    let mut out = Vec::new();
    let mut i = skip_ws(b, span.0 + 1);
    if b[i] == b']' {
        return Ok(out);
    }
    loop {
        let v = value_span(b, i)?;
        out.push(v);
        i = skip_ws(b, v.1);
        match b.get(i) {
            Some(b',') => i += 1,
            Some(b']') => return Ok(out),
            _ => return Err(format!("expected ',' or ']' at byte {i}")),
        }
    }
}

/// One answered request.
#[derive(Debug, Clone)]
pub struct Call {
    /// HTTP status of the reply.
    pub status: u16,
    /// What a 200 billed.
    pub billed: Billed,
    /// Bytes of the request body.
    pub request_bytes: usize,
}

#[derive(Default)]
struct State {
    cache: Cache,
    calls: Vec<Call>,
}

/// The running stub; stops accepting when dropped.
pub struct CacheStub {
    addr: SocketAddr,
    steps: usize,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl CacheStub {
    /// Starts a stub whose script runs a `steps`-step `bash` loop.
    pub fn start(steps: usize) -> std::io::Result<CacheStub> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
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
                    std::thread::spawn(move || serve(stream, &state, steps));
                }
            })
        };
        Ok(CacheStub {
            addr,
            steps,
            state,
            stop,
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`: the `ANTHROPIC_BASE_URL`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn steps(&self) -> usize {
        self.steps
    }

    /// Every request answered so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.lock().calls.clone()
    }

    /// The sum of everything billed.
    pub fn total(&self) -> Billed {
        let mut t = Billed::default();
        for c in &self.lock().calls {
            t.add(&c.billed);
        }
        t
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Drop for CacheStub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(mut stream: TcpStream, state: &Mutex<State>, steps: usize) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let Some((path, body)) = read_request(&stream) else {
        return;
    };
    let (status, reply) = if path != "/v1/messages" {
        (
            404,
            error_body("not_found_error", &format!("no route {path}")),
        )
    } else {
        answer(state, &body, steps)
    };
    let text = reply.to_string();
    let _ = write!(
        stream,
        "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nrequest-id: req_stub\r\n\r\n{text}",
        text.len()
    );
    let _ = stream.flush();
}

fn error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

fn answer(state: &Mutex<State>, body: &[u8], steps: usize) -> (u16, Value) {
    let mut state = state.lock().unwrap_or_else(|p| p.into_inner());
    let billed = state.cache.bill(body, Instant::now());
    let parsed: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let (status, reply) = match billed {
        Err(message) => (400, error_body("invalid_request_error", &message)),
        Ok(mut billed) => {
            let done = parsed["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["content"].as_array())
                .flatten()
                .filter(|b| b["type"] == "tool_result")
                .count();
            let (content, stop) = if done < steps {
                let n = done + 1;
                let command =
                    format!("echo step {n}; head -c {STEP_OUTPUT_BYTES} /dev/zero | tr '\\0' a");
                (
                    json!([
                        {"type": "text", "text": format!("Step {n} of {steps}.")},
                        {"type": "tool_use", "id": format!("toolu_stub_{n:03}"), "name": "bash",
                         "input": {"command": command}}
                    ]),
                    "tool_use",
                )
            } else {
                (
                    json!([{"type": "text", "text": format!("Done: {steps} steps.")}]),
                    "end_turn",
                )
            };
            billed.output_tokens = (content.to_string().len() as u64 / 4).max(1);
            let reply = json!({
                "id": format!("msg_stub_{:04}", state.calls.len() + 1),
                "type": "message",
                "role": "assistant",
                "model": parsed["model"],
                "content": content,
                "stop_reason": stop,
                "stop_sequence": null,
                "usage": {
                    "input_tokens": billed.input_tokens,
                    "cache_creation_input_tokens": billed.cache_creation_input_tokens,
                    "cache_read_input_tokens": billed.cache_read_input_tokens,
                    "output_tokens": billed.output_tokens,
                }
            });
            state.calls.push(Call {
                status: 200,
                billed,
                request_bytes: body.len(),
            });
            return (200, reply);
        }
    };
    state.calls.push(Call {
        status,
        billed: Billed::default(),
        request_bytes: body.len(),
    });
    (status, reply)
}

/// Reads one request: the path and the body (by `content-length`).
fn read_request(stream: &TcpStream) -> Option<(String, Vec<u8>)> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let path = line.split_whitespace().nth(1)?.to_owned();
    let mut length = 0usize;
    loop {
        line.clear();
        if reader.read_line(&mut line).ok()? == 0 {
            return None;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':')
            && k.eq_ignore_ascii_case("content-length")
        {
            length = v.trim().parse().ok()?;
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((path, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CC: &str = r#","cache_control":{"type":"ephemeral"}"#;

    /// A body with `n` user/assistant text blocks of `size` bytes each, breakpoints on the
    /// blocks listed.
    fn body(n: usize, size: usize, marks: &[usize]) -> Vec<u8> {
        let blocks: Vec<String> = (0..n)
            .map(|i| {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                let cc = if marks.contains(&i) { CC } else { "" };
                let text = format!("{i:04}{}", "x".repeat(size - 4));
                format!(r#"{{"role":"{role}","content":[{{"type":"text","text":"{text}"{cc}}}]}}"#)
            })
            .collect();
        format!(
            r#"{{"model":"m","max_tokens":5,"messages":[{}]}}"#,
            blocks.join(",")
        )
        .into_bytes()
    }

    /// Bytes a text block of `size` counts (its JSON, without cache_control).
    fn block_bytes(size: usize) -> u64 {
        (r#"{"type":"text","text":""}"#.len() + size) as u64
    }

    #[test]
    fn moving_breakpoint_reads_the_previous_prefix() {
        let mut c = Cache::default();
        let now = Instant::now();
        let b = block_bytes(2000);
        // Call 1: 3 blocks, breakpoint on the last; 1,517 tokens: written.
        let one = c.bill(&body(3, 2000, &[2]), now).unwrap();
        assert_eq!(one.cache_creation_input_tokens, 3 * b / 4);
        assert_eq!((one.cache_read_input_tokens, one.input_tokens), (0, 0));
        // Call 2: two blocks more, the breakpoint moved: reads 3 blocks, writes 2.
        let two = c.bill(&body(5, 2000, &[4]), now).unwrap();
        assert_eq!(two.cache_read_input_tokens, 3 * b / 4);
        assert_eq!(two.cache_creation_input_tokens, 5 * b / 4 - 3 * b / 4);
        assert_eq!(two.input_tokens, 0);
        // No breakpoint: nothing read, everything input.
        let three = c.bill(&body(5, 2000, &[]), now).unwrap();
        assert_eq!(three.input_tokens, 5 * b / 4);
        assert_eq!(three.prompt_tokens(), three.input_tokens);
    }

    #[test]
    fn short_prefixes_are_not_cached() {
        let mut c = Cache::default();
        let now = Instant::now();
        // 2 blocks of 1000 bytes: about 512 tokens, under the minimum.
        let one = c.bill(&body(2, 1000, &[1]), now).unwrap();
        assert_eq!(one.cache_creation_input_tokens, 0);
        assert_eq!(one.input_tokens, 2 * block_bytes(1000) / 4);
        let two = c.bill(&body(2, 1000, &[1]), now).unwrap();
        assert_eq!(two, one);
    }

    #[test]
    fn lookback_is_twenty_blocks() {
        let mut c = Cache::default();
        let now = Instant::now();
        c.bill(&body(2, 5000, &[1]), now).unwrap();
        // 19 blocks later the entry is the 20th block back: found.
        let hit = c.bill(&body(21, 5000, &[20]), now).unwrap();
        assert_eq!(hit.cache_read_input_tokens, 2 * block_bytes(5000) / 4);
        let mut c = Cache::default();
        c.bill(&body(2, 5000, &[1]), now).unwrap();
        // 20 blocks later: out of reach.
        let miss = c.bill(&body(22, 5000, &[21]), now).unwrap();
        assert_eq!(miss.cache_read_input_tokens, 0);
        // A second breakpoint nearer to the old entry finds it.
        let mut c = Cache::default();
        c.bill(&body(2, 5000, &[1]), now).unwrap();
        let hit = c.bill(&body(22, 5000, &[10, 21]), now).unwrap();
        assert_eq!(hit.cache_read_input_tokens, 2 * block_bytes(5000) / 4);
    }

    #[test]
    fn any_byte_change_misses_and_five_breakpoints_are_refused() {
        let mut c = Cache::default();
        let now = Instant::now();
        c.bill(&body(3, 2000, &[2]), now).unwrap();
        let mut changed = String::from_utf8(body(5, 2000, &[4])).unwrap();
        changed = changed.replacen("0000x", "0000y", 1);
        assert_eq!(
            c.bill(changed.as_bytes(), now)
                .unwrap()
                .cache_read_input_tokens,
            0
        );
        // Key order is part of the bytes.
        let mut c = Cache::default();
        c.bill(&body(3, 2000, &[2]), now).unwrap();
        let reordered = String::from_utf8(body(5, 2000, &[4]))
            .unwrap()
            .replacen(r#"{"type":"text","text":"0000"#, r#"{"text":"0000"#, 1)
            .replacen(r#"x"}]}"#, r#"x","type":"text"}]}"#, 1);
        assert_eq!(
            c.bill(reordered.as_bytes(), now)
                .unwrap()
                .cache_read_input_tokens,
            0
        );
        // Expired after the TTL.
        let mut c = Cache::default();
        c.bill(&body(3, 2000, &[2]), now).unwrap();
        let later = now + TTL + Duration::from_secs(1);
        assert_eq!(
            c.bill(&body(5, 2000, &[4]), later)
                .unwrap()
                .cache_read_input_tokens,
            0
        );
        let e = Cache::default()
            .bill(&body(6, 10, &[0, 1, 2, 3, 4]), now)
            .unwrap_err();
        assert!(e.contains("Found 5"), "{e}");
        assert!(
            Cache::default()
                .bill(&body(6, 10, &[0, 1, 2, 3]), now)
                .is_ok()
        );
    }
}
