//! The fixed-size, typed frame header every backend carries.
//!
//! ```text
//! offset size field
//!  0     2    magic  "KF" (0x4b 0x46)
//!  2     1    version (1)
//!  3     1    kind   (1 data, 2 abort, 3 heartbeat)
//!  4     2    flags  (0; reserved, must be zero)
//!  6     2    step
//!  8     4    epoch
//! 12     4    spec digest
//! 16     8    op id  (hash of the op's name)
//! 24     4    seq    (how many ops of this name the sender issued before)
//! 28     4    chunk
//! 32     8    payload length in bytes
//! ```
//! All fields little-endian. Decoding checks everything it can before a
//! payload byte is read or allocated.

/// Length of an encoded [`Header`].
pub const HEADER_LEN: usize = 40;
const MAGIC: [u8; 2] = *b"KF";
const VERSION: u8 = 1;

/// Who the peers are: the config server's version of the cluster. Every
/// version gets its own connections (the handshake and the shm ring files
/// carry it), so no frame crosses versions and the frame header does not
/// need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ClusterVersion(pub u64);

impl std::fmt::Display for ClusterVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "version {}", self.0)
    }
}

/// The swap generation inside one cluster version: 0 at connect, one more
/// per strategy swap. Every frame header carries it; frames of an older
/// epoch are refused. A separate counter from [`ClusterVersion`] because
/// the two have different authorities: the version comes from the config
/// server and a joining worker knows it, the swap count is agreed inside a
/// session and a joining worker cannot know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Epoch(pub u32);

impl std::fmt::Display for Epoch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "epoch {}", self.0)
    }
}

/// Where a session is in its life: the cluster version, then the swap epoch
/// inside it. Ordered lexicographically (the field order), so it never goes
/// back: a resize to a newer version at epoch 0 is later than any epoch of
/// the older version. Shown as `v2/e3`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Generation {
    pub version: ClusterVersion,
    pub epoch: Epoch,
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "v{}/e{}", self.version.0, self.epoch.0)
    }
}

/// The 64-bit identity of an op name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpId(pub u64);

impl std::fmt::Display for OpId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A byte range of an op's buffer.
    Data = 1,
    /// The sender failed this op and tells its peers why (the payload is a
    /// small structure defined by the collectives layer).
    Abort = 2,
    /// The sender is alive (sent on idle links, see
    /// [`crate::endpoint::Liveness`]); taken by the matcher, never by an op.
    /// Its tag means nothing; its payload is the sender's beacon
    /// ([`crate::endpoint::Matcher::beacons`]), opaque to the transport.
    Heartbeat = 3,
    /// The sender lost a peer (the payload names it and why, see
    /// [`crate::endpoint::Matcher::hearsay`]); taken by the matcher, never
    /// by an op. Its tag means nothing.
    Lost = 4,
}

/// The identity of one op instance on the wire: the transport matches
/// receives on this; the collective plan matches `chunk` and `step` inside
/// it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct OpTag {
    pub epoch: Epoch,
    pub op: OpId,
    pub seq: u32,
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: FrameKind,
    pub tag: OpTag,
    pub chunk: u32,
    pub step: u16,
    /// A digest of the op's spec (count, dtype, reduction, root, topology):
    /// a receiver whose own spec differs fails the op instead of reducing
    /// garbage.
    pub digest: u32,
    /// Payload length; backends set it from the payload they send.
    pub len: u64,
}

/// Why a header could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    #[error("bad magic {0:02x?} (not a KungFu-rs frame)")]
    Magic([u8; 2]),
    #[error("unsupported frame version {0} (this build speaks {VERSION})")]
    Version(u8),
    #[error("unknown frame kind {0}")]
    Kind(u8),
    #[error("reserved flags set: {0:#06x}")]
    Flags(u16),
    #[error("frame payload of {len} bytes exceeds the limit of {max} bytes")]
    TooLarge { len: u64, max: usize },
}

impl Header {
    /// Encodes into the fixed wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..2].copy_from_slice(&MAGIC);
        b[2] = VERSION;
        b[3] = self.kind as u8;
        // b[4..6]: flags, zero
        b[6..8].copy_from_slice(&self.step.to_le_bytes());
        b[8..12].copy_from_slice(&self.tag.epoch.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.digest.to_le_bytes());
        b[16..24].copy_from_slice(&self.tag.op.0.to_le_bytes());
        b[24..28].copy_from_slice(&self.tag.seq.to_le_bytes());
        b[28..32].copy_from_slice(&self.chunk.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes and validates a header; `max_payload` bounds `len`, so that a
    /// hostile length is refused before anything is allocated for it.
    pub fn decode(b: &[u8; HEADER_LEN], max_payload: usize) -> Result<Header, HeaderError> {
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if b[0..2] != MAGIC {
            return Err(HeaderError::Magic([b[0], b[1]]));
        }
        if b[2] != VERSION {
            return Err(HeaderError::Version(b[2]));
        }
        let kind = match b[3] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            3 => FrameKind::Heartbeat,
            4 => FrameKind::Lost,
            k => return Err(HeaderError::Kind(k)),
        };
        let flags = u16_at(4);
        if flags != 0 {
            return Err(HeaderError::Flags(flags));
        }
        let len = u64_at(32);
        if len > max_payload as u64 {
            return Err(HeaderError::TooLarge {
                len,
                max: max_payload,
            });
        }
        Ok(Header {
            kind,
            tag: OpTag {
                epoch: Epoch(u32_at(8)),
                op: OpId(u64_at(16)),
                seq: u32_at(24),
            },
            chunk: u32_at(28),
            step: u16_at(6),
            digest: u32_at(12),
            len,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            kind: FrameKind::Data,
            tag: OpTag {
                epoch: Epoch(7),
                op: OpId(0x0123_4567_89ab_cdef),
                seq: 42,
            },
            chunk: 0xdead_beef,
            step: 513,
            digest: 0x1234_5678,
            len: 1 << 33,
        }
    }

    #[test]
    fn generations_order_by_version_then_epoch() {
        let g = |v, e| Generation {
            version: ClusterVersion(v),
            epoch: Epoch(e),
        };
        // a resize (new version, epoch back at 0) is later than any swap
        // of the version before it
        assert!(g(1, 3) < g(2, 0));
        assert!(g(1, u32::MAX) < g(2, 0));
        assert!(g(2, 0) < g(2, 1));
        assert_eq!(g(2, 3).max(g(1, 7)), g(2, 3));
        assert_eq!(g(2, 3).to_string(), "v2/e3");
        assert_eq!(ClusterVersion(2).to_string(), "version 2");
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(Header::decode(&h.encode(), usize::MAX), Ok(h));
        let a = Header {
            kind: FrameKind::Abort,
            len: 0,
            ..h
        };
        assert_eq!(Header::decode(&a.encode(), 0), Ok(a));
    }

    #[test]
    fn every_field_is_checked() {
        let good = sample().encode();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&b, usize::MAX),
            Err(HeaderError::Magic(_))
        ));
        let mut b = good;
        b[2] = 9;
        assert_eq!(Header::decode(&b, usize::MAX), Err(HeaderError::Version(9)));
        let mut b = good;
        b[3] = 0;
        assert_eq!(Header::decode(&b, usize::MAX), Err(HeaderError::Kind(0)));
        let mut b = good;
        b[5] = 1;
        assert_eq!(
            Header::decode(&b, usize::MAX),
            Err(HeaderError::Flags(0x100))
        );
        assert_eq!(
            Header::decode(&good, 1 << 20),
            Err(HeaderError::TooLarge {
                len: 1 << 33,
                max: 1 << 20
            })
        );
    }

    mod props {
        use super::*;
        use proptest::prelude::*;
        use proptest::test_runner::RngSeed;

        /// A fixed seed, so CI runs the same cases every time (change it to
        /// explore); no regression files.
        fn config() -> ProptestConfig {
            ProptestConfig {
                cases: 1024,
                rng_seed: RngSeed::Fixed(0x4b46_0001),
                failure_persistence: None,
                ..ProptestConfig::default()
            }
        }

        fn header() -> impl Strategy<Value = Header> {
            (
                prop_oneof![
                    Just(FrameKind::Data),
                    Just(FrameKind::Abort),
                    Just(FrameKind::Heartbeat),
                    Just(FrameKind::Lost)
                ],
                (any::<u32>(), any::<u64>(), any::<u32>()),
                any::<u32>(),
                any::<u16>(),
                any::<u32>(),
                any::<u64>(),
            )
                .prop_map(|(kind, (epoch, op, seq), chunk, step, digest, len)| {
                    Header {
                        kind,
                        tag: OpTag {
                            epoch: Epoch(epoch),
                            op: OpId(op),
                            seq,
                        },
                        chunk,
                        step,
                        digest,
                        len,
                    }
                })
        }

        /// The error the layout table of the module docs prescribes for
        /// `b` (checked in table order), worked out from the table, not by
        /// `decode`.
        fn prescribed(b: &[u8; HEADER_LEN], max: usize) -> Option<HeaderError> {
            let len = u64::from_le_bytes(b[32..40].try_into().unwrap());
            if &b[0..2] != b"KF" {
                Some(HeaderError::Magic([b[0], b[1]]))
            } else if b[2] != 1 {
                Some(HeaderError::Version(b[2]))
            } else if !(1..=4).contains(&b[3]) {
                Some(HeaderError::Kind(b[3]))
            } else if b[4] != 0 || b[5] != 0 {
                Some(HeaderError::Flags(u16::from_le_bytes([b[4], b[5]])))
            } else if len > max as u64 {
                Some(HeaderError::TooLarge { len, max })
            } else {
                None
            }
        }

        /// Checks one decode of `b` against the table: what decodes
        /// re-encodes to the same bytes within the limit, and every refusal
        /// is the prescribed error, whose message names the bad value.
        fn check(b: &[u8; HEADER_LEN], max: usize) -> Result<(), TestCaseError> {
            match Header::decode(b, max) {
                Ok(h) => {
                    prop_assert_eq!(prescribed(b, max), None);
                    prop_assert_eq!(&h.encode(), b);
                    prop_assert!(h.len <= max as u64);
                }
                Err(e) => {
                    prop_assert_eq!(Some(e.clone()), prescribed(b, max));
                    let msg = e.to_string();
                    let names = match &e {
                        HeaderError::Magic(m) => msg.contains(&format!("{m:02x?}")),
                        HeaderError::Version(v) | HeaderError::Kind(v) => {
                            msg.contains(&v.to_string())
                        }
                        HeaderError::Flags(f) => msg.contains(&format!("{f:#06x}")),
                        HeaderError::TooLarge { len, max } => {
                            msg.contains(&len.to_string()) && msg.contains(&max.to_string())
                        }
                    };
                    prop_assert!(names, "{:?} says {:?}", e, msg);
                }
            }
            Ok(())
        }

        proptest! {
            #![proptest_config(config())]

            /// Every header survives the round trip, within the limit; over
            /// it, the length is refused naming both.
            #[test]
            fn round_trip(h in header(), slack in 0u64..1 << 20) {
                let b = h.encode();
                let max = usize::try_from(h.len.saturating_add(slack)).unwrap_or(usize::MAX);
                prop_assert_eq!(Header::decode(&b, max), Ok(h));
                if let Some(below) = h.len.checked_sub(1 + slack) {
                    let below = usize::try_from(below).unwrap();
                    prop_assert_eq!(
                        Header::decode(&b, below),
                        Err(HeaderError::TooLarge { len: h.len, max: below })
                    );
                }
            }

            /// Arbitrary bytes never panic and decode or fail as the table
            /// says.
            #[test]
            fn arbitrary_bytes(b in any::<[u8; HEADER_LEN]>(), max in any::<usize>()) {
                check(&b, max)?;
            }

            /// A good header with a few bytes changed (the cases that pass
            /// the magic and reach the later checks).
            #[test]
            fn mutated_headers(
                h in header(),
                edits in proptest::collection::vec((0..HEADER_LEN, any::<u8>()), 1..4),
                max in prop_oneof![Just(usize::MAX), any::<usize>(), 0usize..4096],
            ) {
                let mut b = h.encode();
                for (i, v) in edits {
                    b[i] = v;
                }
                check(&b, max)?;
            }
        }
    }

    /// A cheap deterministic fuzz: random and mutated headers never panic,
    /// and whatever decodes re-encodes to the same bytes.
    #[test]
    fn random_bytes_never_panic() {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let good = sample().encode();
        for i in 0..200_000 {
            let mut b = [0u8; HEADER_LEN];
            if i % 2 == 0 {
                for byte in b.iter_mut() {
                    *byte = next() as u8;
                }
            } else {
                b = good;
                let pos = (next() % HEADER_LEN as u64) as usize;
                b[pos] = next() as u8;
            }
            if let Ok(h) = Header::decode(&b, usize::MAX) {
                assert_eq!(h.encode(), b);
            }
        }
    }
}
