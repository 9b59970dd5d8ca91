//! Issue 25, acceptance 5: two hosts on one Redis bus share one cap. Each host's supervisor
//! (`lead run --host H --max-concurrent-calls 2`, its own team dir) runs four teammates that
//! make six calls each against one stub (`bench/rate_stub.rs`, which counts the requests it
//! answers at once): never more than 2 in flight between the two hosts, and every call done.

mod support;

#[path = "../bench/rate_stub.rs"]
mod rate_stub;

use std::process::Stdio;
use std::time::Duration;

use rate_stub::{Limit, RateStub};
use support::hosts::{Bus, Host, ok};
use support::redis_server::RedisServer;
use support::team::{Bg, wait_until};

const T: Duration = Duration::from_secs(120);
const CALLS: usize = 6;
const CAP: u32 = 2;

#[test]
fn two_hosts_on_one_bus_share_one_cap() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    // Serves any number at once: it only counts.
    let stub = RateStub::start(
        Limit::Concurrent { n: 1000 },
        Duration::from_millis(100),
        CALLS - 1,
    );
    let scratch = tempfile::tempdir().unwrap();
    let bus = Bus::new(&server, "governed", scratch.path(), &[]);
    let (a, b) = (Host::new(), Host::new());
    let with_stub = |host: &Host, args: &[&str]| {
        let mut c = bus.lead(host, args);
        c.env("TROUPE_PROVIDER", "anthropic")
            .env("ANTHROPIC_API_KEY", "sk-test")
            .env("ANTHROPIC_BASE_URL", stub.url());
        c
    };
    let mut names = Vec::new();
    for (host, on) in [("ha", &a), ("hb", &b)] {
        for i in 0..4 {
            let name = format!("{host}{i}");
            let o = with_stub(
                on,
                &[
                    "spawn", &name, "--role", "r", "--prompt", "work", "--model", "m-stub",
                    "--host", host,
                ],
            )
            .output()
            .unwrap();
            ok(&o);
            names.push(name);
        }
    }
    let cap = CAP.to_string();
    let _sups: Vec<Bg> = [("ha", &a), ("hb", &b)]
        .into_iter()
        .map(|(host, on)| {
            Bg(with_stub(
                on,
                &[
                    "run",
                    "--host",
                    host,
                    "--sandbox",
                    "off",
                    "--max-concurrent-calls",
                    &cap,
                    "--stop-timeout",
                    "1",
                    "--kill-grace",
                    "1",
                ],
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap())
        })
        .collect();
    let members = wait_until(T, "all eight done with their calls", || {
        let ms = bus.members(&a);
        (ms.len() == names.len()
            && ms
                .iter()
                .all(|m| m["status"] == "idle" && m["calls"].as_u64() >= Some(CALLS as u64)))
        .then_some(ms)
    });
    let counts = stub.counts();
    eprintln!("two hosts, --max-concurrent-calls {CAP}: {counts:?}");
    for m in &members {
        let host = m["name"].as_str().unwrap()[..2].to_owned();
        assert_eq!(m["host"], host.as_str(), "{m}");
    }
    assert_eq!(counts.served, (names.len() * CALLS) as u64, "{counts:?}");
    assert_eq!(counts.limited, 0, "{counts:?}");
    assert!(
        counts.most_at_once <= CAP,
        "{} calls in flight at once between the two hosts, over the cap of {CAP}",
        counts.most_at_once
    );
}
