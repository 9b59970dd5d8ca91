//! The documentation (issue 23): README.md is a short front page and docs/ holds one chapter per
//! subject. These checks keep the two honest as the code moves: the README stays short and keeps
//! the commands other files run as written (.ci/run, tests/first_run.rs), every relative link
//! and anchor leads somewhere, docs/cli.md names every command `lead --help` lists, and
//! docs/exit-codes.md lists the exit codes the code defines.
//!
//! Only the subcommand check runs a binary (`lead --help`); the rest reads files.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("failed to read {}: {e}", path.display()))
}

fn readme() -> String {
    read(&root().join("README.md"))
}

/// README.md and every docs/*.md, sorted.
fn markdown_files() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    files.extend(chapters());
    files
}

/// Every docs/*.md, sorted.
fn chapters() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    files.sort();
    files
}

/// The lines of `text` outside fenced code blocks.
fn prose_lines(text: &str) -> Vec<&str> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push(line);
        }
    }
    out
}

/// The contents of each ```sh block, in order.
fn sh_blocks(text: &str) -> Vec<Vec<&str>> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in text.lines() {
        match (&mut current, line.trim_start().starts_with("```")) {
            (None, true) if line.trim() == "```sh" => current = Some(Vec::new()),
            (Some(_), true) => blocks.push(current.take().unwrap()),
            (Some(block), false) => block.push(line),
            _ => {}
        }
    }
    blocks
}

/// The prose of `text` with inline code spans removed (they may span lines), so that a link
/// written inside backticks is not taken for one.
fn prose_without_code(text: &str) -> String {
    let joined = prose_lines(text).join("\n");
    let mut out = String::new();
    let mut in_code = false;
    for c in joined.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            out.push(c);
        }
    }
    out
}

/// The targets of the Markdown links `[text](target)` in `text`, outside code.
fn link_targets(text: &str) -> Vec<String> {
    let prose = prose_without_code(text);
    let mut targets = Vec::new();
    let mut rest = prose.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').expect("a link target ends with ')'");
        targets.push(after[..end].trim().to_owned());
        rest = &after[end..];
    }
    targets
}

/// GitHub's anchor for a heading: lower case, backticks and punctuation dropped, spaces to '-'.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of every heading of a Markdown file.
fn anchors(text: &str) -> BTreeSet<String> {
    prose_lines(text)
        .into_iter()
        .filter(|l| l.starts_with('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect()
}

#[test]
fn readme_is_a_short_front_page() {
    let lines = readme().lines().count();
    assert!(
        lines < 250,
        "README.md has {lines} lines; keep it under 250 and move detail into docs/"
    );
}

#[test]
fn readme_install_command_is_exact() {
    let text = readme();
    let install: Vec<&str> = sh_blocks(&text)
        .into_iter()
        .flatten()
        .map(str::trim)
        .filter(|l| l.starts_with("cargo install"))
        .collect();
    assert_eq!(
        install,
        ["cargo install --locked --path . --root /usr/local"],
        "README.md must install with exactly this command (both binaries into /usr/local/bin, \
         where the systemd units in scripts/ expect them)"
    );
}

/// .ci/run runs the README's first command as a new user would, and its test step runs the
/// second; tests/first_run.rs stands for the first. They must stay first and as written.
#[test]
fn readme_first_commands_are_the_demo_and_the_tests() {
    let text = readme();
    let blocks = sh_blocks(&text);
    let first = blocks.first().expect("README.md has a ```sh block");
    let commands: Vec<&str> = first
        .iter()
        .map(|l| l.split('#').next().unwrap().trim())
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(commands, ["cargo run --bin lead -- demo", "cargo test"]);
}

#[test]
fn relative_links_and_anchors_resolve() {
    let mut broken = Vec::new();
    for file in markdown_files() {
        let text = read(&file);
        let dir = file.parent().unwrap();
        for target in link_targets(&text) {
            if target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = match target.split_once('#') {
                Some((p, a)) => (p, Some(a)),
                None => (target.as_str(), None),
            };
            let dest = if path.is_empty() {
                file.clone()
            } else {
                dir.join(path)
            };
            if !dest.exists() {
                broken.push(format!("{}: {target}: no such file", file.display()));
                continue;
            }
            if let Some(anchor) = anchor
                && !anchors(&read(&dest)).contains(anchor)
            {
                broken.push(format!(
                    "{}: {target}: no heading with that anchor",
                    file.display()
                ));
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn every_chapter_is_listed_in_the_readme_and_links_back() {
    let targets: BTreeSet<String> = link_targets(&readme()).into_iter().collect();
    for chapter in chapters() {
        let name = chapter.file_name().unwrap().to_str().unwrap();
        assert!(
            targets.contains(&format!("docs/{name}")),
            "README.md does not link docs/{name}"
        );
        let text = read(&chapter);
        let head: Vec<&str> = text.lines().take(3).collect();
        assert!(
            head[0].starts_with("# "),
            "docs/{name} starts with its title"
        );
        assert!(
            head.iter().any(|l| l.contains("](../README.md")),
            "docs/{name} opens with a one-line summary and a link back to README.md"
        );
    }
}

/// The subcommands in the `Commands:` section of `lead --help` (without `help`).
fn lead_subcommands() -> Vec<String> {
    let out = Command::new(env!("CARGO_BIN_EXE_lead"))
        .arg("--help")
        .output()
        .expect("run lead --help");
    assert!(out.status.success(), "lead --help failed");
    let help = String::from_utf8(out.stdout).unwrap();
    let section = help
        .split_once("Commands:\n")
        .expect("lead --help has a Commands section")
        .1;
    let names: Vec<String> = section
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| *n != "help")
        .map(str::to_owned)
        .collect();
    assert!(names.len() >= 10, "too few subcommands parsed: {names:?}");
    names
}

#[test]
fn cli_chapter_mentions_every_subcommand() {
    let cli = read(&root().join("docs/cli.md"));
    let missing: Vec<String> = lead_subcommands()
        .into_iter()
        .filter(|name| {
            let needle = format!("lead {name}");
            !cli.match_indices(&needle).any(|(at, _)| {
                cli[at + needle.len()..]
                    .chars()
                    .next()
                    .is_none_or(|c| !c.is_alphanumeric() && c != '-' && c != '_')
            })
        })
        .collect();
    assert!(
        missing.is_empty(),
        "docs/cli.md does not mention `lead {}`",
        missing.join("`, `lead ")
    );
}

/// Every .rs file under the crate's source dirs.
fn sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                let text = read(&path);
                out.push((path, text));
            }
        }
    }
    let mut out = Vec::new();
    for dir in ["shared", "lead", "worker"] {
        walk(&root().join(dir), &mut out);
    }
    out
}

/// The exit codes the code names: constants called `EXIT_*` or `EX_*` (and `up_trust`'s
/// `REFUSED`), and the codes of `Error::exit_code`.
fn defined_exit_codes(sources: &[(PathBuf, String)]) -> BTreeSet<u32> {
    let mut codes = BTreeSet::new();
    for (path, text) in sources {
        for line in text.lines() {
            let Some((_, decl)) = line.split_once("const ") else {
                continue;
            };
            let Some((name, rest)) = decl.split_once(':') else {
                continue;
            };
            let name = name.trim();
            if !(name.starts_with("EXIT_") || name.starts_with("EX_") || name == "REFUSED") {
                continue;
            }
            // Only integers are codes (`EXIT_FLUSH_WAIT` is a `Duration`).
            let ty = rest.split_once('=').map_or("", |(t, _)| t.trim());
            if !matches!(ty, "u8" | "i32" | "u32" | "i64" | "u16" | "usize") {
                continue;
            }
            let value = rest
                .split_once('=')
                .and_then(|(_, v)| v.trim().strip_suffix(';'))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| panic!("{}: cannot read `{}`", path.display(), line.trim()));
            codes.insert(value);
        }
        if path.ends_with("shared/error.rs") {
            let body = text
                .split_once("fn exit_code")
                .expect("shared/error.rs has Error::exit_code")
                .1;
            let body = body
                .split_once("_ =>")
                .expect("exit_code ends with `_ =>`")
                .0;
            for arm in body.split("=> ").skip(1) {
                let digits: String = arm.chars().take_while(char::is_ascii_digit).collect();
                codes.insert(digits.parse().expect("an exit code after `=>`"));
            }
        }
    }
    codes
}

/// The codes docs/exit-codes.md lists: every number written as code, `` `N` ``.
fn documented_exit_codes() -> BTreeSet<u32> {
    let text = read(&root().join("docs/exit-codes.md"));
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|span| span.parse().ok())
        .collect()
}

#[test]
fn exit_codes_chapter_agrees_with_the_code() {
    let sources = sources();
    let defined = defined_exit_codes(&sources);
    let documented = documented_exit_codes();
    assert!(
        defined.len() >= 8,
        "too few exit codes found in the code: {defined:?}"
    );
    let undocumented: Vec<_> = defined.difference(&documented).collect();
    assert!(
        undocumented.is_empty(),
        "exit codes the code defines but docs/exit-codes.md does not list: {undocumented:?}"
    );
    // A broken pipe exits 141, as a shell reports a tool killed by SIGPIPE.
    assert!(documented.contains(&141), "docs/exit-codes.md lists 141");
    // Every documented code is one the code can return, as a constant, a match arm or a literal.
    let all: String = sources.iter().map(|(_, t)| t.as_str()).collect();
    let produced = |n: u32| {
        [
            format!(": u8 = {n};"),
            format!(": i32 = {n};"),
            format!("=> {n},"),
            format!("Ok({n})"),
            format!("ExitCode::from({n})"),
            format!("exit({n})"),
        ]
        .iter()
        .any(|p| all.contains(p.as_str()))
    };
    let unknown: Vec<_> = documented.iter().filter(|n| !produced(**n)).collect();
    assert!(
        unknown.is_empty(),
        "docs/exit-codes.md lists codes the code never returns: {unknown:?}"
    );
}

/// The README's tour, run as a reader runs it: its two shell blocks (the cassette's `export`,
/// then the script) in `bash -e` from the clone's root, with the built `lead` and `worker`
/// first on `PATH` and no key. It must end with alice's work on disk and every process gone.
#[test]
fn readme_tour_runs_as_printed() {
    if Command::new("jq").arg("--version").output().is_err() {
        assert!(
            std::env::var_os("CI").is_none(),
            "jq is missing: the tour needs it (.ci/run installs it)"
        );
        eprintln!("SKIPPED: jq is not installed");
        return;
    }
    let text = readme();
    let start = text
        .find("## A five-minute tour")
        .expect("the tour's heading");
    let rest = &text[start + 3..];
    let section = &rest[..rest.find("\n## ").unwrap_or(rest.len())];
    let blocks = sh_blocks(section);
    assert_eq!(blocks.len(), 2, "the tour is an export and a script");
    assert!(blocks[0].iter().any(|l| l.contains("TROUPE_CASSETTE")));
    let script = format!("{}\n{}\n", blocks[0].join("\n"), blocks[1].join("\n"));
    let tmp = tempfile::tempdir().unwrap();
    let bin = Path::new(env!("CARGO_BIN_EXE_lead")).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut cmd = Command::new("timeout");
    cmd.args(["180", "bash", "-e", "-c", &script])
        .current_dir(root())
        .env("PATH", path)
        .env("TMPDIR", tmp.path())
        .env_remove("TROUPE_WORKER");
    for var in [
        "ANTHROPIC_API_KEY",
        "ANTHROPIC_API_KEY_FILE",
        "OPENAI_API_KEY",
        "OPENAI_API_KEY_FILE",
        "OPENAI_BASE_URL",
        "MODEL_ID",
        "TROUPE_TEAM_DIR",
        "TROUPE_BUS",
        "TROUPE_PROVIDER",
    ] {
        cmd.env_remove(var);
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The dir the script made with mktemp -d: stop whatever it left running, pass or fail.
    let work = fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join(".team").is_dir());
    if let Some(w) = &work {
        let _ = Command::new(env!("CARGO_BIN_EXE_lead"))
            .args(["stop", "--timeout", "5"])
            .current_dir(w)
            .env_remove("TROUPE_TEAM_DIR")
            .output();
    }
    assert!(
        out.status.success(),
        "the tour failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let work = work.expect("the tour made a team dir under TMPDIR");
    let hello = fs::read_to_string(work.join("hello.py")).unwrap();
    assert!(hello.starts_with("#!"), "hello.py has no shebang: {hello}");
    assert!(hello.contains("hello, world"), "{hello}");
    for printed in [
        "[idle_notification from alice]",
        "completed    alice",
        "print(\"hello, world\")",
    ] {
        assert!(
            stdout.contains(printed),
            "the tour did not print {printed:?}:\n{stdout}"
        );
    }
}
