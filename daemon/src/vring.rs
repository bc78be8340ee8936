//! The daemon's vring: vhost-user-backend's `VringRwLock`, plus the error
//! eventfd the VMM hands over with `VHOST_USER_SET_VRING_ERR` and a
//! "broken" state.
//!
//! The crate stores that eventfd where a backend cannot reach it, so this
//! wrapper keeps a duplicate. When a queue cannot be served any more (the
//! guest published an impossible ring index, a used-ring write failed), the
//! queue is marked broken: its requests are no longer popped (no spin, no
//! thread that silently ends), the reason is logged once, and the error
//! eventfd tells the VMM, which sets DEVICE_NEEDS_RESET for the driver. A
//! reset of the queue by the VMM (a new SET_VRING_* sequence) clears it.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use vhost_user_backend::{VringRwLock, VringStateGuard, VringStateMutGuard, VringT};
use virtio_queue::Error as VirtQueError;
use vm_memory::GuestAddressSpace;

#[derive(Clone)]
pub struct FsVring<M: GuestAddressSpace> {
    inner: VringRwLock<M>,
    err: Arc<Mutex<Option<OwnedFd>>>,
    broken: Arc<AtomicBool>,
}

impl<M: GuestAddressSpace> FsVring<M> {
    /// Marks the queue broken and tells the VMM; true the first time (the
    /// caller logs the reason then, and only then).
    pub fn mark_broken(&self) -> bool {
        if self.broken.swap(true, Ordering::SeqCst) {
            return false;
        }
        if let Some(fd) = self.err.lock().unwrap_or_else(|p| p.into_inner()).as_ref() {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to an eventfd we own.
            if unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) } != 8 {
                crate::error_limited!(
                    "telling the VMM about a broken queue: {}",
                    io::Error::last_os_error()
                );
            }
        }
        true
    }

    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }
}

impl<'a, M: 'a + GuestAddressSpace> VringStateGuard<'a, M> for FsVring<M> {
    type G = <VringRwLock<M> as VringStateGuard<'a, M>>::G;
}

impl<'a, M: 'a + GuestAddressSpace> VringStateMutGuard<'a, M> for FsVring<M> {
    type G = <VringRwLock<M> as VringStateMutGuard<'a, M>>::G;
}

impl<M: 'static + GuestAddressSpace> VringT<M> for FsVring<M> {
    fn new(mem: M, max_queue_size: u16) -> Result<Self, VirtQueError> {
        Ok(FsVring {
            inner: VringRwLock::new(mem, max_queue_size)?,
            err: Default::default(),
            broken: Default::default(),
        })
    }

    fn get_ref(&self) -> <Self as VringStateGuard<'_, M>>::G {
        self.inner.get_ref()
    }

    fn get_mut(&self) -> <Self as VringStateMutGuard<'_, M>>::G {
        self.inner.get_mut()
    }

    fn add_used(&self, desc_index: u16, len: u32) -> Result<(), VirtQueError> {
        self.inner.add_used(desc_index, len)
    }

    fn signal_used_queue(&self) -> io::Result<()> {
        self.inner.signal_used_queue()
    }

    fn enable_notification(&self) -> Result<bool, VirtQueError> {
        self.inner.enable_notification()
    }

    fn disable_notification(&self) -> Result<(), VirtQueError> {
        self.inner.disable_notification()
    }

    fn needs_notification(&self) -> Result<bool, VirtQueError> {
        self.inner.needs_notification()
    }

    fn set_enabled(&self, enabled: bool) {
        self.inner.set_enabled(enabled)
    }

    fn set_queue_info(
        &self,
        desc_table: u64,
        avail_ring: u64,
        used_ring: u64,
    ) -> Result<(), VirtQueError> {
        // The VMM sets a queue up again after a reset: it may be served anew.
        self.broken.store(false, Ordering::SeqCst);
        self.inner.set_queue_info(desc_table, avail_ring, used_ring)
    }

    fn queue_next_avail(&self) -> u16 {
        self.inner.queue_next_avail()
    }

    fn set_queue_next_avail(&self, base: u16) {
        self.inner.set_queue_next_avail(base)
    }

    fn set_queue_next_used(&self, idx: u16) {
        self.inner.set_queue_next_used(idx)
    }

    fn queue_used_idx(&self) -> Result<u16, VirtQueError> {
        self.inner.queue_used_idx()
    }

    fn set_queue_size(&self, num: u16) {
        self.inner.set_queue_size(num)
    }

    fn set_queue_event_idx(&self, enabled: bool) {
        self.inner.set_queue_event_idx(enabled)
    }

    fn set_queue_ready(&self, ready: bool) {
        self.inner.set_queue_ready(ready)
    }

    fn set_kick(&self, file: Option<File>) {
        self.inner.set_kick(file)
    }

    fn read_kick(&self) -> io::Result<bool> {
        self.inner.read_kick()
    }

    fn set_call(&self, file: Option<File>) {
        self.inner.set_call(file)
    }

    fn set_err(&self, file: Option<File>) {
        let dup = file.as_ref().and_then(|f| {
            // SAFETY: dup of an fd the caller owns; the duplicate is owned here.
            let fd = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
            // SAFETY: `fd` was just created and is owned by nobody else.
            (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) })
        });
        *self.err.lock().unwrap_or_else(|p| p.into_inner()) = dup;
        self.inner.set_err(file)
    }
}
