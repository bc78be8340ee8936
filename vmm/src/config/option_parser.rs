//! Parser for Cloud Hypervisor style option values: `key=value,key=value`,
//! from which each option fills its config type (whose `validate` checks
//! the values, as for an API body).
//!
//! Every option declares the keys it accepts, so a typo is reported with the
//! option's name and the full list of accepted keys instead of being ignored.

use std::collections::BTreeMap;

use super::checks::{ID_EXPECTED, PCI_SEGMENT_EXPECTED};
use super::{ConfigError, Transport};

/// The parsed `key=value` pairs of one option, e.g. `--memory size=1G,shared=on`.
#[derive(Debug)]
pub struct OptionValues {
    option: &'static str,
    values: BTreeMap<String, String>,
}

impl OptionValues {
    /// Splits `input` on commas and checks every key against `accepted`.
    pub fn parse(
        option: &'static str,
        input: &str,
        accepted: &'static [&'static str],
    ) -> Result<Self, ConfigError> {
        let mut values = BTreeMap::new();
        for item in input.split(',') {
            if item.is_empty() {
                continue;
            }
            let (key, value) = item.split_once('=').ok_or_else(|| ConfigError::Malformed {
                option,
                item: item.to_string(),
                accepted: accepted.join(", "),
            })?;
            if !accepted.contains(&key) {
                return Err(ConfigError::UnknownKey {
                    option,
                    key: key.to_string(),
                    accepted: accepted.join(", "),
                });
            }
            if values.insert(key.to_string(), value.to_string()).is_some() {
                return Err(ConfigError::DuplicateKey {
                    option,
                    key: key.to_string(),
                });
            }
        }
        Ok(OptionValues { option, values })
    }

    pub fn get(&self, key: &str) -> Option<&str> {
        self.values.get(key).map(String::as_str)
    }

    /// The value of `key` converted by `convert`, which names what it expected on failure.
    pub fn convert<T>(
        &self,
        key: &'static str,
        convert: impl Fn(&str) -> Result<T, &'static str>,
    ) -> Result<Option<T>, ConfigError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => convert(v)
                .map(Some)
                .map_err(|expected| self.invalid(key, v, expected)),
        }
    }

    pub fn invalid(&self, key: &'static str, value: &str, expected: &str) -> ConfigError {
        ConfigError::InvalidValue {
            option: self.option,
            key,
            value: value.to_string(),
            expected: expected.to_string(),
        }
    }

    /// `key=<value> is not supported: why`, naming this option.
    pub fn unsupported(&self, key: &str, why: &str) -> ConfigError {
        ConfigError::Unsupported {
            option: self.option,
            message: format!(
                "{key}={} is not supported: {why}",
                self.get(key).unwrap_or("")
            ),
        }
    }

    /// Refuses the first of `keys` that was given (Cloud Hypervisor keys
    /// with no meaning here), saying `why`.
    pub fn refuse_any(&self, keys: &[&str], why: &str) -> Result<(), ConfigError> {
        match keys.iter().find(|k| self.get(k).is_some()) {
            Some(key) => Err(self.unsupported(key, why)),
            None => Ok(()),
        }
    }

    /// A toggle key (`on`/`off`), if given.
    pub fn toggle(&self, key: &'static str) -> Result<Option<bool>, ConfigError> {
        self.convert(key, parse_toggle)
    }

    /// A key's text, if given.
    pub fn text(&self, key: &str) -> Option<String> {
        self.get(key).map(str::to_string)
    }

    /// A number a u16 field holds; one that does not fit is refused with
    /// `expected`, the field's limit (which its `validate` checks).
    pub fn u16_value(&self, key: &'static str, expected: &str) -> Result<Option<u16>, ConfigError> {
        let Some(n) = self.convert(key, parse_u32)? else {
            return Ok(None);
        };
        u16::try_from(n)
            .map(Some)
            .map_err(|_| self.invalid(key, &n.to_string(), expected))
    }

    /// The `transport` key (virtio-PCI when not given).
    pub fn transport(&self) -> Result<Transport, ConfigError> {
        Ok(self
            .convert("transport", Transport::parse)?
            .unwrap_or_default())
    }

    /// The `pci_segment` key (0 when not given).
    pub fn pci_segment(&self) -> Result<u16, ConfigError> {
        Ok(self
            .convert("pci_segment", |v| {
                v.parse::<u16>().map_err(|_| PCI_SEGMENT_EXPECTED)
            })?
            .unwrap_or(0))
    }

    /// The `id` key: the one given (not empty), or empty when absent (the
    /// config's `validate` names the device then).
    pub fn id(&self) -> Result<String, ConfigError> {
        match self.get("id") {
            Some("") => Err(self.invalid("id", "", ID_EXPECTED)),
            other => Ok(other.unwrap_or_default().to_string()),
        }
    }
}

/// `on`/`off` (also `true`/`false`), as Cloud Hypervisor accepts them.
pub fn parse_toggle(v: &str) -> Result<bool, &'static str> {
    match v {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => Err("on or off"),
    }
}

/// A byte count with an optional K, M or G suffix (powers of 1024).
pub fn parse_size(v: &str) -> Result<u64, &'static str> {
    const EXPECTED: &str = "a size in bytes with optional K, M or G suffix";
    let (digits, shift) = match v.as_bytes().last() {
        Some(b'K' | b'k') => (&v[..v.len() - 1], 10),
        Some(b'M' | b'm') => (&v[..v.len() - 1], 20),
        Some(b'G' | b'g') => (&v[..v.len() - 1], 30),
        _ => (v, 0),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(EXPECTED);
    }
    let n: u64 = digits.parse().map_err(|_| EXPECTED)?;
    n.checked_mul(1u64 << shift).ok_or("a size below 16 EiB")
}

pub fn parse_u32(v: &str) -> Result<u32, &'static str> {
    v.parse().map_err(|_| "an unsigned integer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("-1M").is_err());
        assert!(parse_size("99999999999999G").is_err());
    }

    #[test]
    fn unknown_and_malformed_keys_name_the_option() {
        let e =
            OptionValues::parse("memory", "size=1G,sharde=on", &["size", "shared"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--memory: unknown key \"sharde\" (accepted keys: size, shared)"
        );
        let e = OptionValues::parse("cpus", "4", &["boot"]).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--cpus: \"4\" is not key=value (accepted keys: boot)"
        );
        let e = OptionValues::parse("cpus", "boot=1,boot=2", &["boot"]).unwrap_err();
        assert_eq!(e.to_string(), "--cpus: key \"boot\" given twice");
    }

    /// A value a u16 cannot hold is refused with the field's limit (which
    /// its `validate` checks otherwise), never cut.
    #[test]
    fn u16_value_refuses_what_does_not_fit() {
        let o = OptionValues::parse("disk", "queue_size=8", &["queue_size"]).unwrap();
        assert_eq!(
            o.u16_value("queue_size", "a power of two").unwrap(),
            Some(8)
        );
        assert_eq!(o.u16_value("absent", "a power of two").unwrap(), None);
        let o = OptionValues::parse("disk", "queue_size=65536", &["queue_size"]).unwrap();
        let e = o.u16_value("queue_size", "a power of two").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--disk: queue_size=\"65536\" is invalid: expected a power of two"
        );
        let o = OptionValues::parse("disk", "queue_size=-1", &["queue_size"]).unwrap();
        assert!(o
            .u16_value("queue_size", "a power of two")
            .unwrap_err()
            .to_string()
            .contains("an unsigned integer"));
    }

    #[test]
    fn convert_reports_value_and_expectation() {
        let o = OptionValues::parse("memory", "shared=maybe", &["shared"]).unwrap();
        let e = o.convert("shared", parse_toggle).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--memory: shared=\"maybe\" is invalid: expected on or off"
        );
        assert_eq!(o.convert("absent", parse_toggle).unwrap(), None);
    }
}
