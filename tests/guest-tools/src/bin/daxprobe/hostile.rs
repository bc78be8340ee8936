//! `daxprobe virtio-hostile pci|mmio SERIAL MARKER`: a hostile driver for
//! a virtio-blk disk, as a root process in the guest can be one. It finds
//! the disk whose serial is SERIAL on the given transport, unbinds the
//! kernel's driver from it (virtio-pci's, or virtio_mmio's), and drives
//! the device through its registers itself (the PCI BARs mapped through
//! `/sys/bus/pci/devices/*/resourceN`, the MMIO window through `/dev/mem`
//! at its address in `/proc/iomem`), with its rings in a locked page of
//! its own (physical address from `/proc/self/pagemap`):
//!
//! 1. resets and starts the device; before DRIVER_OK writes queue_size = 3
//!    (not a power of two) [`BAD_SIZE_WRITES`] times, then a valid size;
//! 2. reads sector 0 and prints its first bytes (`read=`, MARKER expected);
//! 3. publishes an available index the device's position + queue size + 5
//!    and kicks; waits 2 s and prints the status (`needs_reset=1` when
//!    DEVICE_NEEDS_RESET shows);
//! 4. writes device_status = 0 and prints what register reads give then
//!    (`status_after_reset=`, `queues=` or `queue_max=`, `capacity=`): a
//!    VMM stuck on the queue never answers them;
//! 5. starts the device again and reads sector 0 once more (`reread=`).
//!
//! Each result is a line `@@GUEST hostile_<transport>_<key>=<value>`.

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, Ordering};
use std::time::{Duration, Instant};

use super::fail;

/// queue_size = 3 writes before DRIVER_OK.
pub const BAD_SIZE_WRITES: usize = 10_000;
const QUEUE_SIZE: u16 = 8;
const ACK: u8 = 1;
const DRIVER: u8 = 2;
const DRIVER_OK: u8 = 4;
const FEATURES_OK: u8 = 8;
const NEEDS_RESET: u8 = 0x40;
/// VIRTIO_F_VERSION_1, in the high half of the features.
const VERSION_1_HIGH: u32 = 1;

/// The ring page's layout: descriptors, available ring, used ring, then
/// one request's header, status byte and 512 bytes of data.
const DESC: usize = 0x000;
const AVAIL: usize = 0x100;
const USED: usize = 0x200;
const HEADER: usize = 0x400;
const STATUS: usize = 0x410;
const DATA: usize = 0x600;
const PAGE: usize = 4096;

/// A shared mapping of device registers (or of the ring page).
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    /// Maps `len` bytes of `path` at `offset`, shared, read-write.
    fn of_file(path: &Path, offset: u64, len: usize) -> Mapping {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_SYNC)
            .open(path)
            .unwrap_or_else(|e| fail(format!("{}: {e}", path.display())));
        let off = libc::off_t::try_from(offset).unwrap_or_else(|_| fail("offset".into()));
        // SAFETY: a new shared mapping of an open file; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                off,
            )
        };
        if ptr == libc::MAP_FAILED {
            fail(format!(
                "mmap {} at {offset:#x}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
        Mapping {
            ptr: ptr.cast(),
            len,
        }
    }

    /// A page of this process's memory, locked so its physical address
    /// stays what `/proc/self/pagemap` says.
    fn locked_page() -> (Mapping, u64) {
        // SAFETY: a new private anonymous mapping; checked below.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_LOCKED | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            fail(format!("ring page: {}", std::io::Error::last_os_error()));
        }
        let page = Mapping {
            ptr: ptr.cast(),
            len: PAGE,
        };
        page.w8(0, 0);
        let pagemap =
            File::open("/proc/self/pagemap").unwrap_or_else(|e| fail(format!("pagemap: {e}")));
        let mut entry = [0u8; 8];
        let index =
            u64::try_from(page.ptr as usize / PAGE).unwrap_or_else(|_| fail("address".into()));
        pagemap
            .read_exact_at(&mut entry, index * 8)
            .unwrap_or_else(|e| fail(format!("pagemap: {e}")));
        let entry = u64::from_le_bytes(entry);
        let pfn = entry & ((1 << 55) - 1);
        if entry >> 63 == 0 || pfn == 0 {
            fail(format!("pagemap gives no frame ({entry:#x}): not root?"));
        }
        (page, pfn * 4096)
    }

    fn at(&self, off: usize, size: usize) -> *mut u8 {
        if off.checked_add(size).is_none_or(|end| end > self.len) {
            fail(format!(
                "register {off:#x} outside a mapping of {:#x}",
                self.len
            ));
        }
        // SAFETY: off + size lies inside the mapping (checked above).
        unsafe { self.ptr.add(off) }
    }

    fn r8(&self, off: usize) -> u8 {
        // SAFETY: in bounds (at), a live mapping.
        unsafe { self.at(off, 1).read_volatile() }
    }
    fn r16(&self, off: usize) -> u16 {
        // SAFETY: in bounds (at), a live mapping; registers are aligned.
        unsafe { self.at(off, 2).cast::<u16>().read_volatile() }
    }
    fn r32(&self, off: usize) -> u32 {
        // SAFETY: as r16.
        unsafe { self.at(off, 4).cast::<u32>().read_volatile() }
    }
    fn w8(&self, off: usize, v: u8) {
        // SAFETY: as r8.
        unsafe { self.at(off, 1).write_volatile(v) }
    }
    fn w16(&self, off: usize, v: u16) {
        // SAFETY: as r16.
        unsafe { self.at(off, 2).cast::<u16>().write_volatile(v) }
    }
    fn w32(&self, off: usize, v: u32) {
        // SAFETY: as r16.
        unsafe { self.at(off, 4).cast::<u32>().write_volatile(v) }
    }
    fn w64(&self, off: usize, v: u64) {
        self.w32(off, low(v));
        self.w32(off + 4, low(v >> 32));
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps what `of_file`/`locked_page` mapped, once.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn low(v: u64) -> u32 {
    u32::try_from(v & 0xffff_ffff).unwrap_or(0)
}

/// What a transport's registers do, as this driver needs them.
trait Regs {
    fn status(&self) -> u8;
    fn set_status(&self, v: u8);
    fn set_driver_features(&self, select: u32, v: u32);
    fn select_queue(&self, q: u16);
    fn set_queue_size(&self, n: u16);
    fn set_queue_addrs(&self, desc: u64, avail: u64, used: u64);
    fn enable_queue(&self);
    fn notify(&self, q: u16);
    /// virtio_blk_config.capacity.
    fn capacity(&self) -> u64;
    /// A register whose read takes the device's lock in the VMM (the
    /// number of queues, or a queue's maximum size): (name, value).
    fn device_read(&self) -> (&'static str, u32);
}

/// virtio-pci: the common, notify and device configuration structures
/// where the vendor capabilities say.
struct Pci {
    bars: Vec<(u8, Mapping)>,
    common: (u8, usize),
    notify: (u8, usize, u32),
    device: (u8, usize),
}

impl Pci {
    fn bar(&self, bar: u8) -> &Mapping {
        &self
            .bars
            .iter()
            .find(|(b, _)| *b == bar)
            .unwrap_or_else(|| fail(format!("BAR {bar} not mapped")))
            .1
    }
    fn common(&self) -> (&Mapping, usize) {
        (self.bar(self.common.0), self.common.1)
    }
}

impl Regs for Pci {
    fn status(&self) -> u8 {
        let (m, o) = self.common();
        m.r8(o + 0x14)
    }
    fn set_status(&self, v: u8) {
        let (m, o) = self.common();
        m.w8(o + 0x14, v)
    }
    fn set_driver_features(&self, select: u32, v: u32) {
        let (m, o) = self.common();
        m.w32(o + 0x08, select);
        m.w32(o + 0x0c, v);
    }
    fn select_queue(&self, q: u16) {
        let (m, o) = self.common();
        m.w16(o + 0x16, q)
    }
    fn set_queue_size(&self, n: u16) {
        let (m, o) = self.common();
        m.w16(o + 0x18, n)
    }
    fn set_queue_addrs(&self, desc: u64, avail: u64, used: u64) {
        let (m, o) = self.common();
        // No MSI-X vector: this driver polls the used ring.
        m.w16(o + 0x1a, 0xffff);
        m.w64(o + 0x20, desc);
        m.w64(o + 0x28, avail);
        m.w64(o + 0x30, used);
    }
    fn enable_queue(&self) {
        let (m, o) = self.common();
        m.w16(o + 0x1c, 1)
    }
    fn notify(&self, q: u16) {
        let (m, o) = self.common();
        let notify_off = usize::from(m.r16(o + 0x1e));
        let (bar, base, mult) = self.notify;
        let mult = usize::try_from(mult).unwrap_or(0);
        self.bar(bar).w16(base + notify_off * mult, q)
    }
    fn capacity(&self) -> u64 {
        let (bar, o) = self.device;
        let m = self.bar(bar);
        u64::from(m.r32(o)) | u64::from(m.r32(o + 4)) << 32
    }
    fn device_read(&self) -> (&'static str, u32) {
        let (m, o) = self.common();
        ("queues", u32::from(m.r16(o + 0x12)))
    }
}

/// virtio-mmio (version 2) registers.
struct Mmio(Mapping);

impl Regs for Mmio {
    fn status(&self) -> u8 {
        u8::try_from(self.0.r32(0x70) & 0xff).unwrap_or(0)
    }
    fn set_status(&self, v: u8) {
        self.0.w32(0x70, u32::from(v))
    }
    fn set_driver_features(&self, select: u32, v: u32) {
        self.0.w32(0x24, select);
        self.0.w32(0x20, v);
    }
    fn select_queue(&self, q: u16) {
        self.0.w32(0x30, u32::from(q))
    }
    fn set_queue_size(&self, n: u16) {
        self.0.w32(0x38, u32::from(n))
    }
    fn set_queue_addrs(&self, desc: u64, avail: u64, used: u64) {
        for (at, v) in [(0x80, desc), (0x90, avail), (0xa0, used)] {
            self.0.w32(at, low(v));
            self.0.w32(at + 4, low(v >> 32));
        }
    }
    fn enable_queue(&self) {
        self.0.w32(0x44, 1)
    }
    fn notify(&self, q: u16) {
        self.0.w32(0x50, u32::from(q))
    }
    fn capacity(&self) -> u64 {
        u64::from(self.0.r32(0x100)) | u64::from(self.0.r32(0x104)) << 32
    }
    fn device_read(&self) -> (&'static str, u32) {
        ("queue_max", self.0.r32(0x34))
    }
}

fn read_text(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// The device directory under `bus` (its `/sys/bus/*/devices` entry)
/// whose virtio child is a block device with serial `serial`.
fn find_disk(bus: &str, serial: &str) -> PathBuf {
    let dir = format!("/sys/bus/{bus}/devices");
    let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| fail(format!("{dir}: {e}")));
    for e in entries.flatten() {
        let dev = e.path();
        let Ok(children) = std::fs::read_dir(&dev) else {
            continue;
        };
        for c in children.flatten() {
            let name = c.file_name().to_string_lossy().to_string();
            if !name.starts_with("virtio") {
                continue;
            }
            let Ok(blocks) = std::fs::read_dir(c.path().join("block")) else {
                continue;
            };
            for b in blocks.flatten() {
                if read_text(&b.path().join("serial")) == serial {
                    return std::fs::canonicalize(&dev).unwrap_or(dev);
                }
            }
        }
    }
    fail(format!("no {bus} virtio disk with serial {serial}"))
}

/// Unbinds the driver bound to the device at `dev`.
fn unbind(dev: &Path) {
    let name = dev
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_else(|| fail("device name".into()));
    let unbind = dev.join("driver/unbind");
    std::fs::write(&unbind, &name).unwrap_or_else(|e| fail(format!("{}: {e}", unbind.display())));
}

/// The virtio-pci capabilities of the device at `dev`, its BARs mapped.
fn pci_regs(dev: &Path) -> Pci {
    let mut config = Vec::new();
    File::open(dev.join("config"))
        .and_then(|mut f| f.read_to_end(&mut config))
        .unwrap_or_else(|e| fail(format!("PCI config: {e}")));
    let byte = |at: usize| config.get(at).copied().unwrap_or(0);
    let word = |at: usize| u32::from_le_bytes([byte(at), byte(at + 1), byte(at + 2), byte(at + 3)]);
    let mut found = [None; 5];
    let mut mult = 0;
    let mut at = usize::from(byte(0x34));
    let mut hops = 0;
    while at != 0 && hops < 48 {
        if byte(at) == 0x09 {
            let kind = usize::from(byte(at + 3));
            let offset = usize::try_from(word(at + 8)).unwrap_or(0);
            if let Some(slot) = found.get_mut(kind) {
                slot.get_or_insert((byte(at + 4), offset));
            }
            if kind == 2 {
                mult = word(at + 16);
            }
        }
        at = usize::from(byte(at + 1));
        hops += 1;
    }
    let cap =
        |kind: usize| found[kind].unwrap_or_else(|| fail(format!("no virtio capability {kind}")));
    let (common, notify, device) = (cap(1), cap(2), cap(4));
    let _ = std::fs::write(dev.join("enable"), "1");
    let mut bars: Vec<(u8, Mapping)> = Vec::new();
    for bar in [common.0, notify.0, device.0] {
        if bars.iter().any(|(b, _)| *b == bar) {
            continue;
        }
        let path = dev.join(format!("resource{bar}"));
        let len = std::fs::metadata(&path)
            .map(|m| m.len())
            .unwrap_or_else(|e| fail(format!("{}: {e}", path.display())));
        let len = usize::try_from(len).unwrap_or_else(|_| fail("BAR size".into()));
        bars.push((bar, Mapping::of_file(&path, 0, len)));
    }
    Pci {
        bars,
        common,
        notify: (notify.0, notify.1, mult),
        device,
    }
}

/// The MMIO window of platform device `dev`, through `/dev/mem`.
fn mmio_regs(dev: &Path) -> Mmio {
    let name = dev
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let iomem = std::fs::read_to_string("/proc/iomem")
        .unwrap_or_else(|e| fail(format!("/proc/iomem: {e}")));
    let start = iomem
        .lines()
        .find_map(|l| {
            let (range, owner) = l.trim().split_once(" : ")?;
            (owner == name).then(|| u64::from_str_radix(range.split('-').next()?, 16).ok())?
        })
        .unwrap_or_else(|| fail(format!("{name} not in /proc/iomem")));
    let m = Mmio(Mapping::of_file(Path::new("/dev/mem"), start, PAGE));
    if m.0.r32(0) != 0x7472_6976 || m.0.r32(8) != 2 {
        fail(format!("no virtio-mmio block device at {start:#x}"));
    }
    m
}

/// Resets and starts the device with queue 0 of [`QUEUE_SIZE`] in `ring`
/// (at guest-physical `phys`); `bad_sizes` queue_size = 3 writes first.
fn start(regs: &dyn Regs, ring: &Mapping, phys: u64, bad_sizes: usize) -> Result<(), String> {
    regs.set_status(0);
    if regs.status() != 0 {
        return Err("the status did not read 0 after a reset".into());
    }
    for off in 0..PAGE {
        ring.w8(off, 0);
    }
    regs.set_status(ACK | DRIVER);
    regs.set_driver_features(0, 0);
    regs.set_driver_features(1, VERSION_1_HIGH);
    regs.set_status(ACK | DRIVER | FEATURES_OK);
    if regs.status() & FEATURES_OK == 0 {
        return Err("FEATURES_OK refused".into());
    }
    regs.select_queue(0);
    for _ in 0..bad_sizes {
        regs.set_queue_size(3);
    }
    regs.set_queue_size(QUEUE_SIZE);
    let at = |off: usize| phys + u64::try_from(off).unwrap_or(0);
    regs.set_queue_addrs(at(DESC), at(AVAIL), at(USED));
    regs.enable_queue();
    regs.set_status(ACK | DRIVER | FEATURES_OK | DRIVER_OK);
    if regs.status() & DRIVER_OK == 0 {
        return Err(format!("DRIVER_OK refused (status {:#x})", regs.status()));
    }
    Ok(())
}

fn used_idx(ring: &Mapping) -> u16 {
    fence(Ordering::SeqCst);
    ring.r16(USED + 2)
}

/// Publishes `avail_idx` and kicks queue 0.
fn publish(regs: &dyn Regs, ring: &Mapping, avail_idx: u16) {
    fence(Ordering::SeqCst);
    ring.w16(AVAIL + 2, avail_idx);
    fence(Ordering::SeqCst);
    regs.notify(0);
}

/// Reads sector 0 through the ring (first chain, heads 0-2); returns its
/// first `n` bytes.
fn read_sector0(regs: &dyn Regs, ring: &Mapping, phys: u64, n: usize) -> Result<String, String> {
    let at = |off: usize| phys + u64::try_from(off).unwrap_or(0);
    let descs: [(u64, u32, u16, u16); 3] = [
        (at(HEADER), 16, 1, 1),
        (at(DATA), 512, 3, 2),
        (at(STATUS), 1, 2, 0),
    ];
    for (i, (addr, len, flags, next)) in descs.into_iter().enumerate() {
        let d = DESC + 16 * i;
        ring.w64(d, addr);
        ring.w32(d + 8, len);
        ring.w16(d + 12, flags);
        ring.w16(d + 14, next);
    }
    // VIRTIO_BLK_T_IN of sector 0.
    for off in HEADER..HEADER + 16 {
        ring.w8(off, 0);
    }
    ring.w8(STATUS, 0xff);
    ring.w16(AVAIL + 4, 0);
    let before = used_idx(ring);
    publish(regs, ring, ring.r16(AVAIL + 2).wrapping_add(1));
    let end = Instant::now() + Duration::from_secs(20);
    while used_idx(ring) == before {
        if Instant::now() > end {
            return Err("no answer in 20 s".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    if ring.r8(STATUS) != 0 {
        return Err(format!("status {}", ring.r8(STATUS)));
    }
    Ok((0..n).map(|i| char::from(ring.r8(DATA + i))).collect())
}

fn say(transport: &str, key: &str, value: impl std::fmt::Display) {
    println!("@@GUEST hostile_{transport}_{key}={value}");
}

pub fn run(transport: &str, serial: &str, marker: &str) {
    let bus = match transport {
        "pci" => "pci",
        "mmio" => "platform",
        _ => fail(format!("{transport}: pci or mmio")),
    };
    let dev = find_disk(bus, serial);
    unbind(&dev);
    let regs: Box<dyn Regs> = if bus == "pci" {
        Box::new(pci_regs(&dev))
    } else {
        Box::new(mmio_regs(&dev))
    };
    let (ring, phys) = Mapping::locked_page();
    if let Err(e) = start(&*regs, &ring, phys, BAD_SIZE_WRITES) {
        fail(format!("{transport}: starting the device: {e}"));
    }
    say(transport, "bad_size_writes", BAD_SIZE_WRITES);
    match read_sector0(&*regs, &ring, phys, marker.len()) {
        Ok(s) => say(transport, "read", s),
        Err(e) => fail(format!("{transport}: reading sector 0: {e}")),
    }
    let position = used_idx(&ring);
    publish(
        &*regs,
        &ring,
        position.wrapping_add(QUEUE_SIZE).wrapping_add(5),
    );
    say(transport, "kicked", 1);
    std::thread::sleep(Duration::from_secs(2));
    say(
        transport,
        "needs_reset",
        u8::from(regs.status() & NEEDS_RESET != 0),
    );
    regs.set_status(0);
    say(transport, "status_after_reset", regs.status());
    let (name, value) = regs.device_read();
    say(transport, name, value);
    say(transport, "capacity", regs.capacity());
    if let Err(e) = start(&*regs, &ring, phys, 0) {
        fail(format!("{transport}: restarting the device: {e}"));
    }
    match read_sector0(&*regs, &ring, phys, marker.len()) {
        Ok(s) => say(transport, "reread", s),
        Err(e) => say(transport, "reread", format!("failed: {e}")),
    }
    regs.set_status(0);
}
