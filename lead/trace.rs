//! `lead trace`: the team's history as a Chrome trace event file (opens in Perfetto and
//! `chrome://tracing`), or as text.
//!
//! Everything drawn is a time a journal or the event log recorded (nothing is inferred from
//! neighbouring entries): one track per agent (each transcript, and the lead's, where its
//! messages came from); on it, activations (`B`/`E`: from the first message consumed, or the
//! first call, to the end of the call that asked for no tool, or to the last record before the
//! process ended), model calls and compactions (`X`, with model, tokens and cost; the wait for
//! the rate governor as a slice inside), tool calls (`X`); each message as a short `send` slice
//! on its sender's track with a flow arrow to the recipient's track at the moment it was
//! consumed; the supervisor's events about a member (spawn, exit, restart, hung, ...) as
//! instants on its track.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Value, json};
use troupe::TeamDir;
use troupe::cost::PriceTable;
use troupe::llm::Block;
use troupe::transcript::Entry;

#[derive(Debug, clap::Args)]
pub struct TraceArgs {
    /// `chrome` (a trace event file) or `text` (an indented listing).
    #[arg(long, default_value = "chrome", value_parser = ["chrome", "text"])]
    format: String,
    /// Write here instead of stdout.
    #[arg(long, short)]
    output: Option<std::path::PathBuf>,
    /// Per-model prices (as `lead run --prices`), for the cost of each call.
    #[arg(long)]
    prices: Option<std::path::PathBuf>,
}

pub fn trace(team: &TeamDir, a: TraceArgs) -> anyhow::Result<u8> {
    let prices = PriceTable::load(a.prices.as_deref())?;
    let mut journals = Vec::new();
    if let Ok(dir) = std::fs::read_dir(team.transcripts_dir()) {
        for e in dir.flatten() {
            let path = e.path();
            let Some(name) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".jsonl"))
            else {
                continue;
            };
            journals.push((name.to_owned(), read_journal(&path)?));
        }
    }
    journals.sort_by(|a, b| a.0.cmp(&b.0));
    let events = troupe::events::read_all(team)?;
    let spans = build(&journals, &events, &prices);
    let text = match a.format.as_str() {
        "text" => render_text(&spans),
        _ => serde_json::to_string_pretty(&chrome(&spans))? + "\n",
    };
    match &a.output {
        Some(p) => std::fs::write(p, text)?,
        None => {
            use std::io::Write;
            let mut out = std::io::stdout().lock();
            if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush())
                && e.kind() != std::io::ErrorKind::BrokenPipe
            {
                return Err(e.into());
            }
        }
    }
    Ok(0)
}

fn read_journal(path: &Path) -> anyhow::Result<Vec<Entry>> {
    Ok(troupe::transcript::read_entries(path)?)
}

/// What the trace holds, in seconds since the epoch, before it is written in either format.
#[derive(Debug, Default, PartialEq)]
pub struct Spans {
    /// Track names, in order (a track's index is its `tid` less one).
    pub tracks: Vec<String>,
    pub slices: Vec<Slice>,
    /// Activations, as begin and end.
    pub activations: Vec<Slice>,
    pub flows: Vec<Flow>,
    pub instants: Vec<Instant>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Slice {
    pub track: usize,
    pub name: String,
    pub cat: &'static str,
    pub start: f64,
    pub end: f64,
    pub args: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Flow {
    pub from: usize,
    pub to: usize,
    pub sent: f64,
    pub consumed: f64,
    pub id: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Instant {
    pub track: usize,
    pub name: String,
    pub at: f64,
    pub args: Value,
}

/// The spans of `journals` (agent name, entries) and the member events among `events`.
pub fn build(journals: &[(String, Vec<Entry>)], events: &[Value], prices: &PriceTable) -> Spans {
    let mut s = Spans::default();
    let mut track_of: BTreeMap<String, usize> = BTreeMap::new();
    let mut track = |s: &mut Spans, name: &str| -> usize {
        *track_of.entry(name.to_owned()).or_insert_with(|| {
            s.tracks.push(name.to_owned());
            s.tracks.len() - 1
        })
    };
    for (name, _) in journals {
        track(&mut s, name);
    }
    for (name, entries) in journals {
        let t = track(&mut s, name);
        // The activation open now, and the latest time recorded in it.
        let mut open: Option<(f64, f64)> = None;
        let close = |s: &mut Spans, open: &mut Option<(f64, f64)>| {
            if let Some((start, end)) = open.take() {
                s.activations.push(Slice {
                    track: t,
                    name: "activation".into(),
                    cat: "activation",
                    start,
                    end,
                    args: json!({}),
                });
            }
        };
        let begin = |open: &mut Option<(f64, f64)>, at: f64| {
            let (start, end) = open.get_or_insert((at, at));
            *start = start.min(at);
            *end = end.max(at);
        };
        for entry in entries {
            match entry {
                Entry::Session { .. } => close(&mut s, &mut open),
                Entry::Inbox {
                    message,
                    at: Some(at),
                } => {
                    begin(&mut open, *at);
                    let from = track(&mut s, &message.from);
                    let sent = message.timestamp.min(*at);
                    s.slices.push(Slice {
                        track: from,
                        name: format!("send -> {name}"),
                        cat: "message",
                        start: sent,
                        end: sent + 1e-6,
                        args: json!({"id": message.id, "type": message.kind,
                            "content": preview(&message.content)}),
                    });
                    s.flows.push(Flow {
                        from,
                        to: t,
                        sent,
                        consumed: *at,
                        id: message.id.clone(),
                    });
                }
                Entry::User { at, .. } => begin(&mut open, *at),
                Entry::Assistant {
                    response,
                    at,
                    started_at: Some(started),
                    waited,
                    seq,
                } => {
                    begin(&mut open, *started);
                    begin(&mut open, *at);
                    let u = &response.usage;
                    s.slices.push(Slice {
                        track: t,
                        name: format!("model {}", response.model),
                        cat: "model",
                        start: *started,
                        end: *at,
                        args: json!({"call": seq, "model": response.model,
                            "input_tokens": u.input_tokens, "output_tokens": u.output_tokens,
                            "cache_read_tokens": u.cache_read_input_tokens,
                            "cache_write_tokens": u.cache_creation_input_tokens,
                            "cost_usd": prices.cost(&response.model, u),
                            "stop_reason": response.stop_reason}),
                    });
                    if let Some(w) = waited.filter(|w| *w > 0.0) {
                        s.slices.push(Slice {
                            track: t,
                            name: "waiting for the rate governor".into(),
                            cat: "wait",
                            start: *started,
                            end: (*started + w).min(*at),
                            args: json!({}),
                        });
                    }
                    let asked_tools = response
                        .content
                        .iter()
                        .any(|b| matches!(b, Block::ToolUse { .. }));
                    if !asked_tools {
                        close(&mut s, &mut open);
                    }
                }
                Entry::ToolResults { timings, at, .. } => {
                    for tm in timings {
                        begin(&mut open, tm.started_at);
                        s.slices.push(Slice {
                            track: t,
                            name: format!("tool {}", tm.name),
                            cat: "tool",
                            start: tm.started_at,
                            end: tm.ended_at.max(tm.started_at),
                            args: json!({"tool_use_id": tm.tool_use_id}),
                        });
                    }
                    if open.is_some() {
                        begin(&mut open, *at);
                    }
                }
                Entry::Compaction {
                    at,
                    started_at: Some(started),
                    tokens_before,
                    ..
                } => {
                    begin(&mut open, *started);
                    begin(&mut open, *at);
                    s.slices.push(Slice {
                        track: t,
                        name: "compaction".into(),
                        cat: "model",
                        start: *started,
                        end: *at,
                        args: json!({"tokens_before": tokens_before}),
                    });
                }
                _ => {}
            }
        }
        close(&mut s, &mut open);
    }
    for ev in events {
        let Some(name) = ev["name"].as_str() else {
            continue;
        };
        let (Some(kind), Some(at)) = (ev["event"].as_str(), ev["ts"].as_f64()) else {
            continue;
        };
        // A member's own life: the supervisor's view of it, and its requests.
        if matches!(kind, "message" | "tool") {
            continue;
        }
        let t = track(&mut s, name);
        let mut args = ev.clone();
        if let Value::Object(m) = &mut args {
            m.remove("ts");
            m.remove("event");
            m.remove("name");
        }
        s.instants.push(Instant {
            track: t,
            name: kind.to_owned(),
            at,
            args,
        });
    }
    s
}

fn preview(text: &str) -> String {
    let one: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if one.chars().count() > 80 {
        format!("{}…", one.chars().take(79).collect::<String>())
    } else {
        one
    }
}

/// Microseconds, the unit of Chrome trace events.
fn us(t: f64) -> f64 {
    (t * 1e6).round()
}

/// The trace event file (JSON object format).
pub fn chrome(s: &Spans) -> Value {
    let pid = 1;
    let tid = |t: usize| t + 1;
    let mut out = vec![json!({"ph": "M", "name": "process_name", "pid": pid,
        "args": {"name": "troupe team"}})];
    for (i, name) in s.tracks.iter().enumerate() {
        out.push(
            json!({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid(i),
            "args": {"name": name}}),
        );
        out.push(
            json!({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid(i),
            "args": {"sort_index": i}}),
        );
    }
    for a in &s.activations {
        out.push(json!({"ph": "B", "name": a.name, "cat": a.cat, "pid": pid,
            "tid": tid(a.track), "ts": us(a.start), "args": a.args}));
        out.push(json!({"ph": "E", "pid": pid, "tid": tid(a.track), "ts": us(a.end)}));
    }
    for x in &s.slices {
        let (start, end) = (us(x.start), us(x.end));
        out.push(json!({"ph": "X", "name": x.name, "cat": x.cat, "pid": pid,
            "tid": tid(x.track), "ts": start, "dur": (end - start).max(0.0), "args": x.args}));
    }
    for (n, f) in s.flows.iter().enumerate() {
        let id = n + 1;
        out.push(
            json!({"ph": "s", "name": "message", "cat": "message", "id": id, "pid": pid,
            "tid": tid(f.from), "ts": us(f.sent)}),
        );
        out.push(
            json!({"ph": "f", "bp": "e", "name": "message", "cat": "message", "id": id,
            "pid": pid, "tid": tid(f.to), "ts": us(f.consumed)}),
        );
    }
    for i in &s.instants {
        out.push(
            json!({"ph": "i", "s": "t", "name": i.name, "pid": pid, "tid": tid(i.track),
            "ts": us(i.at), "args": i.args}),
        );
    }
    json!({"traceEvents": out, "displayTimeUnit": "ms"})
}

/// The spans as text: per track, each activation with the calls inside it, times in seconds
/// from the trace's start. Names and previews come from journals a model wrote (a tool name, a
/// message's text): each line is escaped for the terminal ([`troupe::term_text`]).
pub fn render_text(s: &Spans) -> String {
    let t0 = s
        .activations
        .iter()
        .chain(&s.slices)
        .map(|x| x.start)
        .chain(s.instants.iter().map(|i| i.at))
        .fold(f64::INFINITY, f64::min);
    let t0 = if t0.is_finite() { t0 } else { 0.0 };
    let mut out = String::new();
    for (t, name) in s.tracks.iter().enumerate() {
        out.push_str(&troupe::term_text::line(name));
        out.push('\n');
        let mut rows: Vec<(f64, u8, String)> = Vec::new();
        for a in s.activations.iter().filter(|a| a.track == t) {
            rows.push((a.start, 0, row(t0, a.start, a.end, 1, "activation")));
        }
        for x in s.slices.iter().filter(|x| x.track == t) {
            let depth = if x.cat == "wait" { 3 } else { 2 };
            let what = match x.cat {
                "model" if x.args.get("input_tokens").is_some() => format!(
                    "{}  {} in / {} out  ${:.4}",
                    x.name,
                    x.args["input_tokens"],
                    x.args["output_tokens"],
                    x.args["cost_usd"].as_f64().unwrap_or(0.0)
                ),
                "message" => format!("{}  {}", x.name, x.args["content"]),
                _ => x.name.clone(),
            };
            let order = if x.cat == "wait" { 2 } else { 1 };
            rows.push((x.start, order, row(t0, x.start, x.end, depth, &what)));
        }
        for i in s.instants.iter().filter(|i| i.track == t) {
            rows.push((
                i.at,
                3,
                format!("  {:>9.3}s          * {}", i.at - t0, i.name),
            ));
        }
        rows.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, _, r) in rows {
            out.push_str(&troupe::term_text::line(&r));
            out.push('\n');
        }
    }
    out
}

fn row(t0: f64, start: f64, end: f64, depth: usize, what: &str) -> String {
    format!(
        "  {:>9.3}s {:>8.3}s {}{what}",
        start - t0,
        end - start,
        "  ".repeat(depth - 1)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use troupe::llm::{ChatResponse, StopReason, Usage};
    use troupe::message::{Message, MessageType};
    use troupe::transcript::ToolTiming;

    fn answer(tools: bool, at: f64, started: f64) -> Entry {
        let content = if tools {
            vec![Block::ToolUse {
                id: "t1".into(),
                name: "bash".into(),
                input: json!({}),
            }]
        } else {
            vec![Block::Text { text: "ok".into() }]
        };
        Entry::Assistant {
            seq: 1,
            response: ChatResponse {
                content,
                stop_reason: if tools {
                    StopReason::ToolUse
                } else {
                    StopReason::EndTurn
                },
                usage: Usage {
                    input_tokens: 100,
                    output_tokens: 10,
                    ..Usage::default()
                },
                model: "m".into(),
            },
            at,
            started_at: Some(started),
            waited: Some(0.5),
        }
    }

    #[test]
    fn an_activation_holds_its_calls_and_a_message_flows_from_its_sender() {
        let mut m = Message::new(MessageType::Message, "lead", "ann", "do it");
        m.timestamp = 9.0;
        let ann = vec![
            Entry::Session {
                incarnation: 1,
                pid: 1,
                at: 5.0,
            },
            Entry::Inbox {
                message: m,
                at: Some(10.0),
            },
            answer(true, 12.0, 10.1),
            Entry::ToolResults {
                results: vec![],
                inbox_ids: vec![],
                at: 13.0,
                timings: vec![ToolTiming {
                    tool_use_id: "t1".into(),
                    name: "bash".into(),
                    started_at: 12.1,
                    ended_at: 12.9,
                }],
            },
            answer(false, 14.0, 13.1),
            Entry::Idle {
                at: 14.1,
                notification: None,
            },
        ];
        let events = vec![json!({"ts": 4.0, "event": "spawn", "name": "ann"})];
        let s = build(
            &[("ann".into(), ann)],
            &events,
            &PriceTable::load(None).unwrap(),
        );
        assert_eq!(s.tracks, ["ann", "lead"]);
        assert_eq!(s.activations.len(), 1);
        assert_eq!((s.activations[0].start, s.activations[0].end), (10.0, 14.0));
        let names: Vec<&str> = s.slices.iter().map(|x| x.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "send -> ann",
                "model m",
                "waiting for the rate governor",
                "tool bash",
                "model m",
                "waiting for the rate governor"
            ]
        );
        assert_eq!(s.slices[0].track, 1, "the send is on the lead's track");
        assert_eq!(
            (
                s.flows[0].from,
                s.flows[0].to,
                s.flows[0].sent,
                s.flows[0].consumed
            ),
            (1, 0, 9.0, 10.0)
        );
        assert_eq!(s.instants[0].name, "spawn");
        let text = render_text(&s);
        assert!(text.contains("activation"), "{text}");
        assert!(text.contains("tool bash"), "{text}");
        let c = chrome(&s);
        let evs = c["traceEvents"].as_array().unwrap();
        assert!(
            evs.iter()
                .any(|e| e["ph"] == "B" && e["ts"] == 10_000_000.0)
        );
        assert!(evs.iter().any(|e| e["ph"] == "f" && e["bp"] == "e"));
    }

    #[test]
    fn a_process_that_ended_mid_activation_closes_it_at_its_last_record() {
        let mut m = Message::new(MessageType::Message, "lead", "ann", "do it");
        m.timestamp = 1.0;
        let ann = vec![
            Entry::Inbox {
                message: m,
                at: Some(2.0),
            },
            answer(true, 3.0, 2.1),
            Entry::Session {
                incarnation: 2,
                pid: 2,
                at: 20.0,
            },
        ];
        let s = build(
            &[("ann".into(), ann)],
            &[],
            &PriceTable::load(None).unwrap(),
        );
        assert_eq!(s.activations.len(), 1);
        assert_eq!((s.activations[0].start, s.activations[0].end), (2.0, 3.0));
    }
}
