//! `events.jsonl`: the append-only audit log of the team.
//!
//! Spawns, exits, restarts, requests, decisions, escalations and set-aside inbox lines are each
//! one JSON line: `{"ts": 1764672000.1, "event": "spawn", ...fields}`. Lines are appended with one
//! `write_all` under `events.lock`, so concurrent processes never interleave. Logging an event
//! never fails the operation that caused it: a failure to log is reported on stderr.
//!
//! As in the inboxes, each line is written preceded by a `\n`: a writer killed mid-write leaves
//! an unterminated fragment, and the next event's leading `\n` ends it instead of being glued
//! to it. Readers skip the empty lines this leaves and set fragments aside with a warning.

use serde_json::{Map, Value, json};

use crate::error::{Error, Result};
use crate::fsutil;
use crate::teamdir::TeamDir;

/// Appends one event. `fields` must be a JSON object (anything else is stored under `"data"`).
pub fn log(team: &TeamDir, event: &str, fields: Value) {
    if let Err(e) = try_log(team, event, fields) {
        tracing::warn!("failed to log event {event}: {e}");
    }
}

/// Appends one event, reporting failure.
pub fn try_log(team: &TeamDir, event: &str, fields: Value) -> Result<()> {
    let mut obj = Map::new();
    obj.insert("ts".into(), json!(fsutil::now()));
    obj.insert("event".into(), json!(event));
    match fields {
        Value::Object(m) => obj.extend(m),
        Value::Null => {}
        other => {
            obj.insert("data".into(), other);
        }
    }
    let line = serde_json::to_vec(&Value::Object(obj))
        .map_err(|e| Error::Protocol(format!("failed to serialize event: {e}")))?;
    team.store().append_event(&line)
}

/// Reads every complete event line (tests, `lead demo`, `lead trace`).
pub fn read_all(team: &TeamDir) -> Result<Vec<Value>> {
    Ok(read_from(team, 0)?.0)
}

/// The events among `lines`. A line that is not a JSON object (a fragment left by a writer
/// killed mid-write) is skipped with a warning.
fn parse_lines(lines: Vec<Vec<u8>>) -> Vec<Value> {
    lines
        .into_iter()
        .filter_map(|l| match serde_json::from_slice::<Value>(&l) {
            Ok(v @ Value::Object(_)) => Some(v),
            _ => {
                let shown = String::from_utf8_lossy(&l[..l.len().min(80)]);
                tracing::warn!("events: skipping an unreadable line: {shown:?}");
                None
            }
        })
        .collect()
}

/// Reads the complete events after position `offset` (0: from the first), returning them with
/// the position to read from next (for following the log as it grows, as `lead demo` does):
/// a byte offset in `events.jsonl`, where a partly written last line is left for the next
/// call, or a position in the bus's event stream. Everything after `offset` is read: a
/// follower that may fall behind reads in pages with [`read_page`].
pub fn read_from(team: &TeamDir, offset: u64) -> Result<(Vec<Value>, u64)> {
    read_page(team, offset, None, usize::MAX)
}

/// As [`read_from`], but at most `max` lines (fragments count) and, with `until`, only the
/// events up to that position: a reader that pages through the log holds one page at a time.
/// The position returned is `offset` when nothing more is there.
pub fn read_page(
    team: &TeamDir,
    offset: u64,
    until: Option<u64>,
    max: usize,
) -> Result<(Vec<Value>, u64)> {
    let (lines, next) = team.store().read_events(offset, until, max)?;
    Ok((parse_lines(lines), next))
}

/// The position of the log's end: reading from it gives the events logged after this call.
/// Only the end of the log is read (on a bus, its newest entry).
pub fn end(team: &TeamDir) -> Result<u64> {
    Ok(team.store().read_events_back(None, 0)?.to)
}

/// The last `n` events of the log, oldest first (fewer when the log holds fewer), and the
/// position to read on from: the same events as the last `n` of [`read_all`], read back from
/// the end, so that the time and memory this takes do not grow with the log.
pub fn tail(team: &TeamDir, n: usize) -> Result<(Vec<Value>, u64)> {
    let first = team.store().read_events_back(None, n)?;
    let to = first.to;
    let mut pages = vec![parse_lines(first.lines)];
    let (mut have, mut from, mut at_start) = (pages[0].len(), first.from, first.at_start);
    // Fragments are not events: read further back for as many as they took.
    while have < n && !at_start {
        let back = team.store().read_events_back(Some(from), n - have)?;
        let evs = parse_lines(back.lines);
        have += evs.len();
        (from, at_start) = (back.from, back.at_start);
        pages.push(evs);
    }
    let mut out = Vec::with_capacity(have);
    for page in pages.into_iter().rev() {
        out.extend(page);
    }
    Ok((out, to))
}

/// How much older than the time asked for an event may be logged after one of that time:
/// an event's `ts` is taken before the wait for the log's lock, and on a bus each host stamps
/// its own with its own clock. [`since`] reads back this much further.
pub const SINCE_SLACK: f64 = 300.0;

/// The events a page read back holds.
const PAGE: usize = 1000;

/// A position before every event of the log up to position `before` whose `ts` is `t` or
/// later: found by reading back from `before` a page at a time, to the first event older
/// than `t` by more than [`SINCE_SLACK`] (or the log's start). Reading on from it (with
/// [`read_page`]) and keeping the events of `ts >= t` gives what a read of the whole log and
/// that filter would, in time and memory that grow with the events since `t`, not the log.
pub fn since(team: &TeamDir, t: f64, before: u64) -> Result<u64> {
    #[derive(serde::Deserialize)]
    struct Stamp {
        ts: Option<f64>,
    }
    let mut at = before;
    loop {
        let back = team.store().read_events_back(Some(at), PAGE)?;
        if back.at_start {
            return Ok(0);
        }
        let older = back.lines.iter().any(|l| {
            serde_json::from_slice::<Stamp>(l)
                .ok()
                .and_then(|s| s.ts)
                .is_some_and(|ts| ts < t - SINCE_SLACK)
        });
        if older || back.from >= at {
            return Ok(back.from);
        }
        at = back.from;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::files;

    #[test]
    fn a_fragment_does_not_swallow_the_next_event() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        try_log(&team, "one", json!({})).unwrap();
        // A writer killed mid-write.
        let mut f = fsutil::open_append(&team.events()).unwrap();
        std::io::Write::write_all(&mut f, br#"{"ts":1,"eve"#).unwrap();
        try_log(&team, "two", json!({"n": 2})).unwrap();
        let names: Vec<_> = read_all(&team)
            .unwrap()
            .into_iter()
            .map(|e| e["event"].clone())
            .collect();
        assert_eq!(names, [json!("one"), json!("two")]);
        let (followed, end) = read_from(&team, 0).unwrap();
        assert_eq!(followed.len(), 2);
        assert_eq!(end, std::fs::metadata(team.events()).unwrap().len());
    }

    /// A log of `count` events of lengths drawn from `seed` (some longer than a block, so that
    /// reads back cross block starts inside a line), with fragments, empty lines and a last line
    /// still being written.
    fn a_log(seed: u64, count: usize) -> (tempfile::TempDir, TeamDir) {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let mut x = seed;
        let mut next = move || {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            x >> 33
        };
        let mut raw = fsutil::open_append(&team.events()).unwrap();
        for i in 0..count {
            let len = match next() % 10 {
                0 => 70_000 + (next() % 70_000) as usize,
                1 => 0,
                _ => (next() % 300) as usize,
            };
            try_log(&team, "e", json!({"i": i, "pad": "x".repeat(len)})).unwrap();
            match next() % 12 {
                0 => std::io::Write::write_all(&mut raw, br#"{"ts":1,"frag"#).unwrap(),
                1 => std::io::Write::write_all(&mut raw, b"\n\n").unwrap(),
                _ => {}
            }
        }
        std::io::Write::write_all(&mut raw, br#"{"ts":2,"event":"being written"#).unwrap();
        (tmp, team)
    }

    #[test]
    fn the_tail_is_the_end_of_the_whole_log_and_reads_on_from_the_same_place() {
        for seed in 1..6 {
            let (_tmp, team) = a_log(seed, 60);
            let (all, end) = read_from(&team, 0).unwrap();
            assert_eq!(super::end(&team).unwrap(), end);
            for n in [0, 1, 2, 7, 59, 60, 61, 500] {
                let (last, at) = tail(&team, n).unwrap();
                assert_eq!(at, end, "seed {seed}, n {n}");
                assert_eq!(
                    last,
                    all[all.len().saturating_sub(n)..],
                    "seed {seed}, n {n}"
                );
            }
            let (lines, _) = team.store().read_events(0, None, usize::MAX).unwrap();
            for n in [0, 1, 7, 500] {
                assert_eq!(
                    files::events::last_lines(&team.events(), n).unwrap(),
                    lines[lines.len().saturating_sub(n)..],
                    "seed {seed}, last {n} lines"
                );
            }
            // Once the last line is complete, the next read from the tail's end gives it.
            try_log(&team, "after", json!({})).unwrap();
            let (more, _) = read_from(&team, end).unwrap();
            assert_eq!(more.last().unwrap()["event"], "after");
        }
    }

    #[test]
    fn pages_back_and_forth_cover_the_log_once() {
        for seed in 10..14 {
            let (_tmp, team) = a_log(seed, 40);
            let (lines, end) = team.store().read_events(0, None, usize::MAX).unwrap();
            // Back, three lines a page, from the end to the start.
            let mut back = Vec::new();
            let mut at = None;
            loop {
                let page = team.store().read_events_back(at, 3).unwrap();
                if at.is_none() {
                    assert_eq!(page.to, end);
                }
                // Reading on from a page's start gives its lines first.
                let (again, _) = team
                    .store()
                    .read_events(page.from, Some(page.to), usize::MAX)
                    .unwrap();
                assert_eq!(again, page.lines, "seed {seed}");
                back.splice(0..0, page.lines);
                if page.at_start {
                    break;
                }
                at = Some(page.from);
            }
            assert_eq!(back, lines, "seed {seed}");
            // Forward, five lines a page.
            let mut fwd = Vec::new();
            let mut pos = 0;
            loop {
                let (page, next) = team.store().read_events(pos, None, 5).unwrap();
                assert!(page.len() <= 5);
                if next == pos {
                    break;
                }
                fwd.extend(page);
                pos = next;
            }
            assert_eq!((fwd, pos), (lines, end), "seed {seed}");
        }
    }

    #[test]
    fn since_starts_before_every_event_of_that_time_and_reads_back_no_further_than_it_must() {
        let tmp = tempfile::tempdir().unwrap();
        let team = TeamDir::create(tmp.path().join(".team")).unwrap();
        let line = |ts: f64, i: usize| {
            serde_json::to_vec(&json!({"ts": ts, "event": "e", "i": i})).unwrap()
        };
        // 5000 old events, then 30 an hour old, then 20 recent ones with one logged late.
        for i in 0..5000 {
            files::events::append(&team, &line(1000.0, i)).unwrap();
        }
        for i in 0..30 {
            files::events::append(&team, &line(10_000.0, i)).unwrap();
        }
        for i in 0..20 {
            let ts = if i == 5 {
                13_590.0
            } else {
                13_600.0 + i as f64
            };
            files::events::append(&team, &line(ts, i)).unwrap();
        }
        let end = super::end(&team).unwrap();
        let wanted = |t: f64| -> Vec<Value> {
            read_all(&team)
                .unwrap()
                .into_iter()
                .filter(|e| e["ts"].as_f64() >= Some(t))
                .collect()
        };
        for t in [0.0, 1000.0, 5000.0, 13_595.0, 13_600.0, 20_000.0] {
            let at = since(&team, t, end).unwrap();
            let (got, _) = read_page(&team, at, Some(end), usize::MAX).unwrap();
            let got: Vec<Value> = got
                .into_iter()
                .filter(|e| e["ts"].as_f64() >= Some(t))
                .collect();
            assert_eq!(got, wanted(t), "since {t}");
            if t >= 13_595.0 {
                // Not back into the old events: a page of them at most.
                let (read, _) = read_page(&team, at, Some(end), usize::MAX).unwrap();
                assert!(read.len() <= 30 + 20 + PAGE, "since {t}: {}", read.len());
            }
        }
    }
}
