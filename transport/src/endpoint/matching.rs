//! Matching of incoming frames to receives, with a bounded byte budget.
//!
//! Every backend (TCP, shared memory, in-memory) shares this: reader tasks
//! [`Matcher::deliver`] frames, ops [`Matcher::recv`] them by [`OpTag`]. A
//! frame is removed only inside a poll that returns it, so a dropped
//! receive loses nothing.
//!
//! # Posted receives
//!
//! An op may also [`Matcher::post`] a receive: one frame, named exactly by
//! a [`RecvKey`], lands in a range of the op's own memory (a [`MemMut`]).
//! A reader that can write a payload where it belongs (TCP reads the
//! socket straight into it) first [`Matcher::claim`]s the range, fills it
//! and reports [`Matcher::landed`]; any other delivery of that frame is
//! copied into the range here. Either way the op then receives
//! [`Arrival::Landed`] (header only) instead of the payload. A frame that
//! came before its receive was posted is unexpected (eager): it waits
//! queued, and [`Matcher::post`] copies it in at once.
//!
//! The range stays the op's memory throughout: the matcher or a reader
//! holds the share until the frame landed or the op was retired, so a
//! dropped op never frees memory that a reader is still writing (the
//! region outlives every share). Landed frames hold no budget.
//!
//! The parts: frames coming in from readers (`deliver`), receives taking
//! them (`recv`), posted receives (`posted`), retired ops and their strays
//! (`strays`), lost peers (`lost`), the losses told to and heard from peers
//! (`notices`), when peers were last heard from (`heard`), and the beacons
//! on heartbeats (`beacons`).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;

use kungfu_topology::Rank;
use tokio::sync::Notify;

use crate::region::MemMut;

mod beacons;
mod deliver;
mod heard;
mod lost;
pub(crate) mod notices;
mod posted;
mod recv;
mod strays;

use crate::{Epoch, Frame, FrameKind, Header, Instant, OpTag, TransportError};
pub use beacons::MAX_BEACON;
pub use notices::CLOSED_BY_PEER;
use posted::take_posted;

/// The one frame a posted receive is for: a data frame of op instance
/// `tag` from `from`, tagged `(chunk, step)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RecvKey {
    pub tag: OpTag,
    pub from: Rank,
    pub chunk: u32,
    pub step: u16,
}

impl RecvKey {
    /// The key of a data frame with `header` from `from` (None for other
    /// kinds, which are never posted for).
    pub fn of(from: Rank, header: &Header) -> Option<RecvKey> {
        (header.kind == FrameKind::Data).then_some(RecvKey {
            tag: header.tag,
            from,
            chunk: header.chunk,
            step: header.step,
        })
    }
}

/// What a receive of an op takes from the matcher.
#[derive(Debug)]
pub enum Arrival {
    /// A frame, payload and all (unexpected, or not posted for).
    Frame(Frame),
    /// The frame of a posted receive is in the op's memory.
    Landed { from: Rank, header: Header },
    /// A frame was consumed in place by the receive's `apply` (see
    /// [`crate::Transport::recv_in_place`]).
    Applied,
}

#[derive(Default)]
struct Slot {
    frames: VecDeque<Frame>,
    /// Posted receives that completed, not yet taken.
    landed: VecDeque<(Rank, Header)>,
    wakers: Vec<Waker>,
}

impl Slot {
    fn is_idle(&self) -> bool {
        self.frames.is_empty() && self.landed.is_empty() && self.wakers.is_empty()
    }
}

struct Inner {
    epoch: Epoch,
    slots: HashMap<OpTag, Slot>,
    queued_bytes: usize,
    /// Receives posted and not yet landed (nor claimed by a reader).
    posted: HashMap<RecvKey, MemMut>,
    /// Rendezvous senders waiting for a post.
    rendezvous: usize,
    lost: HashMap<Rank, Arc<str>>,
    /// The order ranks were lost in (the first is the likeliest cause of
    /// the others: a neighbour that gave up because of it).
    lost_order: Vec<Rank>,
    /// Who reported each rank lost by hearsay here (absent for a loss
    /// this endpoint found itself): see [`Matcher::hearsay`].
    accusers: HashMap<Rank, Rank>,
    /// Where each rank runs, when known ([`Matcher::name_peers`]): added
    /// to the reason of a loss.
    names: Vec<Arc<str>>,
    /// When each peer was last heard from (any frame, a heartbeat, bytes
    /// of a long frame), while liveness is watched.
    heard: HashMap<Rank, Instant>,
    /// Time excused per peer since it was last heard ([`Matcher::excuse`]).
    excused: HashMap<Rank, std::time::Duration>,
    closed: bool,
    retired: HashSet<OpTag>,
    retired_order: VecDeque<OpTag>,
    refused: u64,
    last_refusal: Option<TransportError>,
    /// Frames of retired ops, payload dropped: the layer above checks them
    /// (a late frame with another spec digest reveals a disagreeing rank).
    strays: VecDeque<Frame>,
    stray_wakers: Vec<Waker>,
}

/// Per-endpoint matching store. See the module docs.
pub struct Matcher {
    inner: Mutex<Inner>,
    /// `inner.posted.len()`, readable without the lock: readers skip
    /// looking for a posted range when there is none.
    posted_n: AtomicUsize,
    /// Told when a receive is posted or the state of posts changes
    /// (retire, epoch, close): what a rendezvous sender waits for.
    posts: Notify,
    space: Notify,
    budget: usize,
    beacons: beacons::Beacons,
    notices: notices::Notices,
}

impl Matcher {
    /// A matcher at `epoch` that holds at most `budget` bytes of unmatched
    /// payload (one frame is always admitted into an empty matcher, so a
    /// frame larger than the budget cannot wedge a peer).
    pub fn new(epoch: Epoch, budget: usize) -> Matcher {
        Matcher {
            inner: Mutex::new(Inner {
                epoch,
                slots: HashMap::new(),
                queued_bytes: 0,
                posted: HashMap::new(),
                rendezvous: 0,
                lost: HashMap::new(),
                lost_order: Vec::new(),
                accusers: HashMap::new(),
                names: Vec::new(),
                heard: HashMap::new(),
                excused: HashMap::new(),
                closed: false,
                retired: HashSet::new(),
                retired_order: VecDeque::new(),
                refused: 0,
                last_refusal: None,
                strays: VecDeque::new(),
                stray_wakers: Vec::new(),
            }),
            posted_n: AtomicUsize::new(0),
            posts: Notify::new(),
            space: Notify::new(),
            budget,
            beacons: beacons::Beacons::default(),
            notices: notices::Notices::default(),
        }
    }

    /// Publishes `inner.posted.len()` to readers that skip the lock.
    fn count_posted(&self, inner: &Inner) {
        if self.posted_n.load(Ordering::Relaxed) != inner.posted.len() {
            self.posted_n.store(inner.posted.len(), Ordering::Release);
        }
        // Under the lock, as every rendezvous checks and registers.
        if inner.rendezvous > 0 {
            self.posts.notify_waiters();
        }
    }

    /// Whether any receive is posted (readers skip looking when not).
    pub fn has_posted(&self) -> bool {
        self.posted_n.load(Ordering::Acquire) != 0
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means another thread panicked while holding
        // it; the state is a plain store that stays consistent between
        // statements, so keep serving rather than propagate the panic.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The epoch frames must be at (older ones are refused).
    pub fn epoch(&self) -> Epoch {
        self.lock().epoch
    }

    /// Moves to `epoch`: frames of older epochs are refused from now on,
    /// and those still queued are dropped (their ops are over: the caller
    /// advances only at a consistency barrier). An epoch never goes back;
    /// an older or equal `epoch` is ignored.
    pub fn advance_epoch(&self, epoch: Epoch) {
        let mut inner = self.lock();
        if epoch <= inner.epoch {
            return;
        }
        inner.epoch = epoch;
        let released = take_posted(&mut inner, |k| k.tag.epoch < epoch);
        self.count_posted(&inner);
        let mut freed = 0;
        inner.slots.retain(|tag, slot| {
            let keep = tag.epoch >= epoch;
            if !keep {
                freed += slot.frames.iter().map(|f| f.payload.len()).sum::<usize>();
            }
            keep
        });
        inner.queued_bytes -= freed;
        drop(inner);
        drop(released);
        if freed > 0 {
            self.space.notify_waiters();
        }
    }

    /// Whether frames of `tag` are still wanted here: the matcher is open,
    /// the tag's epoch is current and its op not retired (a wire that
    /// holds receives posted for it cancels them otherwise).
    pub fn wants(&self, tag: OpTag) -> bool {
        let inner = self.lock();
        !inner.closed && tag.epoch >= inner.epoch && !inner.retired.contains(&tag)
    }

    /// How many receives are posted and not landed (for tests).
    pub fn posted(&self) -> usize {
        self.lock().posted.len()
    }

    /// Whether the endpoint closed (or shut down).
    pub fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Fails everything pending and later. Idempotent.
    pub fn close(&self) {
        let mut inner = self.lock();
        inner.closed = true;
        let released = take_posted(&mut inner, |_| true);
        self.count_posted(&inner);
        inner.slots.retain(|_, s| {
            for w in s.wakers.drain(..) {
                w.wake();
            }
            false
        });
        inner.queued_bytes = 0;
        for w in inner.stray_wakers.drain(..) {
            w.wake();
        }
        drop(inner);
        drop(released);
        self.space.notify_waiters();
    }

    /// Bytes of unmatched payload held now.
    pub fn queued_bytes(&self) -> usize {
        self.lock().queued_bytes
    }

    /// How many frames were refused (older epoch).
    pub fn refused(&self) -> u64 {
        self.lock().refused
    }

    /// The last refusal, if any.
    pub fn last_refusal(&self) -> Option<TransportError> {
        self.lock().last_refusal.clone()
    }
}

fn wake_all(inner: &mut Inner) {
    for slot in inner.slots.values_mut() {
        for w in slot.wakers.drain(..) {
            w.wake();
        }
    }
}
