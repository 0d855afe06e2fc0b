//! A monitored allreduce's squared norms on the fast path
//! ([`super::Fast::fuses_norms`]): each rank sums, in its reduction, the
//! squares of the inputs it reads and of the result it writes (its
//! share); on the split and large ways, where each rank reduces a slice,
//! it sends its share with the message of the phase after the reduction
//! ([`NORMS_BYTES`] after the slice, or as the large way's "ready"), and
//! every rank adds the shares in rank order, so all get the same bits.

/// Bytes of a share on the wire: two little-endian f64.
pub(super) const NORMS_BYTES: usize = 16;

/// A share: the sum of the squared inputs, and of the squared result.
pub(super) type Share = [f64; 2];

/// This rank's share and the sum of the shares heard so far.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Norms {
    /// This rank's share (on the direct way, where each rank reduces every
    /// input, the whole).
    pub(super) mine: Share,
    sum: Share,
    mine_added: bool,
}

impl Norms {
    /// Adds rank `r`'s share (`r` is not `me`): called for the peers in
    /// ascending rank order, so that with this rank's own share put in its
    /// place the sum is in rank order on every rank.
    pub(super) fn add(&mut self, me: usize, r: usize, q: Share) {
        if me < r && !self.mine_added {
            self.push(self.mine);
            self.mine_added = true;
        }
        self.push(q);
    }

    fn push(&mut self, q: Share) {
        self.sum[0] += q[0];
        self.sum[1] += q[1];
    }

    /// Every rank's shares, summed in rank order (once all are added).
    pub(super) fn total(&self) -> Share {
        let mut n = *self;
        if !n.mine_added {
            n.push(n.mine);
        }
        n.sum
    }
}

/// A share as sent.
pub(super) fn to_bytes(q: Share) -> [u8; NORMS_BYTES] {
    let mut b = [0; NORMS_BYTES];
    b[..8].copy_from_slice(&q[0].to_le_bytes());
    b[8..].copy_from_slice(&q[1].to_le_bytes());
    b
}

/// A share as read ([`NORMS_BYTES`] bytes; `None` for another length).
pub(super) fn from_bytes(b: &[u8]) -> Option<Share> {
    let b: &[u8; NORMS_BYTES] = b.try_into().ok()?;
    let f = |i: usize| f64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
    Some([f(0), f(8)])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sum is in rank order wherever this rank's own share falls, and
    /// a share survives its bytes.
    #[test]
    fn shares_add_in_rank_order() {
        // values whose sum depends on the order of the additions
        let share = |r: usize| [[1e16, 1.0, -1e16, 3.0][r], r as f64];
        for me in 0..4 {
            let mut n = Norms {
                mine: share(me),
                ..Norms::default()
            };
            for r in (0..4).filter(|&r| r != me) {
                n.add(me, r, share(r));
            }
            let want = (0..4).fold([0.0, 0.0], |s, r| [s[0] + share(r)[0], s[1] + share(r)[1]]);
            assert_eq!(n.total(), want, "me {me}");
        }
        let q = [1.5, -2.25e300];
        assert_eq!(from_bytes(&to_bytes(q)), Some(q));
        assert_eq!(from_bytes(&[0; 15]), None);
    }
}
