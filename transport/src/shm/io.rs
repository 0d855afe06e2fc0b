//! The threads and the polling that move frames through the rings: the
//! reader and writer threads of each ring, and the rings polled by a
//! receiving task itself.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::sync::oneshot;

use super::ring::{Ring, SENDER_CLOSED};
use super::ShmWire;
use crate::endpoint::{Matcher, Pump, CLOSED_BY_PEER};
use crate::pool::BufferPool;
use crate::wire::Apply;
use crate::{OpTag, PeerSet, TransportError, HEADER_LEN};

/// A reader thread leaves frames to the receiving tasks for this long after
/// they last polled the rings.
const DEFER_TO_POLLER: Duration = Duration::from_micros(300);

/// When a receiving task of this process last polled the inbound rings.
pub(super) struct PollClock {
    start: std::time::Instant,
    /// Nanoseconds after `start`.
    at: AtomicU64,
}

impl PollClock {
    pub(super) fn new() -> PollClock {
        PollClock {
            start: std::time::Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn touch(&self) {
        self.at.store(self.now(), Ordering::Relaxed);
    }

    /// No task polls any more (one went to sleep): readers take over now.
    fn clear(&self) {
        self.at.store(0, Ordering::Relaxed);
    }

    /// Time since the last poll (long if there was none).
    fn since(&self) -> Duration {
        match self.at.load(Ordering::Relaxed) {
            0 => Duration::MAX,
            at => Duration::from_nanos(self.now().saturating_sub(at)),
        }
    }
}

pub(super) enum WriterMsg {
    Frame(
        [u8; HEADER_LEN],
        Bytes,
        oneshot::Sender<Result<(), TransportError>>,
    ),
    Finish(oneshot::Sender<()>),
}

/// Runs a future to completion on this (non-runtime) thread.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// How an idle reader thread behaves.
#[derive(Clone)]
pub(super) struct ReadPolicy {
    pub(super) max_frame: usize,
    pub(super) frames: Arc<BufferPool>,
    /// Spin before sleeping (ranks have a core each).
    pub(super) eager: bool,
    pub(super) polled: Arc<PollClock>,
}

pub(super) fn read_loop(
    ring: &Ring,
    peer: Rank,
    matcher: &Matcher,
    stop: &AtomicBool,
    policy: &ReadPolicy,
) {
    let (max_frame, eager, polled) = (policy.max_frame, policy.eager, &policy.polled);
    loop {
        // Wait without the consumer lock, so receivers may take frames
        // themselves. The close flag before the data (see
        // `Consumer::read_exact`).
        let closed = ring.closed() & SENDER_CLOSED != 0;
        if !ring.has_data() {
            if closed {
                return matcher.fail_peer(peer, CLOSED_BY_PEER);
            }
            if let Err(why) = ring.wait_data(stop, eager) {
                return matcher.fail_peer(peer, why);
            }
            continue;
        }
        // A receiving task that polled the rings lately takes the frames
        // itself (applying them in place, with no copy): between two of its
        // receives it is busy reducing or sending, so leave them a while.
        let since = polled.since();
        if since < DEFER_TO_POLLER {
            if stop.load(Ordering::Acquire) {
                return;
            }
            ring.nap(DEFER_TO_POLLER - since);
            continue;
        }
        let frame = {
            let mut taking = ring.consumer();
            if !ring.has_data() {
                continue; // a receiver took it
            }
            match taking.read_frame(max_frame, stop, |len| policy.frames.take(len)) {
                Ok(frame) => frame,
                Err(e) => {
                    return matcher.fail_peer(peer, e.unwrap_or_else(|| CLOSED_BY_PEER.into()))
                }
            }
        };
        // The matcher may make us wait for space (back-pressure): this
        // thread stops reading the ring, and the sender stops when it fills.
        match block_on(matcher.deliver(peer, frame.0, frame.1.freeze())) {
            Ok(()) | Err(TransportError::StaleEpoch { .. }) => {}
            Err(_) => return,
        }
    }
}

impl ShmWire {
    /// As [`ShmWire::pump_all`], but a frame of `tag` from a rank in
    /// `from` is first lent in place to `apply`; if it consumes the frame,
    /// it leaves the ring with no copy, and this returns at once.
    pub(super) fn pump_for(&self, tag: OpTag, from: &PeerSet, apply: Apply<'_>) -> Pump {
        let mut res = Pump::Idle;
        for (peer, ring) in self.inbound.iter().enumerate() {
            let Some(ring) = ring else { continue };
            if !ring.has_data() {
                continue;
            }
            let Some(mut taking) = ring.try_consumer() else {
                continue;
            };
            let sender = Rank(peer as u32);
            // A corrupt ring or a bad header is left for the reader thread
            // to report.
            while let Ok(Some((header, p))) = taking.peek_frame(self.max_frame) {
                let len = header.len as usize;
                // len <= max_frame, which a configuration may set to anything
                let Some(whole) = HEADER_LEN.checked_add(len) else {
                    break;
                };
                if !p.holds(whole) {
                    break;
                }
                // A posted receive: copied from the ring into the op's
                // memory (before lending: the op must not write it).
                if self.matcher.has_posted()
                    && p.lend(HEADER_LEN, len, |parts| {
                        self.matcher.land_parts(sender, &header, parts)
                    }) == Some(true)
                {
                    p.consume(whole);
                    res = Pump::Moved;
                    continue;
                }
                if header.tag == tag
                    && from.contains(sender)
                    && p.lend(HEADER_LEN, len, |parts| apply(sender, &header, parts)) == Some(true)
                {
                    p.consume(whole);
                    self.lent.fetch_add(1, Ordering::Relaxed);
                    return Pump::Consumed;
                }
                if !self.matcher.has_room(len) {
                    break;
                }
                let mut payload = self.frames.take(len);
                if !p.peek(HEADER_LEN, payload.as_mut()) {
                    break;
                }
                p.consume(whole);
                match self.matcher.deliver_now(sender, header, payload.freeze()) {
                    Ok(()) | Err(TransportError::StaleEpoch { .. }) => res = Pump::Moved,
                    Err(_) => return res,
                }
            }
        }
        res
    }

    /// A receiving task starts polling the inbound rings: senders skip
    /// waking the reader threads. A frame published while a sender saw the
    /// flag set, and left in the ring when the poller stopped, is taken by
    /// the next receive or by the reader thread after its bounded nap
    /// (`DEFER_TO_POLLER`, at most `NAP`).
    pub(super) fn polling_started(&self) {
        self.polled.touch();
        if self.polling.fetch_add(1, Ordering::SeqCst) == 0 {
            self.set_polling(1);
        }
    }

    /// The end of a spin phase (also of a receive dropped mid-spin).
    pub(super) fn polling_stopped(&self) {
        // the clock counts from the end of a spin phase (a receive that
        // goes to sleep clears it afterwards)
        self.polled.touch();
        if self.polling.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.set_polling(0);
        }
    }

    /// A receiving task stops polling and will sleep until a reader thread
    /// delivers its frame: the readers must not wait for it any longer.
    pub(super) fn sleeping(&self) {
        self.polled.clear();
        for ring in self.inbound.iter().flatten() {
            if ring.has_data() {
                ring.wake_reader();
            }
        }
    }

    fn set_polling(&self, v: u32) {
        for ring in self.inbound.iter().flatten() {
            ring.set_polling(v);
        }
    }

    /// Moves every whole frame that is already in an inbound ring into the
    /// matcher, without waiting and without the reader threads (a ring
    /// whose reader is busy is skipped). Returns whether it moved any.
    pub(super) fn pump_all(&self) -> bool {
        let none = PeerSet::new();
        let tag = OpTag {
            epoch: self.matcher.epoch(),
            op: crate::OpId(0),
            seq: 0,
        };
        self.pump_for(tag, &none, &mut |_, _, _| false) != Pump::Idle
    }
}

pub(super) fn write_loop(
    ring: &Ring,
    peer: Rank,
    rx: &std_mpsc::Receiver<WriterMsg>,
    matcher: &Matcher,
    stop: &AtomicBool,
) {
    let mut lost: Option<TransportError> = None;
    loop {
        let msg = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(m) => m,
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match msg {
            WriterMsg::Frame(h, payload, done) => {
                if lost.is_none() {
                    let frame = ring.producer();
                    let r = frame
                        .write_all(&h, stop)
                        .and_then(|()| frame.write_all(&payload, stop));
                    if let Err(why) = r {
                        lost = Some(matcher.lose_writer(peer, why));
                    }
                }
                let _ = done.send(lost.clone().map_or(Ok(()), Err));
            }
            WriterMsg::Finish(done) => {
                ring.close(SENDER_CLOSED);
                let _ = done.send(());
                return;
            }
        }
    }
}
