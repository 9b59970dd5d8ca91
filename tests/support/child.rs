//! Re-running the current test binary as a child process with a role, so that a test can fork
//! real processes that run library code (writers to kill, racing deciders, a dying drainer).
//!
//! A test file declares one `#[test] fn child()` that calls [`dispatch`]; in the parent run it
//! returns at once, in a child (started by [`spawn`]) it runs the role named in the environment
//! and exits the process.

#![allow(dead_code)]

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};

const ROLE: &str = "TROUPE_TEST_CHILD_ROLE";

/// Starts a child running `role`, with `vars` in its environment and stdout piped.
pub fn spawn(role: &str, vars: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in vars {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn child test process")
}

/// A child role: its name and the function it runs with the child's environment.
pub type Role = (&'static str, fn(&HashMap<String, String>));

/// In a child, runs the role's function from `roles` and exits; in the parent, returns.
pub fn dispatch(roles: &[Role]) {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let vars: HashMap<String, String> = std::env::vars().collect();
    let f = roles
        .iter()
        .find(|(name, _)| *name == role)
        .unwrap_or_else(|| panic!("unknown child role {role}"))
        .1;
    f(&vars);
    std::process::exit(0);
}

/// Writes one report line to the real stdout (bypassing the test harness's capture).
pub fn report(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    // The harness may have printed "test child ... " without a newline: start a fresh line.
    out.write_all(b"\n").expect("report to parent");
    out.write_all(line.as_bytes()).expect("report to parent");
    out.write_all(b"\n").expect("report to parent");
    out.flush().expect("report to parent");
}

/// The report lines of a finished child that start with `prefix`, with the prefix removed.
pub fn reports(output: &[u8], prefix: &str) -> Vec<String> {
    String::from_utf8_lossy(output)
        .lines()
        .filter_map(|l| l.strip_prefix(prefix).map(str::to_owned))
        .collect()
}

/// A tiny xorshift generator: enough randomness for kill timing, no dependency.
pub struct Rng(u64);

impl Rng {
    pub fn seeded() -> Rng {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
            | 1;
        eprintln!("rng seed {seed}");
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}
