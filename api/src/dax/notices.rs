//! What the controller tells each fs device's daemon besides its policy,
//! over the daemon's control socket: where the window sits in
//! guest-physical memory ([`PolicyController::tell_locations`]), and each
//! range whose file shrank on the host ([`deliver_truncations`], from the
//! VMM's notice queue); and what it
//! relays from the daemon: its adaptive policy's decisions, as
//! `vm.dax-events` ([`PolicyController::relay_adaptive`]). A notice a
//! daemon could not be reached for is told again: the location at every
//! tick until it is taken, a truncation after a tick. Until it hears of its
//! window's place, a daemon refuses requests with buffers there (EFAULT).

use std::sync::Arc;

use serde_json::json;

use super::daemon::NoticeFailure;
use super::DaemonNotice;
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
            match super::Daemon::at(socket)
                .tell(&DaemonNotice::Location(loc))
                .await
            {
                Ok(()) => {
                    tracing::info!(
                        "fs {id}: told the daemon its window is at guest-physical {:#x}",
                        loc.gpa
                    );
                    self.told_location(&id, Some(loc));
                }
                Err(NoticeFailure::Answered { status, body }) => {
                    tracing::warn!(
                        "fs {id}: the daemon answered {status} to the window's location: {body}"
                    );
                    self.told_location(&id, None);
                }
                Err(e @ NoticeFailure::Unreachable(_)) => {
                    tracing::debug!("fs {id}: telling the daemon the window's location: {e}");
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
/// window shrunk on the host, from the VMM's notice queue
/// ([`super::DaemonNotices`], which never drops; not from the event
/// stream, which does), so the daemon's stats and log say so beside its own
/// requests. A notice its daemon did not take because it could not be
/// reached is given back and tried again after a [`super::RECONCILE_PERIOD`];
/// one it refused, or one for a device without a daemon's control socket or
/// that left, is let go (logged): telling again would not change that.
pub(crate) async fn deliver_truncations(controller: Arc<PolicyController>) {
    let mut overflows = 0;
    loop {
        controller.vmm.notices().ready().await;
        while !controller.deliver_pending(&mut overflows).await {
            tokio::time::sleep(super::RECONCILE_PERIOD).await;
        }
    }
}

impl PolicyController {
    /// One delivery of everything pending; false when something is left to
    /// try again (the VMM did not list its devices, or a daemon could not
    /// be reached). `overflows`: the queue's overflow count last logged.
    async fn deliver_pending(&self, overflows: &mut u64) -> bool {
        if self.sync().await.is_err() {
            return false;
        }
        let notices = self.vmm.notices();
        let seen = notices.overflows();
        if seen > *overflows {
            tracing::warn!(
                "more than {} window truncations waited for a daemon ({seen} times so far): each time they were told as one range that spans them all",
                super::MAX_PENDING_RANGES
            );
            *overflows = seen;
        }
        let mut delivered = true;
        for (id, pending) in notices.take() {
            delivered &= self.deliver(&id, &pending).await;
        }
        delivered
    }

    /// Tells `id`'s daemon `pending`, in order; what it could not be told
    /// goes back to the queue. False when something went back.
    async fn deliver(&self, id: &str, pending: &[DaemonNotice]) -> bool {
        let socket = self.devices().get(id).map(|d| d.control_socket.clone());
        let socket = match socket {
            Some(Some(socket)) => socket,
            Some(None) => {
                tracing::debug!("fs {id}: no daemon's control socket to tell of a truncation");
                return true;
            }
            None => {
                tracing::debug!("fs {id}: the device left before its truncations were told");
                return true;
            }
        };
        let daemon = super::Daemon::at(&socket);
        for (i, notice) in pending.iter().enumerate() {
            match daemon.tell(notice).await {
                Ok(()) => {}
                Err(NoticeFailure::Answered { status, .. }) => {
                    tracing::debug!("fs {id}: the daemon answered {status} to a truncation notice");
                }
                Err(e @ NoticeFailure::Unreachable(_)) => {
                    tracing::debug!(
                        "fs {id}: telling the daemon of a truncation: {e}; trying again later"
                    );
                    self.vmm.notices().put_back(id, &pending[i..]);
                    return false;
                }
            }
        }
        true
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
        daemon_hanging_up(path, status, seen, 0);
    }

    /// [`daemon`], but the first `hang_ups` requests get no answer (the
    /// connection closes): as a daemon that went away mid-request.
    fn daemon_hanging_up(
        path: std::path::PathBuf,
        status: &'static str,
        seen: Arc<Mutex<Vec<String>>>,
        mut hang_ups: usize,
    ) {
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
                if hang_ups > 0 {
                    hang_ups -= 1;
                    continue;
                }
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

    /// What the VMM's window observer does with a window event: publish it
    /// on the event stream and, for a truncation, queue the daemon's notice.
    fn window_event(controller: &PolicyController, kind: &'static str, offset: u64, len: u64) {
        controller.events.publish(DaxEvent::new(
            kind,
            "fs0",
            json!({"offset": offset, "len": len}),
        ));
        if kind == "truncated" {
            controller.vmm.notices().truncated("fs0", offset, len);
        }
    }

    /// Waits (a bounded while: the delivery task runs on this runtime)
    /// until the stand-in daemon has seen `count` requests.
    async fn daemon_saw(seen: &Mutex<Vec<String>>, count: usize) -> Vec<String> {
        for _ in 0..400 {
            if seen.lock().unwrap().len() >= count {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(25)).await;
        }
        seen.lock().unwrap().clone()
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_truncation_reaches_the_daemon_while_an_event_reader_is_stalled() {
        use crate::events::EVENT_BUFFER;
        use control_protocol::WINDOW_TRUNCATED;
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let socket = dir.as_path().join("control.sock");
        let seen = Arc::new(Mutex::new(Vec::new()));
        daemon(socket.clone(), "204 No Content", seen.clone());
        let controller = stand_in_vmm(socket, Arc::new(Mutex::new(None)));
        // Subscribed, and never reads.
        let mut stalled = controller.events.subscribe();
        tokio::spawn(deliver_truncations(controller.clone()));
        tokio::task::yield_now().await;
        // A truncation in a burst of maps that overruns the stream's ring
        // before any reader runs.
        window_event(&controller, "truncated", 0x20_0000, 0x3000);
        for i in 0..2 * EVENT_BUFFER as u64 {
            window_event(&controller, "map", i * 0x1000, 0x1000);
        }
        let seen = daemon_saw(&seen, 1).await;
        assert_eq!(
            seen,
            vec![format!(
                "POST {WINDOW_TRUNCATED} HTTP/1.1 {{\"offset\":2097152,\"len\":12288}}"
            )]
        );
        assert!(
            matches!(
                stalled.try_recv(),
                Err(tokio::sync::broadcast::error::TryRecvError::Lagged(_))
            ),
            "the burst made the stalled reader lag"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_truncation_the_daemon_did_not_answer_is_told_again() {
        let dir = vmm_sys_util::tempdir::TempDir::new().unwrap();
        let socket = dir.as_path().join("control.sock");
        let seen = Arc::new(Mutex::new(Vec::new()));
        daemon_hanging_up(socket.clone(), "204 No Content", seen.clone(), 1);
        let controller = stand_in_vmm(socket, Arc::new(Mutex::new(None)));
        tokio::spawn(deliver_truncations(controller.clone()));
        tokio::task::yield_now().await;
        window_event(&controller, "truncated", 0x1000, 0x1000);
        let seen = daemon_saw(&seen, 2).await;
        assert_eq!(seen.len(), 2, "told, not answered, told again: {seen:?}");
        assert_eq!(seen[0], seen[1]);
        assert!(
            seen[1].ends_with("{\"offset\":4096,\"len\":4096}"),
            "{seen:?}"
        );
        assert!(controller.vmm.notices().take().is_empty(), "taken");
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
