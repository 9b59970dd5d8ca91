//! Property tests of every file format troupe reads (issue 6, the fuzz point): the inbox reader,
//! `Message` lines, request files, `config.json`, cassettes and transcripts, fed arbitrary bytes,
//! torn lines, huge numbers, deep nesting (10,000 levels), invalid UTF-8, NULs, CRs and very long
//! lines. Everything runs through the real APIs on real files in a temporary team dir.
//!
//! Properties:
//! - nothing panics, whatever the bytes;
//! - an inbox holding valid messages among garbage lines, blank lines, repeated lines and a torn
//!   tail delivers every valid message exactly once, in order, through `Inbox::drain`, sets every
//!   garbage line aside in `NAME.corrupt.jsonl`, and never delivers the torn tail (it is set
//!   aside, whether still unterminated or ended by a later append, whose message is delivered);
//!   the journal then holds every valid message once, readable after a reopen;
//! - `Message::to_line` output parses back to the same message, and no strict prefix of it does;
//! - request files: `get` returns a request or an error naming the file; `list` keeps every good
//!   request whatever else lies in the directory;
//! - `config.json`: garbage is a clean error naming the file and left untouched; unknown fields
//!   of a valid config survive a load and an update;
//! - cassettes: any text loads or is refused with a `Config` error; a torn last line is ignored;
//! - transcripts: `read_entries` and `Journal::open_path` return exactly the complete valid
//!   entries, in order.
//!
//! Case counts are set per property so that the file runs in seconds; `PROPTEST_CASES=N`
//! overrides every one of them for a longer run.

use std::collections::HashSet;
use std::path::Path;

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::Config as ProptestConfig;
use serde_json::{Map, Value, json};
use troupe::config::{MemberStatus, Roster, TeamConfig};
use troupe::inbox::{Durability, Inbox};
use troupe::llm::{
    Block, CassetteEntry, ChatResponse, LlmError, ReplayProvider, StopReason, Usage,
};
use troupe::message::{MAX_MESSAGE_BYTES, Message, MessageType};
use troupe::requests::{NewRequest, RequestKind, RequestStatus, RequestStore};
use troupe::transcript::{Entry, Journal, read_entries};
use troupe::{AgentName, Error, TeamDir};

/// Opens `name`'s journal as its owner. The owner lock is let go at once: the test is the only
/// process that uses the journal.
fn open_journal(team: &TeamDir, name: &AgentName) -> (Journal, Vec<Entry>) {
    let owner = Journal::try_own(team, name)
        .unwrap()
        .expect("no other owner");
    Journal::open(team, name, &owner).unwrap()
}

/// The owner lock of the journal at `path`, which must be free.
fn own_path(path: &std::path::Path) -> troupe::fsutil::HeldLock {
    troupe::fsutil::HeldLock::try_acquire(&troupe::transcript::owner_lock_path(path))
        .unwrap()
        .expect("no other owner")
}

// ---------------------------------------------------------------------------------------------
// Configuration

/// `cases` cases, unless `PROPTEST_CASES` says otherwise. Failures are not saved in the source
/// tree: each one found is kept as a named regression test at the end of this file.
fn cases(cases: u32) -> ProptestConfig {
    let mut config = ProptestConfig {
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = cases;
    }
    config
}

/// A fresh team dir in a temp dir (the `TempDir` must outlive the `TeamDir`).
fn team() -> (tempfile::TempDir, TeamDir) {
    let tmp = tempfile::tempdir().unwrap();
    let team = TeamDir::create(tmp.path().join(".team")).unwrap();
    (tmp, team)
}

fn alice() -> AgentName {
    AgentName::teammate("alice").unwrap()
}

// ---------------------------------------------------------------------------------------------
// Building blocks: text, numbers, JSON values, nasty fragments, mutations

/// Text that stresses a JSON writer and reader: any char, with NUL, CR, LF, quotes, backslashes,
/// control and separator characters, a BOM and non-BMP characters over-represented.
fn text(len: std::ops::Range<usize>) -> BoxedStrategy<String> {
    prop::collection::vec(
        prop_oneof![
            4 => any::<char>(),
            2 => prop::char::range(' ', '~'),
            1 => prop::sample::select(vec![
                '\0', '\r', '\n', '\t', '"', '\\', '/', '\u{7f}', '\u{85}', '\u{2028}',
                '\u{2029}', '\u{feff}', '\u{fffd}', '\u{10ffff}', '{', '}', '[', ']', ',',
            ]),
        ],
        len,
    )
    .prop_map(String::from_iter)
    .boxed()
}

/// Any finite f64 (JSON has no NaN or infinity).
fn finite() -> BoxedStrategy<f64> {
    use prop::num::f64::{NEGATIVE, NORMAL, POSITIVE, SUBNORMAL, ZERO};
    prop_oneof![
        3 => POSITIVE | NEGATIVE | NORMAL | SUBNORMAL | ZERO,
        1 => prop::sample::select(vec![0.0, -0.0, f64::MAX, f64::MIN, f64::MIN_POSITIVE, 1.764_672_000_123e9]),
    ]
    .boxed()
}

/// An arbitrary JSON value of bounded depth and size.
fn json_value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        finite().prop_map(Value::from),
        text(0..12).prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((text(0..8), inner), 0..5)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
    .boxed()
}

/// `depth` nested arrays.
fn nested_arrays(depth: usize) -> Vec<u8> {
    let mut v = b"[".repeat(depth);
    v.extend(b"]".repeat(depth));
    v
}

/// `depth` nested objects.
fn nested_objects(depth: usize) -> Vec<u8> {
    let mut v = br#"{"a":"#.repeat(depth);
    v.extend(b"1");
    v.extend(b"}".repeat(depth));
    v
}

/// JSON values (as raw text) that a reader must skip over when it ignores them: deep nesting
/// far beyond serde_json's recursion limit, huge numbers, long strings. Every one is valid JSON.
fn ignorable_raw() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        prop::sample::select(vec![1usize, 127, 128, 129, 1000, 10_000]).prop_map(nested_arrays),
        prop::sample::select(vec![1usize, 128, 10_000]).prop_map(nested_objects),
        prop::sample::select(vec![
            "1e999",
            "-1e999",
            "1e-99999",
            "18446744073709551616",
            "-9223372036854775809",
            "123456789012345678901234567890123456789012345678901234567890",
            "0.00000000000000000000000000000000000000000000000000000000001",
            // Strings a skipped field may hold, though a parsed one may not.
            "\"\\ud800\"",
            "\"\\udc00\\ud800\"",
        ])
        .prop_map(|s| s.as_bytes().to_vec()),
        prop::sample::select(vec![
            &b"\"\xff\xfe\""[..],
            b"\"\xed\xa0\x80\"",
            b"\"\xc0\xaf\""
        ])
        .prop_map(<[u8]>::to_vec),
        (1usize..300_000).prop_map(|n| {
            let mut v = b"\"".to_vec();
            v.extend(std::iter::repeat_n(b'x', n));
            v.push(b'"');
            v
        }),
        json_value().prop_map(|v| serde_json::to_vec(&v).unwrap()),
    ]
    .boxed()
}

/// Raw fragments that are bad JSON, or good JSON of the wrong kind, or both.
fn nasty_raw() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        3 => ignorable_raw(),
        1 => prop::sample::select(vec![1000usize, 10_000]).prop_map(|d| b"[".repeat(d)),
        1 => prop::sample::select(vec![1000usize, 10_000]).prop_map(|d| br#"{"a":"#.repeat(d)),
        3 => prop::sample::select(NASTY.to_vec())
        .prop_map(<[u8]>::to_vec),
        2 => prop::collection::vec(any::<u8>(), 0..64),
    ]
    .boxed()
}

/// Small bad (or surprising) JSON texts.
const NASTY: &[&[u8]] = &[
    b"\"\xff\xfe\"",       // invalid UTF-8 in a string
    b"\"\xc0\xaf\"",       // overlong encoding
    b"\"\xed\xa0\x80\"",   // an encoded surrogate
    b"\"\\ud800\"",        // a lone surrogate escape
    b"\"\\udc00\\ud800\"", // reversed surrogates
    b"\"\\u12\"",          // a short escape
    b"\"\\x41\"",          // an unknown escape
    b"\"a\x00b\"",         // a raw NUL inside a string
    b"\"a\rb\"",           // a raw CR inside a string
    b"\x00",
    b"\r",
    b"\xef\xbb\xbf{}", // a BOM
    b"NaN",
    b"Infinity",
    b"-",
    b"01",
    b"1.",
    b".5",
    b"1e",
    b"+1",
    b"tru",
    b"nul",
    b"\"unterminated",
    b"[1,]",
    b"{\"a\":1,}",
    b"{\"a\" 1}",
    b"{1:2}",
    b"}",
    b"]",
    b"",
];

/// One change to a valid JSON object's text.
#[derive(Debug, Clone)]
enum Mutation {
    /// Cut the text short.
    Truncate(Index),
    /// Insert raw bytes somewhere.
    Insert(Index, Vec<u8>),
    /// Overwrite one byte.
    Overwrite(Index, u8),
    /// Replace one top-level field's value with raw bytes.
    ReplaceField(Index, Vec<u8>),
    /// Remove one top-level field.
    DropField(Index),
    /// Duplicate one top-level field.
    DuplicateField(Index),
    /// Add a field (raw value).
    AddField(String, Vec<u8>),
    /// Wrap the object in an array.
    WrapInArray,
}

fn mutation() -> BoxedStrategy<Mutation> {
    prop_oneof![
        2 => any::<Index>().prop_map(Mutation::Truncate),
        2 => (any::<Index>(), nasty_raw()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::Overwrite(i, b)),
        4 => (any::<Index>(), nasty_raw()).prop_map(|(i, b)| Mutation::ReplaceField(i, b)),
        1 => any::<Index>().prop_map(Mutation::DropField),
        1 => any::<Index>().prop_map(Mutation::DuplicateField),
        2 => (text(0..6), nasty_raw()).prop_map(|(k, b)| Mutation::AddField(k, b)),
        1 => Just(Mutation::WrapInArray),
    ]
    .boxed()
}

/// Renders an object from raw `(key, value)` pairs.
fn raw_object(fields: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut out = b"{".to_vec();
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend(serde_json::to_vec(k).unwrap());
        out.push(b':');
        out.extend(v);
    }
    out.push(b'}');
    out
}

/// The fields of a JSON object as raw pairs (empty for anything else).
fn raw_fields(object: &[u8]) -> Vec<(String, Vec<u8>)> {
    match serde_json::from_slice::<Value>(object) {
        Ok(Value::Object(map)) => map
            .into_iter()
            .map(|(k, v)| (k, serde_json::to_vec(&v).unwrap()))
            .collect(),
        _ => Vec::new(),
    }
}

/// Applies a mutation to the text of a JSON object.
fn mutate(valid: &[u8], m: &Mutation) -> Vec<u8> {
    let mut out = valid.to_vec();
    match m {
        Mutation::Truncate(i) => out.truncate(i.index(valid.len().max(1))),
        Mutation::Insert(i, raw) => {
            let at = i.index(valid.len() + 1);
            out.splice(at..at, raw.iter().copied());
        }
        Mutation::Overwrite(i, b) => {
            if !out.is_empty() {
                let at = i.index(out.len());
                out[at] = *b;
            }
        }
        Mutation::ReplaceField(i, raw) => {
            let mut fields = raw_fields(valid);
            if !fields.is_empty() {
                let at = i.index(fields.len());
                fields[at].1.clone_from(raw);
                out = raw_object(&fields);
            }
        }
        Mutation::DropField(i) => {
            let mut fields = raw_fields(valid);
            if !fields.is_empty() {
                fields.remove(i.index(fields.len()));
                out = raw_object(&fields);
            }
        }
        Mutation::DuplicateField(i) => {
            let mut fields = raw_fields(valid);
            if !fields.is_empty() {
                let dup = fields[i.index(fields.len())].clone();
                fields.push(dup);
                out = raw_object(&fields);
            }
        }
        Mutation::AddField(k, raw) => {
            let mut fields = raw_fields(valid);
            fields.push((k.clone(), raw.clone()));
            out = raw_object(&fields);
        }
        Mutation::WrapInArray => {
            out.insert(0, b'[');
            out.push(b']');
        }
    }
    out
}

/// Bytes for a whole file or line: random bytes, nasty fragments, or a mutated valid object.
fn arbitrary_bytes(valid: BoxedStrategy<Vec<u8>>) -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        2 => prop::collection::vec(any::<u8>(), 0..512),
        1 => text(0..200).prop_map(String::into_bytes),
        2 => nasty_raw(),
        1 => (1usize..400_000, any::<u8>()).prop_map(|(n, b)| vec![b; n]),
        4 => (valid.clone(), mutation()).prop_map(|(v, m)| mutate(&v, &m)),
        2 => (valid, prop::collection::vec(mutation(), 1..4))
            .prop_map(|(v, ms)| ms.iter().fold(v, |acc, m| mutate(&acc, m))),
    ]
    .boxed()
}

/// Replaces every `\n` (a line must hold none).
fn one_line(mut bytes: Vec<u8>) -> Vec<u8> {
    for b in &mut bytes {
        if *b == b'\n' {
            *b = b'\r';
        }
    }
    bytes
}

// ---------------------------------------------------------------------------------------------
// Messages

fn message_type() -> BoxedStrategy<MessageType> {
    prop::sample::select(MessageType::ALL.to_vec()).boxed()
}

/// Message content: usually short, sometimes long enough to approach or pass the size limit.
fn content() -> BoxedStrategy<String> {
    prop_oneof![
        12 => text(0..200),
        1 => (1usize..300_000, text(0..20)).prop_map(|(n, t)| "c".repeat(n) + &t),
    ]
    .boxed()
}

/// A message as troupe's senders build them: a non-empty id, and a `request_id` on every
/// protocol message; any text anywhere else.
fn message() -> BoxedStrategy<Message> {
    (
        (
            text(1..40),
            message_type(),
            text(0..20),
            text(0..20),
            content(),
            finite(),
        ),
        (
            prop::option::of(text(0..12)),
            prop::option::of(any::<bool>()),
            prop::option::of(text(0..40)),
            prop::option::of(text(0..40)),
            prop::option::of(text(0..40)),
        ),
    )
        .prop_map(
            |(
                (id, kind, from, to, content, timestamp),
                (request_id, approve, reason, plan, feedback),
            )| {
                let request_id = match request_id {
                    None if kind.is_protocol() => Some("a1b2c3d4".to_owned()),
                    other => other,
                };
                Message {
                    id,
                    kind,
                    from,
                    to,
                    content,
                    timestamp,
                    request_id,
                    approve,
                    reason,
                    plan,
                    feedback,
                    traceparent: None,
                }
            },
        )
        .boxed()
}

/// A message small enough to send.
fn small_message() -> BoxedStrategy<Message> {
    message()
        .prop_filter("fits the size limit", |m| m.to_line().is_ok())
        .boxed()
}

/// How a valid line reaches an inbox: as troupe writes it, or as another writer might (the
/// reference design, an editor): surrounding whitespace, a CR, extra fields holding anything a
/// reader skips over (10,000-deep nesting, huge numbers, 300 KB strings).
#[derive(Debug, Clone)]
enum Shape {
    Exact,
    TrailingCr,
    Padded,
    ExtraFields(Vec<(String, Vec<u8>)>),
}

fn shape() -> BoxedStrategy<Shape> {
    prop_oneof![
        12 => Just(Shape::Exact),
        1 => Just(Shape::TrailingCr),
        1 => Just(Shape::Padded),
        2 => prop::collection::vec((text(0..6).prop_map(|k| format!("x-{k}")), ignorable_raw()), 1..3)
            .prop_map(Shape::ExtraFields),
    ]
    .boxed()
}

/// The line (without its `\n`) that delivers `m`.
fn render(m: &Message, shape: &Shape) -> Vec<u8> {
    let mut line = m.to_line().unwrap();
    assert_eq!(line.pop(), Some(b'\n'));
    match shape {
        Shape::Exact => line,
        Shape::TrailingCr => {
            line.push(b'\r');
            line
        }
        Shape::Padded => [&b" \t"[..], &line, b"  \r"].concat(),
        Shape::ExtraFields(extra) => {
            // Insert the extra fields first: `{"x-..":RAW,` + the rest of the object.
            let mut out = b"{".to_vec();
            for (k, raw) in extra {
                out.extend(serde_json::to_vec(k).unwrap());
                out.push(b':');
                out.extend(raw);
                out.push(b',');
            }
            out.extend(&line[1..]);
            out
        }
    }
}

/// A garbage inbox line: anything without a `\n` that is not a message.
fn garbage_line() -> BoxedStrategy<Vec<u8>> {
    arbitrary_bytes(
        message()
            .prop_map(|m| serde_json::to_vec(&m).unwrap())
            .boxed(),
    )
    .prop_map(one_line)
    .prop_filter("garbage must not parse as a message", |l| {
        !l.is_empty() && Message::parse_line(l).is_err()
    })
    .boxed()
}

/// One line of a generated inbox.
#[derive(Debug, Clone)]
enum Line {
    /// A message, with the shape of its line.
    Valid(Box<Message>, Shape),
    /// Another copy of an earlier valid line (a redelivery): must not be delivered twice.
    Repeat(Index),
    /// An unparsable line: must be set aside.
    Garbage(Vec<u8>),
    /// An empty line: ignored.
    Blank,
}

fn inbox_line() -> BoxedStrategy<Line> {
    prop_oneof![
        6 => (small_message(), shape()).prop_map(|(m, s)| Line::Valid(Box::new(m), s)),
        1 => any::<Index>().prop_map(Line::Repeat),
        4 => garbage_line().prop_map(Line::Garbage),
        1 => Just(Line::Blank),
    ]
    .boxed()
}

/// A torn tail: bytes without a `\n` (often the start of a real line).
fn torn_tail() -> BoxedStrategy<Vec<u8>> {
    prop_oneof![
        1 => Just(Vec::new()),
        2 => (small_message(), any::<Index>()).prop_map(|(m, i)| {
            let mut line = m.to_line().unwrap();
            line.truncate(i.index(line.len() - 1).max(1));
            line
        }),
        2 => arbitrary_bytes(prop::collection::vec(any::<u8>(), 1..64).boxed()).prop_map(one_line),
    ]
    .prop_filter("a torn tail is not a whole message", |t| {
        Message::parse_line(t).is_err()
    })
    .boxed()
}

/// The set-aside records of an inbox: `(reason, line)` per record, in order.
fn corrupt_records(team: &TeamDir, name: &AgentName) -> Vec<(String, String)> {
    let Ok(text) = std::fs::read_to_string(team.inbox_corrupt(name)) else {
        return Vec::new();
    };
    assert!(text.is_empty() || text.ends_with('\n'), "torn corrupt file");
    text.lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).expect("corrupt record is JSON");
            assert!(v["at"].is_f64(), "{l}");
            (
                v["reason"].as_str().unwrap().to_owned(),
                v["line"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn inbox_ids(entries: &[Entry]) -> Vec<String> {
    entries
        .iter()
        .filter_map(|e| match e {
            Entry::Inbox { message, .. } => Some(message.id.clone()),
            _ => None,
        })
        .collect()
}

const TORN: &str = "torn line (writer died mid-write)";

/// Whether `bytes` are JSON cut short (what a killed writer leaves).
fn ends_too_soon(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde::de::IgnoredAny>(bytes).is_err_and(|e| e.is_eof())
}

/// The inbox property (see the module docs); `journaled` picks valid messages that an earlier
/// drain recorded before it died without truncating, `append_first` whether a writer appends
/// before the drain (ending the torn tail) or after it.
fn check_inbox(
    lines: Vec<Line>,
    tail: Vec<u8>,
    journaled: Vec<bool>,
    append_first: bool,
) -> Result<(), TestCaseError> {
    let (_tmp, team) = team();
    let name = alice();
    let inbox = Inbox::new(&team, &name);
    let (mut journal, _) = open_journal(&team, &name);

    let mut bytes = Vec::new();
    let mut valid: Vec<(Message, Vec<u8>)> = Vec::new();
    let mut garbage: Vec<String> = Vec::new();
    for (i, line) in lines.into_iter().enumerate() {
        match line {
            Line::Valid(mut m, shape) => {
                m.id = format!("{}#{i}", m.id); // unique ids: each line is its own message
                let raw = render(&m, &shape);
                bytes.extend(&raw);
                valid.push((*m, raw));
            }
            Line::Repeat(k) if !valid.is_empty() => {
                bytes.extend(&valid[k.index(valid.len())].1);
            }
            Line::Repeat(_) | Line::Blank => {}
            Line::Garbage(raw) => {
                bytes.extend(&raw);
                garbage.push(String::from_utf8_lossy(&raw).into_owned());
            }
        }
        bytes.push(b'\n');
    }
    bytes.extend(&tail);
    std::fs::write(inbox.path(), &bytes).unwrap();

    // An earlier drain journaled some messages and died before truncating the inbox.
    let (mut before, mut fresh) = (Vec::new(), Vec::new());
    for (i, (m, _)) in valid.iter().enumerate() {
        if journaled.get(i).copied().unwrap_or(false) {
            before.push(m.clone());
        } else {
            fresh.push(m.clone());
        }
    }
    let entries: Vec<Entry> = before
        .iter()
        .map(|m| Entry::Inbox {
            message: m.clone(),
            at: None,
        })
        .collect();
    journal.append(&entries).unwrap();

    let late = Message::new(MessageType::Message, "lead", "alice", "after the tear");
    let delivered = if append_first {
        // The writer's line starts with a `\n` that ends the fragment; the drain delivers every
        // message and sets the fragment aside with the garbage.
        inbox.append(&late, Durability::ProcessCrash).unwrap();
        let got = inbox.drain(&mut journal).unwrap();
        let mut want = fresh.clone();
        want.push(late.clone());
        prop_assert_eq!(&got, &want);
        got
    } else {
        // The drain sets the unterminated tail aside itself; a later append is delivered by the
        // next drain.
        let mut got = inbox.drain(&mut journal).unwrap();
        prop_assert_eq!(&got, &fresh);
        inbox.append(&late, Durability::ProcessCrash).unwrap();
        let again = inbox.drain(&mut journal).unwrap();
        prop_assert_eq!(&again, std::slice::from_ref(&late));
        got.extend(again);
        got
    };
    prop_assert_eq!(inbox.len(), 0, "the inbox is truncated after a drain");
    prop_assert!(inbox.drain(&mut journal).unwrap().is_empty());

    // Every garbage line, then the torn tail, was set aside once, in order. A tail that is JSON
    // cut short is called torn, whether the drain found it unterminated or a writer ended it.
    let mut expected_corrupt = garbage;
    let tail_line = String::from_utf8_lossy(&tail).into_owned();
    if !tail.is_empty() {
        expected_corrupt.push(tail_line.clone());
    }
    let records = corrupt_records(&team, &name);
    let lines: Vec<&String> = records.iter().map(|(_, line)| line).collect();
    prop_assert_eq!(lines, expected_corrupt.iter().collect::<Vec<_>>());
    if let Some((why, _)) = records.last().filter(|_| !tail.is_empty())
        && (!append_first || ends_too_soon(&tail))
    {
        prop_assert_eq!(why, TORN, "the tail {:?}", tail_line);
    }
    prop_assert!(records.iter().all(|(why, _)| !why.is_empty()));
    let events = troupe::events::read_all(&team).unwrap();
    let set_aside: u64 = events
        .iter()
        .filter(|e| e["event"] == "inbox_corrupt")
        .map(|e| e["lines"].as_u64().unwrap())
        .sum();
    prop_assert_eq!(set_aside as usize, expected_corrupt.len());

    // The journal holds every valid message exactly once, whole: the earlier batch, then this
    // drain's, as a reopen and a plain read find them.
    let want: Vec<Entry> = before
        .iter()
        .chain(&delivered)
        .map(|m| Entry::Inbox {
            message: m.clone(),
            at: None,
        })
        .collect();
    let (reopened, entries) = open_journal(&team, &name);
    prop_assert_eq!(&consumed(entries), &want);
    prop_assert_eq!(reopened.seen_count(), want.len());
    prop_assert_eq!(&consumed(read_entries(journal.path()).unwrap()), &want);
    Ok(())
}

proptest! {
    #![proptest_config(cases(256))]

    /// Valid messages among garbage, blank and repeated lines, with a torn tail: each valid
    /// message is delivered exactly once, in order; garbage and the tail are set aside.
    #[test]
    fn inbox_drain_delivers_every_valid_message_once(
        lines in prop::collection::vec(inbox_line(), 0..24),
        tail in torn_tail(),
        journaled in prop::collection::vec(prop::bool::weighted(0.15), 0..24),
        append_first in any::<bool>(),
    ) {
        check_inbox(lines, tail, journaled, append_first)?;
    }
}

proptest! {
    #![proptest_config(cases(256))]

    /// Any bytes in an inbox: drain and peek return, never panic; whatever drain delivers is
    /// exactly what peek saw, and the inbox is empty afterwards.
    #[test]
    fn inbox_drain_survives_any_bytes(
        bytes in arbitrary_bytes(message().prop_map(|m| serde_json::to_vec(&m).unwrap()).boxed()),
        more in prop::collection::vec(
            arbitrary_bytes(message().prop_map(|m| serde_json::to_vec(&m).unwrap()).boxed()), 0..4),
    ) {
        let (_tmp, team) = team();
        let inbox = Inbox::new(&team, &alice());
        let (mut journal, _) = open_journal(&team, &alice());
        let mut all = bytes;
        for m in more {
            all.push(b'\n');
            all.extend(m);
        }
        std::fs::write(inbox.path(), &all).unwrap();
        let peeked = inbox.peek().unwrap();
        let drained = inbox.drain(&mut journal).unwrap();
        let mut seen = HashSet::new();
        let unique: Vec<Message> = peeked.into_iter().filter(|m| seen.insert(m.id.clone())).collect();
        prop_assert_eq!(drained, unique);
        prop_assert_eq!(inbox.len(), 0);
    }

    /// `parse_line` on anything never panics, and accepts only what names an id and a type.
    #[test]
    fn parse_line_never_panics(
        line in arbitrary_bytes(message().prop_map(|m| serde_json::to_vec(&m).unwrap()).boxed()),
    ) {
        if let Ok(m) = Message::parse_line(&line) {
            prop_assert!(!m.id.is_empty());
            prop_assert!(!m.kind.is_protocol() || m.request_id.is_some());
            prop_assert!(m.timestamp.is_finite());
        }
    }

    /// `to_line` writes one `\n`-terminated line within the limit, or refuses with the size;
    /// the line parses back to the same message, and no strict prefix of it (a torn write) does.
    #[test]
    fn to_line_round_trips(m in message(), cuts in prop::collection::vec(any::<Index>(), 8)) {
        match m.to_line() {
            Ok(line) => {
                prop_assert!(line.len() <= MAX_MESSAGE_BYTES);
                prop_assert_eq!(line.last(), Some(&b'\n'));
                let body = &line[..line.len() - 1];
                prop_assert!(!body.contains(&b'\n'), "a message line holds one line");
                prop_assert_eq!(Message::parse_line(body).unwrap(), m);
                for cut in cuts {
                    let prefix = &body[..cut.index(body.len())];
                    prop_assert!(Message::parse_line(prefix).is_err(), "{} bytes parsed", prefix.len());
                }
            }
            Err(Error::MessageTooLarge { size, limit }) => {
                prop_assert_eq!(limit, MAX_MESSAGE_BYTES);
                prop_assert!(size > MAX_MESSAGE_BYTES);
                prop_assert_eq!(size, serde_json::to_vec(&m).unwrap().len() + 1);
            }
            Err(e) => prop_assert!(false, "unexpected error: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Requests

/// A request file as the store writes it, for mutation.
fn request_json() -> BoxedStrategy<Vec<u8>> {
    (
        prop::sample::select(vec!["shutdown", "plan_approval"]),
        prop::sample::select(vec!["pending", "approved", "rejected", "expired"]),
        json_value(),
        prop::option::of(json_value()),
        prop::option::of(any::<u64>()),
        finite(),
        prop::option::of(finite()),
        any::<bool>(),
    )
        .prop_map(|(kind, status, payload, response, inc, at, exp, pretty)| {
            let v = json!({
                "request_id": "0badf00d", "kind": kind, "from": "lead", "to": "alice",
                "status": status, "payload": payload, "response": response,
                "target_incarnation": inc, "created_at": at, "updated_at": at, "expires_at": exp,
            });
            if pretty {
                serde_json::to_vec_pretty(&v).unwrap()
            } else {
                serde_json::to_vec(&v).unwrap()
            }
        })
        .boxed()
}

/// 8 lower-case hex characters.
fn request_id() -> BoxedStrategy<String> {
    any::<u32>().prop_map(|n| format!("{n:08x}")).boxed()
}

/// A good request made through the store: kind, reason or plan, whether to answer it.
#[derive(Debug, Clone)]
struct Good {
    shutdown: bool,
    text: String,
    answer: Option<bool>,
}

fn good_request() -> BoxedStrategy<Good> {
    (any::<bool>(), text(0..80), prop::option::of(any::<bool>()))
        .prop_map(|(shutdown, text, answer)| Good {
            shutdown,
            text,
            answer,
        })
        .boxed()
}

/// Files in `requests/` that are not requests: `(name, bytes)`; the name may look like an id.
fn stray_file() -> BoxedStrategy<(String, Vec<u8>)> {
    let name = prop_oneof![
        4 => request_id().prop_map(|id| format!("{id}.json")),
        1 => prop::sample::select(vec![
            "ABCDEF01.json", "abc.json", "abcdef012.json", "abcdef01.json.tmp",
            ".abcdef01.json", "abcdef01.jso", "abcdefgh.json", "notes.txt",
        ]).prop_map(str::to_owned),
    ];
    (name, arbitrary_bytes(request_json())).boxed()
}

proptest! {
    #![proptest_config(cases(128))]

    /// `get` on any bytes returns a request or an error naming the file; `list` returns every
    /// good request, with its status, whatever else lies in the directory, and answering a
    /// corrupt request fails cleanly and leaves the file as it was.
    #[test]
    fn requests_get_and_list_survive_any_file(
        goods in prop::collection::vec(good_request(), 0..4),
        strays in prop::collection::vec(stray_file(), 1..6),
    ) {
        let (_tmp, team) = team();
        let store = RequestStore::new(&team);
        let mut made = Vec::new();
        for g in &goods {
            let new = if g.shutdown {
                NewRequest {
                    kind: RequestKind::Shutdown, from: "lead".into(), to: "alice".into(),
                    payload: json!({"reason": g.text}), target_incarnation: Some(1), ttl: None,
                }
            } else {
                NewRequest {
                    kind: RequestKind::PlanApproval, from: "alice".into(), to: "lead".into(),
                    payload: json!({"plan": g.text}), target_incarnation: None, ttl: None,
                }
            };
            let r = store.create(new).unwrap();
            let r = match g.answer {
                Some(approve) => store.resolve(&r.request_id, &r.to, approve, json!({"reason": g.text})).unwrap(),
                None => r,
            };
            made.push(r);
        }
        let good_ids: HashSet<&str> = made.iter().map(|r| r.request_id.as_str()).collect();
        let mut parsed_strays = 0;
        for (file, bytes) in &strays {
            if good_ids.iter().any(|id| file.starts_with(id)) {
                continue;
            }
            let path = team.requests_dir().join(file);
            std::fs::write(&path, bytes).unwrap();
            let Some(id) = file.strip_suffix(".json").filter(|id| troupe::teamdir::check_request_id(id).is_ok()) else {
                continue;
            };
            match store.get(id) {
                Ok(_) => parsed_strays += 1,
                Err(e @ Error::Corrupt { .. }) => {
                    prop_assert!(e.to_string().contains(&path.display().to_string()), "{e}");
                    // Answering it fails cleanly and leaves the file as it was.
                    let answered = store.resolve(id, "alice", true, json!({}));
                    prop_assert!(answered.is_err(), "answered a corrupt request");
                    prop_assert!(store.expire_if_due(id).is_err());
                    prop_assert_eq!(&std::fs::read(&path).unwrap(), bytes);
                }
                Err(e) => prop_assert!(false, "unexpected error for {}: {e}", file),
            }
        }
        let listed = store.list(None).unwrap();
        for r in &made {
            prop_assert!(listed.contains(r), "lost {}", r.request_id);
            prop_assert_eq!(&store.get(&r.request_id).unwrap(), r);
        }
        // A stray at an already-seen name was skipped; every other parsable one is listed.
        prop_assert!(listed.len() >= made.len());
        prop_assert!(listed.len() <= made.len() + parsed_strays);
        let pending = store.list(Some(RequestStatus::Pending)).unwrap();
        prop_assert!(pending.iter().all(|r| r.status == RequestStatus::Pending));
        for r in made.iter().filter(|r| r.status == RequestStatus::Pending) {
            prop_assert!(pending.contains(r));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// config.json

/// Keys no struct of the roster knows.
fn extra_key() -> BoxedStrategy<String> {
    text(0..10).prop_map(|k| format!("x-{k}")).boxed()
}

/// Unknown fields and their values. Nesting stays well inside serde_json's recursion limit,
/// which a flattened map is subject to (deeper is a clean parse error, tested separately).
fn extras() -> BoxedStrategy<Map<String, Value>> {
    prop::collection::vec(
        (
            extra_key(),
            prop_oneof![
                4 => json_value(),
                1 => (1usize..100).prop_map(|d| serde_json::from_slice(&nested_arrays(d)).unwrap()),
            ],
        ),
        0..4,
    )
    .prop_map(|kv| kv.into_iter().collect())
    .boxed()
}

fn member_json() -> BoxedStrategy<Value> {
    (
        text(0..16),
        text(0..16),
        prop::sample::select(vec![
            "spawning", "working", "idle", "shutdown", "failed", "stopped",
        ]),
        prop::option::of(any::<u32>()),
        any::<u64>(),
        extras(),
        any::<bool>(),
    )
        .prop_map(|(name, role, status, pid, incarnation, extra, reference)| {
            let mut m = Map::new();
            m.insert("name".into(), json!(name));
            m.insert("role".into(), json!(role));
            m.insert("status".into(), json!(status));
            if !reference {
                // The reference design writes only name, role and status.
                m.insert("pid".into(), json!(pid));
                m.insert("incarnation".into(), json!(incarnation));
            }
            m.extend(extra);
            Value::Object(m)
        })
        .boxed()
}

fn config_json() -> BoxedStrategy<Value> {
    (
        text(0..16),
        prop::collection::vec(member_json(), 0..4),
        extras(),
    )
        .prop_map(|(team_name, members, extra)| {
            let mut c = Map::new();
            c.insert("team_name".into(), json!(team_name));
            c.insert("members".into(), Value::Array(members));
            c.extend(extra);
            Value::Object(c)
        })
        .boxed()
}

/// Whether every field of `want` is in `got` with the same value (objects recursively, arrays
/// element by element): `got` may add defaulted fields.
fn contains(got: &Value, want: &Value) -> bool {
    match (got, want) {
        (Value::Object(g), Value::Object(w)) => w
            .iter()
            .all(|(k, wv)| g.get(k).is_some_and(|gv| contains(gv, wv))),
        (Value::Array(g), Value::Array(w)) => {
            g.len() == w.len() && g.iter().zip(w).all(|(g, w)| contains(g, w))
        }
        _ => got == want,
    }
}

proptest! {
    #![proptest_config(cases(256))]

    /// Any bytes in config.json: `load` returns a roster or an error naming the file, and
    /// neither it nor a refused update changes the file.
    #[test]
    fn config_load_survives_any_bytes(
        bytes in arbitrary_bytes(config_json().prop_map(|v| serde_json::to_vec(&v).unwrap()).boxed()),
    ) {
        let (_tmp, team) = team();
        let path = team.config();
        std::fs::write(&path, &bytes).unwrap();
        let roster = Roster::new(&team);
        match roster.load() {
            Ok(_) => {}
            Err(e @ Error::Corrupt { .. }) => {
                let msg = e.to_string();
                prop_assert!(msg.contains(&path.display().to_string()), "{msg}");
                prop_assert!(msg.contains("left untouched"), "{msg}");
                let updated = roster.update(|c| {
                    c.team_name.push('!');
                    Ok(())
                });
                prop_assert!(updated.is_err(), "updated a corrupt roster");
            }
            Err(e) => prop_assert!(false, "unexpected error: {e}"),
        }
        prop_assert_eq!(std::fs::read(&path).unwrap(), bytes);
    }

    /// A valid config with unknown fields (top level and per member) loads, keeps them through a
    /// serialize round trip and through an update that rewrites the file.
    #[test]
    fn config_keeps_unknown_fields(v in config_json(), pretty in any::<bool>()) {
        let (_tmp, team) = team();
        let bytes = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) }.unwrap();
        std::fs::write(team.config(), &bytes).unwrap();
        let roster = Roster::new(&team);
        let cfg: TeamConfig = roster.load().unwrap();
        prop_assert_eq!(cfg.members.len(), v["members"].as_array().unwrap().len());
        let out = serde_json::to_value(&cfg).unwrap();
        prop_assert!(contains(&out, &v), "lost a field:\n{out:#}\nvs\n{v:#}");
        let again: TeamConfig = serde_json::from_value(out).unwrap();
        prop_assert_eq!(&again, &cfg);

        // An update rewrites the file and keeps what it did not change.
        roster.update(|c| {
            c.team_name.push('!');
            for m in &mut c.members {
                m.restarts = m.restarts.saturating_add(1);
                m.status = MemberStatus::Stopped;
            }
            Ok(())
        }).unwrap();
        let written: Value = serde_json::from_slice(&std::fs::read(team.config()).unwrap()).unwrap();
        let mut want = v.clone();
        want["team_name"] = json!(format!("{}!", v["team_name"].as_str().unwrap()));
        for m in want["members"].as_array_mut().unwrap() {
            m["status"] = json!("stopped");
        }
        prop_assert!(contains(&written, &want), "lost a field:\n{written:#}\nvs\n{want:#}");
    }
}

// ---------------------------------------------------------------------------------------------
// Model responses: cassettes and transcripts

fn block() -> BoxedStrategy<Block> {
    prop_oneof![
        text(0..80).prop_map(|text| Block::Text { text }),
        (text(0..12), text(0..12), json_value()).prop_map(|(id, name, input)| Block::ToolUse {
            id,
            name,
            input
        }),
        (text(0..12), text(0..80), any::<bool>()).prop_map(|(tool_use_id, content, is_error)| {
            Block::ToolResult {
                tool_use_id,
                content,
                is_error,
            }
        }),
    ]
    .boxed()
}

fn response() -> BoxedStrategy<ChatResponse> {
    (
        prop::collection::vec(block(), 0..4),
        prop_oneof![
            prop::sample::select(vec![
                StopReason::EndTurn,
                StopReason::ToolUse,
                StopReason::MaxTokens,
                StopReason::StopSequence,
                StopReason::PauseTurn,
                StopReason::Refusal,
                StopReason::ContextWindowExceeded,
            ]),
            // An unknown reason is kept verbatim (a known name would parse as that variant).
            text(0..10).prop_map(|t| StopReason::Other(format!("x-{t}"))),
        ],
        any::<[u64; 4]>(),
        text(0..12),
    )
        .prop_map(|(content, stop_reason, u, model)| ChatResponse {
            content,
            stop_reason,
            usage: Usage {
                input_tokens: u[0],
                output_tokens: u[1],
                cache_creation_input_tokens: u[2],
                cache_read_input_tokens: u[3],
            },
            model,
        })
        .boxed()
}

fn cassette_entry() -> BoxedStrategy<CassetteEntry> {
    (
        prop::sample::select(vec!["lead", "coder", "tester"]),
        0u64..6,
        prop::option::of(0u64..40),
        response(),
    )
        .prop_map(|(agent, seq, turn, response)| CassetteEntry {
            agent: agent.to_owned(),
            seq,
            turn,
            response,
        })
        .boxed()
}

fn cassette_line() -> BoxedStrategy<Vec<u8>> {
    cassette_entry()
        .prop_map(|e| serde_json::to_vec(&e).unwrap())
        .boxed()
}

/// Text for a whole cassette: any of the garbage above, made valid UTF-8 (the API takes `&str`).
fn cassette_text() -> BoxedStrategy<String> {
    prop::collection::vec(
        prop_oneof![
            3 => arbitrary_bytes(cassette_line()),
            1 => cassette_line(),
            1 => Just(Vec::new()),
        ],
        1..6,
    )
    .prop_map(|lines| String::from_utf8_lossy(&lines.join(&b'\n')).into_owned())
    .boxed()
}

fn entry() -> BoxedStrategy<Entry> {
    prop_oneof![
        (any::<u64>(), any::<u32>(), finite()).prop_map(|(incarnation, pid, at)| Entry::Session {
            incarnation,
            pid,
            at
        }),
        small_message().prop_map(|message| Entry::Inbox { message, at: None }),
        (any::<u64>(), response(), finite()).prop_map(|(seq, response, at)| Entry::Assistant {
            seq,
            response,
            at,
            started_at: None,
            waited: None,
        }),
        (
            prop::collection::vec(block(), 0..3),
            prop::collection::vec(text(1..10), 0..3),
            finite()
        )
            .prop_map(|(results, inbox_ids, at)| Entry::ToolResults {
                results,
                inbox_ids,
                at,
                timings: Vec::new(),
            }),
        (prop::collection::vec(text(1..10), 0..3), finite())
            .prop_map(|(ids, at)| Entry::Handled { ids, at }),
        (finite(), prop::option::of(small_message()))
            .prop_map(|(at, notification)| Entry::Idle { at, notification }),
        (text(1..10), finite()).prop_map(|(id, at)| Entry::IdleDelivered { id, at }),
        (text(0..80), finite()).prop_map(|(text, at)| Entry::User { text, at }),
    ]
    .boxed()
}

fn entry_json() -> BoxedStrategy<Vec<u8>> {
    entry()
        .prop_map(|e| serde_json::to_vec(&e).unwrap())
        .boxed()
}

/// One line of a generated transcript (a test value: its size does not matter).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
enum JournalLine {
    Valid(Entry),
    Garbage(Vec<u8>),
    Blank,
}

fn journal_line() -> BoxedStrategy<JournalLine> {
    prop_oneof![
        3 => entry().prop_map(JournalLine::Valid),
        2 => arbitrary_bytes(entry_json())
            .prop_map(one_line)
            .prop_filter("garbage must not parse as an entry", |l| {
                serde_json::from_slice::<Entry>(l).is_err()
            })
            .prop_map(JournalLine::Garbage),
        1 => Just(JournalLine::Blank),
    ]
    .boxed()
}

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

proptest! {
    #![proptest_config(cases(256))]

    /// Any text as a cassette: loads or is refused with a config error; never panics. Any bytes
    /// as a cassette file: the same through `open`.
    #[test]
    fn cassette_parse_never_panics(
        text in cassette_text(),
        bytes in arbitrary_bytes(cassette_line()),
    ) {
        match ReplayProvider::from_str(&text) {
            Ok(_) | Err(LlmError::Config(_)) => {}
            Err(e) => prop_assert!(false, "unexpected error: {e}"),
        }
        let tmp = tempfile::tempdir().unwrap();
        let path = write_file(tmp.path(), "c.jsonl", &bytes);
        match ReplayProvider::open(&path) {
            Ok(_) => {}
            Err(LlmError::Config(msg)) => {
                prop_assert!(msg.contains(&path.display().to_string()), "{msg}");
            }
            Err(e) => prop_assert!(false, "unexpected error: {e}"),
        }
    }

    /// A cassette of valid entries and blank lines loads every call, whatever its unterminated
    /// last line; a complete bad line is refused with its line number.
    #[test]
    fn cassette_keeps_every_entry_and_names_bad_lines(
        entries in prop::collection::vec(cassette_entry(), 0..8),
        blanks in prop::collection::vec(any::<bool>(), 8),
        tail in torn_tail(),
        bad in prop::option::of((any::<Index>(), arbitrary_bytes(cassette_line()).prop_map(one_line))),
    ) {
        let mut lines: Vec<Vec<u8>> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if blanks[i] {
                lines.push(b"  \r".to_vec());
            }
            lines.push(serde_json::to_vec(e).unwrap());
        }
        let calls: HashSet<(&str, u64)> = entries.iter().map(|e| (e.agent.as_str(), e.seq)).collect();
        let mut text = Vec::new();
        for l in &lines {
            text.extend(l);
            text.push(b'\n');
        }
        text.extend(&tail);
        let text = String::from_utf8_lossy(&text).into_owned();
        let replay = ReplayProvider::from_str(&text).unwrap();
        prop_assert_eq!(replay.len(), calls.len());

        if let Some((at, raw)) = bad {
            let raw = String::from_utf8_lossy(&raw).into_owned();
            let trimmed = raw.trim();
            if !trimmed.is_empty() && serde_json::from_str::<CassetteEntry>(trimmed).is_err() {
                let at = at.index(lines.len() + 1);
                let mut with_bad: Vec<String> =
                    lines.iter().map(|l| String::from_utf8(l.clone()).unwrap()).collect();
                with_bad.insert(at, raw);
                let text = with_bad.join("\n") + "\n";
                match ReplayProvider::from_str(&text) {
                    Err(LlmError::Config(msg)) => {
                        prop_assert!(msg.contains(&format!("line {}:", at + 1)), "{msg}");
                    }
                    other => prop_assert!(false, "bad line {} accepted: {:?}", at + 1, other.map(|r| r.len())),
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(128))]

    /// Any bytes as a transcript: `read_entries` and `Journal::open_path` return, never panic,
    /// and agree.
    #[test]
    fn transcript_read_never_panics(
        lines in prop::collection::vec(arbitrary_bytes(entry_json()), 1..5),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let path = write_file(tmp.path(), "t.jsonl", &lines.join(&b'\n'));
        let read = read_entries(&path).unwrap();
        let (_, opened) = Journal::open_path(path.clone(), &own_path(&path)).unwrap();
        prop_assert_eq!(read, opened);
    }

    /// Valid entries among garbage and blank lines, with a torn tail: every complete valid entry
    /// is returned, in order; opening the journal cuts the tail, and a later append follows the
    /// last complete line.
    #[test]
    fn transcript_returns_every_complete_entry(
        lines in prop::collection::vec(journal_line(), 0..16),
        tail in torn_tail(),
    ) {
        let mut bytes = Vec::new();
        let mut want = Vec::new();
        for line in lines {
            match line {
                JournalLine::Valid(e) => {
                    bytes.extend(serde_json::to_vec(&e).unwrap());
                    want.push(e);
                }
                JournalLine::Garbage(raw) => bytes.extend(raw),
                JournalLine::Blank => {}
            }
            bytes.push(b'\n');
        }
        let complete = bytes.len();
        bytes.extend(&tail);
        let tmp = tempfile::tempdir().unwrap();
        let path = write_file(tmp.path(), "t.jsonl", &bytes);
        prop_assert_eq!(&read_entries(&path).unwrap(), &want);

        let (mut journal, entries) = Journal::open_path(path.clone(), &own_path(&path)).unwrap();
        prop_assert_eq!(&entries, &want);
        prop_assert_eq!(std::fs::read(&path).unwrap().len(), complete, "the torn tail is cut");
        for id in inbox_ids(&want) {
            prop_assert!(journal.has_seen(&id));
        }
        let idle = Entry::Idle {
            at: 1.5,
            notification: None,
        };
        journal.append(std::slice::from_ref(&idle)).unwrap();
        want.push(idle);
        prop_assert_eq!(read_entries(&path).unwrap(), want);
    }
}

/// Regression, found by `inbox_drain_delivers_every_valid_message_once`: the drain journals each
/// message's raw inbox line inside an `Entry::Inbox`. A line with an unknown field nested deeper
/// than serde_json's recursion limit, or holding a number out of range, invalid UTF-8 or a lone
/// surrogate, is a valid message (the envelope skips unknown fields without looking closely) but
/// not a readable `Entry` (an internally tagged enum buffers every field), so the journal read
/// back without it: the message, delivered and the inbox truncated, vanished from the transcript
/// and from the conversation rebuilt after a restart.
#[test]
fn journal_reads_back_messages_with_deep_or_huge_unknown_fields() {
    let raws: Vec<Vec<u8>> = vec![
        nested_arrays(10_000),
        nested_objects(10_000),
        nested_arrays(128),
        b"1e999".to_vec(),
        b"-1e999".to_vec(),
        b"123456789012345678901234567890".to_vec(),
        b"\"\xff\xfe\"".to_vec(),
        b"\"\\ud800\"".to_vec(),
    ];
    for raw in raws {
        let (_tmp, team) = team();
        let inbox = Inbox::new(&team, &alice());
        let (mut journal, _) = open_journal(&team, &alice());
        let m = Message::new(MessageType::Message, "lead", "alice", "deep");
        let mut line = render(&m, &Shape::ExtraFields(vec![("x-extra".into(), raw)]));
        assert_eq!(Message::parse_line(&line).unwrap(), m);
        line.push(b'\n');
        std::fs::write(inbox.path(), &line).unwrap();
        assert_eq!(inbox.drain(&mut journal).unwrap(), vec![m.clone()]);
        let want = vec![Entry::Inbox {
            message: m.clone(),
            at: None,
        }];
        let read = read_entries(journal.path()).unwrap();
        assert!(
            matches!(read[..], [Entry::Inbox { at: Some(t), .. }] if t > 0.0),
            "the drain records when it consumed the message: {read:?}"
        );
        assert_eq!(consumed(read), want);
        let (reopened, entries) = open_journal(&team, &alice());
        assert_eq!(consumed(entries), want);
        assert!(reopened.has_seen(&m.id));
    }
}

proptest! {
    #![proptest_config(cases(128))]

    /// Issue 14, the offset file: whatever `NAME.offset` holds (garbage, a torn write, a
    /// number past the end, a number in the middle of a line, nothing), a drain loses nothing
    /// and repeats nothing. A consumer that journaled the first `done` messages drains, with
    /// that offset file, exactly the rest, in order; the offset it leaves never points past the
    /// file.
    #[test]
    fn any_offset_file_loses_and_repeats_nothing(
        msgs in prop::collection::vec(message(), 1..12),
        done in any::<Index>(),
        offset in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..40),
            any::<u64>().prop_map(|n| format!("{n:020}\n").into_bytes()),
            (0u64..4096).prop_map(|n| format!("{n:020}\n").into_bytes()),
            (0u64..4096).prop_map(|n| format!("{n:020}").into_bytes()),
        ],
    ) {
        let (_tmp, team) = team();
        let inbox = Inbox::new(&team, &alice());
        let mut unique: Vec<Message> = Vec::new();
        let mut ids = HashSet::new();
        for m in msgs {
            // (An oversized message is refused, as it should be: it is simply not sent.)
            if ids.insert(m.id.clone()) && inbox.append(&m, Durability::ProcessCrash).is_ok() {
                unique.push(m);
            }
        }
        let done = done.index(unique.len() + 1);
        {
            let (mut j, _) = open_journal(&team, &alice());
            let entries: Vec<Entry> = unique[..done]
                .iter()
                .map(|m| Entry::Inbox { message: m.clone(), at: None })
                .collect();
            j.append(&entries).unwrap();
        }
        std::fs::write(team.inbox_offset(&alice()), &offset).unwrap();
        let (mut j, _) = open_journal(&team, &alice());
        let mut got = inbox.drain(&mut j).unwrap();
        got.extend(inbox.drain(&mut j).unwrap());
        let want: Vec<String> = unique[done..].iter().map(|m| m.id.clone()).collect();
        let have: Vec<String> = got.iter().map(|m| m.id.clone()).collect();
        prop_assert_eq!(have, want);
        prop_assert!(inbox.is_empty());
        prop_assert!(inbox.peek().unwrap().is_empty());
    }
}

/// Journal entries with the drain's time of consumption left out, to compare them with the
/// messages alone.
fn consumed(entries: Vec<Entry>) -> Vec<Entry> {
    entries
        .into_iter()
        .map(|e| match e {
            Entry::Inbox { message, .. } => Entry::Inbox { message, at: None },
            other => other,
        })
        .collect()
}
