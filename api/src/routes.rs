//! Cloud Hypervisor's endpoints, with its bodies, status codes and error
//! style (a text body saying what was wrong).
//!
//! Bodies are read as bytes whatever the Content-Type: ch-remote sends none,
//! and a server insisting on `application/json` would answer it 415.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::Value;

use crate::dax;
use crate::{ApiError, EventBus, VmmAction, VmmChannel, VmmReply, VmmResult};

/// What every handler can reach.
#[derive(Clone)]
pub(crate) struct AppState {
    pub vmm: VmmChannel,
    pub events: EventBus,
    /// The generation the daemon gave the desired policy, per fs device id
    /// (the policy itself is kept with the device's configuration in the VMM).
    pub accepted_generation: Arc<Mutex<HashMap<String, u64>>>,
    /// `vmm.ping`'s answer, given by the VMM at start: answered here, so a
    /// VMM thread busy with a slow daemon does not make the VMM look dead.
    pub ping: Arc<serde_json::Value>,
    /// How the reconcile loop last found each device's daemon.
    pub reconcile: Arc<Mutex<HashMap<String, dax::ReconcileState>>>,
    /// Held while a policy is pushed and the desired one recorded, so the
    /// reconcile loop never pushes a policy a request is replacing.
    pub push_lock: Arc<tokio::sync::Mutex<()>>,
    /// Per device: the last adaptive-policy event relayed from its daemon.
    pub adaptive_cursor: Arc<Mutex<HashMap<String, u64>>>,
    /// Per device: the window location its daemon last took.
    pub window_locations: Arc<Mutex<HashMap<String, control_protocol::WindowLocation>>>,
}

/// Errors as Cloud Hypervisor writes them: a JSON array of strings, the
/// error chain from the outermost context to the root cause (ch-remote
/// prints it as it is). Our messages are one sentence that names the field
/// and the limit; it is the whole chain.
impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(vec![self.message])).into_response()
    }
}

pub(crate) fn reply(result: VmmResult) -> Response {
    match result {
        Ok(VmmReply::NoContent) => StatusCode::NO_CONTENT.into_response(),
        Ok(VmmReply::Json(v)) => Json(v).into_response(),
        Ok(VmmReply::Dax(_) | VmmReply::Kvm(_)) => {
            ApiError::internal("unexpected answer from the VMM").into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// The JSON body of `endpoint`, which needs one.
pub(crate) fn json_body(endpoint: &str, body: &Bytes) -> Result<Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(format!(
            "{endpoint}: a JSON body is required"
        )));
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("{endpoint}: the body is not valid JSON: {e}")))
}

async fn simple(state: &AppState, action: VmmAction) -> Response {
    reply(state.vmm.call(action).await)
}

async fn with_body(
    state: &AppState,
    endpoint: &str,
    body: Bytes,
    action: fn(Value) -> VmmAction,
) -> Response {
    match json_body(endpoint, &body) {
        Ok(v) => reply(state.vmm.call(action(v)).await),
        Err(e) => e.into_response(),
    }
}

/// `vm.add-net`: the body, and the tap fds that came with it (Kata sends
/// them as SCM_RIGHTS in the same sendmsg as the request).
async fn add_net(
    State(s): State<AppState>,
    fds: Option<axum::Extension<crate::passed_fds::PassedFds>>,
    body: Bytes,
) -> Response {
    let fds = fds.map(|f| f.0.take()).unwrap_or_default();
    match json_body("vm.add-net", &body) {
        Ok(v) => reply(s.vmm.call(VmmAction::AddNet(v, fds)).await),
        Err(e) => e.into_response(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveDevice {
    id: String,
}

async fn remove_device(State(s): State<AppState>, body: Bytes) -> Response {
    let parsed = json_body("vm.remove-device", &body).and_then(|v| {
        RemoveDevice::deserialize(&v)
            .map_err(|e| ApiError::bad_request(format!("vm.remove-device: {e}")))
    });
    match parsed {
        Ok(r) => reply(s.vmm.call(VmmAction::RemoveDevice(r.id)).await),
        Err(e) => e.into_response(),
    }
}

/// Cloud Hypervisor endpoints this VMM does not serve, with why. They answer
/// 501 Not Implemented (a code ch-remote names) with that reason, so a user
/// sees what is missing rather than "no such endpoint".
pub const UNSUPPORTED: &[(&str, &str)] = &[
    ("vm.add-device", "VFIO device passthrough is not supported"),
    (
        "vm.add-generic-vhost-user",
        "only vhost-user-fs is supported (vm.add-fs)",
    ),
    ("vm.add-vdpa", "vDPA devices are not supported"),
    (
        "vm.add-user-device",
        "userspace (vfio-user) devices are not supported",
    ),
    ("vm.resize-disk", "disks cannot be resized"),
    ("vm.resize-zone", "memory zones are not supported"),
    ("vm.snapshot", "snapshots are not supported"),
    ("vm.restore", "snapshots are not supported"),
    ("vm.coredump", "guest core dumps are not supported"),
    ("vm.send-migration", "live migration is not supported"),
    ("vm.receive-migration", "live migration is not supported"),
    ("vm.nmi", "NMI injection is not supported"),
    ("vm.balloon-stats", "there is no virtio-balloon device"),
];

fn unsupported(endpoint: &'static str, why: &'static str) -> ApiError {
    ApiError {
        status: 501,
        message: format!("{endpoint}: not supported by dax-vmm: {why} (see docs/api.md)"),
    }
}

/// The API's routes (without the reconcile loop: see [`app`]).
pub fn router(vmm: VmmChannel, events: EventBus, ping: serde_json::Value) -> Router {
    app(vmm, events, ping).0
}

/// The routes, and the state the reconcile loop ([`dax::reconcile`]) runs on.
pub(crate) fn app(
    vmm: VmmChannel,
    events: EventBus,
    ping: serde_json::Value,
) -> (Router, AppState) {
    let state = AppState {
        vmm,
        events,
        accepted_generation: Arc::default(),
        ping: Arc::new(ping),
        reconcile: Arc::default(),
        push_lock: Arc::default(),
        adaptive_cursor: Arc::default(),
        window_locations: Arc::default(),
    };
    (routes(state.clone()), state)
}

fn routes(state: AppState) -> Router {
    let mut router = Router::new();
    for &(endpoint, why) in UNSUPPORTED {
        let answer = move || async move { unsupported(endpoint, why) };
        let route = if endpoint == "vm.balloon-stats" {
            get(answer)
        } else {
            put(answer)
        };
        router = router.route(&format!("/api/v1/{endpoint}"), route);
    }
    router
        .route(
            "/api/v1/vmm.ping",
            get(|State(s): State<AppState>| async move { Json((*s.ping).clone()) }),
        )
        .route(
            "/api/v1/vmm.shutdown",
            put(
                |State(s): State<AppState>| async move { simple(&s, VmmAction::ShutdownVmm).await },
            ),
        )
        .route(
            "/api/v1/vm.create",
            put(|State(s): State<AppState>, b: Bytes| async move {
                with_body(&s, "vm.create", b, VmmAction::Create).await
            }),
        )
        .route(
            "/api/v1/vm.delete",
            put(|State(s): State<AppState>| async move { simple(&s, VmmAction::Delete).await }),
        )
        .route(
            "/api/v1/vm.boot",
            put(|State(s): State<AppState>| async move { simple(&s, VmmAction::Boot).await }),
        )
        .route(
            "/api/v1/vm.info",
            get(|State(s): State<AppState>| async move { simple(&s, VmmAction::Info).await }),
        )
        .route(
            "/api/v1/vm.shutdown",
            put(|State(s): State<AppState>| async move { simple(&s, VmmAction::ShutdownVm).await }),
        )
        .route(
            "/api/v1/vm.reboot",
            put(|State(s): State<AppState>| async move { simple(&s, VmmAction::Reboot).await }),
        )
        .route(
            "/api/v1/vm.power-button",
            put(
                |State(s): State<AppState>| async move { simple(&s, VmmAction::PowerButton).await },
            ),
        )
        .route(
            "/api/v1/vm.pause",
            put(|State(s): State<AppState>| async move { simple(&s, VmmAction::Pause).await }),
        )
        .route(
            "/api/v1/vm.resume",
            put(|State(s): State<AppState>| async move { simple(&s, VmmAction::Resume).await }),
        )
        .route(
            "/api/v1/vm.add-fs",
            put(|State(s): State<AppState>, b: Bytes| async move {
                with_body(&s, "vm.add-fs", b, VmmAction::AddFs).await
            }),
        )
        .route(
            "/api/v1/vm.add-pmem",
            put(|State(s): State<AppState>, b: Bytes| async move {
                with_body(&s, "vm.add-pmem", b, VmmAction::AddPmem).await
            }),
        )
        .route(
            "/api/v1/vm.add-disk",
            put(|State(s): State<AppState>, b: Bytes| async move {
                with_body(&s, "vm.add-disk", b, VmmAction::AddDisk).await
            }),
        )
        .route(
            "/api/v1/vm.resize",
            put(|State(s): State<AppState>, b: Bytes| async move {
                with_body(&s, "vm.resize", b, VmmAction::Resize).await
            }),
        )
        .route(
            "/api/v1/vm.add-vsock",
            put(|State(s): State<AppState>, b: Bytes| async move {
                with_body(&s, "vm.add-vsock", b, VmmAction::AddVsock).await
            }),
        )
        .route("/api/v1/vm.add-net", put(add_net))
        .route("/api/v1/vm.remove-device", put(remove_device))
        .route(
            "/api/v1/vm.counters",
            get(|State(s): State<AppState>| async move { simple(&s, VmmAction::Counters).await }),
        )
        .route(
            "/api/v1/vm.dax-policy",
            get(dax::get_policy)
                .put(dax::put_policy)
                .delete(dax::delete_policy),
        )
        .route("/api/v1/vm.dax-metrics", get(dax::metrics))
        .route(
            "/api/v1/vm.dax-events",
            get(|State(s): State<AppState>| async move { s.events.sse() }),
        )
        .fallback(|uri: axum::http::Uri| async move {
            ApiError::not_found(format!("no endpoint {} (see docs/api.md)", uri.path()))
        })
        .method_not_allowed_fallback(
            |method: axum::http::Method, uri: axum::http::Uri| async move {
                ApiError {
                    status: 405,
                    message: format!("{} does not take {method} (see docs/api.md)", uri.path()),
                }
            },
        )
        .layer(axum::middleware::map_response(errors_as_json))
        .with_state(state)
}

/// Errors that axum's extractors produce themselves (a malformed query
/// string, say) come as plain text; Cloud Hypervisor's clients expect every
/// error as a JSON array of strings, so those are rewrapped.
async fn errors_as_json(response: Response) -> Response {
    let status = response.status();
    let is_text = response
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/plain"));
    if !(status.is_client_error() || status.is_server_error()) || !is_text {
        return response;
    }
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap_or_default();
    let message = String::from_utf8_lossy(&body).trim().to_string();
    (status, Json(vec![message])).into_response()
}
