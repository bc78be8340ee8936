//! `--cpus boot=N,max=M,topology=T:C:D:P` and the vCPUs' APIC ids.
//!
//! vCPUs `boot..max` are hot-pluggable (ACPI CPU hot-plug, `vm.resize`).
//! The rules are Cloud Hypervisor's: `max` defaults to `boot` and may not
//! be below it; a topology's four parts are non-zero, at most 2 threads per
//! core, and multiply to `max`. On top of those, every vCPU's APIC id must
//! fit the 8-bit xAPIC ids of the MADT (0xff is the broadcast id).

use serde::{Deserialize, Serialize};

use super::checks::invalid;
use super::option_parser::{parse_u32, OptionValues};
use super::ConfigError;

/// Largest vCPU count: APIC ids are 8 bits in the MADT and 0xff is broadcast.
pub const MAX_VCPUS: u32 = 254;
/// The largest APIC id a vCPU may have (0xff is the broadcast id).
pub const MAX_APIC_ID: u32 = 254;

/// How the vCPUs are grouped: threads in cores, cores in dies, dies in
/// packages (Cloud Hypervisor's `CpuTopology`, its field names in JSON;
/// every part is required, as there).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpuTopology {
    pub threads_per_core: u16,
    pub cores_per_die: u16,
    pub dies_per_package: u16,
    pub packages: u16,
}

/// Bits needed to hold an id below `n`.
pub fn id_bits(n: u32) -> u32 {
    (n.max(1) - 1).checked_ilog2().map_or(0, |b| b + 1)
}

impl CpuTopology {
    /// One package of `cpus` single-thread cores: what a VM without a
    /// topology gets.
    pub fn flat(cpus: u32) -> Self {
        CpuTopology {
            threads_per_core: 1,
            cores_per_die: u16::try_from(cpus).unwrap_or(u16::MAX),
            dies_per_package: 1,
            packages: 1,
        }
    }

    /// `T:C:D:P`, as Cloud Hypervisor spells it on its command line.
    fn parse(value: &str) -> Result<Self, &'static str> {
        const EXPECTED: &str = "threads_per_core:cores_per_die:dies_per_package:packages";
        let parts: Vec<u16> = value
            .split(':')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|_| EXPECTED)?;
        match parts[..] {
            [t, c, d, p] => Ok(CpuTopology {
                threads_per_core: t,
                cores_per_die: c,
                dies_per_package: d,
                packages: p,
            }),
            _ => Err(EXPECTED),
        }
    }

    pub fn to_option(self) -> String {
        format!(
            "{}:{}:{}:{}",
            self.threads_per_core, self.cores_per_die, self.dies_per_package, self.packages
        )
    }

    fn parts(self) -> [u32; 4] {
        [
            self.threads_per_core,
            self.cores_per_die,
            self.dies_per_package,
            self.packages,
        ]
        .map(u32::from)
    }

    /// The logical processors in a package.
    pub fn per_package(self) -> u32 {
        let [t, c, d, _] = self.parts();
        t * c * d
    }

    /// APIC-id bits taken by the thread, core and die levels.
    pub fn level_bits(self) -> (u32, u32, u32) {
        let [t, c, d, _] = self.parts();
        (id_bits(t), id_bits(c), id_bits(d))
    }

    /// vCPU `index`'s APIC id: its thread, core, die and package numbers
    /// each in a field just wide enough, as real hardware (and Cloud
    /// Hypervisor) number them. A flat topology gives `index` itself.
    pub fn apic_id(self, index: u32) -> u32 {
        let [t, c, d, _] = self.parts();
        let (tb, cb, db) = self.level_bits();
        let thread = index % t;
        let core = (index / t) % c;
        let die = (index / (t * c)) % d;
        let package = index / (t * c * d);
        thread | (core << tb) | (die << (tb + cb)) | (package << (tb + cb + db))
    }
}

/// The vCPUs: the part of Cloud Hypervisor's CpusConfig this VMM
/// implements (its JSON field names; the rest is checked by
/// [`super::ch_fields`]), what `--cpus` and `vm.create` both fill and
/// [`CpusConfig::validate`] checks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CpusConfig {
    /// vCPUs present at boot (and, after `vm.resize`, the count asked for,
    /// as Cloud Hypervisor reports it).
    pub boot_vcpus: u32,
    /// vCPUs the guest may ever have; those above `boot_vcpus` are
    /// hot-pluggable. 0 when not given: [`CpusConfig::validated`] makes it
    /// `boot_vcpus` (a 0 given is refused: [`given_max`]).
    #[serde(default, deserialize_with = "given_max_json")]
    pub max_vcpus: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub topology: Option<CpuTopology>,
}

impl Default for CpusConfig {
    fn default() -> Self {
        CpusConfig {
            boot_vcpus: 1,
            max_vcpus: 1,
            topology: None,
        }
    }
}

pub const CPUS_KEYS: &[&str] = &["boot", "max", "topology"];

fn vcpus_expected() -> String {
    format!("1 to {MAX_VCPUS} vCPUs")
}

/// A `max` given: not 0, which would read as "not given".
fn given_max(max: u32) -> Result<u32, ConfigError> {
    if max == 0 {
        return Err(invalid("cpus", "max", max, vcpus_expected()));
    }
    Ok(max)
}

fn given_max_json<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    match Option::<u32>::deserialize(d)? {
        None => Ok(0),
        Some(max) => given_max(max).map_err(serde::de::Error::custom),
    }
}

impl CpusConfig {
    pub fn parse(input: &str) -> Result<Self, ConfigError> {
        Self::from_values(&OptionValues::parse("cpus", input, CPUS_KEYS)?)
    }

    /// Fills a config from the values of `--cpus` and checks it.
    fn from_values(o: &OptionValues) -> Result<Self, ConfigError> {
        CpusConfig {
            boot_vcpus: o.convert("boot", parse_u32)?.unwrap_or(1),
            max_vcpus: o
                .convert("max", parse_u32)?
                .map(given_max)
                .transpose()?
                .unwrap_or(0),
            topology: o.convert("topology", CpuTopology::parse)?,
        }
        .validated()
    }

    /// Makes `max_vcpus` `boot_vcpus` if not given, and checks the config.
    pub fn validated(mut self) -> Result<Self, ConfigError> {
        if self.max_vcpus == 0 {
            self.max_vcpus = self.boot_vcpus;
        }
        self.validate()?;
        Ok(self)
    }

    /// Cloud Hypervisor's rules, and every vCPU's APIC id within the MADT's.
    pub fn validate(&self) -> Result<(), ConfigError> {
        const OPTION: &str = "cpus";
        let (boot, max) = (self.boot_vcpus, self.max_vcpus);
        if boot == 0 || boot > MAX_VCPUS {
            return Err(invalid(OPTION, "boot", boot, vcpus_expected()));
        }
        if max == 0 || max > MAX_VCPUS {
            return Err(invalid(OPTION, "max", max, vcpus_expected()));
        }
        if boot > max {
            return Err(invalid(
                OPTION,
                "boot",
                boot,
                format!("at most max={max} (the hot-pluggable limit)"),
            ));
        }
        if let Some(t) = self.topology {
            let value = t.to_option();
            let parts = t.parts();
            if parts.contains(&0) {
                return Err(invalid(OPTION, "topology", value, "four parts above 0"));
            }
            if t.threads_per_core > 2 {
                return Err(invalid(
                    OPTION,
                    "topology",
                    value,
                    "at most 2 threads per core",
                ));
            }
            let product = parts
                .iter()
                .try_fold(1u32, |p, &x| p.checked_mul(x))
                .unwrap_or(u32::MAX);
            if product != max {
                return Err(invalid(
                    OPTION,
                    "topology",
                    value,
                    format!("parts whose product ({product}) equals max={max}"),
                ));
            }
            let highest = t.apic_id(max - 1);
            if highest > MAX_APIC_ID {
                return Err(invalid(
                    OPTION,
                    "topology",
                    value,
                    format!(
                        "a layout whose APIC ids stay at or below {MAX_APIC_ID} (this one reaches {highest})"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The topology the guest sees: the one given, else one package of
    /// `max_vcpus` single-thread cores.
    pub fn effective_topology(&self) -> CpuTopology {
        self.topology
            .unwrap_or_else(|| CpuTopology::flat(self.max_vcpus))
    }

    /// The `--cpus` spelling of this configuration.
    pub fn to_option(&self) -> String {
        let mut s = format!("boot={},max={}", self.boot_vcpus, self.max_vcpus);
        if let Some(t) = self.topology {
            s.push_str(&format!(",topology={}", t.to_option()));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(input: &str) -> String {
        CpusConfig::parse(input).unwrap_err().to_string()
    }

    #[test]
    fn boot_max_and_topology() {
        assert_eq!(CpusConfig::parse("boot=2").unwrap().max_vcpus, 2);
        let c = CpusConfig::parse("boot=1,max=4,topology=1:4:1:1").unwrap();
        assert_eq!((c.boot_vcpus, c.max_vcpus), (1, 4));
        assert_eq!(c.topology, Some(CpuTopology::flat(4)));
        assert_eq!(CpusConfig::parse(&c.to_option()).unwrap(), c);
        assert_eq!(CpusConfig::parse("").unwrap(), CpusConfig::default());
        assert_eq!(
            err("boot=0"),
            "--cpus: boot=\"0\" is invalid: expected 1 to 254 vCPUs"
        );
        assert_eq!(
            err("boot=2,max=255"),
            "--cpus: max=\"255\" is invalid: expected 1 to 254 vCPUs"
        );
        assert_eq!(
            err("boot=3,max=2"),
            "--cpus: boot=\"3\" is invalid: expected at most max=2 (the hot-pluggable limit)"
        );
        assert!(err("boot=two").contains("unsigned integer"));
        assert!(err("boot=1,affinity=x").contains("accepted keys: boot, max, topology"));
    }

    #[test]
    fn topology_rules_are_cloud_hypervisors_plus_the_apic_id_limit() {
        assert_eq!(
            err("boot=2,max=4,topology=1:2:1:1"),
            "--cpus: topology=\"1:2:1:1\" is invalid: expected parts whose product (2) equals max=4"
        );
        assert!(err("boot=2,max=4,topology=1:4:0:1").contains("four parts above 0"));
        assert!(err("boot=3,max=3,topology=3:1:1:1").contains("at most 2 threads per core"));
        assert!(err("boot=1,topology=1:1:1").contains("threads_per_core:cores_per_die"));
        assert!(err("boot=1,topology=1:1:1:x").contains("threads_per_core:cores_per_die"));
        // 2 threads x 3 cores: the core field is 2 bits wide, so a package
        // spans 8 ids and 40 packages reach id 8*39+5 = 317.
        assert!(err("boot=1,max=240,topology=2:3:1:40").contains("(this one reaches 317)"));
        assert!(CpusConfig::parse("boot=1,max=240,topology=2:3:1:40").is_err());
        assert!(CpusConfig::parse("boot=8,max=8,topology=2:2:1:2").is_ok());
    }

    #[test]
    fn apic_ids_pack_each_level_in_its_own_field() {
        let t = CpusConfig::parse("boot=1,max=12,topology=2:3:1:2")
            .unwrap()
            .effective_topology();
        let ids: Vec<u32> = (0..12).map(|i| t.apic_id(i)).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13]);
        let flat = CpusConfig::parse("boot=1,max=5")
            .unwrap()
            .effective_topology();
        assert_eq!(
            (0..5).map(|i| flat.apic_id(i)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4]
        );
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 254].map(id_bits),
            [0, 1, 2, 2, 3, 3, 4, 8]
        );
    }
}
