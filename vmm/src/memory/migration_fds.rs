//! Guest RAM in a local migration: no bytes are copied, each region's
//! memfd is passed over the unix socket (`MemoryFd`, SCM_RIGHTS) and the
//! new VMM maps the same pages.
//!
//! As Cloud Hypervisor's `Vm::send_memory_fds` does, one `MemoryFd` goes
//! per KVM slot with the slot number as its 4-byte payload, and the
//! receiver answers each with a response. The slot alone says nothing of
//! where the region lies in its file (boot RAM's one memfd spans the
//! 32-bit hole at two offsets), so the regions' addresses and offsets come
//! later, in the layout ([`MemoryLayoutState`]) the `Config` step carries;
//! the receiver keeps the fds by slot until then and checks each against
//! its region before mapping it: a regular file (a memfd is one), large
//! enough to hold the region at its offset, and no fd left over.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use vm_memory::{FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vm_state::protocol::{self, Command, ProtocolError, Request, Response, Status};

use super::snapshot::{MemoryLayoutState, MemorySnapshotError, MAX_RAM_REGIONS};
use super::GuestMemoryMmap;

#[derive(Debug, thiserror::Error)]
pub enum MemoryFdError {
    /// Cloud Hypervisor's words for the same refusal.
    #[error("Local migration requires shared memory or hugepages enabled (guest RAM at {gpa:#x} is private)")]
    NotShared { gpa: u64 },
    #[error("guest RAM at {gpa:#x} is in the layout but not in this VM's memory")]
    NotInMemory { gpa: u64 },
    #[error("MemoryFd for slot {slot}: the receiver answered {status:?}")]
    Refused { slot: u32, status: Status },
    #[error("MemoryFd: {0}")]
    Protocol(#[from] ProtocolError),
    #[error("MemoryFd: expected a MemoryFd request, got {0:?}")]
    NotMemoryFd(Command),
    #[error("MemoryFd for slot {slot}: a second fd for the same slot")]
    DuplicateSlot { slot: u32 },
    #[error("MemoryFd: more than {MAX_RAM_REGIONS} fds")]
    TooMany,
    #[error("MemoryFd for slot {slot}: fstat failed: {source}")]
    Stat { slot: u32, source: io::Error },
    #[error("MemoryFd for slot {slot}: the fd is not a regular file (a memfd is one)")]
    NotRegularFile { slot: u32 },
    #[error("slot {slot} (guest RAM at {gpa:#x}): no MemoryFd came for it")]
    MissingSlot { slot: u32, gpa: u64 },
    #[error("slot {slot}: a MemoryFd came for it, but the layout has no region on that slot")]
    UnusedSlot { slot: u32 },
    #[error(
        "slot {slot} (guest RAM at {gpa:#x}): the file holds {size} bytes, \
         but the region needs {needed} (offset {offset:#x} + length {length:#x})"
    )]
    TooSmall {
        slot: u32,
        gpa: u64,
        size: u64,
        offset: u64,
        length: u64,
        needed: u64,
    },
    #[error("slot {slot} (guest RAM at {gpa:#x}): the layout gives it no file offset")]
    NoFileOffset { slot: u32, gpa: u64 },
    #[error("slot {slot}: duplicating the received fd failed: {source}")]
    Dup { slot: u32, source: io::Error },
    #[error("mapping the received guest RAM failed: {0}")]
    Map(String),
    #[error(transparent)]
    Layout(#[from] MemorySnapshotError),
}

/// Sends one `MemoryFd` per region of `layout` (its slot, its memfd) and
/// waits for the receiver's answer to each. Every region is checked to
/// have a memfd before the first is sent, so private RAM is refused with
/// nothing sent. Each answer is waited for as long as the socket's read
/// timeout allows: the caller sets one, so a silent receiver ends it.
pub fn send_memory_fds(
    socket: &UnixStream,
    layout: &MemoryLayoutState,
    mem: &GuestMemoryMmap,
) -> Result<(), MemoryFdError> {
    let mut files = Vec::with_capacity(layout.regions.len());
    for r in &layout.regions {
        let region = mem
            .find_region(GuestAddress(r.gpa))
            .filter(|m| m.start_addr().0 == r.gpa && m.len() == r.length)
            .ok_or(MemoryFdError::NotInMemory { gpa: r.gpa })?;
        let file = region
            .file_offset()
            .ok_or(MemoryFdError::NotShared { gpa: r.gpa })?;
        files.push((r.slot, file.file()));
    }
    for (slot, file) in files {
        protocol::send_request_with_fd(
            socket,
            Command::MemoryFd,
            &protocol::encode_memory_fd_slot(slot),
            file.as_fd(),
        )?;
        let response = Response::read_from(&mut &*socket)?;
        if response.status() != Status::Ok {
            return Err(MemoryFdError::Refused {
                slot,
                status: response.status(),
            });
        }
    }
    Ok(())
}

/// The fds received so far, by slot, until the layout comes to check and
/// map them.
#[derive(Debug, Default)]
pub struct ReceivedMemoryFds {
    by_slot: BTreeMap<u32, File>,
}

impl ReceivedMemoryFds {
    /// No fd came (the sender sends RAM through the stream instead).
    pub fn is_empty(&self) -> bool {
        self.by_slot.is_empty()
    }

    /// Receives the payload and fd of `request` (a `MemoryFd` whose header
    /// was read): a regular file, on a slot not seen before, at most
    /// [`MAX_RAM_REGIONS`] in all. Returns the slot; the caller answers.
    /// The wait for the payload is bounded by the socket's read timeout.
    pub fn receive(
        &mut self,
        socket: &UnixStream,
        request: &Request,
    ) -> Result<u32, MemoryFdError> {
        if request.command() != Command::MemoryFd {
            return Err(MemoryFdError::NotMemoryFd(request.command()));
        }
        let (payload, fd) = protocol::recv_payload_with_fd(socket, request)?;
        let slot = protocol::decode_memory_fd_slot(&payload)?;
        if self.by_slot.contains_key(&slot) {
            return Err(MemoryFdError::DuplicateSlot { slot });
        }
        if self.by_slot.len() >= MAX_RAM_REGIONS {
            return Err(MemoryFdError::TooMany);
        }
        let file = File::from(fd);
        let kind = file
            .metadata()
            .map_err(|source| MemoryFdError::Stat { slot, source })?
            .file_type();
        // A memfd is a regular file; a socket, pipe or device could not
        // back guest RAM the way the layout says.
        if !kind.is_file() {
            return Err(MemoryFdError::NotRegularFile { slot });
        }
        self.by_slot.insert(slot, file);
        Ok(slot)
    }

    /// Maps every region of `layout` from the fd of its slot, each checked
    /// by fstat to hold the region at its offset; an fd no region uses is
    /// refused too (the sender and the layout disagree).
    pub fn into_guest_memory(
        self,
        layout: &MemoryLayoutState,
    ) -> Result<GuestMemoryMmap, MemoryFdError> {
        layout.validate()?;
        let mut ranges = Vec::with_capacity(layout.regions.len());
        for r in &layout.regions {
            let (slot, gpa) = (r.slot, r.gpa);
            let file = self
                .by_slot
                .get(&slot)
                .ok_or(MemoryFdError::MissingSlot { slot, gpa })?;
            let offset = r
                .file_offset
                .ok_or(MemoryFdError::NoFileOffset { slot, gpa })?;
            let size = file
                .metadata()
                .map_err(|source| MemoryFdError::Stat { slot, source })?
                .len();
            // validate() checked that offset + length does not wrap.
            let needed = offset.saturating_add(r.length);
            if size < needed {
                return Err(MemoryFdError::TooSmall {
                    slot,
                    gpa,
                    size,
                    offset,
                    length: r.length,
                    needed,
                });
            }
            let file = file
                .try_clone()
                .map_err(|source| MemoryFdError::Dup { slot, source })?;
            ranges.push((
                GuestAddress(gpa),
                narrow::usize_of(r.length),
                Some(FileOffset::new(file, offset)),
            ));
        }
        if let Some(&slot) = self
            .by_slot
            .keys()
            .find(|s| !layout.regions.iter().any(|r| r.slot == **s))
        {
            return Err(MemoryFdError::UnusedSlot { slot });
        }
        GuestMemoryMmap::from_ranges_with_files(&ranges)
            .map_err(|e| MemoryFdError::Map(e.to_string()))
    }
}

#[cfg(test)]
#[path = "migration_fds_tests.rs"]
mod tests;
