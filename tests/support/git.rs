//! git in the tests: run in a dir with no inherited repository overrides, and a fresh
//! repository with one commit.

use std::path::Path;
use std::process::{Command, Output};

/// `git -C dir ARGS` (any owner's repository: the team may run as another user).
pub fn git(dir: &Path, args: &[&str]) -> Output {
    Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "safe.directory=*"])
        .args(args)
        .env_remove("GIT_DIR")
        .env_remove("GIT_WORK_TREE")
        .output()
        .unwrap()
}

/// [`git`], its stdout; it must succeed.
pub fn git_ok(dir: &Path, args: &[&str]) -> String {
    let o = git(dir, args);
    assert!(
        o.status.success(),
        "git {args:?} in {}: {}",
        dir.display(),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Commits what is staged in `dir` as a person would, with an identity of the test's own.
pub fn commit(dir: &Path, message: &str) {
    git_ok(
        dir,
        &[
            "-c",
            "user.name=Test",
            "-c",
            "user.email=test@example.invalid",
            "commit",
            "-q",
            "-m",
            message,
        ],
    );
}

/// Makes `repo` a repository on `main` (no identity of its own) whose one commit adds `file`
/// (a path inside it).
pub fn init_with(repo: &Path, file: &str) {
    std::fs::create_dir_all(repo.join(file).parent().unwrap()).unwrap();
    git_ok(repo, &["init", "-q", "-b", "main"]);
    std::fs::write(repo.join(file), "the main tree\n").unwrap();
    git_ok(repo, &["add", file]);
    commit(repo, "first");
}
