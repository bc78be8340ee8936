//! The API socket's open connections: how many there are, which are idle
//! (no request in progress), and which one to close when a new connection
//! comes past the cap.
//!
//! A client that opens connections and sends nothing must not keep
//! `vmm.ping` from answering: past the cap, a new connection closes an idle
//! one (one that never sent a complete request first, oldest first; then
//! the kept-alive one idle the longest), and is refused only when every
//! open connection has a request in progress.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use hyper::body::{Bytes, Frame, SizeHint};
use tokio::sync::Notify;

/// One open connection.
pub(crate) struct Slot {
    /// Requests in progress: from their head being read to the end of
    /// their answer's body.
    busy: AtomicUsize,
    /// Whether a complete request head ever arrived.
    served: AtomicBool,
    /// When its last answer ended (or it was accepted).
    last_active: Mutex<Instant>,
    /// Told when the connection is to be closed to make room.
    pub evict: Notify,
}

impl Slot {
    /// A request's head was read: the connection is busy until the
    /// returned guard (carried by the answer's body) is dropped.
    pub fn begin(self: &Arc<Self>) -> Busy {
        self.served.store(true, Ordering::SeqCst);
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self.clone())
    }

    pub fn served(&self) -> bool {
        self.served.load(Ordering::SeqCst)
    }

    pub fn idle(&self) -> bool {
        self.busy.load(Ordering::SeqCst) == 0
    }
}

/// A request in progress on a [`Slot`].
pub(crate) struct Busy(Arc<Slot>);

impl Drop for Busy {
    fn drop(&mut self) {
        *lock(&self.0.last_active) = Instant::now();
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The open connections, by the order they were accepted in.
#[derive(Default)]
pub(crate) struct Connections {
    open: Mutex<BTreeMap<u64, Arc<Slot>>>,
    next: AtomicU64,
}

/// A connection's place in [`Connections`], given back when dropped.
pub(crate) struct Registered {
    connections: Arc<Connections>,
    id: u64,
    pub slot: Arc<Slot>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        lock(&self.connections.open).remove(&self.id);
    }
}

impl Connections {
    pub fn len(&self) -> usize {
        lock(&self.open).len()
    }

    pub fn register(self: &Arc<Self>) -> Registered {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let slot = Arc::new(Slot {
            busy: AtomicUsize::new(0),
            served: AtomicBool::new(false),
            last_active: Mutex::new(Instant::now()),
            evict: Notify::new(),
        });
        lock(&self.open).insert(id, slot.clone());
        Registered {
            connections: self.clone(),
            id,
            slot,
        }
    }

    /// Tells one idle connection to close, and stops counting it; false if
    /// every open connection has a request in progress.
    pub fn evict_one(&self) -> bool {
        let mut open = lock(&self.open);
        // Never served first (the map is in accept order: the oldest), then
        // the kept-alive connection idle the longest.
        let victim = open
            .iter()
            .find(|(_, s)| s.idle() && !s.served())
            .or_else(|| {
                open.iter()
                    .filter(|(_, s)| s.idle())
                    .min_by_key(|(_, s)| *lock(&s.last_active))
            })
            .map(|(id, _)| *id);
        let Some(id) = victim else {
            return false;
        };
        if let Some(slot) = open.remove(&id) {
            // A permit is kept if the connection's task is not waiting yet.
            slot.evict.notify_one();
        }
        true
    }
}

/// An answer's body that keeps its connection counted busy until hyper has
/// written all of it (an event stream stays busy as long as it runs).
pub(crate) struct Tracked {
    pub body: Body,
    pub _busy: Busy,
}

impl hyper::body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    // Delegated: hyper writes Content-Length from the exact size hint, and
    // ch-remote finds a body only through that header.
    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eviction_takes_never_served_first_then_the_longest_idle_and_never_a_busy_one() {
        let c = Arc::new(Connections::default());
        let kept = c.register();
        drop(kept.slot.begin()); // served, now idle
        let busy = c.register();
        let _request = busy.slot.begin();
        let silent = c.register();
        assert_eq!(c.len(), 3);
        assert!(c.evict_one());
        assert_eq!(c.len(), 2);
        assert!(!lock(&c.open).values().any(|s| Arc::ptr_eq(s, &silent.slot)));
        assert!(c.evict_one());
        assert!(!lock(&c.open).values().any(|s| Arc::ptr_eq(s, &kept.slot)));
        // Only the connection with a request in progress is left.
        assert!(!c.evict_one());
        assert_eq!(c.len(), 1);
    }
}
