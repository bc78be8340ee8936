//! What the daemon (dax-virtiofsd) and the VMM (dax-vmm) must agree on
//! about the DAX window, kept once so that a change reaches both sides.
//! Most of it is a fact of Linux's virtio-fs driver (`fs/fuse/dax.c`) or of
//! the vhost-user protocol that both sides obey; the rest is what the two
//! processes show side by side (the latency histograms).
//!
//! | fact | the daemon | the VMM |
//! |---|---|---|
//! | [`DAX_SHM_REGION_ID`] | names the window in SHMEM_MAP/UNMAP | refuses any other region |
//! | [`GUEST_RANGE_SIZE`] | counts the window's occupancy by range (adaptive policy) | counts mapped ranges for the API |
//! | [`MIN_WINDOW_SIZE`], [`MAX_WINDOW_SIZE`], [`window_size_fits`] | announces the policy's `cache_size` (GET_SHMEM_CONFIG) | takes `cache_size`, or the announced size, and reserves it |
//! | [`protocol_features`] | offers them | asks for them, refuses a DAX device without them |
//! | [`MAP_LATENCY_BUCKETS_US`] | SETUPMAPPING round trips | SHMEM_MAP handling |
//! | [`GUEST_RECLAIM_OCCUPANCY_PCT`] | tells the guest's reclaim from files going away | (its pre-fault uses its own, lower mark: see `vhost_user_fs/window/reclaim.rs`) |
//!
//! This crate depends on no crate of the workspace: `policies`, the daemon,
//! `virtio-devices`, the VMM and its API all use it.

use vhost::vhost_user::message::VhostUserProtocolFeatures;

/// Shared memory region id of the DAX window (`VIRTIO_FS_SHMCAP_ID_CACHE`
/// in Linux's `include/uapi/linux/virtio_fs.h`): the guest finds the window
/// by it (virtio-PCI capability or virtio-MMIO `SHM_SEL`), the daemon
/// puts it in every SHMEM_MAP/UNMAP and its GET_SHMEM_CONFIG answer, and
/// the VMM refuses a request naming another region.
pub const DAX_SHM_REGION_ID: u8 = 0;

/// Linux maps its DAX window in ranges of `1 << GUEST_RANGE_SHIFT` bytes
/// (`FUSE_DAX_SHIFT`): every SETUPMAPPING covers one such range.
pub const GUEST_RANGE_SHIFT: u32 = 21;

/// The size of the guest's DAX ranges (`FUSE_DAX_SZ`, 2 MiB). The daemon's
/// adaptive policy counts the window by range; the VMM counts mapped ranges
/// and aligns small windows to it; a window is a whole number of ranges
/// (Linux leaves a partial tail unused); and the mapping alignment the
/// daemon announces at FUSE_INIT may not exceed it (Linux turns DAX off for
/// a larger `map_alignment`).
pub const GUEST_RANGE_SIZE: u64 = 1 << GUEST_RANGE_SHIFT;

/// Smallest window: one range, or the guest has nothing to map.
pub const MIN_WINDOW_SIZE: u64 = GUEST_RANGE_SIZE;

/// Largest window a device may have, whoever sizes it (the VMM's
/// `cache_size`, the policy's `cache_size` the daemon announces in
/// GET_SHMEM_CONFIG): the VMM reserves address space and a KVM memory slot
/// for all of it and places it in a 64-bit PCI window (512 GiB) or the
/// virtio-MMIO device area (512 GiB). The policy refuses more than this so
/// that a policy the daemon accepts never names a window the VMM refuses.
pub const MAX_WINDOW_SIZE: u64 = 256 << 30;

/// Whether `size` is a window both sides accept: a whole number of ranges
/// from [`MIN_WINDOW_SIZE`] to [`MAX_WINDOW_SIZE`]. The policy's and the
/// VMM's `cache_size` are checked with it.
pub fn window_size_fits(size: u64) -> bool {
    (MIN_WINDOW_SIZE..=MAX_WINDOW_SIZE).contains(&size) && size.is_multiple_of(GUEST_RANGE_SIZE)
}

/// `bytes` as the command line and the policy write sizes: in the largest
/// of K, M, G, T that divides it (`2M`, `256G`), for messages that state a
/// limit.
pub fn size_text(bytes: u64) -> String {
    for (shift, unit) in [(40, 'T'), (30, 'G'), (20, 'M'), (10, 'K')] {
        if bytes != 0 && bytes.trailing_zeros() >= shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// vhost-user protocol features of every fs device: several request queues
/// (`MQ`), acks the VMM waits for (`REPLY_ACK`), and guest memory added and
/// removed one region at a time (`CONFIGURE_MEM_SLOTS`, for memory
/// hot-plug; the VMM falls back to SET_MEM_TABLE without it). The daemon
/// offers these; the VMM asks for them.
pub const FS_PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::MQ
    .union(VhostUserProtocolFeatures::REPLY_ACK)
    .union(VhostUserProtocolFeatures::CONFIGURE_MEM_SLOTS);

/// What DAX adds: the backend request channel (`BACKEND_REQ`) on which the
/// daemon sends SHMEM_MAP/UNMAP (`SHMEM`, bit 22 of the vhost-user spec)
/// with the file's descriptor (`BACKEND_SEND_FD`). A daemon without all
/// three cannot map anything, so the VMM refuses it for `dax=on`.
pub const DAX_PROTOCOL_FEATURES: VhostUserProtocolFeatures = VhostUserProtocolFeatures::BACKEND_REQ
    .union(VhostUserProtocolFeatures::BACKEND_SEND_FD)
    .union(VhostUserProtocolFeatures::SHMEM);

/// The protocol features of an fs device with or without a DAX window: what
/// the daemon offers and the VMM asks for.
pub fn protocol_features(dax: bool) -> VhostUserProtocolFeatures {
    if dax {
        FS_PROTOCOL_FEATURES | DAX_PROTOCOL_FEATURES
    } else {
        FS_PROTOCOL_FEATURES
    }
}

/// Upper bounds (µs) of the map-latency histograms, ascending; a last
/// bucket (+Inf) follows. The daemon times SETUPMAPPING's round trip
/// (request sent, VMM maps, ack back), the VMM its own part of it (checks,
/// mmap, pre-fault); with the same buckets the two Prometheus histograms
/// (`daxvmm_fs_map_roundtrip_seconds`, `daxvmm_dax_map_latency_seconds`)
/// can be read side by side, bucket for bucket. Roughly three per decade
/// from 10 µs to 100 ms; anything slower lands in +Inf.
pub const MAP_LATENCY_BUCKETS_US: [u64; 10] =
    [10, 25, 50, 100, 250, 500, 1_000, 2_500, 10_000, 100_000];

/// Linux's background reclaim of DAX ranges runs when fewer than this
/// percentage of the window's ranges are free (`FUSE_DAX_RECLAIM_THRESHOLD`),
/// and frees a few least recently used ranges per pass, one REMOVEMAPPING
/// each.
pub const GUEST_RECLAIM_FREE_PCT: u64 = 20;

/// The same mark as occupancy: with this percentage of ranges mapped or
/// more, the guest's unmaps are its reclaim, not files going away. The
/// daemon's adaptive policy counts an unmap as reclaim from here (or from
/// its lower `pressure_high`); the policy's default `pressure_high` (75)
/// sits below it so that pressure is seen before the guest reclaims.
pub const GUEST_RECLAIM_OCCUPANCY_PCT: u64 = 100 - GUEST_RECLAIM_FREE_PCT;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_region_and_range_are_linux_s() {
        // include/uapi/linux/virtio_fs.h: VIRTIO_FS_SHMCAP_ID_CACHE 0.
        assert_eq!(DAX_SHM_REGION_ID, 0);
        // fs/fuse/dax.c: FUSE_DAX_SHIFT 21, FUSE_DAX_SZ (1 << FUSE_DAX_SHIFT).
        assert_eq!(GUEST_RANGE_SIZE, 2 * 1024 * 1024);
        assert_eq!(GUEST_RANGE_SIZE, 1 << GUEST_RANGE_SHIFT);
    }

    #[test]
    fn a_window_is_whole_ranges_between_the_limits() {
        assert!(window_size_fits(MIN_WINDOW_SIZE));
        assert!(window_size_fits(MAX_WINDOW_SIZE));
        assert!(window_size_fits(64 * GUEST_RANGE_SIZE));
        assert!(!window_size_fits(0));
        assert!(!window_size_fits(MAX_WINDOW_SIZE + GUEST_RANGE_SIZE));
        assert!(
            !window_size_fits(GUEST_RANGE_SIZE + 4096),
            "a partial range"
        );
        assert!(!window_size_fits(GUEST_RANGE_SIZE / 2));
        // The VMM reserves it in its own address space (its guest-physical
        // room is checked by the VMM's config tests).
        assert!(usize::try_from(MAX_WINDOW_SIZE).is_ok());
    }

    #[test]
    fn sizes_read_as_the_command_line_writes_them() {
        assert_eq!(size_text(MIN_WINDOW_SIZE), "2M");
        assert_eq!(size_text(MAX_WINDOW_SIZE), "256G");
        assert_eq!(size_text(3 << 20), "3M");
        assert_eq!(size_text(4096), "4K");
        assert_eq!(size_text(1 << 40), "1T");
        assert_eq!(size_text(1000), "1000");
        assert_eq!(size_text(0), "0");
    }

    #[test]
    fn dax_adds_the_shmem_channel_to_the_fs_features() {
        let (plain, dax) = (protocol_features(false), protocol_features(true));
        assert_eq!(plain, FS_PROTOCOL_FEATURES);
        assert!(!plain.intersects(DAX_PROTOCOL_FEATURES));
        assert!(dax.contains(FS_PROTOCOL_FEATURES | DAX_PROTOCOL_FEATURES));
        // The vhost-user spec puts SHMEM at bit 22; a vhost release that
        // numbered it otherwise would disagree with other implementations.
        assert_ne!(dax.bits() & 1 << 22, 0);
        assert!(dax.contains(VhostUserProtocolFeatures::BACKEND_SEND_FD));
    }

    #[test]
    fn latency_buckets_ascend() {
        // Both histograms find a sample's bucket as the first bound at or
        // above it, which needs the bounds in order.
        assert!(MAP_LATENCY_BUCKETS_US.windows(2).all(|w| w[0] < w[1]));
        assert!(MAP_LATENCY_BUCKETS_US[0] > 0);
    }

    #[test]
    fn reclaim_starts_under_a_fifth_free() {
        // fs/fuse/dax.c: FUSE_DAX_RECLAIM_THRESHOLD 20 (percent free).
        assert_eq!(GUEST_RECLAIM_FREE_PCT, 20);
        assert_eq!(GUEST_RECLAIM_OCCUPANCY_PCT, 80);
    }
}
