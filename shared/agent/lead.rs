//! The LLM lead: the agent behind `lead chat` and `lead demo`.
//!
//! It is an agent like a teammate (journal in `transcripts/lead.jsonl`, conversation rebuilt
//! from it, inbox drained into it before every model call and shown as one `<inbox>` turn), with
//! the management tools of DESIGN.md section 10 instead of the protocol answers: it spawns
//! teammates, messages them, reviews their plans and asks them to shut down. Every tool goes
//! through [`crate::ops`], the same code the scripting CLI uses, so the rules (who may do what,
//! which state may move) live in one place, and a refusal comes back to the model as an error
//! result it can read.
//!
//! The caller drives it: [`Lead::say`] records what the person said, [`Lead::turn`] runs model
//! calls and tools until the model ends its turn, and [`Lead::next_wake`] tells an unattended
//! caller (`chat -p`, the demo) whether the team still owes the lead something.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::Value;

use crate::agent::compaction;
use crate::agent::conversation::{self, Rebuilt};
use crate::agent::outage::{self, OnFailure};
use crate::config::{MemberStatus, Roster};
use crate::error::{Error, Result};
use crate::events;
use crate::fsutil::{self, HeldLock};
use crate::inbox::{Durability, Inbox};
use crate::llm::{Block, ChatRequest, LlmError, Provider, Role, StopReason, Usage};
use crate::mail::{self, Stopped};
use crate::message::{Message, MessageType};
use crate::ops::{self, SpawnSpec};
use crate::requests::{Request, RequestKind, RequestStatus, RequestStore};
use crate::teamdir::{AgentName, LEAD, TeamDir};
use crate::tools::{self, ToolOutput};
use crate::transcript::{Entry, Journal};

/// Settings of the LLM lead.
#[derive(Debug, Clone)]
pub struct LeadSettings {
    pub team: TeamDir,
    /// Where the file tools and `bash` work (the team's working directory).
    pub workdir: PathBuf,
    /// Model id; empty for the provider's default (`MODEL_ID`).
    pub model: String,
    /// Model calls allowed per turn.
    pub max_calls: u64,
    /// Bound on the characters of conversation sent per call.
    /// The model's context size in tokens (`None`: the default of its family).
    pub context_tokens: Option<u64>,
    pub max_tokens: u32,
    pub bash_timeout: Duration,
    /// The sandbox of its `bash` commands.
    pub sandbox: std::sync::Arc<crate::sandbox::Sandbox>,
    /// What its calls cost (recorded as `lead_spend` in config.json; see [`crate::cost`]).
    pub prices: Arc<crate::cost::PriceTable>,
}

/// What the lead did, for whoever shows it (the REPL, the demo timeline).
#[derive(Debug)]
pub enum Shown<'a> {
    /// Messages drained from the inbox, about to be shown to the model.
    Inbox(&'a [Message]),
    /// Text the model wrote.
    Text(&'a str),
    /// A tool call and its result.
    Tool {
        name: &'a str,
        input: &'a Value,
        output: &'a ToolOutput,
    },
}

/// How a turn ended.
#[derive(Debug)]
pub enum TurnEnd {
    /// The model ended its turn (or the call budget ran out).
    Done,
    /// SIGTERM/SIGINT: the current step was finished and journaled.
    Interrupted,
    /// The model provider failed for good.
    Llm(LlmError),
}

/// What an unattended lead should do next; see [`Lead::next_wake`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Messages wait that the model should see now.
    Turn,
    /// The team is still working or owes an answer: wait for the inbox.
    Wait,
    /// Nobody is working, nothing is pending and the inbox is empty: the job is over.
    Done,
}

/// The LLM lead of one team directory.
pub struct Lead {
    s: LeadSettings,
    provider: Box<dyn Provider>,
    journal: Journal,
    conv: Rebuilt,
    inbox: Inbox,
    roster: Roster,
    requests: RequestStore,
    term: Arc<AtomicBool>,
    usage: Usage,
    /// What this session's calls cost, in US dollars.
    cost_usd: f64,
    /// The turn under way, as exported (a no-op when nothing is).
    span: crate::telemetry::Activation,
    /// `transcripts/lead.lock`: one LLM lead per team dir.
    _alive: HeldLock,
    /// On a bus, the lease of the lead's inbox: one consumer per team, whatever the host.
    _consumer: crate::fence::LeadInboxConsumer,
}

impl Lead {
    /// Takes the lead's journal (refusing if another `lead chat` holds it), rebuilds the
    /// conversation from it and records the new session.
    pub fn open(
        s: LeadSettings,
        provider: Box<dyn Provider>,
        term: Arc<AtomicBool>,
    ) -> Result<Lead> {
        let name = AgentName::lead();
        fsutil::create_dir(&s.team.transcripts_dir())?;
        let lock_path = s.team.transcript_lock(&name);
        let Some(alive) = HeldLock::try_acquire_settled(&lock_path)? else {
            return Err(Error::Locked {
                what: "the lead's transcript (another `lead chat` runs on this team dir)",
                path: lock_path,
            });
        };
        let consumer = crate::fence::LeadInboxConsumer::take(&s.team)?;
        let (journal, conv) = conversation::resume(&s.team, &name, 0, &alive)?;
        let sandbox = s.sandbox.status().clone();
        if let Err(e) = Roster::new(&s.team).update(|c| {
            c.lead_sandbox = Some(sandbox);
            Ok(())
        }) {
            tracing::warn!("could not record the lead's sandbox in config.json: {e}");
        }
        Ok(Lead {
            inbox: Inbox::new(&s.team, &name),
            roster: Roster::new(&s.team),
            requests: RequestStore::new(&s.team),
            s,
            provider,
            journal,
            conv,
            term,
            usage: Usage::default(),
            cost_usd: 0.0,
            span: crate::telemetry::Activation::none(),
            _alive: alive,
            _consumer: consumer,
        })
    }

    /// The lead's inbox (for waiting on it).
    pub fn inbox(&self) -> &Inbox {
        &self.inbox
    }

    /// Token counts of this session's model calls.
    pub fn usage(&self) -> Usage {
        self.usage
    }

    /// What this session's model calls cost, in US dollars.
    pub fn cost_usd(&self) -> f64 {
        self.cost_usd
    }

    /// Records one call's usage and cost as the lead's (`lead_spend` in config.json, which
    /// counts toward the team budget); a call that takes the team over its budget wakes the
    /// teammates, which then stop by code.
    fn account(&mut self, response: &crate::llm::ChatResponse) {
        let usage = response.usage;
        self.usage.add(&usage);
        let model = if !response.model.is_empty() {
            response.model.clone()
        } else if !self.s.model.is_empty() {
            self.s.model.clone()
        } else {
            std::env::var("MODEL_ID").unwrap_or_default()
        };
        let cost = self.s.prices.cost(&model, &usage);
        self.cost_usd += cost;
        match self.roster.update(|c| {
            c.lead_spend
                .get_or_insert_with(Default::default)
                .add_call(&usage, cost);
            Ok(c.clone())
        }) {
            Ok(cfg) => {
                if crate::cost::team_over_budget(&cfg).is_some() {
                    crate::cost::wake_team(&self.s.team, &cfg, None);
                }
            }
            Err(e) => tracing::warn!("could not record the lead's usage in config.json: {e}"),
        }
    }

    /// Records what the person said; the next [`Lead::turn`] shows it to the model.
    pub fn say(&mut self, text: &str) -> Result<()> {
        let entry = Entry::User {
            text: text.to_owned(),
            at: fsutil::now(),
        };
        self.journal.append(std::slice::from_ref(&entry))?;
        self.conv.push_entry(&entry);
        Ok(())
    }

    /// Sleeps `d` unless SIGTERM/SIGINT comes first; returns whether it slept the whole time.
    fn sleep(&self, d: Duration) -> bool {
        let until = std::time::Instant::now() + d;
        while std::time::Instant::now() < until {
            if self.term.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20).min(d));
        }
        !self.term.load(Ordering::SeqCst)
    }

    /// Runs model calls and tools until the model ends its turn. Before each call the inbox is
    /// drained (journaled first) and its new messages join the next user turn.
    pub fn turn(&mut self, show: &mut dyn FnMut(Shown<'_>)) -> Result<TurnEnd> {
        // A turn is the lead's activation, exported as a trace of its own when traces are.
        self.span = crate::telemetry::Activation::woken_by(&self.conv.unseen);
        let out = self.turn_steps(show);
        std::mem::replace(&mut self.span, crate::telemetry::Activation::none()).end(fsutil::now());
        out
    }

    fn turn_steps(&mut self, show: &mut dyn FnMut(Shown<'_>)) -> Result<TurnEnd> {
        for _ in 0..self.s.max_calls {
            if self.term.load(Ordering::SeqCst) {
                return Ok(TurnEnd::Interrupted);
            }
            let batch = self.drain_now()?;
            if !batch.is_empty() {
                show(Shown::Inbox(&batch));
            }
            self.conv.flush_unseen();
            match self.conv.messages.last() {
                Some(last) if last.role == Role::User => {}
                // Nothing new since the model's last answer.
                _ => break,
            }
            let ctx = self
                .s
                .context_tokens
                .unwrap_or_else(|| compaction::default_context_tokens(&self.s.model));
            if let Err(e) = self.compact_if_needed(ctx)? {
                return Ok(TurnEnd::Llm(e));
            }
            // Compaction keeps the prompt inside the context; a last turn whose tool results
            // are too many together is cut to fit, as a teammate's is; the bound is the last
            // resort.
            let system = self.system_prompt();
            let specs = tools::lead_specs();
            let messages = compaction::fit_last_turn(&self.conv.messages, &system, &specs, ctx);
            let req = ChatRequest {
                model: self.s.model.clone(),
                system,
                messages: conversation::bound(
                    &messages,
                    (ctx * compaction::BYTES_PER_TOKEN) as usize,
                ),
                tools: specs,
                max_tokens: self.s.max_tokens,
                agent: LEAD.to_owned(),
                seq: self.conv.calls,
            };
            // An outage is waited out, as a teammate does (see `outage`); a person at the
            // terminal sees why. Anything else ends the turn with the error.
            let mut waited = None;
            let started_at = fsutil::now();
            crate::llm::gate::take_waited();
            let response = loop {
                match self.provider.complete(&req) {
                    Ok(r) => break r,
                    Err(e) if outage::on_failure(&e) == OnFailure::Wait => {
                        let max = outage::max_wait_from_env();
                        let d = outage::next_wait(
                            waited,
                            outage::first_wait(max),
                            max,
                            crate::llm::retry::random_unit(),
                        );
                        waited = Some(d);
                        tracing::warn!("{e}; the lead tries again in {:.1} s", d.as_secs_f64());
                        if !self.sleep(d) {
                            return Ok(TurnEnd::Interrupted);
                        }
                    }
                    Err(e) => return Ok(TurnEnd::Llm(e)),
                }
            };
            self.account(&response);
            let gate_wait = crate::llm::gate::take_waited().as_secs_f64();
            let waited = (gate_wait > 0.0).then_some(gate_wait);
            let ended_at = fsutil::now();
            self.span.model_call(
                started_at,
                ended_at,
                &self.s.model,
                &response.model,
                &response.usage,
                waited,
            );
            let entry = Entry::Assistant {
                seq: self.conv.calls,
                response: response.clone(),
                at: ended_at,
                started_at: Some(started_at),
                waited,
            };
            self.journal.append(std::slice::from_ref(&entry))?;
            self.conv.push_entry(&entry);
            let mut results = Vec::new();
            let mut inbox_ids = Vec::new();
            let mut timings = Vec::new();
            for block in &response.content {
                match block {
                    Block::Text { text } if !text.trim().is_empty() => show(Shown::Text(text)),
                    Block::ToolUse { id, name, input } => {
                        let started_at = fsutil::now();
                        // As a teammate does: a name no tool has is answered here, and recorded
                        // escaped.
                        let checked = tools::check_tool_name(name);
                        let name = &tools::recorded_name(name);
                        let tool_span = self.span.tool(name, id);
                        let output = if let Err(e) = checked {
                            ToolOutput::error(e)
                        } else if response.stop_reason == StopReason::MaxTokens {
                            ToolOutput::cut_short()
                        } else {
                            self.run_tool(name, input, &mut inbox_ids)?
                        };
                        drop(tool_span);
                        timings.push(crate::transcript::ToolTiming {
                            tool_use_id: id.clone(),
                            name: name.clone(),
                            started_at,
                            ended_at: fsutil::now(),
                        });
                        show(Shown::Tool {
                            name,
                            input,
                            output: &output,
                        });
                        results.push(Block::ToolResult {
                            tool_use_id: id.clone(),
                            content: output.content,
                            is_error: output.is_error,
                        });
                    }
                    _ => {}
                }
            }
            if results.is_empty() {
                break;
            }
            let entry = Entry::ToolResults {
                results,
                inbox_ids,
                at: fsutil::now(),
                timings,
            };
            self.journal.append(std::slice::from_ref(&entry))?;
            self.conv.push_entry(&entry);
        }
        Ok(TurnEnd::Done)
    }

    /// Compacts the conversation when its prompt is estimated past
    /// [`compaction::COMPACT_AT`] of the context, as a teammate does: the older turns are
    /// replaced by the lead's own summary, journaled.
    fn compact_if_needed(&mut self, ctx: u64) -> Result<std::result::Result<(), LlmError>> {
        let system = self.system_prompt();
        let specs = tools::lead_specs();
        let before = compaction::estimate(&system, &specs, &self.conv.messages);
        if !compaction::should_compact(before, ctx) {
            return Ok(Ok(()));
        }
        let keep = (ctx as f64 * compaction::KEEP_RECENT) as u64;
        let Some(at) = compaction::cut(&self.conv.messages, keep) else {
            return Ok(Ok(()));
        };
        let req = compaction::summary_call(
            &self.s.model,
            ctx,
            &self.conv.messages[..at],
            self.s.max_tokens,
            LEAD,
            self.conv.compactions,
        );
        let started_at = fsutil::now();
        let response = match self.provider.complete(&req) {
            Ok(r) => r,
            Err(e) => return Ok(Err(e)),
        };
        self.account(&response);
        let reminder = "You are the lead of this team: you spawn teammates, give them work, \
                        answer their plans and shutdowns, and report to the person.";
        let entry = Entry::Compaction {
            summary: compaction::summary_turn(reminder, &compaction::summary_of(&response), at),
            keep_from: at,
            tokens_before: before,
            at: fsutil::now(),
            started_at: Some(started_at),
        };
        self.journal.append(std::slice::from_ref(&entry))?;
        self.conv.push_entry(&entry);
        events::log(
            &self.s.team,
            "compacted",
            serde_json::json!({"name": LEAD, "replaced": at, "tokens_before": before}),
        );
        Ok(Ok(()))
    }

    /// Drains the inbox now (journaled first) without calling the model; the messages join the
    /// next turn. Returns the new ones, for display. The REPL calls this when messages arrive
    /// while the person is at the prompt.
    pub fn drain_now(&mut self) -> Result<Vec<Message>> {
        let batch = self.inbox.drain(&mut self.journal)?;
        for m in &batch {
            self.conv.push_entry(&Entry::Inbox {
                message: m.clone(),
                at: None,
            });
        }
        Ok(batch)
    }

    /// Messages received that the model has not seen yet, oldest first.
    pub fn unseen(&self) -> &[Message] {
        &self.conv.unseen
    }

    /// For an unattended lead, after [`Lead::drain_now`]: take a turn now, wait, or stop.
    ///
    /// Any unseen message other than an `idle_notification` asks for a turn at once (a plan to
    /// review, a report, a shutdown answer). Idle notifications alone do not: while others
    /// still work they would only cost a model call each; once the whole team is quiet (nobody
    /// spawning or working, every live teammate's inbox empty, no shutdown answer outstanding)
    /// they get one turn together, so the lead sees the teammates' final summaries. A quiet
    /// team and nothing unseen mean the job is over.
    ///
    /// A teammate marks itself `working` before it drains its inbox and sends its idle
    /// notification before it marks itself `idle`, so "idle with an empty inbox" never hides a
    /// message still being handled.
    pub fn next_wake(&self) -> Result<Next> {
        let unseen = &self.conv.unseen;
        if unseen
            .iter()
            .any(|m| m.kind != MessageType::IdleNotification)
        {
            return Ok(Next::Turn);
        }
        if !self.team_quiet()? {
            return Ok(Next::Wait);
        }
        Ok(if unseen.is_empty() {
            Next::Done
        } else {
            Next::Turn
        })
    }

    fn team_quiet(&self) -> Result<bool> {
        // A roster that does not parse (a person's edit in progress) tells nothing: not quiet.
        let Ok(cfg) = self.roster.load() else {
            return Ok(false);
        };
        for m in &cfg.members {
            // A hand-written member with an invalid name is never started: it waits for nothing.
            let Ok(name) = AgentName::teammate(&m.name) else {
                continue;
            };
            let busy = match m.status {
                // Working includes waiting for the model API to come back.
                MemberStatus::Spawning | MemberStatus::Working => true,
                MemberStatus::Idle => !Inbox::new(&self.s.team, &name).is_empty(),
                _ => false,
            };
            if busy {
                return Ok(false);
            }
        }
        let owed = self
            .requests
            .list(Some(RequestStatus::Pending))?
            .iter()
            .any(|r| r.kind == RequestKind::Shutdown && r.from == LEAD);
        Ok(!owed)
    }

    fn system_prompt(&self) -> String {
        format!(
            "You are the lead of a team of AI agents. Each teammate is a separate process with \
             its own tools; you manage them with yours. Your working directory is {wd}; it is \
             also the teammates' and file tools are confined to it.\n\n\
             - Start a teammate with spawn_teammate (a name of lower-case letters, digits, - and \
             _, a role and its instructions). Set require_plan_approval when it must have a \
             plan approved before it changes anything.\n\
             - Teammates' messages, plans to review, shutdown answers and idle notifications \
             reach you as <inbox> turns. Review a plan with plan_approval (request_id, approve, \
             and feedback that says what to change when you reject it).\n\
             - When a teammate's work is done, ask it to stop with shutdown_request; it may \
             refuse with a reason.\n\
             - When you are waiting for teammates, end your turn: their messages wake you.\n\
             When the person's request is done, end your turn with a short summary for them.",
            wd = self.s.workdir.display()
        )
    }

    /// Runs one tool. `Err` only when the turn cannot go on: the inbox drain of `read_inbox`
    /// failed (its journal write was undone, or the journal is unusable).
    fn run_tool(
        &mut self,
        name: &str,
        input: &Value,
        inbox_ids: &mut Vec<String>,
    ) -> Result<ToolOutput> {
        let out = match tools::check_input(input) {
            Err(e) => ToolOutput::error(e),
            Ok(_) if name == "read_inbox" => ToolOutput::ok(self.read_inbox(inbox_ids)?),
            Ok(_) => self.dispatch(name, input),
        };
        tools::log_call(&self.s.team, LEAD, name, input, &out);
        Ok(out)
    }

    /// Every tool but `read_inbox` (see [`Lead::run_tool`]).
    fn dispatch(&mut self, name: &str, input: &Value) -> ToolOutput {
        let team = &self.s.team;
        if let Some(out) = tools::tasks::run(team, LEAD, 0, name, input) {
            return out;
        }
        let file_tool = matches!(name, "bash" | "read_file" | "write_file" | "edit_file");
        if file_tool {
            let wd = match tools::fs::Workdir::for_agent(
                &self.s.workdir,
                &self.s.team,
                self.s.sandbox.owner(),
            ) {
                Ok(wd) => wd,
                Err(e) => return ToolOutput::error(format!("working directory unavailable: {e}")),
            };
            return match name {
                "bash" => tools::bash::bash(&wd, &self.s.sandbox, input, self.s.bash_timeout),
                "read_file" => tools::fs::read_file(&wd, input),
                "write_file" => tools::fs::write_file(&wd, input),
                _ => tools::fs::edit_file(&wd, input),
            };
        }
        let result = match name {
            "spawn_teammate" => spawn_teammate(team, input),
            "list_teammates" => self.list_teammates(),
            "send_message" => send_message(team, input),
            "broadcast" => broadcast(team, input),
            "shutdown_request" => self.shutdown_request(input),
            "shutdown_response" => self.shutdown_status(input),
            "plan_approval" => self.review_plan(input),
            "list_requests" => self.list_requests(input),
            "request_status" => tools::input_str(input, "request_id").and_then(|id| {
                let r = self.requests.get(id).map_err(|e| e.to_string())?;
                serde_json::to_string_pretty(&r).map_err(|e| e.to_string())
            }),
            other => Err(format!(
                "unknown tool {other:?}; available: {}",
                tools::lead_specs()
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
        };
        match result {
            Ok(text) => ToolOutput::ok(text),
            Err(e) => ToolOutput::error(e),
        }
    }

    fn list_teammates(&self) -> std::result::Result<String, String> {
        let cfg = self.roster.load().map_err(|e| e.to_string())?;
        if cfg.members.is_empty() {
            return Ok("no teammates yet".into());
        }
        let pending = self
            .requests
            .list(Some(RequestStatus::Pending))
            .map_err(|e| e.to_string())?;
        let lines: Vec<String> = cfg
            .members
            .iter()
            .map(|m| {
                let mut line = format!("{} ({}): {}", m.name, m.role, m.status);
                let p: Vec<String> = pending
                    .iter()
                    .filter(|r| r.to == m.name || r.from == m.name)
                    .map(|r| format!("{} request_id={}", r.kind, r.request_id))
                    .collect();
                if !p.is_empty() {
                    line.push_str(&format!("; pending: {}", p.join(", ")));
                }
                if let Some(why) = &m.reason {
                    line.push_str(&format!("; {why}"));
                }
                line
            })
            .collect();
        Ok(lines.join("\n"))
    }

    fn read_inbox(&mut self, inbox_ids: &mut Vec<String>) -> Result<String> {
        let batch = self.inbox.drain(&mut self.journal)?;
        inbox_ids.extend(batch.iter().map(|m| m.id.clone()));
        Ok(if batch.is_empty() {
            "no new messages".into()
        } else {
            conversation::render_inbox(&batch)
        })
    }

    fn shutdown_request(&self, input: &Value) -> std::result::Result<String, String> {
        let name = tools::input_str(input, "teammate")?;
        let name = AgentName::teammate(name).map_err(|e| e.to_string())?;
        let pending = self
            .requests
            .list(Some(RequestStatus::Pending))
            .map_err(|e| e.to_string())?;
        if let Some(r) = pending
            .iter()
            .find(|r| r.kind == RequestKind::Shutdown && r.to == name.as_str())
        {
            return Err(format!(
                "{name} already has a pending shutdown request (request_id={}); wait for its answer",
                r.request_id
            ));
        }
        let req = ops::request_shutdown(
            &self.s.team,
            name.as_str(),
            "the lead asks you to shut down",
            ops::SHUTDOWN_TTL,
        )
        .map_err(|e| e.to_string())?;
        Ok(format!(
            "shutdown request request_id={} sent to {name}; its answer will arrive in your inbox",
            req.request_id
        ))
    }

    fn shutdown_status(&self, input: &Value) -> std::result::Result<String, String> {
        let id = tools::input_str(input, "request_id")?;
        let r = self.requests.get(id).map_err(|e| e.to_string())?;
        if r.kind != RequestKind::Shutdown {
            return Err(format!(
                "request {id} is a {} request, not a shutdown; use request_status",
                r.kind
            ));
        }
        Ok(describe_request(&r))
    }

    fn review_plan(&self, input: &Value) -> std::result::Result<String, String> {
        let id = tools::input_str(input, "request_id")?;
        let approve = tools::input_bool(input, "approve")?;
        let feedback = tools::input_opt_str(input, "feedback")?.unwrap_or("");
        let r = self.requests.get(id).map_err(|e| e.to_string())?;
        if r.kind != RequestKind::PlanApproval {
            return Err(format!(
                "request {id} is a {} request, not a plan; only plans are reviewed with plan_approval",
                r.kind
            ));
        }
        if r.status != RequestStatus::Pending {
            return Err(format!(
                "request {id} is already {}; a plan is decided once (the teammate may submit a new one)",
                r.status
            ));
        }
        if !approve && feedback.trim().is_empty() {
            return Err(
                "give feedback when you reject a plan, so the teammate knows what to change".into(),
            );
        }
        let r = ops::decide_plan(&self.s.team, id, approve, feedback).map_err(|e| e.to_string())?;
        Ok(format!(
            "plan request_id={id} of {} {}; {} has been told",
            r.from,
            if approve { "approved" } else { "rejected" },
            r.from
        ))
    }

    fn list_requests(&self, input: &Value) -> std::result::Result<String, String> {
        let status = match tools::input_opt_str(input, "status")? {
            None | Some("") => None,
            Some(s) => Some(
                s.parse::<RequestStatus>()
                    .map_err(|e| format!("{e}; use pending, approved, rejected or expired"))?,
            ),
        };
        let list = self.requests.list(status).map_err(|e| e.to_string())?;
        if list.is_empty() {
            return Ok("no requests".into());
        }
        Ok(list
            .iter()
            .map(describe_request)
            .collect::<Vec<_>>()
            .join("\n"))
    }
}

/// One line about a request, naming its id the way the inbox does (`request_id=...`).
fn describe_request(r: &Request) -> String {
    let mut line = format!(
        "request_id={} {} {} -> {}: {}",
        r.request_id, r.kind, r.from, r.to, r.status
    );
    if let Some(plan) = r.payload.get("plan").and_then(Value::as_str) {
        let plan: String = plan.chars().take(200).collect();
        line.push_str(&format!("; plan: {plan}"));
    }
    if let Some(text) = r.response_text().filter(|t| !t.is_empty()) {
        line.push_str(&format!("; answer: {text}"));
    }
    line
}

fn spawn_teammate(team: &TeamDir, input: &Value) -> std::result::Result<String, String> {
    let name = tools::input_str(input, "name")?;
    let role = tools::input_str(input, "role")?;
    let prompt = tools::input_str(input, "prompt")?;
    let require_plan_approval = match input.get("require_plan_approval") {
        None | Some(Value::Null) => false,
        Some(_) => tools::input_bool(input, "require_plan_approval")?,
    };
    let auto_claim = match input.get("auto_claim") {
        None | Some(Value::Null) => false,
        Some(_) => tools::input_bool(input, "auto_claim")?,
    };
    let model = tools::input_opt_str(input, "model")?
        .filter(|m| !m.trim().is_empty())
        .map(str::to_owned);
    if role.trim().is_empty() || prompt.trim().is_empty() {
        return Err("role and prompt must not be empty".into());
    }
    // A role is shown in `lead status` and `lead top`: one line of printable text.
    crate::term_text::check_one_line("role", role)?;
    let spec = SpawnSpec {
        name: name.to_owned(),
        role: role.to_owned(),
        prompt: prompt.to_owned(),
        model,
        require_plan_approval,
        auto_claim,
        budget_usd: None,
        budget_tokens: None,
        worktree: false,
        host: None,
    };
    let m = ops::spawn(team, &spec).map_err(|e| e.to_string())?;
    Ok(if m.status == MemberStatus::Idle {
        format!("{name} was idle; its new task is in its inbox")
    } else {
        format!(
            "spawned {name} as {role}{}; its task is in its inbox and it will report through yours",
            if require_plan_approval {
                " (it must have a plan approved before it changes anything)"
            } else {
                ""
            }
        )
    })
}

fn send_message(team: &TeamDir, input: &Value) -> std::result::Result<String, String> {
    let to = tools::input_str(input, "to")?;
    let content = tools::input_str(input, "content")?;
    if to == LEAD {
        return Err("you are the lead; send messages to teammates".into());
    }
    let to = AgentName::teammate(to).map_err(|e| e.to_string())?;
    let msg = Message::new(MessageType::Message, LEAD, to.as_str(), content);
    mail::send(team, &msg, Stopped::Refuse, Durability::Sync)
        .map_err(|e| format!("not sent: {e}"))?;
    Ok(format!("sent to {to} (id {})", msg.id))
}

fn broadcast(team: &TeamDir, input: &Value) -> std::result::Result<String, String> {
    let content = tools::input_str(input, "content")?;
    let sent = ops::broadcast(team, content).map_err(|e| e.to_string())?;
    Ok(if sent.is_empty() {
        "no running teammates to broadcast to".into()
    } else {
        format!(
            "sent to {}",
            sent.iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    })
}
