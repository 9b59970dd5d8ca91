//! How workers start: spawn -> idle, idle memory and CPU per worker for the separate `worker`
//! binary and the lead's built-in worker, each with `--sandbox off` and `best-effort`, in the
//! same run; [`targets`] says whether the sandboxed rows are within 10 % (spawn -> idle p50)
//! and 0.1 MB (PSS, with VmRSS beside) of the unsandboxed ones.

use std::path::Path;
use troupe::eprintln;

use anyhow::Context;
use serde_json::{Value, json};
use troupe::config::Roster;
use troupe::{TeamDir, fsutil};

use crate::lead::Supervisor;
use crate::measure::round3;
use crate::watch::RootWatch;
use crate::{BenchArgs, section, team};

/// How workers start, in the same run: for the separate `worker` binary (when it is built beside
/// `lead`) and for the lead's built-in worker, with the sandbox `off` and `best-effort`, a team
/// of `workers` spawned to `idle` as in `spawn_100`, each under its own supervisor.
pub fn worker_startup(a: &BenchArgs, lead: &Path, scratch: &Path) -> anyhow::Result<Value> {
    // The built-in worker through `TROUPE_WORKER`: a link named `worker` to `lead` (the lead
    // runs as the worker when started as `worker`), so a `worker` beside it is not chosen.
    let links = scratch.join("built-in");
    fsutil::create_dir(&links)?;
    let built_in = links.join("worker");
    std::os::unix::fs::symlink(lead, &built_in)
        .with_context(|| format!("failed to link {}", built_in.display()))?;
    let beside = lead.with_file_name("worker");
    let mut kinds = vec![("built_in", Some(built_in))];
    if beside.is_file() {
        kinds.insert(0, ("binary", Some(beside)));
    } else {
        eprintln!(
            "worker start-up: no {} (cargo build --release --bin worker): the separate binary is not measured",
            beside.display()
        );
    }
    let cassette = scratch.join("startup.cassette.jsonl");
    team::write_cassette(&cassette)?;
    let names: Vec<String> = (0..a.workers).map(team::member_name).collect();
    let mut out = json!({
        "measured": "as spawn_100, one team per row, each under its own supervisor; spawn_to_idle_ms is the p50 of each member's spawn call -> idle",
    });
    for (kind, path) in kinds {
        let mut rows = json!({"program": path.as_ref().map(|p| p.display().to_string())});
        for sandbox in ["off", "best-effort"] {
            let label = format!("{kind}, sandbox {sandbox}");
            let root = scratch.join(format!("startup-{kind}-{sandbox}"));
            let team = TeamDir::create(root.join("team"))?;
            let work = root.join("work");
            fsutil::create_dir(&work)?;
            let args: Vec<String> = vec![
                "--workdir".into(),
                work.display().to_string(),
                "--sandbox".into(),
                sandbox.into(),
            ];
            let mut envs = team::replay_envs(&cassette);
            if let Some(p) = &path {
                envs.push(("TROUPE_WORKER".into(), p.display().to_string()));
            }
            let watch = RootWatch::new(team.root());
            let row = (|| -> anyhow::Result<Value> {
                let mut sup = Supervisor::start(lead, &team, &args, &envs)?;
                let mut pids = Vec::new();
                let r = team::spawn_phase(&team, &watch, &names, sup.pid(), &mut pids, &label)?;
                sup.stop()?;
                Ok(json!({
                    "all_idle_ms": r["all_idle_ms"],
                    "spawn_to_idle_ms": r["each_spawn_to_idle"]["p50_ms"],
                    "spawn_calls_ms": r["spawn_calls_ms"],
                    "roster_rewrites_per_worker": r["roster_rewrites_per_worker"],
                    "rss_mb_mean": r["rss_mb_mean"],
                    "rss_mb_max": r["rss_mb_max"],
                    "rss_anon_mb_mean": r["rss_anon_mb_mean"],
                    "pss_mb_mean": r["pss_mb_mean"],
                    "rss_with_children_mb_mean": r["rss_with_children_mb_mean"],
                    "cpu_ms_mean": r["cpu_ms_mean"],
                    "sandbox": Roster::new(&team).load().ok().and_then(|c| {
                        c.members.first()?.sandbox.as_ref().map(|s| s.describe())
                    }),
                }))
            })();
            rows[sandbox] = section(row);
        }
        out[kind] = rows;
    }
    Ok(out)
}

/// The sandbox's cost at start-up, per worker kind of [`worker_startup`]: sandboxed spawn ->
/// idle within 10 % of `--sandbox off`, and idle memory (PSS) within 0.1 MB.
pub fn targets(doc: &Value) -> Value {
    let mut t = json!({});
    for kind in ["binary", "built_in"] {
        let rows = &doc["worker_startup"][kind];
        if rows.is_null() {
            continue;
        }
        let (off, on) = (&rows["off"], &rows["best-effort"]);
        let (idle_off, idle_on) = (
            off["spawn_to_idle_ms"].as_f64(),
            on["spawn_to_idle_ms"].as_f64(),
        );
        let (rss_off, rss_on) = (off["rss_mb_mean"].as_f64(), on["rss_mb_mean"].as_f64());
        let (pss_off, pss_on) = (off["pss_mb_mean"].as_f64(), on["pss_mb_mean"].as_f64());
        let ratio = idle_off.zip(idle_on).map(|(f, n)| round3(n / f.max(0.001)));
        let pss_diff = pss_off.zip(pss_on).map(|(f, n)| round3(n - f));
        t[format!("sandbox_spawn_to_idle_{kind}")] = json!({
            "target": "sandboxed spawn -> idle (p50) within 10 % of --sandbox off",
            "off_ms": idle_off,
            "sandboxed_ms": idle_on,
            "ratio": ratio,
            "met": ratio.is_some_and(|r| r <= 1.10),
        });
        // Judged on PSS: what a sandboxed worker adds to the machine's memory. VmRSS also
        // counts, whole in each worker, the pages of code that the sandbox set-up touched
        // once and every worker shares; it is reported beside.
        t[format!("sandbox_memory_{kind}")] = json!({
            "target": "sandboxed idle memory (mean PSS) within 0.1 MB of --sandbox off",
            "off_mb": pss_off,
            "sandboxed_mb": pss_on,
            "diff_mb": pss_diff,
            "vm_rss_diff_mb": rss_off.zip(rss_on).map(|(f, n)| round3(n - f)),
            "met": pss_diff.is_some_and(|d| d <= 0.1),
        });
    }
    t
}

/// Prints the start-up rows of [`worker_startup`] and its targets, one line each.
pub fn report(t: &Value) {
    let Some(t) = t.as_object() else { return };
    for (k, v) in t {
        let met = if v["met"] == true { "met" } else { "NOT met" };
        if k.starts_with("sandbox_spawn_to_idle") {
            eprintln!(
                "{k}: off {} ms, sandboxed {} ms (x{}); target {}: {met}",
                v["off_ms"], v["sandboxed_ms"], v["ratio"], v["target"]
            );
        } else {
            eprintln!(
                "{k}: PSS off {} MB, sandboxed {} MB ({:+} MB; VmRSS {:+} MB); target {}: {met}",
                v["off_mb"],
                v["sandboxed_mb"],
                v["diff_mb"].as_f64().unwrap_or(f64::NAN),
                v["vm_rss_diff_mb"].as_f64().unwrap_or(f64::NAN),
                v["target"]
            );
        }
    }
}
