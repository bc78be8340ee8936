//! What the drain tests add: a guest kernel that keeps a VM running, and
//! a destination host's spare VMM with the daemon it needs.
//!
//! Two hosts on one machine: the destination's fs sockets must sit at the
//! paths the VM's configuration names, where the source's daemon already
//! listens. So the spare VMM runs in a mount namespace of its own
//! (`unshare -m`, which needs root) in which the VM's socket directory is
//! the destination's (a bind mount), as it would be on another host. The
//! network is the machine's: the migration goes over 127.0.0.1.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use test_infra::rig;

use super::{start_daemon_at, vm_state, wait_for, Proc, Vm};

/// A bzImage whose 64-bit entry is `cli; hlt; jmp .-1`: the vCPU halts in
/// KVM for good. A VM booted with it runs (and migrates) without using the
/// CPU. Not the rig's guest kernel: on a host whose /dev/kvm cannot run a
/// stock Linux kernel (the project's CI machines, which is why the guest
/// tests boot theirs nested) that one ends its VM within seconds
/// (`KVM_EXIT_INTERNAL_ERROR`), and a drain needs its VM running throughout.
pub fn halting_kernel(dir: &Path) -> PathBuf {
    // Boot protocol header fields (Documentation/arch/x86/boot.rst).
    let mut setup = vec![0u8; 1024];
    setup[0x1f1] = 1; // setup_sects: one sector after the boot sector
    setup[0x1fe..0x200].copy_from_slice(&0xaa55u16.to_le_bytes());
    setup[0x202..0x206].copy_from_slice(b"HdrS");
    setup[0x206..0x208].copy_from_slice(&0x020fu16.to_le_bytes()); // version
    setup[0x211] = 1; // loadflags: LOADED_HIGH
    setup[0x214..0x218].copy_from_slice(&0x10_0000u32.to_le_bytes()); // code32_start
    setup[0x22c..0x230].copy_from_slice(&0x7fff_ffffu32.to_le_bytes()); // initrd_addr_max
    setup[0x238..0x23c].copy_from_slice(&2048u32.to_le_bytes()); // cmdline_size
    let mut payload = vec![0u8; 4096];
    // At the 64-bit entry (load address + 0x200): cli; hlt; jmp back to hlt.
    payload[0x200..0x204].copy_from_slice(&[0xfa, 0xf4, 0xeb, 0xfd]);
    let path = dir.join("halt.bzImage");
    std::fs::write(&path, [setup, payload].concat()).unwrap();
    path
}

/// A destination host's spare for `vm`: an empty VMM (API only) in a
/// mount namespace where `vm`'s socket directory is `sockets`, and what
/// listens there for the VM's fs device.
pub struct Spare {
    pub api: PathBuf,
    /// The destination's side of the VM's socket directory.
    pub sockets: PathBuf,
    /// The VM's share (shared storage: the same directory).
    share: PathBuf,
    vmm: Proc,
    daemon: Option<Proc>,
    fake: Option<Arc<AtomicBool>>,
}

impl Spare {
    /// On another host than `vm`'s: a mount namespace in which the VM's
    /// socket directory is `<root>/<host>/<vm>`.
    pub fn start(root: &Path, host: &str, vm: &Vm) -> Spare {
        let sockets = root.join(host).join(&vm.name);
        Self::start_with(root, host, vm, Some(sockets))
    }

    /// On the host `vm` came from (it is coming back): the VM's socket
    /// directory as it is, its old daemon gone.
    pub fn start_at_home(root: &Path, host: &str, vm: &Vm) -> Spare {
        Self::start_with(root, host, vm, None)
    }

    fn start_with(root: &Path, host: &str, vm: &Vm, own: Option<PathBuf>) -> Spare {
        let sockets = own.clone().unwrap_or_else(|| vm.dir.clone());
        std::fs::create_dir_all(&sockets).unwrap();
        std::fs::create_dir_all(root.join(host)).unwrap();
        let api = root.join(host).join(format!("spare-{}.sock", vm.name));
        let _ = std::fs::remove_file(&api);
        let bin = rig::tool("vmm", "dax-vmm").expect("dax-vmm");
        let log = std::fs::File::create(root.join(host).join("spare.log")).unwrap();
        let mut script = format!(
            "exec '{}' --api-socket 'path={}' -v",
            bin.display(),
            api.display()
        );
        if own.is_some() {
            script = format!(
                "mount --bind '{}' '{}' && {script}",
                sockets.display(),
                vm.dir.display()
            );
        }
        let vmm = Proc(
            Command::new("unshare")
                .args(["--mount", "--propagation", "private", "sh", "-c", &script])
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("unshare (util-linux)"),
        );
        let sock = api.clone();
        wait_for(
            "the spare VMM's API socket",
            Duration::from_secs(30),
            || sock.exists(),
        );
        Spare {
            api,
            sockets,
            share: vm.dir.join("share"),
            vmm,
            daemon: None,
            fake: None,
        }
    }

    /// The destination's daemon for the VM, on the same share.
    pub fn start_daemon(&mut self) {
        self.stop_fake();
        let _ = std::fs::remove_file(self.sockets.join("fs.sock"));
        self.daemon = Some(start_daemon_at(&self.sockets, &self.share));
        let control = self.control();
        wait_for("the destination's daemon", Duration::from_secs(30), || {
            control.exists()
        });
    }

    /// Something that is no daemon at the VM's fs socket: it accepts each
    /// connection and closes it, so the VM cannot be received.
    pub fn start_fake_daemon(&mut self) {
        let path = self.sockets.join("fs.sock");
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            while !stopped.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((conn, _)) => drop(conn),
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        self.fake = Some(stop);
    }

    fn stop_fake(&mut self) {
        if let Some(stop) = self.fake.take() {
            stop.store(true, Ordering::Relaxed);
        }
    }

    pub fn control(&self) -> PathBuf {
        self.sockets.join("fs-control.sock")
    }

    /// The spare's VM's state, None while it has none.
    pub fn vm_state(&self) -> Option<String> {
        vm_state(&self.api)
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        self.stop_fake();
        self.vmm.kill();
        if let Some(mut d) = self.daemon.take() {
            d.kill();
        }
    }
}
