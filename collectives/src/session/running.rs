//! One op in flight: drives its plan over the transport until it is done.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{Rank, Strategy};
use kungfu_transport::{
    Frame, FrameKind, Header, Instant, OpTag, PeerSet, Transport, TransportError,
};
use tokio::task::JoinSet;

use super::driver::send_aborts;
use super::{Inner, OpOutput};
use crate::abort::{Abort, AbortReason};
use crate::dtype::scale_down;
use crate::plan::{Plan, Transmit};
use crate::pool::PooledBuf;
use crate::{CollectiveError, OpSpec, ReduceOp};

/// One op's frames from one peer: (frames, bytes, time of the last).
type Arrivals = (u64, u64, Duration);

/// One op in flight: its plan, buffer and identity.
pub(super) struct RunningOp {
    pub(super) name: Arc<str>,
    pub(super) spec: OpSpec,
    pub(super) tag: OpTag,
    pub(super) digest: u32,
    pub(super) work: PooledBuf,
    pub(super) plan: Plan,
    /// The op failed because a peer said so (not to be echoed back).
    pub(super) remote_abort: bool,
    /// The strategy it runs on (`AUTO` resolved).
    pub(super) strategy: Strategy,
    pub(super) started: std::time::Instant,
    /// Data frames received, by sender.
    pub(super) arrivals: Vec<Arrivals>,
}

/// Counts a data frame from `from` of `len` bytes.
fn arrived(arrivals: &mut [Arrivals], started: std::time::Instant, from: Rank, len: usize) {
    if let Some(a) = arrivals.get_mut(from.idx()) {
        a.0 += 1;
        a.1 += len as u64;
        a.2 = started.elapsed();
    }
}

type SendResult = Result<usize, (Rank, TransportError)>;

impl RunningOp {
    pub(super) async fn run<T: Transport>(
        &mut self,
        inner: &Inner<T>,
    ) -> Result<OpOutput, CollectiveError> {
        let t = &inner.transport;
        let (me, n) = (t.rank(), t.size());
        let needed = self.plan.peers().clone();
        // A lost rank fails the op now, unless we only receive from it and
        // some of its frames for this op are here (a broadcast root that
        // sent everything and closed): then the receives decide.
        t.check_peers(self.plan.targets())
            .and_then(|()| t.check_peers_for(self.tag, &needed))
            .map_err(|e| self.transport_error(e))?;
        // Aborts may come from any rank, so listen to all, and drop lost
        // ranks this op does not need as they are reported.
        let mut listen: PeerSet = (0..n as u32).map(Rank).filter(|&r| r != me).collect();
        let mut sends: JoinSet<SendResult> = JoinSet::new();
        let timeout = inner.config.op_timeout;
        let mut deadline = Instant::now() + timeout;
        let cap = inner.config.max_inflight_bytes;
        let mut inflight = 0usize;
        // Frames for backends that send from place once there is room
        // (shared memory with a full ring): kept in the working buffer, not
        // copied, and tried again between receives.
        let mut pending: VecDeque<Transmit> = VecDeque::new();
        loop {
            let mut k = 0;
            while k < pending.len() {
                let tx = &pending[k];
                let header = self.header(FrameKind::Data, tx.chunk, tx.step);
                if t.try_send_now(tx.to, header, &self.work[tx.range.clone()])
                    .map_err(|e| self.transport_error(e))?
                {
                    let tx = pending.remove(k).expect("k < len");
                    self.plan.handle_sent(tx.id, &mut self.work);
                    deadline = Instant::now() + timeout;
                } else {
                    k += 1;
                }
            }
            while inflight < cap || sends.is_empty() {
                let Some(tx) = self.plan.poll_transmit() else {
                    break;
                };
                let header = self.header(FrameKind::Data, tx.chunk, tx.step);
                // Straight from the buffer where the backend can (no copy
                // into an owned payload, no task).
                if t.try_send_now(tx.to, header, &self.work[tx.range.clone()])
                    .map_err(|e| self.transport_error(e))?
                {
                    self.plan.handle_sent(tx.id, &mut self.work);
                    continue;
                }
                if t.sends_in_place(tx.to) {
                    pending.push_back(tx);
                    continue;
                }
                let mut copy = inner.frames.take(tx.range.len());
                copy.as_mut().copy_from_slice(&self.work[tx.range.clone()]);
                let payload = copy.freeze();
                self.plan.handle_sent(tx.id, &mut self.work);
                let t = t.clone();
                let len = payload.len();
                inflight += len;
                sends.spawn(async move {
                    t.send(tx.to, header, payload)
                        .await
                        .map(|()| len)
                        .map_err(|e| (tx.to, e))
                });
            }
            if self.plan.is_done() {
                break;
            }
            // With frames pending, receive without sleeping (the backend
            // still spins, then comes back to retry them).
            let recv_deadline = if pending.is_empty() {
                deadline
            } else {
                Instant::now()
            };
            tokio::select! {
                Some(joined) = sends.join_next(), if !sends.is_empty() => {
                    inflight -= self.check_send(joined)?;
                    deadline = Instant::now() + timeout;
                }
                r = t.recv_in_place(self.tag, &listen, recv_deadline, {
                    // Frames the plan can take now are applied straight
                    // from the transport's memory (shm: the ring); anything
                    // else (aborts, other digests, frames ahead of their
                    // dependencies) comes back owned and goes the long way.
                    let (plan, work, digest) = (&mut self.plan, &mut *self.work, self.digest);
                    let (arrivals, started) = (&mut self.arrivals, self.started);
                    move |from: Rank, h: &Header, parts: &[&[u8]]| {
                        let taken = h.kind == FrameKind::Data
                            && h.digest == digest
                            && matches!(plan.try_apply(from, h.chunk, h.step, parts, work), Ok(true));
                        if taken {
                            arrived(arrivals, started, from, parts.iter().map(|p| p.len()).sum());
                        }
                        taken
                    }
                }) => match r {
                    Ok(None) => deadline = Instant::now() + timeout,
                    Ok(Some(frame)) => {
                        deadline = Instant::now() + timeout;
                        self.handle_frame(inner, frame)?;
                    }
                    // A lost peer this op does not need, or no longer needs
                    // (everything it owed us arrived before its connection
                    // closed; sends still owed to it fail on their own), is
                    // no reason to fail.
                    Err(TransportError::PeerLost { peer, .. })
                        if !needed.contains(peer) || !self.plan.waiting_for().contains(&peer) =>
                    {
                        listen.remove(peer);
                    }
                    Err(TransportError::Timeout { .. })
                        if !pending.is_empty() && Instant::now() < deadline => {}
                    Err(TransportError::Timeout { .. }) => {
                        return Err(CollectiveError::Timeout {
                            name: self.name.clone(),
                            epoch: self.tag.epoch,
                            after: timeout,
                            waiting: self.plan.waiting_for(),
                        });
                    }
                    Err(e) => return Err(self.transport_error(e)),
                }
            }
        }
        // Complete only once every frame is handed to the transport, so a
        // caller that shuts down after the last op loses nothing.
        loop {
            match tokio::time::timeout_at(deadline, sends.join_next()).await {
                Ok(Some(joined)) => {
                    self.check_send(joined)?;
                }
                Ok(None) => break,
                Err(_) => {
                    return Err(CollectiveError::Timeout {
                        name: self.name.clone(),
                        epoch: self.tag.epoch,
                        after: timeout,
                        waiting: Vec::new(),
                    })
                }
            }
        }
        let range = self.spec.output_range(me, n);
        if let (Some(ReduceOp::Avg), Some(r)) = (self.spec.kind.reduce_op(), &range) {
            scale_down(self.spec.dtype, &mut self.work[r.clone()], n);
        }
        Ok(OpOutput {
            work: std::mem::replace(&mut self.work, PooledBuf::unpooled(Vec::new())),
            range,
            version: inner.transport.version(),
            epoch: self.tag.epoch,
            strategy: self.strategy,
        })
    }

    fn header(&self, kind: FrameKind, chunk: u32, step: u16) -> Header {
        Header {
            kind,
            tag: self.tag,
            chunk,
            step,
            digest: self.digest,
            len: 0,
        }
    }

    /// The bytes a finished send carried, or its error.
    fn check_send(
        &self,
        joined: Result<SendResult, tokio::task::JoinError>,
    ) -> Result<usize, CollectiveError> {
        match joined {
            Ok(Ok(len)) => Ok(len),
            Ok(Err((_, e))) => Err(self.transport_error(e)),
            Err(e) => Err(CollectiveError::Transport {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                source: TransportError::Handshake {
                    peer: None,
                    addr: String::new(),
                    reason: format!("send task failed: {e}"),
                },
            }),
        }
    }

    fn transport_error(&self, e: TransportError) -> CollectiveError {
        match e {
            TransportError::PeerLost { peer, .. } => CollectiveError::PeerLost {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                peer,
                source: e,
            },
            TransportError::Closed => CollectiveError::Closed,
            e => CollectiveError::Transport {
                name: self.name.clone(),
                epoch: self.tag.epoch,
                source: e,
            },
        }
    }

    fn handle_frame<T: Transport>(
        &mut self,
        inner: &Inner<T>,
        f: Frame,
    ) -> Result<(), CollectiveError> {
        let me = inner.transport.rank();
        if f.header.kind == FrameKind::Data {
            arrived(&mut self.arrivals, self.started, f.from, f.payload.len());
        }
        match f.header.kind {
            FrameKind::Abort => Err(match Abort::decode(&f.payload) {
                Ok(a) => {
                    self.remote_abort = true;
                    a.to_error(&self.name, self.tag.epoch, me, &self.spec)
                }
                Err(why) => CollectiveError::Protocol {
                    name: self.name.clone(),
                    epoch: self.tag.epoch,
                    peer: f.from,
                    reason: format!("malformed abort frame: {why}"),
                },
            }),
            FrameKind::Data if f.header.digest != self.digest => {
                Err(CollectiveError::Mismatch {
                    name: self.name.clone(),
                    epoch: self.tag.epoch,
                    ranks: vec![me, f.from],
                    detail: format!(
                        "rank {} sent a frame for a different op spec (digest {:08x}); rank {} has {} (digest {:08x})",
                        f.from.0, f.header.digest, me.0, self.spec.describe(), self.digest
                    ),
                })
            }
            FrameKind::Data => {
                let (chunk, step) = (f.header.chunk, f.header.step);
                self.plan
                    .handle_frame(f.from, chunk, step, f.payload, &mut self.work)
                    .map_err(|e| CollectiveError::Protocol {
                            name: self.name.clone(),
                            epoch: self.tag.epoch,
                            peer: f.from,
                            reason: e.to_string(),
                    })
            }
        }
    }

    /// Tells every other rank that this op failed here and why, so none
    /// waits for its deadline. Errors that came from a peer's abort are not
    /// echoed; local-only errors (invalid arguments, shutdown) concern no one
    /// else.
    pub(super) fn notify_failure<T: Transport>(&self, inner: &Inner<T>, e: &CollectiveError) {
        let me = inner.transport.rank();
        if self.remote_abort {
            return;
        }
        let (reason, offender) = match e {
            CollectiveError::Mismatch { ranks, .. } => {
                (AbortReason::Mismatch, ranks.get(1).copied().unwrap_or(me))
            }
            CollectiveError::Protocol { peer, .. } => (AbortReason::Protocol, *peer),
            CollectiveError::PeerLost { peer, .. } => (AbortReason::PeerLost, *peer),
            CollectiveError::Timeout { waiting, .. } => {
                (AbortReason::Timeout, waiting.first().copied().unwrap_or(me))
            }
            _ => return,
        };
        let abort = Abort::new(reason, me, offender, &self.spec);
        send_aborts(inner, self.tag, self.digest, &abort);
    }
}
