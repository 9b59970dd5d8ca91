//! Keeping a conversation inside the model's context: estimates, the compaction policy, and the
//! text of the summary request. Pure functions; the agents make the model call and journal the
//! result ([`crate::transcript::Entry::Compaction`]).
//!
//! **Tokens are estimated** from the bytes a request carries: the JSON of the system prompt,
//! the tool specs and the messages, plus a fixed overhead, divided by [`BYTES_PER_TOKEN`] (3,
//! rounded up). Real tokenizers give about 3.5 to 4 bytes per token for English and code, so the
//! estimate is high on purpose: a request estimated under the context size is under it. The same
//! rule bounds what is sent: a request estimated at `T` tokens carries at most `3 * T` bytes of
//! conversation, tools and system.
//!
//! **Policy**: once the estimate passes [`COMPACT_AT`] of the context size, the older turns are
//! replaced by one summary written by a model call, and the most recent turns, up to
//! [`KEEP_RECENT`] of the context, are kept verbatim (cut before an assistant turn, so no tool
//! result loses its tool use). A tool result longer than [`RESULT_SHARE`] of the context is cut
//! to its head and tail when it is journaled. The last turn is always kept; when its results do
//! not fit together (many large parallel reads), [`fit_last_turn`] cuts them further in what
//! is sent.

use crate::llm::{Block, ChatMessage, ChatRequest, ChatResponse, LlmError, Role, ToolSpec};

/// Bytes per estimated token.
pub const BYTES_PER_TOKEN: u64 = 3;

/// Bytes a request carries besides the conversation, tools and system (model, max_tokens, the
/// JSON around them).
const OVERHEAD_BYTES: u64 = 512;

/// Compact once the prompt is estimated past this share of the context.
pub const COMPACT_AT: f64 = 0.75;

/// The most recent turns kept verbatim, as a share of the context.
pub const KEEP_RECENT: f64 = 0.25;

/// The most one tool result may take of the context.
pub const RESULT_SHARE: f64 = 0.125;

/// The share of the context the summary request may carry of the old turns.
const SUMMARY_INPUT_SHARE: f64 = 0.5;

/// Where a compaction request begins; the fake servers of the tests look for it.
pub const MARKER: &str = "[compaction]";

/// Whether the API refused a request for being longer than the model's context.
pub fn too_long(e: &LlmError) -> bool {
    match e {
        LlmError::Rejected {
            status,
            kind,
            message,
        } => {
            let m = message.to_ascii_lowercase();
            *status == 413
                || kind == "context_length_exceeded"
                || (*status == 400
                    && (m.contains("too long")
                        || m.contains("context length")
                        || m.contains("context window")
                        || m.contains("maximum context")))
        }
        _ => false,
    }
}

/// The context size of a model family, in tokens, when no setting says otherwise.
pub fn default_context_tokens(model: &str) -> u64 {
    let m = model.to_ascii_lowercase();
    if m.starts_with("claude") {
        200_000
    } else if m.starts_with("gpt-4.1") {
        1_000_000
    } else if m.starts_with("gpt-4o") || m.starts_with("o1") || m.starts_with("o3") {
        128_000
    } else if m.starts_with("o4") || m.starts_with("gpt-5") {
        200_000
    } else {
        // An unknown or local model: the common size of the current open models.
        128_000
    }
}

/// The bytes of `s` as a JSON string.
fn json_len(s: &str) -> u64 {
    serde_json::to_string(s).map_or(s.len(), |j| j.len()) as u64
}

/// The estimated bytes of one message as sent.
fn message_bytes(m: &ChatMessage) -> u64 {
    32 + m
        .content
        .iter()
        .map(|b| match b {
            Block::Text { text } => 32 + json_len(text),
            Block::ToolUse { id, name, input } => {
                64 + json_len(id) + json_len(name) + input.to_string().len() as u64
            }
            Block::ToolResult {
                tool_use_id,
                content,
                ..
            } => 64 + json_len(tool_use_id) + json_len(content),
        })
        .sum::<u64>()
}

/// The estimated tokens of a request.
pub fn estimate(system: &str, tools: &[ToolSpec], messages: &[ChatMessage]) -> u64 {
    let tools: u64 = tools
        .iter()
        .map(|t| {
            48 + json_len(&t.name)
                + json_len(&t.description)
                + t.input_schema.to_string().len() as u64
        })
        .sum();
    let bytes =
        OVERHEAD_BYTES + json_len(system) + tools + messages.iter().map(message_bytes).sum::<u64>();
    bytes.div_ceil(BYTES_PER_TOKEN)
}

/// Whether a prompt of `tokens` should be compacted first.
pub fn should_compact(tokens: u64, context: u64) -> bool {
    tokens as f64 > context as f64 * COMPACT_AT
}

/// Where to cut for a compaction: the index of the first message kept verbatim (an assistant
/// turn, at least 1), keeping the most recent messages that fit in `keep_tokens`; at least the
/// last assistant turn and what follows it. `None` when there is nothing before it to summarize.
pub fn cut(messages: &[ChatMessage], keep_tokens: u64) -> Option<usize> {
    let budget = keep_tokens * BYTES_PER_TOKEN;
    let mut total = 0;
    let mut best = None;
    for (i, m) in messages.iter().enumerate().rev() {
        total += message_bytes(m);
        if m.role == Role::Assistant && i > 0 {
            if best.is_some() && total > budget {
                break;
            }
            best = Some(i);
        }
    }
    best
}

/// `text` cut to at most about `max_bytes`: its head and tail, with a line saying how much was
/// left out between them. Unchanged when it fits.
pub fn cut_middle(text: &str, max_bytes: usize) -> String {
    cut_middle_saying(text, max_bytes, "to fit the context")
}

/// [`cut_middle`] with `why` in the line that says how much was cut.
fn cut_middle_saying(text: &str, max_bytes: usize, why: &str) -> String {
    if text.len() <= max_bytes {
        return text.to_owned();
    }
    let keep = max_bytes.saturating_sub((60 + why.len()).max(100)) / 2;
    let head_end = floor_char(text, keep);
    let tail_start = ceil_char(text, text.len() - keep);
    format!(
        "{}\n[... {} bytes cut from the middle {why} ...]\n{}",
        &text[..head_end],
        tail_start - head_end,
        &text[tail_start..]
    )
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char(s: &str, mut i: usize) -> usize {
    while i < s.len() && !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// The conversation to send in a request with `system` and `tools`, so that the request is
/// estimated inside `context`: `messages` as they are when they fit, else with the tool results
/// of the last assistant turn cut to their heads and tails.
///
/// [`cut`] always keeps that turn and its results verbatim, and each result is cut to
/// [`result_cap`] when it is journaled, but nothing bounds how many results one turn has: eight
/// or more large parallel reads do not fit together, and no compaction can help. Each of its
/// `n` results then keeps at most `context / (2 * n)` tokens (halved again while the request
/// still does not fit), with a line saying how many bytes were cut and that the model can
/// re-read them in parts. Only what is sent is cut, never the journal: the same journal gives
/// the same request after a restart, and the next compaction summarizes the turn.
pub fn fit_last_turn(
    messages: &[ChatMessage],
    system: &str,
    tools: &[ToolSpec],
    context: u64,
) -> Vec<ChatMessage> {
    let fits = |m: &[ChatMessage]| estimate(system, tools, m) <= context;
    if fits(messages) {
        return messages.to_vec();
    }
    let after = messages
        .iter()
        .rposition(|m| m.role == Role::Assistant)
        .map_or(0, |a| a + 1);
    let is_result = |b: &Block| matches!(b, Block::ToolResult { .. });
    let n = messages[after..]
        .iter()
        .flat_map(|m| &m.content)
        .filter(|b| is_result(b))
        .count();
    if n == 0 {
        return messages.to_vec();
    }
    let why = format!(
        "this turn's {n} tool results did not fit the context together; re-read what you need \
         in smaller parts (a range of lines: bash sed -n 'FROM,TOp' FILE)"
    );
    let mut cap = (context * BYTES_PER_TOKEN / (2 * n as u64)) as usize;
    loop {
        let mut out = messages.to_vec();
        for m in &mut out[after..] {
            for b in &mut m.content {
                if let Block::ToolResult { content, .. } = b {
                    *content = cut_middle_saying(content, cap, &why);
                }
            }
        }
        if fits(&out) || cap <= MIN_FITTED_RESULT {
            return out;
        }
        cap /= 2;
    }
}

/// The least [`fit_last_turn`] cuts a result to: its note and a little of each end.
const MIN_FITTED_RESULT: usize = 512;

/// The most bytes one tool result may keep in a context of `context` tokens.
pub fn result_cap(context: u64) -> usize {
    (context as f64 * RESULT_SHARE * BYTES_PER_TOKEN as f64) as usize
}

/// The user turn that asks the model to summarize `old` (the turns being replaced), as plain
/// text so it needs no tools: every block cut to a few thousand bytes, the oldest lines dropped
/// past half the context.
pub fn summary_request(old: &[ChatMessage], context: u64) -> String {
    let mut lines: Vec<String> = Vec::new();
    for m in old {
        let who = match m.role {
            Role::User => "user",
            Role::Assistant => "you",
        };
        for b in &m.content {
            let line = match b {
                Block::Text { text } => format!("{who}: {}", cut_middle(text, 4000)),
                Block::ToolUse { name, input, .. } => {
                    format!(
                        "you called {name}: {}",
                        cut_middle(&input.to_string(), 2000)
                    )
                }
                Block::ToolResult {
                    content, is_error, ..
                } => format!(
                    "{}: {}",
                    if *is_error {
                        "tool error"
                    } else {
                        "tool result"
                    },
                    cut_middle(content, 2000)
                ),
            };
            lines.push(line);
        }
    }
    let budget = (context as f64 * SUMMARY_INPUT_SHARE * BYTES_PER_TOKEN as f64) as usize;
    let mut total = 0;
    let mut start = lines.len();
    while start > 0 && total + lines[start - 1].len() < budget {
        start -= 1;
        total += lines[start].len() + 1;
    }
    let dropped = if start > 0 {
        format!("[{start} older lines are left out]\n")
    } else {
        String::new()
    };
    format!(
        "{MARKER} Your conversation is about to be compacted to fit your context. Below are its \
         older turns. Write a summary of them for yourself, to replace them: what you were asked, \
         what you did and found (files, commands, results, decisions), what is left to do, and \
         any request ids you still have to answer. Be concrete and brief; answer with the summary \
         only.\n\n<older_turns>\n{dropped}{}\n</older_turns>",
        lines[start..].join("\n")
    )
}

/// The model call that writes the summary of `old` for the agent named `agent` (its calls are
/// numbered apart from the agent's own, for replayed cassettes: `AGENT.compaction`).
pub fn summary_call(
    model: &str,
    context: u64,
    old: &[ChatMessage],
    max_tokens: u32,
    agent: &str,
    seq: u64,
) -> ChatRequest {
    ChatRequest {
        model: model.to_owned(),
        system: "You write the summary an agent keeps of its own earlier work when its \
                 conversation outgrows its context."
            .to_owned(),
        messages: vec![ChatMessage {
            role: Role::User,
            content: vec![Block::Text {
                text: summary_request(old, context),
            }],
        }],
        tools: Vec::new(),
        max_tokens: max_tokens.min(4096),
        agent: format!("{agent}.compaction"),
        seq,
    }
}

/// The summary a [`summary_call`] answered.
pub fn summary_of(response: &ChatResponse) -> String {
    response
        .content
        .iter()
        .filter_map(|b| match b {
            Block::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The user turn that replaces the older turns: who the agent is, then its own summary.
pub fn summary_turn(reminder: &str, summary: &str, replaced: usize) -> String {
    format!(
        "[This conversation was compacted: {replaced} earlier messages were replaced by your own \
         summary of them. The full history is in your transcript.]\n{reminder}\n\n<summary>\n\
         {}\n</summary>",
        summary.trim()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn text(role: Role, t: &str) -> ChatMessage {
        ChatMessage {
            role,
            content: vec![Block::Text { text: t.into() }],
        }
    }

    fn step(i: usize, out: usize) -> [ChatMessage; 2] {
        [
            ChatMessage {
                role: Role::Assistant,
                content: vec![Block::ToolUse {
                    id: format!("t{i}"),
                    name: "bash".into(),
                    input: json!({"command": "ls"}),
                }],
            },
            ChatMessage {
                role: Role::User,
                content: vec![Block::ToolResult {
                    tool_use_id: format!("t{i}"),
                    content: "a".repeat(out),
                    is_error: false,
                }],
            },
        ]
    }

    #[test]
    fn the_estimate_is_never_below_a_third_of_the_bytes() {
        let mut msgs = vec![text(Role::User, "go")];
        for i in 0..10 {
            msgs.extend(step(i, 3000));
        }
        let bytes = serde_json::to_string(&msgs).unwrap().len() as u64;
        let est = estimate("sys", &[], &msgs);
        assert!(
            est * BYTES_PER_TOKEN >= bytes,
            "{est} tokens for {bytes} bytes"
        );
        assert!(
            est * BYTES_PER_TOKEN < bytes * 2,
            "{est} tokens for {bytes} bytes"
        );
    }

    #[test]
    fn the_cut_keeps_whole_steps_and_something_to_summarize() {
        let mut msgs = vec![text(Role::User, "go")];
        for i in 0..10 {
            msgs.extend(step(i, 3000));
        }
        // Two steps (about 6,500 bytes) fit in 2,300 tokens.
        let at = cut(&msgs, 2300).unwrap();
        assert_eq!(msgs[at].role, Role::Assistant);
        assert_eq!(at, msgs.len() - 4);
        // Nothing fits: the last step is kept all the same.
        assert_eq!(cut(&msgs, 1), Some(msgs.len() - 2));
        // Only one turn: nothing to summarize.
        assert_eq!(cut(&msgs[..1], 100), None);
    }

    /// One assistant turn that asked for `n` reads, and their results of `each` bytes.
    fn parallel_reads(n: usize, each: usize) -> [ChatMessage; 2] {
        [
            ChatMessage {
                role: Role::Assistant,
                content: (0..n)
                    .map(|i| Block::ToolUse {
                        id: format!("r{i}"),
                        name: "read_file".into(),
                        input: json!({"path": format!("f{i}.txt")}),
                    })
                    .collect(),
            },
            ChatMessage {
                role: Role::User,
                content: (0..n)
                    .map(|i| Block::ToolResult {
                        tool_use_id: format!("r{i}"),
                        content: char::from(b'A' + i as u8).to_string().repeat(each),
                        is_error: false,
                    })
                    .collect(),
            },
        ]
    }

    #[test]
    fn a_last_turn_of_many_large_results_is_shrunk_to_fit() {
        let context = 30_000;
        let system = "s".repeat(6000);
        let mut msgs = vec![text(Role::User, "read them all")];
        // Ten reads, each at the most one result may keep: together more than the context.
        msgs.extend(parallel_reads(10, result_cap(context)));
        assert!(estimate(&system, &[], &msgs) > context);
        // The cut keeps the whole last turn all the same.
        assert_eq!(cut(&msgs, context / 4), Some(1));
        let fitted = fit_last_turn(&msgs, &system, &[], context);
        assert!(
            estimate(&system, &[], &fitted) <= context,
            "{} tokens in a context of {context}",
            estimate(&system, &[], &fitted)
        );
        assert_eq!(fitted.len(), msgs.len());
        assert_eq!(fitted[..2], msgs[..2]);
        let Block::ToolResult {
            content,
            tool_use_id,
            ..
        } = &fitted[2].content[3]
        else {
            panic!("{:?}", fitted[2].content[3]);
        };
        assert_eq!(tool_use_id, "r3");
        // Each keeps its head and tail, and says how much was cut and how to see it.
        let head = content.len() - content.trim_start_matches('D').len();
        let tail = content.len() - content.trim_end_matches('D').len();
        assert!(head > 1000 && tail > 1000, "{content}");
        assert!(
            content.len() <= result_cap(context) / 2,
            "{}",
            content.len()
        );
        let cut_bytes = result_cap(context) - head - tail;
        assert!(
            content.contains(&format!("{cut_bytes} bytes cut")),
            "{content}"
        );
        assert!(content.contains("re-read"), "{content}");
        // A conversation that fits is left as it is.
        assert_eq!(fit_last_turn(&msgs[..2], &system, &[], context), msgs[..2]);
        let small = parallel_reads(2, 1000);
        assert_eq!(fit_last_turn(&small, &system, &[], context), small);
    }

    #[test]
    fn cut_middle_keeps_head_and_tail_on_char_boundaries() {
        let s = format!("{}{}", "é".repeat(3000), "z".repeat(3000));
        let c = cut_middle(&s, 1000);
        assert!(c.len() < 1100, "{}", c.len());
        assert!(c.starts_with('é') && c.ends_with('z'));
        assert!(c.contains("bytes cut from the middle"));
        assert_eq!(cut_middle("short", 1000), "short");
    }

    #[test]
    fn the_summary_request_fits_half_the_context() {
        let mut msgs = vec![text(Role::User, "go")];
        for i in 0..200 {
            msgs.extend(step(i, 50_000));
        }
        let r = summary_request(&msgs, 20_000);
        assert!(r.starts_with(MARKER));
        assert!(r.len() < 31_000, "{}", r.len());
        assert!(r.contains("older lines are left out"));
    }

    #[test]
    fn context_sizes_by_family() {
        assert_eq!(default_context_tokens("claude-sonnet-4-5"), 200_000);
        assert_eq!(default_context_tokens("gpt-4o-mini"), 128_000);
        assert_eq!(default_context_tokens("llama3"), 128_000);
    }
}
