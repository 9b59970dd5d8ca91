//! The supervisor's hold on its host, on a team spread over machines (see
//! [`troupe::store::HostLease`]): a thread renews the lease every [`RENEW_EVERY`] for as long as the
//! supervisor lives, through a graceful team stop too (which blocks the main loop for up to
//! `--stop-timeout`), and looks for a `lead stop` aimed at this host. What it finds, it raises as
//! a flag and a byte on the supervisor's wake pipe.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use troupe::store::HostLease;
use troupe::store::redis::lease::keep_renewing;

/// How often the lease is renewed (well inside [`troupe::store::HOST_LEASE`]).
const RENEW_EVERY: Duration = Duration::from_millis(500);

#[derive(Default)]
struct Flags {
    /// Another supervisor holds the lease now.
    lost: AtomicBool,
    /// `lead stop` asked this host to stop.
    stop: AtomicBool,
    /// The supervisor is done: let the lease go.
    done: AtomicBool,
}

pub struct LeaseKeeper {
    flags: Arc<Flags>,
    handle: Option<JoinHandle<HostLease>>,
}

impl LeaseKeeper {
    /// Keeps `lease` from now on; `wake` gets a byte when a flag goes up.
    pub fn start(lease: HostLease, wake: std::os::unix::net::UnixStream) -> LeaseKeeper {
        let flags = Arc::new(Flags::default());
        let f = flags.clone();
        let handle = std::thread::Builder::new()
            .name("lease".into())
            .spawn(move || keep(lease, &f, wake))
            .expect("spawn the lease thread");
        LeaseKeeper {
            flags,
            handle: Some(handle),
        }
    }

    /// Whether another supervisor took the lease.
    pub fn lost(&self) -> bool {
        self.flags.lost.load(Ordering::SeqCst)
    }

    /// Whether `lead stop` asked this host to stop.
    pub fn stop_requested(&self) -> bool {
        self.flags.stop.load(Ordering::SeqCst)
    }

    /// Stops renewing and lets the lease go (unless it was lost).
    pub fn release(mut self) {
        self.flags.done.store(true, Ordering::SeqCst);
        if let Some(h) = self.handle.take()
            && let Ok(lease) = h.join()
            && !self.lost()
        {
            lease.release();
        }
    }
}

fn keep(lease: HostLease, flags: &Flags, mut wake: std::os::unix::net::UnixStream) -> HostLease {
    let lost = keep_renewing(
        || lease.renew(),
        &flags.done,
        RENEW_EVERY,
        "the members carry on",
        || {
            if !flags.stop.load(Ordering::SeqCst) && lease.stop_requested().unwrap_or(false) {
                tracing::info!(host = lease.host(), "`lead stop` asked this host to stop");
                flags.stop.store(true, Ordering::SeqCst);
                let _ = wake.write(&[0]);
            }
        },
    );
    if lost {
        tracing::error!(
            host = lease.host(),
            "another supervisor took this host's lease (this one was stalled past it); \
             stopping this host's members"
        );
        flags.lost.store(true, Ordering::SeqCst);
        let _ = wake.write(&[0]);
    }
    lease
}
