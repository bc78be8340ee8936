use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
    VIRTIO_CONFIG_S_FEATURES_OK, VIRTIO_F_VERSION_1,
};
use vm_memory::{GuestAddress, GuestMemoryAtomic};

use super::*;
use crate::device::{read_config_bytes, ActivateError, ActivatedQueue, SharedMemoryRegion};

const BAR0: u64 = 0xe000_0000;
const SHM_BAR_ADDR: u64 = 0x2_0000_0000;
const SHM_LEN: u64 = 0x1_0000_0000; // 4 GiB: exercises the 64-bit capability form

struct Dev {
    activated: Arc<Mutex<Vec<u16>>>,
}

impl VirtioDevice for Dev {
    fn device_type(&self) -> u32 {
        26
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[64, 64]
    }
    fn features(&self) -> u64 {
        1 << VIRTIO_F_VERSION_1
    }
    fn ack_features(&mut self, _features: u64) {}
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        read_config_bytes(b"tag0", offset, data)
    }
    fn activate(
        &mut self,
        _mem: GuestMemoryAtomic<GuestMemoryMmap>,
        _interrupt: Arc<dyn VirtioInterrupt>,
        queues: Vec<ActivatedQueue>,
    ) -> Result<(), ActivateError> {
        *self.activated.lock().unwrap() = queues.iter().map(|q| q.index).collect();
        Ok(())
    }
    fn reset(&mut self) -> bool {
        true
    }
    fn shm_regions(&self) -> Vec<SharedMemoryRegion> {
        vec![SharedMemoryRegion {
            id: 0,
            guest_addr: SHM_BAR_ADDR,
            len: SHM_LEN,
            host_addr: 0,
        }]
    }
}

/// Records what the transport asks of its MSI sender: (sent, re-routed,
/// mask state per vector, vectors whose notifier was asked for).
#[derive(Default)]
struct Sent(
    Mutex<Vec<(u16, u32)>>,
    Mutex<Vec<(u16, u32)>>,
    Mutex<BTreeMap<u16, bool>>,
    Mutex<Vec<u16>>,
);
impl MsiSender for Sent {
    fn send(&self, vector: u16, entry: MsixEntry) -> std::io::Result<()> {
        self.0.lock().unwrap().push((vector, entry.data));
        Ok(())
    }
    fn update(&self, vector: u16, entry: MsixEntry) -> std::io::Result<()> {
        self.1.lock().unwrap().push((vector, entry.data));
        Ok(())
    }
    fn notifier(&self, vector: u16) -> Option<EventFd> {
        self.3.lock().unwrap().push(vector);
        EventFd::new(0).ok()
    }
    fn set_masked(&self, vector: u16, masked: bool) -> std::io::Result<()> {
        self.2.lock().unwrap().insert(vector, masked);
        Ok(())
    }
}

impl Sent {
    /// The vectors the sender was last told are unmasked.
    fn unmasked(&self) -> Vec<u16> {
        self.2
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, m)| !**m)
            .map(|(v, _)| *v)
            .collect()
    }
}

fn device() -> (VirtioPciDevice, Arc<Mutex<Vec<u16>>>, Arc<Sent>) {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let activated = Arc::new(Mutex::new(Vec::new()));
    let sent = Arc::new(Sent::default());
    let d = VirtioPciDevice::new(
        Box::new(Dev {
            activated: activated.clone(),
        }),
        GuestMemoryAtomic::new(mem),
        BAR0,
        Some((SHM_BAR_ADDR, SHM_LEN)),
        3,
        sent.clone(),
    )
    .unwrap();
    (d, activated, sent)
}

fn cfg8(d: &VirtioPciDevice, off: u64) -> u8 {
    let mut b = [0u8];
    d.read_config(off, &mut b);
    b[0]
}
fn cfg32(d: &VirtioPciDevice, off: u64) -> u32 {
    let mut b = [0u8; 4];
    d.read_config(off, &mut b);
    u32::from_le_bytes(b)
}
fn bar_w(d: &mut VirtioPciDevice, off: u64, v: u64, len: usize) {
    d.write_bar0(off, &v.to_le_bytes()[..len]);
}
fn bar_r(d: &mut VirtioPciDevice, off: u64, len: usize) -> u64 {
    let mut b = [0u8; 8];
    d.read_bar0(off, &mut b[..len]);
    u64::from_le_bytes(b)
}

#[derive(Debug, PartialEq)]
struct VirtioCap {
    cfg_type: u8,
    bar: u8,
    id: u8,
    offset: u64,
    length: u64,
}

/// Walks the capability list from 0x34 as Linux's virtio_pci_modern does.
fn walk(d: &VirtioPciDevice) -> (Vec<VirtioCap>, Option<u64>, Option<u64>) {
    let mut caps = Vec::new();
    let (mut notify_mult, mut msix) = (None, None);
    let mut ptr = u64::from(cfg8(d, 0x34));
    let mut guard = 0;
    while ptr != 0 && guard < 48 {
        guard += 1;
        match cfg8(d, ptr) {
            0x09 => {
                let cap_len = cfg8(d, ptr + 2);
                let mut c = VirtioCap {
                    cfg_type: cfg8(d, ptr + 3),
                    bar: cfg8(d, ptr + 4),
                    id: cfg8(d, ptr + 5),
                    offset: u64::from(cfg32(d, ptr + 8)),
                    length: u64::from(cfg32(d, ptr + 12)),
                };
                if c.cfg_type == CAP_NOTIFY {
                    notify_mult = Some(u64::from(cfg32(d, ptr + 16)));
                }
                if c.cfg_type == CAP_SHARED_MEMORY {
                    assert_eq!(cap_len, 24, "64-bit shared memory capability");
                    c.offset |= u64::from(cfg32(d, ptr + 16)) << 32;
                    c.length |= u64::from(cfg32(d, ptr + 20)) << 32;
                }
                caps.push(c);
            }
            0x11 => msix = Some(ptr),
            other => panic!("unexpected capability {other:#x}"),
        }
        ptr = u64::from(cfg8(d, ptr + 1));
    }
    (caps, notify_mult, msix)
}

#[test]
fn ids_bars_and_every_capability_field() {
    let (d, _, _) = device();
    assert_eq!(cfg32(&d, 0), 0x105a_1af4, "virtio-fs: 0x1040 + 26");
    assert_eq!(cfg8(&d, 8), 1, "revision 1: modern only");
    assert_eq!(d.bar_address(0), Some(BAR0));
    assert_eq!(d.bar_address(2), Some(SHM_BAR_ADDR));
    assert_eq!(cfg32(&d, 0x18) & 0xf, 0xc, "BAR 2: 64-bit prefetchable");
    let (caps, mult, msix) = walk(&d);
    let expect = |cfg_type, bar, id, offset, length| VirtioCap {
        cfg_type,
        bar,
        id,
        offset,
        length,
    };
    assert_eq!(
        caps,
        vec![
            expect(CAP_COMMON, 0, 0, COMMON_CFG_OFFSET, COMMON_CFG_SIZE),
            expect(CAP_ISR, 0, 0, ISR_OFFSET, 1),
            expect(CAP_DEVICE, 0, 0, DEVICE_CFG_OFFSET, DEVICE_CFG_SIZE),
            expect(
                CAP_NOTIFY,
                0,
                0,
                NOTIFY_OFFSET,
                2 * u64::from(NOTIFY_OFF_MULTIPLIER)
            ),
            expect(CAP_SHARED_MEMORY, SHM_BAR, 0, 0, SHM_LEN),
            expect(CAP_PCI_CFG, 0, 0, 0, 0),
        ]
    );
    assert_eq!(mult, Some(u64::from(NOTIFY_OFF_MULTIPLIER)));
    let msix = msix.expect("MSI-X capability");
    assert_eq!(cfg32(&d, msix) >> 16 & 0x7ff, 2, "table size - 1");
    assert_eq!(
        cfg32(&d, msix + 4),
        u32::try_from(MSIX_TABLE_OFFSET).unwrap(),
        "table in BAR 0"
    );
    assert_eq!(
        cfg32(&d, msix + 8),
        u32::try_from(MSIX_PBA_OFFSET).unwrap(),
        "PBA in BAR 0"
    );
}

#[test]
fn common_config_brings_the_device_up() {
    let (mut d, activated, _) = device();
    assert_eq!(bar_r(&mut d, 0x12, 2), 2, "num_queues");
    bar_w(&mut d, 0x00, 1, 4);
    assert_eq!(bar_r(&mut d, 0x04, 4), 1, "VERSION_1 is bit 32");
    bar_w(
        &mut d,
        0x14,
        u64::from(VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER),
        1,
    );
    bar_w(&mut d, 0x08, 1, 4);
    bar_w(&mut d, 0x0c, 1, 4);
    bar_w(
        &mut d,
        0x14,
        u64::from(
            VIRTIO_CONFIG_S_ACKNOWLEDGE | VIRTIO_CONFIG_S_DRIVER | VIRTIO_CONFIG_S_FEATURES_OK,
        ),
        1,
    );
    assert_ne!(
        narrow::low_u32(bar_r(&mut d, 0x14, 1)) & VIRTIO_CONFIG_S_FEATURES_OK,
        0
    );
    bar_w(&mut d, 0x16, 1, 2);
    assert_eq!(
        bar_r(&mut d, 0x18, 2),
        64,
        "queue_size defaults to the maximum"
    );
    assert_eq!(bar_r(&mut d, 0x1e, 2), 1, "queue_notify_off");
    bar_w(&mut d, 0x18, 32, 2);
    bar_w(&mut d, 0x20, 0x1_0000, 8);
    bar_w(&mut d, 0x28, 0x2_0000, 4); // 32-bit halves, as some drivers write them
    bar_w(&mut d, 0x2c, 0, 4);
    bar_w(&mut d, 0x30, 0x3_0000, 8);
    assert_eq!(bar_r(&mut d, 0x28, 8), 0x2_0000);
    bar_w(&mut d, 0x1c, 1, 2);
    let s = narrow::low_u32(bar_r(&mut d, 0x14, 1));
    bar_w(&mut d, 0x14, u64::from(s | VIRTIO_CONFIG_S_DRIVER_OK), 1);
    assert!(d.is_activated());
    assert_eq!(*activated.lock().unwrap(), vec![1]);
    // Device config, and a notification without ioeventfd reaching the kick.
    let mut tag = [0u8; 4];
    d.read_bar0(DEVICE_CFG_OFFSET, &mut tag);
    assert_eq!(&tag, b"tag0");
    bar_w(
        &mut d,
        NOTIFY_OFFSET + u64::from(NOTIFY_OFF_MULTIPLIER),
        1,
        2,
    );
    let notifiers = d.queue_notifiers();
    assert_eq!(
        notifiers[1].1,
        NOTIFY_OFFSET + u64::from(NOTIFY_OFF_MULTIPLIER)
    );
    assert_eq!(notifiers[1].0.read().unwrap(), 1);
    // Reset from the driver.
    bar_w(&mut d, 0x14, 0, 1);
    assert_eq!(d.status(), 0);
    assert!(!d.is_activated());
    assert_eq!(bar_r(&mut d, 0x16, 2), 0, "queue_select back to 0");
}

#[test]
fn msix_vectors_masking_and_isr() {
    let (mut d, _, sent) = device();
    let (_, _, msix) = walk(&d);
    let msix = msix.unwrap();
    // Assign vectors: config 0, queue 0 → 1; a vector past the table is refused.
    bar_w(&mut d, 0x10, 0, 2);
    bar_w(&mut d, 0x16, 0, 2);
    bar_w(&mut d, 0x1a, 1, 2);
    assert_eq!(bar_r(&mut d, 0x1a, 2), 1);
    bar_w(&mut d, 0x16, 1, 2);
    bar_w(&mut d, 0x1a, 9, 2);
    assert_eq!(bar_r(&mut d, 0x1a, 2), u64::from(VIRTIO_MSI_NO_VECTOR));
    // Program entry 1 and enable MSI-X with the entry still masked.
    bar_w(&mut d, MSIX_TABLE_OFFSET + 16, 0xfee0_0000, 4);
    bar_w(&mut d, MSIX_TABLE_OFFSET + 24, 0x51, 4);
    assert_eq!(
        sent.1.lock().unwrap().last(),
        Some(&(1, 0x51)),
        "each table write re-routes its vector"
    );
    d.write_config(msix + 2, &0x8000u16.to_le_bytes());
    d.device_interrupt.trigger(Interrupt::Queue(0)).unwrap();
    assert!(sent.0.lock().unwrap().is_empty(), "masked: held back");
    assert_eq!(bar_r(&mut d, MSIX_PBA_OFFSET, 4), 0b10);
    // Unmask: the pending interrupt goes out.
    bar_w(&mut d, MSIX_TABLE_OFFSET + 28, 0, 4);
    assert_eq!(*sent.0.lock().unwrap(), vec![(1, 0x51)]);
    assert_eq!(bar_r(&mut d, MSIX_PBA_OFFSET, 4), 0);
    d.device_interrupt.trigger(Interrupt::Queue(0)).unwrap();
    assert_eq!(sent.0.lock().unwrap().len(), 2);
    // ISR: set by interrupts, cleared by reading it.
    assert_eq!(bar_r(&mut d, ISR_OFFSET, 1), u64::from(ISR_QUEUE));
    assert_eq!(bar_r(&mut d, ISR_OFFSET, 1), 0);
}

#[test]
fn pci_cfg_capability_window_reaches_bar0() {
    let (mut d, _, _) = device();
    let (caps, _, _) = walk(&d);
    assert!(caps.iter().any(|c| c.cfg_type == CAP_PCI_CFG));
    // Find the cap's offset by walking again for its position.
    let mut ptr = u64::from(cfg8(&d, 0x34));
    while cfg8(&d, ptr + 3) != CAP_PCI_CFG || cfg8(&d, ptr) != 0x09 {
        ptr = u64::from(cfg8(&d, ptr + 1));
    }
    d.write_config(ptr + 4, &[0]); // bar 0
    d.write_config(ptr + 8, &0x12u32.to_le_bytes()); // num_queues
    d.write_config(ptr + 12, &2u32.to_le_bytes());
    assert_eq!(cfg32(&d, ptr + 16) & 0xffff, 2);
    // Through the window, select queue 1 and read it back directly.
    d.write_config(ptr + 8, &0x16u32.to_le_bytes());
    d.write_config(ptr + 16, &1u16.to_le_bytes());
    assert_eq!(bar_r(&mut d, 0x16, 2), 1);
}

#[test]
fn a_queue_with_a_vector_hands_out_its_irqfd_which_is_armed_only_while_unmasked() {
    let (mut d, _, sent) = device();
    let msix = walk(&d).2.unwrap();
    let control = |d: &mut VirtioPciDevice, v: u16| d.write_config(msix + 2, &v.to_le_bytes());
    assert!(
        d.device_interrupt.notifier(Interrupt::Queue(0)).is_none(),
        "no vector: only trigger reaches the guest"
    );
    bar_w(&mut d, 0x16, 0, 2);
    bar_w(&mut d, 0x1a, 1, 2);
    assert!(d.device_interrupt.notifier(Interrupt::Queue(0)).is_some());
    assert!(
        d.device_interrupt.notifier(Interrupt::Queue(1)).is_none(),
        "queue 1 has no vector"
    );
    assert_eq!(
        *sent.3.lock().unwrap(),
        vec![1],
        "queue 0's notifier is vector 1's"
    );

    // Enabled with every entry masked (the reset state): nothing armed.
    control(&mut d, 0x8000);
    assert_eq!(
        sent.2.lock().unwrap().len(),
        3,
        "every vector's state is given"
    );
    assert_eq!(sent.unmasked(), Vec::<u16>::new());
    bar_w(&mut d, MSIX_TABLE_OFFSET + 16, 0xfee0_0000, 4);
    bar_w(&mut d, MSIX_TABLE_OFFSET + 24, 0x51, 4);
    bar_w(&mut d, MSIX_TABLE_OFFSET + 28, 0, 4);
    assert_eq!(sent.unmasked(), vec![1], "entry 1 unmasked");
    control(&mut d, 0xc000);
    assert_eq!(sent.unmasked(), Vec::<u16>::new(), "function mask");
    control(&mut d, 0x8000);
    assert_eq!(sent.unmasked(), vec![1]);
    bar_w(&mut d, MSIX_TABLE_OFFSET + 28, 1, 4);
    assert_eq!(sent.unmasked(), Vec::<u16>::new(), "entry 1 masked again");
    bar_w(&mut d, MSIX_TABLE_OFFSET + 28, 0, 4);
    control(&mut d, 0);
    assert_eq!(sent.unmasked(), Vec::<u16>::new(), "MSI-X disabled");
}
