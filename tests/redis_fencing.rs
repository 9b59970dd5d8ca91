//! Issue 24, fencing: on a team spread over hosts, a process that was replaced while it was
//! stalled (a supervisor past its lease, a worker whose member a successor runs, a second
//! consumer of the lead's inbox) writes nothing for what it no longer holds, and a Redis outage
//! is not a lost lease.

mod support;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use support::hosts::{Bus, Host, ok};
use support::redis_server::RedisServer;
use support::team::{Bg, alive, pids_with_arg, wait_until};

const T: Duration = Duration::from_secs(40);

/// Ids of the inbox messages in `host`'s journal of `name`.
fn journaled(host: &Host, name: &str) -> Vec<String> {
    let path = host.team.join(format!("transcripts/{name}.jsonl"));
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Vec::new();
    };
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "inbox")
        .filter_map(|v| v["message"]["id"].as_str().map(str::to_owned))
        .collect()
}

fn member<'m>(ms: &'m [Value], name: &str) -> &'m Value {
    ms.iter().find(|m| m["name"] == name).unwrap()
}

/// `lead send NAME TEXT` from `host`: the message's id when it was acknowledged.
fn send(bus: &Bus, host: &Host, name: &str, text: &str) -> Option<String> {
    let o = bus.out(host, &["send", name, text]);
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
}

/// Live worker processes of member `name` (zombies have no command line, so do not count).
fn workers_of(name: &str) -> Vec<u64> {
    pids_with_arg(name)
        .into_iter()
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let args: Vec<&[u8]> = c.split(|b| *b == 0).collect();
                args.windows(2)
                    .any(|w| w[0] == b"--name" && w[1] == name.as_bytes())
            })
        })
        .collect()
}

/// Acceptance 1: supervisor A of host h is stalled (SIGSTOP) past its lease, while its workers
/// keep running; B takes over host h with its own team dir and new workers of the same members;
/// messages are sent all along. Every acknowledged message is consumed exactly once across both
/// team dirs, none by A's workers once B's run; A, resumed, kills its workers and exits 4
/// writing nothing; each member has one worker, B's, and none ends down.
#[test]
fn a_stalled_supervisor_and_its_workers_are_fenced_off_by_the_successor() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let names = ["fa", "fb"];
    let bus = Bus::new(&server, "split", scratch.path(), &names);
    let (a, b) = (Host::new(), Host::new());
    for n in names {
        ok(&bus.out(
            &a,
            &["spawn", n, "--role", "r", "--prompt", "ack", "--host", "h"],
        ));
    }
    let mut sup_a = bus.run(&a, "h");
    let before = wait_until(T, "A's members idle", || {
        let ms = bus.members(&a);
        ms.iter().all(|m| m["status"] == "idle").then_some(ms)
    });
    let a_workers: HashMap<&str, u64> = names
        .iter()
        .map(|n| (*n, member(&before, n)["pid"].as_u64().unwrap()))
        .collect();
    let inc_a = member(&before, "fa")["incarnation"].as_u64().unwrap();

    // Messages before the stall, then A stalls and B starts; messages all along.
    let mut sent: Vec<(String, String, Instant)> = Vec::new();
    let send_some = |sent: &mut Vec<(String, String, Instant)>, k: usize| {
        for _ in 0..k {
            let n = names[sent.len() % names.len()];
            let text = format!("note {}", sent.len());
            if let Some(id) = send(&bus, &b, n, &text) {
                sent.push((n.to_owned(), id, Instant::now()));
            }
        }
    };
    send_some(&mut sent, 6);
    kill(Pid::from_raw(sup_a.0.id() as i32), Signal::SIGSTOP).unwrap();
    let sup_b = bus.run(&b, "h");
    let mut b_began = None;
    let deadline = Instant::now() + T;
    while b_began.is_none() {
        assert!(Instant::now() < deadline, "B did not take over");
        send_some(&mut sent, 2);
        let ms = bus.members(&b);
        let taken = names.iter().all(|n| {
            let m = member(&ms, n);
            m["incarnation"].as_u64().unwrap() > inc_a && m["status"] == "idle"
        });
        if taken {
            b_began = Some(Instant::now());
        }
    }
    let b_began = b_began.unwrap();
    send_some(&mut sent, 16);
    assert!(
        sent.len() >= 30,
        "only {} messages acknowledged",
        sent.len()
    );

    // A resumes: it finds its lease taken, kills its own workers and exits 4, writing nothing.
    kill(Pid::from_raw(sup_a.0.id() as i32), Signal::SIGCONT).unwrap();
    let a_exit = wait_until(T, "A to exit", || sup_a.0.try_wait().unwrap());
    send_some(&mut sent, 4);

    // Everything acknowledged is consumed, once, across both team dirs.
    let all: Vec<&str> = sent.iter().map(|(_, id, _)| id.as_str()).collect();
    wait_until(T, "every message consumed", || {
        let got: usize = names
            .iter()
            .map(|n| {
                let mut ids = journaled(&a, n);
                ids.extend(journaled(&b, n));
                ids.iter().filter(|i| all.contains(&i.as_str())).count()
            })
            .sum();
        (got >= all.len()).then_some(())
    });
    std::thread::sleep(Duration::from_millis(500));
    for (n, id, at) in &sent {
        let in_a = journaled(&a, n).iter().filter(|i| *i == id).count();
        let in_b = journaled(&b, n).iter().filter(|i| *i == id).count();
        assert_eq!(
            in_a + in_b,
            1,
            "{n} {id}: {in_a} in A's journal, {in_b} in B's"
        );
        if *at > b_began {
            assert_eq!(
                in_a, 0,
                "{n} {id}, sent after B's workers ran, consumed by A's"
            );
        }
    }
    // The overlap was exercised: A's workers consumed during the stall, before B's ran, and
    // were then refused (exit 79, "replaced") rather than consuming more.
    let stalled_at = sent[6].2;
    let by_a_in_overlap = sent
        .iter()
        .filter(|(n, id, at)| *at >= stalled_at && journaled(&a, n).contains(id))
        .count();
    assert!(
        by_a_in_overlap > 0,
        "A's workers consumed nothing while A was stalled"
    );
    // An A worker that tried to drain once B's ran was refused (exit 79); one that stayed
    // idle was killed by A when it resumed. Either way it consumed nothing more (above).
    let refused = names
        .iter()
        .filter(|n| {
            std::fs::read_to_string(a.team.join(format!("logs/{n}.log")))
                .is_ok_and(|l| l.contains("was replaced"))
        })
        .count();
    eprintln!(
        "{} acknowledged, {by_a_in_overlap} consumed by A's workers while A was stalled, \
         {refused} of A's workers refused as replaced",
        sent.len()
    );
    // One worker per member, B's; none ended down.
    let ms = bus.members(&b);
    for n in names {
        let m = member(&ms, n);
        assert_eq!(m["status"], "idle", "{m}");
        let pid = m["pid"].as_u64().unwrap();
        assert_eq!(workers_of(n), [pid], "{n}: one worker, B's");
        let cmdline = std::fs::read_to_string(format!("/proc/{pid}/cmdline")).unwrap();
        assert!(cmdline.contains(b.team.to_str().unwrap()), "{cmdline}");
    }
    for (n, pid) in &a_workers {
        assert!(!alive(*pid), "A's worker of {n} still runs");
    }
    assert_eq!(a_exit.code(), Some(4), "A exits 4 once its lease was taken");
    drop(sup_b);
}

/// The fenced drain, step by step, on one team dir and one member: a worker of incarnation 1
/// drains; incarnation 2 begins while that worker is between its read and its mark (its batch
/// journaled): the mark is refused (`Error::Fenced`), the batch is taken out of its journal
/// again, and incarnation 2's first drain consumes it; incarnation 1's next read is refused too.
#[test]
fn a_replaced_incarnation_is_refused_between_its_read_and_its_mark() {
    use troupe::inbox::{DrainPoint, Durability, Inbox};
    use troupe::message::{Message, MessageType};
    use troupe::store::redis::RedisBus;
    let Some(server) = RedisServer::start() else {
        return;
    };
    let bus = |n: &str| {
        let _ = n;
        RedisBus::with_password(&server.url("step"), &server.password).unwrap()
    };
    let (old_dir, new_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let old = troupe::TeamDir::create(old_dir.path().join(".team"))
        .unwrap()
        .with_bus(Some(bus("old")));
    let new = troupe::TeamDir::create(new_dir.path().join(".team"))
        .unwrap()
        .with_bus(Some(bus("new")));
    let supervisor = troupe::TeamDir::create(new_dir.path().join(".team"))
        .unwrap()
        .with_bus(Some(bus("supervisor")));
    let m = troupe::AgentName::teammate("m").unwrap();
    troupe::fence::begin_incarnation(&supervisor, "m", 1).unwrap();
    troupe::fence::act_as_member(&old, "m", 1);
    troupe::fence::act_as_member(&new, "m", 2);
    let sender = Inbox::new(&supervisor, &m);
    let first = Message::new(MessageType::Message, "lead", "m", "first");
    sender.append(&first, Durability::Sync).unwrap();
    let (mut old_journal, _) = support::drain::open_journal(&old, &m);
    let got = Inbox::new(&old, &m).drain(&mut old_journal).unwrap();
    assert_eq!(got, vec![first.clone()]);
    let second = Message::new(MessageType::Message, "lead", "m", "second");
    sender.append(&second, Durability::Sync).unwrap();
    let e = Inbox::new(&old, &m)
        .drain_with(&mut old_journal, |at, _| {
            if at == DrainPoint::Journaled {
                troupe::fence::begin_incarnation(&supervisor, "m", 2).unwrap();
            }
        })
        .unwrap_err();
    assert!(matches!(e, troupe::Error::Fenced { .. }), "{e}");
    assert!(troupe::fence::replaced(&old));
    let ids = |t: &troupe::TeamDir| -> Vec<String> {
        support::drain::journaled(t, &m)
            .into_iter()
            .map(|(id, _)| id)
            .collect()
    };
    drop(old_journal);
    assert_eq!(
        ids(&old),
        vec![first.id.clone()],
        "the refused batch left the journal"
    );
    let (mut new_journal, _) = support::drain::open_journal(&new, &m);
    let got = Inbox::new(&new, &m).drain(&mut new_journal).unwrap();
    assert_eq!(got, vec![second.clone()]);
    let (mut old_journal, _) = support::drain::open_journal(&old, &m);
    let third = Message::new(MessageType::Message, "lead", "m", "third");
    sender.append(&third, Durability::Sync).unwrap();
    let e = Inbox::new(&old, &m).drain(&mut old_journal).unwrap_err();
    assert!(matches!(e, troupe::Error::Fenced { .. }), "{e}");
    assert_eq!(
        Inbox::new(&new, &m).drain(&mut new_journal).unwrap(),
        [third]
    );
}

/// Acceptance 2: Redis down for 8 s with no successor: the supervisor keeps its lease (same
/// epoch), no worker is restarted, and every acknowledged message is consumed once.
#[test]
fn a_redis_outage_is_not_a_lost_lease() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "outage", scratch.path(), &["oa"]);
    let a = Host::new();
    ok(&bus.out(
        &a,
        &[
            "spawn", "oa", "--role", "r", "--prompt", "ack", "--host", "h",
        ],
    ));
    let mut sup = bus.run(&a, "h");
    let before = wait_until(T, "oa idle", || {
        let ms = bus.members(&a);
        let m = member(&ms, "oa").clone();
        (m["status"] == "idle").then_some(m)
    });
    let mut ids: Vec<String> = (0..5)
        .filter_map(|i| send(&bus, &a, "oa", &format!("before {i}")))
        .collect();
    assert_eq!(ids.len(), 5);
    server.stop();
    let down = Instant::now();
    while down.elapsed() < Duration::from_secs(8) {
        // Refused while the server is down: not acknowledged, so not owed.
        if let Some(id) = send(&bus, &a, "oa", "during") {
            ids.push(id);
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    server.start_again();
    ids.extend((0..5).filter_map(|i| send(&bus, &a, "oa", &format!("after {i}"))));
    wait_until(T, "every message consumed", || {
        let got = journaled(&a, "oa");
        ids.iter().all(|id| got.contains(id)).then_some(())
    });
    let got = journaled(&a, "oa");
    for id in &ids {
        assert_eq!(got.iter().filter(|i| *i == id).count(), 1, "{id}");
    }
    assert!(
        sup.0.try_wait().unwrap().is_none(),
        "the supervisor still runs"
    );
    let after = wait_until(T, "oa idle again", || {
        let m = member(&bus.members(&a), "oa").clone();
        (m["status"] == "idle").then_some(m)
    });
    assert_eq!(after["pid"], before["pid"], "not restarted: {after}");
    assert_eq!(after["incarnation"], before["incarnation"], "{after}");
    assert_eq!(after["restarts"], before["restarts"], "{after}");
}

/// Acceptance 3 (N10): `lead chat -p` on host a holds the lead's inbox; `lead inbox` on host b
/// exits 4 and consumes nothing of it; once the chat ends, it may.
#[test]
fn the_lead_inbox_has_one_consumer_per_team() {
    use support::fake_llm::{FakeLlm, Reply, anthropic_text};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "leadinbox", scratch.path(), &[]);
    let (a, b) = (Host::new(), Host::new());
    let fake = FakeLlm::start(Vec::<Reply>::new());
    fake.push_for(
        "m-lead",
        Reply::ok(anthropic_text("done")).delay(Duration::from_secs(6)),
    );
    // The reports that come in meanwhile may take it another turn or two.
    for _ in 0..4 {
        fake.push_for("m-lead", Reply::ok(anthropic_text("noted")));
    }
    let with_fake = |host: &Host, args: &[&str]| {
        let mut c = bus.lead(host, args);
        c.env("TROUPE_PROVIDER", "anthropic")
            .env("ANTHROPIC_API_KEY", "sk-test")
            .env("ANTHROPIC_BASE_URL", fake.url());
        c
    };
    let mut chat = Bg(with_fake(&a, &["chat", "-p", "wait", "--model", "m-lead"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap());
    wait_until(T, "the chat's model call", || {
        (fake.requests_for("m-lead") > 0).then_some(())
    });
    // Three reports for the lead arrive while the chat waits for its model.
    let team_b = bus.team_dir(&b);
    let lead = troupe::AgentName::lead();
    let inbox = troupe::inbox::Inbox::new(&team_b, &lead);
    let reports: Vec<String> = (0..3)
        .map(|i| {
            let m = troupe::message::Message::new(
                troupe::message::MessageType::Message,
                "someone",
                "lead",
                format!("report {i}"),
            );
            inbox.append(&m, troupe::inbox::Durability::Sync).unwrap();
            m.id
        })
        .collect();
    let o = bus.out(&b, &["inbox"]);
    assert_eq!(
        o.status.code(),
        Some(4),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("lead chat"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        journaled(&b, "lead").is_empty(),
        "b consumed the chat's mail"
    );
    let peek = bus.out(&b, &["inbox", "--peek", "--json"]);
    ok(&peek);
    let waiting: Vec<Value> = serde_json::from_slice(&peek.stdout).unwrap();
    assert_eq!(waiting.len(), 3, "{waiting:?}");
    // Once the chat has ended, its consumer lease is gone: `lead inbox` takes what is left.
    let code = wait_until(T, "the chat to end", || chat.0.try_wait().unwrap())
        .code()
        .unwrap();
    assert_eq!(code, 0, "{}", stderr_of(&mut chat));
    let o = bus.out(&b, &["inbox", "--json"]);
    ok(&o);
    let consumed_by_chat = journaled(&a, "lead");
    let drained: Vec<Value> = serde_json::from_slice(&o.stdout).unwrap();
    for id in &reports {
        let in_chat = consumed_by_chat.contains(id);
        let in_b = drained.iter().any(|m| m["id"] == id.as_str());
        assert!(
            in_chat ^ in_b,
            "{id}: chat {in_chat}, lead inbox on b {in_b}"
        );
    }
}

fn stderr_of(bg: &mut Bg) -> String {
    use std::io::Read;
    let mut s = String::new();
    if let Some(e) = bg.0.stderr.as_mut() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// A raw connection to the bus of `server`'s team `team`, as the troupe user (the test's own
/// hand on the server: a successor's epoch set, a key deleted).
fn raw(server: &RedisServer, team: &str) -> (troupe::store::redis::RedisBus, redis::Connection) {
    let bus =
        troupe::store::redis::RedisBus::with_password(&server.url(team), &server.password).unwrap();
    let conn = bus.connect(Duration::from_secs(5)).unwrap();
    (bus, conn)
}

/// Every write of m6 a process of member `m` makes, tried through `team`: an event, a beat, the
/// rate governor's soft state, a place in its queue, a task (whose id goes into the id set
/// first). Each result, named.
fn m6_writes(team: &troupe::TeamDir, epoch: u64, label: &str) -> Vec<(&'static str, String)> {
    use troupe::store::govern::Pool;
    let mut out: Vec<(&'static str, troupe::Result<()>)> = Vec::new();
    out.push((
        "event",
        troupe::events::try_log(team, "probe", serde_json::json!({"by": label})),
    ));
    let mut beater = troupe::store::beat::Beater::new(team.store(), "m", epoch);
    beater.beat(Duration::from_secs(1));
    out.push(("beat", beater.refusal()));
    let pool = Pool::new(team.store(), "fp");
    out.push((
        "governor state",
        pool.update(|_| (Some(label.as_bytes().to_vec()), ())),
    ));
    out.push(("governor queue", pool.queue("m", false).map(drop)));
    let tasks = troupe::tasks::TaskStore::new(team);
    out.push((
        "task id",
        tasks
            .create(troupe::tasks::NewTask {
                subject: format!("by {label}"),
                created_by: "m".into(),
                ..Default::default()
            })
            .map(drop),
    ));
    out.into_iter()
        .map(|(what, r)| {
            let verdict = match r {
                Ok(()) => "written".to_owned(),
                Err(troupe::Error::Fenced { .. }) => "fenced".to_owned(),
                Err(troupe::Error::Unfenced { .. }) => "unfenced".to_owned(),
                Err(e) => format!("failed: {e}"),
            };
            (what, verdict)
        })
        .collect()
}

/// What m6's writes left on the server, as an unfenced reader sees it: the events' `by`, the
/// beat's epoch, the governor's state, and how many task ids are reserved.
fn m6_seen(
    observer: &troupe::TeamDir,
    conn: &mut redis::Connection,
    bus: &troupe::store::redis::RedisBus,
) -> (Vec<String>, Option<u64>, Option<String>, usize) {
    let events: Vec<String> = troupe::events::read_all(observer)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == "probe")
        .filter_map(|e| e["by"].as_str().map(str::to_owned))
        .collect();
    let beat = troupe::store::beat::last(observer.store(), "m")
        .unwrap()
        .map(|b| b.epoch);
    let state = troupe::store::govern::Pool::new(observer.store(), "fp")
        .update(|now| (None, now.map(|b| String::from_utf8_lossy(b).into_owned())))
        .unwrap();
    let ids: Vec<String> = redis::cmd("SMEMBERS")
        .arg(bus.key("tasks"))
        .query(conn)
        .unwrap();
    (events, beat, state, ids.len())
}

fn verdicts(got: &[(&'static str, String)]) -> Vec<String> {
    got.iter().map(|(_, v)| v.clone()).collect()
}

/// Issue 41, acceptance 6 (review-4 m6): a process fenced as member m's incarnation 1, once
/// incarnation 2 began, adds no event, beat, governor state, queue place or task id: each is
/// refused with `Error::Fenced`, and the server holds nothing of them; incarnation 2's own
/// writes pass. Then `epoch:m` is deleted by hand: incarnation 2 is refused each of them and
/// its drain too (`Error::Unfenced`, without taking the process for replaced), while a writer
/// that acts for nobody (a person's `lead send`, `lead task add`) still writes; the next
/// incarnation, begun by the supervisor, sets the key again and writes.
#[test]
fn a_stale_or_unfenced_incarnation_adds_no_event_beat_governor_state_or_id() {
    use troupe::inbox::{Durability, Inbox};
    use troupe::message::{Message, MessageType};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = || {
        troupe::TeamDir::create(dir.path().join(".team"))
            .unwrap()
            .with_bus(Some(
                troupe::store::redis::RedisBus::with_password(&server.url("m6"), &server.password)
                    .unwrap(),
            ))
    };
    let (bus, mut conn) = raw(&server, "m6");
    // One process each: the supervisor (unfenced here), the reader, and two incarnations.
    let (supervisor, observer, old, new) = (team(), team(), team(), team());
    troupe::fence::begin_incarnation(&supervisor, "m", 1).unwrap();
    troupe::fence::act_as_member(&old, "m", 1);
    troupe::fence::begin_incarnation(&supervisor, "m", 2).unwrap();
    troupe::fence::act_as_member(&new, "m", 2);

    let got = m6_writes(&old, 1, "old");
    assert_eq!(verdicts(&got), ["fenced"; 5], "{got:?}");
    assert!(troupe::fence::replaced(&old));
    assert_eq!(
        m6_seen(&observer, &mut conn, &bus),
        (vec![], None, None, 0),
        "the stale incarnation wrote"
    );

    let got = m6_writes(&new, 2, "new");
    assert_eq!(verdicts(&got), ["written"; 5], "{got:?}");
    let seen = m6_seen(&observer, &mut conn, &bus);
    assert_eq!(
        seen,
        (vec!["new".to_owned()], Some(2), Some("new".to_owned()), 1)
    );

    // The fence key deleted by hand: refused, not passed.
    let deleted: i64 = redis::cmd("DEL")
        .arg(bus.key("epoch:m"))
        .query(&mut conn)
        .unwrap();
    assert_eq!(deleted, 1);
    let got = m6_writes(&new, 2, "unfenced");
    assert_eq!(verdicts(&got), ["unfenced"; 5], "{got:?}");
    assert!(
        !troupe::fence::replaced(&new),
        "a missing key is not a successor"
    );
    assert_eq!(
        m6_seen(&observer, &mut conn, &bus),
        seen,
        "written unfenced"
    );
    let m = troupe::AgentName::teammate("m").unwrap();
    let waiting = Message::new(MessageType::Message, "lead", "m", "waits");
    Inbox::new(&observer, &m)
        .append(&waiting, Durability::Sync)
        .unwrap();
    let (mut journal, _) = support::drain::open_journal(&new, &m);
    let e = Inbox::new(&new, &m).drain(&mut journal).unwrap_err();
    assert!(matches!(e, troupe::Error::Unfenced { .. }), "{e}");
    let to_lead = Message::new(MessageType::Message, "m", "lead", "from m");
    let e = Inbox::new(&new, &troupe::AgentName::lead())
        .append(&to_lead, Durability::Sync)
        .unwrap_err();
    assert!(matches!(e, troupe::Error::Unfenced { .. }), "{e}");
    drop(journal);
    assert!(support::drain::journaled(&new, &m).is_empty());

    // Writers acting for nobody are not fenced.
    troupe::events::try_log(&observer, "probe", serde_json::json!({"by": "person"})).unwrap();
    troupe::tasks::TaskStore::new(&observer)
        .create(troupe::tasks::NewTask {
            subject: "by a person".into(),
            created_by: "lead".into(),
            ..Default::default()
        })
        .unwrap();

    // The supervisor's next start of the member sets the key again.
    troupe::fence::begin_incarnation(&supervisor, "m", 3).unwrap();
    let next = team();
    troupe::fence::act_as_member(&next, "m", 3);
    let got = m6_writes(&next, 3, "next");
    assert_eq!(verdicts(&got), ["written"; 5], "{got:?}");
    let (mut journal, _) = support::drain::open_journal(&next, &m);
    assert_eq!(
        Inbox::new(&next, &m).drain(&mut journal).unwrap(),
        [waiting]
    );
    let (events, beat, _, ids) = m6_seen(&observer, &mut conn, &bus);
    assert_eq!(events, ["new", "person", "next"]);
    assert_eq!((beat, ids), (Some(3), 3));
}

/// The member's `exit` events in `host`'s team, as (incarnation, code).
fn exits(bus: &Bus, host: &Host, name: &str) -> Vec<(u64, Option<i64>)> {
    troupe::events::read_all(&bus.team_dir(host))
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == "exit" && e["name"] == name)
        .map(|e| (e["incarnation"].as_u64().unwrap(), e["code"].as_i64()))
        .collect()
}

/// Acceptance 6 with a real worker: an idle worker writes nothing but its beats, so a successor
/// elsewhere (its member's epoch raised past it, by hand here) is found at its next beat:
/// refused, it exits 79, with no beat of its incarnation left on the server. (Its supervisor,
/// whose lease nobody took here, then starts the member as it would any member it runs.)
#[test]
fn an_idle_worker_whose_incarnation_was_replaced_exits_79_at_its_next_beat() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "idle", scratch.path(), &["ia"]);
    let a = Host::new();
    ok(&bus.out(
        &a,
        &[
            "spawn", "ia", "--role", "r", "--prompt", "ack", "--host", "h",
        ],
    ));
    let mut sup = bus.run(&a, "h");
    let before = wait_until(T, "ia idle", || {
        let m = member(&bus.members(&a), "ia").clone();
        (m["status"] == "idle").then_some(m)
    });
    let pid = before["pid"].as_u64().unwrap();
    let inc = before["incarnation"].as_u64().unwrap();
    let (raw_bus, mut conn) = raw(&server, "idle");
    let () = redis::cmd("SET")
        .arg(raw_bus.key("epoch:ia"))
        .arg(inc + 10)
        .query(&mut conn)
        .unwrap();
    let () = redis::cmd("DEL")
        .arg(raw_bus.key("beat:ia"))
        .query(&mut conn)
        .unwrap();
    wait_until(T, "the replaced worker to exit", || {
        (!alive(pid)).then_some(())
    });
    let first = wait_until(T, "its exit event", || {
        exits(&bus, &a, "ia").first().copied()
    });
    assert_eq!(first, (inc, Some(79)));
    let beat = troupe::store::beat::last(bus.team_dir(&a).store(), "ia").unwrap();
    assert!(
        beat.as_ref().is_none_or(|b| b.epoch != inc),
        "the replaced worker beat: {beat:?}"
    );
    assert!(sup.0.try_wait().unwrap().is_none(), "the supervisor runs");
}

/// A fence key deleted by hand (as a server restarted without its data loses them all): the
/// idle member's worker is refused at its next beat and exits 75, which its supervisor
/// restarts as a new incarnation, setting `epoch:NAME` again; the supervisor's own lease record
/// deleted is written again by its next renewal, and the supervisor is not taken for replaced.
#[test]
fn a_deleted_fence_key_refuses_and_the_supervisor_gets_the_member_going_again() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "deleted", scratch.path(), &["da"]);
    let a = Host::new();
    ok(&bus.out(
        &a,
        &[
            "spawn", "da", "--role", "r", "--prompt", "ack", "--host", "h",
        ],
    ));
    let mut sup = bus.run(&a, "h");
    let before = wait_until(T, "da idle", || {
        let m = member(&bus.members(&a), "da").clone();
        (m["status"] == "idle").then_some(m)
    });
    let pid = before["pid"].as_u64().unwrap();
    let inc = before["incarnation"].as_u64().unwrap();
    let (raw_bus, mut conn) = raw(&server, "deleted");
    let epoch_key = raw_bus.key("epoch:da");
    let () = redis::cmd("DEL").arg(&epoch_key).query(&mut conn).unwrap();
    wait_until(T, "the unfenced worker to exit", || {
        (!alive(pid)).then_some(())
    });
    let after = wait_until(T, "da idle again", || {
        let m = member(&bus.members(&a), "da").clone();
        (m["status"] == "idle" && m["incarnation"].as_u64() > Some(inc)).then_some(m)
    });
    assert_eq!(exits(&bus, &a, "da"), [(inc, Some(75))]);
    let epoch: Option<String> = redis::cmd("GET").arg(&epoch_key).query(&mut conn).unwrap();
    assert_eq!(epoch, Some(after["incarnation"].to_string()));
    // The lease's record: written again by the next renewal, same epoch.
    let record_key = raw_bus.key("lease:h-epoch");
    let record: String = redis::cmd("GET").arg(&record_key).query(&mut conn).unwrap();
    let () = redis::cmd("DEL").arg(&record_key).query(&mut conn).unwrap();
    wait_until(T, "the lease's record back", || {
        redis::cmd("GET")
            .arg(&record_key)
            .query::<Option<String>>(&mut conn)
            .unwrap()
    });
    let back: String = redis::cmd("GET").arg(&record_key).query(&mut conn).unwrap();
    assert_eq!(back, record);
    // The team goes on: a message is answered by the member, which was not restarted again.
    let id = send(&bus, &a, "da", "still there?").expect("acknowledged");
    wait_until(T, "the message consumed", || {
        journaled(&a, "da").contains(&id).then_some(())
    });
    assert!(sup.0.try_wait().unwrap().is_none(), "the supervisor runs");
    let last = member(&bus.members(&a), "da").clone();
    assert_eq!(last["incarnation"], after["incarnation"], "{last}");
}

/// Review 4, m5: the rate governor's gate of a replaced incarnation lets no call go out. Its
/// place in the slots' queue is refused by the fence, and that refusal is final
/// (`LlmError::Fenced`, exit 79), not a store failure the call would go on without; a fence
/// key deleted by hand gives exit 75. The live incarnation passes.
#[test]
fn a_replaced_incarnations_gate_lets_no_call_out() {
    use troupe::llm::gate::Gate;
    let Some(server) = RedisServer::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = || {
        troupe::TeamDir::create(dir.path().join(".team"))
            .unwrap()
            .with_bus(Some(
                troupe::store::redis::RedisBus::with_password(&server.url("m5"), &server.password)
                    .unwrap(),
            ))
    };
    let (supervisor, old, new) = (team(), team(), team());
    troupe::fence::begin_incarnation(&supervisor, "m", 1).unwrap();
    troupe::fence::act_as_member(&old, "m", 1);
    troupe::fence::begin_incarnation(&supervisor, "m", 2).unwrap();
    troupe::fence::act_as_member(&new, "m", 2);
    let code = |team: &troupe::TeamDir| match troupe::governor::Governor::new(team, "m")
        .enter("fp", "model")
    {
        Ok(_slot) => None,
        Err(e) => Some((e.exit_code(), e.to_string())),
    };
    let refused = code(&old).expect("the replaced incarnation's call went out");
    assert_eq!(refused.0, 79, "{}", refused.1);
    assert_eq!(code(&new), None, "the live incarnation is let through");
    let (bus, mut conn) = raw(&server, "m5");
    let _: i64 = redis::cmd("DEL")
        .arg(bus.key("epoch:m"))
        .query(&mut conn)
        .unwrap();
    let unfenced = code(&new).expect("a call went out with the fence key gone");
    assert_eq!(unfenced.0, 75, "{}", unfenced.1);
}

/// `lead status`'s cooldowns on a bus: the endpoints' soft states are found by a SCAN of the
/// team's keys, and the way to end one names its key.
#[test]
fn a_cooldown_on_a_bus_is_listed_with_its_key() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = troupe::TeamDir::create(dir.path().join(".team"))
        .unwrap()
        .with_bus(Some(
            troupe::store::redis::RedisBus::with_password(&server.url("cd"), &server.password)
                .unwrap(),
        ));
    assert_eq!(troupe::governor::cooldowns(&team), []);
    let now = troupe::fsutil::now();
    let limits = troupe::governor::Limits {
        cooldown_until: now + 120.0,
        ..troupe::governor::Limits::default()
    };
    for (fp, l) in [
        ("fpa", &limits),
        ("fpb", &troupe::governor::Limits::default()),
    ] {
        troupe::store::govern::Pool::new(team.store(), fp)
            .update(|_| (Some(serde_json::to_vec(l).unwrap()), ()))
            .unwrap();
    }
    let got = troupe::governor::cooldowns(&team);
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0].endpoint, "fpa");
    assert!((got[0].until - (now + 120.0)).abs() < 1.0, "{got:?}");
    let (bus, mut conn) = raw(&server, "cd");
    let key = bus.key("govern:fpa:state");
    assert_eq!(got[0].clear, format!("redis-cli DEL {key}"));
    let _: i64 = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
    assert_eq!(troupe::governor::cooldowns(&team), []);
}
