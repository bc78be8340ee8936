//! A migration's switch over the network on a real tap opened by name:
//! the device closes it so that another process (the receiving VMM) can
//! open the same name, then opens it again and passes frames both ways as
//! before. Needs CAP_NET_ADMIN and /dev/net/tun (skipped without); the
//! host's side of the tap is a packet socket on the interface.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc::channel;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use virtio_bindings::virtio_ring::VRING_DESC_F_WRITE;
use virtio_queue::mock::MockSplitQueue;
use vm_memory::{Address, Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::test_util::{desc, frame, memory};
use super::*;
use crate::test_util::ChannelInterrupt;

/// An EtherType for local experiments (IEEE 802): no host stack answers it.
const ETHER_TYPE: u16 = 0x88b5;
const GUEST_MAC: [u8; 6] = [0x52, 0x54, 0, 0x12, 0x34, 0x56];
const HOST_MAC: [u8; 6] = [0x02, 0, 0, 0, 0, 0x02];
const RX_BUFS: u64 = 0x20_0000;
const TX_BUFS: u64 = 0x30_0000;
/// A bound for a hang, not a speed figure.
const PATIENCE: Duration = Duration::from_secs(30);

/// Opens (or creates) the tap `name` and brings it up, IPv6 off on it so
/// the host sends nothing of its own into it: what the VMM's reopen does.
fn open_up(name: &str) -> Result<Arc<dyn TapLike>, TapError> {
    let tap = Tap::open_named(name)?;
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6"), "1");
    tap.configure_host_side(None, None, None)?;
    Ok(Arc::new(tap))
}

/// A packet socket on the interface for [`ETHER_TYPE`] frames: the frames
/// the guest sent come out of it, the host's frames for the guest go in.
struct HostSide(OwnedFd);

impl HostSide {
    fn on(interface: &str) -> Self {
        let name = CString::new(interface).unwrap();
        // SAFETY: a NUL-terminated name for the call's duration.
        let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
        assert_ne!(index, 0, "{interface}: {}", std::io::Error::last_os_error());
        let protocol = ETHER_TYPE.to_be();
        // SAFETY: integer arguments; the fd is owned right below.
        let fd = unsafe {
            libc::socket(
                libc::AF_PACKET,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::c_int::from(protocol),
            )
        };
        assert!(fd >= 0, "AF_PACKET: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: sockaddr_ll is plain data; zeroed is a valid value.
        let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        addr.sll_family = const { narrow::sa_family_of(libc::AF_PACKET) };
        addr.sll_protocol = protocol;
        addr.sll_ifindex = libc::c_int::try_from(index).unwrap();
        let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_ll>()).unwrap();
        // SAFETY: a valid sockaddr_ll and its size, for the call's duration.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                std::ptr::addr_of!(addr).cast::<libc::sockaddr>(),
                len,
            )
        };
        assert_eq!(rc, 0, "bind: {}", std::io::Error::last_os_error());
        HostSide(fd)
    }

    /// Sends `payload` to the guest's MAC.
    fn send(&self, payload: &[u8]) {
        let mut f = GUEST_MAC.to_vec();
        f.extend_from_slice(&HOST_MAC);
        f.extend_from_slice(&ETHER_TYPE.to_be_bytes());
        f.extend_from_slice(payload);
        // SAFETY: `f` is live and its length is given.
        let n = unsafe { libc::send(self.0.as_raw_fd(), f.as_ptr().cast(), f.len(), 0) };
        assert_eq!(
            usize::try_from(n).ok(),
            Some(f.len()),
            "{}",
            std::io::Error::last_os_error()
        );
    }

    /// Waits (bounded) for a frame with `payload` from the guest.
    fn wait_for(&self, payload: &[u8]) {
        let end = Instant::now() + PATIENCE;
        let mut buf = [0u8; 2048];
        while Instant::now() < end {
            // SAFETY: `buf` is live and its length is given.
            let n =
                unsafe { libc::recv(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
            match usize::try_from(n) {
                Ok(n) if n >= 14 && buf[14..n].starts_with(payload) => return,
                Ok(_) => {}
                Err(_) => std::thread::sleep(Duration::from_millis(1)),
            }
        }
        panic!(
            "{:?} did not come out of the tap",
            String::from_utf8_lossy(payload)
        );
    }
}

/// A guest frame to the host's MAC carrying `payload`, at TX descriptor `n`.
fn tx_frame(
    mem: &GuestMemoryMmap,
    q: &MockSplitQueue<'_, GuestMemoryMmap>,
    n: u16,
    payload: &[u8],
) {
    let mut packet = HOST_MAC.to_vec();
    packet.extend_from_slice(&GUEST_MAC);
    packet.extend_from_slice(&ETHER_TYPE.to_be_bytes());
    packet.extend_from_slice(payload);
    let f = frame(&packet);
    let at = TX_BUFS + u64::from(n) * 0x100;
    mem.write_slice(&f, GuestAddress(at)).unwrap();
    q.add_desc_chains(&[desc(at, u32::try_from(f.len()).unwrap(), 0, 0)], n)
        .unwrap();
}

/// RX descriptors `from..to`, one 2 KiB buffer each (at most 8 in all:
/// the mock queue's used ring starts where a 16-entry available ring's
/// ninth entry would be).
fn rx_buffers(q: &MockSplitQueue<'_, GuestMemoryMmap>, from: u16, to: u16) {
    for n in from..to {
        let at = RX_BUFS + u64::from(n) * 0x1000;
        q.add_desc_chains(&[desc(at, 2048, VRING_DESC_F_WRITE, 0)], n)
            .unwrap();
    }
}

/// Waits (bounded) until a used RX buffer holds a frame carrying `payload`.
fn wait_delivered(mem: &GuestMemoryMmap, q: &MockSplitQueue<'_, GuestMemoryMmap>, payload: &[u8]) {
    let end = Instant::now() + PATIENCE;
    while Instant::now() < end {
        let used: u16 = mem.read_obj(q.used_addr().unchecked_add(2)).unwrap();
        for i in 0..u64::from(used) {
            let head: u32 = mem
                .read_obj(q.used_addr().unchecked_add(4 + 8 * i))
                .unwrap();
            let mut got = vec![0u8; payload.len()];
            let at = RX_BUFS + u64::from(head) * 0x1000 + (VNET_HDR_LEN + 14) as u64;
            mem.read_slice(&mut got, GuestAddress(at)).unwrap();
            if got == payload {
                return;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!(
        "{:?} did not reach the guest",
        String::from_utf8_lossy(payload)
    );
}

/// Before the switch the tap is the device's: a second open of its name
/// is refused (a single-queue tap). Paused and released, the name opens
/// (the receiving VMM's turn) and the device refuses to resume on no tap;
/// taken back, it has the tap again (the fd given is the tap's) and,
/// resumed, moves frames both ways on it.
#[test]
fn a_switch_closes_a_tap_opened_by_name_and_opens_it_again() {
    let name = format!("daxsw{}", std::process::id() % 100_000);
    let tap = match open_up(&name) {
        Ok(t) => t,
        Err(e) => return eprintln!("no tap here ({e}); skipped"),
    };
    let again = name.clone();
    let mut dev = Net::new(NetDeviceConfig {
        id: "net0".into(),
        tap,
        mac: MacAddr(GUEST_MAC),
        mtu: None,
        queue_size: 16,
        allowed_offloads: header::OFFLOAD_FEATURES,
        reopen: Some(Box::new(move || open_up(&again))),
    });
    let mem = memory();
    let rxq = MockSplitQueue::create(&mem, GuestAddress(0), 16);
    let txq = MockSplitQueue::create(&mem, GuestAddress(0x10_0000), 16);
    let kicks = [(); 2].map(|()| EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let (itx, _irq) = channel();
    dev.ack_features(1 << VIRTIO_F_VERSION_1);
    dev.activate(
        GuestMemoryAtomic::new(mem.clone()),
        Arc::new(ChannelInterrupt(Mutex::new(itx))),
        vec![
            ActivatedQueue {
                index: 0,
                queue: rxq.create_queue().unwrap(),
                kick: kicks[0].try_clone().unwrap(),
            },
            ActivatedQueue {
                index: 1,
                queue: txq.create_queue().unwrap(),
                kick: kicks[1].try_clone().unwrap(),
            },
        ],
    )
    .unwrap();
    let host = HostSide::on(&name);
    rx_buffers(&rxq, 0, 4);
    kicks[0].write(1).unwrap();
    tx_frame(&mem, &txq, 0, b"tx-before");
    kicks[1].write(1).unwrap();
    host.wait_for(b"tx-before");
    host.send(b"rx-before");
    wait_delivered(&mem, &rxq, b"rx-before");
    assert!(Tap::open_named(&name).is_err(), "held by the device");

    dev.pause().unwrap();
    assert!(dev.release_for_switch().unwrap());
    drop(host);
    drop(Tap::open_named(&name).expect("free once released"));
    let e = dev.resume().unwrap_err().to_string();
    assert!(e.contains("its tap is closed"), "{e}");

    let fd = dev
        .reclaim_after_switch()
        .unwrap()
        .expect("the new tap's fd");
    assert_eq!(Tap::from_fd(fd).unwrap().name(), name);
    assert!(Tap::open_named(&name).is_err(), "held again");
    dev.resume().unwrap();
    let host = HostSide::on(&name);
    rx_buffers(&rxq, 4, 8);
    kicks[0].write(1).unwrap();
    tx_frame(&mem, &txq, 1, b"tx-after");
    kicks[1].write(1).unwrap();
    host.wait_for(b"tx-after");
    host.send(b"rx-after");
    wait_delivered(&mem, &rxq, b"rx-after");
}

/// A tap passed as an fd (no way to open it again) is kept.
#[test]
fn a_tap_passed_as_an_fd_is_not_released() {
    let (ours, _peer) = super::test_util::pair();
    struct Passed(std::os::unix::net::UnixDatagram);
    impl AsRawFd for Passed {
        fn as_raw_fd(&self) -> std::os::fd::RawFd {
            self.0.as_raw_fd()
        }
    }
    impl FrameIo for Passed {}
    impl TapLike for Passed {
        fn set_offload(&self, _: u32) -> std::io::Result<()> {
            Ok(())
        }
        fn offload_features(&self) -> u64 {
            0
        }
    }
    let mut dev = Net::new(NetDeviceConfig {
        id: "net0".into(),
        tap: Arc::new(Passed(ours)),
        mac: MacAddr(GUEST_MAC),
        mtu: None,
        queue_size: 16,
        allowed_offloads: 0,
        reopen: None,
    });
    assert!(!dev.release_for_switch().unwrap());
    assert!(dev.tap.is_some());
    assert!(dev.reclaim_after_switch().unwrap().is_none());
}
