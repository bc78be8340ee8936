//! The renderer against fixed snapshots.

use super::*;

fn device(id: &str) -> DeviceMetrics {
    DeviceMetrics {
        id: id.into(),
        up: true,
        window: Some(WindowStats {
            size: 32 << 20,
            ranges_mapped: 2,
            stray_resets: 2,
            unwatched_files: 1,
            watch_refusals: 5,
            resident_bytes: Some(8192),
            stray_bytes: Some(4096),
            counters: WindowCounters {
                bytes_mapped: 4 << 20,
                maps: 3,
                unmaps: 1,
                resets: 0,
                prefaulted_bytes: 3 << 20,
                guest_prefaulted_bytes: 2 << 20,
                prefault_failures: 1,
                truncated_bytes: 3 << 20,
                restored_ranges: 4,
                failures: vec![("misaligned", 1), ("bad_fd", 0)],
                latency_buckets: vec![(Some(10), 1), (Some(100), 3), (None, 3)],
                latency_sum_us: 150,
                map_stages: vec![control_protocol::StageTotal {
                    stage: "mmap".into(),
                    count: 3,
                    sum_us: 90,
                }],
            },
        }),
        daemon: None,
    }
}

/// The text of `devices`, device i with `stats[i]` from its daemon.
fn render_of(
    devices: Vec<DeviceMetrics>,
    stats: Vec<Option<DaemonStats>>,
    faults: PageFaults,
    kvm: Option<KvmCounters>,
) -> String {
    let devices = devices
        .into_iter()
        .zip(stats.into_iter().chain(std::iter::repeat(None)))
        .map(|(d, daemon)| DeviceMetrics { daemon, ..d })
        .collect();
    render(&MetricsSnapshot {
        kvm,
        devices,
        faults,
    })
}

#[test]
fn renders_families_once_with_device_labels() {
    let stats = DaemonStats {
        file_attrs_dax: 5,
        file_attrs_nodax: 7,
        fuse_reads: 2,
        requests: 40,
        handles: 3,
        cap_refusals: [("inodes".to_string(), 4), ("handles".to_string(), 0)].into(),
        map_alignment: 2 << 20,
        map_latency_buckets: vec![(Some(100), 2), (None, 3)],
        map_latency_sum_us: 500,
        adaptive: control_protocol::AdaptiveStats {
            pressure: true,
            reclaims: 9,
            withdrawn: [("thrashing".to_string(), 2)].into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let text = render_of(
        vec![device("fs0"), device("fs\"1")],
        vec![Some(stats), None],
        PageFaults {
            minor: 10,
            major: 1,
        },
        Some(KvmCounters {
            exits: 1000,
            halt_exits: 10,
            page_faults: 600,
            page_faults_fixed: 512,
            pages: vec![("4k", 300), ("2m", 4), ("1g", 0)],
        }),
    );
    assert_eq!(
        text.matches("# TYPE daxvmm_dax_maps_total counter").count(),
        1
    );
    assert!(text.contains("daxvmm_dax_maps_total{device=\"fs0\"} 3\n"));
    assert!(
        text.contains("daxvmm_dax_mapped_ranges{device=\"fs\\\"1\"} 2\n"),
        "label escaped"
    );
    assert!(text.contains("daxvmm_dax_failures_total{device=\"fs0\",reason=\"misaligned\"} 1\n"));
    assert!(
        text.contains("daxvmm_dax_map_latency_seconds_bucket{device=\"fs0\",le=\"0.00001\"} 1\n")
    );
    assert!(text.contains("daxvmm_dax_map_latency_seconds_bucket{device=\"fs0\",le=\"+Inf\"} 3\n"));
    assert!(text.contains("daxvmm_dax_map_latency_seconds_sum{device=\"fs0\"} 0.00015\n"));
    assert!(text
        .contains("daxvmm_dax_map_stage_seconds_total{device=\"fs0\",stage=\"mmap\"} 0.00009\n"));
    assert!(text.contains("daxvmm_dax_map_stages_total{device=\"fs0\",stage=\"mmap\"} 3\n"));
    assert!(text.contains("daxvmm_fs_file_attrs_dax_total{device=\"fs0\"} 5\n"));
    assert!(
        !text.contains("daxvmm_fs_file_attrs_dax_total{device=\"fs\\\"1\"}"),
        "no daemon stats, no sample"
    );
    assert!(text.contains("daxvmm_process_page_faults_total{kind=\"major\"} 1\n"));
    assert!(text.contains("daxvmm_dax_resident_bytes{device=\"fs0\"} 8192\n"));
    assert!(text.contains("daxvmm_dax_stray_bytes{device=\"fs0\"} 4096\n"));
    assert_eq!(
        text.matches("# TYPE daxvmm_dax_stray_bytes gauge").count(),
        1
    );
    assert!(text.contains("daxvmm_fs_cap_refusals_total{device=\"fs0\",cap=\"inodes\"} 4\n"));
    assert!(text.contains("daxvmm_fs_handles{device=\"fs0\"} 3\n"));
    assert!(text.contains("daxvmm_fs_map_alignment_bytes{device=\"fs0\"} 2097152\n"));
    assert!(text.contains("daxvmm_dax_adaptive_pressure{device=\"fs0\"} 1\n"));
    assert!(
        text.contains("daxvmm_fs_map_roundtrip_seconds_bucket{device=\"fs0\",le=\"0.0001\"} 2\n")
    );
    assert!(text.contains("daxvmm_fs_map_roundtrip_seconds_count{device=\"fs0\"} 3\n"));
    assert!(text.contains("daxvmm_dax_adaptive_reclaims_total{device=\"fs0\"} 9\n"));
    assert!(text
        .contains("daxvmm_dax_adaptive_withdrawn_total{device=\"fs0\",reason=\"thrashing\"} 2\n"));
    assert!(text.contains("daxvmm_dax_prefaulted_bytes_total{device=\"fs0\"} 3145728\n"));
    assert!(text.contains("daxvmm_dax_prefault_failures_total{device=\"fs0\"} 1\n"));
    assert!(text.contains("daxvmm_dax_truncated_bytes_total{device=\"fs0\"} 3145728\n"));
    assert!(text.contains("daxvmm_dax_restored_ranges_total{device=\"fs0\"} 4\n"));
    assert!(text.contains("daxvmm_dax_stray_resets_total{device=\"fs0\"} 2\n"));
    assert!(text.contains("daxvmm_dax_unwatched_files{device=\"fs0\"} 1\n"));
    assert!(text.contains("daxvmm_dax_watch_refusals_total{device=\"fs0\"} 5\n"));
    assert!(text.contains("daxvmm_dax_guest_prefaulted_bytes_total{device=\"fs0\"} 2097152\n"));
    assert!(text.contains("# TYPE daxvmm_kvm_exits_total counter\ndaxvmm_kvm_exits_total 1000\n"));
    assert!(text.contains("daxvmm_kvm_page_faults_total 600\n"));
    assert!(text.contains("daxvmm_kvm_mapped_pages{size=\"2m\"} 4\n"));
}

/// The whole text for a fixed snapshot, byte for byte: two devices (one
/// with daemon stats, one without), KVM's counters, page faults. Pinned
/// from the renderer as it was before it became table-driven.
#[test]
fn the_text_for_a_fixed_snapshot_is_pinned() {
    let stats = DaemonStats {
        file_attrs_dax: 5,
        file_attrs_nodax: 7,
        fuse_reads: 2,
        fuse_read_bytes: 8192,
        fuse_writes: 1,
        fuse_write_bytes: 4096,
        requests: 40,
        setupmappings: 6,
        removemappings: 2,
        handles: 3,
        policy_generation: 4,
        cap_refusals: [("inodes".to_string(), 4), ("handles".to_string(), 0)].into(),
        map_alignment: 2 << 20,
        map_latency_buckets: vec![(Some(100), 2), (Some(2500), 3), (None, 3)],
        map_latency_sum_us: 500,
        adaptive: control_protocol::AdaptiveStats {
            pressure: true,
            pressure_episodes: 2,
            reclaims: 9,
            thrashing_files: 1,
            withdrawn: [("thrashing".to_string(), 2)].into(),
            granted: [("reread".to_string(), 1)].into(),
            ..Default::default()
        },
        ..Default::default()
    };
    let mut failed = device("fs\"1");
    failed.up = false;
    let text = render_of(
        vec![device("fs0"), failed],
        vec![Some(stats), None],
        PageFaults {
            minor: 10,
            major: 1,
        },
        Some(KvmCounters {
            exits: 1000,
            halt_exits: 10,
            page_faults: 600,
            page_faults_fixed: 512,
            pages: vec![("4k", 300), ("2m", 4), ("1g", 0)],
        }),
    );
    assert_eq!(text, include_str!("metrics_pinned.prom"));
    let none = render(&MetricsSnapshot::default());
    assert_eq!(none, include_str!("metrics_pinned_empty.prom"));
    // A window with no failure reasons and no latency buckets, a daemon
    // with empty maps and no round-trip histogram: which headers stay.
    let sparse = DeviceMetrics {
        id: "fs0".into(),
        up: true,
        window: Some(WindowStats::default()),
        daemon: None,
    };
    let text = render_of(
        vec![sparse],
        vec![Some(DaemonStats::default())],
        PageFaults::default(),
        None,
    );
    assert_eq!(text, include_str!("metrics_pinned_sparse.prom"));
}

#[test]
fn a_device_before_boot_has_only_its_up_gauge() {
    let d = DeviceMetrics {
        id: "fs0".into(),
        up: true,
        ..Default::default()
    };
    let text = render_of(vec![d], vec![], PageFaults::default(), None);
    assert!(text.contains("daxvmm_fs_up{device=\"fs0\"} 1\n"));
    assert!(!text.contains("daxvmm_kvm_"), "no VM, no KVM counters");
    assert!(!text.contains("daxvmm_dax_maps_total"));
    assert!(!text.contains("daxvmm_dax_map_latency_seconds"));
}
