//! The frontend's side of the backend request channel: SHMEM_MAP and
//! SHMEM_UNMAP from the daemon, answered by the DAX window. A refused
//! request is answered with its errno (the crate sends it as the REPLY_ACK
//! value) and logged; the device and the VMM keep running.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use vhost::vhost_user::message::VhostUserMMap;
use vhost::vhost_user::{HandlerResult, VhostUserFrontendReqHandler};

use super::window::{DaxWindow, RequestError};

pub struct DaxRequestHandler {
    id: String,
    window: Arc<DaxWindow>,
}

impl DaxRequestHandler {
    pub fn new(id: String, window: Arc<DaxWindow>) -> Self {
        DaxRequestHandler { id, window }
    }

    fn answer(
        &self,
        what: &str,
        req: &VhostUserMMap,
        r: Result<(), RequestError>,
    ) -> HandlerResult<u64> {
        let (off, len) = (req.shm_offset, req.len);
        match r {
            Ok(()) => {
                tracing::trace!(
                    "fs {}: {what} {len:#x} bytes at window offset {off:#x}",
                    self.id
                );
                Ok(0)
            }
            Err(e) => {
                crate::warn_limited!("fs {}: refused {what} from the daemon: {e}", self.id);
                Err(std::io::Error::from_raw_os_error(e.errno))
            }
        }
    }
}

impl VhostUserFrontendReqHandler for DaxRequestHandler {
    fn shmem_map(&self, req: &VhostUserMMap, fd: &dyn AsRawFd) -> HandlerResult<u64> {
        // The pre-fault runs after the ack ([`super::worker`]).
        self.answer(
            "SHMEM_MAP",
            req,
            self.window.map_deferring_prefault(req, fd),
        )
    }

    fn shmem_unmap(&self, req: &VhostUserMMap) -> HandlerResult<u64> {
        self.answer("SHMEM_UNMAP", req, self.window.unmap(req))
    }
}
