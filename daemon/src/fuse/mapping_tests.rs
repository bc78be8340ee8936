//! SETUPMAPPING and REMOVEMAPPING through the server to a stand-in for the
//! VMM on a real backend request channel (REPLY_ACK, as the VMM
//! negotiates it): what the adaptive policy is told is what the VMM did,
//! and the alignment INIT announced holds for the session.

use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

use vhost::vhost_user::message::VhostUserMMap;
use vhost::vhost_user::{
    Backend, Error as VhostError, FrontendReqHandler, HandlerResult, VhostUserFrontendReqHandler,
};

use super::tests::{policy, Rig};
use super::*;
use crate::fuse::abi::{opcode, ROOT_ID};

const MIB: u64 = 1 << 20;

/// The VMM's end of the channel: acknowledges every SHMEM_MAP and
/// SHMEM_UNMAP, or refuses them while told to.
#[derive(Default)]
struct Vmm {
    refuse_maps: AtomicBool,
    refuse_unmaps: AtomicBool,
    /// Each SHMEM_MAP's descriptor: its access mode and the file's inode.
    seen: std::sync::Mutex<Vec<(i32, u64)>>,
}

fn refused() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::EINVAL)
}

impl VhostUserFrontendReqHandler for Vmm {
    fn shmem_map(&self, _req: &VhostUserMMap, fd: &dyn AsRawFd) -> HandlerResult<u64> {
        if self.refuse_maps.load(SeqCst) {
            return Err(refused());
        }
        // SAFETY: F_GETFL on a descriptor the caller holds open.
        let access = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) } & libc::O_ACCMODE;
        // SAFETY: an all-zero stat is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is a valid, writable stat.
        assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
        self.seen.lock().unwrap().push((access, st.st_ino));
        Ok(0)
    }

    fn shmem_unmap(&self, _req: &VhostUserMMap) -> HandlerResult<u64> {
        if self.refuse_unmaps.load(SeqCst) {
            return Err(refused());
        }
        Ok(0)
    }
}

/// Gives the server a channel to `vmm`, served on a thread of its own (the
/// daemon waits for each ack).
fn connect(rig: &Rig, vmm: Arc<Vmm>) {
    let mut requests = FrontendReqHandler::new(vmm).unwrap();
    requests.set_reply_ack_flag(true);
    // SAFETY: `dup` of an fd the handler keeps open; the result is checked.
    let daemon_end = unsafe { libc::dup(requests.get_tx_raw_fd()) };
    assert!(daemon_end >= 0);
    // SAFETY: `daemon_end` is a fresh fd nothing else owns.
    let stream = unsafe { UnixStream::from_raw_fd(daemon_end) };
    let backend = Backend::from_stream(stream);
    backend.set_reply_ack_flag(true);
    backend.set_shmem_flag(true);
    rig.server.connect_vmm_channel(backend);
    // A refusal is answered (with its errno) and the channel lives on;
    // the thread ends when the channel does.
    std::thread::spawn(move || {
        while let Ok(_) | Err(VhostError::ReqHandlerError(_)) = requests.handle_request() {}
    });
}

fn setupmapping(rig: &mut Rig, nodeid: u64, moffset: u64, len: u64) -> i32 {
    setupmapping_with(rig, nodeid, moffset, len, abi::SETUPMAPPING_FLAG_READ)
}

fn setupmapping_with(rig: &mut Rig, nodeid: u64, moffset: u64, len: u64, flags: u64) -> i32 {
    let map = abi::SetupmappingIn {
        fh: u64::MAX,
        foffset: 0,
        len,
        flags,
        moffset,
    };
    rig.call(opcode::SETUPMAPPING, nodeid, map.as_slice()).0
}

fn removemapping(rig: &mut Rig, moffset: u64, len: u64) -> i32 {
    let mut body = abi::RemovemappingIn { count: 1 }.as_slice().to_vec();
    body.extend_from_slice(abi::RemovemappingOne { moffset, len }.as_slice());
    rig.call(opcode::REMOVEMAPPING, ROOT_ID, &body).0
}

fn mapped_ranges(rig: &Rig) -> u64 {
    rig.server.policy.adaptive.stats().mapped_ranges
}

/// A 32 MiB window (the rig's mapper) with a 4 MiB file in it, after an
/// INIT with the VMM's channel up: the rig, the VMM, the file's node id and
/// what INIT answered.
fn rig_with_vmm(json: &str) -> (Rig, Arc<Vmm>, u64, abi::InitOut) {
    let mut rig = Rig::new(policy(json));
    let vmm = Arc::new(Vmm::default());
    connect(&rig, vmm.clone());
    let init = rig.init();
    let f = std::fs::File::create(rig.dir.as_path().join("data")).unwrap();
    f.set_len(4 * MIB).unwrap();
    let file = rig.lookup(ROOT_ID, "data").unwrap().nodeid;
    (rig, vmm, file, init)
}

#[test]
fn only_what_the_vmm_mapped_and_unmapped_is_counted_in_the_window() {
    let (mut rig, vmm, file, _) = rig_with_vmm(r#"{"cache_size": "32M"}"#);

    // The VMM refuses the map: the guest gets EIO, nothing is counted.
    vmm.refuse_maps.store(true, SeqCst);
    assert_eq!(setupmapping(&mut rig, file, 0, 2 * MIB), libc::EIO);
    assert_eq!(
        mapped_ranges(&rig),
        0,
        "a refused SETUPMAPPING maps nothing"
    );

    vmm.refuse_maps.store(false, SeqCst);
    assert_eq!(setupmapping(&mut rig, file, 0, 4 * MIB), 0);
    assert_eq!(mapped_ranges(&rig), 2);

    // The VMM refuses the unmap: the window there may still map the file.
    vmm.refuse_unmaps.store(true, SeqCst);
    assert_eq!(removemapping(&mut rig, 0, 2 * MIB), libc::EIO);
    assert_eq!(mapped_ranges(&rig), 2, "a refused unmap unmaps nothing");
    // A range the daemon refuses itself never reaches the VMM.
    vmm.refuse_unmaps.store(false, SeqCst);
    assert_eq!(removemapping(&mut rig, 0, 2 * MIB + 1), libc::EINVAL);
    assert_eq!(mapped_ranges(&rig), 2, "a malformed unmap unmaps nothing");

    assert_eq!(removemapping(&mut rig, 0, 2 * MIB), 0);
    assert_eq!(mapped_ranges(&rig), 1);
    let report = rig.server.report();
    assert_eq!((report.setupmappings, report.removemappings), (1, 1));
}

#[test]
fn the_alignment_announced_at_init_holds_until_the_next_init() {
    let (mut rig, _vmm, file, out) = rig_with_vmm(r#"{"window_granularity": "2M"}"#);
    assert_eq!(out.map_alignment, 21);

    // A policy of 4 KiB granularity takes hold at the next remount only:
    // this session still refuses what is not 2 MiB-aligned...
    rig.server
        .policy
        .replace(policy(r#"{"window_granularity": "4K"}"#));
    assert_eq!(setupmapping(&mut rig, file, 4096, 4096), libc::EINVAL);
    assert_eq!(rig.server.report().map_alignment, 2 * MIB);
    assert_eq!(setupmapping(&mut rig, file, 2 * MIB, 2 * MIB), 0);

    // ...and the next session is told, and held to, the new one.
    let out = rig.init();
    assert_eq!(out.map_alignment, 12);
    assert_eq!(rig.server.report().map_alignment, 4096);
    let file = rig.lookup(ROOT_ID, "data").unwrap().nodeid;
    assert_eq!(setupmapping(&mut rig, file, 4096, 4096), 0);

    // A coarser policy does not refuse what this session was promised.
    rig.server
        .policy
        .replace(policy(r#"{"window_granularity": "2M"}"#));
    assert_eq!(setupmapping(&mut rig, file, 8192, 4096), 0);
}

/// A guest repeating requests the VMM refuses (or an INIT the daemon
/// refuses) gets each refusal answered, but the log gets at most one line
/// per call site per period, not one per request.
#[test]
fn repeated_refused_mappings_and_inits_log_a_bounded_count() {
    const REPEATS: usize = 1000;
    let (mut rig, vmm, file, _) = rig_with_vmm(r#"{"cache_size": "32M"}"#);
    assert_eq!(setupmapping(&mut rig, file, 0, 2 * MIB), 0);
    vmm.refuse_maps.store(true, SeqCst);
    vmm.refuse_unmaps.store(true, SeqCst);
    let too_old = abi::InitIn {
        major: 7,
        minor: 1,
        ..Default::default()
    };
    crate::log_limit::capture::start();
    for _ in 0..REPEATS {
        assert_eq!(setupmapping(&mut rig, file, 2 * MIB, 2 * MIB), libc::EIO);
        assert_eq!(removemapping(&mut rig, 0, 2 * MIB), libc::EIO);
        let (e, _) = rig.call(opcode::INIT, 0, too_old.as_slice());
        assert_eq!(e, libc::EPROTO);
    }
    // What the daemon logs by default (per-request errnos are debug).
    let logged: Vec<_> = crate::log_limit::capture::take()
        .into_iter()
        .filter(|(level, _)| *level <= tracing::Level::INFO)
        .collect();
    // Three call sites, each logging at most once in a period (none if
    // another test in this process logged there within it).
    assert!(
        logged.len() <= 3,
        "{} lines, first {:?}",
        logged.len(),
        &logged[..4]
    );
    assert_eq!(rig.server.report().dax_failures, 2 * REPEATS as u64);
}

/// A SETUPMAPPING's time in the daemon is traced stage by stage (a count
/// and a sum each): one the VMM refuses counts only the stages it passed;
/// `served` (queue to used ring) counts SETUPMAPPINGs only.
#[test]
fn a_setupmapping_is_traced_stage_by_stage() {
    let (mut rig, vmm, file, _) = rig_with_vmm(r#"{"cache_size": "32M"}"#);
    assert_eq!(setupmapping(&mut rig, file, 0, 2 * MIB), 0);
    vmm.refuse_maps.store(true, SeqCst);
    assert_eq!(setupmapping(&mut rig, file, 2 * MIB, 2 * MIB), libc::EIO);
    let now = std::time::Instant::now();
    rig.server.served(Some(opcode::SETUPMAPPING), now);
    rig.server.served(Some(opcode::READ), now);
    rig.server.served(None, now);
    let stages = rig.server.report().map_stages;
    let count = |name: &str| stages.iter().find(|s| s.stage == name).unwrap().count;
    assert_eq!(
        [
            count("open"),
            count("shmem_map"),
            count("record"),
            count("served")
        ],
        [2, 1, 1, 1]
    );
}

/// A file mapped range after range is opened once: the next range passes
/// the descriptor kept from the first (counted in `map_fds_reused`), of the
/// same file and access. A writable map of it is opened for writing,
/// another file gets its own descriptor, and nothing is kept once the
/// file's last range is unmapped, the guest forgets the node (which can
/// then map nothing), or a new session starts.
#[test]
fn the_next_range_of_a_mapped_file_reuses_its_descriptor_only_while_it_is_mapped() {
    use std::os::unix::fs::MetadataExt;
    let (mut rig, vmm, file, _) = rig_with_vmm(r#"{"cache_size": "32M"}"#);
    let path = |name: &str| rig.dir.as_path().join(name);
    std::fs::File::create(path("other"))
        .unwrap()
        .set_len(4 * MIB)
        .unwrap();
    let ino = |name: &str| std::fs::metadata(path(name)).unwrap().ino();
    let (data_ino, other_ino) = (ino("data"), ino("other"));
    let other = rig.lookup(ROOT_ID, "other").unwrap().nodeid;
    let rw = abi::SETUPMAPPING_FLAG_READ | abi::SETUPMAPPING_FLAG_WRITE;

    assert_eq!(setupmapping(&mut rig, file, 0, 2 * MIB), 0);
    assert_eq!(setupmapping(&mut rig, file, 2 * MIB, 2 * MIB), 0);
    assert_eq!(rig.server.report().map_fds_reused, 1, "the second range");
    assert_eq!(setupmapping_with(&mut rig, file, 4 * MIB, 2 * MIB, rw), 0);
    assert_eq!(setupmapping(&mut rig, other, 6 * MIB, 2 * MIB), 0);
    assert_eq!(
        rig.server.report().map_fds_reused,
        1,
        "a writable map and another file open their own"
    );
    assert_eq!(
        *vmm.seen.lock().unwrap(),
        [
            (libc::O_RDONLY, data_ino),
            (libc::O_RDONLY, data_ino),
            (libc::O_RDWR, data_ino),
            (libc::O_RDONLY, other_ino),
        ]
    );
    assert_eq!(rig.server.dax.kept_fds(), 3);

    // The other file's only range goes: so does its descriptor.
    assert_eq!(removemapping(&mut rig, 6 * MIB, 2 * MIB), 0);
    assert_eq!(rig.server.dax.kept_fds(), 2);
    // The guest forgets the node: its descriptors go, ranges or not, and
    // the forgotten node maps nothing.
    let forget = abi::ForgetIn { nlookup: 1 };
    rig.call(opcode::FORGET, file, forget.as_slice());
    assert_eq!(rig.server.dax.kept_fds(), 0);
    assert_ne!(setupmapping(&mut rig, file, 8 * MIB, 2 * MIB), 0);
    assert_eq!(vmm.seen.lock().unwrap().len(), 4, "nothing reached the VMM");
    // A new session keeps nothing of the old one.
    assert_eq!(setupmapping(&mut rig, other, 6 * MIB, 2 * MIB), 0);
    assert_eq!(rig.server.dax.kept_fds(), 1);
    rig.init();
    assert_eq!(rig.server.dax.kept_fds(), 0);
}

/// At most MAX_KEPT_FDS descriptors are kept, however many files are
/// mapped; the oldest go first.
#[test]
fn kept_descriptors_are_capped() {
    use crate::dax::kept_fds::MAX_KEPT_FDS;
    let (mut rig, _vmm, _, _) = rig_with_vmm(r#"{"window_granularity": "4K"}"#);
    for i in 0..=MAX_KEPT_FDS as u64 {
        let name = format!("f{i}");
        std::fs::File::create(rig.dir.as_path().join(&name)).unwrap();
        let node = rig.lookup(ROOT_ID, &name).unwrap().nodeid;
        assert_eq!(setupmapping(&mut rig, node, i * 4096, 4096), 0);
    }
    assert_eq!(rig.server.dax.kept_fds(), MAX_KEPT_FDS);
}
