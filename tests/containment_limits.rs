//! Issue 22, "No terminal." and "Limits." (finding N6, note m6, acceptance 2): every `bash`
//! command runs in a session of its own, without a controlling terminal, under per-command
//! resource limits and with `oom_score_adj` 1000. Real workers under `lead run`, driven by the
//! fake LLM server, in the default layout:
//!
//! - with `lead run` started from a real terminal (`script`), `/dev/tty` fails with ENXIO in a
//!   command, and a TIOCSTI through it types nothing into that terminal: sandboxed and with
//!   `--sandbox off`;
//! - `ulimit` and `/proc/self/oom_score_adj` in a command show the limits: the defaults, and
//!   those given to `lead run` (which hands them to its workers);
//! - a fork bomb stops at the process limit, its call returns at its timeout, and meanwhile
//!   `lead status` and another worker answer: as root (commands run as `nobody`) and in a team
//!   run unprivileged.
//!
//! The kernel exempts uid 0 from RLIMIT_NPROC, and a command that runs as root of its own user
//! namespace is uid 0 to it: the fork bomb checks who commands run as first and never starts
//! as uid 0. These tests never skip under `CI=true`.

#[path = "support/hostile.rs"]
mod hostile;
mod support;

use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hostile::{Site, T, stop, within};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::{Value, json};
use support::fake_llm::{
    FakeLlm, Reply, anthropic_message, anthropic_text, anthropic_tool_use_block,
};
use support::team::{Bg, alive, wait_until};

const USAGE: &str = r#"{"input_tokens":3,"output_tokens":2}"#;

/// The defaults of `--sandbox-nproc`, `--sandbox-mem` (in KiB, as `ulimit -v` shows it),
/// `--sandbox-cpu` and `--sandbox-nofile`.
const DEFAULTS: [u64; 4] = [1024, 8 * 1024 * 1024, 600, 4096];

/// The workers' HTTP timeout: longer than the fake server's patience, so that a model call
/// waiting for this test's next reply is never given up and retried (its reply would be lost).
const LLM_TIMEOUT: &str = "120";

/// `lead run` with short stop timeouts and `extra` flags, as `uid` when given, its output in
/// logs beside the working dir; its commands time out after `bash_timeout`.
fn run(site: &Site, url: &str, extra: &[&str], uid: Option<u32>, bash_timeout: u64) -> Bg {
    let bash_timeout = bash_timeout.to_string();
    hostile::run_lead(
        site,
        url,
        extra,
        uid,
        &[
            ("TROUPE_BASH_TIMEOUT_SECS", &bash_timeout),
            ("TROUPE_LLM_TIMEOUT_SECS", LLM_TIMEOUT),
        ],
    )
}

/// Makes the agent of `model` run `command` with `bash` (its reply to the pending model call),
/// and returns the id of that call.
fn push_bash(fake: &FakeLlm, model: &str, command: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let id = format!("tu_{}", NEXT.fetch_add(1, Ordering::SeqCst));
    let input = json!({ "command": command }).to_string();
    fake.push_for(
        model,
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block(&id, "bash", &input),
            "tool_use",
            USAGE,
        )),
    );
    id
}

/// The text of the tool result `id`, once a model call of `model` carries it.
fn tool_result(fake: &FakeLlm, model: &str, id: &str) -> Option<String> {
    fake.requests().iter().rev().find_map(|r| {
        if r.body["model"] != model {
            return None;
        }
        let messages = r.body["messages"].as_array()?;
        let block = messages
            .iter()
            .filter_map(|m| m["content"].as_array())
            .flatten()
            .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == id)?;
        Some(block["content"].as_str().unwrap_or_default().to_owned())
    })
}

/// Runs `command` as the agent of `model` and returns its result (panics after `within`).
fn bash_call(fake: &FakeLlm, model: &str, command: &str, within: Duration) -> String {
    let id = push_bash(fake, model, command);
    wait_until(within, &format!("{model}'s result of `{command}`"), || {
        tool_result(fake, model, &id)
    })
}

/// Ends the agent's turn with a text, and waits for it to go idle.
fn finish(site: &Site, fake: &FakeLlm, name: &str, model: &str) {
    fake.push_for(model, Reply::ok(anthropic_text("Done.")));
    site.wait_status(name, "idle");
}

/// The numbers of a command's output, one a line, after `prefix=`.
fn value(out: &str, prefix: &str) -> Option<String> {
    out.lines()
        .find_map(|l| l.strip_prefix(&format!("{prefix}=")))
        .map(|v| v.trim().to_owned())
}

/// Whether the process limit is set in commands of this sandbox: everywhere but where commands
/// run as the worker's own non-root user without a user namespace of their own (the kernel
/// would count every process of that user there, the team's own included), which the status
/// then says in a note.
fn nproc_applies(status: &Value) -> bool {
    let notes = status["notes"].to_string();
    if notes.contains("no process limit") {
        return false;
    }
    nix::unistd::geteuid().is_root()
        || status["namespaces"]
            .as_str()
            .is_some_and(|n| n.contains("user"))
}

// ---------------------------------------------------------------------------------------------
// No terminal
// ---------------------------------------------------------------------------------------------

/// The command of the hostile model: says what `/dev/tty` gives, which tty the command has,
/// and tries to type `echo INJECTED-<nonce>` into the terminal through TIOCSTI (0x5412 in the
/// generic ioctl numbers of x86 and arm).
fn tty_probe(nonce: &str) -> String {
    format!(
        "(exec 3</dev/tty) 2>&1 | sed 's/^.*: //; s/^/tty-open=/'; \
         echo tty_nr=$(awk '{{print $7}}' /proc/self/stat); \
         perl -e 'open(my $t, \"+<\", \"/dev/tty\") or die \"tiocsti=open: $!\\n\"; \
         ioctl($t, 0x5412, $_) or die \"tiocsti=ioctl: $!\\n\" for split //, \"echo INJECTED-{nonce}\\n\"; \
         print \"tiocsti=injected\\n\"' 2>&1"
    )
}

/// N6: `lead run` started from a terminal (a `script` pseudo-terminal, its controlling
/// terminal), in `mode`; a worker's command opens `/dev/tty` and pushes a line into it with
/// TIOCSTI; after `lead run` ends, the terminal's shell reads its next line. The command must
/// have no terminal (ENXIO, `tty_nr` 0), and the shell must read nothing.
fn no_terminal(mode: &str) {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    let tmp = site.tmp.path();
    let inner = tmp.join("terminal.sh");
    std::fs::write(
        &inner,
        format!(
            "\"$TROUPE_TEST_LEAD\" run --stop-timeout 1 --kill-grace 1 --sandbox {mode} \
             >{out} 2>{err} &\n\
             echo $! > {pid}\n\
             wait\n\
             IFS= read -r -t 5 line\n\
             echo \"shell read: [$line]\"\n",
            out = tmp.join("lead.stdout").display(),
            err = tmp.join("lead.stderr").display(),
            pid = tmp.join("lead.pid").display(),
        ),
    )
    .unwrap();
    let typescript = tmp.join("typescript");
    let mut lead = site.lead(&url, &[]);
    lead.env("TROUPE_LLM_TIMEOUT_SECS", LLM_TIMEOUT);
    let mut script = Command::new("script");
    script
        .arg("-qec")
        .arg(format!("bash {}", inner.display()))
        .arg(&typescript)
        .current_dir(&site.work)
        .env("TROUPE_TEST_LEAD", env!("CARGO_BIN_EXE_lead"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(site.log("script.stderr"));
    for (k, v) in lead.get_envs() {
        match v {
            Some(v) => script.env(k, v),
            None => script.env_remove(k),
        };
    }
    let mut script = Bg(script.spawn().unwrap());
    // Held open until the shell has read: `script` may end when its input does.
    let keyboard = script.0.stdin.take();
    site.wait_status("amy", "working");
    let lead_pid: i32 = wait_until(T, "lead.pid", || {
        std::fs::read_to_string(tmp.join("lead.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    });
    let out = bash_call(&fake, "m-amy", &tty_probe(&site.nonce), T);
    eprintln!("the command said:\n{out}");
    finish(&site, &fake, "amy", "m-amy");
    let _ = kill(Pid::from_raw(lead_pid), Signal::SIGTERM);
    let screen = || {
        std::fs::read_to_string(&typescript)
            .unwrap_or_default()
            .replace('\r', "")
    };
    within(T, || screen().contains("shell read: ["));
    drop(keyboard);
    let ended = within(T, || script.0.try_wait().ok().flatten().is_some());
    let screen = screen();
    let mut problems = Vec::new();
    if value(&out, "tty-open").as_deref() != Some("No such device or address") {
        problems.push(format!("opening /dev/tty did not fail with ENXIO: {out}"));
    }
    if value(&out, "tty_nr").as_deref() != Some("0") {
        problems.push(format!("the command has a controlling terminal: {out}"));
    }
    if value(&out, "tiocsti").as_deref() == Some("injected") {
        problems.push(format!("TIOCSTI went through: {out}"));
    }
    if !ended {
        problems.push(format!(
            "script did not end within {T:?} of lead run's SIGTERM"
        ));
    }
    if screen.contains(&format!("INJECTED-{}", site.nonce)) {
        problems.push(format!("the terminal got the command's input:\n{screen}"));
    }
    if !screen.contains("shell read: [") {
        problems.push(format!("the terminal's shell never read:\n{screen}"));
    }
    assert!(
        problems.is_empty(),
        "--sandbox {mode}:\n  {}\nlead stderr:\n{}",
        problems.join("\n  "),
        site.read_log("lead.stderr")
    );
}

#[test]
fn a_command_has_no_terminal_to_type_into() {
    no_terminal("best-effort");
}

/// With `--sandbox off` too: a command never types into the person's terminal.
#[test]
fn a_command_has_no_terminal_with_the_sandbox_off() {
    no_terminal("off");
}

// ---------------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------------

/// What a command sees of its limits, one `name=value` a line.
const SHOW_LIMITS: &str = "echo nproc=$(ulimit -u); echo mem=$(ulimit -v); \
     echo cpu=$(ulimit -t); echo nofile=$(ulimit -n); echo hard_nofile=$(ulimit -Hn); \
     echo oom=$(cat /proc/self/oom_score_adj); \
     echo raise=$( (ulimit -n 100000 && echo raised) 2>&1 | sed 's/^.*: //')";

/// `lead run` with `flags`; a command shows its limits, which must be `want` (nproc, mem in
/// KiB, cpu, nofile) with oom_score_adj 1000.
fn limits_seen(flags: &[&str], want: [u64; 4]) {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    let mut lead = run(&site, &url, flags, None, 120);
    site.wait_status("amy", "working");
    let status = site.sandbox_status("amy");
    eprintln!("amy's sandbox: {status}");
    let out = bash_call(&fake, "m-amy", SHOW_LIMITS, T);
    eprintln!("the command said:\n{out}");
    finish(&site, &fake, "amy", "m-amy");
    let mut problems = Vec::new();
    let nproc = if nproc_applies(&status) {
        Some(want[0])
    } else {
        None
    };
    for (name, want) in [
        ("nproc", nproc),
        ("mem", Some(want[1])),
        ("cpu", Some(want[2])),
        ("nofile", Some(want[3])),
        ("hard_nofile", Some(want[3])),
        ("oom", Some(1000)),
    ] {
        let Some(want) = want else { continue };
        if value(&out, name) != Some(want.to_string()) {
            problems.push(format!("{name}: want {want}, the command sees {out:?}"));
        }
    }
    let sandboxed = status["mode"] != "off";
    if sandboxed && value(&out, "raise").as_deref() == Some("raised") {
        problems.push(format!("a sandboxed command raised its limit: {out}"));
    }
    problems.extend(stop(&mut lead.0, "lead run"));
    assert!(
        problems.is_empty(),
        "{}\nlead stderr:\n{}",
        problems.join("\n"),
        site.read_log("lead.stderr")
    );
}

/// The defaults: a `cargo build` of a mid-size crate fits in them.
#[test]
fn a_command_runs_under_the_default_limits() {
    limits_seen(&[], DEFAULTS);
}

/// The limits given to `lead run` reach its workers, with the sandbox off too.
#[test]
fn the_limits_of_lead_run_reach_its_workers() {
    limits_seen(
        &[
            "--sandbox-nproc",
            "300",
            "--sandbox-mem",
            "3G",
            "--sandbox-cpu",
            "77",
            "--sandbox-nofile",
            "333",
        ],
        [300, 3 * 1024 * 1024, 77, 333],
    );
    limits_seen(
        &[
            "--sandbox",
            "off",
            "--sandbox-mem",
            "2G",
            "--sandbox-nofile",
            "512",
        ],
        [1024, 2 * 1024 * 1024, 600, 512],
    );
}

/// A root team's command cannot lower its oom_score_adj below 1000 again (the keeper, which
/// has CAP_SYS_RESOURCE, set it as the floor too). A team run unprivileged cannot set a floor:
/// its commands may lower the score back down to the worker's own.
#[test]
fn a_root_teams_command_cannot_lower_its_oom_score() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: only root can set a floor under oom_score_adj");
        return;
    }
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    let mut lead = run(&site, &url, &[], None, 120);
    site.wait_status("amy", "working");
    let out = bash_call(
        &fake,
        "m-amy",
        "(echo 0 > /proc/self/oom_score_adj) 2>/dev/null; echo oom=$(cat /proc/self/oom_score_adj)",
        T,
    );
    finish(&site, &fake, "amy", "m-amy");
    let stopped = stop(&mut lead.0, "lead run");
    assert_eq!(value(&out, "oom").as_deref(), Some("1000"), "{out}");
    assert_eq!(stopped, None);
}

// ---------------------------------------------------------------------------------------------
// Fork bomb
// ---------------------------------------------------------------------------------------------

/// The process limit of the fork bomb tests (small, so that the machine's 2 cores are not
/// swamped), and their command timeout.
const BOMB_NPROC: usize = 200;
const BOMB_TIMEOUT: u64 = 10;

/// Counts the live processes whose command line holds `marker`, keeping the most seen, until
/// told to stop.
struct Counter {
    most: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Counter {
    fn start(marker: String) -> Counter {
        let most = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (most, stop) = (most.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    most.fetch_max(with_marker(&marker).len(), Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        };
        Counter {
            most,
            stop,
            thread: Some(thread),
        }
    }

    fn most(&self) -> usize {
        self.most.load(Ordering::SeqCst)
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Live processes whose command line holds `marker`.
fn with_marker(marker: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|b| String::from_utf8_lossy(&b).contains(marker))
                && alive(u64::from(pid))
        })
        .collect()
}

/// Who runs the fork bomb.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// The team runs as root (the test's user), its working dir open to others, so that
    /// commands run as `nobody`.
    RootTeamNobodyCommands,
    /// The whole team runs as an unprivileged user: uid 65534 when the test is root, else the
    /// test's own user.
    UnprivilegedTeam,
}

/// Acceptance 2: amy's command is a fork bomb that waits (so the call lasts until its
/// timeout); while it runs, `lead status` answers and bob runs a command. The bomb must stop
/// at the process limit, the call must return at its timeout, the bomb must be gone after it,
/// and the lead and both workers must live on.
fn fork_bomb(layout: Layout) {
    let site = Site::new();
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    site.spawn(&url, "amy", "m-amy");
    site.spawn(&url, "bob", "m-bob");
    let root = nix::unistd::geteuid().is_root();
    let uid = match layout {
        Layout::RootTeamNobodyCommands => {
            std::fs::set_permissions(site.tmp.path(), std::fs::Permissions::from_mode(0o711))
                .unwrap();
            std::fs::set_permissions(&site.work, std::fs::Permissions::from_mode(0o777)).unwrap();
            None
        }
        Layout::UnprivilegedTeam if root => {
            site.chown_all(65534);
            Some(65534)
        }
        Layout::UnprivilegedTeam => None,
    };
    let nproc = BOMB_NPROC.to_string();
    let mut lead = run(&site, &url, &["--sandbox-nproc", &nproc], uid, BOMB_TIMEOUT);
    let lead_pid = lead.0.id();
    let amy = site.wait_status("amy", "working");
    let bob = site.wait_status("bob", "working");
    let status = site.sandbox_status("amy");
    eprintln!("{layout:?}: amy's sandbox: {status}");
    // Never a bomb as uid 0: nothing but the pid space would stop it.
    let who = bash_call(&fake, "m-amy", "echo uid=$(id -u)", T);
    let cmd_uid = value(&who, "uid").unwrap_or_default();
    assert!(
        !cmd_uid.is_empty() && cmd_uid != "0",
        "{layout:?}: commands run as uid {cmd_uid:?} ({who}); sandbox {status}"
    );
    if let Layout::RootTeamNobodyCommands = layout {
        assert!(
            status["user"]
                .as_str()
                .is_some_and(|u| u.contains("nobody")),
            "{layout:?}: commands do not run as nobody: {status}"
        );
    }
    let marker = format!("bomb{}", site.nonce);
    // A fallback bound should troupe set no limit: `ulimit -u` can lower a limit but never
    // raise one troupe set, so this line changes nothing when the limit is in force. The
    // shell then waits with a builtin (a fork could fail once the bomb is at the limit, and
    // the shell would end before its timeout).
    let bomb = format!(
        "ulimit -u 2000 2>/dev/null; : {marker}; sleep 300 & s=$!; \
         bomb() {{ bomb | bomb & }}; bomb; wait $s"
    );
    let counter = Counter::start(marker.clone());
    let t0 = Instant::now();
    let id = push_bash(&fake, "m-amy", &bomb);
    // amy's next turns are queued now, so that no model call of hers waits on this test (a
    // call that waits longer than the worker's HTTP timeout is retried, and its reply lost).
    let after = push_bash(&fake, "m-amy", "echo amy-answers");
    fake.push_for("m-amy", Reply::ok(anthropic_text("Done.")));
    let mut problems = Vec::new();
    // Meanwhile: the bomb has started, `lead status` answers, bob runs a command.
    if !within(T, || counter.most() >= BOMB_NPROC / 2) {
        problems.push(format!(
            "the bomb never reached {} processes (most seen {})",
            BOMB_NPROC / 2,
            counter.most()
        ));
    }
    let status_t0 = Instant::now();
    let text = site.status_text();
    if !text.contains("amy") || !text.contains("bob") {
        problems.push(format!("lead status during the bomb:\n{text}"));
    }
    eprintln!(
        "lead status took {:?} during the bomb ({} processes seen so far)",
        status_t0.elapsed(),
        counter.most()
    );
    let alive_bob = bash_call(&fake, "m-bob", "echo bob-answers", T);
    fake.push_for("m-bob", Reply::ok(anthropic_text("Done.")));
    if !alive_bob.contains("bob-answers") {
        problems.push(format!("bob's command during the bomb: {alive_bob}"));
    }
    let out = wait_until(
        Duration::from_secs(BOMB_TIMEOUT) + T,
        "the result of the fork bomb",
        || tool_result(&fake, "m-amy", &id),
    );
    let took = t0.elapsed();
    eprintln!(
        "the bomb's call returned after {took:?}; most processes seen {}; its output ends: {}",
        counter.most(),
        &out[out.len().saturating_sub(300)..]
    );
    if !out.contains(&format!("command timed out after {BOMB_TIMEOUT} s")) {
        problems.push(format!(
            "the bomb's call did not end at its timeout: {}",
            &out[..out.len().min(300)]
        ));
    }
    if !out.contains("Resource temporarily unavailable") {
        problems.push("the bomb's forks never failed".into());
    }
    if !within(T, || with_marker(&marker).is_empty()) {
        problems.push(format!(
            "the bomb outlived its call: {} processes left",
            with_marker(&marker).len()
        ));
    }
    let most = counter.most();
    drop(counter);
    if most > BOMB_NPROC {
        problems.push(format!(
            "the bomb ran {most} processes at once, over the limit of {BOMB_NPROC}"
        ));
    }
    for (who, pid) in [("the lead", lead_pid), ("amy", amy), ("bob", bob)] {
        if !alive(u64::from(pid)) {
            problems.push(format!("{who} (pid {pid}) died"));
        }
    }
    let after = wait_until(T, "amy's command after the bomb", || {
        tool_result(&fake, "m-amy", &after)
    });
    if !after.contains("amy-answers") {
        problems.push(format!("amy's next command: {after}"));
    }
    site.wait_status("amy", "idle");
    site.wait_status("bob", "idle");
    problems.extend(stop(&mut lead.0, "lead run"));
    assert!(
        problems.is_empty(),
        "{layout:?}:\n  {}\nlead stderr:\n{}",
        problems.join("\n  "),
        site.read_log("lead.stderr")
    );
}

/// As root, with commands that run as `nobody` (the working dir is open to it).
#[test]
fn a_fork_bomb_ends_at_the_limit_as_nobody_under_a_root_team() {
    if !nix::unistd::geteuid().is_root() {
        eprintln!(
            "skipped: not root, so commands cannot run as nobody; \
             a_fork_bomb_ends_at_the_limit_in_an_unprivileged_team covers this user"
        );
        return;
    }
    fork_bomb(Layout::RootTeamNobodyCommands);
}

/// A team run unprivileged (uid 65534 when the test is root).
#[test]
fn a_fork_bomb_ends_at_the_limit_in_an_unprivileged_team() {
    fork_bomb(Layout::UnprivilegedTeam);
}
