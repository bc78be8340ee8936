//! The agent's view of etcd: the policy objects under a prefix (read whole,
//! then watched), status keys written under a lease, and the drain's keys
//! (read and watched as raw [`Entry`]s, some written without a lease).

use std::collections::BTreeMap;
use std::time::Duration;

use etcd_client::{
    Certificate, Client, ConnectOptions, EventType, GetOptions, Identity, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, TlsOptions, WatchOptions, WatchStream,
};

use crate::config::Secrets;

use crate::selection::{parse_object, Parsed};

/// How long one etcd request may take before the agent treats etcd as gone.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Store {
    client: Client,
}

/// One key under a prefix: its name (the prefix stripped), value and mod
/// revision; a deleted key has no value.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub name: String,
    pub value: Option<Vec<u8>>,
    pub mod_revision: i64,
}

/// A change to the policy objects, from the watch.
pub enum Change {
    Put(Parsed),
    Deleted(String),
}

fn err(what: &str, e: etcd_client::Error) -> String {
    format!("etcd {what}: {e}")
}

impl Store {
    pub async fn connect(endpoints: &[String], secrets: &Secrets) -> Result<Store, String> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(REQUEST_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(2), REQUEST_TIMEOUT);
        if let Some(ca) = &secrets.ca {
            let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(ca));
            if let Some((cert, key)) = &secrets.identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            if let Some(domain) = &secrets.domain {
                tls = tls.domain_name(domain.clone());
            }
            options = options.with_tls(tls);
        }
        if let Some((user, password)) = &secrets.user {
            options = options.with_user(user.clone(), password.clone());
        }
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(|e| err("connect", e))?;
        Ok(Store { client })
    }

    /// Every object under `prefix`, by name, and the store's revision.
    pub async fn policies(
        &mut self,
        prefix: &str,
    ) -> Result<(BTreeMap<String, Parsed>, i64), String> {
        let resp = self
            .client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| err("get", e))?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let objects = resp
            .kvs()
            .iter()
            .map(|kv| {
                let name = String::from_utf8_lossy(&kv.key()[prefix.len()..]).into_owned();
                let parsed = parse_object(&name, kv.value(), kv.mod_revision());
                (name, parsed)
            })
            .collect();
        Ok((objects, revision))
    }

    /// Watches `prefix` from `revision` on.
    pub async fn watch(&mut self, prefix: &str, revision: i64) -> Result<WatchStream, String> {
        self.client
            .watch(
                prefix,
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_start_revision(revision),
                ),
            )
            .await
            .map_err(|e| err("watch", e))
    }

    /// Watches the one key `key` from `revision` on.
    pub async fn watch_key(&mut self, key: &str, revision: i64) -> Result<WatchStream, String> {
        self.client
            .watch(key, Some(WatchOptions::new().with_start_revision(revision)))
            .await
            .map_err(|e| err("watch", e))
    }

    /// Every key under `prefix` (`exact`: the key `prefix` alone), and the
    /// store's revision.
    pub async fn entries(
        &mut self,
        prefix: &str,
        exact: bool,
    ) -> Result<(Vec<Entry>, i64), String> {
        let options = (!exact).then(|| GetOptions::new().with_prefix());
        let resp = self
            .client
            .get(prefix, options)
            .await
            .map_err(|e| err("get", e))?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let list = resp
            .kvs()
            .iter()
            .filter_map(|kv| {
                Some(Entry {
                    name: String::from_utf8_lossy(kv.key().get(prefix.len()..)?).into_owned(),
                    value: Some(kv.value().to_vec()),
                    mod_revision: kv.mod_revision(),
                })
            })
            .collect();
        Ok((list, revision))
    }

    /// Rewrites the existing `key`, keeping the lease it has (its writer's):
    /// fails if the key is gone.
    pub async fn rewrite(&mut self, key: &str, value: &str) -> Result<(), String> {
        self.client
            .put(key, value, Some(PutOptions::new().with_ignore_lease()))
            .await
            .map(|_| ())
            .map_err(|e| err("put", e))
    }

    /// Puts `value` at `key` without a lease: it outlives this agent.
    pub async fn put_kept(&mut self, key: &str, value: &str) -> Result<(), String> {
        self.client
            .put(key, value, None)
            .await
            .map(|_| ())
            .map_err(|e| err("put", e))
    }

    /// A new lease of `ttl`, and what keeps it alive.
    pub async fn lease(
        &mut self,
        ttl: Duration,
    ) -> Result<(i64, LeaseKeeper, LeaseKeepAliveStream), String> {
        let ttl = i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX);
        let id = self
            .client
            .lease_grant(ttl, None)
            .await
            .map_err(|e| err("lease grant", e))?
            .id();
        let (keeper, stream) = self
            .client
            .lease_keep_alive(id)
            .await
            .map_err(|e| err("lease keep-alive", e))?;
        Ok((id, keeper, stream))
    }

    pub async fn put(&mut self, key: &str, value: &str, lease: i64) -> Result<(), String> {
        self.client
            .put(key, value, Some(PutOptions::new().with_lease(lease)))
            .await
            .map(|_| ())
            .map_err(|e| err("put", e))
    }

    pub async fn delete(&mut self, key: &str) -> Result<(), String> {
        self.client
            .delete(key, None)
            .await
            .map(|_| ())
            .map_err(|e| err("delete", e))
    }
}

/// One message of a watch: the response, or None when etcd cancelled the
/// watch (it was compacted past our revision), which means: read everything
/// again. A broken or ended stream is an error (the session starts over).
pub fn watched(
    msg: Result<Option<etcd_client::WatchResponse>, etcd_client::Error>,
) -> Result<Option<etcd_client::WatchResponse>, String> {
    let resp = msg
        .map_err(|e| format!("etcd watch: {e}"))?
        .ok_or("etcd watch: the stream ended")?;
    Ok((!resp.canceled() && resp.compact_revision() == 0).then_some(resp))
}

/// The keys one watch response changed, as [`Entry`]s (`prefix` stripped).
pub fn entries(resp: &etcd_client::WatchResponse, prefix: &str) -> Vec<Entry> {
    resp.events()
        .iter()
        .filter_map(|ev| {
            let kv = ev.kv()?;
            Some(Entry {
                name: String::from_utf8_lossy(kv.key().get(prefix.len()..)?).into_owned(),
                value: match ev.event_type() {
                    EventType::Put => Some(kv.value().to_vec()),
                    EventType::Delete => None,
                },
                mod_revision: kv.mod_revision(),
            })
        })
        .collect()
}

/// The changes in one watch response (`prefix` is stripped from names).
pub fn changes(resp: &etcd_client::WatchResponse, prefix: &str) -> Vec<Change> {
    resp.events()
        .iter()
        .filter_map(|ev| {
            let kv = ev.kv()?;
            let name = String::from_utf8_lossy(kv.key().get(prefix.len()..)?).into_owned();
            Some(match ev.event_type() {
                EventType::Put => Change::Put(parse_object(&name, kv.value(), kv.mod_revision())),
                EventType::Delete => Change::Deleted(name),
            })
        })
        .collect()
}
