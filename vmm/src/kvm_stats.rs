//! KVM's binary statistics (`KVM_GET_STATS_FD`, Linux 5.14): the counters
//! KVM keeps per VM and per vCPU, read with `pread` from a file descriptor,
//! without stopping anything. The DAX metrics use them to show what a
//! workload costs in guest exits and nested page faults, and which page
//! sizes KVM maps guest memory with (a DAX window backed by 2 MiB host
//! pages shows up in `pages_2m`).
//!
//! The file holds a header, descriptors (flags, size, offset, name) and a
//! data block of u64 values; names are looked up once, when it is opened.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;

use kvm_bindings::{kvm_stats_desc, kvm_stats_header, KVMIO};
use vmm_sys_util::ioctl::ioctl;
use vmm_sys_util::ioctl_io_nr;

ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);

/// Longest name a descriptor may declare; KVM's are under 48 bytes.
const MAX_NAME_SIZE: u32 = 256;
/// More descriptors than KVM has ever had per VM or vCPU (about 50).
const MAX_DESCRIPTORS: u32 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum KvmStatsError {
    #[error("KVM_GET_STATS_FD: {0}")]
    Open(std::io::Error),
    #[error("reading KVM's statistics: {0}")]
    Read(std::io::Error),
    #[error("KVM's statistics header is not one this VMM understands: {0}")]
    Format(String),
}

/// One VM's or one vCPU's statistics file.
pub struct KvmStatsFile {
    file: File,
    /// Name → byte offset in the file of its first u64.
    offsets: HashMap<String, u64>,
}

impl KvmStatsFile {
    /// Opens the statistics of the VM or vCPU whose fd is `fd`.
    pub fn open(fd: &impl AsRawFd) -> Result<KvmStatsFile, KvmStatsError> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new fd
        // (or -1); `fd` is a KVM VM or vCPU fd the caller owns.
        let raw = unsafe { ioctl(fd, KVM_GET_STATS_FD()) };
        if raw < 0 {
            return Err(KvmStatsError::Open(std::io::Error::last_os_error()));
        }
        // SAFETY: the ioctl returned a new fd that nothing else owns.
        let file = unsafe { File::from_raw_fd(raw) };
        let offsets = read_descriptors(&file)?;
        Ok(KvmStatsFile { file, offsets })
    }

    /// The value of the named statistic (its first element), if KVM has it.
    pub fn get(&self, name: &str) -> Option<u64> {
        let offset = *self.offsets.get(name)?;
        let mut value = [0u8; 8];
        self.file.read_exact_at(&mut value, offset).ok()?;
        Some(u64::from_ne_bytes(value))
    }
}

fn read_descriptors(file: &File) -> Result<HashMap<String, u64>, KvmStatsError> {
    let mut raw = [0u8; size_of::<kvm_stats_header>()];
    file.read_exact_at(&mut raw, 0)
        .map_err(KvmStatsError::Read)?;
    let field = |i: usize| u32::from_ne_bytes(raw[i * 4..i * 4 + 4].try_into().expect("4 bytes"));
    // flags, name_size, num_desc, id_offset, desc_offset, data_offset
    let (name_size, num_desc, desc_offset, data_offset) = (field(1), field(2), field(4), field(5));
    if name_size == 0 || name_size > MAX_NAME_SIZE || num_desc > MAX_DESCRIPTORS {
        return Err(KvmStatsError::Format(format!(
            "name_size {name_size}, num_desc {num_desc}"
        )));
    }
    let desc_size = size_of::<kvm_stats_desc>() + name_size as usize;
    let mut descs = vec![0u8; desc_size * num_desc as usize];
    file.read_exact_at(&mut descs, u64::from(desc_offset))
        .map_err(KvmStatsError::Read)?;
    let mut offsets = HashMap::new();
    for d in descs.chunks_exact(desc_size) {
        // struct kvm_stats_desc: u32 flags, i16 exponent, u16 size,
        // u32 offset (within the data block), u32 bucket_size, name.
        let size = u16::from_ne_bytes([d[6], d[7]]);
        let offset = u32::from_ne_bytes(d[8..12].try_into().expect("4 bytes"));
        let name = &d[size_of::<kvm_stats_desc>()..];
        let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
        if size == 0 {
            continue;
        }
        if let Ok(name) = std::str::from_utf8(name) {
            offsets.insert(name.to_string(), u64::from(data_offset) + u64::from(offset));
        }
    }
    Ok(offsets)
}

/// The statistics of a VM and its vCPUs, read together for the metrics.
pub struct VmKvmStats {
    vm: KvmStatsFile,
    vcpus: Vec<KvmStatsFile>,
}

impl VmKvmStats {
    pub fn new(vm: KvmStatsFile, vcpus: Vec<KvmStatsFile>) -> Self {
        VmKvmStats { vm, vcpus }
    }

    /// A per-vCPU statistic summed over the vCPUs (0 where KVM lacks it).
    pub fn vcpu_sum(&self, name: &str) -> u64 {
        self.vcpus.iter().filter_map(|v| v.get(name)).sum()
    }

    /// A per-VM statistic.
    pub fn vm(&self, name: &str) -> Option<u64> {
        self.vm.get(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_ioctls::Kvm;

    /// Against the real KVM: the statistics every x86 kernel with binary
    /// stats has are found, and a vCPU that has not run has no exits.
    #[test]
    fn reads_vm_and_vcpu_statistics_from_kvm() {
        let Ok(kvm) = Kvm::new() else {
            eprintln!("no /dev/kvm; skipped");
            return;
        };
        let vm = kvm.create_vm().unwrap();
        let vcpu = vm.create_vcpu(0).unwrap();
        let vm_stats = KvmStatsFile::open(&vm).unwrap();
        let vcpu_stats = KvmStatsFile::open(&vcpu).unwrap();
        assert_eq!(vcpu_stats.get("exits"), Some(0));
        assert!(vcpu_stats.get("pf_taken").is_some());
        assert!(vm_stats.get("pages_4k").is_some());
        assert!(vm_stats.get("pages_2m").is_some());
        assert_eq!(vm_stats.get("no such statistic"), None);
        let both = VmKvmStats::new(vm_stats, vec![vcpu_stats]);
        assert_eq!(both.vcpu_sum("exits"), 0);
    }
}
