//! Computes `TROUPE_BUILD_ID`: the package version and a hash of every file the binaries are
//! built from, so that `lead run` can tell a `worker` of its own build from a stale one (see
//! `lead/worker_exe.rs`). Two builds of the same sources get the same id, on any machine.
//!
//! The hash is FNV-1a (64 bits) over each file's path relative to the package root (sorted,
//! `/`-separated), its length and its contents. It needs no dependency: it tells builds apart,
//! it does not defend against anyone.

use std::fs;
use std::path::{Path, PathBuf};

/// Files and directories (taken whole) that make up the binaries.
const INPUTS: [&str; 7] = [
    "Cargo.toml",
    "Cargo.lock",
    "build.rs",
    "shared",
    "lead",
    "worker",
    "scripts/demo.cassette.jsonl",
];

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// Every file under `path` (or `path` itself), relative to `root`.
fn collect(root: &Path, path: &Path, out: &mut Vec<PathBuf>) {
    let full = root.join(path);
    if full.is_dir() {
        let entries = fs::read_dir(&full)
            .unwrap_or_else(|e| panic!("failed to list {}: {e}", full.display()));
        for entry in entries {
            let entry = entry.unwrap_or_else(|e| panic!("failed to list {}: {e}", full.display()));
            collect(root, &path.join(entry.file_name()), out);
        }
    } else if full.is_file() {
        out.push(path.to_path_buf());
    }
}

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let mut files = Vec::new();
    for input in INPUTS {
        // A missing input (say, no Cargo.lock yet) is left out; naming it would make cargo
        // rerun this script on every build.
        if root.join(input).exists() {
            println!("cargo:rerun-if-changed={input}");
            collect(&root, Path::new(input), &mut files);
        }
    }
    let mut names: Vec<(String, PathBuf)> = files
        .into_iter()
        .map(|p| {
            let name: Vec<String> = p
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            (name.join("/"), p)
        })
        .collect();
    names.sort();
    let mut hash = FNV_OFFSET;
    for (name, path) in &names {
        let full = root.join(path);
        let bytes =
            fs::read(&full).unwrap_or_else(|e| panic!("failed to read {}: {e}", full.display()));
        hash = fnv1a(hash, name.as_bytes());
        hash = fnv1a(hash, &[0]);
        hash = fnv1a(hash, &(bytes.len() as u64).to_le_bytes());
        hash = fnv1a(hash, &bytes);
    }
    let version = std::env::var("CARGO_PKG_VERSION").expect("set by cargo");
    println!("cargo:rustc-env=TROUPE_BUILD_ID={version}-{hash:016x}");
    if packs_relative_relocations() {
        println!("cargo:rustc-link-arg-bins=-Wl,-z,pack-relative-relocs");
    }
}

/// Whether to link `lead` and `worker` with packed relative relocations (`DT_RELR`): a
/// position-independent Rust binary carries one 24-byte `RELA` entry per pointer the loader must
/// adjust (about 10,000 in `worker`, 250 kB read at every start and kept resident), where
/// `DT_RELR` needs a few kB. Measured on an idle worker: 0.24 MB less RSS. The loader must know
/// the format: glibc 2.36 or later, so only when building on such a glibc for the same target
/// (a cross build, or another libc, links as before). A linker that does not know the option
/// (GNU ld before 2.38) warns and ignores it.
fn packs_relative_relocations() -> bool {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux"
        || var("CARGO_CFG_TARGET_ENV") != "gnu"
        || var("HOST") != var("TARGET")
    {
        return false;
    }
    glibc_version().is_some_and(|v| v >= (2, 36))
}

/// The running glibc's version, as `(major, minor)`.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_version() -> Option<(u32, u32)> {
    unsafe extern "C" {
        fn gnu_get_libc_version() -> *const std::ffi::c_char;
    }
    // SAFETY: glibc returns a pointer to a static NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(gnu_get_libc_version()) };
    let mut parts = text.to_str().ok()?.split('.');
    let major = parts.next()?.parse().ok()?;
    let minor = parts
        .next()?
        .trim_end_matches(|c: char| !c.is_ascii_digit())
        .parse()
        .ok()?;
    Some((major, minor))
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn glibc_version() -> Option<(u32, u32)> {
    None
}
