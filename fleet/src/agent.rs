//! The reconcile loop, as a Kubernetes controller runs one: read the whole
//! desired state (every policy object) and its revision, converge every
//! local VM to it, then watch from the next revision and converge again
//! on each change — and every `resync_interval` regardless, so a VMM or
//! daemon that restarted (and lost what it was given) gets it back.
//!
//! A session ends when etcd goes away, the watch is cancelled (compaction)
//! or the lease is lost; the next one starts with a full read. Reconnects
//! back off exponentially with jitter, so agents that lost etcd together
//! do not come back in step.
//!
//! Status keys (`<prefix>/status/<host>/<vm>/<fs id>`) are written under
//! the session's lease: when the agent dies its host's status goes with it.
//! Only a status whose content changed is written again.
//!
//! The same loop carries host drains ([`crate::drain`]): it watches this
//! host's drain key and every host's receiver requests, and takes the
//! drain tasks' events. The VMs it manages are those of its configuration
//! that did not leave by a drain, and those it received.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::config::{Config, Secrets, VmConfig};
use crate::drain::doc::Incoming;
use crate::drain::receive::Receiver;
use crate::drain::source::{Ctx, Source};
use crate::drain::{Event, Events};
use crate::selection::{effective, Parsed};
use crate::store::{changes, entries, watched, Change, Entry, Store};
use crate::vmm;

/// Where a status key stands for a device the VMM could not list.
pub const NO_DEVICE: &str = "-";
const BACKOFF_MIN: Duration = Duration::from_millis(200);
const BACKOFF_MAX: Duration = Duration::from_secs(10);

/// Why a session ended.
enum Ended {
    /// The watch was cancelled (compaction): read everything again now.
    Resync,
}

/// Exponential backoff with ±50 % jitter.
struct Backoff {
    next: Duration,
    seed: u64,
}

impl Backoff {
    fn new() -> Self {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            // The low 64 bits of the nanoseconds: the part that varies.
            .map_or(1, |d| {
                u64::try_from(d.as_nanos() & u128::from(u64::MAX)).unwrap_or(1)
            })
            ^ u64::from(std::process::id()) << 32;
        Backoff {
            next: BACKOFF_MIN,
            seed: seed | 1,
        }
    }

    fn reset(&mut self) {
        self.next = BACKOFF_MIN;
    }

    fn delay(&mut self) -> Duration {
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let base = self.next;
        self.next = (self.next * 2).min(BACKOFF_MAX);
        // From half to one and a half times the base.
        base / 2 + base.mul_f64((self.seed % 1000) as f64 / 1000.0)
    }
}

/// What was last done for one VM's fs device.
#[derive(Clone, Debug, PartialEq)]
struct Applied {
    /// (object name, mod revision) applied; None: the default.
    object: Option<(String, i64)>,
    generation: u64,
}

pub struct Agent {
    cfg: Config,
    secrets: Secrets,
    objects: BTreeMap<String, Parsed>,
    /// Status key → the JSON last written under the current lease.
    written: HashMap<String, String>,
    applied: HashMap<(String, String), Applied>,
    /// Each VM's fs ids, as last listed.
    devices: HashMap<String, Vec<String>>,
    /// This host drained.
    source: Source,
    /// This host as a drain's destination.
    receiver: Receiver,
    /// Where the drain's tasks report (they outlive a session).
    events: Events,
    /// What they report, until [`Agent::run`] takes it.
    inbox: Option<UnboundedReceiver<Event>>,
}

impl Agent {
    pub fn new(cfg: Config, secrets: Secrets) -> Self {
        let (events, inbox) = unbounded_channel();
        Agent {
            cfg,
            secrets,
            objects: BTreeMap::new(),
            written: HashMap::new(),
            applied: HashMap::new(),
            devices: HashMap::new(),
            source: Source::default(),
            receiver: Receiver::default(),
            events,
            inbox: Some(inbox),
        }
    }

    /// The VMs this agent manages: those received here, and those of its
    /// configuration that neither left by a drain nor share a name with one
    /// received.
    fn managed(&self) -> Vec<VmConfig> {
        let mut vms: Vec<VmConfig> = self
            .cfg
            .vms
            .iter()
            .filter(|v| !self.source.migrated(&v.name) && !self.receiver.is_adopted(&v.name))
            .cloned()
            .collect();
        vms.extend(self.receiver.adopted_vms());
        vms
    }

    /// What was applied to `vm` is forgotten (it left, or arrived).
    fn forget_vm(&mut self, vm: &str) {
        self.devices.remove(vm);
        self.applied.retain(|(v, _), _| v != vm);
    }

    /// Runs until the process is told to stop.
    pub async fn run(mut self) {
        let mut rx = match self.inbox.take() {
            Some(rx) => rx,
            None => {
                let (events, rx) = unbounded_channel();
                self.events = events;
                rx
            }
        };
        let mut backoff = Backoff::new();
        loop {
            match self.session(&mut backoff, &mut rx).await {
                Ok(Ended::Resync) => {
                    tracing::info!("watch cancelled (compacted?): reading every policy again")
                }
                Err(e) => {
                    let delay = backoff.delay();
                    tracing::warn!("{e}; again in {} ms", delay.as_millis());
                    tokio::time::sleep(delay).await;
                }
            }
        }
    }

    async fn session(
        &mut self,
        backoff: &mut Backoff,
        rx: &mut UnboundedReceiver<Event>,
    ) -> Result<Ended, String> {
        let mut store = Store::connect(&self.cfg.etcd, &self.secrets).await?;
        let prefix = self.cfg.policies_prefix();
        let (objects, revision) = store.policies(&prefix).await?;
        self.objects = objects;
        let (lease, mut keeper, mut alive) = store.lease(self.cfg.lease_ttl()).await?;
        // A new lease holds none of the status written before.
        self.written.clear();
        tracing::info!(
            "{} policy object(s) at revision {revision}; lease {lease:x}",
            self.objects.len()
        );
        let drain_key = self.cfg.drain_key();
        let (drain, drain_revision) = store.entries(&drain_key, true).await?;
        let (statuses, _) = store
            .entries(&self.cfg.drain_status_prefix(), false)
            .await?;
        let (adopted, _) = store.entries(&self.cfg.adopted_prefix(), false).await?;
        let incoming_prefix = self.cfg.incoming_prefix();
        let (incoming, incoming_revision) = store.entries(&incoming_prefix, false).await?;
        self.receiver.load(&mut store, &self.cfg, adopted).await?;
        self.source
            .load(&self.cfg.host, drain.into_iter().next(), statuses);
        self.reconcile(&mut store, lease, true).await?;
        for e in incoming {
            self.incoming(&mut store, lease, e).await?;
        }
        self.drain_step(&mut store, lease).await?;
        backoff.reset();
        let mut watch = store.watch(&prefix, revision + 1).await?;
        let mut drain_watch = store.watch_key(&drain_key, drain_revision + 1).await?;
        let mut incoming_watch = store.watch(&incoming_prefix, incoming_revision + 1).await?;
        let mut resync = tokio::time::interval(self.cfg.resync_interval());
        resync.tick().await;
        let mut keep = tokio::time::interval(self.cfg.lease_ttl() / 3);
        loop {
            tokio::select! {
                msg = watch.message() => {
                    // Not revoking the lease on a resync: the next session
                    // writes every status again under a new one, so none
                    // flaps away; this one expires, holding nothing, once
                    // no longer kept alive.
                    let Some(resp) = watched(msg)? else {
                        return Ok(Ended::Resync);
                    };
                    let list = changes(&resp, &prefix);
                    if list.is_empty() {
                        continue;
                    }
                    for change in list {
                        match change {
                            Change::Put(p) => {
                                self.objects.insert(p.name().to_string(), p);
                            }
                            Change::Deleted(name) => {
                                self.objects.remove(&name);
                            }
                        }
                    }
                    self.reconcile(&mut store, lease, false).await?;
                }
                msg = drain_watch.message() => {
                    let Some(resp) = watched(msg)? else {
                        return Ok(Ended::Resync);
                    };
                    for e in entries(&resp, &drain_key) {
                        self.source.set_drain(&self.cfg.host, Some(e));
                    }
                    self.drain_step(&mut store, lease).await?;
                }
                msg = incoming_watch.message() => {
                    let Some(resp) = watched(msg)? else {
                        return Ok(Ended::Resync);
                    };
                    for e in entries(&resp, &incoming_prefix) {
                        self.incoming(&mut store, lease, e).await?;
                    }
                }
                Some(event) = rx.recv() => self.drain_event(&mut store, lease, event).await?,
                _ = resync.tick() => {
                    self.reconcile(&mut store, lease, true).await?;
                    self.source.resync();
                    self.drain_step(&mut store, lease).await?;
                }
                _ = keep.tick() => keeper
                    .keep_alive()
                    .await
                    .map_err(|e| format!("etcd lease keep-alive: {e}"))?,
                msg = alive.message() => match msg {
                    Ok(Some(r)) if r.ttl() > 0 => {}
                    Ok(Some(_)) => return Err("etcd lease expired".into()),
                    Ok(None) => return Err("etcd lease keep-alive: the stream ended".into()),
                    Err(e) => return Err(format!("etcd lease keep-alive: {e}")),
                },
            }
        }
    }

    /// Converges every VM; `force` re-applies even what was applied before
    /// (idempotent: an unchanged policy makes no new generation).
    async fn reconcile(
        &mut self,
        store: &mut Store,
        lease: i64,
        force: bool,
    ) -> Result<(), String> {
        let vms = self.managed();
        let work = vms.iter().map(|vm| self.converge_vm(vm, force));
        let results = futures_util::future::join_all(work).await;
        let mut statuses = BTreeMap::new();
        for (vm, (devices, per_fs)) in vms.iter().zip(results) {
            if let Some(ids) = devices {
                self.devices.insert(vm.name.clone(), ids);
            }
            for (fs, applied, status) in per_fs {
                if let Some(a) = applied {
                    self.applied.insert((vm.name.clone(), fs.clone()), a);
                }
                statuses.insert(self.cfg.status_key(&vm.name, &fs), status.to_string());
            }
        }
        for (key, value) in &statuses {
            if self.written.get(key) != Some(value) {
                store.put(key, value, lease).await?;
                self.written.insert(key.clone(), value.clone());
            }
        }
        // Devices that went away take their status with them.
        let gone: Vec<String> = self
            .written
            .keys()
            .filter(|k| !statuses.contains_key(*k))
            .cloned()
            .collect();
        for key in gone {
            store.delete(&key).await?;
            self.written.remove(&key);
        }
        Ok(())
    }

    /// The drain moves on (see [`Source::step`]).
    async fn drain_step(&mut self, store: &mut Store, lease: i64) -> Result<(), String> {
        let vms = self.managed();
        let mut ctx = Ctx {
            store,
            lease,
            cfg: &self.cfg,
            vms: &vms,
            events: &self.events,
        };
        self.source.step(&mut ctx).await
    }

    /// A receiver request `<destination>/<vm>` put or deleted: this host
    /// is asked for a receiver, or answers this host's request.
    async fn incoming(&mut self, store: &mut Store, lease: i64, e: Entry) -> Result<(), String> {
        let (Some((destination, vm)), Some(value)) = (e.name.split_once('/'), e.value) else {
            return Ok(());
        };
        let request = match Incoming::parse(destination, vm, &value) {
            Ok(r) => r,
            Err(err) => {
                tracing::warn!("drain: {err}");
                return Ok(());
            }
        };
        let vms = self.managed();
        if destination == self.cfg.host {
            self.receiver
                .request(store, &self.cfg, &self.events, vm, request, &vms)
                .await;
            return Ok(());
        }
        let mut ctx = Ctx {
            store,
            lease,
            cfg: &self.cfg,
            vms: &vms,
            events: &self.events,
        };
        self.source
            .answered(&mut ctx, destination, vm, request)
            .await
    }

    /// What a drain task reported.
    async fn drain_event(
        &mut self,
        store: &mut Store,
        lease: i64,
        event: Event,
    ) -> Result<(), String> {
        match event {
            Event::ReceiverReady { vm, url } => {
                self.receiver.ready(store, &self.cfg, &vm, url).await;
            }
            Event::Received { vm, result } => {
                let arrived = self.receiver.received(store, &self.cfg, &vm, result).await;
                if !matches!(arrived, Ok(false)) && self.receiver.is_adopted(&vm) {
                    // Arrived (even if etcd did not hear of it yet): it is
                    // this host's now, under its own name; a record of it
                    // leaving here before goes.
                    self.source.forget(&vm);
                    self.forget_vm(&vm);
                }
                if arrived? {
                    self.reconcile(store, lease, true).await?;
                    self.drain_step(store, lease).await?;
                }
            }
            Event::Sent { vm, result } => {
                let left = result.is_ok();
                let vms = self.managed();
                let mut ctx = Ctx {
                    store,
                    lease,
                    cfg: &self.cfg,
                    vms: &vms,
                    events: &self.events,
                };
                self.source.sent(&mut ctx, &vm, result).await?;
                if left {
                    self.receiver.release(store, &self.cfg, &vm).await?;
                    self.forget_vm(&vm);
                    self.reconcile(store, lease, false).await?;
                }
            }
        }
        Ok(())
    }

    /// One VM: its devices (None if the VMM could not be asked) and, per
    /// device, what was applied and its status.
    async fn converge_vm(
        &self,
        vm: &VmConfig,
        force: bool,
    ) -> (Option<Vec<String>>, Vec<(String, Option<Applied>, Value)>) {
        let eff = effective(&self.objects, &vm.labels);
        let object = eff.winner.map(|o| (o.name.clone(), o.mod_revision));
        let invalid = eff.errors.join("; ");
        let status = |generation: Option<u64>, error: Option<String>| {
            let mut errors: Vec<String> = error.into_iter().collect();
            if !invalid.is_empty() {
                errors.push(invalid.clone());
            }
            json!({
                "policy": object.as_ref().map(|o| &o.0),
                "revision": object.as_ref().map(|o| o.1),
                "generation": generation,
                "error": if errors.is_empty() { Value::Null } else { Value::String(errors.join("; ")) },
            })
        };
        let ids = match vmm::fs_ids(&vm.api_socket).await {
            Ok(ids) => ids,
            Err(e) => {
                // Known devices keep their keys, with the error; unknown: one key.
                let known = self.devices.get(&vm.name).cloned().unwrap_or_default();
                let keys = if known.is_empty() {
                    vec![NO_DEVICE.to_string()]
                } else {
                    known
                };
                let out = keys
                    .into_iter()
                    .map(|fs| {
                        let generation = self
                            .applied
                            .get(&(vm.name.clone(), fs.clone()))
                            .map(|a| a.generation);
                        (fs, None, status(generation, Some(e.clone())))
                    })
                    .collect();
                return (None, out);
            }
        };
        let mut out = Vec::new();
        for fs in &ids {
            let last = self.applied.get(&(vm.name.clone(), fs.clone()));
            if !force && last.is_some_and(|a| a.object == object) {
                out.push((fs.clone(), None, status(last.map(|a| a.generation), None)));
                continue;
            }
            match vmm::apply(&vm.api_socket, fs, eff.winner.map(|o| &o.policy)).await {
                Ok(generation) => {
                    let applied = Applied {
                        object: object.clone(),
                        generation,
                    };
                    out.push((fs.clone(), Some(applied), status(Some(generation), None)));
                }
                Err(e) => {
                    tracing::warn!("{}/{fs}: {e}", vm.name);
                    out.push((
                        fs.clone(),
                        None,
                        status(last.map(|a| a.generation), Some(e)),
                    ));
                }
            }
        }
        (Some(ids), out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_its_cap_with_jitter() {
        let mut b = Backoff::new();
        let mut last = Duration::ZERO;
        for i in 0..12 {
            let d = b.delay();
            let base = (BACKOFF_MIN * 2u32.pow(i)).min(BACKOFF_MAX);
            assert!(
                d >= base / 2 && d <= base + base / 2,
                "{i}: {d:?} for {base:?}"
            );
            last = d;
        }
        assert!(last >= BACKOFF_MAX / 2);
        b.reset();
        assert!(b.delay() <= BACKOFF_MIN + BACKOFF_MIN / 2);
    }
}
