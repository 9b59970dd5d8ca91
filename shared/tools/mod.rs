//! The tools offered to agents: their specs (names and input fields as in the reference design,
//! so prompts and cassettes carry over) and the helpers that parse their input.
//!
//! File tools and `bash` live in [`fs`] and [`bash`]; the protocol and team tools are run by the
//! agent that owns the state they touch (`crate::agent::teammate`, the lead).

pub mod bash;
pub mod confined;
pub mod fs;
mod keeper;
pub mod tasks;

use serde_json::{Map, Value, json};

use crate::events;
use crate::llm::ToolSpec;
use crate::teamdir::TeamDir;

/// Characters of tool output given back to the model, at most.
pub const OUTPUT_CAP: usize = 50_000;

/// Refuses a tool name a model asked for that no tool could have: anything but 1 to 64
/// letters, digits, `_` and `-` (what the providers accept for a tool's name). Checked before
/// the name reaches a heartbeat, an event or the journal's tool timings, all of which a person's
/// terminal shows; the error names it escaped ([`crate::term_text`]).
pub fn check_tool_name(name: &str) -> Result<(), String> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        return Ok(());
    }
    Err(format!(
        "no tool is named \"{}\" (shown escaped, {} characters): a tool's name is 1 to 64 \
         letters, digits, '_' or '-'",
        crate::term_text::cell(name),
        name.chars().count()
    ))
}

/// The name a tool call is recorded under: its own when [`check_tool_name`] passes it, else
/// its escaped form cut to 80 characters, so that no record carries a control character (or a
/// page of text) the model wrote.
pub fn recorded_name(name: &str) -> String {
    match check_tool_name(name) {
        Ok(()) => name.to_owned(),
        Err(_) => crate::term_text::cell(name).chars().take(80).collect(),
    }
}

/// Tools that change the world; closed by the plan gate until a plan is approved.
pub const MUTATING: [&str; 3] = ["bash", "write_file", "edit_file"];

/// What a tool gives back to the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    pub content: String,
    pub is_error: bool,
}

impl ToolOutput {
    /// A successful result.
    pub fn ok(content: impl Into<String>) -> ToolOutput {
        ToolOutput {
            content: content.into(),
            is_error: false,
        }
    }

    /// The result of a tool use in a response cut off by `max_tokens`: its input may be
    /// incomplete, so it is not run.
    pub fn cut_short() -> ToolOutput {
        ToolOutput::error(
            "not run: the response hit max_tokens before this tool call was complete; send a shorter call",
        )
    }

    /// An error result: the model reads the text and carries on.
    pub fn error(content: impl Into<String>) -> ToolOutput {
        ToolOutput {
            content: content.into(),
            is_error: true,
        }
    }
}

fn spec(name: &str, description: &str, properties: Value, required: &[&str]) -> ToolSpec {
    ToolSpec {
        name: name.to_owned(),
        description: description.to_owned(),
        input_schema: json!({"type": "object", "properties": properties, "required": required}),
    }
}

fn bash_spec() -> ToolSpec {
    spec(
        "bash",
        "Run a shell command in the working directory (120 s timeout, output capped at 50,000 characters).",
        json!({"command": {"type": "string", "description": "The command line to run with bash -c."}}),
        &["command"],
    )
}

fn read_file_spec() -> ToolSpec {
    spec(
        "read_file",
        "Read a text file inside the working directory.",
        json!({"path": {"type": "string"}, "limit": {"type": "integer", "description": "Read at most this many lines."}}),
        &["path"],
    )
}

fn write_file_spec() -> ToolSpec {
    spec(
        "write_file",
        "Create or replace a file inside the working directory (parent directories are created).",
        json!({"path": {"type": "string"}, "content": {"type": "string"}}),
        &["path", "content"],
    )
}

fn edit_file_spec() -> ToolSpec {
    spec(
        "edit_file",
        "Replace the one occurrence of old_text with new_text in a file inside the working directory.",
        json!({"path": {"type": "string"}, "old_text": {"type": "string"}, "new_text": {"type": "string"}}),
        &["path", "old_text", "new_text"],
    )
}

fn send_message_spec() -> ToolSpec {
    spec(
        "send_message",
        "Send a message to a teammate or to the lead (name \"lead\").",
        json!({"to": {"type": "string"}, "content": {"type": "string"}}),
        &["to", "content"],
    )
}

fn read_inbox_spec() -> ToolSpec {
    spec(
        "read_inbox",
        "Read and consume the new messages in your inbox now.",
        json!({}),
        &[],
    )
}

/// The teammate's `shutdown_response{request_id, approve, reason?}`.
pub fn teammate_shutdown_response_spec() -> ToolSpec {
    spec(
        "shutdown_response",
        "Answer the lead's shutdown request: approve to finish and exit, or reject with a reason to keep working.",
        json!({"request_id": {"type": "string"}, "approve": {"type": "boolean"}, "reason": {"type": "string"}}),
        &["request_id", "approve"],
    )
}

/// The teammate's `plan_approval{plan}` (submit).
pub fn teammate_plan_approval_spec() -> ToolSpec {
    spec(
        "plan_approval",
        "Submit a plan to the lead for approval; the answer arrives in your inbox as a plan_approval_response.",
        json!({"plan": {"type": "string"}}),
        &["plan"],
    )
}

/// The tools of a teammate, in a fixed order (stable for prompt caching). With the plan gate
/// closed, the mutating tools are left out.
pub fn teammate_specs(gate_open: bool) -> Vec<ToolSpec> {
    let mut v = Vec::new();
    if gate_open {
        v.push(bash_spec());
    }
    v.push(read_file_spec());
    if gate_open {
        v.push(write_file_spec());
        v.push(edit_file_spec());
    }
    v.extend([
        send_message_spec(),
        read_inbox_spec(),
        teammate_shutdown_response_spec(),
        teammate_plan_approval_spec(),
    ]);
    v.extend(tasks::teammate_specs());
    v
}

/// The tools of the LLM lead, in a fixed order.
pub fn lead_specs() -> Vec<ToolSpec> {
    vec![
        bash_spec(),
        read_file_spec(),
        write_file_spec(),
        edit_file_spec(),
        spec(
            "spawn_teammate",
            "Spawn (or reactivate) a teammate process with a name, a role and instructions.",
            json!({
                "name": {"type": "string", "description": "Lower-case letters, digits, - and _; starts with a letter."},
                "role": {"type": "string"},
                "prompt": {"type": "string", "description": "The teammate's task and instructions."},
                "require_plan_approval": {"type": "boolean", "description": "The teammate must have a plan approved before it may change anything."},
                "model": {"type": "string", "description": "Model id for this teammate (default: the team's)."},
                "auto_claim": {"type": "boolean", "description": "The teammate claims tasks of the board by itself whenever it would go idle."}
            }),
            &["name", "role", "prompt"],
        ),
        spec(
            "list_teammates",
            "List the teammates with their status.",
            json!({}),
            &[],
        ),
        send_message_spec(),
        read_inbox_spec(),
        spec(
            "broadcast",
            "Send a message to every running teammate.",
            json!({"content": {"type": "string"}}),
            &["content"],
        ),
        spec(
            "shutdown_request",
            "Ask a teammate to shut down; returns the request_id.",
            json!({"teammate": {"type": "string"}}),
            &["teammate"],
        ),
        spec(
            "shutdown_response",
            "Check the status of a shutdown request.",
            json!({"request_id": {"type": "string"}}),
            &["request_id"],
        ),
        spec(
            "plan_approval",
            "Approve or reject a teammate's plan, with feedback.",
            json!({"request_id": {"type": "string"}, "approve": {"type": "boolean"}, "feedback": {"type": "string"}}),
            &["request_id", "approve"],
        ),
        spec(
            "list_requests",
            "List protocol requests, optionally by status (pending, approved, rejected, expired).",
            json!({"status": {"type": "string"}}),
            &[],
        ),
        spec(
            "request_status",
            "Show one protocol request.",
            json!({"request_id": {"type": "string"}}),
            &["request_id"],
        ),
    ]
    .into_iter()
    .chain(tasks::lead_specs())
    .collect()
}

/// The input as an object; a string means the model sent arguments that were not valid JSON.
pub fn check_input(input: &Value) -> Result<&Map<String, Value>, String> {
    match input {
        Value::Object(m) => Ok(m),
        Value::String(raw) => Err(format!(
            "invalid tool arguments: not a JSON object: {}",
            raw.chars().take(200).collect::<String>()
        )),
        other => Err(format!(
            "invalid tool arguments: expected a JSON object, got {other}"
        )),
    }
}

/// A required string field.
pub fn input_str<'a>(input: &'a Value, field: &str) -> Result<&'a str, String> {
    match input.get(field) {
        Some(Value::String(s)) => Ok(s),
        Some(_) => Err(format!("field {field:?} must be a string")),
        None => Err(format!("missing required field {field:?} (string)")),
    }
}

/// An optional string field.
pub fn input_opt_str<'a>(input: &'a Value, field: &str) -> Result<Option<&'a str>, String> {
    match input.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(format!("field {field:?} must be a string")),
    }
}

/// A required boolean field (`"true"`/`"false"` strings are accepted: small models send them).
pub fn input_bool(input: &Value, field: &str) -> Result<bool, String> {
    match input.get(field) {
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s == "true" => Ok(true),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(_) => Err(format!("field {field:?} must be a boolean")),
        None => Err(format!("missing required field {field:?} (boolean)")),
    }
}

/// An optional non-negative integer field.
pub fn input_opt_u64(input: &Value, field: &str) -> Result<Option<u64>, String> {
    match input.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| format!("field {field:?} must be a non-negative integer")),
    }
}

/// Cuts `s` to [`OUTPUT_CAP`] characters, saying how much was cut.
pub fn cap_output(s: String) -> String {
    let n = s.chars().count();
    if n <= OUTPUT_CAP {
        return s;
    }
    let kept: String = s.chars().take(OUTPUT_CAP).collect();
    format!(
        "{kept}\n[output truncated: {} more characters not shown]",
        n - OUTPUT_CAP
    )
}

/// A one-line description of a tool call for the audit log and the demo timeline: the path,
/// command, recipient or request it names, cut to 120 characters. Never the file contents or
/// message text in full.
pub fn describe_call(name: &str, input: &Value) -> String {
    let field = |f: &str| input.get(f).and_then(Value::as_str).unwrap_or("");
    let text = match name {
        "bash" => field("command").to_owned(),
        "read_file" | "write_file" | "edit_file" => field("path").to_owned(),
        "send_message" => format!("to {}", field("to")),
        "spawn_teammate" => format!("{} ({})", field("name"), field("role")),
        "shutdown_request" => field("teammate").to_owned(),
        "plan_approval" if input.get("request_id").is_some() => format!(
            "{} {}",
            field("request_id"),
            match input.get("approve").and_then(Value::as_bool) {
                Some(true) => "approve",
                Some(false) => "reject",
                None => "?",
            }
        ),
        "shutdown_response" => {
            let verdict = match input.get("approve").and_then(Value::as_bool) {
                Some(true) => " approve",
                Some(false) => " reject",
                None => "",
            };
            format!("{}{verdict}", field("request_id"))
        }
        "request_status" => field("request_id").to_owned(),
        _ => String::new(),
    };
    let one_line = text.replace('\n', " ");
    if one_line.chars().count() > 120 {
        format!("{}...", one_line.chars().take(117).collect::<String>())
    } else {
        one_line
    }
}

/// Records a finished tool call in `events.jsonl` as a `tool` event.
pub fn log_call(team: &TeamDir, agent: &str, name: &str, input: &Value, out: &ToolOutput) {
    events::log(
        team,
        "tool",
        json!({"name": agent, "tool": name, "detail": describe_call(name, input), "ok": !out.is_error}),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_names_are_short_words() {
        let (longest, too_long) = ("a".repeat(64), "a".repeat(65));
        for ok in ["bash", "task_claim", "x-1", &longest] {
            assert!(check_tool_name(ok).is_ok(), "{ok}");
            assert_eq!(recorded_name(ok), ok);
        }
        for bad in ["", "a b", "bash\n", "x\u{1b}]2;T\u{7}", "é", &too_long] {
            let e = check_tool_name(bad).unwrap_err();
            assert!(!e.chars().any(char::is_control), "{e:?}");
            assert!(!recorded_name(bad).chars().any(char::is_control));
        }
        assert_eq!(recorded_name("x\u{1b}]2;T\u{7}"), r"x\x1b]2;T\x07");
        assert!(
            check_tool_name("x\u{1b}]2;T\u{7}")
                .unwrap_err()
                .starts_with(r#"no tool is named "x\x1b]2;T\x07" (shown escaped, 7 characters)"#)
        );
    }
}
