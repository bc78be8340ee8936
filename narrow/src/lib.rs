//! Checked narrowing of integers, the one place the workspace's cast lints
//! (`cast_possible_truncation`, `cast_sign_loss`) are answered for values
//! whose width is known by construction.
//!
//! - `*_of`: a constant narrowed to the field that carries it. Evaluated in a
//!   `const` block (`const { narrow::u16_of(X) }`), a constant that outgrows
//!   its field fails the build instead of being cut; at run time it panics.
//! - `low_*`: the low part of a wider value, kept on purpose (a 64-bit
//!   register written as two 32-bit halves, a 2-byte register write held as
//!   `u64`).
//! - `sat_*`: a count or index that fits by construction, saturating rather
//!   than wrapping if it ever did not.

#![no_std]

/// `value` as an 8-bit field (a port count in an ACPI I/O descriptor, a
/// virtio status bit); it must fit.
pub const fn u8_of(value: u64) -> u8 {
    assert!(value <= u8::MAX as u64, "the value does not fit in 8 bits");
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as u8;
    narrowed
}

/// `value` as a 16-bit field (an I/O port, a virtio feature or id); it
/// must fit.
pub const fn u16_of(value: u64) -> u16 {
    assert!(
        value <= u16::MAX as u64,
        "the value does not fit in 16 bits"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as u16;
    narrowed
}

/// `value` as a 32-bit field (an address below 4 GiB, a register offset);
/// it must fit.
pub const fn u32_of(value: u64) -> u32 {
    assert!(
        value <= u32::MAX as u64,
        "the value does not fit in 32 bits"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as u32;
    narrowed
}

/// `value` as a length or address in this process (a size of host memory
/// held as `u64`); it must fit, which it always does where `usize` is 64
/// bits wide, as on every target the VMM builds for.
pub const fn usize_of(value: u64) -> usize {
    assert!(
        value <= usize::MAX as u64,
        "the value does not fit in usize"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as usize;
    narrowed
}

/// `value` as a `c_short` (flock and ifreq fields); it must fit.
pub const fn c_short_of(value: libc::c_int) -> libc::c_short {
    assert!(
        value >= libc::c_short::MIN as libc::c_int && value <= libc::c_short::MAX as libc::c_int,
        "the value does not fit in a c_short"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as libc::c_short;
    narrowed
}

/// `value` as a `sa_family_t` (`AF_UNIX`, `AF_INET`); it must fit.
pub const fn sa_family_of(value: libc::c_int) -> libc::sa_family_t {
    assert!(
        value >= 0 && value <= libc::sa_family_t::MAX as libc::c_int,
        "the value does not fit in a sa_family_t"
    );
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "checked just above"
    )]
    let narrowed = value as libc::sa_family_t;
    narrowed
}

/// The low 32 bits of `value`: the low half of a 64-bit value the
/// transports split into two 32-bit registers, or a 4-byte register write
/// held as `u64`.
pub const fn low_u32(value: u64) -> u32 {
    (value & 0xffff_ffff) as u32
}

/// The low 16 bits of `value`: a 2-byte register write held in a wider
/// value.
pub const fn low_u16(value: u64) -> u16 {
    (value & 0xffff) as u16
}

/// The low 8 bits of `value`: an 8-bit field of a register.
pub const fn low_u8(value: u64) -> u8 {
    (value & 0xff) as u8
}

/// A count, index or length that fits a `u32` by construction (a length
/// within a descriptor chain, whose lengths are `u32`); saturates rather
/// than wraps if it ever did not.
pub fn sat_u32<T: TryInto<u32>>(value: T) -> u32 {
    value.try_into().unwrap_or(u32::MAX)
}

/// As [`sat_u32`], for a queue index or count (queues number at most
/// `u16::MAX`).
pub fn sat_u16<T: TryInto<u16>>(value: T) -> u16 {
    value.try_into().unwrap_or(u16::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_that_fit_pass_through_and_the_low_parts_are_kept() {
        assert_eq!(u32_of(0xfee0_0000), 0xfee0_0000);
        assert_eq!(u16_of(0x3f8), 0x3f8);
        assert_eq!(u8_of(16), 16);
        assert_eq!(usize_of(1 << 40), 1 << 40);
        assert_eq!(c_short_of(-1), -1);
        assert_eq!(sa_family_of(libc::AF_UNIX), 1);
        assert_eq!(low_u32(0x1_2345_6789), 0x2345_6789);
        assert_eq!(low_u16(0x1_2345), 0x2345);
        assert_eq!(low_u8(0xcf9), 0xf9);
        assert_eq!(sat_u32(5usize), 5);
        assert_eq!(sat_u32(u64::MAX), u32::MAX);
        assert_eq!(sat_u16(70_000u32), u16::MAX);
    }

    #[test]
    #[should_panic(expected = "does not fit in 32 bits")]
    fn a_value_that_does_not_fit_is_refused_not_cut() {
        let _ = u32_of(1 << 32);
    }

    #[test]
    #[should_panic(expected = "does not fit in 8 bits")]
    fn a_port_count_over_a_byte_is_refused() {
        let _ = u8_of(256);
    }

    #[test]
    #[should_panic(expected = "does not fit in a sa_family_t")]
    fn a_negative_family_is_refused() {
        let _ = sa_family_of(-1);
    }
}
