//! The REST API's router on any method, path, query and body: every
//! request gets a status (never a panic, never a 5xx from a bad body), with
//! a stand-in VMM that answers as the real control loop does for the
//! configuration bodies (parsed with the VMM's own VmConfig parser) and
//! the snapshot, restore and migration bodies (with its parsers of those).
#![no_main]

use std::sync::{Mutex, OnceLock};

use api::{ApiError, EventBus, VmmAction, VmmReceiver, VmmReply};
use axum::body::Body;
use axum::http::Request;
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;

const PATHS: &[&str] = &[
    "/api/v1/vmm.ping",
    "/api/v1/vmm.shutdown",
    "/api/v1/vm.create",
    "/api/v1/vm.delete",
    "/api/v1/vm.boot",
    "/api/v1/vm.info",
    "/api/v1/vm.shutdown",
    "/api/v1/vm.reboot",
    "/api/v1/vm.pause",
    "/api/v1/vm.resume",
    "/api/v1/vm.add-fs",
    "/api/v1/vm.add-pmem",
    "/api/v1/vm.add-disk",
    "/api/v1/vm.remove-device",
    "/api/v1/vm.counters",
    "/api/v1/vm.snapshot",
    "/api/v1/vm.restore",
    "/api/v1/vm.send-migration",
    "/api/v1/vm.receive-migration",
    "/api/v1/vm.dax-policy",
    "/api/v1/vm.dax-metrics",
    "/api/v1/vm.dax-status",
    "/api/v1/",
    "/",
];
const METHODS: &[&str] = &["GET", "PUT", "POST", "DELETE", "PATCH", "HEAD"];

struct Rig {
    runtime: tokio::runtime::Runtime,
    router: axum::Router,
    receiver: Mutex<VmmReceiver>,
}

fn rig() -> &'static Rig {
    static RIG: OnceLock<Rig> = OnceLock::new();
    RIG.get_or_init(|| {
        let (channel, receiver) = api::vmm_channel().unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        Rig {
            runtime,
            router: api::router(
                channel,
                EventBus::default(),
                serde_json::json!({"version": "fuzz"}),
            ),
            receiver: Mutex::new(receiver),
        }
    })
}

fn answer(action: VmmAction) -> Result<VmmReply, ApiError> {
    let parsed = match &action {
        VmmAction::Create(v) => vmm::config::json::vm_config_from_json(v)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::AddFs(v) => vmm::config::json::fs_config_from_json(v, 0)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::AddPmem(v) => vmm::config::json::pmem_config_from_json(v, 0)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::AddDisk(v) => vmm::config::json::disk_config_from_json(v, 0)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::Snapshot(v) => vmm::config::json::snapshot_config_from_json(v)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::Restore(v, _) => vmm::config::json::restore_config_from_json(v)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::SendMigration(v) => vmm::migration::send_migration_from_json(v)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        VmmAction::ReceiveMigration(v) => vmm::migration::receive_migration_from_json(v)
            .map(|_| ())
            .map_err(|e| e.to_string()),
        _ => Ok(()),
    };
    parsed.map_err(ApiError::bad_request)?;
    Ok(match action {
        VmmAction::DaxStatus { .. } => VmmReply::Dax(Vec::new()),
        VmmAction::Info | VmmAction::Counters => VmmReply::Json(serde_json::json!({})),
        _ => VmmReply::NoContent,
    })
}

fuzz_target!(|data: &[u8]| {
    let rig = rig();
    let (head, body) = data.split_at(data.len().min(2));
    let method = METHODS[usize::from(head.first().copied().unwrap_or(0)) % METHODS.len()];
    let path = PATHS[usize::from(head.get(1).copied().unwrap_or(0)) % PATHS.len()];
    // A query from the body's first line, when it looks like one.
    let (query, body) = match body.strip_prefix(b"?") {
        Some(rest) => {
            let end = rest.iter().position(|&b| b == b'\n').unwrap_or(rest.len());
            (
                String::from_utf8_lossy(&rest[..end])
                    .replace(|c: char| c.is_whitespace() || c.is_control(), ""),
                &rest[end..],
            )
        }
        None => (String::new(), body),
    };
    let uri = if query.is_empty() {
        path.to_string()
    } else {
        format!("{path}?{query}")
    };
    let Ok(request) = Request::builder()
        .method(method)
        .uri(uri)
        .body(Body::from(body.to_vec()))
    else {
        return;
    };
    let response = rig.runtime.block_on(async {
        let fut = rig.router.clone().oneshot(request);
        tokio::pin!(fut);
        loop {
            tokio::select! {
                r = &mut fut => break r,
                _ = tokio::task::yield_now() => {
                    for api::ApiRequest { action, reply } in rig.receiver.lock().unwrap().drain() {
                        let _ = reply.send(answer(action));
                    }
                }
            }
        }
    });
    let status = response.expect("the router is infallible").status();
    assert!(!status.is_server_error(), "{method} {path}: {status}");
});
