//! A client that reads replies exactly as Cloud Hypervisor's `api_client`
//! (the crate ch-remote is built on) does, so the API tests fail where
//! ch-remote would. Written from reading its source (`api_client/src/lib.rs`,
//! v53 line), not copied:
//!
//! - the request: `<METHOD> /api/v1/<command> HTTP/1.1`, `Host: localhost`,
//!   `Accept: */*`, `Content-Length` only with a body, no Content-Type, no
//!   `Connection: close` (the connection stays open; the client stops
//!   reading once it has what the headers promised);
//! - written in four writes, as `api_client` does: the request line with
//!   `Host` and `Accept`, the `Content-Length` line, the blank line, the
//!   body; nothing is read before the last (a server that answers after
//!   the head and closes gives it a broken pipe);
//! - the reply is read 256 bytes at a time, as UTF-8 (a reply that is not
//!   makes ch-remote panic; here it is an error);
//! - the status is the text between `HTTP/1.1 ` and the first `\r`,
//!   trimmed, parsed as an integer: `200 OK` fails;
//! - the body is found only through a header spelled exactly
//!   `Content-Length: `; without one, reading stops at the end of the
//!   headers and there is no body;
//! - 100, 200 and 204 are success; every other code is an error carrying
//!   the body.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

#[derive(Debug, PartialEq, Eq)]
pub enum ChError {
    /// The socket failed (connect, read, write).
    Socket(String),
    /// "Error parsing HTTP status code": what stood where the code should be.
    StatusCodeParsing(String),
    MissingProtocol,
    ContentLengthParsing(String),
    /// A reply that is not UTF-8 (ch-remote panics on it).
    NotUtf8,
    /// "Server responded with error": the code and the body, if any.
    ServerResponse(u16, Option<String>),
}

/// A successful reply: its code (100, 200 or 204) and body, if any.
pub type Reply = (u16, Option<String>);

/// One ch-remote request: `command` is e.g. `vm.add-fs` or `vmm.ping`.
pub fn request(
    socket: &Path,
    method: &str,
    command: &str,
    body: Option<&str>,
) -> Result<Reply, ChError> {
    request_path(socket, method, &format!("/api/v1/{command}"), body)
}

/// The same for any path (and query), for requests ch-remote does not make.
pub fn request_path(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Reply, ChError> {
    let mut s = UnixStream::connect(socket).map_err(|e| ChError::Socket(e.to_string()))?;
    let mut writes = vec![format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n"
    )];
    if let Some(b) = body {
        writes.push(format!("Content-Length: {}\r\n", b.len()));
    }
    writes.push("\r\n".to_string());
    if let Some(b) = body {
        writes.push(b.to_string());
    }
    for w in writes {
        s.write_all(w.as_bytes())
            .map_err(|e| ChError::Socket(e.to_string()))?;
    }
    parse_reply(&mut s)
}

/// The value of header `name` as `api_client` finds it: the text after the
/// first occurrence of exactly `<name>: `, up to the next `\r`.
fn header<'a>(reply: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}: ");
    let at = reply.find(&key)?;
    let rest = &reply[at + key.len()..];
    Some(&rest[..rest.find('\r').unwrap_or(rest.len())])
}

pub fn parse_reply(socket: &mut dyn Read) -> Result<Reply, ChError> {
    let mut reply = String::new();
    let mut body_at = None;
    let mut length: Option<usize> = None;
    loop {
        let mut chunk = [0u8; 256];
        let n = socket
            .read(&mut chunk)
            .map_err(|e| ChError::Socket(e.to_string()))?;
        if n == 0 {
            break;
        }
        reply.push_str(std::str::from_utf8(&chunk[..n]).map_err(|_| ChError::NotUtf8)?);
        if let Some(end) = reply.find("\r\n\r\n") {
            body_at = Some(end + 4);
            length = match header(&reply, "Content-Length") {
                Some(v) => Some(
                    v.trim()
                        .parse()
                        .map_err(|_| ChError::ContentLengthParsing(v.to_string()))?,
                ),
                None => None,
            };
            if length.is_none() {
                break;
            }
        }
        if let (Some(at), Some(len)) = (body_at, length) {
            if reply.len() >= at + len {
                break;
            }
        }
    }
    let body = length.and(body_at.map(|at| reply[at..].to_string()));
    let start = reply.find("HTTP/1.1").ok_or(ChError::MissingProtocol)?;
    let line_end = reply[start..].find('\r').map_or(reply.len(), |e| start + e);
    let code_text = reply
        .get(start + "HTTP/1.1 ".len()..line_end)
        .unwrap_or_default();
    let code: u16 = code_text
        .trim()
        .parse()
        .map_err(|_| ChError::StatusCodeParsing(code_text.to_string()))?;
    match code {
        100 | 200 | 204 => Ok((code, body)),
        _ => Err(ChError::ServerResponse(code, body)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Option<String>, ChError> {
        parse_reply(&mut text.as_bytes()).map(|(_, body)| body)
    }

    #[test]
    fn reads_replies_as_api_client_does() {
        // micro-http's form.
        assert_eq!(
            parse("HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\n{}"),
            Ok(Some("{}".into()))
        );
        assert_eq!(parse("HTTP/1.1 204 \r\n\r\n"), Ok(None));
        // A reason phrase breaks it, as it breaks ch-remote.
        assert_eq!(
            parse("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"),
            Err(ChError::StatusCodeParsing("200 OK".into()))
        );
        // Lower-case content-length: the body is not seen.
        assert_eq!(
            parse("HTTP/1.1 200 \r\ncontent-length: 2\r\n\r\n{}"),
            Ok(None)
        );
        assert_eq!(
            parse("HTTP/1.1 400 \r\nContent-Length: 7\r\n\r\n[\"bad\"]"),
            Err(ChError::ServerResponse(400, Some("[\"bad\"]".into())))
        );
        assert_eq!(parse("garbage\r\n\r\n"), Err(ChError::MissingProtocol));
    }
}
