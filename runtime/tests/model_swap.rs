//! A model of the strategy swap at a consistency barrier
//! ([`kungfu_collectives::Session::swap_strategy`]), checked with
//! stateright over every interleaving at a small bound.
//!
//! # What is modelled
//! Each worker runs one program: an allreduce `a`, the swap, then `a`
//! and a broadcast `b` from rank 0 (more ops make the state space grow
//! fast, and these cover an op before the swap, ops held by it, and an
//! op that depends on one peer only). Ops are issued without waiting for
//! each other, the ops of a segment in any order, so ops of the second
//! segment are issued while the swap runs. The swap's decisions are the
//! real [`SwapGate`]'s (`begin`, `admit`, `agreement`, `agreed`, `end`,
//! called as `collectives/src/session/swap.rs` calls them; the gate is
//! neither `Clone` nor `Hash`, so each step rebuilds it from the state
//! and keeps what it answers). Around it, as the session does:
//! - an op is named by its tag (epoch, name, seq): the seq counts the
//!   ops of that name started before, at their start, not their issue;
//! - an op takes the session's epoch and strategy when it starts, and
//!   needs a frame from each peer its output depends on
//!   ([`OpKind::depends_on`]); frames carry the strategy's digest, and
//!   one with another digest fails the op ([`CollectiveError::Mismatch`]);
//! - frames travel unordered; one of an older epoch than its receiver's
//!   is refused; one whose op has not started waits (is queued);
//! - the swap: hold new ops, drain the ops in flight, a consensus (an
//!   allreduce of the agreement's digest, at the current epoch, not held),
//!   then advance the epoch and the strategy if every digest was the
//!   same, and start the held ops in order at the epoch now;
//! - crashes (a frame a crashed worker sent may still arrive, or not),
//!   and the failure detector: ops waiting for a peer it reports lost
//!   fail once nothing that peer sent is queued for them.
//!
//! # What is abstracted away
//! Chunks and steps of an op (one frame per peer it depends on), the
//! consensus's two allreduces (one here), and time: an op's timeout fires
//! only where nothing else can happen. The transport swap's second
//! consensus (every rank connected) is not modelled; its first one is
//! this one.
//!
//! # The bound
//! `KUNGFU_MODEL_BOUND` workers (3 by default: a few seconds per check in
//! a debug build; at 4 the crash check outgrew 9 GB within minutes). The
//! calm check has no crash, two ops after the swap, and the last worker
//! asking for the same strategy as the others or another; the crash
//! check has one crash, at any point, and one op after the swap.
//!
//! [`SwapGate`]: kungfu_collectives::SwapGate
//! [`OpKind::depends_on`]: kungfu_collectives::OpKind::depends_on
//! [`CollectiveError::Mismatch`]: kungfu_collectives::CollectiveError::Mismatch

mod model;

use std::collections::{BTreeMap, BTreeSet};

use kungfu_collectives::{OpKind, ReduceOp, SwapGate, SwapTo};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::Epoch;
use stateright::{Checker, Model, Property};

type Id = u8;

/// The names of the program's ops; the swap's consensus has its own.
const A: u8 = 0;
const B: u8 = 1;
const CONSENSUS: u8 = 2;

/// The program: the op before the swap, then the ops after it (the
/// model's `after`).
const BEFORE: [u8; 1] = [A];

fn kind(name: u8) -> OpKind {
    match name {
        B => OpKind::Broadcast { root: Rank(0) },
        _ => OpKind::Allreduce(ReduceOp::Sum),
    }
}

/// A strategy by its index in [`Strategy::ALL`] (which orders them).
type S = u8;

fn strategy(s: S) -> Strategy {
    Strategy::ALL[s as usize]
}

fn index(s: Strategy) -> S {
    Strategy::ALL.iter().position(|&x| x == s).expect("in ALL") as S
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Tag {
    epoch: u32,
    name: u8,
    seq: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum End {
    Done,
    Lost,
    Mismatch,
    Timeout,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Op {
    NotIssued,
    Held,
    Running {
        tag: Tag,
        strategy: S,
        got: BTreeSet<Id>,
    },
    Ended(End),
}

/// The gate's data, to rebuild the real one from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Gate {
    to: S,
    /// The held ops (indices into `after`), in the order admitted.
    held: Vec<usize>,
    /// The epoch the agreement was asked for at.
    asked: Option<u32>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Swap {
    NotYet,
    /// Holding new ops; draining, then agreeing in `consensus`.
    Under {
        gate: Gate,
        consensus: Option<(Tag, [u8; 8])>,
        /// The digests received.
        got: BTreeMap<Id, [u8; 8]>,
    },
    /// Returned: the new epoch, or an error.
    Returned(Result<u32, End>),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Worker {
    crashed: bool,
    /// The strategy this worker asks for.
    to: S,
    epoch: u32,
    strategy: S,
    /// Per name: the seq of the next op started.
    seqs: [u32; 3],
    before: [Op; BEFORE.len()],
    after: Vec<Op>,
    swap: Swap,
    detected: BTreeSet<Id>,
    /// Every op started (the consensus too), with the strategy it ran on.
    log: BTreeSet<(Tag, S)>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct Frame {
    from: Id,
    to: Id,
    tag: Tag,
    strategy: S,
    /// A consensus frame's digest.
    digest: Option<[u8; 8]>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    workers: Vec<Worker>,
    net: BTreeSet<Frame>,
    crashes: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// `.0` crashes; of the frames it sent that are still in flight, those
    /// whose bit is set in `.1` (in the order of the network's set) arrive
    /// all the same, the others are lost with the connection.
    Crash(Id, u32),
    /// `.0` issues op `.1` of its program (`BEFORE` then `after`).
    Issue(Id, usize),
    BeginSwap(Id),
    Deliver(Frame),
    Detect(Id, Id),
    /// The timeout of `.0`'s ops: only where nothing else can happen.
    Timeout(Id),
}

#[derive(Clone, Debug)]
struct SwapModel {
    n: usize,
    max_crashes: u8,
    /// Whether some initial states have the last worker ask for another
    /// strategy than the others.
    disagree: bool,
    /// The ops after the swap.
    after: &'static [u8],
    /// Whether the swap runs its consensus (the real one does; without,
    /// each worker takes its own strategy at the next epoch).
    consensus: bool,
}

const FROM: Strategy = Strategy::Ring;

impl SwapModel {
    fn peers(&self) -> PeerList {
        PeerList::local(self.n)
    }

    /// The real gate, rebuilt.
    fn gate(&self, g: &Gate) -> SwapGate<usize> {
        let mut gate = SwapGate::default();
        gate.begin(SwapTo::Strategy(strategy(g.to)))
            .expect("one swap at a time");
        for &h in &g.held {
            assert!(gate.admit(h, |x| x).is_none(), "held while swapping");
        }
        if let Some(e) = g.asked {
            gate.agreement(Epoch(e), &self.peers()).expect("agreement");
        }
        gate
    }

    /// Starts an op of `name` at `i`'s epoch and strategy, sending a frame
    /// to each peer whose output depends on `i`'s.
    fn start(&self, s: &mut State, i: Id, name: u8, digest: Option<[u8; 8]>) -> Op {
        let w = &mut s.workers[i as usize];
        let tag = Tag {
            epoch: w.epoch,
            name,
            seq: w.seqs[name as usize],
        };
        w.seqs[name as usize] += 1;
        w.log.insert((tag, w.strategy));
        let strategy = w.strategy;
        for to in 0..self.n as Id {
            if to != i && kind(name).depends_on(Rank(to.into()), Rank(i.into())) {
                s.net.insert(Frame {
                    from: i,
                    to,
                    tag,
                    strategy,
                    digest,
                });
            }
        }
        Op::Running {
            tag,
            strategy,
            got: BTreeSet::new(),
        }
    }

    /// The peers `i`'s op of `name` still needs a frame from.
    fn missing(&self, i: Id, name: u8, got: &BTreeSet<Id>) -> Vec<Id> {
        (0..self.n as Id)
            .filter(|&p| p != i && !got.contains(&p))
            .filter(|&p| kind(name).depends_on(Rank(i.into()), Rank(p.into())))
            .collect()
    }

    /// How `i`'s op of `name` at `tag` ends now, if it does: once it has
    /// every frame it needs, or once one it needs can never come (its
    /// sender is reported lost and nothing it sent is queued).
    fn ends(&self, s: &State, i: Id, name: u8, tag: Tag, got: &BTreeSet<Id>) -> Option<End> {
        let missing = self.missing(i, name, got);
        if missing.is_empty() {
            return Some(End::Done);
        }
        let w = &s.workers[i as usize];
        let lost = missing.iter().any(|&p| {
            w.detected.contains(&p)
                && !s
                    .net
                    .iter()
                    .any(|f| f.from == p && f.to == i && f.tag == tag)
        });
        lost.then_some(End::Lost)
    }

    /// What a worker does without waiting for an input: ops end, the swap
    /// moves on.
    fn settle(&self, s: &mut State, i: Id) {
        loop {
            let before = s.workers[i as usize].clone();
            let w = &before;
            let ops = w
                .before
                .iter()
                .zip(BEFORE)
                .chain(w.after.iter().zip(self.after.iter().copied()));
            for (k, (op, name)) in ops.enumerate() {
                if let Op::Running { tag, got, .. } = op {
                    if let Some(e) = self.ends(s, i, name, *tag, got) {
                        let w = &mut s.workers[i as usize];
                        match k.checked_sub(BEFORE.len()) {
                            None => w.before[k] = Op::Ended(e),
                            Some(k) => w.after[k] = Op::Ended(e),
                        }
                    }
                }
            }
            let w = s.workers[i as usize].clone();
            let running = w
                .before
                .iter()
                .chain(&w.after)
                .any(|o| matches!(o, Op::Running { .. }));
            if let Swap::Under {
                gate,
                consensus,
                got,
            } = &w.swap
            {
                let mut g = self.gate(gate);
                match *consensus {
                    // drained: agree on the digest
                    None if !running => {
                        let a = g
                            .agreement(Epoch(w.epoch), &self.peers())
                            .expect("agreement");
                        if let Swap::Under { gate, .. } = &mut s.workers[i as usize].swap {
                            gate.asked = Some(w.epoch);
                        }
                        if self.consensus {
                            let Op::Running { tag, .. } =
                                self.start(s, i, CONSENSUS, Some(a.digest))
                            else {
                                unreachable!("started")
                            };
                            if let Swap::Under { consensus, .. } = &mut s.workers[i as usize].swap {
                                *consensus = Some((tag, a.digest));
                            }
                        } else {
                            self.returned(s, i, g.agreed(true).map_err(|_| End::Mismatch));
                        }
                    }
                    Some((tag, mine)) => {
                        let from: BTreeSet<Id> = got.keys().copied().collect();
                        match self.ends(s, i, CONSENSUS, tag, &from) {
                            Some(End::Done) => {
                                let same = got.values().all(|d| *d == mine);
                                self.returned(s, i, g.agreed(same).map_err(|_| End::Mismatch));
                            }
                            Some(e) => self.returned(s, i, Err(e)),
                            None => {}
                        }
                    }
                    None => {}
                }
            }
            if s.workers[i as usize] == before {
                return;
            }
        }
    }

    /// The swap returned `r`: the gate ends, its held ops start in order.
    fn returned(&self, s: &mut State, i: Id, r: Result<(Epoch, SwapTo), End>) {
        let w = &mut s.workers[i as usize];
        let Swap::Under { gate, .. } = &w.swap else {
            unreachable!("under a swap")
        };
        let held = self.gate(gate).end();
        let r = match r {
            Ok((next, SwapTo::Strategy(to))) => {
                w.epoch = next.0;
                w.strategy = index(to);
                Ok(next.0)
            }
            Ok(_) => unreachable!("a strategy swap"),
            Err(e) => Err(e),
        };
        w.swap = Swap::Returned(r);
        for h in held {
            let op = self.start(s, i, self.after[h], None);
            s.workers[i as usize].after[h] = op;
        }
    }

    fn step(&self, s: &State, a: &Action) -> Option<State> {
        let mut t = s.clone();
        let live = |i: Id| !s.workers[i as usize].crashed;
        let i = match *a {
            Action::Crash(i, keep) => {
                if !live(i) || s.crashes >= self.max_crashes {
                    return None;
                }
                t.crashes += 1;
                t.workers[i as usize].crashed = true;
                // what is queued for it goes nowhere; of what it sent,
                // what `keep` says arrives
                let mut k = 0;
                t.net.retain(|f| {
                    if f.from != i {
                        return f.to != i;
                    }
                    k += 1;
                    f.to != i && keep & (1 << (k - 1)) != 0
                });
                return Some(t);
            }
            Action::Issue(i, k) => {
                let w = &s.workers[i as usize];
                if !live(i) {
                    return None;
                }
                if k < BEFORE.len() {
                    if w.before[k] != Op::NotIssued || w.swap != Swap::NotYet {
                        return None;
                    }
                    let op = self.start(&mut t, i, BEFORE[k], None);
                    t.workers[i as usize].before[k] = op;
                } else {
                    let k = k - BEFORE.len();
                    if w.after[k] != Op::NotIssued || w.swap == Swap::NotYet {
                        return None;
                    }
                    // the gate holds it, or it starts now
                    let held = match &w.swap {
                        Swap::Under { gate, .. } => self.gate(gate).admit(k, |x| x).is_none(),
                        _ => false,
                    };
                    if held {
                        if let Swap::Under { gate, .. } = &mut t.workers[i as usize].swap {
                            gate.held.push(k);
                        }
                        t.workers[i as usize].after[k] = Op::Held;
                    } else {
                        let op = self.start(&mut t, i, self.after[k], None);
                        t.workers[i as usize].after[k] = op;
                    }
                }
                i
            }
            Action::BeginSwap(i) => {
                let w = &s.workers[i as usize];
                if !live(i) || w.swap != Swap::NotYet || w.before.contains(&Op::NotIssued) {
                    return None;
                }
                let gate = Gate {
                    to: w.to,
                    held: Vec::new(),
                    asked: None,
                };
                t.workers[i as usize].swap = Swap::Under {
                    gate,
                    consensus: None,
                    got: BTreeMap::new(),
                };
                i
            }
            Action::Deliver(ref f) => {
                let i = f.to;
                if !live(i) || !s.net.contains(f) {
                    return None;
                }
                let w = &mut t.workers[i as usize];
                if f.tag.epoch < w.epoch {
                    // refused: an older epoch
                    t.net.remove(f);
                    return Some(t);
                }
                let mut taken = false;
                for op in w.before.iter_mut().chain(w.after.iter_mut()) {
                    if let Op::Running { tag, strategy, got } = op {
                        if *tag == f.tag {
                            taken = true;
                            if *strategy != f.strategy {
                                *op = Op::Ended(End::Mismatch);
                            } else {
                                got.insert(f.from);
                            }
                        }
                    }
                }
                let mut mismatch = false;
                if let Swap::Under {
                    consensus: Some((tag, _)),
                    got,
                    ..
                } = &mut w.swap
                {
                    if *tag == f.tag {
                        taken = true;
                        mismatch = f.strategy != w.strategy;
                        got.insert(f.from, f.digest.expect("a consensus frame"));
                    }
                }
                if !taken {
                    // queued until its op starts (or for an op that
                    // ended: refused, see gc)
                    return None;
                }
                t.net.remove(f);
                if mismatch {
                    // the consensus op itself fails
                    self.returned(&mut t, i, Err(End::Mismatch));
                }
                i
            }
            Action::Detect(i, p) => {
                if !live(i) || live(p) || !t.workers[i as usize].detected.insert(p) {
                    return None;
                }
                i
            }
            Action::Timeout(i) => {
                if !live(i) || !self.quiet(s) {
                    return None;
                }
                let w = &mut t.workers[i as usize];
                let mut any = false;
                for op in w.before.iter_mut().chain(w.after.iter_mut()) {
                    if matches!(op, Op::Running { .. }) {
                        *op = Op::Ended(End::Timeout);
                        any = true;
                    }
                }
                if matches!(
                    w.swap,
                    Swap::Under {
                        consensus: Some(_),
                        ..
                    }
                ) {
                    self.returned(&mut t, i, Err(End::Timeout));
                    any = true;
                }
                if !any {
                    return None;
                }
                i
            }
        };
        self.settle(&mut t, i);
        gc(&mut t);
        (t != *s).then_some(t)
    }

    fn candidates(&self, s: &State, out: &mut Vec<Action>) {
        for i in 0..self.n as Id {
            let sent = s.net.iter().filter(|f| f.from == i && f.to != i).count();
            if s.crashes < self.max_crashes && !s.workers[i as usize].crashed {
                out.extend((0..1u32 << sent).map(|keep| Action::Crash(i, keep)));
            }
            for k in 0..BEFORE.len() + self.after.len() {
                out.push(Action::Issue(i, k));
            }
            out.push(Action::BeginSwap(i));
            for p in 0..self.n as Id {
                out.push(Action::Detect(i, p));
            }
        }
        out.extend(s.net.iter().cloned().map(Action::Deliver));
    }

    /// Whether nothing but a timeout (or a fault) can happen.
    fn quiet(&self, s: &State) -> bool {
        let mut c = Vec::new();
        self.candidates(s, &mut c);
        c.iter()
            .filter(|a| !fault(a))
            .all(|a| self.step(s, a).is_none())
    }
}

/// A crash: what the environment does, which may stop.
fn fault(a: &Action) -> bool {
    matches!(a, Action::Crash(..))
}

/// Drops frames no op can take any more: to a crashed worker, of an
/// epoch older than the receiver's (refused), or of an op that ended
/// there.
fn gc(s: &mut State) {
    let workers = &s.workers;
    s.net.retain(|f| {
        let w = &workers[f.to as usize];
        let ended = w.log.iter().any(|(t, _)| *t == f.tag) && !w.running(f.tag);
        !w.crashed && f.tag.epoch >= w.epoch && !ended
    });
}

impl Worker {
    fn running(&self, tag: Tag) -> bool {
        let op = self.before.iter().chain(&self.after).any(|o| match o {
            Op::Running { tag: t, .. } => *t == tag,
            _ => false,
        });
        let consensus = matches!(&self.swap,
            Swap::Under { consensus: Some((t, _)), .. } if *t == tag);
        op || consensus
    }

    fn finished(&self) -> bool {
        self.before
            .iter()
            .chain(&self.after)
            .all(|o| matches!(o, Op::Ended(_)))
            && matches!(self.swap, Swap::Returned(_))
    }

    /// Whether an op (or the swap) ended on a loss or a timeout.
    fn failed(&self) -> bool {
        let op = self
            .before
            .iter()
            .chain(&self.after)
            .any(|o| matches!(o, Op::Ended(End::Lost | End::Timeout)));
        op || matches!(self.swap, Swap::Returned(Err(End::Lost | End::Timeout)))
    }
}

impl Model for SwapModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let star = index(Strategy::Star);
        let tree = index(Strategy::Tree);
        let run = |last: S| {
            let w = |i: usize| Worker {
                crashed: false,
                to: if i + 1 == self.n { last } else { star },
                epoch: 0,
                strategy: index(FROM),
                seqs: [0; 3],
                before: [const { Op::NotIssued }; BEFORE.len()],
                after: vec![Op::NotIssued; self.after.len()],
                swap: Swap::NotYet,
                detected: BTreeSet::new(),
                log: BTreeSet::new(),
            };
            State {
                workers: (0..self.n).map(w).collect(),
                net: BTreeSet::new(),
                crashes: 0,
            }
        };
        let mut init = vec![run(star)];
        if self.disagree {
            init.push(run(tree));
        }
        init
    }

    fn actions(&self, s: &State, out: &mut Vec<Action>) {
        self.candidates(s, out);
        out.extend((0..self.n as Id).map(Action::Timeout));
    }

    fn next_state(&self, s: &State, a: Action) -> Option<State> {
        self.step(s, &a)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE_STRATEGY, |_, s: &State| {
                let mut on = BTreeMap::new();
                let live = s.workers.iter().filter(|w| !w.crashed);
                live.flat_map(|w| &w.log)
                    .all(|(tag, st)| *on.entry(*tag).or_insert(*st) == *st)
            }),
            Property::always(ENDS, |m: &SwapModel, s: &State| {
                !model::settled(m, s, fault) || s.workers.iter().all(|w| w.crashed || w.finished())
            }),
            Property::always(CALM, |m: &SwapModel, s: &State| {
                if s.crashes > 0 {
                    return true;
                }
                let results: BTreeSet<_> =
                    s.workers.iter().map(|w| format!("{:?}", w.swap)).collect();
                s.workers.iter().all(|w| !w.failed())
                    && (!model::settled(m, s, fault) || results.len() == 1)
            }),
            Property::sometimes("the swap takes effect", |_, s: &State| {
                s.workers
                    .iter()
                    .all(|w| matches!(w.swap, Swap::Returned(Ok(1))))
            }),
            Property::sometimes("ranks that disagree all get a mismatch", |m, s: &State| {
                !m.disagree
                    || s.workers
                        .iter()
                        .all(|w| w.swap == Swap::Returned(Err(End::Mismatch)))
            }),
            Property::sometimes("a crash splits the epochs", |m: &SwapModel, s: &State| {
                let live = || s.workers.iter().filter(|w| !w.crashed);
                m.max_crashes == 0
                    || (live().all(Worker::finished)
                        && live().any(|w| w.epoch == 0)
                        && live().any(|w| w.epoch == 1))
            }),
            Property::sometimes("an op ends by its timeout", |m: &SwapModel, s: &State| {
                m.max_crashes == 0
                    || s.workers.iter().any(|w| {
                        !w.crashed
                            && w.before
                                .iter()
                                .chain(&w.after)
                                .any(|o| *o == Op::Ended(End::Timeout))
                    })
            }),
        ]
    }
}

const ONE_STRATEGY: &str = "no two live workers run an op of one tag on different strategies";
const ENDS: &str = "every op ends once crashes stop";
const CALM: &str = "without a crash, no op fails but on a mismatch, and every swap returns alike";

/// No crash; the last worker may ask for another strategy; two ops
/// after the swap, issued in either order.
fn calm(n: usize) -> SwapModel {
    SwapModel {
        n,
        max_crashes: 0,
        disagree: true,
        after: &[A, B],
        consensus: true,
    }
}

/// One crash, at any point; the broadcast after the swap.
fn crash(n: usize) -> SwapModel {
    SwapModel {
        n,
        max_crashes: 1,
        disagree: false,
        after: &[B],
        consensus: true,
    }
}

#[test]
fn a_swap_holds_the_ops_issued_meanwhile_and_ranks_agree() {
    model::check("swap, no crash", calm(model::bound(3))).assert_properties();
}

#[test]
fn a_crash_during_a_swap_never_runs_one_tag_on_two_strategies() {
    model::check("swap, a crash", crash(model::bound(3))).assert_properties();
}

/// Without the consensus, ranks that ask for different strategies run
/// the next epoch's ops on them: the checker must find it.
#[test]
fn without_the_consensus_one_tag_runs_on_two_strategies() {
    let m = SwapModel {
        consensus: false,
        ..calm(3)
    };
    let c = model::check("swap, no consensus", m);
    let path = c.assert_any_discovery(ONE_STRATEGY);
    println!("the counterexample: {path}");
}
