//! Initial vCPU state for the bzImage 64-bit entry: long mode with an
//! identity map of the first GiB, flat segments, boot MSRs, FPU and LAPIC.

use kvm_bindings::{
    kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs, Msrs,
};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};

use super::layout::*;
use crate::memory::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    #[error("{what}: {source}")]
    Kvm {
        what: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM accepted only {set} of {wanted} boot MSRs")]
    Msrs { set: usize, wanted: usize },
    #[error("writing {what} into guest memory failed: {source}")]
    GuestWrite {
        what: &'static str,
        source: vm_memory::GuestMemoryError,
    },
}

const X86_CR0_PE: u64 = 1 << 0;
const X86_CR0_NW: u64 = 1 << 29;
const X86_CR0_CD: u64 = 1 << 30;
const X86_CR0_PG: u64 = 1 << 31;
const X86_CR4_PAE: u64 = 1 << 5;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;

/// GDT: null, 64-bit code, data, TSS. Flags follow the descriptor layout
/// (type, S, DPL, P in the low byte; AVL, L, D/B, G in the high nibble).
const GDT: [(u16, u32, u32); 4] = [
    (0, 0, 0),
    (0xa09b, 0, 0xfffff),
    (0xc093, 0, 0xfffff),
    (0x808b, 0, 0xfffff),
];
const CODE_SELECTOR: u16 = 1;
const DATA_SELECTOR: u16 = 2;
const TSS_SELECTOR: u16 = 3;

pub fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    let (flags, base, limit) = (u64::from(flags), u64::from(base), u64::from(limit));
    ((base & 0xff00_0000) << 32)
        | ((flags & 0xf0ff) << 40)
        | ((limit & 0x000f_0000) << 32)
        | ((base & 0x00ff_ffff) << 16)
        | (limit & 0xffff)
}

/// Decodes a GDT entry into the segment KVM wants, with the limit scaled by G.
pub fn segment_from_gdt(entry: u64, index: u16) -> kvm_segment {
    let g = ((entry >> 55) & 1) as u8;
    let raw_limit = narrow::low_u32((entry & 0xffff) | ((entry >> 32) & 0xf_0000));
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: if g == 1 {
            (raw_limit << 12) | 0xfff
        } else {
            raw_limit
        },
        selector: index * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g,
        avl: ((entry >> 52) & 1) as u8,
        unusable: if (entry >> 47) & 1 == 1 { 0 } else { 1 },
        padding: 0,
    }
}

/// Writes the GDT, an empty IDT and the page tables mapping 0..1 GiB with 2 MiB pages.
pub fn write_boot_structures(mem: &GuestMemoryMmap) -> Result<(), RegsError> {
    let write = |what, addr: u64, v: u64| {
        mem.write_obj(v, GuestAddress(addr))
            .map_err(|source| RegsError::GuestWrite { what, source })
    };
    for (i, &(flags, base, limit)) in GDT.iter().enumerate() {
        write(
            "GDT",
            GDT_START + 8 * i as u64,
            gdt_entry(flags, base, limit),
        )?;
    }
    write("IDT", IDT_START, 0)?;
    write("PML4", PML4_START, PDPTE_START | 0x3)?;
    write("PDPT", PDPTE_START, PDE_START | 0x3)?;
    for i in 0..512u64 {
        // Present, writable, 2 MiB page.
        write("PD", PDE_START + i * 8, (i << 21) | 0x83)?;
    }
    Ok(())
}

/// Long-mode system registers for the boot vCPU.
pub fn setup_sregs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut sregs: kvm_sregs = vcpu.get_sregs().map_err(|source| RegsError::Kvm {
        what: "KVM_GET_SREGS",
        source,
    })?;
    let gdt: Vec<u64> = GDT.iter().map(|&(f, b, l)| gdt_entry(f, b, l)).collect();
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = const { narrow::u16_of(GDT.len() as u64 * 8 - 1) };
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;
    sregs.cs = segment_from_gdt(gdt[usize::from(CODE_SELECTOR)], CODE_SELECTOR);
    let data = segment_from_gdt(gdt[usize::from(DATA_SELECTOR)], DATA_SELECTOR);
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    sregs.tr = segment_from_gdt(gdt[usize::from(TSS_SELECTOR)], TSS_SELECTOR);
    sregs.cr3 = PML4_START;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 = (sregs.cr0 | X86_CR0_PE | X86_CR0_PG) & !(X86_CR0_CD | X86_CR0_NW);
    sregs.efer |= EFER_LME | EFER_LMA;
    vcpu.set_sregs(&sregs).map_err(|source| RegsError::Kvm {
        what: "KVM_SET_SREGS",
        source,
    })
}

/// General registers at the bzImage 64-bit entry: `rsi` points at boot_params.
pub fn setup_regs(vcpu: &VcpuFd, entry: u64) -> Result<(), RegsError> {
    let regs = kvm_regs {
        rflags: 0x2,
        rip: entry,
        rsp: BOOT_STACK_POINTER,
        rbp: BOOT_STACK_POINTER,
        rsi: ZERO_PAGE_START,
        ..Default::default()
    };
    vcpu.set_regs(&regs).map_err(|source| RegsError::Kvm {
        what: "KVM_SET_REGS",
        source,
    })
}

pub fn setup_fpu(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let fpu = kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    };
    vcpu.set_fpu(&fpu).map_err(|source| RegsError::Kvm {
        what: "KVM_SET_FPU",
        source,
    })
}

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

/// Boot MSRs. MTRRs enabled with write-back default type: without it the
/// guest treats all RAM as uncached and runs orders of magnitude slower.
pub fn boot_msrs() -> Vec<(u32, u64)> {
    vec![
        (MSR_IA32_SYSENTER_CS, 0),
        (MSR_IA32_SYSENTER_ESP, 0),
        (MSR_IA32_SYSENTER_EIP, 0),
        (MSR_STAR, 0),
        (MSR_CSTAR, 0),
        (MSR_KERNEL_GS_BASE, 0),
        (MSR_SYSCALL_MASK, 0),
        (MSR_LSTAR, 0),
        (MSR_IA32_TSC, 0),
        (MSR_IA32_MISC_ENABLE, 1), // fast strings
        (MSR_MTRR_DEF_TYPE, (1 << 11) | 6),
    ]
}

pub fn setup_msrs(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let entries: Vec<kvm_msr_entry> = boot_msrs()
        .into_iter()
        .map(|(index, data)| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        })
        .collect();
    let msrs = Msrs::from_entries(&entries).expect("boot MSR list is far below the FAM limit");
    let set = vcpu.set_msrs(&msrs).map_err(|source| RegsError::Kvm {
        what: "KVM_SET_MSRS",
        source,
    })?;
    if set != entries.len() {
        return Err(RegsError::Msrs {
            set,
            wanted: entries.len(),
        });
    }
    Ok(())
}

const APIC_LVT0: usize = 0x350;
const APIC_LVT1: usize = 0x360;
const APIC_MODE_NMI: u32 = 0x4;
const APIC_MODE_EXTINT: u32 = 0x7;

fn set_delivery_mode(lapic: &mut kvm_lapic_state, reg: usize, mode: u32) {
    // The registers are C chars (i8): the bytes are reinterpreted, not converted.
    let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[reg + i].cast_unsigned());
    let value = (u32::from_le_bytes(bytes) & !0x700) | (mode << 8);
    for (i, b) in value.to_le_bytes().iter().enumerate() {
        lapic.regs[reg + i] = b.cast_signed();
    }
}

/// LINT0 delivers the 8259's ExtINT and LINT1 NMIs, as a BIOS leaves them.
pub fn setup_lint(vcpu: &VcpuFd) -> Result<(), RegsError> {
    let mut lapic = vcpu.get_lapic().map_err(|source| RegsError::Kvm {
        what: "KVM_GET_LAPIC",
        source,
    })?;
    set_delivery_mode(&mut lapic, APIC_LVT0, APIC_MODE_EXTINT);
    set_delivery_mode(&mut lapic, APIC_LVT1, APIC_MODE_NMI);
    vcpu.set_lapic(&lapic).map_err(|source| RegsError::Kvm {
        what: "KVM_SET_LAPIC",
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_encoding_round_trips() {
        let code = gdt_entry(0xa09b, 0, 0xfffff);
        assert_eq!(code, 0x00af_9b00_0000_ffff);
        let seg = segment_from_gdt(code, 1);
        assert_eq!(
            (
                seg.selector,
                seg.type_,
                seg.l,
                seg.db,
                seg.g,
                seg.present,
                seg.s
            ),
            (8, 0xb, 1, 0, 1, 1, 1)
        );
        assert_eq!(seg.limit, 0xffff_ffff);
        let data = segment_from_gdt(gdt_entry(0xc093, 0, 0xfffff), 2);
        assert_eq!((data.type_, data.db, data.l, data.unusable), (3, 1, 0, 0));
        let odd = segment_from_gdt(gdt_entry(0x0093, 0x1234_5678, 0xabcde), 5);
        assert_eq!((odd.base, odd.limit, odd.g), (0x1234_5678, 0xabcde, 0));
        assert_eq!(segment_from_gdt(0, 0).unusable, 1);
    }

    #[test]
    fn lint_delivery_modes() {
        let mut lapic = kvm_lapic_state::default();
        lapic.regs[APIC_LVT0] = 0xff_u8.cast_signed();
        lapic.regs[APIC_LVT0 + 1] = 0x07;
        set_delivery_mode(&mut lapic, APIC_LVT1, APIC_MODE_NMI);
        set_delivery_mode(&mut lapic, APIC_LVT0, APIC_MODE_EXTINT);
        assert_eq!(lapic.regs[APIC_LVT0 + 1].cast_unsigned(), 0x07);
        assert_eq!(
            lapic.regs[APIC_LVT0].cast_unsigned(),
            0xff,
            "vector bits kept"
        );
        assert_eq!(lapic.regs[APIC_LVT1 + 1].cast_unsigned(), 0x04);
    }

    #[test]
    fn mtrrs_default_to_write_back() {
        assert!(boot_msrs().contains(&(MSR_MTRR_DEF_TYPE, 0x806)));
    }
}
