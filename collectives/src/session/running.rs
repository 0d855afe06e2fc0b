//! The async driver of one op: feeds its [`OpMachine`] what the transport
//! reports and does what the machine asks. Every decision (window, digest,
//! aborts, deadline, lost peers) is the machine's; this file only moves
//! bytes and reads the clock, choosing by the wire's [`Caps`] how:
//!
//! - a send is injected straight from the working memory where the wire
//!   can (`inject`), else kept there until it can (`holds_sends`), else
//!   sent from the range itself, lent to the wire until it has written it
//!   (`borrows_sends`), else from a copy;
//! - a receive is posted into its range of the working memory where the
//!   wire does not lend frames in place (`lends`) or may only deliver the
//!   frame into a posted receive (above `eager_max`; a reducing receive
//!   then goes to scratch memory);
//! - sends in flight are futures this task polls, not a task each.

use std::collections::VecDeque;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use kungfu_topology::Rank;
use kungfu_transport::wire::Caps;
use kungfu_transport::{Arrival, Header, Instant, RecvKey, Region, Transport, TransportError};

use super::driver::send_abort;
use super::opmem::{lends_to, OpMem};
use super::{Inner, OpOutput};
use crate::op::{OpEvent, OpMachine, Transmit};
use crate::plan::{ActionId, PlanError};
use crate::timeline::OpTrace;
use crate::CollectiveError;

/// One op in flight: its machine and working memory (see [`OpMem`]).
pub(super) struct RunningOp {
    pub(super) m: OpMachine,
    pub(super) work: OpMem,
}

/// Caps of a transport that declares none: every send from a copy.
const COPY: Caps = Caps {
    name: "",
    max_frame: usize::MAX,
    inject: false,
    holds_sends: false,
    polled: false,
    lends: true,
    needs_registration: false,
    borrows_sends: false,
    eager_max: usize::MAX,
};

/// A frame kept in the working buffer until a shared-memory ring has room.
type Pending = (ActionId, Rank, Header, Range<usize>);

type SendFuture<'a> = Pin<Box<dyn Future<Output = Result<(), TransportError>> + Send + 'a>>;

/// Sends in flight, polled by the op's own task.
#[derive(Default)]
struct Sends<'a>(Vec<(ActionId, SendFuture<'a>)>);

impl<'a> Sends<'a> {
    fn push(
        &mut self,
        id: ActionId,
        f: impl Future<Output = Result<(), TransportError>> + Send + 'a,
    ) {
        self.0.push((id, Box::pin(f)));
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The next send that completed.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<(ActionId, Result<(), TransportError>)> {
        for i in 0..self.0.len() {
            if let Poll::Ready(r) = self.0[i].1.as_mut().poll(cx) {
                let (id, _) = self.0.swap_remove(i);
                return Poll::Ready((id, r));
            }
        }
        Poll::Pending
    }
}

/// Receives posted into scratch memory (reducing receives above a wire's
/// eager limit): the frame is reduced from there when it lands.
#[derive(Default)]
struct Scratch(Vec<(RecvKey, Arc<Region>)>);

impl Scratch {
    /// The frame `header` from `from` landed: in scratch memory (then it is
    /// reduced from there, as a frame), or in the op's own range.
    fn landed(&mut self, m: &mut OpMachine, from: Rank, header: &Header, work: &mut OpMem) {
        let key = RecvKey::of(from, header);
        let i = self.0.iter().position(|(k, _)| Some(*k) == key);
        match i.map(|i| self.0.swap_remove(i).1) {
            Some(s) => m.handle_frame(Instant::now(), from, header, landed_payload(s), work),
            None => m.handle_landed(Instant::now(), from, header, work),
        }
    }
}

/// How long a failed op waits for its aborts to reach the wire before it
/// reports the failure.
const ABORT_FLUSH: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits for every task of `tasks`.
async fn futures_join(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        let _ = t.await;
    }
}

/// The payload of a frame that landed in `scratch`, owned.
fn landed_payload(scratch: Arc<Region>) -> Bytes {
    match scratch.read(0..scratch.len()) {
        Ok(mem) => Bytes::from_owner(mem),
        Err(_) => Bytes::new(),
    }
}

impl RunningOp {
    pub(super) async fn run<T: Transport>(
        &mut self,
        inner: &Inner<T>,
        t: &Arc<T>,
    ) -> Result<OpOutput, CollectiveError> {
        let (m, work) = (&mut self.m, &mut self.work);
        // Lend ranges only where a wire of the op's peers needs them.
        let lend = work.is_lent()
            || m.needed()
                .iter()
                .any(|p| t.peer_caps(p).is_some_and(|c| lends_to(&c)));
        if lend {
            work.lend();
            m.post_receives();
        }
        // A lost rank fails the op now if the op would wait for it (or
        // for anyone, when this rank's output depends on it), unless some
        // of its frames for this op are here (a broadcast root that sent
        // everything and closed): then the receives decide. A send to a
        // lost rank fails on its own. The error names the first rank lost.
        match t.lost_for(m.tag(), &m.listening().clone()) {
            Ok(lost) => {
                for e in lost {
                    if let TransportError::PeerLost { peer, .. } = e {
                        m.handle_peer_lost(Instant::now(), peer, e);
                    }
                }
            }
            Err(e) => m.handle_error(e),
        }
        let mut listen = m.listening().clone();
        let mut trace = inner.config.timeline.as_ref().map(OpTrace::new);
        let mut sends = Sends::default();
        let mut scratch = Scratch::default();
        // Frames for backends that send from place once there is room
        // (shared memory with a full ring): kept in the working buffer, not
        // copied, and tried again between receives.
        let mut pending: VecDeque<Pending> = VecDeque::new();
        let mut aborts = Vec::new();
        let event = loop {
            let mut k = 0;
            while k < pending.len() {
                let (id, to, header, ref range) = pending[k];
                let Some(r) = work.read(range.clone(), |b| t.try_send_now(to, header, b)) else {
                    m.handle_internal(PlanError::Busy {
                        range: range.clone(),
                    });
                    break;
                };
                match r {
                    Ok(false) => k += 1,
                    r => {
                        if let (Some(tr), Ok(true)) = (&trace, &r) {
                            tr.sent_now(to, &header, range.len());
                        }
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
                        let Some(r) = work.read(range.clone(), |b| t.try_send_now(to, header, b))
                        else {
                            m.handle_internal(PlanError::Busy { range });
                            break;
                        };
                        // Asked only for a frame that was not injected.
                        let caps = match r {
                            Ok(false) => t.peer_caps(to).unwrap_or(COPY),
                            _ => COPY,
                        };
                        let lent = match r {
                            Ok(false) if caps.borrows_sends => work.share(range.clone()),
                            _ => None,
                        };
                        match (r, lent) {
                            (Ok(false), _) if caps.holds_sends => {
                                pending.push_back((id, to, header, range))
                            }
                            // The range is the wire's until the send is done.
                            (Ok(false), Some(mem)) => {
                                if let Some(tr) = &mut trace {
                                    tr.send(id, to, &header, range.len());
                                }
                                sends.push(id, t.send_mem(to, header, mem))
                            }
                            (Ok(false), None) => {
                                let mut copy = inner.pool.take(range.len());
                                let copied =
                                    work.read(range.clone(), |b| copy.as_mut().copy_from_slice(b));
                                if copied.is_none() {
                                    m.handle_internal(PlanError::Busy { range });
                                    break;
                                }
                                m.handle_copied(id, work);
                                if let Some(tr) = &mut trace {
                                    tr.send(id, to, &header, range.len());
                                }
                                sends.push(id, t.send(to, header, copy.freeze()));
                            }
                            (r, _) => {
                                if let (Some(tr), Ok(true)) = (&trace, &r) {
                                    tr.sent_now(to, &header, range.len());
                                }
                                m.handle_sent(Instant::now(), id, r.map(drop), work)
                            }
                        }
                    }
                    Transmit::Abort {
                        to,
                        header,
                        payload,
                    } => aborts.extend(send_abort(inner, t, to, header, payload)),
                }
            }
            // A receive whose frame had come lands as it is posted, which
            // may make sends ready: hand them out before waiting.
            let mut landed_now = false;
            while let Some(r) = lend.then(|| m.poll_recv()).flatten() {
                let Some(caps) = t.peer_caps(r.from) else {
                    continue;
                };
                let rendezvous = r.range.len() > caps.eager_max;
                let key = RecvKey {
                    tag: m.tag(),
                    from: r.from,
                    chunk: r.chunk,
                    step: r.step,
                };
                let posted = if r.reduce && rendezvous {
                    let mut buf = inner.pool.take_vec(r.range.len());
                    buf.vec_mut().resize(r.range.len(), 0);
                    let region = Region::from_pooled(buf);
                    let mem = region.write(0..r.range.len()).expect("a new region");
                    scratch.0.push((key, region));
                    t.post_recv(key, mem)
                } else if !r.reduce && (rendezvous || !caps.lends) {
                    // The frame lands where it belongs.
                    match work.share_mut(r.range.clone()) {
                        Some(mem) => t.post_recv(key, mem),
                        None => {
                            m.handle_internal(PlanError::Busy { range: r.range });
                            break;
                        }
                    }
                } else {
                    continue;
                };
                match posted {
                    Ok(None) => {}
                    Ok(Some(header)) => {
                        landed_now = true;
                        scratch.landed(m, r.from, &header, work);
                    }
                    Err(e) => m.handle_error(e),
                }
            }
            if let Some(e) = m.poll_event(work) {
                break e;
            }
            if landed_now {
                continue;
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
                // Sends first: a send just handed out starts (reaches its
                // wire's queue) on its first poll, here, before this task
                // waits for anything.
                biased;
                (id, r) = std::future::poll_fn(|cx| sends.poll_next(cx)), if !sends.is_empty() => {
                    if let Some(tr) = &mut trace {
                        tr.sent(id);
                    }
                    m.handle_sent(Instant::now(), id, r, work)
                }
                // Frames the machine can take now are applied straight from
                // the transport's memory (shm: the ring); posted ones land
                // in the working memory; anything else comes back owned.
                r = t.recv_in_place(tag, &listen, recv_deadline, |from: Rank, h: &Header, parts: &[&[u8]]| {
                    let t0 = trace.is_some().then(std::time::Instant::now);
                    let applied = m.try_apply(Instant::now(), from, h, parts, work);
                    if let (Some(tr), Some(t0), true) = (&trace, t0, applied) {
                        tr.recv(from, h, h.len as usize, "in place", t0);
                    }
                    applied
                }) => match r {
                    Ok(Arrival::Applied) => {}
                    Ok(Arrival::Frame(f)) => {
                        let t0 = std::time::Instant::now();
                        let len = f.payload.len();
                        m.handle_frame(Instant::now(), f.from, &f.header, f.payload, work);
                        if let Some(tr) = &trace {
                            tr.recv(f.from, &f.header, len, "owned", t0);
                        }
                    }
                    Ok(Arrival::Landed { from, header }) => {
                        let t0 = std::time::Instant::now();
                        scratch.landed(m, from, &header, work);
                        if let Some(tr) = &trace {
                            tr.recv(from, &header, header.len as usize, "landed", t0);
                        }
                    }
                    Err(e @ TransportError::PeerLost { peer, .. }) => {
                        m.handle_peer_lost(Instant::now(), peer, e);
                        listen.clone_from(m.listening());
                    }
                    Err(TransportError::Timeout { .. }) => m.handle_timeout(Instant::now()),
                    Err(e) => m.handle_error(e),
                }
            }
        };
        if !aborts.is_empty() {
            // So do the losses this rank found and has not told yet, and
            // the one it failed on, found here: a peer that closed its
            // links while this op needed it (not told otherwise, as it may
            // be a clean end) is lost to every rank, which a neighbour that
            // sees this rank exit next must not be blamed for.
            let me = t.rank();
            let mut notices = t.take_loss_notices();
            if let OpEvent::Failed(CollectiveError::PeerLost {
                peer,
                source: TransportError::PeerLost { reason, .. },
                ..
            }) = &event
            {
                if !reason.starts_with("reported lost by") {
                    notices.push(t.loss_notice(*peer, reason));
                }
            }
            for (header, payload) in notices {
                for to in (0..t.size() as u32).map(Rank).filter(|&r| r != me) {
                    aborts.extend(send_abort(inner, t, to, header, payload.clone()));
                }
            }
            // The aborts reach the wire before the caller hears of the
            // failure (see `send_abort`); a peer that does not take them
            // soon is not waited for.
            let bound = inner.config.op_timeout.min(ABORT_FLUSH);
            let _ = tokio::time::timeout(bound, futures_join(aborts)).await;
        }
        match event {
            OpEvent::Done => Ok(OpOutput {
                out: self.work.output(self.m.output_range()),
                version: t.version(),
                epoch: self.m.tag().epoch,
                strategy: self.m.strategy(),
                norms: None,
            }),
            // A loss heard of in an abort names where the lost rank ran.
            OpEvent::Failed(CollectiveError::PeerLost {
                name,
                epoch,
                peer,
                source: TransportError::PeerLost { peer: p, reason },
            }) => Err(CollectiveError::PeerLost {
                name,
                epoch,
                peer,
                source: TransportError::PeerLost {
                    peer: p,
                    reason: t.matcher().locate(p, reason),
                },
            }),
            OpEvent::Failed(e) => Err(e),
        }
    }
}
