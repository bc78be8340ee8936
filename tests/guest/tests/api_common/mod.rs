//! What the API tests share: the VMM started with only `--api-socket`, and
//! requests read back exactly as ch-remote reads them.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use test_infra::ch_client::{self, ChError};
pub use test_infra::host::{wait_for_path as wait_for, KillOnDrop as Proc};
use test_infra::rig;

/// One request as ch-remote sends it (Host, Accept, Content-Length only
/// with a body, no Content-Type, the connection left open), its reply read
/// exactly as ch-remote's `api_client` reads it: a status line or header
/// that ch-remote would not understand fails the test.
pub fn http(sock: &Path, method: &str, path: &str, body: &str) -> (u16, String) {
    let body = (!body.is_empty()).then_some(body);
    match ch_client::request_path(sock, method, path, body) {
        Ok((code, text)) => (code, text.unwrap_or_default()),
        Err(ChError::ServerResponse(code, text)) => (code, text.unwrap_or_default()),
        Err(e) => panic!("{method} {path}: ch-remote could not read the reply: {e:?}"),
    }
}

pub fn json(sock: &Path, method: &str, path: &str, body: &str) -> serde_json::Value {
    let (status, text) = http(sock, method, path, body);
    assert_eq!(status, 200, "{method} {path}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{method} {path}: {e}: {text}"))
}

/// Asserts a 4xx whose message contains `needle`. The body must be what
/// Cloud Hypervisor sends: a JSON array of strings (the error chain).
pub fn refused(sock: &Path, method: &str, path: &str, body: &str, status: u16, needle: &str) {
    let (got, text) = http(sock, method, path, body);
    assert_eq!(got, status, "{method} {path} {body}: {text}");
    let chain: Vec<String> = serde_json::from_str(&text).unwrap_or_else(|e| {
        panic!("{method} {path}: error body {text:?} is not a JSON array of strings: {e}")
    });
    let message = chain.join("\n");
    assert!(
        message.contains(needle),
        "{method} {path} {body}: expected {needle:?} in {message:?}"
    );
}

pub fn scratch(name: &str) -> PathBuf {
    let dir = rig::target_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("share")).unwrap();
    dir
}

/// The VMM with only `--api-socket dir/api.sock` (not waited for).
pub fn start_vmm(dir: &Path) -> (Proc, PathBuf) {
    start_vmm_with(dir, |_| {})
}

/// [`start_vmm`], its command set up by `configure` first.
pub fn start_vmm_with(dir: &Path, configure: impl FnOnce(&mut Command)) -> (Proc, PathBuf) {
    let vmm = rig::tool("vmm", "dax-vmm").expect("dax-vmm");
    let api = dir.join("api.sock");
    let mut command = Command::new(&vmm);
    command
        .arg("--api-socket")
        .arg(format!("path={}", api.display()))
        .stderr(Stdio::null());
    configure(&mut command);
    (Proc(command.spawn().unwrap()), api)
}

/// The VMM with only an API socket, and a daemon with a control socket,
/// both in `dir`; returns them and (api socket, control socket).
pub fn start(dir: &Path) -> (Proc, Proc, PathBuf, PathBuf) {
    let (vmm, api) = start_vmm(dir);
    let control = dir.join("fs-control.sock");
    let daemon = start_daemon(dir);
    wait_for(&api);
    wait_for(&control);
    (vmm, daemon, api, control)
}

/// A created (not booted) VM whose fs device `fs0` is served by the daemon
/// `start` runs in `dir`.
pub fn create_vm_with_fs0(dir: &Path, api: &Path, control: &Path) {
    let create = r#"{"payload":{"kernel":"/nonexistent/bzImage"},"memory":{"size":268435456,"shared":true},"serial":{"mode":"Null"}}"#;
    assert_eq!(http(api, "PUT", "/api/v1/vm.create", create).0, 204);
    let add_fs = format!(
        r#"{{"tag":"t","socket":"{}","id":"fs0","cache_size":67108864,"control_socket":"{}"}}"#,
        dir.join("fs.sock").display(),
        control.display()
    );
    assert_eq!(http(api, "PUT", "/api/v1/vm.add-fs", &add_fs).0, 204);
}

/// Our daemon on `dir/share`, with its vhost-user and control sockets in `dir`.
pub fn start_daemon(dir: &Path) -> Proc {
    test_infra::host::spawn_daemon(
        &dir.join("share"),
        &dir.join("fs.sock"),
        &dir.join("fs-control.sock"),
    )
}

/// Opens the event stream and reads up to its `subscribed` event; a read
/// that waits longer than `patience` fails the test instead of hanging it.
pub fn subscribe(api: &Path, patience: Duration) -> BufReader<UnixStream> {
    let mut s = UnixStream::connect(api).unwrap();
    write!(
        s,
        "GET /api/v1/vm.dax-events HTTP/1.1\r\nHost: localhost\r\n\r\n"
    )
    .unwrap();
    s.set_read_timeout(Some(patience)).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !line.contains("event: subscribed") {
        line.clear();
        assert!(r.read_line(&mut line).unwrap() > 0, "event stream closed");
    }
    r
}
