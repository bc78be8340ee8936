//! What every owner of VM state implements so that a VM can be snapshotted,
//! restored and moved to a new VMM process, and the document the state is
//! written in.
//!
//! The split follows the two models the plan names (read, not copied):
//! Cloud Hypervisor's `vm-migration` keeps pausing apart from saving
//! (`Pausable` / `Snapshottable`), and Firecracker's `persist.rs` restores a
//! device by constructing it from its saved state rather than by patching a
//! live one. Here:
//!
//! - [`Pausable`]: after `pause` returns Ok nothing the component owns
//!   changes until `resume` (no guest request served, no queue moved).
//! - [`Persist`]: `save` returns a serde value; `restore` is a constructor
//!   taking the same value, so a half-restored component never exists.
//! - [`Migratable`]: asked before anything is paused; an error names what
//!   cannot move and why, so an operator learns it while the VM still runs.
//! - [`StateDocument`]: the one JSON document a snapshot's `state.json` and
//!   a migration's `State` payload carry. The document has a format name and
//!   a version; each section (the VM, a vCPU, a device) carries its own kind
//!   and version, so a section can change without the others, and a restore
//!   refuses a version it does not know by the section's name.
//!
//! [`protocol`] is the migration wire protocol (Cloud Hypervisor's framing
//! and our two fd-passing commands); [`fd_socket`] passes the fds over its
//! unix socket.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

pub mod fd_socket;
pub mod protocol;

/// The `format` of every state document this crate writes; another value
/// is refused before any section is read.
pub const DOCUMENT_FORMAT: &str = "dax-vmm";
/// The version of the document's envelope (the top-level fields and how a
/// section is framed), not of any section.
pub const DOCUMENT_VERSION: u32 = 1;

/// Why pausing, saving, restoring or moving failed; every variant names the
/// section or component (and the field where there is one).
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("the state document's format is {found:?}, not {DOCUMENT_FORMAT:?}: it was not written by dax-vmm")]
    UnknownFormat { found: String },
    #[error("{section}: version {found} cannot be restored by this build (it restores version {supported})")]
    UnknownVersion {
        section: String,
        found: u32,
        supported: u32,
    },
    #[error("{section}: holds the state of a {found:?}, not of a {expected:?}")]
    WrongKind {
        section: String,
        found: String,
        expected: &'static str,
    },
    #[error("{section}: missing from the state document")]
    MissingSection { section: String },
    #[error("{section}: present in the state document but restored by nothing (its state would be lost)")]
    UnclaimedSection { section: String },
    #[error("{section}: a section of that name is already in the document")]
    DuplicateSection { section: String },
    #[error("{section}: {field}: {reason}")]
    Invalid {
        section: String,
        field: String,
        reason: String,
    },
    #[error("{section}: cannot be written: {reason}")]
    Encode { section: String, reason: String },
    #[error("{component}: cannot pause: {reason}")]
    Pause { component: String, reason: String },
    #[error("{component}: cannot resume: {reason}")]
    Resume { component: String, reason: String },
    #[error("{component} cannot be carried by {how}: {reason}")]
    NotMovable {
        component: String,
        how: MoveKind,
        reason: String,
    },
}

/// Quiesce a component: after `pause` returns Ok, nothing it owns changes
/// (no queue advances, no request is served, no interrupt is raised) until
/// `resume`. Both are expected to be idempotent.
pub trait Pausable {
    fn pause(&mut self) -> Result<(), StateError>;
    fn resume(&mut self) -> Result<(), StateError>;
}

/// The serde type a component saves, with the name and version of its
/// section in the state document.
pub trait SectionState: Serialize + DeserializeOwned {
    /// What kind of component wrote it (`"fs"`, `"vcpu"`); a section of
    /// another kind is refused, naming both.
    const KIND: &'static str;
    /// The version this build writes and restores. Bump it whenever the
    /// type's serialized form changes meaning.
    const VERSION: u32;
}

/// Save a component's state; restore is a constructor taking the same
/// value (what the component cannot hold in its state, such as guest
/// memory or a passed fd, comes in `RestoreArgs`).
pub trait Persist: Sized {
    type State: SectionState;
    type RestoreArgs<'a>;
    /// `&mut self`: saving may need to stop something first (a vhost-user
    /// device's rings). Called on a paused component.
    fn save(&mut self) -> Result<Self::State, StateError>;
    fn restore(args: Self::RestoreArgs<'_>, state: &Self::State) -> Result<Self, StateError>;
}

/// How a VM is being moved: what a component can rely on at the other end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum MoveKind {
    /// To files; restored later by a new process (the old one is gone, so
    /// nothing it holds can be handed over).
    Snapshot,
    /// To a new VMM process on this host over a unix socket, while the old
    /// one still holds its fds (guest memory, tap, the DAX window's files)
    /// and can pass them.
    LocalMigration,
}

impl fmt::Display for MoveKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MoveKind::Snapshot => "a snapshot",
            MoveKind::LocalMigration => "a local migration",
        })
    }
}

/// Checked on every component before anything is paused.
pub trait Migratable {
    /// Err([`StateError::NotMovable`]) names the component and why it cannot
    /// be carried by `how` (a vhost-user daemon without device-state
    /// support, a tap that cannot be reopened).
    fn check_movable(&self, how: MoveKind) -> Result<(), StateError>;
}

/// One section as the document holds it: who wrote it, in which version,
/// and the state itself.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Section {
    kind: String,
    version: u32,
    state: Box<RawValue>,
}

/// The versioned state document (`state.json`, a migration's `State`).
///
/// Sections are named by their owner (`"vm"`, `"vcpu/0"`, `"devices/fs0"`);
/// a restore `take`s each one it restores and `finish`es, which refuses a
/// section nothing took.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StateDocument {
    format: String,
    version: u32,
    /// The writer's version, for the operator reading the file; a restore
    /// does not compare it (the sections' versions decide).
    vmm_version: String,
    /// Kept as JSON text until taken, so a section that does not decode is
    /// reported by its name rather than as a position in the file, and each
    /// is decoded once, straight into its owner's type: a migration does
    /// all of this while the guest is paused, and building a JSON value
    /// tree of every saved byte first cost it as much as the decoding.
    sections: BTreeMap<String, Box<RawValue>>,
}

/// The envelope's identity, read before anything else of a document.
#[derive(Deserialize)]
struct Envelope {
    format: Option<serde_json::Value>,
    version: Option<serde_json::Value>,
}

impl StateDocument {
    /// An empty document written by VMM version `vmm_version`.
    pub fn new(vmm_version: &str) -> Self {
        StateDocument {
            format: DOCUMENT_FORMAT.to_string(),
            version: DOCUMENT_VERSION,
            vmm_version: vmm_version.to_string(),
            sections: BTreeMap::new(),
        }
    }

    /// The version of dax-vmm that wrote the document.
    pub fn vmm_version(&self) -> &str {
        &self.vmm_version
    }

    /// The names of the sections not taken yet.
    pub fn section_names(&self) -> impl Iterator<Item = &str> {
        self.sections.keys().map(String::as_str)
    }

    /// Adds `state` as section `name`; a name already present is refused
    /// (two owners claiming one name would lose one's state).
    pub fn put<T: SectionState>(&mut self, name: &str, state: &T) -> Result<(), StateError> {
        if self.sections.contains_key(name) {
            return Err(StateError::DuplicateSection {
                section: name.to_string(),
            });
        }
        let encode = |e: serde_json::Error| StateError::Encode {
            section: name.to_string(),
            reason: e.to_string(),
        };
        let state = serde_json::value::to_raw_value(state).map_err(encode)?;
        let section = Section {
            kind: T::KIND.to_string(),
            version: T::VERSION,
            state,
        };
        let raw = serde_json::value::to_raw_value(&section).map_err(encode)?;
        self.sections.insert(name.to_string(), raw);
        Ok(())
    }

    /// Removes section `name` and decodes it as `T`: refused if missing, of
    /// another kind, of a version other than `T::VERSION`, or if a field
    /// does not decode (the error names the field's path).
    pub fn take<T: SectionState>(&mut self, name: &str) -> Result<T, StateError> {
        let raw = self
            .sections
            .remove(name)
            .ok_or_else(|| StateError::MissingSection {
                section: name.to_string(),
            })?;
        let section: Section = decode_field(name, "", raw.get())?;
        if section.kind != T::KIND {
            return Err(StateError::WrongKind {
                section: name.to_string(),
                found: section.kind,
                expected: T::KIND,
            });
        }
        if section.version != T::VERSION {
            return Err(StateError::UnknownVersion {
                section: name.to_string(),
                found: section.version,
                supported: T::VERSION,
            });
        }
        decode_field(name, "state.", section.state.get())
    }

    /// Ends a restore: Ok only if every section was taken.
    pub fn finish(self) -> Result<(), StateError> {
        match self.sections.into_keys().next() {
            Some(section) => Err(StateError::UnclaimedSection { section }),
            None => Ok(()),
        }
    }

    /// The document as JSON (pretty, sections included: operators read
    /// `state.json`).
    pub fn to_json(&self) -> Result<Vec<u8>, StateError> {
        let encode = |e: serde_json::Error| StateError::Encode {
            section: "document".to_string(),
            reason: e.to_string(),
        };
        // Through a value tree: raw sections would be written as they are
        // held, on one line each.
        let value = serde_json::to_value(self).map_err(encode)?;
        serde_json::to_vec_pretty(&value).map_err(encode)
    }

    /// The document as compact JSON, for a migration's `State`: sent while
    /// the guest is paused, where pretty printing's indentation (a line per
    /// number of every saved byte array) only costs downtime. Read back by
    /// [`Self::from_json`] like the pretty form.
    pub fn to_compact_json(&self) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(self).map_err(|e| StateError::Encode {
            section: "document".to_string(),
            reason: e.to_string(),
        })
    }

    /// Reads a document: its format and envelope version are checked before
    /// anything else, so a file of another format or version is refused as
    /// such rather than by whichever field first fails to decode.
    pub fn from_json(bytes: &[u8]) -> Result<Self, StateError> {
        let text = std::str::from_utf8(bytes).map_err(|e| StateError::Invalid {
            section: "document".to_string(),
            field: "(JSON)".to_string(),
            reason: e.to_string(),
        })?;
        let envelope: Envelope = serde_json::from_str(text).map_err(|e| StateError::Invalid {
            section: "document".to_string(),
            field: "(JSON)".to_string(),
            reason: e.to_string(),
        })?;
        let format = envelope.format.as_ref().and_then(serde_json::Value::as_str);
        if format != Some(DOCUMENT_FORMAT) {
            return Err(StateError::UnknownFormat {
                found: format.unwrap_or("(none)").to_string(),
            });
        }
        let version = envelope
            .version
            .as_ref()
            .and_then(serde_json::Value::as_u64);
        if version != Some(u64::from(DOCUMENT_VERSION)) {
            return Err(StateError::UnknownVersion {
                section: "document".to_string(),
                found: version.and_then(|v| u32::try_from(v).ok()).unwrap_or(0),
                supported: DOCUMENT_VERSION,
            });
        }
        decode_field("document", "", text)
    }
}

/// Decodes the JSON `text`, naming the failing field as `section:
/// prefix.path`. Decoded without tracking the path first (the path's
/// bookkeeping per element of every saved byte array doubled the time a
/// migration's receiver spent decoding); only a text that fails is
/// decoded again to find where.
fn decode_field<T: DeserializeOwned>(
    section: &str,
    prefix: &str,
    text: &str,
) -> Result<T, StateError> {
    if let Ok(value) = serde_json::from_str(text) {
        return Ok(value);
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let value: T = serde_path_to_error::deserialize(&mut de).map_err(|e| StateError::Invalid {
        section: section.to_string(),
        field: match e.path().to_string().as_str() {
            "." => prefix.trim_end_matches('.').to_string(),
            path => format!("{prefix}{path}"),
        },
        reason: e.into_inner().to_string(),
    })?;
    de.end().map_err(|e| StateError::Invalid {
        section: section.to_string(),
        field: "(JSON)".to_string(),
        reason: e.to_string(),
    })?;
    Ok(value)
}

#[cfg(test)]
#[path = "lib_tests.rs"]
mod tests;
