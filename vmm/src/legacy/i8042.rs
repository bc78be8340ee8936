//! Just enough of the i8042 keyboard controller for the guest to reset the
//! machine (command 0xfe on port 0x64), which Linux tries on reboot.

use std::sync::Arc;

use crate::bus::BusDevice;
use crate::exit::{ExitHandle, VmExit};

pub const I8042_PORT: u64 = 0x60;
pub const PORT_COUNT: u64 = 5;
const COMMAND_OFFSET: u64 = 4;
const CMD_RESET_CPU: u8 = 0xfe;

pub struct I8042 {
    exit: Arc<ExitHandle>,
}

impl I8042 {
    pub fn new(exit: Arc<ExitHandle>) -> Self {
        I8042 { exit }
    }
}

impl BusDevice for I8042 {
    /// Status and data read as 0: no key pending, input buffer empty, so a
    /// driver waiting for the controller never spins.
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        tracing::debug!("i8042: write {data:x?} at offset {offset}");
        if offset == COMMAND_OFFSET && data.first() == Some(&CMD_RESET_CPU) {
            self.exit.request(VmExit::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_requests_reset() {
        let exit = Arc::new(ExitHandle::new().unwrap());
        let mut dev = I8042::new(exit.clone());
        dev.write(0, &[CMD_RESET_CPU]);
        assert_eq!(exit.reason(), None, "0xfe on the data port is not a reset");
        dev.write(COMMAND_OFFSET, &[0xaa]);
        assert_eq!(exit.reason(), None);
        dev.write(COMMAND_OFFSET, &[CMD_RESET_CPU]);
        assert_eq!(exit.reason(), Some(VmExit::Reset));
    }
}
