//! Governed load (issue 25): 8 real teammates make 6 model calls each (one activation of 5
//! `read_inbox` calls and an answer) against the rate-limiting stub of [`crate::rate_stub`],
//! with the rate governor off, by default, and with `--max-concurrent-calls 3`; for each run,
//! the 429s the stub gave, the calls it served, the most it answered at once and the wall
//! time from the first spawn to every teammate done.

use std::path::Path;
use std::time::{Duration, Instant};
use troupe::eprintln;

use anyhow::bail;
use serde_json::{Value, json};
use troupe::config::{Member, MemberStatus, Roster};
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::teamdir::AgentName;
use troupe::{TeamDir, fsutil};

use crate::lead::Supervisor;
use crate::measure::round3;
use crate::rate_stub::{Limit, RateStub};

const MATES: usize = 8;
const CALLS: usize = 6;
/// How long the stub takes to answer a request it serves.
const LATENCY: Duration = Duration::from_millis(100);

/// Every run: each stub with the governor off, by default and under a cap of 3.
pub fn run(lead: &Path, scratch: &Path) -> anyhow::Result<Value> {
    let stubs = [
        (
            "window_6_per_s",
            Limit::Window {
                n: 6,
                window: Duration::from_secs(1),
            },
        ),
        ("concurrent_3", Limit::Concurrent { n: 3 }),
        (
            "headers_10_per_s",
            Limit::Headers {
                n: 10,
                window: Duration::from_secs(1),
            },
        ),
    ];
    let modes: [(&str, &[&str]); 3] = [
        ("off", &["--rate-governor", "off"]),
        ("default", &[]),
        ("cap_3", &["--max-concurrent-calls", "3"]),
    ];
    let mut out = serde_json::Map::new();
    for (stub_name, limit) in stubs {
        let mut runs = serde_json::Map::new();
        for (mode, args) in modes {
            let label = format!("{stub_name} {mode}");
            let dir = scratch.join(format!("governed-{stub_name}-{mode}"));
            let r = one(lead, &dir, limit, args)?;
            eprintln!(
                "governed {label}: {} 429s, {} served, at most {} at once, {:.2} s",
                r["rate_limited"], r["served"], r["most_at_once"], r["wall_s"]
            );
            runs.insert(mode.to_owned(), r);
        }
        out.insert(stub_name.to_owned(), Value::Object(runs));
    }
    Ok(json!({
        "teammates": MATES,
        "calls_each": CALLS,
        "stub_latency_ms": LATENCY.as_millis() as u64,
        "runs": out,
    }))
}

fn one(lead: &Path, dir: &Path, limit: Limit, args: &[&str]) -> anyhow::Result<Value> {
    let stub = RateStub::start(limit, LATENCY, CALLS - 1);
    let team = TeamDir::create(dir.join("team"))?;
    let work = dir.join("work");
    fsutil::create_dir(&work)?;
    let names: Vec<String> = (0..MATES).map(|i| format!("m{i}")).collect();
    Roster::new(&team).update(|c| {
        for n in &names {
            let mut m = Member::new(n, "bench");
            m.prompt = Some("Read your inbox until you are told to stop.".to_owned());
            m.model = Some("m-stub".to_owned());
            c.members.push(m);
        }
        Ok(())
    })?;
    let mut run_args: Vec<String> = vec![
        "--workdir".into(),
        work.display().to_string(),
        "--sandbox".into(),
        "off".into(),
    ];
    run_args.extend(args.iter().map(|s| (*s).to_owned()));
    let envs = vec![
        ("TROUPE_PROVIDER".to_owned(), "anthropic".to_owned()),
        ("ANTHROPIC_API_KEY".to_owned(), "sk-bench".to_owned()),
        ("ANTHROPIC_BASE_URL".to_owned(), stub.url()),
        ("TROUPE_API_WAIT_MAX_SECS".to_owned(), "2".to_owned()),
    ];
    let t0 = Instant::now();
    for n in &names {
        let task = Message::new(MessageType::TaskAssignment, "lead", n, "work".to_owned());
        Inbox::new(&team, &AgentName::teammate(n)?).append(&task, Durability::Sync)?;
    }
    Roster::new(&team).update(|c| {
        for m in c.members.iter_mut() {
            m.status = MemberStatus::Spawning;
        }
        Ok(())
    })?;
    let mut sup = Supervisor::start(lead, &team, &run_args, &envs)?;
    let deadline = t0 + Duration::from_secs(180);
    loop {
        let cfg = Roster::new(&team).load()?;
        if cfg
            .members
            .iter()
            .all(|m| m.status == MemberStatus::Idle && m.calls >= CALLS as u64)
        {
            break;
        }
        if let Some(m) = cfg
            .members
            .iter()
            .find(|m| m.status == MemberStatus::Failed)
        {
            bail!("{} failed: {}", m.name, m.reason.as_deref().unwrap_or("?"));
        }
        if Instant::now() >= deadline {
            bail!("the teammates were not done within 180 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let wall = t0.elapsed();
    let counts = stub.counts();
    sup.stop()?;
    Ok(json!({
        "rate_limited": counts.limited,
        "served": counts.served,
        "most_at_once": counts.most_at_once,
        "wall_s": round3(wall.as_secs_f64()),
    }))
}
