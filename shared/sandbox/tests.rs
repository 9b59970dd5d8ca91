//! The sandbox from the inside: commands run through the real keeper, as an agent's would.

use std::path::Path;
use std::time::Duration;

use serde_json::json;

use super::*;
use crate::tools::bash::bash;
use crate::tools::fs::Workdir;

struct Setup {
    _t: tempfile::TempDir,
    work: PathBuf,
    team: PathBuf,
    sb: Sandbox,
}

fn setup(settings: Settings) -> Setup {
    let t = tempfile::tempdir().unwrap();
    let work = t.path().join("work");
    let team = work.join(".team");
    std::fs::create_dir_all(team.join("requests")).unwrap();
    std::fs::write(team.join("config.json"), "{\"members\":[]}").unwrap();
    let sb = Sandbox::prepare(&settings, &work, &team, "alice", None);
    Setup {
        _t: t,
        work,
        team,
        sb,
    }
}

fn run(s: &Setup, command: &str) -> String {
    let wd = Workdir::new(&s.work).unwrap();
    bash(
        &wd,
        &s.sb,
        &json!({ "command": command }),
        Duration::from_secs(20),
    )
    .content
}

/// Whether this machine must offer the whole sandbox (CI does).
fn must_be_active() -> bool {
    std::env::var_os("CI").is_some()
}

#[test]
fn commands_cannot_touch_the_team_dir_or_the_system() {
    let s = setup(Settings::default());
    let st = s.sb.status();
    eprintln!("{}", st.describe());
    if must_be_active() {
        assert!(st.active, "{st:?}");
    }
    if !st.active {
        return;
    }
    assert_eq!(run(&s, "echo hi > f && cat f").trim(), "hi");
    let out = run(
        &s,
        "echo '{}' > .team/config.json; rm -rf .team/requests; ls -a .team",
    );
    assert!(
        out.contains("Read-only file system") || out.contains("Permission denied"),
        "{out}"
    );
    let abs = format!("echo '{{}}' > {}/config.json", s.team.display());
    run(&s, &abs);
    assert_eq!(
        std::fs::read_to_string(s.team.join("config.json")).unwrap(),
        "{\"members\":[]}"
    );
    assert!(s.team.join("requests").is_dir());
    let out = run(
        &s,
        "touch /etc/troupe-test 2>&1; touch /usr/troupe-test 2>&1; echo done",
    );
    assert!(!Path::new("/etc/troupe-test").exists(), "{out}");
    let out = run(&s, "ls /proc | grep -c '^[0-9]'");
    let n: u32 = out.trim().parse().unwrap_or(999);
    assert!(n < 10, "the command sees {n} processes:\n{out}");
    let out = run(&s, "ls /run | wc -l; ls /root 2>&1 | head -1");
    assert!(out.starts_with("0") || out.starts_with("1"), "{out}");
    let out = run(&s, "echo t > /tmp/x && cat /tmp/x && echo $TMPDIR");
    assert_eq!(out.trim(), "t\n/tmp");
    assert!(
        st.tmp.as_ref().unwrap().join("x").exists(),
        "the private /tmp is {:?}",
        st.tmp
    );
}

#[test]
fn the_environment_of_the_worker_is_out_of_reach() {
    // SAFETY: this test's process reads no environment concurrently in a way that matters.
    unsafe { std::env::set_var("ANTHROPIC_API_KEY", "sk-very-secret") };
    let s = setup(Settings::default());
    if !s.sb.status().active {
        assert!(!must_be_active());
        return;
    }
    let out = run(
        &s,
        "for f in /proc/*/environ; do tr '\\0' '\\n' < $f; done 2>&1; kill -9 $PPID; kill -9 1; echo alive",
    );
    assert!(!out.contains("sk-very-secret"), "{out}");
    assert!(out.contains("alive"), "{out}");
}

#[test]
fn off_runs_unsandboxed() {
    let s = setup(Settings {
        mode: Mode::Off,
        ..Settings::default()
    });
    assert_eq!(s.sb.status().describe(), "off: tools run unsandboxed");
    run(&s, "echo x > .team/owned");
    assert!(s.team.join("owned").exists());
}

#[test]
fn as_root_commands_run_as_nobody_where_nobody_can_work() {
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let work = t.path().join("work");
    let team = work.join(".team");
    std::fs::create_dir_all(&team).unwrap();
    std::fs::set_permissions(&work, std::fs::Permissions::from_mode(0o777)).unwrap();
    let sb = Sandbox::prepare(&Settings::default(), &work, &team, "bob", None);
    let st = sb.status();
    if must_be_active() {
        assert!(st.active, "{st:?}");
    }
    if !st.active {
        return;
    }
    assert_eq!(st.user, "nobody (uid 65534)", "{st:?}");
    let s = Setup {
        _t: t,
        work,
        team,
        sb,
    };
    assert_eq!(
        run(&s, "id -u; echo x > mine && echo wrote").trim(),
        "65534\nwrote"
    );
}

#[test]
fn required_refuses_commands_when_something_is_missing() {
    let s = setup(Settings {
        mode: Mode::Required,
        user: Some("no-such-user-here".to_owned()),
        ..Settings::default()
    });
    let st = s.sb.status();
    if !nix::unistd::geteuid().is_root() {
        // --sandbox-user is refused for not being root: missing all the same.
        assert!(st.refused.is_some(), "{st:?}");
    }
    assert!(!st.active && st.refused.is_some(), "{st:?}");
    let out = run(&s, "echo ran > ran");
    assert!(out.starts_with("not run: the sandbox is required"), "{out}");
    assert!(!s.work.join("ran").exists());
    assert!(
        st.describe().starts_with("required but unavailable"),
        "{}",
        st.describe()
    );
}

/// A `--sandbox-read` dir under `/tmp` is bound back over the private `/tmp`, whose rights
/// Landlock would grant it too: it is mounted read-only.
#[test]
fn a_read_dir_under_tmp_stays_read_only() {
    let t = tempfile::tempdir().unwrap();
    let ro = t.path().join("ro");
    std::fs::create_dir(&ro).unwrap();
    std::fs::write(ro.join("f"), "as it was").unwrap();
    let s = setup(Settings {
        read: vec![ro.clone()],
        ..Settings::default()
    });
    if !s.sb.status().active {
        assert!(!must_be_active(), "{:?}", s.sb.status());
        return;
    }
    let out = run(
        &s,
        &format!(
            "cat {0}/f; echo changed > {0}/f; touch {0}/new",
            ro.display()
        ),
    );
    assert!(out.starts_with("as it was"), "{out}");
    assert_eq!(std::fs::read_to_string(ro.join("f")).unwrap(), "as it was");
    assert!(!ro.join("new").exists(), "{out}");
}
