//! The pieces of the drain crash tests that the file inbox and the Redis one share: a drainer
//! that dies by SIGKILL at the NTH time it reaches a crash point, writers whose acknowledged
//! ids are collected as they come, and what a consumer's journal holds.

use std::collections::HashMap;
use std::process::{Child, Output};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use troupe::inbox::{DrainPoint, Inbox};
use troupe::transcript::{Entry, Journal};
use troupe::{AgentName, TeamDir};

use super::child;

/// A crash point by the name the tests pass in the environment.
pub fn point_named(s: &str) -> DrainPoint {
    match s {
        "read" => DrainPoint::Read,
        "journaled" => DrainPoint::Journaled,
        "reset" => DrainPoint::Reset,
        "marked" => DrainPoint::Marked,
        _ => panic!("unknown point {s}"),
    }
}

/// Opens `name`'s journal as its owner. The owner lock is let go at once: the test (or the
/// child) is the only process that uses the journal.
pub fn open_journal(team: &TeamDir, name: &AgentName) -> (Journal, Vec<Entry>) {
    let owner = Journal::try_own(team, name)
        .unwrap()
        .expect("no other owner");
    Journal::open(team, name, &owner).unwrap()
}

/// In a child: drains `inbox`, `name`'s in `team`, until the NTH time (of `vars`) it reaches
/// POINT, and dies there (see [`drain_until_killed`]).
pub fn killed_drainer(
    inbox: &Inbox,
    team: &TeamDir,
    name: &AgentName,
    vars: &HashMap<String, String>,
) {
    let (mut journal, _) = open_journal(team, name);
    drain_until_killed(
        inbox,
        &mut journal,
        point_named(&vars["POINT"]),
        vars["NTH"].parse().unwrap(),
    );
}

/// Drains `inbox` into `journal` as a worker does (when its waiter says something is there)
/// until the `nth` time the drain reaches `point`, and dies there by SIGKILL; gives up after
/// two seconds.
pub fn drain_until_killed(inbox: &Inbox, journal: &mut Journal, point: DrainPoint, nth: u64) {
    let mut waiter = troupe::wait::InboxWaiter::new(inbox).unwrap();
    let mut hits = 0;
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        waiter.wait(Some(Duration::from_millis(10)), &[]).unwrap();
        inbox
            .drain_with(journal, |p, _| {
                if p == point {
                    hits += 1;
                    if hits == nth {
                        nix::sys::signal::kill(
                            nix::unistd::getpid(),
                            nix::sys::signal::Signal::SIGKILL,
                        )
                        .unwrap();
                    }
                }
            })
            .unwrap();
    }
}

/// Starts child `role` with `vars`, and a thread that collects the ids it reports as `ok ID`
/// as they come (a full pipe would stop the child).
pub fn spawn_acked(role: &str, vars: &[(&str, String)]) -> (Child, JoinHandle<Vec<String>>) {
    let mut c = child::spawn(role, vars);
    let mut out = c.stdout.take().unwrap();
    let acks = std::thread::spawn(move || {
        let mut text = Vec::new();
        std::io::Read::read_to_end(&mut out, &mut text).unwrap();
        child::reports(&text, "ok ")
    });
    (c, acks)
}

/// Counts a drainer child that died by SIGKILL at `point` in `kills`; any other end must be
/// a success (it gave up without reaching the point often enough).
pub fn count_kill<'a>(out: &Output, point: &'a str, kills: &mut HashMap<&'a str, u32>) {
    if std::os::unix::process::ExitStatusExt::signal(&out.status) == Some(9) {
        *kills.entry(point).or_default() += 1;
    } else {
        assert!(out.status.success(), "drainer failed: {:?}", out.status);
    }
}

/// `(id, content)` of every inbox message in `name`'s journal, in order.
pub fn journaled(team: &TeamDir, name: &AgentName) -> Vec<(String, String)> {
    troupe::transcript::read_entries(&team.transcript(name))
        .unwrap()
        .into_iter()
        .filter_map(|e| match e {
            Entry::Inbox { message, .. } => Some((message.id, message.content)),
            _ => None,
        })
        .collect()
}
