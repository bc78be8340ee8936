//! What a run boots: the host script around the VMM, the guest's
//! initramfs (busybox, modules, the test script) and the emulated host's
//! (KVM modules, the VMM, the guest's images, the host files).

use std::path::Path;

use super::binaries::{read_tool, tool_name};
use super::Guest;
use crate::cpio::CpioArchive;
use crate::kernel::GuestKernel;
use crate::RigError;

/// Passes the VMM's standard output (the guest's serial) on a line at a
/// time. The VMM writes the serial byte by byte, as the guest sends it, and
/// the host script's own marker lines share the console (or pipe) with it: a
/// marker written while a guest line was half out split that line in two
/// (`@` then `@GUEST rw_queues=2`), and the guest's value was lost. One
/// `write` per whole line keeps each writer's lines whole, since a `write`
/// to a tty or a short one to a pipe is not interleaved with another.
/// `follow FILE` does the same for a serial the VMM writes to a file
/// (`serial.mode=File`, as Kata sends it): it empties FILE and passes what
/// is appended to it on a line at a time; `kill $TAIL` stops it.
pub(super) const WHOLE_LINES: &str = "rm -f \"$WORK/.serial\"; mkfifo \"$WORK/.serial\"\n\
     awk '{print; fflush()}' <\"$WORK/.serial\" &\nLINES_PID=$!\n\
     follow() { : > \"$1\"; rm -f \"$WORK/.follow\"; mkfifo \"$WORK/.follow\"; \
     awk '{print; fflush()}' <\"$WORK/.follow\" & tail -n +1 -f \"$1\" >\"$WORK/.follow\" & TAIL=$!; }\n";

pub(super) fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

pub(super) fn host_script(guest: &Guest) -> String {
    let mut args = vec![
        "--kernel".to_string(),
        "$KERNEL".into(),
        "--initramfs".into(),
        "$INITRAMFS".into(),
        "--cmdline".into(),
        sh_quote(&guest.cmdline()),
        "--cpus".into(),
        format!("boot={}", guest.cpus),
        "--memory".into(),
        sh_quote(&format!("size={}", guest.memory)),
        "--serial".into(),
        "tty".into(),
    ];
    args.extend(guest.vmm_args.iter().map(|a| sh_quote(a)));
    if let Some(api) = &guest.api_script {
        let mut api_args = vec!["--api-socket".to_string(), "/tmp/api.sock".into()];
        api_args.extend(guest.vmm_args.iter().map(|a| sh_quote(a)));
        return format!(
            "cd \"$WORK\"\nexport PATH=\"$WORK/bin:$PATH\" RUST_LOG_STYLE=never CMDLINE={cmdline}\n{before}\n\
             {lines}echo '@@RIG vmm_start'\n\"$VMM\" {api_args} </dev/null >\"$WORK/.serial\" &\nVMM_PID=$!\n\
             i=0; while [ ! -S /tmp/api.sock ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done\n\
             {api}\nwait $VMM_PID\necho \"@@RIG vmm_exit=$?\"\nwait $LINES_PID\n{after}\n",
            lines = WHOLE_LINES,
            cmdline = sh_quote(&guest.cmdline()),
            before = guest.host_before,
            api_args = api_args.join(" "),
            after = guest.host_after,
        );
    }
    format!(
        "cd \"$WORK\"\nexport PATH=\"$WORK/bin:$PATH\" RUST_LOG_STYLE=never\n{before}\n{lines}echo '@@RIG vmm_start'\n\"$VMM\" {args} </dev/null >\"$WORK/.serial\"\necho \"@@RIG vmm_exit=$?\"\nwait $LINES_PID\n{after}\n",
        before = guest.host_before,
        lines = WHOLE_LINES,
        args = args.join(" "),
        after = guest.host_after,
    )
}

/// The guest's initramfs: busybox, modules, an init that runs the script.
pub(super) fn guest_initramfs(
    guest: &Guest,
    kernel: &GuestKernel,
    busybox: &[u8],
) -> Result<Vec<u8>, RigError> {
    let names: Vec<&str> = guest.guest_modules.iter().map(String::as_str).collect();
    let modules = kernel.modules_with_deps(&names)?;
    let mut image = base_image(busybox);
    let load = add_modules(&mut image, &modules, |name| {
        format!(" || echo \"@@GUEST insmod_failed={name}\"")
    });
    for f in &guest.guest_files {
        image.file(&f.path, f.perm, &f.data);
    }
    for tool in &guest.guest_tools {
        image.file(
            &format!("bin/{}", tool_name(tool)?),
            0o755,
            &read_tool(tool)?,
        );
    }
    image.file("test.sh", 0o755, guest.script.as_bytes());
    let init = format!(
        "{INIT_PREAMBLE}\
         echo \"@@GUEST init uptime=$(cut -d' ' -f1 /proc/uptime)\"\n\
         {load}\
         sh /test.sh\n\
         echo \"@@GUEST script_exit=$?\"\n\
         sleep 0.5\n\
         poweroff -f\n"
    );
    // (The pause lets the last marker line out before the kernel's own
    // power-down message, which could otherwise land inside it.)
    image.file("init", 0o755, init.as_bytes());
    Ok(image.finish())
}

/// The emulated host's initramfs: busybox, KVM modules, the VMM, the guest's
/// kernel and initramfs, the host files and the host script.
pub(super) fn emulated_host_initramfs(
    guest: &Guest,
    kernel: &GuestKernel,
    busybox: &[u8],
    vmm: &Path,
    guest_initramfs: &[u8],
    host_script: &str,
) -> Result<Vec<u8>, RigError> {
    let mut wanted = vec!["kvm_amd"];
    wanted.extend(guest.host_modules.iter().map(String::as_str));
    let kvm = kernel.modules_with_deps(&wanted)?;
    let mut image = base_image(busybox);
    let load = add_modules(&mut image, &kvm, |_| String::new());
    let vmm_bytes = std::fs::read(vmm).map_err(|e| RigError::io(vmm, e))?;
    image.file("bin/dax-vmm", 0o755, &vmm_bytes);
    for tool in &guest.host_tools {
        image.file(
            &format!("bin/{}", tool_name(tool)?),
            0o755,
            &read_tool(tool)?,
        );
    }
    let bzimage = std::fs::read(&kernel.bzimage).map_err(|e| RigError::io(&kernel.bzimage, e))?;
    image.file("guest/vmlinuz", 0o644, &bzimage);
    image.file("guest/initramfs.cpio", 0o644, guest_initramfs);
    image.dir("work");
    for f in &guest.host_files {
        image.file(&format!("work/{}", f.path), f.perm, &f.data);
    }
    image.file("rig/host.sh", 0o755, host_script.as_bytes());
    let init = format!(
        "{INIT_PREAMBLE}\
         mount -t tmpfs tmpfs /tmp\n\
         {load}\
         [ -c /dev/kvm ] || echo '@@RIG error=no /dev/kvm in the emulated host'\n\
         echo \"@@RIG l1_ready uptime=$(cut -d' ' -f1 /proc/uptime)\"\n\
         VMM=/bin/dax-vmm KERNEL=/guest/vmlinuz INITRAMFS=/guest/initramfs.cpio WORK=/work sh /rig/host.sh\n\
         poweroff -f\n"
    );
    image.file("init", 0o755, init.as_bytes());
    Ok(image.finish())
}

/// How both inits start: busybox applets on PATH, proc, sysfs and devtmpfs.
pub(super) const INIT_PREAMBLE: &str = "#!/bin/busybox sh\n\
    /bin/busybox --install -s /bin\n\
    export PATH=/bin\n\
    mount -t proc proc /proc\n\
    mount -t sysfs sysfs /sys\n\
    mount -t devtmpfs devtmpfs /dev\n";

/// Puts decompressed modules in `/lib/modules` and returns the shell lines
/// that load them in order; `on_failure` appends to each `insmod` line.
pub(super) fn add_modules(
    image: &mut CpioArchive,
    modules: &[(String, Vec<u8>)],
    on_failure: impl Fn(&str) -> String,
) -> String {
    let mut load = String::new();
    for (name, data) in modules {
        image.file(&format!("lib/modules/{name}.ko"), 0o644, data);
        load.push_str(&format!(
            "insmod /lib/modules/{name}.ko{}\n",
            on_failure(name)
        ));
    }
    load
}

pub(super) fn base_image(busybox: &[u8]) -> CpioArchive {
    let mut image = CpioArchive::new();
    for dir in ["proc", "sys", "dev", "tmp", "etc", "mnt", "root"] {
        image.dir(dir);
    }
    image.char_device("dev/console", 0o600, 5, 1);
    image.file("bin/busybox", 0o755, busybox);
    image.symlink("bin/sh", "busybox");
    image
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn host_script_quotes_arguments() {
        let mut g = Guest::new("q", "true");
        g.cmdline = "it's".into();
        g.vmm_args = vec!["--pmem".into(), "file=a b".into()];
        let s = host_script(&g);
        assert!(s.contains(r"'console=ttyS0 panic=-1 quiet it'\''s'"), "{s}");
        assert!(s.contains("'file=a b'"), "{s}");
        assert!(s.contains("</dev/null"));
    }

    /// Runs `script` with `$WORK` at `work` and checks that the console got
    /// the guest's `@@GUEST k=2` and the host's `@@HOST mid=1`, each whole.
    fn assert_guest_line_whole(script: &str, work: &std::path::Path) {
        std::fs::create_dir_all(work).unwrap();
        let out = Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("WORK", work)
            .output()
            .unwrap();
        std::fs::remove_dir_all(work).unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines.contains(&"@@GUEST k=2"), "{text:?}");
        assert!(lines.contains(&"@@HOST mid=1"), "{text:?}");
        assert_eq!(lines.len(), 2, "{text:?}");
    }

    #[test]
    fn a_marker_written_mid_line_does_not_split_the_guest_line() {
        // The guest's line goes out a byte at a time, as the VMM writes the
        // serial; the host's marker is written while it is half out.
        let work = std::env::temp_dir().join(format!("rig-lines-{}", std::process::id()));
        let script = format!(
            "{WHOLE_LINES}(for c in @ @ G U E S T ' ' k = 2; do printf '%s' \"$c\"; sleep 0.02; done; echo) >\"$WORK/.serial\" &\n\
             sleep 0.1; echo '@@HOST mid=1'\nwait $LINES_PID\n"
        );
        assert_guest_line_whole(&script, &work);
    }

    #[test]
    fn a_serial_file_followed_reaches_the_console_a_line_at_a_time() {
        // `serial.mode=File`: the VMM appends to the file a byte at a time.
        let work = std::env::temp_dir().join(format!("rig-follow-{}", std::process::id()));
        let script = format!(
            "{WHOLE_LINES}: > \"$WORK/.serial\"; cd \"$WORK\"; follow serial.log\n\
             (for c in @ @ G U E S T ' ' k = 2; do printf '%s' \"$c\" >> serial.log; sleep 0.05; done; echo >> serial.log) &\n\
             sleep 0.2; echo '@@HOST mid=1'; sleep 1; kill $TAIL; wait\n"
        );
        assert_guest_line_whole(&script, &work);
    }

    #[test]
    fn api_mode_starts_the_vmm_with_only_its_socket_and_runs_the_api_script() {
        let mut g = Guest::new("a", "true");
        g.vmm_args = vec!["-v".into()];
        g.api_script = Some("api PUT /api/v1/vm.boot".into());
        g.host_before = "BEFORE".into();
        g.host_after = "AFTER".into();
        let s = host_script(&g);
        assert!(
            s.contains("\"$VMM\" --api-socket /tmp/api.sock '-v' </dev/null >\"$WORK/.serial\" &"),
            "{s}"
        );
        assert!(
            !s.contains("--kernel"),
            "the VM is created by the API script: {s}"
        );
        // The kernel command line reaches the script, which puts it in vm.create.
        assert!(s.contains("CMDLINE='console=ttyS0"), "{s}");
        let order: Vec<usize> = [
            "BEFORE",
            "vmm_start",
            "-S /tmp/api.sock",
            "api PUT /api/v1/vm.boot",
            "wait $VMM_PID",
            "vmm_exit",
            "AFTER",
        ]
        .iter()
        .map(|needle| {
            s.find(needle)
                .unwrap_or_else(|| panic!("{needle} missing: {s}"))
        })
        .collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "steps out of order: {s}"
        );
    }
}
