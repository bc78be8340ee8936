//! The 16550 UART on COM1 (0x3f8, IRQ 4), from vm-superio, with its
//! interrupt delivered through a KVM irqfd.

use std::io::Write;
use std::sync::{Arc, Mutex};

use acpi_tables::{aml, Aml};
use vm_superio::{serial::NoEvents, Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

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
        SerialDevice {
            serial: Serial::new(IrqFdTrigger(irq), out),
        }
    }

    /// Describes COM1 in the DSDT. A hardware-reduced ACPI platform has no
    /// legacy PIC, so Linux maps no ISA IRQs by default: without this device
    /// (and its interrupt) the 8250 driver cannot get IRQ 4 and user space
    /// cannot open the console.
    pub fn append_aml(sink: &mut Vec<u8>) {
        let port = const { narrow::u16_of(COM1_PORT) };
        aml::Device::new(
            "_SB_.COM1".into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0501")),
                &aml::Name::new("_UID".into(), &aml::ZERO),
                &aml::Name::new("_DDN".into(), &"COM1"),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![
                        &aml::Interrupt::new(true, true, false, false, COM1_IRQ),
                        &aml::IO::new(port, port, 1, const { narrow::u8_of(PORT_COUNT) }),
                    ]),
                ),
            ],
        )
        .to_aml_bytes(sink);
    }

    /// The UART's registers and input FIFO.
    pub fn state(&self) -> vm_superio::serial::SerialState {
        self.serial.state()
    }

    /// Replaces the UART's registers and FIFO with saved ones, keeping its
    /// interrupt and output. Raises the interrupt if the saved state has
    /// one pending (so only after the irqchips are restored).
    pub fn restore_state(&mut self, state: &vm_superio::serial::SerialState) -> Result<(), String> {
        let irq = self
            .serial
            .interrupt_evt()
            .0
            .try_clone()
            .map_err(|e| format!("duplicating the irqfd: {e}"))?;
        let placeholder = Serial::new(
            IrqFdTrigger(
                irq.try_clone()
                    .map_err(|e| format!("duplicating the irqfd: {e}"))?,
            ),
            Box::new(std::io::sink()) as Box<dyn Write + Send>,
        );
        // vm-superio builds a UART from a state only with its writer; the
        // placeholder lends it one meanwhile. from_state fails only on a
        // FIFO over 64 bytes (the caller refuses those first) or an irqfd
        // that cannot be written; then the port is left writing nowhere
        // and the restore fails, so the VM is dropped anyway.
        let out = std::mem::replace(&mut self.serial, placeholder).into_writer();
        self.serial = Serial::from_state(state, IrqFdTrigger(irq), NoEvents, out)
            .map_err(|e| format!("{e:?}"))?;
        Ok(())
    }

    /// Queues host input for the guest; returns how many bytes fit in the FIFO.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.serial.enqueue_raw_bytes(bytes).unwrap_or(0)
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        // The bus hands out offsets within the device's PORT_COUNT ports.
        if let (Some(first), Ok(offset)) = (data.first_mut(), u8::try_from(offset)) {
            *first = self.serial.read(offset);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let (Some(&v), Ok(offset)) = (data.first(), u8::try_from(offset)) {
            // An output error (a closed stdout) must not stop the guest.
            if let Err(e) = self.serial.write(offset, v) {
                tracing::debug!("serial write: {e:?}");
            }
        }
    }
}

type SharedSerial = Arc<Mutex<SerialDevice>>;

/// Where host input goes: the serial port of the VM running now, if any.
/// The VMM has one stdin but may boot several VMs in turn (vm.reboot,
/// vm.shutdown then vm.boot), so one reader thread serves them all and each
/// VM connects its port for its lifetime.
#[derive(Default)]
pub struct InputRouter {
    target: Mutex<Option<SharedSerial>>,
}

impl InputRouter {
    pub fn connect(&self, serial: SharedSerial) {
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = Some(serial);
    }

    /// Disconnects `serial` if it is still the one connected.
    pub fn disconnect(&self, serial: &SharedSerial) {
        let mut target = self.target.lock().unwrap_or_else(|e| e.into_inner());
        if target.as_ref().is_some_and(|t| Arc::ptr_eq(t, serial)) {
            *target = None;
        }
    }

    /// Hands `bytes` to the connected port. The FIFO holds 64 bytes; a full
    /// FIFO is retried shortly, as a real UART would drop nothing if the
    /// guest keeps reading. With no VM running the input is dropped.
    pub fn feed(&self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let Some(serial) = self
                .target
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
            else {
                return;
            };
            let taken = serial
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .enqueue_input(bytes);
            bytes = &bytes[taken..];
            if taken == 0 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
    }
}

static STDIN_ROUTER: std::sync::OnceLock<Arc<InputRouter>> = std::sync::OnceLock::new();

/// Connects `serial` to the VMM's stdin, starting the one reader thread on
/// first use. Returns the router, to disconnect from when the VM ends.
pub fn connect_stdin(serial: SharedSerial) -> std::io::Result<Arc<InputRouter>> {
    use std::os::fd::AsFd;
    let router = match STDIN_ROUTER.get() {
        Some(r) => r.clone(),
        None => {
            // A duplicate of fd 0, read without std's stdin lock (see vm::RawTerminal).
            let mut stdin = std::fs::File::from(std::io::stdin().as_fd().try_clone_to_owned()?);
            let router = STDIN_ROUTER.get_or_init(Default::default).clone();
            let reader = router.clone();
            std::thread::Builder::new()
                .name("serial-input".into())
                .spawn(move || {
                    use std::io::Read;
                    if let Err(e) = seccomp::enter_thread(crate::seccomp_filters::SERIAL_INPUT) {
                        tracing::error!("serial input: {e}; no console input");
                        return;
                    }
                    let mut buf = [0u8; 64];
                    while let Ok(n @ 1..) = stdin.read(&mut buf) {
                        reader.feed(&buf[..n]);
                    }
                })?;
            router
        }
    };
    router.connect(serial);
    Ok(router)
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

    #[test]
    fn input_goes_to_the_port_connected_now_and_nowhere_after_it_disconnects() {
        let port = || {
            Arc::new(Mutex::new(SerialDevice::new(
                EventFd::new(libc::EFD_NONBLOCK).unwrap(),
                Box::new(std::io::sink()),
            )))
        };
        let first_byte = |p: &SharedSerial| {
            let mut v = [0u8];
            p.lock().unwrap().read(0, &mut v);
            v[0]
        };
        let router = InputRouter::default();
        router.feed(b"lost"); // no VM yet: dropped, not blocked on
        let (old, new) = (port(), port());
        router.connect(old.clone());
        router.feed(b"a");
        assert_eq!(first_byte(&old), b'a');
        // A reboot: the new VM connects before the old one's teardown runs.
        router.connect(new.clone());
        router.disconnect(&old);
        router.feed(b"b");
        assert_eq!(first_byte(&new), b'b');
        assert_eq!(first_byte(&old), 0, "the old port got nothing more");
        router.disconnect(&new);
        router.feed(b"c");
        assert_eq!(first_byte(&new), 0);
    }

    #[test]
    fn aml_describes_com1_with_its_interrupt() {
        let mut aml = Vec::new();
        SerialDevice::append_aml(&mut aml);
        assert!(aml.windows(4).any(|w| w == b"COM1"));
        // Extended interrupt descriptor (0x89), consumer|edge, one GSI = 4.
        assert!(
            aml.windows(9)
                .any(|w| w == [0x89, 0x06, 0x00, 0x03, 0x01, 0x04, 0x00, 0x00, 0x00]),
            "{aml:x?}"
        );
    }
}
