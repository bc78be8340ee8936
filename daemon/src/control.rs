//! The daemon's control socket (`--control-socket`): JSON over HTTP/1.1 on a
//! unix socket (mode 0600), served by axum on a thread of its own, so the
//! VMM's API (or an operator with curl) can read and replace the DAX policy
//! while the guest runs.
//!
//! The messages are the `control-protocol` crate's (shared with the VMM's
//! API): `GET`/`PUT`/`DELETE /api/v1/policy` answer `PolicyState` or
//! `PolicyUpdate`, `GET /api/v1/stats` answers `DaemonStats`,
//! `GET /api/v1/adaptive/events?after=N` the adaptive policy's decisions
//! (`AdaptiveEvents`); the VMM's API posts window notices to
//! `/api/v1/window/truncated` and `PUT`s `/api/v1/window/location`. An invalid
//! policy gets 400 naming the field, and changes nothing.
//!
//! A new policy is swapped in whole; the next LOOKUP or GETATTR of any inode
//! answers by it, and Linux re-instantiates an inode whose `FUSE_ATTR_DAX`
//! flipped. `effect` says when a change takes hold: `live`, at the next
//! `remount` (`window_granularity`), or only when the device is `recreate`d
//! (`cache_size`: the window was sized when the VMM connected).

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use control_protocol::{
    AdaptiveEvents, DaemonStats, PolicyChange, PolicyState, PolicyUpdate, WindowLocation,
    WindowTruncated, WINDOW_LOCATION, WINDOW_TRUNCATED,
};
use policies::Policy;
use serde::Deserialize;

use crate::fuse::server::Server;
use crate::policy::DaxPolicy;

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("--control-socket {path}: {source}")]
    Bind {
        path: String,
        source: std::io::Error,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventsParams {
    #[serde(default)]
    after: u64,
}

#[derive(Deserialize)]
struct PutParams {
    #[serde(default)]
    dry_run: bool,
}

/// What the control socket serves: the DAX policy (read and swapped here)
/// and the FUSE server (its report, and the VMM's notices about the window).
#[derive(Clone)]
struct Control {
    policy: Arc<DaxPolicy>,
    server: Arc<Server>,
}

fn error(status: StatusCode, message: String) -> Response {
    (status, message + "\n").into_response()
}

fn policy_state(policy: &DaxPolicy) -> PolicyState {
    let cur = policy.current();
    PolicyState {
        generation: cur.generation,
        policy: cur.policy.to_value(),
    }
}

/// Validates, diffs and (unless `dry_run`) swaps in `new`.
fn apply(policy: &DaxPolicy, new: Policy, dry_run: bool) -> PolicyUpdate {
    let cur = policy.current();
    let diff = policies::diff(&cur.policy, &new);
    let changes: Vec<PolicyChange> = diff
        .changes
        .iter()
        .map(|c| PolicyChange {
            field: c.field.to_string(),
            from: c.from.clone(),
            to: c.to.clone(),
            effect: c.effect,
        })
        .collect();
    let generation = if dry_run || diff.is_empty() {
        cur.generation
    } else {
        policy.replace(new)
    };
    if !dry_run && !diff.is_empty() {
        tracing::info!(
            "DAX policy generation {generation}: {} change(s)",
            changes.len()
        );
    }
    PolicyUpdate {
        generation,
        applied: !dry_run,
        changes,
    }
}

async fn get_policy(State(c): State<Control>) -> Json<PolicyState> {
    Json(policy_state(&c.policy))
}

async fn put_policy(
    State(c): State<Control>,
    Query(q): Query<PutParams>,
    body: String,
) -> Response {
    match Policy::parse_json(&body) {
        Ok(p) => Json(apply(&c.policy, p, q.dry_run)).into_response(),
        Err(e) => error(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

/// Back to the policy the daemon started with (its `--dax-policy`, or the
/// default, with its `--cache-size`).
async fn delete_policy(State(c): State<Control>, Query(q): Query<PutParams>) -> Json<PolicyUpdate> {
    let startup = c.policy.startup();
    Json(apply(&c.policy, startup, q.dry_run))
}

async fn stats(State(c): State<Control>) -> Json<DaemonStats> {
    Json(c.server.report())
}

/// The VMM says where the window sits in guest-physical memory (at boot,
/// and again when the guest moves the device's BAR): from now on a READ or
/// WRITE buffer there is served through the file mapped at that offset.
async fn window_location(State(c): State<Control>, body: String) -> Response {
    let loc: WindowLocation = match serde_json::from_str(&body) {
        Ok(l) => l,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("{WINDOW_LOCATION}: {e}")),
    };
    match c.server.set_window_location(loc) {
        Ok(()) => {
            tracing::info!(
                "the DAX window is at guest-physical {:#x}, {:#x} bytes",
                loc.gpa,
                loc.size
            );
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => error(StatusCode::BAD_REQUEST, format!("{WINDOW_LOCATION}: {e}")),
    }
}

/// The VMM found a mapped file shrunk on the host and shows zeros over the
/// vanished range: counted, and logged for the operator (the guest still
/// believes the range maps the file; it learns the new size at its next
/// GETATTR).
async fn window_truncated(State(c): State<Control>, body: String) -> Response {
    let t: WindowTruncated = match serde_json::from_str(&body) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("{WINDOW_TRUNCATED}: {e}")),
    };
    c.server.count_window_truncation(t.len);
    crate::warn_limited!(
        "the VMM reports window offset {:#x}+{:#x} truncated: a file mapped there shrank on the host (the guest reads zeros there until it remaps)",
        t.offset,
        t.len
    );
    StatusCode::NO_CONTENT.into_response()
}

async fn adaptive_events(
    State(c): State<Control>,
    Query(q): Query<EventsParams>,
) -> Json<AdaptiveEvents> {
    Json(c.policy.adaptive.events_after(q.after))
}

/// `policy` is the one `server` answers by.
pub fn router(server: Arc<Server>, policy: Arc<DaxPolicy>) -> Router {
    Router::new()
        .route(
            "/api/v1/policy",
            get(get_policy).put(put_policy).delete(delete_policy),
        )
        .route("/api/v1/stats", get(stats))
        .route("/api/v1/adaptive/events", get(adaptive_events))
        .route(WINDOW_TRUNCATED, axum::routing::post(window_truncated))
        .route(WINDOW_LOCATION, axum::routing::put(window_location))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "no such endpoint (see docs/virtiofs.md)".into(),
            )
        })
        .with_state(Control { policy, server })
}

/// Binds the socket now (before any sandbox hides the path), readable and
/// writable by the owner only; returns the listener to [`serve`].
pub fn bind(path: &Path) -> Result<std::os::unix::net::UnixListener, ControlError> {
    let shown = path.display().to_string();
    let err = |source| ControlError::Bind {
        path: shown.clone(),
        source,
    };
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    control_protocol::listener::bind_owner_only(path).map_err(|(_, e)| err(e))
}

/// Binds the control socket nobody asked for by name
/// ([`control_protocol::default_control_socket`]).
/// Nothing here is worth failing the daemon for: a path taken by anything
/// but a socket, or too long for a socket address, is left alone and the
/// daemon serves without a control socket, saying so.
pub fn bind_default(vhost_user_socket: &Path) -> Option<std::os::unix::net::UnixListener> {
    use std::os::unix::fs::FileTypeExt;
    let path = control_protocol::default_control_socket(vhost_user_socket);
    match std::fs::symlink_metadata(&path) {
        Ok(m) if !m.file_type().is_socket() => {
            tracing::warn!(
                "no control socket: {} exists and is not a socket (give --control-socket PATH)",
                path.display()
            );
            return None;
        }
        _ => {}
    }
    match bind(&path) {
        Ok(l) => {
            tracing::info!("control socket at {}", path.display());
            Some(l)
        }
        Err(e) => {
            tracing::warn!("no control socket: {e} (give --control-socket PATH)");
            None
        }
    }
}

/// Serves the control API on a thread of its own until the process exits;
/// `policy` is the one `server` answers by.
pub fn serve(
    listener: std::os::unix::net::UnixListener,
    server: Arc<Server>,
    policy: Arc<DaxPolicy>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("control socket: starting its runtime: {e}");
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match tokio::net::UnixListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        tracing::error!("control socket: {e}");
                        return;
                    }
                };
                if let Err(e) = axum::serve(listener, router(server, policy)).await {
                    tracing::error!("control socket: {e}");
                }
            });
        })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    #[test]
    fn the_default_control_socket_is_bound_beside_the_vhost_user_socket() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let vhost = dir.as_path().join("vhost-fs.sock");
        let listener = bind_default(&vhost).expect("bound");
        let path = dir.as_path().join("vhost-fs.sock.control");
        assert!(std::fs::symlink_metadata(&path)
            .unwrap()
            .file_type()
            .is_socket());
        std::os::unix::net::UnixStream::connect(&path).expect("it listens there");
        // A stale one (its daemon gone) is replaced.
        drop(listener);
        assert!(bind_default(&vhost).is_some());
    }

    #[test]
    fn a_file_in_the_default_place_is_left_alone_and_no_control_socket_served() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let vhost = dir.as_path().join("s");
        std::fs::write(dir.as_path().join("s.control"), b"keep me").unwrap();
        assert!(bind_default(&vhost).is_none());
        assert_eq!(
            std::fs::read(dir.as_path().join("s.control")).unwrap(),
            b"keep me"
        );
        // Too long for a socket address: no control socket, no error.
        let long = dir.as_path().join("x".repeat(120));
        assert!(bind_default(&long).is_none());
    }
}
