//! Tests of `lib.rs`: the traits on a small component, and the state
//! document's envelope (round trip, and each refusal naming its section).

use super::*;

/// A component with state of its own: a counter that moves only while not
/// paused, and a name its restore needs from outside its state.
struct Counter {
    name: String,
    count: u64,
    paused: bool,
    movable: bool,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct CounterState {
    count: u64,
    paused: bool,
}

impl SectionState for CounterState {
    const KIND: &'static str = "counter";
    const VERSION: u32 = 2;
}

/// Another kind, for the kind check.
#[derive(Debug, Serialize, Deserialize)]
struct OtherState {
    count: u64,
    paused: bool,
}

impl SectionState for OtherState {
    const KIND: &'static str = "other";
    const VERSION: u32 = 2;
}

impl Counter {
    fn tick(&mut self) {
        if !self.paused {
            self.count += 1;
        }
    }
}

impl Pausable for Counter {
    fn pause(&mut self) -> Result<(), StateError> {
        self.paused = true;
        Ok(())
    }
    fn resume(&mut self) -> Result<(), StateError> {
        self.paused = false;
        Ok(())
    }
}

impl Persist for Counter {
    type State = CounterState;
    type RestoreArgs<'a> = &'a str;

    fn save(&mut self) -> Result<CounterState, StateError> {
        if !self.paused {
            return Err(StateError::Invalid {
                section: self.name.clone(),
                field: "paused".to_string(),
                reason: "saved while running".to_string(),
            });
        }
        Ok(CounterState {
            count: self.count,
            paused: self.paused,
        })
    }

    fn restore(name: &str, state: &CounterState) -> Result<Self, StateError> {
        Ok(Counter {
            name: name.to_string(),
            count: state.count,
            paused: state.paused,
            movable: true,
        })
    }
}

impl Migratable for Counter {
    fn check_movable(&self, how: MoveKind) -> Result<(), StateError> {
        if self.movable || how == MoveKind::LocalMigration {
            return Ok(());
        }
        Err(StateError::NotMovable {
            component: self.name.clone(),
            how,
            reason: "its backend lives only in this process".to_string(),
        })
    }
}

fn counter(name: &str, count: u64) -> Counter {
    Counter {
        name: name.to_string(),
        count,
        paused: false,
        movable: true,
    }
}

/// A document with one counter saved as "devices/c0", as JSON bytes.
fn saved_document() -> Vec<u8> {
    let mut c = counter("c0", 41);
    c.tick();
    c.pause().unwrap();
    c.tick();
    let mut doc = StateDocument::new("0.1.0");
    doc.put("devices/c0", &c.save().unwrap()).unwrap();
    doc.to_json().unwrap()
}

/// Edits the JSON of a saved document.
fn edited(edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let mut v: serde_json::Value = serde_json::from_slice(&saved_document()).unwrap();
    edit(&mut v);
    serde_json::to_vec(&v).unwrap()
}

#[test]
fn a_component_round_trips_through_the_document() {
    let bytes = saved_document();
    let mut doc = StateDocument::from_json(&bytes).unwrap();
    assert_eq!(doc.vmm_version(), "0.1.0");
    let state: CounterState = doc.take("devices/c0").unwrap();
    assert_eq!(
        state,
        CounterState {
            count: 42,
            paused: true
        },
        "the tick while paused did not count"
    );
    doc.finish().unwrap();
    let mut restored = Counter::restore("c0", &state).unwrap();
    assert_eq!((restored.count, restored.paused), (42, true));
    restored.resume().unwrap();
    restored.tick();
    assert_eq!(restored.count, 43);
}

/// The compact form a migration sends reads back as the same document as
/// the pretty one a snapshot writes, and is smaller.
#[test]
fn the_compact_form_reads_back_as_the_pretty_one() {
    let pretty = saved_document();
    let doc = StateDocument::from_json(&pretty).unwrap();
    let compact = doc.to_compact_json().unwrap();
    assert!(
        compact.len() < pretty.len(),
        "{} >= {}",
        compact.len(),
        pretty.len()
    );
    let mut back = StateDocument::from_json(&compact).unwrap();
    let state: CounterState = back.take("devices/c0").unwrap();
    assert_eq!(
        state,
        CounterState {
            count: 42,
            paused: true
        }
    );
    back.finish().unwrap();
    let a: serde_json::Value = serde_json::from_slice(&pretty).unwrap();
    let b: serde_json::Value = serde_json::from_slice(&compact).unwrap();
    assert_eq!(a, b);
}

#[test]
fn the_envelope_is_the_documented_shape() {
    let v: serde_json::Value = serde_json::from_slice(&saved_document()).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "format": "dax-vmm",
            "version": 1,
            "vmm_version": "0.1.0",
            "sections": {
                "devices/c0": {"kind": "counter", "version": 2, "state": {"count": 42, "paused": true}}
            }
        })
    );
}

#[test]
fn an_unknown_section_version_is_refused_naming_the_section() {
    let bytes = edited(|v| v["sections"]["devices/c0"]["version"] = 3.into());
    let mut doc = StateDocument::from_json(&bytes).unwrap();
    let err = doc.take::<CounterState>("devices/c0").unwrap_err();
    assert!(
        matches!(&err, StateError::UnknownVersion { section, found: 3, supported: 2 } if section == "devices/c0"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "devices/c0: version 3 cannot be restored by this build (it restores version 2)"
    );
}

#[test]
fn a_missing_section_is_named() {
    let mut doc = StateDocument::from_json(&saved_document()).unwrap();
    let err = doc.take::<CounterState>("devices/c1").unwrap_err();
    assert_eq!(
        err.to_string(),
        "devices/c1: missing from the state document"
    );
}

#[test]
fn a_section_nothing_restores_is_named() {
    let doc = StateDocument::from_json(&saved_document()).unwrap();
    let err = doc.finish().unwrap_err();
    assert!(
        matches!(&err, StateError::UnclaimedSection { section } if section == "devices/c0"),
        "{err:?}"
    );
}

#[test]
fn a_section_of_another_kind_is_refused() {
    let mut doc = StateDocument::from_json(&saved_document()).unwrap();
    let err = doc.take::<OtherState>("devices/c0").unwrap_err();
    assert_eq!(
        err.to_string(),
        "devices/c0: holds the state of a \"counter\", not of a \"other\""
    );
}

#[test]
fn a_field_that_does_not_decode_is_named_by_its_path() {
    let bytes = edited(|v| v["sections"]["devices/c0"]["state"]["count"] = "many".into());
    let mut doc = StateDocument::from_json(&bytes).unwrap();
    let err = doc.take::<CounterState>("devices/c0").unwrap_err();
    assert!(
        matches!(&err, StateError::Invalid { section, field, .. } if section == "devices/c0" && field == "state.count"),
        "{err:?}"
    );
    // A section without its version.
    let bytes = edited(|v| {
        v["sections"]["devices/c0"]
            .as_object_mut()
            .unwrap()
            .remove("version");
    });
    let mut doc = StateDocument::from_json(&bytes).unwrap();
    let err = doc.take::<CounterState>("devices/c0").unwrap_err();
    assert!(
        err.to_string().starts_with("devices/c0: ") && err.to_string().contains("version"),
        "{err}"
    );
}

#[test]
fn another_format_or_document_version_is_refused_before_any_section() {
    let err =
        StateDocument::from_json(&edited(|v| v["format"] = "cloud-hypervisor".into())).unwrap_err();
    assert!(
        matches!(&err, StateError::UnknownFormat { found } if found == "cloud-hypervisor"),
        "{err:?}"
    );
    // Cloud Hypervisor's state.json has no format field at all.
    let err = StateDocument::from_json(br#"{"snapshots":{},"snapshot_data":null}"#).unwrap_err();
    assert!(
        matches!(&err, StateError::UnknownFormat { found } if found == "(none)"),
        "{err:?}"
    );
    // A version mismatch wins over a section that would not decode.
    let err = StateDocument::from_json(&edited(|v| {
        v["version"] = 2.into();
        v["sections"] = "garbage".into();
    }))
    .unwrap_err();
    assert!(
        matches!(&err, StateError::UnknownVersion { section, found: 2, supported: 1 } if section == "document"),
        "{err:?}"
    );
    let err = StateDocument::from_json(b"{\"format\": \"dax-vmm\",").unwrap_err();
    assert!(
        matches!(&err, StateError::Invalid { section, .. } if section == "document"),
        "{err:?}"
    );
}

#[test]
fn a_name_is_put_once() {
    let mut doc = StateDocument::new("0.1.0");
    let state = CounterState {
        count: 1,
        paused: true,
    };
    doc.put("vm", &state).unwrap();
    let err = doc.put("vm", &state).unwrap_err();
    assert!(
        matches!(&err, StateError::DuplicateSection { section } if section == "vm"),
        "{err:?}"
    );
    assert_eq!(doc.section_names().collect::<Vec<_>>(), ["vm"]);
}

#[test]
fn what_cannot_move_is_named_with_how() {
    let mut c = counter("net0", 0);
    c.movable = false;
    c.check_movable(MoveKind::LocalMigration).unwrap();
    let err = c.check_movable(MoveKind::Snapshot).unwrap_err();
    assert_eq!(
        err.to_string(),
        "net0 cannot be carried by a snapshot: its backend lives only in this process"
    );
}
