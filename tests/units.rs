//! Issue 22, acceptance 3: the shipped systemd units, `scripts/troupe.service` and
//! `scripts/troupe-host@.service`.
//!
//! - `systemd-analyze verify` passes on both, without a warning (on copies whose `ExecStart=`
//!   names the `lead` just built, since verify wants the binary to exist);
//! - `systemd-analyze security --offline=yes` rates both at most 4.0;
//! - `lead run`, started as troupe.service starts it (its `ExecStart=` and `WorkingDirectory=`,
//!   as its `User=` through `setpriv` with the unit's empty bounding set and no new privileges,
//!   `$CREDENTIALS_DIRECTORY` holding the credential copies), runs a worker whose commands
//!   cannot read the credential sources in `/etc`, while the worker itself read its API key
//!   from the credential. The units' stronger promise, `/etc/troupe` hidden from commands
//!   whatever their uid may read, is a test too.
//!
//! systemd is not PID 1 on these machines, so the unit's own namespaces and filters are not
//! applied here: what is checked is what the offline tools and `setpriv` can show. Under
//! `CI=true` nothing skips: `.ci/run` installs `systemd-analyze` (Debian's `systemd`), and CI
//! runs as root, which `setpriv` needs.

mod support;

use std::os::unix::fs::{PermissionsExt, chown};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use support::fake_llm::{FakeLlm, Reply, anthropic_message, anthropic_text, json_str};
use support::fake_llm::{Recorded, anthropic_tool_use_block};
use support::team::{Stopping, wait_until};

const UNITS: [&str; 2] = ["troupe.service", "troupe-host@.service"];
/// The highest exposure `systemd-analyze security` may give a unit (issue 22).
const MAX_EXPOSURE: f64 = 4.0;
/// Where the units expect `lead`; the copies for verify name the test's binary instead.
const INSTALLED_LEAD: &str = "/usr/local/bin/lead";
const T: Duration = Duration::from_secs(30);
const USAGE: &str = r#"{"input_tokens":3,"output_tokens":2}"#;

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// `systemd-analyze` on PATH, or `None` (outside CI only) after saying the test skips.
fn systemd_analyze() -> Option<PathBuf> {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("systemd-analyze"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            !in_ci(),
            "systemd-analyze is not installed (CI=true: the unit tests fail rather than skip); \
             .ci/run installs Debian's systemd package"
        );
        eprintln!("SKIPPED: no systemd-analyze on PATH (Debian: apt-get install systemd)");
    }
    found
}

fn unit_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("scripts")
        .join(name)
}

fn unit_text(name: &str) -> String {
    let path = unit_path(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// The value of the first uncommented `key=` line of a unit.
fn directive(unit: &str, key: &str) -> Option<String> {
    let prefix = format!("{key}=");
    unit.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().to_owned())
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn both_units_pass_systemd_analyze_verify() {
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for name in UNITS {
        let unit = unit_text(name);
        assert!(
            unit.contains(INSTALLED_LEAD),
            "{name} no longer runs {INSTALLED_LEAD}: update this test"
        );
        let copy = dir.path().join(name);
        std::fs::write(
            &copy,
            unit.replace(INSTALLED_LEAD, env!("CARGO_BIN_EXE_lead")),
        )
        .unwrap();
        let o = Command::new(&analyze)
            .args(["verify", "--man=no"])
            .arg(&copy)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let said = text(&o);
        eprintln!("systemd-analyze verify {name}: {} {said:?}", o.status);
        // verify exits 0 on warnings (an unknown key, a value it cannot parse and ignores):
        // a warning fails the test too.
        assert!(
            o.status.success() && said.trim().is_empty(),
            "systemd-analyze verify {name}: {}\n{said}",
            o.status
        );
    }
}

/// The overall exposure `systemd-analyze security` printed ("→ Overall exposure level for
/// troupe.service: 2.5 OK 🙂").
fn exposure(report: &str) -> Option<f64> {
    let line = report
        .lines()
        .find(|l| l.contains("Overall exposure level for"))?;
    line.rsplit_once(": ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn both_units_are_rated_at_most_4() {
    let Some(analyze) = systemd_analyze() else {
        return;
    };
    for name in UNITS {
        let o = Command::new(&analyze)
            .args(["security", "--offline=yes", "--no-pager"])
            .arg(unit_path(name))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let report = text(&o);
        let score = exposure(&report).unwrap_or_else(|| {
            panic!(
                "no exposure level in systemd-analyze security {name} ({}):\n{report}",
                o.status
            )
        });
        eprintln!("{name}: exposure {score}");
        assert!(
            score <= MAX_EXPOSURE,
            "{name} is rated {score}, above {MAX_EXPOSURE}:\n{report}"
        );
    }
}

#[test]
fn exposure_is_read_from_the_summary_line() {
    let report = "✗ PrivateNetwork=    Service has access to the host's network    0.5\n\n\
                  → Overall exposure level for troupe-host@i.service: 2.5 OK 🙂\n";
    assert_eq!(exposure(report), Some(2.5));
    assert_eq!(exposure("nothing here"), None);
}

/// The unit's user: its uid on this machine, or where it does not exist (as in CI) the
/// highest uid of Debian's range for people (up to 59999) that no user has, which `setpriv`
/// takes as well.
fn unit_uid(unit: &str) -> u32 {
    let name = directive(unit, "User").expect("troupe.service has a User= line");
    assert_ne!(name, "root", "troupe.service runs as root");
    if let Ok(Some(u)) = nix::unistd::User::from_name(&name) {
        return u.uid.as_raw();
    }
    (1000..60_000)
        .rev()
        .find(|&uid| matches!(nix::unistd::User::from_uid(uid.into()), Ok(None)))
        .expect("a free uid")
}

/// Where the credential sources are: a fresh dir under `/etc` (removed at the end), or
/// `/etc/troupe` itself (made by the test, which refuses to touch one it did not make).
enum Sources {
    Temp(tempfile::TempDir),
    EtcTroupe,
}

impl Sources {
    fn path(&self) -> &Path {
        match self {
            Sources::Temp(t) => t.path(),
            Sources::EtcTroupe => Path::new("/etc/troupe"),
        }
    }
}

impl Drop for Sources {
    fn drop(&mut self) {
        if let Sources::EtcTroupe = self {
            let _ = std::fs::remove_dir_all("/etc/troupe");
        }
    }
}

/// What systemd would lay out for troupe.service, in temp dirs: the state directory (owned by
/// the unit's user, 0700, with `work` in it), the credential sources under `/etc` (root's,
/// files of `mode`), and `$CREDENTIALS_DIRECTORY` (the copies, owned by the unit's user,
/// read-only, under `/run` as systemd's are).
struct Layout {
    uid: u32,
    state: tempfile::TempDir,
    sources: Sources,
    creds: tempfile::TempDir,
    /// The API key: in `sources/anthropic.key` and in the credential `anthropic_api_key`.
    key: String,
    /// A bus password in `sources/bus-password` (a source the unit could load too).
    bus_password: String,
}

impl Layout {
    fn new(uid: u32, sources: Sources, mode: u32) -> Layout {
        let nonce = support::team::marker();
        let key = format!("sk-ant-unit-SOURCE-{nonce}");
        let bus_password = format!("bus-password-SOURCE-{nonce}");
        let state = tempfile::Builder::new()
            .prefix("troupe-units-state-")
            .tempdir()
            .unwrap();
        std::fs::create_dir(state.path().join("work")).unwrap();
        for d in [state.path().to_path_buf(), state.path().join("work")] {
            chown(&d, Some(uid), Some(uid)).unwrap();
            std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        }
        std::fs::set_permissions(sources.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        for (file, secret) in [("anthropic.key", &key), ("bus-password", &bus_password)] {
            let p = sources.path().join(file);
            std::fs::write(&p, format!("{secret}\n")).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        }
        let creds = tempfile::Builder::new()
            .prefix("troupe-units-credentials-")
            .tempdir_in("/run")
            .unwrap();
        let copy = creds.path().join("anthropic_api_key");
        std::fs::write(&copy, format!("{key}\n")).unwrap();
        std::fs::set_permissions(&copy, std::fs::Permissions::from_mode(0o400)).unwrap();
        chown(&copy, Some(uid), Some(uid)).unwrap();
        std::fs::set_permissions(creds.path(), std::fs::Permissions::from_mode(0o500)).unwrap();
        chown(creds.path(), Some(uid), Some(uid)).unwrap();
        Layout {
            uid,
            state,
            sources,
            creds,
            key,
            bus_password,
        }
    }

    /// A path of the unit with its state directory moved here.
    fn place(&self, unit_path: &str) -> String {
        unit_path.replace("/var/lib/troupe", &self.state.path().to_string_lossy())
    }

    /// `lead ARGS` as the unit runs it: as its user with no capabilities to gain
    /// (`CapabilityBoundingSet=`, `NoNewPrivileges=yes`), in its working dir, with the
    /// environment systemd gives it (a drop-in's settings: the provider and the fake server).
    fn as_unit(&self, workdir: &str, args: &[String], url: &str) -> Command {
        let mut c = Command::new("setpriv");
        c.arg(format!("--reuid={}", self.uid))
            .arg(format!("--regid={}", self.uid))
            .args([
                "--clear-groups",
                "--bounding-set=-all",
                "--inh-caps=-all",
                "--no-new-privs",
                "--",
            ])
            .arg(env!("CARGO_BIN_EXE_lead"))
            .args(args)
            .current_dir(workdir)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/bin:/bin")
            .env("HOME", self.state.path())
            .env("CREDENTIALS_DIRECTORY", self.creds.path())
            .env("TROUPE_PROVIDER", "anthropic")
            .env("ANTHROPIC_BASE_URL", url)
            .env("TROUPE_LLM_TIMEOUT_SECS", "10")
            .stdin(Stdio::null());
        c
    }
}

/// The `bash` tool's result in a request body, as the model got it.
fn tool_results(r: &Recorded) -> String {
    r.body["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|m| m["content"].as_array().into_iter().flatten())
        .filter(|b| b["type"] == "tool_result")
        .map(|b| b["content"].to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether this test can run `setpriv` to another user; says why not when it skips (never
/// under `CI=true`).
fn can_setpriv() -> bool {
    if nix::unistd::geteuid().is_root() {
        return true;
    }
    assert!(
        !in_ci(),
        "CI=true and not root: setpriv to the unit's user needs root"
    );
    eprintln!("SKIPPED: setpriv to the unit's user needs root");
    false
}

/// `lead run` as troupe.service runs it, on `layout`, with one member whose model asks `bash`
/// to read every credential source and the credential copy: checks that the command ran to
/// its end as the unit's user, that the worker used the key of `$CREDENTIALS_DIRECTORY`, and
/// that no secret reached the model.
fn run_as_the_unit(unit: &str, layout: &Layout) {
    let workdir = layout.place(&directive(unit, "WorkingDirectory").unwrap());
    let mut exec: Vec<String> = directive(unit, "ExecStart")
        .unwrap()
        .split_whitespace()
        .map(|a| layout.place(a))
        .collect();
    assert_eq!(exec[0], INSTALLED_LEAD, "troupe.service's ExecStart");
    // The one change: the idle worker approves a team stop's shutdown through its model, which
    // this test does not script, so the stop at the end waits 1 s for it instead of 30.
    if let Some(i) = exec.iter().position(|a| a == "--stop-timeout") {
        exec[i + 1] = "1".to_owned();
    }
    let team_dir = exec
        .iter()
        .position(|a| a == "--team-dir")
        .map(|i| exec[i + 1].clone())
        .expect("troupe.service passes --team-dir");

    let sources = layout.sources.path().display().to_string();
    let creds = layout.creds.path().display().to_string();
    let command = format!(
        "for f in {sources}/anthropic.key {sources}/bus-password {creds}/anthropic_api_key; do \
         echo \"== $f\"; cat \"$f\" 2>&1; done; echo \"uid=$(id -u) done\""
    );
    let fake = FakeLlm::start([]).patient(T);
    let url = fake.url();
    fake.push_for(
        "m-unit",
        Reply::ok(anthropic_message(
            &anthropic_tool_use_block(
                "toolu_1",
                "bash",
                &format!(r#"{{"command":{}}}"#, json_str(&command)),
            ),
            "tool_use",
            USAGE,
        )),
    );
    fake.push_for("m-unit", Reply::ok(anthropic_text("Nothing to read.")));

    let lead = |args: &[&str]| {
        let mut all = vec!["--team-dir".to_owned(), team_dir.clone()];
        all.extend(args.iter().map(|a| a.to_string()));
        layout.as_unit(&workdir, &all, &url)
    };
    let o = lead(&[
        "spawn", "amy", "--role", "r", "--prompt", "Read.", "--model", "m-unit",
    ])
    .output()
    .unwrap();
    assert!(o.status.success(), "lead spawn as the unit: {}", text(&o));
    let log = layout.state.path().join("lead-run.log");
    let mut run = layout.as_unit(&workdir, &exec[1..], &url);
    run.stdout(Stdio::from(std::fs::File::create(&log).unwrap()))
        .stderr(Stdio::from(
            std::fs::OpenOptions::new().append(true).open(&log).unwrap(),
        ));
    let lead_run = Stopping(run.spawn().unwrap());
    wait_until(
        T,
        "amy's second model call (with the command's output)",
        || (fake.requests_for("m-unit") >= 2).then_some(()),
    );
    let reqs = fake.requests();
    let status = lead(&["status", "--json"]).output().unwrap();
    drop(lead_run);
    let log = std::fs::read_to_string(&log).unwrap_or_default();

    let first = reqs.iter().find(|r| r.body["model"] == "m-unit").unwrap();
    assert_eq!(
        first.header("x-api-key"),
        Some(layout.key.as_str()),
        "the worker's key comes from $CREDENTIALS_DIRECTORY/anthropic_api_key; lead log:\n{log}"
    );
    let got = reqs
        .iter()
        .filter(|r| r.body["model"] == "m-unit")
        .map(tool_results)
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!("the command got: {got}");
    assert!(
        got.contains(&format!("uid={} done", layout.uid)),
        "the command did not run to its end as uid {}: {got}\nlead log:\n{log}",
        layout.uid
    );
    for (what, secret) in [
        ("the API key", &layout.key),
        ("the bus password", &layout.bus_password),
    ] {
        for (i, r) in reqs.iter().enumerate() {
            assert!(
                !r.raw_body.contains(secret.as_str()),
                "{what} reached the model in request {i}; the command got: {got}"
            );
        }
    }
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap_or_default();
    let sandbox = status["members"]
        .as_array()
        .and_then(|ms| ms.iter().find(|m| m["name"] == "amy"))
        .map_or(serde_json::Value::Null, |m| m["sandbox"].clone());
    eprintln!("amy's sandbox as the unit's user: {sandbox}");
    if in_ci() {
        assert_eq!(
            sandbox["active"], true,
            "CI=true and the sandbox of a unit-run worker is not active: {sandbox}"
        );
    }
}

/// The unit's install steps: the sources `root:root 0600` in a dir under `/etc`, a system tree
/// that commands may read (review 3, N7). The unit's user, and so its commands, cannot read
/// them; the worker still gets its key, through `$CREDENTIALS_DIRECTORY`.
#[test]
fn a_command_of_the_unit_cannot_read_the_credential_sources() {
    if !can_setpriv() {
        return;
    }
    let unit = unit_text("troupe.service");
    let sources = tempfile::Builder::new()
        .prefix("troupe-units-")
        .tempdir_in("/etc")
        .unwrap();
    let layout = Layout::new(unit_uid(&unit), Sources::Temp(sources), 0o600);
    run_as_the_unit(&unit, &layout);
}

/// The units' contract with the sandbox: `/etc/troupe`, where every credential source lives,
/// is hidden from commands whatever their uid may read; here the sources are readable by all
/// (0644), so only the sandbox can keep them from the command.
#[test]
fn etc_troupe_is_hidden_from_commands_whatever_their_uid_may_read() {
    if !can_setpriv() {
        return;
    }
    assert!(
        !Path::new("/etc/troupe").exists(),
        "/etc/troupe exists: this test makes its own and removes it, so it runs only where \
         troupe is not installed"
    );
    std::fs::create_dir("/etc/troupe").unwrap();
    let unit = unit_text("troupe.service");
    let layout = Layout::new(unit_uid(&unit), Sources::EtcTroupe, 0o644);
    run_as_the_unit(&unit, &layout);
}
