//! `lead merge`: the merge queue by hand (see [`troupe::merge`]). `lead merge NAME` queues the
//! tip of NAME's worktree branch; `--list [--json]` shows the entries, oldest first;
//! `--cancel ID` and `--retry ID` take an entry out and put one back.

use serde_json::json;
use troupe::TeamDir;
use troupe::config::Roster;
use troupe::merge::{MergeStore, NewEntry};

#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("what").required(true).args(["name", "list", "cancel", "retry"]))]
pub struct MergeArgs {
    /// Queue the tip of this worktree member's branch (`troupe/NAME`).
    name: Option<String>,
    /// List the entries, oldest first.
    #[arg(long)]
    list: bool,
    /// Take this open entry out of the queue.
    #[arg(long, value_name = "ID")]
    cancel: Option<String>,
    /// Queue again a stopped, sent-back or cancelled entry.
    #[arg(long, value_name = "ID")]
    retry: Option<String>,
    #[arg(long)]
    json: bool,
}

pub fn merge(team: &TeamDir, a: MergeArgs) -> anyhow::Result<u8> {
    let store = MergeStore::new(team);
    if a.list {
        let mut all = store.list()?;
        all.sort_by(|x, y| {
            x.queued_at
                .total_cmp(&y.queued_at)
                .then_with(|| x.id.cmp(&y.id))
        });
        if a.json {
            println!("{}", serde_json::to_string_pretty(&all)?);
            return Ok(0);
        }
        if all.is_empty() {
            println!("the merge queue is empty");
            return Ok(0);
        }
        println!(
            "{:<8}  {:<12} {:<9} {:<8} {:<7}  STATE",
            "ID", "MEMBER", "TASK", "COMMIT", "TRIES"
        );
        for e in &all {
            // An entry's file can be written by hand, and its report quotes a check's output.
            let row = format!(
                "{:<8}  {:<12} {:<9} {:<8} {:<7}  {}{}",
                e.id,
                e.member,
                e.task.as_deref().unwrap_or("-"),
                troupe::merge::short(&e.commit),
                e.attempts,
                troupe::merge::describe(e),
                e.report
                    .as_deref()
                    .map(|r| format!(": {}", r.lines().next().unwrap_or_default()))
                    .unwrap_or_default()
            );
            println!("{}", troupe::term_text::line(&row));
        }
        return Ok(0);
    }
    let (entry, verb) = if let Some(id) = &a.cancel {
        (store.cancel(id)?, "cancelled")
    } else if let Some(id) = &a.retry {
        (store.retry(id)?, "queued again")
    } else {
        let name = a.name.as_deref().unwrap_or_default();
        troupe::teamdir::AgentName::teammate(name)?;
        let cfg = Roster::new(team).load()?;
        let m = cfg
            .member(name)
            .ok_or_else(|| troupe::Error::UnknownMember(name.to_owned()))?;
        let Some(wt) = &m.worktree else {
            return Err(crate::ExitError {
                code: 2,
                message: format!(
                    "{name} has no worktree (lead spawn {name} --worktree): nothing to merge"
                ),
            }
            .into());
        };
        // Taken from the member's store by a fetch that checks every object.
        let Some(commit) = troupe::worktree::take_branch(wt)? else {
            return Err(crate::ExitError {
                code: 2,
                message: format!("{name}'s branch {} does not exist", wt.branch),
            }
            .into());
        };
        let (entry, new) = store.enqueue(&NewEntry {
            member: name.to_owned(),
            branch: wt.branch.clone(),
            commit,
            task: None,
            host: m.host.clone(),
        })?;
        (entry, if new { "queued" } else { "already queued" })
    };
    if a.json {
        println!("{}", json!({"result": verb, "entry": entry}));
    } else {
        println!(
            "{}",
            troupe::term_text::line(&format!(
                "{} {} ({} at {})",
                verb,
                entry.id,
                entry.branch,
                troupe::merge::short(&entry.commit)
            ))
        );
    }
    Ok(0)
}
