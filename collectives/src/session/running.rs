//! The async driver of one op: feeds its [`OpMachine`] what the transport
//! reports and does what the machine asks. Every decision (window, digest,
//! aborts, deadline, lost peers) is the machine's; this file only moves
//! bytes and reads the clock.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use kungfu_topology::Rank;
use kungfu_transport::{Arrival, Header, Instant, Mem, RecvKey, Region, Transport, TransportError};
use tokio::task::JoinSet;

use super::driver::send_abort;
use super::output::Output;
use super::{Inner, OpOutput};
use crate::op::{OpEvent, OpMachine, Transmit};
use crate::plan::{ActionId, PlanError};
use crate::pool::PooledBuf;
use crate::CollectiveError;

/// One op in flight: its machine and working memory. Ranges of the memory
/// are lent to the transport while receives are posted into them, so it is
/// a [`Region`], shared range by range, not a slice.
pub(super) struct RunningOp {
    pub(super) m: OpMachine,
    pub(super) work: Arc<Region>,
    /// The caller's memory ([`super::Session::submit_in`]), not a pooled
    /// buffer: the output stays in it.
    pub(super) shared: bool,
}

/// `range` of the working memory, to send from.
fn read(m: &mut OpMachine, work: &Arc<Region>, range: Range<usize>) -> Option<Mem> {
    match work.read(range.clone()) {
        Ok(mem) => Some(mem),
        Err(_) => {
            // Only a plan that sends a range it also receives into at the
            // same time could get here.
            m.handle_internal(PlanError::Busy { range });
            None
        }
    }
}

/// A frame kept in the working buffer until a shared-memory ring has room.
type Pending = (ActionId, Rank, Header, Range<usize>);

impl RunningOp {
    pub(super) async fn run<T: Transport>(
        &mut self,
        inner: &Inner<T>,
    ) -> Result<OpOutput, CollectiveError> {
        let t = &inner.transport;
        let (m, work) = (&mut self.m, &mut self.work);
        // A lost rank fails the op now, unless we only receive from it and
        // some of its frames for this op are here (a broadcast root that
        // sent everything and closed): then the receives decide.
        if let Err(e) = t
            .check_peers(m.targets())
            .and_then(|()| t.check_peers_for(m.tag(), m.needed()))
        {
            m.handle_error(e);
        }
        let mut listen = m.listening().clone();
        let mut sends: JoinSet<(ActionId, Result<(), TransportError>)> = JoinSet::new();
        // Frames for backends that send from place once there is room
        // (shared memory with a full ring): kept in the working buffer, not
        // copied, and tried again between receives.
        let mut pending: VecDeque<Pending> = VecDeque::new();
        let event = loop {
            let mut k = 0;
            while k < pending.len() {
                let (id, to, header, ref range) = pending[k];
                let Some(mem) = read(m, work, range.clone()) else {
                    break;
                };
                match t.try_send_now(to, header, mem.as_slice()) {
                    Ok(false) => k += 1,
                    r => {
                        drop(mem);
                        pending.remove(k);
                        m.handle_sent(Instant::now(), id, r.map(drop), work);
                    }
                }
            }
            while let Some(tx) = m.poll_transmit() {
                match tx {
                    Transmit::Data {
                        id,
                        to,
                        header,
                        range,
                    } => {
                        let Some(mem) = read(m, work, range.clone()) else {
                            break;
                        };
                        // Straight from the buffer where the backend can
                        // (no copy into an owned payload, no task).
                        match t.try_send_now(to, header, mem.as_slice()) {
                            Ok(false) if t.sends_in_place(to) => {
                                pending.push_back((id, to, header, range))
                            }
                            Ok(false) => {
                                let mut copy = inner.pool.take(range.len());
                                copy.as_mut().copy_from_slice(mem.as_slice());
                                drop(mem);
                                m.handle_copied(id, work);
                                let (t, payload) = (t.clone(), copy.freeze());
                                sends.spawn(async move { (id, t.send(to, header, payload).await) });
                            }
                            r => {
                                drop(mem);
                                m.handle_sent(Instant::now(), id, r.map(drop), work)
                            }
                        }
                    }
                    Transmit::Abort {
                        to,
                        header,
                        payload,
                    } => send_abort(inner, to, header, payload),
                }
            }
            // Receives whose range is free: the wire writes their frames
            // straight into the working memory.
            while let Some(r) = m.poll_recv() {
                if !t.posts_from(r.from) {
                    continue;
                }
                let key = RecvKey {
                    tag: m.tag(),
                    from: r.from,
                    chunk: r.chunk,
                    step: r.step,
                };
                let posted = match work.write(r.range.clone()) {
                    Ok(mem) => t.post_recv(key, mem),
                    Err(_) => {
                        m.handle_internal(PlanError::Busy { range: r.range });
                        break;
                    }
                };
                match posted {
                    Ok(None) => {}
                    Ok(Some(header)) => m.handle_landed(Instant::now(), r.from, &header, work),
                    Err(e) => m.handle_error(e),
                }
            }
            if let Some(e) = m.poll_event(work) {
                break e;
            }
            let deadline = m.poll_timeout().expect("a running op has a deadline");
            // With frames pending, receive without sleeping (the backend
            // still spins, then comes back to retry them).
            let recv_deadline = if pending.is_empty() {
                deadline
            } else {
                Instant::now()
            };
            let tag = m.tag();
            tokio::select! {
                Some(joined) = sends.join_next(), if !sends.is_empty() => match joined {
                    Ok((id, r)) => m.handle_sent(Instant::now(), id, r, work),
                    Err(e) => m.handle_error(TransportError::Handshake {
                        peer: None,
                        addr: String::new(),
                        reason: format!("send task failed: {e}"),
                    }),
                },
                // Frames the machine can take now are applied straight from
                // the transport's memory (shm: the ring); posted ones land
                // in the working memory; anything else comes back owned.
                r = t.recv_in_place(tag, &listen, recv_deadline, |from: Rank, h: &Header, parts: &[&[u8]]| {
                    m.try_apply(Instant::now(), from, h, parts, work)
                }) => match r {
                    Ok(Arrival::Applied) => {}
                    Ok(Arrival::Frame(f)) => m.handle_frame(Instant::now(), f.from, &f.header, f.payload, work),
                    Ok(Arrival::Landed { from, header }) => m.handle_landed(Instant::now(), from, &header, work),
                    Err(e @ TransportError::PeerLost { peer, .. }) => {
                        m.handle_peer_lost(Instant::now(), peer, e);
                        listen.clone_from(m.listening());
                    }
                    Err(TransportError::Timeout { .. }) => m.handle_timeout(Instant::now()),
                    Err(e) => m.handle_error(e),
                }
            }
        };
        match event {
            OpEvent::Done => Ok(OpOutput {
                out: self.output(),
                version: inner.transport.version(),
                epoch: self.m.tag().epoch,
                strategy: self.m.strategy(),
            }),
            OpEvent::Failed(e) => Err(e),
        }
    }
}

impl RunningOp {
    /// Where a finished op's output is: a pooled working buffer taken back
    /// (no copy: at the end no range of it is lent out, so the op holds
    /// it alone), or a read share of the caller's memory.
    fn output(&mut self) -> Output {
        let range = self.m.output_range();
        if self.shared {
            return Output::Shared(range.and_then(|r| self.work.read(r).ok()));
        }
        let region = std::mem::replace(&mut self.work, Region::from_vec(Vec::new()));
        let buf = match Region::into_pooled(region) {
            Ok(b) => b,
            // Held elsewhere still (a share not yet dropped): copy it out.
            Err(region) => PooledBuf::unpooled(
                region
                    .read(0..region.len())
                    .map(|m| m.as_slice().to_vec())
                    .unwrap_or_default(),
            ),
        };
        Output::Owned(buf, range)
    }
}
