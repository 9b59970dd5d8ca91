//! Issue 24, the seam: one contract of the team's shared state, run on both backends of the
//! store, the team dir's files and a Redis bus, through the same calls (the callers never ask
//! which it is): racing deciders of one request (one wins), racing roster writers (none lost),
//! racing keyed task creations (one creates), racing makers of a merge queue entry (one makes it), the event log read from any position, a named
//! lock that excludes, a heartbeat, the rate governor's call slots, and a change watch that wakes on the roster and the board and not on
//! the event log. On the bus, none of it is in the team dir.

mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use support::redis_server::RedisServer;
use troupe::config::{Member, Roster};
use troupe::requests::{NewRequest, RequestKind, RequestStore};
use troupe::store::Watched;
use troupe::tasks::{NewTask, TaskStore};
use troupe::{Error, TeamDir};

/// The contract; `open` gives a new handle on the same team (each racer its own, as separate
/// processes would have).
fn shared_state_contract(open: &(dyn Fn() -> TeamDir + Sync)) {
    let team = open();
    // One decision of a request, whoever races for it.
    let req = RequestStore::new(&team)
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "alice".into(),
            to: "lead".into(),
            payload: serde_json::json!({"plan": "p"}),
            target_incarnation: None,
            ttl: None,
        })
        .unwrap();
    let results: Vec<_> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..8)
            .map(|i| {
                let t = open();
                let id = req.request_id.clone();
                s.spawn(move || {
                    RequestStore::new(&t).resolve(&id, "lead", i % 2 == 0, serde_json::json!({}))
                })
            })
            .collect();
        racers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        results.iter().filter(|r| r.is_ok()).count(),
        1,
        "{results:?}"
    );
    for r in results.iter().filter(|r| r.is_err()) {
        assert!(matches!(r, Err(Error::AlreadyResolved { .. })), "{r:?}");
    }
    let won = results.iter().find_map(|r| r.as_ref().ok()).unwrap();
    let requests = RequestStore::new(&team);
    let decided = requests.get(&req.request_id).unwrap();
    assert_eq!(&decided, won);
    assert_ne!(decided.status, troupe::requests::RequestStatus::Pending);
    assert_eq!(requests.list(None).unwrap(), vec![decided]);
    assert!(matches!(
        requests.resolve("0badf00d", "lead", true, serde_json::json!({})),
        Err(Error::UnknownRequest(_))
    ));
    // Roster writers racing: every change lands.
    std::thread::scope(|s| {
        for i in 0..8 {
            let t = open();
            s.spawn(move || {
                Roster::new(&t)
                    .update(|c| {
                        c.members.push(Member::new(&format!("m{i}"), "r"));
                        Ok(())
                    })
                    .unwrap()
            });
        }
    });
    let mut names: Vec<String> = Roster::new(&team)
        .load()
        .unwrap()
        .members
        .into_iter()
        .map(|m| m.name)
        .collect();
    names.sort();
    assert_eq!(names, (0..8).map(|i| format!("m{i}")).collect::<Vec<_>>());
    // A team file's task, created by eight at once: once.
    let created: Vec<bool> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let t = open();
                s.spawn(move || {
                    TaskStore::new(&t)
                        .create_keyed("build", task("build it"))
                        .unwrap()
                        .1
                })
            })
            .collect();
        racers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(created.iter().filter(|c| **c).count(), 1, "{created:?}");
    // The event log, in order, from any position.
    for i in 0..3 {
        troupe::events::try_log(&team, "probe", serde_json::json!({"i": i})).unwrap();
    }
    let (all, pos) = troupe::events::read_from(&team, 0).unwrap();
    let probes: Vec<_> = all.iter().filter(|e| e["event"] == "probe").collect();
    assert_eq!(probes.len(), 3);
    assert_eq!(probes[2]["i"], 2);
    troupe::events::try_log(&team, "later", serde_json::json!({})).unwrap();
    let (next, _) = troupe::events::read_from(&team, pos).unwrap();
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(next[0]["event"], "later");
    // A named lock: never two holders at once.
    let inside = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..4 {
            let t = open();
            let (inside, most) = (&inside, &most);
            s.spawn(move || {
                let path = t.root().join("probe.lock");
                for _ in 0..5 {
                    let _held = t.store().lock("probe", &path).unwrap();
                    let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(n, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(2));
                    inside.fetch_sub(1, Ordering::SeqCst);
                }
            });
        }
    });
    assert_eq!(most.load(Ordering::SeqCst), 1);
    // The change watch: an event logged wakes nobody; a roster change and a task do.
    let watch = team
        .store()
        .watch(&[Watched::Roster, Watched::Tasks])
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    watch.changed();
    troupe::events::try_log(&team, "quiet", serde_json::json!({})).unwrap();
    // A heartbeat is a key with an expiry: read back by anyone, and it wakes nobody either.
    let mut beater = troupe::store::beat::Beater::new(team.store(), "late", 3);
    beater.beat(Duration::from_secs(30));
    beater.beat(Duration::from_secs(2));
    let beat = troupe::store::beat::last(open().store(), "late")
        .unwrap()
        .expect("the beat");
    assert_eq!((beat.epoch, beat.allowance), (3, 2.0));
    assert_eq!(
        troupe::store::beat::last(team.store(), "nobody").unwrap(),
        None
    );
    // The rate governor's soft state and call slots: shared, first come first served (the
    // LLM lead first), and they wake nobody either.
    call_slots(open);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !watch.changed(),
        "an event, a heartbeat or a call slot woke the watch"
    );
    Roster::new(&team)
        .update(|c| {
            c.members.push(Member::new("late", "r"));
            Ok(())
        })
        .unwrap();
    assert!(
        seen_within(&watch, Duration::from_secs(5)),
        "the roster change"
    );
    TaskStore::new(&team).create(task("one more")).unwrap();
    assert!(seen_within(&watch, Duration::from_secs(5)), "the new task");
}

/// The merge queue's entries: racing makers of one entry (one makes it, all get it), the
/// states it moves through, a cancel and a retry, an unknown id.
fn merge_entries(open: &(dyn Fn() -> TeamDir + Sync)) {
    use troupe::merge::{MergeState, MergeStore, NewEntry};
    let new = NewEntry {
        member: "alice".into(),
        branch: "troupe/alice".into(),
        commit: "a".repeat(40),
        task: Some(("1234abcd".into(), 1)),
        host: None,
    };
    let made: Vec<_> = std::thread::scope(|s| {
        let racers: Vec<_> = (0..8)
            .map(|_| {
                let t = open();
                let new = new.clone();
                s.spawn(move || MergeStore::new(&t).enqueue(&new).unwrap())
            })
            .collect();
        racers.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(made.iter().filter(|(_, new)| *new).count(), 1);
    assert!(made.iter().all(|(e, _)| e == &made[0].0));
    let team = open();
    let store = MergeStore::new(&team);
    let id = made[0].0.id.clone();
    assert_eq!(store.list().unwrap(), vec![made[0].0.clone()]);
    let (e, moved) = store
        .update_checking(&id, "troupe/integration", "b", "c")
        .unwrap();
    assert!(moved);
    assert_eq!((e.state, e.attempts), (MergeState::Checking, 1));
    store.cancel(&id).unwrap();
    assert!(store.cancel(&id).is_err(), "a cancelled entry is closed");
    assert_eq!(store.retry(&id).unwrap().state, MergeState::Queued);
    assert!(matches!(store.get("0badc0de"), Err(Error::UnknownMerge(_))));
}

/// The rate governor's part of the contract, each party with its own handle on the team.
fn call_slots(open: &(dyn Fn() -> TeamDir + Sync)) {
    use troupe::store::govern::{Cap, Pool};
    let (t1, t2, t3) = (open(), open(), open());
    let (p1, p2, p3) = (
        Pool::new(t1.store(), "fp"),
        Pool::new(t2.store(), "fp"),
        Pool::new(t3.store(), "fp"),
    );
    p1.update(|now| (Some(b"limits".to_vec()), assert!(now.is_none())))
        .unwrap();
    let back = p2.update(|now| (None, now.map(<[u8]>::to_vec))).unwrap();
    assert_eq!(back.as_deref(), Some(&b"limits"[..]));
    let mut a = p1.queue("a", false).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut b = p2.queue("b", false).unwrap();
    assert!(b.try_take(1).unwrap().is_none(), "b went before a");
    let held = a.try_take(1).unwrap().expect("a's turn");
    drop(a);
    assert!(b.try_take(1).unwrap().is_none(), "two holders of one slot");
    assert!(b.try_take(2).unwrap().is_some(), "a second slot is free");
    drop(held);
    let slot = b.try_take(1).unwrap().expect("b's turn");
    drop(b);
    drop(slot);
    let mut mate = p2.queue("mate", false).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut lead = p3.queue("lead", true).unwrap();
    assert!(mate.try_take(1).unwrap().is_none(), "the lead goes first");
    assert!(lead.try_take(1).unwrap().is_some());
    drop((mate, lead));
    // A model's cap counts that model's calls, the team's every call (review 4, R4-9): under
    // a team's cap of 3 and opus's of 1, an opus call goes beside a haiku one; a second opus
    // waiter waits for the first and keeps no slot from a haiku waiter behind it.
    let opus = || Cap {
        group: Some(("claude-opus".into(), 1)),
        team: Some(3),
    };
    let mut h1 = p1.queue("h1", false).unwrap();
    let first_haiku = h1.try_take(3).unwrap().expect("nothing in flight");
    drop(h1);
    let mut o1 = p2.queue("o1", false).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut o2 = p3.queue("o2", false).unwrap();
    std::thread::sleep(Duration::from_millis(5));
    let mut h2 = p1.queue("h2", false).unwrap();
    let first_opus = o1
        .try_take(opus())
        .unwrap()
        .expect("no opus call in flight");
    drop(o1);
    assert!(
        o2.try_take(opus()).unwrap().is_none(),
        "two opus calls at once"
    );
    let second_haiku = h2.try_take(3).unwrap();
    assert!(
        second_haiku.is_some(),
        "o2, held back by its cap, held h2 back"
    );
    drop(h2);
    let mut h3 = p2.queue("h3", false).unwrap();
    assert!(
        h3.try_take(3).unwrap().is_none(),
        "the team's cap counts the opus call"
    );
    drop(first_opus);
    assert!(h3.try_take(3).unwrap().is_none(), "h3 went ahead of o2");
    let second_opus = o2.try_take(opus()).unwrap().expect("o2's turn");
    drop(o2);
    drop((first_haiku, second_opus, second_haiku));
    assert!(h3.try_take(3).unwrap().is_some());
}

fn task(subject: &str) -> NewTask {
    NewTask {
        subject: subject.into(),
        description: String::new(),
        blocked_by: Vec::new(),
        owner: None,
        created_by: "lead".into(),
    }
}

fn seen_within(watch: &troupe::store::watch::Watch, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if watch.changed() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn the_contract_holds_on_the_files() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Arc::new(tmp.path().join(".team"));
    TeamDir::create(&*root).unwrap();
    let open = {
        let root = root.clone();
        move || TeamDir::create(&*root).unwrap().with_bus(None)
    };
    shared_state_contract(&open);
    merge_entries(&open);
}

#[test]
fn the_contract_holds_on_a_redis_bus() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join(".team");
    let (url, password) = (server.url("contract"), server.password.clone());
    let open = move || {
        TeamDir::create(&root).unwrap().with_bus(Some(
            troupe::store::redis::RedisBus::with_password(&url, &password).unwrap(),
        ))
    };
    shared_state_contract(&open);
    merge_entries(&open);
    // And nothing of it is in the team dir.
    let team = TeamDir::create(tmp.path().join(".team"))
        .unwrap()
        .with_bus(None);
    assert!(!team.config().exists());
    assert!(std::fs::read_dir(team.requests_dir()).map_or(true, |mut d| d.next().is_none()));
    assert!(!team.events().exists());
    assert!(!team.root().join("beats").exists());
    assert!(!team.root().join("govern").exists());
    assert!(!team.merge_dir().exists());
}
