//! The VMM's allowlists against the calls its threads make: each checked
//! in a forked child that installs the main thread's filter and then the
//! thread's own, as the VMM does (a refused call ends the child with
//! SIGSYS), and, for the KVM requests, on a thread of this process against
//! a real VM.

use std::ffi::CString;

use seccomp::{try_in_child, Outcome};

use super::*;

const SIGSYS_: Outcome = Outcome::Signalled(SIGSYS);
const EBADF_: Outcome = Outcome::Returned(EBADF);

/// Runs `call` in a child under the filters of `kinds` (the main thread's
/// first), built there for the child's own pid.
fn under(kinds: &'static [&'static str], call: impl FnOnce() -> i64) -> Outcome {
    try_in_child(
        || {
            let lists = all_for(std::process::id());
            kinds
                .iter()
                .map(|k| {
                    let (_, list) = lists.iter().find(|(n, _)| n == k).unwrap();
                    seccomp::build(k, list, seccomp::Mode::Kill)
                        .unwrap()
                        .unwrap()
                })
                .collect()
        },
        call,
    )
}

const MAIN: &[&str] = &[VMM];
const ON_VCPU: &[&str] = &[VMM, VCPU];
const ON_API: &[&str] = &[VMM, API];
const ON_ACTIVATOR: &[&str] = &[VMM, ACTIVATOR];
const ON_WORKER: &[&str] = &[VMM, ACTIVATOR, DEVICE_WORKER];
const ON_BLOCK_IO: &[&str] = &[VMM, ACTIVATOR, BLOCK_IO];
/// The vsock thread starts with its device, on the main thread.
const ON_VSOCK: &[&str] = &[VMM, VSOCK_WORKER];
/// A net queue pair's thread, started by the activator.
const ON_NET: &[&str] = &[VMM, ACTIVATOR, NET_WORKER];

fn ioctl(request: u64) -> impl FnOnce() -> i64 {
    // SAFETY: an ioctl on fd -1 touches no memory: EBADF if it gets past
    // the filter.
    move || i64::from(unsafe { libc::ioctl(-1, request as _, 0) })
}

fn socket(domain: c_int, kind: c_int) -> impl FnOnce() -> i64 {
    // SAFETY: integer arguments; the fd ends with the child.
    move || i64::from(unsafe { libc::socket(domain, kind, 0) })
}

fn prctl(option: c_int, arg: u64) -> impl FnOnce() -> i64 {
    // SAFETY: the options tested take an integer or a NUL-terminated name
    // (`arg` then points to a static C string).
    move || i64::from(unsafe { libc::prctl(option, arg, 0, 0, 0) })
}

fn open(path: &CString, flags: c_int) -> impl FnOnce() -> i64 {
    let path = path.clone();
    // SAFETY: a NUL-terminated path; the fd ends with the child.
    move || i64::from(unsafe { libc::openat(AT_FDCWD, path.as_ptr(), flags, 0o600) })
}

#[test]
fn the_kvm_request_numbers_are_the_kernels() {
    use kvm_bindings::*;
    use vmm_sys_util::{ioctl_io_nr, ioctl_ior_nr, ioctl_iow_nr};
    ioctl_io_nr!(RUN, KVMIO, 0x80);
    ioctl_ior_nr!(GET_REGS, KVMIO, 0x81, kvm_regs);
    ioctl_iow_nr!(
        SET_USER_MEMORY_REGION,
        KVMIO,
        0x46,
        kvm_userspace_memory_region
    );
    ioctl_iow_nr!(IOEVENTFD, KVMIO, 0x79, kvm_ioeventfd);
    ioctl_iow_nr!(IRQFD, KVMIO, 0x76, kvm_irqfd);
    ioctl_iow_nr!(SET_GSI_ROUTING, KVMIO, 0x6a, kvm_irq_routing);
    assert_eq!(
        [
            KVM_RUN,
            KVM_GET_REGS,
            KVM_SET_USER_MEMORY_REGION,
            KVM_IOEVENTFD,
            KVM_IRQFD,
            KVM_SET_GSI_ROUTING
        ],
        [
            RUN(),
            GET_REGS(),
            SET_USER_MEMORY_REGION(),
            IOEVENTFD(),
            IRQFD(),
            SET_GSI_ROUTING()
        ]
        .map(u64::from)
    );
}

/// A vCPU used to be allowed every ioctl: a guest that took one over
/// could create vCPUs and devices, open KVM's stats, drive a terminal.
#[test]
fn a_vcpu_makes_only_the_kvm_requests_a_vcpu_issues() {
    for &request in VCPU_IOCTLS {
        assert_eq!(under(ON_VCPU, ioctl(request)), EBADF_, "{request:#x}");
    }
    const KVM_CREATE_VCPU: u64 = 0xae41;
    const KVM_GET_STATS_FD: u64 = 0xaece;
    const KVM_CREATE_DEVICE: u64 = 0xc00c_aee0;
    for request in [
        KVM_CREATE_VCPU,
        KVM_GET_STATS_FD,
        KVM_CREATE_DEVICE,
        crate::memory::prefault::KVM_PRE_FAULT_MEMORY_NR,
        TCSETS,
        TIOCSTI,
    ] {
        assert_eq!(under(ON_VCPU, ioctl(request)), SIGSYS_, "{request:#x}");
    }
    // The main thread makes the VM: every request still passes there.
    assert_eq!(under(MAIN, ioctl(KVM_CREATE_VCPU)), EBADF_);
}

/// Every thread could `kill` any process (and `tgkill` any thread): now
/// only the VMM's own threads, by tgkill, as pthread_kill (the vCPU kicks)
/// and abort do.
#[test]
fn signals_reach_only_the_vmms_own_threads() {
    // SAFETY: signal 0 only checks that the target exists.
    let tgkill_self = || unsafe { libc::syscall(SYS_tgkill, libc::getpid(), libc::gettid(), 0) };
    // SAFETY: as above; process 1 exists.
    let tgkill_init = || unsafe { libc::syscall(SYS_tgkill, 1, 1, 0) };
    // SAFETY: as above.
    let kill_self = || i64::from(unsafe { libc::kill(libc::getpid(), 0) });
    // SAFETY: as above.
    let kill_init = || i64::from(unsafe { libc::kill(1, 0) });
    for kinds in [MAIN, ON_VCPU, ON_API, ON_ACTIVATOR, ON_WORKER, ON_VSOCK] {
        assert_eq!(under(kinds, tgkill_self), Outcome::Returned(0), "{kinds:?}");
        assert_eq!(under(kinds, tgkill_init), SIGSYS_, "{kinds:?}");
        assert_eq!(under(kinds, kill_init), SIGSYS_, "{kinds:?}");
        assert_eq!(under(kinds, kill_self), SIGSYS_, "{kinds:?}");
    }
}

/// `prctl` was allowed with any option on every thread: now only naming a
/// new thread and setting no_new_privs, on the threads that start threads.
#[test]
fn prctl_only_names_new_threads_and_sets_no_new_privs_where_threads_start() {
    let name = c"t".as_ptr() as u64;
    for kinds in [MAIN, ON_ACTIVATOR] {
        assert_eq!(under(kinds, prctl(PR_SET_NAME, name)), Outcome::Returned(0));
        assert_eq!(
            under(kinds, prctl(PR_SET_NO_NEW_PRIVS, 1)),
            Outcome::Returned(0)
        );
    }
    for kinds in [MAIN, ON_VCPU, ON_API, ON_ACTIVATOR, ON_WORKER, ON_VSOCK] {
        for option in [PR_SET_DUMPABLE, PR_SET_PDEATHSIG, PR_SET_MM, PR_SET_PTRACER] {
            assert_eq!(
                under(kinds, prctl(option, 0)),
                SIGSYS_,
                "{kinds:?} {option}"
            );
        }
    }
    for kinds in [ON_VCPU, ON_API, ON_WORKER] {
        assert_eq!(under(kinds, prctl(PR_SET_NAME, name)), SIGSYS_, "{kinds:?}");
    }
}

/// `socket` took any family on the main and API threads: now unix stream
/// sockets only, as std (main) and tokio (API) make them, and on the main
/// thread a blocking TCP stream (a migration's); none on a vCPU.
#[test]
fn sockets_are_unix_streams_and_the_main_threads_migration_stream() {
    let (blocking, nonblocking) = (
        SOCK_STREAM | SOCK_CLOEXEC,
        SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK,
    );
    let ok = Outcome::Returned(0);
    assert_eq!(under(MAIN, socket(AF_UNIX, blocking)), ok);
    assert_eq!(under(MAIN, socket(AF_UNIX, nonblocking)), ok);
    assert_eq!(under(ON_API, socket(AF_UNIX, nonblocking)), ok);
    // A migration's TCP stream, the main thread's only (std's blocking
    // sockets: connect, or listen and accept one sender).
    assert_eq!(under(MAIN, socket(AF_INET, blocking)), ok);
    assert_eq!(under(MAIN, socket(AF_INET6, blocking)), ok);
    assert_eq!(under(ON_API, socket(AF_INET, blocking)), SIGSYS_);
    assert_eq!(under(ON_API, socket(AF_INET6, blocking)), SIGSYS_);
    for kinds in [MAIN, ON_API] {
        for (domain, kind) in [
            (AF_INET, nonblocking),
            (AF_INET6, nonblocking),
            (AF_INET, SOCK_STREAM),
            (AF_NETLINK, SOCK_RAW | SOCK_CLOEXEC),
            (AF_PACKET, SOCK_RAW),
            (AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC),
            (AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC),
        ] {
            let refused = under(kinds, socket(domain, kind));
            assert_eq!(refused, SIGSYS_, "{kinds:?} {domain} {kind:#x}");
        }
    }
    for kinds in [ON_VCPU, ON_WORKER, ON_ACTIVATOR] {
        assert_eq!(
            under(kinds, socket(AF_UNIX, blocking)),
            SIGSYS_,
            "{kinds:?}"
        );
    }
}

/// `openat` took any flags on the main thread and was allowed on the API
/// thread, which opens nothing: now the API thread (like every thread but
/// the main one) cannot open a file, and the main thread cannot truncate
/// one, nor create one except by appending (the serial log) or unnamed
/// (a pmem backing in a directory).
#[test]
fn only_the_main_thread_opens_files_and_never_truncates() {
    let dir = std::env::temp_dir().join(format!("seccomp-open-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path =
        |name: &str| CString::new(dir.join(name).into_os_string().into_encoded_bytes()).unwrap();
    let existing = path("existing");
    std::fs::write(dir.join("existing"), b"kept").unwrap();
    let dir_c = path("");
    let ok = Outcome::Returned(0);
    assert_eq!(under(MAIN, open(&existing, O_RDONLY | O_CLOEXEC)), ok);
    assert_eq!(under(MAIN, open(&existing, O_RDWR | O_CLOEXEC)), ok);
    let log = path("serial.log");
    assert_eq!(
        under(MAIN, open(&log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC)),
        ok
    );
    assert_eq!(
        under(MAIN, open(&dir_c, O_RDWR | O_TMPFILE | O_CLOEXEC)),
        ok
    );
    for flags in [
        O_WRONLY | O_TRUNC,
        O_RDWR | O_CREAT,
        O_WRONLY | O_CREAT | O_TRUNC,
        O_WRONLY | O_CREAT | O_EXCL | O_APPEND,
        O_PATH,
        O_WRONLY,
    ] {
        assert_eq!(under(MAIN, open(&existing, flags)), SIGSYS_, "{flags:#o}");
    }
    assert_eq!(std::fs::read(dir.join("existing")).unwrap(), b"kept");
    for kinds in [ON_API, ON_VCPU, ON_ACTIVATOR, ON_WORKER] {
        assert_eq!(
            under(kinds, open(&existing, O_RDONLY | O_CLOEXEC)),
            SIGSYS_,
            "{kinds:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a vCPU does for the guest's device registers, against a real VM on
/// a thread of this process under the main thread's and the vCPU's
/// filters: a BAR moved (its memory slot deleted and made again, an
/// ioeventfd moved), an MSI-X vector routed and its irqfd attached and
/// detached, the registers read for an error message. A refused call would
/// end this test process with SIGSYS.
#[test]
fn a_vcpus_device_work_passes_its_filters_against_real_kvm() {
    use kvm_bindings::{kvm_irq_routing_entry, kvm_userspace_memory_region, KVM_IRQ_ROUTING_MSI};
    use kvm_ioctls::{IoEventAddress, Kvm, NoDatamatch};
    use vmm_sys_util::eventfd::EventFd;
    let Ok(kvm) = Kvm::new() else {
        return eprintln!("no /dev/kvm; skipped");
    };
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    const SIZE: usize = 2 << 20;
    // SAFETY: a fresh anonymous mapping, unmapped at the end of the test.
    let host = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            SIZE,
            PROT_READ | PROT_WRITE,
            MAP_PRIVATE | MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(host, MAP_FAILED);
    let programs: Vec<_> = all_for(std::process::id())
        .into_iter()
        .filter(|(k, _)| [VMM, VCPU].contains(k))
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .collect();
    let (notify, irq) = (
        EventFd::new(EFD_NONBLOCK).unwrap(),
        EventFd::new(EFD_NONBLOCK).unwrap(),
    );
    let host_addr = host as u64;
    std::thread::scope(|s| {
        s.spawn(|| {
            for p in &programs {
                seccomp::apply_filter(p).unwrap();
            }
            let slot = |gpa, size| kvm_userspace_memory_region {
                slot: 0,
                flags: 0,
                guest_phys_addr: gpa,
                memory_size: size,
                userspace_addr: host_addr,
            };
            // SAFETY: the mapping outlives the slot (deleted below).
            unsafe {
                vm.set_user_memory_region(slot(0x1_0000_0000, SIZE as u64))
                    .unwrap();
                vm.set_user_memory_region(slot(0x1_0000_0000, 0)).unwrap();
                vm.set_user_memory_region(slot(0x2_0000_0000, SIZE as u64))
                    .unwrap();
                vm.set_user_memory_region(slot(0x2_0000_0000, 0)).unwrap();
            }
            let at = IoEventAddress::Mmio(0xe000_0000);
            vm.register_ioevent(&notify, &at, NoDatamatch).unwrap();
            vm.unregister_ioevent(&notify, &at, NoDatamatch).unwrap();
            let mut route = kvm_irq_routing_entry {
                gsi: 24,
                type_: KVM_IRQ_ROUTING_MSI,
                ..Default::default()
            };
            route.u.msi.address_lo = 0xfee0_0000;
            let table = kvm_bindings::KvmIrqRouting::from_entries(&[route]).unwrap();
            vm.set_gsi_routing(&table).unwrap();
            vm.register_irqfd(&irq, 24).unwrap();
            vm.unregister_irqfd(&irq, 24).unwrap();
            vcpu.get_regs().unwrap();
        });
    });
    // SAFETY: the mapping made above, no longer in a slot.
    unsafe { libc::munmap(host, SIZE) };
}

#[test]
fn every_thread_kind_is_a_subset_of_the_main_threads_list() {
    // Threads start under the main thread's filter: a call it does not
    // allow would be refused whatever the thread's own list says.
    let main: std::collections::BTreeSet<i64> = COMMON.iter().chain(VMM_CALLS).copied().collect();
    for (kind, extra) in [
        (VCPU, VCPU_CALLS),
        (API, API_CALLS),
        (DEVICE_WORKER, DEVICE_WORKER_CALLS),
        (VSOCK_WORKER, VSOCK_WORKER_CALLS),
        (ACTIVATOR, ACTIVATOR_CALLS),
        (BLOCK_IO, BLOCK_IO_CALLS),
    ] {
        for nr in extra {
            assert!(
                main.contains(nr),
                "{kind} allows syscall {nr}, which the main thread's filter refuses"
            );
        }
    }
    for (kind, list) in all() {
        assert!(seccomp::build(kind, &list, seccomp::Mode::Kill)
            .unwrap()
            .is_some());
    }
}

/// Filters stack: a device worker runs under the activator's filter
/// (which started it) as well as its own. A call the worker needs that
/// the activator's list lacks kills the VMM (seen: recvfrom, when
/// workers were started from vCPUs).
#[test]
fn device_workers_calls_pass_the_filter_of_the_thread_that_starts_them() {
    let activator = all()
        .into_iter()
        .find(|(k, _)| *k == ACTIVATOR)
        .map(|(_, l)| l)
        .unwrap();
    for nr in DEVICE_WORKER_CALLS
        .iter()
        .chain(BLOCK_IO_CALLS)
        .chain(COMMON)
    {
        assert!(
            activator.contains(&Allow::Call(*nr)),
            "a device or block I/O worker needs syscall {nr}, which the activator's filter refuses"
        );
    }
}

/// A virtio-blk I/O thread under its three filters: the I/O a request
/// turns into passes (on a real file), and so does the eventfd write that
/// completes it, and nothing else a compromised
/// thread would want does — no opens, sockets, ioctls, mmap of new files
/// or new processes.
#[test]
fn a_block_io_thread_does_positioned_io_and_nothing_more() {
    let t = vmm_sys_util::tempfile::TempFile::new().unwrap();
    std::fs::write(t.as_path(), vec![7u8; 8192]).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(t.as_path())
        .unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
    // The I/O thread completes the request itself: it raises the guest's
    // interrupt (an irqfd) and wakes a stalled queue thread (an eventfd).
    let irqfd = vmm_sys_util::eventfd::EventFd::new(EFD_NONBLOCK).unwrap();
    let irq = std::os::fd::AsRawFd::as_raw_fd(&irqfd);
    let io = move || {
        let mut buf = [0u8; 512];
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: one iovec over a local buffer; an fd this process owns.
        let read = unsafe { libc::preadv(fd, &iov, 1, 512) };
        // SAFETY: the same buffer, written back.
        let written = unsafe { libc::pwritev(fd, &iov, 1, 1024) };
        // SAFETY: integer arguments on our fd.
        let flushed = unsafe { libc::fdatasync(fd) };
        // SAFETY: integer arguments on our fd; a hole inside the file.
        let punched = unsafe {
            libc::fallocate(
                fd,
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                4096,
                4096,
            )
        };
        // tmpfs and ext4 punch holes; another file system may say
        // EOPNOTSUPP, which is not the filter's doing.
        let punch_ok = punched == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EOPNOTSUPP);
        let one = 1u64.to_ne_bytes();
        // SAFETY: an 8-byte buffer written to an eventfd this process owns.
        let signalled = unsafe { libc::write(irq, one.as_ptr().cast(), one.len()) };
        if (read, written, flushed, signalled) != (512, 512, 0, 8) || !punch_ok {
            // SAFETY: ends the forked child at once with a status the
            // parent reads as "returned 98".
            unsafe { libc::_exit(98) };
        }
        0
    };
    assert_eq!(under(ON_BLOCK_IO, io), Outcome::Returned(0));
    let path = CString::new("/etc/hostname").unwrap();
    assert_eq!(under(ON_BLOCK_IO, open(&path, O_RDONLY)), SIGSYS_);
    assert_eq!(
        under(ON_BLOCK_IO, socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC)),
        SIGSYS_
    );
    assert_eq!(under(ON_BLOCK_IO, ioctl(FIONBIO)), SIGSYS_);
    assert_eq!(
        under(ON_BLOCK_IO, prctl(PR_SET_NAME, c"x".as_ptr() as u64)),
        SIGSYS_
    );
    let fork = || {
        // SAFETY: no arguments; the filter refuses it before it runs.
        i64::from(unsafe { libc::fork() })
    };
    assert_eq!(under(ON_BLOCK_IO, fork), SIGSYS_);
}

#[test]
fn threads_that_start_threads_let_them_install_their_own_filter() {
    // The main thread starts the API thread, vCPUs and the activator;
    // the activator starts device workers. Each new thread calls seccomp(2).
    for (kind, extra) in [(VMM, VMM_CALLS), (ACTIVATOR, ACTIVATOR_CALLS)] {
        for nr in [SYS_clone3, SYS_seccomp] {
            assert!(
                extra.contains(&nr),
                "{kind} starts threads but does not allow syscall {nr}"
            );
        }
    }
}

/// The vsock thread's whole job under its filters, in a child: a guest
/// request connected to `<socket>_<port>`, a host stream accepted with its
/// CONNECT line, bytes both ways, shutdowns. Only non-blocking unix stream
/// sockets; no other family, no file opens, no blocking socket.
#[test]
fn the_vsock_thread_serves_both_directions_under_its_filters() {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    use virtio_devices::vsock::packet::*;
    use virtio_devices::vsock::UnixBackend;

    let dir = std::env::temp_dir().join(format!("seccomp-vsock-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("v.sock");
    // Made on the main thread, as the device is.
    let mut backend = UnixBackend::new(3, &path).unwrap();
    let listener = UnixListener::bind(dir.join("v.sock_5000")).unwrap();
    let mut host_client = UnixStream::connect(&path).unwrap();
    host_client.write_all(b"CONNECT 80\n").unwrap();
    let req = |op, src_port, dst_port, len| Header {
        src_cid: 3,
        dst_cid: HOST_CID,
        src_port,
        dst_port,
        len,
        type_: TYPE_STREAM,
        op,
        flags: 0,
        buf_alloc: 65536,
        fwd_cnt: 0,
    };
    // A step that went wrong: the child's outcome is Returned(step).
    fn failed(step: i32) -> i64 {
        // SAFETY: errno is this thread's; try_in_child reads it back.
        unsafe { *libc::__errno_location() = step };
        -1
    }
    let outcome = under(ON_VSOCK, move || {
        backend.set_active(true);
        let mut buf = vec![0u8; 4096];
        // Guest → host.
        backend
            .on_guest_packet(&req(OP_REQUEST, 1000, 5000, 0), &[])
            .unwrap();
        let Some((h, _)) = backend.next_packet(&mut buf) else {
            return failed(1);
        };
        if h.op != OP_RESPONSE {
            return failed(2);
        }
        let Ok((mut host, _)) = listener.accept() else {
            return failed(3);
        };
        backend
            .on_guest_packet(&req(OP_RW, 1000, 5000, 2), b"hi")
            .unwrap();
        let mut two = [0u8; 2];
        if host.read_exact(&mut two).is_err() || &two != b"hi" {
            return failed(4);
        }
        // Host → guest through the CONNECT line.
        let mut request = None;
        for _ in 0..500 {
            backend.poll_host();
            if let Some((h, _)) = backend.next_packet(&mut buf) {
                request = Some(h);
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let Some(h) = request.filter(|h| h.op == OP_REQUEST && h.dst_port == 80) else {
            return failed(5);
        };
        backend
            .on_guest_packet(&req(OP_RESPONSE, 80, h.src_port, 0), &[])
            .unwrap();
        let mut shut = req(OP_SHUTDOWN, 1000, 5000, 0);
        shut.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
        backend.on_guest_packet(&shut, &[]).unwrap();
        // Stopping: the socket's name goes.
        drop(backend);
        0
    });
    assert_eq!(outcome, Outcome::Returned(0));
    let mut ok = [0u8; 3];
    host_client.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"OK ");
    assert!(!path.exists(), "the stopped backend unlinked its socket");
    let blocking = SOCK_STREAM | SOCK_CLOEXEC;
    assert_eq!(
        under(ON_VSOCK, socket(AF_UNIX, blocking | SOCK_NONBLOCK)),
        Outcome::Returned(0)
    );
    for (domain, kind) in [
        (AF_UNIX, blocking),
        (AF_INET, blocking | SOCK_NONBLOCK),
        (AF_VSOCK, blocking | SOCK_NONBLOCK),
    ] {
        assert_eq!(
            under(ON_VSOCK, socket(domain, kind)),
            SIGSYS_,
            "{domain} {kind:#x}"
        );
    }
    let existing = CString::new(
        dir.join("v.sock_5000")
            .into_os_string()
            .into_encoded_bytes(),
    )
    .unwrap();
    assert_eq!(
        under(ON_VSOCK, open(&existing, O_RDONLY | O_CLOEXEC)),
        SIGSYS_
    );
    assert_eq!(
        under(
            ON_VSOCK,
            ioctl(crate::memory::prefault::KVM_PRE_FAULT_MEMORY_NR)
        ),
        SIGSYS_
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The net worker's whole job under its filters, in a child: frames read
/// and written on the tap (a real one where this test may create it, a
/// datagram pair standing in otherwise). The tap's offloads are set on the
/// activator; its address through an AF_INET socket on the main thread
/// only; the worker has no ioctl and no socket at all.
#[test]
fn the_net_worker_moves_frames_and_nothing_else() {
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixDatagram;
    use virtio_devices::net::{FrameIo, Tap};

    let (guest_side, host_side) = UnixDatagram::pair().unwrap();
    guest_side.set_nonblocking(true).unwrap();
    // The worker reads and writes a tap with readv(2)/writev(2), as here.
    let outcome = under(ON_NET, move || {
        let mut buf = [0u8; 64];
        let (g, h) = (guest_side.as_raw_fd(), host_side.as_raw_fd());
        let at = buf.as_mut_ptr();
        let iov = |len: usize| libc::iovec {
            iov_base: at.cast(),
            iov_len: len,
        };
        let (out, whole) = (iov(40), iov(64));
        // SAFETY: the vectors cover buf, on fds this child holds.
        let (sent, got, empty) = unsafe {
            (
                libc::writev(g, &out, 1),
                libc::readv(h, &whole, 1),
                libc::readv(g, &whole, 1),
            )
        };
        let would_block = std::io::Error::last_os_error().raw_os_error() == Some(EAGAIN);
        if (sent, got, empty) == (40, 40, -1) && would_block {
            0
        } else {
            -1
        }
    });
    assert_eq!(outcome, Outcome::Returned(0));
    let offload = TUNSETOFFLOAD;
    assert_eq!(under(ON_ACTIVATOR, ioctl(offload)), EBADF_);
    for request in [offload, TUNSETIFF, SIOCSIFADDR, FIONBIO] {
        assert_eq!(under(ON_NET, ioctl(request)), SIGSYS_, "{request:#x}");
    }
    let inet = SOCK_DGRAM | SOCK_CLOEXEC;
    assert_eq!(under(MAIN, socket(AF_INET, inet)), Outcome::Returned(0));
    for kinds in [ON_ACTIVATOR, ON_NET, ON_API, ON_VCPU] {
        assert_eq!(under(kinds, socket(AF_INET, inet)), SIGSYS_, "{kinds:?}");
    }
    // A TCP stream is the main thread's for a migration; no other
    // thread that handles guest traffic has one.
    for kinds in [ON_ACTIVATOR, ON_NET, ON_API, ON_VCPU] {
        assert_eq!(
            under(kinds, socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC)),
            SIGSYS_,
            "{kinds:?}"
        );
    }

    // A real tap (needs CAP_NET_ADMIN): opened on the main thread, its
    // offloads set on the activator, read on the worker.
    let name = format!("daxsc{}", std::process::id() % 100000);
    let tap = match Tap::open_named(&name) {
        Ok(t) => std::sync::Arc::new(t),
        Err(e) => return eprintln!("real tap part skipped: {e}"),
    };
    let t = tap.clone();
    assert_eq!(
        under(ON_ACTIVATOR, move || i64::from(
            t.set_offload(TUN_F_CSUM).is_err()
        )),
        Outcome::Returned(0)
    );
    let outcome = under(ON_NET, move || {
        let mut buf = [0u8; 64];
        match tap.recv_frame(&mut buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
            _ => -1,
        }
    });
    assert_eq!(outcome, Outcome::Returned(0));
}

/// `vm.resize` with `desired_ram` on the control (main) thread: a memfd
/// for shared RAM, its size, the mapping, MADV_DONTDUMP, and the new KVM
/// memory slot.
#[test]
fn hotplugged_ram_is_made_and_given_to_kvm_under_the_main_threads_filter() {
    use kvm_bindings::kvm_userspace_memory_region;
    let kvm = kvm_ioctls::Kvm::new().ok();
    let vm = kvm.as_ref().map(|k| k.create_vm().unwrap());
    let programs: Vec<_> = all_for(std::process::id())
        .into_iter()
        .filter(|(k, _)| *k == VMM)
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .collect();
    let outcome = try_in_child(
        || programs,
        || {
            for shared in [false, true] {
                let cfg = crate::config::MemoryConfig {
                    shared,
                    ..Default::default()
                };
                let Ok(region) = crate::memory::create_hotplug_region(&cfg, 1 << 32, 128 << 20)
                else {
                    return 1;
                };
                let Some(vm) = &vm else {
                    continue;
                };
                let slot = |size| kvm_userspace_memory_region {
                    slot: 100,
                    flags: 0,
                    guest_phys_addr: 1 << 32,
                    memory_size: size,
                    userspace_addr: region.as_ptr() as u64,
                };
                // SAFETY: the region outlives the slot, deleted right after.
                let made = unsafe {
                    vm.set_user_memory_region(slot(128 << 20))
                        .and_then(|_| vm.set_user_memory_region(slot(0)))
                };
                if made.is_err() {
                    return 2;
                }
            }
            0
        },
    );
    if kvm.is_none() {
        eprintln!("no /dev/kvm: the KVM slot was not tried");
    }
    assert_eq!(outcome, Outcome::Returned(0));
}

/// `vm.resize` creates vCPUs after boot on the control (main) thread: the
/// KVM vCPU and its CPUID, MSRs, FPU and LAPIC set up under the main
/// thread's filter, then its thread started and entering the vCPU filter,
/// where it runs KVM requests on the new vCPU. Against real KVM.
#[test]
fn a_vcpu_created_at_runtime_by_the_main_thread_passes_its_filters() {
    use crate::vcpu::{Vcpu, VcpuSetup};
    use kvm_ioctls::Kvm;
    let Ok(kvm) = Kvm::new() else {
        return eprintln!("no /dev/kvm; skipped");
    };
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    let mem = crate::memory::create_guest_memory(&crate::config::MemoryConfig {
        size: 32 << 20,
        ..Default::default()
    })
    .unwrap();
    let programs: Vec<_> = all_for(std::process::id())
        .into_iter()
        .filter(|(k, _)| [VMM, VCPU].contains(k))
        .map(|(k, l)| seccomp::build(k, &l, seccomp::Mode::Kill).unwrap().unwrap())
        .collect();
    let (main_filter, vcpu_filter) = (&programs[0], &programs[1]);
    std::thread::scope(|s| {
        s.spawn(|| {
            seccomp::apply_filter(main_filter).unwrap();
            let setup = VcpuSetup {
                topology: crate::config::CpuTopology::flat(4),
                base_cpuid: &cpuid,
                tsc_deadline: false,
                entry: 0,
                mem: &mem,
            };
            // A hot-added vCPU: not the boot one, so no boot registers.
            let vcpu = Vcpu::new(&vm, 2, &setup).unwrap();
            // Its thread, started from here, enters the vCPU filter and
            // makes a vCPU's requests on it.
            std::thread::scope(|t| {
                t.spawn(move || {
                    seccomp::apply_filter(vcpu_filter).unwrap();
                    vcpu.fd().get_regs().unwrap();
                });
            });
        });
    });
}
