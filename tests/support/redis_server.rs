//! A real `redis-server` for the Redis bus tests: started from the distribution's package on a
//! free loopback port, in a temporary dir, with `appendonly yes`, `appendfsync always` and
//! AUTH required (an ACL user `troupe` with a random password; the default user keeps its
//! rights under another random password, because Redis 7.0 replays the transactions of its
//! append-only log as the default user: with `user default off`, a restart dropped every
//! script's writes, NOPERM at load), and stopped (SIGKILL) when dropped. Under `CI=true` a missing server fails the test; elsewhere
//! the test says so and skips.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    child: Child,
    bin: PathBuf,
    pub port: u16,
    pub password: String,
    pub dir: tempfile::TempDir,
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
                 user troupe on >{password} ~* &* +@all\n",
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
            dir,
        };
        server.wait_ready();
        Some(server)
    }

    /// Kills the server with SIGKILL and starts it again on the same port and files (its
    /// append-only log brings back what it acknowledged).
    pub fn restart(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = spawn(&self.bin, &self.dir.path().join("redis.conf"));
        self.wait_ready();
    }

    /// Kills the server with SIGKILL and leaves it down (see [`RedisServer::start_again`]).
    pub fn stop(&mut self) {
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

    /// Answers `PING` once authenticated.
    fn wait_ready(&self) {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", self.port)) {
                let cmd = format!("AUTH troupe {}\r\nPING\r\n", self.password);
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
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
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
