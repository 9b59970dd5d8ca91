//! A stand-in for the Anthropic Messages API that limits its callers as providers do, for
//! `troupe-bench --governed-only` and `tests/governor.rs` (which includes this file with
//! `#[path]`). Measuring code: it lives in the bench, not in the library or the binaries.
//!
//! It listens on `127.0.0.1:0` (one thread per connection, one request per connection,
//! `Connection: close`), answers `POST /v1/messages` after [`Limit`]'s rule, and takes
//! `latency` to answer a request it serves. A served request gets a `read_inbox` tool call
//! while the conversation holds fewer than `steps` tool results, else an `end_turn` text: a
//! teammate's one activation makes `steps + 1` calls.
//!
//! - [`Limit::Window`]: at most `n` requests served per window of `window` (windows start at
//!   the stub's start); beyond that a 429 `rate_limit_error` with `retry-after` (fractional
//!   seconds) to the window's end.
//! - [`Limit::Concurrent`]: at most `n` requests being answered at once; beyond that a 429
//!   with `retry-after: 1`.
//! - [`Limit::Headers`]: as `Window`, and every answer carries
//!   `anthropic-ratelimit-requests-limit`, `-remaining` (what is left of the window) and
//!   `-reset` (the window's end, RFC 3339).

#![allow(
    dead_code,
    reason = "troupe-bench and the test binary each use a part of the stub"
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How the stub limits its callers.
#[derive(Debug, Clone, Copy)]
pub enum Limit {
    Window { n: u32, window: Duration },
    Concurrent { n: u32 },
    Headers { n: u32, window: Duration },
}

/// What the stub has answered.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Counts {
    pub served: u64,
    pub limited: u64,
    /// The most requests it was answering at once.
    pub most_at_once: u32,
}

struct State {
    counts: Counts,
    in_flight: u32,
    window_index: u64,
    in_window: u32,
}

pub struct RateStub {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RateStub {
    pub fn start(limit: Limit, latency: Duration, steps: usize) -> RateStub {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let state = Arc::new(Mutex::new(State {
            counts: Counts::default(),
            in_flight: 0,
            window_index: 0,
            in_window: 0,
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let thread = {
            let (state, stop) = (state.clone(), stop.clone());
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(stream) = stream else { continue };
                    let state = state.clone();
                    std::thread::spawn(move || {
                        serve(stream, &state, limit, latency, steps, started);
                    });
                }
            })
        };
        RateStub {
            addr,
            state,
            stop,
            thread: Some(thread),
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn counts(&self) -> Counts {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).counts
    }
}

impl Drop for RateStub {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The request's body, parsed (`None` for anything that is not a JSON POST).
fn read_body(stream: &TcpStream) -> Option<serde_json::Value> {
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    reader.read_line(&mut line).ok()?;
    let mut length = 0usize;
    loop {
        line.clear();
        reader.read_line(&mut line).ok()?;
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
    let mut body = vec![0u8; length];
    reader.read_exact(&mut body).ok()?;
    serde_json::from_slice(&body).ok()
}

fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let days = (secs / 86_400.0).floor() as i64;
    let rem = secs - days as f64 * 86_400.0;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let h = (rem / 3600.0).floor();
    let mi = ((rem - h * 3600.0) / 60.0).floor();
    let s = rem - h * 3600.0 - mi * 60.0;
    format!("{y:04}-{m:02}-{d:02}T{h:02}:{mi:02}:{s:06.3}Z")
}

fn serve(
    stream: TcpStream,
    state: &Mutex<State>,
    limit: Limit,
    latency: Duration,
    steps: usize,
    started: Instant,
) {
    let Some(body) = read_body(&stream) else {
        return;
    };
    let now = Instant::now();
    let mut headers = Vec::new();
    let verdict: Result<(), f64> = {
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        let r = match limit {
            Limit::Window { n, window } | Limit::Headers { n, window } => {
                let w = window.as_secs_f64();
                let since = now.duration_since(started).as_secs_f64();
                let index = (since / w) as u64;
                if index != st.window_index {
                    st.window_index = index;
                    st.in_window = 0;
                }
                let end = (index + 1) as f64 * w - since;
                let r = if st.in_window < n {
                    st.in_window += 1;
                    Ok(())
                } else {
                    Err(end.max(0.001))
                };
                if matches!(limit, Limit::Headers { .. }) {
                    let reset = SystemTime::now() + Duration::from_secs_f64(end);
                    headers.push(("anthropic-ratelimit-requests-limit", n.to_string()));
                    headers.push((
                        "anthropic-ratelimit-requests-remaining",
                        (n - st.in_window.min(n)).to_string(),
                    ));
                    headers.push(("anthropic-ratelimit-requests-reset", rfc3339(reset)));
                }
                r
            }
            Limit::Concurrent { n } => {
                if st.in_flight < n {
                    Ok(())
                } else {
                    Err(1.0)
                }
            }
        };
        match r {
            Ok(()) => {
                st.in_flight += 1;
                st.counts.most_at_once = st.counts.most_at_once.max(st.in_flight);
            }
            Err(_) => st.counts.limited += 1,
        }
        r
    };
    let (status, text) = match verdict {
        Ok(()) => {
            std::thread::sleep(latency);
            {
                let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
                st.in_flight -= 1;
                st.counts.served += 1;
            }
            let results = body["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|m| m["content"].as_array().cloned().unwrap_or_default())
                .filter(|b| b["type"] == "tool_result")
                .count();
            let content = if results < steps {
                serde_json::json!([{"type": "tool_use", "id": format!("toolu_{results}"),
                    "name": "read_inbox", "input": {}}])
            } else {
                serde_json::json!([{"type": "text", "text": "done"}])
            };
            let stop = if results < steps {
                "tool_use"
            } else {
                "end_turn"
            };
            let reply = serde_json::json!({
                "id": "msg_stub", "type": "message", "role": "assistant",
                "model": body["model"], "content": content, "stop_reason": stop,
                "stop_sequence": null,
                "usage": {"input_tokens": 10, "output_tokens": 5},
            });
            (200, reply.to_string())
        }
        Err(wait) => {
            headers.push(("retry-after", format!("{wait:.3}")));
            let reply = serde_json::json!({"type": "error", "error": {
                "type": "rate_limit_error", "message": "stub: rate limited"}});
            (429, reply.to_string())
        }
    };
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        if status == 200 {
            "OK"
        } else {
            "Too Many Requests"
        },
        text.len()
    );
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut stream = stream;
    let _ = stream.write_all(head.as_bytes());
    let _ = stream.write_all(text.as_bytes());
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Both);
}
