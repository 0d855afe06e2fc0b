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

use std::time::Duration;

use kungfu_collectives::{CollectiveError, OpStats, PeerStats, Session};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::any::TransportKind;
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
    pub ops: &'a [(Strategy, OpStats)],
    /// What completed ops received from each peer, by rank, cumulative:
    /// [`Session::peer_stats`].
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

/// Switches to the fastest of `candidates`: every `window` steps it
/// measures the rate of the strategy in use (bytes per second of op time
/// over the window, from [`Context::ops`]), proposes each candidate not yet
/// measured in turn, and then the fastest one when it beats the strategy
/// in use by more than `margin` (a fraction). Rates are re-measured while a
/// strategy is in use, so one that becomes slower (a slow link, a
/// straggler) is left.
#[derive(Clone, Debug)]
pub struct FastestStrategy {
    pub candidates: Vec<Strategy>,
    pub window: u64,
    pub margin: f64,
    rates: Vec<Option<f64>>,
    last: (u64, Duration),
}

impl FastestStrategy {
    pub fn new(candidates: Vec<Strategy>, window: u64, margin: f64) -> FastestStrategy {
        FastestStrategy {
            rates: vec![None; candidates.len()],
            candidates,
            window,
            margin,
            last: (0, Duration::ZERO),
        }
    }

    /// The rate measured for each candidate so far (bytes per second).
    pub fn rates(&self) -> Vec<(Strategy, Option<f64>)> {
        self.candidates
            .iter()
            .copied()
            .zip(self.rates.iter().copied())
            .collect()
    }
}

impl Policy for FastestStrategy {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        if self.window == 0 || !cx.progress.step.is_multiple_of(self.window) {
            return Vec::new();
        }
        let now = cx.op_totals();
        let (bytes, busy) = (
            now.0.saturating_sub(self.last.0),
            now.1.saturating_sub(self.last.1),
        );
        self.last = now;
        if busy.is_zero() || bytes == 0 {
            return Vec::new();
        }
        let rate = bytes as f64 / busy.as_secs_f64();
        let cur = self.candidates.iter().position(|&c| c == cx.strategy);
        if let Some(i) = cur {
            self.rates[i] = Some(rate);
        }
        if let Some(i) = self.rates.iter().position(Option::is_none) {
            return vec![Action::SetStrategy(self.candidates[i])];
        }
        let (best, best_rate) = self
            .rates
            .iter()
            .enumerate()
            .filter_map(|(i, r)| Some((i, (*r)?)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .expect("every candidate measured");
        if Some(best) != cur && best_rate > rate * (1.0 + self.margin) {
            vec![Action::SetStrategy(self.candidates[best])]
        } else {
            Vec::new()
        }
    }
}

/// Resizes the cluster at given steps: `(step, size)` pairs.
#[derive(Clone, Debug)]
pub struct ScaleSchedule {
    pub at: Vec<(u64, u32)>,
}

impl Policy for ScaleSchedule {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        self.at
            .iter()
            .find(|(step, _)| *step == cx.progress.step)
            .map(|&(_, n)| vec![Action::Resize(n)])
            .unwrap_or_default()
    }
}

/// Scales out while it pays: every `every` steps it records the cluster's
/// throughput ([`Metrics::throughput`]) at the current size; it proposes
/// `step_size` more workers (up to `max_size`) while each scale-out raised
/// the throughput by at least `min_gain` (a fraction), and when one did
/// not (a plateau), goes back to the previous size and stays.
#[derive(Clone, Debug)]
pub struct ScaleOnPlateau {
    pub every: u64,
    pub step_size: u32,
    pub max_size: u32,
    pub min_gain: f64,
    seen: Vec<(u32, f64)>,
    settled: bool,
}

impl ScaleOnPlateau {
    pub fn new(every: u64, step_size: u32, max_size: u32, min_gain: f64) -> ScaleOnPlateau {
        ScaleOnPlateau {
            every,
            step_size,
            max_size,
            min_gain,
            seen: Vec::new(),
            settled: false,
        }
    }

    /// Whether a plateau was found (no more proposals).
    pub fn settled(&self) -> bool {
        self.settled
    }
}

impl Policy for ScaleOnPlateau {
    fn after_step(&mut self, cx: &Context<'_>) -> Vec<Action> {
        let p = cx.progress;
        let Some(t) = p.metrics.throughput.filter(|t| t.is_finite()) else {
            return Vec::new();
        };
        if self.settled || self.every == 0 || !p.step.is_multiple_of(self.every) {
            return Vec::new();
        }
        let n = cx.size as u32;
        if let Some(&(prev_n, prev_t)) = self.seen.last() {
            if prev_n < n && t < prev_t * (1.0 + self.min_gain) {
                self.settled = true;
                return vec![Action::Resize(prev_n)];
            }
        }
        self.seen.push((n, t));
        let next = n.saturating_add(self.step_size);
        if next <= self.max_size && self.step_size > 0 {
            vec![Action::Resize(next)]
        } else {
            self.settled = true;
            Vec::new()
        }
    }
}

/// Slots of one worker's proposals in the agreement allgather.
const SLOTS: usize = 6;
const NONE: u64 = 0;

/// `x`'s code in a proposal: its place in `all` (every value's list), plus
/// one (0 is no proposal).
fn code_of<X: PartialEq>(all: &[X], x: X) -> u64 {
    all.iter()
        .position(|a| *a == x)
        .expect("every value is in ALL") as u64
        + 1
}

fn strategy_code(s: Strategy) -> u64 {
    code_of(&Strategy::ALL, s)
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
            Action::SetTransport(t) if v[5] == NONE => v[5] = code_of(&TransportKind::ALL, t),
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
    if let Some((code, _)) = first(5) {
        let t = usize::try_from(code - 1).ok();
        if let Some(&t) = t.and_then(|i| TransportKind::ALL.get(i)) {
            out.push(Action::SetTransport(t));
        }
    }
    out
}

/// What the policies see now.
fn context<'a, T: Transport>(
    session: &Session<T>,
    progress: &'a Progress,
    ops: &'a [(Strategy, OpStats)],
    peers: &'a [PeerStats],
) -> Context<'a> {
    Context {
        rank: session.rank(),
        size: session.size(),
        strategy: session.strategy(),
        progress,
        ops,
        peers,
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

    /// Moves to another session (after an elastic resize): agreement and
    /// strategy swaps go through it from now on.
    pub fn set_session(&mut self, session: Session<T>) {
        self.session = session;
    }

    fn run_hook(&mut self, hook: impl Fn(&mut dyn Policy, &Context<'_>) -> Vec<Action>) {
        let (ops, peers) = (self.session.op_stats(), self.session.peer_stats());
        let cx = context(&self.session, &self.progress, &ops, &peers);
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
        let (ops, peers) = (self.session.op_stats(), self.session.peer_stats());
        let cx = context(&self.session, &self.progress, &ops, &peers);
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
            Action::SetTransport(TransportKind::Tcp),
        ]);
        let all: Vec<u64> = [r0, r1, r2].concat();
        assert_eq!(
            decide(&all),
            vec![
                Action::SetStrategy(Strategy::Ring),
                Action::Resize(3),
                Action::SetBatchSize(64),
                Action::Custom { kind: 7, value: 99 },
                Action::SetTransport(TransportKind::Tcp),
            ]
        );
        assert!(decide(&[r0, r0].concat()).is_empty());
        // garbage from a peer is ignored, not a panic
        assert!(decide(&[u64::MAX, u64::MAX, u64::MAX, u64::MAX, 0, u64::MAX]).is_empty());
        for t in TransportKind::ALL {
            assert_eq!(
                decide(&encode(&[Action::SetTransport(t)])),
                vec![Action::SetTransport(t)]
            );
        }
        for s in Strategy::ALL {
            assert_eq!(
                decide(&encode(&[Action::SetStrategy(s)])),
                vec![Action::SetStrategy(s)]
            );
        }
    }

    /// One policy instance driven over 60 steps, its decisions applied
    /// as an adapter would: it acts only at every 10th step, only when
    /// the noise scale is off the batch in use by more than the
    /// tolerance, on multiples of the cluster size, within its bounds.
    #[test]
    fn adaptive_batch_size_follows_the_noise_scale() {
        let mut p = AdaptiveBatchSize {
            min: 32,
            max: 4096,
            every: 10,
            tolerance: 0.1,
        };
        let mut prog = Progress {
            batch_size: 128,
            ..Progress::default()
        };
        let mut decided = Vec::new();
        for step in 1..=70 {
            let (size, noise) = match step {
                ..=25 => (4, Some(1001.0)),
                26..=35 => (4, Some(1040.0)),
                36..=45 => (4, Some(1e9)),
                46..=55 => (4, Some(20.0)),
                56..=60 => (4, Some(f64::NAN)),
                _ => (3, Some(1001.0)),
            };
            prog.step = step;
            prog.metrics.noise_scale = noise;
            let got = p.after_step(&cx(size, Strategy::Auto, &prog, &[], &[]));
            for a in &got {
                if let Action::SetBatchSize(b) = a {
                    prog.batch_size = *b;
                }
            }
            if !got.is_empty() {
                decided.push((step, got));
            }
        }
        assert_eq!(
            decided,
            vec![
                // 1001 rounded to a multiple of 4
                (10, vec![Action::SetBatchSize(1000)]),
                // step 20: 1001 is within 10% of 1000; step 30: 1040 too
                (40, vec![Action::SetBatchSize(4096)]),
                (50, vec![Action::SetBatchSize(32)]),
                // step 60: no finite estimate; step 70: 3 workers
                (70, vec![Action::SetBatchSize(1002)]),
            ]
        );
        prog.metrics.noise_scale = None;
        prog.step = 80;
        assert!(p
            .after_step(&cx(3, Strategy::Auto, &prog, &[], &[]))
            .is_empty());
    }

    fn cx<'a>(
        size: usize,
        strategy: Strategy,
        progress: &'a Progress,
        ops: &'a [(Strategy, OpStats)],
        peers: &'a [PeerStats],
    ) -> Context<'a> {
        Context {
            rank: Rank(0),
            size,
            strategy,
            progress,
            ops,
            peers,
        }
    }

    fn stats(bytes: u64, ms: u64) -> OpStats {
        OpStats {
            ops: 1,
            bytes,
            busy: Duration::from_millis(ms),
        }
    }

    #[test]
    fn fastest_strategy_explores_then_keeps_the_fastest() {
        let mut p = FastestStrategy::new(vec![Strategy::Ring, Strategy::Star], 10, 0.1);
        let prog = |step| Progress {
            step,
            ..Progress::default()
        };
        // window 1 on RING: 1000 B in 10 ms; STAR not measured yet
        let ops = [(Strategy::Ring, stats(1000, 10))];
        let got = p.after_step(&cx(4, Strategy::Ring, &prog(10), &ops, &[]));
        assert_eq!(got, vec![Action::SetStrategy(Strategy::Star)]);
        // not a window step
        assert!(p
            .after_step(&cx(4, Strategy::Star, &prog(11), &ops, &[]))
            .is_empty());
        // window 2 on STAR: 1000 B more in 40 ms: slower; back to RING
        let ops = [
            (Strategy::Ring, stats(1000, 10)),
            (Strategy::Star, stats(1000, 40)),
        ];
        let got = p.after_step(&cx(4, Strategy::Star, &prog(20), &ops, &[]));
        assert_eq!(got, vec![Action::SetStrategy(Strategy::Ring)]);
        // window 3 on RING as fast as before: stay
        let ops = [
            (Strategy::Ring, stats(2000, 20)),
            (Strategy::Star, stats(1000, 40)),
        ];
        assert!(p
            .after_step(&cx(4, Strategy::Ring, &prog(30), &ops, &[]))
            .is_empty());
        // window 4: RING became 10x slower (a slow link): STAR wins again
        let ops = [
            (Strategy::Ring, stats(3000, 120)),
            (Strategy::Star, stats(1000, 40)),
        ];
        let got = p.after_step(&cx(4, Strategy::Ring, &prog(40), &ops, &[]));
        assert_eq!(got, vec![Action::SetStrategy(Strategy::Star)]);
        assert_eq!(p.rates()[0].1, Some(1000.0 / 0.1));
    }

    #[test]
    fn scale_policies_propose_resizes() {
        let mut sched = ScaleSchedule {
            at: vec![(5, 4), (9, 2)],
        };
        let at = |step| Progress {
            step,
            ..Progress::default()
        };
        assert_eq!(
            sched.after_step(&cx(2, Strategy::Auto, &at(5), &[], &[])),
            vec![Action::Resize(4)]
        );
        assert!(sched
            .after_step(&cx(4, Strategy::Auto, &at(6), &[], &[]))
            .is_empty());

        let mut p = ScaleOnPlateau::new(10, 1, 8, 0.1);
        let tp = |step, t| Progress {
            step,
            metrics: Metrics {
                throughput: Some(t),
                ..Metrics::default()
            },
            ..Progress::default()
        };
        let run = |p: &mut ScaleOnPlateau, n, step, t| {
            p.after_step(&cx(n, Strategy::Auto, &tp(step, t), &[], &[]))
        };
        assert_eq!(run(&mut p, 2, 10, 100.0), vec![Action::Resize(3)]);
        assert!(run(&mut p, 3, 15, 150.0).is_empty(), "only every 10 steps");
        assert_eq!(run(&mut p, 3, 20, 150.0), vec![Action::Resize(4)]);
        // 4 workers are barely faster than 3: back to 3, and stay
        assert_eq!(run(&mut p, 4, 30, 155.0), vec![Action::Resize(3)]);
        assert!(p.settled());
        assert!(run(&mut p, 3, 40, 150.0).is_empty());
    }

    #[test]
    fn a_straggler_stands_out() {
        let peer = |ms: u64| PeerStats {
            ops: 10,
            frames: 10,
            bytes: 1000,
            last_frame: Duration::from_millis(ms * 10),
        };
        let prog = Progress::default();
        let peers = [PeerStats::default(), peer(1), peer(2), peer(30)];
        let c = cx(4, Strategy::Auto, &prog, &[], &peers);
        assert_eq!(c.straggler(3.0), Some(Rank(3)));
        let peers = [PeerStats::default(), peer(1), peer(2), peer(3)];
        let c = cx(4, Strategy::Auto, &prog, &[], &peers);
        assert_eq!(c.straggler(3.0), None);
    }
}
