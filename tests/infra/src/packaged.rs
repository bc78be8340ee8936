//! Debian's own programs (fio, iperf3, …) copied into a guest's or the
//! emulated host's image with the shared libraries they load, for the
//! benchmarks that run them there.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::rig::ImageFile;
use crate::RigError;

/// `/usr/bin/<tool>`, or an error naming the package to install.
pub fn installed(tool: &str) -> Result<PathBuf, RigError> {
    let path = Path::new("/usr/bin").join(tool);
    if path.exists() {
        Ok(path)
    } else {
        Err(RigError::Setup(format!(
            "{} is missing: apt-get install {tool}",
            path.display()
        )))
    }
}

/// The shared libraries `ldd` names for `bin`, with the program
/// interpreter, as (path it is loaded from, path of the file to read).
pub fn shared_libraries(bin: &Path) -> Result<Vec<(String, PathBuf)>, RigError> {
    let out = Command::new("ldd")
        .arg(bin)
        .output()
        .map_err(|e| RigError::Setup(format!("ldd {}: {e}", bin.display())))?;
    if !out.status.success() {
        return Err(RigError::Setup(format!(
            "ldd {}: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(parse_ldd(&String::from_utf8_lossy(&out.stdout)))
}

/// `ldd` lines: `libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)` and
/// the interpreter's `/lib64/ld-linux-x86-64.so.2 (0x…)`; the vDSO has no
/// file. Both paths are the one the loader looks up (symlinks are read
/// through when the file is copied).
pub fn parse_ldd(text: &str) -> Vec<(String, PathBuf)> {
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/')
                .then(|| (path.trim_start_matches('/').to_string(), path.into()))
        })
        .collect()
}

/// `bins` and their libraries as image files: each binary at
/// `{bin_dir}/<name>`, each library at `{lib_root}<its path>`, each
/// library once.
pub fn with_libraries(
    bins: &[&Path],
    bin_dir: &str,
    lib_root: &str,
) -> Result<Vec<ImageFile>, RigError> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| RigError::io(p, e));
    let mut files = Vec::new();
    let mut seen = HashSet::new();
    for bin in bins {
        let name = bin.file_name().unwrap_or_default().to_string_lossy();
        files.push(ImageFile {
            path: format!("{bin_dir}/{name}"),
            perm: 0o755,
            data: read(bin)?,
        });
        for (path, file) in shared_libraries(bin)? {
            if seen.insert(path.clone()) {
                files.push(ImageFile {
                    path: format!("{lib_root}{path}"),
                    perm: 0o755,
                    data: read(&file)?,
                });
            }
        }
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_output_gives_libraries_and_the_interpreter_not_the_vdso() {
        let text = "\tlinux-vdso.so.1 (0x00007ffd)\n\
                    \tlibz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x00007f84)\n\
                    \tlibceph-common.so.2 => /usr/lib/x86_64-linux-gnu/ceph/libceph-common.so.2 (0x1)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f84e83aa000)\n";
        assert_eq!(
            parse_ldd(text),
            vec![
                (
                    "lib/x86_64-linux-gnu/libz.so.1".to_string(),
                    PathBuf::from("/lib/x86_64-linux-gnu/libz.so.1")
                ),
                (
                    "usr/lib/x86_64-linux-gnu/ceph/libceph-common.so.2".to_string(),
                    PathBuf::from("/usr/lib/x86_64-linux-gnu/ceph/libceph-common.so.2")
                ),
                (
                    "lib64/ld-linux-x86-64.so.2".to_string(),
                    PathBuf::from("/lib64/ld-linux-x86-64.so.2")
                ),
            ]
        );
        assert!(parse_ldd("\tnot a dynamic executable\n").is_empty());
    }
}
