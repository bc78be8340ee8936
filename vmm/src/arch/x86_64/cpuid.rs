//! CPUID for each vCPU: KVM's supported list with the APIC id, topology and
//! hypervisor bits a guest expects from a machine with `cpus` single-thread cores.

use kvm_bindings::kvm_cpuid_entry2;

/// Leaf 1 ECX: the TSC deadline timer (KVM emulates it when the capability is present).
const LEAF1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// Leaf 1 ECX: "running under a hypervisor".
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX: HTT, meaning EBX[23:16] holds the logical processor count.
const LEAF1_EDX_HTT: u32 = 1 << 28;

/// Topology level types in leaves 0xB and 0x1F.
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Bits needed to hold an APIC id below `n`.
fn id_bits(n: u32) -> u32 {
    (n.max(1) - 1).checked_ilog2().map_or(0, |b| b + 1)
}

/// Rewrites `entries` for vCPU `index` (also its APIC id) of `cpus`.
pub fn patch_cpuid(entries: &mut [kvm_cpuid_entry2], index: u32, cpus: u32, tsc_deadline: bool) {
    let core_bits = id_bits(cpus);
    for e in entries.iter_mut() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (index << 24) | ((1 << core_bits).min(255) << 16);
                e.ecx |= LEAF1_ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= LEAF1_ECX_TSC_DEADLINE;
                }
                e.edx |= LEAF1_EDX_HTT;
            }
            // Intel deterministic cache parameters: cores per package in EAX[31:26].
            4 if e.eax & 0x1f != 0 => {
                e.eax = (e.eax & 0x03ff_ffff) | ((cpus - 1) << 26);
            }
            // Extended topology: one thread per core, all cores in one package.
            0xb | 0x1f => {
                let (eax, ebx, level) = match e.index {
                    0 => (0, 1, LEVEL_SMT),
                    1 => (core_bits, cpus, LEVEL_CORE),
                    _ => (0, 0, 0),
                };
                e.eax = eax;
                e.ebx = ebx;
                e.ecx = (level << 8) | (e.index & 0xff);
                e.edx = index;
            }
            // AMD: core count and APIC id width.
            0x8000_0008 => {
                e.ecx = (e.ecx & !0xf0ff) | (core_bits << 12) | (cpus - 1);
            }
            // AMD topology extensions: extended APIC id, core id, one node.
            0x8000_001e => {
                e.eax = index;
                e.ebx = (e.ebx & !0xff) | index;
                e.ecx = 0;
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 1,
            ebx: 0xffff_ffff,
            ecx: 0,
            edx: 0,
            ..Default::default()
        }
    }

    #[test]
    fn apic_ids_and_topology() {
        let mut e = vec![
            leaf(1, 0),
            leaf(0xb, 0),
            leaf(0xb, 1),
            leaf(0xb, 2),
            leaf(0x8000_0008, 0),
            leaf(0x8000_001e, 0),
        ];
        patch_cpuid(&mut e, 3, 4, true);
        assert_eq!(e[0].ebx >> 24, 3, "initial APIC id");
        assert_eq!((e[0].ebx >> 16) & 0xff, 4, "logical processors");
        assert_eq!(e[0].ebx & 0xffff, 0xffff, "other leaf 1 bits kept");
        assert_ne!(e[0].ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_ne!(e[0].ecx & LEAF1_ECX_TSC_DEADLINE, 0);
        assert_eq!((e[1].ebx, e[1].ecx, e[1].edx), (1, 0x100, 3));
        assert_eq!((e[2].eax, e[2].ebx, e[2].ecx, e[2].edx), (2, 4, 0x201, 3));
        assert_eq!(
            (e[3].ebx, e[3].ecx >> 8),
            (0, 0),
            "levels past core are invalid"
        );
        assert_eq!(e[4].ecx & 0xff, 3);
        assert_eq!((e[4].ecx >> 12) & 0xf, 2);
        assert_eq!(e[5].eax, 3);
    }

    #[test]
    fn id_widths() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 254].map(id_bits),
            [0, 1, 2, 2, 3, 3, 4, 8]
        );
    }
}
