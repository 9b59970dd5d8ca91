//! Issue 26, `lead top`: the real `lead top` in a tmux pane against a live team of three (the
//! real `lead` and `worker` on a fake model server): each member's row shows its state; a
//! member sent work shows `working` soon after; `m` sends a message the member consumes; `q`
//! exits 0 and the terminal is restored (the shell's screen back, the tty cooked again). And
//! `lead top --once --json` prints one frame for scripts. Ctrl-C, SIGTERM and SIGHUP restore
//! the terminal as `q` does; Ctrl-Z gives it back while top is stopped and `fg` resumes the
//! view; a terminal that goes away ends it. Without tmux the tests say so and skip (under
//! CI=true they fail).

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Bg, Team, lead_cmd as lead, wait_until};
use troupe::config::MemberStatus;
use troupe::message::MessageType;
use troupe::transcript::Entry;

const T: Duration = Duration::from_secs(30);

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

/// A tmux server of its own (its socket in the test's dir), killed on drop.
struct Tmux {
    socket: std::path::PathBuf,
}

impl Tmux {
    fn cmd(&self, args: &[&str]) -> Output {
        Command::new("tmux")
            .arg("-S")
            .arg(&self.socket)
            .args(args)
            .output()
            .unwrap()
    }

    fn screen(&self) -> String {
        let o = self.cmd(&["capture-pane", "-p", "-t", "top"]);
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "top"];
        args.extend_from_slice(keys);
        assert!(self.cmd(&args).status.success());
    }

    /// The screen's line for member `name` (its table row).
    fn row(&self, name: &str) -> Option<String> {
        self.screen()
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .map(str::to_owned)
    }
}

impl Tmux {
    /// A tmux session (its own server) whose shell prints a mark, runs `lead top` on `team`,
    /// prints top's exit status and then `stty -a` into the returned file.
    fn start_top(team: &Team, session: &str) -> (Tmux, std::path::PathBuf) {
        Tmux::start_top_in(team, session, "{top}")
    }

    /// As [`Tmux::start_top`], with `{top}` of `run` (bash) standing for the command.
    fn start_top_in(team: &Team, session: &str, run: &str) -> (Tmux, std::path::PathBuf) {
        let tmux = Tmux {
            socket: team.path().join(format!("{session}.sock")),
        };
        let marks = team.path().join(format!("{session}.stty"));
        let top = format!(
            "{lead} --team-dir {dir} top",
            lead = env!("CARGO_BIN_EXE_lead"),
            dir = shell_quote(team.dir.root()),
        );
        let script = format!(
            "echo BEFORE-TOP; {run}; echo \"top exited $?\"; stty -a > {marks}; sleep 60",
            run = run.replace("{top}", &top),
            marks = shell_quote(&marks),
        );
        let o = tmux.cmd(&[
            "new-session",
            "-d",
            "-s",
            "top",
            "-x",
            "220",
            "-y",
            "40",
            "bash",
            "-c",
            &script,
        ]);
        assert!(o.status.success(), "{o:?}");
        (tmux, marks)
    }

    /// The pid of `lead top` in the pane: the child of the pane's shell.
    fn top_pid(&self) -> i32 {
        let o = self.cmd(&["list-panes", "-t", "top", "-F", "#{pane_pid}"]);
        let shell = String::from_utf8_lossy(&o.stdout).trim().to_owned();
        wait_until(T, "lead top's process", || {
            let o = Command::new("pgrep").args(["-P", &shell]).output().ok()?;
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .and_then(|l| l.trim().parse().ok())
        })
    }

    /// Waits until top has drawn its view.
    fn wait_drawn(&self) {
        wait_until(T, "top's view", || {
            self.screen().contains("troupe top").then_some(())
        });
    }

    /// Waits for top to exit and checks that it exited `code` and gave the terminal back: the
    /// shell's screen (not the alternate one) and a cooked tty.
    fn assert_exited_restored(&self, marks: &Path, code: i32, how: &str) {
        let screen = wait_until(T, &format!("top to exit on {how}"), || {
            let s = self.screen();
            s.contains("top exited").then_some(s)
        });
        assert!(
            screen.contains(&format!("top exited {code}")),
            "{how}: {screen}"
        );
        assert!(
            screen.contains("BEFORE-TOP") && !screen.contains("troupe top"),
            "{how}: the shell's screen is back: {screen}"
        );
        let stty = wait_until(T, "stty's report", || {
            std::fs::read_to_string(marks)
                .ok()
                .filter(|s| !s.is_empty())
        });
        assert!(
            stty.contains(" icanon") && stty.contains(" echo "),
            "{how}: the tty is cooked again: {stty}"
        );
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd(&["kill-server"]);
    }
}

fn have_tmux() -> bool {
    let found = Command::new("tmux")
        .arg("-V")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !found {
        assert!(
            std::env::var("CI").is_err(),
            "tmux is missing (.ci/run installs it)"
        );
        eprintln!("SKIPPED: tmux is not installed");
    }
    found
}

fn consumed(team: &Team, name: &str, content: &str) -> bool {
    team.transcript(name).iter().any(|e| {
        matches!(e, Entry::Inbox { message, .. }
            if message.kind == MessageType::Message && message.content == content)
    })
}

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

#[test]
fn lead_top_shows_the_team_live_sends_with_m_and_quits_clean_with_q() {
    if !have_tmux() {
        return;
    }
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(T);
    for n in ["ann", "bob", "cat"] {
        fake.push_for(&format!("m-{n}"), Reply::ok(anthropic_text("ready")));
    }
    let url = fake.url();
    for n in ["ann", "bob", "cat"] {
        let model = format!("m-{n}");
        let o = out(&mut lead(
            &team,
            &url,
            &[
                "spawn", n, "--role", "helper", "--prompt", "p", "--model", &model,
            ],
        ));
        assert!(o.status.success(), "{o:?}");
    }
    let _sup = Bg(lead(
        &team,
        &url,
        &["run", "--stop-timeout", "2", "--kill-grace", "1"],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap());
    wait_until(T, "three idle members", || {
        ["ann", "bob", "cat"]
            .iter()
            .all(|n| team.status(n) == MemberStatus::Idle)
            .then_some(())
    });

    let (tmux, marks) = Tmux::start_top(&team, "top");
    // Each member's row shows its state.
    for n in ["ann", "bob", "cat"] {
        let r = wait_until(T, &format!("{n}'s row"), || tmux.row(n));
        assert!(r.contains("helper"), "{r}");
    }
    wait_until(T, "every row idle", || {
        ["ann", "bob", "cat"]
            .iter()
            .all(|n| tmux.row(n).is_some_and(|r| r.contains(" idle ")))
            .then_some(())
    });
    assert!(tmux.screen().contains("troupe top"), "{}", tmux.screen());

    // Work for bob: his row says working while the model thinks.
    fake.push_for(
        "m-bob",
        Reply::ok(anthropic_text("done")).delay(Duration::from_secs(4)),
    );
    let sent = Instant::now();
    let o = out(&mut lead(&team, &url, &["send", "bob", "some work"]));
    assert!(o.status.success(), "{o:?}");
    let row = wait_until(Duration::from_secs(5), "bob's row working", || {
        tmux.row("bob").filter(|r| r.contains("working"))
    });
    eprintln!(
        "bob shown working {:.2} s after the send: {row}",
        sent.elapsed().as_secs_f64()
    );

    // `m` on cat's row sends her a message she consumes.
    fake.push_for("m-cat", Reply::ok(anthropic_text("thanks")));
    tmux.keys(&["Down", "Down"]);
    tmux.keys(&["m"]);
    wait_until(T, "the message prompt", || {
        tmux.screen().contains("message to cat:").then_some(())
    });
    tmux.keys(&["-l", "hello from top"]);
    tmux.keys(&["Enter"]);
    wait_until(T, "cat consumed the message", || {
        consumed(&team, "cat", "hello from top").then_some(())
    });
    wait_until(T, "the note of the send", || {
        tmux.screen().contains("sent to cat").then_some(())
    });

    // `q` exits 0 and gives the terminal back.
    tmux.keys(&["q"]);
    tmux.assert_exited_restored(&marks, 0, "q");

    // One frame as JSON, for scripts.
    let o = out(&mut lead(&team, &url, &["top", "--once", "--json"]));
    assert!(o.status.success(), "{o:?}");
    let frame: Value = serde_json::from_slice(&o.stdout).unwrap();
    let rows = frame["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3, "{frame}");
    for r in rows {
        assert_eq!(r["liveness"], "alive", "{r}");
        assert!(r["state"].is_string(), "{r}");
    }
    assert!(frame["header"]["tasks"].is_object(), "{frame}");
}

/// The state letter of a process (`/proc/PID/stat`): `T` when stopped.
fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ")?.1.chars().next()
}

#[test]
fn lead_top_gives_the_terminal_back_on_ctrl_c_sigterm_sighup_and_ctrl_z() {
    if !have_tmux() {
        return;
    }
    let team = Team::new();
    let fake = FakeLlm::start([]).patient(T);
    fake.push_for("m-ann", Reply::ok(anthropic_text("ready")));
    let url = fake.url();
    let o = out(&mut lead(
        &team,
        &url,
        &[
            "spawn", "ann", "--role", "helper", "--prompt", "p", "--model", "m-ann",
        ],
    ));
    assert!(o.status.success(), "{o:?}");
    let _sup = Bg(lead(&team, &url, &["run", "--stop-timeout", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_until(T, "ann idle", || {
        (team.status("ann") == MemberStatus::Idle).then_some(())
    });

    // Ctrl-C is a key in raw mode: top quits as on `q`.
    let (tmux, marks) = Tmux::start_top(&team, "ctrl-c");
    tmux.wait_drawn();
    tmux.keys(&["C-c"]);
    tmux.assert_exited_restored(&marks, 0, "Ctrl-C");
    drop(tmux);

    // SIGTERM and SIGHUP (a closed ssh session) from outside.
    for (sig, name) in [(libc::SIGTERM, "SIGTERM"), (libc::SIGHUP, "SIGHUP")] {
        let (tmux, marks) = Tmux::start_top(&team, name);
        tmux.wait_drawn();
        let pid = tmux.top_pid();
        // SAFETY: kill has no memory-safety preconditions.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
        tmux.assert_exited_restored(&marks, 0, name);
    }

    // Ctrl-Z gives the terminal back and stops top; `fg` gives it the screen again. A shell
    // with job control, as a user's is (without it, a stop signal to the shell's own process
    // group is discarded: there would be nobody to continue it).
    let (tmux, marks) = Tmux::start_top_in(
        &team,
        "ctrl-z",
        "set -m; {top}; echo \"stopped $?\"; read -r _; fg",
    );
    tmux.wait_drawn();
    let pid = tmux.top_pid();
    tmux.keys(&["C-z"]);
    wait_until(T, "top stopped", || {
        (proc_state(pid) == Some('T')).then_some(())
    });
    let screen = wait_until(T, "the shell's report", || {
        let s = tmux.screen();
        s.contains("stopped 148").then_some(s)
    });
    assert!(
        screen.contains("BEFORE-TOP") && !screen.contains("troupe top"),
        "the shell's screen while top is stopped: {screen}"
    );
    tmux.keys(&["Enter"]);
    tmux.wait_drawn();
    assert!(tmux.row("ann").is_some(), "{}", tmux.screen());
    tmux.keys(&["q"]);
    tmux.assert_exited_restored(&marks, 0, "q after Ctrl-Z");
    drop(tmux);

    // The terminal goes away under it (the tmux server killed, as an ssh session dropped):
    // top ends, instead of reading the hung-up terminal forever.
    let (tmux, _) = Tmux::start_top(&team, "hangup");
    tmux.wait_drawn();
    let pid = tmux.top_pid();
    drop(tmux);
    let deadline = Instant::now() + Duration::from_secs(10);
    let gone = || matches!(proc_state(pid), None | Some('Z'));
    while !gone() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    if !gone() {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        panic!("lead top outlived its terminal by 10 s (killed now)");
    }
}
