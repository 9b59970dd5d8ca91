//! The event log in a team dir: `events.jsonl`, one JSON object per line, appended under
//! `events.lock` with one write that starts with `\n` (ending any fragment a killed writer
//! left), never trimmed.

use crate::error::{Error, Result};
use crate::fsutil;
use crate::teamdir::TeamDir;

/// Appends one event line (no newline in `line`).
pub fn append(team: &TeamDir, line: &[u8]) -> Result<()> {
    let mut buf = Vec::with_capacity(line.len() + 2);
    buf.push(b'\n');
    buf.extend_from_slice(line);
    buf.push(b'\n');
    let lock_path = team.events_lock();
    let lock = fsutil::open_lock(&lock_path)?;
    let _guard = fsutil::lock_exclusive(&lock, &lock_path)?;
    let path = team.events();
    let mut f = fsutil::open_append(&path)?;
    std::io::Write::write_all(&mut f, &buf).map_err(Error::io("append to", &path))
}

/// The complete lines after byte `offset`, and the offset just past the last one (a line still
/// being written is left for the next call). Empty lines are left out.
pub fn read(team: &TeamDir, offset: u64) -> Result<(Vec<Vec<u8>>, u64)> {
    use std::io::{Read, Seek, SeekFrom};
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
    let lines = buf[..complete]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
        .map(<[u8]>::to_vec)
        .collect();
    Ok((lines, offset + complete as u64))
}
