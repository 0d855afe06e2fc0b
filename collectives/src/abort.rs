//! The payload of an abort frame: which rank failed an op, because of which
//! rank, and the spec the detector had, so every rank can say precisely
//! what differs.
//!
//! ```text
//! 0  reason u8 (1 spec mismatch, 2 protocol violation, 3 peer lost,
//!    4 timeout; the offender is the disagreeing, violating, lost or
//!    awaited rank)
//! 1  kind u8   2 dtype u8   3 reduce op u8 (0: none)
//! 4  detector u32   8 offender u32   12 root u32 (u32::MAX: none)
//! 16 count u64      24 reserved (8 bytes, zero)
//! ```

use std::sync::Arc;

use bytes::Bytes;
use kungfu_topology::{Rank, Root};
use kungfu_transport::{Epoch, TransportError};

use crate::{CollectiveError, DType, OpKind, OpSpec, ReduceOp};

pub(crate) const ABORT_LEN: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AbortReason {
    Mismatch = 1,
    Protocol = 2,
    PeerLost = 3,
    Timeout = 4,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Abort {
    reason: AbortReason,
    detector: Rank,
    offender: Rank,
    kind: u8,
    dtype: u8,
    op: u8,
    root: u32,
    count: u64,
}

impl Abort {
    pub(crate) fn new(reason: AbortReason, detector: Rank, offender: Rank, spec: &OpSpec) -> Abort {
        Abort {
            reason,
            detector,
            offender,
            kind: spec.kind.code(),
            dtype: spec.dtype as u8,
            op: spec.kind.reduce_op().map_or(0, |o| o as u8),
            root: match spec.kind.root() {
                Root::At(r) => r.0,
                Root::Any => u32::MAX,
            },
            count: spec.count as u64,
        }
    }

    pub(crate) fn encode(&self) -> Bytes {
        let mut b = vec![0u8; ABORT_LEN];
        b[0] = self.reason as u8;
        b[1] = self.kind;
        b[2] = self.dtype;
        b[3] = self.op;
        b[4..8].copy_from_slice(&self.detector.0.to_le_bytes());
        b[8..12].copy_from_slice(&self.offender.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.root.to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        Bytes::from(b)
    }

    pub(crate) fn decode(b: &[u8]) -> Result<Abort, String> {
        if b.len() != ABORT_LEN {
            return Err(format!("{} bytes, expected {ABORT_LEN}", b.len()));
        }
        let reason = match b[0] {
            1 => AbortReason::Mismatch,
            2 => AbortReason::Protocol,
            3 => AbortReason::PeerLost,
            4 => AbortReason::Timeout,
            r => return Err(format!("unknown reason {r}")),
        };
        if OpKind::name_of_code(b[1]).is_none() || DType::from_u8(b[2]).is_none() {
            return Err("unknown op kind or dtype".into());
        }
        if b[3] != 0 && ReduceOp::from_u8(b[3]).is_none() {
            return Err(format!("unknown reduce op {}", b[3]));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        Ok(Abort {
            reason,
            kind: b[1],
            dtype: b[2],
            op: b[3],
            detector: Rank(u32_at(4)),
            offender: Rank(u32_at(8)),
            root: u32_at(12),
            count: u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
        })
    }

    fn describe(&self) -> String {
        let mut s = format!(
            "{} {} count={}",
            OpKind::name_of_code(self.kind).unwrap_or("?"),
            DType::from_u8(self.dtype).map_or("?", |d| d.name()),
            self.count
        );
        if let Some(op) = ReduceOp::from_u8(self.op) {
            s.push_str(&format!(" op={op}"));
        }
        if self.root != u32::MAX {
            s.push_str(&format!(" root={}", self.root));
        }
        s
    }

    /// The error a rank reports on receiving this abort.
    pub(crate) fn to_error(
        &self,
        name: &Arc<str>,
        epoch: Epoch,
        me: Rank,
        mine: &OpSpec,
    ) -> CollectiveError {
        let (d, o) = (self.detector.0, self.offender.0);
        let aborted = |reason: String| CollectiveError::Aborted {
            name: name.clone(),
            epoch,
            by: self.detector,
            reason,
        };
        match self.reason {
            AbortReason::Mismatch => {
                let mut ranks = vec![self.detector, self.offender];
                ranks.dedup();
                CollectiveError::Mismatch {
                    name: name.clone(),
                    epoch,
                    ranks,
                    detail: format!(
                        "rank {d} has {} and refused a frame of rank {o}; rank {} has {}",
                        self.describe(),
                        me.0,
                        mine.describe()
                    ),
                }
            }
            AbortReason::PeerLost => CollectiveError::PeerLost {
                name: name.clone(),
                epoch,
                peer: self.offender,
                source: TransportError::PeerLost {
                    peer: self.offender,
                    reason: format!("reported lost by rank {d}").into(),
                },
            },
            AbortReason::Protocol => aborted(format!("protocol violation by rank {o}")),
            AbortReason::Timeout => aborted(format!("rank {d} timed out waiting for rank {o}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::OpKind;

    #[test]
    fn round_trip_and_garbage() {
        let spec = OpSpec {
            kind: OpKind::Reduce {
                op: ReduceOp::Max,
                root: Rank(3),
            },
            dtype: DType::BF16,
            count: 1 << 40,
            check: 0,
        };
        let a = Abort::new(AbortReason::Mismatch, Rank(1), Rank(2), &spec);
        let b = Abort::decode(&a.encode()).unwrap();
        assert_eq!(a, b);
        assert_eq!(
            b.describe(),
            "reduce bf16 count=1099511627776 op=max root=3"
        );
        assert!(Abort::decode(&[0; 5]).is_err());
        let mut bad = a.encode().to_vec();
        bad[1] = 99;
        assert!(Abort::decode(&bad).is_err());
    }
}
