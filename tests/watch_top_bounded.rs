//! Review 4, R4-12: `lead watch` (from now on, or `--since` an hour) and `lead top --once` on a
//! large event log (300 MB of `events.jsonl` by default, `TROUPE_TEST_EVENT_LOG_MB` to change
//! it; on a bus, a stream of 100,000 events) stay under 50 MB of peak RSS and print the same as
//! on a log of only its last events. Before, each read and parsed the whole log first (1.25 GB
//! for a 200 MB file). The real `lead` is run; its peak RSS is what `wait4` reports for it (see
//! [`measure`]), and the times to its first output are printed, not asserted (the machine is
//! shared).

mod support;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::child;
use support::redis_server::RedisServer;
use support::team::{Team, add_member_to};
use troupe::TeamDir;
use troupe::store::redis::{BUS_ENV, PASSWORD_ENV, RedisBus};

/// The most a `lead watch` or `lead top --once` may hold, whatever the log's size.
const RSS_LIMIT_KB: i64 = 50 * 1024;
/// How long a run may take before it is killed and the test fails.
const LIMIT: Duration = Duration::from_secs(300);
/// Events both logs end with: more than `lead top` keeps (2000).
const TAIL_LEN: usize = 2500;
/// Events on the large bus (its stream's cap).
const BUS_EVENTS: usize = 100_000;

fn big_mb() -> u64 {
    std::env::var("TROUPE_TEST_EVENT_LOG_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// The last events of both logs, of the last ten minutes: alice's tool calls (each different,
/// then the same one six times, for top's lint), messages, and a rate limit 100 s ago.
fn tail_lines(now: f64) -> Vec<String> {
    let mut out = Vec::new();
    for i in 0..TAIL_LEN {
        let ts = now - 600.0 + i as f64 * 0.2;
        let ev = if i == TAIL_LEN - 10 {
            json!({"ts": ts, "event": "rate_limited", "name": "alice", "status": 429,
                "wait_secs": 1.0})
        } else if i >= TAIL_LEN - 6 {
            json!({"ts": ts, "event": "tool", "name": "alice", "tool": "bash",
                "detail": "cargo test --quiet", "ok": false})
        } else if i % 3 == 0 {
            json!({"ts": ts, "event": "message", "from": "lead", "to": "alice",
                "type": "message", "id": format!("m{i}"), "text": "go on"})
        } else {
            json!({"ts": ts, "event": "tool", "name": "alice", "tool": "read_file",
                "detail": format!("src/file{i}.rs"), "ok": true})
        };
        out.push(serde_json::to_string(&ev).unwrap());
    }
    out
}

/// An old event of bob's, two days old, as the filler of the large log.
fn old_line(now: f64) -> String {
    serde_json::to_string(
        &json!({"ts": now - 172_800.0, "event": "tool", "name": "bob",
        "tool": "bash", "detail": "cargo test --quiet -p troupe --lib governor::tests 2>&1 | \
        tail -n 40", "ok": true}),
    )
    .unwrap()
}

/// A team dir of alice and bob whose events.jsonl is `filler_bytes` of old events, then the
/// tail, written as the log's writer does (each line after a `\n`).
fn team_with_log(now: f64, filler_bytes: u64) -> Team {
    let team = Team::new();
    team.add_member("alice", 1, false);
    team.add_member("bob", 1, false);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(team.dir.events())
        .unwrap();
    let mut w = BufWriter::with_capacity(1 << 20, f);
    let old = format!("\n{}\n", old_line(now));
    let mut written = 0;
    while written < filler_bytes {
        w.write_all(old.as_bytes()).unwrap();
        written += old.len() as u64;
    }
    for l in tail_lines(now) {
        write!(w, "\n{l}\n").unwrap();
    }
    w.flush().unwrap();
    team
}

#[test]
fn child() {
    child::dispatch(&[("measure", measure)]);
}

/// Child role: runs `lead` (its arguments in `LEAD_ARGS`, one a line) with its output going
/// where this process's goes, says its pid (`PID n`), and once it ends its peak RSS in kB as
/// `wait4` has it (`RSS n`). `wait4`'s figure is at least the RSS of the process that spawned
/// it (Linux keeps the high-water mark of the memory an `exec` replaces): a fresh small process
/// spawns it, not the test process with its large buffers.
#[allow(
    clippy::zombie_processes,
    reason = "reaped with wait4, for its resource usage"
)]
fn measure(vars: &HashMap<String, String>) {
    let args: Vec<&str> = vars["LEAD_ARGS"].lines().collect();
    let child = Command::new(env!("CARGO_BIN_EXE_lead"))
        .args(&args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    child::report(&format!("PID {pid}"));
    let mut status = 0;
    // SAFETY: rusage is plain data, written by wait4.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: pid is this process's unreaped child; the pointers are to live locals.
    let r = unsafe { libc::wait4(pid, &mut status, 0, &mut ru) };
    assert_eq!(r, pid, "wait4: {}", std::io::Error::last_os_error());
    child::report(&format!("RSS {}", ru.ru_maxrss));
}

/// `lead --team-dir DIR ARGS`, on the bus `bus` (URL, password) when given, as run by the
/// [`measure`] role.
fn lead(dir: &TeamDir, bus: Option<(&str, &str)>, args: &[&str]) -> Child {
    let mut all = vec!["--team-dir".to_owned(), dir.root().display().to_string()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    let mut vars = vec![("LEAD_ARGS", all.join("\n"))];
    if let Some((url, password)) = bus {
        vars.push((BUS_ENV, url.to_owned()));
        vars.push((PASSWORD_ENV, password.to_owned()));
    }
    child::spawn("measure", &vars)
}

struct Run {
    /// What `lead` printed.
    lines: Vec<String>,
    /// When its first line came.
    first: Duration,
    /// Its peak RSS.
    rss_kb: i64,
}

/// Follows `child` (a [`measure`] role) until `lead` has printed `want` lines (or ended),
/// calling `poke` every 100 ms meanwhile, then kills it and waits for its peak RSS.
fn run(mut child: Child, want: usize, mut poke: impl FnMut()) -> Run {
    let started = Instant::now();
    let out = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines() {
            let Ok(l) = l else { break };
            if tx.send((l, started.elapsed())).is_err() {
                break;
            }
        }
    });
    let mut lines = Vec::new();
    let mut first = None;
    let mut pid = None;
    let mut rss_kb = None;
    let mut killed = false;
    while rss_kb.is_none() {
        if let Some(p) = pid
            && !killed
            && (lines.len() >= want || started.elapsed() > LIMIT)
        {
            // SAFETY: kill has no memory-safety preconditions; the role has not reaped it.
            unsafe { libc::kill(p, libc::SIGKILL) };
            killed = true;
        }
        match rx.recv_timeout(Duration::from_millis(100)) {
            Ok((l, at)) => {
                if let Some(p) = l.strip_prefix("PID ") {
                    pid = Some(p.parse::<libc::pid_t>().unwrap());
                } else if let Some(k) = l.strip_prefix("RSS ") {
                    rss_kb = Some(k.parse::<i64>().unwrap());
                } else if l.starts_with('{') && lines.len() < want {
                    first.get_or_insert(at);
                    lines.push(l);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if lines.len() < want {
                    poke();
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    assert!(
        child.wait().unwrap().success(),
        "the measuring child failed"
    );
    Run {
        lines,
        first: first.unwrap_or_else(|| started.elapsed()),
        rss_kb: rss_kb.expect("the measuring child reported no RSS"),
    }
}

/// A frame of `lead top --once --json` without what changes from one second to the next.
fn comparable(line: &str) -> Value {
    let mut f: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    let digits = |v: &mut Value| {
        if let Value::String(s) = v {
            *s = s
                .chars()
                .map(|c| if c.is_ascii_digit() { '0' } else { c })
                .collect();
        }
    };
    let o = f.as_object_mut().unwrap();
    o.remove("at");
    o.remove("team_name");
    digits(&mut f["header"]["rate"]);
    for r in f["rows"].as_array_mut().unwrap() {
        let o = r.as_object_mut().unwrap();
        o.remove("silent_for");
        o.remove("doing_since");
        digits(&mut r["doing_now"]);
    }
    f
}

/// One team's runs: top's frame, `watch --since 1h`'s lines, `watch`'s first line.
struct Seen {
    top: Run,
    since: Run,
    from_now: Run,
}

fn look(dir: &TeamDir, bus: Option<(&str, &str)>) -> Seen {
    let top = run(lead(dir, bus, &["top", "--once", "--json"]), 1, || {});
    let since = run(
        lead(dir, bus, &["watch", "--since", "1h", "--json"]),
        TAIL_LEN,
        || {},
    );
    let mut n = 0;
    let from_now = run(lead(dir, bus, &["watch", "--json"]), 1, || {
        n += 1;
        troupe::events::try_log(dir, "marker", json!({"n": n})).unwrap();
    });
    Seen {
        top,
        since,
        from_now,
    }
}

fn report(what: &str, s: &Seen) {
    for (cmd, r) in [
        ("lead top --once", &s.top),
        ("lead watch --since 1h", &s.since),
        ("lead watch", &s.from_now),
    ] {
        println!(
            "{what}: {cmd}: first output after {:.3} s, peak RSS {} kB",
            r.first.as_secs_f64(),
            r.rss_kb
        );
    }
}

/// What the large log's runs must show: the small log's rows, within the RSS limit.
fn same_as_small(big: &Seen, small: &Seen) {
    assert_eq!(big.top.lines.len(), 1, "lead top --once printed no frame");
    let frame = comparable(&big.top.lines[0]);
    assert_eq!(frame, comparable(&small.top.lines[0]));
    let alice = frame["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "alice")
        .unwrap();
    assert_eq!(alice["lints"], json!(["same tool call 6 times in a row"]));
    assert!(
        frame["header"]["rate"]
            .as_str()
            .unwrap()
            .starts_with("rate limited"),
        "{frame}"
    );
    assert_eq!(big.since.lines.len(), TAIL_LEN, "lead watch --since 1h");
    assert_eq!(big.since.lines, small.since.lines);
    for r in [&big.from_now, &small.from_now] {
        let ev: Value = serde_json::from_str(&r.lines[0]).unwrap();
        assert_eq!(ev["event"], "marker", "lead watch from now on printed {ev}");
    }
    for (cmd, r) in [
        ("lead top --once", &big.top),
        ("lead watch --since 1h", &big.since),
        ("lead watch", &big.from_now),
    ] {
        assert!(
            r.rss_kb < RSS_LIMIT_KB,
            "{cmd} peaked at {} kB on the large log (limit {RSS_LIMIT_KB} kB)",
            r.rss_kb
        );
    }
}

#[test]
fn watch_and_top_on_a_large_event_log_hold_little_and_show_what_a_small_one_shows() {
    let now = troupe::fsutil::now();
    let made = Instant::now();
    let big = team_with_log(now, big_mb() << 20);
    let size = std::fs::metadata(big.dir.events()).unwrap().len();
    println!(
        "events.jsonl: {} MiB written in {:.1} s",
        size >> 20,
        made.elapsed().as_secs_f64()
    );
    let small = team_with_log(now, 0);
    let small_seen = look(&small.dir, None);
    report("small log", &small_seen);
    let big_seen = look(&big.dir, None);
    report(&format!("{} MiB log", size >> 20), &big_seen);
    same_as_small(&big_seen, &small_seen);
}

#[test]
fn watch_and_top_on_a_full_event_stream_hold_little_and_show_what_a_short_one_shows() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let now = troupe::fsutil::now();
    let made = Instant::now();
    let mut teams = Vec::new();
    for (name, filler) in [("short", 0), ("full", BUS_EVENTS - TAIL_LEN)] {
        let url = server.url(name);
        let bus = RedisBus::with_password(&url, &server.password).unwrap();
        let local = Team::new();
        let on_bus = local.dir.clone().with_bus(Some(bus.clone()));
        add_member_to(&on_bus, "alice", 1, false);
        add_member_to(&on_bus, "bob", 1, false);
        let mut conn = bus.connect(Duration::from_secs(5)).unwrap();
        let key = bus.key("events");
        let old = old_line(now);
        let tail = tail_lines(now);
        let mut lines = std::iter::repeat_n(&old, filler).chain(&tail).peekable();
        while lines.peek().is_some() {
            let mut p = redis::pipe();
            for l in lines.by_ref().take(1000) {
                p.cmd("XADD").arg(&key).arg("*").arg("e").arg(l).ignore();
            }
            p.query::<()>(&mut conn).unwrap();
        }
        teams.push((local, on_bus, url));
    }
    println!(
        "{BUS_EVENTS} events sent to the bus in {:.1} s",
        made.elapsed().as_secs_f64()
    );
    let pw = server.password.as_str();
    let (_s, short, short_url) = &teams[0];
    let short_seen = look(short, Some((short_url, pw)));
    report("short stream", &short_seen);
    let (_f, full, full_url) = &teams[1];
    let full_seen = look(full, Some((full_url, pw)));
    report(&format!("stream of {BUS_EVENTS} events"), &full_seen);
    same_as_small(&full_seen, &short_seen);
}

#[test]
fn on_a_bus_pages_back_and_forth_cover_the_stream_once() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let local = Team::new();
    let bus = RedisBus::with_password(&server.url("pages"), &server.password).unwrap();
    let team = local.dir.clone().with_bus(Some(bus));
    let store = team.store();
    assert_eq!(troupe::events::end(&team).unwrap(), 0, "an empty stream");
    for i in 0..50 {
        troupe::events::try_log(&team, "e", json!({"i": i})).unwrap();
    }
    let (lines, end) = store.read_events(0, None, usize::MAX).unwrap();
    assert_eq!(lines.len(), 50);
    assert_eq!(troupe::events::end(&team).unwrap(), end);
    let mut back = Vec::new();
    let mut at = None;
    loop {
        let page = store.read_events_back(at, 3).unwrap();
        assert_eq!(page.to, at.unwrap_or(end));
        let (again, _) = store
            .read_events(page.from, Some(page.to), usize::MAX)
            .unwrap();
        assert_eq!(again, page.lines);
        back.splice(0..0, page.lines);
        if page.at_start {
            break;
        }
        at = Some(page.from);
    }
    assert_eq!(back, lines);
    let mut fwd = Vec::new();
    let mut pos = 0;
    loop {
        let (page, next) = store.read_events(pos, None, 7).unwrap();
        if next == pos {
            break;
        }
        fwd.extend(page);
        pos = next;
    }
    assert_eq!((fwd, pos), (lines, end));
    let all = troupe::events::read_all(&team).unwrap();
    for n in [0, 1, 49, 50, 51] {
        let (last, to) = troupe::events::tail(&team, n).unwrap();
        assert_eq!(to, end);
        assert_eq!(last, all[all.len().saturating_sub(n)..], "tail {n}");
    }
}
