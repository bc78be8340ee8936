//! The VMM's control loop when it serves the REST API: it owns the VM
//! configuration and the VM, and answers the API's actions one at a time,
//! between stop signals and the VM ending on its own.
//!
//! States follow Cloud Hypervisor's: no VM, `Created` (a configuration),
//! `Running`, `Paused`, `Shutdown` (stopped by `vm.shutdown`; `vm.boot`
//! starts it again). A paused VM can be snapshotted (`vm.snapshot`); a VMM
//! without a VM can restore one (`vm.restore`, `--restore`), which comes
//! back paused unless told to resume. When the guest itself powers off,
//! resets or panics, the VMM exits with the same status as without the API.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use api::{
    ApiError, DaemonNotices, DaxEvent, EventBus, FsDaxStatus, VmmAction, VmmReceiver, VmmReply,
    VmmResult, WindowStats,
};
use serde_json::{json, Value};
use virtio_devices::vhost_user_fs::window::{WindowEvent, WindowObserver};

use crate::config::json::{
    disk_config_from_json, fs_config_from_json, net_config_from_json, pmem_config_from_json,
    restore_config_from_json, snapshot_config_from_json, vm_config_from_json, vm_config_to_json,
    vsock_config_from_json,
};
use crate::config::{ConfigError, DeviceConfig, RestoreConfig, VmConfig};
use crate::device_manager::{DeviceManagerError, FsDeviceInfo};
use crate::exit::VmExit;
use crate::migration;
use crate::signals::StopSignals;
use crate::snapshot::RestoreTaps;
use crate::vm::{Vm, VmError};

/// Publishes one fs device's window events on the API's event stream, and
/// leaves each truncation for the device's daemon on the notice queue (the
/// stream may drop events for a reader that lags; the queue never drops).
struct EventPublisher {
    device: String,
    bus: EventBus,
    notices: DaemonNotices,
}

impl WindowObserver for EventPublisher {
    fn event(&self, event: &WindowEvent) {
        let (kind, fields) = match event {
            WindowEvent::Map {
                offset,
                len,
                fd_offset,
                writable,
                took,
            } => (
                "map",
                json!({"offset": offset, "len": len, "fd_offset": fd_offset, "writable": writable, "micros": u64::try_from(took.as_micros()).unwrap_or(u64::MAX)}),
            ),
            WindowEvent::Unmap { offset, len } => ("unmap", json!({"offset": offset, "len": len})),
            WindowEvent::Reset => ("reset", json!({})),
            WindowEvent::Truncated { offset, len } => {
                self.notices.truncated(&self.device, *offset, *len);
                ("truncated", json!({"offset": offset, "len": len}))
            }
            WindowEvent::Refused {
                request,
                reason,
                offset,
                len,
            } => (
                "refused",
                json!({"request": request, "reason": reason.as_str(), "offset": offset, "len": len}),
            ),
        };
        self.bus.publish(DaxEvent::new(kind, &self.device, fields));
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Created,
    Running,
    Paused,
    Shutdown,
}

impl State {
    fn as_str(self) -> &'static str {
        match self {
            State::Created => "Created",
            State::Running => "Running",
            State::Paused => "Paused",
            State::Shutdown => "Shutdown",
        }
    }
}

/// What `vmm.ping` answers (as Cloud Hypervisor's VmmPingResponse); the
/// API thread answers it without asking the control loop.
pub fn ping_info() -> Value {
    json!({
        "build_version": env!("CARGO_PKG_VERSION"),
        "version": env!("CARGO_PKG_VERSION"),
        "pid": std::process::id(),
        "features": ["kvm", "virtio-fs-dax", "virtio-pmem", "virtio-blk", "virtio-vsock", "virtio-net", "virtio-mmio", "virtio-pci", "pci-hotplug"],
    })
}

/// How the loop ended.
pub enum LoopExit {
    /// `vmm.shutdown`.
    Requested,
    /// The VM ended on its own, or a stop signal arrived.
    Vm(VmExit),
    /// `vm.send-migration` handed the VM to another VMM.
    Migrated,
}

pub struct ControlLoop {
    config: Option<VmConfig>,
    vm: Option<Vm>,
    state: State,
    events: EventBus,
    /// What the fs devices' windows leave for their daemons.
    notices: DaemonNotices,
    /// The VM migrated away: the loop ends once the answer is sent.
    migrated: bool,
}

/// `vm.info`'s `device_tree` as Cloud Hypervisor shapes it, for the
/// virtio-PCI devices of a running VM: each one's id and `pci_bdf`
/// (`SSSS:00:DD.0`, with its segment).
fn device_tree(vm: &Vm) -> Value {
    let nodes: serde_json::Map<String, Value> = vm
        .pci_addresses()
        .into_iter()
        .map(|(id, at)| {
            let node =
                json!({"id": id, "resources": [], "children": [], "pci_bdf": at.to_string()});
            (id, node)
        })
        .collect();
    Value::Object(nodes)
}

/// `vm.add-vsock`'s device: one vsock device per VM, as in Cloud Hypervisor.
fn new_vsock(c: &VmConfig, body: &Value) -> Result<DeviceConfig, ApiError> {
    let v = vsock_config_from_json(body).map_err(bad_request("vm.add-vsock"))?;
    if let Some(old) = &c.vsock {
        return Err(ApiError::conflict(format!(
            "vm.add-vsock: the VM has a vsock device already (\"{}\"); remove it first",
            old.id
        )));
    }
    Ok(DeviceConfig::Vsock(v))
}

/// `e` and its sources, outermost first, each that its outer one does not
/// already show: the whole error chain in one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let shown = cause.to_string();
        if !text.contains(&shown) {
            text = format!("{text}: {shown}");
        }
        source = cause.source();
    }
    text
}

/// Why `vm.snapshot` refuses a VM in `state` (any but paused).
fn not_snapshottable_in(state: State) -> String {
    match state {
        State::Running => {
            "vm.snapshot: trying to snapshot while the VM is running: pause it first (vm.pause)"
                .to_string()
        }
        state => format!(
            "vm.snapshot: the VM is not booted (it is {}): only a paused VM can be snapshotted",
            state.as_str()
        ),
    }
}

/// The API's answer to a body that is wrong: 400, naming the endpoint.
fn bad_request<E: std::fmt::Display>(endpoint: &'static str) -> impl Fn(E) -> ApiError {
    move |e| ApiError::bad_request(format!("{endpoint}: {e}"))
}

/// The API's answer to a hot-plug that did not happen: 400 for a transport
/// without hot-plug (the request itself is wrong), 409 for one the VM's
/// state refuses (an id still in use), 500 for one that failed.
fn hotplug_error(endpoint: &str, e: &DeviceManagerError) -> ApiError {
    let message = format!("{endpoint}: {e}");
    match e {
        DeviceManagerError::HotplugOverMmio { .. } => ApiError::bad_request(message),
        e if e.is_refusal() => ApiError::conflict(message),
        _ => ApiError::internal(message),
    }
}

/// A window's stats for `vm.dax-metrics`: its counters as the window keeps
/// them, and what is read off the window (`mincore` over its mappings).
fn window_stats(info: &FsDeviceInfo) -> Option<WindowStats> {
    let w = info.window.as_ref()?;
    Some(WindowStats {
        size: w.size(),
        ranges_mapped: w.mapped_guest_ranges(),
        stray_resets: w.stray_resets(),
        unwatched_files: {
            let (followed, watched) = w.watched_files();
            u64::try_from(followed.saturating_sub(watched)).unwrap_or(u64::MAX)
        },
        watch_refusals: w.watch_refusals(),
        resident_bytes: w.resident_bytes().ok(),
        stray_bytes: w.stray_bytes().ok(),
        counters: w.metrics.snapshot(),
    })
}

impl ControlLoop {
    /// `notices`: the API's queue for the daemons ([`VmmReceiver::notices`]).
    pub fn new(config: Option<VmConfig>, events: EventBus, notices: DaemonNotices) -> Self {
        ControlLoop {
            config,
            vm: None,
            state: State::Created,
            events,
            notices,
            migrated: false,
        }
    }

    /// Makes each fs device's window observer, which publishes its events
    /// and queues its daemon's notices.
    fn observer(&self) -> impl Fn(&str) -> Arc<dyn WindowObserver> {
        let bus = self.events.clone();
        let notices = self.notices.clone();
        move |id: &str| -> Arc<dyn WindowObserver> {
            Arc::new(EventPublisher {
                device: id.to_string(),
                bus: bus.clone(),
                notices: notices.clone(),
            })
        }
    }

    /// Boots the configured VM (used at start-up when the command line gave one).
    pub fn boot(&mut self) -> Result<(), VmError> {
        let config = self.config.as_ref().expect("boot needs a configuration");
        let observe = self.observer();
        self.vm = Some(Vm::boot(config, Some(&observe))?);
        self.state = State::Running;
        Ok(())
    }

    fn stop_vm(&mut self) {
        if let Some(vm) = self.vm.take() {
            vm.stop();
        }
        self.state = State::Shutdown;
    }

    /// Serves `requests` until `vmm.shutdown`, a stop signal, or the VM ending.
    pub fn run(
        mut self,
        requests: &VmmReceiver,
        signals: &StopSignals,
    ) -> std::io::Result<LoopExit> {
        loop {
            let mut fds = vec![requests.eventfd().as_raw_fd()];
            if let Some(vm) = &self.vm {
                fds.push(vm.exit_eventfd().as_raw_fd());
                fds.push(vm.eject_eventfd().as_raw_fd());
                fds.push(vm.vcpu_eject_eventfd().as_raw_fd());
            }
            if let Some(sig) = signals.wait(&fds)? {
                self.stop_vm();
                return Ok(LoopExit::Vm(VmExit::Signal(sig)));
            }
            if let Some(reason) = self.vm.as_ref().and_then(Vm::exit_reason) {
                self.stop_vm();
                return Ok(LoopExit::Vm(reason));
            }
            self.complete_ejects();
            if let Some(vm) = &self.vm {
                vm.complete_vcpu_ejects();
            }
            for req in requests.drain() {
                let api::ApiRequest { action, reply } = req;
                if matches!(action, VmmAction::ShutdownVmm) {
                    self.stop_vm();
                    let _ = reply.send(Ok(VmmReply::NoContent));
                    return Ok(LoopExit::Requested);
                }
                // A client that went away is no error.
                let _ = reply.send(self.handle(action));
                if self.migrated {
                    // The answer is on its way (the API server lets it
                    // out before it stops); the paused VM is let go.
                    self.stop_vm();
                    return Ok(LoopExit::Migrated);
                }
            }
        }
    }

    /// Booted: running or paused.
    fn booted(&self) -> bool {
        matches!(self.state, State::Running | State::Paused)
    }

    fn not_running(&self, endpoint: &str) -> ApiError {
        ApiError::conflict(format!(
            "{endpoint}: the VM is not running (it is {})",
            self.state.as_str()
        ))
    }

    /// Applies `change` to a copy of the configuration; returns the copy
    /// only if the whole configuration still checks out, so nothing is
    /// half-applied.
    fn changed_config<T>(
        &self,
        endpoint: &str,
        change: impl FnOnce(&mut VmConfig) -> Result<T, ApiError>,
    ) -> Result<(VmConfig, T), ApiError> {
        let mut next = self.config.clone().ok_or_else(|| {
            ApiError::conflict(format!("{endpoint}: no VM is created (vm.create first)"))
        })?;
        let changed = change(&mut next)?;
        next.validate().map_err(|e| match e {
            // As Cloud Hypervisor answers a device id that exists: 409.
            ConfigError::DuplicateId { .. } => ApiError::conflict(format!("{endpoint}: {e}")),
            e => ApiError::bad_request(format!("{endpoint}: {e}")),
        })?;
        Ok((next, changed))
    }

    /// `vm.add-fs` / `vm.add-pmem` / `vm.add-disk` / `vm.add-vsock` /
    /// `vm.add-net`: `parse` gives the device's config from the request
    /// (checked, and named for the configuration it joins). Before boot
    /// the device joins the configuration (204); on a running VM it is
    /// hot-plugged too, and the reply says where, as Cloud Hypervisor's
    /// does (200 `{"id","bdf"}`).
    fn add_device(
        &mut self,
        endpoint: &str,
        parse: impl FnOnce(&VmConfig) -> Result<DeviceConfig, ApiError>,
    ) -> VmmResult {
        let (next, device) = self.changed_config(endpoint, |c| {
            let device = parse(c)?;
            c.add_device(device.clone());
            Ok(device)
        })?;
        let observe = self.observer();
        let booted = self.booted();
        let Some(vm) = self.vm.as_mut().filter(|_| booted) else {
            self.config = Some(next);
            return Ok(VmmReply::NoContent);
        };
        let placed = match &device {
            DeviceConfig::Fs(f) => vm.add_fs(f, Some(&observe)),
            DeviceConfig::Pmem(p) => vm.add_pmem(p),
            DeviceConfig::Disk(d) => vm.add_disk(d),
            DeviceConfig::Vsock(v) => vm.add_vsock(v),
            DeviceConfig::Net(n) => vm.add_net(n),
        };
        let info = placed.map_err(|e| hotplug_error(endpoint, &e))?;
        self.config = Some(next);
        Ok(VmmReply::Json(json!({"id": info.id, "bdf": info.bdf})))
    }

    /// `vm.remove-device`: the device leaves the configuration now (so a
    /// reboot does not bring it back); on a running VM the guest is asked to
    /// eject it, and it goes when the guest has let go of it.
    fn remove_device(&mut self, id: &str) -> VmmResult {
        let endpoint = "vm.remove-device";
        let (next, ()) = self.changed_config(endpoint, |c| {
            if !c.remove_device(id) {
                return Err(ApiError::not_found(format!(
                    "{endpoint}: no device with id \"{id}\""
                )));
            }
            Ok(())
        })?;
        if let Some(vm) = self.vm.as_ref().filter(|_| self.booted()) {
            vm.remove_device(id)
                .map_err(|e| ApiError::conflict(format!("{endpoint}: {e}")))?;
        }
        self.config = Some(next);
        Ok(VmmReply::NoContent)
    }

    /// `vm.resize`: see [`crate::resize`].
    fn resize(&mut self, body: &Value) -> VmmResult {
        let booted = self.booted();
        let config = self
            .config
            .as_mut()
            .ok_or_else(|| ApiError::conflict("vm.resize: no VM is created (vm.create first)"))?;
        let vm = self.vm.as_mut().filter(|_| booted);
        crate::resize::resize(body, config, vm)
    }

    /// Takes away the devices the guest ejected. One the guest ejected on
    /// its own (no `vm.remove-device`) leaves the configuration too.
    fn complete_ejects(&mut self) {
        let Some(vm) = self.vm.as_mut() else {
            return;
        };
        for id in vm.complete_ejects() {
            if let Some(c) = self.config.as_mut() {
                c.remove_device(&id);
            }
        }
    }

    /// Answers one API action.
    fn handle(&mut self, action: VmmAction) -> VmmResult {
        match action {
            VmmAction::ShutdownVmm => Ok(VmmReply::NoContent),
            VmmAction::Create(body) => self.create(&body),
            VmmAction::Delete => {
                self.stop_vm();
                self.config = None;
                self.state = State::Created;
                Ok(VmmReply::NoContent)
            }
            VmmAction::Boot => self.boot_action(),
            VmmAction::Info => self.info(),
            VmmAction::ShutdownVm => {
                if !self.booted() {
                    return Err(self.not_running("vm.shutdown"));
                }
                self.stop_vm();
                Ok(VmmReply::NoContent)
            }
            VmmAction::Reboot => self.reboot(),
            VmmAction::PowerButton => self.power_button(),
            VmmAction::Pause => self.pause(),
            VmmAction::Resume => self.resume(),
            VmmAction::AddFs(body) => self.add_device("vm.add-fs", |c| {
                fs_config_from_json(&body, c.fs.len())
                    .map(DeviceConfig::Fs)
                    .map_err(bad_request("vm.add-fs"))
            }),
            VmmAction::AddPmem(body) => self.add_device("vm.add-pmem", |c| {
                pmem_config_from_json(&body, c.pmem.len())
                    .map(DeviceConfig::Pmem)
                    .map_err(bad_request("vm.add-pmem"))
            }),
            VmmAction::AddDisk(body) => self.add_device("vm.add-disk", |c| {
                disk_config_from_json(&body, c.disks.len())
                    .map(DeviceConfig::Disk)
                    .map_err(bad_request("vm.add-disk"))
            }),
            VmmAction::AddVsock(body) => self.add_device("vm.add-vsock", |c| new_vsock(c, &body)),
            VmmAction::AddNet(body, fds) => self.add_device("vm.add-net", |c| {
                let n =
                    net_config_from_json(&body, c.net.len()).map_err(bad_request("vm.add-net"))?;
                n.with_fds(fds)
                    .map(DeviceConfig::Net)
                    .map_err(bad_request("vm.add-net"))
            }),
            VmmAction::RemoveDevice(id) => self.remove_device(&id),
            VmmAction::Resize(body) => self.resize(&body),
            VmmAction::Counters => Ok(VmmReply::Json(self.counters())),
            VmmAction::DaxStatus { window_stats } => {
                Ok(VmmReply::Dax(self.dax_status(window_stats)))
            }
            VmmAction::KvmCounters => Ok(VmmReply::Kvm(
                self.vm.as_ref().and_then(|vm| vm.kvm_counters()),
            )),
            VmmAction::Snapshot(body) => self.snapshot(&body),
            VmmAction::Restore(body, fds) => {
                let restore = restore_config_from_json(&body).map_err(bad_request("vm.restore"))?;
                // As Cloud Hypervisor: the fds must be those net_fds names.
                let taps = RestoreTaps::take(&restore.net_fds, fds)
                    .map_err(|e| ApiError::bad_request(format!("vm.restore: {e}")))?;
                self.restore("vm.restore", &restore, taps)?;
                Ok(VmmReply::NoContent)
            }
            VmmAction::SendMigration(body) => self.send_migration(&body),
            VmmAction::ReceiveMigration(body) => self.receive_migration(&body),
        }
    }

    /// `vm.send-migration`: hands the VM to the VMM listening on the
    /// body's socket; answered when done (Cloud Hypervisor v52's way). On
    /// success the loop ends after the answer; on failure the VM runs on
    /// (or stays paused) here.
    fn send_migration(&mut self, body: &Value) -> VmmResult {
        const ENDPOINT: &str = "vm.send-migration";
        let target = migration::send_migration_from_json(body)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        let (Some(config), Some(vm)) = (self.config.as_ref(), self.vm.as_mut()) else {
            return Err(ApiError::not_found(format!(
                "{ENDPOINT}: no VM is booted (it is {})",
                self.state.as_str()
            )));
        };
        migration::send_migration(vm, config, &target).map_err(|e| {
            ApiError::internal(format!(
                "{ENDPOINT}: the VM could not be migrated to {}: {}",
                target.url,
                error_chain(&e)
            ))
        })?;
        self.migrated = true;
        Ok(VmmReply::NoContent)
    }

    /// `vm.receive-migration`: into a VMM without a VM, waits for a sender
    /// on the body's socket and takes its VM; answered when it has arrived
    /// or the migration failed.
    fn receive_migration(&mut self, body: &Value) -> VmmResult {
        const ENDPOINT: &str = "vm.receive-migration";
        let source = migration::receive_migration_from_json(body)
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
        if self.config.is_some() {
            return Err(ApiError::internal(format!(
                "{ENDPOINT}: a VM is already created (it is {}): receive into a VMM without one",
                self.state.as_str()
            )));
        }
        let observe = self.observer();
        let received = migration::receive_migration(&source.url, Some(&observe)).map_err(|e| {
            ApiError::internal(format!(
                "{ENDPOINT}: no VM was received on {}: {}",
                source.url,
                error_chain(&e)
            ))
        })?;
        self.config = Some(received.config);
        self.vm = Some(received.vm);
        self.state = if received.paused {
            State::Paused
        } else {
            State::Running
        };
        Ok(VmmReply::NoContent)
    }

    /// `vm.snapshot`: writes a paused VM's state and memory to the
    /// directory the body names (as Cloud Hypervisor, only a paused VM: its
    /// vCPUs and devices stand still while they are saved).
    fn snapshot(&mut self, body: &Value) -> VmmResult {
        const ENDPOINT: &str = "vm.snapshot";
        let target = snapshot_config_from_json(body).map_err(bad_request(ENDPOINT))?;
        let Some(config) = self.config.as_ref() else {
            return Err(ApiError::not_found(format!("{ENDPOINT}: no VM is created")));
        };
        let vm = match (self.vm.as_mut(), self.state) {
            (Some(vm), State::Paused) => vm,
            (_, state) => return Err(ApiError::internal(not_snapshottable_in(state))),
        };
        let dir = &target.destination_dir;
        if !dir.is_dir() {
            return Err(ApiError::internal(format!(
                "{ENDPOINT}: destination_url: {} is not a directory",
                dir.display()
            )));
        }
        vm.check_snapshottable()
            .and_then(|()| vm.snapshot(config, dir))
            .map_err(|e| {
                ApiError::internal(format!(
                    "{ENDPOINT}: the VM could not be snapshotted to {}: {}",
                    dir.display(),
                    error_chain(&e)
                ))
            })?;
        Ok(VmmReply::NoContent)
    }

    /// Restores the VM a snapshot directory holds (`vm.restore`, or
    /// `--restore` at start: `what` names which). Only into a VMM without a
    /// VM; the VM comes back paused, and runs if `restore.resume` says so.
    /// `taps` are the net devices' new taps (`vm.restore`'s `net_fds`).
    pub fn restore(
        &mut self,
        what: &str,
        restore: &RestoreConfig,
        taps: RestoreTaps,
    ) -> Result<(), ApiError> {
        if self.config.is_some() {
            return Err(ApiError::internal(format!(
                "{what}: a VM is already created (it is {}): restore into a VMM without one (vm.delete it first)",
                self.state.as_str()
            )));
        }
        let dir = &restore.source_dir;
        if !dir.is_dir() {
            return Err(ApiError::internal(format!(
                "{what}: source_url: {} is not a directory",
                dir.display()
            )));
        }
        let observe = self.observer();
        let (config, vm) =
            Vm::restore(dir, restore.prefault, taps, Some(&observe)).map_err(|e| {
                ApiError::internal(format!(
                    "{what}: the VM could not be restored from {}: {}",
                    dir.display(),
                    error_chain(&e)
                ))
            })?;
        self.config = Some(config);
        self.vm = Some(vm);
        self.state = State::Paused;
        if restore.resume {
            self.resume().map_err(|e| {
                ApiError::internal(format!("{what}: restored, but not resumed: {}", e.message))
            })?;
        }
        Ok(())
    }

    /// `vm.create`: takes a configuration when there is none.
    fn create(&mut self, body: &Value) -> VmmResult {
        if self.config.is_some() {
            return Err(ApiError::conflict(
                "vm.create: a VM is already created (vm.delete it first)",
            ));
        }
        let config = vm_config_from_json(body)
            .map_err(|e| ApiError::bad_request(format!("vm.create: {e}")))?;
        self.config = Some(config);
        self.state = State::Created;
        Ok(VmmReply::NoContent)
    }

    /// `vm.boot`: boots a created VM that is not booted.
    fn boot_action(&mut self) -> VmmResult {
        match (&self.config, self.state) {
            (None, _) => Err(ApiError::conflict(
                "vm.boot: no VM is created (vm.create first)",
            )),
            (Some(_), State::Running | State::Paused) => Err(ApiError::conflict(format!(
                "vm.boot: the VM is already booted (it is {})",
                self.state.as_str()
            ))),
            (Some(_), _) => {
                self.boot()
                    .map_err(|e| ApiError::internal(format!("vm.boot: {e}")))?;
                Ok(VmmReply::NoContent)
            }
        }
    }

    /// `vm.info`: the configuration, the state and, booted, where the
    /// virtio-PCI devices are.
    fn info(&self) -> VmmResult {
        let config = self
            .config
            .as_ref()
            .ok_or_else(|| ApiError::conflict("vm.info: no VM is created"))?;
        let mut info = json!({
            "config": vm_config_to_json(config),
            "state": self.state.as_str(),
            "memory_actual_size": config.memory.size,
        });
        if let Some(vm) = self.vm.as_ref().filter(|_| self.booted()) {
            info["device_tree"] = device_tree(vm);
        }
        Ok(VmmReply::Json(info))
    }

    /// `vm.reboot`: stops the booted VM and boots it again.
    fn reboot(&mut self) -> VmmResult {
        if !self.booted() {
            return Err(self.not_running("vm.reboot"));
        }
        self.stop_vm();
        self.boot().map_err(|e| {
            ApiError::internal(format!(
                "vm.reboot: the VM stopped but did not boot again: {e}"
            ))
        })?;
        Ok(VmmReply::NoContent)
    }

    /// `vm.power-button`: only a running guest can see the press.
    fn power_button(&self) -> VmmResult {
        match (&self.vm, self.state) {
            (Some(vm), State::Running) => {
                vm.power_button()
                    .map_err(|e| ApiError::internal(format!("vm.power-button: {e}")))?;
                Ok(VmmReply::NoContent)
            }
            _ => Err(self.not_running("vm.power-button")),
        }
    }

    /// `vm.pause`: parks a running VM's vCPUs.
    fn pause(&mut self) -> VmmResult {
        match (&mut self.vm, self.state) {
            (Some(vm), State::Running) => {
                vm.pause();
                self.state = State::Paused;
                Ok(VmmReply::NoContent)
            }
            _ => Err(self.not_running("vm.pause")),
        }
    }

    /// `vm.resume`: runs a paused VM's vCPUs again.
    fn resume(&mut self) -> VmmResult {
        match (&mut self.vm, self.state) {
            (Some(vm), State::Paused) => {
                vm.resume();
                self.state = State::Running;
                Ok(VmmReply::NoContent)
            }
            _ => Err(ApiError::conflict(format!(
                "vm.resume: the VM is not paused (it is {})",
                self.state.as_str()
            ))),
        }
    }

    /// `vm.counters`: Cloud Hypervisor's shape, `{"<device id>":
    /// {"<counter>": u64}}`; disks and NICs with Cloud Hypervisor's names,
    /// fs devices with their DAX window's.
    fn counters(&self) -> Value {
        let mut out = serde_json::Map::new();
        for (id, counters) in self.vm.iter().flat_map(|vm| vm.device_counters()) {
            let values: serde_json::Map<String, Value> = counters
                .snapshot()
                .into_iter()
                .map(|(name, v)| (name.to_string(), Value::from(v)))
                .collect();
            out.insert(id.clone(), Value::Object(values));
        }
        for info in self.vm.iter().flat_map(|vm| vm.fs_devices()) {
            let Some(s) = info.window.as_ref().map(|w| w.metrics.snapshot()) else {
                continue;
            };
            let failures: u64 = s.failures.iter().map(|(_, n)| n).sum();
            out.insert(
                info.id.clone(),
                json!({
                    "dax_maps": s.maps, "dax_unmaps": s.unmaps, "dax_resets": s.resets,
                    "dax_bytes_mapped": s.bytes_mapped, "dax_failures": failures,
                }),
            );
        }
        Value::Object(out)
    }

    fn dax_status(&self, with_window_stats: bool) -> Vec<FsDaxStatus> {
        let window_location = |i: &FsDeviceInfo| {
            let w = i.window.as_ref()?;
            let gpa = w.guest_base();
            (gpa != 0).then(|| api::WindowLocation {
                gpa,
                size: w.size(),
            })
        };
        let running: &[FsDeviceInfo] = self.vm.as_ref().map_or(&[], |vm| vm.fs_devices());
        self.config
            .iter()
            .flat_map(|c| &c.fs)
            .map(|f| {
                let info = running.iter().find(|i| i.id == f.id);
                FsDaxStatus {
                    id: f.id.clone(),
                    control_socket: f.effective_control_socket(),
                    window: info.filter(|_| with_window_stats).and_then(window_stats),
                    window_location: info.and_then(window_location),
                    failed: info
                        .is_some_and(|i| i.failed.load(std::sync::atomic::Ordering::SeqCst)),
                    configured_policy: f.dax_policy.clone(),
                }
            })
            .collect()
    }
}

#[cfg(test)]
#[path = "control_loop_tests.rs"]
mod tests;
