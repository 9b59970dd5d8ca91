//! `lead watch`: the team's events as they happen, one a line (or one JSON object a line with
//! `--json`, flushed as each comes), from now or from `--since`, filtered by member and event,
//! ending with the team with `--until-stop`.
//!
//! Events are read through the store (the team dir's `events.jsonl`, or the bus's stream), from
//! the position the last read ended at, every 100 ms: each event is printed once, in the log's
//! order. The start is the log's end, found by reading back from it (on a bus, its newest
//! entry), and `--since` reads back from there only as far as the time it names
//! ([`events::since`]): neither reads the rest of the log, which is never trimmed, and
//! reads go a page at a time, so what `lead watch` holds does not grow with the log.

use std::io::Write;
use std::time::Duration;

use serde_json::Value;
use troupe::TeamDir;
use troupe::events;

#[derive(Debug, clap::Args)]
pub struct WatchArgs {
    /// Begin with the events since this time: an age (`90s`, `10m`, `2h`, `1d`), Unix seconds,
    /// or an RFC 3339 time (default: from now on).
    #[arg(long)]
    since: Option<String>,
    /// One JSON object a line, as in events.jsonl.
    #[arg(long)]
    json: bool,
    /// Only events about this member (its name, or the sender or recipient of a message);
    /// repeatable.
    #[arg(long = "member", value_name = "NAME")]
    members: Vec<String>,
    /// Only events of this kind (`spawn`, `exit`, `hung`, `tool`, ...); repeatable.
    #[arg(long = "event", value_name = "EVENT")]
    events: Vec<String>,
    /// End (exit 0) once no supervisor runs the team, after its last events (at once, after
    /// those --since asks for, when none runs).
    #[arg(long)]
    until_stop: bool,
}

/// How often the log is read for new events.
const POLL: Duration = Duration::from_millis(100);
/// How often `--until-stop` asks whether a supervisor still runs.
const STOP_CHECK: Duration = Duration::from_millis(500);

/// The events read at a time: what `lead watch` holds, however far back `--since` reaches or
/// however many events came at once.
const PAGE: usize = 1000;

pub fn watch(team: &TeamDir, a: WatchArgs) -> anyhow::Result<u8> {
    let now = troupe::fsutil::now();
    let since = a.since.as_deref().map(|s| since(s, now)).transpose()?;
    let mut out = std::io::stdout().lock();
    // From now on: from the log's end, found without reading the log.
    let end = events::end(team)?;
    if let Some(t) = since {
        // What --since reaches into: read back to its start, then on to the end, a page at a
        // time.
        let mut at = events::since(team, t, end)?;
        while at < end {
            let (past, next) = events::read_page(team, at, Some(end), PAGE)?;
            if next == at {
                break;
            }
            at = next;
            for ev in past.iter().filter(|e| e["ts"].as_f64() >= Some(t)) {
                if !print(&mut out, ev, &a)? {
                    return Ok(0);
                }
            }
        }
    }
    let mut pos = end;
    let mut checked = std::time::Instant::now();
    loop {
        // Asked before the read: the events a supervisor logs as it ends are read after.
        let mut stopping = false;
        if a.until_stop && checked.elapsed() >= STOP_CHECK {
            checked = std::time::Instant::now();
            stopping = !troupe::liveness::supervisor_running(team)?;
        }
        loop {
            let (new, next) = events::read_page(team, pos, None, PAGE)?;
            if next == pos {
                break;
            }
            pos = next;
            for ev in &new {
                if !print(&mut out, ev, &a)? {
                    return Ok(0);
                }
            }
        }
        if stopping {
            return Ok(0);
        }
        std::thread::sleep(POLL);
    }
}

/// Prints `ev` if the filters want it; false once stdout is closed (a pager or `head` quit).
fn print(out: &mut impl Write, ev: &Value, a: &WatchArgs) -> anyhow::Result<bool> {
    if !wanted(ev, &a.members, &a.events) {
        return Ok(true);
    }
    let text = if a.json {
        serde_json::to_string(ev)?
    } else {
        line(ev)
    };
    match writeln!(out, "{text}").and_then(|()| out.flush()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// The fields that name the member an event is about.
const WHO: [&str; 4] = ["name", "member", "from", "to"];

/// Whether an event passes the filters (an empty filter passes everything).
pub fn wanted(ev: &Value, members: &[String], kinds: &[String]) -> bool {
    let kind_ok = kinds.is_empty() || kinds.iter().any(|k| ev["event"] == k.as_str());
    let member_ok = members.is_empty()
        || WHO
            .iter()
            .any(|f| members.iter().any(|m| ev[*f] == m.as_str()));
    kind_ok && member_ok
}

/// The start of `--since`: an age (`90s`, `10m`, `2h`, `1d`), Unix seconds, or an RFC 3339
/// time, at `now`.
pub fn since(s: &str, now: f64) -> anyhow::Result<f64> {
    let s = s.trim();
    let unit = |u: char| match u {
        's' => Some(1.0),
        'm' => Some(60.0),
        'h' => Some(3600.0),
        'd' => Some(86400.0),
        _ => None,
    };
    if let Some(last) = s.chars().last()
        && let Some(scale) = unit(last)
        && let Ok(n) = s[..s.len() - 1].parse::<f64>()
        && n >= 0.0
    {
        return Ok(now - n * scale);
    }
    if let Ok(t) = s.parse::<f64>()
        && t >= 0.0
    {
        return Ok(t);
    }
    if let Some(t) = troupe::llm::gate::parse_rfc3339(s) {
        return Ok(t
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()));
    }
    anyhow::bail!(
        "--since {s:?}: expected an age such as 90s, 10m, 2h or 1d, Unix seconds, or an RFC 3339 \
         time such as 2026-12-05T10:00:00Z"
    )
}

/// One event as a line: its time (UTC), its kind, the member it is about, then its other
/// fields as `key=value`, with control characters escaped ([`troupe::term_text`]).
pub fn line(ev: &Value) -> String {
    let ts = ev["ts"].as_f64().unwrap_or(0.0);
    let kind = ev["event"].as_str().unwrap_or("?");
    let who = match (ev["name"].as_str(), ev["from"].as_str(), ev["to"].as_str()) {
        (Some(n), _, _) => n.to_owned(),
        (None, Some(f), Some(t)) => format!("{f} -> {t}"),
        _ => ev["member"].as_str().unwrap_or("").to_owned(),
    };
    let mut s = format!("{} {kind:<16} {who:<12}", clock(ts));
    if let Value::Object(m) = ev {
        for (k, v) in m {
            if matches!(k.as_str(), "ts" | "event") || WHO.contains(&k.as_str()) && v.is_string() {
                continue;
            }
            let v = match v {
                Value::String(t) if !t.is_empty() && !t.contains(char::is_whitespace) => t.clone(),
                other => other.to_string(),
            };
            s.push_str(&format!(" {k}={v}"));
        }
    }
    // Event fields hold a model's text (a subject, a path, a command) and a JSON string keeps
    // DEL and the C1 controls raw: the whole line is escaped, before it is cut.
    let s = troupe::term_text::line(s.trim_end()).into_owned();
    if s.chars().count() > 200 {
        let cut: String = s.chars().take(199).collect();
        format!("{cut}…")
    } else {
        s
    }
}

/// `HH:MM:SS.mmm` of Unix time `ts`, UTC.
fn clock(ts: f64) -> String {
    let ms = (ts * 1000.0).round() as u64;
    let day = ms % 86_400_000;
    format!(
        "{:02}:{:02}:{:02}.{:03}",
        day / 3_600_000,
        day / 60_000 % 60,
        day / 1000 % 60,
        day % 1000
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn filters_pick_by_member_and_kind() {
        let spawn = json!({"ts": 1.0, "event": "spawn", "name": "ann"});
        let msg = json!({"ts": 2.0, "event": "message", "from": "lead", "to": "bob"});
        let none: [String; 0] = [];
        assert!(wanted(&spawn, &none, &none));
        assert!(wanted(&spawn, &["ann".into()], &none));
        assert!(!wanted(&spawn, &["bob".into()], &none));
        assert!(wanted(&msg, &["bob".into()], &["message".into()]));
        assert!(!wanted(&msg, &["bob".into()], &["spawn".into()]));
        assert!(wanted(&msg, &none, &["spawn".into(), "message".into()]));
    }

    #[test]
    fn since_reads_ages_unix_times_and_rfc3339() {
        let now = 1_000_000.0;
        assert_eq!(since("90s", now).unwrap(), now - 90.0);
        assert_eq!(since("10m", now).unwrap(), now - 600.0);
        assert_eq!(since("2h", now).unwrap(), now - 7200.0);
        assert_eq!(since("1d", now).unwrap(), now - 86400.0);
        assert_eq!(since("1764921600", now).unwrap(), 1_764_921_600.0);
        assert_eq!(since("2025-12-05T08:00:00Z", now).unwrap(), 1_764_921_600.0);
        assert!(since("yesterday", now).is_err());
        assert!(since("-5m", now).is_err());
    }

    #[test]
    fn a_line_shows_time_kind_member_and_the_rest() {
        let ev = json!({"ts": 1_764_921_601.25, "event": "exit", "name": "ann", "code": 0,
            "reason": "shut down"});
        assert_eq!(
            line(&ev),
            r#"08:00:01.250 exit             ann          code=0 reason="shut down""#
        );
        let msg = json!({"ts": 0.0, "event": "message", "from": "lead", "to": "bob", "id": "m1"});
        assert_eq!(
            line(&msg),
            "00:00:00.000 message          lead -> bob  id=m1"
        );
    }

    #[test]
    fn a_line_shows_control_characters_escaped() {
        let ev = json!({"ts": 0.0, "event": "tool", "name": "ann\u{1b}]2;T\u{7}",
            "detail": "notes\u{1b}]52;c;eA==\u{7}\u{9b}", "tool": "read_file",
            "subject": "two\nlines \u{7f}"});
        assert_eq!(
            line(&ev),
            r#"00:00:00.000 tool             ann\x1b]2;T\x07    detail=notes\x1b]52;c;eA==\x07\u{9b} subject="two\nlines \x7f" tool=read_file"#
        );
    }
}
