//! The daemon's control socket (`dax-virtiofsd --control-socket`): JSON over
//! HTTP/1.1 on a unix socket. These types are the messages; the daemon
//! serializes them and the VMM's API parses them, so the two cannot drift
//! apart (an effect is an enum, not a string compared on both sides).
//!
//! | request | answer |
//! |---|---|
//! | `GET` [`POLICY`] | [`PolicyState`] |
//! | `PUT` [`POLICY`]`[?dry_run=true]` (a policy document) | [`PolicyUpdate`]; 400 with the message naming the field for an invalid one |
//! | `DELETE` [`POLICY`] | [`PolicyUpdate`] (back to the default policy) |
//! | `GET` [`STATS`] | [`DaemonStats`] |
//! | `GET` [`ADAPTIVE_EVENTS`]`?after=N` | [`AdaptiveEvents`]: the adaptive policy's decisions numbered above N |
//! | `POST` [`WINDOW_TRUNCATED`] ([`WindowTruncated`]) | 204: the VMM tells the daemon that a mapped file shrank on the host and the window range shows zeros now |
//! | `PUT` [`WINDOW_LOCATION`] ([`WindowLocation`]) | 204: the VMM tells the daemon where the window sits in guest-physical memory (at start, and after the guest moves a BAR), so requests whose buffers lie in the window can be served; 400 for a location that does not fit |

pub mod listener;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Where dax-virtiofsd serves its control socket unless told otherwise,
/// and where the VMM looks for it when an fs device names none:
/// `<vhost-user socket>.control`. Kata Containers' driver has no field
/// for a control socket, so this is how its VMs get one.
pub fn default_control_socket(vhost_user_socket: &std::path::Path) -> std::path::PathBuf {
    let mut p = vhost_user_socket.as_os_str().to_owned();
    p.push(".control");
    p.into()
}

pub const POLICY: &str = "/api/v1/policy";
pub const STATS: &str = "/api/v1/stats";
pub const ADAPTIVE_EVENTS: &str = "/api/v1/adaptive/events";
pub const WINDOW_TRUNCATED: &str = "/api/v1/window/truncated";
pub const WINDOW_LOCATION: &str = "/api/v1/window/location";

/// Where a device's DAX window sits in guest-physical memory. A FUSE READ
/// or WRITE whose buffer lies in `[gpa, gpa + size)` names window pages
/// (a guest program read into a DAX mapping of another file), which the
/// daemon serves from what it mapped there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowLocation {
    pub gpa: u64,
    pub size: u64,
}

/// A window range whose file pages vanished (the file shrank on the host):
/// the VMM shows its scratch there now, so the guest reads zeros.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WindowTruncated {
    pub offset: u64,
    pub len: u64,
}

/// A DAX window's counters at one moment, as the VMM's window keeps them
/// (`virtio_devices::vhost_user_fs::metrics`) and the VMM's API publishes
/// them (`vm.dax-metrics`, `vm.counters`): one type from where they are
/// counted to where they are rendered. Not a control-socket message.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WindowCounters {
    pub maps: u64,
    pub unmaps: u64,
    /// Bytes of the window backed by a file mapping right now.
    pub bytes_mapped: u64,
    /// Unmaps that dropped every mapping at once (device reset, daemon gone).
    pub resets: u64,
    /// Bytes of new mappings whose host page tables were filled at map time.
    pub prefaulted_bytes: u64,
    /// Bytes of new mappings put into KVM's page tables at map time.
    pub guest_prefaulted_bytes: u64,
    /// Maps whose pre-fault failed (the mapping stayed; pages fault later).
    pub prefault_failures: u64,
    /// Bytes of mappings whose file shrank on the host, shown as scratch since.
    pub truncated_bytes: u64,
    /// Ranges mapped again from a saved window record (a restore or an
    /// incoming migration), apart from the guest's own maps.
    pub restored_ranges: u64,
    /// Refused SHMEM_MAP/UNMAP requests, by reason label.
    pub failures: Vec<(&'static str, u64)>,
    /// SHMEM_MAP latency: cumulative counts per upper bound in µs (None:
    /// +Inf), as [`DaemonStats::map_latency_buckets`] gives the daemon's.
    pub latency_buckets: Vec<(Option<u64>, u64)>,
    pub latency_sum_us: u64,
    /// Where the VMM's side of a SHMEM_MAP goes, stage by stage.
    pub map_stages: Vec<StageTotal>,
}

/// Time spent in one stage of serving a DAX map, summed over the maps that
/// reached it: the daemon's ([`DaemonStats::map_stages`]) and the VMM's
/// ([`WindowCounters::map_stages`]) trace of a SETUPMAPPING.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StageTotal {
    pub stage: String,
    pub count: u64,
    pub sum_us: u64,
}

/// The policy in force and its generation (1 at start, +1 per change).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyState {
    pub generation: u64,
    /// The policy document, normalized (every field filled).
    pub policy: Value,
}

/// When a changed policy field takes hold: the policy's own diff decides
/// it, and the messages carry it as it is.
pub use policies::Effect;

/// One changed field of a policy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyChange {
    /// The field's path in the document (`rules[1].min_size`).
    pub field: String,
    /// The old and new values, as the policy document spells them.
    pub from: String,
    pub to: String,
    pub effect: Effect,
}

/// The answer to a PUT or DELETE: the generation in force afterwards (the
/// same one when nothing changed or on a dry run) and what changed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PolicyUpdate {
    pub generation: u64,
    pub applied: bool,
    pub changes: Vec<PolicyChange>,
}

/// The daemon's counters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DaemonStats {
    pub requests: u64,
    pub errors: u64,
    pub fuse_reads: u64,
    pub fuse_read_bytes: u64,
    pub fuse_writes: u64,
    pub fuse_write_bytes: u64,
    pub setupmappings: u64,
    pub removemappings: u64,
    pub dax_failures: u64,
    pub inodes: u64,
    pub policy_generation: u64,
    pub file_attrs_dax: u64,
    pub file_attrs_nodax: u64,
    pub handles: u64,
    /// Requests refused at a cap, by cap name (`inodes`, `handles`, ...).
    pub cap_refusals: BTreeMap<String, u64>,
    /// SETUPMAPPING's SHMEM_MAP round trip (daemon → VMM → ack): cumulative
    /// counts per upper bound in µs (None: +Inf), and the sum in µs.
    pub map_latency_buckets: Vec<(Option<u64>, u64)>,
    pub map_latency_sum_us: u64,
    /// The mapping alignment announced at FUSE_INIT, bytes (`auto` resolved).
    pub map_alignment: u64,
    /// What the start-up probe found of the shared directory's file system.
    pub host_fs: String,
    pub adaptive: AdaptiveStats,
    /// Window ranges the VMM reported truncated under a mapping
    /// ([`WINDOW_TRUNCATED`]), and their bytes.
    #[serde(default)]
    pub window_truncations: u64,
    #[serde(default)]
    pub window_truncated_bytes: u64,
    /// Where the VMM last said the window is ([`WINDOW_LOCATION`]).
    #[serde(default)]
    pub window_location: Option<WindowLocation>,
    /// READ/WRITE requests with a buffer in the window, served by copying
    /// between the request's file and the file mapped there; their bytes;
    /// and those refused (EFAULT: a buffer over an unmapped or read-only
    /// part of the window, past a mapped file's end, or no location yet).
    #[serde(default)]
    pub window_buffer_ios: u64,
    #[serde(default)]
    pub window_buffer_bytes: u64,
    #[serde(default)]
    pub window_buffer_refusals: u64,
    /// Where a SETUPMAPPING's time goes in the daemon, stage by stage
    /// (`open`, `shmem_map`, `record`, and `served`: popped from the queue
    /// until its reply is on the used ring).
    #[serde(default)]
    pub map_stages: Vec<StageTotal>,
    /// SETUPMAPPINGs that passed a descriptor kept from an earlier range of
    /// the same file instead of opening the file again.
    #[serde(default)]
    pub map_fds_reused: u64,
}

/// The adaptive DAX policy's view of the window and what it decided.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveStats {
    pub enabled: bool,
    /// Whether the window is under pressure now.
    pub pressure: bool,
    /// 2 MiB ranges of the window, and how many hold a mapping now.
    pub window_ranges: u64,
    pub mapped_ranges: u64,
    /// Unmaps of a range while the window was under pressure (the guest's
    /// reclaim).
    pub reclaims: u64,
    /// Times pressure started.
    pub pressure_episodes: u64,
    /// Answers turned from DAX to no DAX, and back, by reason.
    pub withdrawn: BTreeMap<String, u64>,
    pub granted: BTreeMap<String, u64>,
    /// Files kept off DAX now because their ranges kept being reclaimed.
    pub thrashing_files: u64,
}

/// One decision of the adaptive policy, as the guest saw it: the answer it
/// got for a file, and why; or the window entering or leaving pressure.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveEvent {
    pub seq: u64,
    /// Milliseconds since the Unix epoch.
    pub at_ms: u64,
    /// `withdraw`, `grant`, `pressure_on` or `pressure_off`.
    pub kind: String,
    /// The file (path in the share, FUSE node id), for withdraw and grant.
    pub path: Option<String>,
    pub nodeid: Option<u64>,
    /// Why: `larger_than_window_share`, `small_file_under_pressure`,
    /// `thrashing`, `reread`, `retry`, `fits`, or the occupancy for pressure.
    pub reason: String,
    /// Mapped ranges, percent of the window, when it was decided.
    pub occupancy_pct: u64,
}

/// The events numbered above the asked one; `missed` counts those the
/// daemon's ring no longer held.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct AdaptiveEvents {
    pub events: Vec<AdaptiveEvent>,
    /// Ask `after=next` next time.
    pub next: u64,
    pub missed: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_back_as_written() {
        let update = PolicyUpdate {
            generation: 3,
            applied: true,
            changes: vec![PolicyChange {
                field: "cache_size".into(),
                from: "1G".into(),
                to: "2G".into(),
                effect: Effect::Recreate,
            }],
        };
        let text = serde_json::to_string(&update).unwrap();
        assert!(text.contains(r#""effect":"recreate""#), "{text}");
        assert_eq!(serde_json::from_str::<PolicyUpdate>(&text).unwrap(), update);
        let stats = DaemonStats {
            cap_refusals: [("inodes".to_string(), 4)].into(),
            ..Default::default()
        };
        let back: DaemonStats =
            serde_json::from_str(&serde_json::to_string(&stats).unwrap()).unwrap();
        assert_eq!(back, stats);
        // A message missing a field is refused, not read as zero.
        assert!(serde_json::from_str::<DaemonStats>(r#"{"requests": 1}"#).is_err());
    }
}
