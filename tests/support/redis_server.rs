//! A real `redis-server` for the Redis bus tests: started from the distribution's package on a
//! free loopback port, in a temporary dir, with `appendonly yes`, `appendfsync always` and
//! AUTH required, and stopped (SIGKILL) when dropped. Under `CI=true` a missing server fails
//! the test; elsewhere the test says so and skips.
//!
//! troupe connects as the ACL user `troupe` (a random password) with the rights docs/redis.md gives
//! it, [`TROUPE_ACL`]: its keys and the commands it sends, nothing else. The default user
//! keeps every right under another random password, because Redis 7.0 replays the transactions
//! of its append-only log as the default user (with `user default off`, a restart dropped every
//! script's writes, NOPERM at load). Every refusal of a command or a key the server logged
//! (`ACL LOG`) fails the test when the server is stopped or dropped, also where troupe only
//! logged the error and carried on: the list must be complete.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The rights of the ACL user `troupe`, as docs/redis.md gives them: keys `troupe:*` only, no
/// pub/sub channel, and exactly the commands troupe sends. The connection: AUTH (which Redis allows
/// anyway; listed so that this is the whole of what troupe sends) and SELECT (a URL's `/DB`
/// other than 0). The documents, locks, id sets and leases: GET, MGET, SET, DEL, EXISTS, SADD,
/// SMEMBERS, SISMEMBER, and PEXPIRE (a lock taken again by its holder, on a retry). The rate
/// governor's call slots and their queue (sorted sets, on the server's clock): ZADD, ZREM,
/// ZRANK, ZCARD, ZRANGEBYSCORE, ZREMRANGEBYSCORE and TIME. The
/// inboxes, events and change feed (streams): XADD, XRANGE, XREVRANGE, XREAD, XDEL and XLEN.
/// The Lua scripts: EVALSHA, and SCRIPT LOAD when the server has lost its script cache (the
/// commands a script calls are checked one by one).
pub const TROUPE_ACL: &str = "resetkeys ~troupe:* resetchannels -@all +auth +select \
    +get +mget +set +del +exists +pexpire +sadd +smembers +sismember \
    +zadd +zrem +zrank +zcard +zrangebyscore +zremrangebyscore +time \
    +xadd +xrange +xrevrange +xread +xdel +xlen \
    +evalsha +script|load";

pub struct RedisServer {
    child: Child,
    bin: PathBuf,
    pub port: u16,
    pub password: String,
    /// The default user's password (the test's own admin connection).
    admin: String,
    pub dir: tempfile::TempDir,
    /// Refusals the server logged before a kill (its ACL log does not outlive it).
    denied: Vec<String>,
}

/// The server binary: `TROUPE_TEST_REDIS_SERVER`, else `redis-server` or `valkey-server` on
/// PATH.
fn server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TROUPE_TEST_REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|d| [d.join("redis-server"), d.join("valkey-server")])
        .find(|p| p.is_file())
}

impl RedisServer {
    /// Starts a server, or returns `None` (outside CI) when none is installed.
    pub fn start() -> Option<RedisServer> {
        let Some(bin) = server_binary() else {
            assert!(
                std::env::var("CI").as_deref() != Ok("true"),
                "redis-server is not installed (CI=true: a Redis test fails rather than skips); \
                 .ci/run installs it with apt-get"
            );
            eprintln!("SKIPPED: no redis-server or valkey-server on PATH");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let password = format!("{:032x}", rand_u128());
        let admin = format!("{:032x}", rand_u128());
        let port = free_port();
        let conf = dir.path().join("redis.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/redis.log\nappendonly yes\n\
                 appendfsync always\nsave \"\"\nuser default on >{admin} ~* &* +@all\n\
                 user troupe on >{password} {TROUPE_ACL}\n",
                dir = dir.path().display(),
            ),
        )
        .unwrap();
        let child = spawn(&bin, &conf);
        let server = RedisServer {
            child,
            bin,
            port,
            password,
            admin,
            dir,
            denied: Vec::new(),
        };
        server.wait_ready();
        Some(server)
    }

    /// Kills the server with SIGKILL and starts it again on the same port and files (its
    /// append-only log brings back what it acknowledged).
    pub fn restart(&mut self) {
        self.keep_denials();
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(&self.bin, &self.dir.path().join("redis.conf"));
        self.wait_ready();
    }

    /// Kills the server with SIGKILL and leaves it down (see [`RedisServer::start_again`]).
    pub fn stop(&mut self) {
        self.keep_denials();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a stopped server again on the same port and files.
    pub fn start_again(&mut self) {
        self.child = spawn(&self.bin, &self.dir.path().join("redis.conf"));
        self.wait_ready();
    }

    /// The bus URL (no password in it, as troupe requires).
    pub fn url(&self, team: &str) -> String {
        format!("redis://troupe@127.0.0.1:{}/0?team={team}", self.port)
    }

    /// Answers `PING` (as the default user: troupe's own user has no PING).
    fn wait_ready(&self) {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) {
                let cmd = format!("AUTH default {}\r\nPING\r\n", self.admin);
                if s.write_all(cmd.as_bytes()).is_ok() {
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    let mut r = BufReader::new(s);
                    let mut a = String::new();
                    let mut b = String::new();
                    if r.read_line(&mut a).is_ok()
                        && r.read_line(&mut b).is_ok()
                        && b.starts_with("+PONG")
                    {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < until,
                "redis-server did not come up on {}",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The server's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("redis.log")).unwrap_or_default()
    }

    /// Where the server keeps its files.
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The refusals of commands and keys in the server's ACL log, each as the server described
    /// it; none when the server does not answer. Not counted: failed logins (a test tries a
    /// wrong password on purpose) and the client library's `CLIENT SETINFO` at connect, whose
    /// refusal it ignores (Redis 7.2 and later; 7.0 has no such command, and refuses an ACL
    /// rule naming it).
    fn acl_denials(&self) -> Vec<String> {
        let url = format!("redis://default@127.0.0.1:{}/", self.port);
        let Ok(info) = redis::IntoConnectionInfo::into_connection_info(url.as_str()) else {
            return Vec::new();
        };
        let settings = info
            .redis_settings()
            .clone()
            .set_password(self.admin.as_str());
        let info = info.set_redis_settings(settings);
        let Ok(mut conn) = redis::Client::open(info)
            .and_then(|c| c.get_connection_with_timeout(Duration::from_secs(2)))
        else {
            return Vec::new();
        };
        let Ok(redis::Value::Array(entries)) = redis::cmd("ACL")
            .arg("LOG")
            .query::<redis::Value>(&mut conn)
        else {
            return Vec::new();
        };
        entries
            .iter()
            .filter_map(|e| match e {
                redis::Value::Array(fields) => Some(fields.iter().map(word).collect::<Vec<_>>()),
                _ => None,
            })
            .filter(|fields| {
                let field = |k: &str| {
                    fields
                        .chunks(2)
                        .find(|kv| kv[0] == k)
                        .and_then(|kv| kv.get(1))
                        .map(String::as_str)
                };
                field("reason") != Some("auth") && field("object") != Some("client|setinfo")
            })
            .map(|fields| fields.join(" "))
            .collect()
    }

    /// Keeps what the ACL log holds before the server is killed.
    fn keep_denials(&mut self) {
        let d = self.acl_denials();
        self.denied.extend(d);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.keep_denials();
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            assert!(
                self.denied.is_empty(),
                "the server refused troupe a command or a key (TROUPE_ACL lacks it):\n{}",
                self.denied.join("\n")
            );
        }
    }
}

/// A field of an ACL log entry as text.
fn word(v: &redis::Value) -> String {
    match v {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        redis::Value::Int(i) => i.to_string(),
        other => format!("{other:?}"),
    }
}

fn spawn(bin: &Path, conf: &Path) -> Child {
    Command::new(bin)
        .arg(conf)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()))
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}

fn rand_u128() -> u128 {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u128::from_le_bytes(b)
}
