//! The inbox sections: throughput and wake-up latency, and the writer and waiter processes they
//! start (this executable re-run with a hidden subcommand).
//!
//! [`throughput`] measures append+drain through one inbox with N concurrent writer processes,
//! for troupe's locked append / journaled drain and for the naive baseline of the reference
//! design (unlocked appends; the reader reads the file, then truncates it, without the writers'
//! lock). Writers are separate processes, as they are in a real team.
//!
//! [`wake_latency`] measures send -> recipient-awake latency: a waiter process ([`waiter`])
//! blocks on its inbox exactly as an idle worker does ([`InboxWaiter::wait`], then
//! [`Inbox::drain`] into a journal) and reports, on its stdout, the `CLOCK_MONOTONIC` instants
//! at which it woke and finished draining; the sender appends one message at a time with
//! [`Durability::Sync`] (as `lead send` does) and waits for each report before the next send.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};
use troupe::eprintln;

use anyhow::{Context, Result, anyhow, bail, ensure};
use troupe::fsutil::HeldLock;
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::store::redis::{RedisBus, RedisInbox};
use troupe::teamdir::{AgentName, TeamDir};
use troupe::transcript::Journal;
use troupe::wait::{InboxWaiter, Wake};

use crate::BenchArgs;
use crate::measure::{Summary, round3};

/// Which append/drain discipline a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Discipline {
    /// Locked single-write append; drain under the lock into a fsynced journal.
    Troupe,
    /// The reference design: unlocked append; read, then truncate, with no lock.
    Naive,
    /// troupe on the Redis bus: a Lua append per message; drain (a read, then one mark
    /// per batch) into the fsynced journal.
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
pub fn cpu_seconds(who: libc::c_int) -> f64 {
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
fn own(team: &TeamDir, name: &AgentName) -> Result<HeldLock> {
    Journal::try_own(team, name)?.with_context(|| {
        format!(
            "failed to own a bench journal: {} is locked",
            team.transcript_lock(name).display()
        )
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

/// The writer side, run in a child process ([`writer`]): wait for `go`, then append `count` messages.
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
            let bus = bus.context("the Redis bench needs a bus")?;
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
                .with_context(|| format!("failed to open {}", path.display()))?;
            for seq in 0..count {
                let m = bench_message(writer, seq);
                f.write_all(&m.to_line()?)
                    .with_context(|| format!("failed to append to {}", path.display()))?;
            }
        }
    }
    Ok(())
}

/// Runs one throughput measurement. `writer_cmd(team, writer, count, discipline, go)` builds the
/// command that runs [`run_writer`] in a child process ([`writer_cmd`]).
pub fn throughput(
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
                .context("failed to start a bench writer")
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
            bail!("the Redis bench needs a bus");
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
    std::fs::write(&go, b"").with_context(|| format!("failed to write {}", go.display()))?;
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
        let status = k.wait().context("failed to wait for a bench writer")?;
        ensure!(status.success(), "a bench writer failed: {status}");
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
    let mut f =
        std::fs::File::open(path).with_context(|| format!("failed to open {}", path.display()))?;
    f.read_to_end(&mut buf)
        .with_context(|| format!("failed to read {}", path.display()))?;
    drop(f);
    OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .with_context(|| format!("failed to truncate {}", path.display()))?;
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

/// The waiter's inbox name.
fn waiter_name() -> AgentName {
    AgentName::teammate("waiter").expect("valid name")
}

/// Content of the message that ends [`run_waiter`].
const WAITER_STOP: &str = "stop";

/// The recipient side of [`wake_latency`], run in a child process ([`waiter`]): blocks on its inbox as an
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
            .context("failed to report to the bench")
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
        .context("failed to start the bench waiter")?;
    let mut child = KillOnDrop(child);
    let stdout = child.0.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut next_line = || -> Result<String> {
        match lines.next() {
            Some(Ok(l)) => Ok(l),
            Some(Err(e)) => Err(anyhow!(e).context("failed to read from the bench waiter")),
            None => bail!("the bench waiter exited early"),
        }
    };
    let ready = next_line()?;
    let waiter_mode = ready
        .strip_prefix("ready ")
        .with_context(|| format!("the bench waiter said {ready:?}"))?
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
            bail!("the bench waiter said {line:?}");
        };
        ensure!(
            count == 1,
            "the bench waiter drained {count} messages at once; expected 1"
        );
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
        .context("failed to wait for the bench waiter")?;
    ensure!(status.success(), "the bench waiter failed: {status}");
    if let Some(r) = &redis {
        r.destroy()?;
    }
    let _ = std::fs::remove_dir_all(&root);
    let none = "no wake-up samples";
    Ok(WakeResult {
        waiter_mode,
        send_to_drained: Summary::of(&drained_ms).context(none)?,
        send_to_woken: Summary::of(&woken_ms).context(none)?,
        append_sync: Summary::of(&append_ms).context(none)?,
    })
}

// ---------------------------------------------------------------------------------------------
// The child processes, and the sections on the file bus.

/// `troupe-bench writer`: one writer process of [`throughput`].
#[derive(Debug, clap::Args)]
pub struct WriterArgs {
    #[arg(long)]
    dir: PathBuf,
    #[arg(long)]
    writer: usize,
    #[arg(long)]
    count: u64,
    #[arg(long)]
    naive: bool,
    #[arg(long)]
    go: PathBuf,
    /// Append to an inbox on the bus (`--bus`) under this team.
    #[arg(long)]
    bus_team: Option<String>,
}

/// `troupe-bench waiter`: the idle recipient of [`wake_latency`].
#[derive(Debug, clap::Args)]
pub struct WaiterArgs {
    #[arg(long)]
    dir: PathBuf,
    /// Wait on the bus (`--bus`) under this team.
    #[arg(long)]
    bus_team: Option<String>,
}

/// The bus of a bench child process: `url` for team `team` (password from the environment).
fn child_bus(url: Option<&str>, team: Option<&str>) -> Result<Option<RedisBus>> {
    match (url, team) {
        (Some(u), Some(t)) => Ok(Some(RedisBus::from_url(u)?.for_team(t)?)),
        _ => Ok(None),
    }
}

/// `troupe-bench writer`, on `bus` (the URL of `--bus`) when given a team there.
pub fn writer(a: &WriterArgs, bus: Option<&str>) -> Result<()> {
    let bus = child_bus(bus, a.bus_team.as_deref())?;
    let d = if a.naive {
        Discipline::Naive
    } else if bus.is_some() {
        Discipline::Redis
    } else {
        Discipline::Troupe
    };
    run_writer(&a.dir, a.writer, a.count, d, &a.go, bus.as_ref())
}

/// `troupe-bench waiter`, on `bus` (the URL of `--bus`) when given a team there.
pub fn waiter(a: &WaiterArgs, bus: Option<&str>) -> Result<()> {
    let bus = child_bus(bus, a.bus_team.as_deref())?;
    run_waiter(&a.dir, &mut std::io::stdout().lock(), bus.as_ref())
}

/// This executable, which the writer and waiter processes re-run.
pub fn this_exe() -> Result<PathBuf> {
    std::env::current_exe().context("failed to find the troupe-bench executable")
}

/// The command that runs [`writer`] from `exe`, on `bus` (URL, team) if given.
pub fn writer_cmd(
    exe: &Path,
    dir: &Path,
    w: usize,
    n: u64,
    d: Discipline,
    go: &Path,
    bus: Option<(&str, &str)>,
) -> Command {
    let mut c = Command::new(exe);
    c.arg("writer")
        .arg("--dir")
        .arg(dir)
        .args(["--writer", &w.to_string(), "--count", &n.to_string()])
        .arg("--go")
        .arg(go);
    if d == Discipline::Naive {
        c.arg("--naive");
    }
    if let Some((url, team)) = bus {
        c.args(["--bus", url, "--bus-team", team]);
    }
    c
}

/// The command that runs [`waiter`] from `exe`, on `bus` (URL, team) if given.
pub fn waiter_cmd(exe: &Path, dir: &Path, bus: Option<(&str, &str)>) -> Command {
    let mut c = Command::new(exe);
    c.arg("waiter").arg("--dir").arg(dir);
    if let Some((url, team)) = bus {
        c.args(["--bus", url, "--bus-team", team]);
    }
    crate::lead::die_with_parent(&mut c);
    c
}

/// One throughput row, as progress on stderr.
pub fn report(r: &ThroughputResult) {
    eprintln!(
        "inbox {:?} drain={:?} writers={} {:.0} msgs/s lost={} dup={} \
         (cpu per msg: writer {:.2} us, consumer {:.2} us; {} drains)",
        r.discipline,
        r.drain,
        r.writers,
        r.msgs_per_sec,
        r.lost,
        r.duplicates,
        r.writer_cpu_us_per_msg,
        r.consumer_cpu_us_per_msg,
        r.drains
    );
}

/// Pause between two wake-up samples, so the waiter is asleep again when the next one is sent.
pub const WAKE_GAP: Duration = Duration::from_millis(5);

/// The inbox sections on the file bus: throughput with 1 and 4 writer processes (troupe drained
/// on every wake-up and every 5 ms, the naive baseline every 5 ms), then the wake-up latency.
/// Returns the `inbox_throughput` and `wake_latency` sections.
pub fn sections(a: &BenchArgs, scratch: &Path) -> Result<(Value, Value)> {
    let exe = this_exe()?;
    let cmd = |dir: &Path, w: usize, n: u64, d: Discipline, go: &Path| {
        writer_cmd(&exe, dir, w, n, d, go, None)
    };
    let mut rows = Vec::new();
    for writers in [1, 4] {
        for (d, drain) in [
            (Discipline::Troupe, DrainMode::OnWake),
            (Discipline::Troupe, DrainMode::Every5Ms),
            (Discipline::Naive, DrainMode::Every5Ms),
        ] {
            let r = throughput(scratch, writers, a.messages, d, drain, &cmd, None)?;
            report(&r);
            rows.push(r);
        }
    }

    let wake = wake_latency(
        scratch,
        a.wake_samples,
        WAKE_GAP,
        &|dir: &Path| waiter_cmd(&exe, dir, None),
        None,
    )?;
    eprintln!(
        "wake latency ({}): p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms (to drained: p99 {:.3} ms)",
        wake.waiter_mode,
        wake.send_to_woken.p50_ms,
        wake.send_to_woken.p99_ms,
        wake.send_to_woken.max_ms,
        wake.send_to_drained.p99_ms
    );
    // Awake is the recipient back from its wait; the drain after it adds the journal's
    // fdatasync (durability, not wake-up), reported apart.
    let mut wake_json = serde_json::to_value(&wake.send_to_woken)?;
    wake_json["measured"] = json!(
        "send start (before the fdatasync'd append) -> recipient awake (back from its inotify wait)"
    );
    wake_json["waiter_mode"] = json!(wake.waiter_mode);
    wake_json["send_to_drained"] = serde_json::to_value(&wake.send_to_drained)?;
    wake_json["append_sync"] = serde_json::to_value(&wake.append_sync)?;
    Ok((serde_json::to_value(&rows)?, wake_json))
}
