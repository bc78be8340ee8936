//! Where a cold map's time goes inside the guest: the guest kernel's own
//! function-graph tracer around a pass of cold touches (and the FUSE
//! READs interleaved with it), so the SETUPMAPPING request as the guest
//! sees it (queued, answered) is split from the guest's DAX fault work
//! around it, and from a READ's request, on the guest's clock.
//!
//! Only a few functions are traced (`set_ftrace_filter`), each with its
//! duration, entry to return, sleeping included. The guest sums them with
//! `awk` and prints one line; the host only reads it. The pass runs last,
//! after the timed passes and the CPU passes, so tracing costs none of
//! their figures; its own figures carry the tracer's cost, a few µs per
//! traced call.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use test_infra::rig::Run;

/// The mounts traced: the guest's marker, what the table calls it.
pub const MOUNTS: [(&str, &str, &str); 2] = [
    ("gtrace_nopf", "/daxnopf", "`dax_prefault=off`"),
    ("gtrace_huge", "/daxhuge", "2 MiB host pages"),
];

/// The traced functions (Linux 6.12's names; a missing one is reported
/// by the guest as `gtrace_missing`, and its rows stay empty).
const FUNCTIONS: &str = "__fuse_simple_request fuse_setup_one_mapping fuse_dax_huge_fault \
     __fuse_dax_fault fuse_iomap_begin dax_iomap_fault virtio_fs_enqueue_req request_wait_answer \
     virtio_fs_requests_done_work fuse_request_end fuse_direct_io vmf_insert_pfn_pmd dax_direct_access";

/// Sums the function-graph trace by function, in the context of the
/// request it belongs to: `map:` inside a SETUPMAPPING
/// (`fuse_setup_one_mapping`), `read:` inside a READ (`fuse_direct_io`),
/// `other:` else; a DAX fault is `cold:` when it made a SETUPMAPPING,
/// `warm:` when not. Prints `key:count:mean_us ...` on one line.
const SUM: &str = r#"awk '
function dur(l) { if (match(l, /[0-9]+\.[0-9]+ us/)) return substr(l, RSTART, RLENGTH - 3) + 0; return 0 }
{
  if (match($0, /\/\* [A-Za-z0-9_.]+ \*\//)) { n = substr($0, RSTART + 3, RLENGTH - 6); k = "close" }
  else if (match($0, /[A-Za-z0-9_.]+\(\) \{/)) { n = substr($0, RSTART, RLENGTH - 4); k = "open" }
  else if (match($0, /[A-Za-z0-9_.]+\(\);/)) { n = substr($0, RSTART, RLENGTH - 3); k = "leaf" }
  else next
  if (k == "open") {
    if (n == "fuse_setup_one_mapping") ctx = "map"
    else if (n == "fuse_direct_io") ctx = "read"
    next
  }
  key = (ctx == "" ? "other" : ctx) ":" n
  if (n == "__fuse_dax_fault") { key = (cold ? "cold" : "warm") ":" n; cold = 0 }
  if (n == "fuse_setup_one_mapping") { cold = 1; ctx = "" }
  if (n == "fuse_direct_io") ctx = ""
  c[key]++; s[key] += dur($0)
}
END { for (key in c) printf "%s:%d:%.1f ", key, c[key], s[key] / c[key] }'"#;

/// The guest's side: one traced `daxprobe roundtrip` pass per mount
/// (64 touches, half of them cold, and 32 READs).
pub fn guest_script() -> String {
    let mut s = format!(
        "T=/sys/kernel/tracing\nmount -t tracefs nodev $T 2>/dev/null\n\
         echo 0 > $T/tracing_on; : > $T/set_ftrace_filter\n\
         for f in {FUNCTIONS}; do echo $f >> $T/set_ftrace_filter 2>/dev/null || echo \"@@GUEST gtrace_missing=$f\"; done\n\
         echo function_graph > $T/current_tracer && echo 1 > $T/options/funcgraph-tail && echo 16384 > $T/buffer_size_kb\n"
    );
    for (marker, mount, _) in MOUNTS {
        let _ = write!(
            s,
            "sync; echo 3 > /proc/sys/vm/drop_caches; : > $T/trace; echo 1 > $T/tracing_on\n\
             daxprobe roundtrip {mount}/rt.bin /fuse/rt.bin 1 >/dev/null 2>&1\n\
             echo 0 > $T/tracing_on\n\
             echo \"@@GUEST {marker}=$({SUM} $T/trace) lost=$(cat $T/per_cpu/cpu0/stats | grep -c '^overrun: [1-9]')\"\n"
        );
    }
    s.push_str("echo nop > $T/current_tracer\n");
    s
}

/// One mount's sums: key → (count, mean µs).
fn sums(line: &str) -> BTreeMap<String, (u64, f64)> {
    line.split_whitespace()
        .filter_map(|w| {
            let mut parts = w.rsplitn(3, ':');
            let mean = parts.next()?.parse().ok()?;
            let count = parts.next()?.parse().ok()?;
            Some((parts.next()?.to_string(), (count, mean)))
        })
        .collect()
}

/// Whether the guest's trace buffer dropped events (`lost=` is how many
/// of its CPUs' buffers overran).
fn overran(line: &str) -> bool {
    line.split_whitespace()
        .filter_map(|w| w.strip_prefix("lost="))
        .any(|n| n.parse::<u64>().map_or(true, |n| n > 0))
}

/// The rows: what each is, and its key in [`sums`].
const ROWS: [(&str, &str); 8] = [
    (
        "the guest's fault that made a SETUPMAPPING (the cold touch's fault)",
        "cold:__fuse_dax_fault",
    ),
    ("… its SETUPMAPPING request", "map:__fuse_simple_request"),
    (
        "… … queueing it (`virtio_fs_enqueue_req`)",
        "map:virtio_fs_enqueue_req",
    ),
    ("… … waiting for the answer", "map:request_wait_answer"),
    (
        "the guest's fault in a range mapped before (the warm touch)",
        "warm:__fuse_dax_fault",
    ),
    ("a 4 KiB FUSE READ request", "read:__fuse_simple_request"),
    (
        "… queueing it (`virtio_fs_enqueue_req`)",
        "read:virtio_fs_enqueue_req",
    ),
    ("… waiting for the answer", "read:request_wait_answer"),
];

/// How a derived row's two means make its cell.
type Combine = fn(f64, f64) -> String;

/// The rows derived from two others: what each is, the two keys in
/// [`sums`], and how their means combine.
const DERIVED: [(&str, &str, &str, Combine); 2] = [
    (
        "the cold fault less its request (the guest's DAX work)",
        "cold:__fuse_dax_fault",
        "map:__fuse_simple_request",
        |fault, request| format!("{:.1}", fault - request),
    ),
    (
        "SETUPMAPPING request ÷ READ request",
        "map:__fuse_simple_request",
        "read:__fuse_simple_request",
        |map, read| format!("{:.2}x", map / read),
    ),
];

/// The table: per mount, each row's count and mean, and the two
/// differences the rows leave (the guest's own work in a cold fault
/// beside its request, and a SETUPMAPPING request beside a READ's).
/// None when no mount's line came.
pub fn table(run: &Run) -> Option<String> {
    let mut out = String::from("| DAX mount | guest function | n | mean µs |\n|---|---|---|---|\n");
    let mut any = false;
    for (marker, _, label) in MOUNTS {
        let Some(line) = run.guest(marker) else {
            continue;
        };
        any = true;
        if overran(line) {
            let _ = writeln!(
                out,
                "| {label} | (the trace buffer overran: the figures below miss calls) | - | - |"
            );
        }
        let sums = sums(line);
        let mean = |key: &str| sums.get(key).map(|&(_, m)| m);
        for (what, key) in ROWS {
            let (n, m) = sums.get(key).map_or(("-".into(), "-".into()), |(n, m)| {
                (n.to_string(), format!("{m:.1}"))
            });
            let _ = writeln!(out, "| {label} | {what} | {n} | {m} |");
        }
        for (what, a, b, combine) in DERIVED {
            if let (Some(a), Some(b)) = (mean(a), mean(b)) {
                let _ = writeln!(out, "| {label} | {what} | - | {} |", combine(a, b));
            }
        }
    }
    any.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_read_key_count_and_mean_and_skip_the_rest() {
        let s =
            sums("map:__fuse_simple_request:32:2280.7 cold:__fuse_dax_fault:32:2500.0 lost=0 junk");
        assert_eq!(s.get("map:__fuse_simple_request"), Some(&(32, 2280.7)));
        assert_eq!(s.get("cold:__fuse_dax_fault"), Some(&(32, 2500.0)));
        assert_eq!(s.len(), 2);
        assert!(!overran("map:x:1:2.0 lost=0"));
        assert!(overran("map:x:1:2.0 lost=1"));
        assert!(
            overran("map:x:1:2.0 lost="),
            "an unreadable count is not trusted"
        );
    }

    #[test]
    fn every_row_key_is_a_traced_function() {
        let derived = DERIVED.iter().flat_map(|&(_, a, b, _)| [a, b]);
        for key in ROWS.iter().map(|&(_, key)| key).chain(derived) {
            let f = key.split_once(':').unwrap().1;
            assert!(FUNCTIONS.split_whitespace().any(|g| g == f), "{f}");
        }
    }
}
