//! Directed graphs over ranks, and the checks that make them usable as
//! reduce and broadcast trees.

use crate::{Digest, Rank};

/// Why a graph cannot serve as a reduce or broadcast tree.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TopologyError {
    #[error("graph has {got} nodes, the peer list {want}")]
    WrongSize { got: usize, want: usize },
    #[error("{rank} has {count} parents in a {what} graph (a tree needs at most one)")]
    TooManyParents {
        rank: Rank,
        count: usize,
        what: &'static str,
    },
    #[error("{rank} is not connected to the root {root} in the {what} graph")]
    Unreached {
        rank: Rank,
        root: Rank,
        what: &'static str,
    },
    #[error("the {what} graph has a cycle through {rank}")]
    Cycle { rank: Rank, what: &'static str },
    #[error("the {what} graph has an edge {from} -> {to} out of range")]
    OutOfRange {
        from: Rank,
        to: Rank,
        what: &'static str,
    },
    #[error("ring order is not a permutation of the ranks")]
    BadRing,
    #[error("rooted topology has the root {got}, expected {want}")]
    WrongRoot { got: Rank, want: Rank },
}

/// A directed graph on ranks `0..n`: data flows along `from -> to`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Graph {
    nexts: Vec<Vec<Rank>>,
    prevs: Vec<Vec<Rank>>,
}

impl Graph {
    /// A graph of `n` nodes and no edges.
    pub fn new(n: usize) -> Graph {
        Graph {
            nexts: vec![Vec::new(); n],
            prevs: vec![Vec::new(); n],
        }
    }

    /// Adds `from -> to`. Panics on an out-of-range rank (generators only
    /// produce ranks below `n`).
    pub fn add_edge(&mut self, from: Rank, to: Rank) {
        self.nexts[from.idx()].push(to);
        self.prevs[to.idx()].push(from);
    }

    pub fn len(&self) -> usize {
        self.nexts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nexts.is_empty()
    }

    /// Where `r` sends.
    pub fn nexts(&self, r: Rank) -> &[Rank] {
        &self.nexts[r.idx()]
    }

    /// Where `r` receives from.
    pub fn prevs(&self, r: Rank) -> &[Rank] {
        &self.prevs[r.idx()]
    }

    /// The reverse graph (a reduce tree becomes the matching broadcast tree).
    pub fn reversed(&self) -> Graph {
        Graph {
            nexts: self.prevs.clone(),
            prevs: self.nexts.clone(),
        }
    }

    fn feed(&self, mut d: Digest) -> Digest {
        d = d.u64(self.len() as u64);
        for nexts in &self.nexts {
            d = d.u64(nexts.len() as u64);
            for n in nexts {
                d = d.u64(u64::from(n.0));
            }
        }
        d
    }

    fn check_range(&self, what: &'static str) -> Result<(), TopologyError> {
        let n = self.len();
        for (f, nexts) in self.nexts.iter().enumerate() {
            for &t in nexts {
                if t.idx() >= n {
                    return Err(TopologyError::OutOfRange {
                        from: Rank(f as u32),
                        to: t,
                        what,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks that this is a tree in which data flows *into* `root`: every
    /// rank has at most one next, no cycles, and every rank reaches `root`.
    pub fn validate_reduce(&self, root: Rank) -> Result<(), TopologyError> {
        self.reversed()
            .validate_tree(root, "reduce")
            .map_err(|e| match e {
                TopologyError::TooManyParents { rank, count, .. } => {
                    TopologyError::TooManyParents {
                        rank,
                        count,
                        what: "reduce",
                    }
                }
                e => e,
            })
    }

    /// Checks that this is a tree in which data flows *out of* `root`: every
    /// rank has at most one prev, no cycles, and `root` reaches every rank.
    pub fn validate_broadcast(&self, root: Rank) -> Result<(), TopologyError> {
        self.validate_tree(root, "broadcast")
    }

    fn validate_tree(&self, root: Rank, what: &'static str) -> Result<(), TopologyError> {
        self.check_range(what)?;
        let n = self.len();
        if root.idx() >= n {
            return Err(TopologyError::OutOfRange {
                from: root,
                to: root,
                what,
            });
        }
        for (r, prevs) in self.prevs.iter().enumerate() {
            if prevs.len() > 1 {
                return Err(TopologyError::TooManyParents {
                    rank: Rank(r as u32),
                    count: prevs.len(),
                    what,
                });
            }
        }
        if !self.prevs[root.idx()].is_empty() {
            return Err(TopologyError::Cycle { rank: root, what });
        }
        // With in-degree <= 1 and the root's in-degree 0, a walk from the
        // root visits each node at most once unless there is a cycle, and a
        // cycle is unreachable from the root; so reaching all n nodes proves
        // both connectivity and acyclicity.
        let mut seen = vec![false; n];
        let mut stack = vec![root];
        seen[root.idx()] = true;
        while let Some(r) = stack.pop() {
            for &t in self.nexts(r) {
                if seen[t.idx()] {
                    return Err(TopologyError::Cycle { rank: t, what });
                }
                seen[t.idx()] = true;
                stack.push(t);
            }
        }
        if let Some(r) = seen.iter().position(|s| !s) {
            return Err(TopologyError::Unreached {
                rank: Rank(r as u32),
                root,
                what,
            });
        }
        Ok(())
    }

    /// The ranks whose data passes through `r` on its way to the root of a
    /// reduce tree, `r` included, in ascending order.
    pub fn subtree_of(&self, r: Rank) -> Vec<Rank> {
        let mut out = vec![r];
        let mut i = 0;
        while i < out.len() {
            out.extend_from_slice(self.prevs(out[i]));
            i += 1;
        }
        out.sort_unstable();
        out
    }
}

/// A reduce tree and a broadcast tree with the same root: an allreduce
/// reduces along the first, then broadcasts along the second.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GraphPair {
    pub root: Rank,
    pub reduce: Graph,
    pub broadcast: Graph,
}

impl GraphPair {
    /// A pair whose broadcast tree is the reduce tree reversed.
    pub fn from_reduce(root: Rank, reduce: Graph) -> GraphPair {
        GraphPair {
            root,
            broadcast: reduce.reversed(),
            reduce,
        }
    }

    pub fn validate(&self, n: usize) -> Result<(), TopologyError> {
        for g in [&self.reduce, &self.broadcast] {
            if g.len() != n {
                return Err(TopologyError::WrongSize {
                    got: g.len(),
                    want: n,
                });
            }
        }
        self.reduce.validate_reduce(self.root)?;
        self.broadcast.validate_broadcast(self.root)
    }

    pub(crate) fn feed(&self, d: Digest) -> Digest {
        self.broadcast
            .feed(self.reduce.feed(d.u64(u64::from(self.root.0))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u32) -> Graph {
        let mut g = Graph::new(n as usize);
        for i in 1..n {
            g.add_edge(Rank(i), Rank(i - 1));
        }
        g
    }

    #[test]
    fn chain_is_a_reduce_tree() {
        let g = chain(5);
        g.validate_reduce(Rank(0)).unwrap();
        g.reversed().validate_broadcast(Rank(0)).unwrap();
        assert_eq!(g.subtree_of(Rank(2)), vec![Rank(2), Rank(3), Rank(4)]);
    }

    #[test]
    fn wrong_root_is_refused() {
        let g = chain(3);
        assert!(g.validate_reduce(Rank(2)).is_err());
    }

    #[test]
    fn unreached_and_cycles_are_refused() {
        let mut g = Graph::new(3);
        g.add_edge(Rank(1), Rank(0));
        assert!(matches!(
            g.validate_reduce(Rank(0)),
            Err(TopologyError::Unreached { rank: Rank(2), .. })
        ));
        let mut c = Graph::new(3);
        c.add_edge(Rank(0), Rank(1));
        c.add_edge(Rank(1), Rank(2));
        c.add_edge(Rank(2), Rank(1));
        assert!(c.validate_broadcast(Rank(0)).is_err());
    }

    #[test]
    fn two_parents_are_refused() {
        let mut g = Graph::new(3);
        g.add_edge(Rank(0), Rank(2));
        g.add_edge(Rank(1), Rank(2));
        g.add_edge(Rank(0), Rank(1));
        assert!(matches!(
            g.validate_broadcast(Rank(0)),
            Err(TopologyError::TooManyParents { rank: Rank(2), .. })
        ));
    }
}
