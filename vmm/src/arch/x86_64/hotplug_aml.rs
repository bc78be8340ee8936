//! The AML of the hot-plug controllers the guest reaches through I/O ports
//! (vCPU, memory and PCI hot-plug, as Cloud Hypervisor and QEMU describe
//! them): each is a `PNP0A06` device that claims its ports in `_CRS`, has a
//! mutex its methods take, and names its registers with Fields over an
//! OperationRegion on those ports; the vCPU and memory controllers also
//! have the same three methods over numbered devices — the status of
//! device N, notify device N, and the scan the GED calls. The shape is
//! written once here; each controller gives its names, registers and
//! device count.

use acpi_tables::{aml, Aml, AmlSink};

/// AML already encoded: lets a part be built in one statement (the
/// crate's objects borrow their parts) and placed in another, as it is,
/// among a device's (or a method's) children.
pub struct RawAml(pub Vec<u8>);

impl RawAml {
    pub fn of(a: &dyn Aml) -> Self {
        let mut v = Vec::new();
        a.to_aml_bytes(&mut v);
        RawAml(v)
    }
}

impl Aml for RawAml {
    fn to_aml_bytes(&self, sink: &mut dyn AmlSink) {
        sink.vec(&self.0);
    }
}

/// One Field over the controller's OperationRegion: its access width, what
/// a write does to the bits it does not name, and the registers it names
/// (a `Reserved` entry skips to a register's offset).
pub struct RegisterField {
    pub access: aml::FieldAccessType,
    pub update: aml::FieldUpdateRule,
    pub entries: Vec<aml::FieldEntry>,
}

/// A hot-plug controller's device in the DSDT.
pub struct PortController<'a> {
    /// The device's ACPI path, e.g. `\_SB_.PRES`.
    pub path: &'a str,
    /// Its `_UID`: which controller this is, as Cloud Hypervisor names it.
    pub uid: &'static str,
    /// The first I/O port of its registers, and how many ports it takes.
    pub port: u16,
    pub ports: u8,
    /// The mutex its methods take.
    pub mutex: &'a str,
    /// The OperationRegion over its ports, which `fields` name.
    pub region: &'a str,
    pub fields: Vec<RegisterField>,
}

impl PortController<'_> {
    /// The device with its ports, mutex and registers, then `children` (its
    /// methods, and whatever else the controller keeps inside it).
    pub fn append_aml(&self, children: &[&dyn Aml], sink: &mut Vec<u8>) {
        let hid = hid();
        let uid = aml::Name::new("_UID".into(), &self.uid);
        let mutex = aml::Mutex::new(self.mutex.into(), 0);
        let crs = aml::Name::new(
            "_CRS".into(),
            &aml::ResourceTemplate::new(vec![&aml::IO::new(self.port, self.port, 1, self.ports)]),
        );
        let (port, len) = (usize::from(self.port), usize::from(self.ports));
        let region = aml::OpRegion::new(
            self.region.into(),
            aml::OpRegionSpace::SystemIO,
            &port,
            &len,
        );
        let fields: Vec<aml::Field> = self
            .fields
            .iter()
            .map(|f| {
                aml::Field::new(
                    self.region.into(),
                    f.access,
                    aml::FieldLockRule::NoLock,
                    f.update,
                    f.entries.clone(),
                )
            })
            .collect();
        let mut all: Vec<&dyn Aml> = vec![&hid, &uid, &mutex, &crs, &region];
        all.extend(fields.iter().map(|f| f as &dyn Aml));
        all.extend_from_slice(children);
        aml::Device::new(self.path.into(), all).to_aml_bytes(sink);
    }

    /// The device without ports or registers, for a controller the VM does
    /// not have: only `children`, so that what calls its methods (the GED's
    /// `_EVT`) still finds them.
    pub fn append_unbacked_aml(&self, children: &[&dyn Aml], sink: &mut Vec<u8>) {
        let hid = hid();
        let uid = aml::Name::new("_UID".into(), &self.uid);
        let mut all: Vec<&dyn Aml> = vec![&hid, &uid];
        all.extend_from_slice(children);
        aml::Device::new(self.path.into(), all).to_aml_bytes(sink);
    }
}

/// `PNP0A06`, the generic container Cloud Hypervisor and QEMU give their
/// hot-plug controllers.
fn hid() -> aml::Name {
    aml::Name::new("_HID".into(), &aml::EISAName::new("PNP0A06"))
}

/// The registers through which the status, notify and scan methods reach
/// numbered devices: paths (absolute, or relative to where the methods
/// sit) of the mutex, the selector register and the selected device's
/// enabled bit.
pub struct SelectedDevice<'a> {
    pub lock: &'a str,
    pub select: &'a str,
    pub enabled: &'a str,
}

/// `name(n)`: the `_STA` of device `n`: 0xf (present, enabled, shown,
/// working) when its enabled bit is set, else 0.
pub fn status_method(name: &str, regs: &SelectedDevice) -> RawAml {
    let lock = || aml::Path::new(regs.lock);
    RawAml::of(&aml::Method::new(
        name.into(),
        1,
        true,
        vec![
            &aml::Acquire::new(lock(), 0xffff),
            &aml::Store::new(&aml::Path::new(regs.select), &aml::Arg(0)),
            &aml::Store::new(&aml::Local(0), &aml::ZERO),
            &aml::If::new(
                &aml::Equal::new(&aml::Path::new(regs.enabled), &aml::ONE),
                vec![&aml::Store::new(&aml::Local(0), &0xfu8)],
            ),
            &aml::Release::new(lock()),
            &aml::Return::new(&aml::Local(0)),
        ],
    ))
}

/// `name(n, event)`: notifies device `n` (named `devices[n]`) of `event`.
/// Notify needs the device by name, so one If per device.
pub fn notify_method(name: &str, devices: &[String]) -> RawAml {
    let paths: Vec<aml::Path> = devices.iter().map(|d| aml::Path::new(d)).collect();
    let notifies: Vec<aml::Notify> = paths
        .iter()
        .map(|p| aml::Notify::new(p, &aml::Arg(1)))
        .collect();
    let numbers: Vec<u64> = (0u64..).take(devices.len()).collect();
    let tests: Vec<aml::Equal> = numbers
        .iter()
        .map(|n| aml::Equal::new(&aml::Arg(0), n))
        .collect();
    let ifs: Vec<aml::If> = tests
        .iter()
        .zip(&notifies)
        .map(|(t, n)| aml::If::new(t, vec![n]))
        .collect();
    RawAml::of(&aml::Method::new(
        name.into(),
        2,
        true,
        ifs.iter().map(|i| i as &dyn Aml).collect(),
    ))
}

/// A bit a scan looks at: the path of a device's flag register and the
/// notification the guest gets for it ("device check" 1, "eject request"
/// 3). The scan acknowledges the flag by writing 1 back.
pub struct ScanFlag<'a> {
    pub flag: &'a str,
    pub event: u8,
}

/// `name()`: selects each of `count` devices in turn and, for each of
/// `flags` set on it, calls `notify(n, event)` and acknowledges the flag.
pub fn scan_method(
    name: &str,
    regs: &SelectedDevice,
    count: usize,
    notify: &str,
    flags: &[ScanFlag],
) -> RawAml {
    let lock = || aml::Path::new(regs.lock);
    let device = aml::Local(0);
    let mut scan_one = vec![RawAml::of(&aml::Store::new(
        &aml::Path::new(regs.select),
        &device,
    ))];
    for f in flags {
        let flag = aml::Path::new(f.flag);
        scan_one.push(RawAml::of(&aml::If::new(
            &aml::Equal::new(&flag, &aml::ONE),
            vec![
                &aml::MethodCall::new(notify.into(), vec![&device, &f.event]),
                &aml::Store::new(&flag, &aml::ONE),
            ],
        )));
    }
    scan_one.push(RawAml::of(&aml::Add::new(&device, &device, &aml::ONE)));
    RawAml::of(&aml::Method::new(
        name.into(),
        0,
        true,
        vec![
            &aml::Acquire::new(lock(), 0xffff),
            &aml::Store::new(&device, &aml::ZERO),
            &aml::While::new(
                &aml::LessThan::new(&device, &count),
                scan_one.iter().map(|a| a as &dyn Aml).collect(),
            ),
            &aml::Release::new(lock()),
        ],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(haystack: &[u8], needle: &[u8]) -> usize {
        haystack
            .windows(needle.len())
            .filter(|w| *w == needle)
            .count()
    }

    #[test]
    fn the_controller_claims_its_ports_and_names_its_registers() {
        let controller = PortController {
            path: "\\_SB_.TEST",
            uid: "Test Hotplug Controller",
            port: 0x1234,
            ports: 12,
            mutex: "TLCK",
            region: "TREG",
            fields: vec![RegisterField {
                access: aml::FieldAccessType::DWord,
                update: aml::FieldUpdateRule::WriteAsZeroes,
                entries: vec![aml::FieldEntry::Named(*b"TSEL", 32)],
            }],
        };
        let method = aml::Method::new("TSCN".into(), 0, true, vec![]);
        let mut sink = Vec::new();
        controller.append_aml(&[&method], &mut sink);
        for name in [&b"TEST"[..], b"TLCK", b"TSEL", b"TSCN", b"_CRS"] {
            assert_eq!(count(&sink, name), 1, "{}", String::from_utf8_lossy(name));
        }
        assert_eq!(count(&sink, b"TREG"), 2, "the region and the field over it");
        // The I/O descriptor: min and max 0x1234, alignment 1, 12 ports.
        assert_eq!(
            count(&sink, &[0x47, 0x01, 0x34, 0x12, 0x34, 0x12, 1, 12]),
            1
        );
        // The region: SystemIO (1), from the port (WordPrefix), 12 long.
        assert_eq!(count(&sink, b"TREG\x01\x0b\x34\x12\x0a\x0c"), 1);

        let mut unbacked = Vec::new();
        controller.append_unbacked_aml(&[&method], &mut unbacked);
        assert_eq!(count(&unbacked, b"TSCN"), 1);
        for absent in [&b"TLCK"[..], b"TREG", b"_CRS"] {
            assert_eq!(count(&unbacked, absent), 0, "no ports without a controller");
        }
    }

    #[test]
    fn notify_has_one_test_per_device_and_scan_one_per_flag() {
        let names: Vec<String> = (0..5).map(|i| format!("D{i:03}")).collect();
        let notify = notify_method("DTFY", &names);
        for n in &names {
            assert_eq!(count(&notify.0, n.as_bytes()), 1, "{n}");
        }
        // NotifyOp (0x86) once per device.
        assert_eq!(count(&notify.0, &[0x86]), names.len());

        let regs = SelectedDevice {
            lock: "DLCK",
            select: "DSEL",
            enabled: "DEN_",
        };
        let flags = [
            ScanFlag {
                flag: "DINS",
                event: 1,
            },
            ScanFlag {
                flag: "DRMV",
                event: 3,
            },
        ];
        let scan = scan_method("DSCN", &regs, names.len(), "DTFY", &flags);
        assert_eq!(count(&scan.0, b"DTFY"), 2, "a call per flag");
        // Each flag is tested and acknowledged.
        assert_eq!(count(&scan.0, b"DINS"), 2);
        assert_eq!(count(&scan.0, b"DRMV"), 2);
        // The eject request's event is passed as a byte (BytePrefix 3).
        assert_eq!(count(&scan.0, &[b'D', b'T', b'F', b'Y', 0x60, 0x0a, 3]), 1);

        let status = status_method("DSTA", &regs);
        for name in [&b"DSTA"[..], b"DLCK", b"DSEL", b"DEN_"] {
            assert!(
                count(&status.0, name) >= 1,
                "{}",
                String::from_utf8_lossy(name)
            );
        }
    }
}
