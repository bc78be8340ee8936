//! Fields of a request body that Cloud Hypervisor would ignore.
//!
//! Cloud Hypervisor's request bodies are serde structs that leave their
//! objects open: a field it does not know is skipped, so its clients send
//! fields some other version has (Kata's runtime-rs sends
//! `payload.mrconfigid`). This VMM does the same for every Cloud Hypervisor
//! object (the VmConfig and its parts, the `vm.add-*` bodies, `vm.resize`,
//! `vm.remove-device`): a field neither it nor Cloud Hypervisor knows is
//! ignored. A field Cloud Hypervisor knows and this VMM cannot honour is
//! still refused by name (the VMM's config layer). The DAX policy document,
//! this VMM's own, stays closed: a misspelt policy field is refused.
//!
//! An ignored field is logged at info once per field (its object's path
//! without array indices, and its name) for the life of the process, so a
//! client that sends it with every request does not fill the log; at most
//! [`MAX_REMEMBERED`] fields are remembered, and past that one line says
//! that further ones go unlogged.

use std::collections::HashSet;
use std::sync::Mutex;

/// Distinct ignored fields logged at most.
pub const MAX_REMEMBERED: usize = 256;

/// A field name longer than this is cut in the log line.
const MAX_NAME_SHOWN: usize = 64;

static LOGGED: Mutex<Option<Logged>> = Mutex::new(None);

/// `object` (e.g. `VmConfig.disks[0]`) had a field `name` that Cloud
/// Hypervisor would ignore: it is ignored, and logged if it is the first
/// time this process sees it.
pub fn ignore(object: &str, name: &str) {
    let mut logged = LOGGED.lock().unwrap_or_else(|p| p.into_inner());
    logged
        .get_or_insert_with(Logged::default)
        .note(object, name);
}

/// The fields already logged.
#[derive(Default)]
struct Logged {
    fields: HashSet<String>,
    /// Whether the line saying the cap was reached was written.
    full: bool,
}

impl Logged {
    /// Logs the field if it is new and there is room; returns whether it did.
    fn note(&mut self, object: &str, name: &str) -> bool {
        let key = format!("{}.{}", without_indices(object), shown(name));
        if self.fields.contains(&key) {
            return false;
        }
        if self.fields.len() >= MAX_REMEMBERED {
            if !self.full {
                self.full = true;
                tracing::info!(
                    "API: {MAX_REMEMBERED} distinct unknown fields were ignored; further ones are ignored without a log line"
                );
            }
            return false;
        }
        tracing::info!(
            "API: {key}: unknown field ignored, as Cloud Hypervisor ignores it (logged once)"
        );
        self.fields.insert(key);
        true
    }
}

/// `VmConfig.disks[0]` → `VmConfig.disks`: one log line for a field
/// whichever element of an array carried it.
fn without_indices(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => in_index = true,
            ']' => in_index = false,
            c if !in_index => out.push(c),
            _ => {}
        }
    }
    out
}

/// The name as logged: printable, and at most [`MAX_NAME_SHOWN`] chars.
fn shown(name: &str) -> String {
    let cut: String = name.chars().take(MAX_NAME_SHOWN).collect();
    let escaped = cut.escape_debug().to_string();
    if name.chars().count() > MAX_NAME_SHOWN {
        format!("{escaped}…")
    } else {
        escaped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_field_is_logged_once_whatever_the_array_element() {
        let mut l = Logged::default();
        assert!(l.note("VmConfig.payload", "mrconfigid"));
        assert!(!l.note("VmConfig.payload", "mrconfigid"));
        assert!(l.note("VmConfig.disks[0]", "frob"));
        assert!(
            !l.note("VmConfig.disks[3]", "frob"),
            "same field, another element"
        );
        assert!(l.note("VmConfig.disks[0]", "frob2"), "another field");
        assert!(
            l.note("VmConfig.fs[0]", "frob"),
            "the same name in another object"
        );
        assert_eq!(without_indices("V.a[12].b[0]"), "V.a.b");
        assert_eq!(shown("a\nb"), "a\\nb");
        assert_eq!(shown(&"x".repeat(100)).chars().count(), MAX_NAME_SHOWN + 1);
        // The process-wide one takes any field without failing.
        ignore("VmConfig", "anything");
    }

    #[test]
    fn the_set_of_logged_fields_is_bounded() {
        let mut l = Logged::default();
        let logged = (0..MAX_REMEMBERED * 2)
            .filter(|i| l.note("VmConfig", &format!("f{i}")))
            .count();
        assert_eq!(logged, MAX_REMEMBERED);
        assert_eq!(l.fields.len(), MAX_REMEMBERED);
        assert!(l.full);
        assert!(
            !l.note("VmConfig", "never-seen"),
            "past the cap nothing is logged"
        );
    }
}
