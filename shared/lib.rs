//! troupe: a team of LLM agents run as real Unix processes.
//!
//! This library owns everything the `lead` and `worker` binaries share: the team directory and
//! its files (inboxes, requests, roster, events, transcripts), the protocol types, the LLM
//! clients, the tools and the agent loop. The binaries never open team files by hand.

pub mod agent;
pub mod bench;
pub mod config;
pub mod error;
pub mod events;
pub mod fsutil;
pub mod ids;
pub mod inbox;
pub mod liveness;
pub mod llm;
pub mod mail;
pub mod message;
pub mod ops;
pub mod requests;
pub mod teamdir;
pub mod tools;
pub mod transcript;
pub mod wait;

pub use error::{Error, Result};
pub use teamdir::{AgentName, TeamDir};
