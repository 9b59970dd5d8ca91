//! Output of the command-line programs that ends quietly when its reader has gone.
//!
//! SIGPIPE stays ignored in troupe's processes (Rust's default): the hook runner, the bash tool
//! and the Redis client rely on EPIPE from a write instead of a signal that would kill the
//! whole process. So a write to a closed pipe (`lead status | head -1`) returns an error,
//! which `println!` turns into a panic. The binaries shadow `println!`, `print!`, `eprintln!`
//! and `eprint!` with the macros below (`use troupe::{println, eprintln};` in each module), and
//! `main` maps an error that is a broken pipe to the same quiet exit ([`is_broken_pipe`]).
//!
//! The exit status is [`EXIT_PIPE`], 141: what a shell reports for a process killed by SIGPIPE,
//! as `cat` or `grep` are in the same place, so `set -o pipefail` scripts see troupe as they see
//! any other tool.

use std::fmt;
use std::io::{self, Write};

/// The exit status after the reader of stdout (or stderr) went away: 128 + SIGPIPE.
pub const EXIT_PIPE: u8 = 141;

/// Writes `args` (and a newline) to stdout; a closed pipe ends the process with
/// [`EXIT_PIPE`], any other write error with 74 (`EX_IOERR`) and a word on stderr.
pub fn print(args: fmt::Arguments<'_>, newline: bool) {
    let mut out = io::stdout().lock();
    let written = out.write_fmt(args).and_then(|()| {
        if newline {
            out.write_all(b"\n")
        } else {
            Ok(())
        }
    });
    if let Err(e) = written {
        drop(out);
        end(&e, "stdout");
    }
}

/// [`print()`] to stderr.
pub fn eprint(args: fmt::Arguments<'_>, newline: bool) {
    let mut err = io::stderr().lock();
    let written = err.write_fmt(args).and_then(|()| {
        if newline {
            err.write_all(b"\n")
        } else {
            Ok(())
        }
    });
    if let Err(e) = written {
        drop(err);
        end(&e, "stderr");
    }
}

fn end(e: &io::Error, stream: &str) -> ! {
    if e.kind() == io::ErrorKind::BrokenPipe {
        std::process::exit(i32::from(EXIT_PIPE));
    }
    let _ = writeln!(io::stderr(), "cannot write to {stream}: {e}");
    std::process::exit(74);
}

/// Whether `e` (or an error in its chain) is a write to a closed pipe.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<io::Error>()
            .is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe)
    })
}

/// `println!` that ends the process quietly when stdout's reader has gone (see the module).
/// The binaries import it (`use troupe::println;`) over std's.
#[macro_export]
macro_rules! println {
    () => {
        $crate::out::print(format_args!(""), true)
    };
    ($($t:tt)*) => {
        $crate::out::print(format_args!($($t)*), true)
    };
}

/// `print!` that ends the process quietly when stdout's reader has gone.
#[macro_export]
macro_rules! print {
    ($($t:tt)*) => {
        $crate::out::print(format_args!($($t)*), false)
    };
}

/// `eprintln!` that ends the process quietly when stderr's reader has gone.
#[macro_export]
macro_rules! eprintln {
    () => {
        $crate::out::eprint(format_args!(""), true)
    };
    ($($t:tt)*) => {
        $crate::out::eprint(format_args!($($t)*), true)
    };
}

/// `eprint!` that ends the process quietly when stderr's reader has gone.
#[macro_export]
macro_rules! eprint {
    ($($t:tt)*) => {
        $crate::out::eprint(format_args!($($t)*), false)
    };
}
