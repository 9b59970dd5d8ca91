//! How the team's costs grow with its size (issue 24): for each size of `--scale` (say
//! `100,300`), in the same run, a fresh team under its own supervisor is spawned to `idle` as in
//! `spawn_100`, then stopped as `lead stop` does (SIGTERM to the supervisor) with every member
//! running. Each size reports the spawn calls' total time, spawn -> all idle, and the team
//! stop; the last size is compared with the first (`ratios`), against the bar of 3.5x
//! for three times the team.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use troupe::eprintln;

use anyhow::{Context, bail};
use serde_json::{Value, json};
use troupe::config::{MemberStatus, Roster};
use troupe::{TeamDir, fsutil};

use crate::lead::{self, Supervisor};
use crate::measure::{ms, own_cpu_ms, round3};
use crate::team;
use crate::watch::{RewriteCount, RootWatch};
use crate::{BenchArgs, section};

/// The most each measure may grow from the smallest size to one three times as large (issue
/// 24); for other proportions it is scaled as `3.5 / 3` of the size ratio.
const BAR_PER_SIZE: f64 = 3.5 / 3.0;

/// The team sizes of `--scale`, in the order given.
#[derive(Debug, Clone)]
pub struct Sizes(pub Vec<usize>);

/// The sizes of `--scale`: team sizes separated by commas, each at least 1, at least two.
pub fn parse_sizes(s: &str) -> Result<Sizes, String> {
    let sizes: Vec<usize> = s
        .split(',')
        .map(|p| {
            p.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("not a team size: {p:?}"))
        })
        .collect::<Result<_, _>>()?;
    if sizes.len() < 2 {
        return Err("give at least two sizes, such as 100,300".into());
    }
    Ok(Sizes(sizes))
}

/// The scale sections into `doc`: one row per size under `scale.sizes`, and the growth of the
/// last size over the first under `scale.ratios` (also in `targets`).
pub fn sections(a: &BenchArgs, sizes: &[usize], lead: &Path, scratch: &Path, doc: &mut Value) {
    // Every size's dir is made before the settle, which probes each: a team's files go where
    // its dir went, and another block group of the same file system can be clean or not.
    let roots: Vec<PathBuf> = sizes.iter().map(|n| size_root(scratch, *n)).collect();
    for r in &roots {
        if let Err(e) = fsutil::create_dir(r) {
            eprintln!("scale: {e}");
        }
    }
    let settle = settle(a.settle_secs, scratch, &roots);
    let mut rows = Vec::new();
    for &n in sizes {
        rows.push((n, section(one_size(a, n, lead, scratch))));
    }
    let ratios = ratios(&rows);
    for (n, row) in &rows {
        if row.get("error").is_none() {
            eprintln!(
                "scale {n}: spawn calls {} ms, spawn -> all idle {} ms, team stop {} ms \
                 (a file created in the scratch dir in {} us; {} roster writes in the stop, {} of config.json; supervisor CPU {} ms to idle, {} ms to stop; \
                 roster {} bytes, parse {} ms, serialize {} ms, whole update {} ms, one member's {} ms)",
                row["spawn_calls_ms"],
                row["all_idle_ms"],
                row["team_stop_ms"],
                row["file_create_us"],
                row["team_stop_roster_rewrites"],
                row["team_stop_config_rewrites"],
                row["supervisor_cpu_ms_to_idle"],
                row["supervisor_cpu_ms_in_stop"],
                row["idle_roster"]["bytes"],
                row["idle_roster"]["parse_ms"],
                row["idle_roster"]["serialize_ms"],
                row["idle_roster"]["update_ms"],
                row["idle_roster"]["member_write_ms"],
            );
        }
    }
    if let Some(r) = ratios.as_object() {
        for (k, v) in r {
            if let Some(x) = v.get("ratio") {
                let met = if v["met"] == true { "met" } else { "NOT met" };
                eprintln!("scale ratio {k}: x{x} (bar x{}): {met}", v["bar"]);
            }
        }
    }
    doc["scale"] = json!({
        "measured": "per size, a fresh team under its own supervisor: the in-process spawn calls (as `lead spawn`), the first call -> every member `idle` in config.json, and SIGTERM to the supervisor (as `lead stop`) with every member running -> the supervisor exited, every member `stopped` or `shutdown`",
        "sizes": rows.iter().map(|(n, r)| {
            let mut r = r.clone();
            r["workers"] = json!(n);
            r
        }).collect::<Vec<_>>(),
        "ratios": ratios,
        "settle": settle,
    });
}

/// The median cost of a file creation, in us, over which the scratch dir's file system is taken
/// to be passing over recently freed inodes: a rested ext4 without a journal creates one in
/// about 15 us, one with a journal in 20-30.
const SETTLED_CREATE_US: f64 = 100.0;
/// How often the creation cost is measured again while waiting.
const SETTLE_PROBE_EVERY: Duration = Duration::from_secs(20);

/// On an ext4 without a journal, waits (at most `max_secs`) until creating a file in `scratch`
/// costs what it does on a rested file system. Such an ext4 does not reuse an inode freed in
/// the last minutes (up to five: a better chance of recovery after a crash, with no journal):
/// every allocation passes over all of them, at hundreds of us a file after the tens of
/// thousands a previous bench run, or a test suite, removed. A team start creates a dozen
/// files a member, so that, not troupe, would set the ratios; once the freed inodes have aged
/// out the file system is as fast as before. Elsewhere nothing is waited for.
fn settle(max_secs: u64, scratch: &Path, roots: &[PathBuf]) -> Value {
    let Some(device) = unjournaled_ext4(scratch) else {
        return json!({"unjournaled_ext4": false, "waited_s": 0});
    };
    let t0 = Instant::now();
    let mut probes = 0;
    // The dearest of the size dirs' creations.
    let mut probe = || -> anyhow::Result<f64> {
        probes += 1;
        let mut worst: f64 = 0.0;
        for r in roots {
            worst = worst.max(create_cost(&r.join(format!("settle-probe-{probes}")))?);
        }
        Ok(worst)
    };
    let first = match probe() {
        Ok(us) => us,
        Err(e) => return json!({"unjournaled_ext4": device, "error": format!("{e:#}")}),
    };
    let mut now = first;
    if now > SETTLED_CREATE_US && max_secs > 0 {
        eprintln!(
            "scale: {device} is an ext4 without a journal and creates a file in {now:.0} us here (about 15 when rested): it passes over the inodes freed in the last minutes; waiting up to {max_secs} s for them to age out (--settle-secs 0 does not wait)"
        );
        let deadline = t0 + Duration::from_secs(max_secs);
        while now > SETTLED_CREATE_US && Instant::now() < deadline {
            std::thread::sleep(SETTLE_PROBE_EVERY.min(deadline - Instant::now()));
            match probe() {
                Ok(us) => now = us,
                Err(e) => return json!({"unjournaled_ext4": device, "error": format!("{e:#}")}),
            }
            eprintln!(
                "scale: a file in {now:.0} us after {:.0} s",
                t0.elapsed().as_secs_f64()
            );
        }
    }
    json!({
        "unjournaled_ext4": device,
        "file_create_us_first": first,
        "file_create_us_last": now,
        "settled": now <= SETTLED_CREATE_US,
        "waited_s": round3(t0.elapsed().as_secs_f64()),
    })
}

/// The block device of the ext4 without a journal that holds `dir` (`vda`), if it is one: an
/// ext4 has `/proc/fs/ext4/DEV`, its journal `/proc/fs/jbd2/DEV-INODE`.
fn unjournaled_ext4(dir: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let fs = nix::sys::statfs::statfs(dir).ok()?;
    if fs.filesystem_type() != nix::sys::statfs::EXT4_SUPER_MAGIC {
        return None;
    }
    let dev = std::fs::metadata(dir).ok()?.dev();
    let link = std::fs::read_link(format!(
        "/sys/dev/block/{}:{}",
        libc::major(dev),
        libc::minor(dev)
    ))
    .ok()?;
    let name = link.file_name()?.to_str()?.to_owned();
    if !Path::new("/proc/fs/ext4").join(&name).exists() {
        return None;
    }
    let journal = format!("{name}-");
    let journaled = std::fs::read_dir("/proc/fs/jbd2").is_ok_and(|d| {
        d.flatten().any(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|f| f.starts_with(&journal))
        })
    });
    (!journaled).then_some(name)
}

/// The growth of each measure from the first row to the last, against the bar.
fn ratios(rows: &[(usize, Value)]) -> Value {
    let (Some((n0, first)), Some((n1, last))) = (rows.first(), rows.last()) else {
        return Value::Null;
    };
    let size_ratio = *n1 as f64 / *n0 as f64;
    let bar = round3(BAR_PER_SIZE * size_ratio);
    let mut out = json!({"size_ratio": round3(size_ratio)});
    for key in ["spawn_calls_ms", "all_idle_ms", "team_stop_ms"] {
        let ratio = first[key]
            .as_f64()
            .zip(last[key].as_f64())
            .map(|(a, b)| round3(b / a.max(0.001)));
        out[key] = json!({
            "from_ms": first[key],
            "to_ms": last[key],
            "ratio": ratio,
            "bar": bar,
            "met": ratio.is_some_and(|r| r <= bar),
        });
    }
    out
}

/// Where the team of `n` members lives.
fn size_root(scratch: &Path, n: usize) -> PathBuf {
    scratch.join(format!("scale-{n}"))
}

/// One team of `n` members: spawned to idle, then stopped with all of them running.
fn one_size(a: &BenchArgs, n: usize, lead: &Path, scratch: &Path) -> anyhow::Result<Value> {
    let root = size_root(scratch, n);
    fsutil::create_dir(&root)?;
    let create_us = create_cost(&root.join("create-probe"))?;
    let team = TeamDir::create(root.join("team"))?;
    let work = root.join("work");
    fsutil::create_dir(&work)?;
    let cassette = root.join("bench.cassette.jsonl");
    team::write_cassette(&cassette)?;
    let mut args = vec!["--workdir".to_owned(), work.display().to_string()];
    if lead::supports_restart_delay(lead) {
        args.extend(["--restart-delay".to_owned(), a.restart_delay.to_string()]);
    }
    let envs = team::replay_envs(&cassette);
    let watch = RootWatch::new(team.root());
    let mut sup = Supervisor::start(lead, &team, &args, &envs)?;
    let sup_pid = sup.pid();
    let names: Vec<String> = (0..n).map(team::member_name).collect();
    let mut pids = Vec::new();
    let label = format!("scale {n}");
    let spawn = team::spawn_phase(&team, &watch, &names, sup_pid, &mut pids, &label)?;
    let cpu_idle = own_cpu_ms(sup_pid);
    // Settled: the idle workers' last writes are done before the stop is timed.
    std::thread::sleep(Duration::from_millis(200));
    let roster_costs = roster_costs(&team)?;
    let cpu_before = own_cpu_ms(sup_pid);
    let rewrites = RewriteCount::new(team.root());
    let stop = stop_until_exit(&mut sup, sup_pid)?;
    let stop_rewrites = rewrites.count();
    let cfg = Roster::new(&team).load()?;
    let running: Vec<&str> = cfg
        .members
        .iter()
        .filter(|m| !matches!(m.status, MemberStatus::Stopped | MemberStatus::Shutdown))
        .map(|m| m.name.as_str())
        .collect();
    if !running.is_empty() {
        bail!(
            "after the team stop, {} member(s) are neither stopped nor shut down: {}",
            running.len(),
            running.join(", ")
        );
    }
    let left = pids
        .iter()
        .filter(|&&p| troupe::liveness::pid_alive(p))
        .count();
    Ok(json!({
        "spawn_calls_ms": spawn["spawn_calls_ms"],
        "spawn_call_each": spawn["spawn_call_each"],
        "all_idle_ms": spawn["all_idle_ms"],
        "each_spawn_to_idle": spawn["each_spawn_to_idle"],
        "roster_rewrites_per_worker": spawn["roster_rewrites_per_worker"],
        "supervisor_cpu_ms_to_idle": cpu_idle.map(round3),
        "team_stop_ms": ms(stop.elapsed),
        "team_stop_roster_rewrites": stop_rewrites.map(|r| r.total()),
        "team_stop_config_rewrites": stop_rewrites.map(|r| r.config),
        "supervisor_cpu_ms_in_stop": stop.cpu_ms.zip(cpu_before).map(|(a, b)| round3(a - b)),
        "worker_processes_left": left,
        "file_create_us": create_us,
        "idle_roster": roster_costs,
    }))
}

/// What one read and one write of the idle team's whole roster cost, and one write of one
/// member's record (medians of 20).
fn roster_costs(team: &TeamDir) -> anyhow::Result<Value> {
    let roster = Roster::new(team);
    let cfg = roster.load()?;
    let bytes = std::fs::read(team.config())?;
    let median = |f: &mut dyn FnMut() -> anyhow::Result<()>| -> anyhow::Result<f64> {
        let mut v = Vec::new();
        for _ in 0..20 {
            let t = Instant::now();
            f()?;
            v.push(t.elapsed().as_secs_f64() * 1000.0);
        }
        v.sort_by(f64::total_cmp);
        Ok(round3(v[v.len() / 2]))
    };
    Ok(json!({
        "bytes": bytes.len(),
        "parse_ms": median(&mut || {
            serde_json::from_slice::<troupe::config::TeamConfig>(&bytes)?;
            Ok(())
        })?,
        "serialize_ms": median(&mut || {
            serde_json::to_vec_pretty(&cfg)?;
            Ok(())
        })?,
        "update_ms": median(&mut || {
            Ok(roster.update(|c| {
                c.members[0].updated_at = Some(fsutil::now());
                Ok(())
            })?)
        })?,
        "member_write_ms": median(&mut || {
            roster.write_member(&cfg.members[0].name, false, &mut |c| {
                c.members[0].updated_at = Some(fsutil::now());
            })?;
            Ok(())
        })?,
    }))
}

/// What creating an empty file in the scratch dir costs before the team starts, in us (the
/// median of 200 made in `dir`, kept until the scratch is removed: a probe that deleted them
/// would add to what it measures). Every worker start creates files, so this sets much of a
/// start's cost: a few us on tmpfs and 20-30 on an ext4 with a journal, and on an ext4
/// without one (this project's VM) hundreds once many files were deleted there in the last
/// minutes, the previous bench run's cleanup among them: such a file system passes over
/// recently freed inodes when it allocates one.
fn create_cost(dir: &Path) -> anyhow::Result<f64> {
    fsutil::create_dir(dir)?;
    let mut v = Vec::with_capacity(200);
    for i in 0..200 {
        let t = Instant::now();
        std::fs::File::create_new(dir.join(format!("f{i}")))
            .with_context(|| format!("failed to create a file in {}", dir.display()))?;
        v.push(t.elapsed().as_secs_f64() * 1e6);
    }
    v.sort_by(f64::total_cmp);
    Ok(round3(v[v.len() / 2]))
}

/// What [`stop_until_exit`] measured.
struct Stopped {
    elapsed: Duration,
    /// The supervisor's own CPU time just before it was reaped.
    cpu_ms: Option<f64>,
}

/// SIGTERM to the supervisor, as `lead stop` sends, until it has exited; its CPU time is read
/// while it is a zombie, before [`Supervisor::stop`] reaps it.
fn stop_until_exit(sup: &mut Supervisor, pid: u32) -> anyhow::Result<Stopped> {
    let t0 = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .context("failed to signal the supervisor")?;
    let deadline = t0 + Duration::from_secs(120);
    let mut cpu = None;
    while Instant::now() < deadline {
        if !troupe::liveness::pid_alive(pid) {
            break;
        }
        cpu = own_cpu_ms(pid).or(cpu);
        std::thread::sleep(Duration::from_millis(2));
    }
    let elapsed = t0.elapsed();
    // A zombie still has its stat.
    cpu = own_cpu_ms(pid).or(cpu);
    sup.stop()?;
    Ok(Stopped {
        elapsed,
        cpu_ms: cpu,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_two_or_more_positive_numbers() {
        assert_eq!(parse_sizes("100,300").unwrap().0, vec![100, 300]);
        assert_eq!(parse_sizes(" 10, 20 ,40").unwrap().0, vec![10, 20, 40]);
        for bad in ["100", "", "100,0", "100,x", "100,-3"] {
            assert!(parse_sizes(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn ratios_compare_the_last_size_with_the_first() {
        let rows = vec![
            (
                100,
                json!({"spawn_calls_ms": 100.0, "all_idle_ms": 1000.0, "team_stop_ms": 200.0}),
            ),
            (
                300,
                json!({"spawn_calls_ms": 340.0, "all_idle_ms": 5500.0, "team_stop_ms": 700.0}),
            ),
        ];
        let r = ratios(&rows);
        assert_eq!(r["spawn_calls_ms"]["ratio"], 3.4);
        assert_eq!(r["spawn_calls_ms"]["met"], true);
        assert_eq!(r["all_idle_ms"]["ratio"], 5.5);
        assert_eq!(r["all_idle_ms"]["met"], false);
        assert_eq!(r["team_stop_ms"]["bar"], 3.5);
        assert_eq!(r["team_stop_ms"]["met"], true);
    }
}
