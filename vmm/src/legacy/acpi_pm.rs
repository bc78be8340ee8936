//! Hardware-reduced ACPI power management: the FADT's sleep control, sleep
//! status and reset registers, one I/O port each.

use std::sync::Arc;

use crate::bus::BusDevice;
use crate::exit::{ExitHandle, VmExit};

pub const SLEEP_CONTROL_PORT: u16 = 0x600;
pub const SLEEP_STATUS_PORT: u16 = 0x601;
pub const RESET_PORT: u16 = 0x602;
pub const PORT_COUNT: u64 = 3;
/// The value the FADT tells the guest to write to `RESET_PORT`.
pub const RESET_VALUE: u8 = 0x1;
/// SLP_TYP the DSDT's `\_S5` package announces.
pub const S5_SLEEP_TYPE: u8 = 5;
const SLEEP_CONTROL_OFFSET: u64 = 0;
const RESET_OFFSET: u64 = (RESET_PORT - SLEEP_CONTROL_PORT) as u64;
const SLP_EN: u8 = 1 << 5;
const SLP_TYP_SHIFT: u8 = 2;
const SLP_TYP_MASK: u8 = 0x7;

pub struct AcpiPm {
    exit: Arc<ExitHandle>,
}

impl AcpiPm {
    pub fn new(exit: Arc<ExitHandle>) -> Self {
        AcpiPm { exit }
    }
}

impl BusDevice for AcpiPm {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let Some(&v) = data.first() else { return };
        tracing::debug!("acpi pm: write {v:#x} at offset {offset}");
        match offset {
            SLEEP_CONTROL_OFFSET => {
                if v & SLP_EN != 0 && (v >> SLP_TYP_SHIFT) & SLP_TYP_MASK == S5_SLEEP_TYPE {
                    self.exit.request(VmExit::PowerOff);
                } else {
                    virtio_devices::warn_limited!(
                        "guest asked for unsupported sleep state (sleep control {v:#x})"
                    );
                }
            }
            RESET_OFFSET if v == RESET_VALUE => self.exit.request(VmExit::Reset),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s5_powers_off_and_reset_resets() {
        let exit = Arc::new(ExitHandle::new().unwrap());
        let mut pm = AcpiPm::new(exit.clone());
        pm.write(0, &[(3 << SLP_TYP_SHIFT) | SLP_EN]); // S3: not supported
        pm.write(0, &[S5_SLEEP_TYPE << SLP_TYP_SHIFT]); // no SLP_EN
        pm.write(2, &[0x2]);
        assert_eq!(exit.reason(), None);
        // What Linux writes for S5: (5 << 2) | SLP_EN = 0x34.
        pm.write(0, &[0x34]);
        assert_eq!(exit.reason(), Some(VmExit::PowerOff));

        let exit = Arc::new(ExitHandle::new().unwrap());
        AcpiPm::new(exit.clone()).write(2, &[RESET_VALUE]);
        assert_eq!(exit.reason(), Some(VmExit::Reset));
    }

    /// A guest writing an unsupported sleep state in a loop must not flood
    /// the host's log. (Another test may have used this call site's period
    /// already, so at most one.)
    #[test]
    fn repeated_unsupported_sleep_states_log_at_most_one_warning_per_period() {
        virtio_devices::log_limit::capture::start();
        let mut pm = AcpiPm::new(Arc::new(ExitHandle::new().unwrap()));
        for _ in 0..8 {
            pm.write(0, &[(3 << SLP_TYP_SHIFT) | SLP_EN]);
        }
        let warnings = virtio_devices::log_limit::capture::take()
            .into_iter()
            .filter(|(_, m)| m.starts_with("guest asked for unsupported sleep state"))
            .count();
        assert!(warnings <= 1, "{warnings} warnings for 8 writes");
    }
}
