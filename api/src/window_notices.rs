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
