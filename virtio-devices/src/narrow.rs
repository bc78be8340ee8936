//! Narrowing the constants of virtio-bindings and libc (`u32`, `c_int`) to
//! the width of the field that carries them: `const { narrow::to_u16(X) }`
//! fails the build, not the run, for a constant that does not fit.

/// `v` as a `u8`; it must fit.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the assert above the cast refuses what does not fit"
)]
pub(crate) const fn to_u8(v: u32) -> u8 {
    assert!(v <= u8::MAX as u32);
    v as u8
}

/// `v` as a `u16`; it must fit.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the assert above the cast refuses what does not fit"
)]
pub(crate) const fn to_u16(v: u32) -> u16 {
    assert!(v <= u16::MAX as u32);
    v as u16
}

/// `v` as a `c_short` (flock and ifreq fields); it must fit.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the assert above the cast refuses what does not fit"
)]
pub(crate) const fn to_c_short(v: libc::c_int) -> libc::c_short {
    assert!(v >= libc::c_short::MIN as libc::c_int && v <= libc::c_short::MAX as libc::c_int);
    v as libc::c_short
}

/// `v` as a `sa_family_t` (`AF_UNIX`, `AF_INET`); it must fit.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "the assert above the cast refuses what does not fit"
)]
pub(crate) const fn to_sa_family(v: libc::c_int) -> libc::sa_family_t {
    assert!(v >= 0 && v <= libc::sa_family_t::MAX as libc::c_int);
    v as libc::sa_family_t
}

/// `v` as a `u32`; it must fit.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the assert above the cast refuses what does not fit"
)]
pub(crate) const fn to_u32(v: u64) -> u32 {
    assert!(v <= u32::MAX as u64);
    v as u32
}

/// `v` as a `usize`: lossless, since this crate builds only where `usize`
/// is 64 bits wide (the VMM is x86-64); for sizes and offsets of host
/// memory held as `u64`.
#[cfg(target_pointer_width = "64")]
#[expect(
    clippy::cast_possible_truncation,
    reason = "usize is 64 bits wide on every target this builds for (cfg above)"
)]
pub(crate) const fn usize_from(v: u64) -> usize {
    v as usize
}

/// The low 32 bits of `v`: a 64-bit value split into the two 32-bit
/// registers (features, addresses, lengths) the transports expose, or a
/// 4-byte register write held as `u64`.
pub(crate) const fn lo32(v: u64) -> u32 {
    (v & 0xffff_ffff) as u32
}

/// The low 16 bits of `v`: a 2-byte register write held in a wider value.
pub(crate) const fn lo16(v: u64) -> u16 {
    (v & 0xffff) as u16
}

/// A count, index or length that fits a `u32` by construction (a length
/// within a descriptor chain, whose lengths are `u32`; a queue index);
/// saturates rather than wraps if it ever did not.
pub(crate) fn sat_u32<T: TryInto<u32>>(v: T) -> u32 {
    v.try_into().unwrap_or(u32::MAX)
}

/// As [`sat_u32`], for a queue index or count (queues number at most
/// `u16::MAX`).
pub(crate) fn sat_u16<T: TryInto<u16>>(v: T) -> u16 {
    v.try_into().unwrap_or(u16::MAX)
}
