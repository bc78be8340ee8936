//! Narrowing conversions of constants, checked where the value is known:
//! evaluated in a `const` block (`const { narrow::u32_of(APIC_START) }`), a
//! constant that outgrows its field fails the build instead of being cut.

/// `value` as a 32-bit field (an address below 4 GiB, a size).
pub const fn u32_of(value: u64) -> u32 {
    assert!(
        value <= u32::MAX as u64,
        "the value does not fit in 32 bits"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as u32;
    narrowed
}

/// `value` as a 16-bit field (an I/O port).
pub const fn u16_of(value: u64) -> u16 {
    assert!(
        value <= u16::MAX as u64,
        "the value does not fit in 16 bits"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as u16;
    narrowed
}

/// `value` as an 8-bit field (a port count in an ACPI I/O descriptor).
pub const fn u8_of(value: u64) -> u8 {
    assert!(value <= u8::MAX as u64, "the value does not fit in 8 bits");
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as u8;
    narrowed
}

/// `value` as a length or address in this process.
pub const fn usize_of(value: u64) -> usize {
    assert!(
        value <= usize::MAX as u64,
        "the value does not fit in usize"
    );
    #[expect(clippy::cast_possible_truncation, reason = "checked just above")]
    let narrowed = value as usize;
    narrowed
}

/// The low 32 bits of `value`: the low half of a 64-bit register written
/// as two 32-bit ones, or a field already masked to fit.
pub fn low_u32(value: u64) -> u32 {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "keeping the low half is the point"
    )]
    let low = value as u32;
    low
}

/// The low 8 bits of `value`: an 8-bit field of a register.
pub fn low_u8(value: u64) -> u8 {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "keeping the low byte is the point"
    )]
    let low = value as u8;
    low
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
        assert_eq!(low_u32(0x1_2345_6789), 0x2345_6789);
        assert_eq!(low_u8(0xcf9), 0xf9);
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
}
