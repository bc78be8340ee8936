//! `GET /api/v1/vm.dax-events`: every DAX map, unmap, reset, refusal,
//! truncation, policy change and the daemons' adaptive decisions, as
//! server-sent events.
//!
//! Producers (the VMM's backend-request threads, the API itself) publish
//! into a bounded broadcast channel and never wait. Each subscriber has its
//! own view of the ring: one that falls more than the ring's size behind
//! loses the oldest events and is told how many, in a `lagged` event; the
//! VMM is never slowed down by a reader. The stream reports outward only:
//! what a daemon must hear travels on the notice queue
//! ([`crate::DaemonNotices`]), which never drops.
//!
//! The kinds a subscriber sees: `subscribed` (first, with the ring's size),
//! then the [`DaxEvent`]s' (`map`, `unmap`, `reset`, `truncated`,
//! `refused` from the VMM's windows; `policy`, `adaptive` from the policy
//! controller), and `lagged` when it fell behind.

use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream, StreamExt};
use serde_json::{json, Value};
use tokio::sync::broadcast;

/// Events kept for a subscriber that is behind.
pub const EVENT_BUFFER: usize = 1024;

/// One event: a kind (`map`, `unmap`, `reset`, `truncated`, `refused`,
/// `policy`, `adaptive`), the device it concerns, and its fields.
#[derive(Clone, Debug, PartialEq)]
pub struct DaxEvent {
    pub kind: &'static str,
    pub device: String,
    pub fields: Value,
    /// Milliseconds since the Unix epoch, when it happened.
    pub at_ms: u64,
}

impl DaxEvent {
    pub fn new(kind: &'static str, device: &str, fields: Value) -> Self {
        let at_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        DaxEvent {
            kind,
            device: device.to_string(),
            fields,
            at_ms,
        }
    }

    fn to_sse(&self) -> Event {
        let data = json!({"device": self.device, "at_ms": self.at_ms, "fields": self.fields});
        Event::default().event(self.kind).data(data.to_string())
    }
}

/// Where events are published; cheap to clone.
#[derive(Clone)]
pub struct EventBus {
    tx: broadcast::Sender<DaxEvent>,
}

impl Default for EventBus {
    fn default() -> Self {
        Self::with_capacity(EVENT_BUFFER)
    }
}

impl EventBus {
    pub fn with_capacity(capacity: usize) -> Self {
        EventBus {
            tx: broadcast::channel(capacity).0,
        }
    }

    /// Never blocks; with no subscriber the event is simply dropped.
    pub fn publish(&self, event: DaxEvent) {
        let _ = self.tx.send(event);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<DaxEvent> {
        self.tx.subscribe()
    }

    /// The SSE response for one subscriber.
    pub fn sse(&self) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
        let hello = Event::default()
            .event("subscribed")
            .data(json!({"buffer": self.tx.len().max(EVENT_BUFFER)}).to_string());
        let events = stream::unfold(self.subscribe(), |mut rx| async move {
            let event = match rx.recv().await {
                Ok(e) => e.to_sse(),
                Err(broadcast::error::RecvError::Lagged(n)) => Event::default()
                    .event("lagged")
                    .data(json!({"dropped": n}).to_string()),
                Err(broadcast::error::RecvError::Closed) => return None,
            };
            Some((Ok(event), rx))
        });
        Sse::new(stream::once(async { Ok(hello) }).chain(events)).keep_alive(KeepAlive::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_slow_subscriber_is_told_how_many_it_missed() {
        let bus = EventBus::with_capacity(4);
        let mut rx = bus.subscribe();
        for i in 0..10 {
            bus.publish(DaxEvent::new("map", "fs0", json!({"offset": i})));
        }
        match rx.recv().await {
            Err(broadcast::error::RecvError::Lagged(n)) => assert_eq!(n, 6),
            other => panic!("expected a lag, got {other:?}"),
        }
        assert_eq!(rx.recv().await.unwrap().fields["offset"], 6);
    }

    #[test]
    fn publishing_without_subscribers_does_not_fail() {
        EventBus::default().publish(DaxEvent::new("unmap", "fs0", Value::Null));
    }
}
