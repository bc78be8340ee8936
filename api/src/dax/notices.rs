//! What the controller tells each fs device's daemon besides its policy,
//! over the daemon's control socket: where the window sits in
//! guest-physical memory ([`PolicyController::tell_locations`]), and each
//! range whose file shrank on the host ([`relay_truncations`]); and what it
//! relays from the daemon: its adaptive policy's decisions, as
//! `vm.dax-events` ([`PolicyController::relay_adaptive`]). All best effort:
//! a daemon that does not hear refuses requests with buffers in the window
//! (EFAULT, as before it knew) or misses a notice the VMM's own metrics
//! still count.

use std::sync::Arc;

use control_protocol::WindowTruncated;
use serde_json::json;

use super::daemon::NoticeFailure;
use super::PolicyController;
use crate::events::DaxEvent;

impl PolicyController {
    /// Tells each daemon where its window is, at start and whenever the
    /// guest moves the window's BAR. Only a change is sent; a daemon that
    /// did not take it is asked again next time.
    pub(crate) async fn tell_locations(&self) {
        let devices = self.devices().clone();
        for (id, d) in devices {
            let (Some(socket), Some(loc)) = (&d.control_socket, d.window_location) else {
                self.told_location(&id, None);
                continue;
            };
            if d.told_location == Some(loc) {
                continue;
            }
            match super::Daemon::at(socket).tell_location(loc).await {
                Ok(()) => {
                    log::info!(
                        "fs {id}: told the daemon its window is at guest-physical {:#x}",
                        loc.gpa
                    );
                    self.told_location(&id, Some(loc));
                }
                Err(NoticeFailure::Answered { status, body }) => {
                    log::warn!(
                        "fs {id}: the daemon answered {status} to the window's location: {body}"
                    );
                    self.told_location(&id, None);
                }
                Err(e @ NoticeFailure::Unreachable(_)) => {
                    log::debug!("fs {id}: telling the daemon the window's location: {e}");
                    self.told_location(&id, None);
                }
            }
        }
    }

    fn told_location(&self, id: &str, loc: Option<control_protocol::WindowLocation>) {
        if let Some(d) = self.devices().get_mut(id) {
            d.told_location = loc;
        }
    }

    /// Publishes, as `adaptive` events, what each daemon's adaptive policy
    /// decided since the last call. The first contact with a daemon only
    /// takes its cursor (what it decided before is history, in its stats);
    /// a daemon that restarted numbers from 1 again and answers all it has.
    pub(crate) async fn relay_adaptive(&self) {
        let devices = self.devices().clone();
        for (id, d) in devices {
            let Some(socket) = &d.control_socket else {
                continue;
            };
            let known = d.adaptive_cursor;
            let daemon = super::Daemon::at(socket);
            let Ok(answer) = daemon.adaptive_events(known.unwrap_or(u64::MAX)).await else {
                continue;
            };
            if let Some(d) = self.devices().get_mut(&id) {
                d.adaptive_cursor = Some(answer.next);
            }
            if known.is_none() {
                continue;
            }
            if answer.missed > 0 {
                self.events.publish(DaxEvent::new(
                    "adaptive",
                    &id,
                    json!({"decision": "missed", "count": answer.missed}),
                ));
            }
            for e in answer.events {
                self.events.publish(DaxEvent::new(
                    "adaptive",
                    &id,
                    json!({
                        "decision": e.kind, "path": e.path, "nodeid": e.nodeid,
                        "reason": e.reason, "occupancy_pct": e.occupancy_pct,
                        "seq": e.seq, "daemon_at_ms": e.at_ms,
                    }),
                ));
            }
        }
    }
}

/// Tells a device's daemon each time the VMM found a file mapped in its
/// window shrunk on the host (a `truncated` event), so the daemon's stats
/// and log say so beside its own requests. Best effort: a daemon that does
/// not answer misses the notice (the VMM's metrics still count it).
pub(crate) async fn relay_truncations(controller: Arc<PolicyController>) {
    use tokio::sync::broadcast::error::RecvError;
    let mut rx = controller.events.subscribe();
    loop {
        let event = match rx.recv().await {
            Ok(e) if e.kind == "truncated" => e,
            Ok(_) => continue,
            Err(RecvError::Lagged(n)) => {
                log::warn!("{n} window events went by before the truncation relay read them; daemons may miss some notices");
                continue;
            }
            Err(RecvError::Closed) => return,
        };
        let notice = WindowTruncated {
            offset: event.fields["offset"].as_u64().unwrap_or(0),
            len: event.fields["len"].as_u64().unwrap_or(0),
        };
        if controller.sync().await.is_err() {
            continue;
        }
        let Some(socket) = controller
            .devices()
            .get(&event.device)
            .and_then(|d| d.control_socket.clone())
        else {
            continue;
        };
        match super::Daemon::at(&socket).tell_truncated(notice).await {
            Ok(()) => {}
            Err(NoticeFailure::Answered { status, .. }) => log::debug!(
                "fs {}: the daemon answered {status} to a truncation notice",
                event.device
            ),
            Err(e @ NoticeFailure::Unreachable(_)) => log::debug!(
                "fs {}: telling the daemon of a truncation: {e}",
                event.device
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{vmm_channel, FsDaxStatus, VmmAction, VmmReply};
    use control_protocol::{WindowLocation, WINDOW_LOCATION};
    use std::io::{Read, Write};
    use std::sync::Mutex;

    /// A daemon's control socket (a thread) that records each request's
    /// first line and body, and answers `status`.
    fn daemon(path: std::path::PathBuf, status: &'static str, seen: Arc<Mutex<Vec<String>>>) {
        let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let mut conn = conn.unwrap();
                let mut buf = [0u8; 4096];
                let mut got = Vec::new();
                // The head and the small JSON body, up to its closing brace.
                while !got.contains(&b'}') {
                    let n = conn.read(&mut buf).unwrap();
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                }
                let text = String::from_utf8_lossy(&got).to_string();
                let line = text.lines().next().unwrap_or_default().to_string();
                let body = text.split("\r\n\r\n").nth(1).unwrap_or_default();
                seen.lock().unwrap().push(format!("{line} {body}"));
                let answer =
                    format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
                conn.write_all(answer.as_bytes()).unwrap();
            }
        });
    }

    /// The stand-in VMM: one fs device with `socket` as its control socket,
    /// placed where `placed` says; the controller that asks it.
    fn stand_in_vmm(
        socket: std::path::PathBuf,
        placed: Arc<Mutex<Option<WindowLocation>>>,
    ) -> Arc<PolicyController> {
        let (channel, receiver) = vmm_channel().unwrap();
        std::thread::spawn(move || loop {
            std::thread::sleep(std::time::Duration::from_millis(5));
            for req in receiver.drain() {
                assert!(matches!(
                    req.action,
                    VmmAction::DaxStatus {
                        window_stats: false
                    }
                ));
                let status = FsDaxStatus {
                    id: "fs0".into(),
                    control_socket: Some(socket.clone()),
                    window_location: *placed.lock().unwrap(),
                    ..Default::default()
                };
                let _ = req.reply.send(Ok(VmmReply::Dax(vec![status])));
            }
        });
        PolicyController::new(channel, crate::EventBus::default())
    }

    /// One tick of the loop, as far as locations go.
    async fn push_locations(controller: &PolicyController) {
        controller.sync().await.unwrap();
        controller.tell_locations().await;
    }

    const AT_4G: WindowLocation = WindowLocation {
        gpa: 0x1_0000_0000,
        size: 1 << 25,
    };

    #[tokio::test(flavor = "current_thread")]
    async fn a_daemon_is_told_its_windows_place_once_and_again_after_a_move() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let socket = dir.as_path().join("control.sock");
        let seen = Arc::new(Mutex::new(Vec::new()));
        daemon(socket.clone(), "204 No Content", seen.clone());
        let placed = Arc::new(Mutex::new(None));
        let state = stand_in_vmm(socket, placed.clone());
        push_locations(&state).await;
        assert!(
            seen.lock().unwrap().is_empty(),
            "not placed yet: nothing to say"
        );
        *placed.lock().unwrap() = Some(AT_4G);
        push_locations(&state).await;
        push_locations(&state).await;
        assert_eq!(
            *seen.lock().unwrap(),
            vec![format!(
                "PUT {WINDOW_LOCATION} HTTP/1.1 {{\"gpa\":4294967296,\"size\":33554432}}"
            )],
            "told once while nothing changes"
        );
        // The guest moves the BAR.
        *placed.lock().unwrap() = Some(WindowLocation {
            gpa: 0x2_0000_0000,
            ..AT_4G
        });
        push_locations(&state).await;
        push_locations(&state).await;
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen[1].contains("\"gpa\":8589934592"), "{seen:?}");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_daemon_that_refused_the_location_is_asked_again() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let socket = dir.as_path().join("control.sock");
        let seen = Arc::new(Mutex::new(Vec::new()));
        daemon(socket.clone(), "400 Bad Request", seen.clone());
        let state = stand_in_vmm(socket, Arc::new(Mutex::new(Some(AT_4G))));
        push_locations(&state).await;
        push_locations(&state).await;
        assert_eq!(seen.lock().unwrap().len(), 2);
        assert_eq!(state.devices()["fs0"].told_location, None);
    }
}
