//! Numbers: percentiles of a set of samples, rounding, and what `/proc` says about a process
//! (resident and proportional set size, CPU time, children).

use std::time::Duration;

use serde::Serialize;

/// Percentiles of a set of durations, in milliseconds (nearest rank).
#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub samples: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

impl Summary {
    /// Summarizes `ms`; `None` when it is empty.
    pub fn of(ms: &[f64]) -> Option<Summary> {
        if ms.is_empty() {
            return None;
        }
        let mut v = ms.to_vec();
        v.sort_by(f64::total_cmp);
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Summary {
            samples: v.len(),
            p50_ms: round3(rank(0.50)),
            p99_ms: round3(rank(0.99)),
            max_ms: round3(v[v.len() - 1]),
            mean_ms: round3(v.iter().sum::<f64>() / v.len() as f64),
        })
    }
}

/// Rounds to three decimals (microseconds, for milliseconds), to keep the JSON readable.
pub fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Resident set size of a process from `/proc/PID/status`, in KiB: `(VmRSS, RssAnon)`.
/// `VmRSS` counts the shared pages of the binary and libraries too; `RssAnon` is the process's
/// own heap and stacks.
pub fn vm_rss(pid: u32) -> Option<(u64, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
    };
    Some((field("VmRSS:")?, field("RssAnon:").unwrap_or(0)))
}

/// A duration in milliseconds, rounded to microseconds.
pub fn ms(d: Duration) -> f64 {
    round3(d.as_secs_f64() * 1000.0)
}

/// The children of process `pid` (of all its threads).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("children")).ok())
        .flat_map(|c| {
            c.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// VmRSS of `pid` and of all its descendants, in KiB: an idle worker's sandbox keeps no process,
/// and this shows it.
pub fn tree_rss_kib(pid: u32) -> u64 {
    let own = vm_rss(pid).map_or(0, |(r, _)| r);
    own + children(pid).into_iter().map(tree_rss_kib).sum::<u64>()
}

/// The proportional set size of `pid` in KiB (`Pss` of `/proc/PID/smaps_rollup`): its private
/// pages plus its share of the pages it shares, such as the binary's code that every worker
/// maps. VmRSS counts those shared pages whole in every process that touched them.
pub fn pss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|rest| rest.split_whitespace().next()?.parse().ok())
}

/// CPU time (user + system) process `pid` used so far, with that of its children it reaped.
pub fn cpu_ms(pid: u32) -> Option<f64> {
    // utime, stime, cutime, cstime.
    stat_cpu_ms(pid, 11..15)
}

/// CPU time (user + system) process `pid` used so far, without that of the children it reaped
/// (a supervisor's own, not its workers').
pub fn own_cpu_ms(pid: u32) -> Option<f64> {
    // utime, stime.
    stat_cpu_ms(pid, 11..13)
}

/// The sum of the clock-tick fields `fields` of `/proc/PID/stat` (counted after the command
/// name: utime, field 14, is the 12th), in ms.
fn stat_cpu_ms(pid: u32, fields: std::ops::Range<usize>) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses: state is field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f
        .get(fields)?
        .iter()
        .filter_map(|x| x.parse::<u64>().ok())
        .sum();
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Some(ticks as f64 * 1000.0 / hz)
}
