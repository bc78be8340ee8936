//! A daemon's answers as the VMM reads them: the vhost-user handshake (`VhostUserFs::connect`) against a fake backend answering with the input, and the API's DAX endpoints against a fake control socket answering with it.
//!
//! Byte 0 picks the exchange: bit 0 clear, the handshake (bit 1: dax=on,
//! bit 2: a cache_size given), the rest of the input being the backend's
//! bytes in `dax_vmm_fuzz::stream`'s layout (cuts, fds); bit 0 set, a DAX
//! endpoint (bits 1-2: GET, PUT or DELETE vm.dax-policy, GET
//! vm.dax-metrics), every control-socket connection answered with the rest
//! of the input as raw HTTP. Each fake peer writes its bytes and shuts its
//! writing side, so nothing waits for a timeout. A refused or garbled
//! answer must be an error (a 502 from the API), never a panic or a 500.
#![no_main]

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};

use api::{ApiError, EventBus, FsDaxStatus, VmmAction, VmmReceiver, VmmReply};
use axum::body::Body;
use axum::http::Request;
use dax_vmm_fuzz::stream;
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;
use virtio_devices::vhost_user_fs::{FsDeviceConfig, VhostUserFs};

struct Rig {
    dir: PathBuf,
    /// The fake backend's next answer, one per connection.
    backend: SyncSender<Vec<u8>>,
    runtime: tokio::runtime::Runtime,
    router: axum::Router,
    receiver: Mutex<VmmReceiver>,
    control: Arc<tokio::net::UnixListener>,
}

/// The fake vhost-user backend: answers each connection with the next
/// input's bytes, shuts its writing side, and reads until the VMM hangs up.
fn fake_backend(listener: UnixListener, answers: Receiver<Vec<u8>>) {
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let Ok(answer) = answers.recv() else { return };
            stream::send_all_and_close(conn.as_raw_fd(), &answer);
            let _ = std::io::copy(&mut conn, &mut std::io::sink());
        }
    });
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("dax-fuzz-replies-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let _ = std::fs::remove_file(dir.join("vhost.sock"));
        let _ = std::fs::remove_file(dir.join("control.sock"));
        let (backend, answers) = sync_channel(1);
        fake_backend(UnixListener::bind(dir.join("vhost.sock")).unwrap(), answers);
        let (channel, receiver) = api::vmm_channel().unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let control = {
            let _guard = runtime.enter();
            Arc::new(tokio::net::UnixListener::bind(dir.join("control.sock")).unwrap())
        };
        Rig {
            dir,
            backend,
            runtime,
            router: api::router(
                channel,
                EventBus::default(),
                serde_json::json!({"version": "fuzz"}),
            ),
            receiver: Mutex::new(receiver),
            control,
        }
    })
}

fn handshake(rig: &Rig, options: u8, answer: &[u8]) {
    rig.backend.send(answer.to_vec()).unwrap();
    let cfg = FsDeviceConfig {
        id: "fuzz".into(),
        tag: "fuzz".into(),
        socket: rig.dir.join("vhost.sock"),
        num_request_queues: 1,
        queue_size: 128,
        dax: options & 2 != 0,
        cache_size: (options & 4 != 0).then_some(2 << 20),
    };
    if let Ok(fs) = VhostUserFs::connect(&cfg) {
        if let Some(w) = fs.window() {
            assert!(w.size() > 0);
            assert_eq!(w.metrics.snapshot().bytes_mapped, 0);
            if let Some(size) = cfg.cache_size {
                assert_eq!(w.size(), size, "a window other than the one configured");
            }
        }
    }
}

/// The stand-in VMM: one fs device whose daemon's control socket is ours.
fn answer(dir: &std::path::Path, action: VmmAction) -> Result<VmmReply, ApiError> {
    Ok(match action {
        VmmAction::DaxStatus { .. } => VmmReply::Dax(vec![FsDaxStatus {
            id: "fs0".into(),
            control_socket: Some(dir.join("control.sock")),
            window: None,
            // The location relay PUTs it to the fuzzed daemon every second.
            window_location: Some(api::WindowLocation {
                gpa: 1 << 32,
                size: 1 << 30,
            }),
            failed: false,
            configured_policy: None,
        }]),
        VmmAction::KvmCounters => VmmReply::Kvm(None),
        _ => VmmReply::NoContent,
    })
}

fn control(rig: &Rig, options: u8, answer_bytes: &[u8]) {
    let (method, uri, body) = match options >> 1 & 3 {
        0 => ("GET", "/api/v1/vm.dax-policy?id=fs0", ""),
        1 => (
            "PUT",
            "/api/v1/vm.dax-policy?id=fs0",
            r#"{"mode": "always"}"#,
        ),
        2 => ("DELETE", "/api/v1/vm.dax-policy?id=fs0", ""),
        _ => ("GET", "/api/v1/vm.dax-metrics", ""),
    };
    let request = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::from(body))
        .unwrap();
    let answer_bytes = Arc::new(answer_bytes.to_vec());
    let status = rig.runtime.block_on(async {
        let listener = rig.control.clone();
        let daemon = tokio::spawn(async move {
            loop {
                let Ok((mut conn, _)) = listener.accept().await else {
                    return;
                };
                let reply = answer_bytes.clone();
                tokio::spawn(async move {
                    let _ = conn.write_all(&reply).await;
                    let _ = conn.shutdown().await;
                    let _ = conn.read_to_end(&mut Vec::new()).await;
                });
            }
        });
        let fut = rig.router.clone().oneshot(request);
        tokio::pin!(fut);
        let response = loop {
            tokio::select! {
                r = &mut fut => break r,
                _ = tokio::task::yield_now() => {
                    for api::ApiRequest { action, reply } in rig.receiver.lock().unwrap().drain() {
                        let _ = reply.send(answer(&rig.dir, action));
                    }
                }
            }
        };
        daemon.abort();
        response.expect("the router is infallible").status()
    });
    assert!(
        status.as_u16() != 500,
        "{method} {uri}: a daemon's answer made an internal error"
    );
}

fuzz_target!(|data: &[u8]| {
    let rig = rig();
    let (&options, rest) = data.split_first().unwrap_or((&0, &[]));
    if options & 1 == 0 {
        handshake(rig, options, rest);
    } else {
        control(rig, options, rest);
    }
});
