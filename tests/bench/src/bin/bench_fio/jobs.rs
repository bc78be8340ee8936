//! The fio jobs of `bench-fio` (the seed's table, the sync rows, the
//! multi-queue rows), the servers they run on, and the seed's figures.

/// The access patterns of the seed's table, as fio's `--rw` names them.
pub(crate) const PATTERNS: [&str; 4] = ["read", "randread", "write", "randwrite"];
/// The engines of the seed's table.
pub(crate) const ENGINES: [&str; 3] = ["psync", "libaio", "mmap"];
/// The seed's multi-job rows: this many jobs, each on its own file.
pub(crate) const MULTI_JOBS: u32 = 4;
/// libaio's queue depth in the seed's table.
pub(crate) const LIBAIO_DEPTH: u32 = 16;

/// What a job's result is compared in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Set {
    /// The seed's table: every server of the main boots.
    Seed,
    /// fsync / msync after each write: every server of the main boots.
    Sync,
    /// Parallel random reads: the multi-queue boot's servers.
    MultiQueue,
}

/// One fio job: its name (a key of the guest's output), what it does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Job {
    pub name: String,
    pub pattern: &'static str,
    pub engine: &'static str,
    pub jobs: u32,
    /// `--fsync=1`: fsync (psync) or msync (mmap) after every write.
    pub sync: bool,
    pub set: Set,
}

impl Job {
    fn new(pattern: &'static str, engine: &'static str, jobs: u32, sync: bool, set: Set) -> Self {
        let sync_word = if sync { "_fsync" } else { "" };
        let set_word = if set == Set::MultiQueue { "mq_" } else { "" };
        Job {
            name: format!("{set_word}{pattern}_{engine}_{jobs}{sync_word}"),
            pattern,
            engine,
            jobs,
            sync,
            set,
        }
    }

    pub fn writes(&self) -> bool {
        self.pattern.contains("write")
    }

    /// fio's arguments besides the file set (directory, size, block size,
    /// run time, output), which every job shares.
    pub fn fio_args(&self) -> String {
        let mut args = format!(
            "--rw={} --ioengine={} --numjobs={}",
            self.pattern, self.engine, self.jobs
        );
        if self.engine == "libaio" {
            // As the seed: asynchronous only with O_DIRECT.
            args.push_str(&format!(" --iodepth={LIBAIO_DEPTH} --direct=1"));
        }
        if self.sync {
            args.push_str(" --fsync=1");
        }
        args
    }

    /// How the tables name it: "psync randread", "libaio seqwrite, 4 jobs",
    /// "psync randwrite + fsync".
    pub fn label(&self) -> String {
        let pattern = match self.pattern {
            "read" => "seqread",
            "write" => "seqwrite",
            p => p,
        };
        let mut label = format!("{} {pattern}", self.engine);
        if self.sync {
            label.push_str(if self.engine == "mmap" {
                " + msync"
            } else {
                " + fsync"
            });
        }
        if self.jobs > 1 {
            label.push_str(&format!(", {} jobs", self.jobs));
        }
        label
    }

    /// The seed's DAX ÷ cache=none for this row, where it states one.
    pub fn seed_ratio(&self) -> &'static str {
        if self.set != Set::Seed || self.jobs != 1 {
            return "—";
        }
        match (self.engine, self.pattern) {
            ("psync", "read") => "18x",
            ("psync", "randread") => "16x",
            ("psync", "write") => "14.5x",
            ("psync", "randwrite") => "14.3x",
            ("libaio", _) => "1.2–1.45x",
            ("mmap", _) => "only with DAX",
            _ => "—",
        }
    }
}

/// Every job, in the order the guest runs them: the seed's single-job
/// rows, its multi-job rows, the sync rows, the multi-queue rows.
pub(crate) fn all_jobs() -> Vec<Job> {
    let mut jobs = Vec::new();
    for n in [1, MULTI_JOBS] {
        for engine in ENGINES {
            for pattern in PATTERNS {
                jobs.push(Job::new(pattern, engine, n, false, Set::Seed));
            }
        }
    }
    for engine in ["psync", "mmap"] {
        jobs.push(Job::new("randwrite", engine, 1, true, Set::Sync));
    }
    for n in [1, 2] {
        jobs.push(Job::new("randread", "psync", n, false, Set::MultiQueue));
    }
    jobs
}

/// A server the jobs run on: its name (the fs tag and the mount point in
/// the guest, a key of the output), what the tables call it, and the host
/// page size of its share (None: the guest's own tmpfs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Server {
    pub name: &'static str,
    pub label: &'static str,
    pub huge: Option<bool>,
}

const fn server(name: &'static str, label: &'static str, huge: Option<bool>) -> Server {
    Server { name, label, huge }
}

/// The servers of the main boots, by the table's columns.
pub(crate) const DAX_4K: Server = server("dax4k", "ours, DAX", Some(false));
pub(crate) const NEVER_4K: Server = server("never4k", "ours, cache=never", Some(false));
pub(crate) const CH_4K: Server = server("ch4k", "CH + virtiofsd, cache=never", Some(false));
pub(crate) const DAX_2M: Server = server("dax2m", "ours, DAX", Some(true));
pub(crate) const NEVER_2M: Server = server("never2m", "ours, cache=never", Some(true));
pub(crate) const CH_2M: Server = server("ch2m", "CH + virtiofsd, cache=never", Some(true));
pub(crate) const TMPFS: Server = server("tmpfs", "guest tmpfs", None);
/// Our VMM's boot: both page sizes, and the guest's tmpfs.
pub(crate) const OURS: [Server; 5] = [DAX_4K, NEVER_4K, DAX_2M, NEVER_2M, TMPFS];
/// Cloud Hypervisor's boot.
pub(crate) const CH: [Server; 2] = [CH_4K, CH_2M];
/// The multi-queue boot (2 vCPUs, no DAX, 4 KiB host pages, our VMM).
pub(crate) const MQ: [Server; 3] = [
    server("mq2", "ours, cache=never, 2 queues", Some(false)),
    server("mq1", "ours, cache=never, 1 queue", Some(false)),
    server("vfsd1", "virtiofsd, cache=never, 1 queue", Some(false)),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_table_has_its_twelve_single_job_rows_and_as_many_multi_job_ones() {
        let jobs = all_jobs();
        let seed: Vec<&Job> = jobs.iter().filter(|j| j.set == Set::Seed).collect();
        assert_eq!(seed.iter().filter(|j| j.jobs == 1).count(), 12);
        assert_eq!(seed.iter().filter(|j| j.jobs == MULTI_JOBS).count(), 12);
        let mut names: Vec<&str> = jobs.iter().map(|j| j.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), jobs.len(), "every job has its own key");
        // Keys of the guest's output: one word of [a-z0-9_].
        assert!(jobs.iter().all(|j| j
            .name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')));
    }

    #[test]
    fn fio_arguments_follow_the_seed() {
        let libaio = Job::new("randread", "libaio", 1, false, Set::Seed);
        assert_eq!(
            libaio.fio_args(),
            "--rw=randread --ioengine=libaio --numjobs=1 --iodepth=16 --direct=1"
        );
        let psync = Job::new("write", "psync", 4, false, Set::Seed);
        assert_eq!(psync.fio_args(), "--rw=write --ioengine=psync --numjobs=4");
        assert_eq!(psync.label(), "psync seqwrite, 4 jobs");
        assert!(psync.writes());
        let msync = Job::new("randwrite", "mmap", 1, true, Set::Sync);
        assert_eq!(
            msync.fio_args(),
            "--rw=randwrite --ioengine=mmap --numjobs=1 --fsync=1"
        );
        assert_eq!(msync.label(), "mmap randwrite + msync");
    }

    #[test]
    fn the_seed_ratio_is_given_only_for_its_single_job_rows() {
        let ratio = |p, e, n| Job::new(p, e, n, false, Set::Seed).seed_ratio();
        assert_eq!(ratio("read", "psync", 1), "18x");
        assert_eq!(ratio("randread", "psync", 1), "16x");
        assert_eq!(ratio("write", "psync", 1), "14.5x");
        assert_eq!(ratio("randwrite", "psync", 1), "14.3x");
        assert_eq!(ratio("randwrite", "libaio", 1), "1.2–1.45x");
        assert_eq!(ratio("read", "mmap", 1), "only with DAX");
        assert_eq!(ratio("read", "psync", 4), "—");
        assert_eq!(
            Job::new("randwrite", "psync", 1, true, Set::Sync).seed_ratio(),
            "—"
        );
    }
}
