//! The API socket's limits, against [`serve`] itself on a unix socket.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use super::{as_cloud_hypervisor, serve, Limits};
use axum::body::Body;
use axum::http::Response;
use hyper::ext::ReasonPhrase;

/// A generous bound on waiting for the server, not a measure of its speed:
/// it only keeps a broken server from hanging the test.
pub(super) const PATIENCE: Duration = Duration::from_secs(30);

/// The server on a thread of its own; stopped when dropped.
pub(super) struct Server {
    path: PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// A server whose VMM is gone (requests that reach it fail).
    pub(super) fn start(name: &str, limits: Limits) -> Server {
        Server::start_with_vmm(name, limits).0
    }

    /// A server, and the VMM end of its channel for the test to answer.
    fn start_with_vmm(name: &str, limits: Limits) -> (Server, crate::VmmReceiver) {
        let dir = std::env::temp_dir().join(format!("api-http1-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let (tx, rx) = crate::vmm_channel().unwrap();
        let app = crate::routes::router(
            tx,
            crate::EventBus::default(),
            serde_json::json!({"version": "test"}),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::UnixListener::from_std(listener).unwrap();
                let stopped = async {
                    let _ = stopped.await;
                };
                serve(listener, app, stopped, limits).await;
            });
        });
        let server = Server {
            path,
            stop: Some(stop),
            thread: Some(thread),
        };
        (server, rx)
    }

    pub(super) fn connect(&self) -> UnixStream {
        let s = UnixStream::connect(&self.path).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.stop.take().unwrap().send(());
        let _ = self.thread.take().unwrap().join();
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `vmm.ping` on `s`; the status line and body.
pub(super) fn ping(s: &mut UnixStream) -> (String, String) {
    s.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("vmm.ping answered");
        assert!(
            n > 0,
            "the server closed the connection instead of answering"
        );
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("Content-Length: "))
                .expect("Content-Length")
                .parse()
                .unwrap();
            if body.len() >= length {
                return (head.lines().next().unwrap().to_string(), body.to_string());
            }
        }
    }
}

/// Whether the server closed `s` (EOF) rather than leaving it open until
/// [`PATIENCE`] ran out.
pub(super) fn closed_by_server(s: &mut UnixStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(s.read(&mut buf), Ok(0))
}

fn set_nofile(soft: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given, which outlives the call.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
    lim.rlim_cur = soft;
    lim.rlim_max = lim.rlim_max.max(soft);
    // SAFETY: setrlimit only reads the struct it is given.
    let r = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(
        r,
        0,
        "RLIMIT_NOFILE {soft}: {}",
        std::io::Error::last_os_error()
    );
}

#[test]
fn ping_answers_while_ten_thousand_silent_connections_are_open() {
    const SILENT: u64 = 10_000;
    let limits = Limits::default();
    // The process (client and server alike) has room for the client's
    // connections, the server's cap and a margin: a server that kept every
    // connection would need twice as many, and run out.
    set_nofile(SILENT + limits.max_connections as u64 + 2000);
    let server = Server::start("flood", limits);
    let silent: Vec<UnixStream> = (0..SILENT)
        .map(|i| {
            UnixStream::connect(&server.path)
                .unwrap_or_else(|e| panic!("silent connection {i}: {e}"))
        })
        .collect();
    let mut s = server.connect();
    let (status, body) = ping(&mut s);
    assert_eq!(status, "HTTP/1.1 200 ", "{body}");
    assert!(body.contains("\"version\":\"test\""), "{body}");
    drop(silent);
}

#[test]
fn half_a_header_is_closed_after_the_header_timeout() {
    let limits = Limits {
        header_timeout: Duration::from_millis(100),
        ..Limits::default()
    };
    let server = Server::start("half-head", limits);
    let mut s = server.connect();
    s.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nHo").unwrap();
    assert!(closed_by_server(&mut s), "half a head is still open");
    // The same after a request was served: the next head is timed too.
    let mut kept = server.connect();
    assert_eq!(ping(&mut kept).0, "HTTP/1.1 200 ");
    kept.write_all(b"GET /api/v1/vmm.ping HTTP/1.1\r\nHo")
        .unwrap();
    assert!(
        closed_by_server(&mut kept),
        "half a second head is still open"
    );
}

/// runtime-rs keeps one API connection for a sandbox's whole life and
/// sends `vmm.shutdown` on it at the end: a connection idle for longer
/// than every timeout the server keeps (the header timeout is the only
/// one, and made tiny here) still answers, whether it was served before
/// or never sent anything. Nothing closes an idle connection below the
/// cap, so there is no longer timeout to wait out.
#[test]
fn kept_alive_connections_answer_after_idling_past_every_timeout() {
    let limits = Limits {
        header_timeout: Duration::from_millis(50),
        ..Limits::default()
    };
    let server = Server::start("keep-alive", limits);
    let mut kept = server.connect();
    assert_eq!(ping(&mut kept).0, "HTTP/1.1 200 ");
    let mut fresh = server.connect();
    std::thread::sleep(limits.header_timeout * 6);
    assert_eq!(ping(&mut kept).0, "HTTP/1.1 200 ", "served, then idle");
    assert_eq!(ping(&mut fresh).0, "HTTP/1.1 200 ", "idle from the start");
    std::thread::sleep(limits.header_timeout * 6);
    assert_eq!(ping(&mut kept).0, "HTTP/1.1 200 ", "idle again");
}

#[test]
fn past_the_cap_the_oldest_silent_connection_makes_room() {
    let limits = Limits {
        max_connections: 3,
        ..Limits::default()
    };
    let server = Server::start("cap", limits);
    // A kept-alive client that has been served, then two silent ones.
    let mut kept = server.connect();
    assert_eq!(ping(&mut kept).0, "HTTP/1.1 200 ");
    let mut oldest_silent = server.connect();
    let _silent = server.connect();
    // The fourth evicts the oldest connection that never sent a request.
    let mut fourth = server.connect();
    assert_eq!(ping(&mut fourth).0, "HTTP/1.1 200 ");
    assert!(closed_by_server(&mut oldest_silent));
    assert_eq!(ping(&mut kept).0, "HTTP/1.1 200 ");
}

#[test]
fn past_the_cap_the_connection_idle_longest_makes_room() {
    let limits = Limits {
        max_connections: 3,
        ..Limits::default()
    };
    let server = Server::start("cap-idle", limits);
    // Three served connections, at the cap; the first is then served
    // again, so the second has been idle the longest.
    let mut conns: Vec<UnixStream> = (0..3).map(|_| server.connect()).collect();
    for c in &mut conns {
        assert_eq!(ping(c).0, "HTTP/1.1 200 ");
    }
    assert_eq!(ping(&mut conns[0]).0, "HTTP/1.1 200 ");
    let mut fourth = server.connect();
    assert_eq!(ping(&mut fourth).0, "HTTP/1.1 200 ");
    assert!(
        closed_by_server(&mut conns[1]),
        "the longest idle is closed"
    );
    assert_eq!(ping(&mut conns[0]).0, "HTTP/1.1 200 ");
    assert_eq!(ping(&mut conns[2]).0, "HTTP/1.1 200 ");
}

/// The device and inode of an open file.
fn file_id(fd: std::os::fd::RawFd) -> (u64, u64) {
    // SAFETY: stat is plain data; fstat fills it from an fd the caller holds.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    assert_eq!(unsafe { libc::fstat(fd, &mut st) }, 0);
    (st.st_dev, st.st_ino)
}

/// Kata's driver (clh.go, vmAddNetPutRequest): `httputil.DumpRequest` of
/// its `PUT http://localhost/api/v1/vm.add-net` with the NetConfig JSON,
/// written with the tap fds in one `sendmsg`. The VMM side must get the
/// body and the fds together; the answer is read as Kata reads it.
#[test]
fn kata_add_net_with_its_tap_fd_in_one_sendmsg() {
    use std::os::fd::AsRawFd;

    let (server, rx) = Server::start_with_vmm("katafd", Limits::default());
    // The "VMM": takes the action and checks what came with it.
    let tap = std::fs::File::open("/dev/null").unwrap();
    let want = file_id(tap.as_raw_fd());
    let vmm = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            assert!(
                std::time::Instant::now() < deadline,
                "no request reached the VMM"
            );
            if let Some(req) = rx.drain().into_iter().next() {
                let crate::VmmAction::AddNet(body, fds) = &req.action else {
                    panic!("{:?}", req.action);
                };
                let got: Vec<(u64, u64)> = fds.iter().map(|fd| file_id(fd.as_raw_fd())).collect();
                let mac = body["mac"].as_str().unwrap_or_default().to_string();
                let _ = req.reply.send(Ok(crate::VmmReply::Json(
                    serde_json::json!({"id": "_net0", "bdf": "0000:00:05.0"}),
                )));
                return (mac, got);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let body = r#"{"ip":"192.168.249.1","mask":"255.255.255.0","mac":"02:42:ac:11:00:02","iommu":false,"num_queues":2,"queue_size":256,"vhost_user":false,"vhost_mode":"Client","offload_tso":true,"offload_ufo":true,"offload_csum":true}"#;
    // What Go's httputil.DumpRequest(req, true) writes for Kata's request.
    let request = format!(
        "PUT /api/v1/vm.add-net HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n\
         Content-Length: {}\r\nContent-Type: application/json\r\n\r\n{body}",
        body.len()
    );
    let mut s = server.connect();
    send_with_fd(&s, request.as_bytes(), tap.as_raw_fd());
    let (mac, fds) = vmm.join().unwrap();
    assert_eq!(mac, "02:42:ac:11:00:02");
    assert_eq!(fds, vec![want], "the tap fd arrived with its request");
    let mut reply = vec![0u8; 4096];
    let n = s.read(&mut reply).unwrap();
    let reply = String::from_utf8_lossy(&reply[..n]).to_string();
    assert!(reply.starts_with("HTTP/1.1 200 \r\n"), "{reply}");
    assert!(
        reply.ends_with(r#"{"bdf":"0000:00:05.0","id":"_net0"}"#) || reply.contains("\"bdf\""),
        "{reply}"
    );
    drop(s);
}

/// Writes `bytes` with `fd` as SCM_RIGHTS in one `sendmsg`, as
/// `api_client`'s `send_with_fds` writes a request's first line.
fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: std::os::fd::RawFd) {
    use std::os::fd::AsRawFd;
    let mut control = [0u64; 4];
    let iov = [std::io::IoSlice::new(bytes)];
    // SAFETY: msghdr is plain data; the control buffer holds CMSG_SPACE(4)
    // bytes and outlives the call; the iovec points at `bytes`.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = iov.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = libc::CMSG_SPACE(4) as usize;
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(4) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<i32>(), fd);
        libc::sendmsg(s.as_raw_fd(), &msg, 0)
    };
    assert_eq!(usize::try_from(sent).ok(), Some(bytes.len()));
}

/// ch-remote's `snapshot file:///DIR` and `restore source_url=…` (its
/// `api_client`: the fds with the first write, then `Content-Length`, the
/// blank line and the body in writes of their own) reach the VMM as
/// `Snapshot` and `Restore` with their bodies, the restore with its fds;
/// the VMM's answer goes back as ch-remote reads it.
#[test]
fn ch_remote_snapshot_and_restore_reach_the_vmm_with_their_fds() {
    use std::os::fd::AsRawFd;

    let (server, rx) = Server::start_with_vmm("snaprestore", Limits::default());
    let tap = std::fs::File::open("/dev/null").unwrap();
    let want = file_id(tap.as_raw_fd());
    let vmm = std::thread::spawn(move || {
        let deadline = std::time::Instant::now() + PATIENCE;
        let mut seen = Vec::new();
        while seen.len() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "the requests did not reach the VMM"
            );
            for req in rx.drain() {
                let (answer, what) = match &req.action {
                    crate::VmmAction::Snapshot(body) => {
                        (Ok(crate::VmmReply::NoContent), (body.clone(), Vec::new()))
                    }
                    crate::VmmAction::Restore(body, fds) => (
                        Err(crate::ApiError::internal(
                            "vm.restore: a VM is already created",
                        )),
                        (
                            body.clone(),
                            fds.iter().map(|fd| file_id(fd.as_raw_fd())).collect(),
                        ),
                    ),
                    // The policy controller's look at the fs devices
                    // around a restore (it may bring some).
                    crate::VmmAction::DaxStatus { .. } => {
                        let _ = req.reply.send(Ok(crate::VmmReply::Dax(Vec::new())));
                        continue;
                    }
                    other => panic!("{other:?}"),
                };
                let _ = req.reply.send(answer);
                seen.push(what);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        seen
    });
    let snapshot = r#"{"destination_url":"file:///tmp/snap"}"#;
    let restore = r#"{"source_url":"file:///tmp/snap","prefault":false,"memory_restore_mode":"Copy","net_fds":[{"id":"net0","num_fds":1,"fds":null}],"vfio_fds":null,"iommufd_fd":null,"resume":false,"zone_updates":[]}"#;
    let mut replies = Vec::new();
    for (command, body, fd) in [
        ("vm.snapshot", snapshot, None),
        ("vm.restore", restore, Some(tap.as_raw_fd())),
    ] {
        let mut s = server.connect();
        let head = format!("PUT /api/v1/{command} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n");
        match fd {
            Some(fd) => send_with_fd(&s, head.as_bytes(), fd),
            None => s.write_all(head.as_bytes()).unwrap(),
        }
        s.write_all(format!("Content-Length: {}\r\n", body.len()).as_bytes())
            .unwrap();
        s.write_all(b"\r\n").unwrap();
        s.write_all(body.as_bytes()).unwrap();
        let mut reply = vec![0u8; 4096];
        let n = s.read(&mut reply).unwrap();
        replies.push(String::from_utf8_lossy(&reply[..n]).to_string());
    }
    let seen = vmm.join().unwrap();
    assert_eq!(
        seen[0].0,
        serde_json::from_str::<serde_json::Value>(snapshot).unwrap()
    );
    assert!(seen[0].1.is_empty());
    assert_eq!(
        seen[1].0,
        serde_json::from_str::<serde_json::Value>(restore).unwrap()
    );
    assert_eq!(seen[1].1, vec![want], "the fd arrived with its restore");
    assert!(
        replies[0].starts_with("HTTP/1.1 204 \r\n"),
        "{}",
        replies[0]
    );
    assert!(
        replies[1].starts_with("HTTP/1.1 500 \r\n"),
        "{}",
        replies[1]
    );
    assert!(
        replies[1].ends_with(r#"["vm.restore: a VM is already created"]"#),
        "{}",
        replies[1]
    );
}

#[test]
fn only_429_carries_a_reason_phrase_the_one_kata_retries_on() {
    let reason = |status: u16| {
        let mut r = Response::new(Body::empty());
        *r.status_mut() = axum::http::StatusCode::from_u16(status).unwrap();
        let r = as_cloud_hypervisor(r);
        r.extensions()
            .get::<ReasonPhrase>()
            .map(|p| String::from_utf8_lossy(p.as_bytes()).into_owned())
    };
    assert_eq!(reason(429).as_deref(), Some("Too Many Requests"));
    for status in [200, 204, 400, 404, 409, 500, 501] {
        assert_eq!(reason(status).as_deref(), Some(""), "{status}");
    }
}
