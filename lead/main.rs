//! The `lead` binary: the supervisor, the scripting CLI and the LLM lead.
//!
//! `main` parses the command line, runs one command and maps its error to the exit codes of
//! DESIGN.md section 8 in one place ([`exit_code`]); errors are printed once, here, with their
//! chain.
//!
//! Started as `worker` (`argv[0]`), it is the worker instead: the lead carries the worker's code
//! (`worker/main.rs`, included as a module), so that `cargo run --bin lead`, which builds only
//! `lead`, can still run a team. `lead run` starts this built-in worker when no `worker` of the
//! same build is at hand (see [`worker_exe`]).

mod chat;
mod commands;
mod demo;
mod demo_board;
mod merge;
mod notify;
mod sandbox_check;
mod shell;
mod supervisor;
mod tasks;
mod top;
mod trace;
mod up;
mod up_trust;
mod watch;
#[path = "../worker/main.rs"]
mod worker;
mod worker_exe;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use troupe::eprintln;

use clap::{Parser, Subcommand};

/// Supervise and script a team of LLM agents run as Unix processes.
#[derive(Debug, Parser)]
#[command(name = "lead", version, about)]
struct Cli {
    /// Team directory (env TROUPE_TEAM_DIR; default: the nearest `.team` holding a team in
    /// this directory or a parent, else ./.team).
    #[arg(long, global = true, env = "TROUPE_TEAM_DIR", value_parser = troupe::fsutil::absolute_arg)]
    team_dir: Option<PathBuf>,
    /// Keep the team's shared state (inboxes, roster, requests, tasks, events) on this Redis
    /// bus, `redis://[USER@]HOST[:PORT][/DB][?team=NAME]`, so that hosts can share a team (env
    /// TROUPE_BUS; the password from TROUPE_BUS_PASSWORD_FILE, the systemd credential
    /// troupe-bus-password or TROUPE_BUS_PASSWORD, never from the URL).
    #[arg(long, global = true, env = "TROUPE_BUS")]
    bus: Option<String>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Supervise the team in the foreground until SIGTERM/SIGINT.
    Run(supervisor::RunArgs),
    /// Stop the team gracefully from another shell; returns when everything is down.
    Stop(supervisor::StopArgs),
    /// Add a teammate (or reactivate one) with its task; a supervisor starts it.
    Spawn(commands::SpawnArgs),
    /// Send a message from the lead to a teammate; prints the message id.
    Send(commands::SendArgs),
    /// Send a message to every running teammate.
    Broadcast(commands::BroadcastArgs),
    /// Show the lead's inbox (consumes it unless --peek).
    Inbox(commands::InboxArgs),
    /// Show every member: status, pid, incarnation, restarts, last exit, tokens, requests.
    Status(commands::ListArgs),
    /// List protocol requests.
    Requests(commands::RequestsArgs),
    /// Ask a teammate to shut down; prints the request id.
    Shutdown(commands::ShutdownArgs),
    /// Approve a teammate's plan.
    Approve(commands::DecideArgs),
    /// Reject a teammate's plan (with --feedback).
    Reject(commands::DecideArgs),
    /// The task board: add, list, show, cancel and reopen tasks.
    Task(tasks::TaskArgs),
    /// Bring a team up from a team file (TOML or JSON): members, tasks, hooks; twice changes
    /// nothing.
    Up(up::UpArgs),
    /// Teammates' git worktrees: `lead worktree remove NAME [--force]`.
    Worktree(commands::WorktreeArgs),
    /// The merge queue: `lead merge NAME` queues NAME's branch; --list [--json], --cancel ID,
    /// --retry ID.
    Merge(merge::MergeArgs),
    /// Print a teammate's log (stderr of its worker).
    Logs(commands::LogsArgs),
    /// A full-screen live view of the team (--once --json: one frame for scripts).
    Top(top::TopArgs),
    /// Follow the team's events as they happen (--json for one object a line).
    Watch(watch::WatchArgs),
    /// Write the team's history as a trace: Chrome trace events (Perfetto) or text.
    Trace(trace::TraceArgs),
    /// Talk to the LLM lead: a REPL, or one prompt with -p (starts a supervisor if none runs).
    Chat(chat::ChatArgs),
    /// Run a whole team on the shipped cassette (no network, no key), printing a timeline.
    Demo(demo::DemoArgs),
    /// The sandbox of teammates' commands: `lead sandbox check [--json]` runs the negative
    /// checks in a real one (exit 1 when one does not hold).
    Sandbox(sandbox_check::SandboxArgs),
    /// Print a completion script: `source <(lead completions bash)`; zsh and fish likewise.
    Completions(shell::CompletionsArgs),
    /// Print the man page lead(1); with --dir, write it and one page per command into DIR.
    Man(shell::ManArgs),
    /// Internal: member names or task ids, one a line, for the bash completion.
    #[command(hide = true)]
    CompleteNames(shell::NamesArgs),
}

fn main() -> ExitCode {
    troupe::llm::protect_keys();
    // SAFETY: no other thread exists yet.
    unsafe { troupe::fsutil::absolute_path_vars() };
    let argv0 = std::env::args_os().next().map(PathBuf::from);
    if argv0.as_deref().and_then(Path::file_name) == Some("worker".as_ref()) {
        return worker::main();
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    if let Some(url) = &cli.bus {
        // Every team dir this process opens reads the bus from the environment, and the
        // workers it starts inherit it.
        // SAFETY: no other thread exists yet (nothing has been started since main began).
        unsafe { std::env::set_var(troupe::secrets::BUS_ENV, url) };
    }
    // The conversational commands share the terminal with a person: only warnings there.
    let level = match cli.command {
        Cmd::Chat(_) | Cmd::Demo(_) | Cmd::Sandbox(_) => tracing::Level::WARN,
        _ => tracing::Level::INFO,
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .without_time()
        .with_max_level(level)
        .init();
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        // The reader of the output went away (`lead logs NAME | head`): a quiet end.
        Err(e) if troupe::out::is_broken_pipe(&e) => ExitCode::from(troupe::out::EXIT_PIPE),
        Err(e) => {
            // An error may quote what it was given (a name, a file's text): escaped.
            eprintln!("lead: {}", troupe::term_text::lines(&format!("{e:#}")));
            ExitCode::from(exit_code(&e))
        }
    }
}

/// The default team dir: the nearest `.team` that holds a team (a `config.json` or a
/// `lead.lock`) in the current directory or one of its parents, as git finds `.git`, with the
/// directory it was found in (the working dir a `lead run` or `lead chat` there defaults to);
/// else `./.team`.
fn find_team_dir() -> (PathBuf, Option<PathBuf>) {
    let here = std::env::current_dir().ok();
    let found = here.as_deref().and_then(|cwd| {
        cwd.ancestors().find(|d| {
            let t = d.join(".team");
            t.join("config.json").exists() || t.join("lead.lock").exists()
        })
    });
    match found {
        Some(d) if Some(d) != here.as_deref() => (d.join(".team"), Some(d.to_path_buf())),
        _ => (PathBuf::from(".team"), None),
    }
}

fn run(cli: Cli) -> anyhow::Result<u8> {
    let (team_dir, found_in) = match cli.team_dir {
        Some(d) => (d, None),
        None => find_team_dir(),
    };
    let team_dir = team_dir.as_path();
    let team = || troupe::TeamDir::open(team_dir);
    let mut command = cli.command;
    // A team found in a parent works in that parent unless told otherwise.
    if let Some(top) = found_in {
        match &mut command {
            Cmd::Run(a) => a.default_workdir(top),
            Cmd::Chat(a) => {
                a.workdir.get_or_insert(top);
            }
            _ => {}
        }
    }
    match command {
        // Rebuilt from what was parsed, not cut out of argv, where `run` may be a value too
        // (`--team-dir run`).
        Cmd::Run(a) if a.detach => supervisor::detach(team_dir, &a.to_args()?),
        Cmd::Run(a) => supervisor::run(team_dir, a),
        Cmd::Stop(a) => supervisor::stop(&team()?, a),
        Cmd::Spawn(a) => commands::spawn(team_dir, a),
        Cmd::Send(a) => commands::send(&team()?, a),
        Cmd::Broadcast(a) => commands::broadcast(&team()?, a),
        Cmd::Inbox(a) => commands::inbox(&team()?, a),
        Cmd::Status(a) => commands::status(&team()?, a),
        Cmd::Requests(a) => commands::requests(&team()?, a),
        Cmd::Shutdown(a) => commands::shutdown(&team()?, a),
        Cmd::Approve(a) => commands::decide(&team()?, a, true),
        Cmd::Reject(a) => commands::decide(&team()?, a, false),
        Cmd::Logs(a) => commands::logs(&team()?, a),
        Cmd::Top(a) => top::top(&team()?, a),
        Cmd::Watch(a) => watch::watch(&team()?, a),
        Cmd::Trace(a) => trace::trace(&team()?, a),
        Cmd::Worktree(a) => commands::worktree(&team()?, a),
        Cmd::Merge(a) => merge::merge(&team()?, a),
        Cmd::Task(a) => tasks::run(team_dir, a),
        Cmd::Up(a) => up::run(team_dir, a),
        Cmd::Chat(a) => chat::run(team_dir, a),
        Cmd::Demo(a) => demo::run(a),
        Cmd::Sandbox(a) => sandbox_check::run(a),
        Cmd::Completions(a) => shell::completions(a),
        Cmd::Man(a) => shell::man(a),
        Cmd::CompleteNames(a) => shell::names(team_dir, a),
    }
}

/// An error that decides its own exit code: a configuration error the lead finds itself (78,
/// an unusable `TROUPE_WORKER`), or a background supervisor's failure to start, passed on with
/// the code it exited with.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct ExitError {
    pub code: u8,
    pub message: String,
}

/// Maps an error to the CLI exit code: an [`ExitError`]'s own code, else the library's code
/// when the chain holds a [`troupe::Error`], else 1.
fn exit_code(e: &anyhow::Error) -> u8 {
    if let Some(x) = e.chain().find_map(|c| c.downcast_ref::<ExitError>()) {
        return x.code;
    }
    e.chain()
        .find_map(|c| c.downcast_ref::<troupe::Error>())
        .map_or(1, troupe::Error::exit_code)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_args(argv: &[&str]) -> supervisor::RunArgs {
        match Cli::try_parse_from(argv).unwrap().command {
            Cmd::Run(a) => a,
            other => panic!("not run: {other:?}"),
        }
    }

    #[test]
    fn detached_run_args_parse_back_the_same() {
        for argv in [
            &["lead", "run", "--detach"][..],
            &[
                "lead",
                "--team-dir",
                "run",
                "run",
                "--detach",
                "--workdir",
                "run",
                "--stop-timeout",
                "7",
                "--kill-grace",
                "2",
                "--max-restarts",
                "9",
                "--restart-window",
                "30",
                "--restart-delay",
                "0.25",
                "--restart-delay-max",
                "12.5",
                "--team-budget-usd",
                "2.5",
                "--max-members",
                "5",
                "--max-spawns-per-minute",
                "12",
                "--prices",
                "/etc/troupe/prices.json",
            ],
        ] {
            let a = run_args(argv);
            let rest = a.to_args().unwrap();
            assert!(!rest.iter().any(|x| x == "--detach"));
            let mut again = vec!["lead".to_owned(), "run".to_owned(), "--detach".to_owned()];
            again.extend(rest);
            let b = run_args(&again.iter().map(String::as_str).collect::<Vec<_>>());
            assert_eq!(format!("{a:?}"), format!("{b:?}"));
        }
    }
}
