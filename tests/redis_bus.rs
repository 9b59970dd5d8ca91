//! Issue 15, first part: an inbox on Redis Streams, against a real `redis-server` (started by
//! the test on a free loopback port, with AUTH and `appendfsync always`). The same guarantees
//! as the file inbox: a drainer killed at each crash point while writer processes append loses
//! and repeats nothing; back-pressure refuses without writing; a waiter wakes on an append.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::child::{self, Rng};
use support::drain;
use support::redis_server::RedisServer;
use troupe::message::{Message, MessageType};
use troupe::store::redis::{PASSWORD_ENV, RedisBus, RedisInbox};
use troupe::wait::Wake;
use troupe::{AgentName, Error, TeamDir};

fn alice() -> AgentName {
    AgentName::teammate("alice").unwrap()
}

fn msg(text: &str) -> Message {
    Message::new(MessageType::Message, "lead", "alice", text)
}

/// In a child: the bus from BUS (password from the environment, as a user gives it).
fn bus_from(vars: &HashMap<String, String>) -> RedisBus {
    RedisBus::from_url(&vars["BUS"]).unwrap()
}

fn team_from(vars: &HashMap<String, String>) -> TeamDir {
    TeamDir::open(PathBuf::from(&vars["TEAM"])).unwrap()
}

/// Appends until STOP exists, reporting `ok ID` for each acknowledged message.
fn writer(vars: &HashMap<String, String>) {
    let bus = bus_from(vars);
    let team = team_from(vars);
    let w = &vars["WRITER"];
    let stop = PathBuf::from(&vars["STOP"]);
    let inbox = RedisInbox::new(&bus, &team, &alice());
    let mut seq = 0u64;
    while !stop.exists() {
        let m = msg(&format!("{w}:{seq}"));
        inbox.append(&m).unwrap();
        child::report(&format!("ok {}", m.id));
        seq += 1;
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Drains, through the inbox seam on the bus, until the NTH time it reaches POINT and dies
/// there by SIGKILL (gives up after 2 s).
fn killed_drainer(vars: &HashMap<String, String>) {
    let team = team_from(vars).with_bus(Some(bus_from(vars)));
    let inbox = troupe::inbox::Inbox::new(&team, &alice());
    drain::killed_drainer(&inbox, &team, &alice(), vars);
}

#[test]
fn child() {
    child::dispatch(&[("writer", writer), ("killed_drainer", killed_drainer)]);
}

/// `team`'s dir with the team's state on the bus `team_name` of `server`, alice in its roster
/// there (the roster is on the bus too: not in config.json) and "ping" in her inbox, and her
/// worker started against the model at `llm` with the bus in its environment (as `lead run`
/// hands it on).
fn alice_on_the_bus(
    server: &RedisServer,
    team_name: &str,
    team: &support::team::Team,
    llm: &str,
) -> (TeamDir, Message, support::team::Worker) {
    let url = server.url(team_name);
    let bus = RedisBus::with_password(&url, &server.password).unwrap();
    let on_bus = team.dir.clone().with_bus(Some(bus));
    support::team::add_member_to(&on_bus, "alice", 1, false);
    // As `lead run` does before it starts a worker: its fence key is what lets it write.
    troupe::fence::begin_incarnation(&on_bus, "alice", 1).unwrap();
    let ping = msg("ping");
    troupe::inbox::Inbox::new(&on_bus, &alice())
        .append(&ping, troupe::inbox::Durability::Sync)
        .unwrap();
    let w = team.worker(
        "alice",
        llm,
        &[
            ("TROUPE_BUS", url.as_str()),
            (PASSWORD_ENV, server.password.as_str()),
        ],
    );
    (on_bus, ping, w)
}

fn setup(server: &RedisServer, team_name: &str) -> (tempfile::TempDir, TeamDir, RedisBus) {
    let tmp = tempfile::tempdir().unwrap();
    let team = TeamDir::create(tmp.path().join(".team")).unwrap();
    let bus = RedisBus::with_password(&server.url(team_name), &server.password).unwrap();
    (tmp, team, bus)
}

#[test]
fn a_redis_inbox_delivers_once_and_refuses_at_its_cap() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let (_t, team, bus) = setup(&server, "once");
    let inbox = RedisInbox::new(&bus, &team, &alice()).with_cap(1000);
    let mut journal = drain::open_journal(&team, &alice()).0;
    assert!(inbox.drain(&mut journal).unwrap().is_empty());
    let (a, b) = (msg("a"), msg("b"));
    for m in [&a, &b, &a] {
        inbox.append(m).unwrap();
    }
    assert_eq!(inbox.peek().unwrap(), vec![a.clone(), b.clone(), a.clone()]);
    assert!(inbox.len().unwrap() > 0);
    // The same id twice: once.
    assert_eq!(
        inbox.drain(&mut journal).unwrap(),
        vec![a.clone(), b.clone()]
    );
    assert!(inbox.is_empty().unwrap());
    assert_eq!(inbox.len().unwrap(), 0);
    inbox.append(&a).unwrap();
    assert!(
        inbox.drain(&mut journal).unwrap().is_empty(),
        "a repeat of a consumed id"
    );
    // Back-pressure: refused, nothing written, and room again once drained.
    let big = msg(&"x".repeat(600));
    inbox.append(&big).unwrap();
    let e = inbox.append(&msg(&"y".repeat(600))).unwrap_err();
    assert!(matches!(e, Error::InboxFull { .. }), "{e}");
    assert!(e.to_string().starts_with("inbox of alice is full"), "{e}");
    assert_eq!(inbox.peek().unwrap(), vec![big.clone()]);
    assert_eq!(inbox.drain(&mut journal).unwrap(), vec![big]);
    inbox.append(&msg("fits now")).unwrap();
    // A bad entry (written by hand) is set aside; the rest is delivered.
    let mut conn = bus.connect(Duration::from_secs(5)).unwrap();
    let stream = bus.key("inbox:alice");
    redis::cmd("XADD")
        .arg(&stream)
        .arg("*")
        .arg("m")
        .arg("not json")
        .query::<String>(&mut conn)
        .unwrap();
    let got = inbox.drain(&mut journal).unwrap();
    assert_eq!(got.len(), 1);
    let corrupt = std::fs::read_to_string(team.inbox_corrupt(&alice())).unwrap();
    assert!(corrupt.contains("not json"), "{corrupt}");
    assert!(inbox.is_empty().unwrap());
}

#[test]
fn a_wrong_password_is_refused_and_never_shown() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let bus = RedisBus::with_password(&server.url("pw"), "not-the-password").unwrap();
    let Err(e) = bus.connect(Duration::from_secs(5)) else {
        panic!("connected with a wrong password")
    };
    let e = e.to_string();
    assert!(!e.contains("not-the-password"), "{e}");
    assert!(e.contains("cannot connect"), "{e}");
}

#[test]
fn a_waiter_wakes_on_an_append_and_times_out() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let (_t, team, bus) = setup(&server, "wake");
    let inbox = RedisInbox::new(&bus, &team, &alice());
    let mut waiter = inbox.waiter().unwrap();
    let t0 = Instant::now();
    assert_eq!(
        waiter.wait(Some(Duration::from_millis(120)), &[]).unwrap(),
        Wake::Timeout
    );
    assert!(t0.elapsed() >= Duration::from_millis(120));
    let sender = {
        let (bus, team) = (bus.clone(), team.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            RedisInbox::new(&bus, &team, &alice())
                .append(&msg("wake"))
                .unwrap();
        })
    };
    let t0 = Instant::now();
    assert_eq!(
        waiter.wait(Some(Duration::from_secs(10)), &[]).unwrap(),
        Wake::Message
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    sender.join().unwrap();
    let mut journal = drain::open_journal(&team, &alice()).0;
    assert_eq!(inbox.drain(&mut journal).unwrap().len(), 1);
}

#[test]
fn a_drainer_killed_at_every_crash_point_loses_and_repeats_nothing() {
    const WRITERS: u64 = 3;
    let Some(server) = RedisServer::start() else {
        return;
    };
    let (tmp, team, bus) = setup(&server, "kills");
    let root = team.root().display().to_string();
    let url = server.url("kills");
    let stop = tmp.path().join("stop");
    let env = |extra: &[(&'static str, String)]| -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("TEAM", root.clone()),
            ("BUS", url.clone()),
            (PASSWORD_ENV, server.password.clone()),
        ];
        v.extend(extra.iter().cloned());
        v
    };
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            drain::spawn_acked(
                "writer",
                &env(&[
                    ("WRITER", w.to_string()),
                    ("STOP", stop.display().to_string()),
                ]),
            )
        })
        .collect();
    let mut rng = Rng::seeded();
    let mut kills: HashMap<&str, u32> = HashMap::new();
    let points = ["read", "journaled", "marked"];
    for round in 0..30 {
        let point = points[round % points.len()];
        let out = child::spawn(
            "killed_drainer",
            &env(&[
                ("POINT", point.into()),
                ("NTH", rng.range(1, 5).to_string()),
            ]),
        )
        .wait_with_output()
        .unwrap();
        drain::count_kill(&out, point, &mut kills);
    }
    std::fs::write(&stop, b"").unwrap();
    let mut acked: HashSet<String> = HashSet::new();
    for (mut w, acks) in writers {
        assert!(w.wait().unwrap().success());
        acked.extend(acks.join().unwrap());
    }
    assert!(acked.len() > 300, "the writers barely ran: {}", acked.len());
    let inbox = RedisInbox::new(&bus, &team, &alice());
    let mut journal = drain::open_journal(&team, &alice()).0;
    inbox.drain(&mut journal).unwrap();
    assert!(inbox.is_empty().unwrap());
    assert_eq!(inbox.len().unwrap(), 0, "the byte count drifted");
    drop(journal);
    let got = drain::journaled(&team, &alice());
    let ids: HashSet<&str> = got.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids.len(), got.len(), "a message was consumed twice");
    let missing = acked.iter().filter(|id| !ids.contains(id.as_str())).count();
    assert_eq!(missing, 0, "{missing} acknowledged messages lost");
    // Each writer's messages in its order.
    let mut next = vec![0u64; WRITERS as usize];
    for (_, body) in &got {
        let (w, seq) = body.split_once(':').unwrap();
        let (w, seq): (usize, u64) = (w.parse().unwrap(), seq.parse().unwrap());
        assert!(seq >= next[w], "writer {w}: {seq} after {}", next[w]);
        next[w] = seq + 1;
    }
    for p in points {
        assert!(
            kills.get(p).copied().unwrap_or(0) > 0,
            "never killed at {p}: {kills:?}"
        );
    }
    eprintln!(
        "acked {} consumed {} kills {kills:?}",
        acked.len(),
        got.len()
    );
}

/// `lead` with `TROUPE_BUS` (or `--bus`) puts the inboxes on the bus: a `lead send` lands in
/// the Redis stream, not in a file, and a drain through the library (the same seam a worker
/// uses) consumes it once. A URL with a password is refused without echoing it.
#[test]
fn the_cli_puts_inboxes_on_the_bus() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join(".team");
    let url = server.url("cli");
    let lead = |args: &[&str], bus_env: bool| {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_lead"));
        c.arg("--team-dir")
            .arg(&root)
            .args(args)
            .env_remove("TROUPE_TEAM_DIR")
            .env_remove("TROUPE_BUS")
            .env(PASSWORD_ENV, &server.password);
        if bus_env {
            c.env("TROUPE_BUS", &url);
        }
        c.output().unwrap()
    };
    let o = lead(&["spawn", "alice", "--role", "r", "--prompt", "p"], true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = lead(&["send", "alice", "hello"], true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = lead(&["--bus", &url, "send", "alice", "again"], false);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = lead(&["status", "--json"], true);
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(status["bus"]["url"], url.as_str(), "{status}");
    assert_eq!(status["bus"]["team"], "cli");
    assert!(!String::from_utf8_lossy(&o.stdout).contains(&server.password));
    let o = lead(&["status", "--json"], false);
    let status: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(status["bus"].is_null(), "{status}");
    let file = root.join("inbox").join("alice.jsonl");
    assert!(
        std::fs::metadata(&file).map_or(0, |m| m.len()) == 0,
        "the message went to the file inbox"
    );
    let bus = RedisBus::with_password(&url, &server.password).unwrap();
    let team = TeamDir::open(&root).unwrap().with_bus(Some(bus));
    let inbox = troupe::inbox::Inbox::new(&team, &alice());
    // (The spawn sent the task first: a task_assignment.)
    let texts = |ms: Vec<Message>| {
        ms.into_iter()
            .filter(|m| m.kind == MessageType::Message)
            .map(|m| m.content)
            .collect::<Vec<_>>()
    };
    assert_eq!(texts(inbox.peek().unwrap()), ["hello", "again"]);
    let mut journal = drain::open_journal(&team, &alice()).0;
    assert_eq!(
        texts(inbox.drain(&mut journal).unwrap()),
        ["hello", "again"]
    );
    assert!(inbox.is_empty());
    let leaky = format!("redis://troupe:{}@127.0.0.1:{}", "hunter2", server.port);
    let o = lead(&["--bus", &leaky, "send", "alice", "x"], false);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("holds a password"), "{err}");
    assert!(!err.contains("hunter2"), "{err}");
}

/// A real worker with `TROUPE_BUS` in its environment (as `lead run` hands it on) drains its
/// inbox from the bus, and its `send_message` to the lead lands in the lead's stream there.
#[test]
fn a_worker_reads_and_writes_its_mail_on_the_bus() {
    use support::fake_llm::{
        FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
    };
    use support::team::{Team, wait_until};
    let Some(server) = RedisServer::start() else {
        return;
    };
    let team = Team::new();
    let usage = r#"{"input_tokens":10,"output_tokens":5,"cache_creation_input_tokens":0,"cache_read_input_tokens":0}"#;
    let fake = FakeLlm::start([
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block("tu_1", "send_message", r#"{"to":"lead","content":"pong"}"#),
            "tool_use",
            usage,
        )),
        Reply::ok(anthropic_text("done")),
    ]);
    let (on_bus, ping, mut w) = alice_on_the_bus(&server, "worker", &team, &fake.url());
    let lead_inbox = troupe::inbox::Inbox::new(&on_bus, &AgentName::lead());
    let reply = wait_until(Duration::from_secs(30), "the reply on the bus", || {
        lead_inbox
            .peek()
            .unwrap()
            .into_iter()
            .find(|m| m.content == "pong")
    });
    assert_eq!(reply.from, "alice");
    assert_eq!(team.consumed_ids("alice"), vec![ping.id.clone()]);
    assert!(troupe::inbox::Inbox::new(&on_bus, &alice()).is_empty());
    assert!(
        std::fs::metadata(team.dir.inbox(&AgentName::lead())).map_or(0, |m| m.len()) == 0,
        "the reply went to the lead's file inbox"
    );
    // SIGTERM ends its wait on the bus at once (the signal pipe is looked at between slices).
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(
        w.wait(Duration::from_secs(5)).code(),
        Some(143),
        "{}",
        team.stderr("alice")
    );
    assert!(
        !team.stderr("alice").contains(&server.password),
        "the password reached a log"
    );
}

/// What the server acknowledged survives its `kill -9` (`appendfsync always`), and the inbox
/// reconnects by itself: the drain after the restart gets every message once.
#[test]
fn acknowledged_messages_survive_a_server_kill() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let (_t, team, bus) = setup(&server, "restart");
    let inbox = RedisInbox::new(&bus, &team, &alice());
    let mut journal = drain::open_journal(&team, &alice()).0;
    let sent: Vec<Message> = (0..50).map(|i| msg(&format!("m{i}"))).collect();
    for m in &sent[..30] {
        inbox.append(m).unwrap();
    }
    // Half drained, then the server dies with the rest of the first batch in it.
    let first = inbox.drain(&mut journal).unwrap();
    assert_eq!(first.len(), 30);
    for m in &sent[30..] {
        inbox.append(m).unwrap();
    }
    server.restart();
    assert!(!server.log().contains("NOPERM"), "{}", server.log());
    let second = inbox.drain(&mut journal).unwrap();
    assert_eq!(second, sent[30..].to_vec());
    assert!(inbox.is_empty().unwrap());
    assert_eq!(inbox.len().unwrap(), 0);
    assert_eq!(journal.seen_count(), 50);
}

/// A waiter rides out a restart of the server: it keeps waiting (the outage logged, not
/// returned) and wakes on the first message sent once the server is back.
#[test]
fn a_waiter_rides_out_a_server_restart() {
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let (_t, team, bus) = setup(&server, "outage");
    let inbox = RedisInbox::new(&bus, &team, &alice());
    let mut waiter = inbox.waiter().unwrap();
    let waiting = std::thread::spawn(move || {
        let t0 = Instant::now();
        let wake = waiter.wait(Some(Duration::from_secs(20)), &[]).unwrap();
        (wake, t0.elapsed())
    });
    std::thread::sleep(Duration::from_millis(200));
    server.restart();
    std::thread::sleep(Duration::from_millis(300));
    inbox.append(&msg("after the restart")).unwrap();
    let (wake, took) = waiting.join().unwrap();
    assert_eq!(wake, Wake::Message);
    assert!(took < Duration::from_secs(10), "{took:?}");
    let mut journal = drain::open_journal(&team, &alice()).0;
    assert_eq!(inbox.drain(&mut journal).unwrap().len(), 1);
}

/// A worker whose drain meets a server outage (here: the server killed while the worker waits
/// for its model, and down for 3 s, so the drain before the next model call finds it gone)
/// waits for the server instead of exiting (which made the supervisor restart it, and a long
/// outage mark it `failed`); once the server is back it finishes its activation and answers.
#[test]
fn a_worker_waits_out_a_server_outage_mid_activation() {
    use support::fake_llm::{
        FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
    };
    use support::team::{Team, wait_until};
    let Some(mut server) = RedisServer::start() else {
        return;
    };
    let team = Team::new();
    let usage = r#"{"input_tokens":10,"output_tokens":5}"#;
    let fake = FakeLlm::start([
        // The first answer comes late: the server dies meanwhile.
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block("tu_1", "read_inbox", "{}"),
            "tool_use",
            usage,
        ))
        .delay(Duration::from_millis(1500)),
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block("tu_2", "send_message", r#"{"to":"lead","content":"back"}"#),
            "tool_use",
            usage,
        )),
        Reply::ok(anthropic_text("done")),
    ]);
    let (on_bus, _, mut w) = alice_on_the_bus(&server, "outage-worker", &team, &fake.url());
    wait_until(Duration::from_secs(30), "the first model call", || {
        (fake.request_count() >= 1).then_some(())
    });
    server.stop();
    std::thread::sleep(Duration::from_secs(3));
    assert!(
        w.try_status().is_none(),
        "the worker exited during the outage: {:?}\n{}",
        w.try_status(),
        team.stderr("alice")
    );
    server.start_again();
    let lead_inbox = troupe::inbox::Inbox::new(&on_bus, &AgentName::lead());
    wait_until(
        Duration::from_secs(30),
        "the reply after the outage",
        || {
            lead_inbox
                .peek()
                .unwrap()
                .into_iter()
                .find(|m| m.content == "back")
        },
    );
    assert!(
        team.stderr("alice").contains("waiting for the bus"),
        "{}",
        team.stderr("alice")
    );
    w.signal(nix::sys::signal::Signal::SIGTERM);
    assert_eq!(w.wait(Duration::from_secs(5)).code(), Some(143));
}
