//! The state of a fabric wire: the operations in flight (each with the
//! memory it holds until its completion), the eager receive slots, and the
//! registrations. How operations are posted is in `post`; what their
//! completions do, and the task that reads them, in `progress`.
//!
//! **Memory.** Every buffer given to libfabric (a send's header and
//! payload, a posted receive's range, an eager slot) is held by the entry
//! of its operation until the completion is read; the entry is keyed by
//! its `fi_context2`, boxed so that it does not move. A receive posted for
//! an op that ended meanwhile (retired, an older epoch, a closed endpoint)
//! is cancelled; closing the endpoint (before the table is dropped) ends
//! the rest.

use std::collections::HashMap;
use std::os::raw::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use kungfu_fabric_sys::fi_context2;
use kungfu_topology::Rank;
use tokio::sync::{oneshot, Notify};

use super::ofi::{Mr, Ofi};
use crate::endpoint::{Matcher, RecvKey};
use crate::pool::BufferPool;
use crate::region::{Mem, MemMut, Region};
use crate::{TransportError, HEADER_LEN};

/// Bytes a send holds until its completion.
pub(super) enum Hold {
    Bytes(Bytes),
    Mem(Mem),
}

impl Hold {
    pub(super) fn as_slice(&self) -> &[u8] {
        match self {
            Hold::Bytes(b) => b,
            Hold::Mem(m) => m.as_slice(),
        }
    }
}

pub(super) enum Kind {
    Send {
        done: Option<oneshot::Sender<Result<(), String>>>,
        header: Box<[u8; HEADER_LEN]>,
        payload: Hold,
        _mrs: Vec<Arc<Mr>>,
    },
    Eager {
        slot: usize,
    },
    Posted {
        key: RecvKey,
        header: Box<[u8; HEADER_LEN]>,
        mem: MemMut,
        _mrs: Vec<Arc<Mr>>,
        cancelled: bool,
    },
}

pub(super) struct Op {
    pub(super) ctx: Box<fi_context2>,
    pub(super) kind: Kind,
    /// The registrations' descriptors of the operation's two buffers.
    pub(super) desc: [*mut c_void; 2],
}

// SAFETY: the context and descriptors are only handed to libfabric (whose
// domain is FI_THREAD_SAFE) and never dereferenced here; the buffers the
// entry holds are Send.
unsafe impl Send for Op {}

impl Op {
    pub(super) fn new(kind: Kind) -> Op {
        Op {
            ctx: Box::default(),
            kind,
            desc: [std::ptr::null_mut(); 2],
        }
    }

    pub(super) fn ctx_ptr(&mut self) -> *mut fi_context2 {
        &raw mut *self.ctx
    }
}

/// An eager receive buffer: a header and up to `eager_max` payload bytes.
pub(super) struct Slot {
    pub(super) buf: Box<[u8]>,
    pub(super) mr: Option<Arc<Mr>>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) pending: HashMap<usize, Op>,
    pub(super) slots: Vec<Slot>,
}

/// What a wire and its progress task share.
pub(super) struct Core {
    pub(super) ofi: Ofi,
    pub(super) state: Mutex<State>,
    pub(super) matcher: Arc<Matcher>,
    pub(super) pool: Arc<BufferPool>,
    /// An operation was posted: progress now.
    pub(super) wake: Notify,
    pub(super) eager_max: usize,
    pub(super) max_frame: usize,
    /// Register every buffer, even where the provider does not need it
    /// (tests the registration path on providers without `FI_MR_LOCAL`).
    register: bool,
    /// This wire's key among a region's registrations (unique per process).
    reg_id: usize,
    next_key: AtomicU64,
    pub(super) closing: AtomicBool,
    /// Frames finished per peer: sent, and received (for the goodbyes).
    pub(super) sent: Vec<AtomicU64>,
    pub(super) received: Vec<AtomicU64>,
    pub(super) spin: Duration,
    pub(super) me: Rank,
    /// Frames that landed in receives posted for them (the rendezvous way).
    pub(super) posted_landed: AtomicU64,
    /// Frames from an address that is no rank's (not in the address
    /// vector the authenticated bootstrap filled): dropped, never blamed
    /// on a rank.
    pub(super) strangers: AtomicU64,
}

pub(super) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        ofi: Ofi,
        matcher: Arc<Matcher>,
        pool: Arc<BufferPool>,
        size: usize,
        eager_max: usize,
        max_frame: usize,
        register: bool,
        spin: Duration,
        me: Rank,
    ) -> Core {
        static IDS: AtomicU64 = AtomicU64::new(1 << 20);
        Core {
            ofi,
            state: Mutex::default(),
            matcher,
            pool,
            wake: Notify::new(),
            eager_max,
            max_frame,
            register,
            reg_id: IDS.fetch_add(1, Ordering::Relaxed) as usize,
            next_key: AtomicU64::new(1),
            closing: AtomicBool::new(false),
            sent: (0..size).map(|_| AtomicU64::new(0)).collect(),
            received: (0..size).map(|_| AtomicU64::new(0)).collect(),
            spin,
            me,
            posted_landed: AtomicU64::new(0),
            strangers: AtomicU64::new(0),
        }
    }

    /// Whether buffers must be registered.
    pub(super) fn registers(&self) -> bool {
        self.register || self.ofi.mr_local
    }

    pub(super) fn register_raw(&self, ptr: *const u8, len: usize) -> Result<Arc<Mr>, String> {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        // SAFETY: every caller keeps the memory alive for as long as the
        // returned region (held next to the buffer it covers).
        unsafe { self.ofi.register(ptr, len.max(1), key) }.map(Arc::new)
    }

    /// The registration of `region`, made once and kept in it.
    pub(super) fn register_region(&self, region: &Arc<Region>) -> Result<Arc<Mr>, TransportError> {
        if let Some(r) = region.registration(self.reg_id) {
            if let Ok(mr) = r.downcast::<Mr>() {
                return Ok(mr);
            }
        }
        // The region holds its registration (dropped with it), so the
        // memory outlives the registration.
        let mr = self
            .register_raw(region.as_ptr(), region.len())
            .map_err(|why| TransportError::Handshake {
                peer: None,
                addr: self.ofi.provider.clone(),
                reason: why,
            })?;
        region.set_registration(self.reg_id, mr.clone());
        Ok(mr)
    }

    /// Cancels receives posted for ops that ended (retired, an older
    /// epoch, a closed matcher).
    pub(super) fn cancel_stale(&self) {
        let mut st = lock(&self.state);
        for op in st.pending.values_mut() {
            if let Kind::Posted { key, cancelled, .. } = &mut op.kind {
                if !*cancelled && !self.matcher.wants(key.tag) {
                    *cancelled = true;
                    self.ofi.cancel(&raw mut *op.ctx);
                }
            }
        }
    }

    /// Whether anything is in flight (sends or posted receives).
    pub(super) fn busy(&self) -> bool {
        let st = lock(&self.state);
        st.pending.len() > st.slots.len()
    }

    /// Sends posted and not completed.
    pub(super) fn sends_in_flight(&self) -> usize {
        let st = lock(&self.state);
        st.pending
            .values()
            .filter(|op| matches!(op.kind, Kind::Send { .. }))
            .count()
    }
}
