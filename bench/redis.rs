//! The inbox sections on a Redis bus (`--bus`), under throwaway team names `bench-PID-...`.

use std::path::Path;
use troupe::eprintln;

use serde_json::{Value, json};
use troupe::store::redis::RedisBus;

use crate::BenchArgs;
use crate::inbox::{self, Discipline, DrainMode, ThroughputResult};

/// The inbox on a Redis bus: throughput with 1 and 4 writer processes drained on every
/// wake-up, and the wake-up latency, as for the file bus.
pub fn inbox(a: &BenchArgs, scratch: &Path, url: &str) -> anyhow::Result<Value> {
    let exe = inbox::this_exe()?;
    let base = RedisBus::from_url(url)?;
    let pid = std::process::id();
    let mut throughput = Vec::new();
    for writers in [1, 4] {
        let team = format!("bench-{pid}-w{writers}");
        let r = throughput_on(scratch, url, &base, &team, writers, a.redis_messages)?;
        inbox::report(&r);
        throughput.push(r);
    }
    let team = format!("bench-{pid}-wake");
    let bus = base.for_team(&team)?;
    let wake = inbox::wake_latency(
        scratch,
        a.wake_samples,
        inbox::WAKE_GAP,
        &|dir: &Path| inbox::waiter_cmd(&exe, dir, Some((url, &team))),
        Some(&bus),
    )?;
    eprintln!(
        "wake latency (redis): p50 {:.3} ms, p99 {:.3} ms (to drained: p99 {:.3} ms)",
        wake.send_to_woken.p50_ms, wake.send_to_woken.p99_ms, wake.send_to_drained.p99_ms
    );
    Ok(json!({
        "bus": url,
        "measured": "as the file bus: writer processes append through the Lua script (one round trip each), the consumer drains on every wake-up (a blocking XREAD, then an XRANGE and a GET of the fence, and one mark script per batch) into its fsynced journal",
        "inbox_throughput": throughput,
        "wake_latency": {
            "send_to_woken": wake.send_to_woken,
            "send_to_drained": wake.send_to_drained,
            "append": wake.append_sync,
        },
    }))
}

/// The inbox throughput of `writers` writer processes of `messages` each, sending to a consumer
/// that drains on every wake-up, on team `team` of the Redis bus at `url` (`base`).
pub fn throughput_on(
    scratch: &Path,
    url: &str,
    base: &RedisBus,
    team: &str,
    writers: usize,
    messages: u64,
) -> anyhow::Result<ThroughputResult> {
    let exe = inbox::this_exe()?;
    let bus = base.for_team(team)?;
    let cmd = |dir: &Path, w: usize, n: u64, d: Discipline, go: &Path| {
        inbox::writer_cmd(&exe, dir, w, n, d, go, Some((url, team)))
    };
    inbox::throughput(
        scratch,
        writers,
        messages,
        Discipline::Redis,
        DrainMode::OnWake,
        &cmd,
        Some(&bus),
    )
}
