//! Guest-physical address map.
//!
//! ```text
//! 0x0000_0500  GDT, then IDT             0x0000_7000  boot_params (zero page)
//! 0x0000_8ff0  boot stack (grows down)   0x0000_9000  PML4, PDPT, PD (identity map of 1 GiB)
//! 0x0002_0000  kernel command line       0x0009_fc00  EBDA start (end of low RAM)
//! 0x000e_0000  ACPI tables (RSDP first)  0x0010_0000  kernel (protected-mode part)
//! RAM up to 3 GiB, then the 32-bit device hole, then the rest of RAM from 4 GiB.
//! ```

use crate::config::MAX_PCI_SEGMENTS;

pub const GDT_START: u64 = 0x500;
pub const IDT_START: u64 = 0x520;
pub const ZERO_PAGE_START: u64 = 0x7000;
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
pub const PML4_START: u64 = 0x9000;
pub const PDPTE_START: u64 = 0xa000;
pub const PDE_START: u64 = 0xb000;
pub const CMDLINE_START: u64 = 0x2_0000;
pub const CMDLINE_MAX_SIZE: usize = 0x1_0000;
pub const EBDA_START: u64 = 0x9_fc00;
/// The RSDP must lie in 0xe0000..0xfffff where Linux scans for it.
pub const ACPI_START: u64 = 0xe_0000;
/// ACPI tables end where the reset stub begins.
pub const ACPI_END: u64 = RESET_VECTOR;
/// The x86 reset vector (F000:FFF0). A guest that reboots "through the
/// BIOS" (Linux's `reboot=b`, its fallback when nothing else worked) jumps
/// here in real mode; with no firmware the VMM places a stub that pulses the
/// i8042 reset line, so the reboot ends the VM instead of running off into
/// zeroed memory.
pub const RESET_VECTOR: u64 = 0xf_fff0;
/// `mov al, 0xfe; out 0x64, al; hlt; jmp short -7` (16-bit code).
pub const RESET_STUB: [u8; 7] = [0xb0, 0xfe, 0xe6, 0x64, 0xf4, 0xeb, 0xf9];
pub const HIGH_RAM_START: u64 = 0x10_0000;

/// Start and size of the hole below 4 GiB that holds no RAM: MMIO devices,
/// the IOAPIC, the local APICs and KVM's TSS pages live here.
pub const MEM_32BIT_GAP_START: u64 = 0xc000_0000;
pub const MEM_32BIT_GAP_SIZE: u64 = 0x4000_0000;
pub const RAM_64BIT_START: u64 = MEM_32BIT_GAP_START + MEM_32BIT_GAP_SIZE;

pub const IOAPIC_START: u64 = 0xfec0_0000;
/// 32-bit PCI memory window (BAR 0 of each virtio-PCI function).
pub const PCI_MMIO32_START: u64 = 0xc000_0000;
pub const PCI_MMIO32_SIZE: u64 = 0x1000_0000;
/// 64-bit PCI memory window: device memory above RAM, this many bytes
/// (shared memory BARs: DAX windows, pmem).
pub const PCI_MMIO64_SIZE: u64 = 1 << 39;
/// Device memory of virtio-MMIO devices, right after the 64-bit PCI window
/// so that no BAR the guest places can land on it.
pub const MMIO_DEVICE_MEMORY_SIZE: u64 = 1 << 39;
/// PCI Express enhanced configuration (ECAM) of bus 0 of each PCI segment:
/// 32 devices × 8 functions × 4 KiB, segment `n`'s at
/// `PCI_ECAM_START + n * PCI_ECAM_SIZE` ([`pci_ecam_start`]).
pub const PCI_ECAM_START: u64 = 0xe000_0000;
pub const PCI_ECAM_SIZE: u64 = 1 << 20;
/// Room for the ECAM ranges of as many segments as a VM may have; the e820
/// map reserves all of it (Linux uses an MCFG range only when it is).
pub const PCI_ECAM_AREA_SIZE: u64 = PCI_ECAM_SIZE * MAX_PCI_SEGMENTS as u64;

/// Where PCI segment `segment`'s ECAM range starts.
pub fn pci_ecam_start(segment: u16) -> u64 {
    PCI_ECAM_START + u64::from(segment) * PCI_ECAM_SIZE
}
/// virtio-MMIO register pages, one 4 KiB page per device, in the 32-bit hole.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
pub const VIRTIO_MMIO_MAX_DEVICES: u64 = 16;
/// IOAPIC pins of virtio-MMIO devices: 5, 6, … (4 is COM1).
pub const VIRTIO_MMIO_IRQ_BASE: u32 = 5;
/// Alignment of device memory (pmem ranges, shared memory regions) above RAM:
/// 2 MiB so the guest can map it with PMD pages.
pub const DEVICE_MEMORY_ALIGN: u64 = 2 << 20;

/// Alignment of the ACPI memory hot-plug area and of each region added to
/// it: Linux adds memory in sections of 128 MiB on x86-64.
pub const HOTPLUG_MEMORY_ALIGN: u64 = 128 << 20;

fn ram_end(ram_size: u64) -> u64 {
    ram_ranges(ram_size)
        .iter()
        .map(|&(a, s)| a + s)
        .max()
        .unwrap_or(0)
}

/// Where RAM added by ACPI memory hot-plug starts: above boot RAM and above
/// 4 GiB (as in Cloud Hypervisor, hot-plugged RAM never goes into the
/// 32-bit hole's neighbourhood), on a section boundary.
pub fn hotplug_memory_start(ram_size: u64) -> u64 {
    ram_end(ram_size)
        .max(1 << 32)
        .next_multiple_of(HOTPLUG_MEMORY_ALIGN)
}

/// First guest-physical address above RAM, above 4 GiB and above the
/// memory hot-plug area (`hotplug_size` bytes, none when 0) for device
/// memory.
pub fn device_memory_start(ram_size: u64, hotplug_size: u64) -> u64 {
    let end = if hotplug_size == 0 {
        ram_end(ram_size).max(1 << 32)
    } else {
        hotplug_memory_start(ram_size) + hotplug_size.next_multiple_of(HOTPLUG_MEMORY_ALIGN)
    };
    end.next_multiple_of(DEVICE_MEMORY_ALIGN)
}
pub const APIC_START: u64 = 0xfee0_0000;
/// KVM needs three pages for the TSS on Intel hosts; placed at the top of the hole.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;

/// Guest RAM ranges for `size` bytes: below the 32-bit hole first, the rest above 4 GiB.
pub fn ram_ranges(size: u64) -> Vec<(u64, u64)> {
    if size <= MEM_32BIT_GAP_START {
        vec![(0, size)]
    } else {
        vec![
            (0, MEM_32BIT_GAP_START),
            (RAM_64BIT_START, size - MEM_32BIT_GAP_START),
        ]
    }
}

// The fixed layout must not overlap; checked when the crate compiles.
const _: () = {
    assert!(GDT_START + 4 * 8 <= IDT_START);
    assert!(IDT_START + 8 <= ZERO_PAGE_START);
    assert!(ZERO_PAGE_START + 4096 <= BOOT_STACK_POINTER);
    assert!(BOOT_STACK_POINTER < PML4_START);
    assert!(PDE_START + 4096 <= CMDLINE_START);
    assert!(CMDLINE_START + CMDLINE_MAX_SIZE as u64 <= EBDA_START);
    assert!(ACPI_END <= HIGH_RAM_START);
    assert!(PCI_MMIO32_START + PCI_MMIO32_SIZE <= VIRTIO_MMIO_START);
    assert!(VIRTIO_MMIO_START + VIRTIO_MMIO_MAX_DEVICES * 0x1000 <= PCI_ECAM_START);
    assert!(PCI_ECAM_START + PCI_ECAM_AREA_SIZE <= IOAPIC_START);
    assert!(
        VIRTIO_MMIO_IRQ_BASE + narrow::u32_of(VIRTIO_MMIO_MAX_DEVICES) <= 24,
        "the IOAPIC has 24 pins"
    );
    assert!(RESET_VECTOR + RESET_STUB.len() as u64 <= HIGH_RAM_START);
    // The jmp's displacement lands on the first byte of the stub: it is
    // minus the stub's length, as an i8.
    assert!(0u8.wrapping_sub(RESET_STUB[6]) as usize == RESET_STUB.len());
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ram_splits_around_the_hole() {
        assert_eq!(ram_ranges(512 << 20), vec![(0, 512 << 20)]);
        assert_eq!(ram_ranges(3 << 30), vec![(0, 3 << 30)]);
        assert_eq!(ram_ranges(4 << 30), vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
    }

    #[test]
    fn device_memory_starts_above_ram_and_4g() {
        assert_eq!(device_memory_start(512 << 20, 0), 1 << 32);
        assert_eq!(device_memory_start(4 << 30, 0), (5 << 30));
    }

    #[test]
    fn the_hotplug_area_lies_between_ram_and_device_memory() {
        // Below the hole: from 4 GiB, as Cloud Hypervisor places it.
        assert_eq!(hotplug_memory_start(512 << 20), 1 << 32);
        assert_eq!(device_memory_start(512 << 20, 1 << 30), 5 << 30);
        // Above it: from the end of RAM, rounded up to a section.
        let ram = (4 << 30) + (1 << 20);
        assert_eq!(hotplug_memory_start(ram), (5 << 30) + (128 << 20));
        // A size that is not a whole section still leaves whole sections.
        assert_eq!(
            device_memory_start(512 << 20, (128 << 20) + 4096),
            (4 << 30) + (256 << 20)
        );
    }
}
