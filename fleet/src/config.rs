//! `dax-fleet --config FILE`: which host this is, where etcd is, the VMs
//! on this host (their API sockets and labels), and for host drains the
//! spare VMMs this host receives VMs in (`receive`) and the bounds of a
//! drain of this host (`drain`). Errors name the field.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("--config {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("--config {path}: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This host's name in the status keys.
    pub host: String,
    /// etcd client URLs.
    pub etcd: Vec<String>,
    /// Key prefix: policies under `<prefix>/policies/`, status under
    /// `<prefix>/status/<host>/`.
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Seconds: the TTL of the lease the status keys are written under (a
    /// dead agent's status disappears this long after it stopped).
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl: u64,
    /// Seconds between two passes over every VM even without a change in
    /// etcd (a restarted VMM or daemon converges again within this).
    #[serde(default = "default_resync")]
    pub resync_interval: u64,
    /// TLS to etcd (`https://` endpoints).
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// etcd user authentication.
    #[serde(default)]
    pub auth: Option<AuthConfig>,
    pub vms: Vec<VmConfig>,
    /// This host as a drain's destination: where VMs drained from other
    /// hosts are received. Without it, this host refuses to receive.
    #[serde(default)]
    pub receive: Option<ReceiveConfig>,
    /// Bounds of a drain of this host.
    #[serde(default)]
    pub drain: DrainConfig,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ReceiveConfig {
    /// The address the spares listen on for a migration (`0.0.0.0`, or
    /// one of this host's addresses).
    pub listen: IpAddr,
    /// The address a source host's VMM connects to.
    pub advertise: IpAddr,
    /// The ports the spares listen on, `[first, last]` (inclusive).
    pub ports: [u16; 2],
    /// VMMs the operator started without a VM (`dax-vmm --api-socket`),
    /// each of which receives one VM.
    pub spares: Vec<SpareConfig>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SpareConfig {
    /// The spare VMM's `--api-socket`.
    pub api_socket: PathBuf,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DrainConfig {
    /// Seconds a destination has to answer with a receiver before the VM's
    /// migration fails.
    #[serde(default = "default_receiver_timeout")]
    pub receiver_timeout: u64,
    /// Seconds one migration may take, from the send to the VMM's answer.
    #[serde(default = "default_migration_timeout")]
    pub migration_timeout: u64,
}

impl Default for DrainConfig {
    fn default() -> Self {
        DrainConfig {
            receiver_timeout: default_receiver_timeout(),
            migration_timeout: default_migration_timeout(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// PEM file of the CA that signed etcd's certificate.
    pub ca: PathBuf,
    /// PEM files of this agent's client certificate and key (etcd's
    /// `--client-cert-auth`); both or neither.
    #[serde(default)]
    pub cert: Option<PathBuf>,
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// The name etcd's certificate must carry, where it is not the
    /// endpoint's host.
    #[serde(default)]
    pub domain: Option<String>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    pub user: String,
    /// A file holding the password (its first line), not the password.
    pub password_file: PathBuf,
}

/// TLS material and credentials, read from the files the config names.
#[derive(Clone, Debug, Default)]
pub struct Secrets {
    pub ca: Option<Vec<u8>>,
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    pub domain: Option<String>,
    pub user: Option<(String, String)>,
}

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VmConfig {
    /// Unique on this host.
    pub name: String,
    /// The VMM's `--api-socket`.
    pub api_socket: PathBuf,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
}

fn default_prefix() -> String {
    "/dax".into()
}
fn default_lease_ttl() -> u64 {
    10
}
fn default_resync() -> u64 {
    10
}
fn default_receiver_timeout() -> u64 {
    60
}
fn default_migration_timeout() -> u64 {
    3600
}

/// Limits checked by validation.
pub const MAX_VMS: usize = 10_000;
pub const LEASE_TTL_RANGE: std::ops::RangeInclusive<u64> = 2..=3600;
pub const RESYNC_RANGE: std::ops::RangeInclusive<u64> = 1..=3600;
pub const RECEIVER_TIMEOUT_RANGE: std::ops::RangeInclusive<u64> = 1..=3600;
pub const MIGRATION_TIMEOUT_RANGE: std::ops::RangeInclusive<u64> = 10..=86_400;
pub const MAX_SPARES: usize = 1000;

/// A name used as one component of an etcd key.
fn check_component(field: &str, v: &str) -> Result<(), String> {
    if v.is_empty() || v.contains('/') || v.len() > 253 {
        return Err(format!(
            "{field}: \"{v}\" must be 1 to 253 characters without '/'"
        ));
    }
    Ok(())
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: shown.clone(),
            source,
        })?;
        Self::parse(&text).map_err(|message| ConfigError::Invalid {
            path: shown,
            message,
        })
    }

    pub fn parse(text: &str) -> Result<Config, String> {
        let c: Config = serde_yaml::from_str(text).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), String> {
        check_component("host", &self.host)?;
        if self.etcd.is_empty() {
            return Err("etcd: at least one endpoint (http://HOST:PORT) is required".into());
        }
        for (i, e) in self.etcd.iter().enumerate() {
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(format!(
                    "etcd[{i}]: \"{e}\" must be a URL (http://HOST:PORT)"
                ));
            }
        }
        if !self.prefix.starts_with('/') || self.prefix.ends_with('/') || self.prefix.len() < 2 {
            return Err(format!(
                "prefix: \"{}\" must start with '/' and not end with one",
                self.prefix
            ));
        }
        if !LEASE_TTL_RANGE.contains(&self.lease_ttl) {
            return Err(format!(
                "lease_ttl: {} must be from 2 to 3600 seconds",
                self.lease_ttl
            ));
        }
        if !RESYNC_RANGE.contains(&self.resync_interval) {
            return Err(format!(
                "resync_interval: {} must be from 1 to 3600 seconds",
                self.resync_interval
            ));
        }
        if let Some(t) = &self.tls {
            if t.cert.is_some() != t.key.is_some() {
                return Err(
                    "tls.cert and tls.key: give both (a client certificate and its key) or neither"
                        .into(),
                );
            }
            if let Some((i, e)) = self
                .etcd
                .iter()
                .enumerate()
                .find(|(_, e)| !e.starts_with("https://"))
            {
                return Err(format!("etcd[{i}]: \"{e}\" must be https:// with tls"));
            }
        }
        if let Some(a) = &self.auth {
            if a.user.is_empty() {
                return Err("auth.user: must not be empty".into());
            }
        }
        if self.vms.len() > MAX_VMS {
            return Err(format!("vms: {} VMs; at most {MAX_VMS}", self.vms.len()));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, vm) in self.vms.iter().enumerate() {
            check_component(&format!("vms[{i}].name"), &vm.name)?;
            if !seen.insert(&vm.name) {
                return Err(format!(
                    "vms[{i}].name: \"{}\" is used twice on this host",
                    vm.name
                ));
            }
            if vm.api_socket.as_os_str().is_empty() {
                return Err(format!("vms[{i}].api_socket: must not be empty"));
            }
        }
        if let Some(r) = &self.receive {
            self.validate_receive(r)?;
        }
        let d = &self.drain;
        if !RECEIVER_TIMEOUT_RANGE.contains(&d.receiver_timeout) {
            return Err(format!(
                "drain.receiver_timeout: {} must be from 1 to 3600 seconds",
                d.receiver_timeout
            ));
        }
        if !MIGRATION_TIMEOUT_RANGE.contains(&d.migration_timeout) {
            return Err(format!(
                "drain.migration_timeout: {} must be from 10 to 86400 seconds",
                d.migration_timeout
            ));
        }
        Ok(())
    }

    fn validate_receive(&self, r: &ReceiveConfig) -> Result<(), String> {
        if r.advertise.is_unspecified() {
            return Err(format!(
                "receive.advertise: {} is no address a source can connect to",
                r.advertise
            ));
        }
        let [first, last] = r.ports;
        if first == 0 || first > last {
            return Err(format!(
                "receive.ports: [{first}, {last}] must be [first, last] with 1 <= first <= last"
            ));
        }
        if r.spares.is_empty() {
            return Err("receive.spares: at least one spare VMM is required".into());
        }
        if r.spares.len() > MAX_SPARES {
            return Err(format!(
                "receive.spares: {} spares; at most {MAX_SPARES}",
                r.spares.len()
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, s) in r.spares.iter().enumerate() {
            if s.api_socket.as_os_str().is_empty() {
                return Err(format!("receive.spares[{i}].api_socket: must not be empty"));
            }
            if !seen.insert(&s.api_socket) {
                return Err(format!(
                    "receive.spares[{i}].api_socket: {} is listed twice",
                    s.api_socket.display()
                ));
            }
            if let Some(vm) = self.vms.iter().find(|v| v.api_socket == s.api_socket) {
                return Err(format!(
                    "receive.spares[{i}].api_socket: {} is VM \"{}\"'s",
                    s.api_socket.display(),
                    vm.name
                ));
            }
        }
        Ok(())
    }

    /// Reads the files `tls` and `auth` name; errors name the field.
    pub fn secrets(&self) -> Result<Secrets, String> {
        let read = |field: &str, p: &Path| {
            std::fs::read(p).map_err(|e| format!("{field}: {}: {e}", p.display()))
        };
        let mut s = Secrets::default();
        if let Some(t) = &self.tls {
            s.ca = Some(read("tls.ca", &t.ca)?);
            if let (Some(c), Some(k)) = (&t.cert, &t.key) {
                s.identity = Some((read("tls.cert", c)?, read("tls.key", k)?));
            }
            s.domain = t.domain.clone();
        }
        if let Some(a) = &self.auth {
            let text = read("auth.password_file", &a.password_file)?;
            let password = String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or_default()
                .to_string();
            s.user = Some((a.user.clone(), password));
        }
        Ok(s)
    }

    pub fn policies_prefix(&self) -> String {
        format!("{}/policies/", self.prefix)
    }

    pub fn status_key(&self, vm: &str, fs: &str) -> String {
        format!("{}/status/{}/{vm}/{fs}", self.prefix, self.host)
    }

    /// The operator's drain of this host.
    pub fn drain_key(&self) -> String {
        format!("{}/drain/{}", self.prefix, self.host)
    }

    /// Every host's receiver requests: `<incoming>/<destination>/<vm>`.
    pub fn incoming_prefix(&self) -> String {
        format!("{}/incoming/", self.prefix)
    }

    /// The drain status of this host's VMs: `<drain-status>/<vm>`.
    pub fn drain_status_prefix(&self) -> String {
        format!("{}/drain-status/{}/", self.prefix, self.host)
    }

    /// The VMs this host received: `<adopted>/<vm>`.
    pub fn adopted_prefix(&self) -> String {
        format!("{}/adopted/{}/", self.prefix, self.host)
    }

    pub fn receiver_timeout(&self) -> Duration {
        Duration::from_secs(self.drain.receiver_timeout)
    }

    pub fn migration_timeout(&self) -> Duration {
        Duration::from_secs(self.drain.migration_timeout)
    }

    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl)
    }

    pub fn resync_interval(&self) -> Duration {
        Duration::from_secs(self.resync_interval)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_issue_example_parses_with_defaults() {
        let c = Config::parse(
            "host: h1\netcd: [\"http://127.0.0.1:2379\"]\nprefix: /dax\nvms:\n  - name: vm1\n    api_socket: /run/vm1.sock\n    labels: {tier: build, team: storage}\n",
        )
        .unwrap();
        assert_eq!(c.host, "h1");
        assert_eq!(c.vms[0].labels["tier"], "build");
        assert_eq!((c.lease_ttl, c.resync_interval), (10, 10));
        assert_eq!(c.status_key("vm1", "fs0"), "/dax/status/h1/vm1/fs0");
        assert_eq!(c.policies_prefix(), "/dax/policies/");
        assert!(c.tls.is_none() && c.auth.is_none());
    }

    #[test]
    fn secrets_are_read_from_the_files_named() {
        let dir = std::env::temp_dir().join(format!("fleet-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("pw"), "s3cret\nignored\n").unwrap();
        std::fs::write(dir.join("ca.pem"), "CA").unwrap();
        let doc = format!(
            "host: h\netcd: [\"https://e:2379\"]\ntls: {{ca: {d}/ca.pem}}\nauth: {{user: fleet, password_file: {d}/pw}}\nvms: []",
            d = dir.display()
        );
        let s = Config::parse(&doc).unwrap().secrets().unwrap();
        assert_eq!(s.user, Some(("fleet".into(), "s3cret".into())));
        assert_eq!(s.ca.as_deref(), Some(&b"CA"[..]));
        let missing = doc.replace("ca.pem", "nope.pem");
        let e = Config::parse(&missing).unwrap().secrets().unwrap_err();
        assert!(e.starts_with("tls.ca: "), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_receive_section_parses_and_its_errors_name_the_field() {
        let base = "host: h2\netcd: [\"http://127.0.0.1:2379\"]\nvms:\n  - {name: vm1, api_socket: /run/vm1.sock}\n";
        let c = Config::parse(&format!(
            "{base}receive:\n  listen: 0.0.0.0\n  advertise: 10.0.0.2\n  ports: [6000, 6099]\n  spares:\n    - api_socket: /run/spare1.sock\ndrain: {{receiver_timeout: 5}}\n"
        ))
        .unwrap();
        let r = c.receive.as_ref().unwrap();
        assert_eq!(r.advertise.to_string(), "10.0.0.2");
        assert_eq!(r.ports, [6000, 6099]);
        assert_eq!(
            (c.drain.receiver_timeout, c.drain.migration_timeout),
            (5, 3600),
            "the other bound keeps its default"
        );
        assert_eq!(c.drain_key(), "/dax/drain/h2");
        assert_eq!(c.drain_status_prefix(), "/dax/drain-status/h2/");
        assert_eq!(c.adopted_prefix(), "/dax/adopted/h2/");
        assert_eq!(c.incoming_prefix(), "/dax/incoming/");
        let receive = |body: &str| format!("{base}receive:\n{body}");
        let spare = "  spares: [{api_socket: /run/s1.sock}]\n";
        for (doc, want) in [
            (
                receive(&format!("  listen: nowhere\n  advertise: 10.0.0.2\n  ports: [1, 2]\n{spare}")),
                "receive.listen: invalid",
            ),
            (
                receive(&format!("  listen: 0.0.0.0\n  advertise: 0.0.0.0\n  ports: [1, 2]\n{spare}")),
                "receive.advertise: 0.0.0.0 is no address a source can connect to",
            ),
            (
                receive(&format!("  listen: 0.0.0.0\n  advertise: 10.0.0.2\n  ports: [6001, 6000]\n{spare}")),
                "receive.ports: [6001, 6000] must be [first, last]",
            ),
            (
                receive("  listen: 0.0.0.0\n  advertise: 10.0.0.2\n  ports: [1, 2]\n  spares: []\n"),
                "receive.spares: at least one spare VMM is required",
            ),
            (
                receive("  listen: 0.0.0.0\n  advertise: 10.0.0.2\n  ports: [1, 2]\n  spares: [{api_socket: /a}, {api_socket: /a}]\n"),
                "receive.spares[1].api_socket: /a is listed twice",
            ),
            (
                receive("  listen: 0.0.0.0\n  advertise: 10.0.0.2\n  ports: [1, 2]\n  spares: [{api_socket: /run/vm1.sock}]\n"),
                "receive.spares[0].api_socket: /run/vm1.sock is VM \"vm1\"'s",
            ),
            (
                format!("{base}drain: {{receiver_timeout: 0}}\n"),
                "drain.receiver_timeout: 0 must be from 1 to 3600 seconds",
            ),
            (
                format!("{base}drain: {{migration_timeout: 5}}\n"),
                "drain.migration_timeout: 5 must be from 10 to 86400 seconds",
            ),
        ] {
            let e = Config::parse(&doc).unwrap_err();
            assert!(e.starts_with(want), "{doc}\n  got:  {e}\n  want: {want}");
        }
    }

    #[test]
    fn errors_name_the_field() {
        let base = "etcd: [\"http://127.0.0.1:2379\"]\n";
        for (doc, want) in [
            (format!("host: a/b\n{base}vms: []"), "host: \"a/b\" must be"),
            ("host: h\netcd: []\nvms: []".to_string(), "etcd: at least one"),
            (
                "host: h\netcd: [\"127.0.0.1:2379\"]\nvms: []".to_string(),
                "etcd[0]: \"127.0.0.1:2379\" must be a URL",
            ),
            (
                format!("host: h\n{base}prefix: dax/\nvms: []"),
                "prefix: \"dax/\" must start with '/'",
            ),
            (
                format!("host: h\n{base}lease_ttl: 1\nvms: []"),
                "lease_ttl: 1 must be from 2 to 3600",
            ),
            (
                format!("host: h\n{base}vms:\n  - {{name: a, api_socket: /x}}\n  - {{name: a, api_socket: /y}}"),
                "vms[1].name: \"a\" is used twice",
            ),
            (
                format!("host: h\n{base}vms:\n  - {{name: a, api_sock: /x}}"),
                "vms[0]: unknown field `api_sock`",
            ),
            (
                format!("host: h\n{base}tls: {{ca: /ca.pem}}\nvms: []"),
                "etcd[0]: \"http://127.0.0.1:2379\" must be https:// with tls",
            ),
            (
                "host: h\netcd: [\"https://e:2379\"]\ntls: {ca: /ca.pem, cert: /c.pem}\nvms: []".to_string(),
                "tls.cert and tls.key: give both",
            ),
        ] {
            let e = Config::parse(&doc).unwrap_err();
            assert!(e.starts_with(want), "{doc}\n  got:  {e}\n  want: {want}");
        }
    }
}
