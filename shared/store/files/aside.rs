//! Lines an inbox drain could not read, set aside in the local team dir on either backend:
//! `inbox/NAME.corrupt.jsonl`, with an `inbox_corrupt` event.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;

use serde_json::json;

use crate::error::{Error, Result};
use crate::events;
use crate::fsutil;
use crate::teamdir::{AgentName, TeamDir};

/// Appends `records` (each stamped with `at`) to `inbox/NAME.corrupt.jsonl`, fsynced, and logs
/// an `inbox_corrupt` event with `event`'s fields: where every drain, of a file or of a Redis
/// stream, puts what it could not read. Its caller is the inbox's one drainer (the drain lock,
/// or the journal's owner lock on a bus).
pub(crate) fn set_aside(
    team: &TeamDir,
    name: &AgentName,
    mut records: Vec<serde_json::Value>,
    event: serde_json::Value,
) -> Result<()> {
    let path = team.inbox_corrupt(name);
    fsutil::create_dir(&team.inbox_dir())?;
    let mut buf = Vec::new();
    for rec in &mut records {
        rec["at"] = json!(fsutil::now());
        serde_json::to_writer(&mut buf, &*rec)
            .map_err(|e| Error::Protocol(format!("failed to serialize corrupt record: {e}")))?;
        buf.push(b'\n');
    }
    let mut f = fsutil::open_append(&path)?;
    // Only the drainer writes this file. A torn last record is the copy of a line whose
    // setter-aside died before marking it consumed, so the line is still there (in the inbox, or
    // pending in the stream) and about to be set aside again: cut the torn copy.
    let len = f.metadata().map_err(Error::io("stat", &path))?.len();
    if len > 0 {
        let keep = last_newline_end(&f, len, &path)?;
        if keep < len {
            f.set_len(keep)
                .map_err(Error::io("truncate torn tail of", &path))?;
        }
    }
    f.write_all(&buf).map_err(Error::io("append to", &path))?;
    fsutil::sync_data(&f, &path)?;
    let mut fields = json!({"name": name, "lines": records.len()});
    if let (Some(f), serde_json::Value::Object(extra)) = (fields.as_object_mut(), event) {
        f.extend(extra);
    }
    events::log(team, "inbox_corrupt", fields);
    tracing::warn!(inbox = %name, lines = records.len(), "set aside unreadable inbox lines");
    Ok(())
}

/// The offset just past the last `\n` in the first `size` bytes of `file` (0 if none).
fn last_newline_end(file: &File, size: u64, path: &Path) -> Result<u64> {
    let mut end = size;
    let mut chunk = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(chunk.len() as u64);
        let n = (end - start) as usize;
        file.read_exact_at(&mut chunk[..n], start)
            .map_err(Error::io("read", path))?;
        if let Some(i) = chunk[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(start + i as u64 + 1);
        }
        end = start;
    }
    Ok(0)
}
