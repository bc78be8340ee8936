//! What the VMM tells each fs device's daemon about its DAX window, over
//! the daemon's control socket: where the window sits in guest-physical
//! memory ([`keep_locations`]), and each range whose file shrank on the
//! host ([`relay_truncations`]). Both are best effort: a daemon that does not
//! hear refuses requests with buffers in the window (EFAULT, as before it
//! knew) or misses a notice the VMM's own metrics still count.

use control_protocol::{WindowLocation, WindowTruncated, WINDOW_LOCATION, WINDOW_TRUNCATED};

use crate::client;
use crate::dax::fs_devices;
use crate::routes::AppState;

/// How often [`keep_locations`] compares each window's place with what its
/// daemon was told.
pub const LOCATION_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// Tells each daemon where its window is, at start and whenever the guest
/// moves the window's BAR (for ever, a task on the API's runtime). Only a
/// change is sent; a daemon that did not take it is asked again next tick.
pub(crate) async fn keep_locations(s: AppState) {
    let mut tick = tokio::time::interval(LOCATION_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        push_locations(&s).await;
    }
}

async fn push_locations(s: &AppState) {
    let Ok(devices) = fs_devices(s, false).await else {
        return;
    };
    let told = s
        .window_locations
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut now_told = std::collections::HashMap::new();
    for d in &devices {
        let (Some(socket), Some(loc)) = (&d.control_socket, d.window_location) else {
            continue;
        };
        if told.get(&d.id) == Some(&loc) {
            now_told.insert(d.id.clone(), loc);
            continue;
        }
        if tell_location(&d.id, socket, loc).await {
            now_told.insert(d.id.clone(), loc);
        }
    }
    *s.window_locations.lock().unwrap_or_else(|p| p.into_inner()) = now_told;
}

async fn tell_location(device: &str, socket: &std::path::Path, loc: WindowLocation) -> bool {
    let body = serde_json::to_string(&loc).unwrap_or_default();
    match client::request(socket, "PUT", WINDOW_LOCATION, Some(body)).await {
        Ok(a) if a.status == 204 => {
            log::info!(
                "fs {device}: told the daemon its window is at guest-physical {:#x}",
                loc.gpa
            );
            true
        }
        Ok(a) => {
            log::warn!(
                "fs {device}: the daemon answered {} to the window's location: {}",
                a.status,
                a.body
            );
            false
        }
        Err(e) => {
            log::debug!("fs {device}: telling the daemon the window's location: {e}");
            false
        }
    }
}

/// Tells a device's daemon each time the VMM found a file mapped in its
/// window shrunk on the host (a `truncated` event), so the daemon's stats
/// and log say so beside its own requests. Best effort: a daemon that does
/// not answer misses the notice (the VMM's metrics still count it).
pub(crate) async fn relay_truncations(s: AppState) {
    use tokio::sync::broadcast::error::RecvError;
    let mut rx = s.events.subscribe();
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
        let Ok(devices) = fs_devices(&s, false).await else {
            continue;
        };
        let Some(socket) = devices
            .iter()
            .find(|d| d.id == event.device)
            .and_then(|d| d.control_socket.clone())
        else {
            continue;
        };
        let body = serde_json::to_string(&notice).unwrap_or_default();
        match client::request(&socket, "POST", WINDOW_TRUNCATED, Some(body)).await {
            Ok(a) if a.status == 204 => {}
            Ok(a) => log::debug!(
                "fs {}: the daemon answered {} to a truncation notice",
                event.device,
                a.status
            ),
            Err(e) => log::debug!(
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
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};

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
    /// placed where `placed` says; the API state that asks it.
    fn stand_in_vmm(
        socket: std::path::PathBuf,
        placed: Arc<Mutex<Option<WindowLocation>>>,
    ) -> AppState {
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
        let ping = serde_json::json!({});
        crate::routes::app(channel, crate::EventBus::default(), ping).1
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
        assert!(state.window_locations.lock().unwrap().is_empty());
    }
}
