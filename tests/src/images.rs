//! Disk images the guest tests build on the build host.

use std::process::Command;

use crate::rig;

/// An ext4 file system of `size` bytes holding `files` (name, bytes) at its
/// root, built with `mke2fs -d` (no root, no loop device). `name` keeps
/// the work files of different tests apart under the rig's target dir.
pub fn ext4_image(name: &str, size: u64, files: &[(&str, &[u8])]) -> Vec<u8> {
    let dir = rig::target_dir().join(format!("rig/{name}-src"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, data) in files {
        std::fs::write(dir.join(file), data).unwrap();
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

/// `len` bytes that do not compress to nothing (xorshift64), the same on
/// every run.
pub fn incompressible(len: u64) -> Vec<u8> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}
