//! One device's config, whichever its kind: what `vm.add-*` carries from
//! the API's body (parsed and checked once, by [`super::json`]) to the
//! VM's configuration and, on a running VM, to the device manager.

use super::{DiskConfig, FsConfig, NetConfig, PmemConfig, VmConfig, VsockConfig};

/// A device `vm.add-*` adds, its config checked and named.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceConfig {
    Fs(FsConfig),
    Pmem(PmemConfig),
    Disk(DiskConfig),
    Vsock(VsockConfig),
    Net(NetConfig),
}

impl DeviceConfig {
    pub fn id(&self) -> &str {
        match self {
            DeviceConfig::Fs(f) => &f.id,
            DeviceConfig::Pmem(p) => &p.id,
            DeviceConfig::Disk(d) => &d.id,
            DeviceConfig::Vsock(v) => &v.id,
            DeviceConfig::Net(n) => &n.id,
        }
    }
}

impl VmConfig {
    /// Adds `device` to its list (the vsock device in its place: one per
    /// VM, which the caller checks). What no single device can get wrong
    /// (ids used twice, PCI segments) is [`VmConfig::validate`]'s.
    pub fn add_device(&mut self, device: DeviceConfig) {
        match device {
            DeviceConfig::Fs(f) => self.fs.push(f),
            DeviceConfig::Pmem(p) => self.pmem.push(p),
            DeviceConfig::Disk(d) => self.disks.push(d),
            DeviceConfig::Vsock(v) => self.vsock = Some(v),
            DeviceConfig::Net(n) => self.net.push(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::json::vm_config_from_json;

    #[test]
    fn each_kind_joins_its_own_list() {
        let mut c = vm_config_from_json(&serde_json::json!({"payload": {"kernel": "/k"}})).unwrap();
        let devices = [
            DeviceConfig::Fs(FsConfig::parse("tag=t,socket=/s", 0).unwrap()),
            DeviceConfig::Pmem(PmemConfig::parse("file=/p", 0).unwrap()),
            DeviceConfig::Disk(DiskConfig::parse("path=/d", 0).unwrap()),
            DeviceConfig::Vsock(VsockConfig::parse("cid=3,socket=/v").unwrap()),
            DeviceConfig::Net(NetConfig::parse("tap=t0", 0).unwrap()),
        ];
        for d in devices.clone() {
            c.add_device(d);
        }
        let ids = [
            c.fs[0].id.as_str(),
            &c.pmem[0].id,
            &c.disks[0].id,
            &c.vsock.as_ref().unwrap().id,
            &c.net[0].id,
        ];
        assert_eq!(ids, devices.each_ref().map(DeviceConfig::id));
        assert_eq!(ids, ["_fs0", "_pmem0", "_disk0", "_vsock0", "_net0"]);
    }
}
