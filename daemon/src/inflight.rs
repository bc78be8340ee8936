//! Requests taken from each queue and not yet on its used ring. The VMM's
//! GET_VRING_BASE (before a snapshot or a migration, and at a reset) stops
//! a queue and reads its next available index: a request popped before it
//! but answered after would be lost to the guest across the move, so
//! `stop_vring` waits (bounded) until none is left on that queue.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long GET_VRING_BASE waits for the requests already taken: a FUSE
/// request the daemon serves ends in host I/O, which this bounds generously.
pub const STOP_WAIT: Duration = Duration::from_secs(30);

#[derive(Default)]
pub struct InFlight {
    counts: Mutex<Vec<usize>>,
    idle: Condvar,
}

/// One request of one queue, counted until dropped (after its used-ring
/// entry is written, or when it is abandoned).
pub struct Busy {
    owner: Arc<InFlight>,
    queue: usize,
}

impl Drop for Busy {
    fn drop(&mut self) {
        let mut counts = self.owner.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(self.queue) {
            *n = n.saturating_sub(1);
        }
        drop(counts);
        self.owner.idle.notify_all();
    }
}

impl InFlight {
    pub fn new(queues: usize) -> Arc<Self> {
        Arc::new(InFlight {
            counts: Mutex::new(vec![0; queues]),
            idle: Condvar::new(),
        })
    }

    /// Counts one request taken from `queue`.
    pub fn begin(self: &Arc<Self>, queue: usize) -> Busy {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = counts.get_mut(queue) {
            *n += 1;
        }
        Busy {
            owner: self.clone(),
            queue,
        }
    }

    /// Waits until no request of `queue` is in flight, at most `wait`;
    /// the count still in flight when the bound passed is the error.
    pub fn wait_idle(&self, queue: usize, wait: Duration) -> Result<(), usize> {
        let deadline = Instant::now() + wait;
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            let n = counts.get(queue).copied().unwrap_or(0);
            if n == 0 {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(n);
            }
            counts = self
                .idle
                .wait_timeout(counts, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::channel;

    use super::*;

    #[test]
    fn stopping_a_queue_waits_for_its_slow_request_only() {
        let f = InFlight::new(2);
        let slow = f.begin(1);
        assert_eq!(f.wait_idle(0, Duration::ZERO), Ok(()), "queue 0 has none");
        assert_eq!(f.wait_idle(1, Duration::ZERO), Err(1), "bounded");
        let (done, finished) = channel();
        let waiter = {
            let f = f.clone();
            std::thread::spawn(move || {
                let r = f.wait_idle(1, STOP_WAIT);
                done.send(()).unwrap();
                r
            })
        };
        // The waiter cannot return while the request is in flight.
        assert!(finished.recv_timeout(Duration::from_millis(50)).is_err());
        drop(slow);
        assert_eq!(waiter.join().unwrap(), Ok(()));
    }
}
