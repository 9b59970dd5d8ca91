//! Fencing: which process may act for a member, a host or the lead's inbox when two believe
//! they do (a supervisor stalled past its lease while a successor took over its host, on a
//! team spread over machines).
//!
//! Each member incarnation is an epoch: the supervisor makes it current ([`begin_incarnation`])
//! before the worker process exists, and the worker fences its writes by it ([`act_as_member`]).
//! From then on, every write that acts for the member (consuming or acknowledging its inbox,
//! answering a request, marking a task, changing a record, reserving an id, logging an event,
//! beating, the rate governor's state and slots) is accepted only while its incarnation is the
//! current one, and a replaced worker's is refused with [`crate::Error::Fenced`]: the worker
//! exits [`EXIT_SUPERSEDED`], which is not restarted. A supervisor's writes are fenced by its
//! host lease's epoch, and `lead chat`'s and `lead inbox`'s by the lease of the lead's inbox
//! ([`LeadInboxConsumer`]). A process that acts for nobody (a person's `lead send`, `lead task
//! add`) is not fenced.
//!
//! A fence whose key is gone (a server restarted without its data, a key deleted by hand)
//! refuses too, with [`crate::Error::Unfenced`]: passing would let a stale process write until
//! the next incarnation. Each key is set again by whoever set it: a lease's holder at its next
//! renewal (within a second; its writes are refused meanwhile, and it is not taken for
//! replaced), and a member's by its supervisor at the member's next start. So a worker refused
//! for a missing key exits [`EXIT_UNFENCED`], which its supervisor restarts as a new
//! incarnation without counting it toward the restart limit.
//!
//! In a team dir (no bus) the flocks already make each of these one process (the journal's
//! owner lock per member and for the lead, `lead.lock` per supervisor), and the checks are
//! those locks.

use super::Store;
use crate::error::Result;
use crate::teamdir::TeamDir;

/// The exit code of a worker whose incarnation a newer one replaced: not restarted.
pub const EXIT_SUPERSEDED: u8 = 79;

/// The exit code of a worker whose fence key is gone: sysexits' `EX_TEMPFAIL`, which its
/// supervisor restarts (uncounted) as a new incarnation, setting the key again.
pub const EXIT_UNFENCED: u8 = 75;

/// Makes `incarnation` the current one of member `name` (before its worker starts): an older
/// incarnation's writes are refused from now on. Fenced by the caller's own fence (a
/// supervisor's host lease).
pub fn begin_incarnation(team: &TeamDir, name: &str, incarnation: u64) -> Result<()> {
    match team.store() {
        Store::Redis(bus) => bus.set_member_epoch(name, incarnation),
        Store::Files(_) => Ok(()),
    }
}

/// Fences this process's writes by member `name`'s `incarnation` (a worker, at start).
pub fn act_as_member(team: &TeamDir, name: &str, incarnation: u64) {
    if let Store::Redis(bus) = team.store() {
        bus.set_fence(bus.member_fence(name, incarnation));
    }
}

/// Whether a write of this process was refused because a newer holder of its fence replaced
/// it (never in a team dir).
pub fn replaced(team: &TeamDir) -> bool {
    match team.store() {
        Store::Redis(bus) => bus.replaced(),
        Store::Files(_) => false,
    }
}

/// The one consumer of the lead's inbox across every host of a team: held by `lead chat` for
/// its life and by `lead inbox` for one drain, and refused to a second one with
/// [`crate::Error::Locked`] (exit 4). In a team dir it is the lead journal's owner lock that
/// the caller holds already, and this holds nothing.
pub struct LeadInboxConsumer {
    _lease: Option<super::redis::lease::ConsumerLease>,
}

impl LeadInboxConsumer {
    /// Takes it, and fences this process's writes by it.
    pub fn take(team: &TeamDir) -> Result<LeadInboxConsumer> {
        Ok(LeadInboxConsumer {
            _lease: match team.store() {
                Store::Redis(bus) => Some(super::redis::lease::ConsumerLease::take(bus)?),
                Store::Files(_) => None,
            },
        })
    }
}
