use std::sync::Mutex;

use serde_json::{json, Value};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vm_memory::{GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::device::{read_config_bytes, ActivateError, VirtioDevice};
use crate::GuestMemoryMmap;

pub(crate) const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
pub(crate) const DEVICE_FEATURE: u64 = 1 << 3;

// virtio-MMIO register offsets (virtio 1.2 §4.2.2).
const DRIVER_FEATURES: u64 = 0x020;
const DRIVER_FEATURES_SEL: u64 = 0x024;
const QUEUE_SEL: u64 = 0x030;
const QUEUE_NUM: u64 = 0x038;
const QUEUE_READY: u64 = 0x044;
const STATUS: u64 = 0x070;
const QUEUE_DESC_LOW: u64 = 0x080;
const QUEUE_DRIVER_LOW: u64 = 0x090;
const QUEUE_DEVICE_LOW: u64 = 0x0a0;
const SHM_SEL: u64 = 0x0ac;

/// What the fake device was asked to do.
#[derive(Default)]
pub(crate) struct Seen {
    pub(crate) acked: Option<u64>,
    /// (queue index, next_avail, next_used) of each activation's queues.
    pub(crate) activated: Vec<Vec<(u16, u16, u16)>>,
    /// Per activated queue: whether the interrupt had a notifier for it
    /// (a vector) when the device was activated.
    pub(crate) notifiers: Vec<bool>,
    pub(crate) paused: usize,
    pub(crate) resumed: usize,
    pub(crate) restored: Option<Value>,
}

/// Serves nothing; a pause gives back its queues as if it had used
/// `served + index` chains of each.
pub(crate) struct Fake {
    pub(crate) seen: Arc<Mutex<Seen>>,
    pub(crate) queues: Vec<ActivatedQueue>,
    pub(crate) served: u16,
}

impl VirtioDevice for Fake {
    fn device_type(&self) -> u32 {
        27
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 16, 16]
    }
    fn features(&self) -> u64 {
        VERSION_1 | DEVICE_FEATURE
    }
    fn ack_features(&mut self, features: u64) {
        self.seen.lock().unwrap().acked = Some(features);
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&[0; 8], offset, data)
    }
    fn activate(
        &mut self,
        _mem: GuestMemoryAtomic<GuestMemoryMmap>,
        interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        self.seen.lock().unwrap().notifiers = queues
            .iter()
            .map(|q| {
                interrupt
                    .notifier(crate::device::Interrupt::Queue(q.index))
                    .is_some()
            })
            .collect();
        self.seen.lock().unwrap().activated.push(
            queues
                .iter()
                .map(|q| (q.index, q.queue.next_avail(), q.queue.next_used()))
                .collect(),
        );
        self.queues = queues;
        Ok(())
    }
    fn reset(&mut self) -> bool {
        self.queues.clear();
        true
    }
    fn pause(&mut self) -> Result<Vec<SavedQueue>, DeviceStateError> {
        self.seen.lock().unwrap().paused += 1;
        Ok(self
            .queues
            .iter_mut()
            .map(|q| {
                let n = self.served + q.index;
                q.queue.set_next_avail(n);
                q.queue.set_next_used(n);
                saved_queue(&q.queue)
            })
            .collect())
    }
    fn resume(&mut self) -> Result<(), DeviceStateError> {
        self.seen.lock().unwrap().resumed += 1;
        Ok(())
    }
    fn save_state(&mut self) -> Result<Value, DeviceStateError> {
        Ok(json!({"fake": self.served}))
    }
    fn restore_state(&mut self, state: &Value) -> Result<(), DeviceStateError> {
        self.seen.lock().unwrap().restored = Some(state.clone());
        Ok(())
    }
    fn check_movable(&self) -> Result<(), DeviceStateError> {
        Ok(())
    }
}

/// A queue's position as the contract's type holds it.
pub(crate) fn saved_queue(q: &Queue) -> SavedQueue {
    SavedQueue::from(q.state())
}

struct Rig {
    t: MmioTransport,
    seen: Arc<Mutex<Seen>>,
}

fn rig(served: u16) -> Rig {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let dev = Fake {
        seen: seen.clone(),
        queues: Vec::new(),
        served,
    };
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let t = MmioTransport::new(Box::new(dev), GuestMemoryAtomic::new(mem), irq).unwrap();
    Rig { t, seen }
}

impl Rig {
    fn w(&mut self, offset: u64, v: u32) {
        self.t.write(offset, &v.to_le_bytes());
    }

    /// A driver bringing the device up with queues 0 and 2 (1 stays off).
    fn bring_up(&mut self) {
        self.w(STATUS, 1);
        self.w(STATUS, 3);
        self.w(DRIVER_FEATURES_SEL, 0);
        self.w(DRIVER_FEATURES, narrow::low_u32(DEVICE_FEATURE));
        self.w(DRIVER_FEATURES_SEL, 1);
        self.w(DRIVER_FEATURES, (VERSION_1 >> 32) as u32);
        self.w(STATUS, 0xb);
        for (queue, base) in [(0u32, 0x1_0000u32), (2, 0x2_0000)] {
            self.w(QUEUE_SEL, queue);
            self.w(QUEUE_NUM, 8);
            self.w(QUEUE_DESC_LOW, base);
            self.w(QUEUE_DRIVER_LOW, base + 0x1000);
            self.w(QUEUE_DEVICE_LOW, base + 0x2000);
            self.w(QUEUE_READY, 1);
        }
        self.w(SHM_SEL, 7);
        self.w(STATUS, 0xf);
        assert!(self.t.is_activated());
    }

    /// A running transport's state, paused and saved, through JSON.
    fn saved(&mut self) -> MmioTransportState {
        self.bring_up();
        self.t.pause().unwrap();
        let state = self.t.save().unwrap();
        serde_json::from_value(serde_json::to_value(&state).unwrap()).unwrap()
    }
}

/// A device that was running is activated again on restore, without the
/// driver writing DRIVER_OK, with the queue positions its pause gave back,
/// the acked features and its own state; the registers read back.
#[test]
fn a_running_device_is_activated_again_with_its_saved_queue_positions() {
    let mut before = rig(5);
    let state = before.saved();
    assert_eq!(before.seen.lock().unwrap().paused, 1);
    before.t.resume().unwrap();
    assert_eq!(before.seen.lock().unwrap().resumed, 1);

    let mut after = rig(0);
    after.t.restore(&state).unwrap();
    let seen = after.seen.lock().unwrap();
    assert_eq!(seen.activated, vec![vec![(0, 5, 5), (2, 7, 7)]]);
    assert_eq!(seen.acked, Some(VERSION_1 | DEVICE_FEATURE));
    assert_eq!(seen.restored, Some(json!({"fake": 5})));
    drop(seen);
    assert!(after.t.is_activated());
    assert_eq!(after.t.status(), 0xf);
    assert_eq!(after.t.shm_sel, 7);
    assert_eq!(after.t.queue_sel, 2);
    // The restored transport saves the same registers again.
    after.t.pause().unwrap();
    assert_eq!(after.t.save().unwrap().registers, state.registers);
}

/// Saving needs a pause first; a device not yet running saves no queue
/// positions and is not activated on restore.
#[test]
fn save_needs_a_pause_and_an_idle_device_is_not_activated() {
    let mut r = rig(1);
    assert!(matches!(r.t.save(), Err(TransportStateError::NotPaused)));
    r.w(STATUS, 1);
    r.t.pause().unwrap();
    let state = r.t.save().unwrap();
    assert!(state.queues.is_empty());
    let mut after = rig(0);
    after.t.restore(&state).unwrap();
    assert!(after.seen.lock().unwrap().activated.is_empty());
    assert_eq!(after.t.status(), 1);
}

/// Changes one field of a saved state.
type Spoil = Box<dyn Fn(&mut Value)>;

/// Each bad field is refused by name, and the transport (and its device)
/// is left as built: nothing restored, nothing activated.
#[test]
fn a_bad_state_is_refused_by_field_and_nothing_is_applied() {
    let good = serde_json::to_value(rig(3).saved()).unwrap();
    let cases: Vec<(&str, Spoil)> = vec![
        (
            "registers.virtio.queues[0]",
            Box::new(|v| v["registers"]["virtio"]["queues"][0]["size"] = json!(3)),
        ),
        (
            "registers.virtio.queues: 2 queues",
            Box::new(|v| {
                v["registers"]["virtio"]["queues"]
                    .as_array_mut()
                    .unwrap()
                    .pop();
            }),
        ),
        (
            "registers.virtio.status",
            Box::new(|v| v["registers"]["virtio"]["status"] = json!(0x4f)),
        ),
        (
            "registers.virtio.driver_features",
            Box::new(|v| v["registers"]["virtio"]["driver_features"] = json!(1u64 << 40)),
        ),
        (
            "acked_features",
            Box::new(|v| v["acked_features"] = json!(VERSION_1)),
        ),
        (
            "queues: 1 queue positions for 2 ready queues",
            Box::new(|v| {
                v["queues"].as_array_mut().unwrap().pop();
            }),
        ),
        (
            "queues[1]: does not match the registers of queue 2",
            Box::new(|v| v["queues"][1]["desc_table"] = json!(0x3_0000)),
        ),
    ];
    let mut unknown = good.clone();
    unknown["registers"]["virtio"]["queue_notify"] = json!(1);
    let e = serde_json::from_value::<MmioTransportState>(unknown).unwrap_err();
    assert!(
        e.to_string().contains("unknown field `queue_notify`"),
        "{e}"
    );
    for (field, spoil) in cases {
        let mut bad = good.clone();
        spoil(&mut bad);
        let bad: MmioTransportState = serde_json::from_value(bad).unwrap();
        let mut fresh = rig(0);
        let e = fresh.t.check_restore(&bad).expect_err(field);
        assert!(e.to_string().contains(field), "{field}: {e}");
        let e = fresh.t.restore(&bad).expect_err(field);
        assert!(e.to_string().contains(field), "{field}: {e}");
        assert_eq!(fresh.t.status(), 0, "{field}: status applied");
        assert_eq!(fresh.t.queue_sel, 0, "{field}: registers applied");
        let seen = fresh.seen.lock().unwrap();
        assert!(seen.restored.is_none(), "{field}: device state restored");
        assert!(seen.activated.is_empty(), "{field}: activated");
        assert!(seen.acked.is_none(), "{field}: features acked");
    }
}
