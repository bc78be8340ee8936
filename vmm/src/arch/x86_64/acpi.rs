//! ACPI tables: RSDP → XSDT → {FADT → DSDT, MADT}.
//!
//! The platform is "hardware-reduced" ACPI: no PM1 blocks or SCI, power-off
//! through the FADT sleep control register and reboot through its reset
//! register (both handled by `legacy::acpi_pm`). The DSDT carries `\_S5`
//! and whatever device descriptions the VMM hands in.

use acpi_tables::{
    aml,
    mcfg::MCFG,
    rsdp::Rsdp,
    sdt::{GenericAddress, Sdt},
    Aml,
};
use vm_memory::{Bytes, GuestAddress};

use super::layout::{pci_ecam_start, ACPI_END, ACPI_START, APIC_START, IOAPIC_START};
use crate::config::CpusConfig;
use crate::legacy::acpi_pm;
use crate::memory::GuestMemoryMmap;

pub const OEM_ID: [u8; 6] = *b"DAXVMM";
const OEM_TABLE_ID: [u8; 8] = *b"DAXVMM01";
const OEM_REVISION: u32 = 1;

/// FADT field offsets (ACPI 6.5, table 5.9).
mod fadt {
    pub const LENGTH: u32 = 276;
    pub const IAPC_BOOT_ARCH: usize = 109;
    pub const FLAGS: usize = 112;
    pub const RESET_REG: usize = 116;
    pub const RESET_VALUE: usize = 128;
    pub const MINOR_VERSION: usize = 131;
    pub const X_DSDT: usize = 140;
    pub const SLEEP_CONTROL_REG: usize = 244;
    pub const SLEEP_STATUS_REG: usize = 256;
    pub const HYPERVISOR_VENDOR_ID: usize = 268;
    pub const FLAG_RESET_REG_SUP: u32 = 1 << 10;
    pub const FLAG_HW_REDUCED_ACPI: u32 = 1 << 20;
    /// IA-PC boot flags: no VGA, no CMOS RTC, MSIs work.
    pub const BOOT_ARCH_NO_VGA: u16 = 1 << 2;
    pub const BOOT_ARCH_NO_CMOS_RTC: u16 = 1 << 5;
}

#[derive(Debug, thiserror::Error)]
pub enum AcpiError {
    #[error("ACPI tables need {needed} bytes but only {available} fit below 1 MiB (each PCI segment's host bridge takes about 2 KiB: fewer platform num_pci_segments fit)")]
    TooLarge { needed: u64, available: u64 },
    #[error("writing the ACPI tables into guest memory failed: {0}")]
    GuestWrite(vm_memory::GuestMemoryError),
}

/// The tables laid out at their guest addresses, RSDP first.
pub struct AcpiTables {
    pub rsdp_addr: u64,
    pub blobs: Vec<(u64, Vec<u8>)>,
}

fn create_dsdt(device_aml: &[u8]) -> Sdt {
    let mut dsdt = Sdt::new(*b"DSDT", 36, 6, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    // \_S5: SLP_TYP 5 is what `acpi_pm` recognises as power-off.
    aml::Name::new(
        "_S5_".into(),
        &aml::Package::new(vec![&acpi_pm::S5_SLEEP_TYPE, &0u8, &0u8, &0u8]),
    )
    .to_aml_bytes(&mut dsdt);
    dsdt.append_slice(device_aml);
    dsdt
}

fn create_fadt(dsdt_addr: u64) -> Sdt {
    let mut f = Sdt::new(
        *b"FACP",
        fadt::LENGTH,
        6,
        OEM_ID,
        OEM_TABLE_ID,
        OEM_REVISION,
    );
    f.write_u16(
        fadt::IAPC_BOOT_ARCH,
        fadt::BOOT_ARCH_NO_VGA | fadt::BOOT_ARCH_NO_CMOS_RTC,
    );
    f.write_u32(
        fadt::FLAGS,
        fadt::FLAG_HW_REDUCED_ACPI | fadt::FLAG_RESET_REG_SUP,
    );
    f.write(
        fadt::RESET_REG,
        GenericAddress::io_port_address::<u8>(acpi_pm::RESET_PORT),
    );
    f.write_u8(fadt::RESET_VALUE, acpi_pm::RESET_VALUE);
    f.write_u8(fadt::MINOR_VERSION, 5);
    f.write_u64(fadt::X_DSDT, dsdt_addr);
    f.write(
        fadt::SLEEP_CONTROL_REG,
        GenericAddress::io_port_address::<u8>(acpi_pm::SLEEP_CONTROL_PORT),
    );
    f.write(
        fadt::SLEEP_STATUS_REG,
        GenericAddress::io_port_address::<u8>(acpi_pm::SLEEP_STATUS_PORT),
    );
    f.write_bytes(fadt::HYPERVISOR_VENDOR_ID, b"DAXVMM\0\0");
    f
}

/// MADT Local APIC flags: the CPU is enabled now; or it is not, but may
/// be brought online later (ACPI 6.3; Linux then counts it as possible).
pub const LAPIC_ENABLED: u32 = 1 << 0;
pub const LAPIC_ONLINE_CAPABLE: u32 = 1 << 1;

/// A Processor Local APIC structure (MADT type 0): also what a CPU
/// device's `_MAT` returns.
/// `uid` and `apic_id` are a vCPU's index and APIC id, which the entry
/// holds in a byte each.
pub fn local_apic_entry(uid: u32, apic_id: u32, flags: u32) -> [u8; 8] {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the config keeps max_vcpus and every APIC id at or below 254 (MAX_VCPUS, MAX_APIC_ID)"
    )]
    let (uid, apic_id) = (uid as u8, apic_id as u8);
    let f = flags.to_le_bytes();
    [0, 8, uid, apic_id, f[0], f[1], f[2], f[3]]
}

/// One Local APIC per possible vCPU: the boot ones enabled, the
/// hot-pluggable ones online-capable (as Cloud Hypervisor lists them).
fn create_madt(cpus: &CpusConfig) -> Sdt {
    let mut madt = Sdt::new(*b"APIC", 44, 5, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    madt.write_u32(36, const { narrow::u32_of(APIC_START) });
    madt.write_u32(40, 1); // PCAT_COMPAT: dual 8259s are present
    let topology = cpus.effective_topology();
    for cpu in 0..cpus.max_vcpus {
        let flags = if cpu < cpus.boot_vcpus {
            LAPIC_ENABLED
        } else {
            LAPIC_ONLINE_CAPABLE
        };
        madt.append_slice(&local_apic_entry(cpu, topology.apic_id(cpu), flags));
    }
    // I/O APIC: type 1, length 12, id, reserved, address, GSI base.
    let mut ioapic = vec![1, 12, 0, 0];
    ioapic.extend_from_slice(&const { narrow::u32_of(IOAPIC_START) }.to_le_bytes());
    ioapic.extend_from_slice(&0u32.to_le_bytes());
    madt.append_slice(&ioapic);
    madt
}

/// One ECAM range per PCI segment, bus 0 only.
fn create_mcfg(pci_segments: u16) -> Vec<u8> {
    let mut mcfg = MCFG::new(OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for segment in 0..pci_segments.max(1) {
        mcfg.add_ecam(pci_ecam_start(segment), segment, 0, 0);
    }
    let mut bytes = Vec::new();
    mcfg.to_aml_bytes(&mut bytes);
    bytes
}

fn create_xsdt(entries: &[u64]) -> Sdt {
    let mut xsdt = Sdt::new(*b"XSDT", 36, 1, OEM_ID, OEM_TABLE_ID, OEM_REVISION);
    for e in entries {
        xsdt.append(*e);
    }
    xsdt
}

fn align8(v: u64) -> u64 {
    (v + 7) & !7
}

impl AcpiTables {
    /// Lays out the tables from `ACPI_START` for the vCPUs of `cpus`, the
    /// DSDT device AML and `pci_segments` PCI segments.
    pub fn build(
        cpus: &CpusConfig,
        device_aml: &[u8],
        pci_segments: u16,
    ) -> Result<Self, AcpiError> {
        let rsdp_addr = ACPI_START;
        let dsdt_addr = align8(rsdp_addr + Rsdp::len() as u64);
        let dsdt = create_dsdt(device_aml);
        let fadt_addr = align8(dsdt_addr + dsdt.len() as u64);
        let fadt = create_fadt(dsdt_addr);
        let madt_addr = align8(fadt_addr + fadt.len() as u64);
        let madt = create_madt(cpus);
        let mcfg_addr = align8(madt_addr + madt.len() as u64);
        let mcfg = create_mcfg(pci_segments);
        let xsdt_addr = align8(mcfg_addr + mcfg.len() as u64);
        let xsdt = create_xsdt(&[fadt_addr, madt_addr, mcfg_addr]);
        let end = xsdt_addr + xsdt.len() as u64;
        if end > ACPI_END {
            return Err(AcpiError::TooLarge {
                needed: end - ACPI_START,
                available: ACPI_END - ACPI_START,
            });
        }
        let mut rsdp = Vec::new();
        Rsdp::new(OEM_ID, xsdt_addr).to_aml_bytes(&mut rsdp);
        Ok(AcpiTables {
            rsdp_addr,
            blobs: vec![
                (rsdp_addr, rsdp),
                (dsdt_addr, dsdt.as_slice().to_vec()),
                (fadt_addr, fadt.as_slice().to_vec()),
                (madt_addr, madt.as_slice().to_vec()),
                (mcfg_addr, mcfg),
                (xsdt_addr, xsdt.as_slice().to_vec()),
            ],
        })
    }

    pub fn write(&self, mem: &GuestMemoryMmap) -> Result<(), AcpiError> {
        for (addr, bytes) in &self.blobs {
            mem.write_slice(bytes, GuestAddress(*addr))
                .map_err(AcpiError::GuestWrite)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads tables back the way an OS does: from the RSDP, by address.
    struct Reader<'a>(&'a AcpiTables);

    impl Reader<'_> {
        fn at(&self, addr: u64) -> &[u8] {
            let (_, b) = self
                .0
                .blobs
                .iter()
                .find(|(a, _)| *a == addr)
                .expect("table at address");
            b
        }
        fn u32(b: &[u8], off: usize) -> u32 {
            u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
        }
        fn u64(b: &[u8], off: usize) -> u64 {
            u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
        }
        fn table(&self, addr: u64) -> &[u8] {
            let b = self.at(addr);
            assert_eq!(Self::u32(b, 4) as usize, b.len(), "length field");
            assert_eq!(
                b.iter().fold(0u8, |s, x| s.wrapping_add(*x)),
                0,
                "checksum of {:?}",
                &b[0..4]
            );
            b
        }
    }

    fn sum(b: &[u8]) -> u8 {
        b.iter().fold(0u8, |s, x| s.wrapping_add(*x))
    }

    #[test]
    fn tables_parse_back_with_valid_checksums() {
        let t = AcpiTables::build(&CpusConfig::parse("boot=2").unwrap(), &[], 1).unwrap();
        let r = Reader(&t);
        let rsdp = r.at(t.rsdp_addr);
        assert_eq!(&rsdp[0..8], b"RSD PTR ");
        assert_eq!(sum(&rsdp[0..20]), 0, "RSDP v1 checksum");
        assert_eq!(sum(rsdp), 0, "RSDP extended checksum");
        assert_eq!(rsdp[15], 2, "revision");
        let xsdt = r.table(Reader::u64(rsdp, 24));
        assert_eq!(&xsdt[0..4], b"XSDT");
        let entries: Vec<u64> = (36..xsdt.len())
            .step_by(8)
            .map(|o| Reader::u64(xsdt, o))
            .collect();
        let sigs: Vec<&[u8]> = entries.iter().map(|a| &r.table(*a)[0..4]).collect();
        assert_eq!(sigs, vec![&b"FACP"[..], b"APIC", b"MCFG"]);
        let mcfg = r.table(entries[2]);
        assert_eq!(
            Reader::u64(mcfg, 44),
            super::super::layout::PCI_ECAM_START,
            "ECAM base of segment 0"
        );
        assert_eq!(mcfg.len(), 44 + 16, "one segment");
        assert_eq!((mcfg[54], mcfg[55]), (0, 0), "buses 0..=0");

        let fadt = r.table(entries[0]);
        assert_eq!(fadt.len(), 276);
        let flags = Reader::u32(fadt, fadt::FLAGS);
        assert_ne!(flags & fadt::FLAG_HW_REDUCED_ACPI, 0);
        assert_ne!(flags & fadt::FLAG_RESET_REG_SUP, 0);
        // Sleep control register: system I/O space, 8 bits, at the PM port.
        assert_eq!(fadt[fadt::SLEEP_CONTROL_REG], 1);
        assert_eq!(
            Reader::u64(fadt, fadt::SLEEP_CONTROL_REG + 4),
            u64::from(acpi_pm::SLEEP_CONTROL_PORT)
        );
        assert_eq!(
            Reader::u64(fadt, fadt::RESET_REG + 4),
            u64::from(acpi_pm::RESET_PORT)
        );
        assert_eq!(fadt[fadt::RESET_VALUE], acpi_pm::RESET_VALUE);

        let dsdt = r.table(Reader::u64(fadt, fadt::X_DSDT));
        assert_eq!(&dsdt[0..4], b"DSDT");
        let s5 = dsdt
            .windows(4)
            .position(|w| w == b"_S5_")
            .expect("_S5_ in DSDT");
        // NameOp, name, PackageOp, PkgLength, NumElements, BytePrefix 5.
        assert_eq!(dsdt[s5 - 1], 0x08);
        assert_eq!(&dsdt[s5 + 4..s5 + 5], &[0x12]);
        assert_eq!(&dsdt[s5 + 7..s5 + 9], &[0x0a, acpi_pm::S5_SLEEP_TYPE]);

        let madt = r.table(entries[1]);
        assert_eq!(Reader::u32(madt, 36), narrow::u32_of(APIC_START));
        let mut off = 44;
        let mut lapic_ids = vec![];
        let mut ioapics = 0;
        while off < madt.len() {
            let (kind, len) = (madt[off], madt[off + 1] as usize);
            match kind {
                0 => {
                    assert_eq!(madt[off + 4] & 1, 1, "enabled");
                    lapic_ids.push(madt[off + 3]);
                }
                1 => {
                    assert_eq!(Reader::u32(madt, off + 4), narrow::u32_of(IOAPIC_START));
                    ioapics += 1;
                }
                _ => panic!("unexpected MADT entry {kind}"),
            }
            off += len;
        }
        assert_eq!(off, madt.len());
        assert_eq!(lapic_ids, vec![0, 1]);
        assert_eq!(ioapics, 1);
    }

    /// The Local APIC entries of the MADT: (uid, APIC id, flags).
    fn madt_lapics(t: &AcpiTables) -> Vec<(u8, u8, u32)> {
        let r = Reader(t);
        let madt = t
            .blobs
            .iter()
            .map(|(a, _)| r.at(*a))
            .find(|b| &b[0..4] == b"APIC")
            .unwrap();
        let mut off = 44;
        let mut out = vec![];
        while off < madt.len() {
            if madt[off] == 0 {
                out.push((madt[off + 2], madt[off + 3], Reader::u32(madt, off + 4)));
            }
            off += madt[off + 1] as usize;
        }
        out
    }

    #[test]
    fn the_madt_lists_every_possible_vcpu_and_enables_the_boot_ones() {
        let cpus = CpusConfig::parse("boot=2,max=4").unwrap();
        let t = AcpiTables::build(&cpus, &[], 1).unwrap();
        assert_eq!(
            madt_lapics(&t),
            vec![
                (0, 0, LAPIC_ENABLED),
                (1, 1, LAPIC_ENABLED),
                (2, 2, LAPIC_ONLINE_CAPABLE),
                (3, 3, LAPIC_ONLINE_CAPABLE),
            ]
        );
        // With a topology, the APIC ids are the topology's.
        let cpus = CpusConfig::parse("boot=1,max=6,topology=2:3:1:1").unwrap();
        let t = AcpiTables::build(&cpus, &[], 1).unwrap();
        let ids: Vec<u8> = madt_lapics(&t).iter().map(|l| l.1).collect();
        assert_eq!(ids, [0, 1, 2, 3, 4, 5]);
        let cpus = CpusConfig::parse("boot=1,max=4,topology=1:2:1:2").unwrap();
        let t = AcpiTables::build(&cpus, &[], 1).unwrap();
        let ids: Vec<u8> = madt_lapics(&t).iter().map(|l| l.1).collect();
        assert_eq!(ids, [0, 1, 2, 3]);
        let cpus = CpusConfig::parse("boot=1,max=6,topology=1:3:1:2").unwrap();
        let t = AcpiTables::build(&cpus, &[], 1).unwrap();
        let ids: Vec<u8> = madt_lapics(&t).iter().map(|l| l.1).collect();
        assert_eq!(ids, [0, 1, 2, 4, 5, 6], "3 cores take 2 bits");
    }

    #[test]
    fn device_aml_lands_in_the_dsdt_and_everything_fits() {
        let t =
            AcpiTables::build(&CpusConfig::parse("boot=254").unwrap(), b"\x5b\x82MARK", 1).unwrap();
        let r = Reader(&t);
        let dsdt = t
            .blobs
            .iter()
            .map(|(a, _)| r.at(*a))
            .find(|b| &b[0..4] == b"DSDT")
            .unwrap();
        assert!(dsdt.windows(4).any(|w| w == b"MARK"));
        let too_big = vec![0u8; narrow::usize_of(ACPI_END - ACPI_START)];
        assert!(matches!(
            AcpiTables::build(&CpusConfig::default(), &too_big, 1),
            Err(AcpiError::TooLarge { .. })
        ));
    }

    #[test]
    fn mcfg_lists_each_segments_ecam_range() {
        let mcfg = create_mcfg(3);
        assert_eq!(&mcfg[0..4], b"MCFG");
        assert_eq!(Reader::u32(&mcfg, 4) as usize, mcfg.len());
        assert_eq!(sum(&mcfg), 0);
        // Allocation entries from offset 44, 16 bytes each: base, segment,
        // start bus, end bus.
        let entries: Vec<(u64, u16, u8, u8)> = mcfg[44..]
            .chunks(16)
            .map(|e| {
                (
                    Reader::u64(e, 0),
                    u16::from_le_bytes([e[8], e[9]]),
                    e[10],
                    e[11],
                )
            })
            .collect();
        assert_eq!(
            entries,
            vec![
                (pci_ecam_start(0), 0, 0, 0),
                (pci_ecam_start(1), 1, 0, 0),
                (pci_ecam_start(2), 2, 0, 0)
            ]
        );
        assert_eq!(pci_ecam_start(1) - pci_ecam_start(0), 1 << 20);
        let t = AcpiTables::build(&CpusConfig::default(), &[], 2).unwrap();
        assert!(t.blobs.iter().any(|(_, b)| *b == create_mcfg(2)));
    }
}
