//! Every child of `lead run` and of a worker is reaped as it exits (issue 42): the keeper of
//! the sandbox probe each of them runs at start, and of every `bash` call, stayed a `<defunct>`
//! child until the next command, if any. Real `lead` and `worker`, the sandbox as the machine
//! gives it, a fake model server.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Team, lead_cmd as lead, start_supervisor, wait_until};
use troupe::config::MemberStatus;

const T: Duration = Duration::from_secs(40);

/// The zombie children of `parent`.
fn zombies_of(parent: u32) -> Vec<u32> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        if f.first() == Some(&"Z") && f.get(1).and_then(|p| p.parse().ok()) == Some(parent) {
            found.push(pid);
        }
    }
    found
}

/// Watches the zombie children of `parents` for `span`; the longest any was seen, by pid.
fn longest_zombies(parents: &[u32], span: Duration) -> HashMap<u32, Duration> {
    let mut first: HashMap<u32, Instant> = HashMap::new();
    let mut longest = HashMap::new();
    let t0 = Instant::now();
    while t0.elapsed() < span {
        for &p in parents {
            for z in zombies_of(p) {
                let at = *first.entry(z).or_insert_with(Instant::now);
                longest.insert(z, at.elapsed());
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    longest
}

#[test]
fn no_child_of_lead_run_or_of_a_worker_stays_defunct() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
    // A command whose bash ends at once, then one that leaves a short background process.
    for command in ["true", "(sleep 0.3 &) ; echo started"] {
        fake.push_for(
            "m-mate",
            Reply::ok(anthropic_message(
                &anthropic_tool_use_block(
                    "toolu_b",
                    "bash",
                    &serde_json::json!({ "command": command }).to_string(),
                ),
                "tool_use",
                r#"{"input_tokens":1,"output_tokens":1}"#,
            )),
        );
    }
    fake.push_for("m-mate", Reply::ok(anthropic_text("done")));
    let url = fake.url();
    let sup = start_supervisor(
        &team,
        lead(
            &team,
            &url,
            &["run", "--stop-timeout", "2", "--kill-grace", "1"],
        ),
    );
    let o = lead(
        &team,
        &url,
        &[
            "spawn", "alice", "--role", "r", "--prompt", "p", "--model", "m-mate",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{o:?}");
    let worker = wait_until(T, "alice idle after her commands", || {
        let m = team.member("alice");
        (m.status == MemberStatus::Idle && fake.requests_for("m-mate") >= 3)
            .then_some(m.pid)
            .flatten()
    });
    let parents = [sup.0.id(), worker];
    let seen = longest_zombies(&parents, Duration::from_secs(3));
    let lingering: Vec<_> = seen
        .iter()
        .filter(|(_, d)| **d >= Duration::from_secs(1))
        .collect();
    assert!(
        lingering.is_empty(),
        "defunct children of lead run ({}) or of alice's worker ({worker}) that lived 1 s and \
         more: {lingering:?}",
        parents[0]
    );
}

#[test]
fn a_worker_with_no_supervisor_brings_config_jsons_view_up_to_date() {
    // A team dir laid down from DESIGN.md, section 6, and a worker started by hand: no lead run.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(".team");
    std::fs::create_dir_all(dir.join("inbox")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"team_name":"default","members":[{"name":"alice","role":"coder","status":"spawning","incarnation":1,"restarts":0,"model":"m-mate","require_plan_approval":false}]}"#,
    )
    .unwrap();
    let team = Team {
        dir: troupe::TeamDir::open(&dir).unwrap(),
        workdir: tmp.path().to_path_buf(),
        tmp,
    };
    let fake = FakeLlm::start([]).patient(Duration::from_secs(30));
    fake.push_for("m-mate", Reply::ok(anthropic_text("ready")));
    let _w = team.worker("alice", &fake.url(), &[("MODEL_ID", "m-mate")]);
    let view = || -> Option<String> {
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(team.dir.config()).ok()?).ok()?;
        v["members"][0]["status"].as_str().map(str::to_owned)
    };
    // The record says idle once alice has started and answered her first turn; the view says
    // the same by then, without any supervisor.
    let record = wait_until(T, "alice's record to say idle", || {
        let r: serde_json::Value = serde_json::from_slice(
            &std::fs::read(team.dir.root().join("members/alice.json")).ok()?,
        )
        .ok()?;
        (r["status"] == "idle").then_some(r)
    });
    let t0 = Instant::now();
    while view().as_deref() != Some("idle") && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        view().as_deref(),
        Some("idle"),
        "config.json still says {:?} 5 s after alice's record said idle ({record})",
        view()
    );
}
