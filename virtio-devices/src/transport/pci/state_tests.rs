use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde_json::json;
use vm_memory::{GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::transport::pci::device::{MsiSender, MSIX_TABLE_OFFSET};
use crate::transport::state::tests::{Fake, Seen, DEVICE_FEATURE, VERSION_1};
use crate::GuestMemoryMmap;

const BAR0: u64 = 0xe000_0000;
const MOVED_BAR0: u64 = 0xe010_0000;

/// What the transport asked of its MSI sender: routes (vector, data) in
/// order, and each vector's last mask.
#[derive(Default)]
struct Routes {
    routed: Mutex<Vec<(u16, u32)>>,
    masked: Mutex<BTreeMap<u16, bool>>,
    /// Vectors whose notifier a backend wrote while they were masked.
    held: Mutex<Vec<u16>>,
    sent: Mutex<Vec<u16>>,
}

impl MsiSender for Routes {
    fn send(&self, vector: u16, _entry: MsixEntry) -> std::io::Result<()> {
        self.sent.lock().unwrap().push(vector);
        Ok(())
    }
    fn update(&self, vector: u16, entry: MsixEntry) -> std::io::Result<()> {
        self.routed.lock().unwrap().push((vector, entry.data));
        Ok(())
    }
    fn notifier(&self, _vector: u16) -> Option<EventFd> {
        EventFd::new(0).ok()
    }
    fn set_masked(&self, vector: u16, masked: bool) -> std::io::Result<()> {
        self.masked.lock().unwrap().insert(vector, masked);
        Ok(())
    }
    fn take_pending(&self, vector: u16) -> bool {
        let mut held = self.held.lock().unwrap();
        let was = held.contains(&vector);
        held.retain(|v| *v != vector);
        was
    }
}

struct Rig {
    d: VirtioPciDevice,
    seen: Arc<Mutex<Seen>>,
    routes: Arc<Routes>,
}

fn rig(served: u16) -> Rig {
    let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let routes = Arc::new(Routes::default());
    let fake = Fake {
        seen: seen.clone(),
        queues: Vec::new(),
        served,
    };
    // Three queues and a config vector.
    let d = VirtioPciDevice::new(
        Box::new(fake),
        GuestMemoryAtomic::new(mem),
        BAR0,
        None,
        4,
        routes.clone(),
    )
    .unwrap();
    Rig { d, seen, routes }
}

impl Rig {
    fn common(&mut self, offset: u64, value: u64, len: usize) {
        self.d.write_bar0(offset, &value.to_le_bytes()[..len]);
    }

    fn msix_cap(&self) -> u64 {
        let byte = |off: u64| {
            let mut b = [0u8];
            self.d.read_config(off, &mut b);
            u64::from(b[0])
        };
        let mut ptr = byte(0x34);
        while byte(ptr) != 0x11 {
            ptr = byte(ptr + 1);
        }
        ptr
    }

    /// A driver: memory decoding on and BAR 0 moved, MSI-X on with
    /// vectors 0 (config) and 1..=2 programmed and unmasked, queues 0 and 2
    /// up on vectors 1 and 2, DRIVER_OK.
    fn bring_up(&mut self) {
        self.d.write_config(0x04, &6u16.to_le_bytes());
        self.d
            .write_config(0x10, &narrow::low_u32(MOVED_BAR0).to_le_bytes());
        let cap = self.msix_cap();
        self.d.write_config(cap + 2, &0x8000u16.to_le_bytes());
        for vector in 0..3u64 {
            let entry = MSIX_TABLE_OFFSET + vector * 16;
            self.common(entry, 0xfee0_0000, 4);
            self.common(entry + 8, 0x50 + vector, 4);
            self.common(entry + 12, 0, 4);
        }
        self.common(0x14, 1, 1);
        self.common(0x14, 3, 1);
        self.common(0x08, 0, 4);
        self.common(0x0c, DEVICE_FEATURE, 4);
        self.common(0x08, 1, 4);
        self.common(0x0c, VERSION_1 >> 32, 4);
        self.common(0x14, 0xb, 1);
        self.common(0x10, 0, 2);
        for (queue, vector, base) in [(0u64, 1u64, 0x1_0000u64), (2, 2, 0x2_0000)] {
            self.common(0x16, queue, 2);
            self.common(0x18, 8, 2);
            self.common(0x1a, vector, 2);
            self.common(0x20, base, 8);
            self.common(0x28, base + 0x1000, 8);
            self.common(0x30, base + 0x2000, 8);
            self.common(0x1c, 1, 2);
        }
        self.common(0x14, 0xf, 1);
        assert!(self.d.is_activated());
    }

    fn queue_vector(&mut self, queue: u64) -> u64 {
        self.common(0x16, queue, 2);
        let mut b = [0u8; 2];
        self.d.read_bar0(0x1a, &mut b);
        u64::from(u16::from_le_bytes(b))
    }
}

/// A running virtio-PCI function comes back in a fresh one: BAR 0 where
/// the guest moved it, every programmed MSI-X vector routed again and
/// unmasked, the queue vectors in place before the device is activated
/// (so it finds a notifier per queue), then activated with its saved queue
/// positions.
#[test]
fn a_pci_function_comes_back_with_its_routes_vectors_and_queue_positions() {
    let mut before = rig(4);
    before.bring_up();
    before.d.pause().unwrap();
    let state = before.d.save().unwrap();
    let state: PciTransportState =
        serde_json::from_value(serde_json::to_value(&state).unwrap()).unwrap();

    let mut after = rig(0);
    after.d.restore(&state).unwrap();
    assert_eq!(after.d.bar_address(0), Some(MOVED_BAR0));
    assert_eq!(
        *after.routes.routed.lock().unwrap(),
        vec![(0, 0x50), (1, 0x51), (2, 0x52)]
    );
    let masked = after.routes.masked.lock().unwrap().clone();
    assert_eq!(
        masked,
        BTreeMap::from([(0, false), (1, false), (2, false), (3, true)])
    );
    let seen = after.seen.lock().unwrap();
    assert_eq!(seen.activated, vec![vec![(0, 4, 4), (2, 6, 6)]]);
    assert_eq!(
        seen.notifiers,
        vec![true, true],
        "vectors before activation"
    );
    assert_eq!(seen.restored, Some(json!({"fake": 4})));
    drop(seen);
    assert_eq!(after.queue_vector(2), 2);
    assert_eq!(after.d.status(), 0xf);
    after.d.pause().unwrap();
    assert_eq!(after.d.save().unwrap().registers, state.registers);
}

/// Changes one field of a saved state.
type Spoil = fn(&mut serde_json::Value);

/// A vector past the table, or an MSI-X table of another size, is refused
/// by field before anything is applied: no route, no BAR moved, nothing
/// activated.
#[test]
fn a_bad_pci_state_is_refused_by_field_and_nothing_is_applied() {
    let mut before = rig(1);
    before.bring_up();
    before.d.pause().unwrap();
    let good = serde_json::to_value(before.d.save().unwrap()).unwrap();
    let spoil: [(&str, Spoil); 3] = [
        ("registers.queue_vectors[1]", |v| {
            v["registers"]["queue_vectors"][1] = json!(9)
        }),
        ("registers.config_vector", |v| {
            v["registers"]["config_vector"] = json!(4)
        }),
        ("MSI-X: table: 3 vectors", |v| {
            v["registers"]["msix"]["table"]
                .as_array_mut()
                .unwrap()
                .pop();
        }),
    ];
    for (field, spoil) in spoil {
        let mut bad = good.clone();
        spoil(&mut bad);
        let bad: PciTransportState = serde_json::from_value(bad).unwrap();
        let mut fresh = rig(0);
        let e = fresh.d.restore(&bad).expect_err(field);
        assert!(e.to_string().contains(field), "{field}: {e}");
        assert!(fresh.routes.routed.lock().unwrap().is_empty(), "{field}");
        assert_eq!(fresh.d.bar_address(0), Some(BAR0), "{field}");
        assert_eq!(fresh.d.status(), 0, "{field}");
        let seen = fresh.seen.lock().unwrap();
        assert!(
            seen.activated.is_empty() && seen.restored.is_none(),
            "{field}"
        );
    }
}

/// A notifier write held back on a masked vector is saved as pending (PBA)
/// and delivered when the restored vector is unmasked; one on a vector
/// that is not masked is KVM's, not the transport's.
#[test]
fn a_held_back_interrupt_of_a_masked_vector_is_saved_pending() {
    let mut before = rig(0);
    before.bring_up();
    // The driver masks vector 2; a backend writes its notifier meanwhile.
    before.common(MSIX_TABLE_OFFSET + 2 * 16 + 12, 1, 4);
    before.routes.held.lock().unwrap().extend([1, 2]);
    before.d.pause().unwrap();
    let state = before.d.save().unwrap();
    assert_eq!(state.registers.msix.pba, vec![1 << 2]);

    let mut after = rig(0);
    after.d.restore(&state).unwrap();
    let mut pba = [0u8; 8];
    after
        .d
        .read_bar0(crate::transport::pci::device::MSIX_PBA_OFFSET, &mut pba);
    assert_eq!(u64::from_le_bytes(pba), 1 << 2);
    // Unmasking delivers it (through the sender) and clears the bit.
    after.common(MSIX_TABLE_OFFSET + 2 * 16 + 12, 0, 4);
    after
        .d
        .read_bar0(crate::transport::pci::device::MSIX_PBA_OFFSET, &mut pba);
    assert_eq!(u64::from_le_bytes(pba), 0);
    assert_eq!(*after.routes.sent.lock().unwrap(), vec![2]);
}
