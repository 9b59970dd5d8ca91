//! Issue 26, OpenTelemetry export: a receiver on 127.0.0.1 speaking OTLP/HTTP decodes what the
//! real `worker` exports with the official proto definitions (`opentelemetry-proto`): a span per
//! model call with the GenAI attributes and token counts equal to the member's ledger, each a
//! child of its activation; the span of the `bash` call is the parent its command's
//! `TRACEPARENT` names; the export's other variables (its headers: a key) are not the
//! command's. With the variable unset, a worker starts no thread and opens no network socket.

mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as Any;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd as lead, wait_until};
use troupe::config::MemberStatus;
use troupe::transcript::Entry;

const T: Duration = Duration::from_secs(30);

/// An OTLP/HTTP receiver: keeps every span of every `POST /v1/traces`, and the headers seen.
struct Receiver {
    port: u16,
    spans: Arc<Mutex<Vec<Span>>>,
    headers: Arc<Mutex<Vec<String>>>,
}

impl Receiver {
    fn start() -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let headers = Arc::new(Mutex::new(Vec::new()));
        let (s, h) = (spans.clone(), headers.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { continue };
                let (s, h) = (s.clone(), h.clone());
                std::thread::spawn(move || {
                    let mut reader = BufReader::new(conn.try_clone().unwrap());
                    loop {
                        let mut line = String::new();
                        if reader.read_line(&mut line).unwrap_or(0) == 0 {
                            return;
                        }
                        let mut len = 0;
                        loop {
                            let mut l = String::new();
                            reader.read_line(&mut l).unwrap();
                            let l = l.trim_end().to_owned();
                            if l.is_empty() {
                                break;
                            }
                            if let Some((k, v)) = l.split_once(':') {
                                if k.eq_ignore_ascii_case("content-length") {
                                    len = v.trim().parse().unwrap();
                                }
                                h.lock().unwrap().push(l.to_ascii_lowercase());
                            }
                        }
                        let mut body = vec![0; len];
                        reader.read_exact(&mut body).unwrap();
                        if line.starts_with("POST /v1/traces") {
                            let req = ExportTraceServiceRequest::decode(&body[..]).unwrap();
                            let mut kept = s.lock().unwrap();
                            for rs in req.resource_spans {
                                for ss in rs.scope_spans {
                                    kept.extend(ss.spans);
                                }
                            }
                        }
                        let _ = conn.write_all(
                            b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n",
                        );
                    }
                });
            }
        });
        Receiver {
            port,
            spans,
            headers,
        }
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }
}

fn attrs(s: &Span) -> HashMap<String, String> {
    s.attributes
        .iter()
        .map(|kv| {
            let v = match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
                Some(Any::StringValue(t)) => t.clone(),
                Some(Any::IntValue(i)) => i.to_string(),
                Some(Any::DoubleValue(d)) => d.to_string(),
                Some(Any::BoolValue(b)) => b.to_string(),
                _ => String::new(),
            };
            (kv.key.clone(), v)
        })
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn spans_carry_the_genai_attributes_the_ledger_and_the_commands_traceparent() {
    let receiver = Receiver::start();
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(T);
    let bash = anthropic_tool_use_block(
        "t1",
        "bash",
        r#"{"command":"echo TP=$TRACEPARENT; echo H=${OTEL_EXPORTER_OTLP_HEADERS:-none}"}"#,
    );
    fake.push_for(
        "m-otel",
        Reply::ok(anthropic_message(
            &bash,
            "tool_use",
            r#"{"input_tokens":120,"output_tokens":30,"cache_creation_input_tokens":0,"cache_read_input_tokens":7}"#,
        )),
    );
    fake.push_for("m-otel", Reply::ok(anthropic_text("done")));
    let url = fake.url();
    let endpoint = format!("http://127.0.0.1:{}", receiver.port);
    let otel = |c: &mut std::process::Command| {
        c.env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_EXPORTER_OTLP_HEADERS", "x-collector-key=shh")
            .env("OTEL_BSP_SCHEDULE_DELAY", "200");
    };
    let mut spawn = lead(
        &team,
        &url,
        &[
            "spawn", "ann", "--role", "r", "--prompt", "run it", "--model", "m-otel",
        ],
    );
    otel(&mut spawn);
    assert!(spawn.output().unwrap().status.success());
    let mut run = lead(
        &team,
        &url,
        &[
            "run",
            "--sandbox",
            "off",
            "--stop-timeout",
            "3",
            "--kill-grace",
            "1",
        ],
    );
    otel(&mut run);
    let mut sup = Bg(run
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_until(T, "ann idle after two calls", || {
        let m = team.member("ann");
        (m.status == MemberStatus::Idle && m.calls >= 2).then_some(())
    });
    // The stop flushes what is left.
    let o = lead(&team, &url, &["stop"]).output().unwrap();
    assert!(o.status.success(), "{o:?}");
    let _ = sup.0.wait();
    let spans = wait_until(T, "the spans", || {
        let s = receiver.spans();
        (s.iter().filter(|s| s.name.starts_with("chat ")).count() >= 2).then_some(s)
    });

    let m = team.member("ann");
    let chats: Vec<&Span> = spans.iter().filter(|s| s.name == "chat m-otel").collect();
    assert_eq!(chats.len() as u64, m.calls, "a span per model call");
    let sum = |k: &str| -> u64 {
        chats
            .iter()
            .map(|s| attrs(s)[k].parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(sum("gen_ai.usage.input_tokens"), m.usage.input_tokens);
    assert_eq!(sum("gen_ai.usage.output_tokens"), m.usage.output_tokens);
    assert_eq!(
        sum("gen_ai.usage.cache_read.input_tokens"),
        m.usage.cache_read_input_tokens
    );
    let activation = spans
        .iter()
        .find(|s| s.name == "activation")
        .expect("an activation span");
    for s in &chats {
        let a = attrs(s);
        assert_eq!(a["gen_ai.operation.name"], "chat");
        assert_eq!(a["gen_ai.provider.name"], "anthropic");
        assert_eq!(a["gen_ai.request.model"], "m-otel");
        assert_eq!(a["troupe.member"], "ann");
        assert!(a.contains_key("troupe.team"));
        assert_eq!(
            s.parent_span_id, activation.span_id,
            "a child of its activation"
        );
        assert_eq!(s.trace_id, activation.trace_id);
        assert!(s.end_time_unix_nano >= s.start_time_unix_nano);
    }

    // The bash call's span is the parent the command's TRACEPARENT names.
    let tool = spans
        .iter()
        .find(|s| s.name == "execute_tool bash")
        .expect("the bash call's span");
    assert_eq!(attrs(tool)["gen_ai.tool.name"], "bash");
    let printed = team
        .transcript("ann")
        .into_iter()
        .find_map(|e| match e {
            Entry::ToolResults { results, .. } => Some(format!("{results:?}")),
            _ => None,
        })
        .expect("the command's output");
    let want = format!("TP=00-{}-{}-01", hex(&tool.trace_id), hex(&tool.span_id));
    assert!(printed.contains(&want), "{printed} lacks {want}");
    assert!(
        printed.contains("H=none"),
        "the export's headers reached the command: {printed}"
    );
    assert!(
        receiver
            .headers
            .lock()
            .unwrap()
            .iter()
            .any(|h| h == "x-collector-key: shh"),
        "the export sends its headers"
    );
}

/// Sockets of `pid` that are TCP or UDP (the inodes `/proc/net/*` lists).
fn network_sockets(pid: u32) -> usize {
    let mut inet = std::collections::HashSet::new();
    for table in ["tcp", "tcp6", "udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for l in text.lines().skip(1) {
            if let Some(inode) = l.split_whitespace().nth(9) {
                inet.insert(inode.to_owned());
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            l.strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(str::to_owned)
        })
        .filter(|inode| inet.contains(inode))
        .count()
}

#[test]
fn without_the_variable_a_worker_starts_no_thread_and_no_socket() {
    let team = Team::new();
    let cassette = team.path().join("c.jsonl");
    std::fs::write(
        &cassette,
        r#"{"agent":"*","seq":0,"response":{"content":[{"type":"text","text":"ack"}],"stop_reason":"end_turn"}}
"#,
    )
    .unwrap();
    let replay = |c: &mut std::process::Command| {
        c.env("TROUPE_PROVIDER", "replay")
            .env("TROUPE_CASSETTE", &cassette)
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    };
    let mut spawn = lead(
        &team,
        "http://127.0.0.1:9",
        &["spawn", "ann", "--role", "r", "--prompt", "hi"],
    );
    replay(&mut spawn);
    assert!(spawn.output().unwrap().status.success());
    let mut run = lead(&team, "http://127.0.0.1:9", &["run", "--sandbox", "off"]);
    replay(&mut run);
    let _sup = Bg(run
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    let pid = wait_until(T, "ann idle", || {
        let m = team.member("ann");
        (m.status == MemberStatus::Idle).then_some(m.pid).flatten()
    });
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .unwrap()
        .trim()
        .to_owned();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .unwrap()
        .trim()
        .to_owned();
    eprintln!("an idle worker without the export: {threads} thread(s), RSS {rss}");
    assert_eq!(threads, "1", "the idle worker runs one thread");
    assert_eq!(
        network_sockets(pid),
        0,
        "the idle worker holds no network socket"
    );
}
