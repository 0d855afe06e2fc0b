//! One op of the fast path, step by step: it posts its contribution,
//! claims the peers' as they come, and once all are here computes its
//! output (or advances a split or large op's phase); timed steps also
//! check its deadline, the liveness of the ranks it waits for, and frames
//! of its tag (a peer's abort, or a peer on the message path). Also how it
//! ends: its error for a lost peer, its output, and giving back what it
//! claimed.

use std::time::{Duration, Instant};

use kungfu_topology::{Rank, Strategy};
use kungfu_transport::shm::lane::HostLanes;
use kungfu_transport::{Arrival, FrameKind, PeerSet, Transport, TransportError};

use super::{bits, Fast, FastOp};
use crate::failure::{self, OpId};
use crate::session::OpOutput;
use crate::timeline::peer_row;
use crate::CollectiveError;

/// How often an op checks that the ranks it waits for are alive.
pub(super) const LIVENESS_EVERY: Duration = Duration::from_millis(2);

impl<T: Transport> Fast<T> {
    /// One op: posts what is unposted, claims what has come, and once
    /// everything is here computes the output.
    pub(super) fn step(
        &self,
        op: &mut FastOp<T>,
        timed: bool,
    ) -> Option<Result<OpOutput, CollectiveError>> {
        let l = &self.lanes;
        let mut moved = false;
        let r = (|| {
            let tail = op.norms_tail();
            let tail: &[u8] = tail.as_ref().map_or(&[], |t| t);
            for p in bits(op.unposted) {
                let post = op.split_post(p).or_else(|| op.contrib.clone());
                let posted = match (&op.mine, post) {
                    (Some(m), _) => l.post(p, op.lane_tag, op.digest, m),
                    (None, Some(r)) => op
                        .work
                        .read(r, |b| l.post_parts(p, op.lane_tag, op.digest, &[b, tail]))
                        .unwrap_or(Ok(false)),
                    (None, None) => Ok(true),
                };
                if posted.map_err(|e| (p, e))? {
                    op.unposted &= !(1 << p.0);
                    moved = true;
                    if let Some(tl) = &op.inner.config.timeline {
                        tl.mark(peer_row(p), "posted", "fast", Instant::now(), "");
                    }
                }
            }
            moved |= self.find_missing(op)?;
            Ok(())
        })();
        if let Err((peer, e)) = r {
            return Some(Err(op.lost(peer, e)));
        }
        let missing: u64 = bits(op.need)
            .filter(|p| op.found[p.idx()].is_none())
            .fold(0, |m, p| m | 1 << p.0);
        if missing == 0 && op.unposted == 0 && (op.large.is_some() || op.split.is_some()) {
            let t0 = Instant::now();
            let phase = op
                .large
                .as_ref()
                .map_or(op.split.unwrap_or(0), |g| u32::from(g.phase));
            let r = if op.split.is_some() {
                op.split_advance(l, self.others())
            } else {
                op.advance(l, self.others())
            };
            if let Some(tl) = &op.inner.config.timeline {
                tl.span(0, &format!("phase {phase}"), "fast", t0, Instant::now(), "");
            }
            op.moved = true;
            return match r {
                None => None,
                Some(Ok(())) => Some(Ok(op.output(self.t.version()))),
                Some(Err(e)) => Some(Err(e)),
            };
        }
        if missing == 0 && op.unposted == 0 {
            let t0 = Instant::now();
            let r = op.compute(l, self.t.version());
            if let Some(tl) = &op.inner.config.timeline {
                tl.span(0, "reduce", "fast", t0, Instant::now(), "");
            }
            return Some(r);
        }
        op.moved |= moved;
        if !timed {
            return None;
        }
        let now = Instant::now();
        if std::mem::take(&mut op.moved) {
            op.live.progress(now);
        }
        if now.duration_since(op.checked) >= LIVENESS_EVERY {
            op.checked = now;
            let set: PeerSet = bits(missing | op.unposted).collect();
            let lost = self.t.check_peers(&set).err().map(|e| {
                let peer = match &e {
                    TransportError::PeerLost { peer, .. } => *peer,
                    _ => bits(missing | op.unposted).next().unwrap_or(Rank(0)),
                };
                op.lost(peer, e)
            });
            if let Some(e) = lost.or_else(|| self.frames_for(op, missing | op.unposted)) {
                // What a peer published before it went is still read: it may
                // have come since this step looked (then the op goes on).
                let late = !op.remote_abort
                    && matches!(e, CollectiveError::PeerLost { .. })
                    && self.find_missing(op).unwrap_or(false);
                if !late {
                    return Some(Err(e));
                }
                op.moved = true;
            }
            if op.live.expired(now) {
                let waiting = bits(missing | op.unposted).collect();
                return Some(Err(op.live.timeout_error(op.id(), waiting)));
            }
        }
        None
    }

    /// Claims the contributions of the op's phase that have come since it
    /// last looked; whether any did.
    fn find_missing(&self, op: &mut FastOp<T>) -> Result<bool, (Rank, TransportError)> {
        let mut moved = false;
        for p in bits(op.need) {
            if op.found[p.idx()].is_none() {
                if let Some(f) = self.lanes.find(p, op.lane_tag).map_err(|e| (p, e))? {
                    op.found[p.idx()] = Some(f);
                    moved = true;
                    if let Some(tl) = &op.inner.config.timeline {
                        tl.mark(peer_row(p), "found", "fast", Instant::now(), "");
                    }
                }
            }
        }
        Ok(moved)
    }

    /// What frames of the op's tag say: a peer's abort (its error, with
    /// why), or a peer on the message path (its spec differs: a mismatch);
    /// or that the transport closed, or a rank the op waits for
    /// (`waiting`) is lost.
    fn frames_for(&self, op: &mut FastOp<T>, waiting: u64) -> Option<CollectiveError> {
        let me = self.t.rank();
        let all: PeerSet = (0..self.t.size() as u32)
            .map(Rank)
            .filter(|&r| r != me)
            .collect();
        match self.t.matcher().try_arrival(op.tag, &all)? {
            Ok(Arrival::Frame(f)) if f.header.kind == FrameKind::Abort => {
                // (a malformed abort is this rank's protocol error: it
                // aborts the others in turn)
                Some(
                    match failure::abort_error(op.id(), me, &op.spec, f.from, &f.payload) {
                        Ok(e) => {
                            op.remote_abort = true;
                            e
                        }
                        Err(e) => e,
                    },
                )
            }
            Ok(Arrival::Frame(f)) => {
                let detail = format!(
                    "rank {} sent a frame of this op: it runs it on the message path, so its op \
                     is not {} (the host fast path's, here)",
                    f.from.0,
                    op.spec.describe()
                );
                Some(failure::mismatch(op.id(), me, f.from, detail))
            }
            Ok(_) => None,
            Err(TransportError::Closed) => Some(CollectiveError::Closed),
            Err(e @ TransportError::PeerLost { peer, .. }) if waiting & (1 << peer.0) != 0 => {
                Some(op.lost(peer, e))
            }
            Err(_) => None,
        }
    }
}

impl<T: Transport> FastOp<T> {
    /// Which op its errors are of.
    pub(super) fn id(&self) -> OpId<'_> {
        OpId {
            name: &self.name,
            epoch: self.tag.epoch,
        }
    }

    /// The error for `peer`, which the op waits for, lost (`e` says how).
    pub(super) fn lost(&self, peer: Rank, e: TransportError) -> CollectiveError {
        failure::transport_error(self.id(), self.live.waited_lost(peer, e))
    }

    /// The op's output, once it is complete.
    pub(super) fn output(&mut self, version: kungfu_transport::ClusterVersion) -> OpOutput {
        let n = self.found.len();
        OpOutput {
            out: self.work.output(self.spec.output_range(self.lane_rank, n)),
            version,
            epoch: self.tag.epoch,
            strategy: Strategy::Clique,
            // summed in rank order: the same bits on every rank
            norms: self.norms.map(|n| {
                let [inputs, result] = n.total();
                crate::session::SqNorms { inputs, result }
            }),
        }
    }

    /// The op is over: its claimed contributions go back to their lanes
    /// and its buffer is no longer lent to peers.
    pub(super) fn end(&mut self, l: &HostLanes) {
        self.release(l);
        if let Some(g) = &self.large {
            g.give_back();
        }
    }

    /// Gives every claimed contribution back to its lane.
    pub(super) fn release(&mut self, l: &HostLanes) {
        for (p, f) in self.found.iter_mut().enumerate() {
            if let Some(f) = f.take() {
                l.release(Rank(p as u32), self.lane_tag, &f);
            }
        }
    }
}
