//! Review 4, m2 (issue 42, acceptance 5): troupe's wall clock stepped ten minutes forward and
//! then back during a run (an NTP step at boot, a clock put right, a VM resumed) kills no
//! worker, and changes no wait by more than a second. The step is troupe's alone: `lead run`
//! and its workers run under libfaketime (`LD_PRELOAD`, the offset read from a file the test
//! rewrites, the monotonic and boot clocks left alone), never the host's clock.

mod support;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, Team, lead_cmd as lead, start_supervisor, wait_until};
use troupe::config::MemberStatus;

const T: Duration = Duration::from_secs(60);

/// libfaketime's preload library, or `None` (outside CI) when it is not installed.
fn faketime() -> Option<PathBuf> {
    let lib = PathBuf::from("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1");
    if lib.exists() {
        return Some(lib);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "libfaketime is not installed (CI=true: this test fails rather than skips); \
         apt-get install libfaketime"
    );
    eprintln!("skipped: libfaketime is not installed");
    None
}

/// troupe's clock, `offset` seconds from the host's.
fn step(file: &Path, offset: i64) {
    std::fs::write(file, format!("{offset:+}\n")).unwrap();
}

fn supervise(team: &Team, url: &str, lib: &Path, offset_file: &Path) -> Bg {
    step(offset_file, 0);
    let mut cmd = lead(
        team,
        url,
        &[
            "run",
            "--watchdog",
            "5",
            "--restart-delay",
            "0.2",
            "--stop-timeout",
            "2",
            "--kill-grace",
            "1",
            "--sandbox",
            "off",
        ],
    );
    cmd.env("LD_PRELOAD", lib)
        .env("FAKETIME_TIMESTAMP_FILE", offset_file)
        .env("FAKETIME_NO_CACHE", "1")
        .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
    start_supervisor(team, cmd)
}

fn spawn(team: &Team, url: &str, name: &str) {
    let o = lead(
        team,
        url,
        &[
            "spawn",
            name,
            "--role",
            "r",
            "--prompt",
            "p",
            "--model",
            &format!("m-{name}"),
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{o:?}");
}

fn events(team: &Team, event: &str) -> Vec<Value> {
    troupe::events::read_all(&team.dir)
        .unwrap()
        .into_iter()
        .filter(|e| e["event"] == event)
        .collect()
}

fn bash(command: &str) -> Reply {
    Reply::ok(anthropic_message(
        &anthropic_tool_use_block(
            "toolu_c",
            "bash",
            &serde_json::json!({ "command": command }).to_string(),
        ),
        "tool_use",
        r#"{"input_tokens":1,"output_tokens":1}"#,
    ))
}

/// An idle member and one in a 20 s command, `--watchdog 5`: the clock goes ten minutes
/// forward, then back. Nobody is taken for hung; both stay at incarnation 1.
#[test]
fn a_wall_clock_step_either_way_kills_no_worker() {
    let Some(lib) = faketime() else { return };
    let team = Team::new();
    let offset = team.tmp.path().join("faketime");
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    fake.push_for("m-idle", Reply::ok(anthropic_text("idle now")));
    fake.push_for("m-busy", bash("sleep 20"));
    fake.push_for("m-busy", Reply::ok(anthropic_text("slept")));
    let _sup = supervise(&team, &url, &lib, &offset);
    spawn(&team, &url, "idle");
    spawn(&team, &url, "busy");
    wait_until(T, "idle idle, busy in its command", || {
        (team.member("idle").status == MemberStatus::Idle && fake.requests_for("m-busy") == 1)
            .then_some(())
    });
    std::thread::sleep(Duration::from_secs(2));
    let began = Instant::now();
    step(&offset, 600);
    std::thread::sleep(Duration::from_secs(4));
    step(&offset, 0);
    std::thread::sleep(Duration::from_secs(4));
    assert!(
        events(&team, "hung").is_empty(),
        "killed as hung after a step of the wall clock: {:?}",
        events(&team, "hung")
    );
    wait_until(T, "busy's command done", || {
        (fake.requests_for("m-busy") == 2).then_some(())
    });
    eprintln!(
        "steps began {:.1} s before busy's command ended",
        began.elapsed().as_secs_f64()
    );
    for name in ["idle", "busy"] {
        let m = team.member(name);
        assert_eq!(m.incarnation, 1, "{name} was restarted");
    }
    assert!(
        events(&team, "hung").is_empty(),
        "{:?}",
        events(&team, "hung")
    );
}
