//! Malformed files of the team dir never panic a command (review 4, R4-13, and
//! `malformed_team_dir_panics.sh` beside it): a merge entry whose commit and landed ids are not
//! ASCII (cut inside a character, they panicked `lead merge --list`, `lead status --json` and
//! `lead top`), beats and governor state holding absurd numbers, events of odd shapes, and a torn
//! merge entry. Real `lead`, a team dir as a hand or a crash may leave it.

mod support;

use support::team::{Team, offline_lead as lead};

#[test]
fn malformed_entries_beats_state_and_events_panic_no_command() {
    let team = Team::new();
    let o = lead(
        &team,
        &["spawn", "alice", "--role", "coder", "--prompt", "work"],
    );
    assert!(o.status.success(), "{o:?}");
    let root = team.dir.root();
    let now = troupe::fsutil::now();
    for d in ["merge", "beats", "govern/0123456789abcdef"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::write(
        root.join("merge/ab12cd34.json"),
        format!(
            r#"{{"id":"ab12cd34","member":"alice","branch":"troupe/alice","commit":"ééééééé","state":"landed","queued_at":{now},"updated_at":{now},"landed":"ééééééé","attempts":1}}"#
        ),
    )
    .unwrap();
    std::fs::write(
        root.join("beats/alice.json"),
        r#"{"epoch":0,"at":1e300,"allowance":1e300,"doing":"model call 1"}"#,
    )
    .unwrap();
    std::fs::write(
        root.join("govern/0123456789abcdef/state.json"),
        r#"{"cooldown_until":1e300,"limit":1e300,"halve_after":0,"changed_at":0,"remaining":0,"reset_at":1e300,"limited":1}"#,
    )
    .unwrap();
    let mut events = std::fs::read(team.dir.events()).unwrap_or_default();
    events.extend_from_slice(
        b"\n{\"ts\":1e300,\"event\":\"spawn\",\"name\":\"alice\"}\n{\"ts\":-1e300,\"event\":\"hung\",\"name\":\"alice\",\"silent_secs\":\"x\"}\n{\"ts\":\"x\",\"event\":7}\n",
    );
    std::fs::write(team.dir.events(), events).unwrap();
    let trace = team.path().join("t.json");
    let trace = trace.to_string_lossy().into_owned();
    let commands: Vec<Vec<&str>> = vec![
        vec!["merge", "--list"],
        vec!["status"],
        vec!["status", "--json"],
        vec!["top", "--once"],
        vec!["top", "--once", "--json"],
        vec!["watch", "--since", "1d", "--until-stop"],
        vec!["trace", "-o", &trace],
        vec!["trace", "--format", "text"],
    ];
    let check = |args: &[&str]| {
        let o = lead(&team, args);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(
            !stderr.contains("panicked") && o.status.code() != Some(101),
            "lead {} panicked: {stderr}",
            args.join(" ")
        );
    };
    for args in &commands {
        check(args);
    }
    // A torn entry beside it.
    std::fs::write(
        root.join("merge/ffff0000.json"),
        r#"{"id":"ffff0000","member":"#,
    )
    .unwrap();
    check(&["merge", "--list"]);
    check(&["status"]);
}
