//! Disk images the guest tests build on the build host.

use std::process::Command;

use crate::rig;

/// An ext4 file system of `size` bytes holding `files` (name, bytes) at its
/// root, built with `mke2fs -d` (no root, no loop device). `name` keeps
/// the work files of different tests apart under the rig's target dir.
pub fn ext4_image(name: &str, size: u64, files: &[(&str, &[u8])]) -> Vec<u8> {
    let entries: Vec<Entry> = files
        .iter()
        .map(|(path, data)| Entry::File {
            path,
            mode: 0o644,
            data,
        })
        .collect();
    ext4_tree(name, size, &entries)
}

/// What [`ext4_tree`] puts in the file system.
pub enum Entry<'a> {
    Dir(&'a str),
    File {
        path: &'a str,
        mode: u32,
        data: &'a [u8],
    },
    Symlink {
        path: &'a str,
        target: &'a str,
    },
}

/// An ext4 file system of `size` bytes holding `entries` (parents made as
/// needed), built with `mke2fs -d`, which keeps modes and symlinks.
pub fn ext4_tree(name: &str, size: u64, entries: &[Entry]) -> Vec<u8> {
    use std::os::unix::fs::PermissionsExt;
    let dir = rig::target_dir().join(format!("rig/{name}-src"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let parent = |p: &std::path::Path| std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    for e in entries {
        match e {
            Entry::Dir(path) => std::fs::create_dir_all(dir.join(path)).unwrap(),
            Entry::File { path, mode, data } => {
                let at = dir.join(path);
                parent(&at);
                std::fs::write(&at, data).unwrap();
                std::fs::set_permissions(&at, std::fs::Permissions::from_mode(*mode)).unwrap();
            }
            Entry::Symlink { path, target } => {
                let at = dir.join(path);
                parent(&at);
                std::os::unix::fs::symlink(target, &at).unwrap();
            }
        }
    }
    let img = rig::target_dir().join(format!("rig/{name}.img"));
    let _ = std::fs::remove_file(&img);
    let out = Command::new("mke2fs")
        .args(["-q", "-F", "-t", "ext4", "-b", "4096", "-d"])
        .arg(&dir)
        .arg(&img)
        .arg(format!("{}k", size / 1024))
        .output()
        .expect("mke2fs (apt-get install e2fsprogs)");
    assert!(
        out.status.success(),
        "mke2fs: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&img).unwrap()
}

/// A disk with an MBR and one Linux partition (type 0x83) holding
/// `partition` from 1 MiB on, as Kata's guest images are laid out (its
/// kernel command line says `root=/dev/vda1`).
pub fn mbr_disk(partition: &[u8]) -> Vec<u8> {
    // The partition starts at 1 MiB, as fdisk puts it.
    const START_SECTOR: u32 = 2048;
    const START: usize = START_SECTOR as usize * 512;
    let sectors = u32::try_from(partition.len().div_ceil(512)).expect("a partition under 2 TiB");
    let mut disk = vec![0u8; START + sectors as usize * 512];
    let entry = &mut disk[446..462];
    entry[4] = 0x83;
    entry[8..12].copy_from_slice(&START_SECTOR.to_le_bytes());
    entry[12..16].copy_from_slice(&sectors.to_le_bytes());
    disk[510] = 0x55;
    disk[511] = 0xaa;
    disk[START..START + partition.len()].copy_from_slice(partition);
    disk
}

/// `len` bytes that do not compress to nothing (xorshift64), the same on
/// every run.
pub fn incompressible(len: u64) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_mbr_has_one_linux_partition_at_one_mib() {
        let disk = super::mbr_disk(&[7u8; 1000]);
        assert_eq!(disk.len(), (1 << 20) + 1024);
        assert_eq!(disk[446 + 4], 0x83);
        assert_eq!(&disk[446 + 8..446 + 12], &2048u32.to_le_bytes());
        assert_eq!(&disk[446 + 12..446 + 16], &2u32.to_le_bytes());
        assert_eq!(&disk[510..512], &[0x55, 0xaa]);
        assert_eq!(disk[1 << 20], 7);
    }
}
