//! The sending side of a local migration: everything is checked before the
//! VM is paused; the memory fds, the DAX windows' files, the taps, the
//! disks' open images (with their locks), the vsock's listening socket and
//! the configuration go while the guest still runs (they are copies of
//! this VMM's fds: should the migration fail, it still holds them all); the guest is paused (the
//! downtime starts) only for the state. On any failure before the
//! receiver answered `Complete`, the VM is resumed if it was running and
//! the error returned; on success it stays paused, for the caller to drop.

use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;

use vm_state::protocol::{self, Command, FdLabel, Request};

use super::channel::Channel;
use super::exchange::{abandon, expect_ok, send_config, send_state_and_complete};
use super::{MigrationError, SendMigration};
use crate::config::VmConfig;
use crate::memory::migration_fds::send_memory_fds;
use crate::memory::snapshot::{join_regions, MemoryLayoutState};
use crate::step_times::StepTimes;
use crate::vm::Vm;

/// Migrates `vm` (configured as `config`) to the receiver `target`
/// names: a local migration or a pre-copy. Ok: the receiver has the VM
/// (running, or paused if this one was paused) and this one is left
/// paused for the caller to drop. Err: this VM runs again if it ran
/// before.
pub fn send_migration(
    vm: &mut Vm,
    config: &VmConfig,
    target: &SendMigration,
) -> Result<(), MigrationError> {
    if !target.local {
        return super::precopy::send_precopy(vm, config, target);
    }
    let layout = check_local(vm)?;
    let channel = Channel::connect(&target.url)?;
    send_over(vm, config, &layout, &channel)
}

/// What a local migration requires, checked before anything is sent or
/// paused: every part of the VM can be saved, and guest RAM is shared (a
/// memfd to pass). Returns RAM's layout.
pub(crate) fn check_local(vm: &Vm) -> Result<MemoryLayoutState, MigrationError> {
    vm.check_snapshottable()
        .map_err(MigrationError::NotMovable)?;
    let layout = vm
        .memory_layout()
        .map_err(|e| MigrationError::NotMovable(e.into()))?;
    if let Some(r) = layout.regions.iter().find(|r| r.file_offset.is_none()) {
        return Err(MigrationError::NotShared { gpa: r.gpa });
    }
    Ok(layout)
}

/// The whole local sequence over a connected unix socket (its timeouts
/// set).
pub(crate) fn send_over(
    vm: &mut Vm,
    config: &VmConfig,
    layout: &MemoryLayoutState,
    channel: &Channel,
) -> Result<(), MigrationError> {
    let was_paused = vm.vcpus.paused();
    let result = match channel.unix() {
        Some(socket) => send_steps(vm, config, layout, socket, channel, was_paused),
        None => Err(MigrationError::NotOverThisChannel(
            "local=on passes fds, which only a unix: socket carries".to_string(),
        )),
    };
    if let Err(e) = &result {
        if !was_paused && vm.vcpus.paused() {
            tracing::warn!("migration failed ({e}); the VM runs again here");
            vm.resume();
        }
        // Tell a receiver still listening that this is over; it may be
        // gone already, which is no further error.
        abandon(channel);
    }
    result
}

fn send_steps(
    vm: &mut Vm,
    config: &VmConfig,
    layout: &MemoryLayoutState,
    socket: &UnixStream,
    channel: &Channel,
    was_paused: bool,
) -> Result<(), MigrationError> {
    Request::start().write_to(&mut &*channel)?;
    expect_ok(channel, Command::Start)?;

    let all_ram = join_regions(vm.mem.clone(), &vm.hotplugged_ram)
        .map_err(|e| MigrationError::NotMovable(e.into()))?;
    send_memory_fds(socket, layout, &all_ram)?;
    send_window_fds(vm, socket, channel)?;
    send_tap_fds(vm, socket, channel)?;
    send_host_fds(vm, socket, channel)?;
    send_config(channel, config, layout)?;

    // The downtime starts here.
    let mut downtime = StepTimes::start();
    if !was_paused {
        vm.pause();
    }
    downtime.step("pause");
    let doc = vm.state_document(config).map_err(MigrationError::Save)?;
    downtime.step("save");
    // As Cloud Hypervisor does once the state is saved: the fs devices let
    // go of their daemons (each serves one VMM), so that a fresh daemon on
    // the same socket path can serve the receiving VMM. Should the
    // migration fail after this, the VM runs on here without its shares.
    vm.release_backends();
    downtime.step("release");
    let state_len = send_state_and_complete(channel, doc, layout, was_paused, &mut downtime)?;
    tracing::info!(
        "migration complete: the VM is the receiving VMM's now; paused here {downtime}, State {state_len} bytes"
    );
    Ok(())
}

/// One `WindowFd` per distinct file mapped in each fs device's DAX window:
/// the receiver maps the window again from them without the daemon.
fn send_window_fds(vm: &Vm, socket: &UnixStream, channel: &Channel) -> Result<(), MigrationError> {
    for info in vm.devices.fs_devices() {
        let Some(window) = &info.window else { continue };
        let files = window
            .mapped_files_by_key()
            .map_err(|e| MigrationError::PassedFd {
                label: format!("WindowFd for {}", info.id),
                reason: e.to_string(),
            })?;
        let mut files: Vec<_> = files.into_iter().collect();
        files.sort_by_key(|(key, _)| *key);
        for ((dev, ino), file) in files {
            let label = FdLabel {
                device: info.id.clone(),
                key: Some([dev, ino]),
            };
            protocol::send_request_with_fd(
                socket,
                Command::WindowFd,
                &label.encode(),
                file.as_fd(),
            )?;
            expect_ok(channel, Command::WindowFd)?;
        }
    }
    Ok(())
}

/// One `TapFd` per net device: our tap is single-queue, so the receiver
/// cannot open it by name while this VMM holds it; it builds the device on
/// this fd instead.
fn send_tap_fds(vm: &Vm, socket: &UnixStream, channel: &Channel) -> Result<(), MigrationError> {
    for (id, fd) in vm.devices.net_taps() {
        let label = FdLabel {
            device: id.to_string(),
            key: None,
        };
        protocol::send_request_with_fd(socket, Command::TapFd, &label.encode(), fd)?;
        expect_ok(channel, Command::TapFd)?;
    }
    Ok(())
}

/// One `DiskFd` per blk device (its open image: the exclusive lock of a
/// writable one goes with the open file description, so the image is
/// never unlocked on the way) and one `VsockFd` for the vsock device (its
/// listener: host clients keep connecting to the same socket, which this
/// VMM never unlinks). The receiver builds the devices on them.
fn send_host_fds(vm: &Vm, socket: &UnixStream, channel: &Channel) -> Result<(), MigrationError> {
    let disks = vm
        .devices
        .disk_images()
        .map(|(id, fd)| (Command::DiskFd, id, fd));
    let vsock = vm
        .devices
        .vsock_listener()
        .map(|(id, fd)| (Command::VsockFd, id, fd));
    for (command, id, fd) in disks.chain(vsock) {
        let label = FdLabel {
            device: id.to_string(),
            key: None,
        };
        protocol::send_request_with_fd(socket, command, &label.encode(), fd)?;
        expect_ok(channel, command)?;
    }
    Ok(())
}
