//! The receiving side of a migration: a state machine over the
//! sender's requests, answering each with exactly one response (Cloud
//! Hypervisor's `vm_receive_migration_step` order). `Abandon` is answered
//! Ok at any point and ends the migration with nothing kept; any failing
//! step is answered `Error` and ends it the same way (the sender only
//! learns that the receiver reported an error; the reason is logged here).
//!
//! A local migration's VM is built over the received memory fds (no
//! copy): the fds are checked against the layout `Config` brings and
//! mapped then. Without fds (a pre-copy), `Config` makes fresh RAM of that
//! layout and each `Memory` request writes into it (and maps what it wrote
//! for the guest, while the guest still runs on the sender). Either way
//! the VM is built from `State` as a restore builds it, paused;
//! `Complete` resumes it (`CompletePaused` leaves it paused).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;

use vm_state::protocol::{self, Command, FdLabel, ProtocolError, Request, Response};
use vm_state::StateDocument;

use super::channel::{Channel, MigrationUrl};
use super::ram_stream::{receive_ranges, RAM_RESENDS};
use super::{MigrationConfig, MigrationError, CONFIG_FORMAT, CONFIG_VERSION};
use crate::config::json::vm_config_from_json;
use crate::config::{PassedFd, TapFds, VmConfig};
use crate::device_manager::ObserverFactory;
use crate::memory::migration_fds::{MemoryFdError, ReceivedMemoryFds};
use crate::memory::snapshot::{
    join_regions, restore_guest_memory_parts, MemoryLayoutState, RegionOrigin, RestoredRam,
};
use crate::snapshot::{state_error, RestoredBase, SnapshotError, MEMORY_SECTION};
use crate::step_times::StepTimes;
use crate::vm::{Vm, VmBase};
use virtio_devices::block::DiskFile;
use virtio_devices::vsock::socket_path;

/// `WindowFd`s, `TapFd`s, `DiskFd`s and `VsockFd`s one migration may pass
/// in all: a DAX window of
/// 1 GiB holds at most 512 ranges of 2 MiB, so this leaves room for
/// several large windows while bounding what a sender makes us hold.
pub const MAX_PASSED_FDS: usize = 4096;

/// The migrated VM, built and (unless the sender was paused) running.
pub struct Received {
    pub config: VmConfig,
    pub vm: Vm,
    /// The sender's VM was paused: this one stays paused.
    pub paused: bool,
}

/// Listens at `url` (a unix socket path must not exist), takes one
/// sender (waiting at most [`super::ACCEPT_TIMEOUT`]) and receives the VM.
/// Err when the migration failed or was abandoned: nothing of it is kept.
pub fn receive_migration(
    url: &MigrationUrl,
    observe: Option<&ObserverFactory>,
) -> Result<Received, MigrationError> {
    let channel = Channel::accept(url)?;
    receive_over(&channel, observe)
}

/// The receive loop over a connected socket (its timeouts set).
pub(crate) fn receive_over(
    socket: &Channel,
    observe: Option<&ObserverFactory>,
) -> Result<Received, MigrationError> {
    let mut receiver = Receiver {
        socket,
        observe,
        phase: Phase::Established,
        memory_fds: ReceivedMemoryFds::default(),
        window_fds: BTreeMap::new(),
        tap_fds: BTreeMap::new(),
        disk_fds: BTreeMap::new(),
        vsock_fd: None,
        passed: 0,
        configured: None,
        restored: None,
    };
    loop {
        let request = match Request::read_from(&mut &*socket) {
            Ok(r) => r,
            Err(e) => {
                // A header we refuse still gets its answer; a closed or
                // silent socket cannot.
                if matches!(
                    e,
                    ProtocolError::UnknownCommand(_) | ProtocolError::BadLength { .. }
                ) {
                    let _ = Response::error().write_to(&mut &*socket);
                }
                tracing::error!("migration receive: {e}");
                return Err(e.into());
            }
        };
        if request.command() == Command::Abandon {
            Response::ok().write_to(&mut &*socket)?;
            tracing::warn!("migration receive: the sender abandoned it; nothing kept");
            return Err(MigrationError::Abandoned);
        }
        match receiver.step(&request) {
            Ok(done) => {
                Response::ok().write_to(&mut &*socket)?;
                if let Some(received) = done {
                    return Ok(received);
                }
            }
            Err(e) => {
                tracing::error!("migration receive: {:?}: {e}", request.command());
                // The sender's operator hears why too.
                let _ = Response::write_error_with_reason(&mut &*socket, &e.to_string());
                return Err(e);
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Established,
    Started,
    Configured,
    Restored,
}

impl Phase {
    fn when(self) -> &'static str {
        match self {
            Phase::Established => "before Start",
            Phase::Started => "before Config",
            Phase::Configured => "after Config (State must come)",
            Phase::Restored => "after State (Complete must come)",
        }
    }
}

/// What `Config` brought: the configuration, and the KVM VM on guest RAM
/// mapped from the received fds as laid out, that RAM already mapped for
/// the guest (made while the guest still runs on the sender).
struct Configured {
    config: VmConfig,
    layout: MemoryLayoutState,
    built: RestoredBase,
    /// Fresh RAM that `Memory` requests fill (a pre-copy): all of it, boot
    /// and hot-plugged, one view of the same mappings. None in a local
    /// migration, whose RAM came as fds.
    incoming: Option<crate::memory::GuestMemoryMmap>,
    /// Bytes of RAM `Memory` requests may still bring.
    ram_budget: u64,
}

struct Receiver<'a> {
    socket: &'a Channel,
    observe: Option<&'a ObserverFactory>,
    phase: Phase,
    memory_fds: ReceivedMemoryFds,
    /// `WindowFd`s by device, then by `(st_dev, st_ino)`.
    window_fds: BTreeMap<String, HashMap<(u64, u64), File>>,
    tap_fds: BTreeMap<String, OwnedFd>,
    /// Each blk device's open image, by device id.
    disk_fds: BTreeMap<String, OwnedFd>,
    /// The vsock device's listener, with its device id.
    vsock_fd: Option<(String, OwnedFd)>,
    /// Fds passed so far (but the memory fds).
    passed: usize,
    configured: Option<Configured>,
    restored: Option<(VmConfig, Vm)>,
}

impl Receiver<'_> {
    /// One request (its header read): Ok(Some) once the VM is complete.
    fn step(&mut self, request: &Request) -> Result<Option<Received>, MigrationError> {
        let command = request.command();
        let unexpected = MigrationError::Unexpected {
            command,
            when: self.phase.when(),
        };
        match (command, self.phase) {
            (Command::Start, Phase::Established) => {
                request.sender_protocol_version()?;
                self.phase = Phase::Started;
            }
            (Command::MemoryFd, Phase::Started) => {
                let socket = self.socket.unix().ok_or_else(|| {
                    MigrationError::NotOverThisChannel(
                        "MemoryFd passes an fd, which only a unix: socket carries".to_string(),
                    )
                })?;
                self.memory_fds.receive(socket, request)?;
            }
            (Command::Memory, Phase::Configured) => {
                let Some(configured) = self.configured.as_mut() else {
                    return Err(unexpected);
                };
                let Some(mem) = configured.incoming.as_ref() else {
                    return Err(MigrationError::Unexpected {
                        command,
                        when: "in a local migration (its RAM came as fds)",
                    });
                };
                let ranges =
                    receive_ranges(&mut &*self.socket, request, mem, &mut configured.ram_budget)?;
                configured
                    .built
                    .base
                    .prefault_ranges(ranges.iter().map(|r| (r.gpa, r.length)));
            }
            (
                Command::WindowFd | Command::TapFd | Command::DiskFd | Command::VsockFd,
                Phase::Started,
            ) => self.passed_fd(request)?,
            (Command::Config, Phase::Started) => {
                let payload = protocol::read_payload(&mut &*self.socket, request)?;
                self.configured = Some(self.config(&payload)?);
                self.phase = Phase::Configured;
            }
            (Command::State, Phase::Configured) => {
                let mut took = StepTimes::start();
                let payload = protocol::read_payload(&mut &*self.socket, request)?;
                took.step("read");
                self.restored = Some(self.state(&payload)?);
                took.step("restore");
                tracing::info!(
                    "migration receive: State of {} bytes taken in {took}",
                    payload.len()
                );
                self.phase = Phase::Restored;
            }
            (Command::Complete | Command::CompletePaused, Phase::Restored) => {
                let Some((config, mut vm)) = self.restored.take() else {
                    return Err(unexpected);
                };
                let paused = command == Command::CompletePaused;
                // The VM is this VMM's now, and so is the vsock socket's
                // name: removed when the device goes. Until here a failed
                // migration left it to the sender, whose listener it is.
                if let Some(name) = vm.devices.vsock_socket_name() {
                    name.claim();
                }
                let mut took = StepTimes::start();
                if !paused {
                    vm.resume();
                }
                took.step("resume");
                tracing::info!(
                    "migration received: the VM {} ({took})",
                    if paused { "is paused" } else { "runs" }
                );
                return Ok(Some(Received { config, vm, paused }));
            }
            (Command::PageFault, _) => return Err(MigrationError::NotTaken(command)),
            _ => return Err(unexpected),
        }
        Ok(None)
    }

    /// The unix socket a command that passes an fd needs.
    fn unix_socket(
        &self,
        command: Command,
    ) -> Result<&std::os::unix::net::UnixStream, MigrationError> {
        self.socket.unix().ok_or_else(|| {
            MigrationError::NotOverThisChannel(format!(
                "{command:?} passes an fd, which only a unix: socket carries"
            ))
        })
    }

    /// A `WindowFd`, `TapFd`, `DiskFd` or `VsockFd`: kept by device (and
    /// file key) until the device that takes it is restored.
    fn passed_fd(&mut self, request: &Request) -> Result<(), MigrationError> {
        let command = request.command();
        let (payload, fd) = protocol::recv_payload_with_fd(self.unix_socket(command)?, request)?;
        let label = FdLabel::decode(command, &payload)?;
        let bad = |reason: &str| MigrationError::PassedFd {
            label: format!("{command:?} for {}", label.device),
            reason: reason.to_string(),
        };
        if self.passed >= MAX_PASSED_FDS {
            return Err(bad(&format!("more than {MAX_PASSED_FDS} fds passed")));
        }
        match (command, label.key) {
            (Command::WindowFd, Some([dev, ino])) => {
                let files = self.window_fds.entry(label.device.clone()).or_default();
                if files.insert((dev, ino), File::from(fd)).is_some() {
                    return Err(bad(&format!("file ({dev}, {ino}) passed twice")));
                }
            }
            (Command::DiskFd, _) => {
                if self.disk_fds.insert(label.device.clone(), fd).is_some() {
                    return Err(bad("a second image for the device"));
                }
            }
            (Command::VsockFd, _) => {
                if let Some((first, _)) = &self.vsock_fd {
                    return Err(bad(&format!(
                        "a second vsock listener (the first was for {first})"
                    )));
                }
                self.vsock_fd = Some((label.device.clone(), fd));
            }
            _ => {
                if self.tap_fds.insert(label.device.clone(), fd).is_some() {
                    return Err(bad("a second tap for the device"));
                }
            }
        }
        self.passed += 1;
        Ok(())
    }

    /// `Config`: our format and version, a configuration that checks out,
    /// and guest RAM mapped from the received fds as the layout says.
    fn config(&mut self, payload: &[u8]) -> Result<Configured, MigrationError> {
        let value: serde_json::Value = serde_json::from_slice(payload)
            .map_err(|e| MigrationError::Config(format!("not JSON: {e}")))?;
        let format = value.get("format").and_then(serde_json::Value::as_str);
        if format != Some(CONFIG_FORMAT) {
            return Err(MigrationError::Config(format!(
                "format {format:?} is not {CONFIG_FORMAT:?}: the sender is not a dax-vmm VMM, whose state this VMM could not restore"
            )));
        }
        let c: MigrationConfig =
            serde_json::from_value(value).map_err(|e| MigrationError::Config(e.to_string()))?;
        if c.version != CONFIG_VERSION {
            return Err(MigrationError::Config(format!(
                "version {} is not {CONFIG_VERSION}, the one this VMM reads",
                c.version
            )));
        }
        let config = vm_config_from_json(&c.vm_config)
            .map_err(|e| MigrationError::Config(format!("vm_config: {e}")))?;
        if self.memory_fds.is_empty() {
            // A pre-copy: fresh RAM of the sender's layout, filled by
            // `Memory` requests; it is mapped for the guest as it comes.
            let ram = restore_guest_memory_parts(&config.memory, &c.memory)
                .map_err(|e| MigrationError::Ram(e.to_string()))?;
            let incoming = join_regions(ram.boot.clone(), &ram.hotplugged)
                .map_err(|e| MigrationError::Ram(e.to_string()))?;
            let base = VmBase::new(&config, ram.boot).map_err(MigrationError::Prepare)?;
            let ram_budget = c
                .memory
                .regions
                .iter()
                .fold(0u64, |sum, r| sum.saturating_add(r.length))
                .saturating_mul(RAM_RESENDS);
            return Ok(Configured {
                config,
                layout: c.memory,
                built: RestoredBase {
                    base,
                    hotplugged: ram.hotplugged,
                },
                ram_budget,
                incoming: Some(incoming),
            });
        }
        let fds = std::mem::take(&mut self.memory_fds);
        let ram = split_ram(fds.into_guest_memory(&c.memory)?, &c.memory)?;
        let base = VmBase::new(&config, ram.boot).map_err(MigrationError::Prepare)?;
        base.prefault_resident();
        Ok(Configured {
            config,
            layout: c.memory,
            built: RestoredBase {
                base,
                hotplugged: ram.hotplugged,
            },
            incoming: None,
            ram_budget: 0,
        })
    }

    /// `State`: the VM built over the mapped RAM and restored, paused.
    fn state(&mut self, payload: &[u8]) -> Result<(VmConfig, Vm), MigrationError> {
        // Each fs device takes the files of its window, by id; one for a
        // device the configuration lacks is refused by name.
        if let Some(device) = self.window_fds.keys().find(|d| {
            self.configured
                .as_ref()
                .is_some_and(|c| !c.config.fs.iter().any(|f| &&f.id == d))
        }) {
            return Err(MigrationError::PassedFd {
                label: format!("WindowFd for {device}"),
                reason: "the configuration has no fs device of that id".to_string(),
            });
        }
        let window_files = std::mem::take(&mut self.window_fds);
        let doc =
            StateDocument::from_json(payload).map_err(|e| MigrationError::State(state_error(e)))?;
        let Some(Configured {
            mut config,
            layout,
            built,
            incoming: _,
            ram_budget: _,
        }) = self.configured.take()
        else {
            return Err(MigrationError::Unexpected {
                command: Command::State,
                when: Phase::Started.when(),
            });
        };
        // Each net device is built on the tap the sender passed (it
        // cannot be opened by name while the sender holds it).
        for (device, fd) in std::mem::take(&mut self.tap_fds) {
            let net = config
                .net
                .iter_mut()
                .find(|n| n.id == device)
                .ok_or_else(|| MigrationError::PassedFd {
                    label: format!("TapFd for {device}"),
                    reason: "the configuration has no net device of that id".to_string(),
                })?;
            net.fds = TapFds(std::sync::Arc::new(vec![fd]));
            net.fds_from_migration = true;
        }
        take_host_fds(
            &mut config,
            std::mem::take(&mut self.disk_fds),
            self.vsock_fd.take(),
        )?;
        let vm = Vm::restore_document(
            &mut config,
            doc,
            |_, saved| {
                if saved.regions != layout.regions {
                    return Err(SnapshotError::Section {
                        section: MEMORY_SECTION.to_string(),
                        reason: "regions differ from those Config laid out".to_string(),
                    });
                }
                Ok(built)
            },
            self.observe,
            window_files,
        )
        .map_err(MigrationError::State)?;
        // Each net device holds its own copy of its passed tap: the
        // configuration's would keep the tap attached after the device let
        // go of it at a later migration's switch.
        for net in config.net.iter_mut().filter(|n| n.fds_from_migration) {
            net.fds = TapFds::default();
        }
        Ok((config, vm))
    }
}

/// Each blk device is built on the image the sender passed (its lock
/// with it: a writable image the sender holds could not be locked
/// again), the vsock device on the listener (its path cannot be bound
/// twice), each once checked to be what the device would have opened
/// or bound itself: the sender is not trusted to pass the right one.
/// One for a device the configuration lacks is refused by name.
pub(crate) fn take_host_fds(
    config: &mut VmConfig,
    disk_fds: BTreeMap<String, OwnedFd>,
    vsock_fd: Option<(String, OwnedFd)>,
) -> Result<(), MigrationError> {
    for (device, fd) in disk_fds {
        let bad = |reason: String| MigrationError::PassedFd {
            label: format!("DiskFd for {device}"),
            reason,
        };
        let disk = config
            .disks
            .iter_mut()
            .find(|d| d.id == device)
            .ok_or_else(|| bad("the configuration has no disk of that id".to_string()))?;
        let file = File::from(fd);
        DiskFile::check_passed(&disk.path, &file, disk.readonly, disk.direct)
            .map_err(|e| bad(e.to_string()))?;
        disk.passed_file = PassedFd::new(file.into());
    }
    if let Some((device, fd)) = vsock_fd {
        let bad = |reason: String| MigrationError::PassedFd {
            label: format!("VsockFd for {device}"),
            reason,
        };
        let vsock = config
            .vsock
            .as_mut()
            .filter(|v| v.id == device)
            .ok_or_else(|| bad("the configuration has no vsock device of that id".to_string()))?;
        let listener = UnixListener::from(fd);
        socket_path::check_passed(&vsock.socket, &listener).map_err(|e| bad(e.to_string()))?;
        vsock.passed_listener = PassedFd::new(listener.into());
    }
    Ok(())
}

/// All of guest RAM as boot RAM and the hot-plugged regions a VM is
/// built from (the same mappings).
fn split_ram(
    mut mem: crate::memory::GuestMemoryMmap,
    layout: &MemoryLayoutState,
) -> Result<RestoredRam, MigrationError> {
    let mut hotplugged = Vec::new();
    for r in layout
        .regions
        .iter()
        .filter(|r| r.origin == RegionOrigin::Hotplug)
    {
        let (rest, region) = mem
            .remove_region(vm_memory::GuestAddress(r.gpa), r.length)
            .map_err(|e| MemoryFdError::Map(format!("region at {:#x}: {e}", r.gpa)))?;
        mem = rest;
        hotplugged.push(region);
    }
    Ok(RestoredRam {
        boot: mem,
        hotplugged,
    })
}
