//! Benchmarks that print numbers (never timed assertions in tests).
//!
//! [`inbox_throughput`] measures append+drain through one inbox with N concurrent writer
//! processes, for troupe's locked append / journaled drain and for the naive baseline of the
//! reference design (unlocked appends; the reader reads the file, then truncates it, without the
//! writers' lock). Writers are separate processes (the `lead` binary re-run with a hidden
//! subcommand), as they are in a real team.

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::inbox::{Durability, Inbox};
use crate::message::{Message, MessageType};
use crate::teamdir::{AgentName, TeamDir};
use crate::transcript::Journal;

/// Which append/drain discipline a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Discipline {
    /// Locked single-write append; drain under the lock into a fsynced journal.
    Troupe,
    /// The reference design: unlocked append; read, then truncate, with no lock.
    Naive,
}

/// One throughput measurement.
#[derive(Debug, Clone, Serialize)]
pub struct ThroughputResult {
    pub discipline: Discipline,
    pub writers: usize,
    pub sent: u64,
    pub delivered: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub seconds: f64,
    pub msgs_per_sec: f64,
}

/// Pause between the bench consumer's drains.
const DRAIN_INTERVAL: Duration = Duration::from_millis(5);

fn bench_name() -> AgentName {
    AgentName::teammate("bench").expect("valid name")
}

/// The writer side, run in a child process: wait for `go`, then append `count` messages.
pub fn run_writer(
    team: &Path,
    writer: usize,
    count: u64,
    discipline: Discipline,
    go: &Path,
) -> Result<()> {
    let team = TeamDir::open(team)?;
    let name = bench_name();
    let inbox = Inbox::new(&team, &name);
    while !go.exists() {
        std::thread::sleep(Duration::from_micros(100));
    }
    match discipline {
        Discipline::Troupe => {
            let mut w = inbox.writer()?;
            for seq in 0..count {
                let m = Message::new(
                    MessageType::Message,
                    "lead",
                    "bench",
                    format!("{writer}:{seq}"),
                );
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
                let m = Message::new(
                    MessageType::Message,
                    "lead",
                    "bench",
                    format!("{writer}:{seq}"),
                );
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
    writer_cmd: &dyn Fn(&Path, usize, u64, Discipline, &Path) -> Command,
) -> Result<ThroughputResult> {
    let root = scratch.join(format!("{discipline:?}-{writers}").to_lowercase());
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
    let (mut journal, _) = Journal::open(&team, &name)?;
    let mut seen = HashSet::new();
    let mut delivered = 0u64;
    let mut duplicates = 0u64;
    let mut count = |msgs: Vec<Message>| {
        for m in msgs {
            delivered += 1;
            if !seen.insert(m.id) {
                duplicates += 1;
            }
        }
    };
    std::fs::write(&go, b"").map_err(Error::io("write", &go))?;
    let start = Instant::now();
    let mut done = false;
    while !done {
        done = kids
            .iter_mut()
            .all(|k| k.try_wait().ok().flatten().is_some());
        match discipline {
            Discipline::Troupe => count(inbox.drain(&mut journal)?),
            Discipline::Naive => count(naive_drain(inbox.path())?),
        }
        // A consumer drains in batches, as a worker does between model calls; draining in a
        // tight loop would mostly measure fsync latency.
        if !done {
            std::thread::sleep(DRAIN_INTERVAL);
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    for k in &mut kids {
        let status = k
            .wait()
            .map_err(Error::io("wait for bench writer", "lead"))?;
        if !status.success() {
            return Err(Error::Protocol(format!("bench writer failed: {status}")));
        }
    }
    let sent = writers as u64 * per_writer;
    let unique = delivered - duplicates;
    let _ = std::fs::remove_dir_all(&root);
    Ok(ThroughputResult {
        discipline,
        writers,
        sent,
        delivered,
        lost: sent.saturating_sub(unique),
        duplicates,
        seconds,
        msgs_per_sec: unique as f64 / seconds,
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
