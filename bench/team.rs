//! A real team: the `lead run` supervisor of this build and its workers on a replay cassette
//! written into the scratch dir (no network). `spawn_100`: members spawned to `idle`, with
//! their idle memory and CPU; `shutdown_round_trip`: shutdown requests until the supervisor
//! reaped the exit; `recovery_after_kill9`: `kill -9` of idle workers until they are `idle`
//! again in their next incarnation (the restart backoff shown apart); `team_stop`: the graceful
//! stop of whoever is left. And `spawn_call`, the spawn call alone into a team no supervisor
//! runs (nothing else takes `config.lock`), with one roster update of the full roster taken
//! apart.

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};
use troupe::eprintln;

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use troupe::config::{MemberStatus, Roster};
use troupe::ops::{self, SpawnSpec};
use troupe::{TeamDir, events, fsutil};

use crate::lead::{self, Supervisor};
use crate::measure::{Summary, cpu_ms, ms, pss_kib, round3, tree_rss_kib, vm_rss};
use crate::watch::{RewriteCount, RootWatch};
use crate::{BenchArgs, section, startup};

/// The team sections, into `doc`: the cost of the spawn call alone, then the team bench, then
/// how workers start.
pub fn sections(a: &BenchArgs, lead: &Path, scratch: &Path, doc: &mut Value) {
    doc["spawn_call"] = section(spawn_call(scratch, a.workers));
    let team = team_bench(a, lead, scratch).unwrap_or_else(|e| {
        let err = section(Err(e));
        vec![("spawn_100", err)]
    });
    for (k, v) in team {
        doc[k] = v;
    }
    doc["worker_startup"] = section(startup::worker_startup(a, lead, scratch));
    startup::report(&startup::targets(doc));
}

pub fn member_name(i: usize) -> String {
    format!("w{i:03}")
}

/// The cassette of the team bench: each member's first call answers with a short text (so it
/// goes idle), its second approves the shutdown request it was shown.
pub fn write_cassette(path: &Path) -> anyhow::Result<()> {
    // Entries of any agent (`*`): two lines whatever the team's size, so that no worker parses
    // a line per member when it starts (which would make the start cost grow with the team).
    let agent = troupe::llm::replay::ANY_AGENT;
    let ready = json!({"agent": agent, "seq": 0, "response": {
        "content": [{"type": "text", "text": "Ready."}],
        "stop_reason": "end_turn",
        "usage": {"input_tokens": 0, "output_tokens": 0},
        "model": "bench-cassette",
    }});
    let approve = json!({"agent": agent, "seq": 1, "response": {
        "content": [{"type": "tool_use", "id": "toolu_bench",
            "name": "shutdown_response",
            "input": {"request_id": "{{request_id}}", "approve": true}}],
        "stop_reason": "tool_use",
        "usage": {"input_tokens": 0, "output_tokens": 0},
        "model": "bench-cassette",
    }});
    let mut text = String::new();
    for e in [ready, approve] {
        text.push_str(&serde_json::to_string(&e)?);
        text.push('\n');
    }
    std::fs::write(path, text).with_context(|| format!("failed to write {}", path.display()))
}

fn events_len(team: &TeamDir) -> u64 {
    std::fs::metadata(team.events()).map_or(0, |m| m.len())
}

/// The first event named `event` about member `name` after byte `*offset` of `events.jsonl`,
/// advancing `*offset` past what was read.
fn find_event(
    team: &TeamDir,
    offset: &mut u64,
    event: &str,
    name: &str,
) -> anyhow::Result<Option<Value>> {
    let (evs, next) = events::read_from(team, *offset)?;
    *offset = next;
    Ok(evs
        .into_iter()
        .find(|e| e["event"] == event && e["name"] == name))
}

/// What the bench spawns member `name` with.
fn bench_spec(name: &str) -> SpawnSpec {
    SpawnSpec {
        name: name.to_owned(),
        role: "bench".into(),
        prompt: "Say you are ready.".into(),
        model: None,
        require_plan_approval: false,
        auto_claim: false,
        budget_usd: None,
        budget_tokens: None,
        worktree: false,
        host: None,
    }
}

/// The spawn call alone: `workers` calls of [`ops::spawn`] into a fresh team that no
/// supervisor runs (nothing else writes its roster), then what one call is made of, each part
/// timed on the full roster: the roster update (read and parse, serialize, durable replace) and
/// the task's durable append to the inbox.
fn spawn_call(scratch: &Path, workers: usize) -> anyhow::Result<Value> {
    use troupe::inbox::{Durability, Inbox};
    use troupe::message::{Message, MessageType};
    const REPEAT: usize = 21;
    let team = TeamDir::create(scratch.join("spawn-call-team"))?;
    let mut each = Vec::with_capacity(workers);
    let t0 = Instant::now();
    for i in 0..workers {
        let t = Instant::now();
        ops::spawn(&team, &bench_spec(&member_name(i)))?;
        each.push(ms(t.elapsed()));
    }
    let total = t0.elapsed();
    let median = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let mut v = Vec::with_capacity(REPEAT);
        for _ in 0..REPEAT {
            let t = Instant::now();
            f()?;
            v.push(ms(t.elapsed()));
        }
        v.sort_by(f64::total_cmp);
        Ok(v[v.len() / 2])
    };
    let roster = Roster::new(&team);
    let cfg = roster.load()?;
    let bytes = serde_json::to_vec_pretty(&cfg)?;
    let load = median(&mut || roster.load().map(|_| ()).map_err(Into::into))?;
    let serialize = median(&mut || {
        serde_json::to_vec_pretty(&cfg)
            .map(|_| ())
            .map_err(Into::into)
    })?;
    let replace = median(&mut || Ok(fsutil::atomic_write(&team.config(), &bytes)?))?;
    let update = median(&mut || {
        Ok(roster.update(|c| {
            c.members[0].updated_at = Some(fsutil::now());
            Ok(())
        })?)
    })?;
    let name = troupe::AgentName::teammate(&member_name(0))?;
    let inbox = Inbox::new(&team, &name);
    let append = median(&mut || {
        let m = Message::new(MessageType::Message, "lead", name.as_str(), "bench");
        Ok(inbox.append(&m, Durability::Sync)?)
    })?;
    let s = Summary::of(&each).context("no spawn calls")?;
    eprintln!(
        "spawn call, no supervisor: {workers} calls in {:.0} ms (p50 {:.2} ms); one roster \
         update of {workers} members {update:.2} ms (read+parse {load:.2}, serialize \
         {serialize:.2}, durable replace {replace:.2}), task append {append:.2} ms",
        ms(total),
        s.p50_ms
    );
    Ok(json!({
        "measured": "ops::spawn (as `lead spawn` does, in process) into a team no supervisor runs: nothing else takes config.lock",
        "calls": workers,
        "total_ms": ms(total),
        "each": s,
        "roster_bytes": bytes.len(),
        "full_roster_ms": {
            "measured": format!("median of {REPEAT}, on the roster of {workers} members"),
            "update": update,
            "read_parse": load,
            "serialize": serialize,
            "durable_replace": replace,
            "task_append_sync": append,
        },
    }))
}

/// The environment of a bench supervisor: the replay provider, named explicitly so no API key
/// in the environment takes over; empty values switch off recording, ordered replay and pacing
/// inherited from the environment.
pub fn replay_envs(cassette: &Path) -> Vec<(String, String)> {
    [
        ("TROUPE_PROVIDER", "replay".to_owned()),
        ("TROUPE_CASSETTE", cassette.display().to_string()),
        ("TROUPE_RECORD", String::new()),
        ("TROUPE_REPLAY_PROGRESS", String::new()),
        ("TROUPE_REPLAY_PACE_MS", String::new()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

/// Runs the team measurements; each key of the result is one section of the document (a
/// section that failed holds `{"error": ...}`).
fn team_bench(
    a: &BenchArgs,
    lead: &Path,
    scratch: &Path,
) -> anyhow::Result<Vec<(&'static str, Value)>> {
    let root = scratch.join("team");
    let team = TeamDir::create(&root)?;
    let work = scratch.join("work");
    troupe::fsutil::create_dir(&work)?;
    let cassette = scratch.join("bench.cassette.jsonl");
    write_cassette(&cassette)?;
    let mut args = vec!["--workdir".to_owned(), work.display().to_string()];
    let delay_flag = lead::supports_restart_delay(lead);
    if delay_flag {
        args.extend(["--restart-delay".to_owned(), a.restart_delay.to_string()]);
    }
    let envs = replay_envs(&cassette);
    let watch = RootWatch::new(team.root());
    let mut sup = Supervisor::start(lead, &team, &args, &envs)?;
    let sup_pid = sup.pid();
    let mut out = Vec::new();
    let mut pids_seen: Vec<u32> = Vec::new();

    let names: Vec<String> = (0..a.workers).map(member_name).collect();
    let spawn = spawn_phase(&team, &watch, &names, sup_pid, &mut pids_seen, "team");
    let spawned_ok = spawn.is_ok();
    out.push(("spawn_100", section(spawn)));
    if spawned_ok {
        let n = a.shutdowns.min(names.len());
        out.push((
            "shutdown_round_trip",
            section(shutdown_phase(&team, &watch, &names[..n])),
        ));
        let victims: Vec<String> = names[n..].iter().rev().take(a.kills).cloned().collect();
        let default_backoff = if delay_flag { a.restart_delay } else { 1.0 };
        out.push((
            "recovery_after_kill9",
            section(recovery_phase(
                &team,
                &watch,
                &victims,
                delay_flag,
                default_backoff,
                &mut pids_seen,
            )),
        ));
    }
    let left = Roster::new(&team)
        .load()
        .map(|c| {
            c.members
                .iter()
                .filter(|m| m.status.wants_process())
                .count()
        })
        .unwrap_or(0);
    eprintln!("team: stopping the supervisor ({left} workers running)");
    let stop = sup.stop();
    let survivors = pids_seen
        .iter()
        .filter(|&&p| troupe::liveness::pid_alive(p))
        .count();
    out.push((
        "team_stop",
        section(stop.map(|d| {
            json!({
                "measured": "SIGTERM to the supervisor -> it exited after its graceful team stop",
                "running_workers": left,
                "ms": ms(d),
                "worker_processes_left": survivors,
            })
        })),
    ));
    Ok(out)
}

pub fn spawn_phase(
    team: &TeamDir,
    watch: &RootWatch,
    names: &[String],
    sup_pid: u32,
    pids_seen: &mut Vec<u32>,
    label: &str,
) -> anyhow::Result<Value> {
    let roster = Roster::new(team);
    eprintln!("{label}: spawning {} workers", names.len());
    let rewrites = RewriteCount::new(team.root());
    // The roster is read as the supervisor reads it: only the members' records that changed
    // (a whole read of hundreds of records every few ms would take the CPU the team needs).
    let records = team.store().watch(&[troupe::store::Watched::Roster]).ok();
    let mut seen = troupe::config::RosterSeen::default();
    if records.is_some() {
        seen.watched();
    }
    let mut last = troupe::config::TeamConfig::default();
    let t0 = Instant::now();
    let mut idle_at: HashMap<String, Duration> = HashMap::new();
    // Spawn from a second thread while this one watches the roster, so early members' idle
    // times are seen as they happen, not after the last spawn call.
    let (spawned_at, cfg) = std::thread::scope(|s| {
        let spawner = s.spawn(|| -> anyhow::Result<Vec<(Duration, Duration)>> {
            let mut at = Vec::with_capacity(names.len());
            for name in names {
                let before = t0.elapsed();
                ops::spawn(team, &bench_spec(name))?;
                at.push((before, t0.elapsed()));
            }
            Ok(at)
        });
        let cfg = watch.until(
            "every worker to be idle",
            Duration::from_secs(120),
            Duration::from_millis(5),
            || {
                // Asked before the load: a spawner done by then left every member it made in it.
                let spawner_done = spawner.is_finished();
                if let Some(w) = &records {
                    w.changed();
                    seen.note_changes(w.take_members());
                }
                roster.load_into(&mut seen, &mut last)?;
                let cfg = &last;
                let now = t0.elapsed();
                for m in &cfg.members {
                    if m.status == MemberStatus::Failed {
                        bail!("{} failed: {}", m.name, m.reason.as_deref().unwrap_or("?"));
                    }
                    if m.status == MemberStatus::Idle && m.pid.is_some() {
                        idle_at.entry(m.name.clone()).or_insert(now);
                    }
                }
                if spawner_done && cfg.members.len() < names.len() {
                    bail!("spawning stopped after {} members", cfg.members.len());
                }
                Ok((idle_at.len() == names.len()).then(|| cfg.clone()))
            },
        );
        let spawned = spawner
            .join()
            .map_err(|_| anyhow::anyhow!("the spawning thread panicked"))?;
        anyhow::Ok((spawned?, cfg?))
    })?;
    let spawn_calls = spawned_at.last().map(|c| c.1).unwrap_or_default();
    let call_ms: Vec<f64> = spawned_at
        .iter()
        .map(|(a, b)| ms(b.saturating_sub(*a)))
        .collect();
    let all_idle = t0.elapsed();
    let roster_rewrites = rewrites.count();
    let mut times: Vec<f64> = idle_at.values().map(|d| d.as_secs_f64() * 1000.0).collect();
    times.sort_by(f64::total_cmp);
    // Each member's own spawn call -> idle.
    let each: Vec<f64> = names
        .iter()
        .zip(&spawned_at)
        .filter_map(|(n, at)| Some(idle_at.get(n)?.saturating_sub(at.1).as_secs_f64() * 1000.0))
        .collect();
    let mut rss = Vec::new();
    let mut anon = Vec::new();
    let mut pss = Vec::new();
    let mut tree = Vec::new();
    let mut cpu = Vec::new();
    for m in &cfg.members {
        let pid = m.pid.context("an idle member without a pid")?;
        pids_seen.push(pid);
        let (r, an) = vm_rss(pid).with_context(|| format!("no /proc/{pid}/status"))?;
        rss.push(r as f64 / 1024.0);
        anon.push(an as f64 / 1024.0);
        pss.push(pss_kib(pid).unwrap_or(0) as f64 / 1024.0);
        tree.push(tree_rss_kib(pid) as f64 / 1024.0);
        cpu.push(cpu_ms(pid).unwrap_or(0.0));
    }
    let mean = |v: &[f64]| round3(v.iter().sum::<f64>() / v.len().max(1) as f64);
    let max = |v: &[f64]| round3(v.iter().copied().fold(0.0, f64::max));
    let polling = names
        .iter()
        .filter(|n| {
            let log = team.root().join("logs").join(format!("{n}.log"));
            std::fs::read_to_string(log).is_ok_and(|t| t.contains("falling back to polling"))
        })
        .count();
    let doc = json!({
        "workers": names.len(),
        "measured": "first `spawn` (in-process ops::spawn, as `lead spawn` does) -> every member `idle` in config.json, with a supervisor already running",
        "spawn_calls_ms": ms(spawn_calls),
        "spawn_call_each": Summary::of(&call_ms),
        "idle_after_last_spawn_call_ms": ms(all_idle.saturating_sub(spawn_calls)),
        "first_idle_ms": round3(times.first().copied().unwrap_or(0.0)),
        "median_idle_ms": round3(times.get(times.len() / 2).copied().unwrap_or(0.0)),
        "all_idle_ms": ms(all_idle),
        "each_spawn_to_idle": Summary::of(&each),
        "roster_rewrites": roster_rewrites.map(|r| r.total()),
        "config_rewrites": roster_rewrites.map(|r| r.config),
        "record_writes": roster_rewrites.map(|r| r.records),
        "roster_rewrites_per_worker": roster_rewrites.map(|r| round3(r.total() as f64 / names.len().max(1) as f64)),
        "config_rewrites_per_worker": roster_rewrites.map(|r| round3(r.config as f64 / names.len().max(1) as f64)),
        "rss_mb_mean": mean(&rss),
        "rss_mb_max": max(&rss),
        "rss_anon_mb_mean": mean(&anon),
        "pss_mb_mean": mean(&pss),
        "rss_with_children_mb_mean": mean(&tree),
        "cpu_ms_mean": mean(&cpu),
        "supervisor_rss_mb": vm_rss(sup_pid).map(|(r, _)| round3(r as f64 / 1024.0)),
        "workers_on_polling_fallback": polling,
    });
    eprintln!(
        "{label}: {} workers idle in {:.0} ms (spawn calls {:.0} ms, each p50 {:.2} ms; \
         spawn -> idle p50 {:.0} ms; {} roster writes a worker, {} of config.json), RSS mean {:.2} MB (anon {:.2} MB, PSS {:.2} MB), max \
         {:.2} MB, CPU {:.0} ms a worker",
        names.len(),
        ms(all_idle),
        ms(spawn_calls),
        doc["spawn_call_each"]["p50_ms"].as_f64().unwrap_or(0.0),
        doc["each_spawn_to_idle"]["p50_ms"].as_f64().unwrap_or(0.0),
        doc["roster_rewrites_per_worker"],
        doc["config_rewrites_per_worker"],
        mean(&rss),
        mean(&anon),
        mean(&pss),
        max(&rss),
        mean(&cpu)
    );
    Ok(doc)
}

fn shutdown_phase(team: &TeamDir, watch: &RootWatch, names: &[String]) -> anyhow::Result<Value> {
    eprintln!("team: {} shutdown round trips", names.len());
    let mut trips = Vec::new();
    let mut bad_exits = Vec::new();
    for name in names {
        let mut offset = events_len(team);
        let t0 = Instant::now();
        ops::request_shutdown(team, name, "bench: shutdown round trip", ops::SHUTDOWN_TTL)?;
        let exit = watch.until(
            &format!("{name} to exit"),
            Duration::from_secs(30),
            Duration::ZERO,
            || find_event(team, &mut offset, "exit", name),
        )?;
        trips.push(t0.elapsed().as_secs_f64() * 1000.0);
        if exit["code"] != 0 {
            bad_exits.push(json!({"name": name, "code": exit["code"], "signal": exit["signal"]}));
        }
    }
    let s = Summary::of(&trips).context("no shutdown samples")?;
    eprintln!(
        "team: shutdown round trip p50 {:.1} ms, p99 {:.1} ms",
        s.p50_ms, s.p99_ms
    );
    let mut doc = serde_json::to_value(&s)?;
    doc["measured"] = json!(
        "request_shutdown (request file + message) -> the supervisor's `exit` event for the worker"
    );
    doc["non_zero_exits"] = json!(bad_exits);
    Ok(doc)
}

fn recovery_phase(
    team: &TeamDir,
    watch: &RootWatch,
    names: &[String],
    delay_flag: bool,
    default_backoff_secs: f64,
    pids_seen: &mut Vec<u32>,
) -> anyhow::Result<Value> {
    eprintln!("team: {} kill -9 recoveries", names.len());
    let roster = Roster::new(team);
    let mut totals = Vec::new();
    let mut backoffs = Vec::new();
    let mut minus = Vec::new();
    for name in names {
        let m = roster.load()?.require(name)?.clone();
        let pid = m.pid.with_context(|| format!("{name} has no pid"))?;
        let old = m.incarnation;
        let mut offset = events_len(team);
        let mut backoff: Option<f64> = None;
        let t0 = Instant::now();
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL)
            .with_context(|| format!("failed to kill {name} (pid {pid})"))?;
        let new_pid = watch.until(
            &format!("{name} to be idle again"),
            Duration::from_secs(60),
            Duration::ZERO,
            || {
                if backoff.is_none()
                    && let Some(e) = find_event(team, &mut offset, "restart_scheduled", name)?
                {
                    backoff = e["in_secs"].as_f64();
                }
                let cfg = roster.load()?;
                let m = cfg.require(name)?;
                if m.status == MemberStatus::Failed {
                    bail!("{name} failed: {}", m.reason.as_deref().unwrap_or("?"));
                }
                Ok((m.status == MemberStatus::Idle && m.incarnation > old)
                    .then_some(m.pid)
                    .flatten()
                    .filter(|&p| p != pid))
            },
        )?;
        let total = t0.elapsed().as_secs_f64() * 1000.0;
        pids_seen.push(new_pid);
        let b = backoff.unwrap_or(default_backoff_secs) * 1000.0;
        totals.push(total);
        backoffs.push(b);
        minus.push(total - b);
    }
    let t = Summary::of(&totals).context("no recovery samples")?;
    let r = Summary::of(&minus).context("no recovery samples")?;
    let b = Summary::of(&backoffs).context("no recovery samples")?;
    eprintln!(
        "team: recovery after kill -9 p50 {:.1} ms (backoff {:.0} ms, rest {:.1} ms)",
        t.p50_ms, b.p50_ms, r.p50_ms
    );
    Ok(json!({
        "measured": "SIGKILL of an idle worker -> `idle` again in config.json with a higher incarnation",
        "samples": t.samples,
        "total_ms_p50": t.p50_ms,
        "total_ms_max": t.max_ms,
        "backoff_ms": b.p50_ms,
        "backoff_from": if delay_flag { "lead run --restart-delay" } else { "the supervisor's built-in first restart delay" },
        "minus_backoff_ms_p50": r.p50_ms,
        "minus_backoff_ms_max": r.max_ms,
    }))
}
