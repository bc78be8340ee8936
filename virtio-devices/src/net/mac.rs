//! MAC addresses as the config gives them (`12:34:56:78:9a:bc`), and the
//! random locally administered one a device gets without.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a MAC address (six hex bytes separated by ':', e.g. 52:54:00:12:34:56)")]
pub struct MacError(pub String);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MacAddr(pub [u8; 6]);

impl MacAddr {
    /// A random unicast address with the locally administered bit set, as
    /// Cloud Hypervisor gives a device configured without `mac=`.
    pub fn random_local() -> Self {
        let mut b = [0u8; 6];
        // getrandom cannot fail for 6 bytes once the pool is ready; zeros
        // (still made local below) are a usable fallback.
        // SAFETY: writes at most 6 bytes into b.
        let _ = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
        b[0] = (b[0] & !0x01) | 0x02;
        MacAddr(b)
    }

    /// Multicast addresses cannot be a device's own.
    pub fn is_unicast(&self) -> bool {
        self.0[0] & 1 == 0
    }
}

impl FromStr for MacAddr {
    type Err = MacError;

    fn from_str(s: &str) -> Result<Self, MacError> {
        let mut b = [0u8; 6];
        let mut parts = s.split(':');
        for byte in &mut b {
            let p = parts.next().filter(|p| p.len() == 2);
            *byte = p
                .and_then(|p| u8::from_str_radix(p, 16).ok())
                .ok_or_else(|| MacError(s.into()))?;
        }
        if parts.next().is_some() {
            return Err(MacError(s.into()));
        }
        Ok(MacAddr(b))
    }
}

impl fmt::Display for MacAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            b[0], b[1], b[2], b[3], b[4], b[5]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_prints_and_makes_local_unicast_addresses() {
        let m: MacAddr = "52:54:00:AB:cd:0f".parse().unwrap();
        assert_eq!(m.0, [0x52, 0x54, 0, 0xab, 0xcd, 0x0f]);
        assert_eq!(m.to_string(), "52:54:00:ab:cd:0f");
        for bad in [
            "",
            "52:54:00:ab:cd",
            "52:54:00:ab:cd:0f:11",
            "5:54:00:ab:cd:0f",
            "zz:54:00:ab:cd:0f",
        ] {
            assert!(bad.parse::<MacAddr>().is_err(), "{bad}");
        }
        for _ in 0..16 {
            let r = MacAddr::random_local();
            assert!(r.is_unicast() && r.0[0] & 2 == 2, "{r}");
        }
        assert!(!"01:00:5e:00:00:01".parse::<MacAddr>().unwrap().is_unicast());
    }
}
