//! A vCPU's KVM state (registers, XSAVE, LAPIC, MSRs, CPUID, events, MP
//! state), captured and restored in the orders KVM needs; why each step
//! sits where it does is said there. The capture runs on the vCPU's own
//! thread while the VM is paused (the thread owns its `VcpuFd`:
//! [`super::RunningVcpus::save_state`]); the restore runs on the main
//! thread into a fresh vCPU before its thread starts ([`super::Vcpu::restore`]).
//!
//! kvm-bindings serializes its structures as raw bytes and deserializes
//! them by copying what fits and zero-filling the rest, so a state saved
//! by a build with other structure sizes would load silently wrong: the
//! state records the sizes it was saved with ([`KvmSizes`]) and the XSAVE
//! area's length, and restore refuses a mismatch naming the part.

use std::collections::BTreeMap;
use std::mem::size_of;

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_debugregs, kvm_lapic_state, kvm_mp_state, kvm_msr_entry, kvm_regs,
    kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave, CpuId, Msrs, Xsave, KVM_MAX_CPUID_ENTRIES,
    KVM_MAX_MSR_ENTRIES,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    #[error("KVM_GET_{part} failed: {source}")]
    Get {
        part: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_SET_{part} failed: {source}")]
    Set {
        part: &'static str,
        source: kvm_ioctls::Error,
    },
    #[error("KVM_SET_MSRS refused MSR {index:#x} (wrote {written} of {total})")]
    MsrRefused {
        index: u32,
        written: usize,
        total: usize,
    },
    #[error("the saved {part} is {saved} bytes, this VMM's is {here} bytes: refused")]
    SizeMismatch {
        part: String,
        saved: usize,
        here: usize,
    },
    #[error("the saved state has XCRS but this host's KVM lacks KVM_CAP_XCRS")]
    NoXcrs,
    #[error("{part}: {source}")]
    Fam {
        part: &'static str,
        source: vmm_sys_util::fam::Error,
    },
}

/// The size of each KVM structure a state holds, by name, as the build
/// that saved it laid them out.
pub type KvmSizes = BTreeMap<String, usize>;

/// What this host's KVM offers for a vCPU's state. Asked once per VM on
/// the main thread: a vCPU thread's seccomp filter allows no
/// KVM_CHECK_EXTENSION or `/dev/kvm` request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StateCaps {
    /// KVM_CAP_XSAVE2's answer, the whole XSAVE area in bytes; None: no
    /// XSAVE2, the 4096-byte KVM_GET_XSAVE.
    pub xsave2_size: Option<usize>,
    pub xcrs: bool,
    pub tsc_khz: bool,
    /// The MSRs saved: the host's index list, filtered ([`msr_is_saved`]),
    /// and [`MSRS_ALWAYS_TRIED`]; sorted, each once.
    pub msrs: Vec<u32>,
}

impl StateCaps {
    pub fn probe(kvm: &Kvm, vm: &VmFd) -> Result<Self, VcpuStateError> {
        let list = kvm
            .get_msr_index_list()
            .map_err(|source| VcpuStateError::Get {
                part: "MSR_INDEX_LIST",
                source,
            })?;
        let mut msrs: Vec<u32> = list
            .as_slice()
            .iter()
            .copied()
            .filter(|&i| msr_is_saved(i))
            .chain(MSRS_ALWAYS_TRIED.iter().copied())
            .collect();
        msrs.sort_unstable();
        msrs.dedup();
        Ok(StateCaps {
            xsave2_size: usize::try_from(vm.check_extension_int(Cap::Xsave2))
                .ok()
                .filter(|&size| size > 0),
            xcrs: vm.check_extension(Cap::Xcrs),
            tsc_khz: vm.check_extension(Cap::GetTscKhz),
            msrs,
        })
    }

    /// The XSAVE area KVM reads and writes on this host, in bytes (never
    /// less than the classic `kvm_xsave`).
    pub fn xsave_len(&self) -> usize {
        self.xsave2_size.unwrap_or(0).max(size_of::<kvm_xsave>())
    }

    /// The `u32` entries past `kvm_xsave` that [`Self::xsave_len`] needs.
    fn xsave_extra_entries(&self) -> usize {
        (self.xsave_len() - size_of::<kvm_xsave>()).div_ceil(size_of::<u32>())
    }
}

const MSR_IA32_MCG_CTL: u32 = 0x17b;

/// MSRs a guest sets that a host's index list may leave out (the
/// paravirtual KVM these tests run on lists neither TSC_AUX, which Linux
/// sets to the CPU number for `getcpu`, nor the MTRRs): read too, and
/// left out like any other when KVM cannot read them.
pub const MSRS_ALWAYS_TRIED: &[u32] = &[
    0x48,  // SPEC_CTRL
    0x200, // MTRR variable ranges: base/mask pairs 0-7
    0x201,
    0x202,
    0x203,
    0x204,
    0x205,
    0x206,
    0x207,
    0x208,
    0x209,
    0x20a,
    0x20b,
    0x20c,
    0x20d,
    0x20e,
    0x20f,
    0x250, // MTRR fixed ranges
    0x258,
    0x259,
    0x268,
    0x269,
    0x26a,
    0x26b,
    0x26c,
    0x26d,
    0x26e,
    0x26f,
    0x2ff,       // MTRR default type
    0xc000_0103, // TSC_AUX
];
/// KVM's paravirtual MSRs (kvmclock, async page faults, steal time, PV
/// EOI, poll control).
const KVM_PV_MSRS: std::ops::RangeInclusive<u32> = 0x4b56_4d00..=0x4b56_4dff;
/// EFER, STAR, LSTAR, CSTAR, SFMASK, FS/GS/KERNEL_GS_BASE, TSC_AUX.
const SYSCALL_MSRS: std::ops::RangeInclusive<u32> = 0xc000_0080..=0xc000_0103;
const MSR_K7_HWCR: u32 = 0xc001_0015;

/// Whether MSR `index` from the host's list is part of a vCPU's state:
/// the architectural range (TSC, TSC_ADJUST, SYSENTER, PAT, MTRRs,
/// MISC_ENABLE, MISC_FEATURES_ENABLES, TSC_DEADLINE, XSS, the legacy
/// kvmclock pair), the syscall MSRs, K7_HWCR and KVM's paravirtual ones —
/// as Firecracker's list. Not MCG_CTL (Linux does not export it; KVM
/// refuses its write), nor the performance counters of emulated CPUs.
pub fn msr_is_saved(index: u32) -> bool {
    index != MSR_IA32_MCG_CTL
        && (index < 0x1000
            || SYSCALL_MSRS.contains(&index)
            || index == MSR_K7_HWCR
            || KVM_PV_MSRS.contains(&index))
}

/// This build's sizes of the structures a [`VcpuState`] holds.
pub fn vcpu_sizes() -> KvmSizes {
    [
        ("regs", size_of::<kvm_regs>()),
        ("sregs", size_of::<kvm_sregs>()),
        ("xsave", size_of::<kvm_xsave>()),
        ("xcrs", size_of::<kvm_xcrs>()),
        ("debugregs", size_of::<kvm_debugregs>()),
        ("lapic", size_of::<kvm_lapic_state>()),
        ("mp_state", size_of::<kvm_mp_state>()),
        ("vcpu_events", size_of::<kvm_vcpu_events>()),
        ("msr_entry", size_of::<kvm_msr_entry>()),
        ("cpuid_entry2", size_of::<kvm_cpuid_entry2>()),
    ]
    .into_iter()
    .map(|(part, size)| (part.to_owned(), size))
    .collect()
}

/// The first part whose saved size differs from this build's (or that
/// only one of them has): (part, saved, here), a missing size as 0.
pub(crate) fn size_mismatch(saved: &KvmSizes, here: &KvmSizes) -> Option<(String, usize, usize)> {
    let get = |m: &KvmSizes, part: &str| m.get(part).copied().unwrap_or(0);
    here.keys()
        .chain(saved.keys())
        .find(|part| get(saved, part) != get(here, part))
        .map(|part| (part.clone(), get(saved, part), get(here, part)))
}

/// One vCPU's KVM state.
#[derive(Clone, Serialize, Deserialize)]
pub struct VcpuState {
    /// The structure sizes this state was saved with.
    pub sizes: KvmSizes,
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The XSAVE area (x87, SSE, AVX…: no separate FPU state is kept).
    pub xsave: Xsave,
    pub xcrs: Option<kvm_xcrs>,
    pub debug_regs: kvm_debugregs,
    pub lapic: kvm_lapic_state,
    pub tsc_khz: Option<u32>,
    pub cpuid: CpuId,
    pub msrs: Vec<kvm_msr_entry>,
    pub vcpu_events: kvm_vcpu_events,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("rip", &self.regs.rip)
            .field("msrs", &self.msrs.len())
            .finish_non_exhaustive()
    }
}

impl vm_state::SectionState for VcpuState {
    const KIND: &'static str = "vcpu";
    const VERSION: u32 = 1;
}

impl VcpuState {
    /// Reads the state of `fd`, which runs no guest code meanwhile.
    pub fn capture(fd: &VcpuFd, caps: &StateCaps) -> Result<Self, VcpuStateError> {
        let get = |part| move |source| VcpuStateError::Get { part, source };
        // First: KVM_GET_MP_STATE accepts pending INIT/SIPI events into the
        // LAPIC, which the later reads then see.
        let mp_state = fd.get_mp_state().map_err(get("MP_STATE"))?;
        let regs = fd.get_regs().map_err(get("REGS"))?;
        let sregs = fd.get_sregs().map_err(get("SREGS"))?;
        let xsave = capture_xsave(fd, caps)?;
        let xcrs = match caps.xcrs {
            true => Some(fd.get_xcrs().map_err(get("XCRS"))?),
            false => None,
        };
        let debug_regs = fd.get_debug_regs().map_err(get("DEBUGREGS"))?;
        let lapic = fd.get_lapic().map_err(get("LAPIC"))?;
        // Optional: older or emulated hosts may not know the rate.
        let tsc_khz = caps.tsc_khz.then(|| fd.get_tsc_khz().ok()).flatten();
        let cpuid = fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(get("CPUID2"))?;
        let msrs = capture_msrs(fd, &caps.msrs)?;
        // Last: the reads above may change pending events.
        let vcpu_events = fd.get_vcpu_events().map_err(get("VCPU_EVENTS"))?;
        Ok(VcpuState {
            sizes: vcpu_sizes(),
            mp_state,
            regs,
            sregs,
            xsave,
            xcrs,
            debug_regs,
            lapic,
            tsc_khz,
            cpuid,
            msrs,
            vcpu_events,
        })
    }

    /// The XSAVE area's length in bytes as saved.
    pub fn xsave_len(&self) -> usize {
        size_of::<kvm_xsave>() + std::mem::size_of_val(self.xsave.as_slice())
    }

    /// Checks that this state fits this build and host, before anything
    /// is written to a vCPU.
    pub fn check(&self, caps: &StateCaps) -> Result<(), VcpuStateError> {
        if let Some((part, saved, here)) = size_mismatch(&self.sizes, &vcpu_sizes()) {
            return Err(VcpuStateError::SizeMismatch { part, saved, here });
        }
        if self.xsave_len() != caps.xsave_len() {
            return Err(VcpuStateError::SizeMismatch {
                part: "xsave area".to_owned(),
                saved: self.xsave_len(),
                here: caps.xsave_len(),
            });
        }
        if self.xcrs.is_some() && !caps.xcrs {
            return Err(VcpuStateError::NoXcrs);
        }
        Ok(())
    }

    /// Writes this state into `fd`, a vCPU that has not run.
    pub fn restore(&self, fd: &VcpuFd, caps: &StateCaps) -> Result<(), VcpuStateError> {
        self.check(caps)?;
        let set = |part| move |source| VcpuStateError::Set { part, source };
        fd.set_cpuid2(&self.cpuid).map_err(set("CPUID2"))?;
        fd.set_mp_state(self.mp_state).map_err(set("MP_STATE"))?;
        fd.set_regs(&self.regs).map_err(set("REGS"))?;
        // SREGS also restores the APIC base MSR the LAPIC below needs.
        fd.set_sregs(&self.sregs).map_err(set("SREGS"))?;
        match caps.xsave2_size {
            // SAFETY: check() made sure the area is exactly the size
            // KVM_CAP_XSAVE2 gave for this host; the VMM enables no XSTATE
            // feature dynamically after asking.
            Some(_) => unsafe { fd.set_xsave2(&self.xsave) }.map_err(set("XSAVE2"))?,
            // SAFETY: without XSAVE2, KVM reads the classic 4096-byte area.
            None => unsafe { fd.set_xsave(&self.xsave.as_fam_struct_ref().xsave) }
                .map_err(set("XSAVE"))?,
        }
        if let Some(xcrs) = &self.xcrs {
            fd.set_xcrs(xcrs).map_err(set("XCRS"))?;
        }
        fd.set_debug_regs(&self.debug_regs)
            .map_err(set("DEBUGREGS"))?;
        // After SREGS (the APIC base) and before the MSRs: TSC_DEADLINE is
        // only taken with the LAPIC's timer configured.
        fd.set_lapic(&self.lapic).map_err(set("LAPIC"))?;
        if let Some(khz) = self.tsc_khz {
            // Another rate needs TSC scaling; on the same host it never differs.
            if fd.get_tsc_khz().ok() != Some(khz) {
                fd.set_tsc_khz(khz).map_err(set("TSC_KHZ"))?;
            }
        }
        restore_msrs(fd, &self.msrs)?;
        // Last: SET_REGS and SET_SREGS clear pending exceptions, which the
        // events put back.
        fd.set_vcpu_events(&self.vcpu_events)
            .map_err(set("VCPU_EVENTS"))?;
        // Tells a kvmclock guest it was paused, so its soft-lockup watchdog
        // does not fire; EINVAL when the guest does not use kvmclock.
        match fd.kvmclock_ctrl() {
            Err(e) if e.errno() != libc::EINVAL => Err(set("KVMCLOCK_CTRL")(e)),
            _ => Ok(()),
        }
    }
}

fn capture_xsave(fd: &VcpuFd, caps: &StateCaps) -> Result<Xsave, VcpuStateError> {
    let mut xsave =
        Xsave::new(caps.xsave_extra_entries()).map_err(|source| VcpuStateError::Fam {
            part: "XSAVE area",
            source,
        })?;
    let get = |part| move |source| VcpuStateError::Get { part, source };
    match caps.xsave2_size {
        // SAFETY: `xsave` holds the size KVM_CAP_XSAVE2 gave for this host
        // (xsave_extra_entries rounds up); no XSTATE feature is enabled
        // dynamically after asking.
        Some(_) => unsafe { fd.get_xsave2(&mut xsave) }.map_err(get("XSAVE2"))?,
        None => {
            let classic = fd.get_xsave().map_err(get("XSAVE"))?;
            // SAFETY: only the fixed-size header is replaced; the entry
            // count (0) stays what the wrapper allocated.
            unsafe { xsave.as_mut_fam_struct().xsave = classic };
        }
    }
    Ok(xsave)
}

/// Reads the MSRs `indices`, at most KVM_MAX_MSR_ENTRIES per call. KVM
/// stops at the first MSR it cannot read and says how many it read: that
/// one is left out and the rest read on (an emulated CPU may list MSRs it
/// cannot read). Each call consumes at least one index, so this ends.
fn capture_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>, VcpuStateError> {
    let mut saved = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let chunk = &rest[..rest.len().min(KVM_MAX_MSR_ENTRIES)];
        let mut msrs = msr_list(chunk.iter().map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        }))?;
        let read = fd
            .get_msrs(&mut msrs)
            .map_err(|source| VcpuStateError::Get {
                part: "MSRS",
                source,
            })?
            .min(chunk.len());
        saved.extend_from_slice(&msrs.as_slice()[..read]);
        let skip = if read < chunk.len() {
            tracing::debug!("KVM_GET_MSRS cannot read MSR {:#x}; not saved", chunk[read]);
            read + 1
        } else {
            read
        };
        rest = &rest[skip..];
    }
    Ok(saved)
}

/// Writes every saved MSR: one KVM refuses is an error naming it.
fn restore_msrs(fd: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<(), VcpuStateError> {
    let mut done = 0;
    for chunk in entries.chunks(KVM_MAX_MSR_ENTRIES) {
        let msrs = msr_list(chunk.iter().copied())?;
        let written = fd.set_msrs(&msrs).map_err(|source| VcpuStateError::Set {
            part: "MSRS",
            source,
        })?;
        if written < chunk.len() {
            return Err(VcpuStateError::MsrRefused {
                index: chunk[written].index,
                written: done + written,
                total: entries.len(),
            });
        }
        done += written;
    }
    Ok(())
}

fn msr_list(entries: impl Iterator<Item = kvm_msr_entry>) -> Result<Msrs, VcpuStateError> {
    Msrs::from_entries(&entries.collect::<Vec<_>>()).map_err(|source| VcpuStateError::Fam {
        part: "MSR list",
        source,
    })
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
