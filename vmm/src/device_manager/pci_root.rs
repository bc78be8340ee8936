//! PCI bus 0: the host bridge at 00:00.0, up to 31 functions behind it, and
//! configuration access through ports 0xCF8 (address) / 0xCFC (data).

use std::sync::{Arc, Mutex};

use pci::configuration::{PciConfiguration, PciIds};

use crate::bus::BusDevice;

pub const PCI_CONFIG_IO_PORT: u64 = 0xcf8;
pub const PCI_CONFIG_IO_SIZE: u64 = 8;
const MAX_DEVICES: usize = 32;
const ENABLE_BIT: u32 = 1 << 31;

/// A PCI function's configuration space as the bus sees it.
pub trait PciFunction: Send {
    fn read_config(&mut self, offset: u64, data: &mut [u8]);
    /// Returns the BAR index the write moved, if any.
    fn write_config(&mut self, offset: u64, data: &[u8]) -> Option<usize>;
}

struct HostBridge(PciConfiguration);

impl PciFunction for HostBridge {
    fn read_config(&mut self, offset: u64, data: &mut [u8]) {
        self.0.read(offset, data);
    }
    fn write_config(&mut self, offset: u64, data: &[u8]) -> Option<usize> {
        self.0.write(offset, data)
    }
}

pub struct PciRoot {
    devices: Vec<Option<Arc<Mutex<dyn PciFunction>>>>,
}

impl Default for PciRoot {
    fn default() -> Self {
        Self::new()
    }
}

impl PciRoot {
    pub fn new() -> Self {
        let mut devices: Vec<Option<Arc<Mutex<dyn PciFunction>>>> =
            (0..MAX_DEVICES).map(|_| None).collect();
        let bridge = PciConfiguration::new(PciIds {
            vendor: 0x8086,
            device: 0x0d57,
            subsystem_vendor: 0,
            subsystem: 0,
            class: 0x06,    // bridge
            subclass: 0x00, // host bridge
            prog_if: 0,
            revision: 0,
        });
        devices[0] = Some(Arc::new(Mutex::new(HostBridge(bridge))));
        PciRoot { devices }
    }

    /// Puts `function` in the first free slot and returns the slot number.
    pub fn add(&mut self, function: Arc<Mutex<dyn PciFunction>>) -> Option<u8> {
        let index = self.devices.iter().position(Option::is_none)?;
        let slot = u8::try_from(index).ok()?;
        self.devices[index] = Some(function);
        Some(slot)
    }

    /// Puts `function` in `slot` if it is free (a restore puts each
    /// function back where the guest saw it).
    pub fn add_at(&mut self, slot: u8, function: Arc<Mutex<dyn PciFunction>>) -> bool {
        match self.devices.get_mut(usize::from(slot)) {
            Some(free @ None) => {
                *free = Some(function);
                true
            }
            _ => false,
        }
    }

    /// Empties `slot` (hot-unplug); the host bridge's slot 0 stays.
    pub fn remove(&mut self, slot: u8) -> Option<Arc<Mutex<dyn PciFunction>>> {
        if slot == 0 {
            return None;
        }
        self.devices.get_mut(usize::from(slot))?.take()
    }

    fn function(&self, bus: u8, device: u8, function: u8) -> Option<&Arc<Mutex<dyn PciFunction>>> {
        if bus != 0 || function != 0 {
            return None;
        }
        self.devices.get(usize::from(device))?.as_ref()
    }

    /// Config read of (bus, device, function) at `offset`; absent functions read all ones.
    pub fn read(&self, bdf: (u8, u8, u8), offset: u64, data: &mut [u8]) {
        match self.function(bdf.0, bdf.1, bdf.2) {
            Some(f) => f
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .read_config(offset, data),
            None => data.fill(0xff),
        }
    }

    pub fn write(&self, bdf: (u8, u8, u8), offset: u64, data: &[u8]) -> Option<usize> {
        let f = self.function(bdf.0, bdf.1, bdf.2)?;
        let moved = f
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write_config(offset, data);
        if let Some(bar) = moved {
            virtio_devices::info_limited!("PCI 00:{:02x}.0: BAR {bar} moved by the guest", bdf.1);
        }
        moved
    }
}

/// Configuration mechanism #1: the address register at 0xCF8, the data
/// window at 0xCFC–0xCFF.
pub struct PciConfigIo {
    root: Arc<Mutex<PciRoot>>,
    address: u32,
}

impl PciConfigIo {
    pub fn new(root: Arc<Mutex<PciRoot>>) -> Self {
        PciConfigIo { root, address: 0 }
    }

    /// (bus, device, function, register offset) selected, if enabled.
    fn target(&self, data_offset: u64) -> Option<((u8, u8, u8), u64)> {
        if self.address & ENABLE_BIT == 0 {
            return None;
        }
        let bus = narrow::low_u8(u64::from(self.address >> 16));
        let device = ((self.address >> 11) & 0x1f) as u8;
        let function = ((self.address >> 8) & 0x7) as u8;
        let reg = u64::from(self.address & 0xfc) + data_offset;
        Some(((bus, device, function), reg))
    }
}

impl BusDevice for PciConfigIo {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset == 0 && data.len() == 4 {
            data.copy_from_slice(&self.address.to_le_bytes());
            return;
        }
        match offset.checked_sub(4).and_then(|o| self.target(o)) {
            Some((bdf, reg)) => self
                .root
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .read(bdf, reg, data),
            None => data.fill(0xff),
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == 0 {
            if let Ok(v) = <[u8; 4]>::try_from(data) {
                self.address = u32::from_le_bytes(v);
            }
            return;
        }
        if let Some((bdf, reg)) = offset.checked_sub(4).and_then(|o| self.target(o)) {
            self.root
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .write(bdf, reg, data);
        }
    }
}

/// ECAM: bus 0's configuration spaces mapped as memory, 4 KiB per function
/// (offset = device << 15 | function << 12 | register).
pub struct PciEcam {
    root: Arc<Mutex<PciRoot>>,
}

impl PciEcam {
    pub fn new(root: Arc<Mutex<PciRoot>>) -> Self {
        PciEcam { root }
    }

    fn target(offset: u64) -> ((u8, u8, u8), u64) {
        let bus = narrow::low_u8(offset >> 20);
        let device = ((offset >> 15) & 0x1f) as u8;
        let function = ((offset >> 12) & 0x7) as u8;
        ((bus, device, function), offset & 0xfff)
    }
}

impl BusDevice for PciEcam {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let (bdf, reg) = Self::target(offset);
        self.root
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .read(bdf, reg, data);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let (bdf, reg) = Self::target(offset);
        self.root
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .write(bdf, reg, data);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cf8(dev: u8, reg: u8) -> [u8; 4] {
        (ENABLE_BIT | u32::from(dev) << 11 | u32::from(reg)).to_le_bytes()
    }

    #[test]
    fn type1_access_reaches_the_host_bridge_and_absent_slots_float() {
        let root = Arc::new(Mutex::new(PciRoot::new()));
        let mut io = PciConfigIo::new(root);
        io.write(0, &cf8(0, 0));
        let mut v = [0u8; 4];
        io.read(0, &mut v);
        assert_eq!(
            u32::from_le_bytes(v),
            u32::from_le_bytes(cf8(0, 0)),
            "address register reads back"
        );
        io.read(4, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x0d57_8086);
        // Byte access within the data window: class code byte at 0x0b.
        io.write(0, &cf8(0, 0x08));
        let mut b = [0u8];
        io.read(4 + 3, &mut b);
        assert_eq!(b[0], 0x06);
        // An empty slot and a disabled address read all ones.
        io.write(0, &cf8(5, 0));
        io.read(4, &mut v);
        assert_eq!(v, [0xff; 4]);
        io.write(0, &0u32.to_le_bytes());
        io.read(4, &mut v);
        assert_eq!(v, [0xff; 4]);
    }

    #[test]
    fn ecam_reaches_the_same_functions() {
        let root = Arc::new(Mutex::new(PciRoot::new()));
        let mut ecam = PciEcam::new(root);
        let mut v = [0u8; 4];
        ecam.read(0, &mut v);
        assert_eq!(u32::from_le_bytes(v), 0x0d57_8086);
        ecam.read(8, &mut v);
        assert_eq!(v[3], 0x06, "class byte at 0x0b");
        ecam.read(3 << 15, &mut v);
        assert_eq!(v, [0xff; 4], "empty slot 3");
        ecam.read(1 << 12, &mut v);
        assert_eq!(v, [0xff; 4], "function 1 of the bridge does not exist");
    }

    struct Fake(u32);
    impl PciFunction for Fake {
        fn read_config(&mut self, _offset: u64, data: &mut [u8]) {
            data.copy_from_slice(&self.0.to_le_bytes()[..data.len()]);
        }
        fn write_config(&mut self, _offset: u64, data: &[u8]) -> Option<usize> {
            self.0 = u32::from_le_bytes(data.try_into().unwrap());
            None
        }
    }

    #[test]
    fn functions_take_free_slots() {
        let root = Arc::new(Mutex::new(PciRoot::new()));
        let slot = root
            .lock()
            .unwrap()
            .add(Arc::new(Mutex::new(Fake(7))))
            .unwrap();
        assert_eq!(slot, 1);
        let mut io = PciConfigIo::new(root.clone());
        io.write(0, &cf8(slot, 0x10));
        io.write(4, &42u32.to_le_bytes());
        let mut v = [0u8; 4];
        io.read(4, &mut v);
        assert_eq!(u32::from_le_bytes(v), 42);
        for _ in 2..MAX_DEVICES {
            root.lock()
                .unwrap()
                .add(Arc::new(Mutex::new(Fake(0))))
                .unwrap();
        }
        assert!(
            root.lock()
                .unwrap()
                .add(Arc::new(Mutex::new(Fake(0))))
                .is_none(),
            "32 slots"
        );
        assert!(root.lock().unwrap().remove(0).is_none(), "the bridge stays");
        assert!(root.lock().unwrap().remove(4).is_some());
        assert!(root.lock().unwrap().remove(4).is_none());
        let again = root.lock().unwrap().add(Arc::new(Mutex::new(Fake(0))));
        assert_eq!(again, Some(4), "a freed slot is reused");
    }
}
