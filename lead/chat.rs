//! `lead chat`: the LLM lead, as a REPL or for one prompt (`-p`).
//!
//! The lead agent itself is [`troupe::agent::lead`]; this module is its front end: the prompt,
//! the slash commands, showing messages as they arrive, and the team's supervisor. When no
//! `lead run` holds the team dir, `chat` starts one as its child and stops the team gracefully
//! when it exits (the child also gets SIGTERM, hence a graceful stop, if `chat` dies).

use std::io::Write;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};
use troupe::{eprintln, print, println};

use anyhow::Context;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use troupe::agent::conversation::render_message;
use troupe::agent::lead::{Lead, LeadSettings, Next, Shown, TurnEnd};
use troupe::llm::{self, LlmError, Provider};
use troupe::message::Message;
use troupe::sandbox::Sandbox;
use troupe::term_text;
use troupe::tools;
use troupe::wait::{InboxWaiter, Signals, Wake};
use troupe::{AgentName, TeamDir};

use crate::supervisor::{self, Attach};

/// Exit code after SIGINT/SIGTERM.
const EXIT_INTERRUPTED: u8 = 130;

#[derive(Debug, clap::Args)]
pub struct ChatArgs {
    /// Run this one prompt, keep going until the team has nothing left to do, then exit.
    #[arg(short = 'p', long = "prompt")]
    pub prompt: Option<String>,
    /// Working directory of the lead's file tools and of a supervisor chat starts
    /// (default: the current directory).
    #[arg(long, value_parser = troupe::fsutil::absolute_arg)]
    pub workdir: Option<PathBuf>,
    /// Model of the lead (overrides MODEL_ID).
    #[arg(long)]
    pub model: Option<String>,
    /// Model calls allowed per turn.
    #[arg(long, default_value_t = 50)]
    pub max_calls: u64,
    /// The model's context size in tokens (default: by model family).
    #[arg(long, value_parser = clap::value_parser!(u64).range(2000..))]
    pub context_tokens: Option<u64>,
    #[arg(long, default_value_t = 8192)]
    pub max_tokens: u32,
    /// A price file (JSON: model-id prefix -> per-million prices) over the built-in prices,
    /// for the lead's own calls and a supervisor chat starts.
    #[arg(long, env = "TROUPE_PRICES")]
    pub prices: Option<PathBuf>,
    /// The sandbox of the lead's bash, and of the workers of a supervisor chat starts.
    #[command(flatten)]
    pub sandbox: troupe::sandbox::Settings,
}

/// Environment settings that override the process environment for the lead's provider and for
/// a supervisor (and so the workers) started here: how `lead demo` points everyone at its
/// cassette without touching its own environment.
#[derive(Debug, Clone, Default)]
pub struct EnvOverlay(pub Vec<(String, String)>);

impl EnvOverlay {
    /// The provider the overlaid environment asks for.
    pub fn provider(&self) -> Result<Box<dyn Provider>, LlmError> {
        llm::from_env_with(&|name| {
            self.0
                .iter()
                .rev()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
                .or_else(|| std::env::var(name).ok())
        })
    }
}

/// A supervisor this process started and must stop.
pub struct OwnSupervisor {
    child: Child,
}

impl OwnSupervisor {
    /// Starts `lead run` for `team` unless a supervisor already holds it (on a bus: unless some
    /// host's supervisor runs; a member the lead spawns then goes to the first that starts it).
    pub fn start_if_needed(
        team: &TeamDir,
        workdir: &Path,
        sandbox: &troupe::sandbox::Settings,
        env: &EnvOverlay,
    ) -> anyhow::Result<Option<OwnSupervisor>> {
        if troupe::liveness::supervisor_running(team)? {
            return Ok(None);
        }
        let mut args = vec!["--workdir".to_owned(), workdir.display().to_string()];
        args.extend(sandbox.to_args().map_err(anyhow::Error::msg)?);
        let child = supervisor::start_background(team, &args, &env.0, Attach::Child)?;
        Ok(Some(OwnSupervisor { child }))
    }

    /// The graceful team stop: SIGTERM to the supervisor, which asks every running teammate to
    /// shut down (SIGTERM, then SIGKILL for stragglers), then waits for it.
    pub fn stop(mut self) -> anyhow::Result<()> {
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(st) = self.child.try_wait()? {
                if !st.success() {
                    eprintln!("lead: the supervisor exited with {st}");
                }
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                anyhow::bail!("the supervisor did not stop within 120 s; killed it");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Builds the lead's settings from the chat flags.
fn settings(
    team: &TeamDir,
    workdir: &Path,
    a: &ChatArgs,
    prices: troupe::cost::PriceTable,
) -> LeadSettings {
    LeadSettings {
        prices: Arc::new(prices),
        team: team.clone(),
        workdir: workdir.to_path_buf(),
        model: a.model.clone().unwrap_or_default(),
        max_calls: a.max_calls,
        context_tokens: a.context_tokens,
        max_tokens: a.max_tokens,
        bash_timeout: Duration::from_secs(120),
        sandbox: Arc::new(Sandbox::prepare(
            &a.sandbox,
            workdir,
            team.root(),
            "lead",
            None,
        )),
    }
}

/// `lead chat`.
pub fn run(team_dir: &Path, a: ChatArgs) -> anyhow::Result<u8> {
    let team = TeamDir::create(team_dir)?;
    // The LLM lead's calls share the team's limits, and go first for a slot.
    troupe::governor::Governor::install(&team, troupe::teamdir::LEAD);
    let workdir = match &a.workdir {
        Some(w) => w.clone(),
        None => std::env::current_dir().context("failed to read the current directory")?,
    };
    let prices = troupe::cost::PriceTable::load(a.prices.as_deref())?;
    let mut env = EnvOverlay::default();
    if let Some(p) = &a.prices {
        let p = std::path::absolute(p)?;
        env.0.push((
            troupe::cost::PRICES_ENV.to_owned(),
            p.to_str()
                .context("--prices is not valid UTF-8")?
                .to_owned(),
        ));
    }
    let provider = match env.provider() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("lead: {}", term_text::lines(&e.to_string()));
            return Ok(e.exit_code());
        }
    };
    if troupe::telemetry::wanted() {
        let team_name = troupe::config::Roster::new(&team)
            .load_team()
            .map(|c| c.team_name)
            .unwrap_or_default();
        troupe::telemetry::init(
            "troupe-lead",
            &team_name,
            troupe::teamdir::LEAD,
            provider.name(),
        );
    }
    let signals = Signals::install().context("failed to install signal handlers")?;
    let mut lead = Lead::open(
        settings(&team, &workdir, &a, prices),
        provider,
        signals.term.clone(),
    )?;
    let own = OwnSupervisor::start_if_needed(&team, &workdir, &a.sandbox, &env)?;
    let result = match &a.prompt {
        Some(p) => unattended(&mut lead, p, &signals, &mut print_shown),
        None => repl(&mut lead, &team, &signals),
    };
    if let Some(own) = own {
        eprintln!("lead: stopping the team");
        own.stop()?;
    }
    eprintln!("lead: {}", spend_line(&team, &lead));
    drop(lead);
    troupe::telemetry::shutdown();
    result
}

/// The lead's own spend this session, and the team's: the last line of `lead chat`.
fn spend_line(team: &TeamDir, lead: &Lead) -> String {
    let u = lead.usage();
    let share =
        troupe::cost::cache_read_share(&u).map_or("-".to_owned(), |s| format!("{:.0}%", s * 100.0));
    let team_cost = troupe::config::Roster::new(team)
        .load()
        .map(|c| troupe::cost::usd(troupe::cost::team_spend(&c).cost_usd))
        .unwrap_or_else(|_| "unknown".to_owned());
    format!(
        "the lead spent {} this session ({} input, {} output tokens, {share} of input read from \
         cache); the team {team_cost} in all",
        troupe::cost::usd(lead.cost_usd()),
        u.input_tokens + u.cache_creation_input_tokens + u.cache_read_input_tokens,
        u.output_tokens,
    )
}

/// Prints what the lead did: its text on stdout, tool calls and arrivals on stderr. All of it
/// is a model's text: escaped for the terminal ([`troupe::term_text`]).
pub fn print_shown(s: Shown<'_>) {
    match s {
        Shown::Text(t) => println!("{}", term_text::lines(t.trim_end())),
        Shown::Inbox(batch) => {
            for m in batch {
                eprintln!("  [inbox] {}", one_line(&render_message(m), 160));
            }
        }
        Shown::Tool {
            name,
            input,
            output,
        } => eprintln!("  {}", describe_tool(name, input, output)),
    }
}

/// `[tool] detail -> first line of the result` on one line, escaped for the terminal.
pub fn describe_tool(
    name: &str,
    input: &serde_json::Value,
    output: &troupe::tools::ToolOutput,
) -> String {
    let line = format!(
        "[{name}] {} -> {}{}",
        tools::describe_call(name, input),
        if output.is_error { "error: " } else { "" },
        one_line(&output.content, 120)
    );
    term_text::line(&line).into_owned()
}

/// The first line of `s`, cut to `max` characters, escaped for the terminal.
pub fn one_line(s: &str, max: usize) -> String {
    let first = s.lines().next().unwrap_or("");
    let cut = if first.chars().count() > max || s.lines().nth(1).is_some() {
        format!("{}...", first.chars().take(max).collect::<String>())
    } else {
        first.to_owned()
    };
    term_text::line(&cut).into_owned()
}

/// One prompt, then turns whenever the team has something for the lead, until the team is
/// quiet with nothing unseen ([`Lead::next_wake`]).
pub fn unattended(
    lead: &mut Lead,
    prompt: &str,
    signals: &Signals,
    show: &mut dyn FnMut(Shown<'_>),
) -> anyhow::Result<u8> {
    lead.say(prompt)?;
    let mut waiter = InboxWaiter::new(lead.inbox())?;
    loop {
        match lead.turn(show)? {
            TurnEnd::Done => {}
            TurnEnd::Interrupted => return Ok(EXIT_INTERRUPTED),
            TurnEnd::Llm(e) => {
                eprintln!("lead: {}", term_text::lines(&e.to_string()));
                return Ok(e.exit_code());
            }
        }
        loop {
            let arrived = lead.drain_now()?;
            if !arrived.is_empty() {
                show(Shown::Inbox(&arrived));
            }
            match lead.next_wake()? {
                Next::Turn => break,
                Next::Done => return Ok(0),
                // Status changes (a teammate going idle) come through config.json, which the
                // inbox watch does not see: look again every 100 ms.
                Next::Wait => {
                    match waiter.wait(Some(Duration::from_millis(100)), &[signals.fd()])? {
                        Wake::External => return Ok(EXIT_INTERRUPTED),
                        Wake::Message | Wake::Timeout => {}
                    }
                }
            }
        }
    }
}

const HELP: &str = "Talk to the lead; it manages the team with its tools.\n\
  /team      the roster (config.json)\n\
  /inbox     messages the lead has received and not yet shown to the model\n\
  /requests  protocol requests (requests/)\n\
  /quit      leave (a team chat started is stopped gracefully); Ctrl-D too";

const PROMPT: &str = "you> ";

/// The interactive loop. Messages arriving while the person is at the prompt are drained
/// (journaled; the model sees them with the next turn) and printed at once, above a fresh
/// prompt.
fn repl(lead: &mut Lead, team: &TeamDir, signals: &Signals) -> anyhow::Result<u8> {
    println!(
        "troupe lead chat on {} (/help for commands)",
        team.root().display()
    );
    let stdin = std::io::stdin();
    let mut waiter = InboxWaiter::new(lead.inbox())?;
    let mut pending: Vec<u8> = Vec::new();
    let mut eof = false;
    prompt();
    loop {
        // Whole lines already read go first.
        if let Some(pos) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line).trim().to_owned();
            match command(lead, team, &line)? {
                Step::Quit => return Ok(0),
                Step::Interrupted => return Ok(EXIT_INTERRUPTED),
                Step::Failed(code) => return Ok(code),
                Step::Next => prompt(),
            }
            continue;
        }
        if eof {
            println!();
            return Ok(0);
        }
        let wake = waiter.wait(None, &[stdin.as_fd(), signals.fd()])?;
        if signals.term.load(std::sync::atomic::Ordering::SeqCst) {
            println!();
            return Ok(EXIT_INTERRUPTED);
        }
        if wake == Wake::Message {
            let arrived = lead.drain_now()?;
            if !arrived.is_empty() {
                // Clear the prompt line, show the messages, prompt again.
                print!("\r\x1b[2K");
                for m in &arrived {
                    println!("[inbox] {}", term_text::lines(&render_message(m)));
                }
                prompt();
            }
            continue;
        }
        let mut buf = [0u8; 4096];
        match nix::unistd::read(stdin.as_fd(), &mut buf) {
            Ok(0) => eof = true,
            Ok(n) => pending.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EINTR | nix::errno::Errno::EAGAIN) => {}
            Err(e) => return Err(e).context("failed to read the terminal"),
        }
        if eof && !pending.is_empty() && !pending.ends_with(b"\n") {
            pending.push(b'\n');
        }
    }
}

fn prompt() {
    print!("{PROMPT}");
    let _ = std::io::stdout().flush();
}

enum Step {
    Next,
    Quit,
    Interrupted,
    Failed(u8),
}

fn command(lead: &mut Lead, team: &TeamDir, line: &str) -> anyhow::Result<Step> {
    match line {
        "" => {}
        "/quit" | "/exit" => return Ok(Step::Quit),
        "/help" => println!("{HELP}"),
        "/team" => crate::commands::status_table(team)?,
        "/requests" => crate::commands::requests_table(team)?,
        "/inbox" => {
            let waiting: Vec<Message> = lead
                .unseen()
                .iter()
                .cloned()
                .chain(troupe::inbox::Inbox::new(team, &AgentName::lead()).peek()?)
                .collect();
            if waiting.is_empty() {
                println!("(no unread messages)");
            }
            for m in &waiting {
                println!("{}", term_text::lines(&render_message(m)));
            }
        }
        cmd if cmd.starts_with('/') => {
            println!("unknown command {}; /help lists them", term_text::line(cmd))
        }
        text => {
            lead.say(text)?;
            match lead.turn(&mut |s| match s {
                Shown::Text(t) => println!("lead: {}", term_text::lines(t.trim_end())),
                Shown::Inbox(batch) => {
                    for m in batch {
                        println!("[inbox] {}", term_text::lines(&render_message(m)));
                    }
                }
                Shown::Tool {
                    name,
                    input,
                    output,
                } => println!("  {}", describe_tool(name, input, output)),
            })? {
                TurnEnd::Done => {}
                TurnEnd::Interrupted => return Ok(Step::Interrupted),
                TurnEnd::Llm(e) => {
                    eprintln!("lead: {}", term_text::lines(&e.to_string()));
                    if e.exit_code() == 78 {
                        return Ok(Step::Failed(78));
                    }
                }
            }
        }
    }
    Ok(Step::Next)
}
