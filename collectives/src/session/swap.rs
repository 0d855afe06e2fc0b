//! The swap: the gate that holds ops started during a swap and the
//! agreement at its barrier ([`SwapGate`], sans-IO), the session's async
//! swap on top of it, and the tombstones of finished ops.

use std::collections::HashMap;
use std::sync::Arc;

use kungfu_topology::{PeerList, Strategy};
use kungfu_transport::{Epoch, OpTag, Transport};

use super::{lock, Callback, OpHandle, Session};
use crate::{CollectiveError, OpSpec};

/// An op started during a swap, with its input copied (or its memory held).
pub(super) struct Deferred {
    pub(super) name: Arc<str>,
    pub(super) spec: OpSpec,
    pub(super) memory: super::output::HeldMemory,
    pub(super) done: Callback,
    pub(super) internal: bool,
    pub(super) scope: Option<Arc<super::scope::Scope>>,
    pub(super) norms: bool,
    /// When it began to wait (the timeline's `queued` span).
    pub(super) since: std::time::Instant,
}

/// How many finished ops are remembered, to judge their late frames.
const TOMBSTONES: usize = 4096;

/// One rank's side of a strategy swap, without I/O: the gate that holds
/// the ops started while the swap runs (`D`: whatever the caller needs to
/// start one later), and the agreement at the barrier. The caller drives
/// it:
///
/// 1. [`SwapGate::begin`]; from now on [`SwapGate::admit`] holds ops;
/// 2. drain: wait until every op in flight here has ended;
/// 3. run a consensus on [`SwapGate::agreement`]'s digest (under
///    [`Agreement::NAME`], at the current epoch, not held by the gate);
/// 4. [`SwapGate::agreed`]: the epoch to advance the transport to;
/// 5. [`SwapGate::end`] (also when a step failed): the held ops, in the
///    order they were admitted, to start now (at the new epoch if it
///    advanced).
pub struct SwapGate<D> {
    swap: Option<Swap<D>>,
}

/// What a swap changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SwapTo {
    Strategy(Strategy),
    /// The transport: its name, which every rank must ask for alike (e.g.
    /// `fabric (tcp;ofi_rxm)`), and whether this rank can connect it.
    Transport {
        name: String,
        available: bool,
    },
}

impl SwapTo {
    fn describe(&self) -> String {
        match self {
            SwapTo::Strategy(s) => format!("strategy {}", s.name()),
            SwapTo::Transport {
                name,
                available: true,
            } => format!("transport {name}"),
            SwapTo::Transport {
                name,
                available: false,
            } => {
                format!("transport {name}, not available here")
            }
        }
    }

    fn digest_bytes(&self) -> Vec<u8> {
        match self {
            SwapTo::Strategy(s) => s.name().as_bytes().to_vec(),
            SwapTo::Transport { name, available } => {
                let mut b = b"transport\0".to_vec();
                b.extend_from_slice(name.as_bytes());
                b.push(u8::from(*available));
                b
            }
        }
    }
}

struct Swap<D> {
    to: SwapTo,
    held: Vec<D>,
    /// Once asked for: the epoch the swap leaves and what must be agreed.
    agreement: Option<(Epoch, Agreement)>,
}

/// What every rank must agree on before a swap takes effect.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Agreement {
    /// The epoch the new strategy takes effect at.
    pub next: Epoch,
    /// The digest of the strategy, `next` and the ranks it runs over.
    pub digest: [u8; 8],
}

impl Agreement {
    /// The name of a swap's consensus (internal names end in NUL).
    pub const NAME: &'static str = "kf/swap\0";
    /// The name of a transport swap's second consensus: every rank
    /// connected the new transport.
    pub const CONNECTED: &'static str = "kf/swap-connected\0";
}

impl<D> Default for SwapGate<D> {
    fn default() -> Self {
        SwapGate { swap: None }
    }
}

fn invalid(reason: String) -> CollectiveError {
    CollectiveError::InvalidArgument {
        name: "<swap>".into(),
        reason,
    }
}

impl<D> SwapGate<D> {
    /// Whether a swap is under way: ops admitted now are held.
    pub fn swapping(&self) -> bool {
        self.swap.is_some()
    }

    /// Starts a swap to `to`: ops admitted from now on are held.
    pub fn begin(&mut self, to: SwapTo) -> Result<(), CollectiveError> {
        if self.swap.is_some() {
            return Err(invalid("another swap is under way on this session".into()));
        }
        self.swap = Some(Swap {
            to,
            held: Vec::new(),
            agreement: None,
        });
        Ok(())
    }

    /// An op started by the caller: given back to be started now, or,
    /// while a swap is under way, turned into what is held by `hold`
    /// (which runs only then, e.g. to copy the op's input) and kept.
    pub fn admit<A>(&mut self, op: A, hold: impl FnOnce(A) -> D) -> Option<A> {
        match &mut self.swap {
            Some(s) => {
                s.held.push(hold(op));
                None
            }
            None => Some(op),
        }
    }

    /// Once every op in flight has ended: what the ranks must agree on to
    /// leave `epoch` (the current one) over `peers`: the strategy, the
    /// epoch it takes effect at, and the ranks it runs over. Fails if no
    /// swap is under way or `epoch` is the last.
    pub fn agreement(
        &mut self,
        epoch: Epoch,
        peers: &PeerList,
    ) -> Result<Agreement, CollectiveError> {
        let s = self
            .swap
            .as_mut()
            .ok_or_else(|| invalid("no swap is under way".into()))?;
        let next = Epoch(
            epoch
                .0
                .checked_add(1)
                .ok_or_else(|| invalid(format!("{epoch} is the last epoch")))?,
        );
        let digest = kungfu_topology::Digest::EMPTY
            .bytes(&s.to.digest_bytes())
            .u64(u64::from(next.0))
            .u64(peers.digest().0)
            .0
            .to_le_bytes();
        let a = Agreement { next, digest };
        s.agreement = Some((epoch, a));
        Ok(a)
    }

    /// The consensus on [`SwapGate::agreement`] ended: `same` if every
    /// rank passed the same digest. Gives the epoch to advance the
    /// transport to and the strategy to run on from then; if the ranks
    /// disagree, nothing changes and every rank gets
    /// [`CollectiveError::Mismatch`].
    pub fn agreed(&self, same: bool) -> Result<(Epoch, SwapTo), CollectiveError> {
        let Some(Swap {
            to,
            agreement: Some((epoch, a)),
            ..
        }) = &self.swap
        else {
            return Err(invalid("no agreement was asked for".into()));
        };
        if !same {
            let what = match to {
                SwapTo::Strategy(_) => "different strategies",
                SwapTo::Transport { .. } => {
                    "different transports, or one not available on every rank"
                }
            };
            return Err(CollectiveError::Mismatch {
                name: Agreement::NAME.into(),
                epoch: *epoch,
                ranks: Vec::new(),
                detail: format!("ranks asked to swap to {what} ({} here)", to.describe()),
            });
        }
        Ok((a.next, to.clone()))
    }

    /// Ends the swap, whether it took effect or not: the held ops, in the
    /// order they were admitted. Ops admitted from now on start at once.
    pub fn end(&mut self) -> Vec<D> {
        self.swap.take().map(|s| s.held).unwrap_or_default()
    }
}

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
        lock(&self.inner.gate).swapping()
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
        let no_connect = |_: Epoch| async { unreachable!("a strategy swap connects nothing") };
        self.swap(SwapTo::Strategy(s), no_connect).await
    }

    /// Changes the transport at a consistency barrier, as
    /// [`Session::swap_strategy`] changes the strategy; a collective.
    ///
    /// Ops started before the call finish on the old transport; ops
    /// started meanwhile wait. The ranks agree (over the old transport)
    /// that they all asked for `name` and can connect it here
    /// (`available`): if not, nothing changes and every rank gets
    /// [`CollectiveError::Mismatch`]. Then each calls `connect` with the
    /// epoch the new transport starts at, and the ranks agree again that
    /// every one connected: if one could not, every rank gets an error and
    /// stays on the old transport (the new ones are shut down). Otherwise
    /// later ops run on the new transport, and the old one closes in the
    /// background (its goodbyes, within `linger`). Returns the new epoch.
    pub async fn swap_transport<F, Fut>(
        &self,
        name: &str,
        available: bool,
        connect: F,
    ) -> Result<Epoch, CollectiveError>
    where
        F: FnOnce(Epoch) -> Fut,
        Fut: std::future::Future<Output = Result<Arc<T>, CollectiveError>>,
    {
        let to = SwapTo::Transport {
            name: name.to_string(),
            available,
        };
        self.swap(to, connect).await
    }

    async fn swap<F, Fut>(&self, to: SwapTo, connect: F) -> Result<Epoch, CollectiveError>
    where
        F: FnOnce(Epoch) -> Fut,
        Fut: std::future::Future<Output = Result<Arc<T>, CollectiveError>>,
    {
        if self.scope.is_some() {
            return Err(CollectiveError::InvalidArgument {
                name: "<swap>".into(),
                reason: "a swap is a collective of the whole session, not of a subgroup".into(),
            });
        }
        lock(&self.inner.gate).begin(to)?;
        // Reopens the gate even if this future is dropped half-way (the
        // ranks may then disagree on the epoch, and later ops fail on
        // their timeout, but none waits here for ever).
        struct Reopen<'a, T: Transport>(&'a Session<T>);
        impl<T: Transport> Drop for Reopen<'_, T> {
            fn drop(&mut self) {
                let s = self.0;
                // Started under the lock, so an op started meanwhile by
                // another thread cannot overtake them.
                let mut g = lock(&s.inner.gate);
                for d in g.end() {
                    if let Some(tl) = &s.inner.config.timeline {
                        let now = std::time::Instant::now();
                        tl.span(0, &d.name, "queued", d.since, now, r#""phase":"queued""#);
                    }
                    drop(s.start_now(super::output::Start {
                        name: d.name,
                        spec: d.spec,
                        mem: d.memory.as_memory(),
                        done: d.done,
                        internal: d.internal,
                        waited: false,
                        scope: d.scope,
                        norms: d.norms,
                    }));
                }
            }
        }
        let _reopen = Reopen(self);
        self.swap_gated(connect).await
    }

    async fn swap_gated<F, Fut>(&self, connect: F) -> Result<Epoch, CollectiveError>
    where
        F: FnOnce(Epoch) -> Fut,
        Fut: std::future::Future<Output = Result<Arc<T>, CollectiveError>>,
    {
        use std::sync::atomic::Ordering;
        // Drain: every op in flight here ends (each within its own timeout).
        loop {
            let drained = self.inner.drained.notified();
            if self.inner.inflight.load(Ordering::SeqCst) == 0 {
                break;
            }
            drained.await;
        }
        let agreement = lock(&self.inner.gate).agreement(self.epoch(), &self.inner.peers)?;
        let (tx, h) = OpHandle::<bool>::pair();
        self.consensus_with(Agreement::NAME, &agreement.digest, true, tx);
        let same = h.await?;
        let (next, to) = lock(&self.inner.gate).agreed(same)?;
        match to {
            SwapTo::Strategy(s) => {
                self.inner.transport().advance_epoch(next);
                self.set_strategy(s);
            }
            SwapTo::Transport { name, .. } => {
                let new = connect(next).await;
                // every rank connected, or all stay (agreed over the old)
                let (tx, h) = OpHandle::<bool>::pair();
                self.consensus_with(Agreement::CONNECTED, &[u8::from(new.is_ok())], true, tx);
                let all = h.await?;
                let new = match (new, all) {
                    (Ok(t), true) => t,
                    (Ok(t), false) => {
                        t.shutdown();
                        return Err(CollectiveError::Transport {
                            name: Agreement::CONNECTED.into(),
                            epoch: self.epoch(),
                            source: kungfu_transport::TransportError::Unavailable {
                                transport: name,
                                reason: "another rank could not connect it; staying on the old transport".into(),
                            },
                        });
                    }
                    (Err(e), _) => return Err(e),
                };
                let old = std::mem::replace(
                    &mut *self
                        .inner
                        .transport
                        .write()
                        .unwrap_or_else(|e| e.into_inner()),
                    new,
                );
                let linger = self
                    .inner
                    .config
                    .op_timeout
                    .min(std::time::Duration::from_secs(5));
                self.inner
                    .runtime
                    .spawn(async move { old.close(linger).await });
            }
        }
        Ok(next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gate_holds_ops_in_order_only_while_swapping() {
        let mut g = SwapGate::<u32>::default();
        assert_eq!(g.admit(1, |_| unreachable!("not held")), Some(1));
        g.begin(SwapTo::Strategy(Strategy::Ring)).unwrap();
        assert!(
            g.begin(SwapTo::Strategy(Strategy::Ring)).is_err(),
            "one swap at a time"
        );
        assert_eq!(g.admit(2, |x| x * 10), None);
        assert_eq!(g.admit(3, |x| x * 10), None);
        assert_eq!(g.end(), [20, 30]);
        assert!(!g.swapping());
        assert_eq!(g.admit(4, |_| unreachable!("not held")), Some(4));
        assert!(g.end().is_empty());
    }

    #[test]
    fn the_agreement_names_the_strategy_the_next_epoch_and_the_ranks() {
        let peers = PeerList::local(3);
        let mut g = SwapGate::<()>::default();
        assert!(g.agreement(Epoch(0), &peers).is_err(), "no swap");
        g.begin(SwapTo::Strategy(Strategy::Ring)).unwrap();
        assert!(g.agreed(true).is_err(), "nothing asked yet");
        let a = g.agreement(Epoch(4), &peers).unwrap();
        assert_eq!(a.next, Epoch(5));
        assert_eq!(
            g.agreed(true).unwrap(),
            (Epoch(5), SwapTo::Strategy(Strategy::Ring))
        );
        match g.agreed(false) {
            Err(CollectiveError::Mismatch { epoch, detail, .. }) => {
                assert_eq!(epoch, Epoch(4));
                assert!(detail.contains("RING"), "{detail}");
            }
            r => panic!("{r:?}"),
        }
        let digest = |s, e, p: &PeerList| {
            let mut g = SwapGate::<()>::default();
            g.begin(SwapTo::Strategy(s)).unwrap();
            g.agreement(e, p).unwrap().digest
        };
        assert_eq!(digest(Strategy::Ring, Epoch(4), &peers), a.digest);
        assert_ne!(digest(Strategy::Star, Epoch(4), &peers), a.digest);
        assert_ne!(digest(Strategy::Ring, Epoch(5), &peers), a.digest);
        assert_ne!(
            digest(Strategy::Ring, Epoch(4), &PeerList::local(4)),
            a.digest
        );
        assert!(
            g.agreement(Epoch(u32::MAX), &peers).is_err(),
            "the last epoch"
        );
    }
}
