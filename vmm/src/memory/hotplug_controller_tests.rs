use super::*;

fn read32(dev: &mut MemoryHotplugController, offset: u64) -> u32 {
    let mut b = [0u8; 4];
    dev.read(offset, &mut b);
    u32::from_le_bytes(b)
}

fn read8(dev: &mut MemoryHotplugController, offset: u64) -> u8 {
    let mut b = [0u8];
    dev.read(offset, &mut b);
    b[0]
}

fn select(dev: &mut MemoryHotplugController, slot: u32) {
    dev.write(SELECTOR, &slot.to_le_bytes());
}

#[test]
fn an_inserted_range_reads_back_through_the_selected_slot() {
    let mut dev = MemoryHotplugController::new();
    let base = (4u64 << 30) + (128 << 20);
    let len = 3u64 << 31; // 6 GiB: the length's high half is not zero
    assert_eq!(dev.insert(1 << 32, 128 << 20), Ok(0));
    assert_eq!(dev.insert(base, len), Ok(1));
    select(&mut dev, 1);
    assert_eq!(read32(&mut dev, SELECTOR), 1);
    assert_eq!(read32(&mut dev, BASE_LOW), (base & 0xffff_ffff) as u32);
    assert_eq!(read32(&mut dev, BASE_HIGH), (base >> 32) as u32);
    assert_eq!(read32(&mut dev, LENGTH_LOW), (len & 0xffff_ffff) as u32);
    assert_eq!(read32(&mut dev, LENGTH_HIGH), (len >> 32) as u32);
    assert_eq!(read8(&mut dev, STATUS), STATUS_ENABLED | STATUS_INSERTING);
    // MSCN acknowledges the insertion: the slot stays enabled.
    dev.write(STATUS, &[STATUS_INSERTING]);
    assert_eq!(read8(&mut dev, STATUS), STATUS_ENABLED);
    // Slot 0 still waits for its acknowledgement.
    select(&mut dev, 0);
    assert_eq!(read8(&mut dev, STATUS), STATUS_ENABLED | STATUS_INSERTING);
    // An empty slot reads as absent.
    select(&mut dev, 2);
    assert_eq!(read8(&mut dev, STATUS), 0);
    assert_eq!(read32(&mut dev, LENGTH_LOW), 0);
}

#[test]
fn the_guest_cannot_change_a_range_or_reach_past_the_slots() {
    let mut dev = MemoryHotplugController::new();
    dev.insert(1 << 32, 128 << 20).unwrap();
    select(&mut dev, 0);
    for reg in [BASE_LOW, BASE_HIGH, LENGTH_LOW, LENGTH_HIGH] {
        dev.write(reg, &u32::MAX.to_le_bytes());
    }
    assert_eq!(read32(&mut dev, BASE_HIGH), 1);
    assert_eq!(read32(&mut dev, LENGTH_LOW), 128 << 20);
    // Writing 0 to the status does not acknowledge; writing "enabled" does
    // not disable.
    dev.write(STATUS, &[0]);
    dev.write(STATUS, &[STATUS_ENABLED]);
    assert_eq!(read8(&mut dev, STATUS), STATUS_ENABLED | STATUS_INSERTING);
    // A selector past the slots reads zeroes and its writes go nowhere.
    for sel in [u32::try_from(MEMORY_SLOTS).unwrap(), u32::MAX] {
        select(&mut dev, sel);
        dev.write(STATUS, &[STATUS_INSERTING]);
        assert_eq!(read8(&mut dev, STATUS), 0);
        assert_eq!(read32(&mut dev, BASE_HIGH), 0);
    }
    select(&mut dev, 0);
    assert_eq!(read8(&mut dev, STATUS), STATUS_ENABLED | STATUS_INSERTING);
}

#[test]
fn slots_run_out() {
    let mut dev = MemoryHotplugController::new();
    for i in 0..MEMORY_SLOTS {
        assert!(dev.has_free_slot());
        assert_eq!(dev.insert((i as u64 + 32) << 27, 128 << 20), Ok(i));
    }
    assert!(!dev.has_free_slot());
    assert_eq!(dev.insert(1 << 40, 128 << 20), Err(NoFreeSlot));
}

fn count(haystack: &[u8], needle: &[u8]) -> usize {
    haystack
        .windows(needle.len())
        .filter(|w| *w == needle)
        .count()
}

#[test]
fn the_aml_has_the_controller_its_registers_and_a_device_per_slot() {
    let mut aml = Vec::new();
    MemoryHotplugController::append_aml(true, &mut aml);
    for name in [
        &b"MHPC"[..],
        b"MLCK",
        b"MHPR",
        b"MHBL",
        b"MHBH",
        b"MHLL",
        b"MHLH",
        b"MSEL",
        b"MEN_",
        b"MINS",
        b"MR64",
    ] {
        assert!(count(&aml, name) > 0, "{}", String::from_utf8_lossy(name));
    }
    // Each method is defined once (MethodOp, PkgLength, name).
    for method in [b"MSCN", b"MSTA", b"MCRS", b"MTFY"] {
        assert!(count(&aml, method) >= 1);
    }
    for i in 0..MEMORY_SLOTS {
        let name = format!("M{i:03}");
        // The device, and MTFY's Notify of it.
        assert!(count(&aml, name.as_bytes()) >= 2, "{name}");
    }
    assert!(count(&aml, format!("M{MEMORY_SLOTS:03}").as_bytes()) == 0);
    // PNP0C80 (memory device), EISA-encoded, once per slot.
    let mut pnp0c80 = Vec::new();
    aml::EISAName::new("PNP0C80").to_aml_bytes(&mut pnp0c80);
    assert_eq!(count(&aml, &pnp0c80), MEMORY_SLOTS);
    // The register block: SystemIO (1) at the port, 24 bytes long.
    let mut region = Vec::new();
    aml::OpRegion::new(
        "MHPR".into(),
        aml::OpRegionSpace::SystemIO,
        &usize::from(MEMORY_HOTPLUG_PORT),
        &narrow::usize_of(MEMORY_HOTPLUG_PORT_COUNT),
    )
    .to_aml_bytes(&mut region);
    assert_eq!(count(&aml, &region), 1);
}

#[test]
fn without_hotplug_the_aml_is_an_empty_scan() {
    let mut aml = Vec::new();
    MemoryHotplugController::append_aml(false, &mut aml);
    assert!(count(&aml, b"MSCN") == 1);
    assert_eq!(count(&aml, b"MHPR"), 0);
    assert_eq!(count(&aml, b"M000"), 0);
}
