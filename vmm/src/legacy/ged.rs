//! The ACPI Generic Event Device (`ACPI0013`) and a power button
//! (`PNP0C0C`), as Cloud Hypervisor signals `vm.power-button`: the FADT is
//! hardware-reduced, so there is no fixed power-button event; instead the
//! GED's interrupt makes Linux run its `_EVT` method, which reads the
//! pending events from an I/O port and notifies the button device; the
//! guest's ACPI button driver then reports KEY_POWER, and whatever the guest
//! runs on it (systemd-logind, acpid, a test's watcher) powers off.
//! The same interrupt announces PCI hot-plug
//! (`device_manager::hotplug_controller`), CPU hot-plug
//! (`vcpu::hotplug_controller`) and memory hot-plug
//! (`memory::hotplug_controller`). It sits with the fixed platform devices
//! rather than with any of those owners: it is made once at boot at a fixed
//! port, like them, and all three raise it, so none of them owns it.

use std::sync::Mutex;

use acpi_tables::{aml, Aml};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// One byte: pending events, cleared when read.
pub const GED_PORT: u16 = 0x603;
/// The IOAPIC pin (above COM1's 4 and the virtio-MMIO pins 5..=20).
pub const GED_IRQ: u32 = 23;
/// Event bit: the power button was pressed.
pub const EVENT_POWER_BUTTON: u8 = 1 << 0;
/// Event bit: a PCI slot changed (see `device_manager::hotplug_controller`).
pub const EVENT_PCI_HOTPLUG: u8 = 1 << 1;
/// Event bit: vCPUs were added or are to be removed (see `vcpu::hotplug_controller`).
pub const EVENT_CPU_HOTPLUG: u8 = 1 << 2;
/// Event bit: RAM was added (see `memory::hotplug_controller`).
pub const EVENT_MEMORY_HOTPLUG: u8 = 1 << 3;

pub struct Ged {
    pending: Mutex<u8>,
    irq: EventFd,
}

impl Ged {
    pub fn new(irq: EventFd) -> Self {
        Ged {
            pending: Mutex::new(0),
            irq,
        }
    }

    /// Interrupts the guest, which reads `event` (one of the `EVENT_` bits).
    pub fn raise(&self, event: u8) -> std::io::Result<()> {
        *self.pending.lock().unwrap_or_else(|p| p.into_inner()) |= event;
        self.irq.write(1)
    }

    /// The DSDT entries: the GED with its interrupt, event register and
    /// `_EVT` method, and the power button it notifies.
    pub fn append_aml(sink: &mut Vec<u8>) {
        aml::Device::new(
            "\\_SB_.PWRB".into(),
            vec![
                &aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0C0C")),
                &aml::Name::new("_UID".into(), &0u8),
            ],
        )
        .to_aml_bytes(sink);
        let events = aml::Local(0);
        aml::Device::new(
            "\\_SB_.GED_".into(),
            vec![
                &aml::Name::new("_HID".into(), &"ACPI0013"),
                &aml::Name::new("_UID".into(), &0u8),
                &aml::Name::new(
                    "_CRS".into(),
                    &aml::ResourceTemplate::new(vec![&aml::Interrupt::new(
                        true, true, false, false, GED_IRQ,
                    )]),
                ),
                &aml::OpRegion::new(
                    "GDST".into(),
                    aml::OpRegionSpace::SystemIO,
                    &(GED_PORT as usize),
                    &1usize,
                ),
                &aml::Field::new(
                    "GDST".into(),
                    aml::FieldAccessType::Byte,
                    aml::FieldLockRule::NoLock,
                    aml::FieldUpdateRule::WriteAsZeroes,
                    vec![aml::FieldEntry::Named(*b"GDAT", 8)],
                ),
                &aml::Method::new(
                    "_EVT".into(),
                    1,
                    true,
                    vec![
                        &aml::Store::new(&events, &aml::Path::new("GDAT")),
                        &aml::If::new(
                            &aml::Equal::new(
                                &aml::And::new(&aml::Zero {}, &events, &EVENT_POWER_BUTTON),
                                &EVENT_POWER_BUTTON,
                            ),
                            vec![&aml::Notify::new(&aml::Path::new("\\_SB_.PWRB"), &0x80u8)],
                        ),
                        &aml::If::new(
                            &aml::Equal::new(
                                &aml::And::new(&aml::Zero {}, &events, &EVENT_PCI_HOTPLUG),
                                &EVENT_PCI_HOTPLUG,
                            ),
                            vec![&aml::MethodCall::new("\\_SB_.PHPR.PSCN".into(), vec![])],
                        ),
                        &aml::If::new(
                            &aml::Equal::new(
                                &aml::And::new(&aml::Zero {}, &events, &EVENT_CPU_HOTPLUG),
                                &EVENT_CPU_HOTPLUG,
                            ),
                            vec![&aml::MethodCall::new("\\_SB_.CPUS.CSCN".into(), vec![])],
                        ),
                        &aml::If::new(
                            &aml::Equal::new(
                                &aml::And::new(&aml::Zero {}, &events, &EVENT_MEMORY_HOTPLUG),
                                &EVENT_MEMORY_HOTPLUG,
                            ),
                            vec![&aml::MethodCall::new("\\_SB_.MHPC.MSCN".into(), vec![])],
                        ),
                    ],
                ),
            ],
        )
        .to_aml_bytes(sink);
    }
}

impl BusDevice for Ged {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|p| p.into_inner()));
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

/// The bus owns the device; the VM keeps this handle to press the button.
#[derive(Clone)]
pub struct GedHandle(pub std::sync::Arc<Mutex<Ged>>);

impl GedHandle {
    /// The events raised that the guest has not read yet.
    pub fn pending(&self) -> u8 {
        *self
            .lock()
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Puts saved pending events back (a restore); raises no interrupt:
    /// one already raised is in the restored irqchip's state.
    pub fn set_pending(&self, events: u8) {
        *self
            .lock()
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = events;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ged> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn raise(&self, event: u8) -> std::io::Result<()> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .raise(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_press_interrupts_and_is_read_once() {
        let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let mut ged = Ged::new(irq.try_clone().unwrap());
        let mut b = [0u8];
        ged.read(0, &mut b);
        assert_eq!(b[0], 0);
        ged.raise(EVENT_POWER_BUTTON).unwrap();
        assert_eq!(irq.read().unwrap(), 1);
        ged.read(0, &mut b);
        assert_eq!(b[0], EVENT_POWER_BUTTON);
        ged.read(0, &mut b);
        assert_eq!(b[0], 0, "cleared by the read");
        let mut aml = Vec::new();
        Ged::append_aml(&mut aml);
        for name in [b"_EVT", b"GDAT", b"PSCN", b"CSCN", b"MSCN"] {
            assert!(aml.windows(4).any(|w| w == name));
        }
    }
}
