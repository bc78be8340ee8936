//! The saved state of a PCI function's configuration space and of its
//! MSI-X table, for a snapshot or a migration.
//!
//! A state is restored onto a function built again from the same
//! configuration, so everything fixed when the function was built (ids,
//! capability list, BAR sizes and kinds, which bits the driver may write,
//! the number of MSI-X vectors) must match what the new function has: a
//! state that differs there belongs to another device, and is refused with
//! the field named. Only what the driver can change comes from the state:
//! the writable bits (BAR addresses the guest moved, the command register,
//! capability registers such as MSI-X's message control), the table, the
//! pending bits, enable and function mask. Restoring checks everything
//! before changing anything.

use serde::{Deserialize, Serialize};

use crate::configuration::{Bar, PciConfiguration, CONFIG_SPACE_SIZE};
use crate::msix::{MsixConfig, MsixEntry, VECTOR_CONTROL_MASKED};

const NUM_REGS: usize = CONFIG_SPACE_SIZE / 4;
const NUM_BARS: usize = 6;

/// Why a saved PCI state does not fit the function it is restored onto.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PciStateError {
    #[error("{part}: {field}: {reason}")]
    Mismatch {
        /// "PCI configuration" or "MSI-X".
        part: &'static str,
        field: String,
        reason: String,
    },
}

fn config_mismatch(field: impl Into<String>, reason: impl Into<String>) -> PciStateError {
    PciStateError::Mismatch {
        part: "PCI configuration",
        field: field.into(),
        reason: reason.into(),
    }
}

fn msix_mismatch(field: impl Into<String>, reason: impl Into<String>) -> PciStateError {
    PciStateError::Mismatch {
        part: "MSI-X",
        field: field.into(),
        reason: reason.into(),
    }
}

/// A configuration space as saved: every register, the mask of bits the
/// driver may write, and the BARs (size and kind; their addresses, as the
/// guest last programmed them, are in `regs`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PciConfigurationState {
    pub regs: Vec<u32>,
    pub writable: Vec<u32>,
    pub bars: Vec<Option<Bar>>,
}

impl PciConfiguration {
    pub fn save(&self) -> PciConfigurationState {
        PciConfigurationState {
            regs: self.regs.to_vec(),
            writable: self.writable.to_vec(),
            bars: self.bars.to_vec(),
        }
    }

    /// Takes the driver-writable bits of `state`; refuses (changing
    /// nothing) a state whose layout is not this function's.
    pub fn restore(&mut self, state: &PciConfigurationState) -> Result<(), PciStateError> {
        self.check_state(state)?;
        for (reg, saved) in self.regs.iter_mut().zip(&state.regs) {
            *reg = *saved;
        }
        Ok(())
    }

    /// Whether [`PciConfiguration::restore`] would take `state`, changing nothing.
    pub fn check_state(&self, state: &PciConfigurationState) -> Result<(), PciStateError> {
        let sized = |field: &str, len: usize, want: usize| {
            if len == want {
                Ok(())
            } else {
                Err(config_mismatch(
                    field,
                    format!("{len} entries, this function has {want}"),
                ))
            }
        };
        sized("regs", state.regs.len(), NUM_REGS)?;
        sized("writable", state.writable.len(), NUM_REGS)?;
        sized("bars", state.bars.len(), NUM_BARS)?;
        for (i, (saved, built)) in state.bars.iter().zip(&self.bars).enumerate() {
            if saved != built {
                return Err(config_mismatch(
                    format!("bars[{i}]"),
                    format!("saved {saved:?}, this function has {built:?}"),
                ));
            }
        }
        for (i, (saved, built)) in state.writable.iter().zip(&self.writable).enumerate() {
            if saved != built {
                return Err(config_mismatch(
                    format!("writable[{i}]"),
                    format!("saved mask {saved:#x}, this function has {built:#x}"),
                ));
            }
        }
        // Read-only bits were set when the function was built: a state
        // that differs there (ids, capabilities) is another device's.
        for (i, ((saved, built), mask)) in state
            .regs
            .iter()
            .zip(&self.regs)
            .zip(&self.writable)
            .enumerate()
        {
            if (saved ^ built) & !mask != 0 {
                return Err(config_mismatch(
                    format!("regs[{i}]"),
                    format!("read-only bits of {saved:#x} differ from this function's {built:#x}"),
                ));
            }
        }
        Ok(())
    }
}

/// An MSI-X table as saved.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsixState {
    pub table: Vec<MsixEntry>,
    pub pba: Vec<u64>,
    pub enabled: bool,
    pub function_masked: bool,
}

impl MsixConfig {
    pub fn save(&self) -> MsixState {
        MsixState {
            table: self.table.clone(),
            pba: self.pba.clone(),
            enabled: self.enabled,
            function_masked: self.function_masked,
        }
    }

    /// Takes the table, pending bits, enable and function mask of `state`;
    /// refuses (changing nothing) one of another size or with bits no
    /// driver could have set. The caller routes the restored entries (see
    /// [`MsixConfig::entry`] and [`MsixConfig::masked`]).
    pub fn restore(&mut self, state: &MsixState) -> Result<(), PciStateError> {
        self.check_state(state)?;
        self.table.clone_from(&state.table);
        self.pba.clone_from(&state.pba);
        self.enabled = state.enabled;
        self.function_masked = state.function_masked;
        Ok(())
    }

    /// Whether [`MsixConfig::restore`] would take `state`, changing nothing.
    pub fn check_state(&self, state: &MsixState) -> Result<(), PciStateError> {
        if state.table.len() != self.table.len() {
            return Err(msix_mismatch(
                "table",
                format!(
                    "{} vectors, this function has {}",
                    state.table.len(),
                    self.table.len()
                ),
            ));
        }
        if state.pba.len() != self.pba.len() {
            return Err(msix_mismatch(
                "pba",
                format!(
                    "{} words, this function has {}",
                    state.pba.len(),
                    self.pba.len()
                ),
            ));
        }
        if let Some(i) = state
            .table
            .iter()
            .position(|e| e.control & !VECTOR_CONTROL_MASKED != 0)
        {
            return Err(msix_mismatch(
                format!("table[{i}].control"),
                "reserved bits set",
            ));
        }
        for (w, word) in state.pba.iter().enumerate() {
            let first = w * 64;
            let valid = self.table.len().saturating_sub(first).min(64);
            let mask = if valid == 64 {
                u64::MAX
            } else {
                (1u64 << valid) - 1
            };
            if word & !mask != 0 {
                return Err(msix_mismatch(
                    format!("pba[{w}]"),
                    "pending bits past the last vector",
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
