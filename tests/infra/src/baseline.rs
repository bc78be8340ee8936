//! The baseline binaries benchmarks compare with (Cloud Hypervisor,
//! virtiofsd), named by environment variables and copied into the
//! emulated host, which has no libraries: so they must be static.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::host::is_static_elf;
use crate::RigError;

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
