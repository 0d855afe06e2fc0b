//! Liveness: heartbeats on every link and a watchdog that declares a
//! silent peer lost, so that a worker that is frozen (SIGSTOP), whose host
//! is gone or whose network is cut is noticed within a bounded time, even
//! when no op waits for it. A socket does not notice these: a stopped
//! process's kernel still acknowledges, and a cut cable sends nothing.
//!
//! Every [`Liveness::interval`] the endpoint sends each peer a
//! [`FrameKind::Heartbeat`] frame (empty; skipped while the previous one to
//! that peer is still on its way, as a full link to a frozen peer would
//! hold it) and checks when each peer was last heard from: any frame, a
//! heartbeat, or bytes of a long frame (a wire that reads one in pieces
//! says so, [`Matcher::heard`]). A peer silent for [`Liveness::timeout`]
//! is lost ([`Matcher::fail_peer`]): the ops that need it fail with
//! [`TransportError::PeerLost`] naming it, as if its connection had
//! broken.
//!
//! Heartbeats carry this endpoint's beacon ([`Matcher::set_beacon`]), the
//! few bytes the layer above has peers know (the stall report).
//!
//! [`Matcher::heard`]: super::Matcher::heard
//! [`Matcher::fail_peer`]: super::Matcher::fail_peer
//! [`Matcher::set_beacon`]: super::Matcher::set_beacon

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use kungfu_topology::Rank;

use super::Endpoint;
use crate::wire::Wire;
use crate::{FrameKind, Header, Instant, OpId, OpTag};

/// How often to send heartbeats, and how long a silence means a peer is
/// lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Liveness {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Liveness {
    /// A peer silent for `timeout` is lost; heartbeats go every sixth of
    /// it (at least every millisecond), so a few may be late or lost
    /// before a live peer looks silent.
    pub fn with_timeout(timeout: Duration) -> Liveness {
        Liveness {
            interval: (timeout / 6).max(Duration::from_millis(1)),
            timeout,
        }
    }
}

impl Default for Liveness {
    /// 1.5 s of silence: a dead peer is named within about 2 s.
    fn default() -> Liveness {
        Liveness::with_timeout(Duration::from_millis(1500))
    }
}

/// The header of a heartbeat carrying `len` bytes of beacon (its tag
/// names no op).
pub(super) fn heartbeat(epoch: crate::Epoch, len: usize) -> Header {
    Header {
        kind: FrameKind::Heartbeat,
        tag: OpTag {
            epoch,
            op: OpId(0),
            seq: 0,
        },
        chunk: 0,
        step: 0,
        digest: 0,
        len: len as u64,
    }
}

impl<W: Wire> Endpoint<W> {
    /// Starts heartbeats to every peer this endpoint reaches and the
    /// watchdog over them (see the module docs); they stop when the
    /// endpoint closes, shuts down or is dropped. Calling it again
    /// replaces the earlier watch.
    pub fn watch_peers(self: &Arc<Self>, l: Liveness) {
        // (The libfabric wire sends heartbeats on its TCP control links,
        // not through the fabric: see `fabric`.)
        let peers: Vec<Rank> = (0..self.size as u32)
            .map(Rank)
            .filter(|&r| self.wire_to(r).is_some())
            .collect();
        self.matcher.watch(peers.iter().copied());
        let weak = Arc::downgrade(self);
        let task = tokio::spawn(watch(weak, peers, l));
        let old = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(task);
        if let Some(old) = old {
            old.abort();
        }
    }

    /// Stops the heartbeats and the watchdog.
    pub(super) fn stop_watching(&self) {
        let task = self
            .watcher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task {
            task.abort();
        }
    }
}

async fn watch<W: Wire>(e: Weak<Endpoint<W>>, peers: Vec<Rank>, l: Liveness) {
    let on_the_way: Arc<Vec<AtomicBool>> =
        Arc::new(peers.iter().map(|_| AtomicBool::new(false)).collect());
    let mut tick = tokio::time::interval(l.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = Instant::now();
    let Some(matcher) = e.upgrade().map(|e| e.matcher.clone()) else {
        return;
    };
    loop {
        let noticed = tokio::select! {
            _ = tick.tick() => false,
            () = matcher.noticed() => true,
        };
        let Some(e) = e.upgrade() else { return };
        if e.matcher.is_closed() {
            return;
        }
        tell_losses(&e, &peers, l.timeout);
        if noticed {
            continue;
        }
        let now = Instant::now();
        let gap = now.duration_since(last);
        if gap >= l.timeout {
            // This process did not run for a whole timeout (it was
            // stopped, SIGSTOP, or starved): every peer looks silent, but
            // it is this one that was away. Peers get a fresh timeout;
            // those that declared this one lost meanwhile have dropped
            // it, and are named lost after that. (Declaring them lost at
            // once would let a worker that was frozen race the survivors
            // to a recovery without them.)
            eprintln!(
                "kungfu: rank {}: this process did not run for {:.1} s (stopped or starved); \
                 its peers get a fresh {:?} to be heard",
                e.me.0,
                now.duration_since(last).as_secs_f64(),
                l.timeout
            );
            e.matcher.heard_all();
        } else if gap > 2 * l.interval {
            // Late by more than a tick, but not by a whole timeout (the
            // host stalled, or this process was starved, for a while):
            // the time away is not the peers' silence. Without this, a
            // stall of the whole host just under the timeout had a worker
            // whose tick came just before it declare a peer lost whose
            // last heartbeat came a little earlier.
            e.matcher.excuse(gap - l.interval, l.timeout);
        }
        last = now;
        let Some(before) = now.checked_sub(l.timeout) else {
            continue;
        };
        for (peer, since) in e.matcher.silent(before) {
            e.matcher.fail_silent(
                peer,
                format!(
                    "silent for {:.1} s (no frame, no heartbeat): frozen or dead, or its host \
                     or the network to it is gone",
                    now.duration_since(since).as_secs_f64()
                ),
            );
        }
        let epoch = e.matcher.epoch();
        let beacon = e.matcher.beacon();
        for (i, &peer) in peers.iter().enumerate() {
            if e.matcher.lost_reason(peer).is_some() || on_the_way[i].swap(true, Ordering::AcqRel) {
                continue;
            }
            let (e, on_the_way, beacon) = (e.clone(), on_the_way.clone(), beacon.clone());
            let limit = l.timeout;
            tokio::spawn(async move {
                if let Some(w) = e.wire_to(peer) {
                    // A failure (a lost peer, a closed endpoint) is the
                    // readers' and the watchdog's to report.
                    let sent = w.send(peer, heartbeat(epoch, beacon.len()), beacon);
                    let _ = tokio::time::timeout(limit, sent).await;
                }
                on_the_way[i].store(false, Ordering::Release);
            });
        }
        tell_losses(&e, &peers, l.timeout);
    }
}

/// Sends every peer not lost a notice of each loss found here since the
/// last call ([`Matcher::take_notices`]), each send bounded by `limit`.
///
/// [`Matcher::take_notices`]: super::Matcher::take_notices
fn tell_losses<W: Wire>(e: &Arc<Endpoint<W>>, peers: &[Rank], limit: std::time::Duration) {
    let losses = e.matcher.take_notices();
    if losses.is_empty() {
        return;
    }
    let epoch = e.matcher.epoch();
    for (lost, why) in losses {
        let (header, payload) = super::loss_notice(epoch, lost, &why);
        for &to in peers {
            if to == lost || e.matcher.lost_reason(to).is_some() {
                continue;
            }
            let (e, payload) = (e.clone(), payload.clone());
            tokio::spawn(async move {
                if let Some(w) = e.wire_to(to) {
                    let _ = tokio::time::timeout(limit, w.send(to, header, payload)).await;
                }
            });
        }
    }
}
