//! A `newc` cpio writer: the format the kernel unpacks as an initramfs.
//!
//! Archives may be concatenated; the kernel unpacks each in turn, so a base
//! image and a per-run overlay can be built separately.

use std::collections::BTreeSet;

const MODE_DIR: u32 = 0o040_755;
const MODE_SYMLINK: u32 = 0o120_777;
const MODE_FILE: u32 = 0o100_000;
const MODE_CHAR: u32 = 0o020_000;

/// An archive built in memory. Parent directories are added on demand.
#[derive(Default)]
pub struct CpioArchive {
    buf: Vec<u8>,
    next_ino: u32,
    dirs: BTreeSet<String>,
}

impl CpioArchive {
    pub fn new() -> Self {
        Self {
            buf: Vec::new(),
            next_ino: 1,
            dirs: BTreeSet::new(),
        }
    }

    /// Adds a regular file with the given permission bits (e.g. 0o755).
    pub fn file(&mut self, path: &str, perm: u32, data: &[u8]) -> &mut Self {
        let path = self.prepare(path);
        self.entry(&path, MODE_FILE | (perm & 0o7777), data);
        self
    }

    pub fn symlink(&mut self, path: &str, target: &str) -> &mut Self {
        let path = self.prepare(path);
        self.entry(&path, MODE_SYMLINK, target.as_bytes());
        self
    }

    /// A character device node. The kernel opens `/dev/console` for init's
    /// stdio before init runs, so an initramfs needs that node.
    pub fn char_device(&mut self, path: &str, perm: u32, major: u32, minor: u32) -> &mut Self {
        let path = self.prepare(path);
        self.entry_with_rdev(&path, MODE_CHAR | (perm & 0o7777), &[], (major, minor));
        self
    }

    pub fn dir(&mut self, path: &str) -> &mut Self {
        let path = self.prepare(path);
        if self.dirs.insert(path.clone()) {
            self.entry(&path, MODE_DIR, &[]);
        }
        self
    }

    /// Closes the archive with the trailer entry and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        // The kernel reads archives in 512-byte blocks; pad like cpio(1) does.
        let padded = self.buf.len().div_ceil(512) * 512;
        self.buf.resize(padded, 0);
        self.buf
    }

    /// Strips the leading '/' and creates the parent directories.
    fn prepare(&mut self, path: &str) -> String {
        let path = path.trim_start_matches('/').to_string();
        let mut parent = String::new();
        let components: Vec<&str> = path.split('/').collect();
        for component in &components[..components.len() - 1] {
            if !parent.is_empty() {
                parent.push('/');
            }
            parent.push_str(component);
            if self.dirs.insert(parent.clone()) {
                let p = parent.clone();
                self.entry(&p, MODE_DIR, &[]);
            }
        }
        path
    }

    fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.entry_with_rdev(name, mode, data, (0, 0));
    }

    fn entry_with_rdev(&mut self, name: &str, mode: u32, data: &[u8], rdev: (u32, u32)) {
        let ino = self.next_ino;
        self.next_ino += 1;
        let nlink = if mode & 0o170_000 == 0o040_000 { 2 } else { 1 };
        let fields = [
            ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            u32::try_from(data.len())
                .expect("a newc member is under 4 GiB (its size field is 32 bits)"),
            0, // devmajor
            0, // devminor
            rdev.0,
            rdev.1,
            u32::try_from(name.len() + 1).expect("a newc name fits its 32-bit field"),
            0, // check
        ];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad4();
        self.buf.extend_from_slice(data);
        self.pad4();
    }

    fn pad4(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::process::{Command, Stdio};

    #[test]
    fn header_layout_and_alignment() {
        let mut a = CpioArchive::new();
        a.file("/bin/x", 0o755, b"hello");
        let bytes = a.finish();
        // First entry is the implied directory "bin".
        assert_eq!(&bytes[..6], b"070701");
        let mode = u32::from_str_radix(std::str::from_utf8(&bytes[14..22]).unwrap(), 16).unwrap();
        assert_eq!(mode, MODE_DIR);
        assert_eq!(bytes.len() % 512, 0);
        let text = String::from_utf8_lossy(&bytes);
        assert!(text.contains("bin/x\0"));
        assert!(text.contains("hello"));
        assert!(text.contains("TRAILER!!!\0"));
    }

    /// cpio(1) must list what we wrote; skipped only where cpio is not installed.
    #[test]
    fn cpio_tool_reads_archive_back() {
        let mut a = CpioArchive::new();
        a.file("etc/a.txt", 0o644, b"abc")
            .symlink("bin/sh", "busybox")
            .dir("dev");
        a.char_device("dev/console", 0o600, 5, 1);
        let bytes = a.finish();
        let Ok(mut child) = Command::new("cpio")
            .args(["-t", "-v", "--quiet"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
        else {
            eprintln!("cpio not installed; archive checked by header test only");
            return;
        };
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success());
        let listing = String::from_utf8(out.stdout).unwrap();
        assert!(listing.contains("etc/a.txt"), "{listing}");
        assert!(listing.contains("bin/sh -> busybox"), "{listing}");
        assert!(
            listing
                .lines()
                .any(|l| l.starts_with('d') && l.ends_with(" dev")),
            "{listing}"
        );
        assert!(
            listing.lines().any(|l| l.starts_with("crw-------")
                && l.contains("5,")
                && l.ends_with(" dev/console")),
            "{listing}"
        );
    }
}
