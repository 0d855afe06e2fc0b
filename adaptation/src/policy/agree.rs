//! The agreement: each worker's proposals encoded in a fixed number of
//! slots, gathered in one allgather, and decided by the same rule on
//! every worker; and the [`Adapter`] that runs the policies' hooks and
//! applies what was agreed.

use kungfu_collectives::{CollectiveError, OpStats, PeerStats, Session};
use kungfu_topology::Strategy;
use kungfu_transport::any::TransportKind;
use kungfu_transport::Transport;

use super::{Action, Context, Policy, Progress};

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
}
