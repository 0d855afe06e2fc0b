//! A stable, dependency-free digest.
//!
//! Workers compare digests to agree on a topology or an op's spec, so the
//! function must give the same value on every machine and every build: no
//! `std::hash` (its algorithm may change between Rust releases), no random
//! keys. FNV-1a is enough here: digests guard against mistakes, not against
//! an adversary, and every mismatch they miss is still caught by the frame
//! length checks of the collectives.

/// FNV-1a, 64 bit, over `bytes`, continuing from `state`
/// (start with [`Digest::EMPTY`]'s value).
pub fn fnv1a64(state: u64, bytes: &[u8]) -> u64 {
    let mut h = state;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A 64-bit digest built incrementally from typed fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub u64);

impl Digest {
    /// The digest of nothing (the FNV-1a offset basis).
    pub const EMPTY: Digest = Digest(0xcbf2_9ce4_8422_2325);

    /// Feeds raw bytes.
    #[must_use]
    pub fn bytes(self, b: &[u8]) -> Digest {
        Digest(fnv1a64(self.0, b))
    }

    /// Feeds a `u64` (little-endian, so the result is the same on every host).
    #[must_use]
    pub fn u64(self, v: u64) -> Digest {
        self.bytes(&v.to_le_bytes())
    }

    /// Feeds a length-prefixed string.
    #[must_use]
    pub fn str(self, s: &str) -> Digest {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }

    /// The 32-bit form carried in frame headers (the two halves folded).
    pub fn short(self) -> u32 {
        // Truncation is the point: fold the high half into the low half.
        (self.0 ^ (self.0 >> 32)) as u32
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_vectors() {
        // Published FNV-1a 64 test vectors.
        assert_eq!(Digest::EMPTY.bytes(b"").0, 0xcbf2_9ce4_8422_2325);
        assert_eq!(Digest::EMPTY.bytes(b"a").0, 0xaf63_dc4c_8601_ec8c);
        assert_eq!(Digest::EMPTY.bytes(b"foobar").0, 0x8594_4171_f739_67e8);
    }

    #[test]
    fn str_is_length_prefixed() {
        let a = Digest::EMPTY.str("ab").str("c");
        let b = Digest::EMPTY.str("a").str("bc");
        assert_ne!(a, b);
    }
}
