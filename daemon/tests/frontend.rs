//! Host-only integration: the daemon binary and the VMM's vhost-user-fs
//! frontend over a real unix socket, with guest memory in this process.
//! The test plays the guest: it puts FUSE requests on the request queue,
//! asks for a DAX mapping, reads the file's bytes through the window, and
//! checks what happens when requests are bad and when the daemon dies.

use std::os::unix::fs::FileExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use daemon::fuse::abi::{self, init, opcode, InHeader, OutHeader, ROOT_ID};
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_devices::device::{ActivatedQueue, Interrupt, VirtioDevice, VirtioInterrupt};
use virtio_devices::vhost_user_fs::{FsDeviceConfig, VhostUserFs};
use virtio_devices::GuestMemoryMmap;
use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueT};
use vm_memory::{Address, ByteValued, Bytes, FileOffset, GuestAddress, GuestMemoryAtomic};
use vmm_sys_util::eventfd::EventFd;
use vmm_sys_util::tempdir::TempDir;
use vmm_sys_util::tempfile::TempFile;

const MIB: u64 = 1 << 20;
const WINDOW: u64 = 8 * MIB;
const QUEUE_SIZE: u16 = 64;
const REQ_BASE: u64 = 0x10_0000;
const REPLY_BASE: u64 = 0x20_0000;
/// Bounds every wait, so a broken daemon fails the test instead of hanging it.
const PATIENCE: Duration = Duration::from_secs(20);

/// The transport's interrupt: `trigger` (what the device's relay thread
/// calls) reports on a channel; with `irqfd`, queue interrupts also have a
/// notifier the daemon is given to write directly, as virtio-PCI's MSI-X has.
struct Irq {
    relayed: Mutex<Sender<u16>>,
    irqfd: Option<EventFd>,
}

impl VirtioInterrupt for Irq {
    fn trigger(&self, interrupt: Interrupt) -> std::io::Result<()> {
        if let Interrupt::Queue(q) = interrupt {
            let _ = self.relayed.lock().unwrap().send(q);
        }
        Ok(())
    }
    fn notifier(&self, interrupt: Interrupt) -> Option<EventFd> {
        match interrupt {
            Interrupt::Queue(_) => self.irqfd.as_ref().map(|e| e.try_clone().unwrap()),
            Interrupt::Config => None,
        }
    }
}

/// The guest's side of the request queue.
struct Guest<'a> {
    mem: &'a GuestMemoryMmap,
    ring: MockSplitQueue<'a, GuestMemoryMmap>,
    kick: EventFd,
    irq: Receiver<u16>,
    /// Where the queue's used ring really is (see [`queue_of`]).
    used_ring: GuestAddress,
    next: u16,
    unique: u64,
}

impl Guest<'_> {
    /// Puts a request on the ring without kicking; returns its slot.
    fn post(&mut self, op: u32, nodeid: u64, body: &[u8]) -> u64 {
        self.post_with(op, nodeid, body, &[], 0x1000, &[])
    }

    /// Puts a request on the ring whose chain has buffers of the test's
    /// choosing (guest-physical address, length): readable ones after the
    /// request, then the slot's reply buffer of `reply_len` bytes, then
    /// writable ones. Returns its slot.
    fn post_with(
        &mut self,
        op: u32,
        nodeid: u64,
        body: &[u8],
        readable: &[(u64, u32)],
        reply_len: u32,
        writable: &[(u64, u32)],
    ) -> u64 {
        self.unique += 1;
        let slot = u64::from(self.next % QUEUE_SIZE);
        let (req_addr, reply_addr) = (REQ_BASE + slot * 0x1000, REPLY_BASE + slot * 0x1000);
        // The request is everything readable: header, body, the extra buffers.
        let extra: u32 = readable.iter().map(|&(_, l)| l).sum();
        let hdr = InHeader {
            len: u32::try_from(40 + body.len()).unwrap() + extra,
            opcode: op,
            unique: self.unique,
            nodeid,
            ..Default::default()
        };
        let req = [hdr.as_slice(), body].concat();
        self.mem.write_slice(&req, GuestAddress(req_addr)).unwrap();
        let bufs: Vec<(u64, u32, u16)> = [(req_addr, u32::try_from(req.len()).unwrap(), 0)]
            .into_iter()
            .chain(readable.iter().map(|&(a, l)| (a, l, 0)))
            .chain([(reply_addr, reply_len, desc_flag(VRING_DESC_F_WRITE))])
            .chain(
                writable
                    .iter()
                    .map(|&(a, l)| (a, l, desc_flag(VRING_DESC_F_WRITE))),
            )
            .collect();
        // Two descriptors per slot, as most requests use; a longer chain
        // borrows the next slots' (requests with one are sent one at a time).
        let mut first = (self.next * 2) % QUEUE_SIZE;
        if usize::from(first) + bufs.len() > usize::from(QUEUE_SIZE) {
            first = 0;
        }
        let last = bufs.len() - 1;
        let descs: Vec<RawDescriptor> = bufs
            .iter()
            .enumerate()
            .map(|(i, &(addr, len, flags))| {
                let (flags, next) = if i < last {
                    let next = first + u16::try_from(i + 1).unwrap();
                    (flags | desc_flag(VRING_DESC_F_NEXT), next)
                } else {
                    (flags, 0)
                };
                RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
            })
            .collect();
        self.ring.add_desc_chains(&descs, first).unwrap();
        self.next += 1;
        slot
    }

    /// Kicks the queue and waits until every posted request is used.
    fn kick_and_wait(&mut self) {
        self.kick.write(1).unwrap();
        let deadline = Instant::now() + PATIENCE;
        loop {
            let used: u16 = self.mem.read_obj(self.used_ring.unchecked_add(2)).unwrap();
            if used == self.next {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{} of {} requests answered",
                used,
                self.next
            );
            let _ = self.irq.recv_timeout(Duration::from_millis(100));
        }
    }

    /// The reply in `slot`: (unique, errno, payload).
    fn reply(&self, slot: u64) -> (u64, i32, Vec<u8>) {
        let reply_addr = REPLY_BASE + slot * 0x1000;
        let out: OutHeader = self.mem.read_obj(GuestAddress(reply_addr)).unwrap();
        let payload_len = (out.len as usize).checked_sub(16);
        let payload_len = payload_len
            .unwrap_or_else(|| panic!("slot {slot} holds no reply (length {})", out.len));
        let mut payload = vec![0u8; payload_len];
        self.mem
            .read_slice(&mut payload, GuestAddress(reply_addr + 16))
            .unwrap();
        (out.unique, -out.error, payload)
    }

    /// Sends one request and waits for it; returns (errno, payload).
    fn call(&mut self, op: u32, nodeid: u64, body: &[u8]) -> (i32, Vec<u8>) {
        let slot = self.post(op, nodeid, body);
        self.kick_and_wait();
        let (unique, errno, payload) = self.reply(slot);
        assert_eq!(unique, self.unique);
        (errno, payload)
    }
}

/// A virtio descriptor flag as the descriptor's 16-bit field.
fn desc_flag(flag: u32) -> u16 {
    u16::try_from(flag).unwrap()
}

/// A test's byte offset as a slice index.
fn index(offset: u64) -> usize {
    usize::try_from(offset).unwrap()
}

fn obj<T: ByteValued + Default>(b: &[u8]) -> T {
    let mut v = T::default();
    v.as_mut_slice()
        .copy_from_slice(&b[..std::mem::size_of::<T>()]);
    v
}

fn start_daemon(share: &Path, socket: &Path) -> Child {
    start_daemon_with(share, socket, &[])
}

fn start_daemon_with(share: &Path, socket: &Path, extra: &[&str]) -> Child {
    spawn_daemon(share, socket, extra, &[])
}

/// Starts the daemon with `groups` as its supplementary groups (set in the
/// child before exec), as a service manager may hand them down.
fn spawn_daemon(share: &Path, socket: &Path, extra: &[&str], groups: &[libc::gid_t]) -> Child {
    let _ = std::fs::remove_file(socket);
    // Unconfined unless the test asks for a sandbox (the confined test does).
    let sandbox: &[&str] = if extra.contains(&"--sandbox") {
        &[]
    } else {
        &["--sandbox", "none"]
    };
    let mut command = Command::new(env!("CARGO_BIN_EXE_dax-virtiofsd"));
    if !groups.is_empty() {
        let groups = groups.to_vec();
        // SAFETY: runs in the forked child before exec; setgroups is one
        // system call on memory allocated before the fork.
        unsafe {
            command.pre_exec(move || {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = command
        .args(sandbox)
        .args(["--cache-size", "8M", "--log-level", "warn"])
        .args(extra)
        .arg("--socket-path")
        .arg(socket)
        .arg("--shared-dir")
        .arg(share)
        .spawn()
        .expect("spawning dax-virtiofsd");
    // Listening, not only bound: a connection is refused in between.
    test_infra::host::wait_for_path(socket);
    child
}

/// Shared guest RAM the daemon can map.
fn guest_memory() -> GuestMemoryMmap {
    let ram = TempFile::new().unwrap().into_file();
    ram.set_len(16 * MIB).unwrap();
    GuestMemoryMmap::from_ranges_with_files(&[(
        GuestAddress(0),
        usize::try_from(16 * MIB).unwrap(),
        Some(FileOffset::new(ram, 0)),
    )])
    .unwrap()
}

/// The queue the device is given for `ring`, with its used ring moved to
/// `used_ring`. virtio-queue 0.18's mock sizes the available ring in
/// elements rather than bytes, so its own used ring overlaps the upper half
/// of the available ring: once more than ~30 requests are posted, the device
/// would read the used index as a descriptor head.
fn queue_of(ring: &MockSplitQueue<GuestMemoryMmap>, used_ring: GuestAddress) -> Queue {
    let mut queue = ring.create_queue::<Queue>().unwrap();
    let low = u32::try_from(used_ring.0 & u64::from(u32::MAX)).unwrap();
    let high = u32::try_from(used_ring.0 >> 32).unwrap();
    queue.set_used_ring_address(Some(low), Some(high));
    queue
}

/// Activates the device with a hiprio and one request queue, as a driver would.
fn activate<'a>(fs: &mut VhostUserFs, mem: &'a GuestMemoryMmap) -> Guest<'a> {
    activate_with(fs, mem, None)
}

/// Activates the device; with `irqfd`, the transport offers it as every
/// queue's notifier.
fn activate_with<'a>(
    fs: &mut VhostUserFs,
    mem: &'a GuestMemoryMmap,
    irqfd: Option<EventFd>,
) -> Guest<'a> {
    let hiprio = MockSplitQueue::create(mem, GuestAddress(0x1000), QUEUE_SIZE);
    let request = MockSplitQueue::create(mem, GuestAddress(0x8000), QUEUE_SIZE);
    // Each queue gets a page of its own past its available ring.
    let (hiprio_used, request_used) = (GuestAddress(0x4000), GuestAddress(0xc000));
    let kicks = [
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
        EventFd::new(libc::EFD_NONBLOCK).unwrap(),
    ];
    let queues = vec![
        ActivatedQueue {
            index: 0,
            queue: queue_of(&hiprio, hiprio_used),
            kick: kicks[0].try_clone().unwrap(),
        },
        ActivatedQueue {
            index: 1,
            queue: queue_of(&request, request_used),
            kick: kicks[1].try_clone().unwrap(),
        },
    ];
    let (tx, rx) = channel();
    fs.ack_features(fs.features());
    let irq = Irq {
        relayed: Mutex::new(tx),
        irqfd,
    };
    fs.activate(GuestMemoryAtomic::new(mem.clone()), Arc::new(irq), queues)
        .expect("activate");
    Guest {
        mem,
        ring: request,
        kick: kicks[1].try_clone().unwrap(),
        irq: rx,
        used_ring: request_used,
        next: 0,
        unique: 0,
    }
}

fn init_in() -> abi::InitIn {
    abi::InitIn {
        major: 7,
        minor: 38,
        flags: u32::try_from(init::INIT_EXT | init::MAP_ALIGNMENT).unwrap(),
        flags2: (init::HAS_INODE_DAX >> 32) as u32,
        ..Default::default()
    }
}

fn fs_config(socket: &Path) -> FsDeviceConfig {
    FsDeviceConfig {
        id: "fs0".into(),
        tag: "share".into(),
        socket: socket.to_path_buf(),
        num_request_queues: 1,
        queue_size: QUEUE_SIZE,
        dax: true,
        cache_size: None,
    }
}

fn window_byte(fs: &VhostUserFs, offset: u64) -> u8 {
    let w = fs.window().unwrap();
    assert!(offset < w.size());
    // SAFETY: the test reads only offsets it has just had mapped.
    unsafe { std::ptr::read_volatile((w.host_addr() + offset) as *const u8) }
}

/// Nothing mapped at `offset`: the window shows its scratch memfd there.
fn window_shows_scratch(fs: &VhostUserFs, offset: u64) -> bool {
    let addr = fs.window().unwrap().host_addr() + offset;
    std::fs::read_to_string("/proc/self/maps")
        .unwrap()
        .lines()
        .any(|l| {
            let (range, rest) = l.split_once(' ').unwrap();
            let (s, e) = range.split_once('-').unwrap();
            (u64::from_str_radix(s, 16).unwrap()..u64::from_str_radix(e, 16).unwrap())
                .contains(&addr)
                && rest.starts_with("rw-s")
                && rest.contains("dax-window-scratch")
        })
}

#[test]
fn setupmapping_maps_the_file_into_the_window_and_a_dead_daemon_fails_only_the_device() {
    let share = TempDir::new().unwrap();
    let pattern: Vec<u8> = (0..4 * MIB).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(share.as_path().join("data.bin"), &pattern).unwrap();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let cfg = fs_config(&socket);

    // A window size the daemon does not declare is refused, naming both.
    let mut daemon = start_daemon(share.as_path(), &socket);
    let e = VhostUserFs::connect(&FsDeviceConfig {
        cache_size: Some(16 * MIB),
        ..cfg.clone()
    })
    .err()
    .expect("mismatch");
    assert!(
        e.to_string().contains("cache_size=16777216") && e.to_string().contains("8388608"),
        "{e}"
    );
    assert!(
        daemon.wait().unwrap().success(),
        "the daemon exits when its VMM goes"
    );
    let mut daemon = start_daemon(share.as_path(), &socket);

    let mem = guest_memory();

    let mut fs = VhostUserFs::connect(&cfg).expect("negotiation");
    assert_eq!(
        fs.window().unwrap().size(),
        WINDOW,
        "window size taken from the daemon"
    );

    let mut cfgspace = [0u8; 40];
    fs.read_config(0, &mut cfgspace);
    assert_eq!(&cfgspace[..5], b"share");
    assert_eq!(u32::from_le_bytes(cfgspace[36..].try_into().unwrap()), 1);

    let mut guest = activate(&mut fs, &mem);
    let (e, p) = guest.call(opcode::INIT, 0, init_in().as_slice());
    assert_eq!(e, 0);
    let init_out: abi::InitOut = obj(&p);
    assert_ne!(
        init_out.flags as u64 & init::MAP_ALIGNMENT,
        0,
        "DAX offered once the backend channel exists"
    );
    // `window_granularity: auto`: 2 MiB where the share's file system
    // caches files in large folios (this machine's temp dir may or not).
    let host_fs = daemon::host_fs::HostFs::probe(share.as_path());
    assert_eq!(
        init_out.map_alignment,
        if host_fs.large_folios { 21 } else { 12 },
        "auto granularity on {}",
        host_fs.describe()
    );
    assert_eq!(init_out.flags2 as u64, init::HAS_INODE_DAX >> 32);

    let (e, p) = guest.call(opcode::LOOKUP, ROOT_ID, b"data.bin\0");
    assert_eq!(e, 0);
    let entry: abi::EntryOut = obj(&p);
    assert_eq!(entry.attr.size, 4 * MIB);
    assert_eq!(
        entry.attr.flags,
        abi::ATTR_DAX,
        "a 4 MiB file gets DAX under the default policy"
    );

    // File range [2M, 4M) at window offset 4M, read-only, as the guest's dax.c does.
    let map = abi::SetupmappingIn {
        fh: u64::MAX,
        foffset: 2 * MIB,
        len: 2 * MIB,
        flags: 2,
        moffset: 4 * MIB,
    };
    assert_eq!(
        guest
            .call(opcode::SETUPMAPPING, entry.nodeid, map.as_slice())
            .0,
        0
    );
    for off in [0, 1, 4095, 4096, MIB + 17, 2 * MIB - 1] {
        assert_eq!(
            window_byte(&fs, 4 * MIB + off),
            pattern[index(2 * MIB + off)],
            "offset {off}"
        );
    }
    let m = fs.window().unwrap().metrics.snapshot();
    assert_eq!((m.maps, m.bytes_mapped), (1, 2 * MIB));

    // A write mapping sees host writes (same page cache) and writes back.
    let rw = abi::SetupmappingIn {
        foffset: 0,
        moffset: 0,
        flags: 3,
        ..map
    };
    assert_eq!(
        guest
            .call(opcode::SETUPMAPPING, entry.nodeid, rw.as_slice())
            .0,
        0
    );
    let host = std::fs::OpenOptions::new()
        .write(true)
        .open(share.as_path().join("data.bin"))
        .unwrap();
    host.write_all_at(b"HOST", 100).unwrap();
    assert_eq!(window_byte(&fs, 100), b'H');

    // Bad requests fail with an errno; the mappings stay as they were.
    let past_end = abi::SetupmappingIn {
        moffset: WINDOW - MIB,
        ..map
    };
    let misaligned = abi::SetupmappingIn {
        moffset: 512,
        ..map
    };
    let bad_flags = abi::SetupmappingIn { flags: 8, ..map };
    for bad in [past_end, misaligned, bad_flags] {
        assert_eq!(
            guest
                .call(opcode::SETUPMAPPING, entry.nodeid, bad.as_slice())
                .0,
            libc::EINVAL,
            "{bad:?}"
        );
    }
    assert_eq!(
        guest.call(opcode::SETUPMAPPING, ROOT_ID, map.as_slice()).0,
        libc::EINVAL,
        "a directory cannot be mapped"
    );
    assert_eq!(window_byte(&fs, 4 * MIB), pattern[index(2 * MIB)]);

    // REMOVEMAPPING of both ranges puts the scratch back.
    let rm = [
        abi::RemovemappingIn { count: 2 }.as_slice().to_vec(),
        abi::RemovemappingOne {
            moffset: 0,
            len: 2 * MIB,
        }
        .as_slice()
        .to_vec(),
        abi::RemovemappingOne {
            moffset: 4 * MIB,
            len: 2 * MIB,
        }
        .as_slice()
        .to_vec(),
    ]
    .concat();
    assert_eq!(guest.call(opcode::REMOVEMAPPING, ROOT_ID, &rm).0, 0);
    assert!(window_shows_scratch(&fs, 0) && window_shows_scratch(&fs, 4 * MIB));
    let m = fs.window().unwrap().metrics.snapshot();
    assert_eq!((m.maps, m.unmaps, m.bytes_mapped), (2, 2, 0));

    // The daemon dies: the device notices, drops its mappings, and is failed;
    // this process (the VMM) carries on.
    assert_eq!(
        guest
            .call(opcode::SETUPMAPPING, entry.nodeid, map.as_slice())
            .0,
        0
    );
    // The host cuts the file to 3 MiB under the mapping of [2M, 4M): the
    // device worker hears of it (inotify) and shows the scratch over the
    // vanished megabyte, which then reads zeros instead of SIGBUS here (or
    // a hung vCPU in a guest); the rest stays the file's.
    host.set_len(3 * MIB).unwrap();
    let deadline = Instant::now() + PATIENCE;
    while !window_shows_scratch(&fs, 5 * MIB) {
        assert!(
            Instant::now() < deadline,
            "the vanished pages never got the scratch"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(window_byte(&fs, 5 * MIB + 4096), 0);
    assert_eq!(window_byte(&fs, 4 * MIB + 1), pattern[index(2 * MIB + 1)]);
    assert_eq!(fs.window().unwrap().metrics.snapshot().truncated_bytes, MIB);
    daemon.kill().unwrap();
    daemon.wait().unwrap();
    let deadline = Instant::now() + PATIENCE;
    while !fs.failed() {
        assert!(
            Instant::now() < deadline,
            "the device never noticed the daemon's death"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        window_shows_scratch(&fs, 4 * MIB),
        "mappings dropped when the daemon went away"
    );
    assert!(fs.reset(), "reset works on a failed device");
}

#[test]
fn a_thread_pool_serves_a_batch_of_requests_out_of_order_and_each_reply_lands_in_its_own_buffer() {
    let share = TempDir::new().unwrap();
    let pattern: Vec<u8> = (0..4 * MIB).map(|i| (i * 13 % 253) as u8).collect();
    std::fs::write(share.as_path().join("data.bin"), &pattern).unwrap();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let mut daemon = start_daemon_with(share.as_path(), &socket, &["--thread-pool-size", "4"]);
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("negotiation");
    // This time the transport has an irqfd for the queues: the daemon must
    // write it itself, and the device relays nothing.
    let irqfd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let mut guest = activate_with(&mut fs, &mem, Some(irqfd.try_clone().unwrap()));
    assert_eq!(guest.call(opcode::INIT, 0, init_in().as_slice()).0, 0);
    let (e, p) = guest.call(opcode::LOOKUP, ROOT_ID, b"data.bin\0");
    assert_eq!(e, 0);
    let nodeid = obj::<abi::EntryOut>(&p).nodeid;
    let (e, p) = guest.call(
        opcode::OPEN,
        nodeid,
        abi::OpenIn {
            flags: libc::O_RDONLY as u32,
            open_flags: 0,
        }
        .as_slice(),
    );
    assert_eq!(e, 0);
    let fh = obj::<abi::OpenOut>(&p).fh;

    // A full ring's worth of reads (two descriptors each), one kick.
    const BATCH: u64 = QUEUE_SIZE as u64 / 2;
    const LEN: u64 = 3000;
    let reads: Vec<(u64, u64, u64)> = (0..BATCH)
        .map(|i| {
            let offset = (i * 130_003) % (4 * MIB - LEN);
            let read = abi::ReadIn {
                fh,
                offset,
                size: u32::try_from(LEN).unwrap(),
                ..Default::default()
            };
            let slot = guest.post(opcode::READ, nodeid, read.as_slice());
            (slot, guest.unique, offset)
        })
        .collect();
    guest.kick_and_wait();
    for (slot, unique, offset) in reads {
        let (got_unique, e, payload) = guest.reply(slot);
        assert_eq!((got_unique, e), (unique, 0), "slot {slot}");
        assert_eq!(
            payload,
            &pattern[index(offset)..index(offset + LEN)],
            "read at {offset}"
        );
    }

    assert!(
        irqfd.read().is_ok_and(|n| n > 0),
        "the daemon signalled the transport's irqfd"
    );
    assert!(
        guest.irq.try_recv().is_err(),
        "no interrupt went through the device's relay"
    );

    // The requests were served by the pool's workers.
    let workers = std::fs::read_dir(format!("/proc/{}/task", daemon.id()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
        .filter(|comm| comm.starts_with("fs-worker-"))
        .count();
    assert_eq!(workers, 4, "--thread-pool-size 4 starts four workers");
    drop(fs);
    assert!(
        daemon.wait().unwrap().success(),
        "the daemon with a pool exits cleanly when its VMM goes"
    );
}

/// The daemon's queue threads, counted by their name in /proc.
fn vring_threads(daemon: &Child) -> usize {
    std::fs::read_dir(format!("/proc/{}/task", daemon.id()))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
        .filter(|comm| comm.trim() == "vring_worker")
        .count()
}

/// One request queue by default, as virtiofsd serves and as Cloud
/// Hypervisor and Kata ask: every queue the daemon offers is a thread from
/// its start, used or not. A VMM asking for more is refused with the
/// option that serves them named; with it, the daemon serves them.
#[test]
fn one_request_queue_by_default_and_a_vmm_asking_for_more_is_told_the_option() {
    let share = TempDir::new().unwrap();
    let sockdir = TempDir::new().unwrap();
    let socket = sockdir.as_path().join("fs.sock");
    let two = FsDeviceConfig {
        num_request_queues: 2,
        ..fs_config(&socket)
    };
    let mut daemon = start_daemon(share.as_path(), &socket);
    wait_for_threads(&daemon, 1);
    assert_eq!(
        vring_threads(&daemon),
        1,
        "hiprio and one request queue, on one thread"
    );
    let e = VhostUserFs::connect(&two)
        .err()
        .expect("two queues refused");
    assert!(
        e.to_string().contains("it serves 2") && e.to_string().contains("--max-request-queues"),
        "{e}"
    );
    assert!(daemon.wait().unwrap().success());

    let mut daemon = start_daemon_with(share.as_path(), &socket, &["--max-request-queues", "2"]);
    wait_for_threads(&daemon, 2);
    assert_eq!(
        vring_threads(&daemon),
        2,
        "a thread for each request queue (hiprio on the first one's)"
    );
    let fs = VhostUserFs::connect(&two).expect("two queues served");
    drop(fs);
    assert!(daemon.wait().unwrap().success());
}

/// Waits (bounded) until the daemon has started `n` queue threads.
fn wait_for_threads(daemon: &Child, n: usize) {
    for _ in 0..200 {
        if vring_threads(daemon) >= n {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// READ and WRITE whose buffers lie in the DAX window.
#[path = "frontend/window_buffers.rs"]
mod window_buffers;

#[path = "frontend/hotplug_ram.rs"]
mod hotplug_ram;

#[path = "common/http.rs"]
mod http;

/// The confined daemon seen from outside through /proc (needs root).
#[path = "frontend/confinement.rs"]
mod confinement;

#[path = "frontend/kata.rs"]
mod kata;

/// SET_DEVICE_STATE_FD / CHECK_DEVICE_STATE with the daemon binary.
#[path = "frontend/device_state.rs"]
mod device_state;

/// A snapshot and restore of the device with its DAX window alive.
#[path = "frontend/restore.rs"]
mod restore;

/// The vhost-user dirty log (LOG_ALL, SET_LOG_BASE) of a READ's writes.
#[path = "frontend/dirty_log.rs"]
mod dirty_log;
