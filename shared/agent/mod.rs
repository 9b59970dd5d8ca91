//! The agent loop shared by teammates (the `worker` binary) and the LLM lead.

pub mod compaction;
pub mod conversation;
pub mod lead;
pub mod outage;
pub mod teammate;
