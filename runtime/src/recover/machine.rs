//! The recovery protocol as a state machine without IO: the async driver
//! ([`crate::Worker::recover`]) and the model checker's model
//! (`runtime/tests/model_recover.rs`) both drive this one, so the code
//! that runs and the code that is checked cannot drift.
//!
//! Ranks here are those of the cluster version the worker is recovering
//! from (the *old* ranks): views travel over its connections, which stay
//! open until a new version is connected.
//!
//! One round decides the successor of one config version (`base`):
//! - every survivor computes the *coordinator*, the lowest rank of `base`
//!   that it does not know lost, and sends it its *view* (the ranks it
//!   knows lost);
//! - the coordinator waits for the view of every rank of `base` it does
//!   not know lost (a rank lost meanwhile is not waited for), then
//!   proposes `base`'s members less every rank any view names, as version
//!   `base + 1`, to the config server, which takes the first proposal for
//!   a version and refuses the others (compare-and-set: the one place
//!   where two coordinators could disagree, it picks one);
//! - every survivor reads the server's config: if it is newer than
//!   `base` and names it, it connects to it (a barrier among its members);
//!   if it does not name it, this worker was left out and stops.
//!   When connecting fails because a member was lost meanwhile, that
//!   config becomes the next `base`, and the next round starts.
//!
//! A coordinator lost before the config changed makes the survivors send
//! their views to the next one. Nothing decides twice for one version,
//! and every survivor follows the server's config, so no two live workers
//! run ops at one version with different memberships.

use std::collections::{BTreeMap, BTreeSet};

use kungfu_topology::Rank;

/// What the driver must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Send this worker's view of the round deciding `base` to `to`.
    SendView {
        to: Rank,
        base: u64,
        lost: Vec<Rank>,
    },
    /// Ask the config server to make `members` version `base + 1`.
    Propose { base: u64, members: Vec<Rank> },
    /// Connect to the cluster `members` at `version` (the server's).
    Connect { version: u64, members: Vec<Rank> },
    /// The cluster went on at `version` without this worker.
    Excluded { version: u64 },
}

/// One worker's side of a recovery (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Recovery {
    me: Rank,
    /// The version whose successor is being decided.
    base: u64,
    /// `base`'s members.
    members: Vec<Rank>,
    /// The ranks this worker knows lost (its own failure detector and the
    /// views it received).
    lost: BTreeSet<Rank>,
    /// As a coordinator: the views received for `base`.
    views: BTreeMap<Rank, BTreeSet<Rank>>,
    /// The coordinator this worker's view for `base` went to.
    sent: Option<Rank>,
    /// Whether this worker proposed for `base`.
    proposed: bool,
    /// A config newer than `base` to connect to, and whether the driver
    /// was told to.
    next: Option<(u64, Vec<Rank>, bool)>,
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
        Recovery {
            me,
            base,
            members,
            lost: lost.into_iter().collect(),
            views: BTreeMap::new(),
            sent: None,
            proposed: false,
            next: None,
            excluded: None,
        }
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

    /// The coordinator of this round as this worker sees it: the lowest
    /// member of `base` it does not know lost.
    pub fn coordinator(&self) -> Option<Rank> {
        coordinator(&self.members, &self.lost)
    }

    /// `r` was lost (this worker's failure detector, or a connection that
    /// broke).
    pub fn handle_lost(&mut self, r: Rank) {
        if r != self.me {
            self.lost.insert(r);
        }
    }

    /// The view of `from` for the round deciding `base`.
    pub fn handle_view(&mut self, from: Rank, base: u64, lost: &[Rank]) {
        if base != self.base || self.lost.contains(&from) {
            return;
        }
        self.views
            .insert(from, lost.iter().copied().filter(|&r| r != from).collect());
    }

    /// The config server holds `members` at `version` (read, or the answer
    /// to a proposal).
    pub fn handle_config(&mut self, version: u64, members: Vec<Rank>) {
        if version <= self.base || self.next.as_ref().is_some_and(|n| n.0 >= version) {
            return;
        }
        if members.contains(&self.me) {
            self.next = Some((version, members, false));
        } else {
            self.excluded.get_or_insert((version, false));
        }
    }

    /// Connecting to `version` failed, since the ranks `lost` were lost:
    /// that config is decided, so its successor is decided next.
    pub fn handle_connect_failed(&mut self, version: u64, lost: impl IntoIterator<Item = Rank>) {
        let Some((v, members, _)) = self.next.take() else {
            return;
        };
        if v != version {
            self.next = Some((v, members, true));
            return;
        }
        self.base = v;
        self.members = members;
        self.views.clear();
        self.sent = None;
        self.proposed = false;
        for r in lost {
            self.handle_lost(r);
        }
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
        if let Some((version, members, told)) = &mut self.next {
            if *told {
                return None;
            }
            *told = true;
            return Some(Step::Connect {
                version: *version,
                members: members.clone(),
            });
        }
        let coord = self.coordinator()?;
        if coord != self.me {
            if self.sent == Some(coord) {
                return None;
            }
            self.sent = Some(coord);
            return Some(Step::SendView {
                to: coord,
                base: self.base,
                lost: self.lost.iter().copied().collect(),
            });
        }
        if self.proposed {
            return None;
        }
        // the others' views widen what is known lost
        let reported: Vec<Rank> = self.views.values().flatten().copied().collect();
        self.lost
            .extend(reported.into_iter().filter(|&r| r != self.me));
        let waiting = self
            .members
            .iter()
            .any(|r| *r != self.me && !self.lost.contains(r) && !self.views.contains_key(r));
        if waiting {
            return None;
        }
        self.proposed = true;
        Some(Step::Propose {
            base: self.base,
            members: survivors(&self.members, &self.lost),
        })
    }

    /// The ranks whose view the coordinator still waits for.
    pub fn waiting_for(&self) -> Vec<Rank> {
        if self.coordinator() != Some(self.me) || self.proposed {
            return Vec::new();
        }
        self.members
            .iter()
            .copied()
            .filter(|r| *r != self.me && !self.lost.contains(r) && !self.views.contains_key(r))
            .collect()
    }
}

/// The lowest of `members` not in `lost`.
pub fn coordinator(members: &[Rank], lost: &BTreeSet<Rank>) -> Option<Rank> {
    members.iter().copied().filter(|r| !lost.contains(r)).min()
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

    #[test]
    fn the_lowest_survivor_collects_views_and_proposes_the_rest() {
        let mut c = Recovery::new(Rank(0), 3, ranks(&[0, 1, 2, 3]), [Rank(3)]);
        assert_eq!(c.poll(), None, "waits for the views of 1 and 2");
        assert_eq!(c.waiting_for(), ranks(&[1, 2]));
        c.handle_view(Rank(1), 3, &ranks(&[3]));
        // a view of another round is not this one's
        c.handle_view(Rank(2), 2, &[]);
        assert_eq!(c.poll(), None);
        c.handle_view(Rank(2), 3, &ranks(&[3]));
        assert_eq!(
            c.poll(),
            Some(Step::Propose {
                base: 3,
                members: ranks(&[0, 1, 2])
            })
        );
        assert_eq!(c.poll(), None, "proposes once");
        c.handle_config(4, ranks(&[0, 1, 2]));
        assert_eq!(
            c.poll(),
            Some(Step::Connect {
                version: 4,
                members: ranks(&[0, 1, 2])
            })
        );
        assert_eq!(c.poll(), None);
    }

    #[test]
    fn a_lost_coordinator_hands_over_and_a_loss_in_a_view_is_taken() {
        let mut w = Recovery::new(Rank(2), 0, ranks(&[0, 1, 2]), [Rank(0)]);
        assert_eq!(
            w.poll(),
            Some(Step::SendView {
                to: Rank(1),
                base: 0,
                lost: ranks(&[0])
            })
        );
        assert_eq!(w.poll(), None);
        // rank 1 is lost too: this worker coordinates, alone
        w.handle_lost(Rank(1));
        assert_eq!(
            w.poll(),
            Some(Step::Propose {
                base: 0,
                members: ranks(&[2])
            })
        );
        // rank 1 reported 2 lost: but the view of a lost rank is not taken
        let mut c = Recovery::new(Rank(0), 0, ranks(&[0, 1, 2]), []);
        c.handle_view(Rank(1), 0, &ranks(&[2]));
        assert_eq!(
            c.poll(),
            Some(Step::Propose {
                base: 0,
                members: ranks(&[0, 1])
            })
        );
    }

    #[test]
    fn a_config_without_this_worker_excludes_it_once() {
        let mut w = Recovery::new(Rank(1), 0, ranks(&[0, 1, 2]), []);
        let _ = w.poll();
        w.handle_config(1, ranks(&[0, 2]));
        assert_eq!(w.poll(), Some(Step::Excluded { version: 1 }));
        assert_eq!(w.poll(), None);
    }

    #[test]
    fn a_failed_connect_makes_that_config_the_next_base() {
        let mut w = Recovery::new(Rank(2), 0, ranks(&[0, 1, 2]), [Rank(1)]);
        let _ = w.poll();
        w.handle_config(1, ranks(&[0, 2]));
        assert!(matches!(w.poll(), Some(Step::Connect { version: 1, .. })));
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
    }
}
