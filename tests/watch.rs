//! Issue 26, `lead watch`: with the real `lead` and `worker` against a fake model server, a
//! follower started before a scripted scenario (a spawn, a supervisor, a message, the team
//! stopped) prints each event of it once, in the log's order, each step's while the team still
//! runs (not at the end), and `--until-stop` ends it with the team. Filters and `--since` pick
//! from the same log.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Team, lead_cmd as lead, start_supervisor, wait_until};
use troupe::config::MemberStatus;

const T: Duration = Duration::from_secs(30);

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

/// The lines a background `lead watch` printed so far.
struct Follower {
    child: std::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Follower {
    fn start(team: &Team, args: &[&str]) -> Follower {
        let mut all = vec!["watch"];
        all.extend_from_slice(args);
        let mut child = lead(team, "http://127.0.0.1:9", &all)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let kept = lines.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(stdout).lines() {
                let Ok(l) = l else { break };
                kept.lock().unwrap().push(l);
            }
        });
        Follower { child, lines }
    }

    fn events(&self) -> Vec<Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect()
    }

    /// Waits until an event `kind` is printed; returns it.
    fn seen(&self, kind: &str) -> Value {
        wait_until(T, &format!("lead watch to print {kind}"), || {
            self.events().into_iter().find(|e| e["event"] == kind)
        })
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn lead_watch_json_prints_each_event_once_in_order_as_it_happens() {
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(Duration::from_secs(20));
    fake.push_for("m-mate", Reply::ok(anthropic_text("ready")));
    fake.push_for("m-mate", Reply::ok(anthropic_text("noted")));
    let url = fake.url();
    let mut sup = start_supervisor(
        &team,
        lead(
            &team,
            &url,
            &["run", "--stop-timeout", "2", "--kill-grace", "1"],
        ),
    );
    // What was logged before the follower starts is not printed: it follows from now on.
    ok(&out(&mut lead(
        &team,
        &url,
        &["task", "add", "before the follower"],
    )));
    std::thread::sleep(Duration::from_millis(500));
    let before = troupe::events::read_all(&team.dir).unwrap().len();
    assert!(before > 0);
    let watch = Follower::start(&team, &["--json", "--until-stop"]);
    let only_ann = Follower::start(&team, &["--json", "--member", "ann", "--event", "spawn"]);
    std::thread::sleep(Duration::from_millis(500));
    // The scenario, step by step: each step's event is printed before the next step.
    ok(&out(&mut lead(
        &team,
        &url,
        &[
            "spawn", "ann", "--role", "r", "--prompt", "p", "--model", "m-mate",
        ],
    )));
    watch.seen("spawn");
    wait_until(T, "ann idle", || {
        (team.status("ann") == MemberStatus::Idle).then_some(())
    });
    ok(&out(&mut lead(&team, &url, &["send", "ann", "hello"])));
    let sent = watch.seen("message");
    assert_eq!(sent["to"], "ann");
    // The team stops: --until-stop ends the follower by itself, after the last events.
    ok(&out(&mut lead(&team, &url, &["stop"])));
    let _ = sup.0.wait();
    let mut follower = watch;
    let status = wait_until(T, "lead watch --until-stop to end", || {
        follower.child.try_wait().unwrap()
    });
    assert!(status.success(), "{status}");
    std::thread::sleep(Duration::from_millis(200));
    let printed = follower.events();
    let logged: Vec<Value> = troupe::events::read_all(&team.dir).unwrap()[before..].to_vec();
    assert_eq!(
        printed.len(),
        logged.len(),
        "printed {printed:#?}\nlogged {logged:#?}"
    );
    assert_eq!(printed, logged, "each event once, in order");
    let kinds: Vec<&str> = printed.iter().filter_map(|e| e["event"].as_str()).collect();
    for k in ["spawn", "message"] {
        assert!(kinds.contains(&k), "{kinds:?}");
    }
    // The filtered follower saw ann's spawn and nothing else.
    let filtered = only_ann.events();
    assert_eq!(filtered.len(), 1, "{filtered:#?}");
    assert_eq!(
        (&filtered[0]["event"], &filtered[0]["name"]),
        (&Value::from("spawn"), &Value::from("ann"))
    );
    // --since reaches back; the text form is one line per event.
    let o = out(&mut lead(
        &team,
        &url,
        &["watch", "--since", "1h", "--until-stop"],
    ));
    let text = ok(&o);
    assert_eq!(text.lines().count(), before + logged.len(), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains(" spawn ") && l.contains("ann")),
        "{text}"
    );
    let o = out(&mut lead(&team, &url, &["watch", "--since", "soon"]));
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("--since"),
        "{o:?}"
    );
}
