//! The thread that activates and resets the VM's virtio devices, in the
//! order their drivers asked (see `virtio_devices::transport::common`).
//!
//! A vCPU that writes DRIVER_OK (or 0, a reset) to a status register only
//! queues the work here and returns to the guest: a vhost-user device's
//! activation is a run of round trips to its daemon, which may be slow or
//! stuck (each run is bounded by `vhost_user_fs::VHOST_USER_TIMEOUT`). Meanwhile
//! the vCPU, the bus and the VMM's other threads keep going; the device's
//! queues fill and are served once the activation is done (guest kicks wait
//! in their ioeventfds).

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use virtio_devices::transport::common::Activator;

type Job = Box<dyn FnOnce() + Send>;

/// Hands jobs to the thread; cloned into every transport.
struct Queue(Mutex<Sender<Job>>);

impl Activator for Queue {
    fn run(&self, job: Job) {
        let sent = self.0.lock().unwrap_or_else(|e| e.into_inner()).send(job);
        if sent.is_err() {
            virtio_devices::error_limited!(
                "device activator: the thread is gone; the request is dropped"
            );
        }
    }
}

/// The thread; it ends when the last transport holding its queue is gone
/// and this handle is dropped.
pub struct DeviceActivator {
    queue: Arc<Queue>,
    thread: Option<JoinHandle<()>>,
}

impl DeviceActivator {
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = channel::<Job>();
        let thread = std::thread::Builder::new()
            .name("device-activator".into())
            .spawn(move || {
                if let Err(e) = seccomp::enter_thread(crate::seccomp_filters::ACTIVATOR) {
                    return tracing::error!("device activator: {e}; devices will not activate");
                }
                for job in rx {
                    job();
                }
            })?;
        Ok(DeviceActivator {
            queue: Arc::new(Queue(Mutex::new(tx))),
            thread: Some(thread),
        })
    }

    /// What a transport runs its activations and resets through.
    pub fn activator(&self) -> Arc<dyn Activator> {
        self.queue.clone()
    }
}

impl Drop for DeviceActivator {
    fn drop(&mut self) {
        // Transports (and so senders) may outlive this handle by a moment;
        // the thread ends when they are all gone. Join only if it already did.
        if let Some(t) = self.thread.take() {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn jobs_run_in_order_off_the_calling_thread() {
        let act = DeviceActivator::start().unwrap();
        let queue = act.activator();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let caller = std::thread::current().id();
        let done = Arc::new(AtomicUsize::new(0));
        for i in 0..5 {
            let (seen, done) = (seen.clone(), done.clone());
            queue.run(Box::new(move || {
                assert_ne!(std::thread::current().id(), caller);
                seen.lock().unwrap().push(i);
                done.fetch_add(1, Ordering::SeqCst);
            }));
        }
        while done.load(Ordering::SeqCst) < 5 {
            std::thread::yield_now();
        }
        assert_eq!(*seen.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    }
}
