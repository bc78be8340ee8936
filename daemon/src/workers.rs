//! `--thread-pool-size N`: a fixed set of worker threads that serve requests
//! the queue threads pop. With a pool, a slow request (a large WRITE, an
//! fsync) no longer holds up the requests queued behind it on the same
//! queue; without one (N = 0) each queue's thread serves its own requests.
//!
//! Jobs waiting for a worker are capped (`--worker-queue-depth`): a queue
//! thread that finds the pool full serves the request itself, so the
//! queue thread slows down and the guest's further requests wait in its
//! ring, where they cost the daemon nothing. (An errno would fail a guest
//! system call that a local filesystem would have served.)

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct WorkerPool {
    sender: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
    /// Jobs submitted and not yet finished, and how many may be.
    pending: Arc<AtomicUsize>,
    depth: usize,
}

impl WorkerPool {
    /// Starts `size` workers (at least one) that take at most `depth`
    /// jobs at once (at least one).
    pub fn new(size: usize, depth: usize) -> io::Result<Self> {
        let (sender, receiver) = channel::<Job>();
        let receiver = Arc::new(Mutex::new(receiver));
        let pending = Arc::new(AtomicUsize::new(0));
        let threads = (0..size.max(1))
            .map(|i| {
                let receiver = receiver.clone();
                std::thread::Builder::new()
                    .name(format!("fs-worker-{i}"))
                    .spawn(move || work(&receiver))
            })
            .collect::<io::Result<Vec<_>>>()?;
        Ok(WorkerPool {
            sender: Some(sender),
            threads,
            pending,
            depth: depth.max(1),
        })
    }

    pub fn size(&self) -> usize {
        self.threads.len()
    }

    /// Jobs that may wait at once.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Queues `job` for the next free worker; gives it back when `depth`
    /// jobs are already pending.
    pub fn submit<F: FnOnce() + Send + 'static>(&self, job: F) -> Result<(), F> {
        let depth = self.depth;
        if self
            .pending
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < depth).then_some(n + 1)
            })
            .is_err()
        {
            return Err(job);
        }
        let pending = self.pending.clone();
        let sender = self.sender.as_ref().expect("the sender lives until drop");
        // The workers only stop when the sender is dropped, so the channel
        // is open while `self` is.
        let _ = sender.send(Box::new(move || {
            job();
            pending.fetch_sub(1, Ordering::AcqRel);
        }));
        Ok(())
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
        let pool = WorkerPool::new(3, 1000).unwrap();
        assert_eq!(pool.size(), 3);
        // Three jobs that each wait for the other two: only a pool that
        // really runs them at once gets past the barrier.
        let barrier = Arc::new(Barrier::new(3));
        let done = Arc::new(AtomicUsize::new(0));
        for _ in 0..3 {
            let (barrier, done) = (barrier.clone(), done.clone());
            assert!(pool
                .submit(move || {
                    barrier.wait();
                    done.fetch_add(1, Ordering::SeqCst);
                })
                .is_ok());
        }
        for _ in 0..100 {
            let done = done.clone();
            assert!(pool
                .submit(move || {
                    done.fetch_add(1, Ordering::SeqCst);
                })
                .is_ok());
        }
        drop(pool);
        assert_eq!(done.load(Ordering::SeqCst), 103);
    }

    #[test]
    fn a_size_of_zero_still_gets_one_worker() {
        let pool = WorkerPool::new(0, 8).unwrap();
        assert_eq!(pool.size(), 1);
        let (tx, rx) = channel();
        assert!(pool.submit(move || tx.send(7).unwrap()).is_ok());
        assert_eq!(
            rx.recv_timeout(std::time::Duration::from_secs(10)).unwrap(),
            7
        );
    }

    #[test]
    fn a_full_pool_gives_the_job_back_and_takes_jobs_again_once_one_finishes() {
        let pool = WorkerPool::new(1, 2).unwrap();
        let (release, wait) = channel::<()>();
        let wait = Arc::new(Mutex::new(wait));
        let (started, is_started) = channel::<()>();
        for _ in 0..2 {
            let (wait, started) = (wait.clone(), started.clone());
            assert!(pool
                .submit(move || {
                    let _ = started.send(());
                    let _ = wait.lock().unwrap().recv();
                })
                .is_ok());
        }
        let refused = pool.submit(|| ());
        assert!(
            refused.is_err(),
            "a third job past a depth of 2 is given back"
        );
        is_started.recv().unwrap();
        release.send(()).unwrap();
        // The first job finishes; room for one more appears.
        let mut accepted = false;
        for _ in 0..1000 {
            if pool.submit(|| ()).is_ok() {
                accepted = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        release.send(()).unwrap();
        assert!(accepted);
    }
}
