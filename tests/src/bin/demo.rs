//! The demo: boots a guest under dax-vmm through the rig with a virtio-fs
//! DAX share served by dax-virtiofsd, and shows what the guest found and
//! what the daemon mapped. `cargo run -p guest-tests --bin demo -- --help`.

use std::time::Duration;

use guest_tests::rig::{self, Guest};

const DEMO_SCRIPT: &str = r#"
echo "@@GUEST kernel=$(uname -r)"
echo "@@GUEST nproc=$(nproc)"
echo "@@GUEST memtotal=$(awk '/^MemTotal:/ {print $2 " " $3}' /proc/meminfo)"
echo "@@GUEST acpi_tables=$(ls /sys/firmware/acpi/tables 2>/dev/null | tr '\n' ' ')"
mkdir -p /mnt && mount -t virtiofs share /mnt -o dax=inode
echo "@@GUEST mount=$(grep ' /mnt ' /proc/mounts)"
echo "@@GUEST files=$(cd /mnt && ls -l | awk 'NR>1 {print $5 "B:" $9}' | tr '\n' ' ')"
echo "@@GUEST statx_dax=$(cd /mnt && daxprobe statx big.bin hello.txt)"
echo "@@GUEST hello=$(cat /mnt/hello.txt)"
t0=$(cut -d' ' -f1 /proc/uptime)
echo "@@GUEST big_md5=$(md5sum < /mnt/big.bin | cut -d' ' -f1) (read through the DAX window)"
echo "@@GUEST big_read_s=$(awk "BEGIN{print $(cut -d' ' -f1 /proc/uptime)-$t0}")"
echo "written by the guest" > /mnt/from-guest.txt && sync
umount /mnt
"#;

/// Host side: a share with a 64 MiB file (DAX under the default policy) and
/// a small one (not), the daemon in the background, its report afterwards.
const HOST_BEFORE: &str = r#"
mkdir -p share && echo "hello from the host" > share/hello.txt
dd if=/dev/urandom of=share/big.bin bs=1M count=64 2>/dev/null
echo "@@HOST big_md5=$(md5sum < share/big.bin | cut -d' ' -f1)"
dax-virtiofsd --socket-path /tmp/demo-fs.sock --shared-dir share --cache-size 32M --log-level info &
DAEMON=$!
i=0; while [ ! -S /tmp/demo-fs.sock ] && [ $i -lt 200 ]; do sleep 0.1; i=$((i+1)); done
"#;

const HOST_AFTER: &str = r#"
wait $DAEMON
echo "@@HOST from_guest=$(cat share/from-guest.txt)"
"#;

fn usage() -> ! {
    eprintln!("usage: demo [--cpus N] [--memory SIZE] [--cmdline WORDS] [--timeout SECS] [--vmm-arg ARG]... [--script FILE] [--echo]");
    std::process::exit(2);
}

fn main() {
    let mut guest = Guest::new("demo", DEMO_SCRIPT);
    guest.cpus = 2;
    guest.memory = "512M,shared=on".into();
    let tool = |pkg, bin| {
        rig::tool(pkg, bin).unwrap_or_else(|e| {
            eprintln!("demo: {e}");
            std::process::exit(1)
        })
    };
    guest.host_tools = vec![tool("daemon", "dax-virtiofsd")];
    guest.guest_tools = vec![tool("guest-tests", "daxprobe")];
    guest.host_before = HOST_BEFORE.into();
    guest.host_after = HOST_AFTER.into();
    guest.vmm_args = vec![
        "-v".into(),
        "--fs".into(),
        "tag=share,socket=/tmp/demo-fs.sock,cache_size=32M".into(),
    ];
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--cpus" => guest.cpus = value().parse().unwrap_or_else(|_| usage()),
            "--memory" => guest.memory = value(),
            "--cmdline" => guest.cmdline = value(),
            "--timeout" => {
                guest.timeout = Duration::from_secs(value().parse().unwrap_or_else(|_| usage()))
            }
            "--vmm-arg" => guest.vmm_args.push(value()),
            "--script" => {
                let path = value();
                guest.script = std::fs::read_to_string(&path).unwrap_or_else(|e| {
                    eprintln!("demo: --script {path}: {e}");
                    std::process::exit(2)
                })
            }
            "--echo" => std::env::set_var("DAX_VMM_RIG_ECHO", "1"),
            _ => usage(),
        }
    }
    let run = match rig::run(&guest) {
        Ok(run) => run,
        Err(e) => {
            eprintln!("demo: {e}");
            std::process::exit(1);
        }
    };
    println!("{}", run.text());
    println!();
    println!("== what the guest found ==");
    let mut found: Vec<_> = run.guest_values().into_iter().collect();
    found.sort();
    for (k, v) in found {
        println!("  {k:14} {v}");
    }
    println!("== the host ==");
    for key in ["big_md5", "from_guest"] {
        println!("  {key:14} {}", run.host(key).unwrap_or("-"));
    }
    println!("== the daemon ==");
    for line in run
        .lines
        .iter()
        .filter(|l| l.text.contains("dax_virtiofsd"))
    {
        println!("  {}", line.text);
    }
    println!("== the VMM ==");
    println!(
        "  exit status    {}",
        run.vmm_exit
            .map(|s| s.to_string())
            .unwrap_or_else(|| "none (did not finish)".into())
    );
    println!("  said           {}", run.vmm_message().unwrap_or("-"));
    if let Some(t) = run.guest_boot_to_init() {
        println!("  boot-to-init   {:.2} s", t.as_secs_f64());
    }
    println!("  log            {}", run.log_path.display());
    if run.timed_out || run.vmm_exit != Some(0) {
        std::process::exit(1);
    }
}
