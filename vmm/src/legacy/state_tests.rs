use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use super::*;
use crate::bus::BusDevice;
use crate::legacy::ged::{Ged, EVENT_MEMORY_HOTPLUG, EVENT_POWER_BUTTON};

fn port() -> (SerialDevice, EventFd) {
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    (
        SerialDevice::new(irq.try_clone().unwrap(), Box::new(std::io::sink())),
        irq,
    )
}

fn ged() -> GedHandle {
    GedHandle(Arc::new(Mutex::new(Ged::new(
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    ))))
}

/// Registers set, input queued and events pending on one set of devices
/// come back on fresh ones, through the section's JSON.
#[test]
fn the_uart_and_the_ged_come_back_as_saved() {
    let (mut serial, _irq) = port();
    serial.write(7, &[0x5a]); // scratch
    serial.write(3, &[0x1b]); // line control
    assert_eq!(serial.enqueue_input(b"abc"), 3);
    let mut first = [0u8];
    serial.read(0, &mut first);
    assert_eq!(first[0], b'a');
    let g = ged();
    g.raise(EVENT_POWER_BUTTON | EVENT_MEMORY_HOTPLUG).unwrap();
    let saved = save(Some(&serial), &g);
    let json = serde_json::to_value(&saved).unwrap();
    let saved: LegacyState = serde_json::from_value(json).unwrap();

    let (mut fresh, _irq) = port();
    let fresh_ged = ged();
    restore(&saved, Some(&mut fresh), &fresh_ged).unwrap();
    assert_eq!(fresh.state(), serial.state());
    let mut b = [0u8];
    fresh.read(7, &mut b);
    assert_eq!(b[0], 0x5a);
    fresh.read(0, &mut b);
    assert_eq!(b[0], b'b', "the input the guest had not read");
    let mut ged_bits = [0u8];
    fresh_ged.0.lock().unwrap().read(0, &mut ged_bits);
    assert_eq!(ged_bits[0], EVENT_POWER_BUTTON | EVENT_MEMORY_HOTPLUG);
}

/// A UART with its "data ready" interrupt enabled and input pending
/// raises it again when restored (after the irqchips, by the restore's
/// order), as it would have.
#[test]
fn a_pending_uart_interrupt_is_raised_again() {
    let (mut serial, _irq) = port();
    serial.write(1, &[0x01]); // IER: received data available
    serial.enqueue_input(b"x");
    let saved = save(Some(&serial), &ged());
    let (mut fresh, irq) = port();
    restore(&saved, Some(&mut fresh), &ged()).unwrap();
    assert!(irq.read().unwrap() >= 1);
}

#[test]
fn an_oversized_fifo_or_a_missing_port_is_refused_by_name() {
    let (serial, _irq) = port();
    let mut saved = save(Some(&serial), &ged());
    saved.serial.as_mut().unwrap().in_buffer = vec![0; SERIAL_FIFO_SIZE + 1];
    let (mut fresh, _irq) = port();
    let e = restore(&saved, Some(&mut fresh), &ged()).unwrap_err();
    assert_eq!(e, LegacyStateError::SerialFifo { len: 65 });
    assert!(e.to_string().contains("serial.in_buffer"), "{e}");
    let saved = save(Some(&serial), &ged());
    let e = restore(&saved, None, &ged()).unwrap_err();
    assert_eq!(e, LegacyStateError::NoSerialPort);
    // Saved without a port, restored with one: the UART starts fresh.
    let mut without = saved.clone();
    without.serial = None;
    restore(&without, Some(&mut fresh), &ged()).unwrap();
}
