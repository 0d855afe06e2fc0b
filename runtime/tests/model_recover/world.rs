//! The world of the recovery model (`model_recover.rs`): the workers,
//! each with the real recovery machine, the config server, the links, and
//! every step they take.

use std::collections::BTreeSet;

use kungfu::recover::machine::{Recovery, Step, NEW};
use kungfu::store::compare_and_set;
use kungfu_topology::Rank;

/// A worker, by its index among the workers of version 0 (its address).
pub(crate) type Id = u8;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Phase {
    /// Training at `version`, whose members are `members`.
    Running { version: u64, members: Vec<Id> },
    /// In `Worker::recover`, from the session of version `from` (whose
    /// peers, by old rank, are `peers`).
    Recovering {
        from: u64,
        peers: Vec<Id>,
        m: Box<Recovery>,
        /// The driver's `decided`: the server's config it last read.
        decided: Option<(u64, Vec<Id>)>,
        /// What the driver waits for.
        wait: Wait,
    },
    /// Left out (`BootstrapError::Excluded`): exits.
    Excluded,
    /// `recover` or an op failed on a deadline: exits.
    Failed,
}

/// What a recovering driver is blocked in.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Wait {
    /// Nothing: it waits for an input of the machine.
    Input,
    /// Connecting `version`, of `members`.
    Connect { version: u64, members: Vec<Id> },
    /// At the barrier of `version`, of `members`.
    Barrier { version: u64, members: Vec<Id> },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Worker {
    pub(crate) phase: Phase,
    pub(crate) crashed: bool,
    pub(crate) frozen: bool,
    /// The peers of its session it saw lost itself (the matcher's
    /// `lost_first_hand`), by id.
    pub(crate) detected: BTreeSet<Id>,
    /// The peers of its session it heard lost (the rest of the matcher's
    /// `lost_in_order`).
    pub(crate) heard: BTreeSet<Id>,
    /// The versions it began to connect (bit `v`): their connections with
    /// it can complete a member's connect, even once it moved on.
    pub(crate) joined: u32,
    /// The versions whose barrier it began (bit `v`; its part may reach
    /// the others even if it crashed or gave up afterwards).
    pub(crate) at_barrier: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct State {
    pub(crate) workers: Vec<Worker>,
    /// The config server: the members of each version (its index).
    pub(crate) server: Vec<Vec<Id>>,
    /// The links cut, `(a, b, version)` with `a < b`: the connection of
    /// that version between them.
    pub(crate) cut: BTreeSet<(Id, Id, u64)>,
    pub(crate) crashes: u8,
    pub(crate) freezes: u8,
    /// Set if a driver met a step without the config it names.
    pub(crate) no_config: bool,
    /// Set once the server refused a proposal (another was first).
    pub(crate) refused: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    Crash(Id),
    Freeze(Id),
    Thaw(Id),
    /// The link between `.0 < .1` breaks.
    Cut(Id, Id),
    /// `.0`'s detector reports `.1` lost.
    Detect(Id, Id),
    /// `.0` hears that another worker of its session lost `.1`.
    Hear(Id, Id),
    /// The driver waited long enough for another's proposal.
    Patience(Id),
    /// `GET /cluster/{base + 1}`.
    Read(Id),
    /// The connect ended: every member is there.
    Connected(Id),
    /// The connect gave up: a member was lost on the old connections.
    ConnectLost(Id),
    /// The barrier ended: every member is there.
    BarrierDone(Id),
    /// The barrier failed on the loss of `.1`.
    BarrierLost(Id, Id),
    /// A deadline: only where nothing else can happen.
    Deadline(Id),
}

#[derive(Clone, Debug)]
pub(crate) struct RecoverModel {
    pub(crate) n: usize,
    pub(crate) max_crashes: u8,
    pub(crate) max_freezes: u8,
    pub(crate) max_cuts: u8,
    /// Whether workers hear of the losses others saw (loss notices).
    pub(crate) hearsay: bool,
    /// Whether the config server's `PUT` calls the real compare-and-set
    /// (without, every `PUT` of a version replaces it: the variant that
    /// must fail).
    pub(crate) cas: bool,
    /// Whether the driver waits at a barrier when the machine asks (it
    /// does; without, it goes on at once: the variant that must fail).
    pub(crate) barrier: bool,
    /// Whether deadlines may fire (where nothing else can happen).
    pub(crate) deadlines: bool,
}

impl State {
    pub(crate) fn live(&self, i: Id) -> bool {
        let w = &self.workers[i as usize];
        !w.crashed && !matches!(w.phase, Phase::Excluded | Phase::Failed)
    }

    /// The version whose connections `i` has open (crashed or not).
    pub(crate) fn session(&self, i: Id) -> Option<u64> {
        match &self.workers[i as usize].phase {
            Phase::Running { version, .. } => Some(*version),
            Phase::Recovering { from, .. } => Some(*from),
            _ => None,
        }
    }

    /// The version `i` connects (or connected), and its members.
    pub(crate) fn joining(&self, i: Id) -> Option<(u64, &Vec<Id>)> {
        match &self.workers[i as usize].phase {
            Phase::Recovering {
                wait: Wait::Connect { version, members } | Wait::Barrier { version, members },
                ..
            } => Some((*version, members)),
            _ => None,
        }
    }

    /// Whether `i` has connections of version `v` (open, or being made).
    pub(crate) fn reached(&self, i: Id, v: u64) -> bool {
        self.session(i) == Some(v) || self.joining(i).is_some_and(|j| j.0 == v)
    }

    /// The members of `i`'s session.
    pub(crate) fn session_members(&self, i: Id) -> &[Id] {
        match &self.workers[i as usize].phase {
            Phase::Running { members, .. } => members,
            Phase::Recovering { peers, .. } => peers,
            _ => &[],
        }
    }

    /// The version and members every live worker that connects (or
    /// connected) claims.
    pub(crate) fn claims(&self) -> impl Iterator<Item = (u64, &Vec<Id>)> {
        self.workers
            .iter()
            .enumerate()
            .filter(|(i, _)| self.live(*i as Id))
            .filter_map(|(i, w)| match &w.phase {
                Phase::Running { version, members } => Some((*version, members)),
                _ => self.joining(i as Id),
            })
    }

    pub(crate) fn is_cut(&self, a: Id, b: Id, v: u64) -> bool {
        self.cut.contains(&(a.min(b), a.max(b), v))
    }
}

pub(crate) fn rank_of(peers: &[Id], id: Id) -> Rank {
    peers
        .iter()
        .position(|&p| p == id)
        .map_or(NEW, |r| Rank(r as u32))
}

pub(crate) fn ids(peers: &[Id], ranks: &[Rank]) -> Vec<Id> {
    ranks.iter().map(|r| peers[r.idx()]).collect()
}

impl RecoverModel {
    /// Runs worker `i`'s driver loop: `poll` until the machine has nothing
    /// to do (or the driver blocks, or returns).
    pub(crate) fn drive(&self, s: &mut State, i: Id) {
        loop {
            let w = &mut s.workers[i as usize];
            let Phase::Recovering {
                peers,
                m,
                decided,
                wait,
                ..
            } = &mut w.phase
            else {
                return;
            };
            if *wait != Wait::Input {
                return;
            }
            let Some(step) = m.poll() else { return };
            // the config of `version` the driver has, if any
            let config = |decided: &Option<(u64, Vec<Id>)>, version| {
                decided
                    .as_ref()
                    .filter(|(v, _)| *v == version)
                    .map(|(_, m)| m.clone())
            };
            match step {
                Step::Propose { base, members } => {
                    let next = base + 1;
                    let members = ids(peers, &members);
                    let cur = s.server.len() as u64 - 1;
                    let taken = if self.cas {
                        compare_and_set(cur as u32, next as u32).is_ok()
                    } else {
                        true
                    };
                    // A refused PUT (409): the decision is read later.
                    s.refused |= !taken;
                    if taken {
                        s.server.truncate(next as usize);
                        s.server.push(members.clone());
                        feed(m, peers, next, &members);
                        *decided = Some((next, members));
                    }
                }
                Step::Connect { version, .. } => match config(decided, version) {
                    Some(members) => {
                        w.joined |= 1 << version;
                        *wait = Wait::Connect { version, members };
                    }
                    None => {
                        s.no_config = true;
                        w.phase = Phase::Failed;
                    }
                },
                Step::Barrier { version } => match config(decided, version) {
                    Some(_) if !self.barrier => m.handle_barrier_passed(version),
                    Some(members) => {
                        w.at_barrier |= 1 << version;
                        *wait = Wait::Barrier { version, members };
                    }
                    None => {
                        s.no_config = true;
                        w.phase = Phase::Failed;
                    }
                },
                Step::Adopt { version } => match config(decided, version) {
                    // the old connections close
                    Some(members) => {
                        w.phase = Phase::Running { version, members };
                        w.detected.clear();
                        w.heard.clear();
                    }
                    None => {
                        s.no_config = true;
                        w.phase = Phase::Failed;
                    }
                },
                Step::Excluded { .. } => w.phase = Phase::Excluded,
            }
        }
    }

    /// `i` knows `r` lost (`first_hand`: by itself): a running worker
    /// begins to recover, a recovering one tells its machine.
    pub(crate) fn lose(&self, t: &mut State, i: Id, r: Id, first_hand: bool) {
        let w = &mut t.workers[i as usize];
        if first_hand {
            w.detected.insert(r);
        } else {
            w.heard.insert(r);
        }
        let known: Vec<Id> = w.detected.union(&w.heard).copied().collect();
        match &mut w.phase {
            // the next op fails with PeerLost: recover
            Phase::Running { version, members } => {
                let lost = known.iter().map(|&d| rank_of(members, d));
                let m = Recovery::new(
                    rank_of(members, i),
                    *version,
                    (0..members.len() as u32).map(Rank).collect(),
                    lost,
                );
                w.phase = Phase::Recovering {
                    from: *version,
                    peers: members.clone(),
                    m: Box::new(m),
                    decided: None,
                    wait: Wait::Input,
                };
            }
            Phase::Recovering {
                peers,
                m,
                wait: Wait::Input,
                ..
            } => m.handle_lost(rank_of(peers, r)),
            // inside a connect or a barrier: taken after it
            _ => {}
        }
        self.drive(t, i);
    }

    /// The new state after `a`, or `None` if `a` is not enabled (or
    /// changes nothing).
    pub(crate) fn step(&self, s: &State, a: &Action) -> Option<State> {
        let mut t = s.clone();
        let may_act = |i: Id| s.live(i) && !s.workers[i as usize].frozen;
        let input = |i: Id| {
            matches!(
                &s.workers[i as usize].phase,
                Phase::Recovering {
                    wait: Wait::Input,
                    ..
                }
            )
        };
        match *a {
            Action::Crash(i) => {
                if !s.live(i) || s.crashes >= self.max_crashes {
                    return None;
                }
                t.crashes += 1;
                t.workers[i as usize].crashed = true;
            }
            Action::Freeze(i) => {
                if !may_act(i) || s.freezes >= self.max_freezes {
                    return None;
                }
                t.freezes += 1;
                t.workers[i as usize].frozen = true;
            }
            Action::Thaw(i) => {
                if !s.workers[i as usize].frozen {
                    return None;
                }
                t.workers[i as usize].frozen = false;
            }
            Action::Cut(a, b) => {
                let v = s.session(a)?;
                let running = |k: Id| {
                    matches!(s.workers[k as usize].phase,
                        Phase::Running { version, .. } if version == v)
                };
                if a >= b
                    || s.cut.len() >= self.max_cuts as usize
                    || !may_act(a)
                    || !may_act(b)
                    || !running(a)
                    || !running(b)
                {
                    return None;
                }
                t.cut.insert((a, b, v));
            }
            Action::Detect(i, r) => {
                let v = s.session(i)?;
                let w = &s.workers[i as usize];
                if !may_act(i)
                    || r == i
                    || !s.session_members(i).contains(&r)
                    || w.detected.contains(&r)
                {
                    return None;
                }
                let gone = !s.live(r) || !s.reached(r, v) || s.is_cut(i, r, v);
                let suspected = s.live(r) && s.workers[r as usize].frozen;
                if !gone && !suspected {
                    return None;
                }
                self.lose(&mut t, i, r, true);
            }
            Action::Hear(i, r) => {
                let v = s.session(i)?;
                let w = &s.workers[i as usize];
                // a live worker of the same session saw it, is not cut
                // off from this one, and is not known lost here (a
                // notice from a rank held lost is not believed)
                let told = (0..self.n as Id).any(|j| {
                    j != i
                        && s.live(j)
                        && s.session(j) == Some(v)
                        && !s.is_cut(i, j, v)
                        && !w.detected.contains(&j)
                        && !w.heard.contains(&j)
                        && s.workers[j as usize].detected.contains(&r)
                });
                if !self.hearsay
                    || !may_act(i)
                    || r == i
                    || w.detected.contains(&r)
                    || w.heard.contains(&r)
                    || !told
                {
                    return None;
                }
                self.lose(&mut t, i, r, false);
            }
            Action::Patience(i) => {
                if !may_act(i) || !input(i) {
                    return None;
                }
                if let Phase::Recovering { m, .. } = &mut t.workers[i as usize].phase {
                    m.handle_patience();
                }
                self.drive(&mut t, i);
            }
            Action::Read(i) => {
                if !may_act(i) || !input(i) {
                    return None;
                }
                let server = &s.server;
                let Phase::Recovering {
                    peers, m, decided, ..
                } = &mut t.workers[i as usize].phase
                else {
                    return None;
                };
                let next = m.base() + 1;
                let members = server.get(next as usize)?;
                feed(m, peers, next, members);
                *decided = Some((next, members.clone()));
                self.drive(&mut t, i);
            }
            Action::Connected(i) => {
                let Phase::Recovering {
                    wait: Wait::Connect { version, members },
                    ..
                } = &s.workers[i as usize].phase
                else {
                    return None;
                };
                let began = |k: Id| s.workers[k as usize].joined & (1 << version) != 0;
                if !may_act(i) || !members.iter().all(|&k| began(k)) {
                    return None;
                }
                let version = *version;
                if let Phase::Recovering { m, wait, .. } = &mut t.workers[i as usize].phase {
                    *wait = Wait::Input;
                    m.handle_connected(version);
                }
                self.drive(&mut t, i);
            }
            Action::ConnectLost(i) => {
                let w = &s.workers[i as usize];
                let Phase::Recovering {
                    wait: Wait::Connect { version, members },
                    ..
                } = &w.phase
                else {
                    return None;
                };
                // lost as this worker saw it itself
                let lost: Vec<Id> = members
                    .iter()
                    .copied()
                    .filter(|k| w.detected.contains(k))
                    .collect();
                if !may_act(i) || lost.is_empty() {
                    return None;
                }
                self.join_failed(&mut t, i, *version, &lost);
            }
            Action::BarrierDone(i) => {
                let Phase::Recovering {
                    wait: Wait::Barrier { version, members },
                    ..
                } = &s.workers[i as usize].phase
                else {
                    return None;
                };
                let there = |k: Id| s.workers[k as usize].at_barrier & (1 << version) != 0;
                if !may_act(i) || !members.iter().all(|&k| there(k)) {
                    return None;
                }
                let version = *version;
                if let Phase::Recovering { m, wait, .. } = &mut t.workers[i as usize].phase {
                    *wait = Wait::Input;
                    m.handle_barrier_passed(version);
                }
                self.drive(&mut t, i);
            }
            Action::BarrierLost(i, k) => {
                let Phase::Recovering {
                    wait: Wait::Barrier { version, members },
                    ..
                } = &s.workers[i as usize].phase
                else {
                    return None;
                };
                // `k` crashed or gave the version up (it may have given
                // its part of the barrier first, or not)
                let gone = !s.live(k) || !s.reached(k, *version);
                if !may_act(i) || !members.contains(&k) || !gone {
                    return None;
                }
                self.join_failed(&mut t, i, *version, &[k]);
            }
            Action::Deadline(i) => {
                if !self.deadlines || !may_act(i) || !self.quiet(s) {
                    return None;
                }
                let stuck = match &s.workers[i as usize].phase {
                    Phase::Recovering { .. } => true,
                    // an op waits for a member that is not training
                    // with it: it times out, and the loop exits
                    Phase::Running { version, members } => members.iter().any(|&j| {
                        !s.live(j)
                            || !matches!(s.workers[j as usize].phase,
                                Phase::Running { version: w, .. } if w == *version)
                    }),
                    _ => false,
                };
                if !stuck {
                    return None;
                }
                t.workers[i as usize].phase = Phase::Failed;
            }
        }
        (t != *s).then_some(t)
    }

    /// The connect or barrier of `version` failed, its members `lost`
    /// lost: the machine takes that config as the next base, then the
    /// losses known meanwhile.
    pub(crate) fn join_failed(&self, t: &mut State, i: Id, version: u64, lost: &[Id]) {
        let w = &mut t.workers[i as usize];
        let known: Vec<Id> = w.detected.union(&w.heard).copied().collect();
        let Phase::Recovering { peers, m, wait, .. } = &mut w.phase else {
            unreachable!("joining")
        };
        *wait = Wait::Input;
        m.handle_connect_failed(version, lost.iter().map(|&j| rank_of(peers, j)));
        for &d in &known {
            m.handle_lost(rank_of(peers, d));
        }
        self.drive(t, i);
    }

    pub(crate) fn candidates(&self, out: &mut Vec<Action>) {
        for i in 0..self.n as Id {
            out.extend([Action::Crash(i), Action::Freeze(i), Action::Thaw(i)]);
            for r in 0..self.n as Id {
                out.extend([
                    Action::Cut(i, r),
                    Action::Detect(i, r),
                    Action::Hear(i, r),
                    Action::BarrierLost(i, r),
                ]);
            }
            out.extend([
                Action::Patience(i),
                Action::Read(i),
                Action::Connected(i),
                Action::ConnectLost(i),
                Action::BarrierDone(i),
            ]);
        }
    }

    /// Whether nothing but a deadline (or a fault) can happen.
    pub(crate) fn quiet(&self, s: &State) -> bool {
        let mut c = Vec::new();
        self.candidates(&mut c);
        c.iter()
            .filter(|a| !fault(a))
            .all(|a| self.step(s, a).is_none())
    }
}

/// A crash, a freeze or a cut: what the environment does, which may stop.
pub(crate) fn fault(a: &Action) -> bool {
    matches!(a, Action::Crash(_) | Action::Freeze(_) | Action::Cut(..))
}

/// Tells the machine the server's config, in the old ranks (a worker
/// the old version did not have has none).
pub(crate) fn feed(m: &mut Recovery, peers: &[Id], version: u64, members: &[Id]) {
    m.handle_config(
        version,
        members.iter().map(|&id| rank_of(peers, id)).collect(),
    );
}
