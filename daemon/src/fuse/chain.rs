//! A request's descriptor chain as two byte streams: what the guest wrote
//! (the FUSE request) and where the reply goes. Small structs are copied;
//! file data never is: [`Reader::bufs`] and [`Writer::bufs`] give host
//! `iovec`s that point straight into guest memory for `preadv`/`pwritev`.
//!
//! Every address comes from the guest. A buffer inside the DAX window
//! (a guest program reading into a DAX mapping of another file) is not in
//! the memory table: it comes back as [`Buf::Window`], a window offset, for
//! the caller to serve through the file mapped there. Any other range
//! outside the memory table fails that request with EFAULT.

use std::io;

use control_protocol::WindowLocation;
use virtio_queue::DescriptorChain;
use vm_memory::bitmap::Bitmap;
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryBackend};

use crate::GuestMemoryMmap;

fn efault(what: &str) -> io::Error {
    tracing::debug!("request refused with EFAULT: {what}");
    io::Error::from_raw_os_error(libc::EFAULT)
}

/// A cursor over an ordered list of guest buffers.
#[derive(Debug, Default)]
struct Segments {
    segs: Vec<(GuestAddress, usize)>,
    /// Bytes consumed so far.
    pos: usize,
    total: usize,
}

impl Segments {
    fn push(&mut self, addr: GuestAddress, len: usize) -> io::Result<()> {
        self.total = self
            .total
            .checked_add(len)
            .ok_or_else(|| efault("descriptor lengths overflow"))?;
        if addr.0.checked_add(len as u64).is_none() {
            return Err(efault("descriptor address + length overflows"));
        }
        self.segs.push((addr, len));
        Ok(())
    }

    fn available(&self) -> usize {
        self.total - self.pos
    }

    /// The guest ranges covering the next `len` bytes from `pos + skip`.
    fn ranges(&self, skip: usize, len: usize) -> io::Result<Vec<(GuestAddress, usize)>> {
        let start = self
            .pos
            .checked_add(skip)
            .filter(|s| s.checked_add(len).is_some_and(|e| e <= self.total));
        let Some(mut start) = start else {
            return Err(efault("request shorter than its header says"));
        };
        let mut left = len;
        let mut out = Vec::new();
        for &(addr, seg_len) in &self.segs {
            if left == 0 {
                break;
            }
            if start >= seg_len {
                start -= seg_len;
                continue;
            }
            let n = (seg_len - start).min(left);
            out.push((GuestAddress(addr.0 + start as u64), n));
            left -= n;
            start = 0;
        }
        Ok(out)
    }

    fn bufs(
        &self,
        mem: &GuestMemoryMmap,
        skip: usize,
        len: usize,
        window: Option<WindowLocation>,
    ) -> io::Result<Vec<Buf>> {
        let mut bufs = Vec::new();
        for (addr, n) in self.ranges(skip, len)? {
            // Guest RAM first: a window location can never claim RAM.
            if !mem.check_range(addr, n) {
                let offset = window
                    .and_then(|w| window_offset(w, addr.0, n))
                    .ok_or_else(|| efault("buffer outside guest RAM and the DAX window"))?;
                bufs.push(Buf::Window { offset, len: n });
                continue;
            }
            for slice in mem.get_slices(addr, n) {
                let slice = slice.map_err(|_| efault("buffer outside guest RAM"))?;
                bufs.push(Buf::Ram(libc::iovec {
                    iov_base: slice.ptr_guard_mut().as_ptr().cast(),
                    iov_len: slice.len(),
                }));
            }
        }
        Ok(bufs)
    }
}

/// The window offset of guest bytes `[gpa, gpa + len)`, when all of them
/// lie in the window.
fn window_offset(w: WindowLocation, gpa: u64, len: usize) -> Option<u64> {
    let end = gpa.checked_add(len as u64)?;
    let window_end = w.gpa.checked_add(w.size)?;
    (gpa >= w.gpa && end <= window_end).then(|| gpa - w.gpa)
}

/// A stretch of a request's buffers.
#[derive(Debug)]
pub enum Buf {
    /// Guest RAM, as the daemon's mapping of it.
    Ram(libc::iovec),
    /// DAX window bytes at this offset: not mapped in the daemon, reached
    /// through the file mapped there.
    Window { offset: u64, len: usize },
}

/// The device-readable part of a request.
pub struct Reader<'a> {
    mem: &'a GuestMemoryMmap,
    segs: Segments,
}

/// The device-writable part: where the reply goes.
pub struct Writer<'a> {
    mem: &'a GuestMemoryMmap,
    segs: Segments,
}

/// Splits a chain into its readable and writable buffers (readable first,
/// as virtio requires; a readable buffer after a writable one is an error).
pub fn split<'a, M>(
    mem: &'a GuestMemoryMmap,
    chain: DescriptorChain<M>,
) -> io::Result<(Reader<'a>, Writer<'a>)>
where
    M: std::ops::Deref,
    M::Target: vm_memory::GuestMemory,
{
    let mut readable = Segments::default();
    let mut writable = Segments::default();
    for desc in chain {
        let (addr, len) = (desc.addr(), desc.len() as usize);
        if desc.is_write_only() {
            writable.push(addr, len)?;
        } else if writable.segs.is_empty() {
            readable.push(addr, len)?;
        } else {
            return Err(efault("readable descriptor after a writable one"));
        }
    }
    Ok((
        Reader {
            mem,
            segs: readable,
        },
        Writer {
            mem,
            segs: writable,
        },
    ))
}

impl<'a> Reader<'a> {
    pub fn available(&self) -> usize {
        self.segs.available()
    }

    pub fn read_exact(&mut self, buf: &mut [u8]) -> io::Result<()> {
        let mut done = 0;
        for (addr, n) in self.segs.ranges(0, buf.len())? {
            self.mem
                .read_slice(&mut buf[done..done + n], addr)
                .map_err(|_| efault("request outside guest RAM"))?;
            done += n;
        }
        self.segs.pos += buf.len();
        Ok(())
    }

    pub fn read_obj<T: ByteValued + Default>(&mut self) -> io::Result<T> {
        let mut v = T::default();
        self.read_exact(v.as_mut_slice())?;
        Ok(v)
    }

    pub fn read_bytes(&mut self, n: usize) -> io::Result<Vec<u8>> {
        if n > self.available() {
            return Err(efault("request shorter than its header says"));
        }
        let mut v = vec![0; n];
        self.read_exact(&mut v)?;
        Ok(v)
    }

    /// The next `len` bytes (not consumed), as guest RAM or window stretches.
    pub fn bufs(&self, len: usize, window: Option<WindowLocation>) -> io::Result<Vec<Buf>> {
        self.segs.bufs(self.mem, 0, len, window)
    }
}

impl<'a> Writer<'a> {
    pub fn available(&self) -> usize {
        self.segs.available()
    }

    #[cfg(test)]
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.write_at(0, buf)?;
        self.segs.pos += buf.len();
        Ok(())
    }

    /// Writes `buf` at `skip` bytes past the cursor without moving it.
    pub fn write_at(&mut self, skip: usize, buf: &[u8]) -> io::Result<()> {
        let mut done = 0;
        for (addr, n) in self.segs.ranges(skip, buf.len())? {
            self.mem
                .write_slice(&buf[done..done + n], addr)
                .map_err(|_| efault("reply buffer outside guest RAM"))?;
            done += n;
        }
        Ok(())
    }

    /// `len` bytes starting `skip` bytes past the cursor, as guest RAM or
    /// window stretches. The RAM iovecs bypass vm-memory: whoever writes
    /// through them calls [`Writer::mark_written`] afterwards.
    pub fn bufs(
        &self,
        skip: usize,
        len: usize,
        window: Option<WindowLocation>,
    ) -> io::Result<Vec<Buf>> {
        self.segs.bufs(self.mem, skip, len, window)
    }

    /// Sets the dirty-log bit of every guest page among the `len` bytes
    /// `skip` past the cursor, after they were written through [`bufs`]'
    /// iovecs (vm-memory marks its own writes; these it never saw). Only
    /// the bytes written: a short read marks its prefix, not the buffer.
    /// Marked after the write, so a VMM that reads and clears the bit
    /// before it copies the page cannot miss the data. Window stretches
    /// are the mapped files' pages, not guest RAM: not logged. Without a
    /// log (no migration) each slice costs one check.
    ///
    /// [`bufs`]: Writer::bufs
    pub fn mark_written(&self, skip: usize, len: usize) -> io::Result<()> {
        for (addr, n) in self.segs.ranges(skip, len)? {
            if !self.mem.check_range(addr, n) {
                continue;
            }
            for slice in self.mem.get_slices(addr, n) {
                let slice = slice.map_err(|_| efault("buffer outside guest RAM"))?;
                slice.bitmap().mark_dirty(0, slice.len());
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;

    /// Builds a chain of buffers at fixed addresses: (addr, len, writable).
    pub fn chain_of<'a>(
        mem: &'a GuestMemoryMmap,
        bufs: &[(u64, u32, bool)],
    ) -> DescriptorChain<&'a GuestMemoryMmap> {
        let q = MockSplitQueue::new(mem, 16);
        let descs: Vec<RawDescriptor> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, w))| {
                let bit = |f: u32| u16::try_from(f).unwrap();
                let mut flags = if w { bit(VRING_DESC_F_WRITE) } else { 0 };
                if i + 1 < bufs.len() {
                    flags |= bit(VRING_DESC_F_NEXT);
                }
                let next = u16::try_from(i + 1).unwrap();
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
            })
            .collect();
        q.build_desc_chain(&descs).unwrap();
        let mut queue: virtio_queue::Queue = q.create_queue().unwrap();
        use virtio_queue::QueueOwnedT;
        queue.iter(mem).unwrap().next().unwrap()
    }

    pub fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap()
    }

    #[test]
    fn reads_across_buffers_and_maps_iovecs_into_guest_memory() {
        let mem = memory();
        mem.write_slice(b"hello ", GuestAddress(0x8000)).unwrap();
        mem.write_slice(b"world", GuestAddress(0x9000)).unwrap();
        let chain = chain_of(
            &mem,
            &[
                (0x8000, 6, false),
                (0x9000, 5, false),
                (0xa000, 8, true),
                (0xb000, 8, true),
            ],
        );
        let (mut r, mut w) = split(&mem, chain).unwrap();
        assert_eq!(r.available(), 11);
        assert_eq!(r.read_bytes(8).unwrap(), b"hello wo");
        assert!(r.read_bytes(4).is_err(), "past the end");
        let bufs = r.bufs(3, None).unwrap();
        let [Buf::Ram(iov)] = bufs[..] else {
            panic!("{bufs:?}")
        };
        // SAFETY: the iovec points at 3 readable bytes of `mem`.
        let bytes = unsafe { std::slice::from_raw_parts(iov.iov_base as *const u8, 3) };
        assert_eq!(bytes, b"rld");

        assert_eq!(w.available(), 16);
        w.write_all(b"0123456789").unwrap();
        assert_eq!(w.bufs(0, 6, None).unwrap().len(), 1);
        assert!(w.bufs(0, 7, None).is_err());
        w.write_at(1, b"Z").unwrap();
        let mut out = [0u8; 8];
        mem.read_slice(&mut out, GuestAddress(0xb000)).unwrap();
        assert_eq!(&out[..4], b"89\0Z");
    }

    /// Marking is bounded by the chain's writable bytes (an overlong or
    /// overflowing length is EFAULT, never a walk past the buffers), skips
    /// window stretches, and without a log (no migration) does nothing.
    #[test]
    fn marking_written_bytes_stays_inside_the_writable_buffers() {
        let mem = memory();
        let window = WindowLocation {
            gpa: 0x4000_0000,
            size: 1 << 21,
        };
        let chain = chain_of(
            &mem,
            &[
                (0x8000, 16, false),
                (0x9ff0, 32, true),
                (0x4000_0000, 4096, true),
            ],
        );
        let (_r, w) = split(&mem, chain).unwrap();
        assert!(w.bufs(0, 32 + 4096, Some(window)).is_ok());
        w.mark_written(0, 32 + 4096).unwrap();
        w.mark_written(16, 16).unwrap();
        for (skip, len) in [(0, 32 + 4097), (32 + 4096, 1), (1, usize::MAX)] {
            assert_eq!(
                w.mark_written(skip, len).unwrap_err().raw_os_error(),
                Some(libc::EFAULT),
                "{skip} + {len}"
            );
        }
        assert!(!mem
            .find_region(GuestAddress(0x9ff0))
            .unwrap()
            .bitmap()
            .dirty_at(0x9ff0));
    }

    #[test]
    fn buffers_outside_guest_ram_fail_the_request() {
        let mem = memory();
        let chain = chain_of(&mem, &[(0x8000, 16, false), (0x4000_0000, 4096, true)]);
        let (_r, w) = split(&mem, chain).unwrap();
        assert_eq!(
            w.bufs(0, 4096, None).unwrap_err().raw_os_error(),
            Some(libc::EFAULT)
        );
        let chain = chain_of(&mem, &[(0x8000, 16, false), (0x4000_0000, 4096, true)]);
        let (_r, w) = split(&mem, chain).unwrap();
        let elsewhere = WindowLocation {
            gpa: 0x8000_0000,
            size: 1 << 20,
        };
        assert!(w.bufs(0, 4096, Some(elsewhere)).is_err());
        let chain = chain_of(&mem, &[(u64::MAX - 4, 16, false)]);
        assert!(split(&mem, chain).is_err());
    }

    #[test]
    fn buffers_in_the_window_come_back_as_window_offsets_and_ram_stays_ram() {
        let mem = memory();
        let window = WindowLocation {
            gpa: 0x4000_0000,
            size: 1 << 21,
        };
        let chain = chain_of(
            &mem,
            &[
                (0x8000, 16, false),
                (0x9000, 4096, true),
                (0x4000_3000, 8192, true),
                (0x401f_f000, 8192, true),
            ],
        );
        let (_r, w) = split(&mem, chain).unwrap();
        let bufs = w.bufs(16, 4096 - 16 + 8192, Some(window)).unwrap();
        assert!(matches!(bufs[0], Buf::Ram(v) if v.iov_len == 4096 - 16));
        assert!(matches!(
            bufs[1],
            Buf::Window {
                offset: 0x3000,
                len: 8192
            }
        ));
        // The last buffer runs past the window's end.
        let all = 4096 + 8192 + 8192;
        assert_eq!(
            w.bufs(0, all, Some(window)).unwrap_err().raw_os_error(),
            Some(libc::EFAULT)
        );
        // A "window" over guest RAM does not turn RAM into window bytes.
        let over_ram = WindowLocation {
            gpa: 0,
            size: 1 << 30,
        };
        let bufs = w.bufs(0, 4096, Some(over_ram)).unwrap();
        assert!(matches!(bufs[0], Buf::Ram(_)));
    }
}
