//! `lead sandbox check`: the negative checks of the review (`review-3`, "Sandbox negative
//! checks") run in a real command sandbox, built as a teammate's would be with the same flags,
//! in a scratch layout; prints what holds and what this kernel lacks, for people or as JSON.
//!
//! Two processes. `lead sandbox check` makes the scratch layout (a git working dir holding the
//! team dir and a fake key file, a root-only file beside it when run as root, a temp dir of
//! its own, a marker file in the real `/tmp`), then starts itself again (`--scratch DIR`,
//! hidden) the way the supervisor starts a worker, but with a bare environment that names the
//! fake key file in `ANTHROPIC_API_KEY_FILE`: the user's environment and keys are never handed
//! on, so no check can read or print them. That child prepares the sandbox with [`Sandbox::prepare`], runs each
//! check through [`troupe::tools::bash::bash`] (the path a model's command takes) and writes
//! its report into the scratch dir; the first process prints it, removes the scratch layout
//! and exits 0 when every check holds, 1 otherwise.
//!
//! The checks are data ([`CHECKS`]): a name, a shell command and a pure judge of its output.
//! No command prints what it reads: it says `ok` or the error, or counts bytes. Every command
//! is bounded by its timeout, and the fork bomb runs only where a process limit of the
//! command's own binds it.

use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use troupe::{print, println};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use troupe::sandbox::{Limit, Limits, Sandbox, Settings, Status};

/// `lead sandbox`: the sandbox of teammates' commands, seen from the inside.
#[derive(Debug, clap::Args)]
pub struct SandboxArgs {
    #[command(subcommand)]
    command: SandboxCmd,
}

#[derive(Debug, clap::Subcommand)]
enum SandboxCmd {
    /// Run the negative checks (team dir, key file, /proc, signals, /dev/tty, .git, a
    /// root-only file, a fork bomb...) in a real command sandbox, built as a teammate's would
    /// be with these flags, and print what holds and what this kernel lacks.
    ///
    /// Exit status: 0 when every check holds, 1 when one does not or the checks could not
    /// run.
    Check(CheckArgs),
}

#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// One JSON document: {"status": the sandbox's status, "checks": [{"name", "holds",
    /// "detail"}], "all_hold": bool}.
    #[arg(long)]
    json: bool,
    /// The sandbox to check: the flags `lead run` would be given.
    #[command(flatten)]
    sandbox: Settings,
    /// Internal: run the checks in the scratch layout at DIR (the process the check starts).
    #[arg(long, hide = true, value_name = "DIR")]
    scratch: Option<PathBuf>,
}

/// The name the checking process prepares its sandbox under, as a teammate's name.
const NAME: &str = "sandbox-check";

/// How long the checking process may take in all (its sandbox probes and every check's
/// timeout fit well within it); past this it is killed and the scratch layout removed.
const CHILD_DEADLINE: Duration = Duration::from_secs(600);

/// The timeout of one check's command.
const TIMEOUT: Duration = Duration::from_secs(20);

/// The fork bomb's call: its `timeout 10`, the killing and reaping of up to a process limit's
/// worth of processes, and room to spare.
const BOMB_TIMEOUT: Duration = Duration::from_secs(45);

pub fn run(a: SandboxArgs) -> anyhow::Result<u8> {
    let SandboxCmd::Check(c) = a.command;
    match &c.scratch {
        Some(dir) => {
            probe(&Layout { root: dir.clone() }, &c.sandbox)?;
            Ok(0)
        }
        None => check(&c),
    }
}

/// What the checking process reports.
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    status: Status,
    checks: Vec<Verdict>,
    all_hold: bool,
}

/// One check's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Verdict {
    name: String,
    holds: bool,
    detail: String,
}

/// The scratch layout, the same for both processes: every path derives from its root.
struct Layout {
    root: PathBuf,
}

impl Layout {
    /// A git repository, as a teammate's working dir is.
    fn workdir(&self) -> PathBuf {
        self.root.join("work")
    }

    /// The default layout's team dir, inside the working dir.
    fn team_dir(&self) -> PathBuf {
        self.workdir().join(".team")
    }

    /// Inside the working dir, which commands may read and write: only the sandbox's cover
    /// hides it there, as it must hide a key a person keeps in the project.
    fn key_file(&self) -> PathBuf {
        self.workdir().join("anthropic.key")
    }

    /// A 0600 file of root's, outside the working dir (made only when run as root).
    fn root_only(&self) -> PathBuf {
        self.root.join("root-only")
    }

    fn report(&self) -> PathBuf {
        self.root.join("report.json")
    }

    /// The checking process's temp dir, where its sandbox makes its private `/tmp`: whatever
    /// the sandbox leaves there (the mount points of paths bound back over it, the dirs of
    /// probes that failed) goes with the scratch layout.
    fn tmp(&self) -> PathBuf {
        self.root.join("tmp")
    }

    /// A file in the real `/tmp` that commands, whose `/tmp` is their private dir, must not
    /// see.
    fn tmp_marker(&self) -> PathBuf {
        let name = self
            .root
            .file_name()
            .map_or_else(|| "troupe-sandbox-check".into(), |n| n.to_string_lossy());
        Path::new("/tmp").join(format!("{name}.marker"))
    }
}

/// The scratch layout and the marker in the real `/tmp`, removed when dropped.
struct Scratch {
    layout: Layout,
    marker: Option<PathBuf>,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(m) = &self.marker {
            let _ = std::fs::remove_file(m);
        }
        if let Err(e) = std::fs::remove_dir_all(&self.layout.root) {
            tracing::warn!(
                "failed to remove the scratch dir {}: {e}",
                self.layout.root.display()
            );
        }
    }
}

impl Scratch {
    /// Makes the layout in a fresh dir of the temp dir, `fake_key` in the key file. Dirs are
    /// 0755, as a project's usually are, so that a sandbox user other than ours can reach the
    /// working dir as it could a real one.
    fn create(fake_key: &str) -> anyhow::Result<Scratch> {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let root = std::env::temp_dir().join(format!("troupe-sandbox-check-{}", &id[..12]));
        make_dir(&root)?;
        let mut scratch = Scratch {
            layout: Layout { root },
            marker: None,
        };
        let l = &scratch.layout;
        make_dir(&l.tmp())?;
        let work = l.workdir();
        make_dir(&work)?;
        new_file(
            &work.join("README"),
            b"scratch repository of lead sandbox check\n",
            0o644,
        )?;
        git(&work, &["init", "-q"])?;
        git(&work, &["add", "README"])?;
        git(&work, &["commit", "-q", "-m", "scratch"])?;
        let hooks = work.join(".git").join("hooks");
        std::fs::create_dir_all(&hooks)
            .with_context(|| format!("failed to create {}", hooks.display()))?;
        // Readable by anyone: only the sandbox may hide it.
        new_file(&l.key_file(), fake_key.as_bytes(), 0o644)?;
        if nix::unistd::geteuid().is_root() {
            new_file(&l.root_only(), b"root only\n", 0o600)?;
        }
        let marker = l.tmp_marker();
        if Path::new("/tmp").is_dir() {
            new_file(&marker, b"outside the sandbox\n", 0o644)?;
            scratch.marker = Some(marker);
        }
        Ok(scratch)
    }
}

/// A new dir with mode 0755 whatever the umask.
fn make_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .mode(0o755)
        .create(dir)
        .and_then(|()| std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)))
        .with_context(|| format!("failed to create {}", dir.display()))
}

/// A new file (never one that was there) with `mode` whatever the umask.
fn new_file(path: &Path, bytes: &[u8], mode: u32) -> anyhow::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.set_permissions(std::fs::Permissions::from_mode(mode))
        })
        .with_context(|| format!("failed to write {}", path.display()))
}

/// Runs git in the scratch repository, without the user's or the system's git config and
/// hooks.
fn git(dir: &Path, args: &[&str]) -> anyhow::Result<()> {
    let mut cmd = Command::new("git");
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("GIT_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .current_dir(dir)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .args([
            "-c",
            "user.name=troupe",
            "-c",
            "user.email=troupe@localhost",
            "-c",
            "init.defaultBranch=main",
            "-c",
            "core.hooksPath=/dev/null",
            "-c",
            "commit.gpgSign=false",
        ])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("failed to run git (the check makes a scratch repository with it)")?;
    if !out.status.success() {
        bail!(
            "git {} failed in {}: {}",
            args.join(" "),
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// `lead sandbox check`: makes the scratch layout, runs the checking process, prints its
/// report.
fn check(c: &CheckArgs) -> anyhow::Result<u8> {
    let fake_key = format!(
        "sk-ant-troupe-sandbox-check-{}",
        uuid::Uuid::new_v4().simple()
    );
    let scratch = Scratch::create(&fake_key)?;
    let report = run_child(&scratch.layout, &c.sandbox, &fake_key)?;
    drop(scratch);
    if c.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(if report.all_hold { 0 } else { 1 })
}

/// Starts the checking process with a bare environment (the fake key file and variable, no
/// key of the user's), waits for it within [`CHILD_DEADLINE`] (a SIGINT or SIGTERM stops it)
/// and reads its report.
fn run_child(layout: &Layout, settings: &Settings, fake_key: &str) -> anyhow::Result<Report> {
    let exe = std::env::current_exe().context("failed to find this program to run the checks")?;
    let mut cmd = Command::new(exe);
    cmd.args(["sandbox", "check", "--scratch"])
        .arg(&layout.root)
        .args(settings.to_args().map_err(anyhow::Error::msg)?)
        .current_dir(layout.workdir())
        .env_clear();
    for var in ["PATH", "HOME"] {
        if let Some(v) = std::env::var_os(var) {
            cmd.env(var, v);
        }
    }
    // The judges read the C locale's error messages.
    cmd.env("LC_ALL", "C")
        .env("TMPDIR", layout.tmp())
        .env("ANTHROPIC_API_KEY_FILE", layout.key_file())
        .env("ANTHROPIC_API_KEY", fake_key)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    // A Ctrl-C reaches the child (same process group) and stops this process's wait instead
    // of ending it, so the scratch layout is still removed.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, stop.clone())
            .context("failed to set up signal handling")?;
    }
    let mut child = cmd.spawn().context("failed to start the checks")?;
    let deadline = Instant::now() + CHILD_DEADLINE;
    let status = loop {
        if let Some(st) = child.try_wait().context("failed to wait for the checks")? {
            break st;
        }
        let stopped = stop.load(Ordering::SeqCst);
        if stopped || Instant::now() >= deadline {
            // Its keepers see it die and kill their commands.
            let _ = child.kill();
            let _ = child.wait();
            if stopped {
                bail!("interrupted");
            }
            bail!(
                "the checks took more than {} s and were stopped",
                CHILD_DEADLINE.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let path = layout.report();
    let bytes = std::fs::read(&path)
        .with_context(|| format!("the checks ended ({status}) without a report"))?;
    serde_json::from_slice(&bytes).with_context(|| format!("failed to parse {}", path.display()))
}

/// The table for people, the sandbox's status line, what this kernel lacks and the notes.
fn render(r: &Report) -> String {
    use std::fmt::Write;
    let width = r
        .checks
        .iter()
        .map(|c| c.name.len())
        .chain([5])
        .max()
        .unwrap_or(5);
    let mut s = String::new();
    let _ = writeln!(s, "{:width$}  HOLDS  DETAIL", "CHECK");
    for c in &r.checks {
        let holds = if c.holds { "yes" } else { "no" };
        let _ = writeln!(s, "{:width$}  {holds:5}  {}", c.name, c.detail);
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "sandbox: {}", r.status.describe());
    if r.status.missing.is_empty() {
        let _ = writeln!(s, "what this kernel lacks: nothing");
    } else {
        let _ = writeln!(s, "what this kernel lacks:");
        for m in &r.status.missing {
            let _ = writeln!(s, "  - {m}");
        }
    }
    for n in &r.status.notes {
        let _ = writeln!(s, "note: {n}");
    }
    let held = r.checks.iter().filter(|c| c.holds).count();
    let _ = writeln!(s, "{held} of {} checks hold", r.checks.len());
    s
}

/// The checking process: makes the team dir, prepares the sandbox as a teammate's, runs every
/// check and writes the report.
fn probe(layout: &Layout, settings: &Settings) -> anyhow::Result<()> {
    let team = troupe::TeamDir::create(layout.team_dir())?;
    troupe::config::Roster::new(&team).update(|c| {
        if c.member(NAME).is_none() {
            c.members
                .push(troupe::config::Member::new(NAME, "sandbox check"));
        }
        Ok(())
    })?;
    let workdir = layout.workdir();
    let sandbox = Sandbox::prepare(settings, &workdir, team.root(), NAME, None);
    let wd = troupe::tools::fs::Workdir::for_agent(&workdir, &team, sandbox.owner())
        .with_context(|| format!("failed to open the working dir {}", workdir.display()))?;
    let root_only = layout.root_only();
    let ctx = Ctx {
        worker: std::process::id(),
        lead: std::os::unix::process::parent_id(),
        team_dir: team.root().to_path_buf(),
        key_file: layout.key_file(),
        root_only: root_only.exists().then_some(root_only),
        shadow: Path::new("/etc/shadow").exists(),
        tmp_marker: layout.tmp_marker(),
        limits: settings.limits,
    };
    let run = |command: &str, timeout: Duration| {
        let t0 = Instant::now();
        let out = troupe::tools::bash::bash(
            &wd,
            &sandbox,
            &serde_json::json!({ "command": command }),
            timeout,
        );
        Ran {
            text: out.content,
            is_error: out.is_error,
            elapsed: t0.elapsed(),
        }
    };
    let checks = run_checks(&ctx, &run);
    let report = Report {
        status: sandbox.status().clone(),
        all_hold: checks.iter().all(|c| c.holds),
        checks,
    };
    troupe::fsutil::atomic_write(&layout.report(), &serde_json::to_vec(&report)?)?;
    Ok(())
}

/// What the checks are about, as the checking process knows it.
#[derive(Debug, Clone)]
struct Ctx {
    /// The checking process's pid: the worker's.
    worker: u32,
    /// Its parent's: `lead sandbox check`, as `lead run` is a worker's.
    lead: u32,
    team_dir: PathBuf,
    key_file: PathBuf,
    root_only: Option<PathBuf>,
    /// `/etc/shadow` exists.
    shadow: bool,
    tmp_marker: PathBuf,
    limits: Limits,
}

/// What one command gave.
#[derive(Debug, Clone)]
struct Ran {
    text: String,
    /// The call failed (a timeout, a sandbox that refused the command).
    is_error: bool,
    elapsed: Duration,
}

/// One negative check.
struct Check {
    name: &'static str,
    /// Shell run after [`prelude`], in the working dir.
    command: &'static str,
    applies: fn(&Ctx) -> bool,
    /// Whether it holds, and what was seen.
    judge: fn(&Ctx, &Ran) -> (bool, String),
    timeout: Duration,
}

fn always(_: &Ctx) -> bool {
    true
}

/// Runs every check that applies here, in order, through `run`.
fn run_checks(ctx: &Ctx, run: &dyn Fn(&str, Duration) -> Ran) -> Vec<Verdict> {
    CHECKS
        .iter()
        .filter(|c| (c.applies)(ctx))
        .map(|c| {
            let ran = run(&format!("{}{}", prelude(ctx), c.command), c.timeout);
            let (holds, detail) = if ran.is_error && ran.text.starts_with("not run:") {
                (false, first_line(&ran.text).to_owned())
            } else {
                (c.judge)(ctx, &ran)
            };
            Verdict {
                name: c.name.to_owned(),
                holds,
                detail,
            }
        })
        .collect()
}

/// The variables and helpers every command starts with. `opens`, `writes`, `opens_rw` and
/// `res` print `ok` or the error's last part ("Permission denied"), never what they read.
fn prelude(ctx: &Ctx) -> String {
    let q = |p: &Path| sh_quote(&p.to_string_lossy());
    format!(
        "T={}; K={}; R={}; M={}; W={}; L={}\n{HELPERS}",
        q(&ctx.team_dir),
        q(&ctx.key_file),
        sh_quote(
            &ctx.root_only
                .as_deref()
                .map_or_else(String::new, |p| p.to_string_lossy().into_owned())
        ),
        q(&ctx.tmp_marker),
        ctx.worker,
        ctx.lead,
    )
}

const HELPERS: &str = r#"opens() { local e; if e=$(exec 2>&1 3<"$1"); then echo ok; else echo "${e##*: }"; fi; }
writes() { local e; if e=$(exec 2>&1 3>>"$1"); then echo ok; else echo "${e##*: }"; fi; }
opens_rw() { local e; if e=$(exec 2>&1 3<>"$1"); then echo ok; else echo "${e##*: }"; fi; }
res() { local e; if e=$("$@" 2>&1); then echo ok; else echo "${e##*: }"; fi; }
"#;

/// `s` in single quotes for the shell.
fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The checks, in the order they run: the fork bomb last, then whether commands still run.
const CHECKS: &[Check] = &[
    Check {
        name: "team-dir-hidden",
        command: r#"printf 'entries: %s\n' "$(ls -A -- "$T" 2>&1 | tr '\n' ' ')"
printf 'read config.json: %s\n' "$(opens "$T/config.json")"
printf 'create a file: %s\n' "$(writes "$T/troupe-check")"; rm -f -- "$T/troupe-check" 2>/dev/null
printf 'make a dir: %s\n' "$(res mkdir -- "$T/troupe-check.d")"; rmdir -- "$T/troupe-check.d" 2>/dev/null
true"#,
        applies: always,
        judge: judge_team_dir,
        timeout: TIMEOUT,
    },
    Check {
        name: "key-file-hidden",
        command: r#"if [ -n "${ANTHROPIC_API_KEY+x}${ANTHROPIC_API_KEY_FILE+x}" ]; then echo 'variables: set'; else echo 'variables: unset'; fi
if c=$(cat -- "$K" 2>&1); then printf 'read: %s bytes\n' "${#c}"; else printf 'read: %s\n' "${c##*: }"; fi"#,
        applies: always,
        judge: judge_key_file,
        timeout: TIMEOUT,
    },
    Check {
        name: "own-proc",
        command: r#"printf 'pids:'; for d in /proc/[0-9]*; do printf ' %s=%s' "${d#/proc/}" "$(tr ' ' _ 2>/dev/null <"$d/comm")"; done; echo"#,
        applies: always,
        judge: judge_own_proc,
        timeout: TIMEOUT,
    },
    Check {
        name: "worker-environ-hidden",
        command: r#"printf 'pid 1: %s\n' "$(opens /proc/1/environ)"
printf 'worker: %s\n' "$(opens "/proc/$W/environ")""#,
        applies: always,
        judge: judge_worker_environ,
        timeout: TIMEOUT,
    },
    Check {
        name: "lead-environ-hidden",
        command: r#"printf 'lead: %s\n' "$(opens "/proc/$L/environ")""#,
        applies: always,
        judge: judge_lead_environ,
        timeout: TIMEOUT,
    },
    Check {
        name: "no-signal-out",
        command: r#"printf 'worker: %s\n' "$(res kill -0 "$W")"
printf 'lead: %s\n' "$(res kill -0 "$L")""#,
        applies: always,
        judge: judge_signals,
        timeout: TIMEOUT,
    },
    Check {
        name: "no-tty",
        command: r#"printf '/dev/tty: %s\n' "$(opens_rw /dev/tty)""#,
        applies: always,
        judge: judge_tty,
        timeout: TIMEOUT,
    },
    Check {
        name: "git-config-read-only",
        command: r#"printf '.git/config: %s\n' "$(writes .git/config)""#,
        applies: always,
        judge: judge_git_config,
        timeout: TIMEOUT,
    },
    Check {
        name: "git-hooks-read-only",
        command: r#"printf '.git/hooks/pre-commit: %s\n' "$(writes .git/hooks/pre-commit)"
rm -f .git/hooks/pre-commit 2>/dev/null; true"#,
        applies: always,
        judge: judge_git_hooks,
        timeout: TIMEOUT,
    },
    Check {
        name: "git-dir-stays",
        command: r#"if e=$(mv -- .git .git-moved 2>&1); then mv -- .git-moved .git; echo '.git: ok'; else echo ".git: ${e##*: }"; fi"#,
        applies: always,
        judge: judge_git_move,
        timeout: TIMEOUT,
    },
    Check {
        name: "root-only-file",
        command: r#"printf 'file: %s\n' "$(opens "$R")""#,
        applies: |c| c.root_only.is_some(),
        judge: judge_root_only,
        timeout: TIMEOUT,
    },
    Check {
        name: "etc-shadow",
        command: r#"printf 'file: %s\n' "$(opens /etc/shadow)""#,
        applies: |c| c.shadow,
        judge: judge_shadow,
        timeout: TIMEOUT,
    },
    Check {
        name: "no-nested-userns",
        command: r#"e=$(unshare -Urm true 2>&1); s=$?; printf 'unshare: %s %s\n' "$s" "${e##*: }""#,
        applies: always,
        judge: judge_unshare,
        timeout: TIMEOUT,
    },
    Check {
        name: "no-privileges",
        command: r#"grep -E '^(Uid|NoNewPrivs|Seccomp|CapPrm|CapEff|CapBnd):' /proc/self/status"#,
        applies: always,
        judge: judge_privileges,
        timeout: TIMEOUT,
    },
    Check {
        name: "private-tmp",
        command: r#"if [ -e "$M" ]; then echo 'marker: seen'; else echo 'marker: not seen'; fi"#,
        applies: always,
        judge: judge_private_tmp,
        timeout: TIMEOUT,
    },
    Check {
        name: "limits",
        command: r#"printf 'nproc: %s\nas: %s\ncpu: %s\nnofile: %s\n' "$(ulimit -u)" "$(ulimit -v)" "$(ulimit -t)" "$(ulimit -n)"
printf 'oom_score_adj: %s\n' "$(cat /proc/self/oom_score_adj 2>&1)""#,
        applies: always,
        judge: judge_limits,
        timeout: TIMEOUT,
    },
    // Run only where a process limit of the command's own binds it: its own user namespace
    // (so the count is its own, not that of every process of its uid on the host), not uid 0
    // on the host, no capability, and a limit of at most 4096 (this machine's other work
    // keeps the rest). `timeout -s KILL`: a SIGTERM to the group leaves bomb processes born
    // while bash blocked it (around its fork) alive, and the bomb grows back.
    Check {
        name: "fork-bomb",
        command: r#"u=$UID; host=$u; own=yes
read -r a b c </proc/self/uid_map; [ "$a $b $c" = '0 0 4294967295' ] && own=no
while read -r inside outside count; do if [ "$u" -ge "$inside" ] && [ "$u" -lt $((inside + count)) ]; then host=$((outside + u - inside)); fi; done </proc/self/uid_map
n=$(ulimit -u); ce=
while read -r k v _; do [ "$k" = CapEff: ] && ce=$v; done </proc/self/status
printf 'host uid: %s\nown user namespace: %s\nnproc: %s\n' "$host" "$own" "$n"
why=
if [ "$own" = no ]; then why="no user namespace of its own: the process count is that of every process of uid $host here"
elif [ "$host" = 0 ]; then why='commands run as uid 0 on the host, which the process limit may not bind'
elif [ "$ce" != 0000000000000000 ]; then why="commands hold capabilities ($ce)"
elif [ "$n" = unlimited ] || [ "$n" -gt 4096 ]; then why="the process limit is $n"
fi
if [ -n "$why" ]; then echo "fork bomb: not run: $why"; exit 0; fi
printf 'fork failures: '
timeout -s KILL 10 bash -c 'sleep 30 & s=$!; :(){ :|:& };:; wait $s' 2>&1 >/dev/null | grep -c fork
echo "timeout exit: ${PIPESTATUS[0]}""#,
        applies: always,
        judge: judge_fork_bomb,
        timeout: BOMB_TIMEOUT,
    },
    Check {
        name: "runs-after-fork-bomb",
        command: "echo ok",
        applies: always,
        judge: judge_after_bomb,
        timeout: TIMEOUT,
    },
];

/// The value of the first line `LABEL: value` (or `LABEL:\tvalue`).
fn field<'a>(text: &'a str, label: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(label)?.strip_prefix(':'))
        .map(str::trim)
}

fn first_line(text: &str) -> &str {
    text.lines().find(|l| !l.trim().is_empty()).unwrap_or("")
}

/// The verdict on output that lacks what the command prints.
fn unexpected(r: &Ran) -> (bool, String) {
    let kind = if r.is_error {
        "failed"
    } else {
        "unexpected output"
    };
    (false, format!("{kind}: {}", first_line(&r.text)))
}

/// The errno a C-locale message stands for.
fn errno_of(message: &str) -> Option<&'static str> {
    const NAMES: [(&str, &str); 10] = [
        ("No such device or address", "ENXIO"),
        ("Permission denied", "EACCES"),
        ("Operation not permitted", "EPERM"),
        ("No such file or directory", "ENOENT"),
        ("Read-only file system", "EROFS"),
        ("Device or resource busy", "EBUSY"),
        ("No such process", "ESRCH"),
        ("Input/output error", "EIO"),
        ("Resource temporarily unavailable", "EAGAIN"),
        ("Invalid cross-device link", "EXDEV"),
    ];
    NAMES
        .iter()
        .find(|(m, _)| message.contains(m))
        .map(|(_, n)| *n)
}

/// "EROFS" for a helper's error, or the error as it came ("ok" when it worked).
fn outcome(result: &str) -> String {
    match errno_of(result) {
        Some(n) => n.to_owned(),
        None if result.is_empty() => "failed".to_owned(),
        None => result.to_owned(),
    }
}

/// Whether what a helper printed is a refusal.
fn refused(result: &str) -> bool {
    result != "ok"
}

/// Judges a check of helper lines: holds when every labelled step was refused.
fn all_refused(r: &Ran, labels: &[&str]) -> (bool, String) {
    let mut parts = Vec::new();
    let mut holds = true;
    for label in labels {
        let Some(v) = field(&r.text, label) else {
            return unexpected(r);
        };
        holds &= refused(v);
        let shown = if refused(v) {
            outcome(v)
        } else {
            "allowed".to_owned()
        };
        parts.push(format!("{label}: {shown}"));
    }
    (holds, parts.join("; "))
}

fn judge_team_dir(_: &Ctx, r: &Ran) -> (bool, String) {
    let Some(entries) = field(&r.text, "entries") else {
        return unexpected(r);
    };
    let listed = if entries.is_empty() {
        "empty".to_owned()
    } else if entries.contains("cannot") {
        format!("unlistable ({})", outcome(entries))
    } else {
        format!("shows {entries}")
    };
    let hidden = entries.is_empty() || entries.contains("cannot");
    let (refused, steps) = all_refused(r, &["read config.json", "create a file", "make a dir"]);
    (hidden && refused, format!("{listed}; {steps}"))
}

fn judge_key_file(_: &Ctx, r: &Ran) -> (bool, String) {
    let (Some(vars), Some(read)) = (field(&r.text, "variables"), field(&r.text, "read")) else {
        return unexpected(r);
    };
    let (unread, how) = match read.strip_suffix(" bytes") {
        Some("0") => (true, "reads empty".to_owned()),
        Some(n) => (false, format!("reads {n} bytes of the key")),
        None => (true, format!("denied ({})", outcome(read))),
    };
    let env = if vars == "unset" {
        "the key variables are not in the environment"
    } else {
        "a key variable is in the environment"
    };
    (unread && vars == "unset", format!("{how}; {env}"))
}

/// The pids and names `own-proc` lists (the glob's own text, where `/proc` is unreadable,
/// is no pid).
fn listed_pids(text: &str) -> Option<Vec<(u32, &str)>> {
    let list = field(text, "pids")?;
    Some(
        list.split_whitespace()
            .filter_map(|p| {
                let (pid, comm) = p.split_once('=').unwrap_or((p, ""));
                Some((pid.parse().ok()?, comm))
            })
            .collect(),
    )
}

/// At most this many processes are the command's own (bash, the helpers, the sandbox's
/// init): more is the host's.
const OWN_PROCESSES: usize = 32;

fn judge_own_proc(ctx: &Ctx, r: &Ran) -> (bool, String) {
    let Some(pids) = listed_pids(&r.text) else {
        return unexpected(r);
    };
    let seen = |pid: u32| pids.iter().any(|(p, _)| *p == pid);
    let shown: Vec<String> = pids
        .iter()
        .take(8)
        .map(|(p, c)| format!("{p} {c}"))
        .collect();
    let more = if pids.len() > 8 { ", ..." } else { "" };
    let list = format!("{} visible ({}{more})", pids.len(), shown.join(", "));
    if seen(ctx.worker) || seen(ctx.lead) {
        return (
            false,
            format!(
                "the worker (pid {}) or the lead (pid {}) is visible: {list}",
                ctx.worker, ctx.lead
            ),
        );
    }
    if pids.len() > OWN_PROCESSES {
        return (false, format!("the host's processes are visible: {list}"));
    }
    (true, list)
}

fn judge_worker_environ(_: &Ctx, r: &Ran) -> (bool, String) {
    all_refused(r, &["pid 1", "worker"])
}

fn judge_lead_environ(_: &Ctx, r: &Ran) -> (bool, String) {
    all_refused(r, &["lead"])
}

fn judge_signals(_: &Ctx, r: &Ran) -> (bool, String) {
    let (holds, detail) = all_refused(r, &["worker", "lead"]);
    (holds, format!("kill -0: {detail}"))
}

fn judge_tty(_: &Ctx, r: &Ran) -> (bool, String) {
    let Some(v) = field(&r.text, "/dev/tty") else {
        return unexpected(r);
    };
    if !refused(v) {
        return (
            false,
            "/dev/tty opens: the terminal is reachable".to_owned(),
        );
    }
    (true, format!("opening /dev/tty fails with {}", outcome(v)))
}

fn judge_git_config(_: &Ctx, r: &Ran) -> (bool, String) {
    all_refused(r, &[".git/config"])
}

fn judge_git_hooks(_: &Ctx, r: &Ran) -> (bool, String) {
    all_refused(r, &[".git/hooks/pre-commit"])
}

fn judge_git_move(_: &Ctx, r: &Ran) -> (bool, String) {
    let (holds, detail) = all_refused(r, &[".git"]);
    (
        holds,
        format!("mv .git: {}", detail.trim_start_matches(".git: ")),
    )
}

fn judge_root_only(ctx: &Ctx, r: &Ran) -> (bool, String) {
    let (holds, detail) = all_refused(r, &["file"]);
    let path = ctx
        .root_only
        .as_deref()
        .map_or_else(String::new, |p| p.display().to_string());
    (
        holds,
        format!(
            "{path} (0600, root): {}",
            detail.trim_start_matches("file: ")
        ),
    )
}

fn judge_shadow(_: &Ctx, r: &Ran) -> (bool, String) {
    let (holds, detail) = all_refused(r, &["file"]);
    let shown = if holds {
        detail.trim_start_matches("file: ").to_owned()
    } else {
        "opens: commands can read root's files".to_owned()
    };
    (holds, format!("/etc/shadow: {shown}"))
}

fn judge_unshare(_: &Ctx, r: &Ran) -> (bool, String) {
    let Some(v) = field(&r.text, "unshare") else {
        return unexpected(r);
    };
    let (code, message) = v.split_once(' ').unwrap_or((v, ""));
    match code {
        "0" => (false, "unshare -Urm true succeeded".to_owned()),
        "127" => (false, "not tested: unshare is not installed".to_owned()),
        _ => (
            true,
            format!("unshare -Urm refused: {}", outcome(message.trim())),
        ),
    }
}

fn judge_privileges(_: &Ctx, r: &Ran) -> (bool, String) {
    let (Some(nnp), Some(eff), Some(prm)) = (
        field(&r.text, "NoNewPrivs"),
        field(&r.text, "CapEff"),
        field(&r.text, "CapPrm"),
    ) else {
        return unexpected(r);
    };
    let none = |caps: &str| caps.chars().all(|c| c == '0');
    let bnd = field(&r.text, "CapBnd").unwrap_or("?");
    let uid = field(&r.text, "Uid")
        .and_then(|u| u.split_whitespace().next())
        .unwrap_or("?");
    let seccomp = field(&r.text, "Seccomp").unwrap_or("?");
    (
        nnp == "1" && none(eff) && none(prm),
        format!(
            "NoNewPrivs {nnp}, CapEff {eff}, CapPrm {prm}, CapBnd {bnd}, uid {uid}, \
             Seccomp {seccomp}"
        ),
    )
}

fn judge_private_tmp(ctx: &Ctx, r: &Ran) -> (bool, String) {
    match field(&r.text, "marker") {
        Some("not seen") => (true, format!("{} is not seen", ctx.tmp_marker.display())),
        Some("seen") => (
            false,
            format!("{} is seen: /tmp is the host's", ctx.tmp_marker.display()),
        ),
        _ => unexpected(r),
    }
}

/// Whether a limit `ulimit` shows (in `unit` bytes or counts) is within the setting.
fn within(shown: &str, setting: Limit, unit: u64) -> bool {
    match setting.0 {
        None => true,
        Some(max) => shown
            .parse::<u64>()
            .is_ok_and(|v| v.saturating_mul(unit) <= max),
    }
}

fn judge_limits(ctx: &Ctx, r: &Ran) -> (bool, String) {
    let l = &ctx.limits;
    let rows = [
        ("nproc", l.nproc, 1, ""),
        ("as", l.mem, 1024, " KiB"),
        ("cpu", l.cpu, 1, " s"),
        ("nofile", l.nofile, 1, ""),
    ];
    let mut holds = true;
    let mut parts = Vec::new();
    for (label, setting, unit, suffix) in rows {
        let Some(v) = field(&r.text, label) else {
            return unexpected(r);
        };
        let ok = within(v, setting, unit);
        holds &= ok;
        let unit_shown = if v == "unlimited" { "" } else { suffix };
        let over = if ok {
            String::new()
        } else {
            format!(" (over --sandbox-{}: {setting})", flag_of(label))
        };
        parts.push(format!("{label} {v}{unit_shown}{over}"));
    }
    let Some(oom) = field(&r.text, "oom_score_adj") else {
        return unexpected(r);
    };
    holds &= oom == "1000";
    parts.push(format!("oom_score_adj {oom}"));
    (holds, parts.join(", "))
}

/// The flag of a limit `ulimit` shows.
fn flag_of(label: &str) -> &str {
    match label {
        "as" => "mem",
        other => other,
    }
}

fn judge_fork_bomb(_: &Ctx, r: &Ran) -> (bool, String) {
    if let Some(why) = field(&r.text, "fork bomb") {
        return (false, why.to_owned());
    }
    let nproc = field(&r.text, "nproc").unwrap_or("?");
    let took = r.elapsed.as_secs_f64();
    if r.is_error {
        return (
            false,
            format!("ended only by the bash tool's timeout, after {took:.1} s"),
        );
    }
    let (Some(failures), Some(exit)) = (
        field(&r.text, "fork failures").and_then(|f| f.parse::<u64>().ok()),
        field(&r.text, "timeout exit"),
    ) else {
        return unexpected(r);
    };
    // SIGKILL to timeout's process group, itself included (137), or to bash alone (124).
    let ended = match exit {
        "124" | "137" => "ended by timeout 10",
        _ => "ended by itself",
    };
    if failures == 0 {
        return (
            false,
            format!(
                "no fork failed: the process limit ({nproc}) was not reached; {ended}; the \
                 call returned in {took:.1} s"
            ),
        );
    }
    (
        true,
        format!(
            "held at the process limit ({nproc}: {failures} failed forks), {ended}; the call \
             returned in {took:.1} s"
        ),
    )
}

fn judge_after_bomb(_: &Ctx, r: &Ran) -> (bool, String) {
    let took = r.elapsed.as_secs_f64();
    if r.is_error || r.text.trim() != "ok" {
        return unexpected(r);
    }
    if r.elapsed > Duration::from_secs(10) {
        return (false, format!("a command took {took:.1} s"));
    }
    (true, format!("a command ran in {took:.2} s"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> Ctx {
        Ctx {
            worker: 4242,
            lead: 4241,
            team_dir: "/tmp/s/work/.team".into(),
            key_file: "/tmp/s/work/anthropic.key".into(),
            root_only: Some("/tmp/s/root-only".into()),
            shadow: true,
            tmp_marker: "/tmp/s.marker".into(),
            limits: Limits::default(),
        }
    }

    fn ran(text: &str) -> Ran {
        Ran {
            text: text.to_owned(),
            is_error: false,
            elapsed: Duration::from_millis(30),
        }
    }

    fn judge(name: &str, text: &str) -> (bool, String) {
        let c = CHECKS.iter().find(|c| c.name == name).expect("a check");
        (c.judge)(&ctx(), &ran(text))
    }

    #[test]
    fn every_command_is_valid_shell_and_names_are_unique() {
        let mut names: Vec<&str> = CHECKS.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CHECKS.len());
        for c in CHECKS {
            let script = format!("{}{}", prelude(&ctx()), c.command);
            let out = Command::new("bash")
                .args(["-n", "-c", &script])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{}: {}",
                c.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }

    #[test]
    fn helpers_print_ok_or_the_error_never_the_content() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("secret");
        std::fs::write(&secret, "sk-secret").unwrap();
        let script = format!(
            "{HELPERS}printf 'a: %s\\n' \"$(opens {})\"; printf 'b: %s\\n' \"$(opens {}/none)\"",
            sh_quote(&secret.to_string_lossy()),
            sh_quote(&dir.path().to_string_lossy())
        );
        let out = Command::new("bash")
            .args(["-c", &script])
            .env("LC_ALL", "C")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(field(&text, "a"), Some("ok"));
        assert_eq!(field(&text, "b"), Some("No such file or directory"));
        assert!(!text.contains("sk-secret"));
    }

    #[test]
    fn quoting_survives_quotes() {
        let out = Command::new("bash")
            .args(["-c", &format!("printf %s {}", sh_quote("it's a $x `y`"))])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it's a $x `y`");
    }

    #[test]
    fn team_dir() {
        let hidden = "entries: \nread config.json: No such file or directory\n\
                      create a file: Read-only file system\nmake a dir: Read-only file system\n";
        let (holds, detail) = judge("team-dir-hidden", hidden);
        assert!(holds, "{detail}");
        assert!(detail.starts_with("empty;") && detail.contains("create a file: EROFS"));
        let open = "entries: config.json inbox logs \nread config.json: ok\n\
                    create a file: ok\nmake a dir: ok\n";
        let (holds, detail) = judge("team-dir-hidden", open);
        assert!(!holds);
        assert!(detail.contains("shows config.json") && detail.contains("allowed"));
        let listed_only = "entries: \nread config.json: ok\ncreate a file: Permission denied\n\
                           make a dir: Permission denied\n";
        assert!(!judge("team-dir-hidden", listed_only).0);
        assert!(!judge("team-dir-hidden", "garbage").0);
    }

    #[test]
    fn key_file() {
        assert!(judge("key-file-hidden", "variables: unset\nread: 0 bytes\n").0);
        assert!(
            judge(
                "key-file-hidden",
                "variables: unset\nread: Permission denied\n"
            )
            .0
        );
        let (holds, detail) = judge("key-file-hidden", "variables: unset\nread: 60 bytes\n");
        assert!(!holds && detail.contains("60 bytes"), "{detail}");
        assert!(!judge("key-file-hidden", "variables: set\nread: 0 bytes\n").0);
    }

    #[test]
    fn own_proc() {
        let (holds, detail) = judge("own-proc", "pids: 1=lead 2=bash 5=bash 6=tr\n");
        assert!(holds, "{detail}");
        assert!(detail.starts_with("4 visible (1 lead, 2 bash"));
        assert!(!judge("own-proc", "pids: 1=systemd 4241=lead 4242=lead 9=bash\n").0);
        let many: String = (100..200).map(|p| format!(" {p}=x")).collect();
        assert!(!judge("own-proc", &format!("pids:{many}\n")).0);
        // /proc unreadable: the glob stays as it is, no process is seen.
        assert!(judge("own-proc", "pids: [0-9]*=\n").0);
    }

    #[test]
    fn environs_and_signals() {
        let denied = "pid 1: Permission denied\nworker: No such file or directory\n";
        let (holds, detail) = judge("worker-environ-hidden", denied);
        assert!(holds);
        assert_eq!(detail, "pid 1: EACCES; worker: ENOENT");
        assert!(!judge("worker-environ-hidden", "pid 1: ok\nworker: ENOENT\n").0);
        assert!(judge("lead-environ-hidden", "lead: No such file or directory\n").0);
        assert!(!judge("lead-environ-hidden", "lead: ok\n").0);
        let (holds, detail) = judge(
            "no-signal-out",
            "worker: (4242) - No such process\nlead: (4241) - No such process\n",
        );
        assert!(holds);
        assert_eq!(detail, "kill -0: worker: ESRCH; lead: ESRCH");
        assert!(
            !judge(
                "no-signal-out",
                "worker: ok\nlead: Operation not permitted\n"
            )
            .0
        );
    }

    #[test]
    fn tty_reports_the_errno() {
        let (holds, detail) = judge("no-tty", "/dev/tty: No such device or address\n");
        assert!(holds);
        assert_eq!(detail, "opening /dev/tty fails with ENXIO");
        let (holds, detail) = judge("no-tty", "/dev/tty: Permission denied\n");
        assert!(holds && detail.ends_with("EACCES"));
        assert!(!judge("no-tty", "/dev/tty: ok\n").0);
    }

    #[test]
    fn git() {
        assert!(
            judge(
                "git-config-read-only",
                ".git/config: Read-only file system\n"
            )
            .0
        );
        assert!(!judge("git-config-read-only", ".git/config: ok\n").0);
        assert!(
            judge(
                "git-hooks-read-only",
                ".git/hooks/pre-commit: Read-only file system\n"
            )
            .0
        );
        assert!(!judge("git-hooks-read-only", ".git/hooks/pre-commit: ok\n").0);
        let (holds, detail) = judge("git-dir-stays", ".git: Device or resource busy\n");
        assert!(holds);
        assert_eq!(detail, "mv .git: EBUSY");
        assert!(!judge("git-dir-stays", ".git: ok\n").0);
    }

    #[test]
    fn root_files() {
        let (holds, detail) = judge("root-only-file", "file: No such file or directory\n");
        assert!(holds);
        assert_eq!(detail, "/tmp/s/root-only (0600, root): ENOENT");
        assert!(!judge("root-only-file", "file: ok\n").0);
        assert!(judge("etc-shadow", "file: Permission denied\n").0);
        let (holds, detail) = judge("etc-shadow", "file: ok\n");
        assert!(!holds && detail.contains("can read root's files"));
    }

    #[test]
    fn nested_user_namespaces() {
        assert!(
            judge(
                "no-nested-userns",
                "unshare: 1 unshare failed: Operation not permitted\n"
            )
            .0
        );
        assert!(!judge("no-nested-userns", "unshare: 0 \n").0);
        let (holds, detail) = judge("no-nested-userns", "unshare: 127 command not found\n");
        assert!(!holds && detail.starts_with("not tested"));
    }

    #[test]
    fn privileges() {
        let text = "Uid:\t65534\t65534\t65534\t65534\nNoNewPrivs:\t1\nSeccomp:\t0\n\
                    CapPrm:\t0000000000000000\nCapEff:\t0000000000000000\n\
                    CapBnd:\t0000000000000000\n";
        let (holds, detail) = judge("no-privileges", text);
        assert!(holds, "{detail}");
        assert!(detail.starts_with("NoNewPrivs 1, CapEff 0000000000000000"));
        assert!(detail.contains("uid 65534"));
        assert!(
            !judge(
                "no-privileges",
                &text.replace("NoNewPrivs:\t1", "NoNewPrivs:\t0")
            )
            .0
        );
        let caps = text.replace("CapEff:\t0000000000000000", "CapEff:\t000001ffffffffff");
        assert!(!judge("no-privileges", &caps).0);
    }

    #[test]
    fn private_tmp() {
        assert!(judge("private-tmp", "marker: not seen\n").0);
        assert!(!judge("private-tmp", "marker: seen\n").0);
    }

    #[test]
    fn limits() {
        let ok = "nproc: 1024\nas: 8388608\ncpu: 600\nnofile: 4096\noom_score_adj: 1000\n";
        let (holds, detail) = judge("limits", ok);
        assert!(holds, "{detail}");
        assert_eq!(
            detail,
            "nproc 1024, as 8388608 KiB, cpu 600 s, nofile 4096, oom_score_adj 1000"
        );
        let lower = "nproc: 512\nas: 1024\ncpu: 1\nnofile: 64\noom_score_adj: 1000\n";
        assert!(judge("limits", lower).0);
        let (holds, detail) = judge("limits", &ok.replace("nproc: 1024", "nproc: unlimited"));
        assert!(
            !holds && detail.contains("over --sandbox-nproc: 1024"),
            "{detail}"
        );
        assert!(!judge("limits", &ok.replace("as: 8388608", "as: 8388609")).0);
        assert!(
            !judge(
                "limits",
                &ok.replace("oom_score_adj: 1000", "oom_score_adj: 0")
            )
            .0
        );
        assert!(within("99999", Limit(None), 1));
    }

    #[test]
    fn fork_bomb() {
        let held = "host uid: 65534\nown user namespace: yes\nnproc: 1024\n\
                    fork failures: 812\ntimeout exit: 124\n";
        let (holds, detail) = judge("fork-bomb", held);
        assert!(holds, "{detail}");
        assert!(detail.starts_with(
            "held at the process limit (1024: 812 failed forks), ended by timeout 10"
        ));
        let unbound = held.replace("fork failures: 812", "fork failures: 0");
        assert!(!judge("fork-bomb", &unbound).0);
        let skipped = "host uid: 0\nown user namespace: yes\nnproc: 1024\n\
                       fork bomb: not run: commands run as uid 0 on the host, which the \
                       process limit may not bind\n";
        let (holds, detail) = judge("fork-bomb", skipped);
        assert!(!holds && detail.starts_with("not run: commands run as uid 0"));
        let c = CHECKS.iter().find(|c| c.name == "fork-bomb").unwrap();
        let mut killed = ran("host uid: 65534\nfork failures: ");
        killed.is_error = true;
        let (holds, detail) = (c.judge)(&ctx(), &killed);
        assert!(!holds && detail.contains("bash tool's timeout"));
    }

    #[test]
    fn after_the_bomb() {
        assert!(judge("runs-after-fork-bomb", "ok\n").0);
        assert!(!judge("runs-after-fork-bomb", "").0);
        let c = CHECKS
            .iter()
            .find(|c| c.name == "runs-after-fork-bomb")
            .unwrap();
        let mut slow = ran("ok");
        slow.elapsed = Duration::from_secs(11);
        assert!(!(c.judge)(&ctx(), &slow).0);
    }

    #[test]
    fn a_refused_sandbox_fails_every_check_that_applies() {
        let mut c = ctx();
        c.root_only = None;
        c.shadow = false;
        let refused = |_: &str, _: Duration| Ran {
            text: "not run: the sandbox is required (--sandbox required) but unavailable here"
                .to_owned(),
            is_error: true,
            elapsed: Duration::ZERO,
        };
        let v = run_checks(&c, &refused);
        assert_eq!(v.len(), CHECKS.len() - 2);
        assert!(
            v.iter()
                .all(|v| !v.holds && v.detail.starts_with("not run:"))
        );
    }

    #[test]
    fn the_table_ends_with_the_status_and_what_is_missing() {
        let r = Report {
            status: Status {
                missing: vec!["Landlock: this kernel does not offer it".to_owned()],
                ..Status::default()
            },
            checks: vec![
                Verdict {
                    name: "own-proc".to_owned(),
                    holds: true,
                    detail: "3 visible".to_owned(),
                },
                Verdict {
                    name: "no-tty".to_owned(),
                    holds: false,
                    detail: "/dev/tty opens".to_owned(),
                },
            ],
            all_hold: false,
        };
        let t = render(&r);
        assert!(
            t.starts_with("CHECK     HOLDS  DETAIL\nown-proc  yes    3 visible\n"),
            "{t}"
        );
        assert!(t.contains("no-tty    no     /dev/tty opens\n"));
        assert!(t.contains("\nsandbox: partial ("));
        assert!(
            t.contains("what this kernel lacks:\n  - Landlock: this kernel does not offer it\n")
        );
        assert!(t.ends_with("1 of 2 checks hold\n"));
    }
}
