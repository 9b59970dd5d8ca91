//! A temporary team dir and a running `worker` process for integration tests.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use troupe::config::{Member, MemberStatus, Roster};
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::transcript::{self, Entry};
use troupe::{AgentName, TeamDir};

/// Variables of the caller's environment that would change what these tests run.
pub const CLEARED_ENV: [&str; 13] = [
    "ANTHROPIC_API_KEY",
    "ANTHROPIC_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
    "MODEL_ID",
    "TROUPE_PROVIDER",
    "TROUPE_CASSETTE",
    "TROUPE_RECORD",
    "TROUPE_TEAM_DIR",
    "TROUPE_REPLAY_PROGRESS",
    "TROUPE_WORKER",
    "TROUPE_BUILD_ID",
    "NOTIFY_SOCKET",
];

/// Polls `f` until it returns `Some`, or panics after `timeout` with `what`.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A fresh team dir with a working directory beside it.
pub struct Team {
    pub tmp: tempfile::TempDir,
    pub dir: TeamDir,
    pub workdir: PathBuf,
}

impl Team {
    pub fn new() -> Team {
        let tmp = tempfile::tempdir().unwrap();
        let dir = TeamDir::create(tmp.path().join(".team")).unwrap();
        let workdir = tmp.path().join("work");
        std::fs::create_dir_all(&workdir).unwrap();
        Team { tmp, dir, workdir }
    }

    /// Adds a member record as the lead would before spawning it.
    pub fn add_member(&self, name: &str, incarnation: u64, require_plan: bool) {
        add_member_to(&self.dir, name, incarnation, require_plan);
    }

    pub fn send(&self, to: &str, text: &str) -> Message {
        let m = Message::new(MessageType::Message, "lead", to, text);
        self.deliver(&m);
        m
    }

    pub fn deliver(&self, m: &Message) {
        Inbox::new(&self.dir, &AgentName::any(&m.to).unwrap())
            .append(m, Durability::ProcessCrash)
            .unwrap();
    }

    pub fn status(&self, name: &str) -> MemberStatus {
        Roster::new(&self.dir)
            .load()
            .unwrap()
            .require(name)
            .unwrap()
            .status
    }

    pub fn member(&self, name: &str) -> Member {
        Roster::new(&self.dir)
            .load()
            .unwrap()
            .require(name)
            .unwrap()
            .clone()
    }

    pub fn transcript(&self, name: &str) -> Vec<Entry> {
        transcript::read_entries(&self.dir.transcript(&AgentName::any(name).unwrap())).unwrap()
    }

    pub fn lead_inbox(&self) -> Vec<Message> {
        Inbox::new(&self.dir, &AgentName::lead()).peek().unwrap()
    }

    /// Ids of inbox messages in a transcript, in order.
    pub fn consumed_ids(&self, name: &str) -> Vec<String> {
        self.transcript(name)
            .into_iter()
            .filter_map(|e| match e {
                Entry::Inbox { message, .. } => Some(message.id),
                _ => None,
            })
            .collect()
    }

    /// Starts `worker` for `name` against an Anthropic-speaking fake at `url`.
    pub fn worker(&self, name: &str, url: &str, extra_env: &[(&str, &str)]) -> Worker {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_worker"));
        cmd.args(["--name", name])
            .arg("--team-dir")
            .arg(self.dir.root())
            .arg("--workdir")
            .arg(&self.workdir)
            .env_remove("OPENAI_API_KEY")
            .env_remove("TROUPE_RECORD")
            .env("TROUPE_PROVIDER", "anthropic")
            .env("ANTHROPIC_API_KEY", "sk-test-key-never-logged")
            .env("ANTHROPIC_BASE_URL", url)
            .env("TROUPE_LLM_TIMEOUT_SECS", "5")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(self.tmp.path().join(format!("{name}.stderr")))
                    .unwrap(),
            ));
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        Worker {
            child: Some(cmd.spawn().unwrap()),
        }
    }

    pub fn stderr(&self, name: &str) -> String {
        std::fs::read_to_string(self.tmp.path().join(format!("{name}.stderr"))).unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        self.tmp.path()
    }
}

/// A worker process; its whole process group is killed on drop.
pub struct Worker {
    pub child: Option<Child>,
}

impl Worker {
    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    pub fn signal(&self, sig: nix::sys::signal::Signal) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.pid()), sig);
    }

    /// Waits for exit (panics after `timeout`).
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let child = self.child.as_mut().unwrap();
        wait_until(timeout, "worker exit", || child.try_wait().unwrap())
    }

    pub fn try_status(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().unwrap().try_wait().unwrap()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(c.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = c.wait();
        }
    }
}

/// The JSON of every request body the fake server received.
pub fn bodies(reqs: &[super::fake_llm::Recorded]) -> Vec<Value> {
    reqs.iter().map(|r| r.body.clone()).collect()
}

/// A `lead` command on `team`, in its working dir, with an Anthropic provider at `url`.
pub fn lead_cmd(team: &Team, url: &str, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lead"));
    c.arg("--team-dir")
        .arg(team.dir.root())
        .args(args)
        .current_dir(&team.workdir)
        .env("TROUPE_PROVIDER", "anthropic")
        .env("ANTHROPIC_API_KEY", "sk-test")
        .env("ANTHROPIC_BASE_URL", url)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::store::redis::BUS_ENV)
        .stdin(Stdio::null());
    c
}

/// A supervisor (`lead run`) stopped as a person would, with SIGTERM, and reaped on drop.
pub struct Stopping(pub Child);

impl Drop for Stopping {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.0.wait();
    }
}

/// A background process (a supervisor) killed and reaped on drop.
pub struct Bg(pub Child);

/// Starts `cmd` (a `lead run` of `team`) in the background with its output dropped, and waits
/// until it holds the team's `lead.lock`.
pub fn start_supervisor(team: &Team, mut cmd: Command) -> Bg {
    let bg = Bg(cmd
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap());
    wait_until(
        Duration::from_secs(30),
        "the supervisor to hold lead.lock",
        || {
            troupe::fsutil::HeldLock::is_held(&team.dir.lead_lock())
                .unwrap()
                .then_some(())
        },
    );
    bg
}

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Whether `pid` is a live process (a zombie waiting for its reaper counts as gone).
pub fn alive(pid: u64) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// The argument lists of every process of the machine, by pid.
fn cmdlines() -> Vec<(u64, Vec<String>)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let pid: u64 = e.file_name().to_str()?.parse().ok()?;
            let raw = std::fs::read(e.path().join("cmdline")).ok()?;
            let args = raw
                .split(|b| *b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            Some((pid, args))
        })
        .collect()
}

/// A marker no other test's processes carry: commands run in their own PID namespace, so the
/// pids they see are not the machine's, and tests find their processes by marker instead.
pub fn marker() -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    format!("{}{n:03}", std::process::id())
}

/// The live processes (as the machine numbers them) with `arg` among their arguments.
pub fn pids_with_arg(arg: &str) -> Vec<u64> {
    cmdlines()
        .into_iter()
        .filter(|(p, args)| args.iter().any(|a| a == arg) && alive(*p))
        .map(|(p, _)| p)
        .collect()
}

/// The live `bash -c` processes whose command contains `fragment`.
pub fn bash_pids_running(fragment: &str) -> Vec<u64> {
    cmdlines()
        .into_iter()
        .filter(|(p, args)| {
            args.first().is_some_and(|a| a == "bash")
                && args.get(2).is_some_and(|c| c.contains(fragment))
                && alive(*p)
        })
        .map(|(p, _)| p)
        .collect()
}

/// Adds a `coder` member to the roster of `dir` (on its bus, when it has one), told to do what
/// the lead asks.
pub fn add_member_to(dir: &TeamDir, name: &str, incarnation: u64, require_plan: bool) {
    Roster::new(dir)
        .update(|c| {
            let mut m = Member::new(name, "coder");
            m.incarnation = incarnation;
            m.require_plan_approval = require_plan;
            m.prompt = Some("Do what the lead asks.".into());
            c.members.push(m);
            Ok(())
        })
        .unwrap();
}

/// Member `name` of a `lead status --json` document.
pub fn member<'a>(status: &'a Value, name: &str) -> &'a Value {
    status["members"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {status}"))
}

/// Stops `pid` (a supervisor of `team`) with SIGSTOP at a moment it holds none of the team
/// dir's short locks (the roster's, a member's, a request's, the events', an inbox's): stopped
/// inside such a write, it would block the very worker a test then waits for. The locks it
/// holds for its whole run (`lead.lock`, the journals' owner locks under `transcripts/`) do not
/// count. Tried again 5 ms later, after a SIGCONT, while it holds one.
#[allow(dead_code)]
pub fn stop_between_writes(pid: u32, team: &TeamDir) {
    use nix::sys::signal::{Signal, kill};
    use std::os::unix::fs::MetadataExt;
    let short_locks = || -> std::collections::HashSet<u64> {
        let mut out = std::collections::HashSet::new();
        let mut dirs = vec![team.root().to_path_buf()];
        while let Some(d) = dirs.pop() {
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            for e in rd.flatten() {
                let p = e.path();
                let Ok(meta) = std::fs::symlink_metadata(&p) else {
                    continue;
                };
                if meta.is_dir() {
                    if p.file_name()
                        .is_some_and(|n| n != "transcripts" && n != "worktrees")
                    {
                        dirs.push(p);
                    }
                } else if p.extension().is_some_and(|x| x == "lock") && p != team.lead_lock() {
                    out.insert(meta.ino());
                }
            }
        }
        out
    };
    let holds_one = |locks: &std::collections::HashSet<u64>| {
        std::fs::read_to_string("/proc/locks")
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.contains("->"))
            .any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(4) == Some(&pid.to_string().as_str())
                    && f.get(5)
                        .and_then(|dev_ino| dev_ino.rsplit(':').next())
                        .and_then(|ino| ino.parse::<u64>().ok())
                        .is_some_and(|ino| locks.contains(&ino))
            })
    };
    let target = nix::unistd::Pid::from_raw(pid as i32);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        kill(target, Signal::SIGSTOP).unwrap();
        // A stop is asynchronous: wait until it took effect before looking at the locks.
        wait_until(Duration::from_secs(10), "the supervisor to stop", || {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .map(|(_, r)| r.trim_start().starts_with('T'))
                })
                .unwrap_or(true)
                .then_some(())
        });
        if !holds_one(&short_locks()) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the supervisor held a short lock at every stop for 30 s"
        );
        kill(target, Signal::SIGCONT).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `lead ARGS` on `team` with no model and no bus (the replay provider, the caller's team dir
/// and bus variables unset, stdin closed): for commands that only read the team.
pub fn offline_lead(team: &Team, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_lead"))
        .arg("--team-dir")
        .arg(team.dir.root())
        .args(args)
        .current_dir(&team.workdir)
        .env_remove("TROUPE_TEAM_DIR")
        .env_remove(troupe::store::redis::BUS_ENV)
        .env("TROUPE_PROVIDER", "replay")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}
