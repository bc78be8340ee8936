use std::sync::Arc;

use vmm_sys_util::tempdir::TempDir;

use super::*;

fn fs_on(dir: &TempDir) -> PassthroughFs {
    let path = CString::new(dir.as_path().to_str().unwrap()).unwrap();
    let root = openat(libc::AT_FDCWD, &path, libc::O_PATH, 0).unwrap();
    let proc_fd = openat(libc::AT_FDCWD, c"/proc/self/fd", libc::O_PATH, 0).unwrap();
    PassthroughFs::new(
        root,
        proc_fd,
        CachePolicy::Never,
        Arc::new(crate::policy::DaxPolicy::new(policies::Policy::default())),
    )
    .unwrap()
}

#[test]
fn lookups_share_inodes_and_forget_drops_them() {
    let dir = TempDir::new().unwrap();
    std::fs::create_dir_all(dir.as_path().join("a/b")).unwrap();
    std::fs::write(dir.as_path().join("a/b/f"), b"x").unwrap();
    let fs = fs_on(&dir);
    let (a, _) = fs.lookup(ROOT_ID, c"a").unwrap();
    let (b, _) = fs.lookup(a, c"b").unwrap();
    let (f, _) = fs.lookup(b, c"f").unwrap();
    assert_eq!(fs.path_of(f), "a/b/f");
    assert_eq!(fs.lookup(b, c"f").unwrap().0, f, "same file, same nodeid");
    assert_eq!(fs.inode_count(), 4);
    fs.forget(f, 1);
    assert!(fs.inode(f).is_ok(), "one reference left");
    fs.forget(f, 1);
    assert!(fs.inode(f).is_err());
    fs.forget(ROOT_ID, 100);
    assert!(fs.inode(ROOT_ID).is_ok(), "the root is never forgotten");
    fs.reset();
    assert_eq!(fs.inode_count(), 1);
}

#[test]
fn rename_keeps_policy_paths_current() {
    let dir = TempDir::new().unwrap();
    std::fs::create_dir(dir.as_path().join("d")).unwrap();
    std::fs::write(dir.as_path().join("f"), b"x").unwrap();
    let fs = fs_on(&dir);
    let (d, _) = fs.lookup(ROOT_ID, c"d").unwrap();
    let (f, _) = fs.lookup(ROOT_ID, c"f").unwrap();
    fs.rename(ROOT_ID, c"f", d, c"g", 0).unwrap();
    assert_eq!(fs.path_of(f), "d/g");
}

#[test]
fn component_names_are_single_safe_components() {
    assert!(component(b"ok.txt\0").is_ok());
    for bad in [&b".."[..], b".", b"", b"a/b", b"/", b"a\0b"] {
        assert!(component(bad).is_err(), "{bad:?}");
    }
    assert!(component(&[b'x'; 255]).is_ok());
    assert_eq!(
        component(&[b'x'; 256]).unwrap_err().raw_os_error(),
        Some(libc::ENAMETOOLONG)
    );
}
