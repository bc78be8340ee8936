//! Answers given before an endpoint reads the body (501, 404, 405, 400,
//! 413), against [`super::serve`] on a unix socket, with the bytes and the
//! write pattern of the real clients: ch-remote (Cloud Hypervisor's
//! `api_client`) and Kata's Go client on one kept-alive connection.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;

use super::tests::{closed_by_server, ping, Server};
use super::{Limits, MAX_DRAINED_BODY, MAX_REQUEST_BODY};
use crate::routes::UNSUPPORTED;

/// A body no socket buffer holds (a unix stream socket takes a few hundred
/// KiB): a server that answers and closes without reading it leaves the
/// client's write with a broken pipe, every time.
const LARGER_THAN_A_SOCKET_BUFFER: usize = 1 << 20;

/// ch-remote's request as its `api_client` writes it
/// (`simple_api_full_command_with_fds_and_response`): the request line with
/// `Host` and `Accept` (one `sendmsg`), then `Content-Length`, the blank
/// line and the body, each a write of its own; nothing is read before all
/// of them are written.
fn ch_remote_write(
    s: &mut UnixStream,
    method: &str,
    endpoint: &str,
    body: Option<&str>,
) -> std::io::Result<()> {
    s.write_all(
        format!("{method} /api/v1/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n")
            .as_bytes(),
    )?;
    if let Some(body) = body {
        s.write_all(format!("Content-Length: {}\r\n", body.len()).as_bytes())?;
    }
    s.write_all(b"\r\n")?;
    if let Some(body) = body {
        s.write_all(body.as_bytes())?;
    }
    s.flush()
}

/// The reply as `api_client`'s `parse_http_response` reads it: 256 bytes at
/// a time until the head, then the `Content-Length: ` body; the status is
/// what lies between `HTTP/1.1 ` and the first `\r`, trimmed. None for the
/// body when the head has no `Content-Length: `.
fn ch_remote_read(s: &mut UnixStream) -> std::io::Result<(u16, Option<String>)> {
    let mut res = String::new();
    let mut body_offset = None;
    let mut content_length = None;
    loop {
        let mut bytes = [0u8; 256];
        let count = s.read(&mut bytes)?;
        if count == 0 {
            break;
        }
        res.push_str(std::str::from_utf8(&bytes[..count]).expect("a UTF-8 reply"));
        if let Some(o) = res.find("\r\n\r\n") {
            body_offset = Some(o + 4);
            content_length = res.find("Content-Length: ").map(|o| {
                let rest = &res[o + "Content-Length: ".len()..];
                rest[..rest.find('\r').unwrap()]
                    .trim()
                    .parse::<usize>()
                    .unwrap()
            });
            if content_length.is_none() {
                break;
            }
        }
        if let (Some(o), Some(n)) = (body_offset, content_length) {
            if res.len() >= o + n {
                break;
            }
        }
    }
    let at = res.find("HTTP/1.1").expect("a status line");
    let status = res[at + "HTTP/1.1 ".len()..res[at..].find('\r').unwrap()]
        .trim()
        .parse()
        .expect("an integer status (no reason phrase)");
    let body = content_length.and(body_offset.map(|o| res[o..].to_string()));
    Ok((status, body))
}

/// One ch-remote command on a connection of its own, as ch-remote runs it.
fn ch_remote(server: &Server, method: &str, endpoint: &str, body: Option<&str>) -> (u16, String) {
    let mut s = server.connect();
    let shown = body.map_or(0, str::len);
    ch_remote_write(&mut s, method, endpoint, body).unwrap_or_else(|e| {
        panic!("{method} {endpoint} with a {shown}-byte body: writing the request: {e}")
    });
    let (status, body) = ch_remote_read(&mut s).unwrap_or_else(|e| {
        panic!("{method} {endpoint} with a {shown}-byte body: reading the answer: {e}")
    });
    (status, body.unwrap_or_default())
}

/// What ch-remote sends for each command this VMM does not support (the
/// JSON its serde writes for the command's arguments; none for `nmi`).
fn ch_remote_body(endpoint: &str) -> Option<&'static str> {
    Some(match endpoint {
        "vm.add-device" => {
            r#"{"path":"/sys/bus/pci/devices/0000:01:00.0/","iommu":false,"id":null,"pci_segment":0,"x_nv_gpudirect_clique":null}"#
        }
        "vm.add-generic-vhost-user" => {
            r#"{"socket":"/tmp/gvu.sock","num_queues":1,"queue_size":1024,"virtio_id":26,"id":null,"pci_segment":0}"#
        }
        "vm.add-vdpa" => {
            r#"{"path":"/dev/vhost-vdpa-0","num_queues":1,"iommu":false,"id":null,"pci_segment":0}"#
        }
        "vm.add-user-device" => r#"{"socket":"/tmp/vfio-user.sock","id":null,"pci_segment":0}"#,
        "vm.resize" => r#"{"desired_vcpus":2,"desired_ram":null,"desired_balloon":null}"#,
        "vm.resize-disk" => r#"{"id":"_disk0","desired_size":2147483648}"#,
        "vm.resize-zone" => r#"{"id":"mem0","desired_ram":1073741824}"#,
        "vm.coredump" => r#"{"destination_url":"file:///tmp/core"}"#,
        _ => return None,
    })
}

/// `body` with blank space after it, still the same JSON, `size` bytes long.
fn padded(body: &str, size: usize) -> String {
    format!("{body}{}", " ".repeat(size.saturating_sub(body.len())))
}

#[test]
fn every_unsupported_endpoint_answers_ch_remote_501_with_its_reason() {
    let server = Server::start("unsupported", Limits::default());
    for &(endpoint, why) in UNSUPPORTED {
        let method = if endpoint == "vm.balloon-stats" {
            "GET"
        } else {
            "PUT"
        };
        let body = ch_remote_body(endpoint);
        let mut bodies = vec![body.map(str::to_string)];
        if let Some(b) = body {
            bodies.push(Some(padded(b, LARGER_THAN_A_SOCKET_BUFFER)));
        }
        for body in bodies {
            let (status, answer) = ch_remote(&server, method, endpoint, body.as_deref());
            assert_eq!(status, 501, "{endpoint}: {answer}");
            let reasons: Vec<String> = serde_json::from_str(&answer).unwrap();
            assert_eq!(reasons.len(), 1, "{answer}");
            assert!(
                reasons[0].starts_with(&format!("{endpoint}: not supported by dax-vmm: {why}")),
                "{answer}"
            );
        }
    }
}

#[test]
fn answers_the_router_gives_without_reading_the_body_still_reach_ch_remote() {
    let server = Server::start("early", Limits::default());
    let body = padded(r#"{"id":"fs0"}"#, LARGER_THAN_A_SOCKET_BUFFER);
    for (endpoint, status, says) in [
        ("vm.frobnicate", 404, "no endpoint /api/v1/vm.frobnicate"),
        ("vm.info", 405, "/api/v1/vm.info does not take PUT"),
        // The query is refused before a handler would read the body.
        ("vm.dax-policy?id=fs0&bogus=1", 400, "bogus"),
    ] {
        let (got, answer) = ch_remote(&server, "PUT", endpoint, Some(&body));
        assert_eq!(got, status, "{endpoint}: {answer}");
        let reasons: Vec<String> = serde_json::from_str(&answer).unwrap();
        assert!(reasons[0].contains(says), "{endpoint}: {answer}");
    }
}

#[test]
fn a_body_over_the_limit_is_read_then_refused_with_413_and_the_connection_kept() {
    let server = Server::start("too-large", Limits::default());
    let size = usize::try_from(MAX_REQUEST_BODY).unwrap() + 1;
    let mut s = server.connect();
    ch_remote_write(&mut s, "PUT", "vm.add-fs", Some(&padded("{}", size)))
        .expect("the whole body was read");
    let (status, answer) = ch_remote_read(&mut s).unwrap();
    assert_eq!(status, 413, "{answer:?}");
    let answer = answer.unwrap();
    assert!(
        answer.contains(&format!("({size} bytes)"))
            && answer.contains(&format!("limit of {MAX_REQUEST_BODY} bytes")),
        "{answer}"
    );
    // Read whole, the refused body leaves the connection in step.
    assert_eq!(ping(&mut s).0, "HTTP/1.1 200 ");
}

#[test]
fn a_body_past_the_drain_bound_is_refused_at_once_and_the_connection_closed() {
    let server = Server::start("huge", Limits::default());
    let mut s = server.connect();
    // Only the head: a server that read before answering would wait.
    let declared = MAX_DRAINED_BODY + 1;
    s.write_all(
        format!(
            "PUT /api/v1/vm.add-fs HTTP/1.1\r\nHost: localhost\r\nContent-Length: {declared}\r\n\r\n{{"
        )
        .as_bytes(),
    )
    .unwrap();
    let mut reader = Replies::new(s.try_clone().unwrap());
    let (head, body) = reader.next();
    assert!(head.starts_with("HTTP/1.1 413 \r\n"), "{head}");
    assert!(head.contains("Connection: close\r\n"), "{head}");
    assert!(body.contains(&format!("({declared} bytes)")), "{body}");
    assert!(closed_by_server(&mut s));
}

/// Replies read one after the other from a kept-alive connection.
struct Replies {
    s: UnixStream,
    pending: Vec<u8>,
}

impl Replies {
    fn new(s: UnixStream) -> Self {
        Replies {
            s,
            pending: Vec::new(),
        }
    }

    /// The next reply's head and body.
    fn next(&mut self) -> (String, String) {
        loop {
            if let Some(end) = self.pending.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8(self.pending[..end + 4].to_vec()).unwrap();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .map_or(0, |n| n.parse().unwrap());
                if self.pending.len() >= end + 4 + length {
                    let body = String::from_utf8(self.pending[end + 4..end + 4 + length].to_vec())
                        .unwrap();
                    self.pending.drain(..end + 4 + length);
                    return (head, body);
                }
            }
            let mut buf = [0u8; 4096];
            let n = self.s.read(&mut buf).expect("a reply");
            assert!(
                n > 0,
                "the server closed the connection; pending: {:?}",
                String::from_utf8_lossy(&self.pending)
            );
            self.pending.extend_from_slice(&buf[..n]);
        }
    }
}

/// A request as Go's net/http writes it for Kata's openapi client: head and
/// body through one buffered writer, so one write.
fn go_request(method: &str, path: &str, body: Option<&str>) -> String {
    match body {
        Some(body) => format!(
            "{method} /api/v1/{path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: OpenAPI-Generator/1.0.0/go\r\n\
             Content-Length: {}\r\nAccept: application/json\r\nContent-Type: application/json\r\n\
             Accept-Encoding: gzip\r\n\r\n{body}",
            body.len()
        ),
        None => format!(
            "{method} /api/v1/{path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: OpenAPI-Generator/1.0.0/go\r\n\
             Accept: application/json\r\nAccept-Encoding: gzip\r\n\r\n"
        ),
    }
}

/// One round of requests that the API answers by itself (no VMM behind
/// it), with the status each must get.
fn round() -> Vec<(String, u16)> {
    let resize = r#"{"desired_vcpus":2}"#;
    let too_large = padded("{}", usize::try_from(MAX_REQUEST_BODY).unwrap() + 1);
    vec![
        (go_request("GET", "vmm.ping", None), 200),
        (go_request("PUT", "vm.resize-zone", Some(resize)), 501),
        (
            go_request(
                "PUT",
                "vm.coredump",
                Some(r#"{"destination_url":"file:///s"}"#),
            ),
            501,
        ),
        (go_request("GET", "vm.balloon-stats", None), 501),
        (go_request("PUT", "vm.frobnicate", Some(resize)), 404),
        (go_request("PUT", "vm.info", Some(resize)), 405),
        (go_request("PUT", "vm.create", Some("not json")), 400),
        (go_request("PUT", "vm.dax-policy?bogus=1", Some("{}")), 400),
        (go_request("PUT", "vm.add-fs", Some(&too_large)), 413),
        (go_request("GET", "vmm.ping", None), 200),
    ]
}

#[test]
fn one_kept_alive_connection_answers_a_long_sequence_in_order() {
    let server = Server::start("sequence", Limits::default());
    let mut s = server.connect();
    let mut replies = Replies::new(s.try_clone().unwrap());
    // One request at a time, as Kata's client sends them...
    for i in 0..20 {
        for (request, status) in round() {
            s.write_all(request.as_bytes()).unwrap();
            let (head, body) = replies.next();
            let line = request.lines().next().unwrap();
            assert!(
                head.starts_with(&format!("HTTP/1.1 {status} \r\n")),
                "round {i}, {line}: {head}{body}"
            );
        }
    }
    // ...and pipelined: every answer still comes, in the order asked.
    let rounds: Vec<(String, u16)> = (0..5).flat_map(|_| round()).collect();
    let all: String = rounds.iter().map(|(r, _)| r.as_str()).collect();
    let writer = {
        let mut s = s.try_clone().unwrap();
        std::thread::spawn(move || s.write_all(all.as_bytes()))
    };
    for (request, status) in &rounds {
        let (head, body) = replies.next();
        let line = request.lines().next().unwrap();
        assert!(
            head.starts_with(&format!("HTTP/1.1 {status} \r\n")),
            "pipelined {line}: {head}{body}"
        );
    }
    writer.join().unwrap().unwrap();
    assert_eq!(ping(&mut s).0, "HTTP/1.1 200 ");
}
