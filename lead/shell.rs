//! Install and shell integration: `lead completions SHELL`, `lead man [--dir DIR]` and the
//! hidden `lead complete-names members|tasks` that the bash completion asks for names.
//!
//! The scripts and pages are generated from the clap command itself (`clap_complete`,
//! `clap_mangen`), so they never drift from the CLI. Static completion cannot know a team's
//! members or tasks; for bash, a small function ([`bash_names`]) is appended to clap's script:
//! where a command takes a member name or a task id (`lead logs NAME`, `lead task show ID`,
//! `lead task add --owner NAME`) it completes from `lead complete-names`, run on the team dir
//! the command line names (or the one `lead` finds), and everywhere else it hands over to
//! clap's `_lead`. Which argument takes what is the table [`NAMED`], checked against the clap
//! command by a unit test. zsh and fish get clap's plain script.
//!
//! Everything is rendered into memory and printed with the pipe-safe macros: a reader that goes
//! away (`lead man | head`) ends `lead` quietly, as everywhere else.

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use troupe::{print, println};

use anyhow::Context;
use clap::{Command, CommandFactory};
use troupe::TeamDir;
use troupe::config::Roster;
use troupe::tasks::TaskStore;

#[derive(Debug, clap::Args)]
pub struct CompletionsArgs {
    shell: Shell,
}

/// The shells `lead completions` writes for.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Shell {
    Bash,
    Zsh,
    Fish,
}

#[derive(Debug, clap::Args)]
pub struct ManArgs {
    /// Write lead.1, one lead-COMMAND.1 per command and worker.1 into this directory (made
    /// if missing) instead of printing lead(1).
    #[arg(long, value_name = "DIR")]
    dir: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct NamesArgs {
    kind: Names,
}

/// What `lead complete-names` lists, one a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Names {
    /// The members in the roster, in its order.
    Members,
    /// Every task's id, oldest first.
    Tasks,
}

impl Names {
    fn as_str(self) -> &'static str {
        match self {
            Names::Members => "members",
            Names::Tasks => "tasks",
        }
    }
}

/// The arguments the bash completion fills from `lead complete-names`: the command path
/// (subcommands joined by `/`), the argument's clap id (a positional or an option), and what
/// it names.
const NAMED: [(&str, &str, Names); 9] = [
    ("logs", "name", Names::Members),
    ("send", "name", Names::Members),
    ("shutdown", "name", Names::Members),
    ("worktree/remove", "name", Names::Members),
    ("task/add", "owner", Names::Members),
    ("task/show", "id", Names::Tasks),
    ("task/cancel", "id", Names::Tasks),
    ("task/reopen", "id", Names::Tasks),
    ("task/add", "blocked_by", Names::Tasks),
];

/// The lead's clap command, as the completion scripts and man pages describe it.
fn lead_command() -> Command {
    let mut cmd = crate::Cli::command().disable_help_subcommand(true);
    cmd.build();
    cmd
}

/// `lead completions SHELL`: prints the completion script.
pub fn completions(a: CompletionsArgs) -> anyhow::Result<u8> {
    let mut cmd = crate::Cli::command();
    let shell = match a.shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    // Into memory first: clap_complete panics on a failed write, such as a closed pipe.
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, "lead", &mut out);
    let mut script = String::from_utf8(out).context("the completion script is not UTF-8")?;
    if let Shell::Bash = a.shell {
        script = bash_defaults(&script)?;
        script.push_str(&bash_names(&lead_command())?);
    }
    print!("{script}");
    Ok(0)
}

/// `lead man [--dir DIR]`: prints lead(1), or writes every page into DIR and prints their paths.
pub fn man(a: ManArgs) -> anyhow::Result<u8> {
    let cmd = lead_command();
    let Some(dir) = a.dir else {
        print!("{}", render(&cmd)?);
        return Ok(0);
    };
    std::fs::create_dir_all(&dir)
        .with_context(|| format!("failed to create the man page dir {}", dir.display()))?;
    let mut pages = Vec::new();
    collect_pages(&cmd, &mut pages);
    let mut worker = crate::worker::Args::command();
    worker.build();
    pages.push(worker);
    for page in &pages {
        let path = dir.join(clap_mangen::Man::new(page.clone()).get_filename());
        std::fs::write(&path, render(page)?)
            .with_context(|| format!("failed to write the man page {}", path.display()))?;
        println!("{}", path.display());
    }
    Ok(0)
}

/// `cmd` and its visible subcommands, at any depth, parents first.
fn collect_pages(cmd: &Command, out: &mut Vec<Command>) {
    out.push(cmd.clone());
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        collect_pages(sub, out);
    }
}

fn render(cmd: &Command) -> anyhow::Result<String> {
    let mut out = Vec::new();
    clap_mangen::Man::new(cmd.clone())
        .render(&mut out)
        .with_context(|| format!("failed to render the man page of {}", cmd.get_name()))?;
    String::from_utf8(out).context("the man page is not UTF-8")
}

/// `lead complete-names members|tasks`: the names on `team_dir`, one a line. Silent, and exit
/// 0, when there is no team or it cannot be read: a completion must never print an error into
/// the command line being typed.
pub fn names(team_dir: &Path, a: NamesArgs) -> anyhow::Result<u8> {
    let Ok(team) = TeamDir::open(team_dir) else {
        return Ok(0);
    };
    let names: Vec<String> = match a.kind {
        Names::Members => Roster::new(&team)
            .load()
            .map(|cfg| cfg.members.into_iter().map(|m| m.name).collect())
            .unwrap_or_default(),
        Names::Tasks => TaskStore::new(&team)
            .list(None)
            .map(|tasks| tasks.into_iter().map(|t| t.id).collect())
            .unwrap_or_default(),
    };
    for n in names {
        println!("{n}");
    }
    Ok(0)
}

/// The line [`bash_defaults`] puts first in clap's `_lead`.
const BASH_DEFAULT_ARGS: &str = r#"    (( $# )) || set -- "${COMP_WORDS[0]}" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}""#;

/// clap's bash script with its `_lead` made to work when called by hand with no arguments
/// (`COMP_WORDS=(lead sp) COMP_CWORD=1 _lead`, as in a script that checks the completion): it
/// then takes the command, the current word and the previous one from `COMP_WORDS`, as bash
/// passes them.
fn bash_defaults(script: &str) -> anyhow::Result<String> {
    let head = "_lead() {\n";
    let at = script
        .find(head)
        .context("internal: clap's bash script has no _lead function")?
        + head.len();
    Ok(format!(
        "{}{BASH_DEFAULT_ARGS}\n{}",
        &script[..at],
        &script[at..]
    ))
}

/// The bash function appended to clap's script (see the module), generated from `cmd`: which
/// words are subcommands, which options take a value, and where [`NAMED`]'s arguments sit.
fn bash_names(cmd: &Command) -> anyhow::Result<String> {
    let (mut parents, mut value_opts, mut hidden) = Default::default();
    walk(cmd, "", &mut parents, &mut value_opts, &mut hidden);
    let globals: Vec<String> = cmd
        .get_arguments()
        .filter(|a| a.is_global_set() && a.get_action().takes_values())
        .filter_map(|a| a.get_long().map(|l| format!("--{l}")))
        .collect();
    let (mut by_pos, mut by_opt) = (Vec::new(), Vec::new());
    for (path, id, kind) in NAMED {
        let sub = path
            .split('/')
            .try_fold(cmd, |c, name| c.find_subcommand(name))
            .with_context(|| format!("internal: no command {path}"))?;
        if let Some(pos) = sub.get_positionals().position(|a| a.get_id() == id) {
            by_pos.push((format!("\"{path} {pos}\""), kind));
        } else {
            let long = sub
                .get_opts()
                .find(|a| a.get_id() == id)
                .and_then(|a| a.get_long())
                .with_context(|| format!("internal: {path} has no argument {id}"))?;
            by_opt.push((format!("\"{path} --{long}\""), kind));
        }
    }
    let cases = |entries: &[(String, Names)]| {
        let mut s = String::new();
        for kind in [Names::Members, Names::Tasks] {
            let words: Vec<&str> = entries
                .iter()
                .filter(|(_, k)| *k == kind)
                .map(|(w, _)| w.as_str())
                .collect();
            if !words.is_empty() {
                let _ = writeln!(
                    s,
                    "            {}) kind={} ;;",
                    words.join(" | "),
                    kind.as_str()
                );
            }
        }
        s
    };
    let parents: Vec<String> = parents.iter().map(|p| format!("\"{p}\"")).collect();
    let value_opts: Vec<&str> = value_opts.iter().map(String::as_str).collect();
    // `''` (an empty word, which no completion is) keeps the pattern well-formed.
    let hidden: Vec<&str> = hidden.iter().map(String::as_str).chain(["''"]).collect();
    let globals_eq: Vec<String> = globals.iter().map(|g| format!("{g}=*")).collect();
    let globals_case = globals
        .iter()
        .map(|g| format!("$value == {g}"))
        .collect::<Vec<_>>()
        .join(" || ");
    Ok(format!(
        r#"
# troupe: member names and task ids, from `lead complete-names`, where a command takes one
# (`lead logs NAME`, `lead task show ID`, ...); everything else is clap's `_lead` above.
_lead_troupe() {{
    local cur="${{COMP_WORDS[COMP_CWORD]}}" path="" npos=0 value="" kind="" w i
    local -a team=()
    for (( i = 1; i < COMP_CWORD; i++ )); do
        w="${{COMP_WORDS[i]}}"
        if [[ -n $value ]]; then
            [[ $w == = ]] && continue
            if [[ {globals_case} ]]; then
                team+=("$value" "$w")
            fi
            value=""
            continue
        fi
        case $w in
            {globals_eq}) team+=("$w") ;;
            {value_opts}) value=$w ;;
            -*) ;;
            *)
                case $path in
                    {parents}) if (( npos == 0 )); then path="${{path:+$path/}}$w"; else npos=$((npos + 1)); fi ;;
                    *) npos=$((npos + 1)) ;;
                esac
                ;;
        esac
    done
    if [[ -n $value ]]; then
        case "$path $value" in
{opt_cases}        esac
    elif [[ $cur != -* ]]; then
        case "$path $npos" in
{pos_cases}        esac
    fi
    if [[ -z $kind ]]; then
        _lead "$@"
        local -a shown=()
        for w in "${{COMPREPLY[@]}}"; do
            case $w in
                {hidden}) ;;
                *) shown+=("$w") ;;
            esac
        done
        COMPREPLY=("${{shown[@]}}")
        return
    fi
    local names
    names=$("${{COMP_WORDS[0]}}" "${{team[@]}}" complete-names "$kind" 2>/dev/null)
    COMPREPLY=($(compgen -W "$names" -- "$cur"))
}}

if [[ "${{BASH_VERSINFO[0]}}" -eq 4 && "${{BASH_VERSINFO[1]}}" -ge 4 || "${{BASH_VERSINFO[0]}}" -gt 4 ]]; then
    complete -F _lead_troupe -o nosort -o bashdefault -o default lead
else
    complete -F _lead_troupe -o bashdefault -o default lead
fi
"#,
        globals_eq = globals_eq.join("|"),
        value_opts = value_opts.join("|"),
        parents = parents.join("|"),
        hidden = hidden.join("|"),
        opt_cases = cases(&by_opt),
        pos_cases = cases(&by_pos),
    ))
}

/// Gathers the paths of commands that have subcommands (`""` for `lead` itself, `task`, ...),
/// every option, long or short, that takes a value, and the names of hidden subcommands
/// (clap's bash script offers them; the wrapper takes them out).
fn walk(
    cmd: &Command,
    path: &str,
    parents: &mut BTreeSet<String>,
    opts: &mut BTreeSet<String>,
    hidden: &mut BTreeSet<String>,
) {
    for a in cmd.get_opts().filter(|a| a.get_action().takes_values()) {
        opts.extend(a.get_long().map(|l| format!("--{l}")));
        opts.extend(a.get_short().map(|s| format!("-{s}")));
    }
    if cmd.has_subcommands() {
        parents.insert(path.to_owned());
    }
    for sub in cmd.get_subcommands() {
        if sub.is_hide_set() {
            hidden.insert(sub.get_name().to_owned());
        }
        let p = if path.is_empty() {
            sub.get_name().to_owned()
        } else {
            format!("{path}/{}", sub.get_name())
        };
        walk(sub, &p, parents, opts, hidden);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_named_argument_is_in_the_cli() {
        let script = bash_names(&lead_command()).unwrap();
        assert!(script.contains("\"logs 0\""), "{script}");
        assert!(script.contains("\"task/add --owner\""), "{script}");
        assert!(script.contains("--team-dir=*"), "{script}");
    }
}
