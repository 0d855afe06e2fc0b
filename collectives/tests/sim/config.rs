//! What a run is set up with: its limits and seeded delays, and the
//! faults to inject.

use std::time::Duration;

use kungfu_topology::Rank;

/// The limits and the seeded delays of a run.
#[derive(Clone, Debug)]
pub struct Config {
    /// The ops' inactivity timeout.
    pub timeout: Duration,
    /// The ops' window (bytes of sends handed out and not completed).
    pub window: usize,
    pub chunk_bytes: usize,
    /// A frame arrives a seeded time in this range after it left.
    pub net: (Duration, Duration),
    /// A send completes a seeded time in this range after it was handed out.
    pub send: (Duration, Duration),
    /// A rank is told that a peer died a seeded time in this range after
    /// it did (and never before the peer's last frame to it arrived).
    pub detect: (Duration, Duration),
    /// More events than this is a livelock.
    pub max_events: usize,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            timeout: Duration::from_secs(10),
            window: 96,
            chunk_bytes: 64,
            net: (Duration::from_micros(1), Duration::from_millis(3)),
            send: (Duration::ZERO, Duration::from_micros(800)),
            detect: (Duration::from_millis(1), Duration::from_millis(40)),
            max_events: 2_000_000,
        }
    }
}

/// A fault to inject.
#[derive(Clone, Copy, Debug)]
pub enum Fault {
    /// The `nth` data frame (from 0) that `from` sends to `to` is lost.
    Drop { from: Rank, to: Rank, nth: usize },
    /// Every abort frame that `from` sends to `to` is lost.
    DropAborts { from: Rank, to: Rank },
    /// `rank` dies at `at`.
    KillAt { rank: Rank, at: Duration },
    /// `rank` dies the moment its op `op` is done, i.e. right after the
    /// last frame of that op left it.
    KillWhenDone { rank: Rank, op: usize },
    /// Right after `to` advances its epoch, a copy of the last data frame
    /// it received before arrives again (a late frame of the old epoch).
    ReplayAfterAdvance { to: Rank },
}
