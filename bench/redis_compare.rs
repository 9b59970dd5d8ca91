//! `--redis-compare` (with `--bus`): troupe's Redis inbox against `redis-benchmark` running
//! plain `XADD` on the same server, in the same minute, with as many clients as writers, under
//! `appendfsync always` and `everysec`, and what troupe asks of the server per message.
//!
//! For each policy and 1 and 4 writers: troupe's throughput run (as the `redis` section: writer
//! processes append one message per call, as `lead send` does, through the append script; the
//! bench drains on every wake-up into its journal), between two `INFO all` snapshots; then
//! `redis-benchmark -c WRITERS -n MESSAGES XADD troupe-bench:xadd:PID * f v`, between two more;
//! then that key is deleted. The policy is set with `CONFIG SET appendonly yes` and `CONFIG SET
//! appendfsync`, and the server's own values are put back at the end, after a failure too. A
//! server that refuses `CONFIG` (a managed one) is measured under its current policy only.
//!
//! Besides that key, the bench touches only its throwaway teams' keys (`troupe:{bench-PID-...}`).
//! `redis-benchmark` 7.0 reads its password from `-a` only (no `REDISCLI_AUTH`), so the
//! password shows in the process list while it runs: use a throwaway one.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use serde_json::{Value, json};
use troupe::eprintln;
use troupe::store::redis::RedisBus;

use crate::BenchArgs;
use crate::inbox::{self, ThroughputResult};
use crate::measure::round3;
use crate::redis_admin::{Admin, Server, Snapshot};

/// The bar of issue 24.
const TARGET: &str = ">= 0.8x of redis-benchmark XADD at the same client count and fsync policy";
const TARGET_RATIO: f64 = 0.8;

/// What troupe's append and mark scripts call (shared/store/redis/inbox.rs): counted as run
/// inside scripts (their time is in `EVALSHA`'s already). The drain's own `XRANGE` is sent,
/// with a `GET` of the fence that is counted here too (one per batch, against the append
/// script's one per message).
const SCRIPT_CALLS: &[&str] = &["get", "set", "xadd", "xrevrange", "xdel"];

/// Server-wide counters per message (or per `XADD` request) between two snapshots.
#[derive(Debug, Clone, Serialize)]
pub struct PerMessage {
    /// Calls per message, by command (`INFO commandstats`; the bench's own `INFO` left out).
    pub calls: BTreeMap<String, f64>,
    /// Server microseconds per message, by command (a script's include its calls').
    pub us: BTreeMap<String, f64>,
    /// Commands clients sent (each its own round trip).
    pub commands_sent: f64,
    /// Commands run inside scripts.
    pub commands_in_scripts: f64,
    /// Server time in the commands clients sent (a script's time includes its calls), us.
    pub server_us: f64,
    /// CPU time of the server process (`used_cpu_user` + `used_cpu_sys`: commands, network
    /// I/O, the AOF), us.
    pub server_cpu_us: Option<f64>,
    /// Bytes from clients, and to them.
    pub net_in_bytes: f64,
    pub net_out_bytes: f64,
    /// Bytes added to the append-only file (null when the server keeps none, or rewrote it
    /// during the run).
    pub aof_bytes: Option<f64>,
    /// AOF rewrites during the run (the server's `auto-aof-rewrite-*`; not per message).
    pub aof_rewrites: Option<u64>,
    /// Connections opened during the run (not per message).
    pub connections: u64,
    /// `aof_delayed_fsync` during the run (everysec fsyncs that had to wait; not per message).
    pub delayed_fsyncs: Option<u64>,
}

fn per_message(before: &Snapshot, after: &Snapshot, messages: u64) -> PerMessage {
    let n = messages.max(1) as f64;
    let per = |x: u64| round3(x as f64 / n);
    let delta = |f: &str| Some(after.num(f)?.saturating_sub(before.num(f)?));
    let (mut calls, mut us_by) = (BTreeMap::new(), BTreeMap::new());
    let (mut sent, mut in_scripts, mut usec) = (0, 0, 0);
    let run = after.since(before);
    // redis-benchmark's XADD is sent, not called from a script.
    let scripted = run.contains_key("evalsha") || run.contains_key("eval");
    for (cmd, (c, us)) in run {
        if cmd == "info" {
            continue;
        }
        if scripted && SCRIPT_CALLS.contains(&cmd.as_str()) {
            in_scripts += c;
        } else {
            sent += c;
            usec += us;
        }
        us_by.insert(cmd.clone(), per(us));
        calls.insert(cmd, per(c));
    }
    let rewrites = delta("aof_rewrites");
    let aof = after.num("aof_enabled") == Some(1) && rewrites == Some(0);
    let cpu = after.cpu_seconds().zip(before.cpu_seconds());
    PerMessage {
        calls,
        us: us_by,
        commands_sent: per(sent),
        commands_in_scripts: per(in_scripts),
        server_us: per(usec),
        server_cpu_us: cpu.map(|(a, b)| round3((a - b) * 1e6 / n)),
        net_in_bytes: per(delta("total_net_input_bytes").unwrap_or(0)),
        net_out_bytes: per(delta("total_net_output_bytes").unwrap_or(0)),
        aof_bytes: delta("aof_current_size").filter(|_| aof).map(per),
        aof_rewrites: rewrites,
        connections: delta("total_connections_received").unwrap_or(0),
        delayed_fsyncs: delta("aof_delayed_fsync"),
    }
}

/// One (policy, writers) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// `always`, `everysec`, or `current` (the server refused `CONFIG`).
    pub appendfsync: String,
    pub writers: usize,
    pub troupe_msgs_per_sec: f64,
    pub troupe_lost: u64,
    /// redis-benchmark's requests per second, with `-c WRITERS`.
    pub xadd_requests_per_sec: f64,
    /// CPU time redis-benchmark spent per request, us (troupe's writers and consumer: in
    /// `troupe`).
    pub xadd_client_cpu_us_per_request: f64,
    pub xadd_requests: u64,
    /// troupe / XADD.
    pub ratio: f64,
    pub met: bool,
    pub troupe: ThroughputResult,
    /// What troupe's run asked of the server, per message delivered.
    pub troupe_per_message: PerMessage,
    /// What redis-benchmark's run asked of it, per request.
    pub xadd_per_request: PerMessage,
}

/// The `redis_compare` section.
pub fn run(a: &BenchArgs, scratch: &Path, url: &str) -> Result<Value> {
    let server = Server::of_url(url)?;
    let mut admin = Admin::connect(&server)?;
    let previous = match (
        admin.config_get("appendonly")?,
        admin.config_get("appendfsync")?,
    ) {
        (Ok(on), Ok(policy)) => Ok((on, policy)),
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    let key = format!("troupe-bench:xadd:{}", std::process::id());
    let mut rows = Vec::new();
    let outcome = match &previous {
        Ok(_) => measure_policies(a, scratch, url, &server, &mut admin, &key, &mut rows),
        Err(e) => {
            eprintln!(
                "redis compare: the server refused CONFIG ({e}); measuring under its current fsync policy only"
            );
            measure(
                a, scratch, url, &server, &mut admin, &key, "current", &mut rows,
            )
        }
    };
    let mut cleanup = Vec::new();
    // The benchmark's key, and the server's own policy, whatever happened above (on a fresh
    // connection if ours broke).
    let mut admin = match admin.call(&["PING"]) {
        Ok(_) => admin,
        Err(_) => Admin::connect(&server)?,
    };
    if let Err(e) = admin.ok(&["DEL", &key]) {
        cleanup.push(format!("{e:#}"));
    }
    if let Ok((on, policy)) = &previous {
        for (name, value) in [("appendfsync", policy), ("appendonly", on)] {
            match admin.config_set(name, value) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => cleanup.push(format!("CONFIG SET {name} {value} refused: {e}")),
                Err(e) => cleanup.push(format!("CONFIG SET {name} {value}: {e:#}")),
            }
        }
    }
    if !cleanup.is_empty() {
        let what = cleanup.join("; ");
        eprintln!("redis compare: could not put the server back: {what}");
        outcome.context(format!("and could not put the server back: {what}"))?;
        bail!("could not put the server back: {what}");
    }
    outcome?;
    Ok(json!({
        "bus": url,
        "measured": "per fsync policy and writer count: troupe's Redis throughput run (writer processes, one append script call per message as `lead send` does; drained on every wake-up into the fsynced journal), then redis-benchmark XADD with as many clients and as many requests, in the same minute; server counters from INFO all before and after each",
        "config": match &previous {
            Ok((on, policy)) => json!({"appendonly": on, "appendfsync": policy, "restored": true}),
            Err(e) => json!({"refused": e}),
        },
        "fsyncs": "not counted: INFO (Redis 7.0) has no fsync counter. Under always the server fsyncs once per event-loop pass that wrote to the AOF, so clients served in the same pass share one fsync; aof_bytes shows what each message writes",
        "xadd_key": key,
        "rows": rows,
    }))
}

/// Both policies, each set on the server first. A server that refuses the first `CONFIG SET`
/// is measured under its current policy.
fn measure_policies(
    a: &BenchArgs,
    scratch: &Path,
    url: &str,
    server: &Server,
    admin: &mut Admin,
    key: &str,
    rows: &mut Vec<Row>,
) -> Result<()> {
    for policy in ["always", "everysec"] {
        let set = match admin.config_set("appendonly", "yes")? {
            Ok(()) => admin.config_set("appendfsync", policy)?,
            Err(e) => Err(e),
        };
        if let Err(e) = set {
            if rows.is_empty() {
                eprintln!(
                    "redis compare: the server refused CONFIG SET ({e}); measuring under its current fsync policy only"
                );
                return measure(a, scratch, url, server, admin, key, "current", rows);
            }
            bail!("CONFIG SET appendfsync {policy} refused: {e}");
        }
        wait_for_rewrite(admin)?;
        measure(a, scratch, url, server, admin, key, policy, rows)?;
    }
    Ok(())
}

/// Turning the AOF on starts a rewrite: wait for it, so that it does not share the run.
fn wait_for_rewrite(admin: &mut Admin) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = admin.snapshot()?;
        let busy = |f: &str| s.num(f).is_some_and(|n| n != 0);
        if !busy("aof_rewrite_in_progress") && !busy("aof_rewrite_scheduled") {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the server's AOF rewrite still runs after 120 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// 1 and 4 writers under the policy in force.
#[allow(clippy::too_many_arguments)]
fn measure(
    a: &BenchArgs,
    scratch: &Path,
    url: &str,
    server: &Server,
    admin: &mut Admin,
    key: &str,
    policy: &str,
    rows: &mut Vec<Row>,
) -> Result<()> {
    let base = RedisBus::from_url(url)?;
    let pid = std::process::id();
    for writers in [1, 4] {
        let team = format!("bench-{pid}-cmp-{policy}-w{writers}");
        let before = admin.snapshot()?;
        let t = crate::redis::throughput_on(scratch, url, &base, &team, writers, a.redis_messages)?;
        let after = admin.snapshot()?;
        let requests = writers as u64 * a.redis_messages;
        let x_before = admin.snapshot()?;
        let cpu_before = inbox::cpu_seconds(libc::RUSAGE_CHILDREN);
        let rate = redis_benchmark(server, writers, requests, key)?;
        let client_cpu = inbox::cpu_seconds(libc::RUSAGE_CHILDREN) - cpu_before;
        let x_after = admin.snapshot()?;
        admin.ok(&["DEL", key])?;
        let ratio = round3(t.msgs_per_sec / rate);
        let row = Row {
            appendfsync: policy.to_owned(),
            writers,
            troupe_msgs_per_sec: t.msgs_per_sec.round(),
            troupe_lost: t.lost,
            xadd_requests_per_sec: rate.round(),
            xadd_client_cpu_us_per_request: round3(client_cpu * 1e6 / requests as f64),
            xadd_requests: requests,
            ratio,
            met: ratio >= TARGET_RATIO && t.lost == 0,
            troupe_per_message: per_message(&before, &after, t.delivered),
            xadd_per_request: per_message(&x_before, &x_after, requests),
            troupe: t,
        };
        report(&row);
        rows.push(row);
    }
    Ok(())
}

/// `redis-benchmark ... XADD key * f v`: requests per second.
fn redis_benchmark(s: &Server, clients: usize, requests: u64, key: &str) -> Result<f64> {
    let mut c = Command::new("redis-benchmark");
    c.args(["-h", &s.host, "-p", &s.port.to_string()])
        .args(["-a", &s.password]);
    if let Some(u) = &s.user {
        c.args(["--user", u]);
    }
    if s.db != 0 {
        c.args(["--dbnum", &s.db.to_string()]);
    }
    c.args([
        "-c",
        &clients.to_string(),
        "-n",
        &requests.to_string(),
        "--csv",
    ])
    .args(["XADD", key, "*", "f", "v"])
    .stdin(Stdio::null());
    let out = c
        .output()
        .context("failed to run redis-benchmark (it comes with redis-server / redis-tools)")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("redis-benchmark failed ({}): {}", out.status, stderr.trim());
    }
    parse_csv(&stdout).with_context(|| {
        format!(
            "no XADD rate in redis-benchmark's output: {} {}",
            stdout.trim(),
            stderr.trim()
        )
    })
}

/// The `rps` of the `XADD` line of `redis-benchmark --csv`.
fn parse_csv(out: &str) -> Option<f64> {
    out.lines().find_map(|l| {
        let mut fields = l.split(',').map(|f| f.trim().trim_matches('"'));
        let test = fields.next()?;
        if !test.starts_with("XADD") {
            return None;
        }
        fields.next()?.parse().ok()
    })
}

/// One line on stderr per (policy, writers).
fn report(r: &Row) {
    let opt = |x: Option<f64>| x.map_or("-".to_owned(), |v| format!("{v:.0}"));
    let p = &r.troupe_per_message;
    let calls: Vec<String> = p.calls.iter().map(|(c, n)| format!("{c} {n:.3}")).collect();
    eprintln!(
        "redis compare appendfsync={} writers={}: troupe {:.0} msgs/s (lost {}), XADD {:.0} req/s, \
         ratio {:.2} ({}); per message: {:.2} commands sent + {:.2} in scripts, server {:.1} us \
         in commands, {} us CPU (XADD: {:.1}, {}), AOF {} bytes (XADD: {}) [{}]",
        r.appendfsync,
        r.writers,
        r.troupe_msgs_per_sec,
        r.troupe_lost,
        r.xadd_requests_per_sec,
        r.ratio,
        if r.met { "met" } else { "not met" },
        p.commands_sent,
        p.commands_in_scripts,
        p.server_us,
        opt(p.server_cpu_us),
        r.xadd_per_request.server_us,
        opt(r.xadd_per_request.server_cpu_us),
        opt(p.aof_bytes),
        opt(r.xadd_per_request.aof_bytes),
        calls.join(", ")
    );
}

/// The `targets` entry of a `--redis-compare` run: every row at 0.8x or better, none lost.
pub fn targets(section: &Value) -> Value {
    let rows: Vec<Value> = section["rows"]
        .as_array()
        .map(|rs| {
            rs.iter()
                .map(|r| {
                    json!({
                        "appendfsync": r["appendfsync"],
                        "writers": r["writers"],
                        "ratio": r["ratio"],
                        "met": r["met"],
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let met = !rows.is_empty() && rows.iter().all(|r| r["met"] == true);
    json!({
        "redis_vs_xadd": {
            "target": TARGET,
            "rows": rows,
            "met": met,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_csv_rate_is_read() {
        let out = "\"test\",\"rps\",\"avg_latency_ms\"\n\"XADD troupe-bench:xadd:1 * f v\",\"5252.10\",\"0.740\"\n";
        assert_eq!(parse_csv(out), Some(5252.10));
        assert_eq!(parse_csv("\"test\",\"rps\"\n"), None);
    }
}
