//! Where a snapshot goes and where a restore comes from: Cloud
//! Hypervisor's VmSnapshotConfig (`vm.snapshot`) and RestoreConfig
//! (`vm.restore`, `--restore source_url=file:///DIR[,prefault=on][,resume=true]`).
//!
//! A snapshot is a directory, named by a `file://` URL as in Cloud
//! Hypervisor. New tap fds for a restored VM's net devices come as Cloud
//! Hypervisor's do: `net_fds` in the `vm.restore` body names the devices
//! and how many fds each takes, and the fds travel with the request as
//! SCM_RIGHTS (`ch-remote restore source_url=...,net_fds=[net0@[3]]`).
//! Restoring memory on demand (userfaultfd), VFIO fds, and fds inherited
//! on the command line are Cloud Hypervisor's and not this VMM's: they are
//! refused by name (the JSON bodies through [`super::ch_fields`], the
//! command line here).

use std::path::PathBuf;

use serde::Deserialize;

use super::option_parser::{parse_toggle, OptionValues};
use super::ConfigError;

/// What a snapshot's URL must be.
pub const FILE_URL_EXPECTED: &str = "a file:// URL naming a directory (file:///DIR)";

/// Cloud Hypervisor's `--restore` keys.
pub const RESTORE_KEYS: &[&str] = &[
    "source_url",
    "prefault",
    "memory_restore_mode",
    "net_fds",
    "vfio_fds",
    "iommufd_fd",
    "resume",
    "zone_updates",
];

/// The keys whose values are bracketed lists (`net_fds=[net0@[3,4]]`),
/// which hold commas: refused by name before the value is split on them.
const LIST_KEYS: &[&str] = &["net_fds", "vfio_fds", "zone_updates"];

/// Why the fd keys are refused on the command line.
const NO_RESTORE_FDS: &str =
    "this VMM takes no inherited tap or VFIO fds at restore (a restored VM opens its taps by name; new tap fds come with vm.restore's net_fds, as ch-remote sends them)";

/// The directory a `file://` URL names, as Cloud Hypervisor reads it: the
/// text after `file://` (`file:///DIR` is `/DIR`). None for another scheme
/// or an empty path. Whether the directory exists is the snapshot's or the
/// restore's to find out.
pub fn file_url_dir(url: &str) -> Option<PathBuf> {
    url.strip_prefix("file://")
        .filter(|path| !path.is_empty())
        .map(PathBuf::from)
}

/// A `vm.snapshot` request: the directory the snapshot is written to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotConfig {
    pub destination_dir: PathBuf,
}

/// A restore, by `vm.restore` or `--restore`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RestoreConfig {
    /// The snapshot's directory.
    pub source_dir: PathBuf,
    /// Touch every page of guest memory while restoring it.
    pub prefault: bool,
    /// Resume the VM once restored (it comes back paused otherwise).
    pub resume: bool,
    /// The net devices given new tap fds with the request, in the order
    /// their fds came.
    pub net_fds: Vec<RestoredNet>,
}

/// One entry of Cloud Hypervisor's `net_fds` (its RestoredNetConfig): the
/// net device `id` of the snapshot takes the next `num_fds` fds passed
/// with the request as its tap, one per queue pair.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoredNet {
    pub id: String,
    pub num_fds: usize,
}

/// The `vm.snapshot` body's fields this VMM reads (what
/// [`super::ch_fields::SNAPSHOT`] passes on).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct SnapshotBody {
    pub destination_url: String,
}

/// The `vm.restore` body's fields this VMM reads (what
/// [`super::ch_fields::RESTORE`] passes on; `memory_restore_mode` and the
/// fd lists are checked there).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RestoreBody {
    pub source_url: String,
    #[serde(default)]
    pub prefault: bool,
    #[serde(default)]
    pub resume: bool,
    #[serde(default)]
    pub net_fds: Vec<RestoredNet>,
}

impl RestoreConfig {
    /// `--restore source_url=file:///DIR[,prefault=on|off][,resume=true|false]
    /// [,memory_restore_mode=copy]`.
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        const OPTION: &str = "restore";
        if let Some(key) = LIST_KEYS.iter().find(|k| {
            input
                .split(',')
                .any(|item| item.starts_with(&format!("{k}=")))
        }) {
            return Err(ConfigError::Unsupported {
                option: OPTION,
                message: format!("{key} is not supported: {NO_RESTORE_FDS}"),
            });
        }
        let o = OptionValues::parse(OPTION, input, RESTORE_KEYS)?;
        o.refuse_any(&["iommufd_fd"], NO_RESTORE_FDS)?;
        let source_dir = o
            .convert("source_url", |v| file_url_dir(v).ok_or(FILE_URL_EXPECTED))?
            .ok_or(ConfigError::MissingKey {
                option: OPTION,
                key: "source_url",
            })?;
        // Cloud Hypervisor reads the mode in any case.
        if let Some(mode) = o.get("memory_restore_mode") {
            match mode.to_ascii_lowercase().as_str() {
                "copy" => {}
                "ondemand" => {
                    return Err(o.unsupported(
                        "memory_restore_mode",
                        "restoring memory on demand (userfaultfd) is not implemented; memory is copied (copy)",
                    ))
                }
                _ => return Err(o.invalid("memory_restore_mode", mode, "copy or ondemand")),
            }
        }
        Ok(RestoreConfig {
            source_dir,
            prefault: o.convert("prefault", parse_toggle)?.unwrap_or(false),
            resume: o.convert("resume", parse_toggle)?.unwrap_or(false),
            net_fds: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_urls_name_their_directory_and_other_schemes_none() {
        assert_eq!(file_url_dir("file:///tmp/snap"), Some("/tmp/snap".into()));
        // As Cloud Hypervisor strips the scheme: a relative path stays one.
        assert_eq!(file_url_dir("file://snap"), Some("snap".into()));
        assert_eq!(file_url_dir("file://"), None);
        assert_eq!(file_url_dir("/tmp/snap"), None);
        assert_eq!(file_url_dir("tcp://10.0.0.1/snap"), None);
        assert_eq!(file_url_dir("FILE:///tmp/snap"), None);
    }

    #[test]
    fn restore_option_as_cloud_hypervisors_docs_write_it() {
        assert_eq!(
            RestoreConfig::parse("source_url=file:///home/foo/snapshot").unwrap(),
            RestoreConfig {
                source_dir: "/home/foo/snapshot".into(),
                prefault: false,
                resume: false,
                net_fds: Vec::new(),
            }
        );
        assert_eq!(
            RestoreConfig::parse(
                "source_url=file:///s,prefault=on,resume=true,memory_restore_mode=Copy"
            )
            .unwrap(),
            RestoreConfig {
                source_dir: "/s".into(),
                prefault: true,
                resume: true,
                net_fds: Vec::new(),
            }
        );
    }

    #[test]
    fn restore_option_refuses_by_name() {
        let e = |input: &str| RestoreConfig::parse(input).unwrap_err().to_string();
        assert_eq!(
            e("prefault=on"),
            "--restore: missing required key \"source_url\""
        );
        assert_eq!(
            e("source_url=/s"),
            format!("--restore: source_url=\"/s\" is invalid: expected {FILE_URL_EXPECTED}")
        );
        assert!(e("source_url=tcp://h/s").contains("source_url=\"tcp://h/s\""));
        assert!(e("source_url=file:///s,memory_restore_mode=ondemand")
            .starts_with("--restore: memory_restore_mode=ondemand is not supported: restoring memory on demand"));
        assert!(e("source_url=file:///s,memory_restore_mode=lazy")
            .contains("memory_restore_mode=\"lazy\" is invalid: expected copy or ondemand"));
        assert!(e("source_url=file:///s,resume=maybe").contains("resume=\"maybe\""));
        // A list with commas in it is named, not split into nonsense.
        assert!(e("source_url=file:///s,net_fds=[net0@[3,4]]")
            .starts_with("--restore: net_fds is not supported: this VMM takes no inherited tap"));
        assert!(e("source_url=file:///s,vfio_fds=[v@5],iommufd_fd=7").contains("vfio_fds"));
        assert!(e("source_url=file:///s,iommufd_fd=7").contains("iommufd_fd=7 is not supported"));
        assert!(e("source_url=file:///s,zone_updates=[z@1]").contains("zone_updates"));
        assert!(e("source_url=file:///s,frob=1").contains("unknown key \"frob\""));
    }
}
