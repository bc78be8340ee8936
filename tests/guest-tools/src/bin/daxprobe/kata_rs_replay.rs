//! `daxprobe kata-rs-replay SOCKET SCRIPT`: a sandbox's life as Kata's
//! Rust runtime (runtime-rs) drives Cloud Hypervisor, against the API
//! socket: ONE connection, dialled every 50 ms until the socket accepts
//! (`cloud_hypervisor_setup_comms`) and kept to the end, every request
//! written as `api_client` v51.0 writes it and every answer read as it
//! reads it (`test_infra::kata::api_client`), the bodies runtime-rs's
//! (`test_infra::kata::rs`).
//!
//! SCRIPT has one step a line (`#` starts a comment): `NAME CALL ARGS`.
//!
//! ```text
//! NAME ping                       vmm.ping until it answers, 50 ms apart; `features` must be an
//!                                 array (handle_ch_build_features)
//! NAME create FILE                vm.create with FILE's bytes as the body (to_string_pretty)
//! NAME add-net TAP MAC            opens TAP as runtime-rs does (open_named_tuntap, one queue),
//!                                 vm.add-net with its fd in `fds` and on the first write
//! NAME boot                       vm.boot
//! NAME agent VSOCK PORT BYTES SECONDS  the agent dial (agent sock/hybrid_vsock.rs): connect to
//!                                 VSOCK, write `connect PORT\n`, read a line that must contain
//!                                 OK; else again 10 ms later (runtime-rs gives up after 301
//!                                 tries; here after SECONDS, the emulated guest boots slower);
//!                                 then BYTES of a pattern each way (the stand-in agent's reply)
//! NAME resize-vcpus OLD NEW MAX   resize_vcpu: vm.resize with desired_vcpus, only when it changes
//! NAME resize-memory MIB BLOCK MAX  resize_memory: vm.info (NAME_info), then vm.resize with
//!                                 desired_ram when MIB, aligned to BLOCK MiB, grows the VM
//! NAME info                       vm.info, read as runtime-rs's VmInfo
//! NAME wait FILE TEXT SECONDS     no request: until FILE holds TEXT (a guest marker)
//! NAME shutdown                   vmm.shutdown
//! ```
//!
//! Prints `@@HOST krs_NAME=ok body=<body>` or `@@HOST krs_NAME=error <why>`
//! per request (`krs_NAME=seen|timeout` for a wait), and
//! `krs_NAME_start_ms` / `krs_NAME_end_ms`, milliseconds since the replay
//! started. Where runtime-rs would give up (a failed create, add-net,
//! boot, dial or resize) the replay prints the error, sends vmm.shutdown
//! so the VMM does not outlive the run, and exits 1.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use test_infra::kata::api_client::call;
use test_infra::kata::rs::{self, info};

use super::{fail, kata_net, num, vsock};

struct Replay {
    api: UnixStream,
    start: Instant,
}

impl Replay {
    fn ms(&self) -> u128 {
        self.start.elapsed().as_millis()
    }

    /// One request; prints its answer. None where runtime-rs sees an error.
    fn call(
        &mut self,
        step: &str,
        method: &str,
        command: &str,
        body: Option<&str>,
        fds: &[RawFd],
    ) -> Option<Option<String>> {
        match call(&mut self.api, method, command, body, fds) {
            Ok(answer) => {
                let text = answer.as_deref().unwrap_or("-").replace('\n', "\\n");
                println!("@@HOST krs_{step}=ok body={text}");
                Some(answer)
            }
            Err(e) => {
                println!("@@HOST krs_{step}=error {command}: {e:?}");
                None
            }
        }
    }

    /// Where runtime-rs stops: end the VMM (so the run ends) and exit.
    fn give_up(&mut self, step: &str) -> ! {
        let _ = call(&mut self.api, "PUT", "vmm.shutdown", None, &[]);
        fail(format!("runtime-rs would stop at {step}"))
    }

    fn ping(&mut self, step: &str) {
        for _ in 0..1200 {
            if let Ok(answer) = call(&mut self.api, "GET", "vmm.ping", None, &[]) {
                let text = answer.as_deref().unwrap_or("-");
                println!("@@HOST krs_{step}=ok body={text}");
                match info::parse_ping(answer.as_deref()) {
                    Ok(features) => println!("@@HOST krs_{step}_features={features:?}"),
                    Err(e) => {
                        println!("@@HOST krs_{step}_error={e}");
                        self.give_up(step);
                    }
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("@@HOST krs_{step}=error no answer");
        self.give_up(step);
    }

    fn info(&mut self, step: &str) -> info::VmInfo {
        let answer = self.call(step, "GET", "vm.info", None, &[]);
        match answer.map(|a| info::parse_vm_info(a.as_deref())) {
            Some(Ok(vm)) => {
                println!(
                    "@@HOST krs_{step}_vm=state={} memory_size={} boot_vcpus={} max_vcpus={}",
                    vm.state, vm.memory_size, vm.boot_vcpus, vm.max_vcpus
                );
                vm
            }
            Some(Err(e)) => {
                println!("@@HOST krs_{step}_error={e}");
                self.give_up(step)
            }
            None => self.give_up(step),
        }
    }

    fn add_net(&mut self, step: &str, tap: &str, mac: &str) {
        let tap = kata_net::open_tap(tap);
        let fd = tap.as_raw_fd();
        let body = rs::add_net_body(mac, &[fd]);
        let answer = self.call(step, "PUT", "vm.add-net", Some(&body), &[fd]);
        // runtime-rs closes its copy once it is sent.
        drop(tap);
        if answer.is_none() {
            self.give_up(step);
        }
    }

    fn agent(&mut self, step: &str, vsock_path: &str, port: &str, bytes: &str, secs: &str) {
        let end = Instant::now() + Duration::from_secs(num(secs));
        let mut tries = 0u32;
        loop {
            tries += 1;
            match dial(vsock_path, port) {
                Ok((mut stream, line)) => {
                    println!("@@HOST krs_{step}_tries={tries}");
                    println!("@@HOST krs_{step}_ok_ms={}", self.ms());
                    println!(
                        "@@HOST krs_{step}={} {}",
                        line.trim_end(),
                        vsock::client(&mut stream, num(bytes))
                    );
                    return;
                }
                Err(why) if Instant::now() > end => {
                    println!("@@HOST krs_{step}=error after {tries} tries: {why}");
                    self.give_up(step);
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    }
}

/// agent `connect_helper`: the lower-case `connect PORT\n` and a reply
/// line containing `OK`. The line is read a byte at a time (runtime-rs
/// reads it through a BufReader; the bytes on the wire are the same).
fn dial(path: &str, port: &str) -> Result<(UnixStream, String), String> {
    let mut s = UnixStream::connect(path).map_err(|e| format!("connect: {e}"))?;
    s.write_all(format!("connect {port}\n").as_bytes())
        .map_err(|e| format!("write: {e}"))?;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.last() != Some(&b'\n') && line.len() < 64 {
        match s.read(&mut byte) {
            Ok(1) => line.push(byte[0]),
            Ok(_) => break,
            Err(e) => return Err(format!("read line: {e}")),
        }
    }
    let line = String::from_utf8_lossy(&line).into_owned();
    if line.contains("OK") {
        Ok((s, line))
    } else {
        Err(format!(
            "handshake error: malformed response code: {line:?}"
        ))
    }
}

fn wait_for_text(file: &str, text: &str, secs: u64) -> bool {
    let end = Instant::now() + Duration::from_secs(secs);
    loop {
        if std::fs::read_to_string(file).is_ok_and(|now| now.contains(text)) {
            return true;
        }
        if Instant::now() > end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn replay(socket: &str, script: &str) {
    let text = std::fs::read_to_string(script).unwrap_or_else(|e| fail(format!("{script}: {e}")));
    let start = Instant::now();
    let api = loop {
        match UnixStream::connect(socket) {
            Ok(s) => break s,
            Err(e) if start.elapsed() > Duration::from_secs(60) => fail(format!("{socket}: {e}")),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let mut r = Replay { api, start };
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some(step) = words.first().copied() else {
            continue;
        };
        println!("@@HOST krs_{step}_start_ms={}", r.ms());
        let ok = match &words[1..] {
            ["ping"] => {
                r.ping(step);
                true
            }
            ["create", file] => {
                let body =
                    std::fs::read_to_string(file).unwrap_or_else(|e| fail(format!("{file}: {e}")));
                r.call(step, "PUT", "vm.create", Some(&body), &[]).is_some()
            }
            ["add-net", tap, mac] => {
                r.add_net(step, tap, mac);
                true
            }
            ["boot"] => r.call(step, "PUT", "vm.boot", None, &[]).is_some(),
            ["agent", vsock_path, port, bytes, secs] => {
                r.agent(step, vsock_path, port, bytes, secs);
                true
            }
            ["resize-vcpus", old, new, max] => {
                match rs::resize_vcpus_request(num(old), num(new), num(max)) {
                    Ok(Some(n)) => {
                        let body = rs::resize_body(Some(n), None);
                        r.call(step, "PUT", "vm.resize", Some(&body), &[]).is_some()
                    }
                    Ok(None) => {
                        println!("@@HOST krs_{step}=unchanged");
                        true
                    }
                    Err(e) => {
                        println!("@@HOST krs_{step}=error {e}");
                        false
                    }
                }
            }
            ["resize-memory", mib, block, max] => {
                let vm = r.info(&format!("{step}_info"));
                match rs::resize_memory_request(vm.memory_size, num(mib), num(block), num(max)) {
                    Ok(Some(bytes)) => {
                        let body = rs::resize_body(None, Some(bytes));
                        r.call(step, "PUT", "vm.resize", Some(&body), &[]).is_some()
                    }
                    Ok(None) => {
                        println!("@@HOST krs_{step}=unchanged");
                        true
                    }
                    Err(e) => {
                        println!("@@HOST krs_{step}=error {e}");
                        false
                    }
                }
            }
            ["info"] => {
                r.info(step);
                true
            }
            ["wait", file, text, secs] => {
                let seen = wait_for_text(file, text, num(secs));
                println!(
                    "@@HOST krs_{step}={}",
                    if seen { "seen" } else { "timeout" }
                );
                true
            }
            ["shutdown"] => r.call(step, "PUT", "vmm.shutdown", None, &[]).is_some(),
            _ => fail(format!(
                "{script}: bad step {line:?} (see daxprobe/kata_rs_replay.rs)"
            )),
        };
        println!("@@HOST krs_{step}_end_ms={}", r.ms());
        if !ok {
            r.give_up(step);
        }
    }
}
