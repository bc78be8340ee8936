//! Guest RAM as the daemon sees it: the memory table sent at activation,
//! and RAM added while the guest runs (ACPI memory hot-plug).
//!
//! The daemon must map every RAM region the guest can put a buffer in, so
//! a region added after activation reaches it before the guest is told of
//! the new RAM: with `CONFIGURE_MEM_SLOTS` as one `ADD_MEM_REG`, otherwise
//! as a whole new `SET_MEM_TABLE`. A memory table of more than
//! [`BASELINE_REGIONS`] regions goes as a `SET_MEM_TABLE` of the first ones
//! plus an `ADD_MEM_REG` for each other (backends built on libvhost-user
//! take no more than 8 in one message).

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use vhost::vhost_user::message::{VhostUserHeaderFlag, VhostUserVirtioFeatures};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo};
use vm_memory::GuestMemoryBackend;

use super::dirty_log::SharedDirtyLog;
use super::{arm_watchdog, FsError, VHOST_USER_TIMEOUT};
use crate::GuestMemoryMmap;

use crate::GuestRegionMmap;

/// Regions one `SET_MEM_TABLE` carries (the spec's baseline).
pub const BASELINE_REGIONS: usize = 8;

fn region_info(id: &str, region: &GuestRegionMmap) -> Result<VhostUserMemoryRegionInfo, FsError> {
    VhostUserMemoryRegionInfo::from_guest_region(region).map_err(|source| FsError::Negotiate {
        id: id.into(),
        step: "guest RAM has no fd to share (start the VM with --memory shared=on)",
        source,
    })
}

/// Sends all of `mem` as the daemon's memory table.
pub(super) fn send_memory_table(
    id: &str,
    frontend: &mut Frontend,
    mem_slots: bool,
    mem: &GuestMemoryMmap,
) -> Result<(), FsError> {
    let regions = mem
        .iter()
        .map(|r| region_info(id, r))
        .collect::<Result<Vec<_>, _>>()?;
    let first = regions.len().min(BASELINE_REGIONS);
    if regions.len() > first && !mem_slots {
        return Err(FsError::Missing {
            id: id.into(),
            what: format!(
                "CONFIGURE_MEM_SLOTS, needed for guest RAM in {} regions (more than {BASELINE_REGIONS})",
                regions.len()
            ),
        });
    }
    let step = |step, source| FsError::Negotiate {
        id: id.into(),
        step,
        source,
    };
    frontend
        .set_mem_table(&regions[..first])
        .map_err(|e| step("SET_MEM_TABLE", e))?;
    for r in &regions[first..] {
        frontend
            .add_mem_region(r)
            .map_err(|e| step("ADD_MEM_REG", e))?;
    }
    Ok(())
}

/// A handle on one daemon's memory table for whoever adds guest RAM.
#[derive(Clone)]
pub struct DaemonMemory {
    pub(super) id: String,
    frontend: Frontend,
    /// `CONFIGURE_MEM_SLOTS` was negotiated: regions are added one by one.
    mem_slots: bool,
    /// `REPLY_ACK` was negotiated: the daemon can say when it is done.
    pub(super) reply_ack: bool,
    failed: Arc<AtomicBool>,
    /// The daemon offered `LOG_ALL` and `LOG_SHMFD` was negotiated.
    pub(super) log_capable: bool,
    /// The virtio features last sent with `SET_FEATURES` (the device's).
    features: Arc<AtomicU64>,
    /// The dirty log the daemon writes, while logging.
    pub(super) log: Arc<Mutex<Option<Arc<SharedDirtyLog>>>>,
}

impl DaemonMemory {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        id: &str,
        frontend: Frontend,
        mem_slots: bool,
        reply_ack: bool,
        failed: Arc<AtomicBool>,
        log_capable: bool,
        features: Arc<AtomicU64>,
        log: Arc<Mutex<Option<Arc<SharedDirtyLog>>>>,
    ) -> Self {
        DaemonMemory {
            id: id.into(),
            frontend,
            mem_slots,
            reply_ack,
            failed,
            log_capable,
            features,
            log,
        }
    }

    /// The virtio features the device last sent with `SET_FEATURES`.
    pub(super) fn features_in_use(&self) -> u64 {
        self.features.load(Ordering::SeqCst)
    }

    /// False once the daemon has gone away: there is nothing to tell it.
    pub fn alive(&self) -> bool {
        !self.failed.load(Ordering::SeqCst)
    }

    /// Runs `send` on the connection under the daemon watchdog and returns
    /// once the daemon has handled it: the guest may use the RAM as soon
    /// as it hears of it. A daemon that does not answer is marked failed,
    /// as at activation.
    pub(super) fn exchange(
        &self,
        during: &str,
        send: impl FnOnce(&mut Frontend) -> Result<(), FsError>,
    ) -> Result<(), FsError> {
        let mut frontend = self.frontend.clone();
        let dog = arm_watchdog(frontend.as_raw_fd()).map_err(|e| FsError::Timeout {
            id: self.id.clone(),
            during: format!("arming the watchdog: {e}"),
        })?;
        let result = if self.reply_ack {
            // Each request of `send` waits for the daemon's ack (and its
            // verdict); the connection's other requests go on as before.
            frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            let result = send(&mut frontend);
            frontend.set_hdr_flags(VhostUserHeaderFlag::empty());
            result
        } else {
            // The daemon handles requests in order: once it answers this
            // one, it has handled those of `send`.
            send(&mut frontend).and_then(|()| {
                frontend
                    .get_features()
                    .map(|_| ())
                    .map_err(|source| FsError::Negotiate {
                        id: self.id.clone(),
                        step: "GET_FEATURES",
                        source,
                    })
            })
        };
        if dog.fired() {
            self.failed.store(true, Ordering::SeqCst);
            return Err(FsError::Timeout {
                id: self.id.clone(),
                during: format!("{during} (over {}s)", VHOST_USER_TIMEOUT.as_secs()),
            });
        }
        result
    }

    /// Gives the daemon `region`, which `after` (guest RAM with the region
    /// in it) now holds.
    pub fn add_region(
        &self,
        after: &GuestMemoryMmap,
        region: &GuestRegionMmap,
    ) -> Result<(), FsError> {
        let id = self.id.as_str();
        self.exchange("adding guest RAM", |f| {
            if self.mem_slots {
                f.add_mem_region(&region_info(id, region)?)
                    .map(|_| ())
                    .map_err(|source| FsError::Negotiate {
                        id: id.into(),
                        step: "ADD_MEM_REG",
                        source,
                    })
            } else {
                send_memory_table(id, f, false, after)
            }?;
            self.resend_log_base(f)
        })
    }

    /// Takes `region` back (the RAM was not added after all); `before` is
    /// guest RAM without it.
    pub fn remove_region(
        &self,
        before: &GuestMemoryMmap,
        region: &GuestRegionMmap,
    ) -> Result<(), FsError> {
        let id = self.id.as_str();
        self.exchange("taking back guest RAM", |f| {
            if self.mem_slots {
                f.remove_mem_region(&region_info(id, region)?)
                    .map_err(|source| FsError::Negotiate {
                        id: id.into(),
                        step: "REM_MEM_REG",
                        source,
                    })
            } else {
                send_memory_table(id, f, false, before)
            }?;
            self.resend_log_base(f)
        })
    }
}

// The dirty log of a live migration, on this daemon (the log itself is
// `dirty_log`'s).
impl DaemonMemory {
    /// Refuses, naming the device, a daemon that cannot log its writes:
    /// it lacks `LOG_ALL` or `LOG_SHMFD`, or has gone away.
    pub fn check_can_log(&self) -> Result<(), FsError> {
        if !self.log_capable {
            return Err(FsError::Missing {
                id: self.id.clone(),
                what: "the vhost-user dirty log (VHOST_F_LOG_ALL and protocol feature LOG_SHMFD), \
                       needed to migrate a running guest"
                    .into(),
            });
        }
        if !self.alive() {
            return Err(FsError::Missing {
                id: self.id.clone(),
                what: "a live connection (the daemon has gone away)".into(),
            });
        }
        Ok(())
    }

    /// Turns the daemon's dirty log on into `log`: `SET_FEATURES` with
    /// `LOG_ALL` added to the features in use, then `SET_LOG_BASE` with the
    /// log's fd. Refused, naming the device, when the daemon lacks
    /// `LOG_ALL` or `LOG_SHMFD` or has gone away.
    pub fn start_dirty_log(&self, log: &Arc<SharedDirtyLog>) -> Result<(), FsError> {
        self.check_can_log()?;
        let mut current = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let features = self.features_in_use() | VhostUserVirtioFeatures::LOG_ALL.bits();
        self.exchange("starting the dirty log", |f| {
            set_features(&self.id, f, features)?;
            self.send_log_base(f, log)
        })?;
        *current = Some(log.clone());
        Ok(())
    }

    /// Turns the daemon's dirty log off: `SET_FEATURES` without `LOG_ALL`.
    /// The log's file stays the daemon's to write until it lets go of it;
    /// the VMM reads it no more.
    pub fn stop_dirty_log(&self) -> Result<(), FsError> {
        let mut current = self.log.lock().unwrap_or_else(|e| e.into_inner());
        if current.take().is_none() || !self.alive() {
            return Ok(());
        }
        let features = self.features_in_use();
        self.exchange("stopping the dirty log", |f| {
            set_features(&self.id, f, features)
        })
    }

    /// While logging, the log base again after a memory table change.
    pub(super) fn resend_log_base(&self, f: &mut Frontend) -> Result<(), FsError> {
        let current = self.log.lock().unwrap_or_else(|e| e.into_inner());
        match current.as_ref() {
            Some(log) => self.send_log_base(f, log),
            None => Ok(()),
        }
    }
}

fn set_features(id: &str, f: &mut Frontend, features: u64) -> Result<(), FsError> {
    f.set_features(features)
        .map_err(|source| FsError::Negotiate {
            id: id.into(),
            step: "SET_FEATURES",
            source,
        })
}

impl DaemonMemory {
    /// `SET_LOG_BASE` inside [`DaemonMemory::exchange`]: without
    /// `NEED_REPLY`, since the daemon answers it with a reply of its own
    /// (the log it took), which an extra ack would follow out of step.
    fn send_log_base(&self, f: &mut Frontend, log: &SharedDirtyLog) -> Result<(), FsError> {
        f.set_hdr_flags(VhostUserHeaderFlag::empty());
        let sent = f.set_log_base(0, Some(log.region()));
        if self.reply_ack {
            f.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        sent.map_err(|source| FsError::Negotiate {
            id: self.id.clone(),
            step: "SET_LOG_BASE",
            source,
        })
    }
}
