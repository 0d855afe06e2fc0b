//! Beacons: a few bytes that the layer above attaches to this endpoint's
//! heartbeats, and the last ones each peer attached to its own. The
//! transport does not read them; the collectives layer's stall report
//! says in them which ops have been waiting here a while.

use std::collections::HashMap;
use std::sync::Mutex;

use bytes::Bytes;
use kungfu_topology::Rank;

use super::Matcher;

/// The longest beacon sent or kept: a peer's longer one is dropped.
pub const MAX_BEACON: usize = 16 << 10;

#[derive(Default)]
pub(super) struct Beacons {
    inner: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// What this endpoint's heartbeats carry.
    mine: Bytes,
    /// The last non-empty beacon of each peer (an empty one clears it).
    theirs: HashMap<Rank, Bytes>,
}

impl Beacons {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes this endpoint's heartbeats carry `b`; false (and nothing
    /// changes) when it is longer than [`MAX_BEACON`].
    pub(super) fn set(&self, b: Bytes) -> bool {
        if b.len() > MAX_BEACON {
            return false;
        }
        self.lock().mine = b;
        true
    }

    pub(super) fn mine(&self) -> Bytes {
        self.lock().mine.clone()
    }

    /// A heartbeat from `from` carried `b`.
    pub(super) fn received(&self, from: Rank, b: Bytes) {
        let mut s = self.lock();
        if b.is_empty() || b.len() > MAX_BEACON {
            s.theirs.remove(&from);
        } else {
            s.theirs.insert(from, b);
        }
    }

    /// The beacons of `peers` (empty for one that sent none).
    pub(super) fn of(&self, peers: &[Rank]) -> Vec<(Rank, Bytes)> {
        let s = self.lock();
        peers
            .iter()
            .map(|p| (*p, s.theirs.get(p).cloned().unwrap_or_default()))
            .collect()
    }
}

impl Matcher {
    /// Makes this endpoint's heartbeats carry `beacon` (see
    /// [`Matcher::beacons`]); false, and nothing changes, when it is longer
    /// than [`MAX_BEACON`].
    pub fn set_beacon(&self, beacon: Bytes) -> bool {
        self.beacons.set(beacon)
    }

    /// What this endpoint's heartbeats carry.
    pub fn beacon(&self) -> Bytes {
        self.beacons.mine()
    }

    /// The last beacon of each watched peer that is not lost (empty for
    /// one whose heartbeats carry none), by rank: peers not watched (no
    /// heartbeats) are not listed.
    pub fn beacons(&self) -> Vec<(Rank, Bytes)> {
        let mut watched: Vec<Rank> = {
            let inner = self.lock();
            inner
                .heard
                .keys()
                .filter(|r| !inner.lost.contains_key(r))
                .copied()
                .collect()
        };
        watched.sort_unstable();
        self.beacons.of(&watched)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::liveness::heartbeat;
    use crate::Epoch;

    #[test]
    fn heartbeats_carry_beacons_of_live_peers() {
        let m = Matcher::new(Epoch(0), 1 << 20);
        m.watch([Rank(1), Rank(2)]);
        assert!(m.set_beacon(Bytes::from_static(b"mine")));
        assert_eq!(&m.beacon()[..], b"mine");
        assert!(!m.set_beacon(Bytes::from(vec![0u8; MAX_BEACON + 1])));
        assert_eq!(&m.beacon()[..], b"mine", "a refused beacon changes nothing");

        let said = |r: u32, b: &'static [u8]| {
            m.deliver_now(Rank(r), heartbeat(Epoch(0), b.len()), Bytes::from_static(b))
                .unwrap()
        };
        said(1, b"one");
        let got = m.beacons();
        assert_eq!(
            got,
            vec![
                (Rank(1), Bytes::from_static(b"one")),
                (Rank(2), Bytes::new())
            ]
        );
        said(1, b"");
        assert_eq!(
            m.beacons()[0],
            (Rank(1), Bytes::new()),
            "an empty one clears"
        );
        said(2, b"two");
        m.fail_peer(Rank(2), "gone");
        assert_eq!(
            m.beacons(),
            vec![(Rank(1), Bytes::new())],
            "lost: not listed"
        );
        // a beacon never reaches an op's queue
        assert!(m.lost_in_order() == vec![Rank(2)]);
    }
}
