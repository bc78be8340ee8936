//! A small HTTP/1.1 client for the daemons' control sockets (hyper's
//! connection API over a tokio unix stream): one connection per request,
//! bounded in time so a hung daemon cannot hold an API request forever.

use std::path::Path;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// How long a daemon has to answer.
pub const DAEMON_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("control socket {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("control socket {path}: {source}")]
    Http { path: String, source: hyper::Error },
    #[error("control socket {path}: no answer within {timeout:?}")]
    Timeout { path: String, timeout: Duration },
    #[error("control socket {path}: building the request: {source}")]
    Request {
        path: String,
        source: hyper::http::Error,
    },
}

/// A daemon's answer: status and body text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// Sends one request to the HTTP server on the unix socket `socket`.
pub async fn request(
    socket: &Path,
    method: &str,
    uri: &str,
    body: Option<String>,
) -> Result<Answer, ClientError> {
    let path = socket.display().to_string();
    match tokio::time::timeout(DAEMON_TIMEOUT, exchange(socket, &path, method, uri, body)).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Timeout {
            path,
            timeout: DAEMON_TIMEOUT,
        }),
    }
}

async fn exchange(
    socket: &Path,
    path: &str,
    method: &str,
    uri: &str,
    body: Option<String>,
) -> Result<Answer, ClientError> {
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|source| ClientError::Connect {
            path: path.into(),
            source,
        })?;
    let http = |source| ClientError::Http {
        path: path.into(),
        source,
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    // The connection task ends when the exchange does (or the daemon hangs up).
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("host", "localhost");
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|source| ClientError::Request {
            path: path.into(),
            source,
        })?;
    let resp = sender.send_request(req).await.map_err(http)?;
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.map_err(http)?.to_bytes();
    Ok(Answer {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}
