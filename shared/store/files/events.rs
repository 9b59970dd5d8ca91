//! The event log in a team dir: `events.jsonl`, one JSON object per line, appended under
//! `events.lock` with one write that starts with `\n` (ending any fragment a killed writer
//! left), never trimmed.
//!
//! A position in it is a byte offset at a line boundary: 0, or just past a `\n`. Reads go
//! forward from one in blocks ([`read`]) or back from one ([`read_back`]), so that what a reader
//! holds is what it asked for, not the log: the log of a busy team grows by hundreds of MB a
//! month, and `lead watch` and `lead top` look only at its end.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{Error, Result};
use crate::fsutil;
use crate::store::EventsBack;
use crate::teamdir::TeamDir;

/// How much a read takes from the file at a time, forward or back.
const BLOCK: usize = 64 * 1024;

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

/// The log, or `None` when there is none yet.
fn open(team: &TeamDir) -> Result<Option<File>> {
    let path = team.events();
    match File::open(&path) {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("open", &path)(e)),
    }
}

/// The complete lines after byte `offset` (up to byte `until`, a line boundary, when given),
/// at most `max` of them, and the offset just past the last one (a line still being written is
/// left for the next call). Empty lines are left out. The file is read a block at a time, only
/// as far as the lines wanted.
pub fn read(
    team: &TeamDir,
    offset: u64,
    until: Option<u64>,
    max: usize,
) -> Result<(Vec<Vec<u8>>, u64)> {
    let path = team.events();
    let Some(mut f) = open(team)? else {
        return Ok((Vec::new(), offset));
    };
    f.seek(SeekFrom::Start(offset))
        .map_err(Error::io("seek", &path))?;
    let mut lines = Vec::new();
    // Just past the last `\n` taken, and the bytes read after it (a line begun).
    let mut pos = offset;
    let mut begun: Vec<u8> = Vec::new();
    let mut block = vec![0u8; BLOCK];
    let mut read_to = offset;
    while lines.len() < max {
        let room = until.map_or(BLOCK as u64, |u| {
            u.saturating_sub(read_to).min(BLOCK as u64)
        });
        if room == 0 {
            break;
        }
        let n = match f.read(&mut block[..room as usize]) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io("read", &path)(e)),
        };
        read_to += n as u64;
        let mut start = 0;
        for nl in memchr::memchr_iter(b'\n', &block[..n]) {
            begun.extend_from_slice(&block[start..nl]);
            start = nl + 1;
            pos += begun.len() as u64 + 1;
            if !begun.is_empty() {
                lines.push(std::mem::take(&mut begun));
                if lines.len() == max {
                    return Ok((lines, pos));
                }
            }
        }
        begun.extend_from_slice(&block[start..n]);
    }
    Ok((lines, pos))
}

/// Up to `n` complete lines before position `before` (`None`: the end of the last complete
/// line; a line still being written is left out), oldest first, read back from there a block
/// at a time: a line cut by a block's start is read whole with the block before, so none is
/// torn. `to` is where they end (`before`, or the end found) and `from` where the first starts.
pub fn read_back(team: &TeamDir, before: Option<u64>, n: usize) -> Result<EventsBack> {
    read_back_in(&team.events(), before, n)
}

/// The last `n` complete lines of the file at `path` (none when it does not exist), oldest
/// first, read back from its end as [`read_back`] reads the event log: for a view of the end
/// of a journal or a log that may be large.
pub fn last_lines(path: &Path, n: usize) -> Result<Vec<Vec<u8>>> {
    Ok(read_back_in(path, None, n)?.lines)
}

/// [`read_back`] of the lines of the file at `path`.
fn read_back_in(path: &Path, before: Option<u64>, n: usize) -> Result<EventsBack> {
    let f = match File::open(path) {
        Ok(f) => Some(f),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(Error::io("open", path)(e)),
    };
    let Some(f) = f else {
        let at = before.unwrap_or(0);
        return Ok(EventsBack {
            lines: Vec::new(),
            from: at,
            to: at,
            at_start: true,
        });
    };
    let len = f.metadata().map_err(Error::io("stat", path))?.len();
    let end = before.unwrap_or(len).min(len);
    if n == 0
        && let Some(to) = before
    {
        return Ok(EventsBack {
            lines: Vec::new(),
            from: to,
            to,
            at_start: to == 0,
        });
    }
    // Where the lines end: `before`, or past the last `\n` found (unknown until then).
    let mut to = before.map(|_| end);
    // Newest first; `from` is the start of the last pushed.
    let mut lines: Vec<Vec<u8>> = Vec::new();
    let mut from = end;
    // The bytes from `cur` up to the oldest `\n` met so far: the end of a line whose start is
    // further back, in pieces (the newest first) so that a long line is copied once.
    let mut part: Vec<Vec<u8>> = Vec::new();
    let joined = |head: &[u8], part: &mut Vec<Vec<u8>>| {
        let mut line = head.to_vec();
        for p in part.drain(..).rev() {
            line.extend_from_slice(&p);
        }
        line
    };
    let mut cur = end;
    let mut block = vec![0u8; BLOCK];
    let wanted = |lines: &Vec<Vec<u8>>, to: Option<u64>| to.is_none() || lines.len() < n;
    while cur > 0 && wanted(&lines, to) {
        let start = cur.saturating_sub(BLOCK as u64);
        let buf = &mut block[..(cur - start) as usize];
        f.read_exact_at(buf, start)
            .map_err(Error::io("read", path))?;
        let mut tail = buf.len();
        for nl in memchr::memrchr_iter(b'\n', buf) {
            let at = start + nl as u64 + 1;
            if to.is_none() {
                // Past the last `\n`: a line being written (or nothing).
                to = Some(at);
                from = at;
                part.clear();
            } else {
                let line = joined(&buf[nl + 1..tail], &mut part);
                if !line.is_empty() {
                    lines.push(line);
                    from = at;
                }
            }
            tail = nl;
            if !wanted(&lines, to) {
                break;
            }
        }
        if !wanted(&lines, to) {
            break;
        }
        part.push(buf[..tail].to_vec());
        cur = start;
    }
    let to = to.unwrap_or(0);
    let at_start = cur == 0 && wanted(&lines, Some(to));
    if at_start && to > 0 {
        // The file's first line.
        let line = joined(&[], &mut part);
        if !line.is_empty() {
            lines.push(line);
        }
    }
    if at_start {
        from = 0;
    } else if lines.is_empty() {
        from = to;
    }
    lines.reverse();
    Ok(EventsBack {
        lines,
        from,
        to,
        at_start,
    })
}
