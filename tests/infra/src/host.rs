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

/// Waits (30 s at most) for `path` to appear, as a socket a process binds;
/// panics naming it.
pub fn wait_for_path(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} did not appear",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
}
