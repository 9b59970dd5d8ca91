//! The end of an activation reaches the lead exactly once, whatever happens in between (old
//! finding 8 and minor note m1 of review 3).
//!
//! Going idle is one journaled step with three effects: the `idle_notification` in the lead's
//! inbox (the activation's summary), the `teammate_idle` hook mark in the roster (when the team
//! has such hooks), and the status `idle`. A kill -9, a full lead inbox or an unreadable
//! config.json anywhere in that step must neither lose the notification or the mark nor make
//! the lead read the summary twice. The real `worker` (and, where its restarts matter, the real
//! supervisor) runs against the fake LLM server; the tests play the lead by draining its inbox
//! into a journal of their own, as `lead inbox` does.

mod support;

use std::process::Stdio;
use std::time::Duration;

use support::drain::open_journal;
use support::fake_llm::{FakeLlm, Reply, anthropic_text};
use support::team::{Stopping, Team, lead_cmd, wait_until};
use troupe::config::{MemberStatus, Roster};
use troupe::hooks::{Hook, HookEvent};
use troupe::inbox::Inbox;
use troupe::message::{Message, MessageType};
use troupe::transcript::{Entry, Journal};
use troupe::{AgentName, TeamDir};

const T: Duration = Duration::from_secs(60);

/// The lead's side: its inbox drained into its journal, as `lead inbox` does.
struct LeadReader {
    journal: Journal,
    inbox: Inbox,
    /// Every message the drains returned, in order (each id once, by the journal's dedup).
    got: Vec<Message>,
}

impl LeadReader {
    fn new(team: &TeamDir) -> LeadReader {
        let (journal, _) = open_journal(team, &AgentName::lead());
        LeadReader {
            journal,
            inbox: Inbox::new(team, &AgentName::lead()),
            got: Vec::new(),
        }
    }

    /// Drains what arrived; returns the summaries (idle notification texts) received so far.
    fn summaries(&mut self) -> Vec<String> {
        let batch = self.inbox.drain(&mut self.journal).unwrap();
        self.got.extend(batch);
        self.got
            .iter()
            .filter(|m| m.kind == MessageType::IdleNotification)
            .map(|m| m.content.clone())
            .collect()
    }
}

/// The number of `idle` entries in `name`'s journal.
fn idles(team: &Team, name: &str) -> usize {
    team.transcript(name)
        .iter()
        .filter(|e| matches!(e, Entry::Idle { .. }))
        .count()
}

fn set_idle_hook(team: &Team) {
    Roster::new(&team.dir)
        .update(|c| {
            c.hooks = vec![Hook {
                event: HookEvent::TeammateIdle,
                command: "true".into(),
                timeout_secs: Some(20),
                sandbox: true,
            }];
            Ok(())
        })
        .unwrap();
}

/// Makes config.json unreadable as a person's edit in progress does; returns what it held.
fn break_config(team: &Team) -> Vec<u8> {
    let path = team.dir.config();
    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, b"{\"team_name\": \"half-way through an edit").unwrap();
    good
}

fn restore_config(team: &Team, good: &[u8]) {
    let path = team.dir.config();
    let tmp = path.with_extension("restore");
    std::fs::write(&tmp, good).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
}

/// Old finding 8, as idle_notification_lost.sh shows it: the lead's inbox is at its cap when an
/// activation ends. The summary is delivered once the lead drains its inbox (the worker neither
/// loses it nor dies of it), and only once.
#[test]
fn a_full_lead_inbox_delays_the_idle_summary_but_never_loses_it() {
    let team = Team::new();
    let fake = FakeLlm::start([
        Reply::ok(anthropic_text("summary of activation 1")),
        Reply::ok(anthropic_text("summary of activation 2")),
    ]);
    let url = fake.url();
    let o = lead_cmd(
        &team,
        &url,
        &["spawn", "alice", "--role", "coder", "--prompt", "do it"],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _lead = Stopping(
        lead_cmd(
            &team,
            &url,
            &["run", "--stop-timeout", "1", "--kill-grace", "1"],
        )
        .stderr(Stdio::null())
        .spawn()
        .unwrap(),
    );
    let mut lead = LeadReader::new(&team.dir);
    wait_until(T, "the first summary", || {
        (lead.summaries() == ["summary of activation 1"]).then_some(())
    });
    // The lead's inbox reaches its cap (64 MiB nobody drained), written here in one go.
    {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(team.dir.inbox(&AgentName::lead()))
            .unwrap();
        let mut junk = vec![b'x'; 64 * 1024 * 1024 + 2];
        junk[0] = b'\n';
        *junk.last_mut().unwrap() = b'\n';
        f.write_all(&junk).unwrap();
    }
    team.send("alice", "second task");
    let log = team.dir.log(&AgentName::teammate("alice").unwrap());
    wait_until(T, "alice to find the lead's inbox full", || {
        (idles(&team, "alice") == 2
            && std::fs::read_to_string(&log).is_ok_and(|l| l.contains("is full")))
        .then_some(())
    });
    // The person drains the lead's inbox: the cap is lifted.
    wait_until(T, "the second summary", || {
        (lead.summaries().len() == 2).then_some(())
    });
    assert_eq!(
        lead.summaries(),
        ["summary of activation 1", "summary of activation 2"]
    );
    let restarts = team.member("alice").restarts;
    assert_eq!(restarts, 0, "a full lead inbox made alice exit");
}

/// Old finding 8: a kill -9 after the activation's end is journaled and before its summary is in
/// the lead's inbox. The restarted worker sends it (the lead's inbox lock, held by the test,
/// stops the first worker right there).
#[test]
fn a_kill_before_the_idle_summary_is_sent_sends_it_on_restart() {
    let team = Team::new();
    team.add_member("alice", 1, false);
    let fake = FakeLlm::start([]).patient(T);
    team.send("alice", "do it");
    let w = team.worker("alice", &fake.url(), &[]);
    wait_until(T, "the model call", || {
        (fake.request_count() == 1).then_some(())
    });
    let lock_path = team.dir.inbox_lock(&AgentName::lead());
    let lock_file = troupe::fsutil::open_lock(&lock_path).unwrap();
    let held = troupe::fsutil::lock_exclusive(&lock_file, &lock_path).unwrap();
    fake.push(Reply::ok(anthropic_text("summary of the activation")));
    wait_until(T, "the activation's end journaled", || {
        (idles(&team, "alice") == 1).then_some(())
    });
    drop(w); // SIGKILL to its process group, while it waits for the lead's inbox
    drop(held);
    let mut lead = LeadReader::new(&team.dir);
    assert!(lead.summaries().is_empty());
    let _w = team.worker("alice", &fake.url(), &[]);
    wait_until(T, "the summary after the restart", || {
        (!lead.summaries().is_empty()).then_some(())
    });
    wait_until(T, "alice idle", || {
        (team.status("alice") == MemberStatus::Idle).then_some(())
    });
    assert_eq!(lead.summaries(), ["summary of the activation"]);
    assert_eq!(fake.request_count(), 1, "the activation ran again");
}

/// Minor note m1 (a): config.json does not parse when the activation ends (a person's edit in
/// progress). The `teammate_idle` mark is made once it parses again, not skipped.
#[test]
fn an_unreadable_roster_at_idle_delays_the_idle_hook_mark_but_never_loses_it() {
    let team = Team::new();
    team.add_member("alice", 1, false);
    set_idle_hook(&team);
    let fake = FakeLlm::start([]).patient(T);
    team.send("alice", "do it");
    let _w = team.worker("alice", &fake.url(), &[]);
    wait_until(T, "the model call", || {
        (fake.request_count() == 1).then_some(())
    });
    let good = break_config(&team);
    fake.push(Reply::ok(anthropic_text("summary of the activation")));
    let mut lead = LeadReader::new(&team.dir);
    wait_until(T, "the summary", || {
        (!lead.summaries().is_empty()).then_some(())
    });
    restore_config(&team, &good);
    wait_until(T, "the idle hook mark", || {
        let m = team.member("alice");
        (m.status == MemberStatus::Idle && m.idle_hook_pending == Some(1)).then_some(())
    });
    assert_eq!(lead.summaries(), ["summary of the activation"]);
}

/// Minor note m1 (b), and a re-sent summary read once: a kill -9 after the summary reached the
/// lead (who has read it) and before the `teammate_idle` mark is in the roster. The restarted
/// worker makes the mark, and the summary it sends again is the same message: the lead does not
/// read it twice.
#[test]
fn a_kill_before_the_idle_hook_mark_marks_it_on_restart_and_the_lead_reads_the_summary_once() {
    let team = Team::new();
    team.add_member("alice", 1, false);
    set_idle_hook(&team);
    let fake = FakeLlm::start([]).patient(T);
    team.send("alice", "do it");
    let w = team.worker("alice", &fake.url(), &[]);
    wait_until(T, "the model call", || {
        (fake.request_count() == 1).then_some(())
    });
    // The mark waits for config.json to parse again.
    let good = break_config(&team);
    fake.push(Reply::ok(anthropic_text("summary of the activation")));
    let mut lead = LeadReader::new(&team.dir);
    wait_until(T, "the summary", || {
        (!lead.summaries().is_empty()).then_some(())
    });
    drop(w); // SIGKILL
    restore_config(&team, &good);
    assert_eq!(team.member("alice").idle_hook_pending, None);
    let _w = team.worker("alice", &fake.url(), &[]);
    wait_until(T, "the idle hook mark after the restart", || {
        let m = team.member("alice");
        (m.status == MemberStatus::Idle && m.idle_hook_pending == Some(1)).then_some(())
    });
    assert_eq!(lead.summaries(), ["summary of the activation"]);
    assert_eq!(fake.request_count(), 1, "the activation ran again");
}
