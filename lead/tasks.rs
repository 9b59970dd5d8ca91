//! `lead task ...`: the team's task board from the shell (`tasks/ID.json`, see
//! `shared/tasks.rs`). Each command prints a table or a line, or with `--json` one JSON
//! document on stdout; refusals exit with the library's codes (3 unknown id, 4 refused).

use std::path::Path;
use troupe::println;

use serde_json::json;
use troupe::config::Roster;
use troupe::tasks::{NewTask, Task, TaskStatus, TaskStore};
use troupe::teamdir::LEAD;
use troupe::term_text;
use troupe::{AgentName, TeamDir};

#[derive(Debug, clap::Args)]
pub struct TaskArgs {
    #[command(subcommand)]
    cmd: TaskCmd,
}

#[derive(Debug, clap::Subcommand)]
enum TaskCmd {
    /// Add a pending task; prints its id.
    Add(AddArgs),
    /// List tasks, oldest first.
    List(ListArgs),
    /// Show one task.
    Show(IdArgs),
    /// Cancel a pending or in-progress task (with --cascade, the open tasks that wait on it too).
    Cancel(CancelArgs),
    /// Put a completed or cancelled task back to pending, owner cleared.
    Reopen(IdArgs),
}

#[derive(Debug, clap::Args)]
struct AddArgs {
    subject: String,
    #[arg(long, default_value = "")]
    description: String,
    /// A task that must be completed before this one can be claimed (repeatable).
    #[arg(long = "blocked-by", value_name = "ID")]
    blocked_by: Vec<String>,
    /// Assign it to this teammate (a member in config.json): only it may claim it.
    #[arg(long)]
    owner: Option<String>,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct ListArgs {
    /// Only tasks in this status (pending, in_progress, completing, completed, cancelled).
    #[arg(long)]
    status: Option<TaskStatus>,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct IdArgs {
    id: String,
    #[arg(long)]
    json: bool,
}

#[derive(Debug, clap::Args)]
struct CancelArgs {
    id: String,
    /// Also cancel the pending and in-progress tasks that wait on it, transitively.
    #[arg(long)]
    cascade: bool,
    #[arg(long)]
    json: bool,
}

pub fn run(team_dir: &Path, a: TaskArgs) -> anyhow::Result<u8> {
    match a.cmd {
        // Tasks may come before any spawn: adding one sets up the team dir.
        TaskCmd::Add(a) => {
            // A refused owner leaves no team dir behind.
            if let Some(owner) = &a.owner {
                AgentName::teammate(owner)?;
                let team = TeamDir::open(team_dir)
                    .map_err(|_| troupe::Error::UnknownMember(owner.clone()))?;
                Roster::new(&team).load()?.require(owner)?;
            }
            add(&TeamDir::create(team_dir)?, a)
        }
        TaskCmd::List(a) => list(&TeamDir::open(team_dir)?, a),
        TaskCmd::Show(a) => show(&TeamDir::open(team_dir)?, a),
        TaskCmd::Cancel(a) => cancel(&TeamDir::open(team_dir)?, a),
        TaskCmd::Reopen(a) => reopen(&TeamDir::open(team_dir)?, a),
    }
}

fn add(team: &TeamDir, a: AddArgs) -> anyhow::Result<u8> {
    let t = TaskStore::new(team).create(NewTask {
        subject: a.subject,
        description: a.description,
        blocked_by: a.blocked_by,
        owner: a.owner,
        created_by: LEAD.to_owned(),
    })?;
    if a.json {
        println!("{}", serde_json::to_string(&t)?);
    } else {
        println!("{}", t.id);
    }
    Ok(0)
}

fn list(team: &TeamDir, a: ListArgs) -> anyhow::Result<u8> {
    let tasks = TaskStore::new(team).list(a.status)?;
    if a.json {
        println!("{}", serde_json::to_string(&tasks)?);
        return Ok(0);
    }
    table(&tasks);
    Ok(0)
}

/// The task table of `lead task list` (and `cancel`).
pub(crate) fn table(tasks: &[Task]) {
    println!(
        "{:<9} {:<12} {:<16} {:<18}  SUBJECT",
        "ID", "STATUS", "OWNER", "BLOCKED_BY"
    );
    for t in tasks {
        let blocked = if t.blocked_by.is_empty() {
            "-".to_owned()
        } else {
            t.blocked_by.join(",")
        };
        // A subject is the model's text: escaped before it is cut, so the column keeps its
        // width; the whole row too, since a task file anyone can write gives the rest.
        let subject = t.subject.replace('\n', " ");
        let subject: String = term_text::line(&subject).chars().take(60).collect();
        let row = format!(
            "{:<9} {:<12} {:<16} {:<18}  {subject}",
            t.id,
            t.status.as_str(),
            t.owner.as_deref().unwrap_or("-"),
            blocked,
        );
        println!("{}", term_text::line(&row));
    }
}

fn show(team: &TeamDir, a: IdArgs) -> anyhow::Result<u8> {
    let t = TaskStore::new(team).get(&a.id)?;
    if a.json {
        println!("{}", serde_json::to_string(&t)?);
        return Ok(0);
    }
    let dash = |s: Option<&str>| s.unwrap_or("-").to_owned();
    let owner = match (&t.owner, t.owner_incarnation) {
        (Some(o), Some(i)) => format!("{o} (incarnation {i})"),
        (o, _) => dash(o.as_deref()),
    };
    // Every field is read from the task's file; subject, description and result are a
    // model's text.
    let line = |s: &str| term_text::line(s).into_owned();
    println!("id:          {}", line(&t.id));
    println!("subject:     {}", line(&t.subject));
    println!("status:      {}", t.status);
    if t.created_hook_pending {
        println!("hooks:       waits for the task_created hooks");
    }
    println!("owner:       {}", line(&owner));
    println!(
        "blocked_by:  {}",
        if t.blocked_by.is_empty() {
            "-".to_owned()
        } else {
            line(&t.blocked_by.join(", "))
        }
    );
    println!("created_by:  {}", line(&t.created_by));
    println!("created_at:  {:.3}", t.created_at);
    println!("updated_at:  {:.3}", t.updated_at);
    if let Some(c) = t.completed_at {
        println!("completed_at: {c:.3}");
    }
    if t.completion > 0 {
        println!("completions: {}", t.completion);
    }
    if !t.description.is_empty() {
        println!("description:\n{}", term_text::lines(&t.description));
    }
    if let Some(r) = &t.result {
        println!("result:\n{}", term_text::lines(r));
    }
    Ok(0)
}

fn cancel(team: &TeamDir, a: CancelArgs) -> anyhow::Result<u8> {
    let done = TaskStore::new(team)
        .cancel(&a.id, a.cascade)
        .map_err(|e| match e {
            // Name the flag that does it.
            troupe::Error::TaskRefused { id, why } => troupe::Error::TaskRefused {
                id,
                why: why.replace("(cascade cancels", "(--cascade cancels"),
            },
            e => e,
        })?;
    if a.json {
        println!("{}", json!({ "cancelled": done }));
    } else {
        for t in &done {
            println!("{} cancelled", term_text::line(&t.id));
        }
    }
    Ok(0)
}

fn reopen(team: &TeamDir, a: IdArgs) -> anyhow::Result<u8> {
    let t = TaskStore::new(team).reopen(&a.id)?;
    if a.json {
        println!("{}", serde_json::to_string(&t)?);
    } else {
        println!("{} {}", t.id, t.status);
    }
    Ok(0)
}
