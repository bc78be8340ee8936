//! Seccomp allowlists, shared by the VMM and the daemon: each binary names
//! the system calls a kind of thread makes; this crate turns such a list
//! into a filter (rust-vmm's `seccompiler`), installs it, and reports a
//! blocked call.
//!
//! A filter is installed on the calling thread and inherited by the threads
//! it starts afterwards, so a thread that starts others must allow what
//! they need too (filters stack: a call passes only if every filter on the
//! thread allows it). `no_new_privs` is set with the first filter.
//!
//! The default action on a call outside the list is `SIGSYS` (Trap): the
//! handler [`install_sigsys_report`] sets writes the call's number to stderr
//! and ends the process, so a missing entry is a one-line diagnosis rather
//! than a silent death, and a compromised thread gets no further.

use std::collections::BTreeMap;

/// A built filter and its installation, for callers (tests) that install
/// filters of their own choosing on a thread.
pub use seccompiler::{apply_filter, BpfProgram};
use seccompiler::{
    SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    TargetArch,
};

/// A system call a thread may make, with all arguments or only with
/// arguments among given values (e.g. `ioctl` with `FIONBIO` only).
///
/// Several entries for one call are alternatives: the call passes if any
/// matches. A [`Allow::Call`] entry makes the call pass with any arguments,
/// whatever other entries say (in any order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Allow {
    Call(i64),
    /// (syscall, argument index, the values allowed for it)
    Arg(i64, u8, &'static [u64]),
    /// (syscall, argument index, the one value allowed): for a value known
    /// only when the filter is built, such as the process's own id.
    ArgIs(i64, u8, u64),
    /// (syscall, conditions that must all hold), e.g. `socket` with domain
    /// `AF_UNIX` and type `SOCK_STREAM|SOCK_CLOEXEC`.
    All(i64, &'static [Cond]),
}

/// One argument condition: `(argument & mask) == value`, on the argument's
/// low 32 bits (every argument these filters look at is an `int`: flags,
/// domains, request numbers, pids).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cond {
    pub arg: u8,
    pub mask: u32,
    pub value: u32,
}

impl Cond {
    /// Argument `arg` equals `value`.
    pub const fn eq(arg: u8, value: u32) -> Cond {
        Cond {
            arg,
            mask: u32::MAX,
            value,
        }
    }

    /// The bits `mask` of argument `arg` are `value` (the others are free).
    pub const fn masked(arg: u8, mask: u32, value: u32) -> Cond {
        Cond { arg, mask, value }
    }

    fn condition(&self) -> Result<SeccompCondition, seccompiler::BackendError> {
        let op = if self.mask == u32::MAX {
            SeccompCmpOp::Eq
        } else {
            SeccompCmpOp::MaskedEq(u64::from(self.mask))
        };
        SeccompCondition::new(self.arg, SeccompCmpArgLen::Dword, op, u64::from(self.value))
    }
}

fn rules(allowed: &[Allow]) -> Result<BTreeMap<i64, Vec<SeccompRule>>, seccompiler::BackendError> {
    let mut map: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let mut unconditional = Vec::new();
    let eq = |index, v| SeccompCondition::new(index, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, v);
    for a in allowed {
        match *a {
            Allow::Call(nr) => unconditional.push(nr),
            Allow::Arg(nr, index, values) => {
                let entry = map.entry(nr).or_default();
                for &v in values {
                    entry.push(SeccompRule::new(vec![eq(index, v)?])?);
                }
            }
            Allow::ArgIs(nr, index, value) => {
                let rule = SeccompRule::new(vec![eq(index, value)?])?;
                map.entry(nr).or_default().push(rule);
            }
            Allow::All(nr, conds) => {
                let conds = conds
                    .iter()
                    .map(Cond::condition)
                    .collect::<Result<Vec<_>, _>>()?;
                map.entry(nr).or_default().push(SeccompRule::new(conds)?);
            }
        }
    }
    // An empty rule list is seccompiler's "any arguments"; set last, so an
    // argument entry listed after the call cannot narrow it again.
    for nr in unconditional {
        map.insert(nr, Vec::new());
    }
    Ok(map)
}

/// `ioctl` for the non-blocking and close-on-exec flags only (what std and
/// tokio set on fds), for threads that need no other ioctl.
pub const IOCTL_FD_FLAGS_ONLY: Allow =
    Allow::Arg(libc::SYS_ioctl, 1, &[libc::FIONBIO, libc::FIOCLEX]);

/// Every call in `nrs`, with any arguments.
pub fn calls(nrs: &[i64]) -> Vec<Allow> {
    nrs.iter().map(|&nr| Allow::Call(nr)).collect()
}

/// What happens to a call outside the allowlist (virtiofsd's `--seccomp`,
/// Cloud Hypervisor's `--seccomp true|false|log`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// SIGSYS: reported on stderr, then the process ends.
    Kill,
    /// SIGSYS, left to whatever handles it (a debugger).
    Trap,
    /// Allowed and logged by the kernel (audit log): for finding missing entries.
    Log,
    /// No filter at all.
    None,
}

impl Mode {
    /// Parses a flag value: kill|trap|log|none, with true/false as Cloud
    /// Hypervisor spells kill/none.
    pub fn parse(flag: &str, value: &str) -> Result<Mode, String> {
        match value {
            "kill" | "true" => Ok(Mode::Kill),
            "trap" => Ok(Mode::Trap),
            "log" => Ok(Mode::Log),
            "none" | "false" => Ok(Mode::None),
            _ => Err(format!(
                "{flag} {value}: expected kill, trap, log or none (true = kill, false = none)"
            )),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("building the {kind} seccomp filter: {source}")]
    Build {
        kind: &'static str,
        source: seccompiler::BackendError,
    },
    #[error("installing the {kind} seccomp filter: {source}")]
    Install {
        kind: &'static str,
        source: seccompiler::Error,
    },
    #[error("installing the SIGSYS handler: {0}")]
    Handler(String),
}

/// Builds the filter for a thread `kind` that may make `syscalls`.
pub fn build(
    kind: &'static str,
    syscalls: &[Allow],
    mode: Mode,
) -> Result<Option<BpfProgram>, SeccompError> {
    let mismatch = match mode {
        Mode::None => return Ok(None),
        Mode::Kill | Mode::Trap => SeccompAction::Trap,
        Mode::Log => SeccompAction::Log,
    };
    let rules = rules(syscalls).map_err(|source| SeccompError::Build { kind, source })?;
    let filter = SeccompFilter::new(rules, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(|source| SeccompError::Build { kind, source })?;
    let program: BpfProgram = filter
        .try_into()
        .map_err(|source| SeccompError::Build { kind, source })?;
    Ok(Some(program))
}

/// Builds and installs the filter on the calling thread (and so on every
/// thread it starts later).
pub fn apply(kind: &'static str, syscalls: &[Allow], mode: Mode) -> Result<(), SeccompError> {
    if let Some(program) = build(kind, syscalls, mode)? {
        seccompiler::apply_filter(&program)
            .map_err(|source| SeccompError::Install { kind, source })?;
    }
    Ok(())
}

/// The filters each kind of thread installs when it starts, set once by
/// the binary ([`register`]); library code that starts a thread calls
/// [`enter_thread`] first thing, which does nothing when no filter was
/// registered (unit tests, `--seccomp false`).
static REGISTRY: std::sync::OnceLock<BTreeMap<&'static str, BpfProgram>> =
    std::sync::OnceLock::new();

/// Builds one filter per thread kind and keeps them for [`enter_thread`].
pub fn register(kinds: &[(&'static str, Vec<Allow>)], mode: Mode) -> Result<(), SeccompError> {
    let mut map = BTreeMap::new();
    for (kind, allowed) in kinds {
        if let Some(p) = build(kind, allowed, mode)? {
            map.insert(*kind, p);
        }
    }
    let _ = REGISTRY.set(map);
    Ok(())
}

/// Installs the registered filter of `kind` on the calling thread. A
/// thread whose filter cannot be installed must not go on (fail closed):
/// callers end the thread on an error.
pub fn enter_thread(kind: &'static str) -> Result<(), SeccompError> {
    match REGISTRY.get().and_then(|m| m.get(kind)) {
        Some(program) => seccompiler::apply_filter(program)
            .map_err(|source| SeccompError::Install { kind, source }),
        None => Ok(()),
    }
}

/// Sets `no_new_privs`: nothing this process executes can gain privileges
/// (set-user-ID bits, file capabilities). Seccomp filters need it too.
pub fn set_no_new_privs() -> std::io::Result<()> {
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Installs the SIGSYS handler for [`Mode::Kill`]: it writes
/// "`<program>`: seccomp: blocked system call N on thread T" to stderr and
/// ends the process with status 159 (128 + SIGSYS).
pub fn install_sigsys_report() -> std::io::Result<()> {
    // SAFETY: an all-zero sigaction is valid to fill in; the handler only
    // makes async-signal-safe calls (write, _exit).
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = sigsys_handler as *const () as usize;
    action.sa_flags = libc::SA_SIGINFO;
    // SAFETY: `action` is a valid sigaction; the old action is not wanted.
    if unsafe { libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Formats `n` in decimal into `buf`, returning the digits.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            return &buf[i..];
        }
    }
}

extern "C" fn sigsys_handler(
    _sig: libc::c_int,
    info: *mut libc::siginfo_t,
    _ctx: *mut libc::c_void,
) {
    // For SIGSYS the kernel fills `si_syscall` (an int 24 bytes into
    // siginfo_t on x86-64, after si_call_addr), which libc does not name.
    // SAFETY: the kernel passes a valid siginfo_t of 128 bytes.
    let nr = unsafe { (info as *const u8).add(24).cast::<i32>().read_unaligned() };
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    let (mut a, mut b) = ([0u8; 20], [0u8; 20]);
    // Neither a system call number nor a thread id is negative; if one
    // were, u64::MAX stands out in the message rather than a wrong number.
    let parts: [&[u8]; 5] = [
        b"seccomp: blocked system call ",
        decimal(u64::try_from(nr).unwrap_or(u64::MAX), &mut a),
        b" on thread ",
        decimal(u64::try_from(tid).unwrap_or(u64::MAX), &mut b),
        b"; ending the process\n",
    ];
    for p in parts {
        // SAFETY: write(2) is async-signal-safe; the buffers are live.
        unsafe { libc::write(2, p.as_ptr().cast(), p.len()) };
    }
    // SAFETY: _exit is async-signal-safe and ends the process at once.
    unsafe { libc::_exit(128 + libc::SIGSYS) };
}

/// The calling thread's `Seccomp:` and `NoNewPrivs:` lines from
/// `/proc/thread-self/status` (the tests' check that a filter is on).
#[cfg(test)]
fn thread_status() -> std::io::Result<(u32, u32)> {
    let status = std::fs::read_to_string("/proc/thread-self/status")?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(u32::MAX)
    };
    Ok((field("Seccomp:"), field("NoNewPrivs:")))
}

/// How a call fared in [`try_in_child`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The filters let the call through; it returned this errno (0: it
    /// succeeded). The kernel decides the errno, the filters only whether
    /// the call reaches it.
    Returned(i32),
    /// The child was ended by this signal: `SIGSYS` is a refused call.
    Signalled(i32),
    /// The child could not install the filters (exit status 100 + step).
    Setup(i32),
}

/// Held by [`try_in_child`] from its fork until its child is reaped. A
/// forked child holds a copy of every fd of the process (a tap's, a
/// lock's) until it exits: a test that needs such an fd closed everywhere
/// in the process at some point (a tap another process must be able to
/// open) holds this for its run, so that no other test's child keeps one.
pub static FORK_GUARD: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// For tests: forks, installs `programs` in the child in order (as the
/// VMM's threads stack theirs on the main thread's), makes `call` there and
/// reports whether the filters let it through. `call` returns the call's
/// result (negative: failed, errno is read). The child never returns into
/// the caller; it needs no signal handler: an unhandled SIGSYS ends it.
///
/// `make_programs` runs in the child, so a filter may name the child's own
/// pid; glibc takes malloc's locks across fork, so the child may allocate.
pub fn try_in_child(
    make_programs: impl FnOnce() -> Vec<BpfProgram>,
    call: impl FnOnce() -> i64,
) -> Outcome {
    let _forking = FORK_GUARD.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: the child runs only the closures given and ends with _exit;
    // the parent waits for it below.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // No core file for the expected SIGSYS.
        let none = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: setrlimit reads the struct; the result does not matter.
        unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) };
        let programs = make_programs();
        for p in &programs {
            if seccompiler::apply_filter(p).is_err() {
                // SAFETY: _exit ends the child at once.
                unsafe { libc::_exit(101) };
            }
        }
        let r = call();
        let errno = if r < 0 {
            std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(255)
        } else {
            0
        };
        // SAFETY: _exit ends the child at once (no destructors, no atexit).
        unsafe { libc::_exit(errno.clamp(0, 99)) };
    }
    assert!(pid > 0, "fork: {}", std::io::Error::last_os_error());
    let mut status = 0;
    // SAFETY: waits for the child just forked; `status` is written.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid, "waitpid: {}", std::io::Error::last_os_error());
    if libc::WIFSIGNALED(status) {
        return Outcome::Signalled(libc::WTERMSIG(status));
    }
    match libc::WEXITSTATUS(status) {
        s @ 100.. => Outcome::Setup(s),
        errno => Outcome::Returned(errno),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_in_both_spellings_and_refuse_others_by_name() {
        assert_eq!(Mode::parse("--seccomp", "kill"), Ok(Mode::Kill));
        assert_eq!(Mode::parse("--seccomp", "true"), Ok(Mode::Kill));
        assert_eq!(Mode::parse("--seccomp", "false"), Ok(Mode::None));
        assert_eq!(
            Mode::parse("--seccomp", "maybe"),
            Err(
                "--seccomp maybe: expected kill, trap, log or none (true = kill, false = none)"
                    .into()
            )
        );
    }

    #[test]
    fn a_filter_blocks_what_it_does_not_list_on_its_own_thread_only() {
        let (before, _) = thread_status().unwrap();
        let t = std::thread::spawn(|| {
            // Errno rather than Trap, so the test process survives.
            let map: BTreeMap<i64, Vec<SeccompRule>> =
                [libc::SYS_getppid].iter().map(|&n| (n, vec![])).collect();
            let filter = SeccompFilter::new(
                map,
                SeccompAction::Allow,
                SeccompAction::Errno(libc::EPERM as u32),
                TargetArch::x86_64,
            )
            .unwrap();
            let program: BpfProgram = filter.try_into().unwrap();
            seccompiler::apply_filter(&program).unwrap();
            // SAFETY: getppid has no preconditions.
            let r = unsafe { libc::syscall(libc::SYS_getppid) };
            (
                r,
                std::io::Error::last_os_error().raw_os_error(),
                thread_status().unwrap(),
            )
        });
        let (r, errno, (seccomp, nnp)) = t.join().unwrap();
        assert_eq!((r, errno), (-1, Some(libc::EPERM)));
        assert_eq!((seccomp, nnp), (2, 1));
        assert_eq!(
            thread_status().unwrap().0,
            before,
            "other threads keep their filters"
        );
    }

    #[test]
    fn an_argument_rule_allows_only_the_listed_values() {
        let t = std::thread::spawn(|| {
            let allowed = [
                Allow::Arg(libc::SYS_prctl, 0, &[libc::PR_GET_NAME as u64]),
                Allow::Call(libc::SYS_exit),
            ];
            let mut map = rules(&allowed).unwrap();
            // Everything else this test thread needs to finish.
            for nr in [
                libc::SYS_futex,
                libc::SYS_munmap,
                libc::SYS_madvise,
                libc::SYS_rt_sigprocmask,
                libc::SYS_sigaltstack,
            ] {
                map.insert(nr, vec![]);
            }
            let filter = SeccompFilter::new(
                map,
                SeccompAction::Errno(libc::EPERM as u32),
                SeccompAction::Allow,
                TargetArch::x86_64,
            )
            .unwrap();
            let program: BpfProgram = filter.try_into().unwrap();
            seccompiler::apply_filter(&program).unwrap();
            let mut name = [0u8; 16];
            // SAFETY: PR_GET_NAME writes at most 16 bytes into `name`.
            let get = unsafe { libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr()) };
            // SAFETY: PR_SET_DUMPABLE takes an integer.
            let set = unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1) };
            (get, set)
        });
        assert_eq!(t.join().unwrap(), (0, -1));
    }

    /// Builds the Trap filter of `allowed` plus exit_group (the child's
    /// `_exit`), in the child of [`try_in_child`].
    fn only(allowed: impl FnOnce() -> Vec<Allow>) -> impl FnOnce() -> Vec<BpfProgram> {
        move || {
            let mut list = allowed();
            list.push(Allow::Call(libc::SYS_exit_group));
            vec![build("test", &list, Mode::Kill).unwrap().unwrap()]
        }
    }

    fn socket(domain: i32, kind: i32) -> i64 {
        // SAFETY: socket(2) with integer arguments; the fd ends with the child.
        i64::from(unsafe { libc::socket(domain, kind, 0) })
    }

    const SIGSYS: Outcome = Outcome::Signalled(libc::SIGSYS);

    #[test]
    fn a_call_entry_allows_any_arguments_whatever_the_entries_order() {
        // SAFETY: PR_SET_DUMPABLE takes an integer.
        let set_dumpable = || i64::from(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1) });
        let narrow = Allow::Arg(libc::SYS_prctl, 0, &[libc::PR_GET_NAME as u64]);
        let any = Allow::Call(libc::SYS_prctl);
        assert_eq!(
            try_in_child(only(move || vec![narrow]), set_dumpable),
            SIGSYS
        );
        // Before, an argument entry after the call entry narrowed it again.
        assert_eq!(
            try_in_child(only(move || vec![any, narrow]), set_dumpable),
            Outcome::Returned(0)
        );
        assert_eq!(
            try_in_child(only(move || vec![narrow, any]), set_dumpable),
            Outcome::Returned(0)
        );
    }

    #[test]
    fn an_all_rule_needs_every_condition_and_rules_are_alternatives() {
        const UNIX_STREAM: &[Cond] = &[
            Cond::eq(0, libc::AF_UNIX as u32),
            Cond::eq(1, (libc::SOCK_STREAM | libc::SOCK_CLOEXEC) as u32),
        ];
        const UNIX_DGRAM: &[Cond] = &[
            Cond::eq(0, libc::AF_UNIX as u32),
            Cond::eq(1, libc::SOCK_DGRAM as u32),
        ];
        let unix = || {
            vec![
                Allow::All(libc::SYS_socket, UNIX_STREAM),
                Allow::All(libc::SYS_socket, UNIX_DGRAM),
            ]
        };
        let stream = libc::SOCK_STREAM | libc::SOCK_CLOEXEC;
        assert_eq!(
            try_in_child(only(unix), || socket(libc::AF_UNIX, stream)),
            Outcome::Returned(0)
        );
        assert_eq!(
            try_in_child(only(unix), || socket(libc::AF_UNIX, libc::SOCK_DGRAM)),
            Outcome::Returned(0)
        );
        assert_eq!(
            try_in_child(only(unix), || socket(libc::AF_INET, stream)),
            SIGSYS
        );
        assert_eq!(
            try_in_child(only(unix), || socket(libc::AF_UNIX, libc::SOCK_SEQPACKET)),
            SIGSYS
        );
    }

    #[test]
    fn a_masked_condition_looks_only_at_the_masked_bits() {
        const READ_ONLY: &[Cond] = &[Cond::masked(
            2,
            libc::O_ACCMODE as u32,
            libc::O_RDONLY as u32,
        )];
        let open = |flags: i32| {
            move || {
                // SAFETY: a NUL-terminated path; the fd ends with the child.
                i64::from(unsafe { libc::openat(libc::AT_FDCWD, c"/dev/null".as_ptr(), flags) })
            }
        };
        let list = || vec![Allow::All(libc::SYS_openat, READ_ONLY)];
        assert_eq!(
            try_in_child(only(list), open(libc::O_RDONLY | libc::O_CLOEXEC)),
            Outcome::Returned(0)
        );
        assert_eq!(try_in_child(only(list), open(libc::O_RDWR)), SIGSYS);
    }

    #[test]
    fn an_argument_known_at_build_time_is_compared_with_that_value() {
        // Built in the child: its own pid.
        let own_pid = || {
            let pid = u64::from(std::process::id());
            vec![
                Allow::ArgIs(libc::SYS_kill, 0, pid),
                Allow::Call(libc::SYS_getpid),
            ]
        };
        // SAFETY: signal 0 only checks that the process exists.
        let kill_self = || i64::from(unsafe { libc::kill(libc::getpid(), 0) });
        // SAFETY: as above; pid 1 exists.
        let kill_init = || i64::from(unsafe { libc::kill(1, 0) });
        assert_eq!(try_in_child(only(own_pid), kill_self), Outcome::Returned(0));
        assert_eq!(try_in_child(only(own_pid), kill_init), SIGSYS);
    }

    #[test]
    fn decimal_formats_without_allocating() {
        let mut b = [0u8; 20];
        assert_eq!(decimal(0, &mut b), b"0");
        assert_eq!(decimal(4096, &mut b), b"4096");
        assert_eq!(decimal(u64::MAX, &mut b), b"18446744073709551615");
    }
}
