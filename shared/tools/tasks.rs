//! The task tools: the team's task board ([`crate::tasks`]) as agents use it. A refusal (a
//! blocked task, one owned by another, an unknown id, a cycle) comes back to the model as an
//! error result that says why.

use serde_json::{Value, json};

use super::{ToolOutput, check_input, input_str, spec};
use crate::llm::ToolSpec;
use crate::tasks::{NewTask, Task, TaskStatus, TaskStore};
use crate::teamdir::{LEAD, TeamDir};

/// A task as the model sees it.
fn show(t: &Task) -> Value {
    let mut v = json!({
        "task_id": t.id, "subject": t.subject, "description": t.description,
        "status": t.status.as_str(), "owner": t.owner, "blocked_by": t.blocked_by,
        "result": t.result,
    });
    let note = if t.status == TaskStatus::Completing {
        Some(
            "held until the team's task_completed hooks pass it (and, for work in a worktree, \
             until the merge queue has landed it); if it is sent back, you get a message saying \
             why and the task is in_progress again",
        )
    } else if t.created_hook_pending {
        Some("nobody can claim it until the team's task_created hooks pass it")
    } else {
        None
    };
    if let Some(note) = note {
        v["note"] = json!(note);
    }
    v
}

fn out(v: Value) -> ToolOutput {
    ToolOutput::ok(serde_json::to_string_pretty(&v).unwrap_or_default())
}

fn status_of(input: &Value, key: &str) -> Result<Option<TaskStatus>, String> {
    match input.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => s.parse::<TaskStatus>().map(Some).map_err(|e| e.to_string()),
        Some(_) => Err(format!("{key} must be a string")),
    }
}

fn task_list_spec() -> ToolSpec {
    spec(
        "task_list",
        "List the team's tasks (oldest first), optionally only those with a status: pending, in_progress, completed or cancelled.",
        json!({"status": {"type": "string", "enum": ["pending", "in_progress", "completed", "cancelled"]}}),
        &[],
    )
}

fn task_get_spec() -> ToolSpec {
    spec(
        "task_get",
        "Show one task.",
        json!({"task_id": {"type": "string"}}),
        &["task_id"],
    )
}

fn task_create_spec() -> ToolSpec {
    spec(
        "task_create",
        "Add a task to the team's board; blocked_by lists the ids of tasks that must be completed first.",
        json!({
            "subject": {"type": "string"},
            "description": {"type": "string"},
            "blocked_by": {"type": "array", "items": {"type": "string"}}
        }),
        &["subject"],
    )
}

/// The teammate's task tools, in a fixed order.
pub fn teammate_specs() -> Vec<ToolSpec> {
    vec![
        task_list_spec(),
        task_get_spec(),
        spec(
            "task_claim",
            "Claim a task to work on: the one named, or without task_id the oldest one you may take (pending, unowned, every blocker completed).",
            json!({"task_id": {"type": "string"}}),
            &[],
        ),
        spec(
            "task_update",
            "Change a task you own: status completed (with its result) when done, or pending to give it back.",
            json!({
                "task_id": {"type": "string"},
                "status": {"type": "string", "enum": ["completed", "pending"]},
                "result": {"type": "string"}
            }),
            &["task_id", "status"],
        ),
        task_create_spec(),
    ]
}

/// The LLM lead's task tools, in a fixed order.
pub fn lead_specs() -> Vec<ToolSpec> {
    vec![
        task_create_spec(),
        task_list_spec(),
        task_get_spec(),
        spec(
            "task_assign",
            "Give a pending task to a teammate.",
            json!({"task_id": {"type": "string"}, "teammate": {"type": "string"}}),
            &["task_id", "teammate"],
        ),
        spec(
            "task_cancel",
            "Cancel a task (refused while other tasks wait on it).",
            json!({"task_id": {"type": "string"}}),
            &["task_id"],
        ),
    ]
}

/// Runs task tool `name` for agent `who` (incarnation `incarnation`; the lead is `lead`), or
/// `None` when `name` is not a task tool of that agent.
pub fn run(
    team: &TeamDir,
    who: &str,
    incarnation: u64,
    name: &str,
    input: &Value,
) -> Option<ToolOutput> {
    let lead = who == LEAD;
    let known = if lead {
        lead_specs().iter().any(|s| s.name == name)
    } else {
        teammate_specs().iter().any(|s| s.name == name)
    };
    if !known {
        return None;
    }
    let store = TaskStore::new(team);
    let result = (|| -> Result<ToolOutput, String> {
        check_input(input)?;
        Ok(match name {
            "task_list" => {
                let tasks = store
                    .list(status_of(input, "status")?)
                    .map_err(|e| e.to_string())?;
                out(json!({"tasks": tasks.iter().map(show).collect::<Vec<_>>()}))
            }
            "task_get" => out(show(
                &store
                    .get(input_str(input, "task_id")?)
                    .map_err(|e| e.to_string())?,
            )),
            "task_create" => {
                let blocked_by = match input.get("blocked_by") {
                    None | Some(Value::Null) => Vec::new(),
                    Some(Value::Array(a)) => a
                        .iter()
                        .map(|v| {
                            v.as_str()
                                .map(str::to_owned)
                                .ok_or_else(|| "blocked_by must list task ids".to_owned())
                        })
                        .collect::<Result<_, _>>()?,
                    Some(_) => return Err("blocked_by must be an array of task ids".into()),
                };
                let description = match input.get("description") {
                    None | Some(Value::Null) => String::new(),
                    Some(Value::String(s)) => s.clone(),
                    Some(_) => return Err("description must be a string".into()),
                };
                let t = store
                    .create(NewTask {
                        subject: input_str(input, "subject")?.to_owned(),
                        description,
                        blocked_by,
                        owner: None,
                        created_by: who.to_owned(),
                    })
                    .map_err(|e| e.to_string())?;
                out(show(&t))
            }
            "task_claim" => {
                let id = match input.get("task_id") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.as_str()),
                    Some(_) => return Err("task_id must be a string".into()),
                };
                out(show(
                    &store
                        .claim(id, who, incarnation)
                        .map_err(|e| e.to_string())?,
                ))
            }
            "task_update" => {
                let status = status_of(input, "status")?.ok_or("status is required")?;
                let result = match input.get("result") {
                    None | Some(Value::Null) => None,
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(_) => return Err("result must be a string".into()),
                };
                out(show(
                    &store
                        .update(input_str(input, "task_id")?, who, status, result)
                        .map_err(|e| e.to_string())?,
                ))
            }
            "task_assign" => {
                let to = input_str(input, "teammate")?;
                let cfg = crate::config::Roster::new(team)
                    .load()
                    .map_err(|e| e.to_string())?;
                if cfg.member(to).is_none() {
                    return Err(format!("no teammate named {to:?}; spawn it first"));
                }
                out(show(
                    &store
                        .assign(input_str(input, "task_id")?, to)
                        .map_err(|e| e.to_string())?,
                ))
            }
            "task_cancel" => {
                let cancelled = store
                    .cancel(input_str(input, "task_id")?, false)
                    .map_err(|e| e.to_string())?;
                out(json!({"cancelled": cancelled.iter().map(show).collect::<Vec<_>>()}))
            }
            _ => unreachable!("checked above"),
        })
    })();
    // A new task, a completion or a cancellation may let an idle claimer go on.
    if matches!(name, "task_create" | "task_update" | "task_cancel")
        && result.as_ref().is_ok_and(|o| !o.is_error)
    {
        crate::tasks::wake_claimers(team, Some(who));
    }
    Some(result.unwrap_or_else(ToolOutput::error))
}
