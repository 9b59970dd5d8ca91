//! Issue 42: malformed entries of any file of the team dir never panic a command. A team dir
//! laid down through the real CLI (a member, a task, a message each way, a plan request, a
//! merge entry, a beat, the rate governor's state, events) has one of its files replaced by
//! arbitrary bytes, a torn copy of itself, itself with one byte changed, or itself with a
//! value of another type or an absurd size; then every command that reads the team runs on it.
//! None may panic (exit 101, "panicked" on stderr); each prints or refuses.
//!
//! `PROPTEST_CASES=N` runs more cases than the default.

mod support;

use std::path::{Path, PathBuf};

use proptest::prelude::*;
use proptest::test_runner::Config as ProptestConfig;
use support::team::{Team, offline_lead as lead};

fn ok(team: &Team, args: &[&str]) -> String {
    let o = lead(team, args);
    assert!(o.status.success(), "lead {args:?}: {o:?}");
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

/// A team dir with something in every file a command reads, and the task's id.
fn populated() -> (Team, String) {
    let team = Team::new();
    ok(
        &team,
        &["spawn", "alice", "--role", "coder", "--prompt", "work"],
    );
    let task = ok(&team, &["task", "add", "write the parser"]);
    let task = task
        .split_whitespace()
        .last()
        .unwrap_or_default()
        .to_owned();
    ok(&team, &["send", "alice", "hello"]);
    let root = team.dir.root();
    let now = troupe::fsutil::now();
    // What a running team leaves: a message to the lead, a plan request, a merge entry, a
    // beat, the governor's state.
    let to_lead = troupe::message::Message::new(
        troupe::message::MessageType::Message,
        "alice",
        "lead",
        "done",
    );
    troupe::inbox::Inbox::new(&team.dir, &troupe::AgentName::lead())
        .append(&to_lead, troupe::inbox::Durability::Sync)
        .unwrap();
    troupe::requests::RequestStore::new(&team.dir)
        .create(troupe::requests::NewRequest {
            kind: troupe::requests::RequestKind::PlanApproval,
            from: "alice".into(),
            to: "lead".into(),
            payload: serde_json::json!({"plan": "the plan"}),
            target_incarnation: None,
            ttl: None,
        })
        .unwrap();
    for d in ["merge", "beats", "govern/0123456789abcdef"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(
        root.join("merge/ab12cd34.json"),
        format!(
            r#"{{"id":"ab12cd34","member":"alice","branch":"troupe/alice","commit":"0123456789abcdef","state":"queued","queued_at":{now},"updated_at":{now},"attempts":0}}"#
        ),
    )
    .unwrap();
    troupe::store::beat::Beater::new(team.dir.store(), "alice", 1)
        .beat(std::time::Duration::from_secs(5));
    std::fs::write(
        root.join("govern/0123456789abcdef/state.json"),
        format!(
            r#"{{"cooldown_until":{},"limit":2.0,"halve_after":0,"changed_at":0,"remaining":3,"reset_at":{},"limited":1,"in_flight":[{now}]}}"#,
            now + 30.0,
            now + 30.0
        ),
    )
    .unwrap();
    (team, task)
}

/// Every regular file under `dir`, but the locks (empty, never parsed).
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_none_or(|x| x != "lock") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// What a file becomes.
#[derive(Debug, Clone)]
enum Harm {
    Bytes(Vec<u8>),
    Torn(proptest::sample::Index),
    Flip(proptest::sample::Index, u8),
    /// The first value of a JSON number, string or bool in it replaced by this text.
    Value(proptest::sample::Index, &'static str),
}

fn harm() -> impl Strategy<Value = Harm> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..300).prop_map(Harm::Bytes),
        any::<proptest::sample::Index>().prop_map(Harm::Torn),
        (any::<proptest::sample::Index>(), any::<u8>()).prop_map(|(i, b)| Harm::Flip(i, b)),
        (
            any::<proptest::sample::Index>(),
            prop::sample::select(vec![
                "1e308",
                "-1e308",
                "-1",
                "18446744073709551616",
                "null",
                "\"\"",
                "\"é\\u0000\\u009b\"",
                "[]",
                "{}",
                "true",
                "\"ééééééééééééé\"",
                "0.5",
            ])
        )
            .prop_map(|(i, v)| Harm::Value(i, v)),
    ]
}

fn apply(harm: &Harm, good: &[u8]) -> Vec<u8> {
    match harm {
        Harm::Bytes(b) => b.clone(),
        Harm::Torn(i) if !good.is_empty() => good[..i.index(good.len())].to_vec(),
        Harm::Flip(i, b) if !good.is_empty() => {
            let mut v = good.to_vec();
            v[i.index(good.len())] = *b;
            v
        }
        Harm::Value(i, with) => {
            // The starts of the values: after a `:` (with its spaces).
            let text = String::from_utf8_lossy(good);
            let starts: Vec<usize> = text
                .match_indices(':')
                .map(|(at, _)| at + 1)
                .filter(|&at| {
                    text[at..]
                        .trim_start()
                        .starts_with(|c: char| c == '"' || c == '-' || c.is_ascii_alphanumeric())
                })
                .collect();
            if starts.is_empty() {
                return good.to_vec();
            }
            let at = starts[i.index(starts.len())];
            let rest = text[at..].trim_start();
            let skip = text.len() - at - rest.len();
            // The value's end: its closing quote, or the next `,` `}` `]`.
            let len = if let Some(s) = rest.strip_prefix('"') {
                let mut escaped = false;
                let mut end = s.len();
                for (k, c) in s.char_indices() {
                    match c {
                        '\\' if !escaped => escaped = true,
                        '"' if !escaped => {
                            end = k;
                            break;
                        }
                        _ => escaped = false,
                    }
                }
                (end + 2).min(rest.len())
            } else {
                rest.find([',', '}', ']', '\n']).unwrap_or(rest.len())
            };
            let mut out = text[..at + skip].to_owned();
            out.push_str(with);
            out.push_str(&rest[len..]);
            out.into_bytes()
        }
        _ => good.to_vec(),
    }
}

/// `good` (JSON, or JSON lines) with every string, or every number, replaced by `with`: a file
/// that still parses, holding absurd values everywhere (a non-ASCII commit id, a time of
/// 1e308, a negative count).
fn everywhere(good: &[u8], strings: bool, with: &serde_json::Value) -> Option<Vec<u8>> {
    fn walk(v: &mut serde_json::Value, strings: bool, with: &serde_json::Value) {
        match v {
            serde_json::Value::String(_) if strings => *v = with.clone(),
            serde_json::Value::Number(_) if !strings => *v = with.clone(),
            serde_json::Value::Array(a) => a.iter_mut().for_each(|x| walk(x, strings, with)),
            serde_json::Value::Object(o) => o.values_mut().for_each(|x| walk(x, strings, with)),
            _ => {}
        }
    }
    let text = std::str::from_utf8(good).ok()?;
    let mut out = String::new();
    for line in text.split_inclusive('\n') {
        let mut v: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            // One document over several lines.
            Err(_) => {
                let mut v: serde_json::Value = serde_json::from_str(text).ok()?;
                walk(&mut v, strings, with);
                return Some(v.to_string().into_bytes());
            }
        };
        walk(&mut v, strings, with);
        out.push_str(&v.to_string());
        if line.ends_with('\n') {
            out.push('\n');
        }
    }
    Some(out.into_bytes())
}

/// `good` (JSON, or JSON lines) with only its `k`th string (or number), counted over the whole
/// file, replaced by `with`; `None` when it has fewer.
fn one(good: &[u8], k: usize, strings: bool, with: &serde_json::Value) -> Option<Vec<u8>> {
    fn walk(
        v: &mut serde_json::Value,
        k: &mut usize,
        strings: bool,
        with: &serde_json::Value,
    ) -> bool {
        match v {
            serde_json::Value::String(_) if strings => {
                if *k == 0 {
                    *v = with.clone();
                    return true;
                }
                *k -= 1;
                false
            }
            serde_json::Value::Number(_) if !strings => {
                if *k == 0 {
                    *v = with.clone();
                    return true;
                }
                *k -= 1;
                false
            }
            serde_json::Value::Array(a) => a.iter_mut().any(|x| walk(x, k, strings, with)),
            serde_json::Value::Object(o) => o.values_mut().any(|x| walk(x, k, strings, with)),
            _ => false,
        }
    }
    let text = std::str::from_utf8(good).ok()?;
    let mut left = k;
    if let Ok(mut v) = serde_json::from_str::<serde_json::Value>(text) {
        return walk(&mut v, &mut left, strings, with).then(|| v.to_string().into_bytes());
    }
    let mut out = String::new();
    let mut done = false;
    for line in text.split_inclusive('\n') {
        match serde_json::from_str::<serde_json::Value>(line) {
            Ok(mut v) if !done => {
                done = walk(&mut v, &mut left, strings, with);
                out.push_str(&v.to_string());
                if line.ends_with('\n') {
                    out.push('\n');
                }
            }
            _ => out.push_str(line),
        }
    }
    done.then(|| out.into_bytes())
}

/// The commands that read the team, for a team whose task is `task`.
fn commands<'a>(task: &'a str, trace: &'a str) -> Vec<Vec<&'a str>> {
    vec![
        vec!["status"],
        vec!["status", "--json"],
        vec!["inbox", "--peek"],
        vec!["requests"],
        vec!["task", "list"],
        vec!["task", "show", task],
        vec!["merge", "--list"],
        vec!["top", "--once"],
        vec!["top", "--once", "--json"],
        vec!["watch", "--since", "1d", "--until-stop"],
        vec!["trace", "--format", "text"],
        vec!["trace", "-o", trace],
        vec!["logs", "alice"],
    ]
}

/// No panic from any command on `team`, whose file `path` was harmed.
fn no_panic(team: &Team, task: &str, path: &Path) -> Result<(), String> {
    let trace = team.path().join("t.json").to_string_lossy().into_owned();
    for args in &commands(task, &trace) {
        let o = lead(team, args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        if stderr.contains("panicked") || o.status.code() == Some(101) {
            return Err(format!(
                "lead {} panicked with {} holding {:?}: {stderr}",
                args.join(" "),
                path.strip_prefix(team.dir.root()).unwrap_or(path).display(),
                String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()),
            ));
        }
    }
    Ok(())
}

/// Every JSON file of the team dir with all its strings, then all its numbers, made absurd:
/// one pass over each file, each kind of value.
#[test]
fn no_command_panics_on_absurd_values_in_any_file() {
    let (team, task) = populated();
    let withs: [(bool, serde_json::Value); 4] = [
        (true, serde_json::json!("ééééééééééééééééé\u{9b}")),
        (true, serde_json::json!("")),
        (false, serde_json::json!(1e308)),
        (false, serde_json::json!(-1)),
    ];
    let mut harmed = 0;
    for path in files(team.dir.root()) {
        let good = std::fs::read(&path).unwrap();
        let mut variants: Vec<Vec<u8>> = withs
            .iter()
            .filter_map(|(strings, with)| everywhere(&good, *strings, with))
            .collect();
        // And each value alone (the others kept, so that the file still parses as what it
        // is): a string made non-ASCII and long, a number made huge.
        for k in 0.. {
            let mut any = false;
            for (strings, with) in &withs[..1] {
                if let Some(v) = one(&good, k, *strings, with) {
                    variants.push(v);
                    any = true;
                }
            }
            if let Some(v) = one(&good, k, false, &withs[2].1) {
                variants.push(v);
                any = true;
            }
            if !any {
                break;
            }
        }
        for bad in variants {
            std::fs::write(&path, &bad).unwrap();
            harmed += 1;
            if let Err(e) = no_panic(&team, &task, &path) {
                panic!("{e}");
            }
        }
        std::fs::write(&path, &good).unwrap();
    }
    eprintln!("{harmed} variants");
    assert!(harmed >= 30, "only {harmed} variants made");
}

fn cases(n: u32) -> ProptestConfig {
    let mut c = ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    if std::env::var_os("PROPTEST_CASES").is_none() {
        c.cases = n;
    }
    c
}

proptest! {
    #![proptest_config(cases(24))]

    #[test]
    fn no_command_panics_on_any_malformed_file(
        pick in any::<proptest::sample::Index>(),
        harm in harm(),
    ) {
        let (team, task) = populated();
        let all = files(team.dir.root());
        let path = &all[pick.index(all.len())];
        let good = std::fs::read(path).unwrap();
        std::fs::write(path, apply(&harm, &good)).unwrap();
        let checked = no_panic(&team, &task, path);
        prop_assert!(checked.is_ok(), "{}", checked.unwrap_err());
    }
}
