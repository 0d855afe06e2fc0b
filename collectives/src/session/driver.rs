//! Starts ops (through the swap gate, then on the host fast path or as a
//! task of their own) and reports their completions; sends aborts and
//! watches strays.

use std::sync::Arc;

use bytes::Bytes;
use std::time::Duration;

use kungfu_topology::Rank;
use kungfu_transport::{FrameKind, Header, Instant, OpTag, Transport, TransportError};

use std::sync::atomic::Ordering;

use super::fast::{Drive, Fast};
use super::opmem;
use super::output::{HeldMemory, Start};
use super::scope::Scope;
use super::swap::Deferred;
use super::{lock, Callback, Inner, Memory, Session};
use crate::abort::{Abort, AbortReason};
use crate::names::check_name;
use crate::{CollectiveError, OpSpec};

impl<T: Transport> Session<T> {
    /// Validates, plans and spawns one op. Errors before the spawn complete
    /// the callback at once. During a swap, the caller's ops wait for it.
    /// An op on the fast path returns what its waited handle drives.
    pub(super) fn start(&self, s: Start<'_>) -> Option<Arc<dyn Drive>> {
        let s = Start {
            scope: self.scope.clone(),
            ..s
        };
        let admitted = lock(&self.inner.gate).admit(s, |s| Deferred {
            name: s.name,
            spec: s.spec,
            memory: HeldMemory::of(s.mem),
            done: s.done,
            internal: s.internal,
            scope: s.scope,
            norms: s.norms,
            since: std::time::Instant::now(),
        });
        admitted.and_then(|s| self.start_now(s))
    }

    /// Starts an op now (past the swap gate): on the host fast path if it
    /// takes it (then returns what a waiting handle drives), else as a
    /// task of its own.
    pub(super) fn start_now(&self, s: Start<'_>) -> Option<Arc<dyn Drive>> {
        if let Some(f) = self.fast_for(&s) {
            return self.start_fast(f, s);
        }
        let (name, done, scope) = (s.name, s.done, s.scope);
        // The caller's memory outlives the error report: its release may be
        // how the caller learns that the op ended.
        let keep = match &s.mem {
            Memory::Region(r) => Some(r.clone()),
            Memory::Input(_) => None,
        };
        // the message path never sums the squares: a monitored op's spare
        // carries this rank's squared norm
        let spare = if s.norms {
            Spare::LocalNorm
        } else {
            Spare::Untouched
        };
        match self.prepare(
            name.clone(),
            s.spec,
            s.mem,
            s.internal,
            scope.as_deref(),
            spare,
        ) {
            Ok(mut op) => {
                let inner = self.inner.clone();
                inner.inflight.fetch_add(1, Ordering::SeqCst);
                lock(&inner.pending).insert(op.m.tag(), (name, std::time::Instant::now()));
                // the op runs to its end on the transport it started on
                let t = inner.transport();
                self.inner.runtime.spawn(async move {
                    let started = std::time::Instant::now();
                    let r = op.run(&inner, &t).await;
                    if r.is_ok() {
                        let mut ps = lock(&inner.peer_stats);
                        for (p, a) in ps.iter_mut().zip(op.m.arrivals()) {
                            if a.frames > 0 {
                                p.ops += 1;
                                p.frames += a.frames;
                                p.bytes += a.bytes;
                                p.last_frame += a.last;
                            }
                        }
                    }
                    let tag = op.m.tag();
                    t.retire(tag);
                    lock(&inner.tombstones).insert(tag, op.m.digest(), *op.m.spec());
                    let bytes = op.m.spec().block_bytes().unwrap_or(0);
                    if let Some(tl) = &inner.config.timeline {
                        trace_op(
                            tl,
                            op.m.name(),
                            op.m.spec(),
                            op.m.strategy(),
                            "message",
                            started,
                            &r,
                        );
                    }
                    let ok = r
                        .is_ok()
                        .then(|| (op.m.strategy(), bytes, started.elapsed()));
                    inner.end_op(tag, ok, done, r);
                });
            }
            Err(e) => {
                done(Err(e));
                drop(keep);
            }
        }
        None
    }

    /// Checks an op's name, spec and memory, on `n` ranks where this one
    /// is `me` ([`Session::place`]).
    pub(super) fn check(
        &self,
        name: &Arc<str>,
        spec: &OpSpec,
        mem: &Memory,
        internal: bool,
        (n, me): (usize, Rank),
    ) -> Result<(), CollectiveError> {
        let invalid = |reason: String| CollectiveError::InvalidArgument {
            name: name.clone(),
            reason,
        };
        if !internal {
            check_name(name).map_err(invalid)?;
        }
        spec.validate(n).map_err(invalid)?;
        let (want, got, what) = match mem {
            Memory::Input(input) => (spec.input_len(me, n), input.len(), "input"),
            Memory::Region(r) => (spec.work_len(n), r.len(), "working"),
        };
        let want = want.expect("validated");
        if got != want {
            return Err(invalid(format!(
                "{} needs {want} {what} bytes, got {got}",
                spec.describe(),
            )));
        }
        Ok(())
    }

    /// The size and this rank's place of the ranks an op in `scope` runs
    /// on.
    pub(super) fn place(&self, scope: Option<&Scope>) -> (usize, Rank) {
        match scope {
            Some(s) => (s.members.len(), s.pos),
            None => {
                // one read of the lock and one count on the Arc, not two
                let t = self.inner.transport();
                (t.size(), t.rank())
            }
        }
    }

    /// The op's working memory, laid out by [`OpSpec::init_work`], on `n`
    /// ranks where this one is `me`, with a monitored op's `spare`.
    pub(super) fn work_of(
        &self,
        spec: &OpSpec,
        mem: Memory,
        (n, me): (usize, Rank),
        spare: Spare,
    ) -> opmem::OpMem {
        match mem {
            Memory::Input(input) => {
                // Bytes the op overwrites before it reads them (all of a
                // broadcast's receiver, the other blocks of an allgather)
                // keep what the pooled buffer held: no pass to zero them.
                let mut work = self
                    .inner
                    .pool
                    .take_filled(spec.work_len(n).expect("validated"));
                spec.init_work_in(input, me, n, &mut work);
                spare.fill(&mut work);
                opmem::OpMem::Plain(work)
            }
            // (a monitored op's memory is always its input)
            Memory::Region(r) => opmem::OpMem::callers(r),
        }
    }

    /// The fast path, if op `s` takes it on the current transport (ops of
    /// subgroups never do: its lanes pair the session's ranks).
    fn fast_for(&self, s: &Start<'_>) -> Option<Arc<Fast<T>>> {
        self.fast_for_spec(s.scope.is_some(), &s.spec)
    }

    /// [`Session::fast_for`] of an op of `spec` (in a subgroup or not).
    fn fast_for_spec(&self, scoped: bool, spec: &OpSpec) -> Option<Arc<Fast<T>>> {
        if scoped {
            return None;
        }
        self.with_fast(|f| f.filter(|f| f.takes(spec)).cloned())
    }

    /// Runs `f` on the fast path of the current transport, if it has one
    /// (made on first use, and anew after a swap).
    pub(super) fn with_fast<R>(&self, f: impl FnOnce(Option<&Arc<Fast<T>>>) -> R) -> R {
        let t = self
            .inner
            .transport
            .read()
            .unwrap_or_else(|e| e.into_inner());
        // keyed by the transport it was made for: a swap makes it anew
        let key = Arc::as_ptr(&t) as *const () as usize;
        let mut cached = lock(&self.inner.fast);
        if cached.as_ref().is_none_or(|(k, _)| *k != key) {
            let c = &self.inner.config;
            *cached = Some((key, Fast::new(&t, c.fast_max_bytes, c.fast_large)));
        }
        drop(t);
        f(cached.as_ref().and_then(|(_, f)| f.as_ref()))
    }

    fn start_fast(&self, f: Arc<Fast<T>>, s: Start<'_>) -> Option<Arc<dyn Drive>> {
        let (name, spec, done) = (s.name, s.spec, s.done);
        // the session's transport, which the fast path holds: no lock
        let place = (f.transport().size(), f.transport().rank());
        let begun = self
            .check(&name, &spec, &s.mem, s.internal, place)
            .and_then(|()| lock(&self.inner.names).begin(&name));
        let (op, seq) = match begun {
            Ok(b) => b,
            Err(e) => {
                done(Err(e));
                return None;
            }
        };
        let tag = OpTag {
            epoch: f.transport().epoch(),
            op,
            seq,
        };
        // decided here, past the swap gate, on the transport the op runs
        // on: the same on every rank
        let fused = s.norms && f.fuses_norms(&spec);
        let spare = match (s.norms, fused) {
            (false, _) => Spare::Untouched,
            (true, true) => Spare::Zero,
            (true, false) => Spare::LocalNorm,
        };
        let work = self.work_of(&spec, s.mem, place, spare);
        let inner = self.inner.clone();
        inner.inflight.fetch_add(1, Ordering::SeqCst);
        lock(&inner.pending).insert(tag, (name.clone(), std::time::Instant::now()));
        let op = f.op(inner, name, spec, tag, work, done).monitored(fused);
        f.start(op, s.waited);
        s.waited.then_some(f as Arc<dyn Drive>)
    }
}

/// The op's span on the timeline's `ops` row.
pub(super) fn trace_op(
    tl: &crate::timeline::Timeline,
    name: &str,
    spec: &OpSpec,
    strategy: kungfu_topology::Strategy,
    path: &str,
    started: std::time::Instant,
    r: &Result<super::OpOutput, crate::CollectiveError>,
) {
    let result = match r {
        Ok(_) => "ok".to_string(),
        Err(e) => e.to_string(),
    };
    let args = format!(
        r#""op":"{}","bytes":{},"path":"{path}","strategy":"{}","result":{}"#,
        spec.kind.name(),
        spec.block_bytes().unwrap_or(0),
        strategy.name(),
        crate::timeline::Timeline::quoted(&result)
    );
    tl.span(
        0,
        name,
        spec.kind.name(),
        started,
        std::time::Instant::now(),
        &args,
    );
}

impl<T: Transport> Inner<T> {
    /// Book-keeping of an op that ended (`ok`: its strategy, bytes and
    /// time), then its completion.
    pub(super) fn end_op(
        &self,
        tag: OpTag,
        ok: Option<(kungfu_topology::Strategy, usize, std::time::Duration)>,
        done: Callback,
        r: Result<super::OpOutput, crate::CollectiveError>,
    ) {
        if let Some((strategy, bytes, took)) = ok {
            lock(&self.stats)
                .entry(strategy)
                .or_default()
                .add(bytes, took);
        }
        lock(&self.pending).remove(&tag);
        lock(&self.names).end(tag.op);
        done(r);
        if self.inflight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.drained.notify_waiters();
        }
    }
}

/// Sends `abort` for op `tag` to every other rank.
pub(super) fn send_aborts<T: Transport>(inner: &Inner<T>, tag: OpTag, digest: u32, abort: &Abort) {
    let t = &inner.transport();
    let me = t.rank();
    let payload = abort.encode();
    let header = Header {
        kind: FrameKind::Abort,
        tag,
        chunk: 0,
        step: 0,
        digest,
        len: 0,
    };
    for r in (0..t.size() as u32).map(Rank).filter(|&r| r != me) {
        // strays: nobody waits for an error here
        drop(send_abort(inner, t, r, header, payload.clone()));
    }
}

/// Sends one abort frame to `to`, unless it is known lost. Best effort:
/// the local error stands either way; the send is bounded by the op
/// timeout. The task ends once the frame is handed to the wire (or the
/// send failed): an op awaits it, briefly, before it reports its error,
/// so that a worker that exits on the error still tells its peers why
/// (else they would blame it, not the rank it lost).
pub(super) fn send_abort<T: Transport>(
    inner: &Inner<T>,
    t: &Arc<T>,
    to: Rank,
    header: Header,
    payload: Bytes,
) -> Option<tokio::task::JoinHandle<()>> {
    if t.check_peers(&[to].into_iter().collect()).is_err() {
        return None;
    }
    let t = t.clone();
    let budget = inner.config.op_timeout;
    Some(inner.runtime.spawn(async move {
        let _ = tokio::time::timeout(budget, t.send(to, header, payload)).await;
    }))
}

/// Reads strays (frames of finished ops) and tells every rank when one
/// reveals a disagreeing peer. Ends when the session is dropped or the
/// transport closes.
pub(super) async fn watch_strays<T: Transport>(weak: std::sync::Weak<Inner<T>>) {
    loop {
        let Some(inner) = weak.upgrade() else { return };
        // the current transport: after a transport swap, the new one's
        let t = inner.transport();
        drop(inner);
        // Wake up now and then to notice that the session is gone.
        let f = match t
            .recv_stray(Instant::now() + Duration::from_millis(500))
            .await
        {
            Ok(f) => f,
            Err(TransportError::Timeout { .. }) => continue,
            Err(_) => return,
        };
        if f.header.kind != FrameKind::Data {
            continue;
        }
        let Some(inner) = weak.upgrade() else { return };
        let tomb = lock(&inner.tombstones).map.get(&f.header.tag).copied();
        if let Some((digest, spec)) = tomb {
            if f.header.digest != digest {
                let abort = Abort::new(AbortReason::Mismatch, t.rank(), f.from, &spec);
                send_aborts(&inner, f.header.tag, digest, &abort);
            }
        }
    }
}

/// What a monitored op ([`Start::norms`]: a sum of f32 whose last element
/// is the monitors' spare) puts in its spare before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Spare {
    /// Not a monitored op.
    Untouched,
    /// Its reduction sums the squares: the spare adds nothing.
    Zero,
    /// It does not: the spare carries this rank's squared norm of the
    /// rest, summed over the ranks by the op itself.
    LocalNorm,
}

impl Spare {
    fn fill(self, work: &mut [u8]) {
        let Some(at) = work.len().checked_sub(4) else {
            return;
        };
        let v = match self {
            Spare::Untouched => return,
            Spare::Zero => 0.0f32,
            Spare::LocalNorm => crate::dtype::sq_norm_bytes(&work[..at]) as f32,
        };
        work[at..].copy_from_slice(&v.to_le_bytes());
    }
}
