//! The workspace binaries a run needs (the VMM, tools for the guest and the
//! host), built static once per process, and the run's scratch directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::{ImageFile, VMM_BIN_ENV};
use crate::host;
use crate::RigError;

pub(super) fn write_file(path: &Path, f: &ImageFile) -> Result<(), RigError> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| RigError::io(parent, e))?;
    }
    std::fs::write(path, &f.data).map_err(|e| RigError::io(path, e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(f.perm))
        .map_err(|e| RigError::io(path, e))
}

/// The workspace's `target/` directory.
pub fn target_dir() -> PathBuf {
    workspace_root().join("target")
}

/// The workspace's root, two folders above this crate (`tests/infra`),
/// spelled without `..` so the paths a run prints are plain.
fn workspace_root() -> PathBuf {
    let infra = Path::new(env!("CARGO_MANIFEST_DIR"));
    infra
        .parent()
        .and_then(Path::parent)
        .unwrap_or(infra)
        .to_path_buf()
}

/// `target/rig/runs/<name>`, emptied first.
pub(super) fn scratch_dir(name: &str) -> Result<PathBuf, RigError> {
    let dir = target_dir().join("rig/runs").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| RigError::io(&dir, e))?;
    Ok(dir)
}

/// The cargo profile of the rig's static builds: `rig` (release without
/// link-time optimization, quicker to build), or what `DAX_VMM_RIG_PROFILE`
/// names (the benchmarks and the demo use `release`).
pub fn build_profile() -> String {
    std::env::var(PROFILE_ENV)
        .ok()
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| "rig".into())
}

/// Names the cargo profile of the rig's static builds.
const PROFILE_ENV: &str = "DAX_VMM_RIG_PROFILE";

/// A static optimized build of a workspace binary (in [`build_profile`]),
/// built once per process so it runs in an initramfs without libraries.
pub fn static_binary(package: &str, bin: &str) -> Result<PathBuf, RigError> {
    static_binary_with(package, bin, &[])
}

/// [`static_binary`] with the package's cargo `features` on, built in a
/// target directory of its own (`rig/build-<features>`): the binary keeps
/// its name, and the usual build is neither replaced nor rebuilt.
pub fn static_binary_with(
    package: &str,
    bin: &str,
    features: &[&str],
) -> Result<PathBuf, RigError> {
    let target = "x86_64-unknown-linux-gnu";
    let target_dir = match features {
        [] => target_dir().join("rig/build"),
        f => target_dir().join(format!("rig/build-{}", f.join("-"))),
    };
    let profile = build_profile();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut build = Command::new(cargo);
    // What cargo told the calling program about its own package: build
    // scripts (ring's, cc's) rebuild when such a variable changes, so the
    // same build asked from a test, a benchmark or test.sh would otherwise
    // be made again each time the caller changes.
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if [
            "CARGO_PKG_",
            "CARGO_MANIFEST_",
            "CARGO_CRATE_",
            "CARGO_BIN_",
            "CARGO_PRIMARY_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
            || name == "CARGO_TARGET_TMPDIR"
            || name == "OUT_DIR"
        {
            build.env_remove(name.as_ref());
        }
    }
    build.args([
        "build",
        "--profile",
        &profile,
        "--locked",
        "-p",
        package,
        "--bin",
        bin,
        "--target",
        target,
    ]);
    if !features.is_empty() {
        build.args(["--features", &features.join(",")]);
    }
    let status = build
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env("CARGO_TARGET_DIR", &target_dir)
        .current_dir(workspace_root())
        .status()
        .map_err(|e| RigError::Setup(format!("cargo build {bin}: {e}")))?;
    if !status.success() {
        return Err(RigError::Setup(format!(
            "cargo build of {bin} failed ({status})"
        )));
    }
    // Cargo puts the dev and test profiles' output in `debug`.
    let out = match profile.as_str() {
        "dev" | "test" => "debug",
        p => p,
    };
    let path = target_dir.join(target).join(out).join(bin);
    if !host::is_static_elf(&path)? {
        return Err(RigError::Setup(format!(
            "{} is not statically linked",
            path.display()
        )));
    }
    Ok(path)
}

pub(super) fn tool_name(path: &Path) -> Result<String, RigError> {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| RigError::Setup(format!("{} has no file name", path.display())))
}

pub(super) fn read_tool(path: &Path) -> Result<Vec<u8>, RigError> {
    std::fs::read(path).map_err(|e| RigError::io(path, e))
}

/// A static binary of this workspace for a guest or host image (built once
/// per process and binary).
pub fn tool(package: &str, bin: &str) -> Result<PathBuf, RigError> {
    static BUILT: std::sync::Mutex<Vec<(String, Result<PathBuf, String>)>> =
        std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, r)) = built.iter().find(|(b, _)| b == bin) {
        return r.clone().map_err(RigError::Setup);
    }
    let r = static_binary(package, bin).map_err(|e| e.to_string());
    built.push((bin.to_string(), r.clone()));
    r.map_err(RigError::Setup)
}

/// The VMM binary the rig runs (built once per process).
pub fn vmm_binary() -> Result<PathBuf, RigError> {
    static VMM: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    VMM.get_or_init(|| match std::env::var_os(VMM_BIN_ENV) {
        Some(p) => Ok(PathBuf::from(p)),
        None => static_binary("vmm", "dax-vmm").map_err(|e| e.to_string()),
    })
    .clone()
    .map_err(RigError::Setup)
}
