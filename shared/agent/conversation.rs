//! Rebuilding a conversation from the journal, rendering inbox batches, bounding the context.
//!
//! The journal ([`crate::transcript`]) is the source of truth; the conversation sent to the model
//! is derived from it, so a worker restarted after `kill -9` continues the same conversation:
//!
//! - inbox entries not claimed by a `read_inbox` tool result become ONE user turn
//!   (`<inbox>...</inbox>`) before the next assistant turn;
//! - an assistant turn's tool uses are answered by the following `tool_results` entry; tool uses
//!   left unanswered by a kill are reported by [`Rebuilt::dangling`] so that the caller can
//!   journal an error result for them before calling the model again;
//! - consecutive messages of one role are merged (tool results first), as the APIs require.

use std::collections::HashSet;

use crate::error::Result;
use crate::fsutil::{self, HeldLock};
use crate::llm::{Block, ChatMessage, Role, StopReason};
use crate::message::{Message, MessageType};
use crate::teamdir::{AgentName, TeamDir};
use crate::transcript::{Entry, Journal};

/// The text of the error result given to a tool use cut off by a restart.
pub const RESTARTED: &str = "error: the worker restarted before this tool finished; its effect is unknown. Check before retrying.";

/// A conversation rebuilt from journal entries.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Rebuilt {
    /// The messages, ready to send (after [`bound`]).
    pub messages: Vec<ChatMessage>,
    /// Consumed inbox messages the model has not seen yet, oldest first.
    pub unseen: Vec<Message>,
    /// Tool use ids of the last assistant turn that have no result.
    pub dangling: Vec<String>,
    /// Model calls journaled so far (the next call's `seq`).
    pub calls: u64,
    /// Model calls since the last `idle` entry (the current activation's).
    pub calls_this_activation: u64,
    /// Whether the last event was the end of an activation (an `idle` entry).
    pub idle: bool,
    /// What `idle` was before the inbox entries since the last model call, person's turn or
    /// idle: restored when every one of them turns out handled by the worker itself.
    idle_before_inbox: Option<bool>,
    /// The last assistant text, for the idle summary.
    pub last_text: String,
    /// Whether the last assistant turn ended without tool uses.
    pub turn_ended: bool,
    /// Compactions applied.
    pub compactions: u64,
    /// Ends of activations whose idle step is not complete (see [`Entry::Idle`]), oldest first.
    pub undelivered: Vec<Undelivered>,
}

/// An idle notification journaled and not yet known delivered: the lead may or may not have it,
/// and the `teammate_idle` hook mark may or may not be in the roster.
#[derive(Debug, Clone, PartialEq)]
pub struct Undelivered {
    /// The notification exactly as journaled (its id included), sent again as it is.
    pub notification: Message,
    /// Model calls journaled when the activation ended: the hook mark's value.
    pub calls: u64,
}

impl Rebuilt {
    /// Replays `entries` in order.
    pub fn from_entries(entries: &[Entry]) -> Rebuilt {
        let claimed: HashSet<&str> = entries
            .iter()
            .filter_map(|e| match e {
                Entry::ToolResults { inbox_ids, .. } => Some(inbox_ids),
                Entry::Handled { ids, .. } => Some(ids),
                _ => None,
            })
            .flatten()
            .map(String::as_str)
            .collect();
        let mut r = Rebuilt::default();
        for e in entries {
            r.apply(e, &claimed);
        }
        r
    }

    fn apply(&mut self, e: &Entry, claimed: &HashSet<&str>) {
        match e {
            Entry::Session { .. } => {}
            Entry::Handled { ids, .. } => {
                self.unseen.retain(|m| !ids.contains(&m.id));
                // Nothing of what woke it is left for the model: it is as it was.
                if self.unseen.is_empty()
                    && let Some(was) = self.idle_before_inbox.take()
                {
                    self.idle = was;
                }
            }
            Entry::Inbox { message, .. } => {
                if !claimed.contains(message.id.as_str()) {
                    self.unseen.push(message.clone());
                }
                self.idle_before_inbox.get_or_insert(self.idle);
                self.idle = false;
            }
            Entry::Assistant { response, .. } => {
                self.flush_unseen();
                let mut content = response.content.clone();
                if content.is_empty() {
                    let why = match response.stop_reason {
                        StopReason::Refusal => "[the model declined to answer]",
                        _ => "[empty response]",
                    };
                    content.push(Block::Text { text: why.into() });
                }
                self.dangling = content
                    .iter()
                    .filter_map(|b| match b {
                        Block::ToolUse { id, .. } => Some(id.clone()),
                        _ => None,
                    })
                    .collect();
                let text: Vec<&str> = content
                    .iter()
                    .filter_map(|b| match b {
                        Block::Text { text } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect();
                if !text.is_empty() {
                    self.last_text = text.join("\n");
                }
                self.turn_ended = self.dangling.is_empty();
                push(&mut self.messages, Role::Assistant, content);
                self.calls += 1;
                self.calls_this_activation += 1;
                self.idle = false;
                self.idle_before_inbox = None;
            }
            Entry::ToolResults { results, .. } => {
                let answered: HashSet<&str> = results
                    .iter()
                    .filter_map(|b| match b {
                        Block::ToolResult { tool_use_id, .. } => Some(tool_use_id.as_str()),
                        _ => None,
                    })
                    .collect();
                self.dangling.retain(|id| !answered.contains(id.as_str()));
                push(&mut self.messages, Role::User, results.clone());
            }
            Entry::Idle { notification, .. } => {
                if let Some(n) = notification {
                    self.undelivered.push(Undelivered {
                        notification: n.clone(),
                        calls: self.calls,
                    });
                }
                self.idle = true;
                self.idle_before_inbox = None;
                self.calls_this_activation = 0;
            }
            Entry::IdleDelivered { id, .. } => {
                self.undelivered.retain(|u| u.notification.id != *id);
            }
            Entry::Compaction {
                summary, keep_from, ..
            } => {
                // The live loop compacts right before a model call, after showing the model
                // every unseen message.
                self.flush_unseen();
                let keep_from = (*keep_from).min(self.messages.len());
                let kept = self.messages.split_off(keep_from);
                self.messages = vec![ChatMessage {
                    role: Role::User,
                    content: vec![Block::Text {
                        text: summary.clone(),
                    }],
                }];
                self.messages.extend(kept);
                self.compactions += 1;
            }
            Entry::User { text, .. } => {
                // Messages consumed before the person spoke come first, in the same user turn.
                self.flush_unseen();
                push(
                    &mut self.messages,
                    Role::User,
                    vec![Block::Text { text: text.clone() }],
                );
                self.idle = false;
                self.idle_before_inbox = None;
            }
        }
    }

    /// Moves unseen inbox messages into a user turn (done before each model call).
    pub fn flush_unseen(&mut self) {
        if self.unseen.is_empty() {
            return;
        }
        let text = render_inbox(&self.unseen);
        self.unseen.clear();
        push(&mut self.messages, Role::User, vec![Block::Text { text }]);
    }

    /// Error results for the dangling tool uses (to be journaled, then applied).
    pub fn dangling_results(&self) -> Vec<Block> {
        self.dangling
            .iter()
            .map(|id| Block::ToolResult {
                tool_use_id: id.clone(),
                content: RESTARTED.to_owned(),
                is_error: true,
            })
            .collect()
    }

    /// Applies one more entry (as journaled by the live loop).
    pub fn push_entry(&mut self, e: &Entry) {
        let claimed: HashSet<&str> = match e {
            Entry::ToolResults { inbox_ids, .. } => inbox_ids.iter().map(String::as_str).collect(),
            _ => HashSet::new(),
        };
        self.apply(e, &claimed);
    }
}

/// Takes over an agent's journal for a new process: opens it, rebuilds the conversation,
/// journals the new session and answers tool uses a kill cut off with an error result (so the
/// next model call sees every `tool_use` answered). `owner` is the agent's liveness lock,
/// `transcripts/NAME.lock`, which makes this process the journal's owner.
pub fn resume(
    team: &TeamDir,
    name: &AgentName,
    incarnation: u64,
    owner: &HeldLock,
) -> Result<(Journal, Rebuilt)> {
    let (mut journal, entries) = Journal::open(team, name, owner)?;
    let mut conv = Rebuilt::from_entries(&entries);
    let session = Entry::Session {
        incarnation,
        pid: std::process::id(),
        at: fsutil::now(),
    };
    journal.append(std::slice::from_ref(&session))?;
    if !conv.dangling.is_empty() {
        let fill = Entry::ToolResults {
            results: conv.dangling_results(),
            inbox_ids: Vec::new(),
            at: fsutil::now(),
            timings: Vec::new(),
        };
        journal.append(std::slice::from_ref(&fill))?;
        conv.push_entry(&fill);
    }
    Ok((journal, conv))
}

/// Appends blocks to the conversation, merging into the last message when it has the same role
/// (tool results go first in a user message).
fn push(messages: &mut Vec<ChatMessage>, role: Role, content: Vec<Block>) {
    if let Some(last) = messages.last_mut()
        && last.role == role
    {
        let (mut results, mut rest): (Vec<Block>, Vec<Block>) = last
            .content
            .drain(..)
            .chain(content)
            .partition(|b| matches!(b, Block::ToolResult { .. }));
        results.append(&mut rest);
        last.content = results;
        return;
    }
    messages.push(ChatMessage { role, content });
}

/// Renders an inbox batch as one user turn. Protocol messages become instructions naming their
/// `request_id`.
pub fn render_inbox(batch: &[Message]) -> String {
    let mut out = String::from("<inbox>\n");
    for m in batch {
        out.push_str(&render_message(m));
        out.push('\n');
    }
    out.push_str("</inbox>");
    out
}

/// One inbox message as text for the model, exactly as its sender wrote it. A terminal shows
/// it through [`crate::term_text::lines`] (`lead inbox`, `lead chat`): the sender is a model.
pub fn render_message(m: &Message) -> String {
    let rid = m.request_id.as_deref().unwrap_or("?");
    match m.kind {
        MessageType::ShutdownRequest => format!(
            "[shutdown_request from {} request_id={rid}] The lead asks you to shut down{}. \
             Answer with the shutdown_response tool: request_id \"{rid}\", approve true to \
             finish and exit, or approve false with a reason to keep working.",
            m.from,
            reason_suffix(m.reason.as_deref().or(Some(m.content.as_str())))
        ),
        MessageType::PlanApprovalResponse => {
            let verdict = if m.approve == Some(true) {
                "APPROVED. You may now carry it out (bash, write_file and edit_file are available)."
            } else {
                "REJECTED. Revise it and submit a new plan with plan_approval."
            };
            let fb = m
                .feedback
                .as_deref()
                .filter(|f| !f.is_empty())
                .or(Some(m.content.as_str()).filter(|c| !c.is_empty()))
                .map(|f| format!(" Feedback: {f}"))
                .unwrap_or_default();
            format!("[plan_approval_response request_id={rid}] Your plan was {verdict}{fb}")
        }
        MessageType::PlanApproval => format!(
            "[plan_approval from {} request_id={rid}] Plan: {}",
            m.from,
            m.plan.as_deref().unwrap_or(&m.content)
        ),
        MessageType::ShutdownResponse => format!(
            "[shutdown_response from {} request_id={rid}] {}{}",
            m.from,
            if m.approve == Some(true) {
                "approved"
            } else {
                "rejected"
            },
            reason_suffix(m.reason.as_deref())
        ),
        _ => format!("[{} from {}] {}", m.kind, m.from, m.content),
    }
}

fn reason_suffix(r: Option<&str>) -> String {
    match r {
        Some(r) if !r.trim().is_empty() => format!(" (reason: {r})"),
        _ => String::new(),
    }
}

/// The messages to send, bounded to about `max_chars` of content: the most recent messages that
/// fit, starting at a user turn that does not begin with tool results (so no result is cut from
/// its tool use). The first kept turn says how much was left out.
pub fn bound(messages: &[ChatMessage], max_chars: usize) -> Vec<ChatMessage> {
    let size = |m: &ChatMessage| -> usize {
        m.content
            .iter()
            .map(|b| match b {
                Block::Text { text } => text.len(),
                Block::ToolUse { input, .. } => input.to_string().len() + 32,
                Block::ToolResult { content, .. } => content.len() + 32,
            })
            .sum()
    };
    let is_cut_point = |m: &ChatMessage| {
        m.role == Role::User
            && !m
                .content
                .iter()
                .any(|b| matches!(b, Block::ToolResult { .. }))
    };
    let mut total = 0;
    let mut start = None;
    for (i, m) in messages.iter().enumerate().rev() {
        total += size(m);
        if is_cut_point(m) {
            if total > max_chars && start.is_some() {
                break;
            }
            start = Some(i);
        }
    }
    let start = start.unwrap_or(0);
    let mut kept = messages[start..].to_vec();
    if start > 0
        && let Some(first) = kept.first_mut()
    {
        first.content.insert(
            0,
            Block::Text {
                text: format!(
                    "[{start} earlier messages are not shown here to bound the context; the full \
                     history is in your transcript]"
                ),
            },
        );
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::{ChatResponse, Usage};
    use serde_json::json;

    fn inbox(text: &str) -> Entry {
        Entry::Inbox {
            message: Message::new(MessageType::Message, "lead", "alice", text),
            at: None,
        }
    }

    fn assistant(blocks: Vec<Block>) -> Entry {
        let stop = if blocks.iter().any(|b| matches!(b, Block::ToolUse { .. })) {
            StopReason::ToolUse
        } else {
            StopReason::EndTurn
        };
        Entry::Assistant {
            seq: 0,
            response: ChatResponse {
                content: blocks,
                stop_reason: stop,
                usage: Usage::default(),
                model: String::new(),
            },
            at: 0.0,
            started_at: None,
            waited: None,
        }
    }

    fn tool_use(id: &str) -> Block {
        Block::ToolUse {
            id: id.into(),
            name: "bash".into(),
            input: json!({"command": "ls"}),
        }
    }

    fn result(id: &str) -> Block {
        Block::ToolResult {
            tool_use_id: id.into(),
            content: "ok".into(),
            is_error: false,
        }
    }

    #[test]
    fn rebuild_pairs_tools_and_merges_inbox() {
        let entries = vec![
            inbox("one"),
            inbox("two"),
            assistant(vec![tool_use("t1"), tool_use("t2")]),
            Entry::ToolResults {
                results: vec![result("t1"), result("t2")],
                inbox_ids: vec![],
                at: 0.0,
                timings: Vec::new(),
            },
            inbox("three"),
            assistant(vec![Block::Text {
                text: "done".into(),
            }]),
            Entry::Idle {
                at: 0.0,
                notification: None,
            },
        ];
        let r = Rebuilt::from_entries(&entries);
        assert_eq!(r.messages.len(), 4);
        assert_eq!(r.messages[0].role, Role::User);
        let Block::Text { text } = &r.messages[0].content[0] else {
            panic!()
        };
        assert!(text.starts_with("<inbox>\n[message from lead] one\n[message from lead] two"));
        // Tool results first, then the later inbox text, in one user turn.
        assert_eq!(r.messages[2].content.len(), 3);
        assert!(matches!(r.messages[2].content[0], Block::ToolResult { .. }));
        assert!(matches!(r.messages[2].content[2], Block::Text { .. }));
        assert!(r.idle && r.dangling.is_empty() && r.unseen.is_empty());
        assert_eq!(r.calls, 2);
        assert_eq!(r.last_text, "done");
    }

    /// Old finding 8: an idle step is pending from its `idle` entry until its `idle_delivered`,
    /// across later activations, and an `idle` of an older journal (no notification) leaves
    /// nothing pending.
    #[test]
    fn an_idle_notification_is_undelivered_until_its_delivery_is_journaled() {
        let note = |text: &str| Message::new(MessageType::IdleNotification, "alice", "lead", text);
        let (first, second) = (note("first"), note("second"));
        let idle = |n: &Message| Entry::Idle {
            at: 0.0,
            notification: Some(n.clone()),
        };
        let delivered = |n: &Message| Entry::IdleDelivered {
            id: n.id.clone(),
            at: 0.0,
        };
        let done = || assistant(vec![Block::Text { text: "ok".into() }]);
        let mut entries = vec![
            Entry::Idle {
                at: 0.0,
                notification: None,
            },
            inbox("go"),
            done(),
            idle(&first),
            inbox("again"),
            done(),
            done(),
            idle(&second),
        ];
        let r = Rebuilt::from_entries(&entries);
        let pending: Vec<(&str, u64)> = r
            .undelivered
            .iter()
            .map(|u| (u.notification.content.as_str(), u.calls))
            .collect();
        assert_eq!(pending, [("first", 1), ("second", 3)]);
        assert!(r.idle);
        entries.push(delivered(&second));
        let r = Rebuilt::from_entries(&entries);
        assert_eq!(r.undelivered.len(), 1);
        assert_eq!(r.undelivered[0].notification, first);
        // Live, entry by entry, the same.
        let mut live = Rebuilt::from_entries(&entries[..1]);
        for e in &entries[1..] {
            live.push_entry(e);
        }
        assert_eq!(live.undelivered, r.undelivered);
        live.push_entry(&delivered(&first));
        assert!(live.undelivered.is_empty() && live.idle);
    }

    #[test]
    fn kill_mid_tool_leaves_dangling_uses() {
        let entries = vec![inbox("go"), assistant(vec![tool_use("t1"), tool_use("t2")])];
        let mut r = Rebuilt::from_entries(&entries);
        assert_eq!(r.dangling, vec!["t1", "t2"]);
        let fill = Entry::ToolResults {
            results: r.dangling_results(),
            inbox_ids: vec![],
            at: 0.0,
            timings: Vec::new(),
        };
        r.push_entry(&fill);
        assert!(r.dangling.is_empty());
        let Block::ToolResult {
            content, is_error, ..
        } = &r.messages[2].content[0]
        else {
            panic!()
        };
        assert!(*is_error && content.contains("restarted"));
    }

    /// A message the worker handles itself (a board wake-up, a stale shutdown) does not undo
    /// the end of an activation: nothing new reached the model, so there is nothing to resume
    /// (and no second idle, which would run the team's idle hooks again).
    #[test]
    fn a_handled_message_leaves_an_idle_conversation_idle() {
        let wake = Message::new(MessageType::StatusUpdate, "lead", "alice", "wake");
        let mut entries = vec![
            inbox("go"),
            assistant(vec![Block::Text {
                text: "done".into(),
            }]),
            Entry::Idle {
                at: 0.0,
                notification: None,
            },
            Entry::Inbox {
                message: wake.clone(),
                at: None,
            },
            Entry::Handled {
                ids: vec![wake.id.clone()],
                at: 0.0,
            },
        ];
        let r = Rebuilt::from_entries(&entries);
        assert!(r.unseen.is_empty());
        assert!(r.idle, "a handled wake-up resumed a finished activation");
        // Live, entry by entry, the same.
        let mut live = Rebuilt::from_entries(&entries[..3]);
        for e in &entries[3..] {
            live.push_entry(e);
        }
        assert!(live.idle);
        // A message the model must see still wakes it.
        entries.push(inbox("more"));
        assert!(!Rebuilt::from_entries(&entries).idle);
    }

    #[test]
    fn read_inbox_claims_its_messages() {
        let m = Message::new(MessageType::Message, "bob", "alice", "via tool");
        let entries = vec![
            inbox("go"),
            assistant(vec![tool_use("t1")]),
            Entry::Inbox {
                message: m.clone(),
                at: None,
            },
            Entry::ToolResults {
                results: vec![result("t1")],
                inbox_ids: vec![m.id.clone()],
                at: 0.0,
                timings: Vec::new(),
            },
        ];
        let r = Rebuilt::from_entries(&entries);
        assert!(
            r.unseen.is_empty(),
            "claimed message must not be shown twice"
        );
        // Killed before the tool result was journaled: the message is shown as inbox instead.
        let r = Rebuilt::from_entries(&entries[..3]);
        assert_eq!(r.unseen.len(), 1);
    }

    #[test]
    fn bound_cuts_at_a_clean_user_turn() {
        let mut msgs = Vec::new();
        for i in 0..10 {
            msgs.push(ChatMessage {
                role: Role::User,
                content: vec![Block::Text {
                    text: format!("u{i} {}", "x".repeat(100)),
                }],
            });
            msgs.push(ChatMessage {
                role: Role::Assistant,
                content: vec![tool_use(&format!("t{i}"))],
            });
            msgs.push(ChatMessage {
                role: Role::User,
                content: vec![result(&format!("t{i}"))],
            });
            msgs.push(ChatMessage {
                role: Role::Assistant,
                content: vec![Block::Text { text: "ok".into() }],
            });
        }
        let kept = bound(&msgs, 500);
        assert!(kept.len() < msgs.len());
        assert_eq!(kept[0].role, Role::User);
        assert!(
            !kept[0]
                .content
                .iter()
                .any(|b| matches!(b, Block::ToolResult { .. }))
        );
        let Block::Text { text } = &kept[0].content[0] else {
            panic!()
        };
        assert!(text.contains("earlier messages are not shown"));
        assert_eq!(bound(&msgs, usize::MAX).len(), msgs.len());
    }

    #[test]
    fn protocol_messages_render_as_instructions() {
        let m = Message {
            reason: Some("work is done".into()),
            ..Message::new(MessageType::ShutdownRequest, "lead", "alice", "")
                .with_request("a1b2c3d4")
        };
        let t = render_message(&m);
        assert!(
            t.contains("request_id \"a1b2c3d4\"") && t.contains("work is done"),
            "{t}"
        );
    }
}
