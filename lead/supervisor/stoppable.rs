//! A thread of the supervisor that runs until it is told to stop: a stop flag it polls, and a
//! socket that wakes it from its `poll` at once (the hooks thread, the merge queue's).

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;

/// The running thread.
pub struct Stoppable {
    stop: Arc<AtomicBool>,
    wake: UnixStream,
    handle: Option<JoinHandle<()>>,
}

impl Stoppable {
    /// Starts thread `name` running `body(stop, wake)`: it returns once `stop` is set; `wake`
    /// (non-blocking) becomes readable when it is.
    pub fn start(
        name: &str,
        body: impl FnOnce(Arc<AtomicBool>, UnixStream) + Send + 'static,
    ) -> anyhow::Result<Stoppable> {
        let (wake_r, wake_w) = UnixStream::pair()?;
        wake_r.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || body(flag, wake_r))?;
        Ok(Stoppable {
            stop,
            wake: wake_w,
            handle: Some(handle),
        })
    }

    /// Sets the flag, wakes the thread and waits for it to end.
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = (&self.wake).write_all(b"x");
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
