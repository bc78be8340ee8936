//! The daemon as Kata Containers starts it: the Go runtime binds
//! and listens on the vhost-user socket itself, passes it as fd 3 with
//! `--syslog --cache=auto --shared-dir=DIR --fd=3 --thread-pool-size=1
//! --announce-submounts`, connects the VMM at once and ends the daemon
//! with SIGKILL; the Rust runtime passes `--socket-path` and waits for
//! "Waiting for vhost-user socket connection" on the daemon's stderr. The
//! default sandbox needs root, as Kata runs it; CI runs as root.

use std::ffi::CString;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::process::Stdio;

use super::*;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        eprintln!("skipped: the daemon's default sandbox needs root");
    }
    root
}

fn daemon_command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dax-virtiofsd"))
}

/// Hands `fd` to the daemon as its fd 3, inheritable, as Go's
/// `exec.Cmd.ExtraFiles` does.
fn pass_as_fd3(command: &mut Command, fd: RawFd) {
    // SAFETY: runs in the forked child before exec; dup2 and fcntl are
    // single system calls on fds the child has.
    unsafe {
        command.pre_exec(move || {
            if fd != 3 && libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // dup2 onto itself would keep close-on-exec: clear it always.
            if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Gives the daemon a `/dev/log` of the test's own: in a mount namespace
/// of the daemon's, a tmpfs over `/dev` with `syslogd` (a socket this test
/// reads) bind-mounted at `/dev/log`. The daemon's --syslog is then seen
/// end to end without touching the host's syslog.
fn with_private_dev_log(command: &mut Command, syslogd: &Path) {
    let socket = CString::new(syslogd.as_os_str().as_bytes()).unwrap();
    // SAFETY: runs in the forked child before exec; each call is one
    // system call on strings allocated before the fork.
    unsafe {
        command.pre_exec(move || {
            let check = |r: libc::c_int| {
                if r < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(r)
                }
            };
            let none = std::ptr::null();
            check(libc::unshare(libc::CLONE_NEWNS))?;
            check(libc::mount(
                none,
                c"/".as_ptr(),
                none,
                libc::MS_REC | libc::MS_PRIVATE,
                std::ptr::null(),
            ))?;
            check(libc::mount(
                c"tmpfs".as_ptr(),
                c"/dev".as_ptr(),
                c"tmpfs".as_ptr(),
                0,
                std::ptr::null(),
            ))?;
            let target = check(libc::open(
                c"/dev/log".as_ptr(),
                libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                0o600,
            ))?;
            libc::close(target);
            check(libc::mount(
                socket.as_ptr(),
                c"/dev/log".as_ptr(),
                none,
                libc::MS_BIND,
                std::ptr::null(),
            ))?;
            Ok(())
        });
    }
}

/// Every record on the test's syslog socket so far.
fn syslog_records(syslogd: &UnixDatagram) -> Vec<String> {
    syslogd.set_nonblocking(true).unwrap();
    let mut records = Vec::new();
    let mut buf = vec![0u8; 65536];
    while let Ok(n) = syslogd.recv(&mut buf) {
        records.push(String::from_utf8_lossy(&buf[..n]).into_owned());
    }
    records
}

fn kill(child: &mut Child) {
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: signals the child this test spawned and has not yet reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(libc::SIGKILL)
    );
}

/// Once nothing holds the listening socket any more, connecting to its
/// file is refused; the file itself stays (it is Kata's).
fn assert_nothing_listens(socket: &Path) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match UnixStream::connect(socket) {
            Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => break,
            _ => assert!(
                Instant::now() < deadline,
                "a daemon process still holds the socket after SIGKILL"
            ),
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(socket.exists(), "the socket file is the caller's to remove");
}

#[test]
fn kata_go_runtime_starts_the_daemon_on_fd_3_with_syslog_and_ends_it_with_sigkill() {
    if !is_root() {
        return;
    }
    let share = TempDir::new().unwrap();
    std::fs::write(share.as_path().join("hello"), b"from the host").unwrap();
    let dir = TempDir::new().unwrap();
    let socket = dir.as_path().join("vhost-fs.sock");
    let log_path = dir.as_path().join("log");
    let syslogd = UnixDatagram::bind(&log_path).unwrap();
    // As Go's net.ListenUnix: a listening stream socket, non-blocking.
    let listener = UnixListener::bind(&socket).unwrap();
    listener.set_nonblocking(true).unwrap();

    let mut command = daemon_command();
    command
        .args([
            "--syslog",
            "--cache=auto",
            &format!("--shared-dir={}", share.as_path().display()),
            "--fd=3",
            "--thread-pool-size=1",
            "--announce-submounts",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    pass_as_fd3(&mut command, listener.as_raw_fd());
    with_private_dev_log(&mut command, &log_path);
    let mut daemon = command.spawn().expect("spawning dax-virtiofsd");
    // Kata closes its copy once the daemon has one.
    drop(listener);

    // Kata starts the VMM at once: the connection waits in the backlog.
    let mem = guest_memory();
    let mut fs = VhostUserFs::connect(&fs_config(&socket)).expect("handshake on fd 3");
    let mut guest = activate(&mut fs, &mem);
    let asked = abi::InitIn {
        flags: init_in().flags | u32::try_from(init::SUBMOUNTS).unwrap(),
        ..init_in()
    };
    let (e, p) = guest.call(opcode::INIT, 0, asked.as_slice());
    assert_eq!(e, 0);
    let out: abi::InitOut = obj(&p);
    assert_ne!(
        out.flags as u64 & init::SUBMOUNTS,
        0,
        "--announce-submounts taken"
    );
    let (e, p) = guest.call(opcode::LOOKUP, ROOT_ID, b"hello\0");
    assert_eq!(e, 0);
    assert_eq!(obj::<abi::EntryOut>(&p).attr.size, 13);
    assert_eq!(obj::<abi::EntryOut>(&p).entry_valid, 1, "--cache=auto");

    // Kata names no control socket: the daemon serves one beside the
    // inherited socket, where the VMM looks when its fs device names none.
    let control = control_protocol::default_control_socket(&socket);
    let mut c = std::os::unix::net::UnixStream::connect(&control)
        .unwrap_or_else(|e| panic!("{}: {e}", control.display()));
    std::io::Write::write_all(
        &mut c,
        b"GET /api/v1/stats HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n",
    )
    .unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut c, &mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Records from before the sandbox and from the serving process in it,
    // under its seccomp filter, all with the pid Kata knows.
    let records = syslog_records(&syslogd);
    let tag = format!(" dax-virtiofsd[{}]: ", daemon.id());
    for wanted in [
        "Waiting for vhost-user socket connection",
        "FUSE INIT: guest 7.38",
    ] {
        assert!(
            records
                .iter()
                .any(|r| r.starts_with("<14>") && r.contains(&tag) && r.contains(wanted)),
            "no syslog record {wanted:?} in {records:?}"
        );
    }

    kill(&mut daemon);
    assert_nothing_listens(&socket);
    let mut stderr = String::new();
    std::io::Read::read_to_string(daemon.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(stderr, "", "everything went to syslog");
}

#[test]
fn without_dev_log_syslog_says_so_once_and_logs_to_stderr() {
    if !is_root() || Path::new(daemon::syslog::DEV_LOG).exists() {
        return; // Needs a host without a syslog socket (checked, not assumed).
    }
    let share = TempDir::new().unwrap();
    let dir = TempDir::new().unwrap();
    let socket = dir.as_path().join("vhost-fs.sock");
    let listener = UnixListener::bind(&socket).unwrap();
    let mut command = daemon_command();
    command
        .args(["--syslog", "--fd=3", "--shared-dir"])
        .arg(share.as_path())
        .stderr(Stdio::piped());
    pass_as_fd3(&mut command, listener.as_raw_fd());
    let mut daemon = command.spawn().unwrap();
    drop(listener);
    let waiting = wait_for_stderr_line(&mut daemon, "Waiting for vhost-user socket connection");
    kill(&mut daemon);
    let notes = waiting
        .iter()
        .filter(|l| l.contains("--syslog: /dev/log"))
        .count();
    assert_eq!(notes, 1, "{waiting:?}");
}

/// Reads the daemon's stderr until a line containing `wanted`; returns
/// the lines so far. Bounded, so a silent daemon fails the test.
fn wait_for_stderr_line(daemon: &mut Child, wanted: &'static str) -> Vec<String> {
    let stderr = daemon.stderr.take().unwrap();
    let (tx, rx) = channel();
    std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines() {
            let line = line.unwrap();
            let done = line.contains(wanted);
            lines.push(line);
            if done {
                break;
            }
        }
        let _ = tx.send(lines);
    });
    let lines = rx.recv_timeout(PATIENCE).expect("the daemon's stderr");
    assert!(
        lines.last().is_some_and(|l| l.contains(wanted)),
        "the daemon never said {wanted:?}: {lines:?}"
    );
    lines
}

#[test]
fn kata_rust_runtime_sees_the_daemon_waiting_on_stderr_before_it_connects() {
    if !is_root() {
        return;
    }
    let share = TempDir::new().unwrap();
    let dir = TempDir::new().unwrap();
    let socket = dir.as_path().join("vhost-fs.sock");
    let mut daemon = daemon_command()
        .arg("--socket-path")
        .arg(&socket)
        .arg("--shared-dir")
        .arg(share.as_path())
        .args([
            "--cache",
            "auto",
            "--thread-pool-size=1",
            "-o",
            "announce_submounts",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_stderr_line(&mut daemon, "Waiting for vhost-user socket connection");
    let fs = VhostUserFs::connect(&fs_config(&socket)).expect("handshake");
    drop(fs);
    assert!(daemon.wait().unwrap().success(), "ends with its VMM");
}

/// Runs the daemon with Kata's argv and `fd3` (if any) as its fd 3;
/// returns its exit code and stderr.
fn run_with_fd3(fd3: Option<RawFd>, extra: &[&str]) -> (Option<i32>, String) {
    let share = TempDir::new().unwrap();
    let mut command = daemon_command();
    command
        .args(["--syslog", "--cache=auto", "--fd=3", "--thread-pool-size=1"])
        .arg(format!("--shared-dir={}", share.as_path().display()))
        .args(extra)
        .stdin(Stdio::null());
    match fd3 {
        Some(fd) => pass_as_fd3(&mut command, fd),
        // SAFETY: runs in the forked child before exec; close is one call.
        None => unsafe {
            command.pre_exec(|| {
                libc::close(3);
                Ok(())
            });
        },
    }
    let out = command.output().unwrap();
    (out.status.code(), String::from_utf8(out.stderr).unwrap())
}

#[test]
fn fd_3_that_is_not_a_listening_unix_socket_is_refused_naming_fd() {
    let file = std::fs::File::open("/proc/self/status").unwrap();
    let (a, _b) = UnixStream::pair().unwrap();
    let datagram = UnixDatagram::unbound().unwrap();
    for (fd3, why) in [
        (Some(file.as_raw_fd()), "not a socket"),
        (Some(a.as_raw_fd()), "the unix socket is not listening"),
        (
            Some(datagram.as_raw_fd()),
            "a SOCK_DGRAM unix socket, not SOCK_STREAM",
        ),
        (None, "not an open file descriptor"),
    ] {
        let (code, stderr) = run_with_fd3(fd3, &[]);
        assert_eq!(code, Some(1), "{why}: {stderr}");
        assert!(
            stderr.starts_with(&format!("dax-virtiofsd: error: --fd 3: {why}")),
            "{why}: {stderr}"
        );
    }
}

#[test]
fn an_unsupported_virtiofsd_option_exits_2_naming_it() {
    let (a, _b) = UnixStream::pair().unwrap();
    for (arg, name) in [
        ("--posix-acl", "--posix-acl=always"),
        ("--writeback", "--writeback"),
        (
            "--migration-on-error=guest-error",
            "--migration-on-error=guest-error",
        ),
    ] {
        let (code, stderr) = run_with_fd3(Some(a.as_raw_fd()), &[arg]);
        assert_eq!(code, Some(2), "{stderr}");
        assert_eq!(
            stderr,
            format!(
                "dax-virtiofsd: {name} is not supported (virtiofsd option; see docs/virtiofs.md)\n"
            )
        );
    }
    let out = daemon_command()
        .arg("--print-capabilities")
        .output()
        .unwrap();
    assert!(out.status.success());
    let caps: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(caps["type"], "fs");
}
