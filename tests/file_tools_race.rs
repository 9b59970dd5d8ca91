//! Issue 22, finding N4: the file tools (`read_file`, `write_file`, `edit_file`) cannot be
//! raced. A real worker under `lead run`, in the default layout (the team dir `.team` inside
//! the working dir), takes its tool calls from the fake LLM server:
//!
//! - while a racer swaps directories of the working dir with symlinks to the team dir's inbox
//!   and to the API key file's dir (`renameat2(RENAME_EXCHANGE)`), many `read_file` and
//!   `write_file` calls give back no key and leave the inbox as it was;
//! - a relative symlink inside the working dir (`x -> .team/inbox`, `y -> .team`) does not
//!   reach the team dir, for reading or writing;
//! - the main working dir's `.git` is read-only to the tools, wholly, and readable;
//! - files and dirs the tools create belong to the user commands run as.
//!
//! None of these tests skips; under `CI=true` they run as everywhere else.

#[path = "support/hostile.rs"]
mod hostile;
mod support;

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use hostile::{Site, T, leaks, within};
use serde_json::{Value, json};
use support::fake_llm::{FakeLlm, Reply, anthropic_message, anthropic_text};
use support::team::{Bg, wait_until};

const USAGE: &str = r#"{"input_tokens":3,"output_tokens":2}"#;

/// A team in the default layout whose one member, amy, is driven by the fake server, with the
/// API key in a file outside the working dir (`ANTHROPIC_API_KEY_FILE`).
struct Team {
    site: Site,
    fake: FakeLlm,
    /// Holds the key file, outside the site: `hostile::leaks` looks for the key in every file
    /// of the site.
    keys: tempfile::TempDir,
    lead: Option<Bg>,
}

impl Team {
    /// `lead spawn amy`, then `prepare` on the working dir (before `lead run`, so the team dir
    /// exists and no command has run yet), then `lead run` with `extra` arguments.
    fn start(extra: &[&str], prepare: impl FnOnce(&Site)) -> Team {
        let site = Site::new();
        let keys = tempfile::tempdir().unwrap();
        std::fs::write(
            keys.path().join("anthropic.key"),
            format!("{}\n", site.secret),
        )
        .unwrap();
        std::fs::set_permissions(
            keys.path().join("anthropic.key"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let fake = FakeLlm::start([]).patient(T);
        site.spawn(&fake.url(), "amy", "m-amy");
        prepare(&site);
        let mut args = vec!["run", "--stop-timeout", "1", "--kill-grace", "1"];
        args.extend_from_slice(extra);
        let mut c = site.lead(&fake.url(), &args);
        c.env_remove("ANTHROPIC_API_KEY")
            .env("ANTHROPIC_API_KEY_FILE", keys.path().join("anthropic.key"))
            .stdout(site.log("lead.stdout"))
            .stderr(site.log("lead.stderr"));
        let lead = Some(Bg(c.spawn().unwrap()));
        wait_until(T, "amy's first model call", || {
            (fake.requests_for("m-amy") >= 1).then_some(())
        });
        Team {
            site,
            fake,
            keys,
            lead,
        }
    }

    fn key_dir(&self) -> &Path {
        self.keys.path()
    }

    /// One model turn of tool calls `(id, tool, input)`; returns the results amy sends back
    /// in its next model call, by id: (text, is_error).
    fn turn(&self, calls: &[(String, &str, Value)]) -> BTreeMap<String, (String, bool)> {
        let before = self.fake.requests_for("m-amy");
        let blocks: Vec<String> = calls
            .iter()
            .map(|(id, tool, input)| {
                support::fake_llm::anthropic_tool_use_block(id, tool, &input.to_string())
            })
            .collect();
        self.fake.push_for(
            "m-amy",
            Reply::ok(anthropic_message(&blocks.join(","), "tool_use", USAGE)),
        );
        wait_until(T, "amy's call with the tool results", || {
            (self.fake.requests_for("m-amy") > before).then_some(())
        });
        let last = self
            .fake
            .requests()
            .into_iter()
            .rfind(|r| r.body["model"] == "m-amy")
            .unwrap();
        let results = tool_results(&last.body);
        assert_eq!(
            results.len(),
            calls.len(),
            "amy's next call does not carry one result per tool call: {}",
            last.raw_body.chars().take(2000).collect::<String>()
        );
        results
    }

    /// Ends amy's turn with text, waits for her to go idle and stops the team; returns what
    /// leaked the key (`hostile::leaks`) and what went wrong.
    fn finish(mut self) -> Vec<String> {
        self.fake
            .push_for("m-amy", Reply::ok(anthropic_text("Done.")));
        let mut out = Vec::new();
        if !within(T, || {
            self.site
                .member("amy")
                .is_some_and(|m| m["status"] == "idle")
        }) {
            out.push(format!(
                "amy did not go idle: {:?}",
                self.site.member("amy")
            ));
        }
        let status = self.site.sandbox_status("amy");
        let tmps: Vec<PathBuf> = status["tmp"]
            .as_str()
            .map(PathBuf::from)
            .into_iter()
            .collect();
        if let Some(mut lead) = self.lead.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(lead.0.id() as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
            if !within(T, || lead.0.try_wait().ok().flatten().is_some()) {
                out.push("lead run did not exit on SIGTERM".into());
            }
        }
        out.extend(leaks(&self.site, &self.fake, &tmps));
        out
    }
}

/// The `tool_result` blocks of the last user message of a Messages API request, by id.
fn tool_results(body: &Value) -> BTreeMap<String, (String, bool)> {
    let Some(last) = body["messages"].as_array().and_then(|m| m.last()) else {
        return BTreeMap::new();
    };
    last["content"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|b| b["type"] == "tool_result")
        .map(|b| {
            let text = match &b["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts
                    .iter()
                    .filter_map(|p| p["text"].as_str())
                    .collect::<Vec<_>>()
                    .join(""),
                other => other.to_string(),
            };
            (
                b["tool_use_id"].as_str().unwrap_or_default().to_owned(),
                (text, b["is_error"] == true),
            )
        })
        .collect()
}

/// The bytes of every message file (`*.jsonl`) of an inbox dir, by name: the lock and offset
/// files beside them are the agents' own business.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_type().is_ok_and(|t| t.is_file())
                && e.file_name().to_string_lossy().ends_with(".jsonl")
        })
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap_or_default(),
            )
        })
        .collect()
}

/// Swaps each pair of paths with `renameat2(RENAME_EXCHANGE)`, over and over, until dropped.
struct Racer {
    stop: Arc<AtomicBool>,
    swaps: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Racer {
    fn start(pairs: Vec<(PathBuf, PathBuf)>) -> Racer {
        let stop = Arc::new(AtomicBool::new(false));
        let swaps = Arc::new(AtomicU64::new(0));
        let pairs: Vec<(CString, CString)> = pairs
            .iter()
            .map(|(a, b)| {
                (
                    CString::new(a.as_os_str().as_bytes()).unwrap(),
                    CString::new(b.as_os_str().as_bytes()).unwrap(),
                )
            })
            .collect();
        let thread = {
            let (stop, swaps) = (stop.clone(), swaps.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for (a, b) in &pairs {
                        // SAFETY: both paths are NUL-terminated strings that outlive the call.
                        let r = unsafe {
                            libc::renameat2(
                                libc::AT_FDCWD,
                                a.as_ptr(),
                                libc::AT_FDCWD,
                                b.as_ptr(),
                                libc::RENAME_EXCHANGE,
                            )
                        };
                        assert_eq!(r, 0, "renameat2: {}", std::io::Error::last_os_error());
                        swaps.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        Racer {
            stop,
            swaps,
            thread: Some(thread),
        }
    }

    /// Stops the racer; returns how many swaps it made.
    fn stop(mut self) -> u64 {
        self.halt();
        self.swaps.load(Ordering::Relaxed)
    }

    fn halt(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            t.join().expect("the racer thread failed");
        }
    }
}

impl Drop for Racer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// N4: while a racer swaps `w` and `r` (real dirs with a decoy `lead.jsonl`) with symlinks to
/// the team dir's inbox (absolute and relative), and `k` (a real dir with a decoy key) with a
/// symlink to the key file's dir, amy makes many `read_file k/anthropic.key` and
/// `write_file {w,r}/lead.jsonl` calls in one turn. No result holds the key, the inbox is as
/// it was (the transcript and the tool log hold what was written, as the calls' input), and
/// the key is in no file or model request.
#[test]
fn a_racer_swapping_dirs_and_symlinks_gets_neither_the_key_nor_the_inbox() {
    const ROUNDS: usize = 150;
    let team = Team::start(&[], |site| {
        for d in ["w", "r", "k"] {
            std::fs::create_dir(site.work.join(d)).unwrap();
        }
        std::fs::write(site.work.join("w/lead.jsonl"), "decoy\n").unwrap();
        std::fs::write(site.work.join("r/lead.jsonl"), "decoy\n").unwrap();
        std::fs::write(site.work.join("k/anthropic.key"), "decoy\n").unwrap();
        std::os::unix::fs::symlink(site.team_dir().join("inbox"), site.work.join("w.alt")).unwrap();
        std::os::unix::fs::symlink(".team/inbox", site.work.join("r.alt")).unwrap();
    });
    let site = &team.site;
    std::os::unix::fs::symlink(team.key_dir(), site.work.join("k.alt")).unwrap();
    let forged = format!("FORGED-{}", site.nonce);
    let inbox = site.team_dir().join("inbox");
    let before = files_of(&inbox);
    let mut calls = Vec::new();
    for i in 0..ROUNDS {
        calls.push((
            format!("r{i}"),
            "read_file",
            json!({"path": "k/anthropic.key"}),
        ));
        calls.push((
            format!("w{i}"),
            "write_file",
            json!({"path": "w/lead.jsonl", "content": format!("{forged}\n")}),
        ));
        calls.push((
            format!("v{i}"),
            "write_file",
            json!({"path": "r/lead.jsonl", "content": format!("{forged}\n")}),
        ));
    }
    let racer = Racer::start(
        ["w", "r", "k"]
            .iter()
            .map(|d| (site.work.join(d), site.work.join(format!("{d}.alt"))))
            .collect(),
    );
    let results = team.turn(&calls);
    let swaps = racer.stop();
    let mut problems = Vec::new();
    let (mut read_ok, mut read_refused, mut written, mut write_refused) = (0, 0, 0, 0);
    for (id, (text, is_error)) in &results {
        if text.contains(&site.secret) {
            problems.push(format!("{id} gave back the key: {text}"));
        }
        match (id.starts_with('r'), *is_error) {
            (true, false) => read_ok += 1,
            (true, true) => read_refused += 1,
            (false, false) => written += 1,
            (false, true) => write_refused += 1,
        }
    }
    eprintln!(
        "{swaps} swaps; read_file: {read_ok} read the decoy, {read_refused} refused; \
         write_file: {written} wrote, {write_refused} refused"
    );
    let after = files_of(&inbox);
    if after != before {
        problems.push(format!(
            "the team dir's inbox changed: before {before:?}, after {after:?}"
        ));
    }
    problems.extend(team.finish());
    assert!(
        problems.is_empty(),
        "the racer got through the file tools:\n  {}",
        problems.join("\n  ")
    );
}

/// A relative symlink stays beneath the working dir, so the open allows it: what it reaches
/// is refused by what was opened. `x -> .team/inbox`, `y -> .team`, `z -> .team/config.json`,
/// and a symlink to a symlink (`q -> y`); `ok -> sub` (a plain dir) works as before.
#[test]
fn relative_symlinks_into_the_team_dir_are_refused() {
    let team = Team::start(&[], |site| {
        let w = &site.work;
        std::os::unix::fs::symlink(".team/inbox", w.join("x")).unwrap();
        std::os::unix::fs::symlink(".team", w.join("y")).unwrap();
        std::os::unix::fs::symlink(".team/config.json", w.join("z")).unwrap();
        std::os::unix::fs::symlink("y", w.join("q")).unwrap();
        std::fs::create_dir(w.join("sub")).unwrap();
        std::os::unix::fs::symlink("sub", w.join("ok")).unwrap();
    });
    let site = &team.site;
    let inbox = site.team_dir().join("inbox");
    let before = files_of(&inbox);
    let refused: Vec<(String, &str, Value)> = [
        ("read_file", json!({"path": "y/config.json"})),
        ("read_file", json!({"path": "z"})),
        ("read_file", json!({"path": "q/config.json"})),
        ("read_file", json!({"path": "x/amy.jsonl"})),
        (
            "write_file",
            json!({"path": "x/lead.jsonl", "content": "forged\n"}),
        ),
        ("write_file", json!({"path": "x/new.jsonl", "content": "x"})),
        ("write_file", json!({"path": "y/planted", "content": "x"})),
        ("write_file", json!({"path": "y/new/deep", "content": "x"})),
        ("write_file", json!({"path": "z", "content": "{}"})),
        (
            "write_file",
            json!({"path": "q/inbox/lead.jsonl", "content": "forged\n"}),
        ),
        (
            "edit_file",
            json!({"path": "z", "old_text": "members", "new_text": "nobody"}),
        ),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (tool, input))| (format!("t{i}"), tool, input))
    .collect();
    let mut calls = refused.clone();
    calls.push((
        "ok1".into(),
        "write_file",
        json!({"path": "ok/made/f.txt", "content": "through ok\n"}),
    ));
    calls.push(("ok2".into(), "read_file", json!({"path": "ok/made/f.txt"})));
    let results = team.turn(&calls);
    let mut problems = Vec::new();
    for (id, tool, input) in &refused {
        let (text, is_error) = &results[id];
        if !is_error || !text.contains("team directory") {
            problems.push(format!(
                "{tool} {input} was not refused as in the team dir: {text}"
            ));
        }
    }
    let (text, is_error) = &results["ok2"];
    if *is_error || text != "through ok\n" {
        problems.push(format!("reading through ok -> sub failed: {text}"));
    }
    if std::fs::read_to_string(site.work.join("sub/made/f.txt"))
        .ok()
        .as_deref()
        != Some("through ok\n")
    {
        problems.push("write_file through ok -> sub did not land in sub".into());
    }
    // The supervisor rewrites config.json as amy's state changes: it must still be the roster.
    if site.member("amy").is_none() {
        problems.push(format!(
            "config.json is no longer the roster: {:?}",
            std::fs::read_to_string(site.team_dir().join("config.json"))
        ));
    }
    if files_of(&inbox) != before {
        problems.push("the inbox changed".into());
    }
    for p in ["planted", "new"] {
        if site.team_dir().join(p).exists() {
            problems.push(format!("{p} was made in the team dir"));
        }
    }
    problems.extend(team.finish());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The main working dir's `.git` is read-only to the file tools, all of it (hooks, config,
/// info, a new dir in it, the dir itself, and through a relative symlink), and stays readable.
#[test]
fn the_git_dir_is_read_only_to_the_file_tools_and_readable() {
    let team = Team::start(&[], |site| {
        let o = std::process::Command::new("git")
            .args(["init", "-q", "-b", "main"])
            .current_dir(&site.work)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        std::fs::create_dir_all(site.work.join(".git/info")).unwrap();
        std::os::unix::fs::symlink(".git/hooks", site.work.join("h")).unwrap();
        std::os::unix::fs::symlink(".git/config", site.work.join("c")).unwrap();
    });
    let site = &team.site;
    let git = site.work.join(".git");
    let config = std::fs::read(git.join("config")).unwrap();
    let head = std::fs::read_to_string(git.join("HEAD")).unwrap();
    let refused: Vec<(String, &str, Value)> = [
        (
            "write_file",
            json!({"path": ".git/hooks/pre-commit", "content": "#!/bin/sh\ntouch /tmp/owned\n"}),
        ),
        ("write_file", json!({"path": ".git/info/x", "content": "y"})),
        (
            "write_file",
            json!({"path": ".git/info/attributes", "content": "* filter=evil"}),
        ),
        (
            "write_file",
            json!({"path": ".git/config", "content": "[core]\n\tfsmonitor = evil\n"}),
        ),
        (
            "write_file",
            json!({"path": ".git/newdir/f", "content": "y"}),
        ),
        ("write_file", json!({"path": ".git", "content": "y"})),
        (
            "write_file",
            json!({"path": "h/post-checkout", "content": "evil"}),
        ),
        ("write_file", json!({"path": "c", "content": "evil"})),
        (
            "edit_file",
            json!({"path": ".git/config", "old_text": "[core]", "new_text": "[alias]"}),
        ),
        (
            "edit_file",
            json!({"path": ".git/HEAD", "old_text": "main", "new_text": "evil"}),
        ),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, (tool, input))| (format!("t{i}"), tool, input))
    .collect();
    let mut calls = refused.clone();
    calls.push(("head".into(), "read_file", json!({"path": ".git/HEAD"})));
    calls.push(("conf".into(), "read_file", json!({"path": "c"})));
    let results = team.turn(&calls);
    let mut problems = Vec::new();
    for (id, tool, input) in &refused {
        let (text, is_error) = &results[id];
        if !is_error || !text.contains("read-only") {
            problems.push(format!(
                "{tool} {input} was not refused as read-only: {text}"
            ));
        }
    }
    if results["head"] != (head.clone(), false) {
        problems.push(format!("read_file .git/HEAD: {:?}", results["head"]));
    }
    if results["conf"] != (String::from_utf8_lossy(&config).into_owned(), false) {
        problems.push(format!(
            "read_file c (-> .git/config): {:?}",
            results["conf"]
        ));
    }
    if std::fs::read(git.join("config")).unwrap() != config {
        problems.push(".git/config changed".into());
    }
    if std::fs::read_to_string(git.join("HEAD")).unwrap() != head {
        problems.push(".git/HEAD changed".into());
    }
    for p in [
        "hooks/pre-commit",
        "hooks/post-checkout",
        "info/x",
        "info/attributes",
        "newdir",
    ] {
        if git.join(p).exists() {
            problems.push(format!(".git/{p} was made"));
        }
    }
    problems.extend(team.finish());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// What `write_file` creates (the file and the dirs it makes) belongs to the user commands
/// run as: a later command may append to the file and make dirs beside it. When the test runs
/// as root, the working dir is opened to others so that the sandbox runs commands as
/// `nobody`; the files then belong to nobody, and the dirs that were there keep their owner.
#[test]
fn what_the_file_tools_create_belongs_to_the_commands_user() {
    let root = nix::unistd::geteuid().is_root();
    let team = Team::start(&[], |site| {
        if root {
            std::fs::set_permissions(site.tmp.path(), std::fs::Permissions::from_mode(0o711))
                .unwrap();
            std::fs::set_permissions(&site.work, std::fs::Permissions::from_mode(0o777)).unwrap();
        }
    });
    let site = &team.site;
    let status = site.sandbox_status("amy");
    eprintln!("amy's sandbox: {status}");
    let results = team.turn(&[
        (
            "w".into(),
            "write_file",
            json!({"path": "made/deep/new.txt", "content": "one\n"}),
        ),
        (
            "b".into(),
            "bash",
            json!({"command": "id -u; echo two >> made/deep/new.txt && mkdir made/deep/sub \
                   && touch made/other && cat made/deep/new.txt"}),
        ),
    ]);
    let (text, is_error) = &results["b"];
    let uid = text.lines().next().unwrap_or_default().trim().to_owned();
    let mut problems = Vec::new();
    if *is_error || !text.ends_with("one\ntwo\n") {
        problems.push(format!(
            "a command could not change what write_file made: {text}"
        ));
    }
    let own = nix::unistd::geteuid().as_raw().to_string();
    // With commands run as the worker's user, that user owns it all; otherwise (root of its
    // own user namespace is the worker's root too) the command's uid as it printed it.
    if uid.parse::<u32>().is_ok() && uid != "0" {
        for p in ["made", "made/deep", "made/deep/new.txt"] {
            let owner = std::fs::metadata(site.work.join(p))
                .unwrap()
                .uid()
                .to_string();
            if owner != uid {
                problems.push(format!("{p} belongs to uid {owner}, commands run as {uid}"));
            }
        }
    }
    let work_owner = std::fs::metadata(&site.work).unwrap().uid().to_string();
    if work_owner != own {
        problems.push(format!(
            "the working dir changed owner to {work_owner} (it was {own})"
        ));
    }
    problems.extend(team.finish());
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
