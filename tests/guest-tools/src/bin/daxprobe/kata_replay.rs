//! `daxprobe kata-replay SOCKET SCRIPT`: replays Kata's sandbox start
//! against the API socket as Kata's Go runtime sends it (the bytes are
//! `test_infra::kata`'s): every call on ONE kept-alive connection, each
//! answer read to its end before the next call, except vm.add-net, which
//! goes on a fresh connection with the tap fd as clh.go's
//! `vmAddNetPutRequest` sends it.
//!
//! SCRIPT has one step a line (`#` starts a comment): `NAME CALL ARGS`.
//!
//! ```text
//! NAME ping                      vmm.ping
//! NAME create FILE               vm.create, the body FILE holds (Go's JSON; a final newline is
//!                                dropped: the request adds Go's own)
//! NAME info                      vm.info
//! NAME add-net TAP MAC           vm.add-net with TAP's fd, on its own connection
//! NAME boot                      vm.boot
//! NAME resize-vcpus N            ResizeVCPUs(N): vm.info (NAME_info), then vm.resize with
//!                                desired_vcpus, a 429 retried only when its status text says
//!                                "Too Many Requests", 20 attempts 20 ms apart (NAME_attempts)
//! NAME resize-memory MIB [BLOCK_MIB]  updateResources' memory loop towards MIB: vm.info for
//!                                GetTotalMemoryMB (NAME_total<i>), ResizeMemory's vm.info
//!                                (NAME_info<i>) and vm.resize with desired_ram (NAME<i>)
//! NAME get CALL                  any GET, written as vm.info is (e.g. vm.counters)
//! NAME shutdown                  terminate: vmm.ping (NAME_ping), then vmm.shutdown
//! NAME wait FILE TEXT SECONDS     no request: waits until FILE holds TEXT (a guest marker in
//!                                the serial log, standing in for Kata's wait on its agent);
//!                                prints NAME=seen or NAME=timeout
//! ```
//!
//! Prints `@@HOST kata_NAME=status=<code> body=<body>` per request (body
//! on one line), `@@HOST kata_NAME_decode=undefined response type` where
//! the Go client could not decode a body (no JSON Content-Type),
//! `@@HOST kata_NAME_error=<why>` where Kata would stop, and at the end
//! `@@HOST kata_connections=<n>`: how many times the kept-alive
//! connection was dialled (1 when keep-alive held).

use std::path::Path;
use std::time::Duration;

use test_infra::kata::{self, conn::Connection, conn::Response};

use super::{fail, kata_net};

fn report(step: &str, r: &Response) {
    println!(
        "@@HOST kata_{step}=status={} body={}",
        r.status,
        r.body.replace('\n', "\\n")
    );
    if (200..300).contains(&r.status) && !r.go_decodes_json() {
        println!("@@HOST kata_{step}_decode=undefined response type");
    }
}

fn send(c: &mut Connection, step: &str, request: &kata::Request) -> Response {
    let r = c
        .send(request)
        .unwrap_or_else(|e| fail(format!("{step}: {}: {e}", request.call)));
    report(step, &r);
    r
}

/// vm.info's body as the Go client decodes it (None where it would fail).
fn info(c: &mut Connection, step: &str) -> Option<serde_json::Value> {
    let r = send(c, step, &kata::vm_info());
    if r.status >= 300 || !r.go_decodes_json() {
        println!("@@HOST kata_{step}_error=vm.info failed");
        return None;
    }
    serde_json::from_str(&r.body).ok()
}

fn resize_vcpus(c: &mut Connection, step: &str, requested: u32) {
    let Some(vm) = info(c, &format!("{step}_info")) else {
        return;
    };
    let desired = match kata::resize_vcpus_plan(&vm, requested) {
        Ok((_, desired)) => desired,
        Err(e) => return println!("@@HOST kata_{step}_error={e}"),
    };
    let desired = u32::try_from(desired).unwrap_or(u32::MAX);
    for attempt in 1..=20 {
        let r = send(c, step, &kata::vm_resize_vcpus(desired));
        if r.status < 300 || !r.status_text.contains("Too Many Requests") || attempt == 20 {
            println!("@@HOST kata_{step}_attempts={attempt}");
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn resize_memory(c: &mut Connection, step: &str, final_mib: u64, block_mib: u64) {
    // Kata's loop ends when a step reaches the target; a bound keeps a
    // VMM that never grows from holding the replay forever.
    for i in 0..64 {
        let Some(vm) = info(c, &format!("{step}_total{i}")) else {
            return;
        };
        let current = kata::total_memory_mib(&vm);
        let next = kata::memory_step_mib(current, final_mib);
        let Some(vm) = info(c, &format!("{step}_info{i}")) else {
            return;
        };
        match kata::resize_memory_plan(&vm, next, block_mib) {
            Err(e) => return println!("@@HOST kata_{step}_error={e}"),
            Ok(Some(bytes)) => {
                if send(c, &format!("{step}{i}"), &kata::vm_resize_ram(bytes)).status >= 300 {
                    return println!("@@HOST kata_{step}_error=vm.resize failed");
                }
            }
            Ok(None) => {}
        }
        if next == final_mib {
            return;
        }
    }
}

pub fn replay(socket: &str, script: &str) {
    let text = std::fs::read_to_string(script).unwrap_or_else(|e| fail(format!("{script}: {e}")));
    let mut c =
        Connection::open(Path::new(socket)).unwrap_or_else(|e| fail(format!("{socket}: {e}")));
    let number = |s: &str| -> u64 {
        s.parse()
            .unwrap_or_else(|_| fail(format!("{s:?} is not a number")))
    };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            [] => {}
            [step, "ping"] => {
                send(&mut c, step, &kata::vmm_ping());
            }
            [step, "create", file] => {
                let body =
                    std::fs::read_to_string(file).unwrap_or_else(|e| fail(format!("{file}: {e}")));
                let body = body.strip_suffix('\n').unwrap_or(&body).to_string();
                send(&mut c, step, &kata::vm_create_with_body(body));
            }
            [step, "info"] => {
                info(&mut c, step);
            }
            [step, "add-net", tap, mac] => {
                let (status, body) =
                    kata_net::add_net_exchange(socket, tap, &kata::add_net_body(mac));
                println!("@@HOST kata_{step}=status={status} body={body}");
            }
            [step, "boot"] => {
                send(&mut c, step, &kata::vm_boot());
            }
            [step, "resize-vcpus", n] => {
                resize_vcpus(&mut c, step, u32::try_from(number(n)).unwrap_or(u32::MAX));
            }
            [step, "resize-memory", mib] => {
                resize_memory(&mut c, step, number(mib), kata::X86_MEMORY_BLOCK_MIB);
            }
            [step, "resize-memory", mib, block] => {
                resize_memory(&mut c, step, number(mib), number(block));
            }
            [step, "get", call] => {
                send(&mut c, step, &kata::get(call));
            }
            [step, "wait", file, text, secs] => {
                let end = std::time::Instant::now() + Duration::from_secs(number(secs));
                let seen = loop {
                    let now = std::fs::read_to_string(file).unwrap_or_default();
                    if now.contains(text) {
                        break true;
                    }
                    if std::time::Instant::now() > end {
                        break false;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                };
                println!(
                    "@@HOST kata_{step}={}",
                    if seen { "seen" } else { "timeout" }
                );
            }
            [step, "shutdown"] => {
                send(&mut c, &format!("{step}_ping"), &kata::vmm_ping());
                send(&mut c, step, &kata::vmm_shutdown());
            }
            _ => fail(format!(
                "{script}: bad step {line:?} (see daxprobe/kata_replay.rs)"
            )),
        }
    }
    println!("@@HOST kata_connections={}", c.dials);
}
