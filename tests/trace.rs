//! Issue 26, `lead trace`: the demo's team dir (the real `lead demo` on its shipped cassette)
//! written as a Chrome trace event file: the `B`/`E` events nest on each track, every `X` has
//! `dur >= 0` and nests with the rest, every flow event binds to a slice on its track, there
//! is one track per agent, and there is a model-call span for each model call and a tool span
//! for each tool call the journals record. The text form lists the same spans.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;
use troupe::transcript::{Entry, read_entries};

fn lead(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lead"))
        .args(args)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove("TROUPE_BUS")
        .output()
        .unwrap()
}

/// A slice: start and end, in microseconds.
type Span = (f64, f64);

#[test]
fn the_demos_trace_nests_binds_its_flows_and_has_a_span_per_call() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("demo");
    let o = lead(&["demo", "--dir", dir.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let team = dir.join(".team");
    let o = lead(&["--team-dir", team.to_str().unwrap(), "trace"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let trace: Value = serde_json::from_slice(&o.stdout).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();

    // One track per agent: every journal's, and no name twice.
    let names: Vec<(u64, String)> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let unique: BTreeSet<&str> = names.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(unique.len(), names.len(), "{names:?}");
    let mut journals = BTreeMap::new();
    for e in std::fs::read_dir(team.join("transcripts")).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "jsonl") {
            let name = p.file_stem().unwrap().to_str().unwrap().to_owned();
            journals.insert(name, read_entries(&p).unwrap());
        }
    }
    assert_eq!(
        unique,
        journals.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        "a track per agent"
    );
    assert!(journals.len() >= 3, "{journals:?}");

    // Per track: B/E balanced and in order, every X with dur >= 0, all of them nested.
    let mut spans: BTreeMap<u64, Vec<Span>> = BTreeMap::new();
    let mut open: BTreeMap<u64, Vec<f64>> = BTreeMap::new();
    let ts = |e: &Value| e["ts"].as_f64().unwrap();
    let mut by_time: Vec<&Value> = events.iter().filter(|e| e["ph"] != "M").collect();
    by_time.sort_by(|a, b| ts(a).total_cmp(&ts(b)));
    for e in events {
        let tid = e["tid"].as_u64().unwrap_or(0);
        match e["ph"].as_str().unwrap() {
            "B" => open.entry(tid).or_default().push(ts(e)),
            "E" => {
                let start = open
                    .get_mut(&tid)
                    .and_then(Vec::pop)
                    .unwrap_or_else(|| panic!("an E without its B on track {tid}: {e}"));
                assert!(ts(e) >= start, "{e}");
                spans.entry(tid).or_default().push((start, ts(e)));
            }
            "X" => {
                let dur = e["dur"].as_f64().unwrap();
                assert!(dur >= 0.0, "{e}");
                spans.entry(tid).or_default().push((ts(e), ts(e) + dur));
            }
            _ => {}
        }
    }
    assert!(open.values().all(Vec::is_empty), "a B without its E");
    for (tid, list) in &spans {
        for (i, a) in list.iter().enumerate() {
            for b in &list[i + 1..] {
                let disjoint = a.1 <= b.0 || b.1 <= a.0;
                let nested = (a.0 <= b.0 && b.1 <= a.1) || (b.0 <= a.0 && a.1 <= b.1);
                assert!(
                    disjoint || nested,
                    "track {tid}: {a:?} and {b:?} overlap without nesting"
                );
            }
        }
    }

    // Every flow event binds to a slice of its track (start and end, by id).
    let mut flows: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "s" || e["ph"] == "f") {
        let tid = e["tid"].as_u64().unwrap();
        let t = ts(e);
        let inside = spans
            .get(&tid)
            .is_some_and(|l| l.iter().any(|(a, b)| *a <= t && t <= *b));
        assert!(inside, "a flow event binds to no slice: {e}");
        let n = flows.entry(e["id"].as_u64().unwrap()).or_default();
        if e["ph"] == "s" {
            n.0 += 1;
        } else {
            n.1 += 1;
        }
    }
    assert!(!flows.is_empty());
    assert!(flows.values().all(|&n| n == (1, 1)), "{flows:?}");

    // A span for each model call and each tool call the journals record.
    let (mut calls, mut tools) = (0, 0);
    for entries in journals.values() {
        for e in entries {
            match e {
                Entry::Assistant { .. } | Entry::Compaction { .. } => calls += 1,
                Entry::ToolResults { results, .. } => tools += results.len(),
                _ => {}
            }
        }
    }
    let count = |cat: &str| {
        events
            .iter()
            .filter(|e| {
                e["ph"] == "X" && e["cat"] == cat && e["name"] != "waiting for the rate governor"
            })
            .count()
    };
    assert!(calls > 10 && tools > 5, "{calls} calls, {tools} tools");
    assert_eq!(count("model"), calls);
    assert_eq!(count("tool"), tools);
    let with_tokens = events
        .iter()
        .filter(|e| e["cat"] == "model" && e["args"]["output_tokens"].as_u64() > Some(0))
        .count();
    assert_eq!(with_tokens, calls, "every model span carries its tokens");

    // The text form lists the same.
    let o = lead(&[
        "--team-dir",
        team.to_str().unwrap(),
        "trace",
        "--format",
        "text",
    ]);
    assert!(o.status.success());
    let text = String::from_utf8(o.stdout).unwrap();
    assert_eq!(text.matches(" model ").count(), calls, "{text}");
    assert_eq!(text.matches(" tool ").count(), tools, "{text}");
}
