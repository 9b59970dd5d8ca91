//! The `worker` binary: one teammate process, started by `lead run` (or by hand for debugging).
//!
//! It runs the teammate loop of [`troupe::agent::teammate`] until an approved shutdown (exit 0),
//! a signal (SIGTERM/SIGINT: finish the current step, persist, exit 143), or a fatal provider
//! error (75 transient, 78 configuration). Exit codes are decided here, in one place.
//!
//! The `lead` binary includes this file as a module and runs [`main`] when it is started as
//! `worker` (its built-in worker), so a lead built alone can still run its team. A worker
//! started with `TROUPE_BUILD_ID` set to another build than its own (the binary was replaced
//! under a running lead) refuses to run: exit 78.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Duration;
use troupe::{eprintln, println};

use anyhow::Context;
use clap::Parser;
use troupe::agent::teammate::{Outcome, Settings, Teammate};
use troupe::fsutil::HeldLock;
use troupe::wait::Signals;
use troupe::{AgentName, TeamDir};

/// Run one teammate of a troupe team.
#[derive(Debug, Parser)]
#[command(
    name = "worker",
    version,
    about,
    after_help = "`worker --build-id` prints the build id (the package version and a hash of the \
                  sources) and exits; `lead run` starts only workers of its own build."
)]
pub(crate) struct Args {
    /// Team directory.
    #[arg(long, env = "TROUPE_TEAM_DIR", default_value = ".team", value_parser = troupe::fsutil::absolute_arg)]
    team_dir: PathBuf,
    /// The teammate's name (must be in config.json).
    #[arg(long)]
    name: String,
    /// Working directory the tools are confined to (default: the current directory).
    #[arg(long, value_parser = troupe::fsutil::absolute_arg)]
    workdir: Option<PathBuf>,
    /// Model calls allowed per activation.
    #[arg(long, env = "TROUPE_MAX_CALLS", default_value_t = 50)]
    max_calls: u64,
    /// The model's context size in tokens (default: by model family, 200,000 for Claude,
    /// 128,000 for GPT-4o and unknown models); the conversation is compacted to stay inside it.
    #[arg(long, env = "TROUPE_CONTEXT_TOKENS", value_parser = clap::value_parser!(u64).range(2000..))]
    context_tokens: Option<u64>,
    /// max_tokens of each model call.
    #[arg(long, env = "TROUPE_MAX_TOKENS", default_value_t = 8192)]
    max_tokens: u32,
    /// Timeout of the bash tool, in seconds.
    #[arg(long, env = "TROUPE_BASH_TIMEOUT_SECS", default_value_t = 120)]
    bash_timeout: u64,
    /// While the model API is down, the longest wait between tries, in seconds (the waits
    /// start at 1 s and double up to this).
    #[arg(long, env = "TROUPE_API_WAIT_MAX_SECS", default_value_t = 30.0, value_parser = parse_secs)]
    api_wait_max: f64,
    /// A price file (JSON: model-id prefix -> per-million prices) over the built-in prices.
    #[arg(long, env = "TROUPE_PRICES")]
    prices: Option<PathBuf>,
    #[command(flatten)]
    sandbox: troupe::sandbox::Settings,
}

/// A positive number of seconds, at most a day.
fn parse_secs(s: &str) -> Result<f64, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("not a number of seconds: {e}"))?;
    if !(0.001..=86_400.0).contains(&secs) {
        return Err("must be from 0.001 to 86400 seconds".to_owned());
    }
    Ok(secs)
}

const EX_USAGE: u8 = 64;
const EX_CONFIG: u8 = 78;
const EXIT_TERM: u8 = 143;

/// The worker's entry point; also the lead's built-in worker (`lead` started as `worker`).
pub(crate) fn main() -> ExitCode {
    troupe::llm::protect_keys();
    // SAFETY: no other thread exists yet.
    unsafe { troupe::fsutil::absolute_path_vars() };
    // Before clap, which would insist on --name: `lead run` asks this of any worker it finds.
    if std::env::args_os().skip(1).any(|a| a == "--build-id") {
        println!("{}", troupe::BUILD_ID);
        return ExitCode::SUCCESS;
    }
    if let Some(lead_build) = std::env::var_os("TROUPE_BUILD_ID").filter(|b| !b.is_empty())
        && lead_build != troupe::BUILD_ID
    {
        // The binary was replaced under a running lead: this code may not speak its formats.
        eprintln!(
            "worker: this worker is build {} but the lead that started it is build {}; \
             restart lead run after rebuilding",
            troupe::BUILD_ID,
            lead_build.to_string_lossy()
        );
        return ExitCode::from(EX_CONFIG);
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { EX_USAGE } else { 0 });
        }
    };
    match run(args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("worker: {e:#}");
            let code = e
                .chain()
                .find_map(|c| c.downcast_ref::<troupe::Error>())
                .map_or(1, |t| match t {
                    troupe::Error::InvalidName { .. } | troupe::Error::UnknownMember(_) => EX_USAGE,
                    troupe::Error::Corrupt { .. } | troupe::Error::NotADirectory(_) => EX_CONFIG,
                    troupe::Error::Fenced { .. } => troupe::fence::EXIT_SUPERSEDED,
                    troupe::Error::Unfenced { .. } => troupe::fence::EXIT_UNFENCED,
                    _ => 1,
                });
            ExitCode::from(code)
        }
    }
}

fn run(a: Args) -> anyhow::Result<u8> {
    let name = AgentName::teammate(&a.name)?;
    let team = TeamDir::open(&a.team_dir)?;
    watch_parent();
    let signals = Signals::install().context("failed to install signal handlers")?;
    // One live process per teammate. A predecessor still holding the lock is finishing its
    // step (an orphan of a crashed lead got SIGTERM through PDEATHSIG, and a model call or a
    // bash command can take minutes): wait for it, however long, rather than exit and count
    // against the restart limit. A signal ends the wait.
    let lock_path = team.transcript_lock(&name);
    troupe::fsutil::create_dir(&team.transcripts_dir())?;
    let mut said = false;
    let _alive = loop {
        if let Some(l) = HeldLock::try_acquire(&lock_path)? {
            break l;
        }
        if signals.term.load(Ordering::SeqCst) {
            return Ok(EXIT_TERM);
        }
        if !said {
            eprintln!(
                "worker: another process of {name} is finishing its step; waiting for it to exit"
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // Every model call of this member goes through the team's rate governor.
    troupe::governor::Governor::install(&team, name.as_str());
    let provider = match troupe::llm::from_env() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("worker: {e}");
            return Ok(e.exit_code());
        }
    };
    let prices = match troupe::cost::PriceTable::load(a.prices.as_deref()) {
        Ok(p) => std::sync::Arc::new(p),
        Err(e) => {
            eprintln!("worker: {e}");
            return Ok(EX_CONFIG);
        }
    };
    // Traces, when OTEL_EXPORTER_OTLP_ENDPOINT asks for them (nothing at all otherwise).
    if troupe::telemetry::wanted() {
        let team_name = troupe::config::Roster::new(&team)
            .load_team()
            .map(|c| c.team_name)
            .unwrap_or_default();
        troupe::telemetry::init("troupe-worker", &team_name, name.as_str(), provider.name());
    }
    let workdir = match a.workdir {
        Some(w) => w,
        None => std::env::current_dir().context("failed to read the current directory")?,
    };
    // What git may write comes from the roster's record of the member's worktree (the team
    // dir is out of its commands' reach), never from the working dir's `.git`. Its own record
    // alone: a team of hundreds starting at once would otherwise read every record hundreds
    // of times.
    let worktree = troupe::config::Roster::new(&team)
        .load_for_patiently(name.as_str(), &|| signals.term.load(Ordering::SeqCst))
        .ok()
        .and_then(|c| c.member(name.as_str()).and_then(|m| m.worktree.clone()));
    let sandbox = std::sync::Arc::new(troupe::sandbox::Sandbox::prepare(
        &a.sandbox,
        &workdir,
        team.root(),
        name.as_str(),
        worktree.as_ref(),
    ));
    let settings = Settings {
        team,
        name,
        workdir,
        max_calls: a.max_calls,
        context_tokens: a.context_tokens,
        max_tokens: a.max_tokens,
        bash_timeout: Duration::from_secs(a.bash_timeout),
        api_wait_max: Duration::from_secs_f64(a.api_wait_max),
        sandbox,
        prices,
        worktree,
    };
    let mut mate = match Teammate::open(settings, provider, signals.term.clone(), &_alive) {
        Ok(m) => m,
        // Stopped while config.json did not parse: a stop, not a configuration error.
        Err(_) if signals.term.load(Ordering::SeqCst) => return Ok(EXIT_TERM),
        Err(e) => return Err(e.into()),
    };
    let code = mate.run(signals.fd()).map(|outcome| match outcome {
        Outcome::Shutdown => 0,
        Outcome::Terminated => EXIT_TERM,
        Outcome::Llm(e) => {
            eprintln!("worker: {e}");
            mate.record_failure(&e.to_string());
            e.exit_code()
        }
    });
    drop(mate);
    // What is left of the traces goes out, for at most a second.
    troupe::telemetry::shutdown();
    Ok(code?)
}

/// Dies with the parent: `PR_SET_PDEATHSIG`, set here (the supervisor starts workers with
/// posix_spawn, which runs no code of its own in the child), plus a check that the parent the
/// lead named is still the parent, for a lead that died before the prctl.
fn watch_parent() {
    let Some(expected) = std::env::var("TROUPE_PARENT_PID")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
    else {
        return;
    };
    // SAFETY: prctl(PR_SET_PDEATHSIG) takes plain integers and touches no memory of ours.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
    }
    if nix::unistd::getppid().as_raw() != expected {
        eprintln!("worker: the lead (pid {expected}) is gone; exiting");
        std::process::exit(i32::from(EXIT_TERM));
    }
}
