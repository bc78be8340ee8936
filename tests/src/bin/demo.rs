//! The demo: boots a guest under dax-vmm through the rig and shows what the
//! guest found. `cargo run -p guest-tests --bin demo -- --help`.

use std::time::Duration;

use guest_tests::rig::{self, Guest};

const DEMO_SCRIPT: &str = r#"
echo "@@GUEST kernel=$(uname -r)"
echo "@@GUEST nproc=$(nproc)"
echo "@@GUEST memtotal=$(awk '/^MemTotal:/ {print $2 " " $3}' /proc/meminfo)"
echo "@@GUEST cmdline=$(cat /proc/cmdline)"
echo "@@GUEST acpi_tables=$(ls /sys/firmware/acpi/tables 2>/dev/null | tr '\n' ' ')"
echo "@@GUEST filesystems=$(grep -E 'virtiofs|fuse' /proc/filesystems | awk '{print $NF}' | tr '\n' ' ')"
"#;

fn usage() -> ! {
    eprintln!("usage: demo [--cpus N] [--memory SIZE] [--cmdline WORDS] [--timeout SECS] [--vmm-arg ARG]... [--script FILE] [--echo]");
    std::process::exit(2);
}

fn main() {
    let mut guest = Guest::new("demo", DEMO_SCRIPT);
    guest.cpus = 2;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| usage());
        match arg.as_str() {
            "--cpus" => guest.cpus = value().parse().unwrap_or_else(|_| usage()),
            "--memory" => guest.memory = value(),
            "--cmdline" => guest.cmdline = value(),
            "--timeout" => guest.timeout = Duration::from_secs(value().parse().unwrap_or_else(|_| usage())),
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
    println!("== the VMM ==");
    println!("  exit status    {}", run.vmm_exit.map(|s| s.to_string()).unwrap_or_else(|| "none (did not finish)".into()));
    println!("  said           {}", run.vmm_message().unwrap_or("-"));
    if let Some(t) = run.guest_boot_to_init() {
        println!("  boot-to-init   {:.2} s", t.as_secs_f64());
    }
    println!("  log            {}", run.log_path.display());
    if run.timed_out || run.vmm_exit != Some(0) {
        std::process::exit(1);
    }
}
