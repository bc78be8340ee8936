//! The destination's side: a request for a receiver
//! (`<prefix>/incoming/<host>/<vm>`) gets a free spare VMM from the
//! `receive` configuration listening on a free port, or a refusal saying
//! why; a VM that arrived is adopted: the spare is that VM from then on
//! (`<prefix>/adopted/<host>/<vm>`, written without a lease so a restarted
//! agent still knows it), and its policies apply here.
//!
//! A spare is free when no adopted VM and no receive under way holds it
//! and its VMM answers that it has no VM. The answer is given once the
//! spare listens (its port in `/proc/net/tcp` or `tcp6` as LISTEN), so the
//! source's VMM never connects before it; a spare that does not listen
//! within [`LISTEN_PATIENCE`] is a refusal.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::doc::{Adopted, Answer, Incoming};
use super::{Event, Events};
use crate::config::{Config, ReceiveConfig, VmConfig};
use crate::store::{Entry, Store};
use crate::vmm;

/// How long a spare may take to listen after `vm.receive-migration`.
pub const LISTEN_PATIENCE: Duration = Duration::from_secs(10);
const LISTEN_POLL: Duration = Duration::from_millis(50);

/// A receive under way.
struct Receiving {
    spare: PathBuf,
    port: u16,
    request: Incoming,
    /// The receiver URL was given to the source.
    answered: bool,
}

#[derive(Default)]
pub struct Receiver {
    adopted: BTreeMap<String, Adopted>,
    receiving: BTreeMap<String, Receiving>,
    loaded: bool,
}

fn incoming_key(cfg: &Config, vm: &str) -> String {
    format!("{}{}/{vm}", cfg.incoming_prefix(), cfg.host)
}

/// Whether something listens on TCP `port` (any address, v4 or v6) in this
/// network namespace.
pub fn listening(port: u16) -> bool {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .any(|path| std::fs::read_to_string(path).is_ok_and(|text| listening_in(&text, port)))
}

/// [`listening`] on the text of one `/proc/net/tcp*` table: a line whose
/// local address ends in `:<port in hex>` and whose state is `0A` (LISTEN).
fn listening_in(table: &str, port: u16) -> bool {
    let want = format!(":{port:04X}");
    table.lines().skip(1).any(|line| {
        let mut fields = line.split_whitespace().skip(1);
        let local = fields.next().unwrap_or_default();
        let state = fields.nth(1).unwrap_or_default();
        local.ends_with(&want) && state == "0A"
    })
}

impl Receiver {
    /// At a session's start, the `adopted` keys as etcd holds them: the
    /// first time, the VMs this host adopted before; later, memory is
    /// right (a write an etcd error interrupted is made again).
    pub async fn load(
        &mut self,
        store: &mut Store,
        cfg: &Config,
        adopted: Vec<Entry>,
    ) -> Result<(), String> {
        if self.loaded {
            let held: BTreeMap<String, Option<Vec<u8>>> =
                adopted.into_iter().map(|e| (e.name, e.value)).collect();
            for (vm, a) in &self.adopted {
                let json = a.to_json();
                if held.get(vm).and_then(|v| v.as_deref()) != Some(json.as_bytes()) {
                    store
                        .put_kept(&format!("{}{vm}", cfg.adopted_prefix()), &json)
                        .await?;
                }
            }
            for vm in held.keys().filter(|vm| !self.adopted.contains_key(*vm)) {
                store
                    .delete(&format!("{}{vm}", cfg.adopted_prefix()))
                    .await?;
            }
            return Ok(());
        }
        self.loaded = true;
        for e in adopted {
            let Some(value) = e.value else { continue };
            match Adopted::parse(&e.name, &value) {
                Ok(a) => {
                    self.adopted.insert(e.name, a);
                }
                Err(err) => tracing::warn!("{err}: ignored"),
            }
        }
        Ok(())
    }

    /// The VMs adopted here, as the agent manages them.
    pub fn adopted_vms(&self) -> impl Iterator<Item = VmConfig> + '_ {
        self.adopted.iter().map(|(name, a)| VmConfig {
            name: name.clone(),
            api_socket: a.api_socket.clone(),
            labels: a.labels.clone(),
        })
    }

    pub fn is_adopted(&self, vm: &str) -> bool {
        self.adopted.contains_key(vm)
    }

    async fn answer(store: &mut Store, cfg: &Config, vm: &str, request: &Incoming, answer: Answer) {
        let mut doc = request.clone();
        doc.answer = Some(answer);
        if let Err(e) = store.rewrite(&incoming_key(cfg, vm), &doc.to_json()).await {
            // The source withdrew its request (it gave up, or its agent died).
            tracing::warn!("drain: answering {}'s request for {vm}: {e}", request.from);
        }
    }

    /// A request for a receiver for `vm`; `managed` are the VMs here.
    pub async fn request(
        &mut self,
        store: &mut Store,
        cfg: &Config,
        events: &Events,
        vm: &str,
        request: Incoming,
        managed: &[VmConfig],
    ) {
        if request.answer.is_some() || self.receiving.contains_key(vm) {
            return;
        }
        let refuse = match &cfg.receive {
            None => Err(format!(
                "\"{}\" has no receive section: it takes no VMs",
                cfg.host
            )),
            Some(_) if managed.iter().any(|v| v.name == vm) => Err(format!(
                "a VM named \"{vm}\" already runs on \"{}\"",
                cfg.host
            )),
            Some(r) => self.provision(r).await,
        };
        let (spare, port) = match refuse {
            Ok(p) => p,
            Err(why) => {
                tracing::info!("drain: no receiver for {vm} from {}: {why}", request.from);
                Self::answer(store, cfg, vm, &request, Answer::Refused(why)).await;
                return;
            }
        };
        let Some(r) = &cfg.receive else { return };
        let listen = format!("tcp:{}", SocketAddr::new(r.listen, port));
        let advertise = format!("tcp:{}", SocketAddr::new(r.advertise, port));
        tracing::info!(
            "drain: receiving {vm} from {} in {} at {listen}",
            request.from,
            spare.display()
        );
        self.receiving.insert(
            vm.to_string(),
            Receiving {
                spare: spare.clone(),
                port,
                request,
                answered: false,
            },
        );
        let events = events.clone();
        let patience = cfg.migration_timeout() + cfg.receiver_timeout();
        let vm = vm.to_string();
        tokio::spawn(async move {
            let receive = vmm::receive_migration(&spare, &listen, patience);
            tokio::pin!(receive);
            let deadline = Instant::now() + LISTEN_PATIENCE;
            loop {
                tokio::select! {
                    result = &mut receive => {
                        let _ = events.send(Event::Received { vm, result });
                        return;
                    }
                    _ = tokio::time::sleep(LISTEN_POLL) => {
                        if listening(port) {
                            break;
                        }
                        if Instant::now() > deadline {
                            let error = format!(
                                "{}: not listening on port {port} {} s after vm.receive-migration",
                                spare.display(),
                                LISTEN_PATIENCE.as_secs()
                            );
                            let _ = events.send(Event::Received { vm, result: Err(error) });
                            return;
                        }
                    }
                }
            }
            let _ = events.send(Event::ReceiverReady {
                vm: vm.clone(),
                url: advertise,
            });
            let result = receive.await;
            let _ = events.send(Event::Received { vm, result });
        });
    }

    /// A free spare and port, or why there is none.
    async fn provision(&self, r: &ReceiveConfig) -> Result<(PathBuf, u16), String> {
        let mut busy = Vec::new();
        let mut spare = None;
        for s in &r.spares {
            let sock = &s.api_socket;
            if let Some((vm, _)) = self.adopted.iter().find(|(_, a)| &a.api_socket == sock) {
                busy.push(format!("{} holds {vm}", sock.display()));
            } else if let Some((vm, _)) = self.receiving.iter().find(|(_, x)| &x.spare == sock) {
                busy.push(format!("{} is receiving {vm}", sock.display()));
            } else {
                match vmm::has_vm(sock).await {
                    Ok(false) => {
                        spare = Some(sock.clone());
                        break;
                    }
                    Ok(true) => busy.push(format!("{} has a VM", sock.display())),
                    Err(e) => busy.push(e),
                }
            }
        }
        let Some(spare) = spare else {
            return Err(format!(
                "no spare VMM free of {}: {}",
                r.spares.len(),
                busy.join("; ")
            ));
        };
        let [first, last] = r.ports;
        let port = (first..=last)
            .find(|p| !self.receiving.values().any(|x| x.port == *p) && !listening(*p))
            .ok_or_else(|| format!("no port free in receive.ports [{first}, {last}]"))?;
        Ok((spare, port))
    }

    /// The spare for `vm` listens: the source is told where.
    pub async fn ready(&mut self, store: &mut Store, cfg: &Config, vm: &str, url: String) {
        let Some(r) = self.receiving.get_mut(vm) else {
            return;
        };
        r.answered = true;
        let request = r.request.clone();
        Self::answer(store, cfg, vm, &request, Answer::Receiver(url)).await;
    }

    /// The receive for `vm` ended; answers whether `vm` was adopted.
    pub async fn received(
        &mut self,
        store: &mut Store,
        cfg: &Config,
        vm: &str,
        result: Result<(), String>,
    ) -> Result<bool, String> {
        let Some(r) = self.receiving.remove(vm) else {
            return Ok(false);
        };
        match result {
            Ok(()) => {
                let adopted = Adopted {
                    api_socket: r.spare,
                    labels: r.request.labels,
                    from: r.request.from,
                };
                tracing::info!(
                    "drain: {vm} arrived from {} in {}",
                    adopted.from,
                    adopted.api_socket.display()
                );
                // Memory first: should the put fail, the next session's
                // load writes it.
                let json = adopted.to_json();
                self.adopted.insert(vm.to_string(), adopted);
                let key = format!("{}{vm}", cfg.adopted_prefix());
                store.put_kept(&key, &json).await?;
                Ok(true)
            }
            Err(e) => {
                tracing::warn!(
                    "drain: {vm} from {} did not arrive in {}: {e}",
                    r.request.from,
                    r.spare.display()
                );
                if !r.answered {
                    Self::answer(store, cfg, vm, &r.request, Answer::Refused(e)).await;
                }
                Ok(false)
            }
        }
    }

    /// `vm`, adopted here, left again: its spare is the operator's to start
    /// anew.
    pub async fn release(
        &mut self,
        store: &mut Store,
        cfg: &Config,
        vm: &str,
    ) -> Result<(), String> {
        if self.adopted.remove(vm).is_some() {
            store
                .delete(&format!("{}{vm}", cfg.adopted_prefix()))
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_port_is_found_in_the_kernels_table() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:1770 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1\n   1: 0100007F:1771 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2 1\n";
        assert!(listening_in(table, 6000));
        assert!(!listening_in(table, 6001), "established, not listening");
        assert!(!listening_in(table, 600));
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        assert!(listening(port));
        drop(l);
        assert!(!listening(port));
    }
}
