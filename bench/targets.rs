//! The budgets of issue 6 (DESIGN.md section 11) and those added since, each with what was
//! measured and whether it was met. Reported, never asserted.

use serde_json::{Value, json};

use crate::startup;

/// The budgets of issue 6, each with what was measured and whether it was met.
pub fn all(doc: &Value) -> Value {
    let on_wake = |writers: u64| {
        doc["inbox_throughput"]
            .as_array()
            .and_then(|rs| {
                rs.iter().find(|r| {
                    r["discipline"] == "troupe"
                        && r["drain"] == "on_wake"
                        && r["writers"] == writers
                })
            })
            .cloned()
            .unwrap_or(Value::Null)
    };
    let (t1, t4) = (on_wake(1), on_wake(4));
    let rate = t4["msgs_per_sec"].as_f64();
    let lost = t4["lost"].as_u64();
    let rate1 = t1["msgs_per_sec"].as_f64();
    let lost1 = t1["lost"].as_u64();
    let drained_p99 = doc["wake_latency"]["send_to_drained"]["p99_ms"].as_f64();
    let wake_p99 = doc["wake_latency"]["p99_ms"].as_f64();
    let idle_ms = doc["spawn_100"]["all_idle_ms"].as_f64();
    let workers = doc["spawn_100"]["workers"].as_u64();
    let rss = doc["spawn_100"]["rss_mb_mean"].as_f64();
    let shut_p50 = doc["shutdown_round_trip"]["p50_ms"].as_f64();
    let cache_share = doc["prompt_cache"]["cache_read_share"].as_f64();
    let mut t = json!({
        "prompt_cache_read_share": {
            "target": ">= 0.85 of prompt tokens read from cache over the 30-step loop (issue 12)",
            "share": cache_share,
            "met": cache_share.is_some_and(|s| s >= 0.85),
        },
        "throughput_4_writers": {
            "target": ">= 400000 msgs/s with 4 writers, drained on every wake-up, 0 lost (issue 14; resolved at 300000)",
            "msgs_per_sec": rate.map(|r| r.round()),
            "lost": lost,
            "met": rate.is_some_and(|r| r >= 400_000.0) && lost == Some(0),
        },
        "throughput_1_writer": {
            "target": ">= 300000 msgs/s with 1 writer, drained on every wake-up, 0 lost",
            "msgs_per_sec": rate1.map(|r| r.round()),
            "lost": lost1,
            "met": rate1.is_some_and(|r| r >= 300_000.0) && lost1 == Some(0),
        },
        "wake_latency_p99": {
            "target": "< 1 ms",
            "ms": wake_p99,
            "met": wake_p99.is_some_and(|p| p < 1.0),
        },
        "send_to_drained_p99": {
            "target": "< 3 ms from send to drained and journaled",
            "ms": drained_p99,
            "met": drained_p99.is_some_and(|p| p < 3.0),
        },
        "spawn_100_to_idle": {
            "target": "100 workers idle within 3 s",
            "workers": workers,
            "ms": idle_ms,
            "met": workers == Some(100) && idle_ms.is_some_and(|t| t < 3000.0),
        },
        "idle_rss": {
            "target": "< 8 MB per idle worker (mean VmRSS)",
            "mb": rss,
            "met": rss.is_some_and(|r| r < 8.0),
        },
        "shutdown_round_trip_p50": {
            "target": "< 100 ms",
            "ms": shut_p50,
            "met": shut_p50.is_some_and(|p| p < 100.0),
        },
    });
    if let (Some(t), Value::Object(s)) = (t.as_object_mut(), startup::targets(doc)) {
        t.extend(s);
    }
    t
}

/// The targets of [`all`] whose names start with one of `prefixes` (the sections a partial run
/// measured).
pub fn only(doc: &Value, prefixes: &[&str]) -> Value {
    let mut t = all(doc);
    if let Some(t) = t.as_object_mut() {
        t.retain(|k, _| prefixes.iter().any(|p| k.starts_with(p)));
    }
    t
}
