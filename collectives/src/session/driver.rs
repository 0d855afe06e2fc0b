//! Spawns ops and reports their completions; sends aborts and watches
//! strays.

use std::sync::Arc;

use bytes::Bytes;
use std::time::Duration;

use kungfu_topology::Rank;
use kungfu_transport::{FrameKind, Header, Instant, OpTag, Transport, TransportError};

use super::{lock, Callback, Inner, Memory, Session};
use crate::abort::{Abort, AbortReason};
use crate::OpSpec;

impl<T: Transport> Session<T> {
    pub(super) fn start_now(
        &self,
        name: Arc<str>,
        spec: OpSpec,
        mem: Memory,
        done: Callback,
        internal: bool,
    ) {
        // The caller's memory outlives the error report: its release may be
        // how the caller learns that the op ended.
        let keep = match &mem {
            Memory::Region(r) => Some(r.clone()),
            Memory::Input(_) => None,
        };
        match self.prepare(name.clone(), spec, mem, internal) {
            Ok(mut op) => {
                let inner = self.inner.clone();
                inner
                    .inflight
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                lock(&inner.pending).insert(op.m.tag(), (name, std::time::Instant::now()));
                // the op runs to its end on the transport it started on
                let t = inner.transport();
                self.inner.runtime.spawn(async move {
                    let started = std::time::Instant::now();
                    let r = op.run(&inner, &t).await;
                    if r.is_ok() {
                        lock(&inner.stats)
                            .entry(op.m.strategy())
                            .or_default()
                            .add(op.m.spec().block_bytes().unwrap_or(0), started.elapsed());
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
                    lock(&inner.pending).remove(&tag);
                    t.retire(tag);
                    lock(&inner.tombstones).insert(tag, op.m.digest(), *op.m.spec());
                    lock(&inner.names).end(tag.op);
                    done(r);
                    if inner
                        .inflight
                        .fetch_sub(1, std::sync::atomic::Ordering::SeqCst)
                        == 1
                    {
                        inner.drained.notify_waiters();
                    }
                });
            }
            Err(e) => {
                done(Err(e));
                drop(keep);
            }
        }
    }
}

/// Sends `abort` for op `tag` to every other rank.
fn send_aborts<T: Transport>(inner: &Inner<T>, tag: OpTag, digest: u32, abort: &Abort) {
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
