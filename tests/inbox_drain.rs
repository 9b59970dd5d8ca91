//! Issue 14: the drain that reads under the writers' lock, journals outside it and marks what
//! it consumed with an offset (or a truncate). A drainer is killed with SIGKILL at each of its
//! crash points ([`DrainPoint`]) while writer processes keep appending, again and again; then
//! every acknowledged message is in the consumer's journal exactly once, in each writer's order.
//! And a 200 MiB stream through a 64 MiB-capped inbox with a live drainer meets no back-pressure
//! while the file stays bounded.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use support::child::{self, Rng};
use support::drain;
use troupe::inbox::{DEFAULT_CAP, Durability, Inbox, reclaim_at};
use troupe::message::{Message, MessageType};
use troupe::{AgentName, TeamDir};

fn alice() -> AgentName {
    AgentName::teammate("alice").unwrap()
}

fn team_from(vars: &HashMap<String, String>) -> TeamDir {
    TeamDir::open(PathBuf::from(&vars["TEAM"])).unwrap()
}

/// Appends COUNT messages "W:SEQ:" padded to SIZE bytes (or, without COUNT, until the file
/// STOP exists, pausing PAUSE_US between appends); reports `ok ID` for each. With REFUSED, a
/// refusal for a full inbox is waited out (1 ms, then the same message again) and counted, the
/// count written to that file at the end; without it, a refusal fails the writer.
fn writer(vars: &HashMap<String, String>) {
    let team = team_from(vars);
    let w: u64 = vars["WRITER"].parse().unwrap();
    let count: u64 = vars.get("COUNT").map_or(u64::MAX, |c| c.parse().unwrap());
    let size: usize = vars["SIZE"].parse().unwrap();
    let stop = vars.get("STOP").map(PathBuf::from);
    let pause = Duration::from_micros(vars.get("PAUSE_US").map_or(0, |p| p.parse().unwrap()));
    let mut out = Inbox::new(&team, &alice()).writer().unwrap();
    let refused_file = vars.get("REFUSED").map(PathBuf::from);
    let mut refused = 0u64;
    for seq in 0..count {
        if stop.as_ref().is_some_and(|s| s.exists()) {
            break;
        }
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
        let head = format!("{w}:{seq}:");
        let body = format!("{head}{}", "x".repeat(size.saturating_sub(head.len())));
        let m = Message::new(MessageType::Message, "lead", "alice", body);
        loop {
            match out.append(&m, Durability::ProcessCrash) {
                Err(troupe::Error::InboxFull { .. }) if refused_file.is_some() => {
                    refused += 1;
                    std::thread::sleep(Duration::from_millis(1));
                }
                r => break r.unwrap(),
            }
        }
        child::report(&format!("ok {}", m.id));
    }
    if let Some(f) = refused_file {
        std::fs::write(f, refused.to_string()).unwrap();
    }
}

/// Drains (with the inbox's cap CAP, so reclaims come often) until the NTH time it reaches
/// POINT, and dies there by SIGKILL; gives up after two seconds.
fn killed_drainer(vars: &HashMap<String, String>) {
    let team = team_from(vars);
    let cap: u64 = vars["CAP"].parse().unwrap();
    let inbox = Inbox::new(&team, &alice()).with_cap(cap);
    drain::killed_drainer(&inbox, &team, &alice(), vars);
}

#[test]
fn child() {
    child::dispatch(&[("writer", writer), ("killed_drainer", killed_drainer)]);
}

#[test]
fn a_drainer_killed_at_every_crash_point_loses_and_repeats_nothing() {
    const WRITERS: u64 = 3;
    // Small enough that a drain reclaims every 4 KiB: the catch-up path runs all the time.
    const CAP: u64 = 64 * 1024;
    let tmp = tempfile::tempdir().unwrap();
    let team = TeamDir::create(tmp.path().join(".team")).unwrap();
    let root = team.root().display().to_string();
    drop(Inbox::new(&team, &alice()).writer().unwrap());
    let stop = tmp.path().join("stop");
    // Each writer's acknowledgements, read as they come (a full pipe would stop the writer).
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            drain::spawn_acked(
                "writer",
                &[
                    ("TEAM", root.clone()),
                    ("WRITER", w.to_string()),
                    ("STOP", stop.display().to_string()),
                    ("PAUSE_US", "100".into()),
                    ("SIZE", "120".into()),
                ],
            )
        })
        .collect();
    let mut rng = Rng::seeded();
    let mut kills: HashMap<&str, u32> = HashMap::new();
    let points = ["read", "journaled", "reset", "marked"];
    let mut round = 0;
    // Kill drainers at each point, in turn, while the writers run.
    while round < 40 {
        let point = points[round % points.len()];
        let nth = rng.range(1, 6);
        let out = child::spawn(
            "killed_drainer",
            &[
                ("TEAM", root.clone()),
                ("CAP", CAP.to_string()),
                ("POINT", point.into()),
                ("NTH", nth.to_string()),
            ],
        )
        .wait_with_output()
        .unwrap();
        drain::count_kill(&out, point, &mut kills);
        round += 1;
    }
    std::fs::write(&stop, b"").unwrap();
    let mut acked: HashSet<String> = HashSet::new();
    for (mut w, acks) in writers {
        assert!(w.wait().unwrap().success());
        acked.extend(acks.join().unwrap());
    }
    assert!(
        acked.len() > 1000,
        "the writers barely ran: {}",
        acked.len()
    );
    // What is left, drained by a drainer that is not killed.
    let mut journal = drain::open_journal(&team, &alice()).0;
    let inbox = Inbox::new(&team, &alice()).with_cap(CAP);
    inbox.drain(&mut journal).unwrap();
    assert!(inbox.is_empty());
    drop(journal);

    let got = drain::journaled(&team, &alice());
    let ids: HashSet<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), got.len(), "a message was consumed twice");
    let missing = acked.iter().filter(|id| !ids.contains(id.as_str())).count();
    assert_eq!(missing, 0, "{missing} acknowledged messages lost");
    let mut next = vec![0u64; WRITERS as usize];
    for (_, body) in &got {
        let mut it = body.split(':');
        let w: usize = it.next().unwrap().parse().unwrap();
        let s: u64 = it.next().unwrap().parse().unwrap();
        assert_eq!(s, next[w], "writer {w} out of order");
        next[w] += 1;
    }
    for p in points {
        assert!(
            kills.get(p).copied().unwrap_or(0) > 0,
            "no drainer died at {p}: {kills:?}"
        );
    }
    assert!(!team.inbox_corrupt(&alice()).exists());
}

/// 200 MiB through an inbox capped at 64 MiB, with a drainer that drains on every wake-up as
/// a worker does: no writer is refused while the backlog is below the cap (the consumed bytes
/// are not a backlog), and the file never grows far past the reclaim threshold.
///
/// Whether the drainer keeps up with two writers going flat out is the machine's doing: on a
/// loaded one it may fall 64 MiB behind, and then a refusal is right. So a writer waits out a
/// refusal and counts it, the drainer notes the largest backlog there was around a drain, and a
/// refusal is false only if that never came near the cap.
#[test]
fn a_long_stream_meets_no_false_back_pressure_and_the_file_stays_bounded() {
    const WRITERS: u64 = 2;
    const SIZE: usize = 4096;
    let each = 100 * 1024 * 1024 / SIZE as u64;
    let tmp = tempfile::tempdir().unwrap();
    let team = TeamDir::create(tmp.path().join(".team")).unwrap();
    let root = team.root().display().to_string();
    let inbox = Inbox::new(&team, &alice());
    let mut waiter = troupe::wait::InboxWaiter::new(&inbox).unwrap();
    let mut writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let mut c = child::spawn(
                "writer",
                &[
                    ("TEAM", root.clone()),
                    ("WRITER", w.to_string()),
                    ("COUNT", each.to_string()),
                    ("SIZE", SIZE.to_string()),
                    (
                        "REFUSED",
                        tmp.path()
                            .join(format!("refused-{w}"))
                            .display()
                            .to_string(),
                    ),
                ],
            );
            // Thousands of report lines: read them as they come so no writer blocks on a pipe.
            let out = c.stdout.take().unwrap();
            std::thread::spawn(move || {
                std::io::copy(&mut std::io::BufReader::new(out), &mut std::io::sink()).unwrap()
            });
            c
        })
        .collect();
    let mut journal = drain::open_journal(&team, &alice()).0;
    let (mut got, mut biggest, mut most_consumed) = (0u64, 0u64, 0u64);
    let mut most_behind = 0u64;
    let offset_file = team.inbox_offset(&alice());
    let consumed_now = || -> u64 {
        std::fs::read_to_string(&offset_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    };
    loop {
        let done = writers.iter_mut().all(|w| w.try_wait().unwrap().is_some());
        // The backlog peaks just before a drain marks what it consumed: at least what that drain
        // consumed (a reclaim also takes what came while it journaled), plus what is left.
        let found = std::fs::metadata(inbox.path())
            .map_or(0, |m| m.len())
            .saturating_sub(consumed_now());
        let n = inbox.drain(&mut journal).unwrap().len() as u64;
        got += n;
        let left = std::fs::metadata(inbox.path())
            .map_or(0, |m| m.len())
            .saturating_sub(consumed_now());
        most_behind = most_behind.max(found).max(n * SIZE as u64 + left);
        biggest = biggest.max(std::fs::metadata(inbox.path()).unwrap().len());
        let consumed: u64 = std::fs::read_to_string(&offset_file)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0);
        most_consumed = most_consumed.max(consumed);
        if done && inbox.is_empty() {
            break;
        }
        waiter.wait(Some(Duration::from_millis(5)), &[]).unwrap();
    }
    for w in &mut writers {
        assert!(w.wait().unwrap().success(), "a writer failed");
    }
    let refused: u64 = (0..WRITERS)
        .map(|w| {
            std::fs::read_to_string(tmp.path().join(format!("refused-{w}")))
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    eprintln!("refusals: {refused}; the drainer was at most {most_behind} bytes behind");
    assert!(
        refused == 0 || most_behind >= DEFAULT_CAP / 2,
        "{refused} refusals while the backlog was at most {most_behind} bytes (cap {DEFAULT_CAP})"
    );
    assert_eq!(got, WRITERS * each);
    // Consumed bytes are reclaimed once they pass a 16th of the cap: after any drain, less
    // than that is left consumed in the file. The rest of the file is the backlog, which the
    // cap bounds (each writer may pass it by a 64th of it).
    assert!(
        most_consumed < reclaim_at(DEFAULT_CAP),
        "{most_consumed} consumed bytes left in the file"
    );
    let bound = DEFAULT_CAP + reclaim_at(DEFAULT_CAP) + WRITERS * (DEFAULT_CAP / 64);
    assert!(
        biggest <= bound,
        "the inbox grew to {biggest} bytes (bound {bound})"
    );
}
