//! The `bash` tool: a command in the working directory, with a timeout and an output cap.
//!
//! The command runs in its own process group, dies with the worker (`PR_SET_PDEATHSIG`), and on
//! timeout the whole group is killed. API keys and `NOTIFY_SOCKET` are removed from its
//! environment. There is no denylist of command strings: confinement is the working directory
//! and the process boundary, not substring matching.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{ToolOutput, cap_output, check_input, input_str};
use crate::tools::fs::Workdir;

/// Default timeout of one command.
pub const BASH_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `bash{command}`. A non-zero exit is a normal result ending in `[exit code N]`; a
/// timeout is an error result with the partial output.
pub fn bash(wd: &Workdir, input: &Value, timeout: Duration) -> ToolOutput {
    let command = match check_input(input).and_then(|_| input_str(input, "command")) {
        Ok(c) => c,
        Err(e) => return ToolOutput::error(e),
    };
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        .arg(command)
        .current_dir(wd.root())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .env_remove("ANTHROPIC_API_KEY")
        .env_remove("OPENAI_API_KEY")
        .env_remove("NOTIFY_SOCKET")
        .process_group(0);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => return ToolOutput::error(format!("failed to start bash: {e}")),
    };
    let pgid = child.id() as i32;
    let readers: Vec<_> = [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn Read + Send>),
    ]
    .into_iter()
    .map(|pipe| {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            if let Some(mut p) = pipe {
                // Keep reading past the cap so the command never blocks on a full pipe.
                let mut chunk = [0u8; 8192];
                while let Ok(n) = p.read(&mut chunk) {
                    if n == 0 {
                        break;
                    }
                    if buf.len() < 4 * super::OUTPUT_CAP {
                        buf.extend_from_slice(&chunk[..n]);
                    }
                }
            }
            buf
        })
    })
    .collect();
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break Some(s),
            Ok(None) if start.elapsed() >= timeout => {
                timed_out = true;
                let _ = nix::sys::signal::killpg(
                    nix::unistd::Pid::from_raw(pgid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                break child.wait().ok();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => return ToolOutput::error(format!("failed to wait for bash: {e}")),
        }
    };
    // Whatever the command left running in its group goes with it.
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid),
        nix::sys::signal::Signal::SIGKILL,
    );
    let mut outs = readers.into_iter().map(|h| h.join().unwrap_or_default());
    let stdout = String::from_utf8_lossy(&outs.next().unwrap_or_default()).into_owned();
    let stderr = String::from_utf8_lossy(&outs.next().unwrap_or_default()).into_owned();
    let mut text = match (stdout.is_empty(), stderr.is_empty()) {
        (_, true) => stdout,
        (true, false) => stderr,
        (false, false) => format!("{stdout}\n[stderr]\n{stderr}"),
    };
    if timed_out {
        return ToolOutput::error(cap_output(format!(
            "command timed out after {} s and was killed; partial output:\n{text}",
            timeout.as_secs()
        )));
    }
    if let Some(code) = status.and_then(|s| s.code())
        && code != 0
    {
        text.push_str(&format!("\n[exit code {code}]"));
    }
    ToolOutput::ok(cap_output(text))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn wd() -> (tempfile::TempDir, Workdir) {
        let t = tempfile::tempdir().unwrap();
        let w = Workdir::new(t.path()).unwrap();
        (t, w)
    }

    #[test]
    fn runs_in_workdir_with_exit_code() {
        let (_t, w) = wd();
        let out = bash(&w, &json!({"command": "pwd; exit 3"}), BASH_TIMEOUT);
        assert!(!out.is_error);
        assert!(out.content.contains(w.root().to_str().unwrap()));
        assert!(out.content.ends_with("[exit code 3]"));
    }

    #[test]
    fn timeout_kills_the_group() {
        let (_t, w) = wd();
        let t0 = Instant::now();
        let out = bash(
            &w,
            &json!({"command": "echo started; sleep 30 & sleep 30"}),
            Duration::from_secs(1),
        );
        assert!(
            out.is_error && out.content.starts_with("command timed out after 1 s"),
            "{}",
            out.content
        );
        assert!(out.content.contains("started"));
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn output_is_capped_and_keys_are_hidden() {
        let (_t, w) = wd();
        let out = bash(
            &w,
            &json!({"command": "head -c 60000 /dev/zero | tr '\\0' a"}),
            BASH_TIMEOUT,
        );
        assert!(
            out.content
                .ends_with("[output truncated: 10000 more characters not shown]")
        );
        let out = Command::new("true").status();
        assert!(out.is_ok());
        // SAFETY: tests in this module do not read the environment concurrently.
        unsafe { std::env::set_var("ANTHROPIC_API_KEY", "sk-secret-test") };
        let out = bash(
            &w,
            &json!({"command": "echo key=${ANTHROPIC_API_KEY:-none}"}),
            BASH_TIMEOUT,
        );
        assert_eq!(out.content.trim(), "key=none");
    }
}
