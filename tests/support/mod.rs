//! Helpers shared by the integration tests. Each test binary uses a different subset.

#![allow(
    dead_code,
    reason = "each test binary uses a different subset of the helpers"
)]

pub mod child;
pub mod cli;
pub mod drain;
pub mod fake_llm;
pub mod git;
pub mod hosts;
pub mod redis_server;
pub mod team;
