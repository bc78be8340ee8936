//! The platform devices' part of a snapshot (one `legacy` section): the
//! COM1 UART's registers and input FIFO (vm-superio's `SerialState`,
//! mirrored here with serde) and the GED's pending event bits. The i8042,
//! the ACPI PM registers and pvpanic hold no state of their own: each write
//! to them acts at once (a reset, a power-off, a panic report), and their
//! reads are constants.
//!
//! The restore runs after the irqchips' (vm-superio's `from_state` raises
//! the UART's interrupt again when one was pending, which an irqchip
//! restored afterwards would overwrite).

use serde::{Deserialize, Serialize};
use vm_state::SectionState;

use super::ged::GedHandle;
use super::serial::SerialDevice;

/// The 16550's FIFO, as vm-superio sizes it: a longer saved one is refused.
pub const SERIAL_FIFO_SIZE: usize = 64;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LegacyStateError {
    #[error("legacy: serial: saved with a serial port, restored with --serial off")]
    NoSerialPort,
    #[error(
        "legacy: serial.in_buffer: {len} bytes, more than the UART's {SERIAL_FIFO_SIZE}-byte FIFO"
    )]
    SerialFifo { len: usize },
    #[error("legacy: serial: raising its pending interrupt: {0}")]
    SerialIrq(String),
}

/// The UART's registers (vm-superio's `SerialState`, field for field).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SerialPortState {
    pub baud_divisor_low: u8,
    pub baud_divisor_high: u8,
    pub interrupt_enable: u8,
    pub interrupt_identification: u8,
    pub line_control: u8,
    pub line_status: u8,
    pub modem_control: u8,
    pub modem_status: u8,
    pub scratch: u8,
    /// Input the guest has not read yet.
    pub in_buffer: Vec<u8>,
}

impl From<vm_superio::serial::SerialState> for SerialPortState {
    fn from(s: vm_superio::serial::SerialState) -> Self {
        SerialPortState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer,
        }
    }
}

impl From<&SerialPortState> for vm_superio::serial::SerialState {
    fn from(s: &SerialPortState) -> Self {
        vm_superio::serial::SerialState {
            baud_divisor_low: s.baud_divisor_low,
            baud_divisor_high: s.baud_divisor_high,
            interrupt_enable: s.interrupt_enable,
            interrupt_identification: s.interrupt_identification,
            line_control: s.line_control,
            line_status: s.line_status,
            modem_control: s.modem_control,
            modem_status: s.modem_status,
            scratch: s.scratch,
            in_buffer: s.in_buffer.clone(),
        }
    }
}

/// The `legacy` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegacyState {
    /// None: the VM had no serial port (`--serial off`).
    pub serial: Option<SerialPortState>,
    /// GED events raised that the guest has not read yet.
    pub ged_pending: u8,
}

impl SectionState for LegacyState {
    const KIND: &'static str = "legacy";
    const VERSION: u32 = 1;
}

/// The platform devices' state; the VM is paused (no vCPU touches them).
pub fn save(serial: Option<&SerialDevice>, ged: &GedHandle) -> LegacyState {
    LegacyState {
        serial: serial.map(|s| s.state().into()),
        ged_pending: ged.pending(),
    }
}

/// Puts `state` back into the freshly built devices. A VM restored with a
/// serial port but saved without one starts its UART fresh; the other way
/// round is refused (the guest's driver state would be lost silently).
pub fn restore(
    state: &LegacyState,
    serial: Option<&mut SerialDevice>,
    ged: &GedHandle,
) -> Result<(), LegacyStateError> {
    match (&state.serial, serial) {
        (Some(saved), Some(port)) => {
            if saved.in_buffer.len() > SERIAL_FIFO_SIZE {
                return Err(LegacyStateError::SerialFifo {
                    len: saved.in_buffer.len(),
                });
            }
            port.restore_state(&saved.into())
                .map_err(LegacyStateError::SerialIrq)?;
        }
        (Some(_), None) => return Err(LegacyStateError::NoSerialPort),
        (None, _) => {}
    }
    ged.set_pending(state.ged_pending);
    Ok(())
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
