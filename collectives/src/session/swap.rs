//! The swap: the gate that holds ops started during a swap, the
//! consensus at the barrier, and the tombstones of finished ops.

use std::collections::HashMap;
use std::sync::Arc;

use kungfu_topology::Strategy;
use kungfu_transport::{Epoch, OpTag, Transport};

use super::{lock, Callback, OpHandle, Session};
use crate::{CollectiveError, OpSpec};

/// An op started during a swap, with its input copied.
pub(super) struct Deferred {
    pub(super) name: Arc<str>,
    pub(super) spec: OpSpec,
    pub(super) input: Vec<u8>,
    pub(super) done: Callback,
    pub(super) internal: bool,
}

/// How many finished ops are remembered, to judge their late frames.
const TOMBSTONES: usize = 4096;

/// The name of a swap's consensus (internal names end in NUL).
const SWAP_NAME: &str = "kf/swap\0";

/// The digest and spec of recently finished ops. A frame that arrives for
/// one of them with another digest comes from a rank that ran the op with
/// another spec after this rank was done: every rank is told.
#[derive(Default)]
pub(super) struct Tombstones {
    pub(super) map: HashMap<OpTag, (u32, OpSpec)>,
    order: std::collections::VecDeque<OpTag>,
}

impl Tombstones {
    pub(super) fn insert(&mut self, tag: OpTag, digest: u32, spec: OpSpec) {
        if self.map.insert(tag, (digest, spec)).is_none() {
            self.order.push_back(tag);
            if self.order.len() > TOMBSTONES {
                let old = self.order.pop_front().expect("non-empty");
                self.map.remove(&old);
            }
        }
    }
}

impl<T: Transport> Session<T> {
    /// Whether a swap ([`Session::swap_strategy`]) is under way here: ops
    /// started now wait for it and run at the new epoch.
    pub fn swapping(&self) -> bool {
        lock(&self.inner.gate).is_some()
    }

    /// Changes the strategy at a consistency barrier and advances the
    /// epoch; a collective: every rank calls it at the same point of its
    /// sequence of ops, with the same `s`.
    ///
    /// Ops started before the call finish on the old topology; ops started
    /// while the swap runs wait for it (in order) and start at the new
    /// epoch; then every rank checks that the others asked for the same
    /// strategy (consensus on its digest) and the epoch advances, so a
    /// late frame of the old epoch is refused. Returns the new epoch. If
    /// the ranks disagree, nothing changes and every rank gets
    /// [`CollectiveError::Mismatch`]; if the barrier fails (a lost peer, a
    /// timeout), its error, and the session stays at the old epoch.
    pub async fn swap_strategy(&self, s: Strategy) -> Result<Epoch, CollectiveError> {
        {
            let mut g = lock(&self.inner.gate);
            if g.is_some() {
                return Err(
                    self.invalid_err("<swap>", "another swap is under way on this session".into())
                );
            }
            *g = Some(Vec::new());
        }
        // Reopens the gate even if this future is dropped half-way (the
        // ranks may then disagree on the epoch, and later ops fail on
        // their timeout, but none waits here for ever).
        struct Reopen<'a, T: Transport>(&'a Session<T>);
        impl<T: Transport> Drop for Reopen<'_, T> {
            fn drop(&mut self) {
                let s = self.0;
                let mut g = lock(&s.inner.gate);
                for d in g.take().unwrap_or_default() {
                    s.start_now(d.name, d.spec, &d.input, d.done, d.internal);
                }
            }
        }
        let _reopen = Reopen(self);
        self.swap_gated(s).await
    }

    async fn swap_gated(&self, s: Strategy) -> Result<Epoch, CollectiveError> {
        use std::sync::atomic::Ordering;
        // Drain: every op in flight here ends (each within its own timeout).
        loop {
            let drained = self.inner.drained.notified();
            if self.inner.inflight.load(Ordering::SeqCst) == 0 {
                break;
            }
            drained.await;
        }
        let epoch = self.epoch();
        let next = Epoch(
            epoch
                .0
                .checked_add(1)
                .ok_or_else(|| self.invalid_err("<swap>", format!("{epoch} is the last epoch")))?,
        );
        // The digest of what every rank must agree on: the strategy, the
        // epoch it takes effect at, and the ranks it runs over.
        let digest = kungfu_topology::Digest::EMPTY
            .bytes(s.name().as_bytes())
            .u64(u64::from(next.0))
            .u64(self.inner.peers.digest().0)
            .0
            .to_le_bytes();
        let (tx, h) = OpHandle::<bool>::pair();
        self.consensus_with(SWAP_NAME, &digest, true, tx);
        if !h.await? {
            return Err(CollectiveError::Mismatch {
                name: SWAP_NAME.into(),
                epoch,
                ranks: Vec::new(),
                detail: format!(
                    "ranks asked to swap to different strategies ({} here)",
                    s.name()
                ),
            });
        }
        self.inner.transport.advance_epoch(next);
        self.set_strategy(s);
        Ok(next)
    }
}
