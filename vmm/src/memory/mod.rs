//! Guest memory and everything that changes it: boot RAM, as anonymous
//! private memory or a memfd mapped `MAP_SHARED` (`shared=on`) that a
//! vhost-user backend can map from the fd we send it (here); RAM added while
//! the guest runs ([`hotplug`]) and the ACPI memory hot-plug controller the
//! guest sees ([`hotplug_controller`]); DAX ranges mapped into the guest's
//! view before it touches them ([`prefault`]); its part of a snapshot
//! ([`snapshot`]) and of a local migration ([`migration_fds`]); the pages
//! written while a live migration copies it ([`dirty_log`]).

pub mod dirty_log;
pub mod hotplug;
pub mod hotplug_controller;
pub mod migration_fds;
pub mod prefault;
pub mod snapshot;

use std::fs::File;
use std::os::fd::FromRawFd;
use std::sync::Arc;

use kvm_ioctls::VmFd;
use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::arch::x86_64::layout::ram_ranges;
use crate::config::MemoryConfig;

pub use virtio_devices::{GuestMemoryMmap, GuestRegionMmap};

#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    #[error("--memory: creating the memfd for shared/huge-page RAM failed: {0}")]
    Memfd(std::io::Error),
    #[error("--memory: sizing the RAM memfd to {size} bytes failed: {source}")]
    Truncate { size: u64, source: std::io::Error },
    #[error("--memory: mapping {size} bytes of guest RAM failed: {source}")]
    Map {
        size: u64,
        source: vm_memory::mmap::FromRangesError,
    },
    #[error("--memory: {size} bytes of guest RAM do not fit in this host's address space")]
    TooLarge { size: u64 },
    #[error("guest RAM has more regions ({count}) than KVM has slot numbers")]
    TooManyRegions { count: usize },
    #[error("registering guest RAM slot {slot} with KVM failed: {source}")]
    Register {
        slot: u32,
        source: kvm_ioctls::Error,
    },
}

/// `size` bytes of RAM as the length of a mapping in this process.
fn host_len(size: u64) -> Result<usize, MemoryError> {
    usize::try_from(size).map_err(|_| MemoryError::TooLarge { size })
}

fn memfd(hugepages: bool) -> std::io::Result<File> {
    let mut flags = libc::MFD_CLOEXEC;
    if hugepages {
        flags |= libc::MFD_HUGETLB;
    }
    // SAFETY: the name is a NUL-terminated literal and the flags are valid;
    // the returned fd is checked before use.
    let fd = unsafe { libc::memfd_create(c"guest-ram".as_ptr(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` was just created and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

pub fn create_guest_memory(cfg: &MemoryConfig) -> Result<GuestMemoryMmap, MemoryError> {
    let ranges = ram_ranges(cfg.size);
    let map_err = |source| MemoryError::Map {
        size: cfg.size,
        source,
    };
    if !cfg.shared && !cfg.hugepages {
        let r = ranges
            .iter()
            .map(|&(a, s)| Ok((GuestAddress(a), host_len(s)?)))
            .collect::<Result<Vec<_>, MemoryError>>()?;
        let mem = GuestMemoryMmap::from_ranges(&r).map_err(map_err)?;
        exclude_from_core_dumps(&mem);
        return Ok(mem);
    }
    let file = memfd(cfg.hugepages).map_err(MemoryError::Memfd)?;
    file.set_len(cfg.size)
        .map_err(|source| MemoryError::Truncate {
            size: cfg.size,
            source,
        })?;
    let mut offset = 0;
    let mut regions = Vec::new();
    for (addr, size) in ranges {
        let f = file.try_clone().map_err(MemoryError::Memfd)?;
        regions.push((
            GuestAddress(addr),
            host_len(size)?,
            Some(FileOffset::new(f, offset)),
        ));
        offset += size;
    }
    let mem = GuestMemoryMmap::from_ranges_with_files(&regions).map_err(map_err)?;
    exclude_from_core_dumps(&mem);
    Ok(mem)
}

/// RAM added while the guest runs (ACPI memory hot-plug): `size` bytes
/// seen at `addr`, backed as boot RAM is (a memfd of its own when RAM is
/// shared or on huge pages, so a vhost-user daemon can map it too).
pub fn create_hotplug_region(
    cfg: &MemoryConfig,
    addr: u64,
    size: u64,
) -> Result<Arc<GuestRegionMmap>, MemoryError> {
    let file = if cfg.shared || cfg.hugepages {
        let file = memfd(cfg.hugepages).map_err(MemoryError::Memfd)?;
        file.set_len(size)
            .map_err(|source| MemoryError::Truncate { size, source })?;
        Some(FileOffset::new(file, 0))
    } else {
        None
    };
    let region = GuestRegionMmap::from_range(GuestAddress(addr), host_len(size)?, file)
        .map_err(|source| MemoryError::Map { size, source })?;
    exclude_region_from_core_dumps(&region);
    Ok(Arc::new(region))
}

/// Keeps guest RAM out of the VMM's core dumps (`MADV_DONTDUMP`, as
/// Firecracker does): a crash of the VMM must not write the guest's memory
/// to wherever the host's `core_pattern` points. Best effort: a failure is
/// logged and the VM still runs.
fn exclude_from_core_dumps(mem: &GuestMemoryMmap) {
    for region in mem.iter() {
        exclude_region_from_core_dumps(region);
    }
}

fn exclude_region_from_core_dumps(region: &GuestRegionMmap) {
    // SAFETY: the region is a live mapping of `len` bytes owned by the
    // caller; MADV_DONTDUMP changes only whether it is dumped.
    let r = unsafe {
        libc::madvise(
            region.as_ptr().cast(),
            // A region's length is a mapping's, so it fits in usize.
            narrow::usize_of(region.len()),
            libc::MADV_DONTDUMP,
        )
    };
    if r != 0 {
        tracing::warn!(
            "excluding guest RAM at {:#x} from core dumps: {}",
            region.start_addr().0,
            std::io::Error::last_os_error()
        );
    }
}

pub fn register_with_kvm(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), MemoryError> {
    for s in dirty_log::boot_slots(mem)? {
        // SAFETY: the region is a live mapping of `size` bytes owned by
        // `mem`, which outlives the VM (both live until the process exits).
        unsafe { s.set(vm, 0) }.map_err(|source| MemoryError::Register {
            slot: s.slot,
            source,
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn shared_memory_is_one_memfd_across_the_hole() {
        let cfg = MemoryConfig {
            size: 64 << 20,
            shared: true,
            hugepages: false,
            hotplug_size: None,
        };
        let mem = create_guest_memory(&cfg).unwrap();
        assert_eq!(mem.num_regions(), 1);
        let region = mem.iter().next().unwrap();
        assert!(
            region.file_offset().is_some(),
            "shared RAM has an fd to hand to a backend"
        );
        mem.write_obj(0xdead_beefu32, GuestAddress(0x1000)).unwrap();
        assert_eq!(
            mem.read_obj::<u32>(GuestAddress(0x1000)).unwrap(),
            0xdead_beef
        );
    }

    /// VmFlags of the mapping that holds `addr`, from /proc/self/smaps.
    fn vm_flags_at(addr: u64) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((s, e)) = range.split_once('-') {
                    if let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16))
                    {
                        inside = (s..e).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.to_string();
                }
            }
        }
        panic!("no mapping at {addr:#x}");
    }

    /// A core dump of the VMM would hold guest memory.
    #[test]
    fn guest_ram_is_left_out_of_core_dumps() {
        for shared in [false, true] {
            let mem = create_guest_memory(&MemoryConfig {
                size: 32 << 20,
                shared,
                hugepages: false,
                hotplug_size: None,
            })
            .unwrap();
            for region in mem.iter() {
                let flags = vm_flags_at(region.as_ptr() as u64);
                assert!(
                    flags.split_whitespace().any(|f| f == "dd"),
                    "shared={shared}: {flags}"
                );
            }
        }
    }

    #[test]
    fn hotplugged_ram_is_backed_like_boot_ram() {
        for (shared, fd) in [(false, false), (true, true)] {
            let cfg = MemoryConfig {
                shared,
                ..Default::default()
            };
            let region = create_hotplug_region(&cfg, 1 << 32, 128 << 20).unwrap();
            assert_eq!(region.start_addr(), GuestAddress(1 << 32));
            assert_eq!(region.len(), 128 << 20);
            assert_eq!(region.file_offset().is_some(), fd, "shared={shared}");
            let flags = vm_flags_at(region.as_ptr() as u64);
            assert!(flags.split_whitespace().any(|f| f == "dd"), "{flags}");
            let mem = create_guest_memory(&cfg).unwrap();
            let mem = mem.insert_region(region).unwrap();
            mem.write_obj(7u64, GuestAddress((1 << 32) + 4096)).unwrap();
            assert_eq!(
                mem.read_obj::<u64>(GuestAddress((1 << 32) + 4096)).unwrap(),
                7
            );
        }
    }

    #[test]
    fn private_memory_has_no_fd() {
        let mem = create_guest_memory(&MemoryConfig {
            size: 32 << 20,
            ..Default::default()
        })
        .unwrap();
        assert!(mem.iter().next().unwrap().file_offset().is_none());
    }
}
