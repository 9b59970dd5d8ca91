//! troupe: a team of LLM agents run as real Unix processes.
//!
//! This library owns everything the `lead` and `worker` binaries share: the team directory and
//! its files (inboxes, requests, roster, events, transcripts), the protocol types, the LLM
//! clients, the tools and the agent loop. The binaries never open team files by hand.

pub mod agent;
pub mod ceilings;
pub mod clock;
pub mod config;
pub mod cost;
pub mod error;
pub mod fsutil;
pub mod governor;
pub mod hooks;
pub mod ids;
pub mod liveness;
pub mod llm;
pub mod mail;
pub mod merge;
pub mod message;
pub mod ops;
pub mod out;
pub mod requests;
pub mod sandbox;
pub mod secrets;
pub mod store;
pub mod tasks;
pub mod teamdir;
pub mod telemetry;
pub mod term_text;
pub mod tools;
pub mod transcript;
pub mod worktree;

pub use error::{Error, Result};
// The store's seams, by the names the rest of the crate knows them.
pub(crate) use store::records;
pub use store::{doc, events, fence, inbox, wait};

/// The build of this code: the package version and 16 hex digits of a hash over every file the
/// binaries are built from (`<version>-<hash>`, computed by `build.rs`). Two builds of the same
/// sources share it; a `worker` built before a `git pull` does not. `worker --build-id` prints
/// it, and `lead run` starts only workers that answer with its own (see `lead/worker_exe.rs`).
pub const BUILD_ID: &str = env!("TROUPE_BUILD_ID");
pub use teamdir::{AgentName, TeamDir};
