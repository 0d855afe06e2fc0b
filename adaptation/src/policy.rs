//! The adaptation-policy API and the agreement that keeps workers
//! consistent.
//!
//! A [`Policy`] reads the training progress and the monitors and proposes
//! [`Action`]s from its hooks. Proposals are local: workers see slightly
//! different metrics, and only some of them may propose. An [`Adapter`]
//! turns them into decisions every worker shares: at each agreement point
//! (which every worker reaches at the same step), the proposals of all
//! workers are gathered in one small allgather, and every worker applies the
//! same deterministic rule to the same list: per kind of action, the
//! proposal of the lowest-ranked proposer wins. The adapter applies strategy
//! changes itself (ops started after the point use the new strategy, ops in
//! flight keep theirs, and every worker switches at the same point of its
//! op sequence); the others are handed to the application.

use kungfu_collectives::{CollectiveError, Session};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::Transport;

/// What a policy may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Communicate with another strategy from the agreement point on.
    SetStrategy(Strategy),
    /// Grow or shrink the cluster to this many workers (elastic resizing).
    Resize(u32),
    /// Train with this global batch size.
    SetBatchSize(u32),
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

/// Adaptive batch size from the gradient noise scale: every `every` steps,
/// proposes the noise scale (rounded to a multiple of the cluster size,
/// clamped to `[min, max]`) when it differs from the batch size in use by
/// more than `tolerance` (a fraction).
#[derive(Clone, Debug)]
pub struct AdaptiveBatchSize {
    pub min: u32,
    pub max: u32,
    pub every: u64,
    pub tolerance: f64,
}

impl Policy for AdaptiveBatchSize {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        let p = cx.progress;
        let Some(b) = p.metrics.noise_scale else {
            return Vec::new();
        };
        if self.every == 0 || !p.step.is_multiple_of(self.every) || !b.is_finite() {
            return Vec::new();
        }
        let n = cx.size.max(1) as f64;
        let target = ((b / n).round().max(1.0) * n).clamp(f64::from(self.min), f64::from(self.max));
        let cur = f64::from(p.batch_size.max(1));
        if (target - cur).abs() / cur > self.tolerance {
            vec![Action::SetBatchSize(target as u32)]
        } else {
            Vec::new()
        }
    }
}

/// Slots of one worker's proposals in the agreement allgather.
const SLOTS: usize = 5;
const NONE: u64 = 0;

fn strategy_code(s: Strategy) -> u64 {
    Strategy::ALL
        .iter()
        .position(|&x| x == s)
        .expect("every strategy is in ALL") as u64
        + 1
}

fn encode(actions: &[Action]) -> [u64; SLOTS] {
    let mut v = [NONE; SLOTS];
    // the first proposal of each kind counts
    for a in actions {
        match *a {
            Action::SetStrategy(s) if v[0] == NONE => v[0] = strategy_code(s),
            Action::Resize(n) if v[1] == NONE => v[1] = u64::from(n) + 1,
            Action::SetBatchSize(b) if v[2] == NONE => v[2] = u64::from(b) + 1,
            Action::Custom { kind, value } if v[3] == NONE => {
                v[3] = u64::from(kind) + 1;
                v[4] = value;
            }
            _ => {}
        }
    }
    v
}

/// The agreed actions from every worker's proposals, in rank order: per
/// kind, the lowest-ranked proposer wins. Values no worker could have sent
/// (a corrupt or foreign peer) are ignored.
fn decide(all: &[u64]) -> Vec<Action> {
    let mut out = Vec::new();
    let first = |slot: usize| {
        all.chunks_exact(SLOTS)
            .map(|c| (c[slot], c))
            .find(|(v, _)| *v != NONE)
    };
    if let Some((code, _)) = first(0) {
        if let Some(&s) = usize::try_from(code - 1)
            .ok()
            .and_then(|i| Strategy::ALL.get(i))
        {
            out.push(Action::SetStrategy(s));
        }
    }
    if let Some((n, _)) = first(1) {
        if let Ok(n) = u32::try_from(n - 1) {
            out.push(Action::Resize(n));
        }
    }
    if let Some((b, _)) = first(2) {
        if let Ok(b) = u32::try_from(b - 1) {
            out.push(Action::SetBatchSize(b));
        }
    }
    if let Some((k, c)) = first(3) {
        if let Ok(kind) = u16::try_from(k - 1) {
            out.push(Action::Custom { kind, value: c[4] });
        }
    }
    out
}

/// What the policies see now.
fn context<'a, T: Transport>(session: &Session<T>, progress: &'a Progress) -> Context<'a> {
    Context {
        rank: session.rank(),
        size: session.size(),
        strategy: session.strategy(),
        progress,
    }
}

/// Runs the policies and makes their proposals decisions every worker
/// shares. Every worker calls the same hooks at the same steps (they are
/// collective).
pub struct Adapter<T: Transport> {
    session: Session<T>,
    policies: Vec<Box<dyn Policy>>,
    pending: Vec<Action>,
    /// The progress the policies see; the application updates it.
    pub progress: Progress,
    /// Every agreed action and the step it took effect.
    history: Vec<(u64, Action)>,
}

impl<T: Transport> Adapter<T> {
    pub fn new(session: Session<T>, policies: Vec<Box<dyn Policy>>) -> Adapter<T> {
        Adapter {
            session,
            policies,
            pending: Vec::new(),
            progress: Progress::default(),
            history: Vec::new(),
        }
    }

    pub fn session(&self) -> &Session<T> {
        &self.session
    }

    /// Proposes an action at the next agreement point (the application's
    /// own proposal, beside the policies').
    pub fn propose(&mut self, a: Action) {
        self.pending.push(a);
    }

    /// Every agreed action with the step at which it took effect.
    pub fn history(&self) -> &[(u64, Action)] {
        &self.history
    }

    fn run_hook(&mut self, hook: impl Fn(&mut dyn Policy, &Context<'_>) -> Vec<Action>) {
        let cx = context(&self.session, &self.progress);
        for p in &mut self.policies {
            let proposed = hook(p.as_mut(), &cx);
            self.pending.extend(proposed);
        }
    }

    /// Before training: runs `before_train` and agrees.
    pub async fn before_train(&mut self) -> Result<Vec<Action>, CollectiveError> {
        self.run_hook(|p, cx| p.before_train(cx));
        self.agree().await
    }

    /// At the start of an epoch: runs `before_epoch` and agrees.
    pub async fn before_epoch(&mut self) -> Result<Vec<Action>, CollectiveError> {
        self.run_hook(|p, cx| p.before_epoch(cx));
        self.agree().await
    }

    /// After a step (with `progress` updated): runs `after_step` and agrees.
    pub async fn after_step(&mut self) -> Result<Vec<Action>, CollectiveError> {
        self.run_hook(|p, cx| p.after_step(cx));
        self.agree().await
    }

    /// At the end of an epoch: runs `after_epoch` and agrees.
    pub async fn after_epoch(&mut self) -> Result<Vec<Action>, CollectiveError> {
        self.run_hook(|p, cx| p.after_epoch(cx));
        self.agree().await
    }

    /// After training: runs `after_train` (no agreement).
    pub fn after_train(&mut self) {
        let cx = context(&self.session, &self.progress);
        for p in &mut self.policies {
            p.after_train(&cx);
        }
    }

    /// An agreement point: gathers every worker's pending proposals,
    /// decides, applies strategy changes, and returns the decisions (the
    /// same on every worker). A collective: every worker calls it at the
    /// same point of its op sequence.
    pub async fn agree(&mut self) -> Result<Vec<Action>, CollectiveError> {
        let mine = encode(&std::mem::take(&mut self.pending));
        let all = self.session.allgather("kf/adapt/agree", &mine).await?;
        let decided = decide(&all);
        for a in &decided {
            if let Action::SetStrategy(s) = a {
                if *s != self.session.strategy() {
                    self.session.swap_strategy(*s).await?;
                }
            }
            if let Action::SetBatchSize(b) = a {
                self.progress.batch_size = *b;
            }
            self.history.push((self.progress.step, *a));
        }
        Ok(decided)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lowest_proposer_wins_per_kind() {
        let r0 = encode(&[]);
        let r1 = encode(&[
            Action::SetStrategy(Strategy::Ring),
            Action::SetBatchSize(64),
        ]);
        let r2 = encode(&[
            Action::SetStrategy(Strategy::Star),
            Action::Resize(3),
            Action::Custom { kind: 7, value: 99 },
        ]);
        let all: Vec<u64> = [r0, r1, r2].concat();
        assert_eq!(
            decide(&all),
            vec![
                Action::SetStrategy(Strategy::Ring),
                Action::Resize(3),
                Action::SetBatchSize(64),
                Action::Custom { kind: 7, value: 99 },
            ]
        );
        assert!(decide(&[r0, r0].concat()).is_empty());
        // garbage from a peer is ignored, not a panic
        assert!(decide(&[u64::MAX, u64::MAX, u64::MAX, u64::MAX, 0]).is_empty());
        for s in Strategy::ALL {
            assert_eq!(
                decide(&encode(&[Action::SetStrategy(s)])),
                vec![Action::SetStrategy(s)]
            );
        }
    }

    #[test]
    fn adaptive_batch_size_proposes_multiples_of_the_cluster() {
        let mut p = AdaptiveBatchSize {
            min: 32,
            max: 4096,
            every: 10,
            tolerance: 0.1,
        };
        let mut prog = Progress {
            step: 10,
            batch_size: 128,
            metrics: Metrics {
                noise_scale: Some(1001.0),
                ..Metrics::default()
            },
            ..Progress::default()
        };
        let cx = |prog: &Progress| -> Vec<Action> {
            let cx = Context {
                rank: Rank(0),
                size: 4,
                strategy: Strategy::Auto,
                progress: prog,
            };
            p.clone().after_step(&cx)
        };
        assert_eq!(cx(&prog), vec![Action::SetBatchSize(1000)]);
        prog.step = 11;
        assert!(cx(&prog).is_empty(), "only every 10 steps");
        prog.step = 20;
        prog.batch_size = 1000;
        assert!(cx(&prog).is_empty(), "within tolerance");
        prog.metrics.noise_scale = Some(1e9);
        assert_eq!(cx(&prog), vec![Action::SetBatchSize(4096)]);
        let _ = &mut p;
    }
}
