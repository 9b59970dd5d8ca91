//! The sandbox of the `bash` tool: what a command an agent runs can see and touch.
//!
//! Each command runs, where the kernel offers it (see docs/security.md):
//!
//! - in new **user, PID and mount namespaces** (PID and mount only, as root without user
//!   namespaces): its own `/proc` shows only its own processes, so no other process's
//!   environment or memory can be read; `/run` (the service manager's and D-Bus's sockets) and
//!   `/dev/shm` are empty, `/tmp` is the agent's private temp dir, the team dir is covered by an
//!   empty read-only tmpfs and key files by `/dev/null`;
//! - under **Landlock**: reads only in the system's trees (`/usr`, `/etc`, `/bin`, `/lib`...,
//!   `/sys`), writes only in the working dir and the private temp dir (plus `/dev/null` and the
//!   like), plus the dirs the user adds; signals and abstract unix sockets stay inside (ABI 6);
//!   a member's git worktree also gets its own store (its git dir) to write, and its
//!   repository's git dir to read only (see [`crate::worktree::GitDirs`]);
//! - with **no capabilities** and no new privileges, and never as uid 0: as root, as `nobody`
//!   (a setting), given a working dir only root may use through idmapped mounts of it (see
//!   `plan::Idmap`); otherwise as the worker's own user.
//!
//! The worker probes once, at start, which of these work here ([`Sandbox::prepare`]) and
//! records the result in its member's `sandbox` status. The plan of the children is built
//! before any fork (`plan`); the children's system calls are in `enter`, run by the keeper
//! (`crate::tools::keeper`).

pub(crate) mod enter;
pub(crate) mod plan;

use std::fmt;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use landlock::{
    ABI, Access, AccessFs, BitFlags, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, Scope,
};
use serde::{Deserialize, Serialize};

use plan::{Facts, Namespaces, Plan, RunAs};
pub use plan::{Limit, Limits};

/// How hard the sandbox is insisted on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mode {
    /// Everything below must be in force, or `bash` refuses to run commands.
    Required,
    /// What the kernel offers is used; what it does not is skipped, said once in the log and
    /// in the member's `sandbox` status.
    #[default]
    BestEffort,
    /// Commands run as the worker's own user, confined by nothing but the working directory
    /// they start in.
    Off,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Required => "required",
            Mode::BestEffort => "best-effort",
            Mode::Off => "off",
        }
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.as_str())
    }
}

impl FromStr for Mode {
    type Err = String;
    fn from_str(s: &str) -> Result<Mode, String> {
        match s {
            "required" => Ok(Mode::Required),
            "best-effort" => Ok(Mode::BestEffort),
            "off" => Ok(Mode::Off),
            _ => Err(format!(
                "unknown sandbox mode {s:?}: expected required, best-effort or off"
            )),
        }
    }
}

/// The sandbox settings of `lead run`, `worker`, `lead chat` and `lead demo` (the same flags
/// on each; `lead run` hands them to its workers).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct Settings {
    /// Sandbox of the bash tool: required (refuse to run commands without it), best-effort
    /// (use what the kernel offers) or off.
    #[arg(
        long = "sandbox",
        env = "TROUPE_SANDBOX",
        default_value = "best-effort",
        value_name = "MODE"
    )]
    pub mode: Mode,
    /// A directory commands may also read (repeatable).
    #[arg(long = "sandbox-read", value_name = "DIR", value_parser = crate::fsutil::absolute_arg)]
    pub read: Vec<PathBuf>,
    /// A file or directory commands may not see, whatever their user may read (repeatable;
    /// `/etc/troupe` always is): where a unit's `LoadCredential=` or `EnvironmentFile=` sources
    /// live.
    #[arg(long = "sandbox-hide", value_name = "PATH", value_parser = crate::fsutil::absolute_arg)]
    pub hide: Vec<PathBuf>,
    /// A directory commands may also write, such as a cache like ~/.cargo (repeatable).
    #[arg(long = "sandbox-write", value_name = "DIR", value_parser = crate::fsutil::absolute_arg)]
    pub write: Vec<PathBuf>,
    /// When troupe runs as root: the unprivileged user commands run as (name or uid; default
    /// nobody; never root). Where it may not use the working directory, it gets it through
    /// idmapped mounts.
    #[arg(long = "sandbox-user", value_name = "USER")]
    pub user: Option<String>,
    /// The resource limits of each command.
    #[command(flatten)]
    pub limits: Limits,
}

impl Settings {
    /// The arguments that parse back into these (what `lead run` gives its workers).
    pub fn to_args(&self) -> Result<Vec<String>, String> {
        let Settings {
            mode,
            read,
            hide,
            write,
            user,
            limits,
        } = self;
        let mut args = vec!["--sandbox".to_owned(), mode.as_str().to_owned()];
        for (flag, dirs) in [
            ("--sandbox-read", read),
            ("--sandbox-hide", hide),
            ("--sandbox-write", write),
        ] {
            for d in dirs {
                let d = d
                    .to_str()
                    .ok_or_else(|| format!("{flag} {} is not valid UTF-8", d.display()))?;
                args.extend([flag.to_owned(), d.to_owned()]);
            }
        }
        if let Some(u) = user {
            args.extend(["--sandbox-user".to_owned(), u.clone()]);
        }
        args.extend(limits.to_args());
        Ok(args)
    }
}

/// What the sandbox of an agent's commands is, as found when it started: recorded in the
/// member's `sandbox` field of `config.json` and shown by `lead status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub mode: Mode,
    /// Every protection below is in force (`missing` is empty).
    pub active: bool,
    /// The Landlock ABI the kernel offers (0: none).
    #[serde(default)]
    pub landlock_abi: u32,
    /// Namespaces commands run in ("user+pid+mount", "pid+mount", or "none").
    #[serde(default)]
    pub namespaces: String,
    /// Who commands run as.
    #[serde(default)]
    pub user: String,
    /// The team dir is hidden from commands.
    #[serde(default)]
    pub team_dir_hidden: bool,
    /// The commands' private temp dir (their `/tmp`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tmp: Option<PathBuf>,
    /// What could not be set up, and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// Choices made at start that people should know of (such as why commands do not run as
    /// `nobody`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Set when `bash` refuses to run commands (`required` and something is missing).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
}

impl Status {
    /// One line for people: "on (landlock 7, user+pid+mount namespaces, as nobody)",
    /// "off: tools run unsandboxed", ...
    pub fn describe(&self) -> String {
        if self.mode == Mode::Off {
            return "off: tools run unsandboxed".to_owned();
        }
        if let Some(r) = &self.refused {
            return format!("required but unavailable, bash refused: {r}");
        }
        let how = format!(
            "landlock {}, {} namespaces, as {}",
            self.landlock_abi, self.namespaces, self.user
        );
        if self.active {
            format!("on ({how})")
        } else {
            format!("partial ({how}; missing: {})", self.missing.join("; "))
        }
    }
}

/// The system trees commands may read (and execute), where they exist.
const SYSTEM_TREES: [&str; 10] = [
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/sys",
];

/// Device files commands may read and write. `/dev/tty` without device ioctls: a command has
/// no controlling terminal (it runs in a session of its own), so opening it fails with ENXIO,
/// as programs that look for a terminal expect.
const DEVICES: [&str; 6] = [
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
    "/dev/tty",
];

/// What commands may do with a device file: read and write it, and its device ioctls except on
/// `/dev/tty` (see [`DEVICES`]).
fn device_access(dev: &Path, file_rw: BitFlags<AccessFs>) -> BitFlags<AccessFs> {
    if dev == Path::new("/dev/tty") {
        file_rw & !BitFlags::from(AccessFs::IoctlDev)
    } else {
        file_rw
    }
}

/// Hidden from commands whenever it exists: where the shipped units keep their secrets
/// (`LoadCredential=` sources), readable by root or the unit's user.
const HIDDEN_ALWAYS: &str = "/etc/troupe";

/// The uid and gid of `nobody` where the user database does not say.
const NOBODY: (libc::uid_t, libc::gid_t) = (65534, 65534);

/// The sandbox of one agent's commands, prepared once when the agent starts.
#[derive(Debug)]
pub struct Sandbox {
    status: Status,
    /// What each command's children do; `None` with `--sandbox off`, or when nothing could be
    /// set up at all.
    plan: Option<Arc<Plan>>,
    /// Landlock rules built in the worker for each command: path and access.
    rules: Vec<(PathBuf, BitFlags<AccessFs>)>,
    /// The Landlock ABI whose rights are asked for (0: no Landlock).
    abi: u32,
    /// `TMPDIR` of the commands.
    tmpdir: Option<PathBuf>,
    /// The resource limits of each command, in every mode.
    limits: Limits,
}

impl Drop for Sandbox {
    /// The private temp dir goes when the agent ends, if the commands left it empty.
    fn drop(&mut self) {
        if let Some(t) = &self.status.tmp {
            let _ = std::fs::remove_dir(t);
        }
    }
}

/// What a command needs of its sandbox: built in the worker just before the fork.
pub(crate) struct ForCommand {
    pub plan: Arc<Plan>,
    /// A fresh Landlock ruleset with the worker-side rules, or `None`.
    pub ruleset: Option<OwnedFd>,
    pub tmpdir: Option<PathBuf>,
}

impl Sandbox {
    /// Prepares the sandbox for an agent named `name` working in `workdir` of the team at
    /// `team_dir`: probes what this kernel and user can set up (by running a trivial command
    /// through it) and keeps the strongest that works. Never fails: what cannot be set up is in
    /// [`Sandbox::status`], said once in the log, and with [`Mode::Required`] commands are then
    /// refused.
    ///
    /// `worktree` is the member's worktree as the roster records it: what git may write is
    /// derived from it, never from a file in the working dir.
    pub fn prepare(
        settings: &Settings,
        workdir: &Path,
        team_dir: &Path,
        name: &str,
        worktree: Option<&crate::worktree::Worktree>,
    ) -> Sandbox {
        if settings.mode == Mode::Off {
            tracing::info!("sandbox off: bash commands run unsandboxed, as this process's user");
            let mut sb = Sandbox::off();
            sb.limits = settings.limits;
            sb.status.notes.extend(sb.nproc_note());
            return sb;
        }
        let sb = Sandbox::prepare_quietly(settings, workdir, team_dir, name, worktree);
        let st = &sb.status;
        if let Some(r) = &st.refused {
            tracing::error!("sandbox required but unavailable ({r}): bash will not run commands");
        } else if st.active {
            tracing::info!("sandbox {}", st.describe());
        } else {
            tracing::warn!("sandbox {}", st.describe());
        }
        sb
    }

    /// [`Sandbox::prepare`] without a word in the log (for a check before the team starts).
    pub fn prepare_quietly(
        settings: &Settings,
        workdir: &Path,
        team_dir: &Path,
        name: &str,
        worktree: Option<&crate::worktree::Worktree>,
    ) -> Sandbox {
        let git = crate::worktree::GitDirs::for_member(workdir, worktree);
        let mut sb = probe_all(settings, workdir, team_dir, name, &git);
        sb.status.notes.extend(sb.nproc_note());
        sb
    }

    /// No sandbox at all (unit tests, `--sandbox off`).
    pub fn off() -> Sandbox {
        Sandbox {
            status: Status {
                mode: Mode::Off,
                namespaces: Namespaces::None.describe().to_owned(),
                user: "this process's user".to_owned(),
                ..Status::default()
            },
            plan: None,
            rules: Vec::new(),
            abi: 0,
            tmpdir: None,
            limits: Limits::default(),
        }
    }

    pub fn status(&self) -> &Status {
        &self.status
    }

    /// The limits a command's process sets (see [`Limits`]). The kernel counts processes per
    /// user, in each user namespace apart: the process limit is per command where commands get
    /// a user namespace of their own or run as a user of their own (`nobody`). Where they run
    /// as the worker's own user in its namespace (`--sandbox off` or no user namespaces, not
    /// root) it would count every process of that user, the team's own included, and is not
    /// set; uid 0 is exempt from it (see [`Sandbox::nproc_note`]).
    pub(crate) fn rlimits(&self) -> enter::Rlimits {
        let l = &self.limits;
        enter::Rlimits {
            nproc: if self.nproc_shared() {
                libc::RLIM_INFINITY
            } else {
                l.nproc.rlim()
            },
            mem: l.mem.rlim(),
            cpu: l.cpu.rlim(),
            nofile: l.nofile.rlim(),
        }
    }

    /// Commands run as the worker's own non-root user without a user namespace of their own.
    fn nproc_shared(&self) -> bool {
        !nix::unistd::geteuid().is_root()
            && self
                .plan
                .as_ref()
                .is_none_or(|p| p.ns != Namespaces::UserPidMount)
    }

    /// Says where the process limit does not hold: commands that run as uid 0 (root, or root
    /// of their own user namespace) are exempt from RLIMIT_NPROC, and where the count would be
    /// shared it is not set.
    fn nproc_note(&self) -> Option<String> {
        self.limits.nproc.0?;
        let uid = nix::unistd::geteuid();
        if self.nproc_shared() {
            return Some(format!(
                "no process limit (--sandbox-nproc): without a user namespace of their own, \
                 commands would share the count of every process of uid {uid}, the team's own \
                 included"
            ));
        }
        let as_root = uid.is_root() && self.plan.as_ref().is_none_or(|p| p.switch_to.is_none());
        as_root.then(|| {
            "the process limit (--sandbox-nproc) does not hold: commands run as uid 0, which \
             the kernel exempts from it"
                .to_owned()
        })
    }

    /// The uid and gid commands run as when that is another user than this process's (troupe
    /// run as root): the owner the file tools give what they make, so commands can change it.
    /// With idmapped mounts files keep their owner on disk (the command sees them as its own):
    /// `None`.
    pub fn owner(&self) -> Option<(libc::uid_t, libc::gid_t)> {
        self.plan
            .as_ref()
            .filter(|p| p.idmap.is_none())
            .and_then(|p| p.switch_to)
    }

    /// What the next command runs in; `Ok(None)` when unsandboxed.
    pub(crate) fn for_command(&self) -> Result<Option<ForCommand>, String> {
        let Some(plan) = &self.plan else {
            return Ok(None);
        };
        let ruleset = if self.abi > 0 {
            self.ruleset().map_err(|e| format!("landlock: {e}"))?
        } else {
            None
        };
        Ok(Some(ForCommand {
            plan: plan.clone(),
            ruleset,
            tmpdir: self.tmpdir.clone(),
        }))
    }

    /// A new ruleset with the rules of every path the worker can name (the sandbox's own
    /// `/proc` and `/dev/shm` are added by the command's process).
    fn ruleset(&self) -> Result<Option<OwnedFd>, landlock::RulesetError> {
        let abi = abi_of(self.abi);
        let mut rs = Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(abi))?
            .scope(Scope::Signal | Scope::AbstractUnixSocket)?
            .create()?;
        for (path, access) in &self.rules {
            // A path gone since the agent started is simply not allowed.
            if let Ok(fd) = PathFd::new(path) {
                rs = rs.add_rule(PathBeneath::new(fd, *access))?;
            }
        }
        Ok(rs.into())
    }
}

/// The crate's ABI for the kernel's version (capped at 6: scopes; 7 adds only logging).
fn abi_of(v: u32) -> ABI {
    ABI::from(v.min(6) as i32)
}

/// The Landlock ABI version the kernel offers (0: none).
pub fn kernel_landlock_abi() -> u32 {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: the version query takes no attribute pointer and returns a number.
    let v = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    u32::try_from(v).unwrap_or(0)
}

/// The agent's private temp dir: `TMP/troupe-UID/HASH-NAME`, HASH naming the team dir. The
/// parent is ours and not a symlink (0711: another user can pass through to a name they
/// know, not list it); one that another user made first is not used, and a fresh
/// `troupe-UID-RANDOM` is made instead.
fn private_tmp(
    team_dir: &Path,
    name: &str,
    owner: Option<(libc::uid_t, libc::gid_t)>,
) -> Result<PathBuf, String> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
    let euid = nix::unistd::geteuid().as_raw();
    let ours = |p: &Path| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == euid);
    let mut parent = std::env::temp_dir().join(format!("troupe-{euid}"));
    match std::fs::DirBuilder::new().mode(0o711).create(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && ours(&parent) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            tracing::warn!(
                "{} belongs to another user or is not a directory; using a fresh temp dir",
                parent.display()
            );
            parent = std::env::temp_dir().join(format!(
                "troupe-{euid}-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..12]
            ));
            std::fs::DirBuilder::new()
                .mode(0o711)
                .create(&parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        Err(e) => return Err(format!("cannot create {}: {e}", parent.display())),
    }
    let _ = std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o711));
    let hash = team_dir
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
        });
    let dir = parent.join(format!("{hash:016x}-{name}"));
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(&dir)
        .map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    if !meta.is_dir() {
        return Err(format!("{} is not a directory; remove it", dir.display()));
    }
    let (uid, gid) = owner.unwrap_or((euid, nix::unistd::getegid().as_raw()));
    if meta.uid() != uid {
        std::os::unix::fs::chown(&dir, Some(uid), Some(gid))
            .map_err(|e| format!("cannot hand {} to uid {uid}: {e}", dir.display()))?;
    }
    Ok(dir)
}

/// Whether the permission bits let `uid`/`gid` (with no supplementary groups) pass through
/// every ancestor of `dir` and write in it. ACLs are not read: a yes is confirmed by a probe.
fn may_work_in(dir: &Path, uid: libc::uid_t, gid: libc::gid_t) -> bool {
    let allows = |m: &std::fs::Metadata, bits: u32| mode_allows(m, uid, gid, bits);
    let Ok(meta) = std::fs::metadata(dir) else {
        return false;
    };
    allows(&meta, 0o3)
        && dir
            .ancestors()
            .skip(1)
            .all(|a| std::fs::metadata(a).is_ok_and(|m| allows(&m, 0o1)))
}

/// Whether the permission bits of `m` give `uid`/`gid` (with no supplementary groups) all of
/// `bits` (`0o1` pass through, `0o2` write, `0o4` read).
fn mode_allows(m: &std::fs::Metadata, uid: libc::uid_t, gid: libc::gid_t, bits: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let mode = m.mode();
    let granted = if m.uid() == uid {
        mode >> 6
    } else if m.gid() == gid {
        mode >> 3
    } else {
        mode
    };
    granted & bits == bits
}

/// What must be idmapped for `uid`/`gid` to work in `workdir` (and the git dirs and extra dirs
/// it writes): the owner of the working dir, and the trees of that owner the user may not
/// use, with the ancestors it may not pass through, outermost first. Ancestors under `/tmp`
/// need none: the kept paths there get fresh parents in the private `/tmp`.
#[allow(clippy::type_complexity)]
fn idmap_targets(
    workdir: &Path,
    git: &[PathBuf],
    writes: &[PathBuf],
    uid: libc::uid_t,
    gid: libc::gid_t,
) -> Result<((libc::uid_t, libc::gid_t), Vec<PathBuf>), String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(workdir)
        .map_err(|e| format!("working dir {}: {e}", workdir.display()))?;
    let owner = (meta.uid(), meta.gid());
    let mut targets: Vec<PathBuf> = Vec::new();
    for d in std::iter::once(workdir)
        .chain(git.iter().map(PathBuf::as_path))
        .chain(writes.iter().map(PathBuf::as_path))
    {
        if may_work_in(d, uid, gid) {
            continue;
        }
        let m = std::fs::metadata(d).map_err(|e| format!("{}: {e}", d.display()))?;
        if (m.uid(), m.gid()) != owner {
            return Err(format!(
                "{} belongs to uid {} and the working dir to uid {}: commands run as uid {uid} \
                 can be given one owner's files only",
                d.display(),
                m.uid(),
                owner.0
            ));
        }
        for a in d.ancestors().skip(1) {
            if a.starts_with("/tmp") || a.starts_with("/run") {
                break;
            }
            let am = std::fs::metadata(a).map_err(|e| format!("{}: {e}", a.display()))?;
            if mode_allows(&am, uid, gid, 0o1) || targets.iter().any(|t| t == a) {
                continue;
            }
            if am.uid() != owner.0 {
                return Err(format!(
                    "uid {uid} may not pass through {}, which belongs to uid {}",
                    a.display(),
                    am.uid()
                ));
            }
            targets.push(a.to_path_buf());
        }
        if !targets.iter().any(|t| t == d) {
            targets.push(d.to_path_buf());
        }
    }
    targets.sort_by_key(|t| t.components().count());
    Ok((owner, targets))
}

/// The flags of the mount holding `path` that a remount in a user namespace must keep
/// (`nosuid`, `nodev`, `noexec` and the atime ones), as `mount(2)` flags.
fn locked_mount_flags(path: &Path) -> libc::c_ulong {
    use nix::sys::statvfs::FsFlags;
    let Ok(st) = nix::sys::statvfs::statvfs(path) else {
        return 0;
    };
    let f = st.flags();
    [
        (FsFlags::ST_NOSUID, libc::MS_NOSUID),
        (FsFlags::ST_NODEV, libc::MS_NODEV),
        (FsFlags::ST_NOEXEC, libc::MS_NOEXEC),
        (FsFlags::ST_NOATIME, libc::MS_NOATIME),
        (FsFlags::ST_NODIRATIME, libc::MS_NODIRATIME),
        (FsFlags::ST_RELATIME, libc::MS_RELATIME),
    ]
    .into_iter()
    .filter(|(st, _)| f.contains(*st))
    .fold(0, |acc, (_, ms)| acc | ms)
}

/// The uid and gid of a user named by name or number.
fn lookup_user(user: &str) -> Result<(libc::uid_t, libc::gid_t), String> {
    if let Ok(uid) = user.parse::<libc::uid_t>() {
        let gid = nix::unistd::User::from_uid(uid.into())
            .ok()
            .flatten()
            .map_or(uid, |u| u.gid.as_raw());
        return Ok((uid, gid));
    }
    match nix::unistd::User::from_name(user) {
        Ok(Some(u)) => Ok((u.uid.as_raw(), u.gid.as_raw())),
        Ok(None) if user == "nobody" => Ok(NOBODY),
        Ok(None) => Err(format!("--sandbox-user {user}: no such user")),
        Err(e) => Err(format!("--sandbox-user {user}: {e}")),
    }
}

/// How a probe ended.
enum Probe {
    Works,
    /// The user cannot enter or write the working dir or the temp dir.
    NoAccess(String),
    /// A step of the set-up failed.
    Failed(String),
}

/// Runs a trivial command in the candidate sandbox.
fn probe(sb: &Sandbox, workdir: &Path) -> Probe {
    let wd = match crate::tools::fs::Workdir::new(workdir) {
        Ok(w) => w,
        Err(e) => return Probe::Failed(format!("working dir {}: {e}", workdir.display())),
    };
    let out = crate::tools::bash::bash(
        &wd,
        sb,
        &serde_json::json!({"command": "test -w . && test -w \"${TMPDIR:-/tmp}\""}),
        std::time::Duration::from_secs(20),
    );
    let text = out.content.trim();
    let first = text
        .lines()
        .find(|l| l.starts_with("troupe-sandbox:"))
        .unwrap_or(text)
        .trim_start_matches("troupe-sandbox: ")
        .to_owned();
    if !out.is_error && text.is_empty() {
        Probe::Works
    } else if text.ends_with("[exit code 1]") && !text.contains("troupe-sandbox:") {
        Probe::NoAccess("cannot write the working dir or its temp dir".to_owned())
    } else if first.starts_with("entering the working directory") {
        Probe::NoAccess(format!("cannot enter the working dir ({first})"))
    } else {
        Probe::Failed(first)
    }
}

fn describe_user(run_as: RunAs, name: Option<&str>) -> String {
    match run_as {
        RunAs::Own { uid, .. } => format!("uid {uid}, without capabilities"),
        RunAs::User { uid, .. } => format!("{} (uid {uid})", name.unwrap_or("user")),
    }
}

/// Tries the strongest sandbox first and keeps the first that works.
fn probe_all(
    settings: &Settings,
    workdir: &Path,
    team_dir: &Path,
    name: &str,
    git: &crate::worktree::GitDirs,
) -> Sandbox {
    let mut missing = Vec::new();
    let abi = kernel_landlock_abi();
    match abi {
        0 => missing.push("Landlock: this kernel does not offer it".to_owned()),
        1..=5 => missing.push(format!(
            "Landlock scopes: the kernel offers ABI {abi}, scopes need 6 (signals and abstract \
             sockets outside are not blocked)"
        )),
        _ => {}
    }
    let workdir = workdir
        .canonicalize()
        .unwrap_or_else(|_| workdir.to_path_buf());
    let team_dir = team_dir
        .canonicalize()
        .unwrap_or_else(|_| team_dir.to_path_buf());
    let root = nix::unistd::geteuid().is_root();
    let own = RunAs::Own {
        uid: nix::unistd::geteuid().as_raw(),
        gid: nix::unistd::getegid().as_raw(),
    };
    let mut failures_early: Vec<String> = Vec::new();
    // Who commands run as: never uid 0. As root, an unprivileged user (nobody by default);
    // where it may not use the working dir, through idmapped mounts of it.
    let mut users: Vec<(RunAs, Option<String>)> = Vec::new();
    if !root {
        if settings.user.is_some() {
            missing.push("--sandbox-user applies only when troupe runs as root".to_owned());
        }
        users.push((own, None));
    } else {
        match settings.user.as_deref() {
            Some("root") | Some("0") => failures_early.push(
                "--sandbox-user root: commands never run as uid 0 (name an unprivileged user)"
                    .to_owned(),
            ),
            Some(u) => match lookup_user(u) {
                Ok((0, _)) => failures_early.push(format!(
                    "--sandbox-user {u} is uid 0: commands never run as uid 0"
                )),
                Ok((uid, gid)) => users.push((RunAs::User { uid, gid }, Some(u.to_owned()))),
                Err(e) => failures_early.push(e),
            },
            None => {
                let (uid, gid) = lookup_user("nobody").unwrap_or(NOBODY);
                users.push((RunAs::User { uid, gid }, Some("nobody".to_owned())));
            }
        }
    }
    let levels: &[Namespaces] = if root {
        &[
            Namespaces::UserPidMount,
            Namespaces::PidMount,
            Namespaces::None,
        ]
    } else {
        &[Namespaces::UserPidMount, Namespaces::None]
    };
    let extra = |dirs: &[PathBuf]| -> Vec<PathBuf> {
        dirs.iter().filter_map(|d| d.canonicalize().ok()).collect()
    };
    let (reads, writes) = (extra(&settings.read), extra(&settings.write));
    let resolv = std::fs::canonicalize("/etc/resolv.conf")
        .ok()
        .filter(|p| !p.starts_with("/etc"));
    let protect: Vec<(PathBuf, libc::c_ulong)> = git
        .read_only
        .iter()
        .filter_map(|p| p.canonicalize().ok())
        .map(|p| {
            let flags = locked_mount_flags(&p);
            (p, flags)
        })
        .collect();
    // What is hidden whatever the command's uid may read: key files, `/etc/troupe` (the shipped
    // units' secret sources) and `--sandbox-hide`.
    let (mut key_files, mut hidden_dirs): (Vec<PathBuf>, Vec<PathBuf>) = (Vec::new(), Vec::new());
    for p in crate::llm::key_files()
        .into_iter()
        .chain(std::iter::once(PathBuf::from(HIDDEN_ALWAYS)))
        .chain(settings.hide.iter().cloned())
    {
        match p.canonicalize() {
            Ok(c) if c.is_dir() => hidden_dirs.push(c),
            Ok(c) => key_files.push(c),
            Err(_) => {}
        }
    }
    let effective = abi_of(abi);
    let read = AccessFs::from_read(effective);
    let all = AccessFs::from_all(effective);
    let file_rw = AccessFs::from_file(effective);
    let mut failures: Vec<String> = failures_early;
    let mut user_note: Option<String> = None;
    for &ns in levels {
        for (run_as, uname) in users.iter() {
            let owner = match run_as {
                RunAs::User { uid, gid } => Some((*uid, *gid)),
                _ => None,
            };
            // A user the modes say cannot use the working dir gets it through idmapped
            // mounts, made by the (root) keeper in a namespace: not without one.
            let idmap = match owner {
                Some((uid, gid))
                    if !std::iter::once(&workdir)
                        .chain(&git.writable)
                        .chain(&writes)
                        .all(|d| may_work_in(d, uid, gid)) =>
                {
                    if ns == Namespaces::None {
                        continue;
                    }
                    match idmap_targets(&workdir, &git.writable, &writes, uid, gid) {
                        Ok(i) => {
                            user_note = Some(format!(
                                "{}: the working dir belongs to uid {}; commands run as uid {uid} \
                                 through idmapped mounts of it (files keep their owner on disk)",
                                uname.as_deref().unwrap_or("user"),
                                (i.0).0
                            ));
                            Some(i)
                        }
                        Err(e) => {
                            failures.push(e);
                            continue;
                        }
                    }
                }
                _ => None,
            };
            let tmp = match private_tmp(&team_dir, name, owner) {
                Ok(t) => t,
                Err(e) => {
                    failures.push(format!("private temp dir: {e}"));
                    continue;
                }
            };
            let mut rules: Vec<(PathBuf, BitFlags<AccessFs>)> = Vec::new();
            if abi > 0 {
                for t in SYSTEM_TREES
                    .iter()
                    .map(PathBuf::from)
                    .chain(reads.iter().cloned())
                {
                    if t.exists() {
                        rules.push((t, read));
                    }
                }
                if let Some(r) = &resolv {
                    rules.push((r.clone(), read & file_rw));
                }
                for d in DEVICES.iter().map(PathBuf::from) {
                    if d.exists() {
                        let access = device_access(&d, file_rw);
                        rules.push((d, access));
                    }
                }
                for t in [workdir.clone(), tmp.clone()]
                    .into_iter()
                    .chain(writes.iter().cloned())
                {
                    rules.push((t, all));
                }
                // The repository's git dir is read (a store reads its objects through its
                // alternates); the member's store is written (its config, alternates and
                // hooks are bound read-only on top).
                if let Some(c) = &git.common {
                    rules.push((c.clone(), read));
                }
                for d in &git.writable {
                    rules.push((d.clone(), all));
                }
            }
            let mut visible: Vec<(PathBuf, bool)> = vec![(workdir.clone(), true)];
            // The repository's git dir read-only; the member's store writable.
            if let Some(c) = &git.common {
                visible.push((c.clone(), true));
            }
            visible.extend(git.writable.iter().map(|d| (d.clone(), true)));
            visible.extend(reads.iter().chain(&writes).map(|d| (d.clone(), true)));
            if let Some(r) = &resolv {
                visible.push((r.clone(), false));
            }
            let facts = Facts {
                ns,
                run_as: *run_as,
                workdir: workdir.clone(),
                team_dir: team_dir.clone(),
                tmp: tmp.clone(),
                key_files: key_files.clone(),
                hidden_dirs: hidden_dirs.clone(),
                idmap,
                visible,
                read_only: git
                    .common
                    .iter()
                    .chain(&reads)
                    .map(|d| (d.clone(), locked_mount_flags(d)))
                    .collect(),
                protect: protect.clone(),
                has_run: Path::new("/run").is_dir(),
                has_tmp: Path::new("/tmp").is_dir(),
                has_shm: Path::new("/dev/shm").is_dir(),
                proc_access: (AccessFs::ReadFile | AccessFs::ReadDir | AccessFs::WriteFile).bits(),
                shm_access: all.bits(),
            };
            let plan = match plan::build(&facts).and_then(|mut p| {
                if let Some(id) = p.idmap.as_mut() {
                    id.userns = Some(enter::idmap_userns(&id.uid_map, &id.gid_map)?);
                }
                Ok(p)
            }) {
                Ok(p) => p,
                Err(e) => {
                    failures.push(e);
                    break;
                }
            };
            let candidate = Sandbox {
                status: Status::default(),
                plan: Some(Arc::new(plan)),
                rules,
                abi,
                limits: settings.limits,
                tmpdir: Some(if ns == Namespaces::None {
                    tmp.clone()
                } else {
                    PathBuf::from("/tmp")
                }),
            };
            match probe(&candidate, &workdir) {
                Probe::Works => {
                    let mut sb = candidate;
                    if ns != levels[0] {
                        missing.push(format!(
                            "{} namespaces: {}",
                            levels[0].describe(),
                            failures.join("; ")
                        ));
                    }
                    let notes: Vec<String> = user_note.take().into_iter().collect();
                    let team_dir_hidden = ns != Namespaces::None
                        || !sb.rules.iter().any(|(p, _)| team_dir.starts_with(p));
                    if ns == Namespaces::None {
                        missing.push(
                            "own /proc: other processes' environments are readable".to_owned(),
                        );
                        if !hidden_dirs.is_empty() {
                            missing.push(format!(
                                "{} stays readable to commands (hiding needs a mount namespace)",
                                hidden_dirs
                                    .iter()
                                    .map(|d| d.display().to_string())
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ));
                        }
                        if !protect.is_empty() {
                            missing.push(
                                "the working dir's .git stays writable (read-only binds need a \
                                 mount namespace)"
                                    .to_owned(),
                            );
                        }
                        if !team_dir_hidden {
                            missing.push(format!(
                                "the team dir {} lies inside a tree commands may write",
                                team_dir.display()
                            ));
                        }
                    }
                    let active =
                        abi >= 6 && ns != Namespaces::None && team_dir_hidden && missing.is_empty();
                    let refused =
                        (settings.mode == Mode::Required && !active).then(|| missing.join("; "));
                    sb.status = Status {
                        mode: settings.mode,
                        active: active && refused.is_none(),
                        landlock_abi: abi,
                        namespaces: ns.describe().to_owned(),
                        user: describe_user(*run_as, uname.as_deref()),
                        team_dir_hidden,
                        tmp: Some(tmp),
                        missing,
                        notes,
                        refused,
                    };
                    if sb.status.refused.is_some() {
                        sb.plan = None;
                    }
                    return sb;
                }
                Probe::NoAccess(why) => {
                    failures.push(format!("{} {why}", uname.as_deref().unwrap_or("this user")));
                    break;
                }
                Probe::Failed(why) => {
                    failures.push(why);
                    break;
                }
            }
        }
    }
    missing.push(format!(
        "no sandbox could be set up: {}",
        failures.join("; ")
    ));
    // As root, best effort never falls back to commands run as root with nothing around them.
    let refused = (settings.mode == Mode::Required || root).then(|| missing.join("; "));
    Sandbox {
        status: Status {
            mode: settings.mode,
            active: false,
            landlock_abi: abi,
            namespaces: Namespaces::None.describe().to_owned(),
            user: "this process's user".to_owned(),
            team_dir_hidden: false,
            tmp: None,
            missing,
            notes: Vec::new(),
            refused,
        },
        plan: None,
        rules: Vec::new(),
        abi: 0,
        tmpdir: None,
        limits: settings.limits,
    }
}

#[cfg(test)]
mod tests;
