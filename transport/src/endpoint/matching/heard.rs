//! When each watched peer was last heard from: the liveness watchdog's
//! view ([`super::super::liveness`]).

use kungfu_topology::Rank;

use super::{Inner, Matcher};
use crate::Instant;

impl Matcher {
    /// Starts keeping when each of `peers` was last heard from (now, to
    /// begin with): see [`Matcher::silent`].
    pub fn watch(&self, peers: impl IntoIterator<Item = Rank>) {
        let now = Instant::now();
        let mut inner = self.lock();
        for p in peers {
            inner.heard.entry(p).or_insert(now);
        }
    }

    /// `peer` is alive now: a wire that reads a long frame in pieces says
    /// so as bytes arrive (frames say so themselves).
    pub fn heard(&self, peer: Rank) {
        let mut inner = self.lock();
        if let Some(t) = inner.heard.get_mut(&peer) {
            *t = Instant::now();
            inner.excused.remove(&peer);
        }
    }

    /// Every watched peer is alive now (as far as this endpoint can tell:
    /// see the liveness watchdog, after this process did not run).
    pub fn heard_all(&self) {
        let now = Instant::now();
        for t in self.lock().heard.values_mut() {
            *t = now;
        }
    }

    /// This process was away for `away` (its watchdog ran late): that
    /// time does not count against any peer's silence, since a peer
    /// could not have been heard while this process did not run. Each
    /// last-heard instant moves `away` later, to now at most, and by at
    /// most `cap` in all until the peer is heard again: a dead peer is
    /// named however late every tick runs.
    pub fn excuse(&self, away: std::time::Duration, cap: std::time::Duration) {
        let now = Instant::now();
        let mut inner = self.lock();
        let Inner { heard, excused, .. } = &mut *inner;
        for (r, t) in heard.iter_mut() {
            let e = excused.entry(*r).or_default();
            let add = away.min(cap.saturating_sub(*e));
            *e += add;
            *t = (*t + add).min(now);
        }
    }

    /// The watched peers not heard from since `before` and not lost here
    /// (a peer lost only by hearsay is still watched).
    pub fn silent(&self, before: Instant) -> Vec<(Rank, Instant)> {
        let inner = self.lock();
        if inner.closed {
            return Vec::new();
        }
        let mut v: Vec<_> = inner
            .heard
            .iter()
            // a peer lost by hearsay only is still watched: found silent
            // here too, its loss becomes this endpoint's own
            .filter(|(r, t)| {
                **t < before && (!inner.lost.contains_key(r) || inner.accusers.contains_key(r))
            })
            .map(|(r, t)| (*r, *t))
            .collect();
        v.sort_unstable();
        v
    }
}
