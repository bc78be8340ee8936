//! Why the VM stopped, reported once by whichever thread sees it first.

use std::sync::Mutex;

use vmm_sys_util::eventfd::EventFd;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VmExit {
    /// ACPI S5 (e.g. `poweroff -f`).
    PowerOff,
    /// ACPI reset register or i8042 reset. The VMM does not reboot guests.
    Reset,
    /// The guest kernel reported a panic through the pvpanic device.
    GuestPanic,
    /// KVM_EXIT_SHUTDOWN: the guest triple-faulted.
    TripleFault { cpu: u32 },
    /// A vCPU hit a KVM error or an exit it cannot handle.
    VcpuError { cpu: u32, message: String },
    /// SIGTERM or SIGINT asked the VMM to stop.
    Signal(i32),
}

impl VmExit {
    /// The VMM's exit status: 0 when the guest or the operator ended the VM
    /// on purpose, 1 for a failure, 3 for a guest kernel panic.
    pub fn status(&self) -> u8 {
        match self {
            VmExit::PowerOff | VmExit::Reset | VmExit::Signal(_) => 0,
            VmExit::GuestPanic => 3,
            VmExit::TripleFault { .. } | VmExit::VcpuError { .. } => 1,
        }
    }

    pub fn message(&self) -> String {
        match self {
            VmExit::PowerOff => "guest powered off".into(),
            VmExit::Reset => "guest requested a reset; stopping (reboot is not supported)".into(),
            VmExit::GuestPanic => "guest kernel panicked (pvpanic)".into(),
            VmExit::TripleFault { cpu } => {
                format!("vCPU {cpu}: guest triple fault (KVM_EXIT_SHUTDOWN)")
            }
            VmExit::VcpuError { cpu, message } => format!("vCPU {cpu}: {message}"),
            VmExit::Signal(sig) => format!("stopped by signal {sig}"),
        }
    }
}

/// Shared by vCPUs and devices; the first reason wins, the main loop wakes on the eventfd.
pub struct ExitHandle {
    reason: Mutex<Option<VmExit>>,
    evt: EventFd,
}

impl ExitHandle {
    pub fn new() -> std::io::Result<Self> {
        Ok(ExitHandle {
            reason: Mutex::new(None),
            evt: EventFd::new(libc::EFD_NONBLOCK)?,
        })
    }

    pub fn request(&self, exit: VmExit) {
        let mut reason = self.reason.lock().unwrap_or_else(|e| e.into_inner());
        if reason.is_none() {
            *reason = Some(exit);
            // A full counter already means "wake up", so a failed write loses nothing.
            let _ = self.evt.write(1);
        }
    }

    pub fn reason(&self) -> Option<VmExit> {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn eventfd(&self) -> &EventFd {
        &self.evt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_reason_wins() {
        let h = ExitHandle::new().unwrap();
        assert_eq!(h.reason(), None);
        h.request(VmExit::GuestPanic);
        h.request(VmExit::PowerOff);
        assert_eq!(h.reason(), Some(VmExit::GuestPanic));
        assert_eq!(h.eventfd().read().unwrap(), 1);
    }

    #[test]
    fn statuses() {
        assert_eq!(VmExit::PowerOff.status(), 0);
        assert_eq!(VmExit::Reset.status(), 0);
        assert_eq!(VmExit::GuestPanic.status(), 3);
        assert_eq!(VmExit::TripleFault { cpu: 1 }.status(), 1);
    }
}
