//! The sending side of a pre-copy live migration: guest RAM goes through
//! the stream while the guest runs, with KVM's dirty log, the VMM's own
//! devices' bitmap and the vhost-user daemons' log telling which pages
//! changed meanwhile ([`DirtyLog`]). Each round sends what the last one
//! left dirty and measures the link; once what is left would go within
//! the downtime target, the guest is paused, the rest and the state go,
//! and the receiver resumes it.
//!
//! Rounds are bounded ([`MAX_ROUNDS`]) and so is the whole pre-copy
//! (`timeout_s`): a guest that writes faster than the link carries fails
//! the migration (`timeout_strategy=cancel`, the default) or is paused
//! for a longer downtime (`ignore`). Any failure before the receiver
//! took the VM leaves it running here, with everything it had: the
//! daemons keep serving it (the receiver's are others, on its host), and
//! what the devices let go of for the switch (disk locks, taps opened by
//! name, the vsock socket) is taken back.

use std::time::{Duration, Instant};

use vm_state::protocol::{Command, Request};

use super::channel::Channel;
use super::exchange::{abandon, expect_ok, send_config, send_state_and_complete};
use super::ram_stream::{data_ranges, dirty_ranges, send_ranges, total, union};
use super::{MigrationError, SendMigration};
use crate::config::VmConfig;
use crate::device_manager::state::SwitchRelease;
use crate::memory::dirty_log::DirtyLog;
use crate::memory::snapshot::join_regions;
use crate::step_times::StepTimes;
use crate::vm::Vm;

/// Rounds of dirty pages sent at most before the guest is paused (or the
/// migration given up): a guest that dirties RAM as fast as the link
/// carries it never converges, and more rounds only cost time.
pub const MAX_ROUNDS: u32 = 30;

/// What to do when the pre-copy runs out of rounds or time before what is
/// left fits the downtime target (Cloud Hypervisor's `timeout_strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimeoutStrategy {
    /// Fail the migration; the VM runs on here.
    Cancel,
    /// Pause anyway and send the rest: a longer downtime.
    Ignore,
}

/// The bounds of one pre-copy (`downtime_ms`, `timeout_s`,
/// `timeout_strategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrecopyLimits {
    pub downtime: Duration,
    pub timeout: Duration,
    pub strategy: TimeoutStrategy,
}

/// A pre-copy migration of `vm` to `target`. Ok: the receiver runs the VM
/// and this one is paused, for the caller to drop. Err: the VM runs here
/// again if it ran before.
pub(super) fn send_precopy(
    vm: &mut Vm,
    config: &VmConfig,
    target: &SendMigration,
) -> Result<(), MigrationError> {
    vm.check_snapshottable()
        .map_err(MigrationError::NotMovable)?;
    check_taps(config)?;
    // Refused by name before anything goes when a daemon cannot log its
    // writes; logging from before the first page is read.
    let mut log = DirtyLog::start(vm)?;
    let channel = Channel::connect(&target.url)?;
    let was_paused = vm.vcpus.paused();
    let mut released = None;
    let result = precopy_steps(
        vm,
        config,
        target,
        &channel,
        &mut log,
        was_paused,
        &mut released,
    );
    if let Err(e) = &result {
        abandon(&channel);
        // Stop logging before the guest runs again: its writes need not be
        // tracked any more.
        drop(log);
        // Before the resume: a net device resumes only with its tap back.
        if let Some(released) = released.take() {
            if let Err(reclaim) = vm.reclaim_after_switch(released) {
                tracing::error!("migration failed ({e}); taking back: {reclaim}");
            }
        }
        if !was_paused && vm.vcpus.paused() {
            tracing::warn!("migration failed ({e}); the VM runs again here");
            vm.resume();
        }
    }
    result
}

/// A net device on taps the operator passed as fds (`fds=`, `net_fds`,
/// Kata's way) cannot move to a VMM that is not given them: its receiver
/// would make a tap of its own, cut off from the network the passed one
/// is part of. Refused by name before anything goes.
pub(super) fn check_taps(config: &VmConfig) -> Result<(), MigrationError> {
    match config
        .net
        .iter()
        .find(|n| !n.fds.is_empty() && !n.fds_from_migration)
    {
        Some(n) => Err(MigrationError::NotOverThisChannel(format!(
            "net {}: its tap was passed as file descriptors (fds=, net_fds), which a receiving VMM cannot be given over this stream; migrate it locally (local=on) or give the device a tap by name (tap=NAME)",
            n.id
        ))),
        None => Ok(()),
    }
}

/// The rate a round's copy achieved (`sent` bytes in `elapsed`, in bytes
/// per second, at least 1) and how long `left` bytes take at that rate.
/// A round too short to measure counts as one millisecond, so its rate is
/// a lower bound rather than a division by zero.
pub(super) fn rate_and_estimate(sent: u64, elapsed: Duration, left: u64) -> (u64, Duration) {
    let ms = u64::try_from(elapsed.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    let rate = (sent.saturating_mul(1000) / ms).max(1);
    let estimate = Duration::from_millis(left.saturating_mul(1000) / rate);
    (rate, estimate)
}

fn precopy_steps(
    vm: &mut Vm,
    config: &VmConfig,
    target: &SendMigration,
    channel: &Channel,
    log: &mut DirtyLog,
    was_paused: bool,
    released: &mut Option<SwitchRelease>,
) -> Result<(), MigrationError> {
    let started = Instant::now();
    let layout = vm
        .memory_layout()
        .map_err(|e| MigrationError::NotMovable(e.into()))?;
    Request::start().write_to(&mut &*channel)?;
    expect_ok(channel, Command::Start)?;
    send_config(channel, config, &layout)?;

    let mem = join_regions(vm.mem.clone(), &vm.hotplugged_ram)
        .map_err(|e| MigrationError::NotMovable(e.into()))?;
    let limits = target.limits;
    let mut ranges = data_ranges(&mem);
    let mut round = 0u32;
    let mut sent_total = 0u64;
    loop {
        let took = Instant::now();
        let sent = send_ranges(channel, &mem, &ranges)?;
        sent_total = sent_total.saturating_add(sent);
        let elapsed = took.elapsed();
        round += 1;
        ranges = dirty_ranges(&log.collect()?, &mem);
        let left = total(&ranges);
        let (rate, estimate) = rate_and_estimate(sent, elapsed, left);
        tracing::info!(
            "migration pre-copy round {round}: {} KiB sent in {} ms; {} KiB dirty, {} ms at this rate",
            sent >> 10,
            elapsed.as_millis(),
            left >> 10,
            estimate.as_millis()
        );
        if estimate <= limits.downtime {
            break;
        }
        let out_of = if round >= MAX_ROUNDS {
            Some(format!("{MAX_ROUNDS} rounds"))
        } else if started.elapsed() >= limits.timeout {
            Some(format!("timeout_s={}", limits.timeout.as_secs()))
        } else {
            None
        };
        if let Some(out_of) = out_of {
            let why = format!(
                "after {out_of}, {} KiB of guest RAM are still dirty: at the {} KiB/s the link carried, {} ms of downtime, above downtime_ms={}; the guest writes faster than the link carries",
                left >> 10,
                rate >> 10,
                estimate.as_millis(),
                limits.downtime.as_millis()
            );
            match limits.strategy {
                TimeoutStrategy::Cancel => {
                    return Err(MigrationError::DidNotConverge(format!(
                        "{why} (timeout_strategy=ignore would pause it for that long)"
                    )))
                }
                TimeoutStrategy::Ignore => {
                    tracing::warn!("migration: {why}; pausing it anyway (timeout_strategy=ignore)");
                    break;
                }
            }
        }
    }

    // The downtime starts here.
    let mut downtime = StepTimes::start();
    if !was_paused {
        vm.pause();
    }
    downtime.step("pause");
    let doc = vm.state_document(config).map_err(MigrationError::Save)?;
    downtime.step("save");
    // The devices are stopped: nothing writes RAM any more.
    // What the last round left dirty, and what was written since.
    let last = union(ranges, dirty_ranges(&log.collect()?, &mem));
    let last_bytes = send_ranges(channel, &mem, &last)?;
    sent_total = sent_total.saturating_add(last_bytes);
    downtime.step("last pages");
    // The receiver opens the disks (their locks), the taps by name and
    // the vsock socket itself.
    *released = Some(vm.release_for_switch().map_err(MigrationError::Save)?);
    downtime.step("release");
    let state_len = send_state_and_complete(channel, doc, &layout, was_paused, &mut downtime)?;
    // The receiver has the VM: nothing is taken back.
    *released = None;
    tracing::info!(
        "migration complete after {round} pre-copy rounds and {} KiB in {} ms: the VM is the receiving VMM's now; paused here {downtime} ({} KiB in the last pages), State {} bytes",
        sent_total >> 10,
        started.elapsed().as_millis(),
        last_bytes >> 10,
        state_len
    );
    Ok(())
}
