//! KVM's GSI routing table: the irqchip pins every VM has, plus one MSI route
//! per MSI-X vector, so a vector can be raised by writing an irqfd — from a
//! VMM thread, or from a vhost-user backend without the VMM.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kvm_bindings::{
    kvm_irq_routing_entry, kvm_irq_routing_entry__bindgen_ty_1, kvm_irq_routing_irqchip,
    kvm_irq_routing_msi, KvmIrqRouting, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI,
};
use kvm_ioctls::VmFd;
use pci::msix::MsixEntry;
use virtio_devices::transport::pci::device::MsiSender;
use vmm_sys_util::eventfd::EventFd;

/// GSIs below this are IOAPIC pins.
const FIRST_MSI_GSI: u32 = 24;
/// KVM's routing table holds at most this many entries (KVM_MAX_IRQ_ROUTES).
const MAX_GSI: u32 = 4096;

#[derive(Debug, thiserror::Error)]
pub enum GsiError {
    #[error("KVM_SET_GSI_ROUTING: {0}")]
    SetRouting(kvm_ioctls::Error),
    #[error("building the routing table: {0:?}")]
    Table(vmm_sys_util::fam::Error),
    #[error("irqfd for GSI {gsi}: {source}")]
    Irqfd { gsi: u32, source: kvm_ioctls::Error },
    #[error("all {MAX_GSI} GSI routes are in use")]
    Exhausted,
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The routes, the next GSI never handed out, and GSIs given back.
struct Routes {
    table: BTreeMap<u32, Vec<kvm_irq_routing_entry>>,
    next: u32,
    free: Vec<u32>,
}

fn irqchip_route(gsi: u32, irqchip: u32, pin: u32) -> kvm_irq_routing_entry {
    kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        u: kvm_irq_routing_entry__bindgen_ty_1 {
            irqchip: kvm_irq_routing_irqchip { irqchip, pin },
        },
        ..Default::default()
    }
}

fn msi_route(gsi: u32, e: MsixEntry) -> kvm_irq_routing_entry {
    kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_MSI,
        u: kvm_irq_routing_entry__bindgen_ty_1 {
            msi: kvm_irq_routing_msi {
                address_lo: e.addr_lo,
                address_hi: e.addr_hi,
                data: e.data,
                ..Default::default()
            },
        },
        ..Default::default()
    }
}

pub struct GsiRouter {
    vm: Arc<VmFd>,
    state: Mutex<Routes>,
}

impl GsiRouter {
    /// Installs the routes KVM has by default (PIC and IOAPIC pins), which
    /// KVM_SET_GSI_ROUTING would otherwise drop.
    pub fn new(vm: Arc<VmFd>) -> Result<Arc<Self>, GsiError> {
        let mut routes: BTreeMap<u32, Vec<kvm_irq_routing_entry>> = BTreeMap::new();
        for gsi in 0..FIRST_MSI_GSI {
            let entry = routes.entry(gsi).or_default();
            if gsi < 8 {
                entry.push(irqchip_route(gsi, KVM_IRQCHIP_PIC_MASTER, gsi));
            } else if gsi < 16 {
                entry.push(irqchip_route(gsi, KVM_IRQCHIP_PIC_SLAVE, gsi - 8));
            }
            entry.push(irqchip_route(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        }
        let router = Arc::new(GsiRouter {
            vm,
            state: Mutex::new(Routes {
                table: routes,
                next: FIRST_MSI_GSI,
                free: Vec::new(),
            }),
        });
        router.commit(&router.state.lock().unwrap_or_else(|e| e.into_inner()).table)?;
        Ok(router)
    }

    fn commit(&self, routes: &BTreeMap<u32, Vec<kvm_irq_routing_entry>>) -> Result<(), GsiError> {
        let mut table = KvmIrqRouting::new(0).map_err(GsiError::Table)?;
        for e in routes.values().flatten() {
            table.push(*e).map_err(GsiError::Table)?;
        }
        self.vm
            .set_gsi_routing(&table)
            .map_err(GsiError::SetRouting)
    }

    /// A GSI for an MSI route, set by `set_msi`: one given back by a
    /// removed device, else a new one.
    pub fn allocate_msi(&self) -> Result<u32, GsiError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(gsi) = state.free.pop() {
            return Ok(gsi);
        }
        if state.next >= MAX_GSI {
            return Err(GsiError::Exhausted);
        }
        state.next += 1;
        Ok(state.next - 1)
    }

    pub fn set_msi(&self, gsi: u32, entry: MsixEntry) -> Result<(), GsiError> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.table.insert(gsi, vec![msi_route(gsi, entry)]);
        self.commit(&state.table)
    }

    /// The routes as the table KVM was last given holds them: (GSI, type,
    /// then irqchip and pin, or MSI address low, high and data).
    #[cfg(test)]
    pub(crate) fn routes(&self) -> Vec<(u32, u32, [u32; 3])> {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state
            .table
            .values()
            .flatten()
            .map(|e| {
                // SAFETY: `type_` says which member of the union was written.
                let u = unsafe {
                    if e.type_ == KVM_IRQ_ROUTING_MSI {
                        [e.u.msi.address_lo, e.u.msi.address_hi, e.u.msi.data]
                    } else {
                        [e.u.irqchip.irqchip, e.u.irqchip.pin, 0]
                    }
                };
                (e.gsi, e.type_, u)
            })
            .collect()
    }

    /// Drops `gsi`'s route and makes the GSI available again.
    fn release_msi(&self, gsi: u32) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if state.table.remove(&gsi).is_some() {
            if let Err(e) = self.commit(&state.table) {
                virtio_devices::warn_limited!("GSI {gsi}: removing its route: {e}");
            }
        }
        state.free.push(gsi);
    }
}

/// MSI-X vectors of one device, each an irqfd on its own routed GSI.
///
/// An irqfd is attached to KVM only while its vector is unmasked: KVM has no
/// masked routes, and a vhost-user backend writes the irqfd without asking
/// the VMM. A write while detached stays in the eventfd's counter, and KVM
/// injects it when the irqfd is attached again (KVM_IRQFD polls the eventfd
/// on assignment), which is the pending-bit behaviour MSI-X asks for.
pub struct IrqfdMsi {
    router: Arc<GsiRouter>,
    vectors: Vec<(u32, EventFd)>,
    /// Per vector: is its irqfd attached to KVM now.
    attached: Mutex<Vec<bool>>,
}

impl IrqfdMsi {
    /// `count` vectors, all masked (detached), as MSI-X starts.
    pub fn new(router: Arc<GsiRouter>, count: u16) -> Result<Self, GsiError> {
        // Built up in the value itself, so a failure half-way gives back
        // (through Drop) the GSIs already taken.
        let mut msi = IrqfdMsi {
            router,
            vectors: Vec::with_capacity(usize::from(count)),
            attached: Mutex::new(vec![false; usize::from(count)]),
        };
        for _ in 0..count {
            let evt = EventFd::new(libc::EFD_NONBLOCK)?;
            msi.vectors.push((msi.router.allocate_msi()?, evt));
        }
        Ok(msi)
    }
}

/// A removed device gives its vectors back: irqfds detached, routes gone.
impl Drop for IrqfdMsi {
    fn drop(&mut self) {
        let attached = self.attached.get_mut().unwrap_or_else(|e| e.into_inner());
        for ((gsi, evt), on) in self.vectors.iter().zip(attached.iter()) {
            if *on {
                let _ = self.router.vm.unregister_irqfd(evt, *gsi);
            }
            self.router.release_msi(*gsi);
        }
    }
}

impl MsiSender for IrqfdMsi {
    fn send(&self, vector: u16, _entry: MsixEntry) -> std::io::Result<()> {
        match self.vectors.get(usize::from(vector)) {
            Some((_, evt)) => evt.write(1),
            None => Err(std::io::Error::other(format!("no MSI-X vector {vector}"))),
        }
    }

    fn update(&self, vector: u16, entry: MsixEntry) -> std::io::Result<()> {
        let Some((gsi, _)) = self.vectors.get(usize::from(vector)) else {
            return Ok(());
        };
        self.router
            .set_msi(*gsi, entry)
            .map_err(|e| std::io::Error::other(e.to_string()))
    }

    fn notifier(&self, vector: u16) -> Option<EventFd> {
        self.vectors
            .get(usize::from(vector))
            .and_then(|(_, evt)| evt.try_clone().ok())
    }

    /// A write to a detached irqfd waits in its eventfd's counter; taking
    /// it (a non-blocking read) leaves nothing for KVM to inject later, so
    /// the caller must keep it as pending.
    fn take_pending(&self, vector: u16) -> bool {
        let Some((_, evt)) = self.vectors.get(usize::from(vector)) else {
            return false;
        };
        let attached = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        // Attached: KVM has taken (or will take) the write itself.
        !attached[usize::from(vector)] && evt.read().is_ok_and(|n| n > 0)
    }

    fn set_masked(&self, vector: u16, masked: bool) -> std::io::Result<()> {
        let Some((gsi, evt)) = self.vectors.get(usize::from(vector)) else {
            return Ok(());
        };
        let mut attached = self.attached.lock().unwrap_or_else(|e| e.into_inner());
        let slot = &mut attached[usize::from(vector)];
        if *slot != masked {
            return Ok(());
        }
        let result = if masked {
            self.router.vm.unregister_irqfd(evt, *gsi)
        } else {
            self.router.vm.register_irqfd(evt, *gsi)
        };
        result.map_err(|source| std::io::Error::other(GsiError::Irqfd { gsi: *gsi, source }))?;
        *slot = !masked;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use kvm_ioctls::Kvm;

    use super::*;

    /// A notifier written while its vector is masked is taken once as
    /// pending; written while unmasked it is KVM's, not pending.
    #[test]
    fn a_write_held_back_by_a_mask_is_taken_once_as_pending() {
        let Ok(kvm) = Kvm::new() else {
            eprintln!("no /dev/kvm; skipped");
            return;
        };
        let vm = Arc::new(kvm.create_vm().expect("KVM_CREATE_VM"));
        vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
        let router = GsiRouter::new(vm).expect("router");
        let msi = IrqfdMsi::new(router, 2).expect("vectors");
        assert!(!msi.take_pending(0), "nothing written");
        msi.notifier(0).unwrap().write(1).unwrap();
        assert!(msi.take_pending(0));
        assert!(!msi.take_pending(0), "taken once");
        msi.update(1, MsixEntry::default()).unwrap();
        msi.set_masked(1, false).unwrap();
        msi.notifier(1).unwrap().write(1).unwrap();
        assert!(!msi.take_pending(1), "unmasked: KVM's");
        assert!(!msi.take_pending(7), "no such vector");
    }
}
