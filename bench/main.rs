//! `troupe-bench`: measures troupe and prints one JSON document on stdout (progress on stderr).
//!
//! The measuring code lives here, not in what `lead` and `worker` ship. It drives the binaries
//! of the same build: the `lead` beside this executable (`cargo build --release --workspace`
//! builds all three into `target/release`), and re-runs itself, through hidden subcommands, for
//! the writer and waiter processes of the inbox sections.
//!
//! - `inbox_throughput`: append+drain with 1 and 4 writer processes, troupe and the naive
//!   baseline ([`inbox::throughput`]).
//! - `wake_latency`: send -> recipient-awake for an idle waiter process
//!   ([`inbox::wake_latency`]).
//! - `spawn_100`, `shutdown_round_trip`, `recovery_after_kill9`, `team_stop`: a real team, with
//!   the real `lead run` supervisor and `worker` binaries on a replay cassette written into the
//!   scratch dir (no network): 100 members spawned to `idle` (and their idle RSS), shutdown
//!   requests until the supervisor reaped the exit, `kill -9` of idle workers until they are
//!   `idle` again in their next incarnation (the restart backoff shown apart), and the graceful
//!   stop of whoever is left ([`team`]).
//! - `spawn_call`: the spawn call alone, into a team no supervisor runs (nothing else takes
//!   `config.lock`), with one roster update of the full roster taken apart; `spawn_100` reports
//!   its spawn calls (total and each) apart from spawn -> idle.
//! - `worker_startup`: spawn -> idle, idle memory and CPU per worker for the separate `worker`
//!   binary and the lead's built-in worker, each with `--sandbox off` and `best-effort`
//!   ([`startup`]). `--team-only` runs just the team sections.
//! - `scale`: with `--scale 100,300`, alone: spawn calls, spawn -> all idle and the team stop
//!   (all members running) for each team size in the same run, and their growth from the first
//!   size to the last against issue 24's bar ([`scale`]).
//! - `bash_round_trip`: the sandbox's cost on one bash tool call ([`sandbox`]).
//! - `prompt_cache`: one real worker (the lead's built-in one) runs a 30-step tool loop against
//!   the caching stub of [`cache_stub`] ([`prompt_cache`]).
//! - `redis`: the inbox sections on a Redis bus, with `--bus` ([`redis`]).
//! - `redis_compare`: with `--bus` and `--redis-compare`, alone: troupe's Redis inbox against
//!   `redis-benchmark` XADD under `appendfsync always` and `everysec`, and the server's commands
//!   per message ([`redis_compare`]).
//! - `targets`: the budgets of issue 6 (DESIGN.md section 11), each with `met`. Reported, never
//!   asserted ([`targets`]).

mod cache_stub;
mod governed;
mod inbox;
mod lead;
mod machine;
mod measure;
mod prompt_cache;
mod rate_stub;
mod redis;
mod redis_admin;
mod redis_compare;
mod sandbox;
mod scale;
mod startup;
mod targets;
mod team;
mod watch;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;
use troupe::{eprintln, println};

use anyhow::Context;
use clap::{Parser, Subcommand};
use serde_json::{Value, json};

use crate::measure::round3;

/// Measure troupe (inbox throughput and wake-up, a team of workers, the sandbox, the prompt
/// cache) and print one JSON document. Runs the `lead` built beside it.
#[derive(Debug, Parser)]
#[command(name = "troupe-bench", version, args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(flatten)]
    args: BenchArgs,
    /// Also measure the inbox on this Redis bus, `redis://[USER@]HOST[:PORT][/DB]`, under
    /// throwaway team names `bench-PID-...` (env TROUPE_BUS; the password as for `lead --bus`:
    /// TROUPE_BUS_PASSWORD_FILE, the systemd credential troupe-bus-password or
    /// TROUPE_BUS_PASSWORD).
    #[arg(long, global = true, env = "TROUPE_BUS")]
    bus: Option<String>,
    #[command(subcommand)]
    child: Option<Child>,
}

/// The bench's own child processes: this executable re-run.
#[derive(Debug, Subcommand)]
enum Child {
    /// Internal: one writer process of the throughput runs.
    #[command(hide = true)]
    Writer(inbox::WriterArgs),
    /// Internal: the idle recipient of the wake-up latency.
    #[command(hide = true)]
    Waiter(inbox::WaiterArgs),
}

/// What to measure, and how much.
#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Messages each writer process appends in the throughput runs.
    #[arg(long, default_value_t = 200_000)]
    pub messages: u64,
    /// Messages sent one at a time to an idle waiter for the wake-up latency.
    #[arg(long, default_value_t = 200)]
    pub wake_samples: usize,
    /// Workers spawned to `idle` (and measured for RSS).
    #[arg(long, default_value_t = 100)]
    pub workers: usize,
    /// Of those, how many are asked to shut down, one after the other.
    #[arg(long, default_value_t = 30)]
    pub shutdowns: usize,
    /// Of those, how many idle workers are killed with SIGKILL, one after the other.
    #[arg(long, default_value_t = 5)]
    pub kills: usize,
    /// Restart delay passed to `lead run --restart-delay` when the supervisor has that flag
    /// (otherwise its built-in first backoff of 1 s applies).
    #[arg(long, default_value_t = 0.1)]
    pub restart_delay: f64,
    /// Scratch directory for the throwaway team dirs (default: the system temp dir).
    #[arg(long)]
    pub scratch: Option<PathBuf>,
    /// Run only the prompt-cache section (the 30-step loop against the caching stub).
    #[arg(long, conflicts_with = "inbox_only")]
    pub prompt_cache_only: bool,
    /// Run only the inbox sections (throughput and wake-up latency).
    #[arg(long)]
    pub inbox_only: bool,
    /// Run only the sandbox section (the bash round trip, sandboxed and not).
    #[arg(long, conflicts_with_all = ["inbox_only", "prompt_cache_only"])]
    pub sandbox_only: bool,
    /// Messages each writer process appends in the Redis throughput runs.
    #[arg(long, default_value_t = 20_000)]
    pub redis_messages: u64,
    /// With --bus, run only the comparison with `redis-benchmark` XADD (1 and 4 clients,
    /// `appendfsync always` then `everysec`, set with CONFIG SET and put back afterwards),
    /// --redis-messages per writer, with the server's commands per message.
    #[arg(long, conflicts_with_all = ["inbox_only", "prompt_cache_only", "sandbox_only"])]
    pub redis_compare: bool,
    /// Run only the team sections (spawn calls, spawn -> idle, worker start-up, shutdown,
    /// recovery).
    #[arg(long, conflicts_with_all = ["inbox_only", "prompt_cache_only", "sandbox_only", "redis_compare"])]
    pub team_only: bool,
    /// Run only the scale sections, for each of these team sizes in turn (such as `100,300`):
    /// spawn calls, spawn -> all idle and the team stop of a fresh team of that size, and how
    /// each grew from the first size to the last (issue 24).
    #[arg(long, value_parser = scale::parse_sizes, conflicts_with_all = ["inbox_only", "prompt_cache_only", "sandbox_only", "redis_compare", "team_only"])]
    pub scale: Option<scale::Sizes>,
    /// With --scale, on an ext4 without a journal only: the longest to wait, in seconds, for
    /// the scratch dir's file creation to cost what it does on a rested file system (such an
    /// ext4 passes over inodes freed in the last minutes, a previous run's cleanup among them);
    /// 0 does not wait.
    #[arg(long, default_value_t = 360)]
    pub settle_secs: u64,
    /// Run only the governed-load section (issue 25): 8 teammates x 6 calls against stubs
    /// that limit them (a window of 6 a second, 3 at once, 10 a second with remaining-requests
    /// headers), with the rate governor off, by default and with a cap of 3: 429s and wall time.
    #[arg(long, conflicts_with_all = ["inbox_only", "prompt_cache_only", "sandbox_only", "redis_compare", "team_only", "scale"])]
    pub governed_only: bool,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    // The bench picks the bus of each measurement itself (the file bus always, the Redis one
    // with `--bus`): no team dir it opens, and no process it starts, may take the
    // environment's.
    // SAFETY: no other thread exists yet.
    unsafe { std::env::remove_var(troupe::store::redis::BUS_ENV) };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .init();
    let bus = cli.bus.as_deref();
    let result = match cli.child {
        None => run(&cli.args, bus),
        Some(Child::Writer(a)) => inbox::writer(&a, bus),
        Some(Child::Waiter(a)) => inbox::waiter(&a, bus),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if troupe::out::is_broken_pipe(&e) => ExitCode::from(troupe::out::EXIT_PIPE),
        Err(e) => {
            eprintln!("troupe-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the sections asked for in a scratch dir of its own, removed afterwards, and prints the
/// document.
fn run(a: &BenchArgs, bus: Option<&str>) -> anyhow::Result<()> {
    let started = Instant::now();
    let scratch = machine::scratch_dir(a.scratch.clone())?;
    let result = run_in(a, bus, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    let mut doc = result?;
    doc["bench_seconds"] = json!(round3(started.elapsed().as_secs_f64()));
    println!("{}", serde_json::to_string_pretty(&doc)?);
    Ok(())
}

fn run_in(a: &BenchArgs, bus: Option<&str>, scratch: &Path) -> anyhow::Result<Value> {
    let mut doc = machine::header(scratch);
    if a.sandbox_only {
        doc["bash"] = section(sandbox::bash_round_trip(scratch));
        return Ok(doc);
    }
    if a.governed_only {
        doc["governed"] = section(governed::run(&lead::lead_exe()?, scratch));
        return Ok(doc);
    }
    if a.prompt_cache_only {
        doc["prompt_cache"] = section(prompt_cache::run(&lead::lead_exe()?, scratch));
        return Ok(doc);
    }
    if a.redis_compare {
        let url = bus.context("--redis-compare needs --bus (or TROUPE_BUS)")?;
        doc["settings"] = json!({"redis_messages_per_writer": a.redis_messages});
        doc["redis_compare"] = section(redis_compare::run(a, scratch, url));
        doc["targets"] = redis_compare::targets(&doc["redis_compare"]);
        return Ok(doc);
    }
    if let Some(scale::Sizes(sizes)) = &a.scale {
        doc["settings"] =
            json!({"scale": sizes, "restart_delay": a.restart_delay, "settle_secs": a.settle_secs});
        scale::sections(a, sizes, &lead::lead_exe()?, scratch, &mut doc);
        doc["targets"] = json!({"scale": doc["scale"]["ratios"].clone()});
        return Ok(doc);
    }
    if a.team_only {
        team::sections(a, &lead::lead_exe()?, scratch, &mut doc);
        doc["targets"] = targets::only(&doc, &["spawn", "idle", "shutdown", "sandbox_"]);
        return Ok(doc);
    }
    // Looked for first: a full run without the lead it drives fails before minutes of
    // measuring, not after.
    let lead = if a.inbox_only {
        None
    } else {
        Some(lead::lead_exe()?)
    };
    let (throughput, wake) = inbox::sections(a, scratch)?;
    let redis_json = match bus {
        Some(url) => section(redis::inbox(a, scratch, url)),
        None => Value::Null,
    };
    let Some(lead) = lead else {
        doc["settings"] =
            json!({"messages_per_writer": a.messages, "wake_samples": a.wake_samples});
        doc["inbox_throughput"] = throughput;
        doc["wake_latency"] = wake;
        if !redis_json.is_null() {
            doc["redis"] = redis_json;
        }
        doc["targets"] = targets::only(&doc, &["throughput", "wake", "send_to"]);
        return Ok(doc);
    };
    doc["settings"] = json!({
        "messages_per_writer": a.messages,
        "wake_samples": a.wake_samples,
        "workers": a.workers,
        "shutdowns": a.shutdowns,
        "kills": a.kills,
    });
    doc["inbox_throughput"] = throughput;
    doc["wake_latency"] = wake;
    doc["bash_round_trip"] = section(sandbox::bash_round_trip(scratch));
    doc["prompt_cache"] = section(prompt_cache::run(&lead, scratch));
    team::sections(a, &lead, scratch, &mut doc);
    if !redis_json.is_null() {
        doc["redis"] = redis_json;
    }
    doc["targets"] = targets::all(&doc);
    Ok(doc)
}

/// A section of the document: its value, or `{"error": ...}` (also shown on stderr) when it
/// failed, so that one broken measurement does not hide the others.
pub fn section(r: anyhow::Result<Value>) -> Value {
    r.unwrap_or_else(|e| {
        eprintln!("troupe-bench: {e:#}");
        json!({"error": format!("{e:#}")})
    })
}
