//! The dirty log against real KVM (the snapshot tests' counting program;
//! skipped where /dev/kvm cannot be opened), and its merge of KVM's
//! bitmaps with a daemon's shared log.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU8, Ordering};

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::snapshot::tests::{
    boot_program, config, counter, counter_passes, have_kvm, COUNTER_AT, PROGRAM_AT,
};

const GIB: u64 = 1 << 30;

/// A page the program never writes.
const UNTOUCHED_AT: u64 = 0x50_0000;

/// Boot RAM slot 0 (all of the test VM's RAM): KVM answers for its dirty
/// log only while the slot has `KVM_MEM_LOG_DIRTY_PAGES`.
fn slot0_logs(vm: &Vm) -> bool {
    let size = narrow::usize_of(vm.mem.iter().next().expect("RAM").len());
    vm.vm.get_dirty_log(0, size).is_ok()
}

/// The program's counter page is dirty after it ran with logging on, a
/// page it never wrote is not (nor its code page, only read), a second
/// collect while paused finds nothing (the first cleared the log), and a
/// stop takes the flag off the slot again.
#[test]
fn the_counter_page_is_dirty_and_a_collect_clears_it() {
    if !have_kvm() {
        return;
    }
    let config = config();
    let mut vm = boot_program(&config);
    counter_passes(&vm, 0);
    assert!(!slot0_logs(&vm), "no dirty log before start");
    let mut log = DirtyLog::start(&vm).expect("dirty log");
    assert!(slot0_logs(&vm), "start flags the slot");
    counter_passes(&vm, counter(&vm) + 1000);
    vm.pause();
    let dirty = log.collect().expect("collect");
    assert!(dirty.is_dirty(COUNTER_AT), "the counter's page");
    assert!(!dirty.is_dirty(UNTOUCHED_AT), "a page nothing wrote");
    assert!(!dirty.is_dirty(PROGRAM_AT), "the code page is only read");
    assert_eq!(dirty.span(), log.span());
    let again = log.collect().expect("collect again");
    assert!(
        again.is_empty(),
        "paused right after a collect: {} page(s) dirty",
        again.count()
    );
    // Running again: the counter's page comes back.
    vm.resume();
    counter_passes(&vm, counter(&vm) + 1000);
    vm.pause();
    assert!(log.collect().expect("collect").is_dirty(COUNTER_AT));
    log.stop().expect("stop");
    assert!(!slot0_logs(&vm), "stop takes the flag off");
}

/// Dropping the log without `stop` takes the flag off as well.
#[test]
fn a_dropped_log_stops() {
    if !have_kvm() {
        return;
    }
    let vm = boot_program(&config());
    let log = DirtyLog::start(&vm).expect("dirty log");
    assert!(slot0_logs(&vm));
    drop(log);
    assert!(!slot0_logs(&vm));
}

/// The log's file as a daemon maps it: one byte at a time.
fn daemon_view(log: &SharedDirtyLog) -> &'static [AtomicU8] {
    let len = narrow::usize_of(log.size());
    // SAFETY: a fresh shared mapping of the whole file, leaked for the
    // test's life.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            log.file().as_raw_fd(),
            0,
        )
    };
    assert_ne!(ptr, libc::MAP_FAILED);
    // SAFETY: `len` bytes mapped above and never unmapped; AtomicU8 has
    // the layout of u8.
    unsafe { std::slice::from_raw_parts(ptr.cast::<AtomicU8>(), len) }
}

fn mark(view: &[AtomicU8], page: u64) {
    view[narrow::usize_of(page / 8)].fetch_or(1 << (page % 8), Ordering::SeqCst);
}

/// A slot's bitmap lands at its guest-physical pages (also when the slot
/// does not start on a 64-page boundary), the daemon's log is OR-ed in
/// and left cleared, and the bitmap is as long as the span says.
#[test]
fn kvm_bitmaps_and_the_daemon_log_merge_and_the_log_is_taken() {
    let span = 5 * GIB;
    let shared = SharedDirtyLog::new(span).unwrap();
    let view = daemon_view(&shared);
    let mut dirty = DirtyPages::new(span).unwrap();
    assert_eq!(dirty.words().len(), narrow::usize_of(span / PAGE_SIZE / 64));
    // Slot at 4 GiB: pages 0 and 65 of the slot.
    dirty.merge_slot(4 * GIB / PAGE_SIZE, &[1, 1 << 1]);
    // A slot starting at page 3: its page 63 is page 66.
    dirty.merge_slot(3, &[1 << 63]);
    // The daemon wrote page 7 and the slot's page 65 too.
    mark(view, 7);
    mark(view, 4 * GIB / PAGE_SIZE + 65);
    dirty.merge_shared_log(&shared);
    let pages: Vec<u64> = (0..span / PAGE_SIZE)
        .filter(|p| dirty.is_dirty(p * PAGE_SIZE))
        .collect();
    assert_eq!(
        pages,
        [7, 66, 4 * GIB / PAGE_SIZE, 4 * GIB / PAGE_SIZE + 65],
        "merged"
    );
    assert_eq!(dirty.count(), 4);
    assert!(
        view.iter().all(|b| b.load(Ordering::SeqCst) == 0),
        "the log was cleared as it was read"
    );
    let mut next = DirtyPages::new(span).unwrap();
    next.merge_shared_log(&shared);
    assert!(next.is_empty(), "nothing written since");
    assert!(!dirty.is_dirty(span), "past the span");
}

/// A daemon setting bits while the VMM takes the log loses none: each
/// round a writer marks each of one word's 64 pages once while the reader
/// keeps taking that word, so a bit set between a read and a clear would
/// be missing for good.
#[test]
fn no_bit_is_lost_to_a_concurrent_writer() {
    let shared = SharedDirtyLog::new(64 * PAGE_SIZE).unwrap();
    let view = daemon_view(&shared);
    for round in 0..200 {
        let go = std::sync::Arc::new(std::sync::Barrier::new(2));
        let writer = {
            let go = go.clone();
            std::thread::spawn(move || {
                go.wait();
                for page in 0..64 {
                    mark(view, page);
                }
            })
        };
        go.wait();
        let mut seen = 0u64;
        while !writer.is_finished() {
            let bits = shared.take_word(0).unwrap();
            assert_eq!(
                seen & bits,
                0,
                "round {round}: a page marked once came back twice"
            );
            seen |= bits;
        }
        writer.join().unwrap();
        seen |= shared.take_word(0).unwrap();
        assert_eq!(
            seen,
            u64::MAX,
            "round {round}: {} page(s) lost",
            seen.count_zeros()
        );
    }
}

#[test]
fn the_span_is_the_ram_layouts() {
    let cfg = |size, hotplug_size| MemoryConfig {
        size,
        hotplug_size,
        ..Default::default()
    };
    assert_eq!(ram_span(&cfg(512 << 20, None)).unwrap(), 512 << 20);
    // Above the 32-bit hole: RAM goes on from 4 GiB.
    assert_eq!(ram_span(&cfg(4 * GIB, None)).unwrap(), 5 * GIB);
    // The hot-plug area starts at 4 GiB at least.
    assert_eq!(ram_span(&cfg(512 << 20, Some(GIB))).unwrap(), 5 * GIB);
    let e = ram_span(&cfg(u64::MAX - 4096, None)).unwrap_err();
    assert!(e.to_string().contains("memory.size"), "{e}");
    let e = ram_span(&cfg(512 << 20, Some(u64::MAX - GIB))).unwrap_err();
    assert!(e.to_string().contains("memory.hotplug_size"), "{e}");
    let e = ram_span(&cfg(MAX_LOG_SPAN, None)).unwrap_err();
    assert!(e.to_string().contains("above the"), "{e}");
}

/// What the VMM itself writes into guest RAM (its devices' buffers and
/// rings) is in the log, as KVM never sees it: a write before the start
/// is not, one after is, and a collect takes it.
#[test]
fn the_vmms_own_writes_are_logged() {
    if !have_kvm() {
        return;
    }
    let mut vm = boot_program(&config());
    vm.pause();
    let before = GuestAddress(UNTOUCHED_AT);
    let after = GuestAddress(UNTOUCHED_AT + 0x2000);
    vm.mem.write_obj(1u64, before).unwrap();
    let mut log = DirtyLog::start(&vm).expect("dirty log");
    vm.mem.write_obj(2u64, after).unwrap();
    let dirty = log.collect().expect("collect");
    assert!(dirty.is_dirty(after.0), "written by the VMM while logging");
    assert!(!dirty.is_dirty(before.0), "written before the start");
    assert!(!log.collect().expect("again").is_dirty(after.0));
}
