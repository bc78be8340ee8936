//! What a paused virtio device hands over for a snapshot and takes back on
//! restore: each activated queue's position ([`SavedQueue`]) and the
//! device's own state as a JSON value (see the `VirtioDevice` methods
//! `pause`, `resume`, `save_state`, `restore_state`, `check_movable`),
//! and the one error those methods return ([`DeviceStateError`]).
//!
//! A saved state comes back from a file: everything in it is checked
//! before anything is applied, and a refusal names the field.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestAddress;

#[derive(Debug, thiserror::Error)]
pub enum DeviceStateError {
    /// The device has no pause/save support (yet): the snapshot or the
    /// migration is refused before anything is paused.
    #[error("{device}: cannot be paused/saved (not supported for this device)")]
    NotSupported { device: String },
    /// This device, as configured, cannot be saved (asked before anything
    /// pauses).
    #[error("{device}: cannot be saved: {reason}")]
    NotMovable { device: String, reason: String },
    /// Pausing or resuming failed (a worker that did not stop in time).
    #[error("{device}: pausing: {reason}")]
    Pause { device: String, reason: String },
    /// A migration's switch: the device could not let go of (`step`
    /// "releasing") or take back ("reclaiming") its host side; `reason`
    /// names the file, tap or socket.
    #[error("{device}: {step} its host side for a migration's switch: {reason}")]
    Switch {
        device: String,
        step: &'static str,
        reason: String,
    },
    /// A saved value the device refuses: which one and why.
    #[error("{device}: saved state: {field}: {reason}")]
    Invalid {
        device: String,
        field: String,
        reason: String,
    },
}

/// Who [`SavedQueue::to_queue`] names in its errors (the caller knows the
/// device and the queue's index and adds them).
pub const QUEUE_STATE: &str = "virtio queue";

/// One queue's position and layout, as `virtio_queue::QueueState` (which
/// has no serde) carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SavedQueue {
    pub max_size: u16,
    pub size: u16,
    pub ready: bool,
    /// The next available-ring entry the device takes.
    pub next_avail: u16,
    /// The next used-ring entry the device fills.
    pub next_used: u16,
    pub event_idx_enabled: bool,
    pub desc_table: u64,
    pub avail_ring: u64,
    pub used_ring: u64,
}

impl From<QueueState> for SavedQueue {
    fn from(s: QueueState) -> Self {
        SavedQueue {
            max_size: s.max_size,
            size: s.size,
            ready: s.ready,
            next_avail: s.next_avail,
            next_used: s.next_used,
            event_idx_enabled: s.event_idx_enabled,
            desc_table: s.desc_table,
            avail_ring: s.avail_ring,
            used_ring: s.used_ring,
        }
    }
}

impl SavedQueue {
    /// The queue again, each value checked as the driver's register writes
    /// are (`Queue`'s own checks); the error names the field. Chains taken
    /// and not used (`next_avail - next_used`) cannot exceed the size.
    pub fn to_queue(&self) -> Result<Queue, DeviceStateError> {
        let bad = |field: &str, e: virtio_queue::Error| invalid(QUEUE_STATE, field, e);
        let mut q = Queue::new(self.max_size).map_err(|e| bad("max_size", e))?;
        q.try_set_size(self.size).map_err(|e| bad("size", e))?;
        q.try_set_desc_table_address(GuestAddress(self.desc_table))
            .map_err(|e| bad("desc_table", e))?;
        q.try_set_avail_ring_address(GuestAddress(self.avail_ring))
            .map_err(|e| bad("avail_ring", e))?;
        q.try_set_used_ring_address(GuestAddress(self.used_ring))
            .map_err(|e| bad("used_ring", e))?;
        let taken = self.next_avail.wrapping_sub(self.next_used);
        if taken > self.size {
            return Err(invalid(
                QUEUE_STATE,
                "next_used",
                format!(
                    "{} behind next_avail {}, more than the size {}",
                    taken, self.next_avail, self.size
                ),
            ));
        }
        q.set_next_avail(self.next_avail);
        q.set_next_used(self.next_used);
        q.set_event_idx(self.event_idx_enabled);
        q.set_ready(self.ready);
        Ok(q)
    }
}

/// [`DeviceStateError::Invalid`] for `device`'s `field`.
pub fn invalid(device: &str, field: &str, reason: impl std::fmt::Display) -> DeviceStateError {
    DeviceStateError::Invalid {
        device: device.to_string(),
        field: field.to_string(),
        reason: reason.to_string(),
    }
}

/// Reads a saved device state field by field, so every refusal names its
/// field: the value must be an object, each [`Self::take`] parses one
/// field, [`Self::finish`] refuses fields nobody took.
pub struct StateFields<'a> {
    device: &'a str,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl<'a> StateFields<'a> {
    pub fn new(device: &'a str, state: &serde_json::Value) -> Result<Self, DeviceStateError> {
        match state {
            serde_json::Value::Object(fields) => Ok(StateFields {
                device,
                fields: fields.clone(),
            }),
            other => Err(invalid(
                device,
                "state",
                format!("not an object: {}", kind(other)),
            )),
        }
    }

    /// The field `name`, parsed; missing or of the wrong shape is an error
    /// naming it.
    pub fn take<T: DeserializeOwned>(&mut self, name: &str) -> Result<T, DeviceStateError> {
        let v = self
            .fields
            .remove(name)
            .ok_or_else(|| invalid(self.device, name, "missing"))?;
        serde_json::from_value(v).map_err(|e| invalid(self.device, name, e))
    }

    /// Refuses a field the device does not know (a newer or another
    /// device's state).
    pub fn finish(self) -> Result<(), DeviceStateError> {
        match self.fields.keys().next() {
            Some(name) => Err(invalid(self.device, name, "unknown field")),
            None => Ok(()),
        }
    }
}

fn kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_queue() -> Queue {
        let mut q = Queue::new(16).unwrap();
        q.set_size(8);
        q.set_desc_table_address(Some(0x1000), None);
        q.set_avail_ring_address(Some(0x2000), None);
        q.set_used_ring_address(Some(0x3000), None);
        q.set_next_avail(7);
        q.set_next_used(5);
        q.set_event_idx(true);
        q.set_ready(true);
        q
    }

    #[test]
    fn a_saved_queue_round_trips_through_json_into_the_same_queue() {
        let saved = SavedQueue::from(ready_queue().state());
        assert_eq!((saved.next_avail, saved.next_used, saved.size), (7, 5, 8));
        let json = serde_json::to_value(saved).unwrap();
        let back: SavedQueue = serde_json::from_value(json).unwrap();
        assert_eq!(back, saved);
        assert_eq!(back.to_queue().unwrap().state(), ready_queue().state());
    }

    #[test]
    fn a_queue_the_driver_could_not_have_set_up_is_refused_by_field() {
        let good = SavedQueue::from(ready_queue().state());
        let field_of = |s: SavedQueue| match s.to_queue().err() {
            Some(DeviceStateError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            field_of(SavedQueue {
                max_size: 3,
                ..good
            }),
            "max_size"
        );
        assert_eq!(field_of(SavedQueue { size: 32, ..good }), "size");
        assert_eq!(
            field_of(SavedQueue {
                desc_table: 0x1001,
                ..good
            }),
            "desc_table"
        );
        assert_eq!(
            field_of(SavedQueue {
                avail_ring: 0x2001,
                ..good
            }),
            "avail_ring"
        );
        assert_eq!(
            field_of(SavedQueue {
                used_ring: 0x3001,
                ..good
            }),
            "used_ring"
        );
        assert_eq!(
            field_of(SavedQueue {
                next_used: 7u16.wrapping_sub(9),
                ..good
            }),
            "next_used"
        );
        // Wrapping indices are fine as long as the distance fits.
        let wrapped = SavedQueue {
            next_avail: 2,
            next_used: u16::MAX - 1,
            ..good
        };
        assert!(wrapped.to_queue().is_ok());
    }

    #[test]
    fn state_fields_name_the_missing_the_malformed_and_the_unknown() {
        let field_of = |r: Result<(), DeviceStateError>| match r {
            Err(DeviceStateError::Invalid { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let e = StateFields::new("dev", &serde_json::json!(3))
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "dev: saved state: state: not an object: a number"
        );
        let value = serde_json::json!({"cid": "x", "other": 1});
        let mut f = StateFields::new("dev", &value).unwrap();
        assert_eq!(field_of(f.take::<u64>("cid").map(drop)), "cid");
        assert_eq!(field_of(f.take::<u64>("mac").map(drop)), "mac");
        assert_eq!(field_of(f.finish()), "other");
        let value = serde_json::json!({"cid": 3});
        let mut f = StateFields::new("dev", &value).unwrap();
        assert_eq!(f.take::<u64>("cid").unwrap(), 3);
        assert!(f.finish().is_ok());
    }
}
