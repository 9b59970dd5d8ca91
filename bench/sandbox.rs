//! The sandbox's cost on one command: the bash tool's round trip, sandboxed and not.

use std::path::Path;
use std::time::{Duration, Instant};
use troupe::eprintln;

use serde_json::{Value, json};
use troupe::fsutil;
use troupe::sandbox::{Sandbox, Settings};

use crate::measure::{ms, round3};

/// What the sandbox costs: the start-up probe of [`Sandbox::prepare`], and the round trip of
/// one `true` through the bash tool, sandboxed and not.
pub fn bash_round_trip(scratch: &Path) -> anyhow::Result<Value> {
    const CALLS: usize = 50;
    let work = scratch.join("bash-work");
    let team = work.join(".team");
    fsutil::create_dir(&team)?;
    let t0 = Instant::now();
    let on = Sandbox::prepare(&Settings::default(), &work, &team, "bench", None);
    let prepare = t0.elapsed();
    let off = Sandbox::off();
    let wd = troupe::tools::fs::Workdir::new(&work)?;
    let input = json!({"command": "true"});
    let mut out = json!({"sandbox": on.status().describe(), "prepare_ms": round3(ms(prepare))});
    for (key, sb) in [("off", &off), ("sandboxed", &on)] {
        let mut samples = Vec::with_capacity(CALLS);
        for _ in 0..CALLS {
            let t = Instant::now();
            let r = troupe::tools::bash::bash(&wd, sb, &input, Duration::from_secs(30));
            samples.push(ms(t.elapsed()));
            anyhow::ensure!(!r.is_error, "bash `true` ({key}) failed: {}", r.content);
        }
        samples.sort_by(f64::total_cmp);
        let p = |q: f64| round3(samples[((samples.len() - 1) as f64 * q) as usize]);
        out[key] = json!({"calls": CALLS, "p50_ms": p(0.5), "p99_ms": p(0.99)});
    }
    eprintln!(
        "bash round trip: off p50 {} ms, sandboxed p50 {} ms; sandbox start-up probe {} ms ({})",
        out["off"]["p50_ms"], out["sandboxed"]["p50_ms"], out["prepare_ms"], out["sandbox"]
    );
    Ok(out)
}
