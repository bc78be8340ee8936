//! Linux capabilities, by raw `capget`/`capset` (two syscalls do not need a
//! C library). The sandbox drops the process to [`KEPT`]; a write that the
//! guest marks "kill suid/sgid" runs with `CAP_FSETID` dropped on its own
//! thread only (capabilities are per thread), so the host kernel clears the
//! setuid/setgid bits and `security.capability` exactly as it would for a
//! local write by an unprivileged process (FUSE_HANDLE_KILLPRIV_V2).

use std::io;

pub const CAP_CHOWN: u32 = 0;
pub const CAP_DAC_OVERRIDE: u32 = 1;
pub const CAP_DAC_READ_SEARCH: u32 = 2;
pub const CAP_FOWNER: u32 = 3;
pub const CAP_FSETID: u32 = 4;
pub const CAP_SYS_ADMIN: u32 = 21;
pub const CAP_MKNOD: u32 = 27;

/// What the daemon keeps once confined: enough to act on any file of the
/// share on the guest's behalf (the guest's kernel checks permissions; the
/// daemon must not be stopped by host modes), to give new entries to their
/// creator, and to create device nodes the guest asks for (never opened).
/// Not kept, among others: CAP_SYS_ADMIN (mounts, namespaces),
/// CAP_DAC_READ_SEARCH (`open_by_handle_at`, the "shocker" escape),
/// CAP_SYS_CHROOT, CAP_SETUID/SETGID, CAP_SETFCAP, CAP_SYS_RESOURCE.
pub const KEPT: [u32; 5] = [
    CAP_CHOWN,
    CAP_DAC_OVERRIDE,
    CAP_FOWNER,
    CAP_FSETID,
    CAP_MKNOD,
];

const VERSION_3: u32 = 0x2008_0522;

#[repr(C)]
struct Header {
    version: u32,
    pid: i32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Data {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// The calling thread's capability sets (two 32-bit words each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CapSets {
    pub effective: u64,
    pub permitted: u64,
    pub inheritable: u64,
}

pub fn mask(caps: &[u32]) -> u64 {
    caps.iter().fold(0, |m, &c| m | 1u64 << c)
}

pub fn get() -> io::Result<CapSets> {
    let mut hdr = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: `hdr` and the two-element `data` array are what capget takes
    // for version 3; both are writable for the call.
    let r = unsafe { libc::syscall(libc::SYS_capget, &mut hdr as *mut Header, data.as_mut_ptr()) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    let join = |lo: u32, hi: u32| u64::from(lo) | u64::from(hi) << 32;
    Ok(CapSets {
        effective: join(data[0].effective, data[1].effective),
        permitted: join(data[0].permitted, data[1].permitted),
        inheritable: join(data[0].inheritable, data[1].inheritable),
    })
}

/// Sets the calling thread's capability sets.
pub fn set(sets: CapSets) -> io::Result<()> {
    let mut hdr = Header {
        version: VERSION_3,
        pid: 0,
    };
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the low half on purpose: the kernel takes each set as two u32 halves"
    )]
    let split = |v: u64| (v as u32, (v >> 32) as u32);
    let (e, p, i) = (
        split(sets.effective),
        split(sets.permitted),
        split(sets.inheritable),
    );
    let data = [
        Data {
            effective: e.0,
            permitted: p.0,
            inheritable: i.0,
        },
        Data {
            effective: e.1,
            permitted: p.1,
            inheritable: i.1,
        },
    ];
    // SAFETY: as in `get`; capset only reads `data`.
    let r = unsafe { libc::syscall(libc::SYS_capset, &mut hdr as *mut Header, data.as_ptr()) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Runs `f` with `CAP_FSETID` out of this thread's effective set, then puts
/// it back. Without the capability to begin with, `f` just runs.
pub fn without_fsetid<T>(f: impl FnOnce() -> io::Result<T>) -> io::Result<T> {
    let sets = get()?;
    let bit = 1u64 << CAP_FSETID;
    if sets.effective & bit == 0 {
        return f();
    }
    set(CapSets {
        effective: sets.effective & !bit,
        ..sets
    })?;
    let result = f();
    if let Err(e) = set(sets) {
        // Leaving the thread without CAP_FSETID only makes later writes clear
        // setuid bits more often; it grants nothing.
        crate::error_limited!("restoring CAP_FSETID after a kill-suid write: {e}");
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fsetid_is_dropped_only_inside_and_only_on_this_thread() {
        let before = get().unwrap();
        let inside = without_fsetid(get).unwrap();
        assert_eq!(inside.effective & (1 << CAP_FSETID), 0);
        assert_eq!(inside.permitted, before.permitted);
        assert_eq!(get().unwrap(), before);
    }
}
