//! Review 4, m7: tasks, requests and merge entries are never removed, and `lead top` read every
//! one of them again at every pass (at least once a second), so what a pass cost grew with
//! the team's history. Now a pass reads only those that changed ([`troupe::store::Listing`]):
//! the real `lead top`, in a tmux pane, on a team of thousands of finished tasks and merge
//! entries reads a small part of them per second, and still shows a finished task reopened.
//! The listing itself, on files and on a bus: the same records as a full listing after every
//! kind of change, without reading the unchanged ones again.

mod support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::redis_server::RedisServer;
use support::team::{Team, wait_until};
use troupe::TeamDir;
use troupe::merge::{MergeStore, NewEntry};
use troupe::store::Listing;
use troupe::store::redis::RedisBus;
use troupe::tasks::{NewTask, Task, TaskStatus, TaskStore};

const T: Duration = Duration::from_secs(30);

fn new_task(subject: &str) -> NewTask {
    NewTask {
        subject: subject.into(),
        description: "what it takes, at some length, as a lead would write it".repeat(4),
        blocked_by: vec![],
        owner: None,
        created_by: "lead".into(),
    }
}

/// `n` finished tasks and `n` landed merge entries of alice's, written as their stores write
/// them (copies of one made through the store, each under an id of its own): the bytes one
/// full listing of them reads.
fn history(team: &TeamDir, n: usize) -> u64 {
    let tasks = TaskStore::new(team);
    let one = tasks.create(new_task("the first")).unwrap();
    let mut task: Value =
        serde_json::from_slice(&std::fs::read(team.task(&one.id).unwrap()).unwrap()).unwrap();
    let (entry, _) = MergeStore::new(team)
        .enqueue(&NewEntry {
            member: "alice".into(),
            branch: "troupe/alice".into(),
            commit: "0123456789abcdef0123456789abcdef01234567".into(),
            task: None,
            host: None,
        })
        .unwrap();
    let mut merge: Value =
        serde_json::from_slice(&std::fs::read(team.merge_entry(&entry.id).unwrap()).unwrap())
            .unwrap();
    let mut bytes = 0;
    for i in 0..n {
        let id = format!("{:08x}", 0x1000_0000 + i);
        task["id"] = json!(id);
        task["status"] = json!(if i % 2 == 0 { "completed" } else { "cancelled" });
        task["created_at"] = json!(1_000_000.0 + i as f64);
        let body = serde_json::to_vec_pretty(&task).unwrap();
        std::fs::write(team.task(&id).unwrap(), &body).unwrap();
        std::fs::write(team.task_lock(&id).unwrap(), b"").unwrap();
        merge["id"] = json!(id);
        merge["state"] = json!("landed");
        merge["landed"] = json!("89abcdef0123456789abcdef0123456789abcdef");
        let entry = serde_json::to_vec_pretty(&merge).unwrap();
        std::fs::write(team.merge_entry(&id).unwrap(), &entry).unwrap();
        std::fs::write(team.merge_lock(&id).unwrap(), b"").unwrap();
        bytes += (body.len() + entry.len()) as u64;
    }
    bytes
}

/// The bytes process `pid` has read so far (`rchar`: every `read` and `pread`, of files or
/// not).
fn rchar(pid: &str) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap();
    io.lines()
        .find_map(|l| l.strip_prefix("rchar: "))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
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

fn shell_quote(p: &Path) -> String {
    format!("'{}'", p.display().to_string().replace('\'', r"'\''"))
}

#[test]
fn lead_top_reads_only_what_changed_at_each_pass() {
    if !have_tmux() {
        return;
    }
    let team = Team::new();
    team.add_member("alice", 1, false);
    let full = history(&team.dir, 3000);
    let tmux = Tmux {
        socket: team.path().join("top.sock"),
    };
    let top = format!(
        "{lead} --team-dir {dir} top",
        lead = env!("CARGO_BIN_EXE_lead"),
        dir = shell_quote(team.dir.root()),
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
        &format!("{top}; sleep 60"),
    ]);
    assert!(o.status.success(), "{o:?}");
    wait_until(T, "top's view", || {
        tmux.screen().contains("completed 1500").then_some(())
    });
    let o = tmux.cmd(&["list-panes", "-t", "top", "-F", "#{pane_pid}"]);
    let shell = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    let pid = wait_until(T, "lead top's process", || {
        let o = Command::new("pgrep").args(["-P", &shell]).output().ok()?;
        String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .map(|l| l.trim().to_owned())
    });
    // A few passes (one a second at least) after the first.
    let before = rchar(&pid);
    std::thread::sleep(Duration::from_millis(3500));
    let read = rchar(&pid) - before;
    println!(
        "one full listing: {full} bytes; lead top read {read} bytes in 3.5 s ({:.2} listings)",
        read as f64 / full as f64
    );
    assert!(
        read < full / 2,
        "lead top read {read} bytes in 3.5 s: the finished tasks and merge entries again \
         (one listing of them is {full})"
    );
    // A finished task reopened is seen all the same.
    TaskStore::new(&team.dir).reopen("10000000").unwrap();
    wait_until(T, "the reopened task on the header", || {
        let s = tmux.screen();
        (s.contains("completed 1499") && s.contains("pending 2")).then_some(())
    });
}

/// Lists `tasks` with `cache` and checks the listing against a full one.
fn listed(tasks: &TaskStore, cache: &mut Listing<Task>) -> Vec<Task> {
    let got = tasks.list_cached(cache).unwrap();
    let full = tasks.list(None).unwrap();
    if got != full {
        let differ: Vec<_> = got
            .iter()
            .zip(&full)
            .filter(|(a, b)| a != b)
            .map(|(a, b)| format!("{} ({}) for {} ({})", a.id, a.status, b.id, b.status))
            .collect();
        panic!(
            "the listing differs from a full one: {} tasks for {}; {differ:?}",
            got.len(),
            full.len()
        );
    }
    got
}

/// The bytes this thread has read so far (`rchar` of `/proc/thread-self/io`: the other tests'
/// threads do not count).
fn thread_rchar() -> u64 {
    rchar("thread-self")
}

#[test]
fn a_listing_of_files_reads_again_only_the_files_that_changed() {
    let team = Team::new();
    team.add_member("alice", 1, false);
    let tasks = TaskStore::new(&team.dir);
    let full = history(&team.dir, 500);
    let mut cache = Listing::default();
    assert_eq!(listed(&tasks, &mut cache).len(), 501);
    let r = thread_rchar();
    let got = tasks.list_cached(&mut cache).unwrap();
    let again = thread_rchar() - r;
    assert_eq!(got.len(), 501);
    assert!(
        again < full / 20,
        "a second listing read {again} bytes (the tasks are {full})"
    );
    // Every kind of change is seen: a new task, a claim, a completion, a reopen, a cancel,
    // and an edit in place by a person (same size).
    let t = tasks.create(new_task("new")).unwrap();
    listed(&tasks, &mut cache);
    tasks.claim(Some(&t.id), "alice", 1).unwrap();
    listed(&tasks, &mut cache);
    tasks
        .update(&t.id, "alice", TaskStatus::Completed, Some("done".into()))
        .unwrap();
    assert_eq!(
        listed(&tasks, &mut cache)
            .iter()
            .find(|x| x.id == t.id)
            .unwrap()
            .status,
        TaskStatus::Completed
    );
    tasks.reopen("10000001").unwrap();
    listed(&tasks, &mut cache);
    tasks.cancel("10000001", false).unwrap();
    listed(&tasks, &mut cache);
    let path = team.dir.task("10000004").unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let edited = text.replace("\"the first\"", "\"the 1st!!\"");
    assert_eq!(edited.len(), text.len());
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, edited.as_bytes()))
        .unwrap();
    let got = listed(&tasks, &mut cache);
    assert_eq!(
        got.iter().find(|x| x.id == "10000004").unwrap().subject,
        "the 1st!!"
    );
    // A file gone is gone from the listing.
    std::fs::remove_file(team.dir.task("10000006").unwrap()).unwrap();
    assert_eq!(listed(&tasks, &mut cache).len(), 501);
}

#[test]
fn a_listing_on_a_bus_reads_again_only_what_the_change_feed_names() {
    let Some(server) = RedisServer::start() else {
        return;
    };
    let local = Team::new();
    let bus = RedisBus::with_password(&server.url("lists"), &server.password).unwrap();
    let team = local.dir.clone().with_bus(Some(bus.clone()));
    support::team::add_member_to(&team, "alice", 1, false);
    let tasks = TaskStore::new(&team);
    let mut made = Vec::new();
    for i in 0..40 {
        made.push(tasks.create(new_task(&format!("task {i}"))).unwrap());
    }
    let mut cache = Listing::default();
    assert_eq!(listed(&tasks, &mut cache).len(), 40);
    // A document changed behind the feed's back (no store writes so): the listing does not
    // read it again, which is what shows it reads only what the feed names.
    let key = bus.key(&format!("task:{}", made[0].id));
    let mut quiet = made[0].clone();
    quiet.subject = "changed quietly".into();
    let set = |t: &Task| {
        let mut conn = bus.connect(Duration::from_secs(5)).unwrap();
        redis::cmd("SET")
            .arg(&key)
            .arg(serde_json::to_string(t).unwrap())
            .query::<()>(&mut conn)
            .unwrap();
    };
    set(&quiet);
    let got = tasks.list_cached(&mut cache).unwrap();
    assert_eq!(
        got.iter().find(|t| t.id == made[0].id).unwrap().subject,
        "task 0"
    );
    set(&made[0]);
    // Every change through the store is seen: a claim, a completion, a reopen, a new task.
    let t = &made[1].id;
    tasks.claim(Some(t), "alice", 1).unwrap();
    listed(&tasks, &mut cache);
    tasks
        .update(t, "alice", TaskStatus::Completed, None)
        .unwrap();
    listed(&tasks, &mut cache);
    tasks.reopen(t).unwrap();
    listed(&tasks, &mut cache);
    tasks.create(new_task("one more")).unwrap();
    assert_eq!(listed(&tasks, &mut cache).len(), 41);
    // Once the feed no longer reaches back to the last listing (capped at about 1000
    // entries), everything is read again: a quiet change too.
    set(&quiet);
    let mut conn = bus.connect(Duration::from_secs(5)).unwrap();
    for _ in 0..1500 {
        redis::cmd("XADD")
            .arg(bus.key("changes"))
            .arg("MAXLEN")
            .arg("~")
            .arg(1000)
            .arg("*")
            .arg("k")
            .arg(bus.key("roster"))
            .query::<()>(&mut conn)
            .unwrap();
    }
    let got = listed(&tasks, &mut cache);
    assert_eq!(
        got.iter().find(|t| t.id == made[0].id).unwrap().subject,
        "changed quietly"
    );
}
