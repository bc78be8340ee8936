//! Serves the router over HTTP/1.1 the way Cloud Hypervisor's server
//! (micro-http) answers, because its clients parse replies strictly:
//! ch-remote's `api_client` reads the status as the integer between
//! `HTTP/1.1 ` and the first `\r` (so `200 OK` is an error; micro-http
//! writes `HTTP/1.1 200 \r\n`), and finds a body only through a header
//! spelled exactly `Content-Length: `. So every reply gets an empty reason
//! phrase and title-case header names.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderValue, Request, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::ext::ReasonPhrase;
use hyper_util::rt::TokioIo;
use tokio::net::UnixListener;
use tokio::task::JoinSet;
use tower::ServiceExt;

/// How long answers in flight may take to reach their clients once the
/// server is told to stop (vmm.shutdown's own answer among them).
const DRAIN: Duration = Duration::from_secs(2);

/// Accepts connections until `stop` resolves, then lets open ones finish
/// for at most [`DRAIN`].
pub async fn serve(
    listener: UnixListener,
    app: Router,
    stop: impl std::future::Future<Output = ()>,
) {
    let mut connections = JoinSet::new();
    tokio::pin!(stop);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let app = app.clone();
                    connections.spawn(async move {
                        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                            let app = app.clone();
                            async move { Ok::<_, Infallible>(as_cloud_hypervisor(app.oneshot(req.map(Body::new)).await.unwrap_or_else(|e| match e {}))) }
                        });
                        let conn = hyper::server::conn::http1::Builder::new()
                            .title_case_headers(true)
                            .serve_connection(TokioIo::new(stream), service);
                        if let Err(e) = conn.await {
                            log::debug!("API connection: {e}");
                        }
                    });
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

/// The reply as micro-http would write it: no reason phrase, and its
/// `Server` header.
fn as_cloud_hypervisor(mut response: Response<Body>) -> Response<Body> {
    response
        .extensions_mut()
        .insert(ReasonPhrase::from_static(b""));
    response.headers_mut().insert(
        "server",
        HeaderValue::from_static("Cloud Hypervisor API (dax-vmm)"),
    );
    response
}
