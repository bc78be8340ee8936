//! CPUID for each vCPU: KVM's supported list with the APIC id, topology and
//! hypervisor bits a guest expects from a machine laid out as the VM's
//! [`CpuTopology`] (by default one package of single-thread cores).

use kvm_bindings::kvm_cpuid_entry2;

use crate::config::CpuTopology;

/// Leaf 1 ECX: the TSC deadline timer (KVM emulates it when the capability is present).
const LEAF1_ECX_TSC_DEADLINE: u32 = 1 << 24;
/// Leaf 1 ECX: "running under a hypervisor".
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// Leaf 1 EDX: HTT, meaning EBX[23:16] holds the logical processor count.
const LEAF1_EDX_HTT: u32 = 1 << 28;

/// Topology level types in leaves 0xB and 0x1F.
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Rewrites `entries` for vCPU `index` of a VM laid out as `topology`
/// (its APIC id from [`CpuTopology::apic_id`]). Dies are folded into the
/// core level of leaves 0xB/0x1F: Linux then sees one die per package.
pub fn patch_cpuid(
    entries: &mut [kvm_cpuid_entry2],
    index: u32,
    topology: CpuTopology,
    tsc_deadline: bool,
) {
    let apic_id = topology.apic_id(index);
    let threads = u32::from(topology.threads_per_core);
    let per_package = topology.per_package();
    let (thread_bits, core_bits, die_bits) = topology.level_bits();
    // Bits of the APIC id below the package number.
    let package_shift = thread_bits + core_bits + die_bits;
    let core_id = (apic_id >> thread_bits) & ((1 << (core_bits + die_bits)) - 1);
    for e in entries.iter_mut() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff)
                    | (apic_id << 24)
                    | ((1u32 << package_shift).min(255) << 16);
                e.ecx |= LEAF1_ECX_HYPERVISOR;
                if tsc_deadline {
                    e.ecx |= LEAF1_ECX_TSC_DEADLINE;
                }
                e.edx |= LEAF1_EDX_HTT;
            }
            // Intel deterministic cache parameters: core ids per package - 1 in EAX[31:26].
            4 if e.eax & 0x1f != 0 => {
                let cores = ((1u32 << (core_bits + die_bits)) - 1).min(63);
                e.eax = (e.eax & 0x03ff_ffff) | (cores << 26);
            }
            // Extended topology: threads in cores, cores (of every die) in a package.
            0xb | 0x1f => {
                let (eax, ebx, level) = match e.index {
                    0 => (thread_bits, threads, LEVEL_SMT),
                    1 => (package_shift, per_package, LEVEL_CORE),
                    _ => (0, 0, 0),
                };
                e.eax = eax;
                e.ebx = ebx;
                e.ecx = (level << 8) | (e.index & 0xff);
                e.edx = apic_id;
            }
            // AMD: logical processors per package and the APIC id width.
            0x8000_0008 => {
                e.ecx = (e.ecx & !0xf0ff) | (package_shift << 12) | (per_package - 1).min(255);
            }
            // AMD topology extensions: extended APIC id, core id and
            // threads per core, one node.
            0x8000_001e => {
                e.eax = apic_id;
                e.ebx = (e.ebx & !0xffff) | ((threads - 1) << 8) | (core_id & 0xff);
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
        patch_cpuid(&mut e, 3, CpuTopology::flat(4), true);
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
    fn two_threads_per_core_in_two_packages() {
        let t = CpuTopology {
            threads_per_core: 2,
            cores_per_die: 3,
            dies_per_package: 1,
            packages: 2,
        };
        let mut e = vec![leaf(1, 0), leaf(0xb, 0), leaf(0xb, 1), leaf(0x8000_001e, 0)];
        // vCPU 7: package 1, core 0, thread 1 -> APIC id 8 | 1.
        patch_cpuid(&mut e, 7, t, false);
        assert_eq!(e[0].ebx >> 24, 9);
        assert_eq!((e[0].ebx >> 16) & 0xff, 8, "ids a package spans");
        assert_eq!((e[1].eax, e[1].ebx, e[1].edx), (1, 2, 9), "SMT level");
        assert_eq!((e[2].eax, e[2].ebx, e[2].edx), (3, 6, 9), "core level");
        assert_eq!(e[3].ebx & 0xffff, 0x100, "core 0, 2 threads per core");
    }
}
