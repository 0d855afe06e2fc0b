//! The conformance suite: what every backend must do, checked the same way
//! for each (test code: it lives in kungfu-tests, not in kungfu-transport,
//! so no build of the library carries it).
//!
//! The cases, each one `#[tokio::test]` per backend:
//!
//! - [`exact_delivery`]: frames of many sizes (empty, odd, larger than a
//!   ring, larger than a socket read) arrive intact between every pair,
//!   through `recv` and through `recv_in_place`.
//! - [`in_place_delivery`]: frames lent in place, including frames that
//!   wrap a ring and so come in two pieces, one of which splits an element;
//!   a declined frame comes back owned.
//! - [`out_of_order`]: many tags interleaved, received in another order
//! - [`borrowed_sends`]: frames sent from a region's memory; a wire that
//!   borrows sends lets go of it before the send resolves
//!   than sent, from chosen peers or any, sequentially and concurrently.
//! - [`cancel_safety`]: receives dropped while they wait, before and after
//!   their frame arrived, lose nothing.
//! - [`retired_tags_become_strays`]: retiring a tag frees what it held;
//!   its queued and later frames become strays.
//! - [`stale_epochs`]: older epochs refused and counted, early frames of
//!   a newer one kept, the epoch never going back.
//! - [`lost_peer`]: a rank that vanishes fails the receives that name it
//!   (once its queued frames are taken) and the sends to it; others stay
//!   usable.
//! - [`back_pressure`]: a small budget bounds what a receiver holds,
//!   everything still arrives, and one frame larger than the budget passes.
//! - [`closed_endpoint`]: close delivers what was sent and returns by its
//!   linger; afterwards, and for operations pending at shutdown,
//!   everything fails with [`TransportError::Closed`](kungfu_transport::TransportError::Closed).
//! - [`bad_input`]: ranks out of range, itself, oversized frames: clear
//!   errors, no panic, the endpoint stays usable.
//! - [`posted_receives`]: receives posted into ranges of one region, of
//!   every size (frames that wrap a ring included), before and after their
//!   frames came, land intact and only in their range; a frame of another
//!   length does not land; retiring releases the range.
//! - [`posted_failures`]: posted receives under cancel, retire, an older
//!   epoch, a lost peer and a closed endpoint.
//!
//! # Adding a backend
//!
//! Implement [`Cluster`] (how to connect `n` ranks in this process, and
//! what the backend declares it does), then, in a test file of a crate
//! that depends on kungfu-tests and tokio (`rt-multi-thread`, `macros`):
//!
//! ```text
//! kungfu_tests::conformance_tests!(kungfu_tests::conformance::clusters::Tcp);
//! ```
//!
//! as `tests/tests/suite/conformance_tcp.rs` does. Every case has its own
//! cluster (fresh ports, ring names, cluster ids), so the cases run in
//! parallel, and each is bounded by [`CASE_LIMIT`].
//!
//! # Declared differences
//!
//! Where backends legitimately differ it is a declaration of the
//! [`Cluster`], checked both ways, never a silent skip:
//!
//! - [`Cluster::lends`]: shared memory lends frames in place; TCP and the
//!   in-memory network never do. A backend that declares lending must
//!   lend (and split a wrapped frame correctly); one that does not must
//!   never call the lending closure.
//! - [`Cluster::holds_sent_frames`]: a socket or a ring holds frames
//!   whose send finished while the receiver has no room; the in-memory
//!   network does not (a send to a full receiver waits). Where frames are
//!   held, they must arrive although the sender closed meanwhile; where
//!   not, the send must wait.
//!
//! # The surface under test
//!
//! The cases use only [`Cluster`], the methods of [`Transport`], and the
//! few readings of the endpoint's state in the `probe` functions of this
//! module (bytes held, frames refused, room, a non-waiting take). When the
//! trait changes, those are what move.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use kungfu_transport::mem::SeededRng;
use kungfu_transport::{Epoch, Frame, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport};

pub mod clusters;
mod delivery;
mod failures;
mod faults;
mod posted;

pub use delivery::{borrowed_sends, exact_delivery, in_place_delivery, out_of_order};
pub use failures::{bad_input, closed_endpoint, lost_peer};
pub use faults::{back_pressure, cancel_safety, retired_tags_become_strays, stale_epochs};
pub use posted::{posted_failures, posted_receives};

/// A bound on each whole case (a backend that hangs fails, it does not
/// stall the run).
pub const CASE_LIMIT: Duration = Duration::from_secs(30);
/// The deadline of anything that must happen (a frame, an error).
const WAIT: Duration = Duration::from_secs(10);

/// How a case wants its cluster set up.
#[derive(Clone, Debug)]
pub struct ConformanceConfig {
    /// The epoch every endpoint connects at.
    pub epoch: Epoch,
    /// The matcher's budget of unmatched bytes (back-pressure).
    pub mailbox_bytes: usize,
    /// The largest frame payload.
    pub max_frame: usize,
    /// Data bytes of a shared-memory ring, for backends that have one:
    /// small, so that frames wrap and stream through.
    pub ring_bytes: usize,
    /// How long a receive keeps polling (and may lend) before it sleeps.
    pub spin: Duration,
}

impl Default for ConformanceConfig {
    fn default() -> ConformanceConfig {
        ConformanceConfig {
            epoch: Epoch(0),
            mailbox_bytes: 64 << 20,
            max_frame: 16 << 20,
            ring_bytes: 4096,
            spin: Duration::from_micros(50),
        }
    }
}

impl ConformanceConfig {
    /// A matcher budget of `budget` bytes (back-pressure).
    fn with_budget(budget: usize) -> ConformanceConfig {
        ConformanceConfig {
            mailbox_bytes: budget,
            ..ConformanceConfig::default()
        }
    }

    /// Receives keep polling (for 2 s), so they find their frames in a
    /// ring and take them from there (lent, or landed where posted).
    fn polling() -> ConformanceConfig {
        ConformanceConfig {
            spin: Duration::from_secs(2),
            ..ConformanceConfig::default()
        }
    }
}

/// A backend under test: how to connect a cluster of it in this process,
/// and what it declares about itself.
pub trait Cluster: 'static {
    type T: Transport;

    /// The backend's name, for failure messages.
    fn name() -> &'static str;

    /// `n` connected endpoints, endpoint `i` being rank `i`, set up as
    /// `cfg` says. Panics if they cannot connect (a test fixture).
    fn connect(n: usize, cfg: ConformanceConfig) -> impl Future<Output = Vec<Arc<Self::T>>>;

    /// Whether a `recv_in_place` at rank `to` of a cluster of `n` lends the
    /// frames of `from` in place (declared, and checked both ways).
    fn lends(n: usize, from: Rank, to: Rank) -> bool {
        let _ = (n, from, to);
        false
    }

    /// Whether a send may finish while its receiver has no room (its
    /// budget spent): the frame then waits in flight (a ring, a socket),
    /// and must still arrive, even if the sender closes. Default: true.
    /// The in-memory network has nowhere to hold a frame: its send
    /// finishes only into the receiver's matcher.
    fn holds_sent_frames() -> bool {
        true
    }

    /// Makes the rank of `t` vanish as a crashed process would: its peers
    /// must see it lost. Default: [`Transport::shutdown`].
    fn abandon(t: &Self::T) {
        t.shutdown();
    }
}

/// Runs `case` of backend `C` within [`CASE_LIMIT`].
pub async fn run<C: Cluster>(case: &str, body: impl Future<Output = ()>) {
    if tokio::time::timeout(CASE_LIMIT, body).await.is_err() {
        panic!("{}: {case} did not finish within {CASE_LIMIT:?}", C::name());
    }
}

/// One `#[tokio::test]` per case of the suite for the [`Cluster`] given.
#[macro_export]
macro_rules! conformance_tests {
    ($cluster:ty) => {
        $crate::conformance_tests!(@each $cluster;
            exact_delivery in_place_delivery out_of_order cancel_safety
            retired_tags_become_strays stale_epochs lost_peer back_pressure
            closed_endpoint bad_input posted_receives posted_failures borrowed_sends);
    };
    (@each $cluster:ty; $($case:ident)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                $crate::conformance::run::<$cluster>(
                    stringify!($case),
                    $crate::conformance::$case::<$cluster>(),
                )
                .await;
            }
        )*
    };
}

// ---- The probes: the only readings of endpoint state --------------------

/// Bytes of unmatched payload `t` holds.
fn queued<T: Transport>(t: &T) -> usize {
    t.matcher().queued_bytes()
}

/// Frames `t` refused for an older epoch.
fn refused<T: Transport>(t: &T) -> u64 {
    t.matcher().refused()
}

/// Whether `t` would take `len` more unmatched bytes now.
fn has_room<T: Transport>(t: &T, len: usize) -> bool {
    t.matcher().has_room(len)
}

/// A frame of `tag` from `from` that `t` holds now, without waiting.
fn held<T: Transport>(t: &T, tag: OpTag, from: &PeerSet) -> Option<Frame> {
    t.matcher().try_recv(tag, from).and_then(Result::ok)
}

// ---- Frames and what must arrive ---------------------------------------

fn soon() -> Instant {
    Instant::now() + WAIT
}

fn tag(epoch: Epoch, op: u64, seq: u32) -> OpTag {
    OpTag {
        epoch,
        op: OpId(op),
        seq,
    }
}

fn rank(i: usize) -> Rank {
    Rank(i as u32)
}

fn one(r: Rank) -> PeerSet {
    [r].into_iter().collect()
}

/// Every rank of `0..n` but `me`.
fn others(n: usize, me: Rank) -> Vec<Rank> {
    (0..n).map(rank).filter(|&r| r != me).collect()
}

/// One frame a case sends: its payload a function of where it goes and
/// what it is, so a byte out of place is found.
#[derive(Clone, Debug)]
struct Msg {
    from: Rank,
    to: Rank,
    header: Header,
    payload: Bytes,
}

impl Msg {
    fn new(from: Rank, to: Rank, tag: OpTag, chunk: u32, len: usize) -> Msg {
        let header = Header {
            // the kind, step and digest ride through untouched
            kind: if chunk % 5 == 4 {
                FrameKind::Abort
            } else {
                FrameKind::Data
            },
            tag,
            chunk,
            step: (chunk % 7) as u16,
            digest: 0x5eed_0000 ^ chunk ^ (from.0 << 8),
            len: len as u64,
        };
        let seed = [
            from.0 as u64,
            to.0 as u64,
            tag.op.0,
            tag.seq as u64,
            chunk as u64,
        ]
        .iter()
        .fold(tag.epoch.0 as u64, |a, &x| {
            a.wrapping_mul(0x100_0000_01b3).wrapping_add(x)
        });
        Msg {
            from,
            to,
            header,
            payload: pattern(seed, len),
        }
    }

    fn key(&self) -> (Rank, OpTag, u32) {
        (self.from, self.header.tag, self.header.chunk)
    }
}

fn pattern(seed: u64, len: usize) -> Bytes {
    let mut rng = SeededRng::new(seed);
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        v.extend_from_slice(&rng.next_u64().to_le_bytes());
    }
    v.truncate(len);
    Bytes::from(v)
}

/// Shuffles `v` with a seeded RNG (Fisher-Yates).
fn shuffle<X>(v: &mut [X], seed: u64) {
    let mut rng = SeededRng::new(seed);
    for i in (1..v.len()).rev() {
        v.swap(i, rng.below(i as u64 + 1) as usize);
    }
}

/// The frames still due at one receiver; each may arrive once.
struct Expect {
    name: &'static str,
    due: std::collections::HashMap<(Rank, OpTag, u32), Msg>,
}

impl Expect {
    fn new<C: Cluster>() -> Expect {
        Expect {
            name: C::name(),
            due: Default::default(),
        }
    }

    fn add(&mut self, m: &Msg) {
        assert!(self.due.insert(m.key(), m.clone()).is_none(), "{m:?} twice");
    }

    fn is_empty(&self) -> bool {
        self.due.is_empty()
    }

    /// Checks that `from` sent a frame with this header and payload, and
    /// that it is still due; it no longer is.
    fn arrived(&mut self, from: Rank, header: &Header, payload: &[u8]) {
        let name = self.name;
        let key = (from, header.tag, header.chunk);
        let Some(m) = self.due.remove(&key) else {
            panic!("{name}: a frame nobody sent, or a second copy: from {from}, {header:?}");
        };
        check_same(name, &m, from, header, payload);
    }

    /// Checks what a receive gave; see [`Got`].
    fn got<C: Cluster>(&mut self, at: Rank, n: usize, got: &Got) {
        for o in &got.offers {
            assert!(
                C::lends(n, o.from, at),
                "{}: {at} lent a frame of {} in place, but the backend declares it does not",
                self.name,
                o.from
            );
            let total: usize = o.parts.iter().sum();
            assert!(
                o.parts.len() <= 2 && total as u64 == o.header.len,
                "{}: lent in pieces {:?} for a frame of {} bytes",
                self.name,
                o.parts,
                o.header.len
            );
            let key = (o.from, o.header.tag, o.header.chunk);
            match self.due.get(&key) {
                Some(m) => check_same(self.name, m, o.from, &o.header, &o.bytes),
                None => panic!("{}: lent a frame not due: {:?}", self.name, o.header),
            }
        }
        match (&got.frame, got.offers.last()) {
            (Some(f), _) => self.arrived(f.from, &f.header, &f.payload),
            (None, Some(o)) if o.accepted => self.arrived(o.from, &o.header, &o.bytes),
            (None, _) => panic!(
                "{}: recv_in_place returned no frame, but none was consumed in place",
                self.name
            ),
        }
    }
}

fn check_same(name: &str, m: &Msg, from: Rank, header: &Header, payload: &[u8]) {
    assert_eq!(
        (from, *header),
        (m.from, m.header),
        "{name}: the header arrived changed"
    );
    if payload != &m.payload[..] {
        let at = payload
            .iter()
            .zip(m.payload.iter())
            .position(|(a, b)| a != b)
            .unwrap_or(payload.len().min(m.payload.len()));
        panic!(
            "{name}: frame {:?} from {from}: {} bytes arrived, {} sent, first difference at byte {at}",
            m.header,
            payload.len(),
            m.payload.len()
        );
    }
}

/// A frame a `recv_in_place` offered to its closure.
#[derive(Debug)]
struct Offer {
    from: Rank,
    header: Header,
    /// The lengths of the pieces.
    parts: Vec<usize>,
    /// The pieces, in order, joined.
    bytes: Vec<u8>,
    accepted: bool,
}

impl Offer {
    /// Lent in two pieces, the first ending inside a 4-byte element of a
    /// payload made of such elements.
    fn splits_an_element(&self) -> bool {
        self.accepted
            && self.header.len.is_multiple_of(4)
            && self.parts.len() == 2
            && !self.parts[0].is_multiple_of(4)
    }
}

/// What one receive gave: a frame owned (`frame`), or consumed in place
/// (the last of `offers`, accepted).
#[derive(Debug)]
struct Got {
    frame: Option<Frame>,
    offers: Vec<Offer>,
}

/// How a case receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    Owned,
    /// `recv_in_place`, the closure consuming what it is lent (`true`) or
    /// declining it (`false`: it must come back owned).
    InPlace(bool),
}

async fn receive<T: Transport>(
    t: &T,
    how: How,
    tag: OpTag,
    from: &PeerSet,
    deadline: Instant,
) -> Result<Got, kungfu_transport::TransportError> {
    match how {
        How::Owned => t.recv(tag, from, deadline).await.map(|f| Got {
            frame: Some(f),
            offers: Vec::new(),
        }),
        How::InPlace(accept) => {
            let mut offers = Vec::new();
            let frame = t
                .recv_in_place(tag, from, deadline, |from, header, parts| {
                    offers.push(Offer {
                        from,
                        header: *header,
                        parts: parts.iter().map(|p| p.len()).collect(),
                        bytes: parts.concat(),
                        accepted: accept,
                    });
                    accept
                })
                .await?;
            let frame = match frame {
                kungfu_transport::Arrival::Frame(f) => Some(f),
                kungfu_transport::Arrival::Applied => None,
                kungfu_transport::Arrival::Landed { from, header } => {
                    panic!("{from}: a landed receive {header:?}, but none was posted")
                }
            };
            Ok(Got { frame, offers })
        }
    }
}

/// Sends `m`, which must succeed within [`WAIT`].
async fn send_ok<T: Transport>(name: &str, t: &T, m: &Msg) {
    match tokio::time::timeout(WAIT, t.send(m.to, m.header, m.payload.clone())).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("{name}: send {:?} to {}: {e}", m.header, m.to),
        Err(_) => panic!("{name}: send {:?} to {} did not finish", m.header, m.to),
    }
}

/// The next frame of `tag` from `from` at `t`, which must come within
/// [`WAIT`].
async fn recv_ok<T: Transport>(name: &str, t: &T, tag: OpTag, from: &PeerSet) -> Frame {
    let r = t.recv(tag, from, soon()).await;
    r.unwrap_or_else(|e| {
        panic!(
            "{name}: receiving op {} seq {} ({}): {e}",
            tag.op, tag.seq, tag.epoch
        )
    })
}

/// Sends `msgs` in order from `t` on a task of their own.
fn spawn_sends<T: Transport>(
    name: &'static str,
    t: &Arc<T>,
    msgs: Vec<Msg>,
) -> tokio::task::JoinHandle<()> {
    let t = t.clone();
    tokio::spawn(async move {
        for m in &msgs {
            send_ok(name, &*t, m).await;
        }
    })
}

async fn join_all(name: &str, tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        if let Err(e) = t.await {
            if e.is_panic() {
                std::panic::resume_unwind(e.into_panic());
            }
            panic!("{name}: a task was cancelled: {e}");
        }
    }
}

/// Waits until `cond` holds, checking it every millisecond; panics with
/// `what` after [`WAIT`]. For states the transport offers no event for
/// (bytes held, frames refused).
async fn eventually(name: &str, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "{name}: timed out waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Polls `f` once: a receive polled once is under way, so what the case
/// does next happens while it waits, with no sleep to make that likely.
async fn poll_once<F: Future + ?Sized>(f: &mut Pin<Box<F>>) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

/// A waker that records that it was woken.
struct Flag(AtomicBool);

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// An operation under way (polled once, pending), polled only when its
/// own waker is woken, as an executor would: so a case sees that the event
/// it causes (a peer lost, a shutdown) wakes the operation, rather than
/// finding the outcome by polling it again itself.
struct Waiting<F: Future> {
    fut: Pin<Box<F>>,
    flag: Arc<Flag>,
}

impl<F: Future> Waiting<F> {
    /// Polls `fut` once; it must be pending.
    fn start(name: &str, what: &str, fut: F) -> Waiting<F> {
        let mut w = Waiting {
            fut: Box::pin(fut),
            flag: Arc::new(Flag(AtomicBool::new(false))),
        };
        assert!(w.poll().is_pending(), "{name}: {what} finished at once");
        w
    }

    fn poll(&mut self) -> Poll<F::Output> {
        let waker = Waker::from(self.flag.clone());
        self.fut.as_mut().poll(&mut Context::from_waker(&waker))
    }

    /// Its outcome, polling it each time it is woken; panics if it is not
    /// woken within [`WAIT`] (give the operation a later deadline, so
    /// that its own timer does not do the waking).
    async fn outcome(mut self, name: &str, what: &str) -> F::Output {
        loop {
            let flag = &self.flag.0;
            let woken = format!("{what} is woken");
            eventually(name, &woken, || flag.swap(false, Ordering::SeqCst)).await;
            if let Poll::Ready(v) = self.poll() {
                return v;
            }
        }
    }
}
