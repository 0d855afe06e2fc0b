//! Who moves the fast path's ops, and how they complete: a caller that
//! waits on its handle polls every op in flight for [`INLINE_SPIN`], then
//! hands over to the progress thread (one per [`Fast`]), which polls while
//! ops are in flight and no caller does; ended ops are completed outside
//! the engine's lock (see the parent module's docs, "Progress and
//! waiting").

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use kungfu_topology::Strategy;
use kungfu_transport::shm::bell::{self, Waiter};
use kungfu_transport::Transport;

use super::{lock, Ended, Fast, FastOp, State};
use crate::abort::Abort;
use crate::op::errors::abort_reason;
use crate::session::driver::{send_aborts, trace_op};
use crate::CollectiveError;

/// How long a waiting caller polls before it hands over to the thread.
pub(super) const INLINE_SPIN: Duration = Duration::from_micros(200);
/// The thread's longest idle sleep (it notices a dropped session by then).
const IDLE_NAP: Duration = Duration::from_millis(100);
/// After this long with ops in flight and nothing moving (no op ended, no
/// peer posted to this rank or released its contributions), the thread
/// sleeps on the lanes' bells instead of spinning. Measured (docs/speed.md,
/// "Waiting for a late peer"): with the bells, sleeping after 200 us cost
/// no latency against spinning for 2 ms, and the CPU a wait burns fell
/// from 2.2 to 0.4-0.5 ms per 5 ms wait.
const NAP_AFTER: Duration = INLINE_SPIN;
/// The longest sleep on the bells: deadlines and peers' liveness are
/// checked between sleeps.
const NAP: Duration = Duration::from_millis(1);

/// How long [`Fast::fail_all`] waits for ops that other threads complete.
const COMPLETING_WAIT: Duration = Duration::from_secs(2);

impl<T: Transport> Fast<T> {
    /// Posts the op's contribution and runs it as far as it goes now;
    /// `waited`: a caller will poll its handle (else the thread is told).
    pub(in crate::session) fn start(&self, mut op: FastOp<T>, waited: bool) {
        op.waited = waited;
        let mut st = lock(&self.state);
        st.ops.push(op);
        let ended = self.progress(&mut st, false);
        // A contribution that found no free slot, or a later phase's, must
        // not wait for the handle to be polled: peers wait for it.
        let stuck = st
            .ops
            .iter()
            .any(|o| o.unposted != 0 || o.split.is_some() || o.large.is_some());
        let left = !st.ops.is_empty();
        drop(st);
        finish(&self.completing, ended, false);
        if left && (!waited || stuck) {
            self.tell_thread();
        }
    }

    /// Wakes the progress thread, whether it waits on the condition
    /// variable (no ops, or a caller polls) or sleeps on the bells.
    fn tell_thread(&self) {
        self.cv.notify_one();
        bell::ring(&self.bell, &self.bell_sleepers, false);
    }

    /// Fails every op in flight as closed (the session is closing or shut
    /// down: nothing will complete them).
    pub(in crate::session) fn fail_all(&self) {
        let mut st = lock(&self.state);
        let ops = std::mem::take(&mut st.ops);
        self.live.store(0, Ordering::SeqCst);
        drop(st);
        self.completing.fetch_add(ops.len(), Ordering::SeqCst);
        let ended = ops
            .into_iter()
            .map(|mut op| {
                op.end(&self.lanes);
                (op, Err(CollectiveError::Closed))
            })
            .collect();
        // the caller closes the session: it holds none of the session's
        // locks, and the runtime may be about to stop
        finish(&self.completing, ended, true);
        // Ops another thread took out as they ended (the progress thread,
        // or a caller that polled) complete there: the session is closed
        // only once their callbacks ran (a C caller reads what they wrote
        // as soon as kf_finalize returns). Bounded: a callback that blocks
        // does not hold the close for ever.
        let until = Instant::now() + COMPLETING_WAIT;
        while self.completing.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn now_ns(&self) -> u64 {
        self.zero.elapsed().as_nanos() as u64
    }

    /// Polls the ops in flight from a waiting caller until `done()`, for
    /// [`INLINE_SPIN`] at most; `false`: handed over to the thread.
    fn drive(&self, done: &mut dyn FnMut() -> bool) -> bool {
        let start = Instant::now();
        let budget = INLINE_SPIN.as_nanos() as u64;
        let mut k = 0u32;
        loop {
            // The clock is read every few rounds only: a round is much
            // shorter than a read of it.
            if k.is_multiple_of(16) {
                if start.elapsed() > INLINE_SPIN {
                    self.hand_over();
                    return false;
                }
                self.inline_until
                    .store(self.now_ns() + 2 * budget, Ordering::Relaxed);
            }
            k = k.wrapping_add(1);
            if let Ok(mut st) = self.state.try_lock() {
                let ended = self.progress(&mut st, k.is_multiple_of(64));
                drop(st);
                finish(&self.completing, ended, false);
            }
            if done() {
                // Other ops in flight are the thread's now (it sleeps while
                // a caller polls); none: no wake-up. Cleared first, both
                // sequentially consistent: an op started meanwhile is
                // either seen here (`live`) or its notice finds the deadline
                // cleared.
                self.inline_until.store(0, Ordering::SeqCst);
                if self.live.load(Ordering::SeqCst) > 0 {
                    self.hand_over();
                }
                return true;
            }
            self.pause();
        }
    }

    /// A polling caller stops: the thread takes over. Under the lock, so
    /// that the thread either sees it or is already waiting for the
    /// notice (it checks and waits under the lock).
    fn hand_over(&self) {
        let st = lock(&self.state);
        self.inline_until.store(0, Ordering::Relaxed);
        drop(st);
        self.tell_thread();
    }

    fn pause(&self) {
        if self.oversubscribed {
            std::thread::yield_now();
        } else {
            // A pause instruction takes up to ~140 cycles on recent x86: a
            // few between polls, or the wait itself becomes the latency.
            for _ in 0..2 {
                std::hint::spin_loop();
            }
        }
    }

    /// Moves every op in flight as far as it goes; returns the ended ones
    /// (to complete without the lock: their callbacks may start ops).
    /// `timed`: reads the clock for deadlines and liveness checks.
    fn progress(&self, st: &mut State<T>, timed: bool) -> Vec<Ended<T>> {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < st.ops.len() {
            match self.step(&mut st.ops[i], timed) {
                None => i += 1,
                Some(r) => {
                    self.completing.fetch_add(1, Ordering::SeqCst);
                    let mut op = st.ops.swap_remove(i);
                    op.end(&self.lanes);
                    ended.push((op, r));
                }
            }
        }
        self.live.store(st.ops.len(), Ordering::SeqCst);
        ended
    }
}

/// Completes ended ops (outside the engine's lock). A failed op tells
/// every peer why, as the message path does, unless a peer told it.
///
/// A caller's callback runs on the progress thread (`on_thread`) or on the
/// session's runtime, never on a thread that happened to start or wait
/// for another op: that thread may hold locks the callback needs (the
/// swap gate, while deferred ops start). Handles (`waited`) are completed
/// in place: that only sends on a oneshot.
/// `completing` counts them down as they complete (see
/// [`Fast::fail_all`]).
fn finish<T: Transport>(completing: &Arc<AtomicUsize>, ended: Vec<Ended<T>>, on_thread: bool) {
    let (now, later): (Vec<_>, Vec<_>) = ended
        .into_iter()
        .partition(|(op, _)| on_thread || op.waited);
    if let Some((op, _)) = later.first() {
        let rt = op.inner.runtime.clone();
        let n = later.len();
        let c = completing.clone();
        rt.spawn(async move {
            complete(later);
            c.fetch_sub(n, Ordering::SeqCst);
        });
    }
    let n = now.len();
    complete(now);
    completing.fetch_sub(n, Ordering::SeqCst);
}

fn complete<T: Transport>(ended: Vec<Ended<T>>) {
    for (mut op, r) in ended {
        // A failed op may have frames of its tag coming (a rank on the
        // message path): they are strays from now on, judged by its
        // tombstone. An op that succeeded had every rank on this path, so
        // no frame of its tag exists, and retiring it costs the matcher's
        // lock and a wake-up of the stray watcher per op (1.2 -> 2-9 us).
        if r.is_err() {
            op.inner.transport().retire(op.tag);
            lock(&op.inner.tombstones).insert(op.tag, op.digest, op.spec);
        }
        if let (Err(e), false) = (&r, op.remote_abort) {
            let me = op.inner.transport().rank();
            if let Some((reason, offender)) = abort_reason(e, me) {
                let abort = Abort::new(reason, me, offender, &op.spec);
                send_aborts(&op.inner, op.tag, op.digest, &abort);
            }
        }
        let done = op.done.take().expect("completed once");
        let bytes = op.spec.block_bytes().unwrap_or(0);
        if let Some(tl) = &op.inner.config.timeline {
            trace_op(
                tl,
                &op.name,
                &op.spec,
                Strategy::Clique,
                "fast",
                op.started,
                &r,
            );
        }
        let ok = r
            .is_ok()
            .then(|| (Strategy::Clique, bytes, op.started.elapsed()));
        op.inner.end_op(op.tag, ok, done, r);
    }
}

/// What a waiting handle drives (a [`Fast`] of any transport).
pub(crate) trait Drive: Send + Sync {
    /// See [`Fast::drive`].
    fn drive(&self, done: &mut dyn FnMut() -> bool) -> bool;
}

impl<T: Transport> Drive for Fast<T> {
    fn drive(&self, done: &mut dyn FnMut() -> bool) -> bool {
        Fast::drive(self, done)
    }
}

/// The progress thread of one [`Fast`]: polls while ops are in flight and
/// no caller does, sleeps otherwise; ends with the session. With ops in
/// flight and nothing moving it spins (or yields) for [`NAP_AFTER`], then
/// sleeps on the lanes' bells: a peer's post or release, or news from this
/// process, wakes it.
pub(super) fn progress_thread<T: Transport>(weak: Weak<Fast<T>>) {
    let mut idle_since: Option<Instant> = None;
    let mut seen = 0u32;
    loop {
        let Some(f) = weak.upgrade() else { return };
        let st = lock(&f.state);
        if st.ops.is_empty() {
            idle_since = None;
            drop(f.cv.wait_timeout(st, IDLE_NAP));
            continue;
        }
        if f.inline_until.load(Ordering::SeqCst) > f.now_ns() {
            // a caller polls every op; it hands over when it stops
            // (`hand_over`), or its deadline passes
            drop(f.cv.wait_timeout(st, IDLE_NAP));
            continue;
        }
        let ended = f.poll_guarded(st);
        let activity = f.lanes.activity();
        let moved = !ended.is_empty() || activity != seen;
        seen = activity;
        finish(&f.completing, ended, true);
        if moved {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() > NAP_AFTER {
            f.sleep_on_bells(&mut seen);
        } else {
            f.pause();
        }
    }
}

impl<T: Transport> Fast<T> {
    /// One round of progress by the thread. A panic (a bug, or a peer's
    /// bytes that slipped past a check) must not end the thread that
    /// completes callback ops: it fails them.
    fn poll_guarded(&self, mut st: std::sync::MutexGuard<'_, State<T>>) -> Vec<Ended<T>> {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.progress(&mut st, true)
        }));
        drop(st);
        match r {
            Ok(ended) => ended,
            Err(_) => {
                self.fail_all();
                Vec::new()
            }
        }
    }

    /// Sleeps on the lanes' bells and this process's own until something
    /// happens, for [`NAP`] at most: armed first, then one more round of
    /// progress (what came before arming is seen there, what comes after
    /// wakes the sleep). `seen`: the lanes' activity count, kept current.
    fn sleep_on_bells(&self, seen: &mut u32) {
        let armed = self.lanes.arm();
        bell::arm(&self.bell_sleepers);
        let local = self.bell.load(Ordering::SeqCst);
        let st = lock(&self.state);
        let idle = st.ops.is_empty() || self.inline_until.load(Ordering::SeqCst) > self.now_ns();
        let ended = if idle {
            Vec::new()
        } else {
            self.poll_guarded(st)
        };
        let activity = self.lanes.activity();
        if !idle && ended.is_empty() && activity == *seen {
            armed.sleep(
                Some(Waiter {
                    word: &self.bell,
                    value: local,
                    shared: false,
                }),
                NAP,
            );
        }
        bell::disarm(&self.bell_sleepers);
        drop(armed);
        *seen = activity;
        finish(&self.completing, ended, true);
    }
}
