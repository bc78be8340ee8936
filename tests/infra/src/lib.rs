//! The guest rig: boots real Linux guests under the project's VMM and hands
//! the test their serial output and the VMM's exit status.
//!
//! Where the host CPU has hardware virtualization the VMM runs directly on
//! `/dev/kvm`. Otherwise (the project's CI machines) it runs inside an emulated
//! host: QEMU with `-accel tcg -cpu max`, whose Linux loads `kvm_amd` and
//! gives the VMM a real `/dev/kvm`. See docs/testing.md.

pub mod baseline;
pub mod ch_client;
pub mod cpio;
pub mod fio;
pub mod host;
pub mod images;
pub mod kata;
pub mod kernel;
pub mod monitor;
pub mod packaged;
pub mod proc_cost;
pub mod prom;
pub mod results;
pub mod rig;
pub mod shell;

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum RigError {
    #[error("rig set-up: {0}")]
    Setup(String),
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
}

impl RigError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        RigError::Io {
            path: path.display().to_string(),
            source,
        }
    }
}
