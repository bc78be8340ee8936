//! Cloud Hypervisor's endpoints, with its bodies, status codes and error
//! style (a text body saying what was wrong).
//!
//! Bodies are read as bytes whatever the Content-Type: ch-remote sends none,
//! and a server insisting on `application/json` would answer it 415.
//!
//! The handlers only translate HTTP: a request becomes a [`VmmAction`] for
//! the VMM's control loop, or a call of the DAX policy controller
//! ([`crate::dax`]) for `vm.dax-policy` and `vm.dax-metrics`; the endpoints
//! that add or remove devices go through the controller's
//! [`PolicyController::device_change`] so it sees the device set change.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use control_protocol::{Effect, PolicyChange, PolicyUpdate};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::dax::{self, PolicyController, PolicyRequest};
use crate::if_match::{etag, if_match};
use crate::{ApiError, EventBus, VmmAction, VmmChannel, VmmReply, VmmResult};

/// What every handler can reach.
#[derive(Clone)]
pub(crate) struct AppState {
    pub vmm: VmmChannel,
    pub events: EventBus,
    /// `vmm.ping`'s answer, given by the VMM at start: answered here, so a
    /// VMM thread busy with a slow daemon does not make the VMM look dead.
    pub ping: Arc<serde_json::Value>,
    /// The owner of every DAX policy fact (see [`crate::dax`]).
    pub dax: Arc<PolicyController>,
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

/// An action that may add or remove fs devices: the policy controller
/// takes the device list before and after it.
async fn device_change(state: &AppState, action: VmmAction) -> Response {
    reply(state.dax.device_change(state.vmm.call(action)).await)
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

/// `vm.restore`: the body, and the fds that came with it (ch-remote sends
/// those of its `net_fds` with the request).
async fn restore(
    State(s): State<AppState>,
    fds: Option<axum::Extension<crate::passed_fds::PassedFds>>,
    body: Bytes,
) -> Response {
    let fds = fds.map(|f| f.0.take()).unwrap_or_default();
    match json_body("vm.restore", &body) {
        Ok(v) => device_change(&s, VmmAction::Restore(v, fds)).await,
        Err(e) => e.into_response(),
    }
}

/// Cloud Hypervisor's VmRemoveDeviceData: open, like its other bodies
/// ([`crate::ignored_fields`]).
#[derive(Deserialize)]
struct RemoveDevice {
    id: String,
}

async fn remove_device(State(s): State<AppState>, body: Bytes) -> Response {
    let parsed = json_body("vm.remove-device", &body).and_then(|v| {
        for key in v.as_object().into_iter().flat_map(|o| o.keys()) {
            if key != "id" {
                crate::ignored_fields::ignore("VmRemoveDevice", key);
            }
        }
        RemoveDevice::deserialize(&v)
            .map_err(|e| ApiError::bad_request(format!("vm.remove-device: {e}")))
    });
    match parsed {
        Ok(r) => device_change(&s, VmmAction::RemoveDevice(r.id)).await,
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
    ("vm.coredump", "guest core dumps are not supported"),
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

/// The routes, and the policy controller whose loops ([`dax::run`],
/// [`dax::deliver_truncations`]) the server runs beside them.
pub(crate) fn app(
    vmm: VmmChannel,
    events: EventBus,
    ping: serde_json::Value,
) -> (Router, Arc<PolicyController>) {
    let dax = PolicyController::new(vmm.clone(), events.clone());
    let state = AppState {
        vmm,
        events,
        ping: Arc::new(ping),
        dax: dax.clone(),
    };
    (routes(state), dax)
}

async fn ping(State(s): State<AppState>) -> Json<Value> {
    Json((*s.ping).clone())
}

async fn shutdown_vmm(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::ShutdownVmm).await
}

async fn create(State(s): State<AppState>, body: Bytes) -> Response {
    match json_body("vm.create", &body) {
        Ok(v) => device_change(&s, VmmAction::Create(v)).await,
        Err(e) => e.into_response(),
    }
}

async fn delete(State(s): State<AppState>) -> Response {
    device_change(&s, VmmAction::Delete).await
}

async fn boot(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::Boot).await
}

/// `vm.info`, with each fs device's desired DAX policy (the controller's).
async fn info(State(s): State<AppState>) -> Response {
    match s.vmm.call(VmmAction::Info).await {
        Ok(VmmReply::Json(mut info)) => {
            s.dax.show_desired(&mut info);
            Json(info).into_response()
        }
        other => reply(other),
    }
}

async fn shutdown_vm(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::ShutdownVm).await
}

async fn reboot(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::Reboot).await
}

async fn power_button(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::PowerButton).await
}

async fn pause(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::Pause).await
}

async fn resume(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::Resume).await
}

async fn add_fs(State(s): State<AppState>, body: Bytes) -> Response {
    match json_body("vm.add-fs", &body) {
        Ok(v) => device_change(&s, VmmAction::AddFs(v)).await,
        Err(e) => e.into_response(),
    }
}

async fn add_pmem(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(&s, "vm.add-pmem", body, VmmAction::AddPmem).await
}

async fn add_disk(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(&s, "vm.add-disk", body, VmmAction::AddDisk).await
}

async fn resize(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(&s, "vm.resize", body, VmmAction::Resize).await
}

async fn add_vsock(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(&s, "vm.add-vsock", body, VmmAction::AddVsock).await
}

async fn snapshot(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(&s, "vm.snapshot", body, VmmAction::Snapshot).await
}

async fn send_migration(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(&s, "vm.send-migration", body, VmmAction::SendMigration).await
}

async fn receive_migration(State(s): State<AppState>, body: Bytes) -> Response {
    with_body(
        &s,
        "vm.receive-migration",
        body,
        VmmAction::ReceiveMigration,
    )
    .await
}

async fn counters(State(s): State<AppState>) -> Response {
    simple(&s, VmmAction::Counters).await
}

async fn dax_events(State(s): State<AppState>) -> Response {
    s.events.sse().into_response()
}

async fn no_endpoint(uri: axum::http::Uri) -> ApiError {
    ApiError::not_found(format!("no endpoint {} (see docs/api.md)", uri.path()))
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError {
        status: 405,
        message: format!("{} does not take {method} (see docs/api.md)", uri.path()),
    }
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
        .route("/api/v1/vmm.ping", get(ping))
        .route("/api/v1/vmm.shutdown", put(shutdown_vmm))
        .route("/api/v1/vm.create", put(create))
        .route("/api/v1/vm.delete", put(delete))
        .route("/api/v1/vm.boot", put(boot))
        .route("/api/v1/vm.info", get(info))
        .route("/api/v1/vm.shutdown", put(shutdown_vm))
        .route("/api/v1/vm.reboot", put(reboot))
        .route("/api/v1/vm.power-button", put(power_button))
        .route("/api/v1/vm.pause", put(pause))
        .route("/api/v1/vm.resume", put(resume))
        .route("/api/v1/vm.add-fs", put(add_fs))
        .route("/api/v1/vm.add-pmem", put(add_pmem))
        .route("/api/v1/vm.add-disk", put(add_disk))
        .route("/api/v1/vm.resize", put(resize))
        .route("/api/v1/vm.add-vsock", put(add_vsock))
        .route("/api/v1/vm.add-net", put(add_net))
        .route("/api/v1/vm.remove-device", put(remove_device))
        .route("/api/v1/vm.snapshot", put(snapshot))
        .route("/api/v1/vm.restore", put(restore))
        .route("/api/v1/vm.send-migration", put(send_migration))
        .route("/api/v1/vm.receive-migration", put(receive_migration))
        .route("/api/v1/vm.counters", get(counters))
        .route(
            "/api/v1/vm.dax-policy",
            get(get_policy).put(put_policy).delete(delete_policy),
        )
        .route("/api/v1/vm.dax-metrics", get(metrics))
        .route("/api/v1/vm.dax-events", get(dax_events))
        .fallback(no_endpoint)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::map_response(errors_as_json))
        .with_state(state)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicyQuery {
    id: Option<String>,
    #[serde(default)]
    dry_run: bool,
}

impl PolicyQuery {
    fn id(&self) -> Result<&str, ApiError> {
        self.id.as_deref().ok_or_else(|| {
            ApiError::bad_request("vm.dax-policy: the query needs id=<fs device id>")
        })
    }
}

/// `GET vm.dax-policy?id=`: the desired policy, what the daemon has in
/// force (its generation as the ETag), how the last reconcile went.
async fn get_policy(
    State(s): State<AppState>,
    Query(q): Query<PolicyQuery>,
) -> Result<Response, ApiError> {
    let id = q.id()?;
    let view = s.dax.policy(id).await?;
    let (acknowledged, daemon_error) = match &view.acknowledged {
        Ok(state) => (json!(state), Value::Null),
        Err(e) => (Value::Null, Value::String(e.clone())),
    };
    let body = Json(json!({
        "id": id,
        "desired": view.desired,
        "desired_generation": view.desired_generation,
        "acknowledged": acknowledged,
        "daemon_error": daemon_error,
        "reconcile": view.reconcile,
    }));
    Ok(match &view.acknowledged {
        Ok(state) => ([(header::ETAG, etag(state.generation))], body).into_response(),
        Err(_) => body.into_response(),
    })
}

/// A PUT or DELETE's answer: what changed, grouped by when it takes effect.
fn policy_update(id: &str, dry_run: bool, answer: PolicyUpdate) -> Response {
    let by_effect = |effect: Effect| -> Vec<&PolicyChange> {
        answer
            .changes
            .iter()
            .filter(|c| c.effect == effect)
            .collect()
    };
    let body = Json(json!({
        "id": id,
        "generation": answer.generation,
        "applied": !dry_run,
        "changes": answer.changes,
        "live": by_effect(Effect::Live),
        "remount": by_effect(Effect::Remount),
        "recreate": by_effect(Effect::Recreate),
    }));
    ([(header::ETAG, etag(answer.generation))], body).into_response()
}

/// `PUT vm.dax-policy?id=[&dry_run=true]` with a policy document.
async fn put_policy(
    State(s): State<AppState>,
    Query(q): Query<PolicyQuery>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let id = q.id()?;
    let request = PolicyRequest {
        dry_run: q.dry_run,
        expected: if_match(&headers),
    };
    let policy = dax::parse_policy(&body)?;
    let answer = s.dax.put(id, Some(policy), request).await?;
    Ok(policy_update(id, q.dry_run, answer))
}

/// `DELETE vm.dax-policy?id=`: back to the daemon's default policy.
async fn delete_policy(
    State(s): State<AppState>,
    Query(q): Query<PolicyQuery>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let request = PolicyRequest {
        dry_run: q.dry_run,
        expected: if_match(&headers),
    };
    let id = q.id()?;
    let answer = s.dax.put(id, None, request).await?;
    Ok(policy_update(id, q.dry_run, answer))
}

/// `GET vm.dax-metrics`: Prometheus text.
async fn metrics(State(s): State<AppState>) -> Result<Response, ApiError> {
    let text = crate::metrics::render(&s.dax.metrics().await?);
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
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
