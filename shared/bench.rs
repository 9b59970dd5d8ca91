//! Benchmarks that print numbers (never timed assertions in tests).
//!
//! [`inbox_throughput`] measures append+drain through one inbox with N concurrent writer
//! processes, for troupe's locked append / journaled drain and for the naive baseline of the
//! reference design (unlocked appends; the reader reads the file, then truncates it, without the
//! writers' lock). Writers are separate processes (the `lead` binary re-run with a hidden
//! subcommand), as they are in a real team.
//!
//! [`wake_latency`] measures send -> recipient-awake latency: a waiter process ([`run_waiter`])
//! blocks on its inbox exactly as an idle worker does ([`InboxWaiter::wait`], then
//! [`Inbox::drain`] into a journal) and reports, on its stdout, the `CLOCK_MONOTONIC` instants
//! at which it woke and finished draining; the sender appends one message at a time with
//! [`Durability::Sync`] (as `lead send` does) and waits for each report before the next send.
//!
//! The team-level measurements (100 workers, shutdown round trip, recovery after `kill -9`) need
//! the supervisor and live in the `lead` binary; [`Summary`], [`vm_rss`] and [`monotonic_ns`]
//! are shared with them.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::bus::{RedisBus, RedisInbox};
use crate::error::{Error, Result};
use crate::inbox::{Durability, Inbox};
use crate::message::{Message, MessageType};
use crate::teamdir::{AgentName, TeamDir};
use crate::transcript::Journal;
use crate::wait::{InboxWaiter, Wake};

/// Which append/drain discipline a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Discipline {
    /// Locked single-write append; drain under the lock into a fsynced journal.
    Troupe,
    /// The reference design: unlocked append; read, then truncate, with no lock.
    Naive,
    /// troupe on the Redis bus: a Lua append per message; drain by consumer group into the
    /// fsynced journal.
    Redis,
}

/// When the bench consumer drains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DrainMode {
    /// Every 5 ms, in batches.
    Every5Ms,
    /// As soon as the inbox waiter wakes it (inotify), as an idle worker does: the drainer runs
    /// back to back with the writers.
    OnWake,
}

/// One throughput measurement.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputResult {
    pub discipline: Discipline,
    pub drain: DrainMode,
    pub writers: usize,
    pub sent: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub seconds: f64,
    pub msgs_per_sec: f64,
    /// CPU time (user + system) the consumer spent per message delivered, in microseconds.
    pub consumer_cpu_us_per_msg: f64,
    /// CPU time the writer processes spent per message sent, in microseconds.
    pub writer_cpu_us_per_msg: f64,
    /// How many drains the consumer ran (the mean batch is `delivered / drains`).
    pub drains: u64,
}

/// CPU time (user + system) used so far by `who` (`RUSAGE_THREAD`, or `RUSAGE_CHILDREN` for
/// the children waited for), in seconds.
fn cpu_seconds(who: libc::c_int) -> f64 {
    // SAFETY: getrusage writes one rusage into the zeroed struct we own.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe {
        libc::getrusage(who, &mut ru);
    }
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Pause between the bench consumer's drains.
const DRAIN_INTERVAL: Duration = Duration::from_millis(5);

/// The owner lock of `name`'s journal in a bench team dir (nobody else uses it).
fn own(team: &TeamDir, name: &AgentName) -> Result<crate::fsutil::HeldLock> {
    Journal::try_own(team, name)?.ok_or_else(|| Error::Locked {
        what: "a bench journal",
        path: team.transcript_lock(name),
    })
}

fn bench_name() -> AgentName {
    AgentName::teammate("bench").expect("valid name")
}

/// Message `seq` of writer `writer`: "WRITER:SEQ", as the consumer counts them.
fn bench_message(writer: usize, seq: u64) -> Message {
    Message::new(
        MessageType::Message,
        "lead",
        "bench",
        format!("{writer}:{seq}"),
    )
}

/// The writer side, run in a child process: wait for `go`, then append `count` messages.
pub fn run_writer(
    team: &Path,
    writer: usize,
    count: u64,
    discipline: Discipline,
    go: &Path,
    bus: Option<&RedisBus>,
) -> Result<()> {
    let team = TeamDir::open(team)?;
    let name = bench_name();
    let inbox = Inbox::new(&team, &name);
    while !go.exists() {
        std::thread::sleep(Duration::from_micros(100));
    }
    match discipline {
        Discipline::Redis => {
            let bus = bus.ok_or_else(|| Error::Protocol("the Redis bench needs a bus".into()))?;
            let inbox = RedisInbox::new(bus, &team, &name);
            for seq in 0..count {
                let m = bench_message(writer, seq);
                inbox.append(&m)?;
            }
        }
        Discipline::Troupe => {
            let mut w = inbox.writer()?;
            for seq in 0..count {
                let m = bench_message(writer, seq);
                w.append(&m, Durability::ProcessCrash)?;
            }
        }
        Discipline::Naive => {
            let path = inbox.path().to_path_buf();
            let mut f = OpenOptions::new()
                .append(true)
                .create(true)
                .open(&path)
                .map_err(Error::io("open", &path))?;
            for seq in 0..count {
                let m = bench_message(writer, seq);
                f.write_all(&m.to_line()?)
                    .map_err(Error::io("append to", &path))?;
            }
        }
    }
    Ok(())
}

/// Runs one throughput measurement. `writer_cmd(team, writer, count, discipline, go)` builds the
/// command that runs [`run_writer`] in a child process.
pub fn inbox_throughput(
    scratch: &Path,
    writers: usize,
    per_writer: u64,
    discipline: Discipline,
    drain: DrainMode,
    writer_cmd: &dyn Fn(&Path, usize, u64, Discipline, &Path) -> Command,
    bus: Option<&RedisBus>,
) -> Result<ThroughputResult> {
    let root = scratch.join(format!("{discipline:?}-{drain:?}-{writers}").to_lowercase());
    let team = TeamDir::create(&root)?;
    let name = bench_name();
    let inbox = Inbox::new(&team, &name);
    let go: PathBuf = root.join("go");
    drop(inbox.writer()?);
    let mut kids: Vec<Child> = (0..writers)
        .map(|w| {
            writer_cmd(team.root(), w, per_writer, discipline, &go)
                .stdin(Stdio::null())
                .spawn()
                .map_err(Error::io("spawn bench writer", "lead"))
        })
        .collect::<Result<_>>()?;
    // Let every writer reach its wait loop before starting the clock.
    std::thread::sleep(Duration::from_millis(200));
    let owner = own(&team, &name)?;
    let (mut journal, _) = Journal::open(&team, &name, &owner)?;
    let mut waiter = InboxWaiter::new(&inbox)?;
    let mut redis = match (discipline, bus) {
        (Discipline::Redis, Some(bus)) => {
            let r = RedisInbox::new(bus, &team, &name);
            let w = r.waiter()?;
            Some((r, w))
        }
        (Discipline::Redis, None) => {
            return Err(Error::Protocol("the Redis bench needs a bus".into()));
        }
        _ => None,
    };
    // Every message is "WRITER:SEQ": one flag per message sent tells a repeat from a first
    // delivery without a hash set of ids (which cost the consumer a tenth of its time).
    let mut seen = vec![false; writers * per_writer as usize];
    let mut delivered = 0u64;
    let mut duplicates = 0u64;
    let mut count = |msgs: Vec<Message>| {
        for m in msgs {
            delivered += 1;
            let mut it = m.content.split(':').map(|n| n.parse::<usize>().ok());
            let slot = match (it.next().flatten(), it.next().flatten()) {
                (Some(w), Some(q)) if w < writers && q < per_writer as usize => {
                    seen.get_mut(w * per_writer as usize + q)
                }
                _ => None,
            };
            match slot {
                Some(flag) if !*flag => *flag = true,
                _ => duplicates += 1,
            }
        }
    };
    let children_before = cpu_seconds(libc::RUSAGE_CHILDREN);
    std::fs::write(&go, b"").map_err(Error::io("write", &go))?;
    let start = Instant::now();
    let consumer_before = cpu_seconds(libc::RUSAGE_THREAD);
    let mut done = false;
    let mut drains = 0u64;
    while !done {
        done = kids
            .iter_mut()
            .all(|k| k.try_wait().ok().flatten().is_some());
        drains += 1;
        match (discipline, &redis) {
            (Discipline::Redis, Some((r, _))) => count(r.drain(&mut journal)?),
            (Discipline::Naive, _) => count(naive_drain(inbox.path())?),
            _ => count(inbox.drain(&mut journal)?),
        }
        if done {
            continue;
        }
        match drain {
            // In batches, as a worker busy with model calls does.
            DrainMode::Every5Ms => std::thread::sleep(DRAIN_INTERVAL),
            // As soon as something arrives, as an idle worker does (the timeout only notices
            // writers that finished).
            DrainMode::OnWake => match &mut redis {
                Some((_, w)) => drop(w.wait(Some(DRAIN_INTERVAL), &[])?),
                None => drop(waiter.wait(Some(DRAIN_INTERVAL), &[])?),
            },
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let consumer_cpu = cpu_seconds(libc::RUSAGE_THREAD) - consumer_before;
    for k in &mut kids {
        let status = k
            .wait()
            .map_err(Error::io("wait for bench writer", "lead"))?;
        if !status.success() {
            return Err(Error::Protocol(format!("bench writer failed: {status}")));
        }
    }
    let writer_cpu = cpu_seconds(libc::RUSAGE_CHILDREN) - children_before;
    if let Some((r, _)) = &redis {
        r.destroy()?;
    }
    let sent = writers as u64 * per_writer;
    let unique = delivered - duplicates;
    let _ = std::fs::remove_dir_all(&root);
    Ok(ThroughputResult {
        discipline,
        drain,
        writers,
        sent,
        delivered,
        lost: sent.saturating_sub(unique),
        duplicates,
        seconds,
        msgs_per_sec: unique as f64 / seconds,
        consumer_cpu_us_per_msg: round3(consumer_cpu * 1e6 / delivered.max(1) as f64),
        writer_cpu_us_per_msg: round3(writer_cpu * 1e6 / sent.max(1) as f64),
        drains,
    })
}

/// The reference design's drain: read everything, then truncate, with no lock.
fn naive_drain(path: &Path) -> Result<Vec<Message>> {
    let mut buf = Vec::new();
    let mut f = std::fs::File::open(path).map_err(Error::io("open", path))?;
    f.read_to_end(&mut buf).map_err(Error::io("read", path))?;
    drop(f);
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .map_err(Error::io("truncate", path))?;
    Ok(buf
        .split(|&b| b == b'\n')
        .filter_map(|l| Message::parse_line(l).ok())
        .collect())
}

/// Nanoseconds on `CLOCK_MONOTONIC`: one clock for every process of the machine, so instants
/// taken in two processes can be subtracted.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime only writes one timespec into `ts`, which is valid and ours.
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Percentiles of a set of durations, in milliseconds (nearest rank).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Summary {
    /// Summarizes `ms`; `None` when it is empty.
    pub fn of(ms: &[f64]) -> Option<Summary> {
        if ms.is_empty() {
            return None;
        }
        let mut v = ms.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Summary {
            samples: v.len(),
            p50_ms: round3(rank(0.50)),
            p99_ms: round3(rank(0.99)),
            max_ms: round3(v[v.len() - 1]),
            mean_ms: round3(v.iter().sum::<f64>() / v.len() as f64),
        })
    }
}

/// Rounds to three decimals (microseconds, for milliseconds), to keep the JSON readable.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Resident set size of a process from `/proc/PID/status`, in KiB: `(VmRSS, RssAnon)`.
/// `VmRSS` counts the shared pages of the binary and libraries too; `RssAnon` is the process's
/// own heap and stacks.
pub fn vm_rss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("RssAnon:").unwrap_or(0)))
}

/// The waiter's inbox name.
fn waiter_name() -> AgentName {
    AgentName::teammate("waiter").expect("valid name")
}

/// Content of the message that ends [`run_waiter`].
const WAITER_STOP: &str = "stop";

/// The recipient side of [`wake_latency`], run in a child process: blocks on its inbox as an
/// idle worker does and, per drain, writes `WOKE_NS DRAINED_NS COUNT` (monotonic instants) to
/// `out`. First writes `ready inotify` or `ready polling`. Returns after a message saying
/// `stop`, or when `out` is closed.
pub fn run_waiter(team: &Path, out: &mut dyn Write, bus: Option<&RedisBus>) -> Result<()> {
    let team = TeamDir::open(team)?;
    let name = waiter_name();
    let inbox = Inbox::new(&team, &name);
    let mut waiter = InboxWaiter::new(&inbox)?;
    let mut redis = match bus {
        Some(bus) => {
            let r = RedisInbox::new(bus, &team, &name);
            let w = r.waiter()?;
            Some((r, w))
        }
        None => None,
    };
    let owner = own(&team, &name)?;
    let (mut journal, _) = Journal::open(&team, &name, &owner)?;
    let mode = if redis.is_some() {
        "redis"
    } else if waiter.uses_inotify() {
        "inotify"
    } else {
        "polling"
    };
    let report = |out: &mut dyn Write, line: String| {
        out.write_all(line.as_bytes())
            .and_then(|()| out.flush())
            .map_err(Error::io("report to", "the bench"))
    };
    report(out, format!("ready {mode}\n"))?;
    loop {
        let wake = match &mut redis {
            Some((_, w)) => w.wait(None, &[])?,
            None => waiter.wait(None, &[])?,
        };
        if wake != Wake::Message {
            continue;
        }
        let woke = monotonic_ns();
        let msgs = match &redis {
            Some((r, _)) => r.drain(&mut journal)?,
            None => inbox.drain(&mut journal)?,
        };
        let drained = monotonic_ns();
        if msgs.is_empty() {
            continue;
        }
        report(out, format!("{woke} {drained} {}\n", msgs.len()))?;
        if msgs.iter().any(|m| m.content == WAITER_STOP) {
            return Ok(());
        }
    }
}

/// Result of [`wake_latency`].
#[derive(Debug, Clone, Serialize)]
pub struct WakeResult {
    /// How the waiter slept: `inotify`, or `polling` (the fallback).
    pub waiter_mode: String,
    /// Send start (before the append) to the end of the recipient's drain.
    pub send_to_drained: Summary,
    /// Send start to the recipient's return from `InboxWaiter::wait`.
    pub send_to_woken: Summary,
    /// The sender's append with fdatasync alone.
    pub append_sync: Summary,
}

/// Kills and reaps a child process when dropped (error paths of a bench).
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Measures send -> recipient-awake latency over `samples` messages, one at a time, each sent
/// `gap` after the previous one was drained (so the recipient is asleep again).
/// `waiter_cmd(team)` builds the command that runs [`run_waiter`] in a child process.
pub fn wake_latency(
    scratch: &Path,
    samples: usize,
    gap: Duration,
    waiter_cmd: &dyn Fn(&Path) -> Command,
    bus: Option<&RedisBus>,
) -> Result<WakeResult> {
    let root = scratch.join("wake");
    let team = TeamDir::create(&root)?;
    let name = waiter_name();
    let inbox = Inbox::new(&team, &name);
    let redis = bus.map(|b| RedisInbox::new(b, &team, &name));
    let child = waiter_cmd(team.root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .map_err(Error::io("spawn bench waiter", "lead"))?;
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut next_line = || -> Result<String> {
        match lines.next() {
            Some(Ok(l)) => Ok(l),
            Some(Err(e)) => Err(Error::io("read from", "the bench waiter")(e)),
            None => Err(Error::Protocol("the bench waiter exited early".into())),
        }
    };
    let ready = next_line()?;
    let waiter_mode = ready
        .strip_prefix("ready ")
        .ok_or_else(|| Error::Protocol(format!("bench waiter said {ready:?}")))?
        .to_owned();
    let (mut drained_ms, mut woken_ms, mut append_ms) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..=samples {
        std::thread::sleep(gap);
        let last = i == samples;
        let text = if last {
            WAITER_STOP.to_owned()
        } else {
            format!("wake {i}")
        };
        let m = Message::new(MessageType::Message, "lead", name.as_str(), text);
        let start = monotonic_ns();
        match &redis {
            Some(r) => r.append(&m)?,
            None => inbox.append(&m, Durability::Sync)?,
        }
        let appended = monotonic_ns();
        let line = next_line()?;
        let nums: Vec<u64> = line
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        let [woke, drained, count] = nums[..] else {
            return Err(Error::Protocol(format!("bench waiter said {line:?}")));
        };
        if count != 1 {
            return Err(Error::Protocol(format!(
                "bench waiter drained {count} messages at once; expected 1"
            )));
        }
        if last {
            break;
        }
        let ms = |t: u64| t.saturating_sub(start) as f64 / 1e6;
        drained_ms.push(ms(drained));
        woken_ms.push(ms(woke));
        append_ms.push(ms(appended));
    }
    let status = child
        .0
        .wait()
        .map_err(Error::io("wait for bench waiter", "lead"))?;
    if !status.success() {
        return Err(Error::Protocol(format!("bench waiter failed: {status}")));
    }
    if let Some(r) = &redis {
        r.destroy()?;
    }
    let _ = std::fs::remove_dir_all(&root);
    let none = || Error::Protocol("no wake-up samples".into());
    Ok(WakeResult {
        waiter_mode,
        send_to_drained: Summary::of(&drained_ms).ok_or_else(none)?,
        send_to_woken: Summary::of(&woken_ms).ok_or_else(none)?,
        append_sync: Summary::of(&append_ms).ok_or_else(none)?,
    })
}
