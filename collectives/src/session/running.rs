//! The async driver of one op: feeds its [`OpMachine`] what the transport
//! reports and does what the machine asks. Every decision (window, digest,
//! aborts, deadline, lost peers) is the machine's; this file only moves
//! bytes and reads the clock.

use std::collections::VecDeque;
use std::ops::Range;

use kungfu_topology::Rank;
use kungfu_transport::{Header, Instant, Transport, TransportError};
use tokio::task::JoinSet;

use super::driver::send_abort;
use super::{Inner, OpOutput};
use crate::op::{OpEvent, OpMachine, Transmit};
use crate::plan::ActionId;
use crate::pool::PooledBuf;
use crate::CollectiveError;

/// One op in flight: its machine and working buffer.
pub(super) struct RunningOp {
    pub(super) m: OpMachine,
    pub(super) work: PooledBuf,
}

/// A frame kept in the working buffer until a shared-memory ring has room.
type Pending = (ActionId, Rank, Header, Range<usize>);

impl RunningOp {
    pub(super) async fn run<T: Transport>(
        &mut self,
        inner: &Inner<T>,
    ) -> Result<OpOutput, CollectiveError> {
        let t = &inner.transport;
        let (m, work) = (&mut self.m, &mut *self.work);
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
                match t.try_send_now(to, header, &work[range.clone()]) {
                    Ok(false) => k += 1,
                    r => {
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
                        // Straight from the buffer where the backend can
                        // (no copy into an owned payload, no task).
                        match t.try_send_now(to, header, &work[range.clone()]) {
                            Ok(false) if t.sends_in_place(to) => {
                                pending.push_back((id, to, header, range))
                            }
                            Ok(false) => {
                                let mut copy = inner.pool.take(range.len());
                                copy.as_mut().copy_from_slice(&work[range]);
                                m.handle_copied(id, work);
                                let (t, payload) = (t.clone(), copy.freeze());
                                sends.spawn(async move { (id, t.send(to, header, payload).await) });
                            }
                            r => m.handle_sent(Instant::now(), id, r.map(drop), work),
                        }
                    }
                    Transmit::Abort {
                        to,
                        header,
                        payload,
                    } => send_abort(inner, to, header, payload),
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
                // the transport's memory (shm: the ring); anything else comes
                // back owned.
                r = t.recv_in_place(tag, &listen, recv_deadline, |from: Rank, h: &Header, parts: &[&[u8]]| {
                    m.try_apply(Instant::now(), from, h, parts, work)
                }) => match r {
                    Ok(None) => {}
                    Ok(Some(f)) => m.handle_frame(Instant::now(), f.from, &f.header, f.payload, work),
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
                work: std::mem::replace(&mut self.work, PooledBuf::unpooled(Vec::new())),
                range: self.m.output_range(),
                version: inner.transport.version(),
                epoch: self.m.tag().epoch,
                strategy: self.m.strategy(),
            }),
            OpEvent::Failed(e) => Err(e),
        }
    }
}
