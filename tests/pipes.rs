//! Issue 23, acceptance 1 (m7 of review 3): a reader that goes away ends `lead` quietly. Each
//! listing command (a team of 40, 300 tasks and a 1 MiB log: the last two larger than a pipe
//! buffer) is given a stdout whose read end is closed before it writes, and one whose reader
//! takes one byte and leaves (`| head -c1`): no panic, nothing on stderr, and the exit status
//! is 0 or 141 (what a shell reports for a process killed by SIGPIPE).

mod support;

use std::io::Read;
use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};

use support::team::{Team, add_member_to, lead_cmd};
use troupe::tasks::{NewTask, TaskStore};

/// A team whose listings are each larger than a pipe buffer (64 KiB).
fn big_team() -> Team {
    let team = Team::new();
    for i in 0..40 {
        add_member_to(&team.dir, &format!("m{i:02}"), 1, false);
    }
    let store = TaskStore::new(&team.dir);
    for i in 0..300 {
        store
            .create(NewTask {
                subject: format!("task {i}: {}", "x".repeat(200)),
                created_by: "lead".into(),
                ..NewTask::default()
            })
            .unwrap();
    }
    std::fs::create_dir_all(team.dir.logs_dir()).unwrap();
    std::fs::write(
        team.dir.root().join("logs/m00.log"),
        "a line of the worker's log\n".repeat(40_000),
    )
    .unwrap();
    team
}

const COMMANDS: [&[&str]; 9] = [
    &["status"],
    &["status", "--json"],
    &["task", "list", "--json"],
    &["logs", "m00"],
    &["requests"],
    &["--help"],
    &["completions", "bash"],
    &["man"],
    &["complete-names", "tasks"],
];

fn command(team: &Team, args: &[&str]) -> Command {
    let mut c = lead_cmd(team, "http://127.0.0.1:9", args);
    c.stderr(Stdio::piped());
    c
}

/// Runs `c` with stdout into a pipe; `take` bytes are read (0: the read end is closed before
/// the command starts), then the reader goes. Returns the exit status and stderr.
fn with_reader_gone(mut c: Command, take: usize) -> (std::process::ExitStatus, String) {
    // Close-on-exec: the command must not inherit the read end as well.
    let (r, w): (OwnedFd, OwnedFd) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let mut reader = if take == 0 {
        drop(r);
        None
    } else {
        Some(std::fs::File::from(r))
    };
    c.stdout(Stdio::from(w));
    let mut child = c.spawn().unwrap();
    // The command holds the write end; this process's copy went with `c`.
    drop(c);
    if let Some(r) = reader.as_mut() {
        let mut buf = vec![0u8; take];
        r.read_exact(&mut buf).unwrap();
    }
    drop(reader);
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (child.wait().unwrap(), err)
}

#[test]
fn a_reader_that_goes_away_ends_lead_quietly() {
    let team = big_team();
    for args in COMMANDS {
        // Larger than a pipe buffer, so the command is still writing when the reader leaves.
        let o = command(&team, args).output().unwrap();
        assert!(o.status.success(), "lead {args:?}: {o:?}");
        let big = matches!(args, ["task", "list", "--json"] | ["logs", "m00"]);
        assert!(
            !big || o.stdout.len() > 64 * 1024,
            "lead {args:?} printed only {} bytes",
            o.stdout.len()
        );
        for take in [0, 1] {
            let (status, err) = with_reader_gone(command(&team, args), take);
            assert!(
                matches!(status.code(), Some(0 | 141)),
                "lead {args:?} (reader took {take} bytes): {status:?}\n{err}"
            );
            assert_eq!(err, "", "lead {args:?} (reader took {take} bytes) said");
        }
    }
}
