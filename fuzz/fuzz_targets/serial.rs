//! The 16550 UART as the VMM wires it (vm-superio's Serial behind `SerialDevice`, on the I/O bus at COM1): register reads and writes of any width, order and value, with host input arriving in between.
#![no_main]

use std::io::Write;
use std::sync::{Arc, Mutex};

use dax_vmm_fuzz::{take_u32, take_u8};
use libfuzzer_sys::fuzz_target;
use vmm::bus::Bus;
use vmm::legacy::serial::{SerialDevice, COM1_PORT, PORT_COUNT};
use vmm_sys_util::eventfd::EventFd;

/// Counts what the guest prints.
struct Out(Arc<Mutex<usize>>);

impl Write for Out {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        *self.0.lock().unwrap() += b.len();
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let printed = Arc::new(Mutex::new(0));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        irq.try_clone().unwrap(),
        Box::new(Out(printed.clone())),
    )));
    let bus = Bus::new();
    bus.insert(serial.clone(), COM1_PORT, PORT_COUNT).unwrap();
    let mut writes = 0;
    let mut pos = 0;
    while pos < data.len() {
        let op = take_u8(data, &mut pos);
        let value = take_u32(data, &mut pos);
        // In and just around the eight registers.
        let addr = COM1_PORT - 2 + u64::from(op >> 4) % (PORT_COUNT + 4);
        let size = [1, 2, 4, 1][usize::from(op >> 2 & 3)];
        match op & 3 {
            0 => {
                if bus.write(addr, &value.to_le_bytes()[..size]) {
                    writes += 1;
                }
            }
            1 => {
                let mut buf = vec![0u8; size];
                bus.read(addr, &mut buf);
            }
            // Host input: up to 16 bytes; the FIFO takes what fits.
            _ => {
                let n = (value as usize % 17).min(data.len() - pos.min(data.len()));
                let input = &data[pos.min(data.len())..][..n];
                let taken = serial.lock().unwrap().enqueue_input(input);
                assert!(taken <= input.len());
                pos += n;
            }
        }
        let _ = irq.read();
    }
    assert!(
        *printed.lock().unwrap() <= writes,
        "more printed than written"
    );
});
