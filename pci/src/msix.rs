//! MSI-X (PCI 3.0 §6.8.2): the vector table and pending-bit array the driver
//! programs through a BAR, and the masking rules that decide whether a
//! vector fires now or is left pending.

/// Bytes per table entry: address low, address high, data, vector control.
pub const MSIX_TABLE_ENTRY_SIZE: u64 = 16;
pub(crate) const VECTOR_CONTROL_MASKED: u32 = 1;
/// Message control bits in the capability.
pub const MSIX_ENABLE: u16 = 1 << 15;
pub const MSIX_FUNCTION_MASK: u16 = 1 << 14;
/// Written into a queue's or config's vector register to mean "no vector".
pub const VIRTIO_MSI_NO_VECTOR: u16 = 0xffff;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MsixEntry {
    pub addr_lo: u32,
    pub addr_hi: u32,
    pub data: u32,
    pub control: u32,
}

impl MsixEntry {
    pub fn masked(&self) -> bool {
        self.control & VECTOR_CONTROL_MASKED != 0
    }
}

/// What happened to an interrupt the device raised on a vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Deliver it now with this message.
    Deliver(MsixEntry),
    /// Masked: recorded in the PBA, delivered when unmasked.
    Pending,
    /// MSI-X off, or no such vector: dropped.
    Dropped,
}

/// A change the VMM must apply to KVM's routing or deliver now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MsixUpdate {
    /// Entry `vector` was reprogrammed (route it anew).
    Entry(u16),
    /// Vector `vector` was pending and is now unmasked: deliver it.
    DeliverPending(u16, MsixEntry),
}

pub struct MsixConfig {
    pub(crate) table: Vec<MsixEntry>,
    pub(crate) pba: Vec<u64>,
    pub(crate) enabled: bool,
    pub(crate) function_masked: bool,
}

/// A table index (or the table's length) as the vector number it is.
fn vector_number(index: usize) -> u16 {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the table is made from a u16 count in MsixConfig::new, so every index and its length fit"
    )]
    let vector = index as u16;
    vector
}

impl MsixConfig {
    pub fn new(vectors: u16) -> Self {
        let n = usize::from(vectors);
        MsixConfig {
            // Entries start masked, as the spec requires after reset.
            table: vec![
                MsixEntry {
                    control: VECTOR_CONTROL_MASKED,
                    ..Default::default()
                };
                n
            ],
            pba: vec![0; n.div_ceil(64)],
            enabled: false,
            function_masked: false,
        }
    }

    pub fn vectors(&self) -> u16 {
        vector_number(self.table.len())
    }

    pub fn entry(&self, vector: u16) -> Option<MsixEntry> {
        self.table.get(usize::from(vector)).copied()
    }

    #[cfg(test)]
    fn table_size(&self) -> u64 {
        self.table.len() as u64 * MSIX_TABLE_ENTRY_SIZE
    }

    #[cfg(test)]
    fn pba_size(&self) -> u64 {
        self.pba.len() as u64 * 8
    }

    #[cfg(test)]
    fn enabled(&self) -> bool {
        self.enabled
    }

    /// The driver wrote the capability's message control.
    pub fn set_message_control(&mut self, control: u16) -> Vec<MsixUpdate> {
        self.enabled = control & MSIX_ENABLE != 0;
        self.function_masked = control & MSIX_FUNCTION_MASK != 0;
        self.release_pending()
    }

    pub fn read_table(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if data.len() != 4 && data.len() != 8 || !offset.is_multiple_of(data.len() as u64) {
            return;
        }
        for (i, chunk) in data.chunks_mut(4).enumerate() {
            if let Some(v) = self.table_dword(offset + 4 * i as u64) {
                chunk.copy_from_slice(&v.to_le_bytes());
            }
        }
    }

    fn table_dword(&self, offset: u64) -> Option<u32> {
        let e = self
            .table
            .get(usize::try_from(offset / MSIX_TABLE_ENTRY_SIZE).ok()?)?;
        Some(match offset % MSIX_TABLE_ENTRY_SIZE {
            0 => e.addr_lo,
            4 => e.addr_hi,
            8 => e.data,
            _ => e.control,
        })
    }

    pub fn write_table(&mut self, offset: u64, data: &[u8]) -> Vec<MsixUpdate> {
        let mut updates = Vec::new();
        if data.len() != 4 && data.len() != 8 || !offset.is_multiple_of(data.len() as u64) {
            return updates;
        }
        for (i, chunk) in data.chunks(4).enumerate() {
            let off = offset + 4 * i as u64;
            let Ok(index) = usize::try_from(off / MSIX_TABLE_ENTRY_SIZE) else {
                continue;
            };
            let Some(e) = self.table.get_mut(index) else {
                continue;
            };
            let v = u32::from_le_bytes(chunk.try_into().expect("4-byte chunk"));
            match off % MSIX_TABLE_ENTRY_SIZE {
                0 => e.addr_lo = v,
                4 => e.addr_hi = v,
                8 => e.data = v,
                _ => e.control = v & VECTOR_CONTROL_MASKED,
            }
            let vector = vector_number(index);
            if updates.last() != Some(&MsixUpdate::Entry(vector)) {
                updates.push(MsixUpdate::Entry(vector));
            }
        }
        updates.extend(self.release_pending());
        updates
    }

    pub fn read_pba(&self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if data.len() != 4 && data.len() != 8 || !offset.is_multiple_of(data.len() as u64) {
            return;
        }
        let Some(word) = usize::try_from(offset / 8)
            .ok()
            .and_then(|i| self.pba.get(i))
        else {
            return;
        };
        let bytes = word.to_le_bytes();
        let start = (offset % 8) as usize;
        data.copy_from_slice(&bytes[start..start + data.len()]);
    }

    /// Whether `vector` may not fire now: MSI-X off, the function masked, or
    /// the entry masked (a vector past the table is always masked).
    pub fn masked(&self, vector: u16) -> bool {
        let entry_masked = self
            .table
            .get(usize::from(vector))
            .is_none_or(MsixEntry::masked);
        !self.enabled || self.function_masked || entry_masked
    }

    /// The device raises `vector`.
    pub fn trigger(&mut self, vector: u16) -> Delivery {
        let Some(entry) = self.table.get(usize::from(vector)).copied() else {
            return Delivery::Dropped;
        };
        if !self.enabled {
            return Delivery::Dropped;
        }
        if self.function_masked || entry.masked() {
            self.pba[usize::from(vector) / 64] |= 1 << (vector % 64);
            return Delivery::Pending;
        }
        Delivery::Deliver(entry)
    }

    /// Pending vectors whose mask is now clear are delivered and leave the PBA.
    fn release_pending(&mut self) -> Vec<MsixUpdate> {
        let mut out = Vec::new();
        if !self.enabled || self.function_masked {
            return out;
        }
        for (i, e) in self.table.iter().enumerate() {
            let bit = 1u64 << (i % 64);
            if self.pba[i / 64] & bit != 0 && !e.masked() {
                self.pba[i / 64] &= !bit;
                out.push(MsixUpdate::DeliverPending(vector_number(i), *e));
            }
        }
        out
    }

    /// Back to the reset state: all masked, nothing pending, disabled (only
    /// the tests reset a table; the transport keeps one for the device's life).
    #[cfg(test)]
    fn reset(&mut self) {
        *self = MsixConfig::new(self.vectors());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w32(m: &mut MsixConfig, off: u64, v: u32) -> Vec<MsixUpdate> {
        m.write_table(off, &v.to_le_bytes())
    }

    fn r32(m: &MsixConfig, off: u64) -> u32 {
        let mut d = [0u8; 4];
        m.read_table(off, &mut d);
        u32::from_le_bytes(d)
    }

    fn program(m: &mut MsixConfig, v: u16, data: u32) {
        let base = u64::from(v) * MSIX_TABLE_ENTRY_SIZE;
        w32(m, base, 0xfee0_0000);
        w32(m, base + 4, 0);
        w32(m, base + 8, data);
    }

    #[test]
    fn table_reads_back_and_starts_masked() {
        let mut m = MsixConfig::new(3);
        assert_eq!((m.table_size(), m.pba_size()), (48, 8));
        assert_eq!(r32(&m, 12), 1, "entries start masked");
        program(&mut m, 1, 0x41);
        assert_eq!(r32(&m, 16), 0xfee0_0000);
        assert_eq!(r32(&m, 24), 0x41);
        let mut q = [0u8; 8];
        m.read_table(16, &mut q);
        assert_eq!(u64::from_le_bytes(q), 0xfee0_0000);
        // Reserved control bits do not stick; out-of-range entries read 0.
        w32(&mut m, 28, 0xffff_fffe);
        assert_eq!(r32(&m, 28), 0);
        assert_eq!(r32(&m, 48), 0);
        assert!(w32(&mut m, 48, 1).is_empty());
    }

    #[test]
    fn masking_leaves_vectors_pending_until_unmasked() {
        let mut m = MsixConfig::new(2);
        program(&mut m, 0, 0x30);
        assert_eq!(m.trigger(0), Delivery::Dropped, "MSI-X not enabled yet");
        m.set_message_control(MSIX_ENABLE);
        assert_eq!(m.trigger(0), Delivery::Pending, "entry still masked");
        let mut pba = [0u8; 8];
        m.read_pba(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 1);
        // Unmasking delivers the pending vector and clears its bit.
        let updates = w32(&mut m, 12, 0);
        assert_eq!(updates.len(), 2);
        assert_eq!(updates[0], MsixUpdate::Entry(0));
        assert!(matches!(updates[1], MsixUpdate::DeliverPending(0, e) if e.data == 0x30));
        m.read_pba(0, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 0);
        assert!(matches!(m.trigger(0), Delivery::Deliver(e) if e.data == 0x30));
        // The function mask holds everything back, whatever the entries say.
        m.set_message_control(MSIX_ENABLE | MSIX_FUNCTION_MASK);
        assert_eq!(m.trigger(0), Delivery::Pending);
        let released = m.set_message_control(MSIX_ENABLE);
        assert!(matches!(released[..], [MsixUpdate::DeliverPending(0, _)]));
        assert_eq!(m.trigger(7), Delivery::Dropped, "no such vector");
        m.reset();
        assert!(!m.enabled());
        assert_eq!(r32(&m, 12), 1);
    }
}
