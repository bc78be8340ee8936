//! What every virtio transport does the same way: the device status state
//! machine, feature negotiation, queue state before activation, activation,
//! reset. A transport maps its registers onto this.
//!
//! Activation and reset run through an [`Activator`]: the VMM's runs them on
//! a thread of its own, not on the vCPU that wrote the status register, so a
//! vhost-user device waiting on its daemon holds neither that vCPU nor the
//! transport's lock. The register state (status, features, queues) changes
//! at once; the device's own work follows in order on the activator.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK, VIRTIO_CONFIG_S_FEATURES_OK,
    VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use crate::device::{ActivatedQueue, Interrupt, VirtioDevice, VirtioInterrupt};
use crate::device_state::SavedQueue;
use crate::event_loop::deferring_joins;
use crate::GuestMemoryMmap;

/// Runs activations and resets, in the order given.
pub trait Activator: Send + Sync {
    fn run(&self, job: Box<dyn FnOnce() + Send>);
}

/// Runs each job on the spot (unit tests, and transports nobody gave an
/// activator).
pub struct Inline;

impl Activator for Inline {
    fn run(&self, job: Box<dyn FnOnce() + Send>) {
        job()
    }
}

/// Where the device is between the driver's DRIVER_OK and its reset.
const IDLE: u8 = 0;
const ACTIVATING: u8 = 1;
pub(super) const ACTIVE: u8 = 2;
pub(super) const FAILED: u8 = 3;

pub(super) type SharedDevice = Arc<Mutex<Box<dyn VirtioDevice>>>;

pub struct VirtioState {
    pub(super) device: SharedDevice,
    pub(super) mem: GuestMemoryAtomic<GuestMemoryMmap>,
    pub(super) queues: Vec<Queue>,
    pub(super) kicks: Vec<EventFd>,
    pub(super) status: u32,
    pub(super) driver_features: u64,
    /// IDLE, ACTIVATING, ACTIVE or FAILED; set by activator jobs.
    pub(super) phase: Arc<AtomicU8>,
    pub(super) activator: Arc<dyn Activator>,
    /// Some while paused (`transport::state`): the positions of the
    /// queues the device gave back (none if it was not running).
    pub(super) paused: Option<Vec<SavedQueue>>,
}

pub(super) fn lock(device: &SharedDevice) -> MutexGuard<'_, Box<dyn VirtioDevice>> {
    device.lock().unwrap_or_else(|e| e.into_inner())
}

impl VirtioState {
    pub fn new(
        device: Box<dyn VirtioDevice>,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
    ) -> std::io::Result<Self> {
        let mut queues = Vec::new();
        let mut kicks = Vec::new();
        for &max in device.queue_max_sizes() {
            let q = Queue::new(max)
                .map_err(|e| std::io::Error::other(format!("queue of size {max}: {e:?}")))?;
            queues.push(q);
            kicks.push(EventFd::new(libc::EFD_NONBLOCK)?);
        }
        Ok(VirtioState {
            device: Arc::new(Mutex::new(device)),
            mem,
            queues,
            kicks,
            status: 0,
            driver_features: 0,
            phase: Arc::new(AtomicU8::new(IDLE)),
            activator: Arc::new(Inline),
            paused: None,
        })
    }

    /// Where activations and resets run from now on.
    pub fn set_activator(&mut self, activator: Arc<dyn Activator>) {
        self.activator = activator;
    }

    /// The device (waits while an activation or reset runs on it).
    pub fn device(&self) -> MutexGuard<'_, Box<dyn VirtioDevice>> {
        lock(&self.device)
    }

    pub fn status(&self) -> u32 {
        match self.phase.load(Ordering::SeqCst) {
            FAILED => self.status | VIRTIO_CONFIG_S_NEEDS_RESET,
            // Not waiting for a device busy with its activation: the
            // driver reads the status often.
            ACTIVE if self.device.try_lock().is_ok_and(|d| d.needs_reset()) => {
                self.status | VIRTIO_CONFIG_S_NEEDS_RESET
            }
            _ => self.status,
        }
    }

    /// Whether the device finished activating and runs.
    pub fn is_activated(&self) -> bool {
        self.phase.load(Ordering::SeqCst) == ACTIVE
    }

    /// One eventfd per queue; guest notifications arrive on them.
    pub fn kicks(&self) -> &[EventFd] {
        &self.kicks
    }

    pub fn queue(&self, index: u32) -> Option<&Queue> {
        self.queues.get(index as usize)
    }

    /// A queue whose registers the driver may still change: before
    /// DRIVER_OK and before the queue is enabled.
    pub fn configurable_queue(&mut self, index: u32) -> Option<&mut Queue> {
        if self.status & VIRTIO_CONFIG_S_DRIVER_OK != 0 {
            return None;
        }
        self.queues.get_mut(index as usize).filter(|q| !q.ready())
    }

    /// Half `select` (0 low, 1 high) of the features the driver wants;
    /// ignored outside the DRIVER..FEATURES_OK window.
    pub fn write_driver_features(&mut self, select: u32, value: u32) {
        if self.status & VIRTIO_CONFIG_S_DRIVER == 0
            || self.status & VIRTIO_CONFIG_S_FEATURES_OK != 0
        {
            return;
        }
        match select {
            0 => self.driver_features = (self.driver_features & !0xffff_ffff) | u64::from(value),
            1 => {
                self.driver_features =
                    (self.driver_features & 0xffff_ffff) | (u64::from(value) << 32)
            }
            _ => {}
        }
    }

    pub fn driver_features(&self) -> u64 {
        self.driver_features
    }

    /// The driver wrote the status register. 0 resets the device.
    pub fn write_status(&mut self, v: u32, interrupt: &Arc<dyn VirtioInterrupt>) {
        if v == 0 {
            self.reset();
            return;
        }
        let new_bits = v & !self.status;
        // The driver may only add bits, in order.
        if v & self.status != self.status {
            tracing::debug!(
                "virtio: status {v:#x} clears bits of {:#x}; ignored",
                self.status
            );
            return;
        }
        if new_bits & VIRTIO_CONFIG_S_FEATURES_OK != 0 {
            let offered = self.device().features();
            let valid = self.driver_features & !offered == 0
                && self.driver_features & (1 << VIRTIO_F_VERSION_1) != 0;
            if !valid {
                // Leaving FEATURES_OK clear tells the driver the set was refused.
                crate::warn_limited!(
                    "virtio: driver features {:#x} refused (offered {offered:#x}, VERSION_1 required)",
                    self.driver_features
                );
                self.status = v & !VIRTIO_CONFIG_S_FEATURES_OK;
                return;
            }
            self.device().ack_features(self.driver_features);
        }
        self.status = v;
        if new_bits & VIRTIO_CONFIG_S_DRIVER_OK != 0 && self.phase.load(Ordering::SeqCst) == IDLE {
            self.activate(interrupt);
        }
    }

    fn activate(&mut self, interrupt: &Arc<dyn VirtioInterrupt>) {
        if self.status & VIRTIO_CONFIG_S_FEATURES_OK == 0 {
            return self.fail("DRIVER_OK without FEATURES_OK", interrupt);
        }
        let mem = self.mem.memory();
        let mut activated = Vec::new();
        for (i, q) in self.queues.iter().enumerate() {
            if !q.ready() {
                continue;
            }
            if !q.is_valid(&*mem) {
                return self.fail(
                    &format!("queue {i} is not valid (addresses, alignment or size)"),
                    interrupt,
                );
            }
            // The device gets its own copy of the queue state; the transport
            // keeps the registers the driver reads back.
            let queue = match Queue::try_from(q.state()) {
                Ok(queue) => queue,
                Err(e) => return self.fail(&format!("queue {i}: {e:?}"), interrupt),
            };
            let kick = match self.kicks[i].try_clone() {
                Ok(k) => k,
                Err(e) => {
                    return self.fail(&format!("cloning queue {i}'s eventfd: {e}"), interrupt)
                }
            };
            activated.push(ActivatedQueue {
                index: narrow::sat_u16(i),
                queue,
                kick,
            });
        }
        self.start_activation(activated, interrupt);
    }

    /// Hands `activated` to the device on the activator: what DRIVER_OK
    /// does, and what a restore does with the saved queue positions.
    pub(super) fn start_activation(
        &mut self,
        activated: Vec<ActivatedQueue>,
        interrupt: &Arc<dyn VirtioInterrupt>,
    ) {
        self.phase.store(ACTIVATING, Ordering::SeqCst);
        let (device, phase, mem, interrupt) = (
            self.device.clone(),
            self.phase.clone(),
            self.mem.clone(),
            interrupt.clone(),
        );
        self.activator.run(Box::new(move || {
            let mut dev = lock(&device);
            match dev.activate(mem, interrupt.clone(), activated) {
                // A reset that came meanwhile has set IDLE: it stays so
                // (its job, next in line, stops the device again).
                Ok(()) => {
                    let _ = phase.compare_exchange(
                        ACTIVATING,
                        ACTIVE,
                        Ordering::SeqCst,
                        Ordering::SeqCst,
                    );
                }
                Err(e) => {
                    crate::error_limited!("virtio device type {}: {e}", dev.device_type());
                    if phase
                        .compare_exchange(ACTIVATING, FAILED, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                    {
                        let _ = interrupt.trigger(Interrupt::Config);
                    }
                }
            }
        }));
    }

    /// Tells the driver the device is broken until it resets it.
    fn fail(&mut self, why: &str, interrupt: &Arc<dyn VirtioInterrupt>) {
        crate::error_limited!("virtio device type {}: {why}", self.device().device_type());
        self.phase.store(FAILED, Ordering::SeqCst);
        let _ = interrupt.trigger(Interrupt::Config);
    }

    /// The driver's reset: the registers go back to their initial state at
    /// once; a device that was activated (or is being) is stopped by a job
    /// that runs after its activation.
    fn reset(&mut self) {
        if self.phase.swap(IDLE, Ordering::SeqCst) != IDLE {
            let device = self.device.clone();
            let phase = self.phase.clone();
            self.activator.run(Box::new(move || {
                let mut dev = lock(&device);
                // The device's threads are told to stop under the lock
                // and waited for (bounded) after it is released.
                let (reset, stopping) = deferring_joins(|| dev.reset());
                if !reset {
                    crate::warn_limited!(
                        "virtio device type {} cannot be reset",
                        dev.device_type()
                    );
                    // Only if the driver has not started again meanwhile.
                    let _ =
                        phase.compare_exchange(IDLE, FAILED, Ordering::SeqCst, Ordering::SeqCst);
                }
                drop(dev);
                drop(stopping);
            }));
        }
        for q in &mut self.queues {
            q.reset();
        }
        self.status = 0;
        self.driver_features = 0;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::mpsc::channel;
    use std::time::Duration;

    use virtio_bindings::virtio_config::VIRTIO_CONFIG_S_ACKNOWLEDGE;
    use vm_memory::GuestAddress;

    use super::*;
    use crate::event_loop::tests::stuck_worker;
    use crate::event_loop::WorkerThread;

    /// A device whose worker's handler never returns (until released).
    struct StuckDevice {
        worker: Option<WorkerThread>,
        /// What releases the worker's handler, for the test.
        release: Arc<Mutex<Option<Arc<AtomicBool>>>>,
        reset: Arc<AtomicBool>,
    }

    impl VirtioDevice for StuckDevice {
        fn device_type(&self) -> u32 {
            2
        }
        fn queue_max_sizes(&self) -> &[u16] {
            &[16]
        }
        fn features(&self) -> u64 {
            1 << VIRTIO_F_VERSION_1
        }
        fn ack_features(&mut self, _: u64) {}
        fn read_config(&self, _: u64, data: &mut [u8]) {
            data.fill(0);
        }
        fn activate(
            &mut self,
            _: GuestMemoryAtomic<GuestMemoryMmap>,
            _: Arc<dyn VirtioInterrupt>,
            _: Vec<ActivatedQueue>,
        ) -> Result<(), crate::ActivateError> {
            let (mut worker, release) = stuck_worker();
            // As good as never: only the test's release ends it.
            worker.set_stop_timeout(Duration::from_secs(3600));
            self.worker = Some(worker);
            *self.release.lock().unwrap() = Some(release);
            Ok(())
        }
        fn reset(&mut self) -> bool {
            self.reset.store(true, Ordering::SeqCst);
            self.worker = None;
            true
        }
    }

    /// Runs each job on a thread of its own, as the VMM's activator runs
    /// them off the vCPU.
    struct Spawn;

    impl Activator for Spawn {
        fn run(&self, job: Box<dyn FnOnce() + Send>) {
            std::thread::spawn(job);
        }
    }

    struct NoInterrupt;

    impl VirtioInterrupt for NoInterrupt {
        fn trigger(&self, _: Interrupt) -> std::io::Result<()> {
            Ok(())
        }
        fn notifier(&self, _: Interrupt) -> Option<EventFd> {
            None
        }
    }

    /// The driver resets a device whose worker thread is stuck: the reset
    /// waits for that thread only after releasing the device's lock, so a
    /// vCPU reading the config space meanwhile is not held up.
    #[test]
    fn a_reset_waits_for_a_stuck_worker_without_holding_the_device() {
        let reset = Arc::new(AtomicBool::new(false));
        let release = Arc::new(Mutex::new(None));
        let dev = StuckDevice {
            worker: None,
            release: release.clone(),
            reset: reset.clone(),
        };
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut state = VirtioState::new(Box::new(dev), GuestMemoryAtomic::new(mem)).unwrap();
        state.set_activator(Arc::new(Spawn));
        let irq: Arc<dyn VirtioInterrupt> = Arc::new(NoInterrupt);
        let mut status = VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER;
        state.write_status(status, &irq);
        state.write_driver_features(1, 1);
        status |= VIRTIO_CONFIG_S_FEATURES_OK;
        state.write_status(status, &irq);
        state.write_status(status | VIRTIO_CONFIG_S_DRIVER_OK, &irq);
        // Bounds for a hang, not speed figures.
        let waited = |done: &dyn Fn() -> bool| {
            let end = std::time::Instant::now() + Duration::from_secs(30);
            while !done() {
                assert!(std::time::Instant::now() < end, "timed out");
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        waited(&|| state.is_activated());
        let release = release
            .lock()
            .unwrap()
            .clone()
            .expect("activated: a worker");
        state.write_status(0, &irq);
        waited(&|| reset.load(Ordering::SeqCst));
        let device = state.device.clone();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut c = [0u8; 4];
            lock(&device).read_config(0, &mut c);
            let _ = tx.send(());
        });
        let read = rx.recv_timeout(Duration::from_secs(30));
        release.store(true, Ordering::SeqCst);
        assert!(read.is_ok(), "a config read waited for the stuck thread");
    }
}
