//! [`PeerSet`]: a set of ranks.

use kungfu_topology::Rank;

/// Ranks below this are held inline: a set of them costs no allocation to
/// make or clone (ops make a few per op).
const INLINE_WORDS: usize = 2;

/// A set of ranks, as a bitset: ranks below 128 inline, others spilled.
#[derive(Clone, Default)]
pub struct PeerSet {
    low: [u64; INLINE_WORDS],
    /// Words `INLINE_WORDS..`, only for clusters past 128 ranks.
    high: Vec<u64>,
}

impl PeerSet {
    pub fn new() -> PeerSet {
        PeerSet::default()
    }

    /// Ranks `0..n`.
    pub fn all(n: usize) -> PeerSet {
        let mut s = PeerSet::new();
        for r in 0..n {
            s.insert(Rank(r as u32));
        }
        s
    }

    fn word(&self, w: usize) -> u64 {
        match w.checked_sub(INLINE_WORDS) {
            None => self.low[w],
            Some(h) => self.high.get(h).copied().unwrap_or(0),
        }
    }

    pub fn insert(&mut self, r: Rank) {
        let (w, b) = (r.idx() / 64, r.idx() % 64);
        match w.checked_sub(INLINE_WORDS) {
            None => self.low[w] |= 1 << b,
            Some(h) => {
                if self.high.len() <= h {
                    self.high.resize(h + 1, 0);
                }
                self.high[h] |= 1 << b;
            }
        }
    }

    pub fn remove(&mut self, r: Rank) {
        let (w, b) = (r.idx() / 64, r.idx() % 64);
        match w.checked_sub(INLINE_WORDS) {
            None => self.low[w] &= !(1 << b),
            Some(h) => {
                if let Some(x) = self.high.get_mut(h) {
                    *x &= !(1 << b);
                }
            }
        }
    }

    pub fn contains(&self, r: Rank) -> bool {
        let (w, b) = (r.idx() / 64, r.idx() % 64);
        self.word(w) & (1 << b) != 0
    }

    pub fn is_empty(&self) -> bool {
        self.words().all(|w| w == 0)
    }

    fn words(&self) -> impl Iterator<Item = u64> + '_ {
        self.low.iter().chain(&self.high).copied()
    }

    pub fn iter(&self) -> impl Iterator<Item = Rank> + '_ {
        self.words().enumerate().flat_map(|(w, bits)| {
            (0..64)
                .filter(move |b| bits & (1u64 << b) != 0)
                .map(move |b| Rank((w * 64 + b) as u32))
        })
    }
}

/// Equal when they hold the same ranks (however the words are stored).
impl PartialEq for PeerSet {
    fn eq(&self, other: &PeerSet) -> bool {
        let n = self.high.len().max(other.high.len()) + INLINE_WORDS;
        (0..n).all(|w| self.word(w) == other.word(w))
    }
}

impl Eq for PeerSet {}

impl std::fmt::Debug for PeerSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.iter().map(|r| r.0)).finish()
    }
}

impl FromIterator<Rank> for PeerSet {
    fn from_iter<I: IntoIterator<Item = Rank>>(iter: I) -> PeerSet {
        let mut s = PeerSet::new();
        for r in iter {
            s.insert(r);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_ranks_inline_and_spilled_and_compares_by_content() {
        let ranks = [0u32, 63, 64, 127, 128, 300];
        let s: PeerSet = ranks.iter().map(|&r| Rank(r)).collect();
        assert_eq!(s.iter().map(|r| r.0).collect::<Vec<_>>(), ranks);
        for r in 0..400 {
            assert_eq!(s.contains(Rank(r)), ranks.contains(&r), "rank {r}");
        }
        let mut t = s.clone();
        t.remove(Rank(300));
        t.remove(Rank(128));
        // Same ranks as a set that never spilled, though t keeps its words.
        let u: PeerSet = [0u32, 63, 64, 127].iter().map(|&r| Rank(r)).collect();
        assert_eq!(t, u);
        assert_ne!(s, u);
        assert_eq!(format!("{u:?}"), "{0, 63, 64, 127}");
        for r in [0, 63, 64, 127] {
            t.remove(Rank(r));
        }
        assert!(t.is_empty() && t == PeerSet::new());
        assert!(!s.is_empty());
        assert_eq!(PeerSet::all(130).iter().count(), 130);
    }
}
