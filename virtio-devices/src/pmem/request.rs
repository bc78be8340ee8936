//! The virtio-pmem request queue: each request asks for a flush; the device
//! fsyncs the backing file and answers 0, or 1 (`VIRTIO_PMEM_RESP_TYPE_EIO`)
//! if the fsync failed. A malformed chain from the guest gets no flush and,
//! where it has room for one, an error answer; the queue keeps serving.

use virtio_queue::{DescriptorChain, Queue, QueueOwnedT, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemory};

pub const VIRTIO_PMEM_REQ_TYPE_FLUSH: u32 = 0;
pub const VIRTIO_PMEM_RESP_TYPE_OK: u32 = 0;
pub const VIRTIO_PMEM_RESP_TYPE_EIO: u32 = 1;
const REQUEST_LEN: u32 = 4;
const RESPONSE_LEN: u32 = 4;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("descriptor chain has no readable request descriptor of at least 4 bytes")]
    NoRequest,
    #[error("descriptor chain has no writable response descriptor of at least 4 bytes")]
    NoResponse,
    #[error("reading the request from guest memory at {0:#x}")]
    ReadRequest(u64),
    #[error("unknown request type {0}")]
    UnknownType(u32),
}

/// Where a chain's request and response live.
struct Parsed {
    request: Result<u32, RequestError>,
    response: Option<GuestAddress>,
}

fn parse<M: GuestMemory>(mem: &M, chain: DescriptorChain<&M>) -> Parsed {
    let mut request = Err(RequestError::NoRequest);
    let mut response = None;
    for desc in chain {
        if desc.is_write_only() {
            if response.is_none() && desc.len() >= RESPONSE_LEN {
                response = Some(desc.addr());
            }
        } else if matches!(request, Err(RequestError::NoRequest)) && desc.len() >= REQUEST_LEN {
            request = mem
                .read_obj::<u32>(desc.addr())
                .map(u32::from_le)
                .map_err(|_| RequestError::ReadRequest(desc.addr().0));
        }
    }
    Parsed { request, response }
}

/// Serves every available request. `flush` performs the fsync. Returns how
/// many chains were used; the caller raises the interrupt if any were and the
/// queue asks for it.
pub fn process_queue<M: GuestMemory>(
    queue: &mut Queue,
    mem: &M,
    mut flush: impl FnMut() -> std::io::Result<()>,
) -> Result<usize, virtio_queue::Error> {
    let mut used = 0;
    // `iter` refuses an available index more than the queue's size ahead
    // (an error: the queue stops); `pop_descriptor_chain` would only log.
    while let Some(chain) = queue.iter(mem)?.next() {
        let head = chain.head_index();
        let parsed = parse(mem, chain);
        let answer = match parsed.request.and_then(|t| {
            if t == VIRTIO_PMEM_REQ_TYPE_FLUSH {
                Ok(t)
            } else {
                Err(RequestError::UnknownType(t))
            }
        }) {
            Ok(_) if parsed.response.is_none() => {
                crate::warn_limited!("virtio-pmem: {}", RequestError::NoResponse);
                None
            }
            Ok(_) => Some(match flush() {
                Ok(()) => VIRTIO_PMEM_RESP_TYPE_OK,
                Err(e) => {
                    crate::error_limited!("virtio-pmem: fsync of the backing file failed: {e}");
                    VIRTIO_PMEM_RESP_TYPE_EIO
                }
            }),
            Err(e) => {
                crate::warn_limited!("virtio-pmem: bad request: {e}");
                Some(VIRTIO_PMEM_RESP_TYPE_EIO)
            }
        };
        let written = match (answer, parsed.response) {
            (Some(code), Some(addr)) if mem.write_obj(code.to_le(), addr).is_ok() => RESPONSE_LEN,
            _ => 0,
        };
        queue.add_used(mem, head, written)?;
        used += 1;
    }
    Ok(used)
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestMemoryMmap;

    const REQ: u64 = 0x10_000;
    const RESP: u64 = 0x11_000;

    fn desc(addr: u64, len: u32, write: bool) -> RawDescriptor {
        let flags = if write {
            const { narrow::u16_of(VRING_DESC_F_WRITE as u64) }
        } else {
            0
        };
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, 0))
    }

    fn run(descs: &[RawDescriptor], req: u32, flush_ok: bool) -> (usize, u32, usize, u32) {
        let mem: GuestMemoryMmap<()> =
            GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x20_000)]).unwrap();
        let vq = MockSplitQueue::new(&mem, 16);
        vq.build_desc_chain(descs).unwrap();
        let mut q: Queue = vq.create_queue().unwrap();
        mem.write_obj(req.to_le(), GuestAddress(REQ)).unwrap();
        mem.write_obj(0xdead_beef_u32, GuestAddress(RESP)).unwrap();
        let mut flushes = 0;
        let used = process_queue(&mut q, &mem, || {
            flushes += 1;
            if flush_ok {
                Ok(())
            } else {
                Err(std::io::Error::from_raw_os_error(libc::EIO))
            }
        })
        .unwrap();
        let resp: u32 = mem.read_obj(GuestAddress(RESP)).unwrap();
        let used_len = vq.used().ring().ref_at(0).unwrap().load().len();
        (used, u32::from_le(resp), flushes, used_len)
    }

    #[test]
    fn flush_answers_ok_and_fsyncs() {
        let (used, resp, flushes, len) = run(&[desc(REQ, 4, false), desc(RESP, 4, true)], 0, true);
        assert_eq!(
            (used, resp, flushes, len),
            (1, VIRTIO_PMEM_RESP_TYPE_OK, 1, 4)
        );
    }

    #[test]
    fn failed_fsync_answers_eio() {
        let (used, resp, flushes, _) = run(&[desc(REQ, 4, false), desc(RESP, 4, true)], 0, false);
        assert_eq!((used, resp, flushes), (1, VIRTIO_PMEM_RESP_TYPE_EIO, 1));
    }

    #[test]
    fn unknown_type_answers_eio_without_flushing() {
        let (used, resp, flushes, _) = run(&[desc(REQ, 4, false), desc(RESP, 4, true)], 7, true);
        assert_eq!((used, resp, flushes), (1, VIRTIO_PMEM_RESP_TYPE_EIO, 0));
    }

    #[test]
    fn malformed_chains_are_used_without_flushing() {
        // No request descriptor: answered EIO.
        let (used, resp, flushes, _) = run(&[desc(RESP, 4, true)], 0, true);
        assert_eq!((used, resp, flushes), (1, VIRTIO_PMEM_RESP_TYPE_EIO, 0));
        // Response too short: nothing written, no flush, chain still returned.
        let (used, resp, flushes, len) = run(&[desc(REQ, 4, false), desc(RESP, 2, true)], 0, true);
        assert_eq!((used, resp, flushes, len), (1, 0xdead_beef, 0, 0));
        // Request outside guest memory.
        let (used, resp, flushes, _) =
            run(&[desc(0x100_0000, 4, false), desc(RESP, 4, true)], 0, true);
        assert_eq!((used, resp, flushes), (1, VIRTIO_PMEM_RESP_TYPE_EIO, 0));
    }

    /// A guest repeating a bad request must not flood the host's log: the
    /// warning goes through the call site's rate limiter. (Other tests may
    /// have used this call site's period already, so at most one.)
    #[test]
    fn repeated_bad_requests_log_at_most_one_warning_per_period() {
        crate::log_limit::capture::start();
        for _ in 0..8 {
            let (used, resp, _, _) = run(&[desc(REQ, 4, false), desc(RESP, 4, true)], 7, true);
            assert_eq!((used, resp), (1, VIRTIO_PMEM_RESP_TYPE_EIO));
        }
        let warnings = crate::log_limit::capture::take()
            .into_iter()
            .filter(|(_, m)| m.starts_with("virtio-pmem: bad request"))
            .count();
        assert!(warnings <= 1, "{warnings} warnings for 8 bad requests");
    }
}
