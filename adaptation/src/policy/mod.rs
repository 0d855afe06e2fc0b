//! The adaptation-policy API and the agreement that keeps workers
//! consistent.
//!
//! A [`Policy`] reads the training progress and the monitors and proposes
//! [`Action`]s from its hooks. Proposals are local: workers see slightly
//! different metrics, and only some of them may propose. An [`Adapter`]
//! turns them into decisions every worker shares: at each agreement point
//! (which every worker reaches at the same step), the proposals of all
//! workers are gathered in one small allgather, and every worker applies the
//! same deterministic rule to the same list: per kind of action (and per
//! custom kind), the value proposed by the most workers wins, and a tie goes
//! to the most senior proposer's: the one in the cluster since the earliest
//! cluster version, then the lowest rank (a worker that just joined, whose
//! policies start afresh, cannot override the workers that were there).
//! The adapter applies strategy
//! changes itself (ops started after the point use the new strategy, ops in
//! flight keep theirs, and every worker switches at the same point of its
//! op sequence); the others are handed to the application.

use std::time::Duration;

use kungfu_collectives::{OpStats, PeerStats};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::any::TransportKind;

mod agree;
mod builtin;
#[cfg(test)]
mod tests;

pub use agree::{Adapter, MAX_CUSTOM};
pub use builtin::{AdaptiveBatchSize, FastestStrategy, ScaleOnPlateau, ScaleSchedule};

/// What a policy may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Communicate with another strategy from the agreement point on.
    SetStrategy(Strategy),
    /// Grow or shrink the cluster to this many workers (elastic resizing).
    Resize(u32),
    /// Train with this global batch size.
    SetBatchSize(u32),
    /// Move to this transport (a fast fabric failed or degraded: go on
    /// over TCP). Like a resize, the application applies it where it holds
    /// the worker: `kungfu::Worker::swap_transport` (a collective, which
    /// every worker reaches at the same point: right after the agreement).
    SetTransport(TransportKind),
    /// The application's own action: a kind and a value it interprets.
    Custom { kind: u16, value: u64 },
}

/// Live metrics a policy may read (the monitors fill them in).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Smoothed gradient noise scale `B_simple` (see `NoiseScale`).
    pub noise_scale: Option<f64>,
    /// Variance of the workers' gradients around their mean.
    pub grad_variance: Option<f64>,
    /// Examples per second of the whole cluster.
    pub throughput: Option<f64>,
    pub loss: Option<f64>,
}

/// Where training is.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Progress {
    pub step: u64,
    pub epoch: u64,
    /// The global batch size in use.
    pub batch_size: u32,
    pub metrics: Metrics,
}

/// What a policy sees at a hook.
#[derive(Clone, Copy, Debug)]
pub struct Context<'a> {
    pub rank: Rank,
    pub size: usize,
    pub strategy: Strategy,
    pub progress: &'a Progress,
    /// Ops completed so far by the strategy they ran on (`AUTO` resolved),
    /// cumulative: [`Session::op_stats`].
    ///
    /// [`Session::op_stats`]: kungfu_collectives::Session::op_stats
    pub ops: &'a [(Strategy, OpStats)],
    /// What completed ops received from each peer, by rank, cumulative:
    /// [`Session::peer_stats`].
    ///
    /// [`Session::peer_stats`]: kungfu_collectives::Session::peer_stats
    pub peers: &'a [PeerStats],
}

impl Context<'_> {
    /// Bytes and busy time of every completed op so far.
    pub fn op_totals(&self) -> (u64, Duration) {
        self.ops.iter().fold((0, Duration::ZERO), |(b, t), (_, o)| {
            (b + o.bytes, t + o.busy)
        })
    }

    /// The peer whose last frames come latest, if its mean latency is more
    /// than `factor` times the median of the others': a straggler or a
    /// slow link, as seen from this worker.
    pub fn straggler(&self, factor: f64) -> Option<Rank> {
        let mut lat: Vec<(f64, Rank)> = self
            .peers
            .iter()
            .enumerate()
            .filter_map(|(r, p)| Some((p.mean_latency()?.as_secs_f64(), Rank(r as u32))))
            .collect();
        if lat.len() < 2 {
            return None;
        }
        lat.sort_by(|a, b| a.0.total_cmp(&b.0));
        let (worst, who) = *lat.last().expect("two or more");
        let others = &lat[..lat.len() - 1];
        let median = others[others.len() / 2].0;
        (worst > factor * median).then_some(who)
    }
}

/// Hooks of the training loop; each returns the actions it proposes.
pub trait Policy: Send {
    fn before_train(&mut self, _cx: &Context<'_>) -> Vec<Action> {
        Vec::new()
    }
    fn before_epoch(&mut self, _cx: &Context<'_>) -> Vec<Action> {
        Vec::new()
    }
    fn after_step(&mut self, _cx: &Context<'_>) -> Vec<Action> {
        Vec::new()
    }
    fn after_epoch(&mut self, _cx: &Context<'_>) -> Vec<Action> {
        Vec::new()
    }
    fn after_train(&mut self, _cx: &Context<'_>) {}
}
