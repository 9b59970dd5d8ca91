//! The bench's own connection to the server of `--bus`, for what troupe never sends: `CONFIG`
//! (the fsync policy), `INFO` (command counts) and the `DEL` of `redis-benchmark`'s key.
//!
//! A few lines of RESP2 over plain TCP rather than a second Redis client in the bench: it sends
//! only the commands above and reads their replies (`rediss://` is not supported here).

use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use troupe::store::redis::{CREDENTIAL, PASSWORD_ENV, PASSWORD_FILE_ENV, RedisBus};

/// Where the server of a bus URL is, and as whom to log in.
#[derive(Clone)]
pub struct Server {
    pub host: String,
    pub port: u16,
    pub user: Option<String>,
    pub db: u32,
    pub password: String,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("db", &self.db)
            .finish_non_exhaustive()
    }
}

impl Server {
    /// The server of `url` (`redis://[USER@]HOST[:PORT][/DB][?team=NAME]`), checked as troupe
    /// checks it, with the password from where troupe reads it.
    pub fn of_url(url: &str) -> Result<Server> {
        Server::with_password(url, password()?)
    }

    /// [`Server::of_url`] with an explicit password.
    fn with_password(url: &str, password: String) -> Result<Server> {
        RedisBus::with_password(url, &password)?;
        let rest = url.strip_prefix("redis://").with_context(|| {
            format!("{url}: the comparison speaks plain TCP, so only redis:// URLs")
        })?;
        let rest = rest.split('?').next().unwrap_or("");
        let (authority, db) = rest.split_once('/').unwrap_or((rest, ""));
        let (user, hostport) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u.to_owned()).filter(|u| !u.is_empty()), h),
            None => (None, authority),
        };
        // `[::1]:6379`, `host:6379`, `host`.
        let (host, port) = match hostport.strip_prefix('[') {
            Some(v6) => {
                let (h, p) = v6.split_once(']').context("unclosed [ in the URL")?;
                (h, p.strip_prefix(':'))
            }
            None => match hostport.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (hostport, None),
            },
        };
        let port = match port {
            Some(p) => p.parse().with_context(|| format!("port {p:?} in {url}"))?,
            None => 6379,
        };
        let db = match db {
            "" => 0,
            d => d
                .parse()
                .with_context(|| format!("database {d:?} in {url}"))?,
        };
        Ok(Server {
            host: if host.is_empty() { "127.0.0.1" } else { host }.to_owned(),
            port,
            user,
            db,
            password,
        })
    }
}

/// The bus password, looked for where troupe looks (shared/store/redis/mod.rs): the file
/// `TROUPE_BUS_PASSWORD_FILE` names, the systemd credential, then `TROUPE_BUS_PASSWORD`.
fn password() -> Result<String> {
    let first_line = |text: String| text.lines().next().unwrap_or("").trim_end().to_owned();
    if let Some(path) = std::env::var_os(PASSWORD_FILE_ENV) {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {PASSWORD_FILE_ENV}"))?;
        return Ok(first_line(text));
    }
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY")
        && let Ok(text) = std::fs::read_to_string(std::path::Path::new(&dir).join(CREDENTIAL))
    {
        return Ok(first_line(text));
    }
    Ok(std::env::var(PASSWORD_ENV).unwrap_or_default())
}

/// A reply. Errors from the server are a value (`Error`), not a failure of the call.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Text(String),
    Error(String),
    Int(i64),
    Nil,
    Array(Vec<Reply>),
}

/// One authenticated connection.
pub struct Admin {
    read: BufReader<TcpStream>,
    write: TcpStream,
}

impl Admin {
    /// Connects, logs in and selects the URL's database.
    pub fn connect(s: &Server) -> Result<Admin> {
        let addr = (s.host.as_str(), s.port)
            .to_socket_addrs()
            .with_context(|| format!("cannot resolve {}", s.host))?
            .next()
            .with_context(|| format!("no address for {}", s.host))?;
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .with_context(|| format!("cannot connect to {addr}"))?;
        stream.set_read_timeout(Some(Duration::from_secs(60)))?;
        let _ = stream.set_nodelay(true);
        let mut admin = Admin {
            read: BufReader::new(stream.try_clone()?),
            write: stream,
        };
        let pw = s.password.as_str();
        let auth = match &s.user {
            Some(u) => admin.call(&["AUTH", u, pw])?,
            None => admin.call(&["AUTH", pw])?,
        };
        if let Reply::Error(e) = auth {
            // The server's words only: they never hold the password.
            bail!("the server refused the login: {e}");
        }
        if s.db != 0 {
            admin.ok(&["SELECT", &s.db.to_string()])?;
        }
        Ok(admin)
    }

    /// Sends one command and reads its reply.
    pub fn call(&mut self, args: &[&str]) -> Result<Reply> {
        let mut buf = format!("*{}\r\n", args.len()).into_bytes();
        for a in args {
            buf.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
            buf.extend_from_slice(a.as_bytes());
            buf.extend_from_slice(b"\r\n");
        }
        self.write
            .write_all(&buf)
            .context("failed to write to the server")?;
        read_reply(&mut self.read)
    }

    /// [`Admin::call`], with an error reply as a failure.
    pub fn ok(&mut self, args: &[&str]) -> Result<Reply> {
        match self.call(args)? {
            Reply::Error(e) => Err(anyhow!("{} refused: {e}", args.join(" "))),
            r => Ok(r),
        }
    }

    /// `CONFIG GET name`: its value, or the server's refusal.
    pub fn config_get(&mut self, name: &str) -> Result<std::result::Result<String, String>> {
        Ok(match self.call(&["CONFIG", "GET", name])? {
            Reply::Error(e) => Err(e),
            Reply::Array(kv) => match kv.get(1) {
                Some(Reply::Text(v)) => Ok(v.clone()),
                _ => Err(format!("CONFIG GET {name}: no such setting")),
            },
            r => Err(format!("CONFIG GET {name}: unexpected reply {r:?}")),
        })
    }

    /// `CONFIG SET name value`, or the server's refusal.
    pub fn config_set(
        &mut self,
        name: &str,
        value: &str,
    ) -> Result<std::result::Result<(), String>> {
        Ok(match self.call(&["CONFIG", "SET", name, value])? {
            Reply::Error(e) => Err(e),
            _ => Ok(()),
        })
    }

    /// `INFO all`, read into a [`Snapshot`].
    pub fn snapshot(&mut self) -> Result<Snapshot> {
        match self.ok(&["INFO", "all"])? {
            Reply::Text(t) => Ok(Snapshot::parse(&t)),
            r => bail!("INFO: unexpected reply {r:?}"),
        }
    }
}

fn read_reply(r: &mut BufReader<TcpStream>) -> Result<Reply> {
    let mut line = Vec::new();
    r.read_until(b'\n', &mut line)
        .context("failed to read from the server")?;
    ensure!(
        line.len() >= 3 && line.ends_with(b"\r\n"),
        "the server closed the connection"
    );
    let body = String::from_utf8_lossy(&line[1..line.len() - 2]).into_owned();
    let len = || -> Result<i64> { body.parse().with_context(|| format!("bad length {body:?}")) };
    Ok(match line[0] {
        b'+' => Reply::Text(body),
        b'-' => Reply::Error(body),
        b':' => Reply::Int(len()?),
        b'$' => match len()? {
            n if n < 0 => Reply::Nil,
            n => {
                let mut v = vec![0; n as usize + 2];
                r.read_exact(&mut v)
                    .context("failed to read from the server")?;
                v.truncate(n as usize);
                Reply::Text(String::from_utf8_lossy(&v).into_owned())
            }
        },
        b'*' => match len()? {
            n if n < 0 => Reply::Nil,
            n => Reply::Array((0..n).map(|_| read_reply(r)).collect::<Result<_>>()?),
        },
        b => bail!("unexpected reply type {:?}", b as char),
    })
}

/// What `INFO all` says at one instant: the `cmdstat_*` lines (calls and microseconds per
/// command) and every other `field:value`.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// `command` (or `command|subcommand`) -> (calls, usec).
    pub commands: BTreeMap<String, (u64, u64)>,
    pub fields: HashMap<String, String>,
}

impl Snapshot {
    fn parse(text: &str) -> Snapshot {
        let mut s = Snapshot::default();
        for line in text.lines() {
            let Some((k, v)) = line.trim_end().split_once(':') else {
                continue;
            };
            if let Some(cmd) = k.strip_prefix("cmdstat_") {
                let num = |name: &str| {
                    v.split(',')
                        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                        .and_then(|n| n.parse().ok())
                        .unwrap_or(0)
                };
                s.commands
                    .insert(cmd.to_owned(), (num("calls"), num("usec")));
            } else {
                s.fields.insert(k.to_owned(), v.to_owned());
            }
        }
        s
    }

    /// A numeric field (`total_commands_processed`, `aof_current_size`, ...).
    pub fn num(&self, field: &str) -> Option<u64> {
        self.fields.get(field)?.parse().ok()
    }

    /// A field that may be fractional (`used_cpu_user`, ...).
    pub fn float(&self, field: &str) -> Option<f64> {
        self.fields.get(field)?.parse().ok()
    }

    /// The server process's CPU time (user + system, all its threads), in seconds.
    pub fn cpu_seconds(&self) -> Option<f64> {
        Some(self.float("used_cpu_user")? + self.float("used_cpu_sys")?)
    }

    /// Calls and microseconds per command since `before`, commands with no calls left out.
    pub fn since(&self, before: &Snapshot) -> BTreeMap<String, (u64, u64)> {
        self.commands
            .iter()
            .filter_map(|(k, &(calls, usec))| {
                let (c0, u0) = before.commands.get(k).copied().unwrap_or((0, 0));
                let d = calls.saturating_sub(c0);
                (d > 0).then(|| (k.clone(), (d, usec.saturating_sub(u0))))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_info_are_read() {
        let pw = || "pw".to_owned();
        let s = Server::with_password("redis://troupe@127.0.0.1:6390/2?team=x", pw()).unwrap();
        assert_eq!(
            (s.host.as_str(), s.port, s.user.as_deref(), s.db),
            ("127.0.0.1", 6390, Some("troupe"), 2)
        );
        let s = Server::with_password("redis://[::1]", pw()).unwrap();
        assert_eq!(
            (s.host.as_str(), s.port, s.user.as_deref(), s.db),
            ("::1", 6379, None, 0)
        );
        assert!(!format!("{s:?}").contains("pw"));
        let a = Snapshot::parse(
            "# Stats\r\ntotal_commands_processed:10\r\n# Commandstats\r\n\
             cmdstat_xadd:calls=3,usec=30,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n",
        );
        let b = Snapshot::parse(
            "total_commands_processed:17\r\n\
             cmdstat_xadd:calls=5,usec=50,usec_per_call=10.00,rejected_calls=0,failed_calls=0\r\n\
             cmdstat_xgroup|create:calls=1,usec=4,usec_per_call=4.00\r\n",
        );
        assert_eq!(b.num("total_commands_processed"), Some(17));
        let d = b.since(&a);
        assert_eq!(d["xadd"], (2, 20));
        assert_eq!(d["xgroup|create"], (1, 4));
        assert_eq!(d.len(), 2);
    }
}
