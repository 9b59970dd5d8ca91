//! Regression tests for the journal findings of the review (review-findings.md, 6 and 8), driven
//! through the real binaries: `lead inbox` beside a running `lead chat`, and the idle
//! notification across a crash and a full lead inbox.

mod support;

use std::process::{Command, Output};

use support::team::{Team, lead_cmd as lead};
use troupe::AgentName;
use troupe::fsutil::HeldLock;
use troupe::message::{Message, MessageType};

fn out(c: &mut Command) -> Output {
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

// Finding 6.

/// Finding 6: while `lead chat` owns the lead's journal (holds `transcripts/lead.lock`), a
/// draining `lead inbox` is refused with exit 4 and a pointer to `/inbox` and `--peek`, and
/// touches neither the journal nor the inbox; `--peek` still works.
#[test]
fn lead_inbox_refuses_to_drain_while_chat_owns_the_journal() {
    let team = Team::new();
    let url = "http://127.0.0.1:9";
    let lead_name = AgentName::lead();
    let m = Message::new(MessageType::Message, "alice", "lead", "hello");
    team.deliver(&m);
    std::fs::create_dir_all(team.dir.transcripts_dir()).unwrap();
    let journal = team.dir.transcript(&lead_name);
    std::fs::write(
        &journal,
        b"{\"kind\":\"idle\",\"at\":1.0}\n{\"kind\":\"user\",\"te",
    )
    .unwrap();
    let chat = HeldLock::try_acquire(&team.dir.transcript_lock(&lead_name))
        .unwrap()
        .expect("the lock is free");

    let o = out(&mut lead(&team, url, &["inbox"]));
    assert_eq!(o.status.code(), Some(4), "{}", stderr(&o));
    let err = stderr(&o);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("/inbox") && err.contains("--peek"), "{err}");
    // Nothing consumed, nothing repaired: the torn tail belongs to the owner.
    assert_eq!(team.lead_inbox(), vec![m.clone()]);
    assert_eq!(
        std::fs::read(&journal).unwrap(),
        b"{\"kind\":\"idle\",\"at\":1.0}\n{\"kind\":\"user\",\"te"
    );

    let o = out(&mut lead(&team, url, &["inbox", "--peek", "--json"]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(&m.id));

    // Once chat is gone, the drain works (and repairs the tail it now owns).
    drop(chat);
    let o = out(&mut lead(&team, url, &["inbox", "--json"]));
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains(&m.id));
    assert!(team.lead_inbox().is_empty());
    assert_eq!(team.consumed_ids("lead"), vec![m.id]);
}
