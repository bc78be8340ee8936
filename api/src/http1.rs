//! Serves the router over HTTP/1.1 the way Cloud Hypervisor's server
//! (micro-http) answers, because its clients parse replies strictly:
//! ch-remote's `api_client` reads the status as the integer between
//! `HTTP/1.1 ` and the first `\r` (so `200 OK` is an error; micro-http
//! writes `HTTP/1.1 200 \r\n`), and finds a body only through a header
//! spelled exactly `Content-Length: `. So every reply gets an empty reason
//! phrase and title-case header names.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::ext::ReasonPhrase;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::connections::{Connections, Registered, Tracked};
use crate::passed_fds::{FdStream, HeldFds, PassedFds};

/// How long answers in flight may take to reach their clients once the
/// server is told to stop (vmm.shutdown's own answer among them).
const DRAIN: Duration = Duration::from_secs(2);

/// What the API socket allows its clients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A new connection's first request head must be complete within this
    /// (a client that connects and sends nothing, or half a head, is closed).
    pub header_timeout: Duration,
    /// A kept-alive connection may wait this long for its next request
    /// head to be complete (hyper's header read timeout, whose timer runs
    /// from the moment hyper waits for a head: the idle time included).
    /// Generous: Kata keeps one connection for a long sequence of calls.
    pub idle_timeout: Duration,
    /// Open connections at most; past it a new one closes an idle one
    /// (see [`crate::connections`]).
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
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
                            log::warn!(
                                "API socket: {} connections open, each with a request in progress (the cap); refusing new ones",
                                limits.max_connections
                            );
                        }
                        refused += 1;
                        drop(stream);
                    } else {
                        if refused > 0 {
                            log::warn!("API socket: {refused} connections were refused at the cap of {}", limits.max_connections);
                            refused = 0;
                        }
                        connections.spawn(connection(stream, app.clone(), open.register(), limits));
                    }
                }
                Err(e) => {
                    log::warn!("API socket: accept: {e}");
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

/// Serves one connection until the client hangs up, a timeout of `limits`
/// closes it, or a new connection past the cap evicts it.
async fn connection(stream: UnixStream, app: Router, registered: Registered, limits: Limits) {
    let slot = registered.slot.clone();
    // Fds passed as SCM_RIGHTS go to the request parsed after them: Kata
    // sends `vm.add-net` and its tap fds in one sendmsg.
    let held = HeldFds::default();
    let stream = FdStream::new(stream, held.clone());
    let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
        let busy = slot.begin();
        let app = app.clone();
        let fds = held.take();
        if !fds.is_empty() {
            req.extensions_mut().insert(PassedFds::new(fds));
        }
        async move {
            let response = app
                .oneshot(req.map(Body::new))
                .await
                .unwrap_or_else(|e| match e {});
            let response = as_cloud_hypervisor(response);
            Ok::<_, Infallible>(response.map(|body| Body::new(Tracked { body, _busy: busy })))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .title_case_headers(true)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let slot = &registered.slot;
    let first_head = tokio::time::sleep(limits.header_timeout);
    tokio::pin!(first_head);
    loop {
        tokio::select! {
            // The connection first: a request it reads now marks it busy
            // before an eviction is looked at.
            biased;
            done = conn.as_mut() => {
                if let Err(e) = done {
                    log::debug!("API connection: {e}");
                }
                return;
            }
            () = slot.evict.notified() => {
                if slot.idle() {
                    log::debug!("API connection: closed to make room (cap {})", limits.max_connections);
                    return;
                }
                // A request came meanwhile: answer it, then close.
                conn.as_mut().graceful_shutdown();
            }
            () = &mut first_head, if !slot.served() => {
                if !slot.served() {
                    log::debug!("API connection: no complete request within {:?}; closed", limits.header_timeout);
                    return;
                }
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
