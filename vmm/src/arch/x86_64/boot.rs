//! Linux direct boot of a bzImage: kernel, initramfs, command line and the
//! zero page (`boot_params`) with its e820 map, per the x86 boot protocol.

use std::fs::File;
use std::path::Path;

use linux_loader::bootparam::{boot_e820_entry, boot_params};
use linux_loader::cmdline::Cmdline;
use linux_loader::loader::{bzimage::BzImage, load_cmdline, KernelLoader};
use vm_memory::{Address, Bytes, GuestAddress, GuestMemoryBackend};

use super::layout::*;
use crate::memory::GuestMemoryMmap;

pub const E820_RAM: u32 = 1;
pub const E820_RESERVED: u32 = 2;

const KERNEL_BOOT_FLAG_MAGIC: u16 = 0xaa55;
const KERNEL_HDR_MAGIC: u32 = 0x5372_6448; // "HdrS"
const KERNEL_LOADER_OTHER: u8 = 0xff;
/// Offset of the 64-bit entry point from the start of the protected-mode kernel.
const BZIMAGE_64BIT_ENTRY_OFFSET: u64 = 0x200;
/// Boot protocol 2.12 (Linux 3.8) is the first with a 64-bit entry point.
const MIN_BOOT_PROTOCOL: u16 = 0x020c;

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("--kernel {path}: {source}")]
    OpenKernel {
        path: String,
        source: std::io::Error,
    },
    #[error("--kernel {path}: not a bzImage this VMM can boot ({source})")]
    LoadKernel {
        path: String,
        source: linux_loader::loader::Error,
    },
    #[error(
        "--kernel {path}: boot protocol {version:#06x} is older than 2.12 and has no 64-bit entry"
    )]
    OldKernel { path: String, version: u16 },
    #[error("--initramfs {path}: {source}")]
    OpenInitramfs {
        path: String,
        source: std::io::Error,
    },
    #[error("--initramfs {path}: {size} bytes do not fit in guest RAM below {limit:#x} after the kernel")]
    InitramfsTooLarge { path: String, size: u64, limit: u64 },
    #[error("--initramfs {path}: copying into guest memory failed: {source}")]
    WriteInitramfs {
        path: String,
        source: vm_memory::GuestMemoryError,
    },
    #[error("--cmdline: {0}")]
    Cmdline(String),
    #[error("writing {what} into guest memory failed: {source}")]
    GuestWrite {
        what: &'static str,
        source: vm_memory::GuestMemoryError,
    },
}

/// Where the kernel landed and where the vCPU must start.
pub struct LoadedKernel {
    pub entry: GuestAddress,
    pub header: linux_loader::bootparam::setup_header,
    pub kernel_end: u64,
}

pub fn load_kernel(mem: &GuestMemoryMmap, path: &Path) -> Result<LoadedKernel, BootError> {
    let display = path.display().to_string();
    let mut file = File::open(path).map_err(|source| BootError::OpenKernel {
        path: display.clone(),
        source,
    })?;
    let loaded = BzImage::load(mem, None, &mut file, Some(GuestAddress(HIGH_RAM_START))).map_err(
        |source| BootError::LoadKernel {
            path: display.clone(),
            source,
        },
    )?;
    let header = loaded.setup_header.ok_or_else(|| BootError::LoadKernel {
        path: display.clone(),
        source: linux_loader::loader::Error::Bzimage(
            linux_loader::loader::bzimage::Error::InvalidBzImage,
        ),
    })?;
    if header.version < MIN_BOOT_PROTOCOL {
        return Err(BootError::OldKernel {
            path: display,
            version: header.version,
        });
    }
    Ok(LoadedKernel {
        entry: loaded.kernel_load.unchecked_add(BZIMAGE_64BIT_ENTRY_OFFSET),
        header,
        kernel_end: loaded.kernel_end,
    })
}

/// Copies the initramfs to the top of RAM below the kernel's `initrd_addr_max`,
/// page aligned, as boot loaders do. Returns (address, size).
pub fn load_initramfs(
    mem: &GuestMemoryMmap,
    path: &Path,
    kernel: &LoadedKernel,
) -> Result<(u64, u64), BootError> {
    let display = path.display().to_string();
    let mut file = File::open(path).map_err(|source| BootError::OpenInitramfs {
        path: display.clone(),
        source,
    })?;
    let size = file
        .metadata()
        .map_err(|source| BootError::OpenInitramfs {
            path: display.clone(),
            source,
        })?
        .len();
    let low_ram_end = mem.last_addr().raw_value().min(MEM_32BIT_GAP_START - 1) + 1;
    let limit = low_ram_end.min(u64::from(kernel.header.initrd_addr_max) + 1);
    let addr = limit
        .checked_sub(size)
        .map(|a| a & !0xfff)
        .filter(|a| *a >= kernel.kernel_end)
        .ok_or(BootError::InitramfsTooLarge {
            path: display.clone(),
            size,
            limit,
        })?;
    let len = usize::try_from(size).map_err(|_| BootError::InitramfsTooLarge {
        path: display.clone(),
        size,
        limit,
    })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, len)
        .map_err(|source| BootError::WriteInitramfs {
            path: display,
            source,
        })?;
    Ok((addr, size))
}

pub fn load_command_line(mem: &GuestMemoryMmap, cmdline: &str) -> Result<u32, BootError> {
    let mut c = Cmdline::new(CMDLINE_MAX_SIZE).map_err(|e| BootError::Cmdline(e.to_string()))?;
    c.insert_str(cmdline)
        .map_err(|e| BootError::Cmdline(format!("{e} (at most {} bytes)", CMDLINE_MAX_SIZE - 1)))?;
    load_cmdline(mem, GuestAddress(CMDLINE_START), &c)
        .map_err(|e| BootError::Cmdline(e.to_string()))?;
    u32::try_from(cmdline.len()).map_err(|_| {
        BootError::Cmdline(format!(
            "{} bytes (at most {} bytes)",
            cmdline.len(),
            CMDLINE_MAX_SIZE - 1
        ))
    })
}

/// The e820 map for the given RAM ranges: low RAM up to the EBDA, the rest
/// from 1 MiB, and RAM above 4 GiB. The legacy 640K-1M area holds the ACPI
/// tables and stays out of the map, as on real machines.
pub fn e820_map(ram: &[(u64, u64)]) -> Vec<(u64, u64, u32)> {
    let mut map = vec![(0, EBDA_START, E820_RAM)];
    for &(start, size) in ram {
        let end = start + size;
        let start = start.max(HIGH_RAM_START);
        if end > start {
            map.push((start, end - start, E820_RAM));
        }
    }
    // Linux uses ECAM only where firmware reserved it.
    map.push((PCI_ECAM_START, PCI_ECAM_AREA_SIZE, E820_RESERVED));
    map.sort_by_key(|e| e.0);
    map
}

/// Fills the zero page and writes it at `ZERO_PAGE_START`.
pub fn write_boot_params(
    mem: &GuestMemoryMmap,
    kernel: &LoadedKernel,
    cmdline_size: u32,
    initramfs: Option<(u64, u64)>,
    e820: &[(u64, u64, u32)],
    rsdp_addr: u64,
) -> Result<(), BootError> {
    let params = build_boot_params(kernel, cmdline_size, initramfs, e820, rsdp_addr);
    mem.write_obj(params, GuestAddress(ZERO_PAGE_START))
        .map_err(|source| BootError::GuestWrite {
            what: "boot_params",
            source,
        })
}

pub fn build_boot_params(
    kernel: &LoadedKernel,
    cmdline_size: u32,
    initramfs: Option<(u64, u64)>,
    e820: &[(u64, u64, u32)],
    rsdp_addr: u64,
) -> boot_params {
    let mut params = boot_params {
        hdr: kernel.header,
        ..Default::default()
    };
    params.hdr.type_of_loader = KERNEL_LOADER_OTHER;
    params.hdr.boot_flag = KERNEL_BOOT_FLAG_MAGIC;
    params.hdr.header = KERNEL_HDR_MAGIC;
    params.hdr.cmd_line_ptr = const { narrow::u32_of(CMDLINE_START) };
    params.hdr.cmdline_size = cmdline_size + 1;
    if let Some((addr, size)) = initramfs {
        #[expect(
            clippy::cast_possible_truncation,
            reason = "load_initramfs places it below initrd_addr_max, a 32-bit address, so its address and size fit"
        )]
        let (image, size) = (addr as u32, size as u32);
        params.hdr.ramdisk_image = image;
        params.hdr.ramdisk_size = size;
    }
    params.acpi_rsdp_addr = rsdp_addr;
    for (i, &(addr, size, type_)) in e820.iter().take(params.e820_table.len()).enumerate() {
        params.e820_table[i] = boot_e820_entry {
            addr,
            size,
            r#type: type_,
        };
    }
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the zero page's table has 128 entries, so the count fits in its byte"
    )]
    let entries = e820.len().min(params.e820_table.len()) as u8;
    params.e820_entries = entries;
    params
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::layout::ram_ranges;

    #[test]
    fn e820_small_guest() {
        let map = e820_map(&ram_ranges(512 << 20));
        assert_eq!(
            map,
            vec![
                (0, EBDA_START, E820_RAM),
                (HIGH_RAM_START, (512 << 20) - HIGH_RAM_START, E820_RAM),
                (PCI_ECAM_START, PCI_ECAM_AREA_SIZE, E820_RESERVED)
            ]
        );
    }

    #[test]
    fn e820_large_guest_skips_the_hole() {
        let map = e820_map(&ram_ranges(6 << 30));
        assert_eq!(map.len(), 4);
        assert_eq!(
            map[1],
            (
                HIGH_RAM_START,
                MEM_32BIT_GAP_START - HIGH_RAM_START,
                E820_RAM
            )
        );
        assert_eq!(map[2], (PCI_ECAM_START, PCI_ECAM_AREA_SIZE, E820_RESERVED));
        assert_eq!(map[3], (RAM_64BIT_START, 3 << 30, E820_RAM));
        let total: u64 = map.iter().filter(|e| e.2 == E820_RAM).map(|e| e.1).sum();
        assert!(total < 6 << 30 && total > (6 << 30) - (1 << 20));
    }

    #[test]
    fn boot_params_layout() {
        let header = linux_loader::bootparam::setup_header {
            version: 0x020f,
            initrd_addr_max: 0x7fff_ffff,
            ..Default::default()
        };
        let k = LoadedKernel {
            entry: GuestAddress(0x100200),
            header,
            kernel_end: 0x200_0000,
        };
        let e820 = e820_map(&ram_ranges(512 << 20));
        let p = build_boot_params(&k, 11, Some((0x1000_0000, 0x1234)), &e820, ACPI_START);
        // Field offsets are fixed by Documentation/arch/x86/zero-page.rst.
        let bytes = vm_memory::ByteValued::as_slice(&p);
        assert_eq!(bytes.len(), 4096);
        assert_eq!(&bytes[0x070..0x078], &ACPI_START.to_le_bytes());
        assert_eq!(
            bytes[0x1e8], 3,
            "e820_entries (two RAM, the ECAM reservation)"
        );
        assert_eq!(&bytes[0x1fe..0x200], &0xaa55u16.to_le_bytes());
        assert_eq!(&bytes[0x202..0x206], b"HdrS");
        assert_eq!(bytes[0x210], 0xff, "type_of_loader");
        assert_eq!(
            &bytes[0x218..0x21c],
            &0x1000_0000u32.to_le_bytes(),
            "ramdisk_image"
        );
        assert_eq!(
            &bytes[0x21c..0x220],
            &0x1234u32.to_le_bytes(),
            "ramdisk_size"
        );
        assert_eq!(
            &bytes[0x228..0x22c],
            &narrow::u32_of(CMDLINE_START).to_le_bytes(),
            "cmd_line_ptr"
        );
        assert_eq!(&bytes[0x238..0x23c], &12u32.to_le_bytes(), "cmdline_size");
        // First e820 entry at 0x2d0: addr, size, type (20 bytes, packed).
        assert_eq!(&bytes[0x2d0..0x2d8], &0u64.to_le_bytes());
        assert_eq!(&bytes[0x2d8..0x2e0], &EBDA_START.to_le_bytes());
        assert_eq!(&bytes[0x2e0..0x2e4], &E820_RAM.to_le_bytes());
        assert_eq!(&bytes[0x2e4..0x2ec], &HIGH_RAM_START.to_le_bytes());
    }
}
