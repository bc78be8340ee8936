//! The drained host's side: which VMs go, where, one at a time, and what
//! etcd is told about each (`<prefix>/drain-status/<host>/<vm>`).
//!
//! Rules (docs/fleet.md states them to operators):
//! - One migration at a time per host: the next VM is asked for only once
//!   the one before has migrated or failed.
//! - A VM goes to the listed destination with the fewest VMs sent to it by
//!   this drain, ties to the lowest name ([`super::doc::place`]); a
//!   destination that refused (no spare free, no `receive` section) is left
//!   out until the next resync, and when every one refused the VM waits
//!   (`waiting-receiver`, with their answers) and is tried again then.
//! - A destination that gives no receiver within `drain.receiver_timeout`
//!   fails the VM (checked at each resync).
//! - A failed VM stays here, running, and is tried again only when the
//!   drain key is written again (a newer mod revision): no retry loop.
//! - Deleting the drain key stops the drain: the migration under way
//!   completes or fails, none starts; queued VMs lose their status.
//! - Statuses are written without a lease: `migrated` tells this agent,
//!   also after a restart, that the VM is no longer its to manage.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use super::doc::{place, Answer, DrainDoc, DrainStatus, Incoming, State};
use super::{Event, Events};
use crate::config::{Config, VmConfig};
use crate::selection::matches;
use crate::store::{Entry, Store};
use crate::vmm;

/// The status key that carries an invalid drain document's error.
pub const DRAIN_ERROR_KEY: &str = "-";

/// What the source side works with on each call.
pub struct Ctx<'a> {
    pub store: &'a mut Store,
    pub lease: i64,
    pub cfg: &'a Config,
    /// The VMs this agent manages now.
    pub vms: &'a [VmConfig],
    pub events: &'a Events,
}

struct Drain {
    revision: i64,
    doc: Result<DrainDoc, String>,
}

/// The one migration under way.
struct Flight {
    vm: String,
    destination: String,
    asked: Instant,
    /// `vm.send-migration` was called.
    sending: bool,
}

#[derive(Default)]
pub struct Source {
    drain: Option<Drain>,
    statuses: BTreeMap<String, DrainStatus>,
    /// Status key name → the JSON etcd holds.
    written: BTreeMap<String, String>,
    flight: Option<Flight>,
    /// Destinations that refused since the last resync, with their answer.
    refused: BTreeMap<String, String>,
    /// VMs no destination took since the last resync.
    parked: BTreeSet<String>,
    loaded: bool,
}

/// Whether a VM the drain at `revision` selects is (again) queued, given
/// its status: one without a status is; one that failed, or still waits,
/// under an older revision of the drain key is; a failure under this one
/// is not (no retry until the key is written again).
fn queued_again(status: Option<&DrainStatus>, revision: i64) -> bool {
    status.is_none_or(|s| {
        s.drain_revision != revision
            && matches!(
                s.state,
                State::Queued | State::WaitingReceiver | State::Failed
            )
    })
}

fn incoming_key(cfg: &Config, destination: &str, vm: &str) -> String {
    format!("{}{destination}/{vm}", cfg.incoming_prefix())
}

impl Source {
    /// At a session's start: the drain key and this host's statuses as
    /// etcd holds them. The first time, the statuses are taken as this
    /// agent's; a migration that was under way when the process ended has
    /// an unknown outcome: its VM is queued again (and fails at once if its
    /// VMM left with it).
    pub fn load(&mut self, host: &str, drain: Option<Entry>, statuses: Vec<Entry>) {
        self.set_drain(host, drain);
        self.written.clear();
        for e in statuses {
            let Some(value) = e.value else { continue };
            if !self.loaded {
                match DrainStatus::parse(&e.name, &value) {
                    Ok(s) if matches!(s.state, State::Migrated | State::Failed) => {
                        self.statuses.insert(e.name.clone(), s);
                    }
                    Ok(_) => {}
                    Err(err) => tracing::warn!("{err}: written again"),
                }
            }
            self.written
                .insert(e.name, String::from_utf8_lossy(&value).into_owned());
        }
        self.loaded = true;
    }

    /// The drain key of `host` changed (None, or no value: deleted).
    pub fn set_drain(&mut self, host: &str, entry: Option<Entry>) {
        // A drain written again starts with every destination asked anew.
        self.resync();
        self.drain = entry.and_then(|e| {
            let value = e.value?;
            Some(Drain {
                revision: e.mod_revision,
                doc: DrainDoc::parse(host, &value).map_err(|e| e.to_string()),
            })
        });
    }

    /// Whether `vm` left this host by a drain.
    pub fn migrated(&self, vm: &str) -> bool {
        self.statuses
            .get(vm)
            .is_some_and(|s| s.state == State::Migrated)
    }

    /// Forgets that `vm` left (it came back, adopted under the same name).
    pub fn forget(&mut self, vm: &str) {
        self.statuses.remove(vm);
    }

    /// A resync: refusals and parked VMs are tried again.
    pub fn resync(&mut self) {
        self.refused.clear();
        self.parked.clear();
    }

    fn set(&mut self, vm: &str, state: State, destination: Option<&str>, error: Option<String>) {
        let drain_revision = self.drain.as_ref().map_or(0, |d| d.revision);
        self.statuses.insert(
            vm.to_string(),
            DrainStatus {
                state,
                destination: destination.map(str::to_string),
                error,
                drain_revision,
            },
        );
    }

    /// A destination's answer to this host's request for `vm`.
    pub async fn answered(
        &mut self,
        ctx: &mut Ctx<'_>,
        destination: &str,
        vm: &str,
        incoming: Incoming,
    ) -> Result<(), String> {
        let ours = self
            .flight
            .as_ref()
            .is_some_and(|f| f.vm == vm && f.destination == destination && !f.sending);
        if !ours || incoming.from != ctx.cfg.host {
            return Ok(());
        }
        match incoming.answer {
            None => return Ok(()),
            Some(Answer::Receiver(url)) => {
                let Some(api_socket) = ctx
                    .vms
                    .iter()
                    .find(|v| v.name == vm)
                    .map(|v| v.api_socket.clone())
                else {
                    // Memory first: an etcd error ends the session, and the
                    // next one writes what memory holds.
                    self.flight = None;
                    let error = "the VM is no longer in this agent's configuration".to_string();
                    self.set(vm, State::Failed, Some(destination), Some(error));
                    ctx.store
                        .delete(&incoming_key(ctx.cfg, destination, vm))
                        .await?;
                    return self.step(ctx).await;
                };
                if let Some(f) = self.flight.as_mut() {
                    f.sending = true;
                }
                self.set(vm, State::Migrating, Some(destination), None);
                tracing::info!("drain: {vm} to {destination} at {url}");
                let events = ctx.events.clone();
                let patience = ctx.cfg.migration_timeout();
                let vm = vm.to_string();
                tokio::spawn(async move {
                    let result = vmm::send_migration(&api_socket, &url, patience).await;
                    let _ = events.send(Event::Sent { vm, result });
                });
            }
            Some(Answer::Refused(why)) => {
                tracing::info!("drain: {destination} has no receiver for {vm}: {why}");
                self.flight = None;
                self.refused.insert(destination.to_string(), why);
                self.set(vm, State::WaitingReceiver, None, Some(self.refusals()));
                ctx.store
                    .delete(&incoming_key(ctx.cfg, destination, vm))
                    .await?;
            }
        }
        self.step(ctx).await
    }

    /// `vm.send-migration` of `vm` answered.
    pub async fn sent(
        &mut self,
        ctx: &mut Ctx<'_>,
        vm: &str,
        result: Result<(), String>,
    ) -> Result<(), String> {
        let Some(f) = self.flight.take_if(|f| f.vm == vm) else {
            return Ok(());
        };
        match result {
            Ok(()) => {
                tracing::info!("drain: {vm} migrated to {}", f.destination);
                self.set(vm, State::Migrated, Some(&f.destination), None);
            }
            Err(e) => {
                tracing::warn!("drain: {vm} did not migrate to {}: {e}", f.destination);
                self.set(vm, State::Failed, Some(&f.destination), Some(e));
            }
        }
        ctx.store
            .delete(&incoming_key(ctx.cfg, &f.destination, vm))
            .await?;
        self.step(ctx).await
    }

    fn refusals(&self) -> String {
        let list: Vec<String> = self
            .refused
            .iter()
            .map(|(d, why)| format!("{d}: {why}"))
            .collect();
        format!("no destination has a receiver: {}", list.join("; "))
    }

    /// Moves the drain on: the receiver timeout, statuses of the selected
    /// VMs, the next migration when none is under way; writes what changed.
    pub async fn step(&mut self, ctx: &mut Ctx<'_>) -> Result<(), String> {
        let timeout = ctx.cfg.receiver_timeout();
        if let Some(f) = self
            .flight
            .take_if(|f| !f.sending && f.asked.elapsed() > timeout)
        {
            let error = format!(
                "\"{}\" gave no receiver within {} s (is its agent running, with a receive section?)",
                f.destination,
                timeout.as_secs()
            );
            self.set(&f.vm, State::Failed, Some(&f.destination), Some(error));
            ctx.store
                .delete(&incoming_key(ctx.cfg, &f.destination, &f.vm))
                .await?;
        }
        let in_flight = self.flight.as_ref().map(|f| f.vm.clone());
        let pending = |s: &DrainStatus| matches!(s.state, State::Queued | State::WaitingReceiver);
        let (revision, doc) = match &self.drain {
            Some(Drain {
                revision,
                doc: Ok(doc),
            }) => (*revision, doc.clone()),
            other => {
                // No drain (or an unreadable one): nothing starts; what was
                // waiting loses its status.
                let error = match other {
                    Some(Drain {
                        doc: Err(e),
                        revision,
                    }) => Some((e.clone(), *revision)),
                    _ => None,
                };
                self.statuses
                    .retain(|vm, s| Some(vm) == in_flight.as_ref() || !pending(s));
                self.statuses.remove(DRAIN_ERROR_KEY);
                if let Some((e, revision)) = error {
                    let status = DrainStatus {
                        state: State::Failed,
                        destination: None,
                        error: Some(e),
                        drain_revision: revision,
                    };
                    self.statuses.insert(DRAIN_ERROR_KEY.to_string(), status);
                }
                return self.flush(ctx).await;
            }
        };
        self.statuses.remove(DRAIN_ERROR_KEY);
        let mut selected: Vec<&VmConfig> = ctx
            .vms
            .iter()
            .filter(|v| matches(&doc.selector, &v.labels))
            .collect();
        selected.sort_by(|a, b| a.name.cmp(&b.name));
        let names: BTreeSet<&str> = selected.iter().map(|v| v.name.as_str()).collect();
        // No longer selected: its waiting ends.
        self.statuses.retain(|vm, s| {
            Some(vm) == in_flight.as_ref() || !pending(s) || names.contains(vm.as_str())
        });
        for vm in &selected {
            let queue = queued_again(self.statuses.get(&vm.name), revision);
            if queue && in_flight.as_deref() != Some(&vm.name) {
                self.set(&vm.name, State::Queued, None, None);
            }
        }
        if self.flight.is_none() {
            let mut sent = BTreeMap::new();
            for s in self.statuses.values() {
                if let (Some(d), State::Migrating | State::Migrated) = (&s.destination, s.state) {
                    if s.drain_revision == revision {
                        *sent.entry(d.clone()).or_insert(0) += 1;
                    }
                }
            }
            let full: BTreeSet<String> = self.refused.keys().cloned().collect();
            for vm in &selected {
                let waiting = self.statuses.get(&vm.name).is_some_and(pending);
                if !waiting || self.parked.contains(&vm.name) {
                    continue;
                }
                let Some(destination) = place(&doc.destinations, &sent, &full) else {
                    self.set(
                        &vm.name,
                        State::WaitingReceiver,
                        None,
                        Some(self.refusals()),
                    );
                    self.parked.insert(vm.name.clone());
                    continue;
                };
                let request = Incoming {
                    from: ctx.cfg.host.clone(),
                    labels: vm.labels.clone(),
                    answer: None,
                };
                let key = incoming_key(ctx.cfg, destination, &vm.name);
                ctx.store.put(&key, &request.to_json(), ctx.lease).await?;
                tracing::info!("drain: asking {destination} for a receiver for {}", vm.name);
                self.set(&vm.name, State::WaitingReceiver, Some(destination), None);
                self.flight = Some(Flight {
                    vm: vm.name.clone(),
                    destination: destination.to_string(),
                    asked: Instant::now(),
                    sending: false,
                });
                break;
            }
        }
        self.flush(ctx).await
    }

    /// Writes the statuses that changed, deletes those that went.
    async fn flush(&mut self, ctx: &mut Ctx<'_>) -> Result<(), String> {
        let prefix = ctx.cfg.drain_status_prefix();
        for (vm, s) in &self.statuses {
            let json = s.to_json();
            if self.written.get(vm) != Some(&json) {
                ctx.store.put_kept(&format!("{prefix}{vm}"), &json).await?;
                self.written.insert(vm.clone(), json);
            }
        }
        let gone: Vec<String> = self
            .written
            .keys()
            .filter(|k| !self.statuses.contains_key(*k))
            .cloned()
            .collect();
        for vm in gone {
            ctx.store.delete(&format!("{prefix}{vm}")).await?;
            self.written.remove(&vm);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_vm_is_queued_again_only_under_a_newer_drain_revision() {
        let status = |state, drain_revision| DrainStatus {
            state,
            destination: None,
            error: None,
            drain_revision,
        };
        assert!(queued_again(None, 5), "never tried");
        assert!(
            !queued_again(Some(&status(State::Failed, 5)), 5),
            "no retry loop"
        );
        assert!(
            queued_again(Some(&status(State::Failed, 4)), 5),
            "written again"
        );
        assert!(queued_again(Some(&status(State::WaitingReceiver, 4)), 5));
        assert!(!queued_again(Some(&status(State::WaitingReceiver, 5)), 5));
        assert!(!queued_again(Some(&status(State::Migrating, 4)), 5));
        assert!(!queued_again(Some(&status(State::Migrated, 4)), 5));
    }
}
