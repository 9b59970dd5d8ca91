//! The files backend of the store: the team dir as DESIGN.md lays it out, each shared file
//! changed under an flock of its own (see [`crate::fsutil`]). One machine: a team spread over
//! hosts needs the Redis backend ([`super::redis`]).
//!
//! Documents and records are written here by [`super::doc`] and [`super::records`] (a durable
//! replace under the sidecar lock), inboxes by [`crate::inbox`].

pub(crate) mod aside;
pub mod events;
pub mod roster;
pub mod watch;
