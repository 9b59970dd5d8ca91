//! `lead chat` driven as a person would drive it: the real REPL on a pseudo-terminal, with the
//! lead's model answering from the fake server. A message that arrives while the prompt waits
//! must show up without a keypress, and the slash commands must print what the files hold.

mod support;

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::pty::{grantpt, posix_openpt, ptsname_r, unlockpt};
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Team, lead_cmd};
use troupe::AgentName;
use troupe::config::{Member, MemberStatus, Roster};
use troupe::fsutil::HeldLock;
use troupe::inbox::{Durability, Inbox};
use troupe::message::{Message, MessageType};
use troupe::requests::{NewRequest, RequestKind, RequestStore};
use troupe::transcript::{self, Entry};

const T: Duration = Duration::from_secs(30);

/// A child running on the slave side of a pseudo-terminal, as the leader of its own session
/// with that terminal as its controlling one. Everything it writes to the terminal collects in
/// `out`; its process group is killed and reaped on drop.
struct PtyChild {
    child: Option<Child>,
    master: File,
    out: Arc<Mutex<Vec<u8>>>,
    /// Where the next [`PtyChild::expect`] starts searching.
    mark: usize,
}

impl PtyChild {
    fn spawn(mut cmd: Command) -> PtyChild {
        // Every descriptor close-on-exec from the start, so children other tests spawn
        // meanwhile do not inherit this terminal.
        let master = posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC).unwrap();
        grantpt(&master).unwrap();
        unlockpt(&master).unwrap();
        let slave_path = ptsname_r(&master).unwrap();
        let slave = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOCTTY)
            .open(&slave_path)
            .unwrap();
        let master = File::from(OwnedFd::from(master));
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid and ioctl are async-signal-safe and allocate nothing; they run in the
        // child between fork and exec, after the slave was installed as descriptors 0, 1 and 2.
        unsafe {
            cmd.pre_exec(|| {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                if libc::ioctl(0, libc::TIOCSCTTY, 0) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        // Dropping the command closes this process's copies of the slave, so the master reads
        // EIO (and the reader ends) once the child and everything it passed the terminal to
        // have exited.
        drop(cmd);
        let out = Arc::new(Mutex::new(Vec::new()));
        let mut reader = master.try_clone().unwrap();
        let sink = Arc::clone(&out);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match reader.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => sink
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend_from_slice(&buf[..n]),
                }
            }
        });
        PtyChild {
            child: Some(child),
            master,
            out,
            mark: 0,
        }
    }

    /// Everything the terminal showed so far, for failure messages.
    fn screen(&self) -> String {
        String::from_utf8_lossy(&self.out.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    }

    /// Types `text` on the terminal.
    fn send(&mut self, text: &str) {
        self.master.write_all(text.as_bytes()).unwrap();
    }

    /// Waits until `text` appears (in the raw bytes, after the previous match) and moves the
    /// mark past it; panics with the terminal's contents after `timeout`.
    fn expect(&mut self, text: &str, timeout: Duration) {
        let needle = text.as_bytes();
        let deadline = Instant::now() + timeout;
        loop {
            {
                let out = self.out.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(pos) = out[self.mark..]
                    .windows(needle.len())
                    .position(|w| w == needle)
                {
                    self.mark += pos + needle.len();
                    return;
                }
            }
            if Instant::now() >= deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {text:?} on the terminal; it shows:\n{}",
                    self.screen()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for a whole line (after the mark) satisfying `ok`, moves the mark past it and
    /// returns it.
    fn expect_line(&mut self, what: &str, timeout: Duration, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            {
                let out = self.out.lock().unwrap_or_else(|p| p.into_inner());
                let mut start = self.mark;
                while let Some(len) = out[start..].iter().position(|&b| b == b'\n') {
                    let line = String::from_utf8_lossy(&out[start..start + len]).into_owned();
                    start += len + 1;
                    if ok(&line) {
                        self.mark = start;
                        return line;
                    }
                }
            }
            if Instant::now() >= deadline {
                panic!(
                    "timed out after {timeout:?} waiting for {what} on the terminal; it shows:\n{}",
                    self.screen()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits for the child to exit (panics, showing the terminal, after `timeout`).
    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        let child = self.child.as_mut().unwrap();
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return st;
            }
            if Instant::now() >= deadline {
                panic!(
                    "the child did not exit within {timeout:?}; the terminal shows:\n{}",
                    self.screen()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for PtyChild {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // The child leads its own session and process group. A supervisor it started gets
            // SIGTERM from the kernel when it dies (PR_SET_PDEATHSIG).
            let _ = killpg(Pid::from_raw(c.id() as i32), Signal::SIGKILL);
            let _ = c.wait();
        }
    }
}

/// A team with "ann" (shut down, so the supervisor starts no worker for her) and a plan of
/// hers waiting for the lead; returns the plan request's id.
fn team_with_a_pending_plan(team: &Team) -> String {
    Roster::new(&team.dir)
        .update(|c| {
            let mut m = Member::new("ann", "coder");
            m.status = MemberStatus::Shutdown;
            m.incarnation = 1;
            c.members.push(m);
            Ok(())
        })
        .unwrap();
    RequestStore::new(&team.dir)
        .create(NewRequest {
            kind: RequestKind::PlanApproval,
            from: "ann".into(),
            to: "lead".into(),
            payload: json!({"plan": "write the file"}),
            target_incarnation: Some(1),
            ttl: None,
        })
        .unwrap()
        .request_id
}

fn chat(team: &Team, fake: &FakeLlm) -> PtyChild {
    PtyChild::spawn(lead_cmd(team, &fake.url(), &["chat", "--model", "m-lead"]))
}

/// The text blocks (or the string content) of one Messages API message.
fn texts(message: &Value) -> Vec<String> {
    match &message["content"] {
        Value::String(s) => vec![s.clone()],
        Value::Array(blocks) => blocks
            .iter()
            .filter_map(|b| b["text"].as_str().map(str::to_owned))
            .collect(),
        _ => Vec::new(),
    }
}

#[test]
fn arrivals_show_at_the_prompt_and_slash_commands_print_the_files() {
    let team = Team::new();
    let request_id = team_with_a_pending_plan(&team);
    let fake = FakeLlm::start([]).patient(Duration::from_secs(15));
    fake.push_for("m-lead", Reply::ok(anthropic_text("hello from the lead")));
    let mut term = chat(&team, &fake);

    // 1. The prompt, once chat has started its supervisor.
    term.expect("you> ", T);
    assert!(
        HeldLock::is_held(&team.dir.lead_lock()).unwrap(),
        "chat should have started a supervisor; the terminal shows:\n{}",
        term.screen()
    );

    // 2. A message arriving while the prompt waits is shown with no key pressed, above a fresh
    // prompt, and is consumed into the lead's journal.
    let lead = AgentName::lead();
    let ping = Message::new(MessageType::Message, "ann", "lead", "ping-from-ann-123");
    Inbox::new(&team.dir, &lead)
        .append(&ping, Durability::Sync)
        .unwrap();
    term.expect("ping-from-ann-123", T);
    term.expect("you> ", T);
    let journal = transcript::read_entries(&team.dir.transcript(&lead)).unwrap();
    assert!(
        journal
            .iter()
            .any(|e| matches!(e, Entry::Inbox { message, .. } if message.id == ping.id)),
        "the shown message is not in the lead's journal: {journal:?}"
    );
    let unread = Inbox::new(&team.dir, &lead).peek().unwrap();
    assert!(
        unread.is_empty(),
        "the lead's inbox should be empty once the message was shown: {unread:?}"
    );

    // 3. /team: the roster as config.json holds it.
    term.send("/team\n");
    let row = term.expect_line("ann's row of /team", T, |l| {
        l.split_whitespace().next() == Some("ann")
    });
    assert!(
        row.contains("coder") && row.contains("shutdown") && row.contains(&request_id),
        "ann's row of /team: {row:?}; the terminal shows:\n{}",
        term.screen()
    );
    term.expect("you> ", T);

    // 4. /requests: the pending plan.
    term.send("/requests\n");
    let row = term.expect_line("the plan in /requests", T, |l| l.starts_with(&request_id));
    assert!(
        row.contains("plan_approval")
            && row.contains("pending")
            && row.contains("ann")
            && row.contains("write the file"),
        "the plan's row of /requests: {row:?}; the terminal shows:\n{}",
        term.screen()
    );
    term.expect("you> ", T);

    // 5. /inbox: the message received, not yet shown to the model.
    term.send("/inbox\n");
    term.expect("ping-from-ann-123", T);
    term.expect("you> ", T);
    assert_eq!(fake.requests_for("m-lead"), 0, "no model call yet");

    // 6. The person speaks: one model call, whose last user turn carries the message and the
    // person's words; the answer is shown and the inbox is then empty.
    term.send("hi\n");
    term.expect("lead: hello from the lead", T);
    term.expect("you> ", T);
    let calls: Vec<Value> = fake
        .requests()
        .into_iter()
        .filter(|r| r.body["model"] == "m-lead")
        .map(|r| r.body)
        .collect();
    assert_eq!(calls.len(), 1, "model calls: {calls:#?}");
    let last = calls[0]["messages"]
        .as_array()
        .and_then(|m| m.last())
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(last["role"], "user", "last message: {last:#}");
    let said = texts(&last);
    assert!(
        said.iter().any(|t| t.contains("ping-from-ann-123"))
            && said.iter().any(|t| t.trim() == "hi"),
        "the last user turn should hold the message and the person's words: {last:#}"
    );
    term.send("/inbox\n");
    term.expect("(no unread messages)", T);
    term.expect("you> ", T);

    // 7. /quit stops the supervisor chat started, then exits 0.
    term.send("/quit\n");
    let st = term.wait(Duration::from_secs(60));
    assert_eq!(
        st.code(),
        Some(0),
        "chat exited with {st}; the terminal shows:\n{}",
        term.screen()
    );
    assert!(
        !HeldLock::is_held(&team.dir.lead_lock()).unwrap(),
        "the supervisor chat started still holds lead.lock; the terminal shows:\n{}",
        term.screen()
    );
    assert_eq!(fake.requests_for("m-lead"), 1);
}

#[test]
fn end_of_file_at_the_prompt_leaves_and_stops_the_team() {
    let team = Team::new();
    let fake = FakeLlm::start([]);
    let mut term = chat(&team, &fake);
    term.expect("you> ", T);
    assert!(HeldLock::is_held(&team.dir.lead_lock()).unwrap());
    // Ctrl-D at the start of a line: in canonical mode the read returns end of file.
    term.send("\x04");
    let st = term.wait(Duration::from_secs(60));
    assert_eq!(
        st.code(),
        Some(0),
        "chat exited with {st}; the terminal shows:\n{}",
        term.screen()
    );
    assert!(!HeldLock::is_held(&team.dir.lead_lock()).unwrap());
    assert_eq!(fake.request_count(), 0);
}
