//! The pvpanic device (ACPI id `QEMU0001`, one I/O port): the guest kernel's
//! `pvpanic-mmio` driver writes to it when it panics, which ends the VMM with
//! a distinct status instead of a silently rebooting or hanging guest.

use std::sync::Arc;

use acpi_tables::{aml, Aml};

use crate::bus::BusDevice;
use crate::exit::{ExitHandle, VmExit};

pub const PVPANIC_PORT: u16 = 0x505;
const PVPANIC_PANICKED: u8 = 1 << 0;
const PVPANIC_CRASH_LOADED: u8 = 1 << 1;

pub struct PvPanic {
    exit: Arc<ExitHandle>,
}

impl PvPanic {
    pub fn new(exit: Arc<ExitHandle>) -> Self {
        PvPanic { exit }
    }

    /// The DSDT entry the guest driver binds to.
    pub fn append_aml(sink: &mut Vec<u8>) {
        aml::Device::new(
            "PEVT".into(),
            vec![
                &aml::Name::new("_HID".into(), &"QEMU0001"),
                &aml::Name::new("_STA".into(), &0xfu8),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![&aml::IO::new(
                        PVPANIC_PORT,
                        PVPANIC_PORT,
                        1,
                        1,
                    )]),
                ),
            ],
        )
        .to_aml_bytes(sink);
    }
}

impl BusDevice for PvPanic {
    /// Reads return the events this device supports.
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = PVPANIC_PANICKED | PVPANIC_CRASH_LOADED;
        }
    }

    fn write(&mut self, _offset: u64, data: &[u8]) {
        match data.first() {
            Some(v) if v & PVPANIC_PANICKED != 0 => self.exit.request(VmExit::GuestPanic),
            Some(v) if v & PVPANIC_CRASH_LOADED != 0 => {
                virtio_devices::warn_limited!("guest panicked; a crash kernel is taking over")
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panic_event_ends_the_vm() {
        let exit = Arc::new(ExitHandle::new().unwrap());
        let mut dev = PvPanic::new(exit.clone());
        let mut caps = [0u8];
        dev.read(0, &mut caps);
        assert_eq!(caps[0], 3);
        dev.write(0, &[PVPANIC_CRASH_LOADED]);
        assert_eq!(exit.reason(), None);
        dev.write(0, &[PVPANIC_PANICKED]);
        assert_eq!(exit.reason(), Some(VmExit::GuestPanic));
    }

    #[test]
    fn aml_names_the_device() {
        let mut aml = Vec::new();
        PvPanic::append_aml(&mut aml);
        assert!(aml.windows(8).any(|w| w == b"QEMU0001"));
        assert!(aml.windows(4).any(|w| w == b"PEVT"));
    }
}
