//! The thread behind one queue pair: it waits on the guest's RX and TX
//! kicks and on the tap, runs [`super::queues`], and interrupts the guest
//! when it used buffers. It watches the tap only while the guest has RX
//! buffers for the next frame, so a guest that stops taking frames costs
//! neither CPU nor memory; its next RX kick starts the tap again.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_net::VIRTIO_NET_F_MRG_RXBUF;
use virtio_queue::{Queue, QueueT};
use vm_memory::{GuestAddressSpace, GuestMemoryAtomic};
use vmm_sys_util::epoll::EventSet;
use vmm_sys_util::eventfd::EventFd;

use super::queues::{NetCounters, RxProgress, TxPath};
use super::rx::RxPath;
use super::tap::FrameIo;
use crate::device::{ActivatedQueue, Interrupt, VirtioInterrupt};
use crate::device_state::SavedQueue;
use crate::event_loop::{EventLoop, Flow, WorkerThread, STOP_TIMEOUT};
use crate::{DeviceCounters, GuestMemoryMmap};

const RX_KICK: u64 = 0;
const TX_KICK: u64 = 1;
const TAP: u64 = 2;

/// What one worker serves.
pub struct PairSetup {
    pub device: String,
    pub rx: ActivatedQueue,
    pub tx: ActivatedQueue,
    pub io: Arc<dyn FrameIo>,
    pub acked: u64,
    /// The device's counters, which outlive this worker.
    pub counters: Arc<DeviceCounters>,
}

struct Pair {
    device: String,
    rx: Queue,
    rx_index: u16,
    rx_kick: EventFd,
    tx: Queue,
    tx_index: u16,
    tx_kick: EventFd,
    /// None while a migration's switch closed the tap: the thread does
    /// not start then.
    io: Option<Arc<dyn FrameIo>>,
    acked: u64,
    rx_path: RxPath,
    tx_path: TxPath,
    counters: NetCounters,
    /// `counters` as last added to `shared_counters`.
    published: NetCounters,
    shared_counters: Arc<DeviceCounters>,
    tap_watched: bool,
    mem: GuestMemoryAtomic<GuestMemoryMmap>,
    interrupt: Arc<dyn VirtioInterrupt>,
}

pub struct PairWorker {
    /// None while paused.
    thread: Option<WorkerThread>,
    /// Kept here too, so that a pause reads the queues' positions once the
    /// thread ended and a resume serves them again.
    pair: Arc<Mutex<Pair>>,
    thread_kind: &'static str,
    thread_name: String,
    paused: bool,
}

impl PairWorker {
    /// Starts the thread `thread_name` under the seccomp kind `thread_kind`.
    pub fn spawn(
        thread_kind: &'static str,
        thread_name: String,
        s: PairSetup,
        mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
    ) -> std::io::Result<Self> {
        let pair = Pair {
            device: s.device.clone(),
            rx: s.rx.queue,
            rx_index: s.rx.index,
            rx_kick: s.rx.kick,
            tx: s.tx.queue,
            tx_index: s.tx.index,
            tx_kick: s.tx.kick,
            io: Some(s.io),
            acked: s.acked,
            rx_path: RxPath::new(s.acked & (1 << VIRTIO_NET_F_MRG_RXBUF) != 0),
            tx_path: TxPath,
            counters: NetCounters::default(),
            published: NetCounters::default(),
            shared_counters: s.counters,
            tap_watched: true,
            mem,
            interrupt,
        };
        let mut worker = PairWorker {
            thread: None,
            pair: Arc::new(Mutex::new(pair)),
            thread_kind,
            thread_name,
            paused: false,
        };
        worker.thread = Some(worker.start_thread()?);
        Ok(worker)
    }

    fn start_thread(&self) -> std::io::Result<WorkerThread> {
        let events = EventLoop::new()?;
        let device = {
            let p = lock(&self.pair);
            let Some(io) = &p.io else {
                return Err(std::io::Error::other(
                    "its tap is closed (a migration's switch released it)",
                ));
            };
            events.add(p.rx_kick.as_raw_fd(), EventSet::IN, RX_KICK)?;
            events.add(p.tx_kick.as_raw_fd(), EventSet::IN, TX_KICK)?;
            if p.tap_watched {
                events.add(io.as_raw_fd(), EventSet::IN, TAP)?;
            }
            p.device.clone()
        };
        let pair = self.pair.clone();
        events.spawn_as(
            self.thread_kind,
            self.thread_name.clone(),
            device,
            move |l, token, _| {
                let mut pair = lock(&pair);
                let ok = match token {
                    RX_KICK => {
                        let _ = pair.rx_kick.read();
                        pair.receive(l)
                    }
                    TX_KICK => {
                        let _ = pair.tx_kick.read();
                        // The host may answer at once: RX follows TX.
                        pair.transmit() && pair.receive(l)
                    }
                    TAP => pair.receive(l),
                    _ => true,
                };
                pair.publish();
                if ok {
                    Flow::Continue
                } else {
                    Flow::Stop
                }
            },
        )
    }

    /// Stops the thread (bounded) and gives the RX and TX queues'
    /// positions, in queue index order. TX chains are used as they are
    /// taken. RX chains held for the next frame are not used: the saved
    /// RX position leaves them in the ring (`next_avail` less the chains
    /// held; the driver does not touch available entries the device has
    /// not used), so a restored device takes them again; a frame waiting
    /// for buffers (read from the tap, not yet delivered) is lost then,
    /// as a frame on the wire may be. A resume goes on with both, here.
    pub fn pause(&mut self) -> Result<Vec<SavedQueue>, String> {
        self.paused = true;
        if let Some(thread) = self.thread.take() {
            if let Err(still) = thread.stop_and_wait() {
                self.thread = Some(still);
                return Err(format!(
                    "its queue thread did not stop within {STOP_TIMEOUT:?}"
                ));
            }
        }
        let p = lock(&self.pair);
        let mut rx = SavedQueue::from(p.rx.state());
        let held = u16::try_from(p.rx_path.held_chains()).unwrap_or(u16::MAX);
        rx.next_avail = rx.next_avail.wrapping_sub(held);
        let tx = SavedQueue::from(p.tx.state());
        Ok(if p.rx_index < p.tx_index {
            vec![rx, tx]
        } else {
            vec![tx, rx]
        })
    }

    /// Serves the same queues again; both kicks are written once, so what
    /// came while paused is served and the guest's kicks are asked for
    /// again.
    pub fn resume(&mut self) -> Result<(), String> {
        if !self.paused {
            return Ok(());
        }
        if let Some(thread) = self.thread.take() {
            if let Err(still) = thread.stop_and_wait() {
                self.thread = Some(still);
                return Err("its queue thread from before the pause is still running".into());
            }
        }
        let start = |e: std::io::Error| format!("starting its queue thread: {e}");
        self.thread = Some(self.start_thread().map_err(start)?);
        {
            let p = lock(&self.pair);
            p.rx_kick.write(1).map_err(start)?;
            p.tx_kick.write(1).map_err(start)?;
        }
        self.paused = false;
        Ok(())
    }

    /// While paused: the worker lets go of its tap (a migration's switch
    /// closes it); it cannot resume until [`Self::put_io`].
    pub fn take_io(&mut self) -> Result<(), String> {
        if !self.paused || self.thread.is_some() {
            return Err("the device is not paused".into());
        }
        lock(&self.pair).io = None;
        Ok(())
    }

    /// While paused: the tap opened again after [`Self::take_io`]; the
    /// resume serves it, watched as the old one was.
    pub fn put_io(&mut self, io: Arc<dyn FrameIo>) -> Result<(), String> {
        if !self.paused || self.thread.is_some() {
            return Err("the device is not paused".into());
        }
        lock(&self.pair).io = Some(io);
        Ok(())
    }
}

fn lock(pair: &Mutex<Pair>) -> std::sync::MutexGuard<'_, Pair> {
    pair.lock().unwrap_or_else(|p| p.into_inner())
}

impl Pair {
    /// Adds what this worker counted since the last call to the device's
    /// counters (this worker's own start from zero at each activation).
    fn publish(&mut self) {
        if self.counters == self.published {
            return;
        }
        let (now, before) = (self.counters.values(), self.published.values());
        for (i, (n, b)) in now.iter().zip(before).enumerate() {
            self.shared_counters.add(i, n.wrapping_sub(b));
        }
        self.published = self.counters;
    }

    /// Delivers what the tap has; false when the queue broke. The guest's
    /// RX kicks are off meanwhile: they are needed only once its buffers
    /// ran out, and then turned on (with EVENT_IDX: asked for at the next
    /// buffer) before the thread waits for one.
    fn receive(&mut self, l: &EventLoop) -> bool {
        // The thread runs only with a tap (see start_thread).
        let Some(io) = self.io.as_deref() else {
            return false;
        };
        let guard = self.mem.memory();
        let mut used = 0;
        let progress = loop {
            if let Err(e) = self.rx.disable_notification(&*guard) {
                crate::error_limited!("{}: RX queue stopped: {e:?}", self.device);
                return false;
            }
            let (progress, n, drop) =
                match self
                    .rx_path
                    .process(&mut self.rx, &*guard, io, &mut self.counters)
                {
                    Ok(r) => r,
                    Err(e) => {
                        crate::error_limited!("{}: RX queue stopped: {e:?}", self.device);
                        return false;
                    }
                };
            used += n;
            if let Some(e) = drop {
                crate::warn_limited!(
                    "{}: RX frame dropped: {e} ({} dropped so far)",
                    self.device,
                    self.counters.rx_dropped
                );
            }
            if progress != RxProgress::NoBuffers {
                break progress;
            }
            match self.rx.enable_notification(&*guard) {
                Ok(true) => continue, // buffers came in meanwhile
                Ok(false) => break progress,
                Err(e) => {
                    crate::error_limited!("{}: RX queue stopped: {e:?}", self.device);
                    return false;
                }
            }
        };
        // Stop reading the tap while the guest's buffers are out (or too
        // few for the frame that waits); its next RX kick brings us back.
        let watch = progress != RxProgress::NoBuffers;
        if watch != self.tap_watched {
            if watch {
                if let Err(e) = l.add(io.as_raw_fd(), EventSet::IN, TAP) {
                    crate::error_limited!("{}: watching the tap: {e}", self.device);
                    return false;
                }
            } else {
                l.remove(io.as_raw_fd());
            }
            self.tap_watched = watch;
        }
        self.notify(used, true)
    }

    /// Sends what the guest queued, TX kicks off meanwhile (the guest
    /// does not kick for frames it queues while this runs); false when the
    /// queue broke.
    fn transmit(&mut self) -> bool {
        let Some(io) = self.io.as_deref() else {
            return false;
        };
        let guard = self.mem.memory();
        let mut used = 0;
        loop {
            if let Err(e) = self.tx.disable_notification(&*guard) {
                crate::error_limited!("{}: TX queue stopped: {e:?}", self.device);
                return false;
            }
            let (n, drop) = match self.tx_path.process(
                &mut self.tx,
                &*guard,
                io,
                self.acked,
                &mut self.counters,
            ) {
                Ok(r) => r,
                Err(e) => {
                    crate::error_limited!("{}: TX queue stopped: {e:?}", self.device);
                    return false;
                }
            };
            used += n;
            if let Some(e) = drop {
                crate::warn_limited!(
                    "{}: TX frame dropped: {e} ({} dropped so far)",
                    self.device,
                    self.counters.tx_dropped
                );
            }
            match self.tx.enable_notification(&*guard) {
                Ok(true) => {} // frames came in meanwhile
                Ok(false) => break,
                Err(e) => {
                    crate::error_limited!("{}: TX queue stopped: {e:?}", self.device);
                    return false;
                }
            }
        }
        self.notify(used, false)
    }

    fn notify(&mut self, used: usize, rx: bool) -> bool {
        if used == 0 {
            return true;
        }
        let guard = self.mem.memory();
        let (queue, index) = if rx {
            (&mut self.rx, self.rx_index)
        } else {
            (&mut self.tx, self.tx_index)
        };
        if queue.needs_notification(&*guard).unwrap_or(true) {
            if let Err(e) = self.interrupt.trigger(Interrupt::Queue(index)) {
                crate::error_limited!("{}: interrupt: {e}", self.device);
                return false;
            }
        }
        true
    }
}
