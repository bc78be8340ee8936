//! A small HTTP/1.1 client for the daemons' control sockets (hyper's
//! connection API over a tokio unix stream): one connection per request,
//! bounded in time so a hung daemon cannot hold an API request forever, and
//! in size so an endless answer cannot grow the VMM (or dax-fleet, which
//! reads the VMMs' APIs with it) without bound: a daemon is less trusted
//! than the VMM.

use std::path::Path;
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Body as _;
use hyper::body::Bytes;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

/// How long a daemon's control socket has to answer one request:
/// connecting, the headers and the whole body. (The vhost-user socket's
/// bound is `virtio_devices::vhost_user_fs::VHOST_USER_TIMEOUT`.)
pub const CONTROL_SOCKET_TIMEOUT: Duration = Duration::from_secs(5);

/// The largest answer body read from a peer, bytes. The largest legitimate
/// answer is a daemon's adaptive-event ring (1024 events, each with a path
/// in the share): a few MiB at most; `vm.info` or a policy is far smaller.
pub const MAX_REPLY_BYTES: usize = 16 << 20;

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
    #[error("control socket {path}: the answer's body exceeds the limit of {limit} bytes")]
    TooLarge { path: String, limit: usize },
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
    request_limited(socket, method, uri, body, MAX_REPLY_BYTES).await
}

/// [`request`] with an answer body of at most `limit` bytes.
pub async fn request_limited(
    socket: &Path,
    method: &str,
    uri: &str,
    body: Option<String>,
    limit: usize,
) -> Result<Answer, ClientError> {
    request_within(socket, method, uri, body, limit, CONTROL_SOCKET_TIMEOUT).await
}

/// [`request_limited`] answered within `timeout` rather than
/// [`CONTROL_SOCKET_TIMEOUT`]: for the VMM's calls that answer only when a
/// long operation is over (`vm.send-migration`, `vm.receive-migration`).
pub async fn request_within(
    socket: &Path,
    method: &str,
    uri: &str,
    body: Option<String>,
    limit: usize,
    timeout: Duration,
) -> Result<Answer, ClientError> {
    let path = socket.display().to_string();
    let exchange = exchange(socket, &path, method, uri, body, limit);
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(ClientError::Timeout { path, timeout }),
    }
}

async fn exchange(
    socket: &Path,
    path: &str,
    method: &str,
    uri: &str,
    body: Option<String>,
    limit: usize,
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
    // The connection ends with the exchange, however that ends (answered,
    // over the limit, timed out): nothing is read from the daemon after.
    let _conn = AbortOnDrop(tokio::spawn(conn));
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
    let too_large = || ClientError::TooLarge {
        path: path.into(),
        limit,
    };
    // A Content-Length over the limit fails before anything is read.
    if resp.body().size_hint().lower() > limit as u64 {
        return Err(too_large());
    }
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    while let Some(frame) = body.frame().await {
        if let Ok(data) = frame.map_err(http)?.into_data() {
            let len = bytes.len().checked_add(data.len()).ok_or_else(too_large)?;
            if len > limit {
                return Err(too_large());
            }
            bytes.extend_from_slice(&data);
        }
    }
    Ok(Answer {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// Aborts the connection task when dropped.
struct AbortOnDrop(tokio::task::JoinHandle<Result<(), hyper::Error>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;
    use std::path::PathBuf;
    use std::thread::JoinHandle;

    use super::*;

    /// A fake control socket that answers one request with `head` and then
    /// whatever `body` writes; the thread answers how many body bytes it
    /// got out before the client hung up.
    fn fake_daemon(
        name: &str,
        head: &'static str,
        body: fn(&mut std::os::unix::net::UnixStream) -> u64,
    ) -> (PathBuf, JoinHandle<u64>) {
        let dir = std::env::temp_dir().join(format!("api-client-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("control.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let thread = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut request = Vec::new();
            let mut byte = [0u8; 1];
            while !request.ends_with(b"\r\n\r\n") && s.read(&mut byte).unwrap() == 1 {
                request.push(byte[0]);
            }
            s.write_all(head.as_bytes()).unwrap();
            body(&mut s)
        });
        (path, thread)
    }

    /// Chunks of 64 KiB until the client hangs up.
    fn endless(s: &mut std::os::unix::net::UnixStream) -> u64 {
        let chunk = format!("10000\r\n{}\r\n", "x".repeat(0x10000));
        let mut sent = 0u64;
        while s.write_all(chunk.as_bytes()).is_ok() {
            sent += 0x10000;
        }
        sent
    }

    /// One request on a runtime of its own, dropped before the fake daemon
    /// is joined (so the aborted connection task is gone and the socket
    /// closed).
    fn call(path: &Path, uri: &str, limit: usize) -> Result<Answer, ClientError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(request_limited(path, "GET", uri, None, limit))
    }

    #[test]
    fn an_endless_answer_fails_at_the_limit() {
        let head = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n";
        let (path, daemon) = fake_daemon("endless", head, endless);
        let e = call(&path, "/api/v1/policy", MAX_REPLY_BYTES).unwrap_err();
        assert!(
            matches!(e, ClientError::TooLarge { limit, .. } if limit == MAX_REPLY_BYTES),
            "{e}"
        );
        assert!(
            e.to_string()
                .ends_with("the answer's body exceeds the limit of 16777216 bytes"),
            "{e}"
        );
        // The client hung up at the limit: the daemon got out at most the
        // limit and what the socket buffers held, not an endless body.
        let sent = daemon.join().unwrap();
        assert!(sent < 2 * MAX_REPLY_BYTES as u64, "{sent} bytes were sent");
    }

    #[test]
    fn a_content_length_over_the_limit_fails_before_the_body_is_read() {
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 1000000000000\r\n\r\n";
        let (path, daemon) = fake_daemon("length", head, endless);
        let e = call(&path, "/api/v1/stats", MAX_REPLY_BYTES).unwrap_err();
        assert!(matches!(e, ClientError::TooLarge { .. }), "{e}");
        daemon.join().unwrap();
    }

    #[test]
    fn request_within_waits_for_the_time_given_and_no_longer() {
        // A peer that reads the request and never answers (it waits for
        // the client to hang up).
        let (path, daemon) = fake_daemon("silent", "", |s| {
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
            0
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let patience = Duration::from_millis(100);
        let e = runtime
            .block_on(request_within(
                &path,
                "PUT",
                "/api/v1/vm.send-migration",
                None,
                1024,
                patience,
            ))
            .unwrap_err();
        assert!(
            matches!(e, ClientError::Timeout { timeout, .. } if timeout == patience),
            "{e}"
        );
        drop(runtime);
        daemon.join().unwrap();
    }

    #[test]
    fn an_answer_within_the_limit_is_read_whole() {
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 1024\r\n\r\n";
        let (path, daemon) = fake_daemon("within", head, |s| {
            s.write_all(&[b'y'; 1024]).unwrap();
            1024
        });
        let a = call(&path, "/api/v1/stats", 1024).unwrap();
        assert_eq!((a.status, a.body.len()), (200, 1024));
        daemon.join().unwrap();
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 1025\r\n\r\n";
        let (path, daemon) = fake_daemon("over", head, |s| {
            let _ = s.write_all(&[b'y'; 1025]);
            1025
        });
        let e = call(&path, "/api/v1/stats", 1024).unwrap_err();
        assert!(
            matches!(e, ClientError::TooLarge { limit: 1024, .. }),
            "{e}"
        );
        daemon.join().unwrap();
    }
}
