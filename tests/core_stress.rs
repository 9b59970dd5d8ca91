//! Crash and race tests of the team directory core, with real processes, real flock and real
//! SIGKILL (acceptance points 1-4 of the core issue).

mod support;

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use support::drain::open_journal;

use serde_json::json;
use support::child::{self, Rng};
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::requests::{NewRequest, RequestKind, RequestStatus, RequestStore};
use troupe::{AgentName, TeamDir};

fn alice() -> AgentName {
    AgentName::teammate("alice").unwrap()
}

fn team_from(vars: &HashMap<String, String>) -> TeamDir {
    TeamDir::open(PathBuf::from(&vars["TEAM"])).unwrap()
}

/// Appends COUNT messages ("W:SEQ" or, with SIZE, a SIZE-byte body), reporting each success.
fn writer(vars: &HashMap<String, String>) {
    let team = team_from(vars);
    let w: u64 = vars["WRITER"].parse().unwrap();
    let count: u64 = vars.get("COUNT").map_or(u64::MAX, |c| c.parse().unwrap());
    let size: usize = vars.get("SIZE").map_or(0, |s| s.parse().unwrap());
    let report = vars.contains_key("REPORT");
    let mut out = Inbox::new(&team, &alice()).writer().unwrap();
    for seq in 0..count {
        let head = format!("{w}:{seq}:");
        let body = if size > head.len() {
            format!("{head}{}", "x".repeat(size - head.len()))
        } else {
            head
        };
        let m = Message::new(MessageType::Message, "lead", "alice", body);
        // A full inbox (the drainer fell behind) refuses: wait, as a sender would, and retry.
        while let Err(e) = out.append(&m, Durability::ProcessCrash) {
            assert!(
                matches!(e, troupe::Error::InboxFull { .. }),
                "append failed: {e}"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        if report {
            child::report(&format!("ok {}", m.id));
        }
    }
}

/// Resolves every request id in IDS, once GO exists, reporting wins and losses.
fn resolver(vars: &HashMap<String, String>) {
    let team = team_from(vars);
    let store = RequestStore::new(&team);
    let approve = vars["DECISION"] == "approve";
    let ids: Vec<String> = std::fs::read_to_string(&vars["IDS"])
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let go = PathBuf::from(&vars["GO"]);
    while !go.exists() {
        std::thread::yield_now();
    }
    for id in ids {
        match store.resolve(&id, "alice", approve, json!({"reason": "race"})) {
            Ok(_) => child::report(&format!("win {id}")),
            Err(e) => child::report(&format!("lose {id} {e}")),
        }
    }
}

/// Drains once and dies by SIGKILL after the journal write, before the truncate.
fn dying_drainer(vars: &HashMap<String, String>) {
    let team = team_from(vars);
    let (mut journal, _) = open_journal(&team, &alice());
    Inbox::new(&team, &alice())
        .drain_with(&mut journal, |point, batch| {
            if point != troupe::inbox::DrainPoint::Journaled {
                return;
            }
            child::report(&format!("drained {}", batch.len()));
            nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL)
                .unwrap();
        })
        .unwrap();
    unreachable!("the drainer should have died");
}

#[test]
fn child() {
    child::dispatch(&[
        ("writer", writer),
        ("resolver", resolver),
        ("dying_drainer", dying_drainer),
    ]);
}

fn new_team() -> (tempfile::TempDir, TeamDir) {
    let tmp = tempfile::tempdir().unwrap();
    let team = TeamDir::create(tmp.path().join(".team")).unwrap();
    (tmp, team)
}

fn parse_body(m: &Message) -> (u64, u64) {
    let mut it = m.content.split(':');
    let w = it.next().unwrap().parse().unwrap();
    let s = it.next().unwrap().parse().unwrap();
    (w, s)
}

#[test]
fn four_writers_one_drainer_exactly_once_in_order() {
    const WRITERS: u64 = 4;
    const EACH: u64 = 25_000;
    let (_tmp, team) = new_team();
    let root = team.root().display().to_string();
    let mut kids: Vec<_> = (0..WRITERS)
        .map(|w| {
            child::spawn(
                "writer",
                &[
                    ("TEAM", root.clone()),
                    ("WRITER", w.to_string()),
                    ("COUNT", EACH.to_string()),
                ],
            )
        })
        .collect();
    let inbox = Inbox::new(&team, &alice());
    let (mut journal, _) = open_journal(&team, &alice());
    let mut got = Vec::new();
    let mut done = false;
    while !done {
        done = kids.iter_mut().all(|k| k.try_wait().unwrap().is_some());
        got.extend(inbox.drain(&mut journal).unwrap());
    }
    for k in &mut kids {
        assert!(k.wait().unwrap().success());
    }
    got.extend(inbox.drain(&mut journal).unwrap());

    let ids: HashSet<_> = got.iter().map(|m| m.id.clone()).collect();
    assert_eq!(ids.len(), got.len(), "an id was consumed twice");
    assert_eq!(got.len() as u64, WRITERS * EACH, "messages lost");
    let mut next = vec![0u64; WRITERS as usize];
    for m in &got {
        let (w, s) = parse_body(m);
        assert_eq!(s, next[w as usize], "writer {w} out of order");
        next[w as usize] += 1;
    }
    assert!(!team.inbox_corrupt(&alice()).exists());
}

#[test]
fn sigkilled_writers_never_deliver_torn_messages() {
    const KILLS: usize = 200;
    const SIZE: usize = 20_000;
    let (_tmp, team) = new_team();
    let root = team.root().display().to_string();
    let stop = Arc::new(AtomicBool::new(false));
    let drainer = {
        let team = team.clone();
        let stop = stop.clone();
        std::thread::spawn(move || {
            let inbox = Inbox::new(&team, &alice());
            let (mut journal, _) = open_journal(&team, &alice());
            let mut got = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                got.extend(inbox.drain(&mut journal).unwrap());
                std::thread::sleep(Duration::from_millis(1));
            }
            got.extend(inbox.drain(&mut journal).unwrap());
            got
        })
    };
    let mut rng = Rng::seeded();
    let mut acked = Vec::new();
    let mut kills = 0;
    let mut w = 0u64;
    let torn = |team: &TeamDir| {
        std::fs::read_to_string(team.inbox_corrupt(&alice())).map_or(0, |c| c.lines().count())
    };
    // At least KILLS kills, and more (up to 10x) until one kill has torn a line, so that the
    // set-aside path is exercised in every run.
    while kills < KILLS || (torn(&team) == 0 && kills < 10 * KILLS) {
        // Two writers at a time, each killed after a random few milliseconds.
        let mut pair: Vec<_> = (0..2)
            .map(|_| {
                w += 1;
                child::spawn(
                    "writer",
                    &[
                        ("TEAM", root.clone()),
                        ("WRITER", w.to_string()),
                        ("SIZE", SIZE.to_string()),
                        ("REPORT", "1".into()),
                    ],
                )
            })
            .collect();
        std::thread::sleep(Duration::from_micros(rng.range(3_000, 25_000)));
        for k in &mut pair {
            std::thread::sleep(Duration::from_micros(rng.range(0, 500)));
            k.kill().unwrap();
            kills += 1;
        }
        for mut k in pair {
            let status = k.wait().unwrap();
            assert!(!status.success(), "writer should have been killed");
            let mut out = Vec::new();
            k.stdout.take().unwrap().read_to_end(&mut out).unwrap();
            acked.extend(child::reports(&out, "ok "));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let got = drainer.join().unwrap();

    let ids: HashSet<_> = got.iter().map(|m| m.id.as_str()).collect();
    assert_eq!(ids.len(), got.len(), "an id was consumed twice");
    for m in &got {
        assert_eq!(m.content.len(), SIZE, "torn message delivered");
        assert!(
            m.content
                .split(':')
                .nth(2)
                .unwrap()
                .bytes()
                .all(|b| b == b'x')
        );
    }
    let lost: Vec<_> = acked
        .iter()
        .filter(|id| !ids.contains(id.as_str()))
        .collect();
    assert!(lost.is_empty(), "{} acknowledged appends lost", lost.len());
    assert!(acked.len() > KILLS, "writers barely wrote: {}", acked.len());

    let corrupt = std::fs::read_to_string(team.inbox_corrupt(&alice())).unwrap_or_default();
    assert!(
        corrupt.lines().count() > 0,
        "no kill tore a line in {kills} kills"
    );
    for line in corrupt.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["reason"], "torn line (writer died mid-write)");
    }
    eprintln!(
        "kills={kills} acked={} delivered={} torn_fragments_set_aside={}",
        acked.len(),
        got.len(),
        corrupt.lines().count()
    );
}

#[test]
fn racing_deciders_have_exactly_one_winner() {
    const N: usize = 1000;
    let (tmp, team) = new_team();
    let store = RequestStore::new(&team);
    let ids: Vec<String> = (0..N)
        .map(|_| {
            store
                .create(NewRequest {
                    kind: RequestKind::Shutdown,
                    from: "lead".into(),
                    to: "alice".into(),
                    payload: json!({"reason": "race"}),
                    target_incarnation: Some(1),
                    ttl: None,
                })
                .unwrap()
                .request_id
        })
        .collect();
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        N,
        "duplicate request ids"
    );
    let ids_file = tmp.path().join("ids");
    std::fs::write(&ids_file, ids.join("\n")).unwrap();
    let go = tmp.path().join("go");
    let root = team.root().display().to_string();
    let kids: Vec<_> = ["approve", "reject"]
        .iter()
        .map(|d| {
            child::spawn(
                "resolver",
                &[
                    ("TEAM", root.clone()),
                    ("DECISION", d.to_string()),
                    ("IDS", ids_file.display().to_string()),
                    ("GO", go.display().to_string()),
                ],
            )
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    std::fs::write(&go, "").unwrap();
    let outs: Vec<_> = kids
        .into_iter()
        .map(|k| {
            let o = k.wait_with_output().unwrap();
            assert!(o.status.success());
            o.stdout
        })
        .collect();
    let mut winners: HashMap<String, usize> = HashMap::new();
    for (i, out) in outs.iter().enumerate() {
        for id in child::reports(out, "win ") {
            assert!(winners.insert(id, i).is_none(), "two winners");
        }
        for lose in child::reports(out, "lose ") {
            let (id, why) = lose.split_once(' ').unwrap();
            let cur = store.get(id).unwrap().status;
            assert_eq!(why, format!("request {id} is already {cur}"));
        }
    }
    assert_eq!(winners.len(), N, "some request had no winner");
    let contested = outs
        .iter()
        .map(|o| child::reports(o, "win ").len())
        .collect::<Vec<_>>();
    eprintln!("wins per decider: {contested:?}");
    for (id, i) in winners {
        let want = if i == 0 {
            RequestStatus::Approved
        } else {
            RequestStatus::Rejected
        };
        assert_eq!(store.get(&id).unwrap().status, want);
    }
}

#[test]
fn drainer_killed_between_journal_and_truncate_repeats_nothing() {
    let (_tmp, team) = new_team();
    let inbox = Inbox::new(&team, &alice());
    let first: Vec<Message> = (0..10)
        .map(|i| Message::new(MessageType::Message, "lead", "alice", format!("m{i}")))
        .collect();
    for m in &first {
        inbox.append(m, Durability::ProcessCrash).unwrap();
    }
    let out = child::spawn(
        "dying_drainer",
        &[("TEAM", team.root().display().to_string())],
    )
    .wait_with_output()
    .unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&out.status),
        Some(9)
    );
    assert_eq!(child::reports(&out.stdout, "drained "), vec!["10"]);
    assert_eq!(
        inbox.peek().unwrap().len(),
        10,
        "inbox must still hold the batch"
    );

    let late = Message::new(MessageType::Message, "lead", "alice", "late");
    inbox.append(&late, Durability::ProcessCrash).unwrap();
    let (mut journal, entries) = open_journal(&team, &alice());
    assert_eq!(entries.len(), 10, "the dead drainer's batch is journaled");
    assert_eq!(inbox.drain(&mut journal).unwrap(), vec![late]);
    assert!(inbox.is_empty());
    let consumed: Vec<String> = troupe::transcript::read_entries(journal.path())
        .unwrap()
        .into_iter()
        .filter_map(|e| match e {
            troupe::transcript::Entry::Inbox { message, .. } => Some(message.id),
            _ => None,
        })
        .collect();
    let mut want: Vec<String> = first.iter().map(|m| m.id.clone()).collect();
    want.push(consumed.last().unwrap().clone());
    assert_eq!(consumed, want, "every message exactly once, in order");
}
