//! The agreement: each worker's proposals encoded in a fixed number of
//! slots, gathered in one allgather, and decided by the same rule on
//! every worker; and the [`Adapter`] that runs the policies' hooks and
//! applies what was agreed.

use kungfu_collectives::{CollectiveError, OpStats, PeerStats, Session};
use kungfu_topology::Strategy;
use kungfu_transport::any::TransportKind;
use kungfu_transport::Transport;

use super::{Action, Context, Policy, Progress};

/// Distinct custom kinds one worker may propose at one agreement point.
pub const MAX_CUSTOM: usize = 4;
/// Slots of one worker's proposals in the agreement allgather: its
/// seniority (the cluster version it joined at), then one slot per kind
/// (strategy, resize, batch size, transport) and a (kind, value) pair per
/// custom kind.
const SLOTS: usize = 5 + 2 * MAX_CUSTOM;
const JOINED: usize = 0;
const STRATEGY: usize = 1;
const RESIZE: usize = 2;
const BATCH: usize = 3;
const TRANSPORT: usize = 4;
const CUSTOM: usize = 5;
const NONE: u64 = 0;

/// `x`'s code in a proposal: its place in `all` (every value's list), plus
/// one (0 is no proposal).
fn code_of<X: PartialEq>(all: &[X], x: X) -> u64 {
    all.iter()
        .position(|a| *a == x)
        .expect("every value is in ALL") as u64
        + 1
}

/// The value of a code of `code_of` (None: no proposal, or no such value).
fn of_code<X: Copy>(all: &[X], code: u64) -> Option<X> {
    let i = usize::try_from(code.checked_sub(1)?).ok()?;
    all.get(i).copied()
}

/// The custom kinds of `actions`, in order of their first proposal.
fn custom_kinds(actions: &[Action]) -> Vec<u16> {
    let mut kinds = Vec::new();
    for a in actions {
        if let Action::Custom { kind, .. } = *a {
            if !kinds.contains(&kind) {
                kinds.push(kind);
            }
        }
    }
    kinds
}

/// One worker's proposals: the first of each kind (and of each custom
/// kind: at most [`MAX_CUSTOM`] of them, the first proposed) counts.
fn encode(joined: u64, actions: &[Action]) -> [u64; SLOTS] {
    let mut v = [NONE; SLOTS];
    v[JOINED] = joined;
    let mut customs = 0;
    for a in actions {
        match *a {
            Action::SetStrategy(s) if v[STRATEGY] == NONE => {
                v[STRATEGY] = code_of(&Strategy::ALL, s)
            }
            Action::Resize(n) if v[RESIZE] == NONE => v[RESIZE] = u64::from(n) + 1,
            Action::SetBatchSize(b) if v[BATCH] == NONE => v[BATCH] = u64::from(b) + 1,
            Action::SetTransport(t) if v[TRANSPORT] == NONE => {
                v[TRANSPORT] = code_of(&TransportKind::ALL, t)
            }
            Action::Custom { kind, value } => {
                let code = u64::from(kind) + 1;
                let have = (0..customs).any(|i| v[CUSTOM + 2 * i] == code);
                if !have && customs < MAX_CUSTOM {
                    v[CUSTOM + 2 * customs] = code;
                    v[CUSTOM + 2 * customs + 1] = value;
                    customs += 1;
                }
            }
            _ => {}
        }
    }
    v
}

/// The winner among `(value, seniority)` proposals: the value proposed by
/// the most workers; of values proposed equally often, the one whose most
/// senior proposer is the most senior (the lowest `(joined version, rank)`).
fn pick<V: PartialEq + Copy>(proposals: impl Iterator<Item = (V, (u64, usize))>) -> Option<V> {
    // (value, proposers, most senior proposer)
    let mut votes: Vec<(V, usize, (u64, usize))> = Vec::new();
    for (v, senior) in proposals {
        match votes.iter_mut().find(|(x, _, _)| *x == v) {
            Some(e) => {
                e.1 += 1;
                e.2 = e.2.min(senior);
            }
            None => votes.push((v, 1, senior)),
        }
    }
    votes
        .into_iter()
        .min_by_key(|&(_, n, senior)| (std::cmp::Reverse(n), senior))
        .map(|(v, _, _)| v)
}

/// The agreed actions from every worker's proposals (in rank order), the
/// same on every worker: per kind, and per custom kind, the value most
/// workers proposed, a tie going to the most senior proposer's (the one in
/// the cluster since the earliest cluster version, then the lowest rank).
/// So a worker that just joined cannot override what the others propose.
/// Values no worker could have sent (a corrupt or foreign peer) are
/// ignored.
fn decide(all: &[u64]) -> Vec<Action> {
    let workers = || {
        all.chunks_exact(SLOTS)
            .enumerate()
            .map(|(rank, c)| (c, (c[JOINED], rank)))
    };
    let slot = |i: usize| workers().filter_map(move |(c, s)| (c[i] != NONE).then_some((c[i], s)));
    let mut out = Vec::new();
    let strategy = slot(STRATEGY).filter_map(|(c, s)| Some((of_code(&Strategy::ALL, c)?, s)));
    out.extend(pick(strategy).map(Action::SetStrategy));
    let resize = slot(RESIZE).filter_map(|(n, s)| Some((u32::try_from(n - 1).ok()?, s)));
    out.extend(pick(resize).map(Action::Resize));
    let batch = slot(BATCH).filter_map(|(b, s)| Some((u32::try_from(b - 1).ok()?, s)));
    out.extend(pick(batch).map(Action::SetBatchSize));
    // every custom kind proposed (each worker's pairs), in kind order
    let customs = || {
        workers().flat_map(|(c, s)| {
            (0..MAX_CUSTOM).filter_map(move |i| {
                let kind = u16::try_from(c[CUSTOM + 2 * i].checked_sub(1)?).ok()?;
                Some((kind, c[CUSTOM + 2 * i + 1], s))
            })
        })
    };
    let mut kinds: Vec<u16> = customs().map(|(k, _, _)| k).collect();
    kinds.sort_unstable();
    kinds.dedup();
    for kind in kinds {
        let votes = customs()
            .filter(|&(k, _, _)| k == kind)
            .map(|(_, v, s)| (v, s));
        out.extend(pick(votes).map(|value| Action::Custom { kind, value }));
    }
    let transport =
        slot(TRANSPORT).filter_map(|(c, s)| Some((of_code(&TransportKind::ALL, c)?, s)));
    out.extend(pick(transport).map(Action::SetTransport));
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
    /// The cluster version this worker joined at: its seniority in the
    /// agreement (lower is more senior).
    joined: u64,
}

impl<T: Transport> Adapter<T> {
    /// An adapter over `session`, whose worker joined the cluster at the
    /// session's cluster version (see [`Adapter::set_joined`]).
    pub fn new(session: Session<T>, policies: Vec<Box<dyn Policy>>) -> Adapter<T> {
        let joined = session.generation().version.0;
        Adapter {
            session,
            policies,
            pending: Vec::new(),
            progress: Progress::default(),
            history: Vec::new(),
            joined,
        }
    }

    /// The cluster version at which this worker joined, when the adapter
    /// is made later than that (an application that makes it after a
    /// resize): its seniority in the agreement.
    pub fn set_joined(&mut self, version: u64) {
        self.joined = version;
    }

    /// Whether `a` has room at the next agreement point: a custom action
    /// of a kind not yet proposed has none once [`MAX_CUSTOM`] kinds are
    /// (it would be dropped).
    pub fn has_room_for(&self, a: &Action) -> bool {
        match a {
            Action::Custom { kind, .. } => {
                let kinds = custom_kinds(&self.pending);
                kinds.contains(kind) || kinds.len() < MAX_CUSTOM
            }
            _ => true,
        }
    }

    pub fn session(&self) -> &Session<T> {
        &self.session
    }

    /// Proposes an action at the next agreement point (the application's
    /// own proposal, beside the policies'). The first proposal of each
    /// kind, and of each of the first [`MAX_CUSTOM`] custom kinds, counts.
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
    /// decides (per kind, the value most workers proposed; a tie goes to
    /// the most senior proposer: earliest cluster version joined at, then
    /// lowest rank), applies strategy changes, and returns the decisions
    /// (the same on every worker). A collective: every worker calls it at the
    /// same point of its op sequence.
    pub async fn agree(&mut self) -> Result<Vec<Action>, CollectiveError> {
        let mine = encode(self.joined, &std::mem::take(&mut self.pending));
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

    fn at(joined: u64, actions: &[Action]) -> [u64; SLOTS] {
        encode(joined, actions)
    }

    #[test]
    fn a_lone_proposer_wins_and_every_kind_is_decided() {
        let r0 = at(0, &[]);
        let r1 = at(
            0,
            &[
                Action::SetStrategy(Strategy::Ring),
                Action::SetBatchSize(64),
            ],
        );
        let r2 = at(
            0,
            &[
                Action::SetStrategy(Strategy::Star),
                Action::Resize(3),
                Action::Custom { kind: 7, value: 99 },
                Action::Custom { kind: 2, value: 5 },
                Action::SetTransport(TransportKind::Tcp),
            ],
        );
        let all: Vec<u64> = [r0, r1, r2].concat();
        assert_eq!(
            decide(&all),
            vec![
                // one vote each: the lower rank of the same seniority
                Action::SetStrategy(Strategy::Ring),
                Action::Resize(3),
                Action::SetBatchSize(64),
                Action::Custom { kind: 2, value: 5 },
                Action::Custom { kind: 7, value: 99 },
                Action::SetTransport(TransportKind::Tcp),
            ]
        );
        assert!(decide(&[r0, r0].concat()).is_empty());
        // garbage from a peer is ignored, not a panic
        assert!(decide(&[u64::MAX; SLOTS]).is_empty());
        assert!(decide(&[u64::MAX; SLOTS * 3 + 1]).is_empty());
        for t in TransportKind::ALL {
            let a = Action::SetTransport(t);
            assert_eq!(decide(&at(0, &[a])), vec![a]);
        }
        for s in Strategy::ALL {
            let a = Action::SetStrategy(s);
            assert_eq!(decide(&at(0, &[a])), vec![a]);
        }
    }

    #[test]
    fn the_majority_wins_and_a_tie_goes_to_the_most_senior() {
        let b = Action::SetBatchSize;
        // ranks 0 and 1 joined at version 2 (a worker that just joined took
        // rank 0); ranks 2 and 3 are there since version 0
        let joiner = at(2, &[b(32)]);
        let old = at(0, &[b(256)]);
        let quiet = at(0, &[]);
        // one vote each: the senior's, not the lower rank's
        assert_eq!(decide(&[joiner, quiet, old, quiet].concat()), vec![b(256)]);
        // the same seniority: the lower rank
        assert_eq!(decide(&[quiet, at(0, &[b(8)]), old].concat()), vec![b(8)]);
        // more votes beat seniority
        let all = [at(0, &[b(256)]), at(1, &[b(64)]), at(2, &[b(64)])].concat();
        assert_eq!(decide(&all), vec![b(64)]);
        // per custom kind alike
        let c = |kind, value| Action::Custom { kind, value };
        let all = [
            at(3, &[c(1, 10), c(2, 20)]),
            at(0, &[c(1, 11)]),
            at(3, &[c(2, 21)]),
            at(3, &[c(2, 21)]),
        ]
        .concat();
        assert_eq!(decide(&all), vec![c(1, 11), c(2, 21)]);
    }

    #[test]
    fn customs_beyond_the_slots_are_refused_before_they_are_dropped() {
        let many: Vec<Action> = (0..6)
            .map(|k| Action::Custom { kind: k, value: 1 })
            .collect();
        let v = encode(0, &many);
        let kept: Vec<u64> = (0..MAX_CUSTOM).map(|i| v[CUSTOM + 2 * i]).collect();
        assert_eq!(kept, vec![1, 2, 3, 4]);
        // a repeated kind takes no slot: its first value counts
        let twice = [
            Action::Custom { kind: 9, value: 1 },
            Action::Custom { kind: 9, value: 2 },
        ];
        assert_eq!(
            decide(&encode(0, &twice)),
            vec![Action::Custom { kind: 9, value: 1 }]
        );
        assert_eq!(custom_kinds(&many).len(), 6);
    }
}
