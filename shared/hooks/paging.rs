//! What a paging hook may name.
//!
//! A `request_pending` hook pages a person: it needs the person's environment (a webhook
//! token) and the network, so the supervisor runs it as its own user, outside the sandbox. Its
//! command line comes from a team file a person applied, but the files it runs or loads need
//! not: `./scripts/page-oncall.sh` in the team's working dir is whatever a teammate last wrote
//! there (review 4, R4-4). So a paging hook runs from `/`, where nothing belongs to the project
//! (`python3 -m pager`, `npx`, `make` find nothing of it there), with a PATH of system dirs,
//! and [`refusal`] turns away a command that names a file a member's commands can write: a path
//! relative to where it runs (`./x.sh`), a program named by a relative path, an absolute path
//! inside a member-writable tree (also as `NAME=PATH`, `--opt=PATH`, `@PATH`, `~/...`), or a
//! program the PATH would find there. The words are split as `sh` splits them, as far as
//! quotes, operators and `$(...)` go; a shell's `-c` script and `eval`'s words are looked into
//! the same way.
//!
//! This is a check of what the command line names, not of what the programs it runs then do:
//! a program outside every tree that reads a script from the project (a pager configured to)
//! is the person's to keep out. The docs say so.

use std::path::{Path, PathBuf};

/// One word of a command line, quotes removed, and whether it stands where `sh` takes a
/// program's name.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Word {
    text: String,
    program: bool,
}

/// What [`refusal`] needs to know of the machine, given by the caller (the policy stays pure).
pub struct Places<'a> {
    /// What the member-writable tree `path` (absolute) lies in is called ("the team's working
    /// dir"), judged where it leads and where its name is; `None` outside every one.
    pub writable: &'a dyn Fn(&Path) -> Option<String>,
    /// Where `sh` would find a program named without a `/`, on the PATH the hook gets.
    pub on_path: &'a dyn Fn(&str) -> Option<PathBuf>,
    /// `~` and `$HOME`.
    pub home: Option<&'a Path>,
}

/// Programs that run the word after them (or a later one) as a program.
const WRAPPERS: &[&str] = &[
    "exec", "command", "builtin", "env", "nice", "nohup", "time", "timeout", "setsid", "stdbuf",
    "sudo", "doas", "xargs", "if", "then", "else", "elif", "do", "while", "until", "!", "{",
];

/// Shells whose `-c` argument is a script.
const SHELLS: &[&str] = &["sh", "bash", "dash", "zsh", "ksh", "mksh", "ash", "busybox"];

/// Why the paging hook `command` may not run, or `None` if it names no file a member can
/// write (see the module's doc).
pub fn refusal(command: &str, places: &Places<'_>) -> Option<String> {
    refusal_at(command, places, 0)
}

fn refusal_at(command: &str, places: &Places<'_>, depth: usize) -> Option<String> {
    // A script in a script in a script: enough to see through the usual `sh -c '...'`.
    if depth > 4 {
        return Some("it nests shells too deeply to be checked".to_owned());
    }
    let (commands, nested) = split(command);
    for words in &commands {
        for w in words {
            if let Some(why) = word_refusal(w, places) {
                return Some(why);
            }
        }
        // `sh -c SCRIPT`, `eval WORDS...`: the script is a command line too.
        let scripts = scripts_of(words);
        for s in scripts {
            if let Some(why) = refusal_at(&s, places, depth + 1) {
                return Some(why);
            }
        }
    }
    nested
        .iter()
        .find_map(|inner| refusal_at(inner, places, depth + 1))
}

/// The scripts a simple command hands to a shell: the word after `-c` of a shell, the rest of
/// the words of `eval`.
fn scripts_of(words: &[Word]) -> Vec<String> {
    let Some(at) = words.iter().position(|w| w.program) else {
        return Vec::new();
    };
    let name = words[at].text.rsplit('/').next().unwrap_or_default();
    let rest = &words[at + 1..];
    if name == "eval" {
        let all: Vec<&str> = rest.iter().map(|w| w.text.as_str()).collect();
        return vec![all.join(" ")];
    }
    if SHELLS.contains(&name) {
        return rest
            .windows(2)
            .filter(|p| p[0].text.starts_with('-') && p[0].text.contains('c'))
            .map(|p| p[1].text.clone())
            .collect();
    }
    // A wrapper's program may be the shell: `exec sh -c ...`, `env X=1 bash -c ...`.
    if WRAPPERS.contains(&name) {
        return scripts_of(rest);
    }
    Vec::new()
}

/// Why word `w` may not be in a paging hook's command.
fn word_refusal(w: &Word, places: &Places<'_>) -> Option<String> {
    let text = expand_home(&w.text, places.home);
    let mut candidates = vec![(text.clone(), w.program)];
    // `NAME=PATH`, `--opt=PATH`, `PATH:PATH`, `@PATH` (curl's file argument).
    if let Some((_, value)) = text.split_once('=') {
        candidates.extend(
            value
                .split(':')
                .map(|v| (expand_home(v, places.home), false)),
        );
    }
    if let Some(file) = text.strip_prefix('@') {
        candidates.push((expand_home(file, places.home), false));
    }
    for (c, program) in candidates {
        if c.starts_with('/') {
            if let Some(what) = (places.writable)(Path::new(&c)) {
                return Some(format!(
                    "it names {c}, which lies in {what}, where teammates' commands can write"
                ));
            }
        } else if c.starts_with("./") || c.starts_with("../") {
            return Some(format!(
                "it names {c}, a path relative to the dir it runs from (a paging hook runs \
                 from /, not from the project)"
            ));
        } else if program && c.contains('/') && !c.contains("://") {
            return Some(format!(
                "it names its program {c} by a relative path (a paging hook runs from /, not \
                 from the project)"
            ));
        } else if program
            && !c.is_empty()
            && let Some(found) = (places.on_path)(&c)
            && let Some(what) = (places.writable)(&found)
        {
            return Some(format!(
                "its program {c} is {}, which lies in {what}, where teammates' commands can \
                 write",
                found.display()
            ));
        }
    }
    None
}

/// `~`, `~/...`, `$HOME/...` and `${HOME}/...` with the home dir put in.
fn expand_home(text: &str, home: Option<&Path>) -> String {
    let Some(home) = home.and_then(Path::to_str) else {
        return text.to_owned();
    };
    for prefix in ["~", "$HOME", "${HOME}"] {
        if let Some(rest) = text.strip_prefix(prefix)
            && (rest.is_empty() || rest.starts_with('/'))
        {
            return format!("{home}{rest}");
        }
    }
    text.to_owned()
}

/// Whether `w` is a shell variable assignment (`NAME=value`).
fn is_assignment(w: &str) -> bool {
    w.split_once('=').is_some_and(|(name, _)| {
        let mut c = name.chars();
        c.next()
            .is_some_and(|f| f.is_ascii_alphabetic() || f == '_')
            && c.all(|x| x.is_ascii_alphanumeric() || x == '_')
    })
}

/// The words of `command`, by simple command, as `sh` splits them; and the command lines
/// inside its double-quoted `$(...)` and backquotes, to be split in turn.
fn split(command: &str) -> (Vec<Vec<Word>>, Vec<String>) {
    let mut s = Splitter::default();
    let chars: Vec<char> = command.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        match c {
            ' ' | '\t' => s.end_word(),
            '\n' | ';' | '&' | '|' | '(' => {
                s.end_word();
                s.end_command();
            }
            ')' => s.end_word(),
            '<' | '>' => {
                s.end_word();
                s.redirect = true;
            }
            '#' if s.word.is_none() => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '\\' => {
                if i < chars.len() {
                    if chars[i] != '\n' {
                        s.push(chars[i]);
                    }
                    i += 1;
                }
            }
            '\'' => {
                s.start();
                while i < chars.len() && chars[i] != '\'' {
                    s.push(chars[i]);
                    i += 1;
                }
                i += 1;
            }
            '"' => {
                s.start();
                while i < chars.len() && chars[i] != '"' {
                    match chars[i] {
                        '\\' if i + 1 < chars.len()
                            && matches!(chars[i + 1], '$' | '`' | '"' | '\\' | '\n') =>
                        {
                            s.push(chars[i + 1]);
                            i += 2;
                        }
                        '$' if chars.get(i + 1) == Some(&'(') => {
                            let (inner, next) = substitution(&chars, i + 2);
                            s.nested.push(inner);
                            i = next;
                        }
                        '`' => {
                            let end = (i + 1..chars.len())
                                .find(|&k| chars[k] == '`')
                                .unwrap_or(chars.len());
                            s.nested.push(chars[i + 1..end].iter().collect());
                            i = end + 1;
                        }
                        c => {
                            s.push(c);
                            i += 1;
                        }
                    }
                }
                i += 1;
            }
            // A command substitution outside quotes: a command line of its own.
            '$' if chars.get(i) == Some(&'(') => {
                let (inner, next) = substitution(&chars, i + 1);
                s.nested.push(inner);
                i = next;
            }
            '`' => {
                let end = (i..chars.len())
                    .find(|&k| chars[k] == '`')
                    .unwrap_or(chars.len());
                s.nested.push(chars[i..end].iter().collect());
                i = end + 1;
            }
            c => s.push(c),
        }
    }
    s.end_word();
    s.end_command();
    (s.commands, s.nested)
}

/// The text of a `$(...)` whose contents start at `from`, and the index after its `)`
/// (parentheses counted; quotes inside are not, which at worst looks at more text).
fn substitution(chars: &[char], from: usize) -> (String, usize) {
    let mut depth = 1;
    let mut k = from;
    while k < chars.len() {
        match chars[k] {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return (chars[from..k].iter().collect(), k + 1);
                }
            }
            _ => {}
        }
        k += 1;
    }
    (chars[from..].iter().collect(), chars.len())
}

#[derive(Default)]
struct Splitter {
    commands: Vec<Vec<Word>>,
    current: Vec<Word>,
    /// The word being read (`Some("")` after an empty `''`).
    word: Option<String>,
    /// The next word stands where a program's name does.
    program_next: bool,
    /// The next word is a redirection's target.
    redirect: bool,
    started: bool,
    nested: Vec<String>,
}

impl Splitter {
    fn begin(&mut self) {
        if !self.started {
            self.started = true;
            self.program_next = true;
        }
    }

    fn start(&mut self) {
        self.begin();
        self.word.get_or_insert_with(String::new);
    }

    fn push(&mut self, c: char) {
        self.start();
        if let Some(w) = &mut self.word {
            w.push(c);
        }
    }

    fn end_word(&mut self) {
        let Some(text) = self.word.take() else {
            return;
        };
        if self.redirect {
            self.redirect = false;
            self.current.push(Word {
                text,
                program: false,
            });
            return;
        }
        // `NAME=value` before the program leaves the next word the program.
        let program = self.program_next && !is_assignment(&text);
        if program {
            let name = text.rsplit('/').next().unwrap_or_default();
            self.program_next = WRAPPERS.contains(&name);
        }
        self.current.push(Word { text, program });
    }

    fn end_command(&mut self) {
        if !self.current.is_empty() {
            self.commands.push(std::mem::take(&mut self.current));
        }
        self.program_next = true;
        self.started = true;
        self.redirect = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn programs(command: &str) -> Vec<String> {
        split(command)
            .0
            .into_iter()
            .flatten()
            .filter(|w| w.program)
            .map(|w| w.text)
            .collect()
    }

    #[test]
    fn words_are_split_as_sh_splits_them() {
        let (cmds, nested) = split(
            "FOO=1 ./page.sh 'a b' \"c $d\" x\\ y >> /var/log/p; curl -d @- https://h/x | tee \
             -a out && exec /bin/true # ./not-run",
        );
        let texts: Vec<Vec<&str>> = cmds
            .iter()
            .map(|c| c.iter().map(|w| w.text.as_str()).collect())
            .collect();
        assert_eq!(
            texts,
            [
                vec!["FOO=1", "./page.sh", "a b", "c $d", "x y", "/var/log/p"],
                vec!["curl", "-d", "@-", "https://h/x"],
                vec!["tee", "-a", "out"],
                vec!["exec", "/bin/true"],
            ]
        );
        assert!(nested.is_empty());
        assert_eq!(
            programs("FOO=1 ./page.sh x; curl y | tee z && exec /bin/true"),
            ["./page.sh", "curl", "tee", "exec", "/bin/true"]
        );
        // A redirection's target is no program, and the command goes on after it.
        assert_eq!(programs(">/dev/null ./x.sh a"), ["./x.sh"]);
        // Substitutions are command lines of their own.
        let (_, nested) = split("echo \"$(./a.sh 1)\" `./b.sh` $(./c.sh (x))");
        assert_eq!(nested, ["./a.sh 1", "./b.sh", "./c.sh (x)"]);
        assert_eq!(programs("(cd /x; ./y)"), ["cd", "./y"]);
    }

    fn places<'a>(
        writable: &'a dyn Fn(&Path) -> Option<String>,
        on_path: &'a dyn Fn(&str) -> Option<PathBuf>,
    ) -> Places<'a> {
        Places {
            writable,
            on_path,
            home: Some(Path::new("/home/ann")),
        }
    }

    fn why(command: &str) -> Option<String> {
        let writable = |p: &Path| {
            [
                ("/srv/app", "the team's working dir"),
                ("/home/ann/cache", "a --sandbox-write dir"),
            ]
            .iter()
            .find(|(t, _)| p.starts_with(t))
            .map(|(_, what)| (*what).to_owned())
        };
        let on_path = |name: &str| match name {
            "pager" => Some(PathBuf::from("/usr/local/bin/pager")),
            "planted" => Some(PathBuf::from("/srv/app/bin/planted")),
            _ => None,
        };
        refusal(command, &places(&writable, &on_path))
    }

    #[test]
    fn a_paging_hook_may_name_system_programs_and_files_outside_the_trees() {
        for ok in [
            "/bin/sh -c 'echo paged >> /var/log/paged.log'",
            "/opt/pager/page.sh",
            "curl -fsS -d @- https://hooks.example.com/T0/B0/x",
            "pager --team \"$TEAM\" < /etc/troupe/page.json",
            "python3 -m pager",
            "PAGER_URL=https://x/y/z pager",
            "jq -r '.plan' | mail -s 'lead: a plan waits 1/2' oncall@example.com",
            "~/bin/page",
            "jq . | pager",
            "jq -r .plan | pager",
            "printf '%s\\n' \"$(cat)\" >> /var/log/p",
        ] {
            assert_eq!(why(ok), None, "{ok}");
        }
    }

    #[test]
    fn a_paging_hook_may_not_name_what_a_member_can_write() {
        for (bad, says) in [
            (
                "./scripts/page-oncall.sh",
                "./scripts/page-oncall.sh, a path relative",
            ),
            (
                "scripts/page-oncall.sh",
                "its program scripts/page-oncall.sh by a relative",
            ),
            ("/srv/app/scripts/page.sh", "lies in the team's working dir"),
            (
                "bash /srv/app/scripts/page.sh",
                "/srv/app/scripts/page.sh, which lies",
            ),
            ("python3 ../x.py", "../x.py"),
            ("cd /srv/app && make page", "/srv/app, which lies"),
            ("/bin/sh -c './x.sh'", "./x.sh, a path relative"),
            ("sh -ec 'cd /srv/app; ./x'", "/srv/app, which"),
            ("env X=1 bash -c \"./x\"", "./x, a path"),
            ("eval ./x", "./x, a path"),
            ("echo \"$(./x.sh)\" | pager", "./x.sh"),
            ("pager `./x.sh`", "./x.sh"),
            ("PYTHONPATH=/srv/app python3 -m pager", "/srv/app, which"),
            ("pager --config=/srv/app/p.toml", "/srv/app/p.toml"),
            ("curl -d @/srv/app/msg https://x", "/srv/app/msg"),
            (
                "~/cache/page.sh",
                "/home/ann/cache/page.sh, which lies in a --sandbox-write",
            ),
            ("$HOME/cache/page.sh", "/home/ann/cache/page.sh"),
            (
                "planted --now",
                "its program planted is /srv/app/bin/planted",
            ),
            (". ./lib.sh", "./lib.sh"),
        ] {
            let w = why(bad).unwrap_or_else(|| panic!("{bad} was let through"));
            assert!(w.contains(says), "{bad}: {w}");
        }
    }
}
