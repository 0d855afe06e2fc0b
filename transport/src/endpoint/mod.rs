//! The endpoint: what every backend shares above the bytes it moves.
//!
//! A backend moves frames through sockets, rings or in-process queues. The
//! endpoint owns what is the same whichever backend moved them:
//!
//! - **Matching.** Frames are matched to receives by [`OpTag`] in the
//!   [`Matcher`]; a frame leaves it only in the poll that returns it, so a
//!   dropped receive loses nothing.
//! - **Epochs.** Frames of an older epoch are refused and counted; frames
//!   still queued for an older epoch are dropped when the endpoint
//!   advances; an epoch never goes back.
//! - **Strays.** Frames of a retired op instance keep only their header,
//!   for the layer above to check (a late frame with another spec digest
//!   reveals a rank that disagreed).
//! - **The back-pressure budget.** Unmatched payload is bounded: when the
//!   budget is spent, a reader waits, and so stops reading its peer,
//!   instead of allocating. One frame always fits an empty matcher, so a
//!   frame larger than the budget cannot wedge a peer.
//! - **Lost peers.** A lost rank fails the receives that name it once
//!   nothing of theirs is queued, and every send to it.
//! - **Liveness** (when started, [`Endpoint::watch_peers`]): heartbeats on
//!   every link, and a peer silent for too long is lost (frozen, its host
//!   or network gone: what no socket reports).
//! - **The receive loop.** A receive first stays runnable for a while,
//!   letting the backend move frames in (its *pump*: a task polling shared
//!   memory rings itself, or the runtime polling sockets when the task
//!   yields), then sleeps until a reader delivers or the deadline passes.
//!
//! [`Endpoint`] is the one implementation of [`Transport`](crate::Transport)
//! (a test double aside): a matcher and one or more wires
//! ([`Wire`](crate::wire::Wire)), routed per peer. The trait's methods that
//! only read or change the matcher's state (`epoch`, `advance_epoch`,
//! `retire`, `recv_stray`, `check_peers`, `check_peers_for`) are provided on
//! top of [`Transport::matcher`](crate::Transport::matcher). Shared memory
//! inside a host and TCP across is one endpoint over two wires that deliver
//! into one matcher.
//!
//! # Layer rule
//!
//! Backends call into this module; this module names no backend (not tcp,
//! shm or mem). What it needs from one comes through the
//! [`Wire`](crate::wire::Wire) trait. Check that
//! `grep -rn "crate::\(tcp\|shm\|mem\|any\)" transport/src/endpoint`
//! finds nothing.

use crate::{Frame, Instant, OpTag, PeerSet, TransportError};

mod generic;
mod liveness;
mod matching;
#[cfg(test)]
mod tests;

pub use self::generic::{Endpoint, EndpointConfig};
pub use self::liveness::Liveness;
pub use self::matching::{Arrival, Matcher, RecvKey, CLOSED_BY_PEER, MAX_BEACON};

/// What one poll of a backend's inbound queues did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pump {
    /// Nothing new.
    Idle,
    /// Frames moved into the matcher.
    Moved,
    /// A frame of the awaited op was consumed in place.
    Consumed,
}

impl Pump {
    pub fn moved(moved: bool) -> Pump {
        if moved {
            Pump::Moved
        } else {
            Pump::Idle
        }
    }
}

/// [`Matcher::recv`], after staying runnable for `spin`: in between,
/// `pump` may move frames in (returning whether it did), and the task
/// yields to the runtime (which then polls its IO instead of parking
/// the thread) and, if `yield_os`, to the OS (ranks outnumber cores).
/// A frame that arrives during the spin costs no thread wake-up.
pub(crate) async fn recv_spinning(
    matcher: &Matcher,
    tag: OpTag,
    from: &PeerSet,
    deadline: Instant,
    spin: std::time::Duration,
    yield_os: bool,
    mut pump: impl FnMut() -> bool + Send,
) -> Result<Frame, TransportError> {
    let pump = || Pump::moved(pump());
    let take = || matcher.try_recv(tag, from).map(|r| r.map(Arrival::Frame));
    match spin_recv(take, spin, yield_os, pump).await {
        Some(Ok(Arrival::Frame(f))) => Ok(f),
        Some(Ok(other)) => unreachable!("plain pumps consume nothing, got {other:?}"),
        Some(Err(e)) => Err(e),
        None => matcher.recv(tag, from, deadline).await,
    }
}

/// The spinning phase of [`recv_spinning`]: `None` if nothing came within
/// `spin` (`take` asks the matcher); [`Arrival::Applied`] when `pump`
/// consumed a frame in place.
pub(crate) async fn spin_recv(
    mut take: impl FnMut() -> Option<Result<Arrival, TransportError>> + Send,
    spin: std::time::Duration,
    yield_os: bool,
    mut pump: impl FnMut() -> Pump + Send,
) -> Option<Result<Arrival, TransportError>> {
    let spin_until = std::time::Instant::now() + spin;
    let mut polls = 0u32;
    loop {
        if let Some(r) = take() {
            return Some(r);
        }
        match pump() {
            Pump::Consumed => return Some(Ok(Arrival::Applied)),
            Pump::Moved => continue,
            Pump::Idle => {}
        }
        // Yielding polls the runtime's IO (a system call), and reading
        // the clock is not free either: do both every few polls only.
        polls = polls.wrapping_add(1);
        if !polls.is_multiple_of(16) {
            std::hint::spin_loop();
            continue;
        }
        if std::time::Instant::now() >= spin_until {
            return None;
        }
        if yield_os {
            std::thread::yield_now();
        }
        tokio::task::yield_now().await;
    }
}

/// The [`crate::FrameKind::Lost`] frame that tells a peer that `lost` is
/// lost, and why.
pub(crate) fn loss_notice(
    epoch: crate::Epoch,
    lost: kungfu_topology::Rank,
    why: &str,
) -> (crate::Header, bytes::Bytes) {
    let payload = matching::notices::encode(lost, why);
    let header = crate::Header {
        kind: crate::FrameKind::Lost,
        ..liveness::heartbeat(epoch, payload.len())
    };
    (header, payload)
}
