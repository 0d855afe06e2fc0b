//! The recovery protocol as a state machine without IO: the async driver
//! ([`crate::Worker::recover`]) and the model checker's model
//! (`runtime/tests/model_recover.rs`) both drive this one, so the code
//! that runs and the code that is checked cannot drift.
//!
//! Ranks here are those of the cluster version the worker is recovering
//! from (the *old* ranks).
//!
//! One round decides the successor of one config version (`base`):
//! - a survivor that knows a member of `base` lost proposes `base`'s
//!   members less every rank it knows lost, as version `base + 1`, to the
//!   config server, which takes the first proposal for a version and
//!   refuses the others (compare-and-set: the one place where survivors
//!   that know different losses could disagree, it picks one). The lowest
//!   member it does not know lost proposes at once, the others only once
//!   the driver says it waited long enough ([`Recovery::handle_patience`]):
//!   usually one proposal per round, and no wait on a survivor that is
//!   itself cut off;
//! - every survivor reads the server's config: if it is newer than `base`
//!   and names it, it connects to it; if it does not name it, this worker
//!   was left out and stops;
//! - connected, it waits at a barrier of the new version (every member
//!   connected) before it closes the old connections: closed at once,
//!   they made this worker look lost to a member still connecting (the
//!   model checker and the launcher's chaos test both found it). Not when
//!   the config has workers the old version did not have (a resize made
//!   it, and they would never meet the barrier);
//! - when connecting fails because a member was lost meanwhile, that
//!   config becomes the next `base`, and the next round starts.
//!
//! Nothing decides twice for one version, and every survivor follows the
//! server's config, so no two live workers run ops at one version with
//! different memberships. A link cut between two live workers makes each
//! end know the other lost (and peers hear of one or the other): whoever
//! proposes first leaves out one end, never a third worker.

use std::collections::BTreeSet;

use kungfu_topology::Rank;

/// The rank a member of a config has when the old version did not have
/// it (a replacement, or a worker added by a resize).
pub const NEW: Rank = Rank(u32::MAX);

/// What the driver must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Ask the config server to make `members` version `base + 1`.
    Propose { base: u64, members: Vec<Rank> },
    /// Connect to the cluster `members` at `version` (the server's), then
    /// call [`Recovery::handle_connected`] or
    /// [`Recovery::handle_connect_failed`].
    Connect { version: u64, members: Vec<Rank> },
    /// Wait at the barrier of `version` (every member connected), then
    /// call [`Recovery::handle_barrier_passed`] or
    /// [`Recovery::handle_connect_failed`].
    Barrier { version: u64 },
    /// Close the old connections and go on at `version`: done.
    Adopt { version: u64 },
    /// The cluster went on at `version` without this worker.
    Excluded { version: u64 },
}

/// Where a worker is with the config it connects to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Stage {
    /// To connect (the driver was not told yet).
    Due,
    Connecting,
    /// Connected; the barrier is due.
    Connected,
    AtBarrier,
    /// Past the barrier (or none was due): to adopt.
    Passed,
    Adopted,
}

/// The config this worker connects to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Next {
    version: u64,
    members: Vec<Rank>,
    stage: Stage,
}

/// One worker's side of a recovery (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Recovery {
    me: Rank,
    /// The version whose successor is being decided.
    base: u64,
    /// `base`'s members.
    members: Vec<Rank>,
    /// The ranks this worker knows lost.
    lost: BTreeSet<Rank>,
    /// Whether the driver waited long enough for the proposal of another.
    impatient: bool,
    /// Whether this worker proposed for `base`.
    proposed: bool,
    next: Option<Next>,
    /// The config without this worker, and whether the driver was told.
    excluded: Option<(u64, bool)>,
}

impl Recovery {
    /// Recovery of rank `me` from version `base`, whose members are
    /// `members`, with the ranks `lost` already known lost.
    pub fn new(
        me: Rank,
        base: u64,
        members: Vec<Rank>,
        lost: impl IntoIterator<Item = Rank>,
    ) -> Recovery {
        let mut m = Recovery {
            me,
            base,
            members,
            lost: BTreeSet::new(),
            impatient: false,
            proposed: false,
            next: None,
            excluded: None,
        };
        lost.into_iter().for_each(|r| m.handle_lost(r));
        m
    }

    pub fn base(&self) -> u64 {
        self.base
    }

    pub fn members(&self) -> &[Rank] {
        &self.members
    }

    /// The ranks this worker knows lost.
    pub fn lost(&self) -> &BTreeSet<Rank> {
        &self.lost
    }

    /// Whether this worker connects to a config (from
    /// [`Step::Connect`] until [`Step::Adopt`] or a failure): the driver
    /// reads no config meanwhile.
    pub fn joining(&self) -> bool {
        self.next.as_ref().is_some_and(|n| n.stage != Stage::Due)
    }

    /// The member of `base` that proposes at once, as this worker sees
    /// it: the lowest it does not know lost.
    pub fn first_proposer(&self) -> Option<Rank> {
        self.members
            .iter()
            .copied()
            .filter(|r| !self.lost.contains(r))
            .min()
    }

    /// `r` was lost (this worker's failure detector, a connection that
    /// broke, or a peer's notice).
    pub fn handle_lost(&mut self, r: Rank) {
        if r != self.me && r != NEW {
            self.lost.insert(r);
        }
    }

    /// The driver waited long enough for another's proposal: this worker
    /// may propose too (once it knows a member lost).
    pub fn handle_patience(&mut self) {
        self.impatient = true;
    }

    /// The config server holds `members` at `version` (read, or the answer
    /// to a proposal); a member the old version did not have is [`NEW`].
    /// Taken only while this worker connects to no config.
    pub fn handle_config(&mut self, version: u64, members: Vec<Rank>) {
        if version <= self.base || self.joining() || self.excluded.is_some() {
            return;
        }
        if self.next.as_ref().is_some_and(|n| n.version >= version) {
            return;
        }
        if members.contains(&self.me) {
            self.next = Some(Next {
                version,
                members,
                stage: Stage::Due,
            });
        } else {
            self.excluded = Some((version, false));
        }
    }

    /// Connected to `version`.
    pub fn handle_connected(&mut self, version: u64) {
        if let Some(n) = &mut self.next {
            if n.version == version && n.stage == Stage::Connecting {
                // the barrier only among workers of the old version
                let old = n.members.iter().all(|&r| r != NEW);
                n.stage = if old { Stage::Connected } else { Stage::Passed };
            }
        }
    }

    /// The barrier of `version` passed: every member connected.
    pub fn handle_barrier_passed(&mut self, version: u64) {
        if let Some(n) = &mut self.next {
            if n.version == version && n.stage == Stage::AtBarrier {
                n.stage = Stage::Passed;
            }
        }
    }

    /// Connecting to `version` (or its barrier) failed, since the ranks
    /// `lost` were lost: that config is decided, so its successor is
    /// decided next.
    pub fn handle_connect_failed(&mut self, version: u64, lost: impl IntoIterator<Item = Rank>) {
        let Some(n) = self.next.take() else {
            return;
        };
        let under_way = matches!(
            n.stage,
            Stage::Connecting | Stage::Connected | Stage::AtBarrier
        );
        if n.version != version || !under_way {
            self.next = Some(n);
            return;
        }
        self.base = n.version;
        self.members = n.members;
        self.proposed = false;
        self.impatient = false;
        lost.into_iter().for_each(|r| self.handle_lost(r));
    }

    /// The next thing to do, if any (call until `None`, then wait for an
    /// input).
    pub fn poll(&mut self) -> Option<Step> {
        if let Some((version, told)) = &mut self.excluded {
            if *told {
                return None;
            }
            *told = true;
            return Some(Step::Excluded { version: *version });
        }
        if let Some(n) = &mut self.next {
            let version = n.version;
            return match n.stage {
                Stage::Due => {
                    n.stage = Stage::Connecting;
                    Some(Step::Connect {
                        version,
                        members: n.members.clone(),
                    })
                }
                Stage::Connected => {
                    n.stage = Stage::AtBarrier;
                    Some(Step::Barrier { version })
                }
                Stage::Passed => {
                    n.stage = Stage::Adopted;
                    Some(Step::Adopt { version })
                }
                Stage::Connecting | Stage::AtBarrier | Stage::Adopted => None,
            };
        }
        let members = survivors(&self.members, &self.lost);
        let first = self.first_proposer() == Some(self.me);
        if self.proposed || members.len() == self.members.len() || !(first || self.impatient) {
            return None;
        }
        self.proposed = true;
        Some(Step::Propose {
            base: self.base,
            members,
        })
    }
}

/// `members` less `lost`, in their order.
pub fn survivors(members: &[Rank], lost: &BTreeSet<Rank>) -> Vec<Rank> {
    members
        .iter()
        .copied()
        .filter(|r| !lost.contains(r))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranks(v: &[u32]) -> Vec<Rank> {
        v.iter().copied().map(Rank).collect()
    }

    /// Drives `w` through connecting `version` and its barrier.
    fn join(w: &mut Recovery, version: u64, members: &[u32]) {
        assert_eq!(
            w.poll(),
            Some(Step::Connect {
                version,
                members: ranks(members)
            })
        );
        assert_eq!(w.poll(), None, "connecting");
        w.handle_connected(version);
        assert_eq!(w.poll(), Some(Step::Barrier { version }));
        assert_eq!(w.poll(), None, "at the barrier");
        w.handle_barrier_passed(version);
        assert_eq!(w.poll(), Some(Step::Adopt { version }));
        assert_eq!(w.poll(), None, "done");
    }

    #[test]
    fn the_lowest_survivor_proposes_at_once_and_every_survivor_joins() {
        let mut c = Recovery::new(Rank(0), 3, ranks(&[0, 1, 2, 3]), [Rank(3)]);
        assert_eq!(
            c.poll(),
            Some(Step::Propose {
                base: 3,
                members: ranks(&[0, 1, 2])
            })
        );
        assert_eq!(c.poll(), None, "proposes once");
        c.handle_config(4, ranks(&[0, 1, 2]));
        join(&mut c, 4, &[0, 1, 2]);
        // rank 2 waits for it, unless it waited long enough
        let mut w = Recovery::new(Rank(2), 3, ranks(&[0, 1, 2, 3]), [Rank(3)]);
        assert_eq!(w.poll(), None);
        w.handle_patience();
        assert!(matches!(w.poll(), Some(Step::Propose { base: 3, .. })));
        // its proposal refused, it reads rank 0's
        w.handle_config(4, ranks(&[0, 1, 2]));
        join(&mut w, 4, &[0, 1, 2]);
    }

    #[test]
    fn nothing_is_proposed_before_a_member_is_known_lost() {
        let mut w = Recovery::new(Rank(0), 0, ranks(&[0, 1, 2]), [Rank(0), NEW]);
        w.handle_patience();
        assert_eq!(w.poll(), None);
        w.handle_lost(Rank(1));
        assert!(matches!(w.poll(), Some(Step::Propose { .. })));
    }

    #[test]
    fn the_two_ends_of_a_cut_link_propose_each_without_the_other() {
        let mut a = Recovery::new(Rank(0), 0, ranks(&[0, 1, 2]), [Rank(1)]);
        let mut b = Recovery::new(Rank(1), 0, ranks(&[0, 1, 2]), [Rank(0)]);
        let pa = a.poll();
        let pb = b.poll();
        assert_eq!(
            (pa, pb),
            (
                Some(Step::Propose {
                    base: 0,
                    members: ranks(&[0, 2])
                }),
                Some(Step::Propose {
                    base: 0,
                    members: ranks(&[1, 2])
                })
            )
        );
        // the server took a's: b is left out, a goes on
        b.handle_config(1, ranks(&[0, 2]));
        assert_eq!(b.poll(), Some(Step::Excluded { version: 1 }));
        assert_eq!(b.poll(), None);
        a.handle_config(1, ranks(&[0, 2]));
        join(&mut a, 1, &[0, 2]);
    }

    #[test]
    fn a_failed_connect_makes_that_config_the_next_base() {
        let mut w = Recovery::new(Rank(2), 0, ranks(&[0, 1, 2]), [Rank(1)]);
        w.handle_config(1, ranks(&[0, 2]));
        assert!(matches!(w.poll(), Some(Step::Connect { version: 1, .. })));
        // a config read meanwhile is not taken
        w.handle_config(2, ranks(&[2]));
        assert_eq!(w.poll(), None);
        w.handle_connect_failed(1, [Rank(0)]);
        assert_eq!((w.base(), w.members()), (1, ranks(&[0, 2]).as_slice()));
        assert_eq!(
            w.poll(),
            Some(Step::Propose {
                base: 1,
                members: ranks(&[2])
            })
        );
        // an older config changes nothing
        w.handle_config(1, ranks(&[0, 1, 2]));
        assert_eq!(w.poll(), None);
        // nor does a failure of the barrier of a version not joined
        w.handle_connect_failed(2, [Rank(0)]);
        assert_eq!(w.base(), 1);
    }

    #[test]
    fn a_config_with_new_workers_is_adopted_without_the_barrier() {
        let mut w = Recovery::new(Rank(1), 0, ranks(&[0, 1, 2]), [Rank(2)]);
        w.handle_config(1, vec![Rank(0), Rank(1), NEW]);
        assert!(matches!(w.poll(), Some(Step::Connect { version: 1, .. })));
        w.handle_connected(1);
        assert_eq!(w.poll(), Some(Step::Adopt { version: 1 }));
        // a barrier that failed after it was passed changes nothing
        w.handle_connect_failed(1, [Rank(0)]);
        assert_eq!((w.base(), w.poll()), (0, None));
    }
}
