//! What the benchmarks read from fio's output.

/// What one fio job (or group of jobs) did: bandwidth (KiB/s) and IOPS of
/// its direction.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FioResult {
    pub kib_per_s: f64,
    pub iops: f64,
}

/// fio's `--minimal` line (terse format 3): the read side's bandwidth and
/// IOPS are fields 7 and 8, the write side's 48 and 49 (1-based). None
/// when the job failed (see [`terse_error`]).
pub fn parse_fio_terse(line: &str, write: bool) -> Option<FioResult> {
    let fields: Vec<&str> = line.trim().split(';').collect();
    if fields.first() != Some(&"3") || terse_error(line) != Some(0) {
        return None;
    }
    let (bw, iops) = if write { (47, 48) } else { (6, 7) };
    Some(FioResult {
        kib_per_s: fields.get(bw)?.parse().ok()?,
        iops: fields.get(iops)?.parse().ok()?,
    })
}

/// The error number of a terse line (field 5): 0 when the job ran, an
/// errno when it failed (e.g. 19, ENODEV, for an mmap the file system
/// refused), whose line has zeroes for figures.
pub fn terse_error(line: &str) -> Option<i32> {
    let fields: Vec<&str> = line.trim().split(';').collect();
    if fields.first() != Some(&"3") {
        return None;
    }
    fields.get(4)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines printed by fio 3.33 `--minimal` for a read and a write job.
    #[test]
    fn fio_terse_lines_give_the_side_the_job_ran() {
        let mut read = vec!["0"; 130];
        read[0] = "3";
        read[6] = "58514";
        read[7] = "14628";
        let read = read.join(";");
        assert_eq!(
            parse_fio_terse(&read, false),
            Some(FioResult {
                kib_per_s: 58514.0,
                iops: 14628.0
            })
        );
        let mut write = vec!["0"; 130];
        write[0] = "3";
        write[47] = "1638400";
        write[48] = "1600";
        let write = write.join(";");
        assert_eq!(parse_fio_terse(&write, true).map(|r| r.iops), Some(1600.0));
        assert_eq!(parse_fio_terse(&write, false).map(|r| r.iops), Some(0.0));
        assert_eq!(parse_fio_terse("fio: error opening /dev/vda", false), None);
        assert_eq!(parse_fio_terse("3;fio-3.33;x", false), None);
        assert_eq!(terse_error(&read), Some(0));
    }

    /// fio 3.33's line for an mmap job the file system refused (ENODEV).
    #[test]
    fn a_failed_jobs_terse_line_is_no_result_but_names_its_error() {
        let mut failed = vec!["0"; 130];
        failed[0] = "3";
        failed[4] = "19";
        let failed = failed.join(";");
        assert_eq!(parse_fio_terse(&failed, false), None);
        assert_eq!(terse_error(&failed), Some(19));
        assert_eq!(terse_error("fio: pid=1, err=19"), None);
    }
}
