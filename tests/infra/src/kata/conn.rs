//! One kept-alive connection used as Go's `http.Transport` uses it for
//! Kata's client: a request is written only after the previous answer was
//! read to its end (the generated client reads every body), an answer ends
//! where its `Content-Length` says (or its last chunk; without either, at
//! EOF, and the connection is not reused), and a connection the server
//! closed while idle is dialled again (counted in [`Connection::dials`],
//! so a test can see that keep-alive held).

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

use super::Request;

/// One answer as Go's `http.ReadResponse` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// The status line after the code (what Go's `resp.Status` holds
    /// after the code: Kata's ResizeVCPUs retries a 429 only when its
    /// error text, this status, contains "Too Many Requests").
    pub status_text: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Response {
    /// A header by name, case-insensitively (Go canonicalises names).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Whether the generated client could decode this answer's body into
    /// a model: it needs a JSON Content-Type (`client.go` `decode`,
    /// `jsonCheck`), or it fails with "undefined response type".
    pub fn go_decodes_json(&self) -> bool {
        if self.body.is_empty() {
            return true;
        }
        // Go's `(?i:(?:application|text)/(?:vnd\.[^;]+\+)?json)`, unanchored.
        let ct = self
            .header("Content-Type")
            .unwrap_or("")
            .to_ascii_lowercase();
        (0..ct.len()).any(|i| {
            let Some(rest) = ["application/", "text/"]
                .iter()
                .find_map(|p| ct.get(i..).and_then(|t| t.strip_prefix(p)))
            else {
                return false;
            };
            rest.starts_with("json")
                || rest.strip_prefix("vnd.").is_some_and(|v| {
                    let segment = v.split(';').next().unwrap_or("");
                    segment.find("+json").is_some_and(|at| at >= 1)
                })
        })
    }
}

pub struct Connection {
    path: PathBuf,
    stream: Option<UnixStream>,
    /// Read but not yet consumed.
    pending: Vec<u8>,
    /// How many times the socket was dialled (1 when keep-alive held).
    pub dials: u32,
}

impl Connection {
    pub fn open(path: &Path) -> io::Result<Connection> {
        let mut c = Connection {
            path: path.to_path_buf(),
            stream: None,
            pending: Vec::new(),
            dials: 0,
        };
        c.dial()?;
        Ok(c)
    }

    fn dial(&mut self) -> io::Result<()> {
        self.stream = Some(UnixStream::connect(&self.path)?);
        self.pending.clear();
        self.dials += 1;
        Ok(())
    }

    /// Writes `request` and reads its answer. A connection found closed
    /// before any of the answer arrived is dialled again once and the
    /// request resent, as Go's transport retries on a dead idle connection.
    pub fn send(&mut self, request: &Request) -> io::Result<Response> {
        self.send_bytes(&request.to_bytes())
    }

    pub fn send_bytes(&mut self, bytes: &[u8]) -> io::Result<Response> {
        if self.stream.is_none() {
            self.dial()?;
        }
        if !self.pending.is_empty() {
            return Err(io::Error::other(format!(
                "unsolicited bytes on the idle connection: {:?}",
                String::from_utf8_lossy(&self.pending)
            )));
        }
        match self.exchange(bytes) {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof && self.pending.is_empty() => {
                self.dial()?;
                self.exchange(bytes)
            }
            other => other,
        }
    }

    fn exchange(&mut self, bytes: &[u8]) -> io::Result<Response> {
        let stream = self.stream.as_mut().expect("dialled");
        if let Err(e) = stream.write_all(bytes) {
            return Err(match e.kind() {
                io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => {
                    io::Error::new(io::ErrorKind::UnexpectedEof, e)
                }
                _ => e,
            });
        }
        let (response, keep) = read_response(stream, &mut self.pending)?;
        if !keep {
            self.stream = None;
            self.pending.clear();
        }
        Ok(response)
    }
}

fn fill(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<bool> {
    let mut chunk = [0u8; 4096];
    let n = r.read(&mut chunk)?;
    buf.extend_from_slice(&chunk[..n]);
    Ok(n > 0)
}

fn eof(what: &str, got: &[u8]) -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("{what}: closed after {:?}", String::from_utf8_lossy(got)),
    )
}

/// Reads one answer from `r`, `buf` holding what was read before and
/// keeping what follows the answer. Returns it and whether the connection
/// may be reused.
pub fn read_response(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<(Response, bool)> {
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        if !fill(r, buf)? {
            return Err(eof("answer head", buf));
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    buf.drain(..head_end + 4);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let bad = || io::Error::other(format!("malformed status line {status_line:?}"));
    let rest = status_line.strip_prefix("HTTP/1.1 ").ok_or_else(bad)?;
    let (code, text) = rest.split_once(' ').unwrap_or((rest, ""));
    let status: u16 = code.parse().map_err(|_| bad())?;
    let mut headers = Vec::new();
    for line in lines {
        let (k, v) = line
            .split_once(':')
            .ok_or_else(|| io::Error::other(format!("malformed header {line:?}")))?;
        headers.push((k.to_string(), v.trim().to_string()));
    }
    let mut response = Response {
        status,
        status_text: format!("{code} {text}"),
        headers,
        body: String::new(),
    };
    let mut keep = !response
        .header("Connection")
        .is_some_and(|v| v.eq_ignore_ascii_case("close"));
    let body: Vec<u8> = if status == 204 || status == 304 || (100..200).contains(&status) {
        Vec::new()
    } else if response
        .header("Transfer-Encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        read_chunked(r, buf)?
    } else if let Some(len) = response.header("Content-Length") {
        let len: usize = len
            .parse()
            .map_err(|_| io::Error::other(format!("bad Content-Length {len:?}")))?;
        while buf.len() < len {
            if !fill(r, buf)? {
                return Err(eof("answer body", buf));
            }
        }
        buf.drain(..len).collect()
    } else {
        // No length: the body runs to EOF and the connection is spent.
        keep = false;
        while fill(r, buf)? {}
        std::mem::take(buf)
    };
    response.body = String::from_utf8_lossy(&body).into_owned();
    Ok((response, keep))
}

fn read_chunked(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = loop {
            if let Some(at) = buf.windows(2).position(|w| w == b"\r\n") {
                break at;
            }
            if !fill(r, buf)? {
                return Err(eof("chunk size", buf));
            }
        };
        let line = String::from_utf8_lossy(&buf[..line_end]).into_owned();
        buf.drain(..line_end + 2);
        let size = usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16)
            .map_err(|_| io::Error::other(format!("bad chunk size {line:?}")))?;
        let need = size
            .checked_add(2)
            .ok_or_else(|| io::Error::other("chunk size overflows"))?;
        while buf.len() < need {
            if !fill(r, buf)? {
                return Err(eof("chunk", buf));
            }
        }
        body.extend(buf.drain(..size));
        buf.drain(..2);
        if size == 0 {
            return Ok(body);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> (Response, bool, Vec<u8>) {
        let mut buf = Vec::new();
        let (r, keep) = read_response(&mut text.as_bytes(), &mut buf).unwrap();
        (r, keep, buf)
    }

    #[test]
    fn answers_end_where_go_ends_them() {
        // Content-Length: what follows stays for the next answer.
        let (r, keep, rest) = read(
            "HTTP/1.1 200 \r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}HTTP",
        );
        assert_eq!((r.status, r.body.as_str(), keep), (200, "{}", true));
        assert_eq!(rest, b"HTTP");
        assert!(r.go_decodes_json());
        assert_eq!(r.status_text, "200 ");
        // 204 has no body whatever follows.
        let (r, keep, rest) = read("HTTP/1.1 204 \r\n\r\nX");
        assert_eq!((r.status, keep, rest.as_slice()), (204, true, &b"X"[..]));
        // Chunked.
        let (r, _, _) =
            read("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n");
        assert_eq!(r.body, "{}");
        // No length: to EOF, and the connection is not reused.
        let (r, keep, _) = read("HTTP/1.1 200 \r\nContent-Type: application/json\r\n\r\n{\"a\":1}");
        assert_eq!((r.body.as_str(), keep), ("{\"a\":1}", false));
        // Connection: close.
        assert!(!read("HTTP/1.1 204 \r\nConnection: close\r\n\r\n").1);
    }

    #[test]
    fn go_decodes_only_json_content_types() {
        let with = |ct: Option<&str>| Response {
            status: 200,
            status_text: "200 ".into(),
            headers: ct
                .map(|c| vec![("content-type".into(), c.into())])
                .unwrap_or_default(),
            body: "{}".into(),
        };
        assert!(with(Some("application/json")).go_decodes_json());
        assert!(with(Some("Application/JSON; charset=utf-8")).go_decodes_json());
        assert!(with(Some("application/vnd.x+json")).go_decodes_json());
        assert!(!with(Some("text/plain")).go_decodes_json());
        assert!(!with(None).go_decodes_json());
    }

    #[test]
    fn a_short_answer_is_an_error() {
        let mut buf = Vec::new();
        let text = "HTTP/1.1 200 \r\nContent-Length: 5\r\n\r\n{}";
        let e = read_response(&mut text.as_bytes(), &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert!(read_response(&mut &b"HTTP/1.0 200 \r\n\r\n"[..], &mut Vec::new()).is_err());
    }
}
