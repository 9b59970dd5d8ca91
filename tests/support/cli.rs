//! The `lead` CLI as a shell script runs it: one command, its exit code, stdout and stderr.

use std::process::{Command, Output};

use super::team::Team;

/// Runs `lead --team-dir TEAM ARGS...` (no provider configured) and waits for it.
pub fn lead(team: &Team, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lead"))
        .arg("--team-dir")
        .arg(team.dir.root())
        .args(args)
        .env_remove("TROUPE_TEAM_DIR")
        .output()
        .unwrap()
}

pub fn code(o: &Output) -> i32 {
    o.status.code().unwrap()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_owned()
}
