//! How an op fails, one implementation for both of its engines (the op
//! machine of the message path, `op/`, and the host fast path,
//! `session/fast/`): the one inactivity deadline ([`Liveness`]), what a lost
//! peer does to it, and the errors they name: a time-out, a lost peer (the
//! first one lost, the culprit, rather than a neighbour that gave up after
//! it), a transport's failure, a peer's abort frame, a mismatch.
//!
//! Nothing here reads a clock: the engines pass the time in, as an
//! `Instant` of their own (tokio's in the op machine, std's on the fast
//! path).

use std::ops::Add;
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::Rank;
use kungfu_transport::{Epoch, TransportError};

use crate::abort::Abort;
use crate::{CollectiveError, OpSpec};

/// How long an op goes on without progress once a rank its output depends
/// on (not one it waits for) was lost: long enough for what that rank sent
/// before it went to arrive, or for the abort of a neighbour that gave up.
pub const LOST_GRACE: Duration = Duration::from_secs(1);

/// Which op an error is of.
#[derive(Clone, Copy)]
pub(crate) struct OpId<'a> {
    pub(crate) name: &'a Arc<str>,
    pub(crate) epoch: Epoch,
}

/// An op's inactivity deadline and what it knows of lost peers.
#[derive(Debug)]
pub(crate) struct Liveness<I> {
    timeout: Duration,
    deadline: I,
    /// The first loss the op heard of: the culprit its errors name.
    first_lost: Option<TransportError>,
    /// A rank the op's output depends on (not one it waits for) was lost:
    /// the deadline is [`LOST_GRACE`] from the last progress.
    lost_dependency: bool,
}

impl<I: Copy + Ord + Add<Duration, Output = I>> Liveness<I> {
    pub(crate) fn new(now: I, timeout: Duration) -> Liveness<I> {
        Liveness {
            timeout,
            deadline: now + timeout,
            first_lost: None,
            lost_dependency: false,
        }
    }

    /// The op moved at `now`: the deadline moves with it.
    pub(crate) fn progress(&mut self, now: I) {
        self.deadline = now + self.grace();
    }

    pub(crate) fn deadline(&self) -> I {
        self.deadline
    }

    pub(crate) fn expired(&self, now: I) -> bool {
        now >= self.deadline
    }

    /// How long the op may go without progress: the op timeout, or less
    /// once a rank its output depends on was lost.
    pub(crate) fn grace(&self) -> Duration {
        if self.lost_dependency {
            self.timeout.min(LOST_GRACE)
        } else {
            self.timeout
        }
    }

    /// `peer` was lost (`e` says how). While the op `waits` for it, the
    /// op fails at once: the error returned names the first rank this op
    /// heard was lost (the culprit, not a neighbour that gave up after
    /// it). Otherwise, if its output `depends` on the peer, the op goes on
    /// but fails after [`LOST_GRACE`] without progress.
    pub(crate) fn peer_lost(
        &mut self,
        now: I,
        peer: Rank,
        e: TransportError,
        waits: bool,
        depends: bool,
    ) -> Option<TransportError> {
        if self.first_lost.is_none() {
            self.first_lost = Some(e.clone());
        }
        if waits {
            return Some(self.waited_lost(peer, e));
        }
        if depends {
            self.lost_dependency = true;
            self.deadline = self.deadline.min(now + self.grace());
        }
        None
    }

    /// What to fail with for `peer`, lost while the op waits for it (`e`
    /// says how): the first loss the op heard of, if it was another
    /// rank's (the culprit), else `e`.
    pub(crate) fn waited_lost(&self, peer: Rank, e: TransportError) -> TransportError {
        match &self.first_lost {
            Some(TransportError::PeerLost { peer: p, reason }) if *p != peer => {
                TransportError::PeerLost {
                    peer: *p,
                    reason: format!(
                        "{reason} (lost first; {peer}, which this op waited for, was lost after \
                         it)"
                    )
                    .into(),
                }
            }
            _ => e,
        }
    }

    /// The error of an op whose deadline passed while it waited for
    /// `waiting`: the lost rank it depended on, or a time-out.
    pub(crate) fn timeout_error(&self, id: OpId<'_>, waiting: Vec<Rank>) -> CollectiveError {
        if self.lost_dependency {
            if let Some(TransportError::PeerLost { peer, reason }) = self.first_lost.clone() {
                let e = TransportError::PeerLost {
                    peer,
                    reason: format!(
                        "{reason} (this op depends on it, and made no progress for {:?} after \
                         the loss)",
                        self.grace()
                    )
                    .into(),
                };
                return transport_error(id, e);
            }
        }
        CollectiveError::Timeout {
            name: id.name.clone(),
            epoch: id.epoch,
            after: self.timeout,
            waiting,
        }
    }
}

/// The op error for a failure of the transport under it.
pub(crate) fn transport_error(id: OpId<'_>, e: TransportError) -> CollectiveError {
    match e {
        TransportError::PeerLost { peer, .. } => CollectiveError::PeerLost {
            name: id.name.clone(),
            epoch: id.epoch,
            peer,
            source: e,
        },
        TransportError::Closed => CollectiveError::Closed,
        e => CollectiveError::Transport {
            name: id.name.clone(),
            epoch: id.epoch,
            source: e,
        },
    }
}

/// The error an abort frame from `from` stands for (`me` runs `spec`):
/// `Ok` with the peer's error, or `Err` with a protocol violation for a
/// malformed one (which, unlike the peer's own, is this rank's to tell the
/// others).
pub(crate) fn abort_error(
    id: OpId<'_>,
    me: Rank,
    spec: &OpSpec,
    from: Rank,
    payload: &[u8],
) -> Result<CollectiveError, CollectiveError> {
    match Abort::decode(payload) {
        Ok(a) => Ok(a.to_error(id.name, id.epoch, me, spec)),
        Err(why) => Err(protocol(id, from, format!("malformed abort frame: {why}"))),
    }
}

/// A peer broke the protocol of the op.
pub(crate) fn protocol(id: OpId<'_>, from: Rank, reason: String) -> CollectiveError {
    CollectiveError::Protocol {
        name: id.name.clone(),
        epoch: id.epoch,
        peer: from,
        reason,
    }
}

/// `from` runs another op under this op's tag (`detail` says how it
/// differs).
pub(crate) fn mismatch(id: OpId<'_>, me: Rank, from: Rank, detail: String) -> CollectiveError {
    CollectiveError::Mismatch {
        name: id.name.clone(),
        epoch: id.epoch,
        ranks: vec![me, from],
        detail,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn lost(peer: u32) -> TransportError {
        TransportError::PeerLost {
            peer: Rank(peer),
            reason: format!("rank {peer} exited").into(),
        }
    }

    #[test]
    fn the_deadline_moves_with_progress_and_shortens_for_a_lost_dependency() {
        let t0 = Instant::now();
        let name: Arc<str> = "op".into();
        let id = OpId {
            name: &name,
            epoch: Epoch(3),
        };
        let mut l = Liveness::new(t0, Duration::from_secs(10));
        assert!(!l.expired(t0 + Duration::from_secs(9)));
        l.progress(t0 + Duration::from_secs(5));
        assert_eq!(l.deadline(), t0 + Duration::from_secs(15));
        // a rank it only depends on: it goes on, for LOST_GRACE more
        let t1 = t0 + Duration::from_secs(6);
        assert!(l.peer_lost(t1, Rank(2), lost(2), false, true).is_none());
        assert_eq!(l.deadline(), t1 + LOST_GRACE);
        match l.timeout_error(id, vec![Rank(1)]) {
            CollectiveError::PeerLost { peer, source, .. } => {
                assert_eq!(peer, Rank(2));
                assert!(source.to_string().contains("made no progress"), "{source}");
            }
            e => panic!("{e:?}"),
        }
        // then one it waits for: the error names the first, the culprit
        match l.peer_lost(t1, Rank(1), lost(1), true, true) {
            Some(TransportError::PeerLost { peer, reason }) => {
                assert_eq!(peer, Rank(2));
                assert!(reason.contains("lost first; rank 1"), "{reason}");
            }
            e => panic!("{e:?}"),
        }
        // without a loss, a time-out naming whom it waited for
        let l = Liveness::new(t0, Duration::from_secs(10));
        match l.timeout_error(id, vec![Rank(1)]) {
            CollectiveError::Timeout {
                after,
                waiting,
                epoch,
                ..
            } => {
                assert_eq!(
                    (after, waiting, epoch),
                    (Duration::from_secs(10), vec![Rank(1)], Epoch(3))
                );
            }
            e => panic!("{e:?}"),
        }
    }

    #[test]
    fn a_malformed_abort_is_this_ranks_protocol_error() {
        let name: Arc<str> = "op".into();
        let id = OpId {
            name: &name,
            epoch: Epoch(0),
        };
        let spec = OpSpec {
            kind: crate::OpKind::Allreduce(crate::ReduceOp::Sum),
            dtype: crate::DType::F32,
            count: 4,
            check: 0,
        };
        let e = abort_error(id, Rank(0), &spec, Rank(1), b"junk").unwrap_err();
        assert!(
            matches!(e, CollectiveError::Protocol { peer: Rank(1), .. }),
            "{e:?}"
        );
    }
}
