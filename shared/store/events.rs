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

/// Reads every complete event line (tests, `lead demo`, `lead status`).
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
/// call, or a position in the bus's event stream.
pub fn read_from(team: &TeamDir, offset: u64) -> Result<(Vec<Value>, u64)> {
    let (lines, next) = team.store().read_events(offset)?;
    Ok((parse_lines(lines), next))
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
