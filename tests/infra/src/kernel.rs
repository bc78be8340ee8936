//! The guest kernel: Debian's 6.12 cloud image, fetched with `apt-get
//! download`, unpacked once into the cache and checked for `CONFIG_FUSE_DAX=y`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::host::{cache_dir, run};
use crate::RigError;

/// Overrides the package choice, e.g. `linux-image-6.12.115+deb12-cloud-amd64-unsigned`.
pub const KERNEL_PACKAGE_ENV: &str = "DAX_VMM_KERNEL_PACKAGE";
const PACKAGE_PREFIX: &str = "linux-image-6.12.";
const PACKAGE_SUFFIX: &str = "-cloud-amd64-unsigned";
/// Options the project needs from the guest kernel, checked before first use.
const REQUIRED_CONFIG: &[&str] = &[
    "CONFIG_FUSE_DAX=y",
    "CONFIG_VIRTIO_FS=y",
    "CONFIG_VIRTIO_PCI=y",
    "CONFIG_ACPI=y",
];

pub struct GuestKernel {
    /// Kernel release, e.g. `6.12.115+deb12-cloud-amd64`.
    pub release: String,
    pub bzimage: PathBuf,
    /// Module name (with `_`, as the kernel spells it) to its `.ko.xz` path.
    modules: BTreeMap<String, PathBuf>,
}

impl GuestKernel {
    /// The newest 6.12 cloud kernel apt knows of, from the cache when it is there.
    pub fn fetch() -> Result<GuestKernel, RigError> {
        let cache = cache_dir()?.join("kernels");
        let package = match std::env::var(KERNEL_PACKAGE_ENV) {
            Ok(p) if !p.is_empty() => p,
            _ => match newest_package() {
                Ok(p) => p,
                // Offline but fetched before: use what the cache holds.
                Err(e) => newest_cached(&cache).ok_or(e)?,
            },
        };
        let dir = cache.join(&package);
        if !dir.join(".complete").exists() {
            download(&package, &dir)?;
        }
        Self::open(&dir)
    }

    fn open(dir: &Path) -> Result<GuestKernel, RigError> {
        let boot = dir.join("boot");
        let mut release = None;
        for entry in std::fs::read_dir(&boot).map_err(|e| RigError::io(&boot, e))? {
            let name = entry
                .map_err(|e| RigError::io(&boot, e))?
                .file_name()
                .to_string_lossy()
                .into_owned();
            if let Some(r) = name.strip_prefix("vmlinuz-") {
                release = Some(r.to_string());
            }
        }
        let release =
            release.ok_or_else(|| RigError::Setup(format!("no vmlinuz in {}", boot.display())))?;
        let mut modules = BTreeMap::new();
        index_modules(&dir.join("lib/modules").join(&release), &mut modules)?;
        Ok(GuestKernel {
            bzimage: boot.join(format!("vmlinuz-{release}")),
            release,
            modules,
        })
    }

    /// The named modules and everything they depend on, decompressed, in an
    /// order `insmod` can load them.
    pub fn modules_with_deps(&self, names: &[&str]) -> Result<Vec<(String, Vec<u8>)>, RigError> {
        let mut ordered = Vec::new();
        let mut seen = HashSet::new();
        for name in names {
            self.visit(&name.replace('-', "_"), &mut seen, &mut ordered)?;
        }
        Ok(ordered)
    }

    fn visit(
        &self,
        name: &str,
        seen: &mut HashSet<String>,
        out: &mut Vec<(String, Vec<u8>)>,
    ) -> Result<(), RigError> {
        if !seen.insert(name.to_string()) {
            return Ok(());
        }
        let path = self.modules.get(name).ok_or_else(|| {
            RigError::Setup(format!("kernel {} has no module {name}", self.release))
        })?;
        let data = run(Command::new("xz").arg("-dc").arg(path))?;
        for dep in module_depends(&data) {
            self.visit(&dep, seen, out)?;
        }
        out.push((name.to_string(), data));
        Ok(())
    }
}

/// `depends=a,b` from the module's `.modinfo` strings.
pub fn module_depends(module: &[u8]) -> Vec<String> {
    module
        .split(|&b| b == 0)
        .find_map(|s| s.strip_prefix(b"depends="))
        .map(|deps| {
            String::from_utf8_lossy(deps)
                .split(',')
                .filter(|d| !d.is_empty())
                .map(|d| d.replace('-', "_"))
                .collect()
        })
        .unwrap_or_default()
}

fn index_modules(dir: &Path, out: &mut BTreeMap<String, PathBuf>) -> Result<(), RigError> {
    for entry in std::fs::read_dir(dir).map_err(|e| RigError::io(dir, e))? {
        let path = entry.map_err(|e| RigError::io(dir, e))?.path();
        if path.is_dir() {
            index_modules(&path, out)?;
        } else if let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".ko.xz"))
        {
            out.insert(stem.replace('-', "_"), path.clone());
        }
    }
    Ok(())
}

/// Compares Debian package names of the form `linux-image-6.12.<patch>…` by patch level.
fn patch_level(package: &str) -> Option<u32> {
    let rest = package.strip_prefix(PACKAGE_PREFIX)?;
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

fn newest_package() -> Result<String, RigError> {
    let out = run(Command::new("apt-cache").args(["pkgnames", PACKAGE_PREFIX]))?;
    String::from_utf8_lossy(&out)
        .lines()
        .filter(|p| p.ends_with(PACKAGE_SUFFIX))
        .filter_map(|p| Some((patch_level(p)?, p.to_string())))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| {
            RigError::Setup(format!(
                "apt knows no {PACKAGE_PREFIX}*{PACKAGE_SUFFIX} package: run apt-get update (bookworm-backports must be enabled)"
            ))
        })
}

fn newest_cached(cache: &Path) -> Option<String> {
    std::fs::read_dir(cache)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|p| cache.join(p).join(".complete").exists())
        .filter_map(|p| Some((patch_level(&p)?, p)))
        .max()
        .map(|(_, p)| p)
}

fn download(package: &str, dir: &Path) -> Result<(), RigError> {
    let staging = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| RigError::io(&staging, e))?;
    run(Command::new("apt-get")
        .args(["download", "-q", package])
        .current_dir(&staging))?;
    let deb = std::fs::read_dir(&staging)
        .map_err(|e| RigError::io(&staging, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| RigError::Setup(format!("apt-get download {package} produced no .deb")))?;
    let tree = staging.join("tree");
    run(Command::new("dpkg").arg("-x").arg(&deb).arg(&tree))?;
    check_config(&tree)?;
    // Keep only what the rig uses: the bzImage, its config and the modules.
    let _ = std::fs::remove_file(&deb);
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tree, dir).map_err(|e| RigError::io(dir, e))?;
    std::fs::write(dir.join(".complete"), package).map_err(|e| RigError::io(dir, e))?;
    let _ = std::fs::remove_dir_all(&staging);
    Ok(())
}

fn check_config(tree: &Path) -> Result<(), RigError> {
    let boot = tree.join("boot");
    let config = std::fs::read_dir(&boot)
        .map_err(|e| RigError::io(&boot, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("config-"))
        })
        .ok_or_else(|| RigError::Setup(format!("no kernel config in {}", boot.display())))?;
    let text = std::fs::read_to_string(&config).map_err(|e| RigError::io(&config, e))?;
    for option in REQUIRED_CONFIG {
        if !text.lines().any(|l| l == *option) {
            return Err(RigError::Setup(format!(
                "{}: the guest kernel needs {option}",
                config.display()
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_are_read_from_modinfo() {
        let blob = b"\x7fELF junk\0license=GPL\0depends=irqbypass,kvm\0vermagic=6.12\0";
        assert_eq!(module_depends(blob), vec!["irqbypass", "kvm"]);
        assert!(module_depends(b"\0depends=\0").is_empty());
        assert!(module_depends(b"no modinfo").is_empty());
    }

    #[test]
    fn packages_order_by_patch_level() {
        assert_eq!(
            patch_level("linux-image-6.12.115+deb12-cloud-amd64-unsigned"),
            Some(115)
        );
        assert_eq!(
            patch_level("linux-image-6.12.9+deb12-cloud-amd64-unsigned"),
            Some(9)
        );
        assert_eq!(
            patch_level("linux-image-6.1.0-30-cloud-amd64-unsigned"),
            None
        );
    }
}
