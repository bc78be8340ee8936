//! Guest RAM's part of a snapshot: the layout of its regions (a section of
//! the state document) and the `memory-ranges` file holding their bytes.
//!
//! The file is laid out as Cloud Hypervisor lays out its own (read in its
//! `vmm/src/memory_manager.rs` `Transportable::send` / `fill_saved_regions`
//! and `vmm/src/sparse.rs` at ae44c29): the ranges of a table
//! (`MemoryRangeTable`: `{gpa, length}` pairs, kept in the state document)
//! lie back to back in table order, range `i` at the sum of the lengths
//! before it; the file is sized to the total first and only the extents
//! holding data are written, so untouched RAM stays a hole and costs no
//! disk. As Cloud Hypervisor's snapshot does, the table has one range per
//! RAM region (the whole region; the holes make it cheap).
//!
//! Where ours differs, on purpose: the reader checks every range against
//! the layout and the file's size against the table before it writes a
//! byte of guest memory (Cloud Hypervisor's sparse reader takes a short
//! file as holes and restores zeroes), and private (anonymous) RAM, which
//! has no file to seek holes in, skips its all-zero 4 KiB pages.
//!
//! The DAX windows and pmem are not RAM regions: their contents are the
//! host's files, never written here.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vm_state::protocol::MemoryRange;
use vm_state::{Persist, SectionState, StateError};

use super::{create_guest_memory, create_hotplug_region, GuestMemoryMmap, GuestRegionMmap};
use crate::config::MemoryConfig;

/// RAM regions a layout may hold: boot RAM's two, one per hot-plug slot,
/// and room to spare; a layout with more is refused before anything is
/// allocated for it.
pub const MAX_RAM_REGIONS: usize = 64;
/// Ranges a `memory-ranges` table may list: far more than ours writes
/// (one per region) and than a table of every data extent of a large
/// guest would; the reader refuses a longer one before reading.
pub const MAX_TABLE_RANGES: usize = 1 << 20;
/// Guest RAM is laid out in whole 4 KiB pages.
const PAGE: u64 = 4096;
/// Bytes copied per read or write.
const CHUNK: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum MemorySnapshotError {
    #[error("memory: {count} RAM regions, more than the {MAX_RAM_REGIONS} a layout holds")]
    TooManyRegions { count: usize },
    #[error("memory: region {index} (gpa {gpa:#x}): {field}: {reason}")]
    BadRegion {
        index: usize,
        gpa: u64,
        field: &'static str,
        reason: String,
    },
    #[error("memory-ranges: the table lists {count} ranges, more than the {MAX_TABLE_RANGES} a restore reads")]
    TooManyRanges { count: usize },
    #[error("memory-ranges: range {index} (gpa {gpa:#x}, length {length:#x}): {reason}")]
    BadRange {
        index: usize,
        gpa: u64,
        length: u64,
        reason: String,
    },
    #[error(
        "memory-ranges: the file holds {file_len} bytes, but range {index} (gpa {gpa:#x}, \
         length {length:#x}) ends at byte {end} of it: the file is shorter than its table"
    )]
    ShortFile {
        index: usize,
        gpa: u64,
        length: u64,
        end: u64,
        file_len: u64,
    },
    #[error(
        "memory-ranges: the file holds {file_len} bytes, more than the {table_len} its table lists"
    )]
    LongFile { file_len: u64, table_len: u64 },
    #[error("memory-ranges: guest RAM at {gpa:#x} is not in this VM's memory")]
    NotInMemory { gpa: u64 },
    #[error("memory: region {index} (gpa {gpa:#x}): {reason}")]
    Mismatch {
        index: usize,
        gpa: u64,
        reason: String,
    },
    #[error("memory: creating guest RAM for the layout failed: {0}")]
    Create(String),
    #[error("memory-ranges: {what} at file offset {offset}: {source}")]
    Io {
        what: &'static str,
        offset: u64,
        source: io::Error,
    },
}

/// Whether a region was there at boot or added by `vm.resize`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RegionOrigin {
    Boot,
    Hotplug,
}

/// One RAM region: where the guest sees it, how long it is, and where it
/// lies in its memfd (None: private anonymous memory).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamRegionState {
    /// The KVM memory slot: a local migration's `MemoryFd` names it (as
    /// Cloud Hypervisor's `GuestRamMapping.slot` does).
    pub slot: u32,
    pub gpa: u64,
    pub length: u64,
    /// Offset of the region's first byte in its memfd: boot RAM's one
    /// memfd spans the 32-bit hole, so its second region starts past 0.
    pub file_offset: Option<u64>,
    pub origin: RegionOrigin,
}

impl RamRegionState {
    /// The state of `region`, registered with KVM as `slot`.
    pub fn of(region: &GuestRegionMmap, slot: u32, origin: RegionOrigin) -> Self {
        RamRegionState {
            slot,
            gpa: region.start_addr().0,
            length: region.len(),
            file_offset: region.file_offset().map(|f| f.start()),
            origin,
        }
    }

    fn end(&self) -> Option<u64> {
        self.gpa.checked_add(self.length)
    }
}

/// Guest RAM's section of the state document: every region, sorted by
/// guest address, and the table of what `memory-ranges` holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryLayoutState {
    pub regions: Vec<RamRegionState>,
    /// The ranges `memory-ranges` holds, back to back (empty for a local
    /// migration, where memory travels as fds).
    pub memory_ranges: Vec<MemoryRange>,
}

impl SectionState for MemoryLayoutState {
    const KIND: &'static str = "memory";
    const VERSION: u32 = 1;
}

impl MemoryLayoutState {
    /// A layout of `regions` (any order); checked as [`Self::validate`].
    pub fn new(mut regions: Vec<RamRegionState>) -> Result<Self, MemorySnapshotError> {
        regions.sort_by_key(|r| r.gpa);
        let layout = MemoryLayoutState {
            regions,
            memory_ranges: Vec::new(),
        };
        layout.validate()?;
        Ok(layout)
    }

    /// Boot RAM's layout as `create_guest_memory` builds it and
    /// `register_with_kvm` registers it (slot = the region's index).
    pub fn of_boot_memory(mem: &GuestMemoryMmap) -> Result<Self, MemorySnapshotError> {
        let mut regions = Vec::new();
        for (index, region) in mem.iter().enumerate() {
            let slot = u32::try_from(index)
                .map_err(|_| MemorySnapshotError::TooManyRegions { count: index })?;
            regions.push(RamRegionState::of(region, slot, RegionOrigin::Boot));
        }
        Self::new(regions)
    }

    /// Every region non-empty, page-aligned, not wrapping (in the guest or
    /// in its file), sorted and apart from the others, on a slot of its own.
    pub fn validate(&self) -> Result<(), MemorySnapshotError> {
        if self.regions.len() > MAX_RAM_REGIONS {
            return Err(MemorySnapshotError::TooManyRegions {
                count: self.regions.len(),
            });
        }
        let mut previous_end = 0;
        for (index, r) in self.regions.iter().enumerate() {
            let bad = |field, reason: String| MemorySnapshotError::BadRegion {
                index,
                gpa: r.gpa,
                field,
                reason,
            };
            if r.length == 0 || r.length % PAGE != 0 {
                return Err(bad(
                    "length",
                    format!("{:#x} is not a whole number of 4 KiB pages", r.length),
                ));
            }
            if r.gpa % PAGE != 0 {
                return Err(bad("gpa", "not 4 KiB aligned".to_string()));
            }
            let end = r.end().ok_or_else(|| {
                bad(
                    "length",
                    format!(
                        "{:#x} wraps past the top of the guest's address space",
                        r.length
                    ),
                )
            })?;
            if let Some(offset) = r.file_offset {
                if offset % PAGE != 0 || offset.checked_add(r.length).is_none() {
                    return Err(bad(
                        "file_offset",
                        format!("{offset:#x} is not 4 KiB aligned or wraps with the length"),
                    ));
                }
            }
            if index > 0 && r.gpa < previous_end {
                return Err(bad(
                    "gpa",
                    format!("overlaps the region before it (which ends at {previous_end:#x})"),
                ));
            }
            if self.regions[..index].iter().any(|o| o.slot == r.slot) {
                return Err(bad("slot", format!("{} is another region's", r.slot)));
            }
            previous_end = end;
        }
        Ok(())
    }

    /// The region holding all of `[gpa, gpa + length)`, if one does.
    fn region_holding(&self, gpa: u64, length: u64) -> Option<&RamRegionState> {
        let end = gpa.checked_add(length)?;
        self.regions
            .iter()
            .find(|r| r.gpa <= gpa && r.end().is_some_and(|e| end <= e))
    }
}

/// Guest RAM and the layout it was built to: what saves and restores the
/// memory section (the bytes go through [`write_memory_ranges`] and
/// [`read_memory_ranges`], or as fds in a local migration).
#[derive(Debug)]
pub struct GuestRam {
    pub mem: GuestMemoryMmap,
    pub layout: MemoryLayoutState,
}

impl Persist for GuestRam {
    type State = MemoryLayoutState;
    /// The VM's `--memory` configuration (shared, huge pages): the layout
    /// says where RAM lies, the configuration how it is backed.
    type RestoreArgs<'a> = &'a MemoryConfig;

    fn save(&mut self) -> Result<MemoryLayoutState, StateError> {
        self.layout.validate().map_err(invalid)?;
        Ok(self.layout.clone())
    }

    /// Fresh (zeroed) guest RAM laid out as `state` says: boot RAM as
    /// `create_guest_memory` makes it for the layout's boot size (refused
    /// unless its regions are the layout's), then each hot-plugged region.
    fn restore(cfg: &MemoryConfig, state: &MemoryLayoutState) -> Result<GuestRam, StateError> {
        restore_guest_memory(cfg, state).map_err(invalid)
    }
}

fn invalid(e: MemorySnapshotError) -> StateError {
    StateError::Invalid {
        section: MemoryLayoutState::KIND.to_string(),
        field: "regions".to_string(),
        reason: e.to_string(),
    }
}

/// [`GuestRam::restore`]'s work, with this module's error.
pub fn restore_guest_memory(
    cfg: &MemoryConfig,
    layout: &MemoryLayoutState,
) -> Result<GuestRam, MemorySnapshotError> {
    let RestoredRam { boot, hotplugged } = restore_guest_memory_parts(cfg, layout)?;
    Ok(GuestRam {
        mem: join_regions(boot, &hotplugged)?,
        layout: layout.clone(),
    })
}

/// Fresh guest RAM for a layout, in the two parts a VM is built from.
pub struct RestoredRam {
    /// Boot RAM, as `create_guest_memory` makes it.
    pub boot: GuestMemoryMmap,
    /// The hot-plugged regions, at their addresses, sorted.
    pub hotplugged: Vec<Arc<GuestRegionMmap>>,
}

/// `boot` with `hotplugged` added: one view of all of guest RAM (the same
/// mappings, not a copy).
pub fn join_regions(
    boot: GuestMemoryMmap,
    hotplugged: &[Arc<GuestRegionMmap>],
) -> Result<GuestMemoryMmap, MemorySnapshotError> {
    let mut mem = boot;
    for region in hotplugged {
        mem = mem
            .insert_region(region.clone())
            .map_err(|e| MemorySnapshotError::Create(e.to_string()))?;
    }
    Ok(mem)
}

/// Fresh (zeroed) guest RAM laid out as `layout` says, as boot RAM and
/// hot-plugged regions: refused unless boot RAM made for the layout's boot
/// size has the layout's boot regions.
pub fn restore_guest_memory_parts(
    cfg: &MemoryConfig,
    layout: &MemoryLayoutState,
) -> Result<RestoredRam, MemorySnapshotError> {
    layout.validate()?;
    let boot: Vec<&RamRegionState> = layout
        .regions
        .iter()
        .filter(|r| r.origin == RegionOrigin::Boot)
        .collect();
    // Validated: the regions do not overlap, so their sum does not wrap.
    let boot_size = boot.iter().map(|r| r.length).sum();
    let boot_cfg = MemoryConfig {
        size: boot_size,
        ..cfg.clone()
    };
    let mem =
        create_guest_memory(&boot_cfg).map_err(|e| MemorySnapshotError::Create(e.to_string()))?;
    let made: Vec<&GuestRegionMmap> = mem.iter().collect();
    if made.len() != boot.len() {
        return Err(MemorySnapshotError::Mismatch {
            index: 0,
            gpa: 0,
            reason: format!(
                "{boot_size} bytes of boot RAM make {} regions here, the layout has {}",
                made.len(),
                boot.len()
            ),
        });
    }
    for (index, (want, got)) in boot.iter().zip(made).enumerate() {
        let got = RamRegionState::of(got, want.slot, RegionOrigin::Boot);
        if got != **want {
            return Err(MemorySnapshotError::Mismatch {
                index,
                gpa: want.gpa,
                reason: format!("boot RAM is laid out here as {got:?}"),
            });
        }
    }
    let mut hotplugged = Vec::new();
    for (index, r) in layout.regions.iter().enumerate() {
        if r.origin != RegionOrigin::Hotplug {
            continue;
        }
        let region = create_hotplug_region(cfg, r.gpa, r.length)
            .map_err(|e| MemorySnapshotError::Create(e.to_string()))?;
        if region.file_offset().map(|f| f.start()) != r.file_offset {
            return Err(MemorySnapshotError::Mismatch {
                index,
                gpa: r.gpa,
                reason:
                    "backed here as private memory or a memfd, the other of what the layout says"
                        .to_string(),
            });
        }
        hotplugged.push(region);
    }
    Ok(RestoredRam {
        boot: mem,
        hotplugged,
    })
}

/// Faults every page of `mem` in now (`MADV_POPULATE_WRITE`, Linux 5.14),
/// a restore's `prefault`: the guest's first touches then take no page
/// faults. Err names the region the kernel refused (by guest address); a
/// kernel without the advice is logged and RAM left to fault in on use.
pub fn populate(mem: &GuestMemoryMmap) -> Result<(), MemorySnapshotError> {
    for region in mem.iter() {
        // SAFETY: the region is a live mapping of `len` bytes owned by
        // `mem`; MADV_POPULATE_WRITE only faults its pages in (writable,
        // contents unchanged).
        let r = unsafe {
            libc::madvise(
                region.as_ptr().cast(),
                narrow::usize_of(region.len()),
                libc::MADV_POPULATE_WRITE,
            )
        };
        if r != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINVAL) {
                // A kernel before 5.14: the guest faults its RAM in as it
                // touches it, as without prefault.
                tracing::warn!(
                    "prefault: this kernel lacks MADV_POPULATE_WRITE; RAM faults in on use"
                );
                return Ok(());
            }
            return Err(MemorySnapshotError::Io {
                what: "prefaulting guest RAM (MADV_POPULATE_WRITE)",
                offset: region.start_addr().0,
                source: e,
            });
        }
    }
    Ok(())
}

/// The next extent of data in `[from, end)` of `file`: Ok(None) past the
/// last one; Err when the file system cannot seek holes (hugetlbfs).
pub(crate) fn next_data_extent(file: &File, from: u64, end: u64) -> io::Result<Option<(u64, u64)>> {
    if from >= end {
        return Ok(None);
    }
    let seek = |offset: u64, whence| {
        let offset = libc::off_t::try_from(offset)
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        // SAFETY: lseek on an fd `file` owns; it moves only the file's
        // offset, which nothing here relies on (reads and writes are
        // positional, and a daemon given the memfd maps it).
        let r = unsafe { libc::lseek(file.as_raw_fd(), offset, whence) };
        u64::try_from(r).map_err(|_| io::Error::last_os_error())
    };
    let data = match seek(from, libc::SEEK_DATA) {
        Ok(data) => data,
        // No data at or after `from`.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Ok(None),
        Err(e) => return Err(e),
    };
    if data >= end {
        return Ok(None);
    }
    let hole = seek(data, libc::SEEK_HOLE)?.min(end);
    Ok(Some((data, hole - data)))
}

fn io_error(what: &'static str, offset: u64) -> impl FnOnce(io::Error) -> MemorySnapshotError {
    move |source| MemorySnapshotError::Io {
        what,
        offset,
        source,
    }
}

/// Copies `[from, from + len)` of `src` to `dst` at `to`, extent by extent
/// of data; Ok(false), nothing copied, when `src` cannot seek holes.
fn copy_data_extents(
    src: &File,
    from: u64,
    dst: &File,
    to: u64,
    len: u64,
    buf: &mut [u8],
) -> Result<bool, MemorySnapshotError> {
    let end = from.checked_add(len).ok_or(MemorySnapshotError::Io {
        what: "sizing a region",
        offset: from,
        source: io::Error::from(io::ErrorKind::InvalidInput),
    })?;
    let mut next = match next_data_extent(src, from, end) {
        Ok(next) => next,
        Err(_) => return Ok(false),
    };
    while let Some((data, extent)) = next {
        let mut done = 0;
        while done < extent {
            let n = narrow::usize_of((extent - done).min(buf.len() as u64));
            let at = data + done;
            let chunk = buf.get_mut(..n).unwrap_or_default();
            src.read_exact_at(chunk, at)
                .map_err(io_error("reading guest RAM's memfd", at))?;
            let out = to + (at - from);
            dst.write_all_at(chunk, out)
                .map_err(io_error("writing", out))?;
            done += n as u64;
        }
        next = next_data_extent(src, data + extent, end)
            .map_err(io_error("seeking data in guest RAM's memfd", data + extent))?;
    }
    Ok(true)
}

/// Writes `layout`'s regions of `mem` to `out` (an empty file) as
/// `memory-ranges`, and records the table in `layout.memory_ranges`.
pub fn write_memory_ranges(
    mem: &GuestMemoryMmap,
    layout: &mut MemoryLayoutState,
    out: &File,
) -> Result<(), MemorySnapshotError> {
    layout.validate()?;
    let table: Vec<MemoryRange> = layout
        .regions
        .iter()
        .map(|r| MemoryRange {
            gpa: r.gpa,
            length: r.length,
        })
        .collect();
    // Validated: each region ends below 2^64, and they do not overlap, so
    // their lengths sum below 2^64 too.
    let total: u64 = table.iter().map(|r| r.length).sum();
    // Emptied first: a byte left from an earlier file would read back as
    // guest memory where this one has a hole.
    out.set_len(0).map_err(io_error("emptying the file", 0))?;
    out.set_len(total)
        .map_err(io_error("sizing the file", total))?;
    let mut buf = vec![0u8; CHUNK];
    let mut cursor = 0u64;
    for range in &table {
        let region = mem
            .find_region(GuestAddress(range.gpa))
            .filter(|r| r.start_addr().0 == range.gpa && r.len() == range.length)
            .ok_or(MemorySnapshotError::NotInMemory { gpa: range.gpa })?;
        let sparse = match region.file_offset() {
            Some(fo) => {
                copy_data_extents(fo.file(), fo.start(), out, cursor, range.length, &mut buf)?
            }
            None => false,
        };
        if !sparse {
            write_nonzero_pages(mem, range, out, cursor, &mut buf)?;
        }
        cursor += range.length;
    }
    layout.memory_ranges = table;
    Ok(())
}

/// The dense path (private RAM, hugetlbfs): reads the range from guest
/// memory and writes every 4 KiB page that is not all zeroes.
fn write_nonzero_pages(
    mem: &GuestMemoryMmap,
    range: &MemoryRange,
    out: &File,
    at: u64,
    buf: &mut [u8],
) -> Result<(), MemorySnapshotError> {
    let mut done = 0;
    while done < range.length {
        let n = narrow::usize_of((range.length - done).min(buf.len() as u64));
        let chunk = buf.get_mut(..n).unwrap_or_default();
        mem.read_slice(chunk, GuestAddress(range.gpa + done))
            .map_err(|_| MemorySnapshotError::NotInMemory {
                gpa: range.gpa + done,
            })?;
        for (i, page) in chunk.chunks(narrow::usize_of(PAGE)).enumerate() {
            if page.iter().any(|&b| b != 0) {
                let offset = at + done + i as u64 * PAGE;
                out.write_all_at(page, offset)
                    .map_err(io_error("writing", offset))?;
            }
        }
        done += n as u64;
    }
    Ok(())
}

/// Checks `layout.memory_ranges` against the layout and `file`'s size,
/// then reads each range's data extents into `mem` (fresh guest memory:
/// the file's holes are left as the zeroes it already holds). Nothing is
/// written to `mem` unless every range checks.
pub fn read_memory_ranges(
    file: &File,
    layout: &MemoryLayoutState,
    mem: &GuestMemoryMmap,
) -> Result<(), MemorySnapshotError> {
    layout.validate()?;
    let table = &layout.memory_ranges;
    let file_len = file
        .metadata()
        .map_err(io_error("reading the file's size", 0))?
        .len();
    if table.len() > MAX_TABLE_RANGES {
        return Err(MemorySnapshotError::TooManyRanges { count: table.len() });
    }
    let mut cursor = 0u64;
    let mut previous_end = 0u64;
    for (index, range) in table.iter().enumerate() {
        let bad = |reason: &str| MemorySnapshotError::BadRange {
            index,
            gpa: range.gpa,
            length: range.length,
            reason: reason.to_string(),
        };
        if range.length == 0 {
            return Err(bad("empty"));
        }
        // Sorted and apart, as the writer lists them: a range over another
        // would restore one guest page from two places.
        if index > 0 && range.gpa < previous_end {
            return Err(bad("overlaps or precedes the range before it"));
        }
        if layout.region_holding(range.gpa, range.length).is_none() {
            return Err(bad("not inside one RAM region of the layout"));
        }
        if mem
            .get_slice(GuestAddress(range.gpa), narrow::usize_of(range.length))
            .is_err()
        {
            return Err(bad("not inside this VM's guest memory"));
        }
        let end = cursor
            .checked_add(range.length)
            .ok_or_else(|| bad("the ranges' lengths add up past 2^64"))?;
        if end > file_len {
            return Err(MemorySnapshotError::ShortFile {
                index,
                gpa: range.gpa,
                length: range.length,
                end,
                file_len,
            });
        }
        cursor = end;
        // region_holding checked that gpa + length does not wrap.
        previous_end = range.gpa.saturating_add(range.length);
    }
    if file_len > cursor {
        return Err(MemorySnapshotError::LongFile {
            file_len,
            table_len: cursor,
        });
    }
    let mut buf = vec![0u8; CHUNK];
    let mut cursor = 0u64;
    for range in table {
        let end = cursor + range.length;
        match next_data_extent(file, cursor, end) {
            Ok(mut next) => {
                while let Some((data, extent)) = next {
                    read_extent(file, data, extent, cursor, range, mem, &mut buf)?;
                    next = next_data_extent(file, data + extent, end)
                        .map_err(io_error("seeking data", data + extent))?;
                }
            }
            // No hole seeking on this file system: read the range whole.
            Err(_) => read_extent(file, cursor, range.length, cursor, range, mem, &mut buf)?,
        }
        cursor = end;
    }
    Ok(())
}

/// Reads `[data, data + extent)` of `file`, a part of `range` (which
/// starts at file offset `range_start`), into guest memory.
fn read_extent(
    file: &File,
    data: u64,
    extent: u64,
    range_start: u64,
    range: &MemoryRange,
    mem: &GuestMemoryMmap,
    buf: &mut [u8],
) -> Result<(), MemorySnapshotError> {
    let mut done = 0;
    while done < extent {
        let n = narrow::usize_of((extent - done).min(buf.len() as u64));
        let at = data + done;
        let chunk = buf.get_mut(..n).unwrap_or_default();
        file.read_exact_at(chunk, at)
            .map_err(io_error("reading", at))?;
        let gpa = range.gpa + (at - range_start);
        mem.write_slice(chunk, GuestAddress(gpa))
            .map_err(|_| MemorySnapshotError::NotInMemory { gpa })?;
        done += n as u64;
    }
    Ok(())
}

#[cfg(test)]
#[path = "snapshot_tests.rs"]
mod tests;
