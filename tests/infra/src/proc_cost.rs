//! What a VMM or file-system daemon process costs the host beyond the
//! guest's RAM and the share's page cache, from `/proc/PID/smaps` and
//! `/proc/PID/status` (read in the emulated host by `daxprobe proc-cost`,
//! parsed back by the benchmarks).
//!
//! Every mapping of `smaps` falls in one of three classes, by its path:
//! - **guest RAM**: a memfd the VMM created for the guest's memory
//!   ([`GUEST_RAM_MEMFDS`]: ours, `guest-ram`, and Cloud Hypervisor's,
//!   `ch_ram`), mapped by the VMM and, through vhost-user, by the daemon;
//! - **share**: a file under the shared directory, or any other file
//!   mapped shared (`s` in its permissions) that is not a memfd, a device
//!   or an anonymous inode: the DAX window's file pages (the host's one
//!   copy of the share's page cache, mapped into the VMM for the guest).
//!   The second rule is needed because a daemon sandboxed in its own mount
//!   namespace hands over files whose path, seen from the host, no longer
//!   starts with the shared directory; neither VMM maps any other regular
//!   file shared;
//! - **own**: everything else — heap, thread stacks, the binary's pages,
//!   other memfds (e.g. the DAX window's scratch page), `[vdso]` and the
//!   like. This is the process's own cost.
//!
//! Each class sums `Rss`, `Pss` and `Anonymous` over its mappings. `Pss`
//! divides a page among all the mappings that hold it, so a page mapped
//! many times (the scratch page behind every empty window range) or by
//! several processes (the binary's text shared by ten VMMs) counts once
//! in all; `Rss` counts it for every mapping.

use std::collections::BTreeMap;

/// Names of the memfds that hold guest RAM (`memfd_create`'s name; smaps
/// shows `/memfd:NAME (deleted)`): ours and Cloud Hypervisor's.
pub const GUEST_RAM_MEMFDS: [&str; 2] = ["guest-ram", "ch_ram"];

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ProcCostError {
    #[error("smaps line {line}: {what}")]
    Smaps { line: usize, what: String },
    #[error("status has no Threads: line")]
    NoThreads,
    #[error("proc-cost line: field {0} missing or not a number")]
    Field(&'static str),
}

/// Which of the three classes a mapping is in (see the module note).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum MappingClass {
    GuestRam,
    Share,
    Own,
}

/// Sums over mappings, KiB.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MemSums {
    pub rss: u64,
    pub pss: u64,
    pub anon: u64,
}

impl MemSums {
    fn add(&mut self, o: &MemSums) {
        self.rss += o.rss;
        self.pss += o.pss;
        self.anon += o.anon;
    }
}

/// One process (or several, summed): its memory by class and its threads.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ProcCost {
    pub procs: u32,
    pub threads: u32,
    pub own: MemSums,
    pub guest_ram: MemSums,
    pub share: MemSums,
}

impl ProcCost {
    pub fn add(&mut self, o: &ProcCost) {
        self.procs += o.procs;
        self.threads += o.threads;
        self.own.add(&o.own);
        self.guest_ram.add(&o.guest_ram);
        self.share.add(&o.share);
    }

    /// The one line `daxprobe proc-cost` prints, `k=v` words (KiB).
    pub fn line(&self) -> String {
        format!(
            "procs={} threads={} own_rss_kib={} own_pss_kib={} own_anon_kib={} \
             ram_rss_kib={} ram_pss_kib={} share_rss_kib={} share_pss_kib={}",
            self.procs,
            self.threads,
            self.own.rss,
            self.own.pss,
            self.own.anon,
            self.guest_ram.rss,
            self.guest_ram.pss,
            self.share.rss,
            self.share.pss,
        )
    }

    /// Reads back what [`ProcCost::line`] wrote (words in any order,
    /// others ignored).
    pub fn parse_line(line: &str) -> Result<ProcCost, ProcCostError> {
        let words: BTreeMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect();
        let get = |k: &'static str| -> Result<u64, ProcCostError> {
            words
                .get(k)
                .and_then(|v| v.parse().ok())
                .ok_or(ProcCostError::Field(k))
        };
        let u32_of = |k: &'static str| -> Result<u32, ProcCostError> {
            u32::try_from(get(k)?).map_err(|_| ProcCostError::Field(k))
        };
        Ok(ProcCost {
            procs: u32_of("procs")?,
            threads: u32_of("threads")?,
            own: MemSums {
                rss: get("own_rss_kib")?,
                pss: get("own_pss_kib")?,
                anon: get("own_anon_kib")?,
            },
            guest_ram: MemSums {
                rss: get("ram_rss_kib")?,
                pss: get("ram_pss_kib")?,
                anon: 0,
            },
            share: MemSums {
                rss: get("share_rss_kib")?,
                pss: get("share_pss_kib")?,
                anon: 0,
            },
        })
    }
}

/// The class of a mapping from the permissions and path on its smaps
/// header line (no path: an anonymous mapping). `share_dir` is the shared
/// directory as the kernel prints it (absolute).
pub fn classify(perms: &str, path: Option<&str>, share_dir: &str) -> MappingClass {
    let Some(path) = path else {
        return MappingClass::Own;
    };
    if let Some(name) = path.strip_prefix("/memfd:") {
        let name = name.strip_suffix(" (deleted)").unwrap_or(name);
        if GUEST_RAM_MEMFDS.contains(&name) {
            return MappingClass::GuestRam;
        }
        return MappingClass::Own;
    }
    let share_dir = share_dir.trim_end_matches('/');
    match path.strip_prefix(share_dir) {
        Some(rest) if !share_dir.is_empty() && rest.starts_with('/') => MappingClass::Share,
        _ if perms.ends_with('s') && path.starts_with('/') && !path.starts_with("/dev/") => {
            MappingClass::Share
        }
        _ => MappingClass::Own,
    }
}

/// A header line of smaps (`START-END PERMS OFFSET DEV INODE [PATH]`): its
/// permissions and path, if any (it may hold spaces); None when the line is
/// not a header.
fn header(line: &str) -> Option<(&str, Option<&str>)> {
    let mut rest = line;
    let mut fields = 0;
    let mut perms = "";
    // Five fields, each followed by spaces; the rest is the path.
    while fields < 5 {
        let end = rest.find(' ').unwrap_or(rest.len());
        let field = &rest[..end];
        if field.is_empty() {
            return None;
        }
        if fields == 0 {
            let (a, b) = field.split_once('-')?;
            if !a.bytes().chain(b.bytes()).all(|c| c.is_ascii_hexdigit()) {
                return None;
            }
        }
        if fields == 1 {
            perms = field;
        }
        fields += 1;
        rest = rest[end..].trim_start_matches(' ');
        if rest.is_empty() {
            return (fields == 5).then_some((perms, None));
        }
    }
    Some((perms, Some(rest)))
}

/// Sums one process's smaps by class: (own, guest RAM, share).
pub fn smaps_cost(smaps: &str, share_dir: &str) -> Result<[MemSums; 3], ProcCostError> {
    let mut sums = [MemSums::default(); 3];
    let mut class: Option<MappingClass> = None;
    for (n, line) in smaps.lines().enumerate() {
        if let Some((perms, path)) = header(line) {
            class = Some(classify(perms, path, share_dir));
            continue;
        }
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let field = match key {
            "Rss" => 0,
            "Pss" => 1,
            "Anonymous" => 2,
            _ => continue,
        };
        let Some(class) = class else {
            return Err(ProcCostError::Smaps {
                line: n + 1,
                what: format!("{key} before any mapping's header"),
            });
        };
        let kib = value
            .trim()
            .strip_suffix("kB")
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| ProcCostError::Smaps {
                line: n + 1,
                what: format!("{key} is not `N kB`: {value:?}"),
            })?;
        let slot = &mut sums[match class {
            MappingClass::Own => 0,
            MappingClass::GuestRam => 1,
            MappingClass::Share => 2,
        }];
        match field {
            0 => slot.rss += kib,
            1 => slot.pss += kib,
            _ => slot.anon += kib,
        }
    }
    Ok(sums)
}

/// `Threads:` of /proc/PID/status.
pub fn status_threads(status: &str) -> Result<u32, ProcCostError> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or(ProcCostError::NoThreads)
}

/// One process's cost from its smaps and status.
pub fn process_cost(smaps: &str, status: &str, share_dir: &str) -> Result<ProcCost, ProcCostError> {
    let [own, guest_ram, share] = smaps_cost(smaps, share_dir)?;
    Ok(ProcCost {
        procs: 1,
        threads: status_threads(status)?,
        own,
        guest_ram,
        share,
    })
}

/// The pids among `(pid, parent)` pairs that descend from `root`, root
/// first (a daemon is a parent that waits and a sandboxed child that serves).
pub fn descendants(root: u32, procs: &[(u32, u32)]) -> Vec<u32> {
    let mut out = vec![root];
    let mut i = 0;
    while i < out.len() {
        let parent = out[i];
        for &(pid, ppid) in procs {
            if ppid == parent && !out.contains(&pid) {
                out.push(pid);
            }
        }
        i += 1;
    }
    out
}

/// The parent pid from /proc/PID/stat (`PID (COMM) STATE PPID …`; COMM
/// may hold spaces and parentheses, so the last `)` ends it).
pub fn stat_parent(stat: &str) -> Option<u32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

#[cfg(test)]
#[path = "proc_cost_tests.rs"]
mod tests;
