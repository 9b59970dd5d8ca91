//! Teams on a Redis bus spread over hosts (each a `lead run --host H` with its own team dir and
//! working dir, here all on this machine), for the tests of placement and fencing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

use super::redis_server::RedisServer;
use super::team::Bg;

pub struct Host {
    _tmp: tempfile::TempDir,
    pub team: PathBuf,
    pub work: PathBuf,
}

impl Host {
    pub fn new() -> Host {
        let tmp = tempfile::tempdir().unwrap();
        let work = tmp.path().join("work");
        std::fs::create_dir_all(&work).unwrap();
        Host {
            team: tmp.path().join(".team"),
            work,
            _tmp: tmp,
        }
    }
}

pub struct Bus {
    pub url: String,
    pub password: String,
    pub cassette: PathBuf,
}

impl Bus {
    /// The team `team` on `server`, its members answered from a cassette in `scratch`.
    pub fn new(server: &RedisServer, team: &str, scratch: &Path, names: &[&str]) -> Bus {
        Bus {
            url: server.url(team),
            password: server.password.clone(),
            cassette: cassette(scratch, names),
        }
    }

    /// `host`'s team dir with the team's state on this bus (the library's seam).
    pub fn team_dir(&self, host: &Host) -> troupe::TeamDir {
        troupe::TeamDir::create(&host.team).unwrap().with_bus(Some(
            troupe::store::redis::RedisBus::with_password(&self.url, &self.password).unwrap(),
        ))
    }

    pub fn lead(&self, host: &Host, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lead"));
        c.arg("--team-dir")
            .arg(&host.team)
            .args(args)
            .current_dir(&host.work)
            .env_remove("TROUPE_TEAM_DIR")
            .env("TROUPE_BUS", &self.url)
            .env(troupe::store::redis::PASSWORD_ENV, &self.password)
            .env("TROUPE_PROVIDER", "replay")
            .env("TROUPE_CASSETTE", &self.cassette)
            .stdin(Stdio::null());
        c
    }

    pub fn out(&self, host: &Host, args: &[&str]) -> Output {
        self.lead(host, args).output().unwrap()
    }

    pub fn run(&self, host: &Host, name: &str) -> Bg {
        Bg(self
            .lead(
                host,
                &[
                    "run",
                    "--host",
                    name,
                    "--stop-timeout",
                    "1",
                    "--kill-grace",
                    "1",
                ],
            )
            .stderr(Stdio::null())
            .spawn()
            .unwrap())
    }

    pub fn members(&self, host: &Host) -> Vec<Value> {
        let o = self.out(host, &["status", "--json"]);
        let v: Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stderr)));
        v["members"].as_array().unwrap().clone()
    }

    pub fn live_hosts(&self, host: &Host) -> Vec<String> {
        let o = self.out(host, &["status", "--json"]);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        v["bus"]["hosts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| h.as_str().unwrap().to_owned())
            .collect()
    }
}

/// A replay cassette answering every call of `names` with "ack".
pub fn cassette(dir: &Path, names: &[&str]) -> PathBuf {
    let path = dir.join("cassette.jsonl");
    let mut text = String::new();
    for n in names {
        for seq in 0..200 {
            text.push_str(&format!(
                r#"{{"agent":"{n}","seq":{seq},"response":{{"content":[{{"type":"text","text":"ack"}}],"stop_reason":"end_turn"}}}}"#
            ));
            text.push('\n');
        }
    }
    std::fs::write(&path, text).unwrap();
    path
}

pub fn ok(o: &Output) {
    assert!(
        o.status.success(),
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}
