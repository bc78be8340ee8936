use super::*;
use crate::configuration::{BarKind, PciIds};
use crate::msix::{Delivery, MSIX_ENABLE, MSIX_TABLE_ENTRY_SIZE};

fn built() -> PciConfiguration {
    let mut c = PciConfiguration::new(PciIds {
        vendor: 0x1af4,
        device: 0x105a,
        subsystem_vendor: 0x1af4,
        subsystem: 0x40,
        class: 0xff,
        subclass: 0,
        prog_if: 0,
        revision: 1,
    });
    c.add_bar(
        0,
        0xe000_0000,
        0x8000,
        BarKind::Mem64 {
            prefetchable: false,
        },
    )
    .unwrap();
    c.add_bar(
        2,
        0x1_0000_0000,
        0x20_0000,
        BarKind::Mem64 { prefetchable: true },
    )
    .unwrap();
    c.add_capability(0x11, &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[0, 0, 0, 0xc0])
        .unwrap();
    c
}

fn w32(c: &mut PciConfiguration, off: u64, v: u32) {
    c.write(off, &v.to_le_bytes());
}

/// A configuration the guest changed (decoding on, both BARs moved, a
/// capability bit set) comes back in a fresh function exactly, BARs at
/// the moved addresses, and survives a JSON round trip.
#[test]
fn configuration_round_trip_keeps_moved_bars() {
    let mut c = built();
    w32(&mut c, 0x04, 0x6);
    w32(&mut c, 0x10, 0xe010_0000);
    w32(&mut c, 0x1c, 0x3);
    w32(&mut c, 0x40, 0x8000_0000);
    let saved = c.save();
    let json = serde_json::to_string(&saved).unwrap();
    let back: PciConfigurationState = serde_json::from_str(&json).unwrap();
    let mut fresh = built();
    assert_eq!(fresh.bar_address(0), Some(0xe000_0000));
    fresh.restore(&back).unwrap();
    assert_eq!(fresh.bar_address(0), Some(0xe010_0000));
    assert_eq!(fresh.bar_address(2), Some(0x3_0000_0000));
    assert!(fresh.memory_enabled());
    for reg in 0..NUM_REGS {
        assert_eq!(fresh.read_reg(reg), c.read_reg(reg), "register {reg}");
    }
}

/// A state of another device (other ids, another BAR layout, a truncated
/// register file) is refused naming the field, and the function keeps
/// what it had.
#[test]
fn a_configuration_of_another_layout_is_refused_by_field() {
    let mut other = built();
    w32(&mut other, 0x04, 0x6);
    let mut state = other.save();
    state.regs[0] = 0x1234_1af4; // another device id: read-only bits
    let mut fresh = built();
    let err = fresh.restore(&state).unwrap_err();
    assert!(err.to_string().contains("regs[0]"), "{err}");
    assert!(!fresh.memory_enabled(), "nothing applied");

    let mut state = other.save();
    state.bars[2] = None;
    let err = fresh.restore(&state).unwrap_err();
    assert!(err.to_string().contains("bars[2]"), "{err}");

    let mut state = other.save();
    state.writable[4] = u32::MAX;
    let err = fresh.restore(&state).unwrap_err();
    assert!(err.to_string().contains("writable[4]"), "{err}");

    let mut state = other.save();
    state.regs.truncate(10);
    let err = fresh.restore(&state).unwrap_err();
    assert!(err.to_string().contains("regs: 10 entries"), "{err}");
    assert!(!fresh.memory_enabled(), "nothing applied");
}

fn program(m: &mut MsixConfig, v: u16, data: u32, masked: bool) {
    let base = u64::from(v) * MSIX_TABLE_ENTRY_SIZE;
    m.write_table(base, &0xfee0_0000u32.to_le_bytes());
    m.write_table(base + 8, &data.to_le_bytes());
    m.write_table(base + 12, &u32::from(masked).to_le_bytes());
}

/// Table, pending bits, enable and function mask come back; a pending
/// vector is still pending (delivered on unmask, not lost).
#[test]
fn msix_round_trip_keeps_entries_and_pending_bits() {
    let mut m = MsixConfig::new(3);
    m.set_message_control(MSIX_ENABLE);
    program(&mut m, 0, 0x41, false);
    program(&mut m, 2, 0x43, true);
    assert_eq!(m.trigger(2), Delivery::Pending);
    let saved = m.save();
    let back: MsixState = serde_json::from_str(&serde_json::to_string(&saved).unwrap()).unwrap();
    let mut fresh = MsixConfig::new(3);
    fresh.restore(&back).unwrap();
    assert_eq!(fresh.save(), saved);
    assert!(matches!(fresh.trigger(0), Delivery::Deliver(e) if e.data == 0x41));
    let mut pba = [0u8; 8];
    fresh.read_pba(0, &mut pba);
    assert_eq!(u64::from_le_bytes(pba), 1 << 2);
    let released = fresh.write_table(2 * MSIX_TABLE_ENTRY_SIZE + 12, &0u32.to_le_bytes());
    assert!(released
        .iter()
        .any(|u| matches!(u, crate::msix::MsixUpdate::DeliverPending(2, e) if e.data == 0x43)));
}

#[test]
fn an_msix_state_of_another_size_or_with_stray_bits_is_refused() {
    let mut m = MsixConfig::new(3);
    m.set_message_control(MSIX_ENABLE);
    let mut fresh = MsixConfig::new(2);
    let err = fresh.restore(&m.save()).unwrap_err();
    assert!(err.to_string().contains("MSI-X: table: 3 vectors"), "{err}");

    let mut fresh = MsixConfig::new(3);
    let mut state = m.save();
    state.pba[0] = 1 << 3;
    let err = fresh.restore(&state).unwrap_err();
    assert!(err.to_string().contains("pba[0]"), "{err}");
    let mut state = m.save();
    state.table[1].control = 0x10;
    let err = fresh.restore(&state).unwrap_err();
    assert!(err.to_string().contains("table[1].control"), "{err}");
    assert_eq!(fresh.trigger(0), Delivery::Dropped, "still disabled");
}
