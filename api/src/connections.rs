//! The API socket's open connections: how many there are, which are idle
//! (no request in progress), whether a request head has started arriving,
//! and which one to close when a new connection comes past the cap.
//!
//! An idle connection is never closed for being idle: Kata's runtime-rs
//! opens one API connection when a sandbox starts and sends its last
//! request (`vmm.shutdown`) on it hours later, without ever redialling.
//! What is bounded is a request that has started: once its first bytes
//! arrive, the rest of its head must follow within the header timeout
//! ([`Slot::head_started`]). A client that opens connections and sends
//! nothing must not keep `vmm.ping` from answering: past the cap, a new
//! connection closes an idle one (one that never sent a complete request
//! first, oldest first; then the kept-alive one idle the longest), and is
//! refused only when every open connection has a request in progress.

use std::collections::BTreeMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::Body;
use hyper::body::{Bytes, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
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
    /// When the first bytes of a request head arrived, while no request
    /// was in progress; cleared when the head is complete.
    head_started: Mutex<Option<Instant>>,
    /// Told when the connection is to be closed to make room.
    pub evict: Notify,
    /// Told when [`Slot::head_started`] is set, so the connection's task
    /// arms the header timeout.
    pub head_begun: Notify,
}

impl Slot {
    /// A request's head was read: the connection is busy until the
    /// returned guard (carried by the answer's body) is dropped.
    pub fn begin(self: &Arc<Self>) -> Busy {
        self.served.store(true, Ordering::SeqCst);
        self.busy.fetch_add(1, Ordering::SeqCst);
        *lock(&self.head_started) = None;
        Busy(self.clone())
    }

    /// Bytes came in. With no request in progress they start a head,
    /// which must be complete within the header timeout; bytes of a body,
    /// or of a request pipelined behind one in progress, start nothing.
    pub fn bytes_arrived(&self) {
        if !self.idle() {
            return;
        }
        let mut started = lock(&self.head_started);
        if started.is_none() {
            *started = Some(Instant::now());
            self.head_begun.notify_one();
        }
    }

    /// When the head now arriving began, if one is.
    pub fn head_started(&self) -> Option<Instant> {
        *lock(&self.head_started)
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
            head_started: Mutex::new(None),
            evict: Notify::new(),
            head_begun: Notify::new(),
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

/// A connection's stream, telling its [`Slot`] when bytes arrive.
pub(crate) struct Watched<S> {
    pub inner: S,
    pub slot: Arc<Slot>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.slot.bytes_arrived();
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
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

    #[test]
    fn a_head_starts_with_bytes_between_requests_and_ends_when_parsed() {
        let c = Arc::new(Connections::default());
        let r = c.register();
        assert_eq!(r.slot.head_started(), None, "a silent connection has none");
        r.slot.bytes_arrived();
        let started = r.slot.head_started().expect("the first bytes start a head");
        r.slot.bytes_arrived();
        assert_eq!(
            r.slot.head_started(),
            Some(started),
            "more bytes of it do not restart it"
        );
        let request = r.slot.begin();
        assert_eq!(r.slot.head_started(), None, "a parsed head ends it");
        r.slot.bytes_arrived();
        assert_eq!(r.slot.head_started(), None, "a body's bytes start no head");
        drop(request);
        assert_eq!(r.slot.head_started(), None, "an idle connection has none");
    }
}
