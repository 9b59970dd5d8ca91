//! Text from models and files, made safe to print on a person's terminal.
//!
//! A teammate's message, a task's subject, a plan, a file path a tool was given, a tool name:
//! all of it is written by a model (or read from a file anyone on the team can write), and a
//! terminal obeys the control characters in what it prints. `ESC ] 52` writes the clipboard,
//! `ESC ] 2` sets the window title, `CR ESC [2K` erases the line so far and lets the text after
//! it pass for a line of troupe's own. So every text (non-`--json`) output of the lead CLI that
//! holds such text goes through [`render`] first, which shows each control character as an
//! escape instead of sending it: `\x1b`, `\r`, `\u{9b}`.
//!
//! What is escaped: the C0 controls (U+0000-U+001F), DEL (U+007F) and the C1 controls
//! (U+0080-U+009F; U+009B is a one-character `ESC [` to many terminals). A tab and a line
//! feed are kept where the output's layout has room for them ([`Layout`]). Everything else,
//! a backslash included, is printed as it is, so text without controls reads unchanged.
//!
//! `--json` output needs none of this: JSON escapes the C0 controls, and a program reading it
//! gets the exact strings back.

use std::borrow::Cow;

/// What a piece of text may keep of its own layout where it is printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// A text of its own lines (a message, a task's description or result): keeps line feeds
    /// and tabs.
    Lines,
    /// One line of a listing or a table row: keeps tabs, shows a line feed as `\n`.
    Line,
    /// One cell of tab-separated output: shows tabs and line feeds as `\t` and `\n`, so that
    /// neither can start a cell or a row of its own.
    Cell,
}

/// `text` as it may be printed on a terminal where `layout` holds: every control character it
/// may not keep shown as an escape (see the module). Borrows `text` when nothing needs one.
pub fn render(text: &str, layout: Layout) -> Cow<'_, str> {
    let Some(first) = text.find(|c| escaped(c, layout)) else {
        return Cow::Borrowed(text);
    };
    let mut out = String::with_capacity(text.len() + 16);
    out.push_str(&text[..first]);
    for c in text[first..].chars() {
        if escaped(c, layout) {
            push_escape(&mut out, c);
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// [`render`] for a text of several lines ([`Layout::Lines`]).
pub fn lines(text: &str) -> Cow<'_, str> {
    render(text, Layout::Lines)
}

/// [`render`] for one line ([`Layout::Line`]).
pub fn line(text: &str) -> Cow<'_, str> {
    render(text, Layout::Line)
}

/// [`render`] for a cell of tab-separated output ([`Layout::Cell`]).
pub fn cell(text: &str) -> Cow<'_, str> {
    render(text, Layout::Cell)
}

/// Refuses a one-line name a model or a person gives (a role, say) that holds a control
/// character, line feeds and tabs included: such a value would be escaped at every place it
/// is shown, so it is better not stored. The error names `what` and shows the value escaped.
pub fn check_one_line(what: &str, value: &str) -> Result<(), String> {
    if value.chars().any(char::is_control) {
        return Err(format!(
            "{what} \"{}\" holds control characters (shown escaped): it must be one line of \
             printable text",
            render(value, Layout::Cell)
        ));
    }
    Ok(())
}

/// Whether `c` is shown as an escape in `layout`. `char::is_control` is exactly the C0
/// controls, DEL and the C1 controls (the `Cc` category).
fn escaped(c: char, layout: Layout) -> bool {
    match c {
        '\t' => layout == Layout::Cell,
        '\n' => layout != Layout::Lines,
        c => c.is_control(),
    }
}

/// The escape of control character `c`, in the forms Rust's `escape_debug` uses: `\t`, `\n`,
/// `\r`, two hex digits for the other C0 controls and DEL, `\u{..}` for the C1 controls.
fn push_escape(out: &mut String, c: char) {
    use std::fmt::Write;
    let _ = match c {
        '\t' => write!(out, "\\t"),
        '\n' => write!(out, "\\n"),
        '\r' => write!(out, "\\r"),
        c if u32::from(c) < 0x80 => write!(out, "\\x{:02x}", u32::from(c)),
        c => write!(out, "\\u{{{:x}}}", u32::from(c)),
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Whether `c` may reach the terminal raw in `layout`.
    fn allowed(c: char, layout: Layout) -> bool {
        match c {
            '\t' => layout != Layout::Cell,
            '\n' => layout == Layout::Lines,
            c => !matches!(u32::from(c), 0..=0x1f | 0x7f..=0x9f),
        }
    }

    /// Reverses [`render`] for a text that held no backslash: every backslash of the output
    /// then starts an escape [`render`] wrote.
    fn unescape(s: &str) -> String {
        let mut out = String::new();
        let mut it = s.chars().peekable();
        while let Some(c) = it.next() {
            if c != '\\' {
                out.push(c);
                continue;
            }
            match it.next() {
                Some('t') => out.push('\t'),
                Some('n') => out.push('\n'),
                Some('r') => out.push('\r'),
                Some('x') => {
                    let hex: String = it.by_ref().take(2).collect();
                    out.push(char::from(u8::from_str_radix(&hex, 16).unwrap()));
                }
                Some('u') => {
                    assert_eq!(it.next(), Some('{'));
                    let hex: String = it.by_ref().take_while(|&c| c != '}').collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).unwrap()).unwrap());
                }
                other => panic!("a stray backslash before {other:?} in {s:?}"),
            }
        }
        out
    }

    const LAYOUTS: [Layout; 3] = [Layout::Lines, Layout::Line, Layout::Cell];

    /// Text rich in what matters here: controls of every kind, backslashes, tabs, line feeds,
    /// and any other character.
    fn texts() -> impl Strategy<Value = String> {
        let ch = prop_oneof![
            3 => (0u32..=0x1f).prop_map(|c| char::from_u32(c).unwrap()),
            2 => (0x7fu32..=0x9f).prop_map(|c| char::from_u32(c).unwrap()),
            1 => Just('\\'),
            1 => Just('\t'),
            1 => Just('\n'),
            4 => any::<char>(),
        ];
        proptest::collection::vec(ch, 0..40).prop_map(|v| v.into_iter().collect())
    }

    proptest! {
        #[test]
        fn output_holds_no_forbidden_character(s in texts(), arbitrary in ".*") {
            for layout in LAYOUTS {
                for t in [&s, &arbitrary] {
                    let out = render(t, layout);
                    prop_assert!(out.chars().all(|c| allowed(c, layout)), "{out:?}");
                }
            }
        }

        #[test]
        fn text_without_controls_is_unchanged(s in "[^\\p{Cc}]*") {
            for layout in LAYOUTS {
                prop_assert!(matches!(render(&s, layout), Cow::Borrowed(t) if t == s));
            }
        }

        #[test]
        fn allowed_characters_pass_and_each_control_becomes_its_own_escape(s in texts()) {
            for layout in LAYOUTS {
                let out = render(&s, layout);
                let by_char: String = s.chars().map(|c| render(&c.to_string(), layout).into_owned()).collect();
                prop_assert_eq!(&*out, &by_char);
                for c in s.chars() {
                    let one = c.to_string();
                    let r = render(&one, layout);
                    if allowed(c, layout) {
                        prop_assert_eq!(&*r, &*one);
                    } else {
                        prop_assert!(r.starts_with('\\') && r.len() > 1, "{r:?}");
                        prop_assert!(r.chars().all(|c| c.is_ascii_graphic()), "{r:?}");
                    }
                }
            }
        }

        #[test]
        fn text_without_backslashes_reads_back(s in texts()) {
            let s: String = s.chars().filter(|&c| c != '\\').collect();
            for layout in LAYOUTS {
                prop_assert_eq!(unescape(&render(&s, layout)), s.clone());
            }
        }

        #[test]
        fn one_line_names_refuse_exactly_the_controls(s in texts()) {
            let has_control = s.chars().any(|c| u32::from(c) <= 0x1f || (0x7f..=0x9f).contains(&u32::from(c)));
            let checked = check_one_line("role", &s);
            prop_assert_eq!(checked.is_err(), has_control);
            if let Err(e) = checked {
                prop_assert!(e.chars().all(|c| !c.is_control()), "{e:?}");
            }
        }
    }

    #[test]
    fn escapes_read_as_rust_writes_them() {
        let payload = "done\x1b]52;c;Y3VybA==\x07\x1b]2;PWNED\x07\r\x1b[2Kforged\x08\u{9b}31m\x7f";
        assert_eq!(
            line(payload),
            r"done\x1b]52;c;Y3VybA==\x07\x1b]2;PWNED\x07\r\x1b[2Kforged\x08\u{9b}31m\x7f"
        );
        assert_eq!(lines("a\n\tb\\n"), "a\n\tb\\n");
        assert_eq!(line("a\n\tb"), r"a\n	b");
        assert_eq!(cell("a\n\tb"), r"a\n\tb");
        assert_eq!(line("\0\u{85}"), r"\x00\u{85}");
        assert!(check_one_line("role", "code reviewer").is_ok());
        assert_eq!(
            check_one_line("role", "x\x1b]2;T\x07").unwrap_err(),
            "role \"x\\x1b]2;T\\x07\" holds control characters (shown escaped): it must be one \
             line of printable text"
        );
    }
}
