//! Loss notices: when this endpoint loses a peer by itself, other than by
//! a clean end of its connection ([`CLOSED_BY_PEER`]): found silent
//! (frozen, or its host or network gone: [`Matcher::fail_silent`]), a
//! connection reset or cut, a protocol violation; it tells every other
//! peer at once
//! ([`FrameKind::Lost`]), ahead of anything it sends later. A peer that
//! hears of it marks the rank lost too, "reported lost by" the sender, so
//! that when the sender then fails and exits because of that loss, its
//! peers name the culprit, not the sender: the first rank in their order
//! of losses is the one lost first anywhere they heard of.
//!
//! The payload (untrusted; one that does not parse is dropped):
//!
//! ```text
//! u32 rank lost (LE) | its reason, UTF-8, at most 1024 bytes
//! ```
//!
//! [`FrameKind::Lost`]: crate::FrameKind::Lost

use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};
use kungfu_topology::Rank;
use tokio::sync::Notify;

use super::lost::locate;
use super::{wake_all, Matcher};

/// The longest reason a notice carries (a longer one is cut).
const MAX_REASON: usize = 1024;

/// Why a peer whose connection ended cleanly (at a frame boundary) is
/// lost. Such a loss is not told: it is how a graceful close looks too,
/// after which the peer's frames to others may still be on their way
/// (and when a process dies, every peer's connection to it ends at once).
/// A connection cut without a reset ends this way too; its other end,
/// which cut it, tells.
pub const CLOSED_BY_PEER: &str = "connection closed by peer";

/// The losses this endpoint found by itself and has not told yet.
#[derive(Default)]
pub(super) struct Notices {
    queue: Mutex<Vec<(Rank, Arc<str>)>>,
    told: Notify,
}

impl Notices {
    pub(super) fn push(&self, peer: Rank, reason: Arc<str>) {
        self.queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((peer, reason));
        self.told.notify_one();
    }
}

/// A notice's payload.
pub(crate) fn encode(peer: Rank, reason: &str) -> Bytes {
    let mut cut = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(cut) {
        cut -= 1;
    }
    let mut b = BytesMut::with_capacity(4 + cut);
    b.put_u32_le(peer.0);
    b.put_slice(&reason.as_bytes()[..cut]);
    b.freeze()
}

fn decode(b: &[u8]) -> Option<(Rank, &str)> {
    let (r, why) = b.split_first_chunk::<4>()?;
    if why.len() > MAX_REASON {
        return None;
    }
    Some((Rank(u32::from_le_bytes(*r)), std::str::from_utf8(why).ok()?))
}

impl Matcher {
    /// Marks `peer` lost: receives that name it fail once nothing of theirs
    /// is queued. The first reason is kept. Unless the reason is
    /// [`CLOSED_BY_PEER`], the other peers are told (see
    /// [`Matcher::fail_silent`]).
    pub fn fail_peer(&self, peer: Rank, reason: impl Into<Arc<str>>) {
        let reason = reason.into();
        let tell = *reason != *CLOSED_BY_PEER;
        self.mark_lost(peer, reason, tell, None)
    }

    /// [`Matcher::fail_peer`]; `tell`: see [`Matcher::fail_silent`];
    /// `accuser`: the peer whose notice this is (hearsay), if any.
    fn mark_lost(&self, peer: Rank, reason: Arc<str>, tell: bool, accuser: Option<Rank>) {
        let mut inner = self.lock();
        let reason = locate(&inner, peer, reason);
        let inner = &mut *inner;
        match inner.lost.entry(peer) {
            std::collections::hash_map::Entry::Occupied(_) => {
                // heard of first, now seen here: this endpoint's own loss
                // too (the first reason is kept; the peers are not told
                // again)
                if accuser.is_none() {
                    inner.accusers.remove(&peer);
                }
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(reason.clone());
                inner.lost_order.push(peer);
                if let Some(by) = accuser {
                    inner.accusers.insert(peer, by);
                }
                if tell && !inner.closed {
                    self.notices.push(peer, reason);
                }
            }
        }
        wake_all(inner);
    }

    /// [`Matcher::fail_peer`] for a peer found silent (by the liveness
    /// watchdog), which the other peers are then told of
    /// ([`Matcher::take_notices`]): they may not have noticed yet.
    pub fn fail_silent(&self, peer: Rank, reason: impl Into<Arc<str>>) {
        self.mark_lost(peer, reason.into(), true, None)
    }

    /// The losses found here since the last call, to tell the peers.
    pub fn take_notices(&self) -> Vec<(Rank, Arc<str>)> {
        std::mem::take(&mut *self.notices.queue.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Completes when a loss is found here (see [`Matcher::take_notices`]).
    pub async fn noticed(&self) {
        self.notices.told.notified().await
    }

    /// `from` says it lost the rank its notice names: that rank is lost
    /// here too (unless it is `from`, or a rank this endpoint does not
    /// watch, such as itself: a peer that lost this worker is simply
    /// lost to it, and says so by dropping it; or unless `from` is lost
    /// here: a worker left out, back from a freeze, is not believed).
    pub fn hearsay(&self, from: Rank, payload: &[u8]) {
        let Some((peer, why)) = decode(payload) else {
            return;
        };
        {
            let inner = self.lock();
            if peer == from || !inner.heard.contains_key(&peer) || inner.lost.contains_key(&from) {
                return;
            }
        }
        self.mark_lost(
            peer,
            format!("reported lost by rank {}: {why}", from.0).into(),
            false,
            Some(from),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::liveness::heartbeat;
    use crate::{Epoch, FrameKind, Header};

    fn notice(len: usize) -> Header {
        Header {
            kind: FrameKind::Lost,
            ..heartbeat(Epoch(0), len)
        }
    }

    #[test]
    fn a_loss_found_here_is_told_and_one_heard_of_is_not_retold() {
        let m = Matcher::new(Epoch(0), 1 << 20);
        m.watch((1..6).map(Rank));
        m.fail_peer(Rank(1), CLOSED_BY_PEER);
        assert!(m.take_notices().is_empty(), "a clean end is not told");
        m.fail_silent(Rank(2), "silent for 1.6 s");
        m.fail_peer(Rank(3), "read: connection reset by peer");
        let told: Vec<Rank> = m.take_notices().into_iter().map(|(r, _)| r).collect();
        assert_eq!(told, vec![Rank(2), Rank(3)]);
        assert!(m.take_notices().is_empty());

        let b = encode(Rank(5), "connection reset");
        m.deliver_now(Rank(4), notice(b.len()), b).unwrap();
        let why = m.lost_reason(Rank(5)).expect("lost by hearsay");
        assert!(
            why.starts_with("reported lost by rank 4: connection reset"),
            "{why}"
        );
        assert!(m.take_notices().is_empty(), "hearsay is not retold");
        assert_eq!(m.lost_in_order(), [1, 2, 3, 5].map(Rank));
        // a lost peer is not believed
        let b = encode(Rank(4), "it says");
        m.deliver_now(Rank(1), notice(b.len()), b).unwrap();
        assert_eq!(m.lost_reason(Rank(4)), None);
    }

    #[test]
    fn losses_found_here_are_told_apart_from_hearsay() {
        // ranks 1 and 2 lost their link: each reports the other, and a
        // peer believes the first it hears (the second comes from a rank
        // it holds lost)
        let m = Matcher::new(Epoch(0), 1 << 20);
        m.watch((1..5).map(Rank));
        let b = encode(Rank(1), "write: the connection was cut");
        m.deliver_now(Rank(2), notice(b.len()), b).unwrap();
        let b = encode(Rank(2), "connection reset");
        m.deliver_now(Rank(1), notice(b.len()), b).unwrap();
        assert_eq!(m.lost_in_order(), [Rank(1)]);
        assert!(m.lost_first_hand().is_empty(), "hearsay only");
        m.fail_peer(Rank(3), CLOSED_BY_PEER);
        m.fail_silent(Rank(4), "silent for 1.6 s");
        assert_eq!(m.lost_in_order(), [1, 3, 4].map(Rank));
        assert_eq!(m.lost_first_hand(), [3, 4].map(Rank));
        // rank 1, heard of, is still watched, and found silent here too
        assert!(m
            .silent(crate::Instant::now())
            .iter()
            .any(|&(r, _)| r == Rank(1)));
        m.fail_silent(Rank(1), "silent for 1.6 s");
        assert_eq!(m.lost_first_hand(), [1, 3, 4].map(Rank));
        let why = m.lost_reason(Rank(1)).expect("lost");
        assert!(
            why.starts_with("reported lost by rank 2"),
            "the first reason: {why}"
        );
        assert!(m
            .silent(crate::Instant::now())
            .iter()
            .all(|&(r, _)| r != Rank(1)));
    }

    #[test]
    fn time_this_process_was_away_is_not_a_peers_silence() {
        let m = Matcher::new(Epoch(0), 1 << 20);
        m.watch([Rank(1), Rank(2)]);
        std::thread::sleep(std::time::Duration::from_millis(40));
        m.heard(Rank(2));
        std::thread::sleep(std::time::Duration::from_millis(1));
        let t = crate::Instant::now();
        let silent =
            |m: &Matcher| -> Vec<Rank> { m.silent(t).into_iter().map(|(r, _)| r).collect() };
        assert_eq!(silent(&m), [Rank(1), Rank(2)]);
        // 20 ms away: rank 1 (heard 40 ms before) is still silent since
        // before t; rank 2 (heard just before) moves to now, not later
        let ms = std::time::Duration::from_millis;
        m.excuse(ms(20), ms(100));
        assert_eq!(silent(&m), [Rank(1)]);
        let (_, at) = m.silent(crate::Instant::now())[0];
        assert!(at <= crate::Instant::now());
        m.excuse(std::time::Duration::from_secs(5), ms(100));
        assert_eq!(silent(&m), []);
        // at most the cap in all, until heard again: 20 + 80 ms excused,
        // so rank 1 is silent again once 100 ms more have passed
        m.excuse(ms(50), ms(100));
        std::thread::sleep(ms(120));
        let late = crate::Instant::now();
        m.excuse(ms(50), ms(100));
        assert_eq!(m.silent(late).len(), 2, "past the cap");
        m.heard(Rank(2));
        m.excuse(ms(50), ms(100));
        assert_eq!(
            m.silent(late)
                .into_iter()
                .map(|(r, _)| r)
                .collect::<Vec<_>>(),
            [Rank(1)]
        );
    }

    #[test]
    fn bad_or_self_serving_notices_change_nothing() {
        let m = Matcher::new(Epoch(0), 1 << 20);
        m.watch([Rank(1), Rank(2)]);
        for b in [
            Bytes::from_static(b"\x01\x00"),
            encode(Rank(1), "it reports itself"),
            encode(Rank(0), "this worker: not watched"),
            encode(Rank(7), "no such peer"),
            {
                let mut v = encode(Rank(2), "").to_vec();
                v.extend([0xff, 0xfe]);
                v.into()
            },
            {
                let mut v = encode(Rank(2), "").to_vec();
                v.extend(std::iter::repeat_n(b'x', MAX_REASON + 1));
                v.into()
            },
        ] {
            m.deliver_now(Rank(1), notice(b.len()), b).unwrap();
        }
        assert!(m.lost_in_order().is_empty());
        let long = "é".repeat(MAX_REASON);
        let (_, why) = decode(&encode(Rank(2), &long))
            .map(|(r, w)| (r, w.to_string()))
            .unwrap();
        assert!(why.len() <= MAX_REASON && long.starts_with(&why));
    }
}
