//! `daxprobe mmap-truncated-rw PATH OFFSET READY GO`: a page of a DAX file
//! that the host cuts short under a guest mapping, then read and written
//! by other processes: a forked child through the inherited mapping, and a
//! new process through a mapping of its own.
//!
//! Maps PATH whole, shared and writable, reads the page at OFFSET, creates
//! READY and waits (60 s at most) for GO (the host has cut the file
//! meanwhile). Then runs each step in a child process of its own and
//! prints, as the step ends, one line `STEP=RESULT`:
//! - `fork_read`, `new_read`: through the inherited mapping, and through a
//!   new `mmap` of the same open file (a mapping of its own, whose first
//!   touch faults in the guest);
//! - `fork_write`, `new_write`: the same, writing one byte at the page's
//!   start (the reads come first, so they cannot see it);
//! - `reopen_read`: through a mapping of PATH opened anew (by then the
//!   guest may have learnt the file's new size).
//!
//! None but `reopen_read` opens the file again, so the guest may still
//! believe the old size: its fault then asks the daemon for a mapping of
//! the vanished range (writable, for a write).
//!
//! RESULT is `zeros` or `data` (what a read step read), `wrote` (a write
//! step's store completed), `sigbus` (the guest kernel refused the
//! access), or what else ended the child.
//! A step that hangs the VM prints nothing, so the last line says which one
//! did.

use std::fs::File;
use std::io::Write;
use std::time::Duration;

use super::{fail, file_len, num, open, wait_for_file, Mapping};

/// Child exit codes: what the page read.
const READ_ZEROS: i32 = 10;
const READ_DATA: i32 = 11;
const WROTE: i32 = 12;

/// Which mapping a step touches the page through.
#[derive(Clone, Copy)]
enum Via {
    Inherited,
    NewMapping,
    Reopened,
}

pub fn run(path: &str, offset: &str, ready: &str, go: &str) {
    let offset: usize = num(offset);
    let f = open(path, true);
    let len = file_len(&f);
    if offset >= len || !offset.is_multiple_of(4096) {
        fail(format!(
            "offset {offset} must be a page inside the {len}-byte {path}"
        ));
    }
    let m = Mapping::new(&f, len, true);
    let first = touch(&m, offset, false);
    println!("touched={}", if first { "zeros" } else { "data" });
    let _ = std::io::stdout().flush();
    File::create(ready).unwrap_or_else(|e| fail(format!("{ready}: {e}")));
    // Goes on after a minute either way.
    let _ = wait_for_file(
        std::path::Path::new(go),
        Duration::from_secs(60),
        Duration::from_millis(50),
    );
    for (step, via, write) in [
        ("fork_read", Via::Inherited, false),
        ("new_read", Via::NewMapping, false),
        ("fork_write", Via::Inherited, true),
        ("new_write", Via::NewMapping, true),
        ("reopen_read", Via::Reopened, false),
    ] {
        let result = in_child(|| {
            let zeros = match via {
                Via::Inherited => touch(&m, offset, write),
                Via::NewMapping => touch(&Mapping::new(&f, len, true), offset, write),
                Via::Reopened => touch(&Mapping::new(&open(path, true), len, true), offset, write),
            };
            if write {
                WROTE
            } else if zeros {
                READ_ZEROS
            } else {
                READ_DATA
            }
        });
        println!("{step}={result}");
        let _ = std::io::stdout().flush();
    }
}

/// Reads (after writing one byte, with `write`) the page at `offset`;
/// whether it is all zeros.
fn touch(m: &Mapping, offset: usize, write: bool) -> bool {
    if write {
        // SAFETY: `offset` lies inside the mapping (checked by the
        // caller), which is shared and writable; volatile so the store is
        // made through the mapping.
        unsafe { std::ptr::write_volatile(m.ptr.add(offset), 0x5a) };
    }
    let page = &m.bytes()[offset..offset + 4096];
    // Volatile reads: the point is the access, not the value.
    page.iter()
        // SAFETY: each element is a valid byte of the live mapping.
        .all(|b| unsafe { std::ptr::read_volatile(b) } == 0)
}

/// Runs `f` in a forked child and says how the child ended.
fn in_child(f: impl FnOnce() -> i32) -> String {
    // SAFETY: fork in a single-threaded program; the child runs `f`,
    // which only touches memory and files, and leaves with _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        fail(format!("fork: {}", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        let code = f();
        // SAFETY: ends the child without running the parent's destructors.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    if libc::WIFSIGNALED(status) {
        return match libc::WTERMSIG(status) {
            libc::SIGBUS => "sigbus".into(),
            sig => format!("signal{sig}"),
        };
    }
    match libc::WEXITSTATUS(status) {
        READ_ZEROS => "zeros".into(),
        READ_DATA => "data".into(),
        WROTE => "wrote".into(),
        code => format!("exit{code}"),
    }
}
