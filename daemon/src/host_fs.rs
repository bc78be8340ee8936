//! What the shared directory's file system is, and whether the host's page
//! cache holds its files in large folios — then a 2 MiB-aligned mapping of
//! a file can be a single PMD in the VMM's page tables and KVM maps the
//! guest's view 2 MiB at a time, so `window_granularity: auto` announces
//! 2 MiB. Probed once at start, before the sandbox hides `/proc`'s view of
//! the host's mounts.
//!
//! The verdict is by file system and kernel: tmpfs with `huge=always` or
//! `huge=within_size` (or shmem THP forced), XFS from Linux 5.18 (large
//! folios in the page cache), ext4 from Linux 6.16. Everything else —
//! btrfs (experimental there), overlayfs, NFS, tmpfs without huge pages,
//! older kernels — is 4 KiB.

use std::os::fd::AsRawFd;
use std::path::Path;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFs {
    /// `tmpfs`, `xfs`, `ext4`, ... or the magic number in hex.
    pub kind: String,
    pub large_folios: bool,
    /// Why, in words, for the log and the stats.
    pub why: String,
}

const TMPFS_MAGIC: i64 = 0x0102_1994;
const XFS_MAGIC: i64 = 0x5846_5342;
const EXT4_MAGIC: i64 = 0xEF53;
const BTRFS_MAGIC: i64 = 0x9123_683E;
const OVERLAYFS_MAGIC: i64 = 0x794C_7630;
const NFS_MAGIC: i64 = 0x6969;
const FUSE_MAGIC: i64 = 0x6573_5546;
const RAMFS_MAGIC: i64 = 0x8584_58f6;

impl HostFs {
    pub fn unknown() -> Self {
        HostFs {
            kind: "unknown".into(),
            large_folios: false,
            why: "not probed".into(),
        }
    }

    /// Probes the file system holding `dir`.
    pub fn probe(dir: &Path) -> Self {
        let file = match std::fs::File::open(dir) {
            Ok(f) => f,
            Err(e) => {
                return HostFs {
                    why: format!("cannot open it: {e}"),
                    ..Self::unknown()
                }
            }
        };
        // SAFETY: statfs is plain data; fstatfs fills it from a valid fd.
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: `file` is open for the call; `st` is writable.
        if unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) } != 0 {
            return HostFs {
                why: format!("fstatfs: {}", std::io::Error::last_os_error()),
                ..Self::unknown()
            };
        }
        let release = kernel_release();
        let huge_mount = mount_options(&file).and_then(|opts| {
            opts.split(',')
                .find_map(|o| o.strip_prefix("huge="))
                .map(str::to_string)
        });
        let shmem_forced =
            std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
                .is_ok_and(|s| s.contains("[force]"));
        Self::judge(
            st.f_type as i64,
            kernel_version(&release),
            huge_mount.as_deref(),
            shmem_forced,
        )
    }

    /// The verdict for a file system magic, a kernel (major, minor), a
    /// tmpfs mount's `huge=` option and whether shmem THP is forced.
    fn judge(magic: i64, kernel: (u32, u32), huge: Option<&str>, shmem_forced: bool) -> Self {
        let verdict = |kind: &str, large_folios: bool, why: String| HostFs {
            kind: kind.into(),
            large_folios,
            why,
        };
        let (major, minor) = kernel;
        let at_least = |a: u32, b: u32| (major, minor) >= (a, b);
        match magic {
            TMPFS_MAGIC => match huge {
                Some(h @ ("always" | "within_size")) => {
                    verdict("tmpfs", true, format!("mounted huge={h}"))
                }
                _ if shmem_forced => verdict("tmpfs", true, "shmem huge pages forced".into()),
                Some(h) => verdict("tmpfs", false, format!("mounted huge={h}")),
                None => verdict("tmpfs", false, "mounted without huge=".into()),
            },
            XFS_MAGIC if at_least(5, 18) => verdict(
                "xfs",
                true,
                format!("large folios since Linux 5.18 (this is {major}.{minor})"),
            ),
            EXT4_MAGIC if at_least(6, 16) => verdict(
                "ext4",
                true,
                format!("large folios since Linux 6.16 (this is {major}.{minor})"),
            ),
            XFS_MAGIC | EXT4_MAGIC => {
                let kind = if magic == XFS_MAGIC { "xfs" } else { "ext4" };
                verdict(
                    kind,
                    false,
                    format!("Linux {major}.{minor} caches it in 4 KiB pages"),
                )
            }
            BTRFS_MAGIC => verdict("btrfs", false, "large folios are experimental there".into()),
            OVERLAYFS_MAGIC => verdict("overlayfs", false, "4 KiB assumed".into()),
            NFS_MAGIC => verdict("nfs", false, "4 KiB assumed".into()),
            FUSE_MAGIC => verdict("fuse", false, "4 KiB assumed".into()),
            RAMFS_MAGIC => verdict("ramfs", false, "4 KiB pages".into()),
            other => verdict(&format!("{other:#x}"), false, "4 KiB assumed".into()),
        }
    }

    pub fn describe(&self) -> String {
        let pages = if self.large_folios {
            "large folios"
        } else {
            "4 KiB pages"
        };
        format!("{} ({}): {pages}", self.kind, self.why)
    }
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// (major, minor) of a release string like `6.1.0-18-amd64`.
fn kernel_version(release: &str) -> (u32, u32) {
    let mut parts = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|p| p.parse().unwrap_or(0));
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// The super-block options of the mount holding `file` (from its fdinfo's
/// `mnt_id` and `/proc/self/mountinfo`).
fn mount_options(file: &std::fs::File) -> Option<String> {
    let fdinfo = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", file.as_raw_fd())).ok()?;
    let mnt_id = fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("mnt_id:"))?
        .trim()
        .to_string();
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        let mut fields = line.split(' ');
        if fields.next()? != mnt_id {
            return None;
        }
        // After the optional fields: "- fstype source super-options".
        let rest = line.split(" - ").nth(1)?;
        rest.split(' ').nth(2).map(str::to_string)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verdicts_by_file_system_and_kernel() {
        let j = HostFs::judge;
        assert!(j(TMPFS_MAGIC, (6, 1), Some("always"), false).large_folios);
        assert!(j(TMPFS_MAGIC, (6, 1), Some("within_size"), false).large_folios);
        assert!(!j(TMPFS_MAGIC, (6, 1), Some("never"), false).large_folios);
        assert!(!j(TMPFS_MAGIC, (6, 1), None, false).large_folios);
        assert!(j(TMPFS_MAGIC, (6, 1), None, true).large_folios);
        assert!(j(XFS_MAGIC, (5, 18), None, false).large_folios);
        assert!(!j(XFS_MAGIC, (5, 15), None, false).large_folios);
        assert!(!j(EXT4_MAGIC, (6, 1), None, false).large_folios);
        assert!(j(EXT4_MAGIC, (6, 16), None, false).large_folios);
        assert!(!j(BTRFS_MAGIC, (6, 17), None, false).large_folios);
        assert_eq!(j(0x1234, (6, 1), None, false).kind, "0x1234");
        assert_eq!(
            j(XFS_MAGIC, (6, 1), None, false).describe(),
            "xfs (large folios since Linux 5.18 (this is 6.1)): large folios"
        );
    }

    #[test]
    fn kernel_versions_parse_from_release_strings() {
        assert_eq!(kernel_version("6.1.0-18-amd64"), (6, 1));
        assert_eq!(kernel_version("5.18.2"), (5, 18));
        assert_eq!(kernel_version(""), (0, 0));
    }

    #[test]
    fn probing_a_real_directory_names_its_file_system() {
        let dir = std::env::temp_dir();
        let fs = HostFs::probe(&dir);
        assert_ne!(fs.kind, "unknown", "{fs:?}");
        // /proc/self/mountinfo answers for the directory's own mount.
        let file = std::fs::File::open(&dir).unwrap();
        assert!(mount_options(&file).is_some());
        let missing = HostFs::probe(Path::new("/nonexistent/dir"));
        assert!(missing.why.starts_with("cannot open it"), "{missing:?}");
    }
}
