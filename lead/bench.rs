//! `lead bench`: runs the benchmarks and prints one JSON document on stdout.

use std::path::PathBuf;
use std::process::Command;

use anyhow::Context;
use serde_json::json;
use troupe::bench::{self, Discipline};

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Messages each writer process appends.
    #[arg(long, default_value_t = 200_000)]
    messages: u64,
    /// Scratch directory for the throwaway team dirs (default: the system temp dir).
    #[arg(long)]
    scratch: Option<PathBuf>,
}

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
}

pub fn writer(a: WriterArgs) -> anyhow::Result<u8> {
    let d = if a.naive {
        Discipline::Naive
    } else {
        Discipline::Troupe
    };
    bench::run_writer(&a.dir, a.writer, a.count, d, &a.go)?;
    Ok(0)
}

pub fn run(a: BenchArgs) -> anyhow::Result<u8> {
    let exe = std::env::current_exe().context("failed to find the lead binary")?;
    let scratch = tempfile_dir(a.scratch)?;
    let cmd = |dir: &std::path::Path, w: usize, n: u64, d: Discipline, go: &std::path::Path| {
        let mut c = Command::new(&exe);
        c.arg("bench-writer")
            .arg("--dir")
            .arg(dir)
            .args(["--writer", &w.to_string(), "--count", &n.to_string()])
            .arg("--go")
            .arg(go);
        if d == Discipline::Naive {
            c.arg("--naive");
        }
        c
    };
    let mut throughput = Vec::new();
    for writers in [1, 4] {
        for d in [Discipline::Troupe, Discipline::Naive] {
            let r = bench::inbox_throughput(&scratch, writers, a.messages, d, &cmd)?;
            eprintln!(
                "inbox {:?} writers={} {:.0} msgs/s lost={} dup={}",
                r.discipline, r.writers, r.msgs_per_sec, r.lost, r.duplicates
            );
            throughput.push(r);
        }
    }
    let _ = std::fs::remove_dir_all(&scratch);
    let doc = json!({
        "machine": machine(),
        "git_commit": git_commit(),
        "inbox_throughput": throughput,
    });
    println!("{}", serde_json::to_string_pretty(&doc)?);
    Ok(0)
}

fn tempfile_dir(base: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    let base = base.unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("troupe-bench-{}", std::process::id()));
    troupe::fsutil::create_dir(&dir)?;
    Ok(dir)
}

fn machine() -> serde_json::Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = nix::sys::utsname::uname()
        .map(|u| {
            format!(
                "{} {}",
                u.sysname().to_string_lossy(),
                u.release().to_string_lossy()
            )
        })
        .unwrap_or_default();
    json!({"cores": cores, "kernel": kernel, "arch": std::env::consts::ARCH})
}

fn git_commit() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}
