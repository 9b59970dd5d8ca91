//! The `lead` binary: supervisor, scripting CLI and LLM lead.

fn main() {
    eprintln!(
        "usage: lead [--team-dir DIR] <run|spawn|send|broadcast|inbox|status|requests|shutdown|approve|reject|logs|stop|chat|demo>"
    );
    std::process::exit(2);
}
