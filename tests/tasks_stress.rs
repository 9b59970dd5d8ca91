//! Racing claimers on the task board, as real processes with real flock: every task is claimed
//! exactly once, and none before its blockers are completed.

mod support;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use support::child;
use troupe::TeamDir;
use troupe::tasks::{NewTask, TaskStatus, TaskStore};

fn team_from(vars: &HashMap<String, String>) -> TeamDir {
    TeamDir::open(PathBuf::from(&vars["TEAM"])).unwrap()
}

fn wait_for_go(vars: &HashMap<String, String>) {
    let go = PathBuf::from(&vars["GO"]);
    while !go.exists() {
        std::thread::yield_now();
    }
}

/// Claims every id in IDS by name, once GO exists, reporting wins and losses.
fn sniper(vars: &HashMap<String, String>) {
    let store = TaskStore::new(&team_from(vars));
    let who = &vars["WHO"];
    let ids: Vec<String> = std::fs::read_to_string(&vars["IDS"])
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    wait_for_go(vars);
    for id in ids {
        match store.claim(Some(&id), who, 1) {
            Ok(_) => child::report(&format!("win {id}")),
            Err(e) => child::report(&format!("lose {id} {e}")),
        }
    }
}

/// Claims the next claimable task and completes it, until all TOTAL tasks are completed,
/// reporting each claim with the time it was made.
fn worker(vars: &HashMap<String, String>) {
    let store = TaskStore::new(&team_from(vars));
    let who = &vars["WHO"];
    let total: usize = vars["TOTAL"].parse().unwrap();
    wait_for_go(vars);
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        match store.claim(None, who, 1) {
            Ok(t) => {
                child::report(&format!("claim {} {}", t.id, t.updated_at));
                store
                    .update(&t.id, who, TaskStatus::Completed, Some(who.clone()))
                    .unwrap();
            }
            Err(troupe::Error::NoClaimableTask) => {
                if store.list(Some(TaskStatus::Completed)).unwrap().len() == total {
                    return;
                }
                assert!(Instant::now() < deadline, "{who}: no progress");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("{who}: {e}"),
        }
    }
}

#[test]
fn child() {
    child::dispatch(&[("sniper", sniper), ("worker", worker)]);
}

fn new_team() -> (tempfile::TempDir, TeamDir) {
    let tmp = tempfile::tempdir().unwrap();
    let team = TeamDir::create(tmp.path().join(".team")).unwrap();
    (tmp, team)
}

fn add(store: &TaskStore, subject: String, blocked_by: Vec<String>) -> String {
    store
        .create(NewTask {
            subject,
            blocked_by,
            created_by: "lead".into(),
            ..NewTask::default()
        })
        .unwrap()
        .id
}

fn start(
    role: &str,
    n: usize,
    tmp: &tempfile::TempDir,
    team: &TeamDir,
    more: &[(&str, String)],
) -> Vec<std::process::Child> {
    let go = tmp.path().join("go");
    let kids = (0..n)
        .map(|i| {
            let mut vars = vec![
                ("TEAM", team.root().display().to_string()),
                ("WHO", format!("claimer{i}")),
                ("GO", go.display().to_string()),
            ];
            vars.extend(more.iter().cloned());
            child::spawn(role, &vars)
        })
        .collect();
    std::thread::sleep(Duration::from_millis(50));
    std::fs::write(&go, "").unwrap();
    kids
}

fn outputs(kids: Vec<std::process::Child>) -> Vec<Vec<u8>> {
    kids.into_iter()
        .map(|k| {
            let o = k.wait_with_output().unwrap();
            assert!(o.status.success(), "a claimer failed");
            o.stdout
        })
        .collect()
}

#[test]
fn racing_claims_of_the_same_tasks_have_exactly_one_winner() {
    const N: usize = 200;
    const CLAIMERS: usize = 4;
    let (tmp, team) = new_team();
    let store = TaskStore::new(&team);
    let ids: Vec<String> = (0..N)
        .map(|i| add(&store, format!("t{i}"), vec![]))
        .collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), N, "duplicate ids");
    let ids_file = tmp.path().join("ids");
    std::fs::write(&ids_file, ids.join("\n")).unwrap();
    let kids = start(
        "sniper",
        CLAIMERS,
        &tmp,
        &team,
        &[("IDS", ids_file.display().to_string())],
    );
    let outs = outputs(kids);
    let mut winners: HashMap<String, usize> = HashMap::new();
    for (i, out) in outs.iter().enumerate() {
        for id in child::reports(out, "win ") {
            assert!(winners.insert(id, i).is_none(), "two winners");
        }
        for lose in child::reports(out, "lose ") {
            let (id, why) = lose.split_once(' ').unwrap();
            assert!(
                why.starts_with(&format!("task {id}: already in progress (owner claimer")),
                "{why}"
            );
        }
    }
    assert_eq!(winners.len(), N, "some task had no winner");
    for (id, i) in winners {
        let t = store.get(&id).unwrap();
        assert_eq!(t.status, TaskStatus::InProgress);
        assert_eq!(t.owner, Some(format!("claimer{i}")));
    }
}

#[test]
fn claimers_take_each_task_once_and_never_before_its_blockers() {
    const N: usize = 60;
    const CLAIMERS: usize = 3;
    let (tmp, team) = new_team();
    let store = TaskStore::new(&team);
    // Layers of a dependency graph: each task after the first few waits on up to two earlier ones.
    let mut ids: Vec<String> = Vec::new();
    for i in 0..N {
        let mut blockers = Vec::new();
        if i >= 4 {
            blockers.push(ids[i / 2].clone());
            if i % 3 == 0 {
                blockers.push(ids[i - 3].clone());
            }
        }
        blockers.dedup();
        ids.push(add(&store, format!("t{i}"), blockers));
    }
    let kids = start("worker", CLAIMERS, &tmp, &team, &[("TOTAL", N.to_string())]);
    let outs = outputs(kids);
    let mut claimed: HashMap<String, f64> = HashMap::new();
    let mut per: Vec<usize> = Vec::new();
    for out in &outs {
        let mine = child::reports(out, "claim ");
        per.push(mine.len());
        for line in mine {
            let (id, at) = line.split_once(' ').unwrap();
            assert!(
                claimed.insert(id.to_owned(), at.parse().unwrap()).is_none(),
                "{id} claimed twice"
            );
        }
    }
    eprintln!("claims per claimer: {per:?}");
    assert_eq!(claimed.len(), N, "every task claimed");
    for t in store.list(None).unwrap() {
        assert_eq!(t.status, TaskStatus::Completed);
        assert_eq!(t.result, t.owner, "completed by its claimer");
        for b in &t.blocked_by {
            let done = store.get(b).unwrap().completed_at.unwrap();
            assert!(
                claimed[&t.id] >= done,
                "{} claimed at {} before its blocker {b} completed at {done}",
                t.id,
                claimed[&t.id]
            );
        }
    }
}
