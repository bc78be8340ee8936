//! New tap fds for a restored VM's net devices, as Cloud Hypervisor takes
//! them with `vm.restore`: the body's `net_fds` names net devices and how
//! many fds each takes (`[{"id":"net0","num_fds":1,"fds":null}]`), and the
//! fds come with the request as SCM_RIGHTS, in that order (what `ch-remote
//! restore source_url=...,net_fds=[net0@[3]]` sends). Each device is then
//! built on the tap it was given instead of opening its tap by name (a tap
//! another process set up, on another host namespace, or one whose name
//! the old VMM still holds).
//!
//! Checked in two steps, both before anything of the VM is made, so a
//! refusal leaves no VM: what the request alone shows, before the snapshot
//! is read ([`RestoreTaps::take`]: the count, and that each fd is a tap);
//! what the snapshot's configuration shows ([`RestoreTaps::hand_to`]: that
//! each id is one of its net devices, with as many queue pairs as fds).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use virtio_devices::net::{Tap, TapError};

use crate::config::{RestoredNet, TapFds, VmConfig};

#[derive(Debug, thiserror::Error)]
pub enum RestoreTapsError {
    #[error("{passed} file descriptor(s) came with the request, but net_fds names {named} (its num_fds summed)")]
    Count { passed: usize, named: String },
    #[error("net_fds: fd {index} of {id} is not a tap: {source}")]
    NotATap {
        id: String,
        index: usize,
        source: TapError,
    },
    #[error(
        "net_fds names {id}, which is not a net device of the snapshot (its net devices: {known})"
    )]
    UnknownDevice { id: String, known: String },
    #[error("net_fds gives {id} {given} fd(s), but the device has {pairs} queue pair(s): one tap fd each")]
    QueuePairs {
        id: String,
        given: usize,
        pairs: usize,
    },
}

/// The passed fds by the net device they are for, each checked to be a tap.
#[derive(Debug, Default)]
pub struct RestoreTaps(Vec<(String, Vec<OwnedFd>)>);

impl RestoreTaps {
    /// Deals the fds passed with the request to the devices `net_fds`
    /// names, in order, `num_fds` each (Cloud Hypervisor's way); refused
    /// unless the counts match exactly and every fd is a tap (TUNGETIFF,
    /// which changes nothing about the fd).
    pub fn take(net_fds: &[RestoredNet], fds: Vec<OwnedFd>) -> Result<Self, RestoreTapsError> {
        let named = net_fds
            .iter()
            .try_fold(0usize, |sum, n| sum.checked_add(n.num_fds));
        if named != Some(fds.len()) {
            return Err(RestoreTapsError::Count {
                passed: fds.len(),
                named: named.map_or_else(|| "more than this VMM counts".into(), |n| n.to_string()),
            });
        }
        let mut fds = fds.into_iter();
        let mut taps = Vec::with_capacity(net_fds.len());
        for n in net_fds {
            let given: Vec<OwnedFd> = fds.by_ref().take(n.num_fds).collect();
            for (index, fd) in given.iter().enumerate() {
                Tap::check_fd(fd.as_fd()).map_err(|source| RestoreTapsError::NotATap {
                    id: n.id.clone(),
                    index,
                    source,
                })?;
            }
            taps.push((n.id.clone(), given));
        }
        Ok(RestoreTaps(taps))
    }

    /// Whether no tap was passed.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Gives each named net device of the snapshot's `config` its taps,
    /// once every id and count is checked (nothing is given otherwise).
    pub fn hand_to(self, config: &mut VmConfig) -> Result<(), RestoreTapsError> {
        for (id, fds) in &self.0 {
            let Some(net) = config.net.iter().find(|n| &n.id == id) else {
                let known: Vec<&str> = config.net.iter().map(|n| n.id.as_str()).collect();
                return Err(RestoreTapsError::UnknownDevice {
                    id: id.clone(),
                    known: if known.is_empty() {
                        "none".into()
                    } else {
                        known.join(", ")
                    },
                });
            };
            let pairs = usize::from(net.num_queues / 2);
            if fds.len() != pairs {
                return Err(RestoreTapsError::QueuePairs {
                    id: id.clone(),
                    given: fds.len(),
                    pairs,
                });
            }
        }
        for (id, fds) in self.0 {
            if let Some(net) = config.net.iter_mut().find(|n| n.id == id) {
                net.fds = TapFds(Arc::new(fds));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "restore_taps_tests.rs"]
mod tests;
