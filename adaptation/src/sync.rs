//! KungFu's synchronisation algorithms over plain `f32` buffers:
//!
//! - [`sync_sgd`]: synchronous SGD, every worker applies the average of
//!   the gradients;
//! - [`model_averaging`]: synchronous model averaging (every worker steps
//!   on its own gradient, then the models are averaged);
//! - [`PairAveraging`]: asynchronous decentralised SGD: after each local
//!   step a worker saves its model and averages it with the saved model of
//!   one random peer, which takes no part in the exchange
//!   ([`kungfu_collectives::p2p`]).

use kungfu_collectives::p2p::{P2pError, PeerStore};
use kungfu_collectives::{CollectiveError, ReduceOp, Session};
use kungfu_topology::Rank;
use kungfu_transport::mem::SeededRng;
use kungfu_transport::Transport;

/// Synchronous SGD: replaces `grad` by the average of every worker's
/// `grad` (allreduce under `name`). A collective.
pub async fn sync_sgd<T: Transport>(
    session: &Session<T>,
    name: &str,
    grad: &mut [f32],
) -> Result<(), CollectiveError> {
    session.allreduce_in_place(name, grad, ReduceOp::Avg).await
}

/// Synchronous model averaging: replaces `model` by the average of every
/// worker's `model`. Call it after each local step (or every few). A
/// collective.
pub async fn model_averaging<T: Transport>(
    session: &Session<T>,
    name: &str,
    model: &mut [f32],
) -> Result<(), CollectiveError> {
    session.allreduce_in_place(name, model, ReduceOp::Avg).await
}

/// Pair averaging (asynchronous decentralised SGD, as KungFu's
/// `PairAveragingOptimizer`): each worker saves its model after a step and
/// averages with one random peer's latest saved model.
pub struct PairAveraging<T: Transport> {
    store: PeerStore<T>,
    name: String,
    me: Rank,
    size: usize,
    rng: SeededRng,
}

impl<T: Transport> PairAveraging<T> {
    /// Every worker creates one (it also answers its peers' requests) and
    /// saves its initial model with [`PairAveraging::save`] before the
    /// others may ask for it.
    pub fn new(session: &Session<T>, name: &str, seed: u64) -> PairAveraging<T> {
        PairAveraging {
            store: PeerStore::new(session),
            name: name.to_string(),
            me: session.rank(),
            size: session.size(),
            rng: SeededRng::new(seed ^ u64::from(session.rank().0).wrapping_mul(0x9e37_79b9)),
        }
    }

    /// Publishes `model` as this worker's latest; returns its version.
    pub fn save(&self, model: &[f32]) -> Result<u64, P2pError> {
        self.store.save(&self.name, bytemuck::cast_slice(model))
    }

    /// Saves `model`, then averages it with a random peer's latest saved
    /// model; returns the peer and the version it averaged with. A single
    /// worker just saves (and returns its own rank, version 0).
    pub async fn step(&mut self, model: &mut [f32]) -> Result<(Rank, u64), P2pError> {
        self.save(model)?;
        if self.size < 2 {
            return Ok((self.me, 0));
        }
        let k = self.rng.below(self.size as u64 - 1) as u32;
        let peer = Rank(if k >= self.me.0 { k + 1 } else { k });
        let (version, bytes) = self.store.request(peer, &self.name).await?;
        if bytes.len() != model.len() * 4 {
            return Err(P2pError::Protocol {
                peer,
                reason: format!(
                    "its model has {} bytes, this one {}",
                    bytes.len(),
                    model.len() * 4
                ),
            });
        }
        for (m, c) in model.iter_mut().zip(bytes.chunks_exact(4)) {
            let other = f32::from_ne_bytes(c.try_into().expect("4 bytes"));
            *m = 0.5 * (*m + other);
        }
        Ok((peer, version))
    }

    /// The store underneath (to save or request other buffers).
    pub fn store(&self) -> &PeerStore<T> {
        &self.store
    }
}
