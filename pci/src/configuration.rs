//! PCI type-0 configuration space (4 KiB, ECAM-sized): the header, BARs with
//! the sizing protocol, and a capability list.
//!
//! Every register has a mask of bits the driver may write; everything else is
//! read-only, so a driver writing all ones to a BAR reads back its size.

pub const CONFIG_SPACE_SIZE: usize = 4096;
const NUM_REGS: usize = CONFIG_SPACE_SIZE / 4;
const STATUS_CAP_LIST: u32 = 1 << (16 + 4);
const COMMAND_REG: usize = 1;
/// I/O space, memory space, bus master, INTx disable.
const COMMAND_WRITABLE: u32 = 0x0001 | 0x0002 | 0x0004 | 0x0400;
const BAR0_REG: usize = 4;
const CAP_PTR_REG: usize = 13;
const INTERRUPT_LINE_REG: usize = 15;
const FIRST_CAP_OFFSET: usize = 0x40;
const LAST_CAP_END: usize = 0x100;
const BAR_MEM64: u32 = 0b100;
const BAR_PREFETCHABLE: u32 = 0b1000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum BarKind {
    Mem32,
    Mem64 { prefetchable: bool },
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PciConfigError {
    #[error("BAR {index}: size {size:#x} is not a power of two of at least 16 bytes")]
    BarSize { index: usize, size: u64 },
    #[error("BAR {index}: address {addr:#x} is not aligned to its size {size:#x}")]
    BarAlignment { index: usize, addr: u64, size: u64 },
    #[error("BAR {index}: out of range, already used, or a 64-bit BAR in slot 5")]
    BarSlot { index: usize },
    #[error("BAR {index}: a 32-bit BAR must lie below 4 GiB")]
    BarAbove4G { index: usize },
    #[error("capability of {len} bytes does not fit in the standard configuration space")]
    CapabilitySpace { len: usize },
}

/// A declared BAR: its size and kind (its address lives in the registers).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bar {
    pub size: u64,
    pub kind: BarKind,
}

pub struct PciConfiguration {
    pub(crate) regs: [u32; NUM_REGS],
    pub(crate) writable: [u32; NUM_REGS],
    pub(crate) bars: [Option<Bar>; 6],
    last_cap: Option<usize>,
    next_cap: usize,
}

/// Identity of a function: ids and class code.
#[derive(Clone, Copy, Debug)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: u16,
    pub subsystem: u16,
    pub class: u8,
    pub subclass: u8,
    pub prog_if: u8,
    pub revision: u8,
}

impl PciConfiguration {
    pub fn new(ids: PciIds) -> Self {
        let mut regs = [0u32; NUM_REGS];
        regs[0] = u32::from(ids.device) << 16 | u32::from(ids.vendor);
        regs[2] = u32::from(ids.class) << 24
            | u32::from(ids.subclass) << 16
            | u32::from(ids.prog_if) << 8
            | u32::from(ids.revision);
        regs[11] = u32::from(ids.subsystem) << 16 | u32::from(ids.subsystem_vendor);
        let mut writable = [0u32; NUM_REGS];
        writable[COMMAND_REG] = COMMAND_WRITABLE;
        writable[INTERRUPT_LINE_REG] = 0xff; // interrupt line is scratch for the OS
        PciConfiguration {
            regs,
            writable,
            bars: [None; 6],
            last_cap: None,
            next_cap: FIRST_CAP_OFFSET,
        }
    }

    /// Declares BAR `index` at `addr`. A 64-bit BAR also takes slot `index + 1`.
    pub fn add_bar(
        &mut self,
        index: usize,
        addr: u64,
        size: u64,
        kind: BarKind,
    ) -> Result<(), PciConfigError> {
        if size < 16 || !size.is_power_of_two() {
            return Err(PciConfigError::BarSize { index, size });
        }
        if !addr.is_multiple_of(size) {
            return Err(PciConfigError::BarAlignment { index, addr, size });
        }
        let slots = if matches!(kind, BarKind::Mem64 { .. }) {
            2
        } else {
            1
        };
        if index + slots > 6
            || (index..index + slots).any(|i| self.bars[i].is_some() || self.is_upper_half(i))
        {
            return Err(PciConfigError::BarSlot { index });
        }
        let mask = !(size - 1);
        match kind {
            BarKind::Mem32 => {
                if addr + size > 1 << 32 {
                    return Err(PciConfigError::BarAbove4G { index });
                }
                // Below 4 GiB (checked above): the low halves are the values.
                self.regs[BAR0_REG + index] = narrow::low_u32(addr);
                self.writable[BAR0_REG + index] = narrow::low_u32(mask);
            }
            BarKind::Mem64 { prefetchable } => {
                let flags = BAR_MEM64 | if prefetchable { BAR_PREFETCHABLE } else { 0 };
                self.regs[BAR0_REG + index] = narrow::low_u32(addr) | flags;
                self.regs[BAR0_REG + index + 1] = narrow::low_u32(addr >> 32);
                self.writable[BAR0_REG + index] = narrow::low_u32(mask) & !0xf;
                self.writable[BAR0_REG + index + 1] = narrow::low_u32(mask >> 32);
            }
        }
        self.bars[index] = Some(Bar { size, kind });
        Ok(())
    }

    fn is_upper_half(&self, index: usize) -> bool {
        index > 0
            && matches!(
                self.bars[index - 1],
                Some(Bar {
                    kind: BarKind::Mem64 { .. },
                    ..
                })
            )
    }

    /// The address BAR `index` currently decodes (as the guest last programmed it).
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = self.bars.get(index).copied().flatten()?;
        let low = u64::from(self.regs[BAR0_REG + index] & !0xf);
        Some(match bar.kind {
            BarKind::Mem32 => low,
            BarKind::Mem64 { .. } => low | u64::from(self.regs[BAR0_REG + index + 1]) << 32,
        })
    }

    pub fn bar_size(&self, index: usize) -> Option<u64> {
        self.bars.get(index).copied().flatten().map(|b| b.size)
    }

    /// Appends a capability: `id`, then `body` (everything after the id and
    /// next-pointer bytes). `writable` masks the bytes of the whole capability
    /// (id and next pointer included) the driver may change. Returns its offset.
    pub fn add_capability(
        &mut self,
        id: u8,
        body: &[u8],
        writable: &[u8],
    ) -> Result<usize, PciConfigError> {
        let len = 2 + body.len();
        let offset = self.next_cap;
        // A capability pointer is a byte: the capabilities end in the first
        // 256 bytes of config space.
        let pointer = u8::try_from(offset)
            .ok()
            .filter(|_| offset + len <= LAST_CAP_END)
            .ok_or(PciConfigError::CapabilitySpace { len })?;
        let mut bytes = vec![id, 0];
        bytes.extend_from_slice(body);
        for (i, b) in bytes.iter().enumerate() {
            self.set_byte(offset + i, *b);
            let w = writable.get(i).copied().unwrap_or(0);
            let (reg, shift) = ((offset + i) / 4, ((offset + i) % 4) * 8);
            self.writable[reg] = (self.writable[reg] & !(0xff << shift)) | u32::from(w) << shift;
        }
        match self.last_cap {
            Some(prev) => self.set_byte(prev + 1, pointer),
            None => {
                self.regs[CAP_PTR_REG] = u32::from(pointer);
                self.regs[COMMAND_REG] |= STATUS_CAP_LIST;
            }
        }
        self.last_cap = Some(offset);
        self.next_cap = (offset + len).next_multiple_of(4);
        Ok(offset)
    }

    fn set_byte(&mut self, offset: usize, value: u8) {
        let (reg, shift) = (offset / 4, (offset % 4) * 8);
        self.regs[reg] = (self.regs[reg] & !(0xff << shift)) | u32::from(value) << shift;
    }

    pub fn read_reg(&self, reg: usize) -> u32 {
        self.regs.get(reg).copied().unwrap_or(0xffff_ffff)
    }

    /// Reads `data.len()` (1, 2 or 4) bytes at `offset`; anything else reads all ones.
    pub fn read(&self, offset: u64, data: &mut [u8]) {
        // An offset past usize is past the config space: all ones.
        let off = usize::try_from(offset).unwrap_or(CONFIG_SPACE_SIZE);
        if !matches!(data.len(), 1 | 2 | 4)
            || !off.is_multiple_of(data.len())
            || off + data.len() > CONFIG_SPACE_SIZE
        {
            data.fill(0xff);
            return;
        }
        let v = self.regs[off / 4].to_le_bytes();
        let start = off % 4;
        data.copy_from_slice(&v[start..start + data.len()]);
    }

    /// Writes through the writable mask. Returns the BAR index whose address
    /// changed while memory decoding is on, so the transport can move what it
    /// registered there. (Drivers size BARs with decoding off, writing all
    /// ones and then the old address back: that is not a move.)
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Option<usize> {
        // An offset past usize is past the config space: ignored.
        let off = usize::try_from(offset).unwrap_or(CONFIG_SPACE_SIZE);
        if !matches!(data.len(), 1 | 2 | 4)
            || !off.is_multiple_of(data.len())
            || off + data.len() > CONFIG_SPACE_SIZE
        {
            return None;
        }
        let reg = off / 4;
        let shift = (off % 4) * 8;
        let mut value = [0u8; 4];
        value[..data.len()].copy_from_slice(data);
        let value = u32::from_le_bytes(value) << shift;
        let lane = if data.len() == 4 {
            u32::MAX
        } else {
            ((1u32 << (data.len() * 8)) - 1) << shift
        };
        let mask = self.writable[reg] & lane;
        let before = self.bar_address_for_reg(reg);
        self.regs[reg] = (self.regs[reg] & !mask) | (value & mask);
        let index = self.bar_index_for_reg(reg)?;
        (before != self.bar_address(index) && self.memory_enabled()).then_some(index)
    }

    fn bar_index_for_reg(&self, reg: usize) -> Option<usize> {
        let slot = reg.checked_sub(BAR0_REG).filter(|&s| s < 6)?;
        if self.bars[slot].is_some() {
            Some(slot)
        } else if self.is_upper_half(slot) {
            Some(slot - 1)
        } else {
            None
        }
    }

    fn bar_address_for_reg(&self, reg: usize) -> Option<u64> {
        self.bar_address(self.bar_index_for_reg(reg)?)
    }

    /// Whether the driver enabled memory decoding.
    pub fn memory_enabled(&self) -> bool {
        self.regs[COMMAND_REG] & 0x2 != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> PciConfiguration {
        PciConfiguration::new(PciIds {
            vendor: 0x1af4,
            device: 0x105b,
            subsystem_vendor: 0x1af4,
            subsystem: 0x40,
            class: 0x05,
            subclass: 0x80,
            prog_if: 0,
            revision: 1,
        })
    }

    fn r32(c: &PciConfiguration, off: u64) -> u32 {
        let mut d = [0u8; 4];
        c.read(off, &mut d);
        u32::from_le_bytes(d)
    }

    #[test]
    fn header_ids_and_read_only_fields() {
        let mut c = cfg();
        assert_eq!(r32(&c, 0), 0x105b_1af4);
        assert_eq!(r32(&c, 8), 0x0580_0001);
        assert_eq!(r32(&c, 0x2c), 0x0040_1af4);
        c.write(0, &0xffff_ffffu32.to_le_bytes());
        assert_eq!(r32(&c, 0), 0x105b_1af4, "ids are read-only");
        c.write(4, &0xffffu16.to_le_bytes());
        assert_eq!(r32(&c, 4) & 0xffff, COMMAND_WRITABLE);
        assert!(c.memory_enabled());
        let mut b = [0u8; 2];
        c.read(3, &mut b); // misaligned
        assert_eq!(b, [0xff, 0xff]);
    }

    #[test]
    fn bar_sizing_protocol_32_and_64_bit() {
        let mut c = cfg();
        c.add_bar(0, 0xe000_0000, 0x4000, BarKind::Mem32).unwrap();
        c.add_bar(
            2,
            0x1_0000_0000,
            0x40_0000,
            BarKind::Mem64 { prefetchable: true },
        )
        .unwrap();
        assert_eq!(r32(&c, 0x10), 0xe000_0000);
        assert_eq!(
            r32(&c, 0x18),
            0x0000_000c,
            "64-bit prefetchable, low address 0"
        );
        assert_eq!(r32(&c, 0x1c), 1);
        // Size it as a driver does, decoding off: save, write all ones, read,
        // restore. That is not a move.
        for (off, expect) in [
            (0x10, 0xffff_c000u32),
            (0x18, 0xffc0_000c),
            (0x1c, 0xffff_ffff),
        ] {
            let saved = r32(&c, off);
            assert_eq!(c.write(off, &u32::MAX.to_le_bytes()), None);
            assert_eq!(r32(&c, off), expect, "BAR at {off:#x}");
            assert_eq!(c.write(off, &saved.to_le_bytes()), None);
        }
        assert_eq!(c.bar_address(2), Some(0x1_0000_0000));
        // Moving a BAR with decoding on reports which one moved.
        c.write(0x04, &2u16.to_le_bytes());
        assert!(c.memory_enabled());
        assert_eq!(c.write(0x1c, &2u32.to_le_bytes()), Some(2));
        assert_eq!(c.bar_address(2), Some(0x2_0000_0000));
        assert_eq!(
            c.write(0x1c, &2u32.to_le_bytes()),
            None,
            "same address: nothing moved"
        );
        // Unused BAR slots read 0 and ignore writes.
        c.write(0x14, &u32::MAX.to_le_bytes());
        assert_eq!(r32(&c, 0x14), 0);
    }

    #[test]
    fn bad_bars_are_refused() {
        let mut c = cfg();
        assert_eq!(
            c.add_bar(0, 0, 0x3000, BarKind::Mem32),
            Err(PciConfigError::BarSize {
                index: 0,
                size: 0x3000
            })
        );
        assert!(matches!(
            c.add_bar(0, 0x1000, 0x4000, BarKind::Mem32),
            Err(PciConfigError::BarAlignment { .. })
        ));
        assert!(matches!(
            c.add_bar(
                5,
                0,
                0x4000,
                BarKind::Mem64 {
                    prefetchable: false
                }
            ),
            Err(PciConfigError::BarSlot { .. })
        ));
        assert!(matches!(
            c.add_bar(0, 0x1_0000_0000, 0x4000, BarKind::Mem32),
            Err(PciConfigError::BarAbove4G { .. })
        ));
        c.add_bar(
            2,
            0,
            0x4000,
            BarKind::Mem64 {
                prefetchable: false,
            },
        )
        .unwrap();
        assert!(matches!(
            c.add_bar(3, 0, 0x4000, BarKind::Mem32),
            Err(PciConfigError::BarSlot { .. })
        ));
    }

    #[test]
    fn capability_list_walks_like_a_driver() {
        let mut c = cfg();
        let a = c
            .add_capability(0x09, &[16, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], &[])
            .unwrap();
        let b = c
            .add_capability(
                0x11,
                &[0x00, 0x00, 0, 0, 0, 0, 0, 0, 0, 0],
                &[0, 0, 0x00, 0xc0],
            )
            .unwrap();
        assert_ne!(r32(&c, 4) & STATUS_CAP_LIST, 0);
        let mut found = Vec::new();
        let mut ptr = r32(&c, 0x34) as u64 & 0xff;
        while ptr != 0 {
            let mut hdr = [0u8; 2];
            c.read(ptr, &mut hdr);
            found.push((usize::try_from(ptr).unwrap(), hdr[0]));
            ptr = u64::from(hdr[1]);
        }
        assert_eq!(found, vec![(a, 0x09), (b, 0x11)]);
        assert_eq!(a % 4, 0);
        assert_eq!(b % 4, 0);
        // Only the declared writable bits of a capability change.
        c.write(b as u64 + 2, &0xffffu16.to_le_bytes());
        let mut ctl = [0u8; 2];
        c.read(b as u64 + 2, &mut ctl);
        assert_eq!(u16::from_le_bytes(ctl), 0xc000);
        assert!(matches!(
            c.add_capability(0x09, &[0; 200], &[]),
            Err(PciConfigError::CapabilitySpace { .. })
        ));
    }
}
