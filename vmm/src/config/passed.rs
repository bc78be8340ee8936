//! A file another process opened and passed to this one (a local
//! migration's sender passes a disk's open image, the vsock's listening
//! socket), carried in a device's config until the device is built on it.
//! Never part of the config's JSON: the fd itself travelled as SCM_RIGHTS.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

/// None, or the passed fd, shared by the config's copies; compared by fd
/// number (as [`super::TapFds`]).
#[derive(Clone, Default)]
pub struct PassedFd(pub Option<Arc<OwnedFd>>);

impl PassedFd {
    pub fn new(fd: OwnedFd) -> Self {
        PassedFd(Some(Arc::new(fd)))
    }

    /// A copy of the fd the device can own (the config keeps its own).
    pub fn try_clone(&self) -> Option<std::io::Result<OwnedFd>> {
        self.0.as_ref().map(|fd| fd.try_clone())
    }

    fn number(&self) -> Option<i32> {
        self.0.as_ref().map(|fd| fd.as_raw_fd())
    }
}

impl PartialEq for PassedFd {
    fn eq(&self, other: &Self) -> bool {
        self.number() == other.number()
    }
}

impl Eq for PassedFd {}

impl std::fmt::Debug for PassedFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PassedFd({:?})", self.number())
    }
}
