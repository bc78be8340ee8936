//! `daxprobe proc-cost SHARE_DIR PID...` (run in the VMM's host): what the
//! processes PID and all their descendants cost the host beyond the guest's
//! RAM and the share's file pages, summed, on one line
//! (`test_infra::proc_cost` says how each mapping is classed).

use test_infra::proc_cost::{descendants, process_cost, stat_parent, ProcCost};

use super::{fail, num};

/// Every process's (pid, parent pid) now.
fn process_table() -> Vec<(u32, u32)> {
    let dir = std::fs::read_dir("/proc").unwrap_or_else(|e| fail(format!("/proc: {e}")));
    dir.filter_map(|e| {
        let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        Some((pid, stat_parent(&stat)?))
    })
    .collect()
}

pub fn run(share_dir: &str, pids: &[&str]) {
    let table = process_table();
    let mut total = ProcCost::default();
    for root in pids {
        for pid in descendants(num(root), &table) {
            let read = |what: &str| {
                std::fs::read_to_string(format!("/proc/{pid}/{what}"))
                    .unwrap_or_else(|e| fail(format!("/proc/{pid}/{what}: {e}")))
            };
            let cost = process_cost(&read("smaps"), &read("status"), share_dir)
                .unwrap_or_else(|e| fail(format!("pid {pid}: {e}")));
            total.add(&cost);
        }
    }
    println!("{}", total.line());
}
