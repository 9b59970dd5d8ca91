//! The child side of the sandbox: what the keeper, the namespace's init and the command's own
//! process do between the worker's fork and bash's exec.
//!
//! Everything here runs in a forked child of a multi-threaded process: only async-signal-safe
//! system calls on plain integers, on stack buffers and on memory built before the fork (the
//! [`Plan`]); no allocation, no locks. A step that fails says which on stderr (the command's
//! output) as `troupe-sandbox: STEP failed: errno N` and ends the command with exit code
//! [`SETUP_FAILED`]: a command never runs with less confinement than its plan says.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use nix::errno::Errno;

use super::plan::{Idmap, Keep, Mount, Plan, Rule};

/// The exit code of a command whose sandbox could not be set up.
pub const SETUP_FAILED: i32 = 125;

/// Writes `msg` to stderr.
pub(crate) fn say(msg: &[u8]) {
    // SAFETY: write(2) of a live buffer.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

/// Says that `step` failed with the current errno.
fn failed(step: &[u8]) {
    let e = Errno::last_raw();
    let (d, n) = digits(e.unsigned_abs() as u64);
    say(b"troupe-sandbox: ");
    say(step);
    say(b" failed: errno ");
    say(&d[..n]);
    say(b"\n");
}

/// Fails the step: says so, and returns the error for `?`.
fn fail(step: &[u8]) -> Result<(), ()> {
    failed(step);
    Err(())
}

/// The decimal digits of `n` and how many there are.
pub(crate) fn digits(mut n: u64) -> ([u8; 20], usize) {
    let mut rev = [0u8; 20];
    let mut len = 0;
    loop {
        rev[len] = b'0' + (n % 10) as u8;
        len += 1;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let mut out = [0u8; 20];
    for i in 0..len {
        out[i] = rev[len - 1 - i];
    }
    (out, len)
}

/// Joins parts into `buf` as a NUL-terminated string (truncated to fit).
pub(crate) fn join<'a>(buf: &'a mut [u8; 64], parts: &[&[u8]]) -> &'a CStr {
    let mut len = 0;
    for p in parts {
        let n = p.len().min(buf.len() - 1 - len);
        buf[len..len + n].copy_from_slice(&p[..n]);
        len += n;
    }
    buf[len] = 0;
    // SAFETY: NUL-terminated above; parts carry no NUL (digits and fixed strings).
    unsafe { CStr::from_bytes_with_nul_unchecked(&buf[..=len]) }
}

/// "/proc/self/fd/N" for a descriptor.
fn fd_path(buf: &mut [u8; 64], fd: RawFd) -> &CStr {
    let (d, n) = digits(fd as u64);
    join(buf, &[b"/proc/self/fd/", &d[..n]])
}

/// In the keeper, before it clones the namespace's init: drops supplementary groups (root
/// only; the command must not keep root's groups), and makes the plan's idmapped mounts in a
/// mount namespace of the keeper's own, which the init's copies (an idmapped mount of a disk's
/// file system needs privilege in the initial user namespace, which the init of a user
/// namespace has not; and what is kept of an idmapped tree is bound back idmapped).
pub(crate) fn before_clone(plan: &Plan) -> Result<(), ()> {
    if plan.clear_groups {
        // SAFETY: setgroups with an empty list.
        if unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
            return fail(b"setgroups");
        }
    }
    if let Some(id) = &plan.idmap {
        // SAFETY: unshare/mount on integers and literals; idmap_all as documented.
        unsafe {
            if libc::unshare(libc::CLONE_NEWNS) != 0 {
                return fail(b"a mount namespace for the idmapped mounts");
            }
            private_mount_tree()?;
            idmap_all(id)?;
        }
    }
    Ok(())
}

/// In the keeper: writes the user namespace's id maps of the init `pid` (it waits for them).
pub(crate) fn write_maps(plan: &Plan, pid: libc::pid_t) -> Result<(), ()> {
    let (d, n) = digits(pid as u64);
    let d = &d[..n];
    let mut buf = [0u8; 64];
    if plan.deny_setgroups {
        write_file(
            join(&mut buf, &[b"/proc/", d, b"/setgroups"]),
            b"deny",
            b"setgroups map",
        )?;
    }
    write_file(
        join(&mut buf, &[b"/proc/", d, b"/uid_map"]),
        plan.uid_map.as_bytes(),
        b"uid map",
    )?;
    write_file(
        join(&mut buf, &[b"/proc/", d, b"/gid_map"]),
        plan.gid_map.as_bytes(),
        b"gid map",
    )
}

fn write_file(path: &CStr, content: &[u8], step: &[u8]) -> Result<(), ()> {
    // SAFETY: open/write/close on a NUL-terminated path and a live buffer.
    unsafe {
        let fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return fail(step);
        }
        let n = libc::write(fd, content.as_ptr().cast(), content.len());
        let ok = n == content.len() as isize;
        if !ok {
            failed(step);
        }
        libc::close(fd);
        if ok { Ok(()) } else { Err(()) }
    }
}

/// In the namespace's init, once its maps are written: builds the command's view of the file
/// system (see [`Plan`]): a private mount tree, its own `/proc`, `/run` and `/tmp` replaced,
/// what must stay visible bound back, the team dir and key files covered.
pub(crate) fn mount_all(plan: &Plan) -> Result<(), ()> {
    private_mount_tree()?;
    // SAFETY: mount/open/mkdir/close on NUL-terminated strings built before the fork.
    unsafe {
        for m in &plan.early_mounts {
            mount_one(m)?;
        }
        // What must stay visible under the trees about to be replaced: held open by
        // descriptor, then bound back at the same path.
        let mut held = [-1 as RawFd; super::plan::MAX_KEEP];
        for (slot, k) in held.iter_mut().zip(&plan.keep) {
            let fd = libc::open(k.path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
            if fd < 0 {
                return fail(b"opening a path to keep visible");
            }
            *slot = fd;
        }
        for m in &plan.cover_mounts {
            mount_one(m)?;
        }
        for (fd, k) in held.iter().zip(&plan.keep) {
            bind_back(*fd, k)?;
            libc::close(*fd);
        }
        for p in &plan.protect {
            protect(p)?;
        }
        for m in &plan.late_mounts {
            mount_one(m)?;
        }
    }
    Ok(())
}

/// Makes every mount of this (new) mount namespace private, so nothing done here propagates
/// back to the namespace it was copied from.
fn private_mount_tree() -> Result<(), ()> {
    // SAFETY: mount(2) with a literal path and no data.
    let r = unsafe {
        libc::mount(
            std::ptr::null(),
            c"/".as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if r != 0 {
        return fail(b"making the mount tree private");
    }
    Ok(())
}

/// One mount of the plan; a target that does not exist (or that this user cannot reach, so
/// neither can the command) is skipped when the mount says so.
///
/// # Safety
/// Only in the sandbox's children.
unsafe fn mount_one(m: &Mount) -> Result<(), ()> {
    let opt = |s: &Option<std::ffi::CString>| s.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: NUL-terminated strings built before the fork.
    let r = unsafe {
        libc::mount(
            opt(&m.source),
            m.target.as_ptr(),
            opt(&m.fstype),
            m.flags,
            opt(&m.data).cast(),
        )
    };
    if r != 0 {
        if m.skip_missing && matches!(Errno::last(), Errno::ENOENT | Errno::EACCES) {
            return Ok(());
        }
        return fail(m.step.as_bytes());
    }
    Ok(())
}

/// Creates the mount point of a kept path in the tree that replaced its parent, and binds the
/// held descriptor there.
///
/// # Safety
/// Only in the sandbox's children.
unsafe fn bind_back(fd: RawFd, k: &Keep) -> Result<(), ()> {
    // SAFETY: mkdir/open/mount on NUL-terminated strings built before the fork.
    unsafe {
        for dir in &k.parents {
            if libc::mkdir(dir.as_ptr(), 0o755) != 0 && Errno::last() != Errno::EEXIST {
                return fail(b"making a mount point");
            }
        }
        if k.is_dir {
            if libc::mkdir(k.path.as_ptr(), 0o755) != 0 && Errno::last() != Errno::EEXIST {
                return fail(b"making a mount point");
            }
        } else {
            let f = libc::open(
                k.path.as_ptr(),
                libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC,
                0o644,
            );
            if f < 0 {
                return fail(b"making a mount point");
            }
            libc::close(f);
        }
        let mut buf = [0u8; 64];
        let src = fd_path(&mut buf, fd);
        if libc::mount(
            src.as_ptr(),
            k.path.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ) != 0
        {
            return fail(b"binding a kept path back");
        }
        if let Some(flags) = k.read_only
            && libc::mount(
                std::ptr::null(),
                k.path.as_ptr(),
                std::ptr::null(),
                libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | flags,
                std::ptr::null(),
            ) != 0
        {
            return fail(b"making a kept path read-only");
        }
    }
    Ok(())
}

/// A user namespace with `uid_map` and `gid_map`, held by descriptor, for idmapped mounts to
/// take their mapping from: made once per sandbox, in the worker (a child that only waits
/// gets the namespace; its maps are written, the namespace opened, and the child ends).
pub(crate) fn idmap_userns(uid_map: &CStr, gid_map: &CStr) -> Result<OwnedFd, String> {
    let err = |what: &str| format!("{what}: {}", std::io::Error::last_os_error());
    // SAFETY: a raw clone without CLONE_VM: the child, a copy with this one thread, only
    // reads a pipe and exits (async-signal-safe); the parent writes files and waits for it.
    unsafe {
        let mut sync = [-1; 2];
        if libc::pipe2(sync.as_mut_ptr(), libc::O_CLOEXEC) != 0 {
            return Err(err("a pipe for the idmap"));
        }
        let child = libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_NEWUSER | libc::SIGCHLD) as libc::c_ulong,
            0,
            0,
            0,
            0,
        ) as libc::pid_t;
        if child == 0 {
            libc::close(sync[1]);
            let mut b = [0u8; 1];
            libc::read(sync[0], b.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
        libc::close(sync[0]);
        let made = if child < 0 {
            Err(err("a user namespace for the idmap"))
        } else {
            let proc = |f: &str| format!("/proc/{child}/{f}");
            std::fs::write(proc("uid_map"), uid_map.to_bytes())
                .and_then(|()| std::fs::write(proc("gid_map"), gid_map.to_bytes()))
                .and_then(|()| std::fs::File::open(proc("ns/user")))
                .map(OwnedFd::from)
                .map_err(|e| format!("the idmap's user namespace: {e}"))
        };
        libc::close(sync[1]);
        if child > 0 {
            libc::waitpid(child, std::ptr::null_mut(), 0);
        }
        made
    }
}

/// `struct mount_attr` of mount_setattr(2).
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

/// At most this many trees are idmapped (the working dir, what git writes, their ancestors).
pub(crate) const MAX_IDMAP: usize = 16;

/// Replaces each of `id.targets` by an idmapped bind of itself. In the keeper, which is real
/// root in a mount namespace of its own (an idmapped mount of a disk's file system needs
/// privilege over the user namespace the file system belongs to: the initial one).
///
/// The mapping is that of the user namespace [`idmap_userns`] made when the sandbox was
/// prepared. Every tree is cloned before any is mounted, so a target below another is cloned
/// from the tree as it is on disk.
///
/// # Safety
/// Only in the keeper.
unsafe fn idmap_all(id: &Idmap) -> Result<(), ()> {
    let Some(ns) = id.userns.as_ref().map(|f| f.as_raw_fd()) else {
        return fail(b"idmapping without its user namespace");
    };
    // SAFETY: the mount syscalls on integers and NUL-terminated strings built before the fork.
    unsafe {
        let mut trees = [-1 as RawFd; MAX_IDMAP];
        let mut ok = true;
        for (slot, t) in trees.iter_mut().zip(&id.targets) {
            if !ok {
                break;
            }
            let fd = libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                t.as_ptr(),
                OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
            ) as RawFd;
            if fd < 0 {
                failed(b"cloning a tree to idmap");
                ok = false;
                break;
            }
            *slot = fd;
            let attr = MountAttr {
                attr_set: MOUNT_ATTR_IDMAP,
                attr_clr: 0,
                propagation: 0,
                userns_fd: ns as u64,
            };
            if libc::syscall(
                libc::SYS_mount_setattr,
                fd,
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            ) != 0
            {
                failed(b"idmapping a tree (does its file system support idmapped mounts?)");
                ok = false;
            }
        }
        for (fd, t) in trees.iter().zip(&id.targets) {
            if ok
                && libc::syscall(
                    libc::SYS_move_mount,
                    *fd,
                    c"".as_ptr(),
                    libc::AT_FDCWD,
                    t.as_ptr(),
                    MOVE_MOUNT_F_EMPTY_PATH,
                ) != 0
            {
                failed(b"mounting an idmapped tree");
                ok = false;
            }
            if *fd >= 0 {
                libc::close(*fd);
            }
        }
        if ok { Ok(()) } else { Err(()) }
    }
}

/// Binds `p` onto itself and remounts that read-only. A path gone since the worker started is
/// skipped (nothing of it is left to protect).
///
/// # Safety
/// Only in the sandbox's children.
unsafe fn protect(p: &super::plan::Protect) -> Result<(), ()> {
    // SAFETY: mount on NUL-terminated strings built before the fork.
    unsafe {
        if libc::mount(
            p.path.as_ptr(),
            p.path.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        ) != 0
        {
            if Errno::last() == Errno::ENOENT {
                return Ok(());
            }
            return fail(b"binding a protected path");
        }
        if libc::mount(
            std::ptr::null(),
            p.path.as_ptr(),
            std::ptr::null(),
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | p.flags,
            std::ptr::null(),
        ) != 0
        {
            return fail(b"making a protected path read-only");
        }
    }
    Ok(())
}

/// The resource limits of one command as its process sets them (see
/// [`super::plan::Limits`]); `RLIM_INFINITY`: left as inherited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rlimits {
    pub nproc: libc::rlim_t,
    pub mem: libc::rlim_t,
    pub cpu: libc::rlim_t,
    pub nofile: libc::rlim_t,
}

/// In the command's own process: sets its limits, soft and hard alike (so that it cannot raise
/// them), each at most the hard limit it already has (raising one would need a capability).
pub(crate) fn set_limits(l: &Rlimits) -> Result<(), ()> {
    for (resource, value, step) in [
        (
            libc::RLIMIT_NPROC,
            l.nproc,
            &b"setting the process limit"[..],
        ),
        (libc::RLIMIT_AS, l.mem, b"setting the address space limit"),
        (libc::RLIMIT_CPU, l.cpu, b"setting the CPU time limit"),
        (
            libc::RLIMIT_NOFILE,
            l.nofile,
            b"setting the open files limit",
        ),
    ] {
        if value == libc::RLIM_INFINITY {
            continue;
        }
        // SAFETY: getrlimit/setrlimit on stack structs.
        unsafe {
            let mut now = libc::rlimit {
                rlim_cur: 0,
                rlim_max: 0,
            };
            if libc::getrlimit(resource, &mut now) != 0 {
                return fail(step);
            }
            let v = value.min(now.rlim_max);
            let new = libc::rlimit {
                rlim_cur: v,
                rlim_max: v,
            };
            if libc::setrlimit(resource, &new) != 0 {
                return fail(step);
            }
        }
    }
    Ok(())
}

/// Sets the `oom_score_adj` of `pid` (0: this process) to 1000, so that the kernel's OOM
/// killer takes commands before the lead and the workers. A writer with CAP_SYS_RESOURCE (a
/// root keeper) also makes 1000 the floor, which the process and its children cannot go
/// below again; an unprivileged team cannot set a floor, and its commands may lower the score
/// back to the worker's own.
pub(crate) fn oom_first(pid: libc::pid_t) -> Result<(), ()> {
    let mut buf = [0u8; 64];
    let path = if pid == 0 {
        join(&mut buf, &[b"/proc/self/oom_score_adj"])
    } else {
        let (d, n) = digits(pid as u64);
        join(&mut buf, &[b"/proc/", &d[..n], b"/oom_score_adj"])
    };
    // SAFETY: open/prctl/write/close on a NUL-terminated path and a static buffer.
    unsafe {
        let mut fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0
            && pid == 0
            && Errno::last() == Errno::EACCES
            && libc::prctl(libc::PR_GET_DUMPABLE) == 0
        {
            // The /proc files of a process that is not dumpable (the worker is not, and this
            // is its copy) belong to root: dumpable for the one open, which checks it.
            libc::prctl(libc::PR_SET_DUMPABLE, 1);
            fd = libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            libc::prctl(libc::PR_SET_DUMPABLE, 0);
        }
        if fd < 0 {
            return fail(b"opening oom_score_adj");
        }
        let ok = libc::write(fd, b"1000".as_ptr().cast(), 4) == 4;
        if !ok {
            failed(b"writing oom_score_adj");
        }
        libc::close(fd);
        if ok { Ok(()) } else { Err(()) }
    }
}

/// In the command's own process, last thing before exec: takes the plan's user, drops every
/// capability, sets no-new-privileges, enters the working directory and the Landlock domain
/// (`ruleset`: the ruleset the worker built for this command, or -1).
pub(crate) fn confine(plan: &Plan, ruleset: RawFd) -> Result<(), ()> {
    // SAFETY: plain syscalls on integers and on memory built before the fork.
    unsafe {
        // The secure bits and the bounding set need CAP_SETPCAP, which the switch of user
        // below takes away; the switch itself needs CAP_SETUID, which capset takes away.
        if plan.drop_caps {
            lock_out_caps()?;
        }
        if let Some((uid, gid)) = plan.switch_to {
            if plan.clear_groups_in_child && libc::setgroups(0, std::ptr::null()) != 0 {
                return fail(b"setgroups");
            }
            if libc::setresgid(gid, gid, gid) != 0 {
                return fail(b"setresgid");
            }
            if libc::setresuid(uid, uid, uid) != 0 {
                return fail(b"setresuid");
            }
        }
        if plan.drop_caps {
            clear_caps()?;
        }
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
            return fail(b"no_new_privs");
        }
        if libc::chdir(plan.workdir.as_ptr()) != 0 {
            return fail(b"entering the working directory");
        }
        if ruleset >= 0 {
            for r in &plan.inner_rules {
                add_rule(ruleset, r)?;
            }
            if libc::syscall(libc::SYS_landlock_restrict_self, ruleset, 0) != 0 {
                return fail(b"landlock_restrict_self");
            }
            libc::close(ruleset);
        }
    }
    Ok(())
}

/// `struct landlock_path_beneath_attr` of the kernel's uapi (packed).
#[repr(C, packed)]
struct PathBeneathAttr {
    allowed_access: u64,
    parent_fd: i32,
}

/// `LANDLOCK_RULE_PATH_BENEATH`.
const RULE_PATH_BENEATH: libc::c_int = 1;

/// Adds a rule for a tree mounted in the sandbox itself (its own `/proc`), which the worker
/// could not name when it built the ruleset.
///
/// # Safety
/// Only in the sandbox's children.
unsafe fn add_rule(ruleset: RawFd, r: &Rule) -> Result<(), ()> {
    // SAFETY: open/syscall/close on a NUL-terminated path and a stack struct.
    unsafe {
        let fd = libc::open(r.path.as_ptr(), libc::O_PATH | libc::O_CLOEXEC);
        if fd < 0 {
            if r.skip_missing && Errno::last() == Errno::ENOENT {
                return Ok(());
            }
            return fail(b"opening a path of a landlock rule");
        }
        let attr = PathBeneathAttr {
            allowed_access: r.access,
            parent_fd: fd,
        };
        let ok = libc::syscall(
            libc::SYS_landlock_add_rule,
            ruleset,
            RULE_PATH_BENEATH,
            &attr as *const PathBeneathAttr,
            0,
        ) == 0;
        if !ok {
            failed(b"landlock_add_rule");
        }
        libc::close(fd);
        if ok { Ok(()) } else { Err(()) }
    }
}

/// Makes sure no capability can come back: the bounding and ambient sets are emptied and the
/// secure bits say uid 0 gains nothing at exec (locked). [`clear_caps`] then drops the ones
/// held.
///
/// # Safety
/// Only in the sandbox's children.
unsafe fn lock_out_caps() -> Result<(), ()> {
    const SECBIT_NOROOT: libc::c_ulong = 1 << 0;
    const SECBIT_NOROOT_LOCKED: libc::c_ulong = 1 << 1;
    const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;
    const SECBIT_NO_SETUID_FIXUP_LOCKED: libc::c_ulong = 1 << 3;
    const SECBIT_KEEP_CAPS_LOCKED: libc::c_ulong = 1 << 5;
    const SECBIT_NO_CAP_AMBIENT_RAISE: libc::c_ulong = 1 << 6;
    const SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED: libc::c_ulong = 1 << 7;
    // SAFETY: prctl and capset on integers and a stack struct.
    unsafe {
        let bits = SECBIT_NOROOT
            | SECBIT_NOROOT_LOCKED
            | SECBIT_NO_SETUID_FIXUP
            | SECBIT_NO_SETUID_FIXUP_LOCKED
            | SECBIT_KEEP_CAPS_LOCKED
            | SECBIT_NO_CAP_AMBIENT_RAISE
            | SECBIT_NO_CAP_AMBIENT_RAISE_LOCKED;
        if libc::prctl(libc::PR_SET_SECUREBITS, bits, 0, 0, 0) != 0 {
            return fail(b"setting the secure bits");
        }
        for cap in 0..64 {
            if libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                if Errno::last() == Errno::EINVAL {
                    break;
                }
                return fail(b"dropping the bounding set");
            }
        }
        if libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        ) != 0
        {
            return fail(b"clearing the ambient set");
        }
    }
    Ok(())
}

/// Clears the effective, permitted and inheritable sets.
///
/// # Safety
/// Only in the sandbox's children.
unsafe fn clear_caps() -> Result<(), ()> {
    // SAFETY: capset on stack structs.
    unsafe {
        #[repr(C)]
        struct Header {
            version: u32,
            pid: i32,
        }
        #[repr(C)]
        struct Data {
            effective: u32,
            permitted: u32,
            inheritable: u32,
        }
        let mut header = Header {
            version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
            pid: 0,
        };
        let data = [
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
            Data {
                effective: 0,
                permitted: 0,
                inheritable: 0,
            },
        ];
        if libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) != 0 {
            return fail(b"capset");
        }
    }
    Ok(())
}
