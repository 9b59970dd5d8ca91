//! The prompt cache: one real worker runs a 30-step tool loop (`bash` printing 1.8 KB a step)
//! against the caching stub of [`crate::cache_stub`], which bills prompt caching by the
//! documented rules; reports the share of prompt tokens read from cache and whether the
//! member's ledger equals what the stub billed.

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};
use troupe::eprintln;

use anyhow::{Context, bail};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};
use troupe::config::{Member, MemberStatus, Roster};
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::{TeamDir, fsutil};

use crate::cache_stub::CacheStub;
use crate::lead;
use crate::measure::round3;

/// Steps of the tool loop run against the caching stub.
const CACHE_LOOP_STEPS: usize = 30;

/// The share of prompt tokens read from cache over a 30-step tool loop of one real worker (the
/// built-in worker of `lead`, started as `worker`) against the caching stub, and whether the
/// member's ledger equals what the stub billed.
pub fn run(lead: &Path, scratch: &Path) -> anyhow::Result<Value> {
    const NAME: &str = "looper";
    let stub = CacheStub::start(CACHE_LOOP_STEPS).context("failed to start the caching stub")?;
    let team = TeamDir::create(scratch.join("cache-team"))?;
    let work = scratch.join("cache-work");
    fsutil::create_dir(&work)?;
    Roster::new(&team).update(|c| {
        let mut m = Member::new(NAME, "bench");
        m.prompt = Some("Run the commands you are given, one step at a time.".to_owned());
        c.members.push(m);
        Ok(())
    })?;
    let name = troupe::AgentName::teammate(NAME)?;
    let msg = Message::new(MessageType::Message, "lead", NAME, "Start.");
    Inbox::new(&team, &name).append(&msg, Durability::ProcessCrash)?;
    // The lead runs as the worker when started as `worker`.
    let mut cmd = Command::new(lead);
    cmd.arg0("worker")
        .args(["--name", NAME])
        .arg("--team-dir")
        .arg(team.root())
        .arg("--workdir")
        .arg(&work)
        .env("TROUPE_PROVIDER", "anthropic")
        .env("ANTHROPIC_API_KEY", "sk-bench-caching-stub")
        .env("ANTHROPIC_BASE_URL", stub.url())
        .env("TROUPE_LLM_TIMEOUT_SECS", "30")
        .env_remove("MODEL_ID")
        .env_remove("TROUPE_RECORD")
        .env_remove("TROUPE_BUILD_ID")
        .env_remove("TROUPE_MAX_CALLS")
        .env_remove("TROUPE_CONTEXT_CHARS")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0);
    lead::die_with_parent(&mut cmd);
    let t0 = Instant::now();
    let mut child = cmd.spawn().context("failed to start the worker")?;
    let done = (|| -> anyhow::Result<troupe::config::Member> {
        let deadline = t0 + Duration::from_secs(300);
        loop {
            if let Some(st) = child.try_wait()? {
                bail!("the worker exited with {st} during the loop");
            }
            let cfg = Roster::new(&team).load()?;
            let m = cfg.require(NAME)?;
            if m.status == MemberStatus::Idle && m.calls > CACHE_LOOP_STEPS as u64 {
                return Ok(m.clone());
            }
            if Instant::now() >= deadline {
                bail!("the {CACHE_LOOP_STEPS}-step loop did not finish within 300 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    })();
    let elapsed = t0.elapsed();
    let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
    let _ = child.wait();
    let member = done?;
    let calls = stub.calls();
    let refused = calls.iter().filter(|c| c.status != 200).count();
    let t = stub.total();
    let u = member.usage;
    let ledger_matches = (
        u.input_tokens,
        u.output_tokens,
        u.cache_creation_input_tokens,
        u.cache_read_input_tokens,
    ) == (
        t.input_tokens,
        t.output_tokens,
        t.cache_creation_input_tokens,
        t.cache_read_input_tokens,
    );
    let share = t.cache_read_share();
    eprintln!(
        "prompt cache: {CACHE_LOOP_STEPS}-step loop, {} calls: {:.1} % of {} prompt tokens read \
         from cache (input {}, write {}, read {}); ledger {} the stub's bill",
        calls.len(),
        share * 100.0,
        t.prompt_tokens(),
        t.input_tokens,
        t.cache_creation_input_tokens,
        t.cache_read_input_tokens,
        if ledger_matches {
            "equals"
        } else {
            "DIFFERS from"
        }
    );
    Ok(json!({
        "measured": "one worker, a 30-step bash loop (1.8 KB output a step) against the caching \
                     stub (documented rules; tokens estimated as bytes/4)",
        "steps": CACHE_LOOP_STEPS,
        "calls": calls.len(),
        "refused_calls": refused,
        "input_tokens": t.input_tokens,
        "cache_creation_input_tokens": t.cache_creation_input_tokens,
        "cache_read_input_tokens": t.cache_read_input_tokens,
        "output_tokens": t.output_tokens,
        "cache_read_share": round3(share),
        "ledger_matches_billing": ledger_matches,
        "seconds": round3(elapsed.as_secs_f64()),
    }))
}
