//! The `lead` binary: the supervisor, the scripting CLI and the LLM lead.
//!
//! `main` parses the command line, runs one command and maps its error to the exit codes of
//! DESIGN.md section 8 in one place ([`exit_code`]); errors are printed once, here, with their
//! chain.

mod bench;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Supervise and script a team of LLM agents run as Unix processes.
#[derive(Debug, Parser)]
#[command(name = "lead", version, about)]
struct Cli {
    /// Team directory (default ./.team; env TROUPE_TEAM_DIR).
    #[arg(long, global = true, env = "TROUPE_TEAM_DIR", default_value = ".team")]
    team_dir: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Measure inbox throughput (and more) and print one JSON document.
    Bench(bench::BenchArgs),
    /// Internal: one writer process of `lead bench`.
    #[command(hide = true)]
    BenchWriter(bench::WriterArgs),
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .init();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("lead: {e:#}");
            ExitCode::from(exit_code(&e))
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<u8> {
    match cli.command {
        Cmd::Bench(args) => bench::run(args),
        Cmd::BenchWriter(args) => bench::writer(args),
    }
}

/// Maps an error to the CLI exit code: the library's own code when the chain holds a
/// [`troupe::Error`], else 1.
fn exit_code(e: &anyhow::Error) -> u8 {
    e.chain()
        .find_map(|c| c.downcast_ref::<troupe::Error>())
        .map_or(1, troupe::Error::exit_code)
}
