use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_CONFIG_S_NEEDS_RESET, VIRTIO_F_VERSION_1,
};
use vm_memory::{GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::device::{read_config_bytes, ActivateError, ActivatedQueue, SharedMemoryRegion};

const VERSION_1: u64 = 1 << VIRTIO_F_VERSION_1;
const DEVICE_FEATURE: u64 = 1 << 0;
const SHM_BASE: u64 = 0x1_0000_0000;
const SHM_LEN: u64 = 0x20_0000;

#[derive(Default)]
struct Seen {
    acked: Option<u64>,
    activated_queues: Vec<u16>,
    resets: usize,
}

struct TestDevice {
    seen: Arc<Mutex<Seen>>,
    fail_activation: bool,
}

impl VirtioDevice for TestDevice {
    fn device_type(&self) -> u32 {
        27
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 16]
    }
    fn features(&self) -> u64 {
        VERSION_1 | DEVICE_FEATURE
    }
    fn ack_features(&mut self, features: u64) {
        self.seen.lock().unwrap().acked = Some(features);
    }
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(&[1, 2, 3, 4, 5, 6, 7, 8], offset, data)
    }
    fn activate(
        &mut self,
        _mem: GuestMemoryAtomic<GuestMemoryMmap>,
        _interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        if self.fail_activation {
            return Err(ActivateError::BackendGone {
                device: "test".into(),
                why: "test failure",
            });
        }
        self.seen.lock().unwrap().activated_queues = queues.iter().map(|q| q.index).collect();
        Ok(())
    }
    fn reset(&mut self) -> bool {
        self.seen.lock().unwrap().resets += 1;
        true
    }
    fn shm_regions(&self) -> Vec<SharedMemoryRegion> {
        vec![SharedMemoryRegion {
            id: 0,
            guest_addr: SHM_BASE,
            len: SHM_LEN,
            host_addr: 0,
        }]
    }
}

struct Rig {
    t: MmioTransport,
    seen: Arc<Mutex<Seen>>,
    irq: EventFd,
}

fn rig_with(fail_activation: bool) -> Rig {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let dev = TestDevice {
        seen: seen.clone(),
        fail_activation,
    };
    let t = MmioTransport::new(
        Box::new(dev),
        GuestMemoryAtomic::new(mem),
        irq.try_clone().unwrap(),
    )
    .unwrap();
    Rig { t, seen, irq }
}

fn rig() -> Rig {
    rig_with(false)
}

impl Rig {
    fn r(&mut self, offset: u64) -> u32 {
        let mut d = [0u8; 4];
        self.t.read(offset, &mut d);
        u32::from_le_bytes(d)
    }
    fn w(&mut self, offset: u64, v: u32) {
        self.t.write(offset, &v.to_le_bytes());
    }
    /// ACKNOWLEDGE, DRIVER, features, FEATURES_OK, as a driver does.
    fn negotiate(&mut self, features: u64) {
        self.w(reg::STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
        self.w(
            reg::STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER,
        );
        self.w(reg::DRIVER_FEATURES_SEL, 0);
        self.w(reg::DRIVER_FEATURES, narrow::low_u32(features));
        self.w(reg::DRIVER_FEATURES_SEL, 1);
        self.w(reg::DRIVER_FEATURES, (features >> 32) as u32);
        self.w(
            reg::STATUS,
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
        );
    }
    fn setup_queue(&mut self, index: u32, base: u64) {
        self.w(reg::QUEUE_SEL, index);
        self.w(reg::QUEUE_NUM, 16);
        self.w(reg::QUEUE_DESC_LOW, narrow::low_u32(base));
        self.w(reg::QUEUE_DESC_HIGH, (base >> 32) as u32);
        self.w(reg::QUEUE_DRIVER_LOW, narrow::low_u32(base + 0x1000));
        self.w(reg::QUEUE_DRIVER_HIGH, 0);
        self.w(reg::QUEUE_DEVICE_LOW, narrow::low_u32(base + 0x2000));
        self.w(reg::QUEUE_DEVICE_HIGH, 0);
        self.w(reg::QUEUE_READY, 1);
    }
    fn driver_ok(&mut self) {
        let s = self.t.status() | VIRTIO_CONFIG_S_DRIVER_OK;
        self.w(reg::STATUS, s);
    }
}

#[test]
fn identity_registers() {
    let mut r = rig();
    assert_eq!(r.r(reg::MAGIC), 0x7472_6976);
    assert_eq!(r.r(reg::VERSION), 2);
    assert_eq!(r.r(reg::DEVICE_ID), 27);
    assert_eq!(r.r(reg::VENDOR_ID), VENDOR_ID);
    r.w(reg::QUEUE_SEL, 1);
    assert_eq!(r.r(reg::QUEUE_NUM_MAX), 16);
    r.w(reg::QUEUE_SEL, 2);
    assert_eq!(
        r.r(reg::QUEUE_NUM_MAX),
        0,
        "a queue past the last one has size 0"
    );
}

#[test]
fn device_features_by_select() {
    let mut r = rig();
    r.w(reg::DEVICE_FEATURES_SEL, 0);
    assert_eq!(r.r(reg::DEVICE_FEATURES), narrow::low_u32(DEVICE_FEATURE));
    r.w(reg::DEVICE_FEATURES_SEL, 1);
    assert_eq!(r.r(reg::DEVICE_FEATURES), (VERSION_1 >> 32) as u32);
    r.w(reg::DEVICE_FEATURES_SEL, 2);
    assert_eq!(r.r(reg::DEVICE_FEATURES), 0);
}

#[test]
fn shared_memory_registers_and_the_id_past_the_last() {
    let mut r = rig();
    r.w(reg::SHM_SEL, 0);
    assert_eq!(r.r(reg::SHM_LEN_LOW), narrow::low_u32(SHM_LEN));
    assert_eq!(r.r(reg::SHM_LEN_HIGH), 0);
    assert_eq!(r.r(reg::SHM_BASE_LOW), 0);
    assert_eq!(r.r(reg::SHM_BASE_HIGH), 1);
    // id == number of regions: absent, length all ones (the classic off-by-one).
    r.w(reg::SHM_SEL, 1);
    assert_eq!(r.r(reg::SHM_LEN_LOW), u32::MAX);
    assert_eq!(r.r(reg::SHM_LEN_HIGH), u32::MAX);
    r.w(reg::SHM_SEL, 255);
    assert_eq!(r.r(reg::SHM_LEN_LOW), u32::MAX);
}

#[test]
fn config_space_reads_through_to_the_device() {
    let mut r = rig();
    let mut b = [0u8; 2];
    r.t.read(reg::CONFIG + 3, &mut b);
    assert_eq!(b, [4, 5]);
    assert_eq!(r.r(reg::CONFIG + 4), u32::from_le_bytes([5, 6, 7, 8]));
    assert_eq!(r.r(reg::CONFIG + 8), 0);
}

#[test]
fn features_not_offered_are_refused() {
    let mut r = rig();
    r.negotiate(VERSION_1 | DEVICE_FEATURE | (1 << 5));
    assert_eq!(r.t.status() & VIRTIO_CONFIG_S_FEATURES_OK, 0);
    assert_eq!(r.seen.lock().unwrap().acked, None);
    let mut r = rig();
    r.negotiate(DEVICE_FEATURE); // no VERSION_1: a legacy driver
    assert_eq!(r.t.status() & VIRTIO_CONFIG_S_FEATURES_OK, 0);
    let mut r = rig();
    r.negotiate(VERSION_1);
    assert_ne!(r.t.status() & VIRTIO_CONFIG_S_FEATURES_OK, 0);
    assert_eq!(r.seen.lock().unwrap().acked, Some(VERSION_1));
}

#[test]
fn activation_hands_over_ready_queues_and_notifications_reach_them() {
    let mut r = rig();
    r.negotiate(VERSION_1);
    r.setup_queue(1, 0x1_0000);
    r.driver_ok();
    assert!(r.t.is_activated());
    assert_eq!(r.seen.lock().unwrap().activated_queues, vec![1]);
    // Queue registers are frozen once the queue is live.
    r.w(reg::QUEUE_SEL, 1);
    r.w(reg::QUEUE_NUM, 8);
    r.w(reg::QUEUE_READY, 0);
    assert_eq!(r.r(reg::QUEUE_READY), 1);
    // A notification the ioeventfd did not catch still reaches the queue's eventfd.
    r.w(reg::QUEUE_NOTIFY, 1);
    let notifiers = r.t.queue_notifiers();
    assert_eq!(notifiers.len(), 2);
    assert_eq!((notifiers[1].1, notifiers[1].2), (reg::QUEUE_NOTIFY, 1));
    assert_eq!(notifiers[1].0.read().unwrap(), 1);
}

#[test]
fn interrupt_status_and_ack() {
    let mut r = rig();
    r.t.interrupt.trigger(Interrupt::Queue(0)).unwrap();
    assert_eq!(r.irq.read().unwrap(), 1);
    assert_eq!(r.r(reg::INTERRUPT_STATUS), INT_USED_RING);
    r.t.interrupt.trigger(Interrupt::Config).unwrap();
    assert_eq!(r.r(reg::INTERRUPT_STATUS), INT_USED_RING | INT_CONFIG);
    r.w(reg::INTERRUPT_ACK, INT_USED_RING);
    assert_eq!(r.r(reg::INTERRUPT_STATUS), INT_CONFIG);
    assert!(r.t.interrupt.notifier(Interrupt::Queue(0)).is_none());
}

#[test]
fn reset_stops_the_device_and_clears_state() {
    let mut r = rig();
    r.negotiate(VERSION_1);
    r.setup_queue(0, 0x1_0000);
    r.driver_ok();
    r.w(reg::SHM_SEL, 1);
    r.w(reg::STATUS, 0);
    assert_eq!(r.seen.lock().unwrap().resets, 1);
    assert!(!r.t.is_activated());
    assert_eq!(r.r(reg::STATUS), 0);
    r.w(reg::QUEUE_SEL, 0);
    assert_eq!(r.r(reg::QUEUE_READY), 0);
    assert_eq!(
        r.r(reg::SHM_LEN_LOW),
        narrow::low_u32(SHM_LEN),
        "SHMSel is back to 0"
    );
    // And it comes up again.
    r.negotiate(VERSION_1);
    r.setup_queue(0, 0x1_0000);
    r.driver_ok();
    assert!(r.t.is_activated());
}

#[test]
fn invalid_queue_or_failed_activation_sets_needs_reset() {
    let mut r = rig();
    r.negotiate(VERSION_1);
    r.setup_queue(0, 0x1_0000_0000); // outside guest memory
    r.driver_ok();
    assert!(!r.t.is_activated());
    assert_ne!(r.t.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    assert_ne!(r.r(reg::INTERRUPT_STATUS) & INT_CONFIG, 0);

    let mut r = rig_with(true);
    r.negotiate(VERSION_1);
    r.setup_queue(0, 0x1_0000);
    r.driver_ok();
    assert!(!r.t.is_activated());
    assert_ne!(r.t.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
}

#[test]
fn driver_ok_without_features_ok_fails_and_bad_accesses_are_ignored() {
    let mut r = rig();
    r.w(reg::STATUS, VIRTIO_CONFIG_S_ACKNOWLEDGE);
    r.w(
        reg::STATUS,
        VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_DRIVER_OK,
    );
    assert!(!r.t.is_activated());
    assert_ne!(r.t.status() & VIRTIO_CONFIG_S_NEEDS_RESET, 0);
    // Narrow and unaligned register accesses do nothing and read zero.
    let mut b = [0xffu8; 2];
    r.t.read(reg::MAGIC, &mut b);
    assert_eq!(b, [0, 0]);
    r.t.write(reg::QUEUE_SEL, &[1]);
    assert_eq!(r.r(reg::QUEUE_SEL), 0);
}
