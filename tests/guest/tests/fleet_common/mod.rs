//! What the fleet tests run: a real etcd (Debian's `etcd-server`), created
//! VMs (not booted: a VMM with only `--api-socket`, a VM created and given
//! an fs device whose daemon has a control socket), and `dax-fleet` agents.
//! The drain tests boot theirs, and add spare VMMs ([`spare`]).

pub mod spare;

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use test_infra::ch_client;
use test_infra::rig;

pub use test_infra::host::KillOnDrop as Proc;

pub fn scratch(name: &str) -> PathBuf {
    let dir = rig::target_dir().join("fleet").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn wait_for(what: &str, patience: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + patience;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {patience:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One etcd member with its data under `dir`.
pub struct Etcd {
    proc: Option<Proc>,
    dir: PathBuf,
    pub url: String,
    peer: String,
    tls: Option<Pki>,
}

/// A CA, etcd's server certificate (for 127.0.0.1) and a client
/// certificate (CN root), made with openssl.
#[derive(Clone)]
pub struct Pki {
    pub dir: PathBuf,
}

impl Pki {
    pub fn make(dir: &Path) -> Pki {
        let dir = dir.join("pki");
        std::fs::create_dir_all(&dir).unwrap();
        let run = |args: &[&str]| {
            let out = Command::new("openssl")
                .args(args)
                .current_dir(&dir)
                .output()
                .expect("openssl");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=test-ca",
        ]);
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        )
        .unwrap();
        std::fs::write(dir.join("client.ext"), "extendedKeyUsage=clientAuth\n").unwrap();
        for (name, cn) in [("server", "etcd"), ("client", "root")] {
            run(&[
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
                "-subj",
                &format!("/CN={cn}"),
            ]);
            run(&[
                "x509",
                "-req",
                "-in",
                &format!("{name}.csr"),
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &format!("{name}.pem"),
                "-days",
                "2",
                "-extfile",
                &format!("{name}.ext"),
            ]);
        }
        Pki { dir }
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }
}

impl Etcd {
    pub fn start(dir: &Path) -> Etcd {
        Self::start_with(dir, None)
    }

    /// With `tls`: https for clients, and client certificates required.
    pub fn start_with(dir: &Path, tls: Option<Pki>) -> Etcd {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut e = Etcd {
            proc: None,
            dir: dir.join("etcd"),
            url: format!("{scheme}://127.0.0.1:{}", free_port()),
            peer: format!("http://127.0.0.1:{}", free_port()),
            tls,
        };
        e.restart();
        e
    }

    /// Starts it (again, on the same data and ports).
    pub fn restart(&mut self) {
        self.stop();
        let log = std::fs::File::create(self.dir.with_extension("log")).unwrap();
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(&self.dir)
            .args(["--listen-client-urls", &self.url])
            .args(["--advertise-client-urls", &self.url])
            .args(["--listen-peer-urls", &self.peer])
            .args(["--initial-advertise-peer-urls", &self.peer])
            .args(["--initial-cluster", &format!("t={}", self.peer)])
            .args(self.tls.iter().flat_map(|p| {
                [
                    "--cert-file".into(),
                    p.file("server.pem").display().to_string(),
                    "--key-file".into(),
                    p.file("server.key").display().to_string(),
                    "--trusted-ca-file".into(),
                    p.file("ca.pem").display().to_string(),
                    "--client-cert-auth".into(),
                ]
            }))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("etcd (Debian package etcd-server; scripts/setup-host.sh installs it)");
        self.proc = Some(Proc(child));
        let addr = self.url.split("://").nth(1).unwrap_or_default().to_string();
        wait_for("etcd accepting clients", Duration::from_secs(30), || {
            std::net::TcpStream::connect(&addr).is_ok()
        });
    }

    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

/// A created VM: its VMM (API only) and its fs device's daemon.
pub struct Vm {
    pub name: String,
    pub dir: PathBuf,
    pub api: PathBuf,
    pub control: PathBuf,
    vmm: Proc,
    daemon: Option<Proc>,
}

fn start_daemon(dir: &Path) -> Proc {
    start_daemon_at(dir, &dir.join("share"))
}

/// A daemon serving `share` with its sockets (`fs.sock`,
/// `fs-control.sock`) in `sockets`.
pub fn start_daemon_at(sockets: &Path, share: &Path) -> Proc {
    let daemon = rig::tool("daemon", "dax-virtiofsd").expect("dax-virtiofsd");
    let _ = std::fs::remove_file(sockets.join("fs-control.sock"));
    Proc(
        Command::new(daemon)
            .args([
                "--sandbox",
                "none",
                "--seccomp",
                "none",
                "--log-level",
                "error",
            ])
            .args(["--cache-size", "64M", "--socket-path"])
            .arg(sockets.join("fs.sock"))
            .arg("--shared-dir")
            .arg(share)
            .arg("--control-socket")
            .arg(sockets.join("fs-control.sock"))
            .spawn()
            .unwrap(),
    )
}

pub fn api(sock: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    match ch_client::request_path(sock, method, path, body) {
        Ok((code, text)) => (code, text.unwrap_or_default()),
        Err(ch_client::ChError::ServerResponse(code, text)) => (code, text.unwrap_or_default()),
        Err(e) => panic!("{method} {path}: {e:?}"),
    }
}

impl Vm {
    pub fn create(root: &Path, name: &str) -> Vm {
        let vm = Self::start(root, name);
        vm.define();
        vm
    }

    /// A VM created with `kernel` and booted (a migration moves only a
    /// running VM).
    pub fn create_booted(root: &Path, name: &str, kernel: &Path) -> Vm {
        let vm = Self::start(root, name);
        let create = format!(
            r#"{{"payload":{{"kernel":"{}"}},"memory":{{"size":268435456,"shared":true}},"serial":{{"mode":"Null"}}}}"#,
            kernel.display()
        );
        let (status, text) = api(&vm.api, "PUT", "/api/v1/vm.create", Some(&create));
        assert_eq!(status, 204, "{text}");
        vm.add_fs();
        let (status, text) = api(&vm.api, "PUT", "/api/v1/vm.boot", None);
        assert_eq!(status, 204, "{text}");
        assert_eq!(vm_state(&vm.api).as_deref(), Some("Running"));
        vm
    }

    /// The VMM and the daemon started, the API socket there.
    fn start(root: &Path, name: &str) -> Vm {
        let dir = root.join(name);
        std::fs::create_dir_all(dir.join("share")).unwrap();
        let daemon = start_daemon(&dir);
        let api_sock = dir.join("api.sock");
        let vmm = rig::tool("vmm", "dax-vmm").expect("dax-vmm");
        let vmm = Proc(
            Command::new(vmm)
                .arg("--api-socket")
                .arg(format!("path={}", api_sock.display()))
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let control = dir.join("fs-control.sock");
        wait_for("the VMM's API socket", Duration::from_secs(30), || {
            api_sock.exists()
        });
        wait_for(
            "the daemon's control socket",
            Duration::from_secs(30),
            || control.exists(),
        );
        Vm {
            name: name.to_string(),
            dir,
            api: api_sock,
            control,
            vmm,
            daemon: Some(daemon),
        }
    }

    /// vm.create and vm.add-fs (as an orchestrator does after a VMM restart).
    pub fn define(&self) {
        let create = r#"{"payload":{"kernel":"/nonexistent/bzImage"},"memory":{"size":268435456,"shared":true},"serial":{"mode":"Null"}}"#;
        assert_eq!(
            api(&self.api, "PUT", "/api/v1/vm.create", Some(create)).0,
            204
        );
        self.add_fs();
    }

    fn add_fs(&self) {
        let fs = format!(
            r#"{{"tag":"t","socket":"{}","id":"fs0","cache_size":67108864,"control_socket":"{}"}}"#,
            self.dir.join("fs.sock").display(),
            self.control.display()
        );
        let (status, text) = api(&self.api, "PUT", "/api/v1/vm.add-fs", Some(&fs));
        assert_eq!(status / 100, 2, "{text}");
    }

    /// What the daemon has in force: (generation, policy document).
    pub fn daemon_policy(&self) -> Option<(u64, serde_json::Value)> {
        daemon_policy(&self.control)
    }

    /// Whether the VMM process has exited (after a migration it does).
    pub fn vmm_exited(&mut self) -> bool {
        self.vmm.0.try_wait().ok().flatten().is_some()
    }

    /// Whether the daemon process has exited (after a migration it does,
    /// its state handed over).
    pub fn daemon_exited(&mut self) -> bool {
        self.daemon
            .as_mut()
            .is_none_or(|d| d.0.try_wait().ok().flatten().is_some())
    }

    /// A new VMM process on the same API socket, the VM defined again.
    pub fn restart_vmm(&mut self) {
        self.vmm.kill();
        let _ = std::fs::remove_file(&self.api);
        let vmm = rig::tool("vmm", "dax-vmm").expect("dax-vmm");
        self.vmm = Proc(
            Command::new(vmm)
                .arg("--api-socket")
                .arg(format!("path={}", self.api.display()))
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let api_sock = self.api.clone();
        wait_for("the restarted VMM", Duration::from_secs(30), || {
            api_sock.exists()
        });
        self.define();
    }

    pub fn restart_daemon(&mut self) {
        if let Some(mut d) = self.daemon.take() {
            d.kill();
        }
        let _ = std::fs::remove_file(&self.control);
        self.daemon = Some(start_daemon(&self.dir));
        let control = self.control.clone();
        wait_for("the restarted daemon", Duration::from_secs(30), || {
            control.exists()
        });
    }
}

/// What the daemon with control socket `control` has in force:
/// (generation, policy document).
pub fn daemon_policy(control: &Path) -> Option<(u64, serde_json::Value)> {
    if !control.exists() {
        return None;
    }
    let (status, _, text) = raw(control, "GET", "/api/v1/policy", &[], "");
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&text).ok()?;
    Some((v["generation"].as_u64()?, v["policy"].clone()))
}

/// The VM's state as `vm.info` says it (`Running`, …); None when the VMM
/// has no VM or cannot be reached.
pub fn vm_state(api_sock: &Path) -> Option<String> {
    let (status, body) = match ch_client::request_path(api_sock, "GET", "/api/v1/vm.info", None) {
        Ok((code, text)) => (code, text.unwrap_or_default()),
        Err(_) => return None,
    };
    if status != 200 {
        return None;
    }
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["state"].as_str().map(str::to_string)
}

/// One HTTP/1.1 request with extra headers; (status, response head, body).
pub fn raw(
    sock: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    use std::io::{Read, Write};
    let mut s = std::os::unix::net::UnixStream::connect(sock).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (k, v) in headers {
        req += &format!("{k}: {v}\r\n");
    }
    req += &format!("Content-Length: {}\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

/// The value of header `name` in a response head.
pub fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// A `dax-fleet` agent for `host` over `vms` (name, labels).
pub struct Agent {
    proc: Option<Proc>,
    pub config: PathBuf,
}

impl Agent {
    pub fn start(dir: &Path, host: &str, etcd: &str, vms: &[(&Vm, BTreeMap<&str, &str>)]) -> Agent {
        Self::start_with(dir, host, etcd, "", vms)
    }

    /// `extra`: more top-level YAML (tls, auth).
    pub fn start_with(
        dir: &Path,
        host: &str,
        etcd: &str,
        extra: &str,
        vms: &[(&Vm, BTreeMap<&str, &str>)],
    ) -> Agent {
        let mut yaml = format!(
            "host: {host}\netcd: [\"{etcd}\"]\nprefix: /dax\nlease_ttl: 3\nresync_interval: 2\n{extra}vms:{}\n",
            if vms.is_empty() { " []" } else { "" }
        );
        for (vm, labels) in vms {
            let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}: {v}")).collect();
            yaml += &format!(
                "  - name: {}\n    api_socket: {}\n    labels: {{{}}}\n",
                vm.name,
                vm.api.display(),
                labels.join(", ")
            );
        }
        let config = dir.join(format!("fleet-{host}.yaml"));
        std::fs::write(&config, yaml).unwrap();
        let mut a = Agent { proc: None, config };
        a.restart();
        a
    }

    pub fn restart(&mut self) {
        self.stop();
        let bin = rig::tool("fleet", "dax-fleet").expect("dax-fleet");
        let log = std::fs::File::create(self.config.with_extension("log")).unwrap();
        self.proc = Some(Proc(
            Command::new(bin)
                .arg("--config")
                .arg(&self.config)
                .stderr(log)
                .spawn()
                .unwrap(),
        ));
    }

    /// SIGKILL: no goodbye; the lease has to expire.
    pub fn stop(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.kill();
        }
    }
}

/// A small etcd client for the test's side: puts, deletes and reads.
pub struct Store {
    rt: tokio::runtime::Runtime,
    client: etcd_client::Client,
}

impl Store {
    pub fn connect(url: &str) -> Store {
        Self::connect_with(url, None)
    }

    pub fn connect_with(url: &str, options: Option<etcd_client::ConnectOptions>) -> Store {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let client = rt
            .block_on(etcd_client::Client::connect([url], options))
            .unwrap();
        Store { rt, client }
    }

    /// Turns etcd's authentication on, with `root` (password `password`)
    /// as the only user.
    pub fn enable_auth(&mut self, password: &str) {
        let c = &mut self.client;
        self.rt
            .block_on(c.user_add("root", password, None))
            .unwrap();
        self.rt.block_on(c.user_grant_role("root", "root")).unwrap();
        self.rt.block_on(c.auth_enable()).unwrap();
    }

    /// Puts `value` at `key`; answers the revision it made.
    pub fn put(&mut self, key: &str, value: &str) -> i64 {
        let c = &mut self.client;
        let r = self.rt.block_on(c.put(key, value, None)).unwrap();
        r.header().unwrap().revision()
    }

    pub fn delete(&mut self, key: &str) {
        let c = &mut self.client;
        self.rt.block_on(c.delete(key, None)).unwrap();
    }

    /// Every key under `prefix` with its JSON value.
    pub fn json_under(&mut self, prefix: &str) -> BTreeMap<String, serde_json::Value> {
        let c = &mut self.client;
        let opts = etcd_client::GetOptions::new().with_prefix();
        let Ok(r) = self.rt.block_on(c.get(prefix, Some(opts))) else {
            return BTreeMap::new();
        };
        r.kvs()
            .iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(kv.key()).into_owned(),
                    serde_json::from_slice(kv.value()).unwrap_or(serde_json::Value::Null),
                )
            })
            .collect()
    }

    pub fn compact(&mut self) {
        let c = &mut self.client;
        let rev = self
            .rt
            .block_on(c.get("/", None))
            .unwrap()
            .header()
            .unwrap()
            .revision();
        self.rt.block_on(c.compact(rev, None)).unwrap();
    }
}
