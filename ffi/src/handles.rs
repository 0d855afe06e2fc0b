//! Handles: the completion record of each op (`Slot`), the table of live
//! handles, how an op completes (`Completion`: output, callback, status)
//! and the calls on a handle (`kf_wait`, `kf_test`, `kf_release`).

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::{
    guard, invalid, kf_callback, kf_handle, kf_status, lock, ready, status_text, Fail, Res,
    FINALIZING, KF_ERR_ABORTED, KF_ERR_FINALIZED, KF_OK, KF_PENDING, PHASE,
};

/// The completion record of one op.
pub(crate) struct Slot {
    pub(crate) done: Mutex<Option<(kf_status, String)>>,
    pub(crate) cv: Condvar,
}

pub(crate) struct Handles {
    next: u64,
    pub(crate) live: HashMap<kf_handle, Arc<Slot>>,
}

static HANDLES: Mutex<Option<Handles>> = Mutex::new(None);

pub(crate) fn with_handles<R>(f: impl FnOnce(&mut Handles) -> R) -> R {
    let mut h = lock(&HANDLES);
    let h = h.get_or_insert_with(|| Handles {
        next: 1,
        live: HashMap::new(),
    });
    f(h)
}

/// A user pointer carried to a library thread.
#[derive(Clone, Copy)]
struct UserPtr(*mut c_void);
// SAFETY: the pointer is only handed back to the caller's callback, which
// the caller wrote to be called from a library thread.
unsafe impl Send for UserPtr {}

/// An output buffer carried to a library thread.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut u8);
// SAFETY: the caller guarantees that the buffer stays valid, and is not
// used by it, until the op completes (the ABI's documented contract); only
// the completing task writes it, once.
unsafe impl Send for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the Send wrapper).
    pub(crate) fn get(self) -> *mut u8 {
        self.0
    }
}

/// How an op completes: its handle, slot, callback. Dropped unfinished
/// (its task was dropped when the runtime stopped), it completes with
/// `KF_ERR_FINALIZED`, so the callback runs once whatever happens.
pub(crate) struct Completion {
    handle: kf_handle,
    slot: Arc<Slot>,
    cb: kf_callback,
    user: UserPtr,
    /// No handle was asked for: forget it once complete.
    auto_release: bool,
    finished: bool,
    /// The count of revokes (`kf_abort`, `kf_reconfigure`) when the op
    /// started: a failure after a later one is that revoke's doing.
    revokes: u64,
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.finished {
            self.complete(Err(Fail(
                KF_ERR_FINALIZED,
                "the library stopped before the op completed".into(),
            )));
        }
    }
}

impl Completion {
    /// A new handle (written to `out` if not NULL).
    pub(crate) fn new(cb: kf_callback, user: *mut c_void, out: *mut kf_handle) -> Completion {
        let slot = Arc::new(Slot {
            done: Mutex::new(None),
            cv: Condvar::new(),
        });
        let handle = with_handles(|h| {
            let id = h.next;
            h.next += 1;
            h.live.insert(id, slot.clone());
            id
        });
        if !out.is_null() {
            // SAFETY: the caller passed a non-NULL pointer to a kf_handle.
            unsafe { out.write_unaligned(handle) };
        }
        Completion {
            handle,
            slot,
            cb,
            user: UserPtr(user),
            auto_release: out.is_null(),
            finished: false,
            revokes: crate::reconfigure::revokes(),
        }
    }

    /// Withdraws the handle of a call that failed before its op started:
    /// no callback, and the handle is unknown again.
    pub(crate) fn withdraw(mut self) {
        self.finished = true;
        with_handles(|h| h.live.remove(&self.handle));
    }

    pub(crate) fn finish(mut self, r: Result<(), Fail>) {
        self.complete(r);
    }

    fn complete(&mut self, r: Result<(), Fail>) {
        self.finished = true;
        let (status, detail) = match r {
            Ok(()) => (KF_OK, String::new()),
            // Closing the connections fails the ops in flight, and so does
            // each peer that leaves in turn (a lost peer): either way the
            // cause is this kf_finalize, and the caller is told so.
            Err(Fail(s, d)) if FINALIZING.load(Ordering::SeqCst) => (
                KF_ERR_FINALIZED,
                format!(
                    "kf_finalize was called before the op completed ({})",
                    status_text(s, &d)
                ),
            ),
            // The worker left its cluster while the op ran (kf_abort, or
            // kf_reconfigure): that failed it, and the caller is told so.
            Err(Fail(s, d)) => match crate::reconfigure::revoked_since(self.revokes) {
                Some(by) => (
                    KF_ERR_ABORTED,
                    format!(
                        "aborted by {by} while the op was in flight ({})",
                        status_text(s, &d)
                    ),
                ),
                None => (s, d),
            },
        };
        // The callback runs even if kf_finalize already marked the slot
        // done: an op started on another thread while kf_finalize ran
        // completes only after it (its `finished` flag keeps it to once).
        // The callback runs before the handle shows the op complete, so
        // what it did is visible to whoever waits on the handle.
        if let Some(cb) = self.cb {
            let user = self.user;
            // SAFETY: the caller's callback, called once, with the handle,
            // status and user pointer it was registered with.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
                cb(self.handle, status, user.0)
            }));
        }
        {
            let mut done = lock(&self.slot.done);
            if done.is_none() {
                *done = Some((status, detail));
            }
            self.slot.cv.notify_all();
        }
        if self.auto_release {
            with_handles(|h| h.live.remove(&self.handle));
        }
    }
}

pub(crate) fn slot_of(h: kf_handle) -> Res<Arc<Slot>> {
    with_handles(|hs| hs.live.get(&h).cloned())
        .ok_or_else(|| invalid(format!("unknown or released handle {h}")))
}

/// Waits until the op completes or `timeout_ms` passes (negative: until it
/// completes, which the op timeout bounds). Returns the op's status, or
/// `KF_PENDING` if it is still running.
#[no_mangle]
pub extern "C" fn kf_wait(h: kf_handle, timeout_ms: i64) -> kf_status {
    guard(|| {
        ready(&mut lock(&PHASE))?;
        wait_slot(h, &*slot_of(h)?, timeout_ms)
    })
}

/// `kf_wait` once the library is up and the handle known.
pub(crate) fn wait_slot(h: kf_handle, slot: &Slot, timeout_ms: i64) -> Res<()> {
    let deadline =
        (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
    let mut done = lock(&slot.done);
    loop {
        if let Some((status, detail)) = &*done {
            return if *status == KF_OK {
                Ok(())
            } else {
                Err(Fail(*status, detail.clone()))
            };
        }
        let wait = match deadline {
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Err(Fail(KF_PENDING, format!("op {h} still running")));
                }
                d - now
            }
            None => Duration::from_millis(100),
        };
        done = slot
            .cv
            .wait_timeout(done, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Sets `*done` to 1 if the op completed (then returns its status), else
/// to 0 (and returns `KF_OK`).
///
/// # Safety
/// `done` points to an int.
#[no_mangle]
pub unsafe extern "C" fn kf_test(h: kf_handle, done: *mut c_int) -> kf_status {
    guard(|| {
        if done.is_null() {
            return Err(invalid("done is NULL"));
        }
        ready(&mut lock(&PHASE))?;
        let slot = slot_of(h)?;
        let state = lock(&slot.done).clone();
        // SAFETY: the caller's int.
        unsafe { done.write_unaligned(c_int::from(state.is_some())) };
        match state {
            Some((KF_OK, _)) | None => Ok(()),
            Some((status, detail)) => Err(Fail(status, detail)),
        }
    })
}

/// Forgets a handle. The op, if still running, completes anyway (its
/// callback runs, its output is written).
#[no_mangle]
pub extern "C" fn kf_release(h: kf_handle) -> kf_status {
    guard(|| {
        ready(&mut lock(&PHASE))?;
        with_handles(|hs| hs.live.remove(&h))
            .map(|_| ())
            .ok_or_else(|| invalid(format!("unknown or released handle {h}")))
    })
}
