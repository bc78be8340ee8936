//! What the fuzz targets share: guest memory, and a split virtqueue whose
//! descriptor table and available ring come from the fuzzer's bytes, so the
//! chains a target sees are whatever a hostile driver could publish.

pub mod stream;

use virtio_queue::{Queue, QueueT};
use vm_memory::bitmap::Bitmap;
use vm_memory::mmap::NewBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

/// Guest memory as the VMM maps it (its devices take this type).
pub type Memory = virtio_devices::GuestMemoryMmap;

/// Guest memory as the daemon maps it (each region with the dirty log's
/// bitmap, empty here).
pub type DaemonMemory = daemon::GuestMemoryMmap;

/// Guest memory: 1 MiB at 0.
pub const MEM_SIZE: u64 = MEM_BYTES as u64;
const MEM_BYTES: usize = 1 << 20;
pub const QUEUE_SIZE: u16 = 16;
pub const DESC_TABLE: u64 = 0x0;
pub const AVAIL_RING: u64 = 0x1000;
pub const USED_RING: u64 = 0x2000;
/// Where the input's payload bytes are written.
pub const DATA: u64 = 0x4000;

/// The low 32 bits of `v`.
pub fn low_half(v: u64) -> u32 {
    u32::try_from(v & u64::from(u32::MAX)).expect("masked to 32 bits")
}

pub fn memory() -> Memory {
    memory_with()
}

/// [`memory`] as the daemon's targets need it.
pub fn daemon_memory() -> DaemonMemory {
    memory_with()
}

fn memory_with<B: NewBitmap>() -> GuestMemoryMmap<B> {
    GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).expect("1 MiB of guest memory")
}

/// Lays `input` out as a queue: the first 256 bytes are the descriptor
/// table (addresses folded into guest memory half of the time, so chains
/// reach real buffers), the next byte the number of available heads, then
/// the heads, then payload at [`DATA`]. Returns the ready queue.
pub fn queue_from<B: Bitmap + 'static>(mem: &GuestMemoryMmap<B>, input: &[u8]) -> Queue {
    let table_len = 16 * usize::from(QUEUE_SIZE);
    let mut table = vec![0u8; table_len];
    let n = input.len().min(table_len);
    table[..n].copy_from_slice(&input[..n]);
    for d in table.chunks_mut(16) {
        let addr = u64::from_le_bytes(d[..8].try_into().expect("8 bytes"));
        if addr & 1 == 0 {
            let folded = DATA + (addr % (MEM_SIZE - DATA));
            d[..8].copy_from_slice(&folded.to_le_bytes());
        }
    }
    mem.write_slice(&table, GuestAddress(DESC_TABLE))
        .expect("table in memory");
    let rest = input.get(table_len..).unwrap_or_default();
    let heads = usize::from(rest.first().copied().unwrap_or(1) % 8).max(1);
    let mut avail = vec![0u8; 4 + 2 * usize::from(QUEUE_SIZE)];
    // `heads` is 1..=7 (a byte modulo 8).
    let idx = u16::try_from(heads).expect("at most 7 heads");
    avail[2..4].copy_from_slice(&idx.to_le_bytes());
    for i in 0..heads {
        let head = u16::from(rest.get(1 + i).copied().unwrap_or(0));
        avail[4 + 2 * i..6 + 2 * i].copy_from_slice(&head.to_le_bytes());
    }
    mem.write_slice(&avail, GuestAddress(AVAIL_RING))
        .expect("avail ring in memory");
    let payload = rest.get(1 + heads..).unwrap_or_default();
    let payload = &payload[..payload
        .len()
        .min(usize::try_from(MEM_SIZE - DATA).expect("under 1 MiB"))];
    mem.write_slice(payload, GuestAddress(DATA))
        .expect("payload in memory");
    let mut q = Queue::new(QUEUE_SIZE).expect("queue size is a power of two");
    q.set_size(QUEUE_SIZE);
    // The rings sit in the first MiB: the high halves are zero.
    q.set_desc_table_address(Some(low_half(DESC_TABLE)), Some(0));
    q.set_avail_ring_address(Some(low_half(AVAIL_RING)), Some(0));
    q.set_used_ring_address(Some(low_half(USED_RING)), Some(0));
    q.set_ready(true);
    q
}

/// The device's position and the driver's available index, both from the
/// input's first four bytes, then [`queue_from`] on the rest: the index
/// may be anything a hostile driver writes, up to 65,535 chains ahead of
/// the device, or behind it. Returns the queue and whether the index is
/// one a queue must refuse (more than [`QUEUE_SIZE`] ahead).
pub fn queue_at_indices(mem: &Memory, input: &[u8]) -> (Queue, bool) {
    let mut pos = 0;
    let next_avail = take_u16(input, &mut pos);
    let avail_idx = take_u16(input, &mut pos);
    let mut q = queue_from(mem, input.get(pos..).unwrap_or_default());
    q.set_next_avail(next_avail);
    q.set_next_used(next_avail);
    mem.write_obj(avail_idx, GuestAddress(AVAIL_RING + 2))
        .expect("avail ring in memory");
    (q, avail_idx.wrapping_sub(next_avail) > QUEUE_SIZE)
}

/// Reads a little-endian integer of `N` bytes from `data` at `*pos`, or 0.
/// The next byte (0 past the end).
pub fn take_u8(data: &[u8], pos: &mut usize) -> u8 {
    take::<1>(data, pos).to_le_bytes()[0]
}

/// The next two bytes, little-endian (0 past the end).
pub fn take_u16(data: &[u8], pos: &mut usize) -> u16 {
    let b = take::<2>(data, pos).to_le_bytes();
    u16::from_le_bytes([b[0], b[1]])
}

/// The next four bytes, little-endian (0 past the end).
pub fn take_u32(data: &[u8], pos: &mut usize) -> u32 {
    low_half(take::<4>(data, pos))
}

pub fn take<const N: usize>(data: &[u8], pos: &mut usize) -> u64 {
    let mut b = [0u8; 8];
    for (i, slot) in b.iter_mut().enumerate().take(N) {
        *slot = data.get(*pos + i).copied().unwrap_or(0);
    }
    *pos += N;
    u64::from_le_bytes(b)
}

/// Caps the process's file size (writes past it get EFBIG, not SIGXFSZ), so
/// a fuzzed WRITE or FALLOCATE cannot fill the disk.
pub fn limit_file_size(bytes: u64) {
    // SAFETY: ignoring SIGXFSZ and setting a limit have no memory effects.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: bytes,
        };
        libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
    }
}

/// A device for the transport targets: two queues, a config space, a
/// shared memory region, and activation that records nothing.
pub struct FuzzDevice {
    pub shm_guest_addr: u64,
}

impl virtio_devices::VirtioDevice for FuzzDevice {
    fn device_type(&self) -> u32 {
        26
    }
    fn queue_max_sizes(&self) -> &[u16] {
        &[16, 16]
    }
    fn features(&self) -> u64 {
        1 << 32 | 1 << 29 | 1
    }
    fn ack_features(&mut self, _features: u64) {}
    fn read_config(&self, offset: u64, data: &mut [u8]) {
        virtio_devices::device::read_config_bytes(b"fuzz-tag\0\0\0\0", offset, data)
    }
    fn activate(
        &mut self,
        _mem: vm_memory::GuestMemoryAtomic<Memory>,
        _interrupt: std::sync::Arc<dyn virtio_devices::VirtioInterrupt>,
        _queues: Vec<virtio_devices::device::ActivatedQueue>,
    ) -> Result<(), virtio_devices::ActivateError> {
        Ok(())
    }
    fn reset(&mut self) -> bool {
        true
    }
    fn shm_regions(&self) -> Vec<virtio_devices::SharedMemoryRegion> {
        vec![virtio_devices::SharedMemoryRegion {
            id: 0,
            guest_addr: self.shm_guest_addr,
            len: 2 << 20,
            host_addr: 0,
        }]
    }
}

/// Register accesses from the input: (write?, offset within `span`, size
/// 1/2/4/8, value).
pub fn accesses(data: &[u8], span: u64) -> impl Iterator<Item = (bool, u64, Vec<u8>)> + '_ {
    data.chunks(8).map(move |c| {
        let mut pos = 0;
        let op = take::<1>(c, &mut pos);
        let offset = take::<2>(c, &mut pos) % span;
        let size = [1usize, 2, 4, 8][usize::from(op.to_le_bytes()[0] >> 1 & 3)];
        let value = low_half(take::<4>(c, &mut pos));
        let mut bytes = vec![0u8; size];
        let v = (u64::from(value) | u64::from(value) << 32).to_le_bytes();
        bytes.copy_from_slice(&v[..size]);
        (op & 1 == 1, offset, bytes)
    })
}

/// A queue holding one chain over `bufs` (guest address, length, device-
/// writable), in order, head at descriptor 0.
pub fn queue_of<B: Bitmap + 'static>(mem: &GuestMemoryMmap<B>, bufs: &[(u64, u32, bool)]) -> Queue {
    let mut table = Vec::new();
    for (i, &(addr, len, write)) in bufs.iter().enumerate() {
        let mut flags = if write { 2u16 } else { 0 };
        if i + 1 < bufs.len() {
            flags |= 1;
        }
        // `queue_from` folds even addresses to DATA + addr; undo that.
        table.extend_from_slice(&(addr - DATA).to_le_bytes());
        table.extend_from_slice(&len.to_le_bytes());
        table.extend_from_slice(&flags.to_le_bytes());
        let next = u16::try_from(i + 1).expect("a chain shorter than the queue");
        table.extend_from_slice(&next.to_le_bytes());
    }
    let mut input = table;
    input.resize(16 * usize::from(QUEUE_SIZE), 0);
    // One available head, descriptor 0; addresses are even, so `queue_from`
    // keeps them in guest memory (folded); give them as offsets from DATA.
    input.extend_from_slice(&[1, 0]);
    queue_from(mem, &input)
}
