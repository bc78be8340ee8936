//! The two address-range buses (port I/O and MMIO) every vCPU exit is
//! dispatched on: the legacy devices, the hot-plug controllers and the
//! transports each take a range of one of them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};

/// A device reached through a bus; offsets are relative to its base.
pub trait BusDevice: Send {
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    #[error("bus range {base:#x}+{len:#x} is empty or overflows")]
    InvalidRange { base: u64, len: u64 },
    #[error("bus range {base:#x}+{len:#x} overlaps a device at {other:#x}")]
    Overlap { base: u64, len: u64, other: u64 },
}

type Entry = (u64, Arc<Mutex<dyn BusDevice>>);

/// Devices keyed by base address; each holds `[base, base + len)`.
#[derive(Default)]
pub struct Bus {
    devices: RwLock<BTreeMap<u64, Entry>>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::InvalidRange { base, len })?;
        let mut devices = self.devices.write().unwrap_or_else(|e| e.into_inner());
        if let Some((&other, _)) = devices
            .range(..end)
            .next_back()
            .filter(|(b, (l, _))| **b + *l > base)
        {
            return Err(BusError::Overlap { base, len, other });
        }
        devices.insert(base, (len, device));
        Ok(())
    }

    /// Takes the device at `base` off the bus (hot-unplug, BAR moves).
    pub fn remove(&self, base: u64) -> Option<Arc<Mutex<dyn BusDevice>>> {
        let mut devices = self.devices.write().unwrap_or_else(|e| e.into_inner());
        devices.remove(&base).map(|(_, dev)| dev)
    }

    fn find(&self, addr: u64) -> Option<(u64, Arc<Mutex<dyn BusDevice>>)> {
        let devices = self.devices.read().unwrap_or_else(|e| e.into_inner());
        let (base, (len, dev)) = devices.range(..=addr).next_back()?;
        (addr - base < *len).then(|| (addr - base, dev.clone()))
    }

    /// Returns false when nothing is mapped at `addr`.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr) {
            Some((offset, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .read(offset, data);
                true
            }
            None => false,
        }
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr) {
            Some((offset, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .write(offset, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Recorder(Vec<(u64, u8)>);
    impl BusDevice for Recorder {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset.to_le_bytes()[0]);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.0.push((offset, data[0]));
        }
    }

    #[test]
    fn dispatch_by_range() {
        let bus = Bus::new();
        let dev = Arc::new(Mutex::new(Recorder::default()));
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fa, &mut b));
        assert_eq!(b[0], 2);
        assert!(bus.write(0x3ff, &[9]));
        assert!(!bus.write(0x400, &[9]));
        assert!(!bus.read(0x3f7, &mut b));
        assert_eq!(dev.lock().unwrap().0, vec![(7, 9)]);
    }

    #[test]
    fn rejects_overlap_and_empty_ranges() {
        let bus = Bus::new();
        bus.insert(Arc::new(Mutex::new(Recorder::default())), 0x60, 5)
            .unwrap();
        let e = bus
            .insert(Arc::new(Mutex::new(Recorder::default())), 0x64, 1)
            .unwrap_err();
        assert_eq!(
            e,
            BusError::Overlap {
                base: 0x64,
                len: 1,
                other: 0x60
            }
        );
        assert!(bus
            .insert(Arc::new(Mutex::new(Recorder::default())), 0x50, 0x10)
            .is_ok());
        assert!(bus
            .insert(Arc::new(Mutex::new(Recorder::default())), 0x10, 0)
            .is_err());
        assert!(bus
            .insert(Arc::new(Mutex::new(Recorder::default())), u64::MAX, 2)
            .is_err());
    }
}
