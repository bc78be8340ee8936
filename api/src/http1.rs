//! Serves the router over HTTP/1.1 the way Cloud Hypervisor's server
//! (micro-http) answers, because its clients parse replies strictly:
//! ch-remote's `api_client` reads the status as the integer between
//! `HTTP/1.1 ` and the first `\r` (so `200 OK` is an error; micro-http
//! writes `HTTP/1.1 200 \r\n`), and finds a body only through a header
//! spelled exactly `Content-Length: `. So every reply gets an empty reason
//! phrase and title-case header names.
//!
//! Every request body is read whole before the router sees the request
//! ([`read_request_body`]): ch-remote writes its request line, its
//! `Content-Length`, the blank line and the body in separate writes and
//! reads nothing until all are written, so an answer given after the head
//! (501 for what is not supported, 404, 405, a 400 on the query) and a
//! close with the body unread would end its last write with a broken pipe
//! instead of showing the answer. A body read whole also keeps a
//! kept-alive connection in step for the next request.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response};
use axum::response::IntoResponse;
use axum::Router;
use http_body_util::BodyExt;
use hyper::body::{Body as _, Incoming};
use hyper::ext::ReasonPhrase;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::connections::{Connections, Registered, Tracked, Watched};
use crate::passed_fds::{FdStream, HeldFds, PassedFds};
use crate::ApiError;

/// The largest request body an endpoint gets (axum's own default limit for
/// a body read whole; the largest real one, a `vm.create`, is a few KiB).
pub const MAX_REQUEST_BODY: u64 = 2 << 20;

/// A body over [`MAX_REQUEST_BODY`] but within this is still read, and
/// dropped, before the 413: its client, writing the whole request before
/// it reads, then gets the answer rather than a broken pipe. A larger one
/// is answered at once with `Connection: close`.
pub const MAX_DRAINED_BODY: u64 = 64 << 20;

/// How long answers in flight may take to reach their clients once the
/// server is told to stop (vmm.shutdown's own answer among them).
const DRAIN: Duration = Duration::from_secs(2);

/// What the API socket allows its clients.
///
/// There is no idle timeout: a connection between two requests is not an
/// attack, and Kata's runtime-rs keeps one connection for a sandbox's whole
/// life (it never redials, and a sandbox whose `vmm.shutdown` fails is
/// leaked). An idle connection costs an fd and a task; the cap bounds
/// them, closing the idle ones first when a new connection needs room.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Once the first bytes of a request head arrive, the rest of the head
    /// must come within this, or the connection is closed (a head
    /// trickled in byte by byte cannot hold a connection).
    pub header_timeout: Duration,
    /// Open connections at most; past it a new one closes an idle one
    /// (see [`crate::connections`]).
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            max_connections: 256,
        }
    }
}

/// Accepts connections until `stop` resolves, then lets open ones finish
/// for at most [`DRAIN`].
pub async fn serve(
    listener: UnixListener,
    app: Router,
    stop: impl std::future::Future<Output = ()>,
    limits: Limits,
) {
    let open = Arc::new(Connections::default());
    let mut connections = JoinSet::new();
    // Connections refused since the last one accepted (all busy at the cap).
    let mut refused = 0u64;
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    if open.len() >= limits.max_connections && !open.evict_one() {
                        if refused == 0 {
                            tracing::warn!(
                                "API socket: {} connections open, each with a request in progress (the cap); refusing new ones",
                                limits.max_connections
                            );
                        }
                        refused += 1;
                        drop(stream);
                    } else {
                        if refused > 0 {
                            tracing::warn!("API socket: {refused} connections were refused at the cap of {}", limits.max_connections);
                            refused = 0;
                        }
                        connections.spawn(connection(stream, app.clone(), open.register(), limits));
                    }
                }
                Err(e) => {
                    tracing::warn!("API socket: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = &mut stop => break,
        }
    }
    let _ = tokio::time::timeout(DRAIN, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
}

/// Serves one connection until the client hangs up, a request head that
/// started is not complete within the header timeout, or a new connection
/// past the cap evicts it.
async fn connection(stream: UnixStream, app: Router, registered: Registered, limits: Limits) {
    let slot = registered.slot.clone();
    // Fds passed as SCM_RIGHTS go to the request parsed after them: Kata
    // sends `vm.add-net` and its tap fds in one sendmsg.
    let held = HeldFds::default();
    let stream = Watched {
        inner: FdStream::new(stream, held.clone()),
        slot: slot.clone(),
    };
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let busy = slot.begin();
        let app = app.clone();
        let fds = held.take();
        if !fds.is_empty() {
            req.extensions_mut().insert(PassedFds::new(fds));
        }
        async move {
            let (parts, body) = req.into_parts();
            let response = match read_request_body(body).await {
                Ok(bytes) => app
                    .oneshot(Request::from_parts(parts, Body::from(bytes)))
                    .await
                    .unwrap_or_else(|e| match e {}),
                Err(refused) => refused.answer(),
            };
            let response = as_cloud_hypervisor(response);
            Ok::<_, Infallible>(response.map(|body| Body::new(Tracked { body, _busy: busy })))
        }
    });
    // hyper's own header read timeout runs from the moment it waits for a
    // head, idle time included: off, and [`Slot::head_started`] times heads.
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .title_case_headers(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let slot = &registered.slot;
    loop {
        let head_deadline = slot
            .head_started()
            .map(|t| tokio::time::Instant::from_std(t + limits.header_timeout));
        tokio::select! {
            // The connection first: a request it reads now marks it busy
            // before an eviction is looked at.
            biased;
            done = conn.as_mut() => {
                if let Err(e) = done {
                    tracing::debug!("API connection: {e}");
                }
                return;
            }
            () = slot.evict.notified() => {
                if slot.idle() {
                    tracing::debug!("API connection: closed to make room (cap {})", limits.max_connections);
                    return;
                }
                // A request came meanwhile: answer it, then close.
                conn.as_mut().graceful_shutdown();
            }
            // A head began: loop to arm its deadline.
            () = slot.head_begun.notified() => {}
            () = tokio::time::sleep_until(head_deadline.unwrap_or_else(tokio::time::Instant::now)),
                if head_deadline.is_some() => {
                if slot.head_started().is_some_and(|t| t.elapsed() >= limits.header_timeout) {
                    tracing::debug!("API connection: a request head not complete within {:?}; closed", limits.header_timeout);
                    return;
                }
            }
        }
    }
}

/// Why a request's body does not reach the router.
enum RefusedBody {
    /// Over [`MAX_REQUEST_BODY`]; `drained` if all of it was read.
    TooLarge { size: Option<u64>, drained: bool },
    /// The client hung up or sent a malformed chunked body.
    Broken(hyper::Error),
}

/// Reads `body` whole, up to [`MAX_REQUEST_BODY`]; reads and drops a larger
/// one up to [`MAX_DRAINED_BODY`] (see there).
async fn read_request_body(mut body: Incoming) -> Result<Bytes, RefusedBody> {
    let declared = body.size_hint().exact();
    if declared.is_some_and(|n| n > MAX_DRAINED_BODY) {
        return Err(RefusedBody::TooLarge {
            size: declared,
            drained: false,
        });
    }
    let mut kept = Vec::new();
    let mut total: u64 = 0;
    while let Some(frame) = body.frame().await {
        let frame = match frame {
            Ok(frame) => frame,
            Err(e) => return Err(RefusedBody::Broken(e)),
        };
        // Trailers carry nothing an endpoint reads.
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total = total.saturating_add(data.len() as u64);
        if total > MAX_DRAINED_BODY {
            return Err(RefusedBody::TooLarge {
                size: None,
                drained: false,
            });
        }
        if total <= MAX_REQUEST_BODY {
            kept.extend_from_slice(&data);
        }
    }
    if total > MAX_REQUEST_BODY {
        return Err(RefusedBody::TooLarge {
            size: Some(total),
            drained: true,
        });
    }
    Ok(Bytes::from(kept))
}

impl RefusedBody {
    /// The answer to a body that does not reach the router.
    fn answer(self) -> Response<Body> {
        match self {
            RefusedBody::TooLarge { size, drained } => {
                let size = size.map_or_else(
                    || format!("over {MAX_DRAINED_BODY} bytes"),
                    |n| format!("{n} bytes"),
                );
                let mut response = ApiError {
                    status: 413,
                    message: format!(
                        "the request body ({size}) is larger than the API's limit of {MAX_REQUEST_BODY} bytes"
                    ),
                }
                .into_response();
                if !drained {
                    // The rest of the body is still coming: the connection
                    // cannot carry another request.
                    response
                        .headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                response
            }
            RefusedBody::Broken(e) => {
                tracing::debug!("API connection: reading a request body: {e}");
                let mut response =
                    ApiError::bad_request(format!("the request body could not be read: {e}"))
                        .into_response();
                response
                    .headers_mut()
                    .insert(header::CONNECTION, HeaderValue::from_static("close"));
                response
            }
        }
    }
}

/// The reply as micro-http would write it: no reason phrase, and its
/// `Server` header. Except 429: Kata's Cloud Hypervisor driver retries a
/// `vm.resize` only when the error its Go client makes of the reply (the
/// status line's text) contains "Too Many Requests", so 429 carries that
/// reason (ch-remote, which wants the bare code, then reports a status it
/// cannot parse instead of TooManyRequests).
fn as_cloud_hypervisor(mut response: Response<Body>) -> Response<Body> {
    let reason: &'static [u8] = if response.status() == axum::http::StatusCode::TOO_MANY_REQUESTS {
        b"Too Many Requests"
    } else {
        b""
    };
    response
        .extensions_mut()
        .insert(ReasonPhrase::from_static(reason));
    response.headers_mut().insert(
        "server",
        HeaderValue::from_static("Cloud Hypervisor API (dax-vmm)"),
    );
    response
}

#[cfg(test)]
#[path = "http1_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "http1_body_tests.rs"]
mod body_tests;
