//! Host helpers: the cache directory, running tools with useful errors, and
//! checking that a binary can run inside an initramfs without libraries.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::RigError;

/// `~/.cache/dax-vmm` (or `$XDG_CACHE_HOME/dax-vmm`); everything the rig
/// downloads or builds once lives here, keyed by version.
pub fn cache_dir() -> Result<PathBuf, RigError> {
    let base = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME")
                .ok_or_else(|| RigError::Setup("HOME is not set".into()))?;
            PathBuf::from(home).join(".cache")
        }
    };
    let dir = base.join("dax-vmm");
    std::fs::create_dir_all(&dir).map_err(|e| RigError::io(&dir, e))?;
    Ok(dir)
}

/// Runs a command to completion; a failure carries its stderr.
pub fn run(cmd: &mut Command) -> Result<Vec<u8>, RigError> {
    let what = format!("{cmd:?}");
    let out = cmd
        .output()
        .map_err(|e| RigError::Setup(format!("{what}: {e}")))?;
    if !out.status.success() {
        return Err(RigError::Setup(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out.stdout)
}

/// True when the ELF file has no program interpreter (PT_INTERP), i.e. it is
/// statically linked and runs in an initramfs that holds no libc.
pub fn is_static_elf(path: &Path) -> Result<bool, RigError> {
    let bytes = std::fs::read(path).map_err(|e| RigError::io(path, e))?;
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return Err(RigError::Setup(format!(
            "{} is not a 64-bit ELF file",
            path.display()
        )));
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let phoff = usize::try_from(u64::from_le_bytes(bytes[0x20..0x28].try_into().unwrap()))
        .map_err(|_| RigError::Setup(format!("{}: e_phoff out of range", path.display())))?;
    let (phentsize, phnum) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    for i in 0..phnum {
        let off = phoff + i * phentsize;
        let Some(p_type) = bytes.get(off..off + 4) else {
            return Err(RigError::Setup(format!(
                "{}: truncated program headers",
                path.display()
            )));
        };
        if u32::from_le_bytes(p_type.try_into().unwrap()) == PT_INTERP {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The CPU flags line of /proc/cpuinfo has `vmx` (Intel) or `svm` (AMD).
pub fn has_hardware_virtualization() -> bool {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|info| {
            info.lines()
                .filter(|l| l.starts_with("flags"))
                .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"))
        })
        .unwrap_or(false)
}

/// The static busybox from Debian's `busybox-static`.
pub fn static_busybox() -> Result<PathBuf, RigError> {
    let path = PathBuf::from("/bin/busybox");
    if !path.exists() {
        return Err(RigError::Setup(
            "/bin/busybox is missing: apt-get install busybox-static".into(),
        ));
    }
    if !is_static_elf(&path)? {
        return Err(RigError::Setup(
            "/bin/busybox is dynamically linked: apt-get install busybox-static (it replaces busybox)".into(),
        ));
    }
    Ok(path)
}

/// A static build of a tool published on crates.io, installed once with
/// `cargo install --locked` (the versions its own lock file pins) into the
/// cache: pjdfstest, run inside guests, and virtiofsd, benchmarked beside
/// our daemon. `env` is added to the build's environment (e.g. to link a
/// C library statically).
pub fn crates_io_tool(
    krate: &str,
    version: &str,
    bin: &str,
    env: &[(&str, &str)],
) -> Result<PathBuf, RigError> {
    let root = cache_dir()?.join(format!("{krate}-{version}"));
    let path = root.join("bin").join(bin);
    // A cached copy that is not static (built by hand, say) is built again.
    if !is_static_elf(&path).unwrap_or(false) {
        eprintln!(
            "building {krate} {version} (static) into {}",
            root.display()
        );
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = std::process::Command::new(cargo)
            .args(["install", krate, "--version", version, "--locked", "--root"])
            .arg(&root)
            // With an explicit target the flag reaches the tool, not the
            // build scripts and proc macros, which cannot be static.
            .args(["--target", "x86_64-unknown-linux-gnu"])
            .env("RUSTFLAGS", "-C target-feature=+crt-static")
            .env("CARGO_TARGET_DIR", root.join("build"))
            .envs(env.iter().copied())
            .status()
            .map_err(|e| RigError::Setup(format!("cargo install {krate}: {e}")))?;
        if !status.success() {
            return Err(RigError::Setup(format!(
                "cargo install {krate} {version} failed ({status})"
            )));
        }
    }
    if !is_static_elf(&path)? {
        return Err(RigError::Setup(format!(
            "{} is not statically linked",
            path.display()
        )));
    }
    Ok(path)
}

/// A child process (a test's VMM, daemon or etcd) killed and reaped when
/// dropped, so a failing test leaves none behind.
pub struct KillOnDrop(pub Child);

/// Our daemon as the API tests and benchmarks run it on this host: no
/// sandbox, errors only, a 64 MiB window, serving `share` on the
/// vhost-user socket `socket` with its control socket at `control`.
pub fn spawn_daemon(share: &Path, socket: &Path, control: &Path) -> KillOnDrop {
    let daemon = crate::rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd");
    KillOnDrop(
        Command::new(&daemon)
            .args([
                "--sandbox",
                "none",
                "--log-level",
                "error",
                "--cache-size",
                "64M",
            ])
            .arg("--socket-path")
            .arg(socket)
            .arg("--shared-dir")
            .arg(share)
            .arg("--control-socket")
            .arg(control)
            .spawn()
            .expect("starting dax-virtiofsd"),
    )
}

impl KillOnDrop {
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Waits (30 s at most) for `path` to appear and, when it is a unix
/// socket, for its owner to listen on it; panics naming it.
///
/// A socket file exists from `bind` on, but a connection is refused until
/// `listen`: a client that connects on seeing the file alone fails now and
/// then on a loaded machine.
pub fn wait_for_path(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() || (is_socket(path) && bound_not_listening(path)) {
        assert!(
            Instant::now() < deadline,
            "{} did not appear (or nobody listens on it)",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_socket(path: &Path) -> bool {
    use std::os::unix::fs::FileTypeExt;
    std::fs::metadata(path).is_ok_and(|m| m.file_type().is_socket())
}

/// Whether `/proc/net/unix` (this network namespace) lists a socket bound
/// at `path` and none of them listening (their flags lack
/// `__SO_ACCEPTCON`): the state between `bind` and `listen`. A socket
/// bound under another name and renamed into place once it listens (the
/// VMM's API socket is) is not listed under `path`, and is ready. Nothing
/// connects to find out: a daemon that serves one VMM would take a probe
/// for it.
pub fn bound_not_listening(path: &Path) -> bool {
    const SO_ACCEPTCON: u32 = 0x0001_0000;
    let Ok(table) = std::fs::read_to_string("/proc/net/unix") else {
        return false;
    };
    let want = path.as_os_str().to_string_lossy();
    let flags: Vec<u32> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.len() >= 8 && fields[7] == want)
                .then(|| u32::from_str_radix(fields[3], 16).ok())
                .flatten()
        })
        .collect();
    !flags.is_empty() && flags.iter().all(|f| f & SO_ACCEPTCON == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dynamic_binaries_are_not_static() {
        // /bin/sh on Debian is dash, dynamically linked.
        assert!(!is_static_elf(Path::new("/bin/sh")).unwrap());
    }

    #[test]
    fn non_elf_is_an_error() {
        let path = std::env::temp_dir().join(format!("rig-not-elf-{}", std::process::id()));
        std::fs::write(
            &path,
            b"#!/bin/sh\necho not an ELF file, but long enough to hold a header......\n",
        )
        .unwrap();
        let result = is_static_elf(&path);
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(result, Err(RigError::Setup(m)) if m.contains("not a 64-bit ELF")));
    }
    /// A socket bound but not yet listening refuses connections: it does
    /// not count as ready until `listen`.
    #[test]
    fn a_bound_socket_is_ready_only_once_it_listens() {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        use std::os::unix::ffi::OsStrExt;
        let path = std::env::temp_dir().join(format!("rig-listen-{}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        // SAFETY: plain socket(2); the fd is owned right below.
        let raw = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0) };
        assert!(raw >= 0);
        // SAFETY: `raw` is a fresh fd nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: an all-zero sockaddr_un is valid; the path is copied in below.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        addr.sun_family = libc::sa_family_t::try_from(libc::AF_UNIX).unwrap();
        for (d, s) in addr.sun_path.iter_mut().zip(path.as_os_str().as_bytes()) {
            *d = libc::c_char::from_ne_bytes([*s]);
        }
        let len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_un>()).unwrap();
        // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
        let bound = unsafe { libc::bind(fd.as_raw_fd(), std::ptr::addr_of!(addr).cast(), len) };
        assert_eq!(bound, 0, "{}", std::io::Error::last_os_error());
        assert!(path.exists() && is_socket(&path));
        assert!(bound_not_listening(&path), "bound, not listening");
        assert!(std::os::unix::net::UnixStream::connect(&path).is_err());
        // SAFETY: listen(2) on our bound socket.
        assert_eq!(unsafe { libc::listen(fd.as_raw_fd(), 1) }, 0);
        assert!(!bound_not_listening(&path));
        wait_for_path(&path);
        // Renamed into place once listening (as the VMM's API socket is).
        let renamed = path.with_extension("renamed");
        std::fs::rename(&path, &renamed).unwrap();
        assert!(!bound_not_listening(&renamed));
        wait_for_path(&renamed);
        std::fs::rename(&renamed, &path).unwrap();
        drop(fd);
        std::fs::remove_file(&path).unwrap();
    }
}
