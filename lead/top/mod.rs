//! `lead top`: a full-screen live view of the team (ratatui on crossterm), for a terminal,
//! over ssh or in tmux. A row per member (state and liveness apart, what it does now and for
//! how long, how long it has been silent, tokens, cost, cache share, inbox, pending requests,
//! host and branch), a header with the team's cost, calls in flight, the rate-limit state,
//! tasks by status and the lints counted, and keys to look closer and to act: `Enter` a
//! member's transcript tail and log, `m` message it, `a`/`r` approve or reject its plan, `s`
//! ask it to shut down, `t` the board, `q` quit.
//!
//! The view is read again when the store's change feed says the roster, requests or tasks
//! changed (within 200 ms) and every second for ages and clocks: the last events from where the
//! last look ended ([`frame::Tail`]), and of the requests, tasks and merge entries only those
//! that changed ([`frame::Lists`]). The terminal is restored on
//! every way out: `q`, Ctrl-C, SIGTERM, SIGHUP, a panic; Ctrl-Z suspends (the terminal given
//! back) and `fg` resumes. `lead top --once --json` prints one frame as JSON instead.

mod draw;
pub mod frame;

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ratatui::crossterm::event::{self, Event, KeyCode, KeyEvent, KeyEventKind, KeyModifiers};
use ratatui::crossterm::{cursor, execute, terminal};
use troupe::TeamDir;
use troupe::store::Watched;

#[derive(Debug, clap::Args)]
pub struct TopArgs {
    /// Print one frame and exit (with --json: as JSON, for scripts).
    #[arg(long)]
    once: bool,
    /// With --once: the frame as JSON.
    #[arg(long, requires = "once")]
    json: bool,
}

pub fn top(team: &TeamDir, a: TopArgs) -> anyhow::Result<u8> {
    if a.once {
        let mut tail = frame::Tail::default();
        tail.refresh(team);
        let f = frame::gather(team, tail.as_slice(), &mut frame::Lists::default())?;
        if a.json {
            println!("{}", serde_json::to_string(&f)?);
        } else {
            print!("{}", draw::plain(&f));
        }
        return Ok(0);
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [libc::SIGTERM, libc::SIGHUP, libc::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        restore();
        previous(info);
    }));
    enter()?;
    let out = run(team, &stop);
    restore();
    out
}

/// Takes the terminal: raw mode, the alternate screen, no cursor.
fn enter() -> anyhow::Result<()> {
    terminal::enable_raw_mode()?;
    execute!(
        std::io::stdout(),
        terminal::EnterAlternateScreen,
        cursor::Hide
    )?;
    Ok(())
}

/// Gives the terminal back as it was (safe to call twice).
fn restore() {
    let _ = terminal::disable_raw_mode();
    let _ = execute!(
        std::io::stdout(),
        terminal::LeaveAlternateScreen,
        cursor::Show
    );
    let _ = std::io::stdout().flush();
}

/// What the view shows besides the table.
#[derive(Debug, Clone, PartialEq)]
pub enum Pane {
    Table,
    /// A member's transcript tail and log.
    Member(String),
    Board,
}

/// A line being typed at the bottom.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub label: String,
    pub text: String,
    pub then: Then,
}

#[derive(Debug, Clone)]
pub enum Then {
    Message(String),
    Reject(String),
}

/// The view's state between frames.
pub struct View {
    pub frame: frame::Frame,
    pub selected: usize,
    pub pane: Pane,
    pub prompt: Option<Prompt>,
    /// The last action's outcome, shown on the status line.
    pub note: String,
}

fn run(team: &TeamDir, stop: &AtomicBool) -> anyhow::Result<u8> {
    let backend = ratatui::backend::CrosstermBackend::new(std::io::stdout());
    let mut term = ratatui::Terminal::new(backend)?;
    let watch = team
        .store()
        .watch(&[Watched::Roster, Watched::Requests, Watched::Tasks])
        .ok();
    let mut tail = frame::Tail::default();
    tail.refresh(team);
    let mut lists = frame::Lists::default();
    let mut view = View {
        frame: frame::gather(team, tail.as_slice(), &mut lists)?,
        selected: 0,
        pane: Pane::Table,
        prompt: None,
        note: String::new(),
    };
    let mut read_at = Instant::now();
    let mut dirty = true;
    let mut maybe_buffered = false;
    loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(0);
        }
        let changed = watch.as_ref().is_some_and(|w| w.changed());
        if changed || read_at.elapsed() >= Duration::from_secs(1) {
            tail.refresh(team);
            match frame::gather(team, tail.as_slice(), &mut lists) {
                Ok(f) => view.frame = f,
                Err(e) => view.note = format!("could not read the team: {e}"),
            }
            read_at = Instant::now();
            dirty = true;
        }
        if dirty {
            let n = view.frame.rows.len();
            view.selected = view.selected.min(n.saturating_sub(1));
            term.draw(|f| draw::draw(f, team, &view))?;
            dirty = false;
        }
        // The terminal is looked at here before crossterm is asked: once it has hung up (an ssh
        // session gone, the tmux server killed) crossterm's poll reads 0 bytes again and again
        // and never returns, so neither a signal nor the clock would end the view.
        match terminal_input(if maybe_buffered {
            Duration::ZERO
        } else {
            Duration::from_millis(200)
        }) {
            Input::HungUp => return Ok(0),
            Input::Quiet if !maybe_buffered => continue,
            _ => {}
        }
        if !event::poll(Duration::ZERO)? {
            maybe_buffered = false;
            continue;
        }
        // One read can parse several events (a paste): the rest wait in crossterm's buffer.
        maybe_buffered = true;
        match event::read()? {
            Event::Key(k) if k.kind != KeyEventKind::Release => {
                dirty = true;
                if k.modifiers.contains(KeyModifiers::CONTROL) {
                    match k.code {
                        KeyCode::Char('c') => return Ok(0),
                        KeyCode::Char('z') => {
                            suspend()?;
                            term.clear()?;
                            continue;
                        }
                        _ => {}
                    }
                }
                if let Some(p) = view.prompt.as_mut() {
                    match k.code {
                        KeyCode::Esc => view.prompt = None,
                        KeyCode::Enter => {
                            let p = view.prompt.take().expect("a prompt");
                            view.note = act_on(team, &p);
                            read_at = Instant::now() - Duration::from_secs(2);
                        }
                        KeyCode::Backspace => {
                            p.text.pop();
                        }
                        KeyCode::Char(c) => p.text.push(c),
                        _ => {}
                    }
                    continue;
                }
                if key(team, &mut view, k) {
                    return Ok(0);
                }
                read_at = Instant::now() - Duration::from_secs(2);
            }
            Event::Resize(..) => dirty = true,
            _ => {}
        }
    }
}

/// What the terminal has for us.
enum Input {
    /// Something to read (or the wait was cut short by a signal).
    Ready,
    Quiet,
    /// It hung up, or is no terminal to poll any more.
    HungUp,
}

/// Waits up to `timeout` for input on stdin, the terminal crossterm reads.
fn terminal_input(timeout: Duration) -> Input {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsFd;
    let stdin = std::io::stdin();
    let mut fds = [PollFd::new(stdin.as_fd(), PollFlags::POLLIN)];
    let ms =
        PollTimeout::try_from(timeout.as_millis().min(1000) as i32).unwrap_or(PollTimeout::MAX);
    match poll(&mut fds, ms) {
        Ok(0) => Input::Quiet,
        Ok(_) => {
            let got = fds[0].revents().unwrap_or(PollFlags::empty());
            if got.intersects(PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL) {
                Input::HungUp
            } else {
                Input::Ready
            }
        }
        Err(nix::errno::Errno::EINTR) => Input::Ready,
        Err(_) => Input::HungUp,
    }
}

/// Gives the terminal back and stops this process (as Ctrl-Z would in a cooked terminal);
/// takes it again when continued.
fn suspend() -> anyhow::Result<()> {
    restore();
    // SAFETY: raise has no memory-safety preconditions.
    unsafe { libc::raise(libc::SIGTSTP) };
    enter()
}

/// Handles a key in the table or a pane; true to quit.
fn key(team: &TeamDir, view: &mut View, k: KeyEvent) -> bool {
    let selected = view.frame.rows.get(view.selected).map(|r| r.name.clone());
    match (k.code, &view.pane) {
        (KeyCode::Char('q'), Pane::Table) => return true,
        (KeyCode::Char('q') | KeyCode::Esc | KeyCode::Enter, Pane::Member(_) | Pane::Board) => {
            view.pane = Pane::Table;
        }
        (KeyCode::Up | KeyCode::Char('k'), _) => view.selected = view.selected.saturating_sub(1),
        (KeyCode::Down | KeyCode::Char('j'), _) => {
            view.selected = (view.selected + 1).min(view.frame.rows.len().saturating_sub(1));
        }
        (KeyCode::Enter, Pane::Table) => {
            if let Some(n) = selected {
                view.pane = Pane::Member(n);
            }
        }
        (KeyCode::Char('t'), _) => view.pane = Pane::Board,
        (KeyCode::Char('m'), _) => {
            if let Some(n) = selected {
                view.prompt = Some(Prompt {
                    label: format!("message to {n}: "),
                    text: String::new(),
                    then: Then::Message(n),
                });
            }
        }
        (KeyCode::Char('a'), _) => {
            if let Some(n) = selected {
                view.note = match pending_plan(team, &n) {
                    Some(id) => match troupe::ops::decide_plan(team, &id, true, "") {
                        Ok(_) => format!("approved {n}'s plan {id}"),
                        Err(e) => format!("{e}"),
                    },
                    None => format!("{n} has no plan waiting"),
                };
            }
        }
        (KeyCode::Char('r'), _) => {
            if let Some(n) = selected {
                view.prompt = Some(Prompt {
                    label: format!("feedback rejecting {n}'s plan: "),
                    text: String::new(),
                    then: Then::Reject(n),
                });
            }
        }
        (KeyCode::Char('s'), _) => {
            if let Some(n) = selected {
                view.note = match troupe::ops::request_shutdown(
                    team,
                    &n,
                    "asked from lead top",
                    Duration::from_secs(30),
                ) {
                    Ok(r) => format!("asked {n} to shut down ({})", r.request_id),
                    Err(e) => format!("{e}"),
                };
            }
        }
        _ => {}
    }
    false
}

/// Carries out what a prompt was for, saying how it went.
fn act_on(team: &TeamDir, p: &Prompt) -> String {
    match &p.then {
        Then::Message(to) => match troupe::ops::send(team, to, &p.text) {
            Ok(id) => format!("sent to {to} ({id})"),
            Err(e) => format!("{e}"),
        },
        Then::Reject(who) => match pending_plan(team, who) {
            Some(id) => match troupe::ops::decide_plan(team, &id, false, &p.text) {
                Ok(_) => format!("rejected {who}'s plan {id}"),
                Err(e) => format!("{e}"),
            },
            None => format!("{who} has no plan waiting"),
        },
    }
}

/// The oldest pending plan approval `who` asked for.
fn pending_plan(team: &TeamDir, who: &str) -> Option<String> {
    troupe::requests::RequestStore::new(team)
        .list(Some(troupe::requests::RequestStatus::Pending))
        .ok()?
        .into_iter()
        .filter(|r| r.kind == troupe::requests::RequestKind::PlanApproval && r.from == who)
        .min_by(|a, b| a.created_at.total_cmp(&b.created_at))
        .map(|r| r.request_id)
}
