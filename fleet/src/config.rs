//! `dax-fleet --config FILE`: which host this is, where etcd is, and the
//! VMs on this host (their API sockets and labels). Errors name the field.

use std::collections::BTreeMap;
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

/// Limits checked by validation.
pub const MAX_VMS: usize = 10_000;
pub const LEASE_TTL_RANGE: std::ops::RangeInclusive<u64> = 2..=3600;
pub const RESYNC_RANGE: std::ops::RangeInclusive<u64> = 1..=3600;

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
