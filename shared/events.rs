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
    // One write: the leading `\n` ends a fragment a killed writer may have left.
    let mut line = vec![b'\n'];
    serde_json::to_writer(&mut line, &Value::Object(obj))
        .map_err(|e| Error::Protocol(format!("failed to serialize event: {e}")))?;
    line.push(b'\n');
    if let Some(bus) = team.bus() {
        return crate::bus::log_event(bus, &line[1..line.len() - 1]);
    }
    let lock_path = team.events_lock();
    let lock = fsutil::open_lock(&lock_path)?;
    let _guard = fsutil::lock_exclusive(&lock, &lock_path)?;
    let path = team.events();
    let mut f = fsutil::open_append(&path)?;
    std::io::Write::write_all(&mut f, &line).map_err(Error::io("append to", &path))
}

/// Reads every complete event line (tests, `lead demo`, `lead status`).
pub fn read_all(team: &TeamDir) -> Result<Vec<Value>> {
    if let Some(bus) = team.bus() {
        return Ok(read_bus(bus, 0)?.0);
    }
    let Some(bytes) = fsutil::read_optional(&team.events())? else {
        return Ok(Vec::new());
    };
    Ok(parse_lines(&bytes))
}

/// The events on `bus` after position `after`, and the position of the last one.
fn read_bus(bus: &crate::bus::RedisBus, after: u64) -> Result<(Vec<Value>, u64)> {
    let (lines, last) = crate::bus::read_events(bus, after)?;
    let mut out = Vec::with_capacity(lines.len());
    for l in lines {
        out.extend(parse_lines(&l));
    }
    Ok((out, last))
}

/// The events among `bytes`, one JSON object per line. Empty lines are skipped; a line that is
/// not a JSON object (a fragment left by a writer killed mid-write) is skipped with a warning.
fn parse_lines(bytes: &[u8]) -> Vec<Value> {
    bytes
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .filter_map(|l| match serde_json::from_slice::<Value>(l) {
            Ok(v @ Value::Object(_)) => Some(v),
            _ => {
                let shown = String::from_utf8_lossy(&l[..l.len().min(80)]);
                tracing::warn!("events.jsonl: skipping an unreadable line: {shown:?}");
                None
            }
        })
        .collect()
}

/// Reads the complete event lines after byte `offset`, returning them with the offset just past
/// the last complete line (for following the log as it grows, as `lead demo` does). A partly
/// written last line is left for the next call.
///
/// On a bus the offset is the position in the event stream instead (see
/// `bus::read_events`).
pub fn read_from(team: &TeamDir, offset: u64) -> Result<(Vec<Value>, u64)> {
    use std::io::{Read, Seek, SeekFrom};
    if let Some(bus) = team.bus() {
        return read_bus(bus, offset);
    }
    let path = team.events();
    let mut f = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), offset)),
        Err(e) => return Err(Error::io("open", &path)(e)),
    };
    f.seek(SeekFrom::Start(offset))
        .map_err(Error::io("seek", &path))?;
    let mut buf = Vec::new();
    f.read_to_end(&mut buf).map_err(Error::io("read", &path))?;
    let complete = buf.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
    Ok((parse_lines(&buf[..complete]), offset + complete as u64))
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
