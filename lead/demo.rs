//! `lead demo`: a whole team on a fresh temporary team dir, on the cassette shipped in the
//! repository (`scripts/demo.cassette.jsonl`, embedded in the binary), with no network and no
//! API key; or, with `--live`, the same scenario against the configured provider.
//!
//! The scenario: the LLM lead spawns a coder (who must have a plan approved) and a tester; the
//! coder's first plan is rejected with feedback and its second approved; the coder writes a
//! file and tells the tester, who reads it and reports to the lead; the lead shuts both down
//! (the tester refuses once). The demo prints a timeline as it happens, built from
//! `events.jsonl` plus the lead's own words, then the status table.
//!
//! The cassette is replayed in its recorded global order (`TROUPE_REPLAY_PROGRESS`): each
//! process waits for the calls that came before its next one, so the three processes meet the
//! same inbox contents every run whatever the scheduler does.
//!
//! `--story board` runs the second story instead, a task board worked by two teammates and
//! checked by a hook (see [`crate::demo_board`]); it shares the set-up and the timeline here.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};
use troupe::{eprintln, println};

use anyhow::Context;
use serde_json::Value;
use troupe::agent::lead::{Lead, LeadSettings, Shown};
use troupe::config::{Member, MemberStatus, Roster};
use troupe::events;
use troupe::requests::RequestStore;
use troupe::sandbox::Sandbox;
use troupe::{TeamDir, fsutil};

use crate::chat::{self, EnvOverlay, OwnSupervisor};
use troupe::wait::Signals;

/// The cassette the demo replays.
const CASSETTE: &str = include_str!("../scripts/demo.cassette.jsonl");

/// What the person asks the lead.
pub const PROMPT: &str = "Build fizzbuzz.py with a small team. Spawn a coder, who must get a \
plan approved before writing anything, and a tester. Review the coder's plan: the tester needs \
a function it can check, not just a script. When the tester has checked the file and reported \
to you, shut the team down.";

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Which story: `fizzbuzz`, an LLM lead building a file with a coder and a tester (plan
    /// approval, messages, shutdowns); or `board`, two auto-claiming teammates working a task
    /// board with a blocked task and a task_completed hook that sends one completion back.
    #[arg(long, value_enum, default_value_t = Story::Fizzbuzz)]
    pub story: Story,
    /// Run the scenario against the configured provider (ANTHROPIC_API_KEY, OPENAI_API_KEY or
    /// OPENAI_BASE_URL, MODEL_ID) instead of the shipped cassette.
    #[arg(long)]
    pub live: bool,
    /// Directory to run in (default: a new directory under the system temp dir). Kept
    /// afterwards for inspection.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    /// Milliseconds each replayed model call "thinks", so the timeline unfolds at a readable
    /// pace (0 for as fast as possible).
    #[arg(long, default_value_t = 100)]
    pub pace_ms: u64,
    #[command(flatten)]
    pub sandbox: troupe::sandbox::Settings,
}

/// The demo's stories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Story {
    /// The LLM lead, a coder with plan approval and a tester build fizzbuzz.py.
    Fizzbuzz,
    /// A task board: two auto-claimers, a blocked task, a hook that sends a completion back.
    Board,
}

/// A fresh demo directory with its team dir and working dir, and the environment that points
/// the processes started from here at the story's cassette.
pub struct Setup {
    pub dir: PathBuf,
    pub team: TeamDir,
    pub workdir: PathBuf,
    pub env: EnvOverlay,
}

impl Setup {
    /// Creates the directories (refusing one that already holds a team) and, unless `--live`,
    /// writes `cassette` there as `file` and sets the replay up in the environment overlay.
    pub fn new(a: &DemoArgs, file: &str, cassette: &str) -> anyhow::Result<Setup> {
        let dir = match &a.dir {
            Some(d) => d.clone(),
            None => std::env::temp_dir().join(format!(
                "troupe-demo-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            )),
        };
        fsutil::create_dir(&dir)?;
        let dir = dir
            .canonicalize()
            .with_context(|| format!("failed to resolve {}", dir.display()))?;
        let team = TeamDir::create(dir.join(".team"))?;
        let workdir = dir.join("work");
        fsutil::create_dir(&workdir)?;
        if !Roster::new(&team).load()?.members.is_empty() {
            anyhow::bail!(
                "{} already holds a team; give the demo a new directory",
                dir.display()
            );
        }
        let mut env = EnvOverlay::default();
        if !a.live {
            let path = dir.join(file);
            std::fs::write(&path, cassette)
                .with_context(|| format!("failed to write {}", path.display()))?;
            let progress = dir.join("replay.progress");
            // A rerun in the same --dir starts the replay from the beginning.
            let _ = std::fs::remove_file(&progress);
            env.0 = vec![
                ("TROUPE_PROVIDER".into(), "replay".into()),
                ("TROUPE_CASSETTE".into(), path.display().to_string()),
                (
                    "TROUPE_REPLAY_PROGRESS".into(),
                    progress.display().to_string(),
                ),
                ("TROUPE_RECORD".into(), String::new()),
                ("TROUPE_REPLAY_PACE_MS".into(), a.pace_ms.to_string()),
            ];
        }
        Ok(Setup {
            dir,
            team,
            workdir,
            env,
        })
    }

    /// The first line of the demo's output.
    pub fn announce(&self, live: bool) {
        println!(
            "troupe demo ({}): team dir {}, working dir {}",
            if live {
                "live provider"
            } else {
                "replaying the shipped cassette, no network"
            },
            self.team.root().display(),
            self.workdir.display()
        );
    }
}

pub fn run(a: DemoArgs) -> anyhow::Result<u8> {
    if a.story == Story::Board {
        return crate::demo_board::run(a);
    }
    let setup = Setup::new(&a, "demo.cassette.jsonl", CASSETTE)?;
    let provider = match setup.env.provider() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("lead: {e}");
            return Ok(e.exit_code());
        }
    };
    setup.announce(a.live);
    let Setup {
        dir,
        team,
        workdir,
        env,
    } = setup;
    println!("the person asks the lead: {PROMPT}\n");
    let started = Instant::now();
    let signals = Signals::install().context("failed to install signal handlers")?;
    let settings = LeadSettings {
        team: team.clone(),
        workdir: workdir.clone(),
        model: String::new(),
        max_calls: 20,
        context_tokens: None,
        max_tokens: 4096,
        bash_timeout: Duration::from_secs(120),
        sandbox: Arc::new(Sandbox::prepare(
            &a.sandbox,
            &workdir,
            team.root(),
            "lead",
            None,
        )),
        prices: Arc::new(troupe::cost::PriceTable::load(None)?),
    };
    let mut lead = Lead::open(settings, provider, signals.term.clone())?;
    let own = OwnSupervisor::start_if_needed(&team, &workdir, &a.sandbox, &env)?;
    let stop = Arc::new(AtomicBool::new(false));
    let (said, heard) = mpsc::channel::<Line>();
    let tail = {
        let (team, stop) = (team.clone(), stop.clone());
        let t0 = fsutil::now();
        std::thread::spawn(move || follow(&team, t0, &heard, &stop, &event_line))
    };
    let result = chat::unattended(&mut lead, PROMPT, &signals, &mut |s| match s {
        Shown::Text(text) => {
            let _ = said.send(Line {
                ts: fsutil::now(),
                who: "lead".into(),
                text: format!("says: {}", text.trim()),
            });
        }
        // Arrivals and tool calls are in events.jsonl, which `follow` prints.
        Shown::Inbox(_) | Shown::Tool { .. } => {}
    });
    if let Some(own) = own {
        own.stop()?;
    }
    stop.store(true, Ordering::SeqCst);
    let _ = tail.join();
    let code = result?;
    println!();
    crate::commands::status_table(&team)?;
    let cfg = Roster::new(&team).load()?;
    let usage = lead.usage();
    println!(
        "\nlead: {} model calls, {} input and {} output tokens, {} cache read, {}; files in {}",
        cfg.lead_spend.map_or(0, |s| s.calls),
        usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens,
        usage.output_tokens,
        troupe::cost::cache_read_share(&usage)
            .map_or("-".to_owned(), |s| format!("{:.0}%", s * 100.0)),
        troupe::cost::usd(lead.cost_usd()),
        dir.display()
    );
    if code != 0 {
        return Ok(code);
    }
    if cfg.members.is_empty() {
        eprintln!("lead: the demo ended without any teammate");
        return Ok(1);
    }
    if let Some(what) = unfinished(&cfg.members) {
        eprintln!("lead: the demo did not end with every teammate shut down ({what})");
        return Ok(1);
    }
    println!("demo complete in {:.1} s", started.elapsed().as_secs_f64());
    Ok(0)
}

/// Who did not end `shutdown`, for the demo's last line: failed members with their reason,
/// then the others as still up; `None` if every member shut down.
pub fn unfinished(members: &[Member]) -> Option<String> {
    let (failed, up): (Vec<&Member>, Vec<&Member>) = members
        .iter()
        .filter(|m| m.status != MemberStatus::Shutdown)
        .partition(|m| m.status == MemberStatus::Failed);
    let mut parts = Vec::new();
    if !failed.is_empty() {
        let named: Vec<String> = failed
            .iter()
            .map(|m| match &m.reason {
                Some(why) => format!("{} ({why})", m.name),
                None => m.name.clone(),
            })
            .collect();
        parts.push(format!("failed: {}", named.join(", ")));
    }
    if !up.is_empty() {
        let named: Vec<&str> = up.iter().map(|m| m.name.as_str()).collect();
        parts.push(format!("still up: {}", named.join(", ")));
    }
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// One timeline line.
pub struct Line {
    pub ts: f64,
    pub who: String,
    pub text: String,
}

/// How one event shows in a timeline: who did it and what (without the time), or `None` for
/// events the timeline leaves out.
pub type Describe<'a> = dyn Fn(&Value, &RequestStore) -> Option<(String, String)> + 'a;

/// The first story's timeline line for an event: the actor is the event's `name` or `from`,
/// else the lead.
pub fn event_line(e: &Value, requests: &RequestStore) -> Option<(String, String)> {
    let text = describe(e, requests)?;
    let who = e
        .get("name")
        .or_else(|| e.get("from"))
        .and_then(Value::as_str)
        .unwrap_or("lead");
    Some((who.to_owned(), text))
}

/// How long a line is held back so that lines from the two sources (events.jsonl, read every
/// 20 ms, and the lead's words) print in time order.
const REORDER: f64 = 0.15;

/// Prints `events.jsonl` (each event as `describe` tells) and the lead's words as one
/// timeline, in time order, while the log grows, until `stop` (then everything left).
pub fn follow(
    team: &TeamDir,
    t0: f64,
    said: &mpsc::Receiver<Line>,
    stop: &AtomicBool,
    describe: &Describe<'_>,
) {
    let requests = RequestStore::new(team);
    let mut offset = 0;
    let mut held: Vec<Line> = Vec::new();
    loop {
        let last = stop.load(Ordering::SeqCst);
        held.extend(said.try_iter());
        match events::read_from(team, offset) {
            Ok((evs, next)) => {
                offset = next;
                for e in &evs {
                    if let Some((who, text)) = describe(e, &requests) {
                        held.push(Line {
                            ts: e.get("ts").and_then(Value::as_f64).unwrap_or(t0),
                            who,
                            text,
                        });
                    }
                }
            }
            Err(e) => eprintln!("lead: failed to read events: {e}"),
        }
        held.sort_by(|a, b| a.ts.total_cmp(&b.ts));
        let horizon = if last {
            f64::INFINITY
        } else {
            fsutil::now() - REORDER
        };
        let ready = held.iter().take_while(|l| l.ts <= horizon).count();
        for l in held.drain(..ready) {
            let mut lines = l.text.lines();
            let first = lines.next().unwrap_or("");
            println!("{:7.2}s  {:<9} {first}", (l.ts - t0).max(0.0), l.who);
            for more in lines {
                println!("{:19} {more}", "");
            }
        }
        if last {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One event as a timeline line (without time and actor), or `None` for events the timeline
/// leaves out because another line already says it.
pub fn describe(e: &Value, requests: &RequestStore) -> Option<String> {
    let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_owned();
    let rid = s("request_id");
    let request = || requests.get(&rid).ok();
    Some(match s("event").as_str() {
        "lead_started" => format!("supervisor up (pid {})", e.get("pid")?),
        "spawn_requested" => format!(
            "asked for by the lead as {}{}",
            s("role"),
            if e.get("require_plan_approval") == Some(&Value::Bool(true)) {
                ", plan approval required"
            } else {
                ""
            }
        ),
        "spawn" => format!(
            "process started: pid {}, incarnation {}",
            e.get("pid")?,
            e.get("incarnation")?
        ),
        "message" => format!("-> {}: {}", s("to"), chat::one_line(&s("text"), 100)),
        "plan_submitted" => {
            let plan = request()
                .and_then(|r| {
                    r.payload
                        .get("plan")
                        .and_then(Value::as_str)
                        .map(str::to_owned)
                })
                .unwrap_or_default();
            format!("submits plan {rid}: {}", chat::one_line(&plan, 100))
        }
        "plan_rejected" | "plan_approved" => format!(
            "<- lead {} plan {rid}: {}",
            if s("event") == "plan_approved" {
                "APPROVES"
            } else {
                "REJECTS"
            },
            chat::one_line(&s("feedback"), 100)
        ),
        "tool" => match s("tool").as_str() {
            t @ ("bash" | "read_file" | "write_file" | "edit_file") => format!(
                "{t} {}{}",
                s("detail"),
                if e.get("ok") == Some(&Value::Bool(false)) {
                    " (failed)"
                } else {
                    ""
                }
            ),
            _ => return None,
        },
        "shutdown_requested" => format!("<- lead asks it to shut down (request {rid})"),
        "shutdown_response" => {
            let reason = request()
                .and_then(|r| r.response_text().map(str::to_owned))
                .unwrap_or_default();
            format!(
                "{} shutdown {rid}{}",
                if e.get("approve") == Some(&Value::Bool(true)) {
                    "APPROVES"
                } else {
                    "REJECTS"
                },
                if reason.is_empty() {
                    String::new()
                } else {
                    format!(": {}", chat::one_line(&reason, 100))
                }
            )
        }
        "exit" => match (e.get("code").and_then(Value::as_i64), e.get("signal")) {
            (Some(c), _) => format!("process exited with code {c}"),
            (None, Some(sig)) => format!("process killed by signal {sig}"),
            _ => "process exited".into(),
        },
        "restart_scheduled" => format!("restart in {} s", e.get("in_secs")?),
        "failed" => format!("FAILED: {}", s("reason")),
        "shutdown_escalated" => format!("shutdown {rid} expired: escalating"),
        "team_stop" => "supervisor stops the team".into(),
        "lead_stopped" => "supervisor stopped".into(),
        // Which worker program runs is for the log; a stale one is warned about on stderr.
        "shutdown_approved" | "reconcile" | "worker_exe" => return None,
        other => other.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(name: &str, status: MemberStatus, reason: Option<&str>) -> Member {
        let mut m = Member::new(name, "coder");
        m.status = status;
        m.reason = reason.map(str::to_owned);
        m
    }

    #[test]
    fn the_last_line_names_failed_members_with_their_reason_apart_from_the_others() {
        let done = member("coder", MemberStatus::Shutdown, None);
        assert_eq!(unfinished(std::slice::from_ref(&done)), None);
        let failed = member(
            "coder",
            MemberStatus::Failed,
            Some("failed to start /x/worker: No such file or directory"),
        );
        let up = member("tester", MemberStatus::Stopped, None);
        assert_eq!(
            unfinished(&[failed.clone(), up.clone()]).as_deref(),
            Some(
                "failed: coder (failed to start /x/worker: No such file or directory); \
                 still up: tester"
            )
        );
        assert_eq!(
            unfinished(&[failed, done.clone()]).as_deref(),
            Some("failed: coder (failed to start /x/worker: No such file or directory)")
        );
        assert_eq!(unfinished(&[done, up]).as_deref(), Some("still up: tester"));
    }
}
