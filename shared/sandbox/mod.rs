//! The sandbox of the `bash` tool: what a command an agent runs can see and touch.
//!
//! (Skeleton: the settings and the status shown in `config.json` and `lead status --json`.
//! The confinement itself lands in the modules beside this one.)

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

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
        f.write_str(self.as_str())
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
    #[arg(long = "sandbox-read", value_name = "DIR")]
    pub read: Vec<PathBuf>,
    /// A directory commands may also write, such as a cache like ~/.cargo (repeatable).
    #[arg(long = "sandbox-write", value_name = "DIR")]
    pub write: Vec<PathBuf>,
    /// When troupe runs as root: the unprivileged user commands run as (name or uid; default
    /// nobody, or root of their own user namespace, without capabilities, when that user
    /// cannot write the working directory). `root` chooses the latter always.
    #[arg(long = "sandbox-user", value_name = "USER")]
    pub user: Option<String>,
}

impl Settings {
    /// The arguments that parse back into these (what `lead run` gives its workers).
    pub fn to_args(&self) -> Result<Vec<String>, String> {
        let Settings {
            mode,
            read,
            write,
            user,
        } = self;
        let mut args = vec!["--sandbox".to_owned(), mode.as_str().to_owned()];
        for (flag, dirs) in [("--sandbox-read", read), ("--sandbox-write", write)] {
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
        Ok(args)
    }
}

/// What the sandbox of an agent's commands is, as found when it started: recorded in the
/// member's `sandbox` field of `config.json` and shown by `lead status`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub mode: Mode,
    /// Every protection below is in force.
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

/// The sandbox of one agent's commands, prepared once when the agent starts.
#[derive(Debug)]
pub struct Sandbox {
    status: Status,
}

impl Sandbox {
    /// Prepares the sandbox for an agent named `name` working in `workdir` of the team at
    /// `team_dir`. Never fails: what cannot be set up is in [`Sandbox::status`], and with
    /// [`Mode::Required`] commands are then refused.
    pub fn prepare(settings: &Settings, workdir: &Path, team_dir: &Path, name: &str) -> Sandbox {
        let _ = (workdir, team_dir, name);
        Sandbox {
            status: Status {
                mode: settings.mode,
                ..Status::default()
            },
        }
    }

    /// No sandbox at all (unit tests, `--sandbox off`).
    pub fn off() -> Sandbox {
        Sandbox {
            status: Status {
                mode: Mode::Off,
                ..Status::default()
            },
        }
    }

    pub fn status(&self) -> &Status {
        &self.status
    }
}
