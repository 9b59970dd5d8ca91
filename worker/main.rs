//! The `worker` binary: one teammate process.

fn main() {
    eprintln!("usage: worker --team-dir DIR --name NAME");
    std::process::exit(64);
}
