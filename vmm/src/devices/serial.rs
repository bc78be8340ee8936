//! The 16550 UART on COM1 (0x3f8, IRQ 4), from vm-superio, with its
//! interrupt delivered through a KVM irqfd.

use std::io::Write;
use std::sync::{Arc, Mutex};

use vm_superio::{serial::NoEvents, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use super::BusDevice;

pub const COM1_PORT: u64 = 0x3f8;
pub const COM1_IRQ: u32 = 4;
pub const PORT_COUNT: u64 = 8;

/// Raises the serial IRQ by signalling the irqfd KVM watches.
pub struct IrqFdTrigger(pub EventFd);

impl Trigger for IrqFdTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

pub struct SerialDevice {
    serial: Serial<IrqFdTrigger, NoEvents, Box<dyn Write + Send>>,
}

impl SerialDevice {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        SerialDevice { serial: Serial::new(IrqFdTrigger(irq), out) }
    }

    /// Queues host input for the guest; returns how many bytes fit in the FIFO.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.serial.enqueue_raw_bytes(bytes).unwrap_or(0)
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if let Some(first) = data.first_mut() {
            *first = self.serial.read(offset as u8);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(&v) = data.first() {
            // An output error (a closed stdout) must not stop the guest.
            if let Err(e) = self.serial.write(offset as u8, v) {
                log::debug!("serial write: {e:?}");
            }
        }
    }
}

/// Feeds the VMM's stdin to the guest until EOF. The FIFO holds 64 bytes; a
/// full FIFO is retried shortly, as a real UART would drop nothing if the
/// guest keeps reading.
pub fn spawn_stdin_reader(serial: Arc<Mutex<SerialDevice>>) -> std::io::Result<()> {
    std::thread::Builder::new().name("serial-input".into()).spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        while let Ok(n) = stdin.read(&mut buf) {
            if n == 0 {
                break;
            }
            let mut pending = &buf[..n];
            while !pending.is_empty() {
                let taken = serial.lock().unwrap_or_else(|e| e.into_inner()).enqueue_input(pending);
                pending = &pending[taken..];
                if taken == 0 {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
            }
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Shared(Arc<Mutex<Vec<u8>>>);
    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn output_reaches_the_writer_and_raises_the_irq_when_enabled() {
        let out = Arc::new(Mutex::new(Vec::new()));
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut dev = SerialDevice::new(irq.try_clone().unwrap(), Box::new(Shared(out.clone())));
        dev.write(1, &[0x02]); // IER: THR empty interrupt
        for b in b"hi" {
            dev.write(0, &[*b]);
        }
        assert_eq!(&*out.lock().unwrap(), b"hi");
        assert!(irq.read().unwrap() >= 1);
        assert_eq!(dev.enqueue_input(b"x"), 1);
        let mut v = [0u8];
        dev.read(0, &mut v);
        assert_eq!(v[0], b'x');
    }
}
