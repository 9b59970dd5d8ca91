//! The plan of a command's sandbox: every path, map and flag the children need, built in the
//! worker before any fork (the children may not allocate), from the facts of
//! [`super::Sandbox::prepare`]. Pure: it reads nothing but what it is given.

use std::ffi::CString;
use std::fmt;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The default limits of one command: a `cargo build` of a mid-size crate fits in them with
/// room to spare (see [`Limits`]).
pub const DEFAULT_NPROC: u64 = 1024;
pub const DEFAULT_MEM: u64 = 8 << 30;
pub const DEFAULT_CPU: u64 = 600;
pub const DEFAULT_NOFILE: u64 = 4096;

/// One resource limit: a number, or none (`unlimited`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit(pub Option<u64>);

impl Limit {
    /// The value `setrlimit` takes.
    pub(crate) fn rlim(self) -> libc::rlim_t {
        self.0.map_or(libc::RLIM_INFINITY, |n| n as libc::rlim_t)
    }
}

impl fmt::Display for Limit {
    /// Digits, or `unlimited`: what [`Limit::from_str`] reads back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("unlimited"),
        }
    }
}

impl FromStr for Limit {
    type Err = String;
    /// `unlimited`, or a number with an optional binary suffix K, M, G or T (`8G`).
    fn from_str(s: &str) -> Result<Limit, String> {
        if s == "unlimited" {
            return Ok(Limit(None));
        }
        let (digits, shift) = match s.char_indices().last() {
            Some((i, c)) if c.is_ascii_alphabetic() => {
                let shift = match c.to_ascii_uppercase() {
                    'K' => 10,
                    'M' => 20,
                    'G' => 30,
                    'T' => 40,
                    _ => return Err(format!("{s:?}: unknown suffix {c:?} (K, M, G or T)")),
                };
                (&s[..i], shift)
            }
            _ => (s, 0),
        };
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?}: expected a number (with K, M, G or T) or unlimited"))?;
        n.checked_mul(1 << shift)
            .map(|n| Limit(Some(n)))
            .ok_or_else(|| format!("{s:?}: too large"))
    }
}

/// The resource limits of each command (settings of `lead run`, `worker`, `lead chat` and
/// `lead demo`), set with `setrlimit` in the command's own process just before it execs bash,
/// soft and hard alike (never above the worker's own hard limit), so the keeper that kills a
/// command is never under them. They bound each process of the command, except the process
/// count, which the kernel keeps per user and user namespace: a command that gets a user
/// namespace of its own or runs as `nobody` has its own count, and a fork bomb stops at the
/// limit and ends with the command's timeout. It is not set where commands run as the
/// worker's own user in its namespace (it would count the team's processes too), and uid 0
/// is exempt from it; the member's sandbox status says so in a note.
///
/// The defaults were measured on this crate (about 120 crates with ring's C code, on 2 cores),
/// built from scratch with the address space, CPU and open files limits in force: `cargo
/// build`, `cargo build --release` and `cargo test --no-run` all pass, rustc peaking at 1.5
/// GiB of address space and the whole build at 22 processes and threads at once. 8 GiB
/// leaves room for bigger crates and linkers (a JVM, which reserves a quarter of the
/// machine's memory for its heap, may need more, or `unlimited`); a command of two minutes
/// never needs 600 s of CPU in one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::Args)]
pub struct Limits {
    /// The most processes and threads one command may run at once (RLIMIT_NPROC), or
    /// `unlimited`.
    #[arg(long = "sandbox-nproc", value_name = "N", default_value = "1024")]
    pub nproc: Limit,
    /// The address space of each process of a command (RLIMIT_AS), in bytes or with K, M, G
    /// or T, or `unlimited`.
    #[arg(long = "sandbox-mem", value_name = "SIZE", default_value = "8G")]
    pub mem: Limit,
    /// The CPU seconds each process of a command may use (RLIMIT_CPU), or `unlimited`.
    #[arg(long = "sandbox-cpu", value_name = "SECS", default_value = "600")]
    pub cpu: Limit,
    /// The most open files of each process of a command (RLIMIT_NOFILE), or `unlimited`.
    #[arg(long = "sandbox-nofile", value_name = "N", default_value = "4096")]
    pub nofile: Limit,
}

impl Default for Limits {
    /// The clap defaults above.
    fn default() -> Limits {
        Limits {
            nproc: Limit(Some(DEFAULT_NPROC)),
            mem: Limit(Some(DEFAULT_MEM)),
            cpu: Limit(Some(DEFAULT_CPU)),
            nofile: Limit(Some(DEFAULT_NOFILE)),
        }
    }
}

impl Limits {
    /// The flags that parse back into these.
    pub fn to_args(&self) -> Vec<String> {
        [
            ("--sandbox-nproc", self.nproc),
            ("--sandbox-mem", self.mem),
            ("--sandbox-cpu", self.cpu),
            ("--sandbox-nofile", self.nofile),
        ]
        .into_iter()
        .flat_map(|(flag, l)| [flag.to_owned(), l.to_string()])
        .collect()
    }
}

/// At most this many paths are bound back over the replaced `/tmp` and `/run`.
pub(crate) const MAX_KEEP: usize = 16;

/// Which namespaces a command gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Namespaces {
    /// None: Landlock (and the user switch) only.
    None,
    /// PID and mount namespaces, without a user namespace (root only).
    PidMount,
    /// User, PID and mount namespaces.
    UserPidMount,
}

impl Namespaces {
    pub(crate) fn describe(self) -> &'static str {
        match self {
            Namespaces::None => "no",
            Namespaces::PidMount => "pid+mount",
            Namespaces::UserPidMount => "user+pid+mount",
        }
    }
}

/// One mount(2) call.
#[derive(Debug)]
pub(crate) struct Mount {
    /// What it is for, in the error message when it fails.
    pub step: &'static str,
    pub source: Option<CString>,
    pub target: CString,
    pub fstype: Option<CString>,
    pub flags: libc::c_ulong,
    pub data: Option<CString>,
    /// A target that is not there (or not reachable) is skipped: the command cannot reach it
    /// either.
    pub skip_missing: bool,
}

/// A path under a replaced tree (`/tmp`, `/run`) that must stay visible at its own path.
#[derive(Debug)]
pub(crate) struct Keep {
    pub path: CString,
    /// Its ancestors below the replaced tree, outermost first (made as mount points).
    pub parents: Vec<CString>,
    pub is_dir: bool,
    /// Bound back read-only: remounted with `MS_RDONLY` and these flags of its mount (those a
    /// user namespace may not drop). Landlock alone cannot keep a kept path read-only: its
    /// mount point lies in the private `/tmp`, which commands may write, and Landlock grants
    /// what any ancestor in the mount tree is granted.
    pub read_only: Option<libc::c_ulong>,
}

/// A path inside a writable tree that is bound onto itself and remounted read-only.
#[derive(Debug)]
pub(crate) struct Protect {
    pub path: CString,
    /// The flags of its mount a remount in a user namespace must keep (see [`Keep::read_only`]).
    pub flags: libc::c_ulong,
}

/// Idmapped binds: each target is replaced by a bind of itself through which files of the
/// owner appear as the command's user's, and what the command creates lands on disk as the
/// owner's (files keep their owners; nothing is chowned). `uid_map` and `gid_map` are the maps
/// of the user namespace the mounts take their mapping from: `OWNER RUN 1`.
#[derive(Debug)]
pub(crate) struct Idmap {
    pub uid_map: CString,
    pub gid_map: CString,
    /// Outermost first: the ancestors the command must pass through, then the trees.
    pub targets: Vec<CString>,
    /// The user namespace with those maps (made by the worker once the plan is built: see
    /// [`super::enter::idmap_userns`]).
    pub userns: Option<std::os::fd::OwnedFd>,
}

/// A Landlock rule for a tree mounted inside the sandbox.
#[derive(Debug)]
pub(crate) struct Rule {
    pub path: CString,
    pub access: u64,
    pub skip_missing: bool,
}

/// Everything the children do, in order.
#[derive(Debug)]
pub(crate) struct Plan {
    pub ns: Namespaces,
    /// The keeper drops root's supplementary groups before it clones.
    pub clear_groups: bool,
    /// The maps are written by an unprivileged keeper: `setgroups` must be denied first.
    pub deny_setgroups: bool,
    pub uid_map: String,
    pub gid_map: String,
    /// Mounted first: the namespace's own `/proc`.
    pub early_mounts: Vec<Mount>,
    /// Done by the keeper (real root) in a mount namespace of its own before it clones the
    /// init: the trees an unprivileged command must write but whose owner is another user,
    /// replaced by idmapped binds of themselves (see [`Idmap`]).
    pub idmap: Option<Idmap>,
    /// Held open before `cover_mounts`, bound back after them.
    pub keep: Vec<Keep>,
    /// Trees replaced: `/tmp` by the private temp dir, `/run` and `/dev/shm` by empty tmpfs.
    pub cover_mounts: Vec<Mount>,
    /// Made read-only where they are, after the kept paths are back: the working dir's `.git`
    /// and the like (see [`Facts::protect`]).
    pub protect: Vec<Protect>,
    /// Mounted last: the team dir and key files covered.
    pub late_mounts: Vec<Mount>,
    /// The user the command becomes (uid, gid), if not the keeper's own.
    pub switch_to: Option<(libc::uid_t, libc::gid_t)>,
    /// `setgroups(0)` in the command's process before it switches user.
    pub clear_groups_in_child: bool,
    /// Drop every capability before exec.
    pub drop_caps: bool,
    /// Where the command starts (entered after the mounts, so its cwd is the visible tree).
    pub workdir: CString,
    /// Landlock rules for trees mounted inside the sandbox.
    pub inner_rules: Vec<Rule>,
}

/// Who the command runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RunAs {
    /// The worker's own (non-root) user.
    Own { uid: libc::uid_t, gid: libc::gid_t },
    /// An unprivileged user, switched to from root (commands never run as uid 0).
    User { uid: libc::uid_t, gid: libc::gid_t },
}

/// The facts a plan is built from.
#[derive(Debug, Clone)]
pub(crate) struct Facts {
    pub ns: Namespaces,
    pub run_as: RunAs,
    pub workdir: PathBuf,
    pub team_dir: PathBuf,
    pub tmp: PathBuf,
    /// Key files that exist (covered by /dev/null).
    pub key_files: Vec<PathBuf>,
    /// Owner (uid, gid) of the trees to idmap onto the command's user, and those trees with the
    /// ancestors it must pass through, outermost first (see [`Idmap`]); only with
    /// [`RunAs::User`], where the keeper is real root.
    pub idmap: Option<((libc::uid_t, libc::gid_t), Vec<PathBuf>)>,
    /// Dirs commands may not see, whatever their uid may read (`/etc/troupe`, where the units'
    /// secrets come from, and `--sandbox-hide`): covered by an empty read-only tmpfs.
    pub hidden_dirs: Vec<PathBuf>,
    /// Paths that must stay visible where they are (the working dir, the extra read and write
    /// dirs, the resolver configuration).
    pub visible: Vec<(PathBuf, bool)>,
    /// Those of `visible` that must stay read-only, with the flags of their mount (see
    /// [`Keep::read_only`]); paths below them listed later in `visible` are bound back
    /// writable on top.
    pub read_only: Vec<(PathBuf, libc::c_ulong)>,
    /// Files and dirs inside writable trees that commands may not change, with the flags of
    /// their mounts: the working dir's `.git` (a worktree's `.git` file), and the member's
    /// store's `config`, `objects/info/alternates` and `hooks` (Landlock cannot take a right
    /// back below a granted dir; a read-only bind mount can).
    pub protect: Vec<(PathBuf, libc::c_ulong)>,
    /// Which of `/run`, `/tmp` and `/dev/shm` exist.
    pub has_run: bool,
    pub has_tmp: bool,
    pub has_shm: bool,
    /// Access masks of the inner rules: `/proc` and `/dev/shm`.
    pub proc_access: u64,
    pub shm_access: u64,
}

fn cstr(p: &Path) -> Result<CString, String> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| format!("{} contains a NUL byte", p.display()))
}

fn lit(s: &str) -> CString {
    CString::new(s).expect("literal without NUL")
}

/// The plan for these facts.
pub(crate) fn build(f: &Facts) -> Result<Plan, String> {
    let namespaced = f.ns != Namespaces::None;
    let (clear_groups, deny_setgroups, uid_map, gid_map, switch_to, clear_in_child, drop_caps) =
        match (f.run_as, f.ns) {
            (RunAs::Own { uid, gid }, _) => (
                false,
                true,
                format!("{uid} {uid} 1\n"),
                format!("{gid} {gid} 1\n"),
                None,
                false,
                namespaced,
            ),
            (RunAs::User { uid, gid }, ns) => (
                true,
                false,
                format!("0 0 1\n{uid} {uid} 1\n"),
                format!("0 0 1\n{gid} {gid} 1\n"),
                Some((uid, gid)),
                // In a user namespace the keeper already dropped root's groups, and the map
                // holds no group of root's to set.
                ns != Namespaces::UserPidMount,
                true,
            ),
        };
    let mut plan = Plan {
        ns: f.ns,
        clear_groups,
        deny_setgroups,
        uid_map,
        gid_map,
        early_mounts: Vec::new(),
        idmap: None,
        keep: Vec::new(),
        cover_mounts: Vec::new(),
        protect: Vec::new(),
        late_mounts: Vec::new(),
        switch_to,
        clear_groups_in_child: clear_in_child,
        drop_caps,
        workdir: cstr(&f.workdir)?,
        inner_rules: Vec::new(),
    };
    if !namespaced {
        return Ok(plan);
    }
    let nosuid = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    plan.early_mounts.push(Mount {
        step: "mounting /proc",
        source: Some(lit("proc")),
        target: lit("/proc"),
        fstype: Some(lit("proc")),
        flags: nosuid,
        data: None,
        skip_missing: false,
    });
    plan.inner_rules.push(Rule {
        path: lit("/proc"),
        access: f.proc_access,
        skip_missing: false,
    });
    if let Some(((uid, gid), targets)) = &f.idmap {
        let RunAs::User { uid: ru, gid: rg } = f.run_as else {
            return Err("idmapped mounts are for a user switched to from root".to_owned());
        };
        if targets.len() > super::enter::MAX_IDMAP {
            return Err(format!(
                "more than {} trees to idmap",
                super::enter::MAX_IDMAP
            ));
        }
        plan.idmap = Some(Idmap {
            uid_map: lit(&format!("{uid} {ru} 1\n")),
            gid_map: lit(&format!("{gid} {rg} 1\n")),
            targets: targets.iter().map(|p| cstr(p)).collect::<Result<_, _>>()?,
            userns: None,
        });
    }
    let mut covered: Vec<&Path> = Vec::new();
    if f.has_tmp {
        plan.cover_mounts.push(Mount {
            step: "mounting the private /tmp",
            source: Some(cstr(&f.tmp)?),
            target: lit("/tmp"),
            fstype: None,
            flags: libc::MS_BIND,
            data: None,
            skip_missing: false,
        });
        covered.push(Path::new("/tmp"));
    }
    if f.has_run {
        plan.cover_mounts.push(Mount {
            step: "mounting an empty /run",
            source: Some(lit("tmpfs")),
            target: lit("/run"),
            fstype: Some(lit("tmpfs")),
            flags: nosuid,
            data: Some(lit("mode=0755,size=1m")),
            skip_missing: false,
        });
        covered.push(Path::new("/run"));
    }
    if f.has_shm {
        plan.cover_mounts.push(Mount {
            step: "mounting an empty /dev/shm",
            source: Some(lit("tmpfs")),
            target: lit("/dev/shm"),
            fstype: Some(lit("tmpfs")),
            flags: libc::MS_NOSUID | libc::MS_NODEV,
            data: Some(lit("mode=1777,size=256m")),
            skip_missing: false,
        });
        plan.inner_rules.push(Rule {
            path: lit("/dev/shm"),
            access: f.shm_access,
            skip_missing: true,
        });
    }
    for (path, is_dir) in &f.visible {
        let Some(root) = covered.iter().find(|c| path.starts_with(c) && path != *c) else {
            continue;
        };
        if plan.keep.len() == MAX_KEEP {
            return Err(format!(
                "more than {MAX_KEEP} paths to keep visible under /tmp and /run"
            ));
        }
        let parents = path
            .ancestors()
            .skip(1)
            .take_while(|a| a != root)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .map(cstr)
            .collect::<Result<Vec<_>, _>>()?;
        plan.keep.push(Keep {
            path: cstr(path)?,
            parents,
            is_dir: *is_dir,
            read_only: f
                .read_only
                .iter()
                .find(|(p, _)| p == path)
                .map(|(_, flags)| *flags),
        });
    }
    // Outermost first, so a path inside a read-only one (the working dir inside a
    // `--sandbox-read` dir, a git dir's `objects`) is bound back writable on top of it.
    plan.keep
        .sort_by_key(|k| k.path.as_bytes().iter().filter(|b| **b == b'/').count());
    for (path, flags) in &f.protect {
        plan.protect.push(Protect {
            path: cstr(path)?,
            flags: *flags,
        });
    }
    plan.late_mounts.push(Mount {
        step: "covering the team dir",
        source: Some(lit("tmpfs")),
        target: cstr(&f.team_dir)?,
        fstype: Some(lit("tmpfs")),
        flags: libc::MS_RDONLY | nosuid,
        data: Some(lit("mode=0555,size=4k")),
        skip_missing: true,
    });
    for d in &f.hidden_dirs {
        plan.late_mounts.push(Mount {
            step: "covering a hidden dir",
            source: Some(lit("tmpfs")),
            target: cstr(d)?,
            fstype: Some(lit("tmpfs")),
            flags: libc::MS_RDONLY | nosuid,
            data: Some(lit("mode=0555,size=4k")),
            skip_missing: true,
        });
    }
    for k in &f.key_files {
        plan.late_mounts.push(Mount {
            step: "covering a key file",
            source: Some(lit("/dev/null")),
            target: cstr(k)?,
            fstype: None,
            flags: libc::MS_BIND,
            data: None,
            skip_missing: true,
        });
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        limits: Limits,
    }

    #[test]
    fn limits_parse_with_suffixes_and_unlimited() {
        let p = |s: &str| s.parse::<Limit>();
        assert_eq!(p("8G"), Ok(Limit(Some(8 << 30))));
        assert_eq!(p("3k"), Ok(Limit(Some(3 << 10))));
        assert_eq!(p("4096"), Ok(Limit(Some(4096))));
        assert_eq!(p("unlimited"), Ok(Limit(None)));
        for bad in ["", "G", "x", "5Q", "-1", "99999999999T"] {
            assert!(p(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!(Limit(Some(8 << 30)).to_string(), "8589934592");
        assert_eq!(Limit(None).rlim(), libc::RLIM_INFINITY);
    }

    #[test]
    fn limits_default_as_clap_does_and_round_trip_through_their_flags() {
        assert_eq!(Cli::parse_from(["x"]).limits, Limits::default());
        let l = Limits {
            nproc: Limit(Some(7)),
            mem: Limit(None),
            cpu: Limit(Some(30)),
            nofile: Limit(Some(64)),
        };
        let args = std::iter::once("x".to_owned()).chain(l.to_args());
        assert_eq!(Cli::parse_from(args).limits, l);
    }

    fn facts(ns: Namespaces, run_as: RunAs) -> Facts {
        Facts {
            ns,
            run_as,
            workdir: "/tmp/demo/work".into(),
            team_dir: "/tmp/demo/work/.team".into(),
            tmp: "/var/tmp/troupe-0/abc-alice".into(),
            key_files: vec!["/etc/troupe/key".into()],
            hidden_dirs: vec!["/etc/troupe".into()],
            idmap: None,
            visible: vec![
                ("/tmp/demo/work".into(), true),
                ("/run/systemd/resolve/stub-resolv.conf".into(), false),
                ("/home/me/.cargo".into(), true),
            ],
            read_only: Vec::new(),
            protect: vec![("/tmp/demo/work/.git".into(), libc::MS_NOSUID)],
            has_run: true,
            has_tmp: true,
            has_shm: true,
            proc_access: 7,
            shm_access: 0xffff,
        }
    }

    #[test]
    fn paths_under_replaced_trees_are_bound_back_with_their_parents() {
        let p = build(&facts(
            Namespaces::UserPidMount,
            RunAs::User {
                uid: 65534,
                gid: 65534,
            },
        ))
        .unwrap();
        let keep: Vec<_> = p
            .keep
            .iter()
            .map(|k| (k.path.to_str().unwrap(), k.parents.len(), k.is_dir))
            .collect();
        assert_eq!(
            keep,
            [
                ("/tmp/demo/work", 1, true),
                ("/run/systemd/resolve/stub-resolv.conf", 2, false)
            ]
        );
        assert_eq!(p.keep[1].parents[0].to_str().unwrap(), "/run/systemd");
        assert_eq!(
            p.late_mounts[0].target.to_str().unwrap(),
            "/tmp/demo/work/.team"
        );
        assert_eq!(p.late_mounts[1].target.to_str().unwrap(), "/etc/troupe");
        assert_eq!(p.late_mounts[2].target.to_str().unwrap(), "/etc/troupe/key");
    }

    #[test]
    fn a_read_only_path_is_remounted_so_and_what_lies_below_is_bound_after_it() {
        let mut f = facts(
            Namespaces::UserPidMount,
            RunAs::User {
                uid: 65534,
                gid: 65534,
            },
        );
        f.visible = vec![
            ("/tmp/r/.git/objects".into(), true),
            ("/tmp/r/.git".into(), true),
        ];
        f.read_only = vec![("/tmp/r/.git".into(), libc::MS_NOSUID)];
        let p = build(&f).unwrap();
        let keep: Vec<_> = p
            .keep
            .iter()
            .map(|k| (k.path.to_str().unwrap(), k.read_only))
            .collect();
        assert_eq!(
            keep,
            [
                ("/tmp/r/.git", Some(libc::MS_NOSUID)),
                ("/tmp/r/.git/objects", None)
            ]
        );
    }

    #[test]
    fn who_the_command_runs_as() {
        let own = build(&facts(
            Namespaces::UserPidMount,
            RunAs::Own {
                uid: 1000,
                gid: 100,
            },
        ))
        .unwrap();
        assert_eq!(
            (own.uid_map.as_str(), own.deny_setgroups),
            ("1000 1000 1\n", true)
        );
        assert!(own.switch_to.is_none() && own.drop_caps);
        let nobody = build(&facts(
            Namespaces::UserPidMount,
            RunAs::User {
                uid: 65534,
                gid: 65534,
            },
        ))
        .unwrap();
        assert_eq!(nobody.uid_map, "0 0 1\n65534 65534 1\n");
        assert_eq!(nobody.switch_to, Some((65534, 65534)));
        assert!(nobody.clear_groups && !nobody.clear_groups_in_child);
        let bare = build(&facts(
            Namespaces::None,
            RunAs::User {
                uid: 65534,
                gid: 65534,
            },
        ))
        .unwrap();
        assert!(bare.early_mounts.is_empty() && bare.late_mounts.is_empty());
        assert!(bare.clear_groups_in_child);
    }
}
