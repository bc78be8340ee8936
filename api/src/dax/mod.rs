//! The DAX policy controller: the one owner of what each fs device's daemon
//! should have and has been told. The router ([`crate::routes`]) only
//! translates HTTP into its calls.
//!
//! Per fs device id it keeps the desired policy (starting from the one the
//! device was configured with in `vm.create`/`vm.add-fs`), the generation
//! the daemon gave it, how the last reconcile went, the adaptive-event
//! cursor and the window location the daemon was told. The device set and
//! each device's control socket come from the VMM's device list without
//! window statistics ([`PolicyController::sync`]), at every tick and around
//! each request that adds or removes devices; a device that leaves takes
//! its state with it (a new device with its id starts afresh).
//!
//! - `GET vm.dax-policy`: [`PolicyController::policy`]: the desired policy
//!   and what the daemon has in force (its generation is the `ETag`);
//! - `PUT`/`DELETE`: [`PolicyController::put`]: an invalid policy is
//!   refused before any daemon sees it; a daemon that refuses or cannot be
//!   reached leaves the desired policy as it was; `If-Match` is checked
//!   against the daemon's generation (412 unless it is still there), so a
//!   fleet tool's read-modify-write does not overwrite a change it has not
//!   seen; putting the same document again makes no new generation;
//! - [`run`]: every [`RECONCILE_PERIOD`], each daemon whose policy is not
//!   the desired one (restarted, say) gets it again; each daemon's adaptive
//!   decisions are relayed into `vm.dax-events`; each daemon is told where
//!   its window is ([`notices`]);
//! - [`deliver_truncations`]: tells a daemon when a file mapped in its
//!   window shrank, from the VMM's notice queue ([`DaemonNotices`], typed,
//!   bounded by coalescing, never dropping; see [`notice_queue`]). The
//!   event stream ([`crate::events`]) only reports outward.
//!
//! `vm.info` shows the desired policy as the fs device's `dax_policy`
//! ([`PolicyController::show_desired`]).

mod daemon;
mod notice_queue;
mod notices;
#[cfg(test)]
#[path = "dax_tests.rs"]
mod tests;

use std::collections::BTreeMap;
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use control_protocol::{PolicyState, PolicyUpdate, WindowLocation};
use policies::Policy;
use serde::Serialize;
use serde_json::{json, Value};

use crate::events::DaxEvent;
use crate::if_match::{etag, IfMatch};
use crate::metrics::{DeviceMetrics, MetricsSnapshot, PageFaults};
use crate::{ApiError, EventBus, FsDaxStatus, VmmAction, VmmChannel, VmmReply, VmmResult};
use daemon::Daemon;
pub use notice_queue::{DaemonNotice, DaemonNotices, MAX_PENDING_RANGES};
pub(crate) use notices::deliver_truncations;

/// How often [`run`] compares desired policies with the daemons'.
pub const RECONCILE_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// What the reconcile loop last found for one device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub(crate) struct ReconcileState {
    /// Whether the daemon had the desired policy (after any re-push).
    pub in_sync: bool,
    /// Times the loop pushed the desired policy again.
    pub pushes: u64,
    /// Why the last comparison or push failed (daemon unreachable...).
    pub last_error: Option<String>,
}

/// What the controller keeps for one fs device.
#[derive(Clone, Debug, Default)]
struct Device {
    /// Where its daemon listens (None: the device names none and none is
    /// at the default place).
    control_socket: Option<PathBuf>,
    /// Where the VMM placed its window, if it did.
    window_location: Option<WindowLocation>,
    /// The policy the device was configured with, as the VMM lists it: a
    /// device listed with another one was created again.
    configured: Option<Value>,
    /// The policy its daemon should have; None until one is given.
    desired: Option<Value>,
    /// The generation the daemon gave `desired`.
    desired_generation: Option<u64>,
    reconcile: Option<ReconcileState>,
    /// The last adaptive-policy event relayed from its daemon.
    adaptive_cursor: Option<u64>,
    /// The window location its daemon last took.
    told_location: Option<WindowLocation>,
}

impl Device {
    fn new(listed: &FsDaxStatus) -> Self {
        Device {
            configured: listed.configured_policy.clone(),
            desired: listed.configured_policy.clone(),
            ..Default::default()
        }
    }

    /// Its daemon, or why there is none to ask (409).
    fn daemon(&self, id: &str) -> Result<Daemon, ApiError> {
        self.control_socket.as_deref().map(Daemon::at).ok_or_else(|| {
            ApiError::conflict(format!(
                "fs device \"{id}\" has no control socket: the device names none (control_socket=<path>) and no socket is at <its socket>.control, where dax-virtiofsd serves one unless started with --no-control-socket"
            ))
        })
    }
}

/// `GET vm.dax-policy`'s facts about one device.
#[derive(Debug, PartialEq)]
pub(crate) struct PolicyView {
    pub desired: Option<Value>,
    pub desired_generation: Option<u64>,
    /// What the daemon has in force, or why it could not be asked.
    pub acknowledged: Result<PolicyState, String>,
    pub reconcile: Option<ReconcileState>,
}

/// A `PUT` or `DELETE` of a device's policy.
#[derive(Debug)]
pub(crate) struct PolicyRequest {
    /// Only say what would change.
    pub dry_run: bool,
    /// `If-Match`: only if the daemon is at one of these generations.
    pub expected: Option<IfMatch>,
}

pub(crate) struct PolicyController {
    vmm: VmmChannel,
    events: EventBus,
    devices: Mutex<BTreeMap<String, Device>>,
    /// Held while a policy is pushed and the desired one recorded, so the
    /// reconcile loop never pushes a policy a request is replacing.
    push_lock: tokio::sync::Mutex<()>,
}

/// The policy document of a `PUT` body, JSON or YAML.
pub(crate) fn parse_policy(body: &[u8]) -> Result<Policy, ApiError> {
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::bad_request("vm.dax-policy: the body is not UTF-8"))?;
    let trimmed = text.trim_start();
    if trimmed.is_empty() {
        return Err(ApiError::bad_request(
            "vm.dax-policy: a policy document (JSON or YAML) is required",
        ));
    }
    let parsed = if trimmed.starts_with('{') {
        Policy::parse_json(text)
    } else {
        Policy::parse_yaml(text)
    };
    parsed.map_err(|e| ApiError::bad_request(format!("vm.dax-policy: {e}")))
}

impl PolicyController {
    pub fn new(vmm: VmmChannel, events: EventBus) -> Arc<Self> {
        Arc::new(PolicyController {
            vmm,
            events,
            devices: Mutex::default(),
            push_lock: tokio::sync::Mutex::default(),
        })
    }

    fn devices(&self) -> MutexGuard<'_, BTreeMap<String, Device>> {
        self.devices.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The VMM's fs devices, with window statistics only when asked (they
    /// cost a `mincore` over every mapping of every window).
    async fn listed(&self, window_stats: bool) -> Result<Vec<FsDaxStatus>, ApiError> {
        match self.vmm.call(VmmAction::DaxStatus { window_stats }).await? {
            VmmReply::Dax(d) => Ok(d),
            other => Err(ApiError::internal(format!(
                "unexpected answer from the VMM: {other:?}"
            ))),
        }
    }

    /// Takes the device set, control sockets and window locations from the
    /// VMM (no window statistics). Devices that left are forgotten; one
    /// listed with another configured policy was created again and starts
    /// afresh.
    pub async fn sync(&self) -> Result<(), ApiError> {
        let listed = self.listed(false).await?;
        let mut devices = self.devices();
        devices.retain(|id, _| listed.iter().any(|d| &d.id == id));
        for d in &listed {
            let known = devices
                .entry(d.id.clone())
                .or_insert_with(|| Device::new(d));
            if known.configured != d.configured_policy {
                *known = Device::new(d);
            }
            known.control_socket.clone_from(&d.control_socket);
            known.window_location = d.window_location;
        }
        Ok(())
    }

    /// Runs `change`, a VMM call that may add or remove devices, between two
    /// syncs, so a device removed and another added with its id are never
    /// taken for one.
    pub async fn device_change(&self, change: impl Future<Output = VmmResult>) -> VmmResult {
        let _ = self.sync().await;
        let result = change.await;
        let _ = self.sync().await;
        result
    }

    fn known(&self, id: &str) -> Result<Device, ApiError> {
        self.devices()
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("no fs device with id \"{id}\"")))
    }

    /// The desired policy of `id` and what its daemon has in force.
    pub async fn policy(&self, id: &str) -> Result<PolicyView, ApiError> {
        self.sync().await?;
        let device = self.known(id)?;
        let acknowledged = match device.daemon(id) {
            Ok(daemon) => daemon.policy().await.map_err(|e| e.message),
            Err(e) => Err(e.message),
        };
        // Read after the daemon answered: a reconcile in between shows.
        let reconcile = self.devices().get(id).and_then(|d| d.reconcile.clone());
        Ok(PolicyView {
            desired: device.desired,
            desired_generation: device.desired_generation,
            acknowledged,
            reconcile,
        })
    }

    /// Puts `policy` (None: the daemon's default) in force on `id`'s daemon
    /// and records it as desired; what changed.
    pub async fn put(
        &self,
        id: &str,
        policy: Option<Policy>,
        request: PolicyRequest,
    ) -> Result<PolicyUpdate, ApiError> {
        let _push = self.push_lock.lock().await;
        self.sync().await?;
        let daemon = self.known(id)?.daemon(id)?;
        if let Some(expected) = request.expected.filter(|e| *e != IfMatch::Any) {
            let current = daemon.policy().await?;
            if !expected.matches(current.generation) {
                return Err(ApiError {
                    status: 412,
                    message: format!(
                        "vm.dax-policy: If-Match names no strong entity tag of the daemon of \"{id}\", which is at generation {}: read it again (it is given as ETag and written If-Match: {})",
                        current.generation,
                        etag(current.generation)
                    ),
                });
            }
        }
        let doc = policy.as_ref().map(Policy::to_value);
        let answer = match &doc {
            Some(doc) => daemon.put_policy(doc, request.dry_run).await?,
            None => daemon.reset_policy(request.dry_run).await?,
        };
        if request.dry_run {
            return Ok(answer);
        }
        let desired = match doc {
            Some(doc) => doc,
            // What the daemon went back to is what it should keep.
            None => daemon.policy().await?.policy,
        };
        if let Some(d) = self.devices().get_mut(id) {
            d.desired = Some(desired);
            d.desired_generation = Some(answer.generation);
        }
        if !answer.changes.is_empty() {
            self.events.publish(DaxEvent::new(
                "policy",
                id,
                json!({"generation": answer.generation, "changes": answer.changes}),
            ));
        }
        Ok(answer)
    }

    /// One pass: each device with a desired policy whose daemon has another
    /// gets the desired one pushed again.
    pub async fn reconcile_once(&self) {
        let _push = self.push_lock.lock().await;
        let desired: Vec<(String, Result<Daemon, ApiError>, Value)> = self
            .devices()
            .iter()
            .filter_map(|(id, d)| Some((id.clone(), d.daemon(id), d.desired.clone()?)))
            .collect();
        for (id, daemon, policy) in desired {
            let outcome = match daemon {
                Ok(daemon) => self.reconcile_device(&id, &daemon, &policy).await,
                Err(e) => Err(e.message),
            };
            let mut devices = self.devices();
            let Some(device) = devices.get_mut(&id) else {
                continue;
            };
            let state = device.reconcile.get_or_insert_with(Default::default);
            match outcome {
                Ok(pushed) => {
                    state.in_sync = true;
                    state.pushes += u64::from(pushed);
                    state.last_error = None;
                }
                Err(e) => {
                    state.in_sync = false;
                    state.last_error = Some(e);
                }
            }
        }
    }

    /// Compares one daemon's policy with `policy`; pushes it if they differ.
    /// Ok(true) when it pushed.
    async fn reconcile_device(
        &self,
        id: &str,
        daemon: &Daemon,
        policy: &Value,
    ) -> Result<bool, String> {
        let current = daemon.policy().await.map_err(|e| e.message)?;
        if current.policy == *policy {
            return Ok(false);
        }
        let answer = daemon
            .put_policy(policy, false)
            .await
            .map_err(|e| e.message)?;
        let generation = answer.generation;
        tracing::info!("DAX policy of {id}: the daemon had another one (restarted?); pushed again as generation {generation}");
        if let Some(d) = self.devices().get_mut(id) {
            d.desired_generation = Some(generation);
        }
        self.events.publish(DaxEvent::new(
            "policy",
            id,
            json!({"generation": generation, "changes": answer.changes, "reconciled": true}),
        ));
        Ok(true)
    }

    /// `vm.info`: each fs device's `dax_policy` as the desired one (the
    /// VMM's configuration has the one the device was configured with).
    pub fn show_desired(&self, info: &mut Value) {
        let devices = self.devices();
        let fs = info
            .get_mut("config")
            .and_then(|c| c.get_mut("fs"))
            .and_then(Value::as_array_mut);
        for f in fs.into_iter().flatten() {
            let Some(known) = f["id"].as_str().and_then(|id| devices.get(id)) else {
                continue;
            };
            // Only the device it was recorded for (not one created again since).
            if f["dax_policy"] == known.configured.clone().unwrap_or(Value::Null) {
                f["dax_policy"] = known.desired.clone().unwrap_or(Value::Null);
            }
        }
    }

    /// What `vm.dax-metrics` renders: the VMM's window statistics, each
    /// daemon's stats, KVM's counters, this process's page faults.
    pub async fn metrics(&self) -> Result<MetricsSnapshot, ApiError> {
        let listed = self.listed(true).await?;
        let mut devices = Vec::with_capacity(listed.len());
        for d in listed {
            let daemon = match &d.control_socket {
                Some(socket) => Daemon::at(socket).stats().await.ok(),
                None => None,
            };
            devices.push(DeviceMetrics {
                id: d.id,
                up: !d.failed,
                window: d.window,
                daemon,
            });
        }
        let kvm = match self.vmm.call(VmmAction::KvmCounters).await {
            Ok(VmmReply::Kvm(k)) => k,
            _ => None,
        };
        Ok(MetricsSnapshot {
            kvm,
            devices,
            faults: PageFaults::of_this_process(),
        })
    }
}

/// Keeps every daemon on its device's desired policy, relays its adaptive
/// decisions and tells it where its window is, for ever (a task on the
/// API's runtime).
pub(crate) async fn run(controller: Arc<PolicyController>) {
    let mut tick = tokio::time::interval(RECONCILE_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if controller.sync().await.is_err() {
            continue;
        }
        controller.reconcile_once().await;
        controller.relay_adaptive().await;
        controller.tell_locations().await;
    }
}
