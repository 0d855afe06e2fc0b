//! A model of resizing an elastic job ([`kungfu::Worker::resize_from_config`]
//! under `kungfu-run -w`), checked with stateright over every
//! interleaving at a small bound.
//!
//! # What is modelled
//! - the **config server** (`runtime/src/elastic/`): its versions; a
//!   `PUT /cluster size N` (from the script, at any time) makes the next
//!   one, keeping the first `N` peers or adding new ones;
//! - the **launcher** (`tools/src/launch/`): it watches the config
//!   through a `watch` channel, which shows the latest config and may skip
//!   one put right after another; it starts each member of a config it
//!   sees that it never started, at that config's version, and stops a
//!   worker that is not in the config it saw last once it has nothing
//!   else to do (`--detach-timeout`);
//! - the **workers**: a worker training at version `v` calls
//!   `resize_from_config` (a collective of `v`'s members) once the server
//!   has something newer; rank 0 of `v` reads the current config and
//!   hands it to every member as the maximum of an allreduce to which the
//!   others give zeros, so a member's call ends once every member called
//!   (or fails once one of them is lost: what a crashed member sent may
//!   have arrived, or not); a worker not in it detaches, the others
//!   connect at its
//!   version (done once every member got there; nothing watches for
//!   losses meanwhile, so only the connect timeout ends a connect that
//!   cannot finish); a new worker connects at the version it was started
//!   with;
//! - **crashes** of any worker at any time.
//!
//! # What is abstracted away
//! The calls of `resize_from_config` that find nothing new (they change
//! nothing), the frames of the length-then-body pair of allreduces (a call
//! here, which every member's waits for), and time:
//! a timeout (connect, op, detach) fires only where nothing else can
//! happen. A crash is not recovered from here (see `model_recover.rs`).
//!
//! # The bound
//! `KUNGFU_MODEL_BOUND` workers at start (4 by default, under a second per
//! check in a debug build), two puts, at most one crash.

mod model;

use stateright::{Checker, Model, Property};

/// A worker by its address: the initial ones, then each new one.
type Id = u8;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Phase {
    /// Not started by the launcher (yet).
    NotStarted,
    /// Connecting at `version` (a new worker, or after a resize).
    Connecting { version: usize, members: Vec<Id> },
    /// Training at `version`; `called`: inside `resize_from_config`.
    Running {
        version: usize,
        members: Vec<Id>,
        called: bool,
    },
    /// Not in the config it switched to: it exits.
    Detached,
    /// An error (a timeout, a lost root): it exits.
    Failed,
    /// Stopped by the launcher.
    Stopped,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Worker {
    phase: Phase,
    crashed: bool,
    /// The versions it connected at or began to (their connections
    /// with it can complete a member's connect).
    reached: u32,
    /// The versions whose `resize_from_config` it called (bits).
    calls: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    workers: Vec<Worker>,
    /// The server's configs by version.
    server: Vec<Vec<Id>>,
    /// The version the launcher saw last.
    seen: usize,
    /// What rank 0 of each version read there: (version, read).
    reads: Vec<(usize, usize)>,
    crashes: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Action {
    /// The next put of the script.
    Put,
    /// The launcher's loop wakes up on the config it watches.
    Watch,
    Crash(Id),
    /// `resize_from_config` (rank 0 reads the server's config).
    Call(Id),
    /// `.0`'s call ends: every member called.
    Complete(Id),
    /// `.0`'s call fails: `.1`, a member, was lost.
    Lost(Id, Id),
    Connected(Id),
    /// A timeout (connect, op) or the launcher's stop: only where nothing
    /// else can happen.
    Timeout(Id),
}

#[derive(Clone, Debug)]
struct ResizeModel {
    n: usize,
    /// The sizes the script puts, in order.
    puts: Vec<usize>,
    max_crashes: u8,
    /// Whether the launcher sees every version (it does, through
    /// `ConfigServer::since`; a watch of the latest alone may skip one).
    every_version: bool,
    /// Whether rank 0 reads and shares what it read (the real code does;
    /// without, each worker reads the server itself).
    shared_read: bool,
}

impl ResizeModel {
    /// The configs the script makes, in order, after version 0.
    fn configs(&self) -> Vec<Vec<Id>> {
        let mut all = vec![(0..self.n as Id).collect::<Vec<_>>()];
        let mut next = self.n as Id;
        for &size in &self.puts {
            let mut c: Vec<Id> = all.last().expect("version 0").clone();
            c.truncate(size);
            while c.len() < size {
                c.push(next);
                next += 1;
            }
            all.push(c);
        }
        all
    }

    fn ids(&self) -> usize {
        self.configs()
            .iter()
            .flatten()
            .max()
            .map_or(0, |&m| m as usize + 1)
    }

    /// What a worker does with the config of `version` it read.
    fn switch(&self, s: &mut State, i: Id, version: usize) {
        let members = s.server[version].clone();
        let w = &mut s.workers[i as usize];
        w.phase = if members.contains(&i) {
            w.reached |= 1 << version;
            Phase::Connecting { version, members }
        } else {
            Phase::Detached
        };
    }

    /// Whether `i` got to `version` (a crashed worker: before it crashed).
    fn reached(s: &State, i: Id, version: usize) -> bool {
        s.workers[i as usize].reached & (1 << version) != 0
    }

    fn step(&self, s: &State, a: &Action) -> Option<State> {
        let mut t = s.clone();
        let configs = self.configs();
        let live = |i: Id| {
            let w = &s.workers[i as usize];
            !w.crashed && matches!(w.phase, Phase::Connecting { .. } | Phase::Running { .. })
        };
        match *a {
            Action::Put => {
                t.server.push(configs.get(s.server.len())?.clone());
            }
            Action::Watch => {
                let latest = s.server.len() - 1;
                if s.seen == latest {
                    return None;
                }
                let seen = if self.every_version {
                    s.seen + 1
                } else {
                    latest
                };
                t.seen = seen;
                let members = s.server[seen].clone();
                for &m in &members {
                    let w = &mut t.workers[m as usize];
                    if w.phase == Phase::NotStarted {
                        w.reached |= 1 << seen;
                        w.phase = Phase::Connecting {
                            version: seen,
                            members: members.clone(),
                        };
                    }
                }
            }
            Action::Crash(i) => {
                if !live(i) || s.crashes >= self.max_crashes {
                    return None;
                }
                t.crashes += 1;
                t.workers[i as usize].crashed = true;
            }
            Action::Call(i) => {
                let Phase::Running {
                    version,
                    ref members,
                    called: false,
                } = s.workers[i as usize].phase
                else {
                    return None;
                };
                if !live(i) || s.server.len() - 1 <= version {
                    return None;
                }
                let latest = s.server.len() - 1;
                if !self.shared_read {
                    self.switch(&mut t, i, latest);
                    return Some(t);
                }
                if members[0] == i {
                    t.reads.push((version, latest));
                }
                let w = &mut t.workers[i as usize];
                w.calls |= 1 << version;
                w.phase = Phase::Running {
                    version,
                    members: members.clone(),
                    called: true,
                };
            }
            Action::Complete(i) => {
                let Phase::Running {
                    version,
                    ref members,
                    called: true,
                } = s.workers[i as usize].phase
                else {
                    return None;
                };
                let called = |m: Id| s.workers[m as usize].calls & (1 << version) != 0;
                if !live(i) || !members.iter().all(|&m| called(m)) {
                    return None;
                }
                let &(_, read) = s.reads.iter().find(|r| r.0 == version)?;
                self.switch(&mut t, i, read);
            }
            Action::Lost(i, k) => {
                let Phase::Running {
                    ref members,
                    called: true,
                    ..
                } = s.workers[i as usize].phase
                else {
                    return None;
                };
                if !live(i) || k == i || !members.contains(&k) || !s.workers[k as usize].crashed {
                    return None;
                }
                t.workers[i as usize].phase = Phase::Failed;
            }
            Action::Connected(i) => {
                let Phase::Connecting {
                    version,
                    ref members,
                } = s.workers[i as usize].phase
                else {
                    return None;
                };
                if !live(i) || !members.iter().all(|&m| Self::reached(s, m, version)) {
                    return None;
                }
                t.workers[i as usize].phase = Phase::Running {
                    version,
                    members: members.clone(),
                    called: false,
                };
            }
            Action::Timeout(i) => {
                if !live(i) || !self.quiet(s) {
                    return None;
                }
                let w = &mut t.workers[i as usize];
                let stopped = !s.server[s.seen].contains(&i);
                w.phase = match &w.phase {
                    _ if stopped => Phase::Stopped,
                    Phase::Connecting { .. } | Phase::Running { called: true, .. } => Phase::Failed,
                    _ => return None,
                };
            }
        }
        (t != *s).then_some(t)
    }

    fn candidates(&self, out: &mut Vec<Action>) {
        out.extend([Action::Put, Action::Watch]);
        for i in 0..self.ids() as Id {
            out.extend([
                Action::Crash(i),
                Action::Call(i),
                Action::Complete(i),
                Action::Connected(i),
            ]);
            for k in 0..self.ids() as Id {
                out.push(Action::Lost(i, k));
            }
        }
    }

    /// Whether nothing but a timeout (or the environment) can happen.
    fn quiet(&self, s: &State) -> bool {
        let mut c = Vec::new();
        self.candidates(&mut c);
        c.iter()
            .filter(|a| !environment(a))
            .all(|a| self.step(s, a).is_none())
    }
}

/// A crash or a put: what the environment does, which may stop.
fn environment(a: &Action) -> bool {
    matches!(a, Action::Crash(_) | Action::Put)
}

impl Model for ResizeModel {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let members: Vec<Id> = (0..self.n as Id).collect();
        let mut workers = vec![
            Worker {
                phase: Phase::NotStarted,
                crashed: false,
                reached: 0,
                calls: 0,
            };
            self.ids()
        ];
        for w in &mut workers[..self.n] {
            w.reached = 1;
            w.phase = Phase::Running {
                version: 0,
                members: members.clone(),
                called: false,
            };
        }
        vec![State {
            workers,
            server: vec![members],
            seen: 0,
            reads: Vec::new(),
            crashes: 0,
        }]
    }

    fn actions(&self, _: &State, out: &mut Vec<Action>) {
        self.candidates(out);
        out.extend((0..self.ids() as Id).map(Action::Timeout));
    }

    fn next_state(&self, s: &State, a: Action) -> Option<State> {
        self.step(s, &a)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(ONE, |_, s: &State| {
                let at: Vec<(usize, &Vec<Id>)> = s
                    .workers
                    .iter()
                    .filter(|w| !w.crashed)
                    .filter_map(|w| match &w.phase {
                        Phase::Connecting { version, members }
                        | Phase::Running {
                            version, members, ..
                        } => Some((*version, members)),
                        _ => None,
                    })
                    .collect();
                at.iter()
                    .all(|(v, m)| at.iter().all(|(u, n)| v != u || m == n))
            }),
            Property::always(ENDS, |m: &ResizeModel, s: &State| {
                if !model::settled(m, s, environment) {
                    return true;
                }
                let latest = s.server.len() - 1;
                s.workers.iter().all(|w| match &w.phase {
                    _ if w.crashed => true,
                    Phase::Running { version, .. } => *version == latest,
                    Phase::NotStarted | Phase::Detached | Phase::Stopped => true,
                    Phase::Failed => s.crashes > 0,
                    Phase::Connecting { .. } => false,
                })
            }),
            Property::sometimes("the job grows and shrinks", |m: &ResizeModel, s: &State| {
                let latest = s.server.len() - 1;
                latest == m.puts.len()
                    && s.workers.iter().filter(|w| {
                        matches!(w.phase, Phase::Running { version, .. } if version == latest)
                    }).count()
                        == s.server[latest].len()
            }),
        ]
    }
}

const ONE: &str = "no two live workers run at one version with different memberships";
const ENDS: &str = "each worker ends at the latest version or leaves (without a crash, none fails)";

/// `n` workers, one crash, the script's puts (sizes relative to `n`).
fn resize(puts: &[isize]) -> ResizeModel {
    let n = model::bound(4);
    ResizeModel {
        n,
        puts: puts.iter().map(|&d| n.saturating_add_signed(d)).collect(),
        max_crashes: 1,
        every_version: true,
        shared_read: true,
    }
}

#[test]
fn a_shrink_then_a_grow_ends_at_the_latest_version() {
    model::check("resize, shrink then grow", resize(&[-1, 0])).assert_properties();
}

/// What the checker found: a grow followed at once by a shrink, which a
/// launcher that watches only the latest config sees as one change (the
/// shrink), so it never starts the worker the grow added; if rank 0 read
/// the grown config in between, every worker connects at that version and
/// waits for the one never started until the connect timeout. kungfu-run
/// now handles every version (`ConfigServer::since`): the next test.
#[test]
fn a_launcher_that_sees_only_the_latest_version_skips_a_grow() {
    let m = ResizeModel {
        every_version: false,
        ..resize(&[1, 0])
    };
    let c = model::check("resize, grow then shrink, latest only", m);
    let path = c.assert_any_discovery(ENDS);
    println!("the counterexample: {path}");
}

#[test]
fn a_grow_then_a_shrink_ends_at_the_latest_version() {
    model::check("resize, grow then shrink", resize(&[1, 0])).assert_properties();
}

/// Workers that each read the server themselves, rather than take rank
/// 0's read, can take different versions and wait for each other: the
/// checker must find it.
#[test]
fn without_rank_0s_read_workers_take_different_versions() {
    let m = ResizeModel {
        shared_read: false,
        ..resize(&[-1, 0])
    };
    let c = model::check("resize, each reads", m);
    let path = c.assert_any_discovery(ENDS);
    println!("the counterexample: {path}");
}
