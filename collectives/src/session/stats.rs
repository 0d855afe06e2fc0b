//! What completed ops did, per strategy and per peer.

use std::time::Duration;

/// What the ops that completed on one strategy did, seen from this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OpStats {
    pub ops: u64,
    /// Bytes of the ops' buffers (one rank's `count` elements each).
    pub bytes: u64,
    /// Time from start to completion, summed.
    pub busy: Duration,
}

impl OpStats {
    pub(super) fn add(&mut self, bytes: usize, took: Duration) {
        self.ops += 1;
        self.bytes += bytes as u64;
        self.busy += took;
    }

    /// Bytes per second of busy time (0 without ops).
    pub fn rate(&self) -> f64 {
        per_second(self.bytes, self.busy)
    }

    /// Mean time per op.
    pub fn mean_latency(&self) -> Option<Duration> {
        mean(self.busy, self.ops)
    }
}

/// What this rank received from one peer in the ops that completed: a
/// slow link shows as a low [`PeerStats::rate`], a straggler as a long
/// [`PeerStats::mean_latency`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PeerStats {
    /// Ops in which frames came from this peer.
    pub ops: u64,
    pub frames: u64,
    pub bytes: u64,
    /// Per op, the time from the op's start to the last frame from this
    /// peer, summed.
    pub last_frame: Duration,
}

impl PeerStats {
    /// Bytes per second from this peer: bytes over the time, from each
    /// op's start, until its last frame arrived (0 without frames).
    pub fn rate(&self) -> f64 {
        per_second(self.bytes, self.last_frame)
    }

    /// Mean time from an op's start to the last frame from this peer.
    pub fn mean_latency(&self) -> Option<Duration> {
        mean(self.last_frame, self.ops)
    }
}

fn per_second(bytes: u64, t: Duration) -> f64 {
    let s = t.as_secs_f64();
    if s > 0.0 {
        bytes as f64 / s
    } else {
        0.0
    }
}

fn mean(total: Duration, n: u64) -> Option<Duration> {
    (n > 0).then(|| Duration::from_secs_f64(total.as_secs_f64() / n as f64))
}
