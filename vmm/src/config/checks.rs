//! The checks every device config shares, for the `validate` methods the
//! command line and the API both call: the error texts name the option,
//! the key, the value as the command line spells it, and the limit.

use std::fmt::Display;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{ConfigError, MAX_PCI_SEGMENTS};

/// How a virtio device reaches the guest (`"pci"` or `"mmio"` in JSON).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Transport {
    #[default]
    Pci,
    Mmio,
}

impl Transport {
    pub fn parse(v: &str) -> Result<Self, &'static str> {
        match v {
            "pci" => Ok(Transport::Pci),
            "mmio" => Ok(Transport::Mmio),
            _ => Err("pci or mmio"),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Pci => "pci",
            Transport::Mmio => "mmio",
        }
    }
}

impl Serialize for Transport {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> Deserialize<'de> for Transport {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v = String::deserialize(d)?;
        Transport::parse(&v).map_err(|expected| {
            serde::de::Error::custom(format!("transport=\"{v}\" is invalid: expected {expected}"))
        })
    }
}

/// `--<option>: key="value" is invalid: expected <expected>`.
pub(super) fn invalid(
    option: &'static str,
    key: &'static str,
    value: impl Display,
    expected: impl Into<String>,
) -> ConfigError {
    ConfigError::InvalidValue {
        option,
        key,
        value: value.to_string(),
        expected: expected.into(),
    }
}

/// `--<option>: key=value is not supported: why`.
pub(super) fn unsupported(
    option: &'static str,
    key: &str,
    value: impl Display,
    why: &str,
) -> ConfigError {
    ConfigError::Unsupported {
        option,
        message: format!("{key}={value} is not supported: {why}"),
    }
}

/// Cloud Hypervisor's `iommu`, which every device has: only its default
/// (off) exists here, and ch-remote sends it.
pub(super) fn no_iommu(option: &'static str, iommu: bool) -> Result<(), ConfigError> {
    if iommu {
        return Err(ConfigError::Unsupported {
            option,
            message: "iommu=on is not supported".into(),
        });
    }
    Ok(())
}

/// What a `pci_segment` must be.
pub(super) const PCI_SEGMENT_EXPECTED: &str =
    "a PCI segment number below 96 (Cloud Hypervisor's limit)";

/// The PCI segment the device goes on exists in some VM (whether in this
/// one depends on the whole VM: [`super::VmConfig::validate`]); a
/// virtio-MMIO device is on no segment, so only 0 is accepted for it.
pub(super) fn transport_and_segment(
    option: &'static str,
    transport: Transport,
    segment: u16,
) -> Result<(), ConfigError> {
    if segment >= MAX_PCI_SEGMENTS {
        return Err(invalid(
            option,
            "pci_segment",
            segment,
            PCI_SEGMENT_EXPECTED,
        ));
    }
    if transport == Transport::Mmio && segment != 0 {
        return Err(unsupported(
            option,
            "pci_segment",
            segment,
            "a transport=mmio device is on no PCI segment (only pci_segment=0 is accepted with it)",
        ));
    }
    Ok(())
}

/// Cloud Hypervisor's requested PCI slot: only null, since slots are assigned.
pub(super) fn no_pci_device_id(option: &'static str, slot: Option<u8>) -> Result<(), ConfigError> {
    match slot {
        Some(slot) => Err(ConfigError::Unsupported {
            option,
            message: format!("pci_device_id={slot} is not supported (slots are assigned)"),
        }),
        None => Ok(()),
    }
}

/// The device's id: the one given, or `_<prefix><index>` as Cloud
/// Hypervisor names a device given without one. An empty id is "not
/// given" in the config; the command line and the JSON refuse one spelled
/// out ([`non_empty_id`]).
pub(super) fn name_device(id: &mut String, prefix: &str, index: usize) {
    if id.is_empty() {
        *id = format!("_{prefix}{index}");
    }
}

pub(super) const ID_EXPECTED: &str = "a non-empty device id";

/// Deserializes an `id`, refusing `""` (which would read as "not given").
pub(super) fn non_empty_id<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    let id = Option::<String>::deserialize(d)?;
    match id {
        Some(id) if id.is_empty() => Err(serde::de::Error::custom(format!(
            "id=\"\" is invalid: expected {ID_EXPECTED}"
        ))),
        id => Ok(id.unwrap_or_default()),
    }
}

/// Cloud Hypervisor's default `pci_segment`, and serde's `true`.
pub(super) fn yes() -> bool {
    true
}
