//! Review 4's R4-7, m4 and m1, with the real `lead` and `worker` under `--max-concurrent-calls
//! 1` against a fake model server: a stopped waiter for the call slot (SIGSTOP, as Ctrl-Z of
//! `lead chat` would) no longer holds the queue for everyone behind it, in a team dir (its
//! place lapses within seconds) or on a bus (within the waiter's lease); a stopped holder of the
//! slot gives it up within its lease, and finishes its call once continued; and a holder killed
//! with `kill -9` leaves no entry in the limits' `in_flight`.
//!
//! The bounds asserted are loose for a noisy machine, but far below what the faults gave: a
//! stopped waiter or holder blocked the next call until it was continued (a team dir) or for 30 s
//! (a waiter on a bus), and a killed call's `in_flight` entry stayed 900 s.

mod support;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::hosts::{Bus, Host};
use support::redis_server::RedisServer;
use support::team::{Bg, Team, lead_cmd, stop_between_writes, wait_until};

const T: Duration = Duration::from_secs(60);
/// How long the test waits for the call a stopped process must not hold up, and the most it
/// may take after the slot freed: the lease is 3 s in a team dir and for a bus's waiter.
const PATIENCE: Duration = Duration::from_secs(25);
const BOUND: Duration = Duration::from_secs(10);

fn text(t: &str) -> Reply {
    Reply::ok(anthropic_text(t))
}

/// A team of one host under `--max-concurrent-calls 1`: in a team dir, or on a bus.
enum Site {
    Dir(Team),
    Bus {
        bus: Bus,
        host: Host,
        _server: Box<RedisServer>,
        _scratch: tempfile::TempDir,
    },
}

impl Site {
    fn dir() -> Site {
        Site::Dir(Team::new())
    }

    fn bus() -> Option<Site> {
        let server = RedisServer::start()?;
        let scratch = tempfile::tempdir().unwrap();
        let bus = Bus::new(&server, "leases", scratch.path(), &[]);
        Some(Site::Bus {
            bus,
            host: Host::new(),
            _server: Box::new(server),
            _scratch: scratch,
        })
    }

    fn lead(&self, url: &str, args: &[&str]) -> Command {
        match self {
            Site::Dir(team) => lead_cmd(team, url, args),
            Site::Bus { bus, host, .. } => {
                let mut c = bus.lead(host, args);
                c.env("TROUPE_PROVIDER", "anthropic")
                    .env("ANTHROPIC_API_KEY", "sk-test")
                    .env("ANTHROPIC_BASE_URL", url);
                c
            }
        }
    }

    fn out(&self, url: &str, args: &[&str]) -> Output {
        self.lead(url, args).output().unwrap()
    }

    /// `lead run` with one call in flight at most, `extra` after.
    fn supervise(&self, url: &str, extra: &[&str]) -> Bg {
        let mut args = vec![
            "run",
            "--max-concurrent-calls",
            "1",
            "--stop-timeout",
            "1",
            "--kill-grace",
            "1",
            "--sandbox",
            "off",
        ];
        if matches!(self, Site::Bus { .. }) {
            args.extend(["--host", "ha"]);
        }
        args.extend_from_slice(extra);
        let bg = Bg(self
            .lead(url, &args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap());
        if let Site::Dir(team) = self {
            wait_until(T, "the supervisor to hold lead.lock", || {
                troupe::fsutil::HeldLock::is_held(&team.dir.lead_lock())
                    .unwrap()
                    .then_some(())
            });
        }
        bg
    }

    /// Spawns `name`, whose model is `m-NAME`.
    fn spawn(&self, url: &str, name: &str) {
        let model = format!("m-{name}");
        let mut args = vec![
            "spawn", name, "--role", "r", "--prompt", "work", "--model", &model,
        ];
        if matches!(self, Site::Bus { .. }) {
            args.extend(["--host", "ha"]);
        }
        let o = self.out(url, &args);
        assert!(o.status.success(), "{o:?}");
    }

    fn members(&self) -> Vec<Value> {
        let o = self.out("http://127.0.0.1:9", &["status", "--json"]);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        v["members"].as_array().cloned().unwrap_or_default()
    }

    fn member(&self, name: &str) -> Value {
        self.members()
            .into_iter()
            .find(|m| m["name"] == name)
            .unwrap_or_default()
    }

    /// Waits until `name` has a process and waits for a call slot; its pid.
    fn waiting_slot(&self, name: &str) -> u32 {
        wait_until(T, &format!("{name} waiting for a call slot"), || {
            let m = self.member(name);
            (m["doing"]["state"] == "waiting_slot")
                .then(|| m["pid"].as_u64())
                .flatten()
                .map(|p| p as u32)
        })
    }

    fn idle(&self, name: &str) {
        wait_until(T, &format!("{name} idle"), || {
            (self.member(name)["status"] == "idle").then_some(())
        });
    }

    /// Stops `pid` with SIGSTOP (in a team dir, at a moment it holds no short lock of it, the
    /// governor's state lock included: stopped inside one, it would block the whole team for a
    /// reason this test is not about).
    fn stop(&self, pid: u32) {
        match self {
            Site::Dir(team) => stop_between_writes(pid, &team.dir),
            Site::Bus { .. } => signal(pid, Signal::SIGSTOP),
        }
    }

    /// How many attempts the governor's state for the fake at `url` has in flight.
    fn in_flight(&self, url: &str) -> usize {
        let team = match self {
            Site::Dir(team) => team.dir.clone(),
            Site::Bus { bus, host, .. } => bus.team_dir(host),
        };
        let fp = troupe::llm::gate::fingerprint(&format!("{url}/v1/messages"), "sk-test");
        let state = troupe::store::govern::Pool::new(team.store(), &fp)
            .update(|b| (None, b.map(<[u8]>::to_vec)))
            .unwrap()
            .expect("the governor's state");
        let state: Value = serde_json::from_slice(&state).unwrap();
        state["in_flight"].as_array().expect("in_flight").len()
    }
}

fn signal(pid: u32, sig: Signal) {
    kill(Pid::from_raw(pid as i32), sig).unwrap();
}

/// How long after `since` the fake first saw a request for `model`, if within `within`.
fn first_request(
    fake: &FakeLlm,
    model: &str,
    since: Instant,
    within: Duration,
) -> Option<Duration> {
    while since.elapsed() < within {
        if fake.requests_for(model) > 0 {
            return Some(since.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// Alice holds the only slot (her call waits at the fake until it is answered); bob and then
/// carol queue for it; bob is stopped; alice's call ends: carol's call starts within `BOUND`.
/// Once continued, bob makes his call too.
fn a_stopped_waiter_does_not_hold_the_queue(site: &Site) {
    let fake = FakeLlm::start([]).patient(T * 2);
    let url = fake.url();
    fake.push_for("m-bob", text("bob done"));
    fake.push_for("m-carol", text("carol done"));
    let _lead = site.supervise(&url, &[]);
    site.spawn(&url, "alice");
    wait_until(T, "alice's call", || {
        (fake.requests_for("m-alice") > 0).then_some(())
    });
    site.spawn(&url, "bob");
    let bob = site.waiting_slot("bob");
    site.spawn(&url, "carol");
    site.waiting_slot("carol");
    site.stop(bob);
    let freed = Instant::now();
    fake.push_for("m-alice", text("alice done"));
    let carol = first_request(&fake, "m-carol", freed, PATIENCE);
    signal(bob, Signal::SIGCONT);
    let carol = carol.unwrap_or_else(|| {
        panic!("carol made no call for {PATIENCE:?} after the slot freed, bob stopped ahead of her")
    });
    eprintln!("carol's call began {carol:?} after alice's ended, bob stopped ahead of her");
    assert!(
        carol < BOUND,
        "carol's call began {carol:?} after the slot freed"
    );
    for name in ["alice", "bob", "carol"] {
        site.idle(name);
    }
    assert_eq!(fake.requests_for("m-bob"), 1, "bob's call once continued");
}

#[test]
fn in_a_team_dir_a_stopped_waiter_does_not_hold_the_queue() {
    a_stopped_waiter_does_not_hold_the_queue(&Site::dir());
}

#[test]
fn on_a_bus_a_stopped_waiter_does_not_hold_the_queue() {
    let Some(site) = Site::bus() else { return };
    a_stopped_waiter_does_not_hold_the_queue(&site);
}

/// Alice holds the only slot and is stopped mid-call, with bob waiting: bob's call starts
/// within `BOUND` of her stop. Continued, alice finishes her call.
#[test]
fn in_a_team_dir_a_stopped_holder_gives_up_its_slot() {
    let site = Site::dir();
    let fake = FakeLlm::start([]).patient(T * 2);
    let url = fake.url();
    fake.push_for("m-bob", text("bob done"));
    let _lead = site.supervise(&url, &[]);
    site.spawn(&url, "alice");
    wait_until(T, "alice's call", || {
        (fake.requests_for("m-alice") > 0).then_some(())
    });
    let alice = site.member("alice")["pid"].as_u64().unwrap() as u32;
    site.spawn(&url, "bob");
    site.waiting_slot("bob");
    site.stop(alice);
    let stopped = Instant::now();
    let bob = first_request(&fake, "m-bob", stopped, PATIENCE);
    signal(alice, Signal::SIGCONT);
    let bob = bob.unwrap_or_else(|| {
        panic!("bob made no call for {PATIENCE:?} after alice was stopped holding the slot")
    });
    eprintln!("bob's call began {bob:?} after alice was stopped holding the slot");
    assert!(bob < BOUND, "bob's call began {bob:?} after alice's stop");
    fake.push_for("m-alice", text("alice done"));
    site.idle("alice");
    site.idle("bob");
}

/// m1: alice holds the only slot and is killed with SIGKILL (not restarted); bob's call goes
/// once her slot is free (at once in a team dir, when its lease lapses on a bus) and ends:
/// nothing is left in flight in the governor's state.
fn a_killed_holders_in_flight_entry_goes_with_it(site: &Site) {
    let fake = FakeLlm::start([]).patient(T * 2);
    let url = fake.url();
    fake.push_for("m-bob", text("bob done"));
    let _lead = site.supervise(&url, &["--max-restarts", "0"]);
    site.spawn(&url, "alice");
    wait_until(T, "alice's call", || {
        (fake.requests_for("m-alice") > 0).then_some(())
    });
    let alice = site.member("alice")["pid"].as_u64().unwrap() as u32;
    site.spawn(&url, "bob");
    site.waiting_slot("bob");
    assert_eq!(site.in_flight(&url), 1, "alice's call is in flight");
    signal(alice, Signal::SIGKILL);
    site.idle("bob");
    assert_eq!(fake.requests_for("m-bob"), 1);
    assert_eq!(
        site.in_flight(&url),
        0,
        "the killed call's entry stayed, with no call in flight"
    );
}

#[test]
fn in_a_team_dir_a_killed_holders_in_flight_entry_goes_with_it() {
    a_killed_holders_in_flight_entry_goes_with_it(&Site::dir());
}

#[test]
fn on_a_bus_a_killed_holders_in_flight_entry_goes_with_it() {
    let Some(site) = Site::bus() else { return };
    a_killed_holders_in_flight_entry_goes_with_it(&site);
}
