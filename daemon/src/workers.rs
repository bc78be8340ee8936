//! `--thread-pool-size N`: a fixed set of worker threads that serve requests
//! the queue threads pop. With a pool, a slow request (a large WRITE, an
//! fsync) no longer holds up the requests queued behind it on the same
//! queue; without one (N = 0) each queue's thread serves its own requests.
//!
//! The pool needs no bound of its own: a guest can have at most a queue's
//! size of requests outstanding, so the jobs waiting here are bounded by the
//! queues' sizes.

use std::io;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct WorkerPool {
    sender: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl WorkerPool {
    /// Starts `size` workers (at least one).
    pub fn new(size: usize) -> io::Result<Self> {
        let (sender, receiver) = channel::<Job>();
        let receiver = Arc::new(Mutex::new(receiver));
        let threads = (0..size.max(1))
            .map(|i| {
                let receiver = receiver.clone();
                std::thread::Builder::new().name(format!("fs-worker-{i}")).spawn(move || work(&receiver))
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(WorkerPool { sender: Some(sender), threads })
    }

    pub fn size(&self) -> usize {
        self.threads.len()
    }

    /// Queues `job` for the next free worker.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        let sender = self.sender.as_ref().expect("the sender lives until drop");
        // The workers only stop when the sender is dropped, so the channel
        // is open while `self` is.
        let _ = sender.send(Box::new(job));
    }
}

fn work(receiver: &Mutex<Receiver<Job>>) {
    loop {
        // The lock is held only while waiting for a job, never while running it.
        let job = match receiver.lock().unwrap_or_else(|p| p.into_inner()).recv() {
            Ok(job) => job,
            Err(_) => return,
        };
        job();
    }
}

impl Drop for WorkerPool {
    /// Lets the queued jobs finish, then stops the workers.
    fn drop(&mut self) {
        drop(self.sender.take());
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Barrier;

    #[test]
    fn jobs_run_in_parallel_and_all_finish_before_drop_returns() {
        let pool = WorkerPool::new(3).unwrap();
        assert_eq!(pool.size(), 3);
        // Three jobs that each wait for the other two: only a pool that
        // really runs them at once gets past the barrier.
        let barrier = Arc::new(Barrier::new(3));
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let (barrier, done) = (barrier.clone(), done.clone());
            pool.submit(move || {
                barrier.wait();
                done.fetch_add(1, Ordering::SeqCst);
            });
        }
        for _ in 0..100 {
            let done = done.clone();
            pool.submit(move || {
                done.fetch_add(1, Ordering::SeqCst);
            });
        }
        drop(pool);
        assert_eq!(done.load(Ordering::SeqCst), 103);
    }

    #[test]
    fn a_size_of_zero_still_gets_one_worker() {
        let pool = WorkerPool::new(0).unwrap();
        assert_eq!(pool.size(), 1);
        let (tx, rx) = channel();
        pool.submit(move || tx.send(7).unwrap());
        assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap(), 7);
    }
}
