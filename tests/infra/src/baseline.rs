//! The baseline binaries benchmarks compare with (Cloud Hypervisor,
//! virtiofsd), named by environment variables and copied into the
//! emulated host, which has no libraries: so they must be static.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::host::is_static_elf;
use crate::rig::ImageFile;
use crate::RigError;

/// Names Cloud Hypervisor's static binary.
pub const VMM_ENV: &str = "BASELINE_VMM";
/// Names virtiofsd's static binary.
pub const VIRTIOFSD_ENV: &str = "BASELINE_VIRTIOFSD";

/// The baseline binary `env` names, checked to be static; None when `env`
/// is unset.
pub fn baseline_binary(env: &str) -> Result<Option<PathBuf>, RigError> {
    let Some(path) = std::env::var_os(env).map(PathBuf::from) else {
        return Ok(None);
    };
    match is_static_elf(&path) {
        Ok(true) => Ok(Some(path)),
        Ok(false) => Err(RigError::Setup(format!(
            "{env}={} is linked dynamically: the emulated host has no libraries; \
             build it with RUSTFLAGS='-C target-feature=+crt-static'",
            path.display()
        ))),
        Err(e) => Err(RigError::Setup(format!("{env}: {e}"))),
    }
}

/// Cloud Hypervisor and virtiofsd from [`VMM_ENV`] and [`VIRTIOFSD_ENV`],
/// each checked to be static: both named, or neither (None).
pub fn vmm_and_virtiofsd() -> Result<Option<(PathBuf, PathBuf)>, RigError> {
    match (baseline_binary(VMM_ENV)?, baseline_binary(VIRTIOFSD_ENV)?) {
        (Some(vmm), Some(virtiofsd)) => Ok(Some((vmm, virtiofsd))),
        (None, None) => Ok(None),
        _ => Err(RigError::Setup(format!(
            "set both {VMM_ENV} and {VIRTIOFSD_ENV}, or neither"
        ))),
    }
}

/// The pair as files of the emulated host: `baseline/cloud-hypervisor`
/// and `baseline/virtiofsd` in its work directory.
pub fn host_files((vmm, virtiofsd): &(PathBuf, PathBuf)) -> Result<Vec<ImageFile>, RigError> {
    [("cloud-hypervisor", vmm), ("virtiofsd", virtiofsd)]
        .into_iter()
        .map(|(name, bin)| {
            Ok(ImageFile {
                path: format!("baseline/{name}"),
                perm: 0o755,
                data: std::fs::read(bin)
                    .map_err(|e| RigError::Setup(format!("{}: {e}", bin.display())))?,
            })
        })
        .collect()
}

/// `BIN --version`'s first line, for the results.
pub fn version(bin: &Path) -> String {
    Command::new(bin)
        .arg("--version")
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|e| format!("({}: {e})", bin.display()))
}
