//! virtiofsd 1.14 options this daemon does not implement. Each is parsed as
//! virtiofsd parses it (so the rest of the command line still parses) and
//! then refused by name: a command line written for virtiofsd must not run
//! with part of its meaning dropped. An option whose given value is what
//! the daemon does anyway (`--posix-acl=never`) is taken.

use clap::builder::PossibleValuesParser;
use clap::Args;

/// What virtiofsd's `--print-capabilities` prints, for what this daemon
/// does (QEMU's docs/interop/vhost-user.json): a virtio-fs backend whose
/// options are all separate flags. Not `migrate-precopy` (the daemon's
/// state moves, but the window's mappings are not yet set up again from
/// it), nor the posix-acl/security-label negotiation modes (neither served).
pub const CAPABILITIES: &str = r#"{
  "type": "fs",
  "features": [
    "separate-options"
  ]
}
"#;

/// The message for a refused virtiofsd option; `name` as the user gave it.
pub fn refusal(name: &str) -> String {
    format!("{name} is not supported (virtiofsd option; see docs/virtiofs.md)")
}

const NEGOTIATION: [&str; 3] = ["never", "auto", "always"];

#[derive(Args, Debug, Default)]
pub struct VirtiofsdOnly {
    #[arg(long, hide = true)]
    tag: Option<String>,
    #[arg(long, hide = true)]
    socket_group: Option<String>,
    #[arg(long, hide = true)]
    xattrmap: Option<String>,
    #[arg(long, hide = true)]
    readonly: bool,
    #[arg(long, hide = true)]
    allow_mmap: bool,
    #[arg(long, hide = true)]
    writeback: bool,
    #[arg(long, hide = true)]
    allow_direct_io: bool,
    #[arg(long, hide = true)]
    modcaps: Option<String>,
    #[arg(long, hide = true)]
    uid_map: Vec<String>,
    #[arg(long, hide = true)]
    gid_map: Vec<String>,
    #[arg(long, hide = true)]
    translate_uid: Vec<String>,
    #[arg(long, hide = true)]
    translate_gid: Vec<String>,
    /// How inodes travel in the device state: only `find-paths` (by path,
    /// verified by device and inode number), virtiofsd's default.
    #[arg(long, value_name = "find-paths",
          value_parser = PossibleValuesParser::new(["find-paths", "file-handles"]))]
    migration_mode: Option<String>,
    /// A migrated inode that cannot be found again: only `abort` (the load
    /// fails, naming its path), virtiofsd's default.
    #[arg(long, value_name = "abort",
          value_parser = PossibleValuesParser::new(["abort", "guest-error"]))]
    migration_on_error: Option<String>,
    /// Taken: every migrated inode is verified by device and inode number.
    #[arg(long)]
    migration_verify_handles: bool,
    /// Taken: a save checks that every inode is still at its path.
    #[arg(long)]
    migration_confirm_paths: bool,
    /// POSIX ACLs: only `never` (the daemon serves none) is taken.
    #[arg(long, require_equals = true, num_args = 0..=1, default_missing_value = "always",
          value_name = "never", value_parser = PossibleValuesParser::new(NEGOTIATION))]
    posix_acl: Option<String>,
    /// Security labels: only `never` (the daemon stores none) is taken.
    #[arg(long, require_equals = true, num_args = 0..=1, default_missing_value = "always",
          value_name = "never", value_parser = PossibleValuesParser::new(NEGOTIATION))]
    security_label: Option<String>,
    /// Inodes are always held as O_PATH fds: only `never` is taken.
    #[arg(long, require_equals = true, value_name = "never",
          value_parser = PossibleValuesParser::new(["never", "fallback", "prefer", "mandatory"]))]
    inode_file_handles: Option<String>,
}

impl VirtiofsdOnly {
    /// The first given option the daemon does not implement, refused by name.
    pub fn refuse_unsupported(&self) -> Result<(), String> {
        if self.migration_mode.as_deref() == Some("file-handles") {
            return Err(
                "--migration-mode=file-handles is not supported: opening files by \
                        handle needs CAP_DAC_READ_SEARCH, which the daemon's sandbox drops \
                        (find-paths, the default, is)"
                    .into(),
            );
        }
        let valued = |name: &str, v: &Option<String>, taken: &str| match v.as_deref() {
            Some(v) if v != taken => Some(format!("{name}={v}")),
            _ => None,
        };
        let given = |name: &str, set: bool| set.then(|| name.to_string());
        let refused = [
            given("--tag", self.tag.is_some()),
            given("--socket-group", self.socket_group.is_some()),
            given("--xattrmap", self.xattrmap.is_some()),
            given("--readonly", self.readonly),
            given("--allow-mmap", self.allow_mmap),
            given("--writeback", self.writeback),
            given("--allow-direct-io", self.allow_direct_io),
            given("--modcaps", self.modcaps.is_some()),
            given("--uid-map", !self.uid_map.is_empty()),
            given("--gid-map", !self.gid_map.is_empty()),
            given("--translate-uid", !self.translate_uid.is_empty()),
            given("--translate-gid", !self.translate_gid.is_empty()),
            valued("--migration-on-error", &self.migration_on_error, "abort"),
            valued("--posix-acl", &self.posix_acl, "never"),
            valued("--security-label", &self.security_label, "never"),
            valued("--inode-file-handles", &self.inode_file_handles, "never"),
        ];
        match refused.into_iter().flatten().next() {
            Some(name) => Err(refusal(&name)),
            None => Ok(()),
        }
    }
}
