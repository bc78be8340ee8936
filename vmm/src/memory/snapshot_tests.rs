//! Tests of `snapshot.rs`: the layout's section round trip and checks, and
//! `memory-ranges` written sparse and read back, or refused by range.

use std::os::fd::AsRawFd;

use vm_memory::GuestMemoryRegion;
use vm_state::{Persist, StateDocument};

use super::*;
use crate::config::MemoryConfig;
use crate::memory::{create_guest_memory, create_hotplug_region, memfd};

const MIB: u64 = 1 << 20;
const HOTPLUG_BASE: u64 = 1 << 32;

/// 32 MiB of boot RAM and 8 MiB hot-plugged at 4 GiB: two regions, on
/// slots 0 and 1.
fn memory(shared: bool) -> (GuestMemoryMmap, MemoryLayoutState) {
    let cfg = MemoryConfig {
        size: 32 * MIB,
        shared,
        ..Default::default()
    };
    let mem = create_guest_memory(&cfg).unwrap();
    let added = create_hotplug_region(&cfg, HOTPLUG_BASE, 8 * MIB).unwrap();
    let mut regions = vec![RamRegionState::of(
        mem.iter().next().unwrap(),
        0,
        RegionOrigin::Boot,
    )];
    regions.push(RamRegionState::of(&added, 1, RegionOrigin::Hotplug));
    let mem = mem.insert_region(added).unwrap();
    (mem, MemoryLayoutState::new(regions).unwrap())
}

/// Bytes at known places: in the first page, across a page boundary in
/// boot RAM, and at the last byte of the hot-plugged region.
const WRITES: [(u64, &[u8]); 3] = [
    (0x10, b"first page"),
    (16 * MIB - 3, b"across a page"),
    (HOTPLUG_BASE + 8 * MIB - 1, b"z"),
];

fn fill(mem: &GuestMemoryMmap) {
    for (gpa, bytes) in WRITES {
        mem.write_slice(bytes, GuestAddress(gpa)).unwrap();
    }
}

/// The data extents of `file`, from SEEK_DATA / SEEK_HOLE.
fn data_extents(file: &File) -> Vec<(u64, u64)> {
    let len = file.metadata().unwrap().len();
    let mut out = Vec::new();
    let mut at = 0;
    while let Some((data, extent)) = next_data_extent(file, at, len).unwrap() {
        out.push((data, extent));
        at = data + extent;
    }
    out
}

fn assert_same_memory(a: &GuestMemoryMmap, b: &GuestMemoryMmap) {
    for region in a.iter() {
        let mut x = vec![0u8; narrow::usize_of(region.len())];
        let mut y = x.clone();
        a.read_slice(&mut x, region.start_addr()).unwrap();
        b.read_slice(&mut y, region.start_addr()).unwrap();
        assert!(x == y, "region at {:#x} differs", region.start_addr().0);
    }
}

fn written_file(shared: bool) -> (GuestMemoryMmap, MemoryLayoutState, File) {
    let (mem, mut layout) = memory(shared);
    fill(&mem);
    let out = memfd(false).unwrap();
    // A file that held something before: none of it may remain.
    out.write_all_at(b"stale", 20 * MIB).unwrap();
    write_memory_ranges(&mem, &mut layout, &out).unwrap();
    (mem, layout, out)
}

/// The file holds data only in the pages written (the file offset of a
/// guest address: its offset in its region plus the regions before it),
/// and a fresh memory reads back equal.
#[test]
fn untouched_ram_is_a_hole_and_the_file_reads_back_equal() {
    for shared in [true, false] {
        let (mem, layout, out) = written_file(shared);
        assert_eq!(
            layout.memory_ranges,
            vec![
                MemoryRange {
                    gpa: 0,
                    length: 32 * MIB
                },
                MemoryRange {
                    gpa: HOTPLUG_BASE,
                    length: 8 * MIB
                },
            ]
        );
        assert_eq!(out.metadata().unwrap().len(), 40 * MIB);
        let file_offset = |gpa: u64| {
            if gpa >= HOTPLUG_BASE {
                gpa - HOTPLUG_BASE + 32 * MIB
            } else {
                gpa
            }
        };
        let pages: Vec<u64> = WRITES
            .iter()
            .flat_map(|(gpa, bytes)| {
                let first = file_offset(*gpa) / PAGE;
                let last = (file_offset(*gpa) + bytes.len() as u64 - 1) / PAGE;
                first..=last
            })
            .collect();
        let extents = data_extents(&out);
        assert!(!extents.is_empty());
        for (data, extent) in &extents {
            for page in data / PAGE..(data + extent).div_ceil(PAGE) {
                assert!(
                    pages.contains(&page),
                    "shared={shared}: data at page {page} of the file, {extents:x?}"
                );
            }
        }
        // Every byte written is where the table says.
        for (gpa, bytes) in WRITES {
            let mut got = vec![0u8; bytes.len()];
            out.read_exact_at(&mut got, file_offset(gpa)).unwrap();
            assert_eq!(got, bytes, "shared={shared}: at {gpa:#x}");
        }
        // Restored as a new VMM would: RAM made from the layout, then read.
        let cfg = MemoryConfig {
            shared,
            ..Default::default()
        };
        let fresh = GuestRam::restore(&cfg, &layout).unwrap().mem;
        assert_eq!(fresh.num_regions(), 2);
        read_memory_ranges(&out, &layout, &fresh).unwrap();
        assert_same_memory(&mem, &fresh);
    }
}

#[test]
fn the_layout_round_trips_through_the_state_document() {
    let (_, mut layout) = memory(true);
    layout.memory_ranges = vec![MemoryRange {
        gpa: 0,
        length: 4096,
    }];
    assert_eq!(layout.regions[0].file_offset, Some(0));
    assert_eq!(layout.regions[1].origin, RegionOrigin::Hotplug);
    let mut doc = StateDocument::new("test");
    doc.put("memory", &layout).unwrap();
    let mut back = StateDocument::from_json(&doc.to_json().unwrap()).unwrap();
    assert_eq!(back.take::<MemoryLayoutState>("memory").unwrap(), layout);
    back.finish().unwrap();
}

/// Boot RAM above 3 GiB is two regions of one memfd: the second one's
/// offset in it is the first one's length.
#[test]
fn boot_ram_across_the_hole_keeps_both_file_offsets() {
    let mem = create_guest_memory(&MemoryConfig {
        size: 4 << 30,
        shared: true,
        ..Default::default()
    })
    .unwrap();
    let layout = MemoryLayoutState::of_boot_memory(&mem).unwrap();
    assert_eq!(layout.regions.len(), 2);
    let first = &layout.regions[0];
    let second = &layout.regions[1];
    assert_eq!((first.slot, first.file_offset), (0, Some(0)));
    assert_eq!((second.slot, second.file_offset), (1, Some(first.length)));
    assert_eq!(first.length + second.length, 4 << 30);
}

#[test]
fn a_bad_layout_is_refused_by_region_and_field() {
    let (_, layout) = memory(true);
    let refused = |edit: &dyn Fn(&mut MemoryLayoutState)| {
        let mut l = layout.clone();
        edit(&mut l);
        l.validate().unwrap_err().to_string()
    };
    let e = refused(&|l| l.regions[1].gpa = 16 * MIB);
    assert!(
        e.contains("region 1") && e.contains("gpa") && e.contains("overlaps"),
        "{e}"
    );
    let e = refused(&|l| l.regions[1].length = u64::MAX - 4095);
    assert!(
        e.contains("region 1") && e.contains("length") && e.contains("wraps"),
        "{e}"
    );
    let e = refused(&|l| l.regions[1].file_offset = Some(u64::MAX - 4095));
    assert!(e.contains("file_offset"), "{e}");
    let e = refused(&|l| l.regions[1].slot = 0);
    assert!(e.contains("region 1") && e.contains("slot"), "{e}");
    let e = refused(&|l| l.regions[0].length = 100);
    assert!(e.contains("region 0") && e.contains("length"), "{e}");
    let e = refused(&|l| {
        l.regions = (0..=MAX_RAM_REGIONS as u64)
            .map(|i| RamRegionState {
                slot: narrow::u32_of(i),
                gpa: i * PAGE,
                length: PAGE,
                file_offset: None,
                origin: RegionOrigin::Hotplug,
            })
            .collect()
    });
    assert!(e.contains("more than the 64"), "{e}");
}

/// A file cut short is refused naming the range it no longer holds, and
/// nothing is written to guest memory.
#[test]
fn a_truncated_file_is_refused_by_range() {
    let (_, layout, out) = written_file(true);
    out.set_len(40 * MIB - PAGE).unwrap();
    let (fresh, _) = memory(true);
    let err = read_memory_ranges(&out, &layout, &fresh).unwrap_err();
    assert!(
        matches!(err, MemorySnapshotError::ShortFile { index: 1, gpa: HOTPLUG_BASE, end, file_len, .. }
            if end == 40 * MIB && file_len == 40 * MIB - PAGE),
        "{err:?}"
    );
    assert!(err.to_string().contains("range 1"), "{err}");
    let mut first = [0u8; 10];
    fresh.read_slice(&mut first, GuestAddress(0x10)).unwrap();
    assert_eq!(first, [0; 10], "nothing restored from a refused file");
}

/// A table that does not match the layout or the file is refused before
/// a byte is read.
#[test]
fn a_lying_table_is_refused_by_range() {
    let (_, layout, out) = written_file(true);
    let (fresh, _) = memory(true);
    let lie = |index: usize, range: MemoryRange| {
        let mut l = layout.clone();
        l.memory_ranges[index] = range;
        read_memory_ranges(&out, &l, &fresh).unwrap_err()
    };
    // Past the end of the boot region (into the gap).
    let e = lie(
        0,
        MemoryRange {
            gpa: 0,
            length: 33 * MIB,
        },
    );
    assert!(
        matches!(e, MemorySnapshotError::BadRange { index: 0, .. }),
        "{e:?}"
    );
    // gpa + length wraps.
    let e = lie(
        1,
        MemoryRange {
            gpa: u64::MAX - 4095,
            length: 8192,
        },
    );
    assert!(
        matches!(e, MemorySnapshotError::BadRange { index: 1, .. }),
        "{e:?}"
    );
    let e = lie(
        1,
        MemoryRange {
            gpa: HOTPLUG_BASE,
            length: 0,
        },
    );
    assert!(
        e.to_string().contains("range 1") && e.to_string().contains("empty"),
        "{e}"
    );
    // Two ranges over the same pages.
    let e = lie(
        1,
        MemoryRange {
            gpa: 0,
            length: 8 * MIB,
        },
    );
    assert!(
        e.to_string().contains("range 1") && e.to_string().contains("overlaps"),
        "{e}"
    );
    // More ranges than a restore reads.
    let mut long = layout.clone();
    long.memory_ranges = vec![
        MemoryRange {
            gpa: 0,
            length: PAGE
        };
        MAX_TABLE_RANGES + 1
    ];
    let e = read_memory_ranges(&out, &long, &fresh).unwrap_err();
    assert!(
        matches!(e, MemorySnapshotError::TooManyRanges { .. }),
        "{e:?}"
    );
    // A table shorter than the file.
    let mut short = layout.clone();
    short.memory_ranges.pop();
    let e = read_memory_ranges(&out, &short, &fresh).unwrap_err();
    assert!(
        matches!(e, MemorySnapshotError::LongFile { file_len, table_len }
        if file_len == 40 * MIB && table_len == 32 * MIB),
        "{e:?}"
    );
    // In the layout but not in the memory restored into.
    let small = create_guest_memory(&MemoryConfig {
        size: 32 * MIB,
        shared: true,
        ..Default::default()
    })
    .unwrap();
    let e = read_memory_ranges(&out, &layout, &small).unwrap_err();
    assert!(
        e.to_string().contains("range 1") && e.to_string().contains("guest memory"),
        "{e}"
    );
}

#[test]
fn hole_seeking_sees_only_written_pages() {
    let f = memfd(false).unwrap();
    f.set_len(16 * MIB).unwrap();
    f.write_all_at(b"x", 5 * MIB + 1).unwrap();
    assert!(f.as_raw_fd() >= 0);
    assert_eq!(data_extents(&f), vec![(5 * MIB, PAGE)]);
    assert_eq!(
        next_data_extent(&f, 5 * MIB + PAGE, 16 * MIB).unwrap(),
        None
    );
    assert_eq!(
        next_data_extent(&f, 0, 5 * MIB).unwrap(),
        None,
        "bounded by end"
    );
}

#[test]
fn restore_refuses_a_layout_its_configuration_cannot_build() {
    let (_, layout) = memory(true);
    // The layout's RAM has memfds; private RAM cannot stand in for it.
    let err = restore_guest_memory(&MemoryConfig::default(), &layout).unwrap_err();
    assert!(
        matches!(
            err,
            MemorySnapshotError::Mismatch {
                index: 0,
                gpa: 0,
                ..
            }
        ),
        "{err:?}"
    );
    // Boot RAM at an address boot RAM does not start at.
    let mut moved = layout.clone();
    moved.regions[0].gpa = 2 * MIB;
    let shared = MemoryConfig {
        shared: true,
        ..Default::default()
    };
    let err = restore_guest_memory(&shared, &moved).unwrap_err();
    assert!(err.to_string().contains("region 0"), "{err}");
    // Saved and restored through the trait, the layout is the same.
    let mut ram = restore_guest_memory(&shared, &layout).unwrap();
    assert_eq!(ram.save().unwrap(), layout);
}

/// Resident pages of `region`'s mapping, by mincore.
fn resident_pages(region: &GuestRegionMmap) -> usize {
    let len = narrow::usize_of(region.len());
    let mut vec = vec![0u8; len.div_ceil(4096)];
    // SAFETY: the region is a live mapping of `len` bytes; `vec` has one
    // byte per page of it.
    let r = unsafe { libc::mincore(region.as_ptr().cast(), len, vec.as_mut_ptr()) };
    assert_eq!(r, 0, "{}", io::Error::last_os_error());
    vec.iter().filter(|&&b| b & 1 != 0).count()
}

/// A restore's prefault leaves every page of guest RAM resident (the
/// guest's first touches take no fault), private and shared RAM alike.
#[test]
fn prefault_makes_every_page_of_guest_ram_resident() {
    for shared in [false, true] {
        let mem = create_guest_memory(&MemoryConfig {
            size: 32 << 20,
            shared,
            ..Default::default()
        })
        .unwrap();
        let region = mem.iter().next().unwrap();
        assert!(
            resident_pages(region) < 8192,
            "fresh RAM is not all resident"
        );
        populate(&mem).unwrap();
        assert_eq!(resident_pages(region), 8192, "shared={shared}");
    }
}
