//! Strategies: pure generator functions from a peer list to graphs.

use std::fmt;
use std::str::FromStr;

use crate::{Digest, Graph, GraphPair, PeerList, Rank, TopologyError};

/// Messages of at least this many bytes count as large for [`Strategy::Auto`]
/// (the default of [`AutoThresholds::large_bytes`]). Measured over TCP on
/// loopback, 2 cores, kungfu-bench allreduce, 4 or 5 rounds per setting
/// (docs/speed.md, "TCP against Open MPI's tcp btl"): at 4 ranks recursive
/// doubling took a median of 165 us at 64 KiB against the ring's 240, and
/// 227 against 265 at 128 KiB; from 256 KiB the ring was faster (357
/// against 440 us). With 64 KiB here a 64 KiB allreduce of 4 ranks took
/// its 6 ring steps, each a wake-up of a peer, where doubling takes 2.
pub const AUTO_LARGE_BYTES: usize = 256 * 1024;

/// [`Strategy::Auto`] takes the ring only while each worker's share of a
/// message (bytes / workers) is at least this many bytes (the default of
/// [`AutoThresholds::ring_min_share`]): below it a ring's 2(n-1) steps
/// of tiny frames cost more in latency than a tree's log n steps of whole
/// ones. `kungfu-sim` puts the cross-over between 1 and 4 KiB (1 MiB on
/// 1024 and on 256 workers, 100 Gbit/s links, 5 us latency).
pub const AUTO_RING_MIN_SHARE: usize = 2 * 1024;

/// Where [`Strategy::Auto`] switches algorithms, by message size in bytes.
/// Every worker of a cluster must use the same values (a difference shows
/// as a mismatch error on the first op it affects).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AutoThresholds {
    /// From this size up, ops use the ring (bandwidth-optimal; rooted
    /// ops a chain along it); below it, recursive doubling inside a host
    /// and a binary tree of stars across hosts (latency-optimal).
    pub large_bytes: usize,
    /// The ring also needs at least this many bytes per worker
    /// (bytes / n); see [`AUTO_RING_MIN_SHARE`].
    pub ring_min_share: usize,
}

impl Default for AutoThresholds {
    /// 256 KiB, and 2 KiB per worker.
    fn default() -> AutoThresholds {
        AutoThresholds {
            large_bytes: AUTO_LARGE_BYTES,
            ring_min_share: AUTO_RING_MIN_SHARE,
        }
    }
}

/// A named way of connecting the workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    Star,
    Ring,
    Tree,
    BinaryTree,
    BinaryTreeStar,
    MultiBinaryTreeStar,
    Clique,
    /// Recursive doubling: in round `k`, rank `i` exchanges its whole
    /// partial result with rank `i ^ 2^k` and both reduce. `log2 n` rounds
    /// (latency-optimal for small messages); with `n` not a power of two,
    /// the ranks beyond the largest power hand their data to a partner
    /// first and get the result back last. Rooted ops (which have no
    /// recursive-doubling form) use a star up to 4 ranks, a binomial tree
    /// beyond; allgather and reduce-scatter run block-wise on those.
    RecursiveDoubling,
    Auto,
}

/// Whether an op has a root (reduce, broadcast, gather) or not.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Root {
    Any,
    At(Rank),
}

/// What a resolved topology looks like.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Tree pairs; chunk `c` of an op uses pair `c % len`. Rooted topologies
    /// have exactly one pair, rooted at the op's root.
    Trees(Vec<GraphPair>),
    /// A ring in this order: reduce-scatter then allgather around it.
    Ring(Vec<Rank>),
    /// Recursive doubling over positions in this order (see
    /// [`Strategy::RecursiveDoubling`]).
    Butterfly(Vec<Rank>),
}

/// A strategy resolved for one peer list, root and message size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    strategy: Strategy,
    n: usize,
    shape: Shape,
    digest: Digest,
}

impl Topology {
    fn new(strategy: Strategy, n: usize, shape: Shape) -> Topology {
        let mut d = Digest::EMPTY.u64(n as u64);
        match &shape {
            Shape::Trees(pairs) => {
                d = d.u64(1).u64(pairs.len() as u64);
                for p in pairs {
                    d = p.feed(d);
                }
            }
            Shape::Ring(order) | Shape::Butterfly(order) => {
                d = d.u64(if matches!(shape, Shape::Ring(_)) {
                    2
                } else {
                    3
                });
                for r in order {
                    d = d.u64(u64::from(r.0));
                }
            }
        }
        Topology {
            strategy,
            n,
            shape,
            digest: d,
        }
    }

    /// The strategy this was generated from; for `AUTO`, the one it chose.
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn size(&self) -> usize {
        self.n
    }

    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// A digest of the graphs themselves (not of the strategy's name), so
    /// two strategies that generate the same graphs agree.
    pub fn digest(&self) -> Digest {
        self.digest
    }

    /// Checks every graph: trees reach every rank with no cycles, a ring is
    /// a permutation.
    pub fn validate(&self) -> Result<(), TopologyError> {
        match &self.shape {
            Shape::Trees(pairs) => pairs.iter().try_for_each(|p| p.validate(self.n)),
            Shape::Ring(order) | Shape::Butterfly(order) => {
                let mut seen = vec![false; self.n];
                if order.len() != self.n {
                    return Err(TopologyError::BadRing);
                }
                for r in order {
                    match seen.get_mut(r.idx()) {
                        Some(s) if !*s => *s = true,
                        _ => return Err(TopologyError::BadRing),
                    }
                }
                Ok(())
            }
        }
    }
}

/// An unknown strategy name.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown strategy {0:?} (expected one of STAR, RING, TREE, BINARY_TREE, BINARY_TREE_STAR, MULTI_BINARY_TREE_STAR, CLIQUE, RECURSIVE_DOUBLING, AUTO)")]
pub struct StrategyParseError(pub String);

impl Strategy {
    /// Every strategy, `AUTO` last.
    pub const ALL: [Strategy; 9] = [
        Strategy::Star,
        Strategy::Ring,
        Strategy::Tree,
        Strategy::BinaryTree,
        Strategy::BinaryTreeStar,
        Strategy::MultiBinaryTreeStar,
        Strategy::Clique,
        Strategy::RecursiveDoubling,
        Strategy::Auto,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Star => "STAR",
            Strategy::Ring => "RING",
            Strategy::Tree => "TREE",
            Strategy::BinaryTree => "BINARY_TREE",
            Strategy::BinaryTreeStar => "BINARY_TREE_STAR",
            Strategy::MultiBinaryTreeStar => "MULTI_BINARY_TREE_STAR",
            Strategy::Clique => "CLIQUE",
            Strategy::RecursiveDoubling => "RECURSIVE_DOUBLING",
            Strategy::Auto => "AUTO",
        }
    }

    /// `AUTO`'s choice for a message of `bytes` on this layout, with the
    /// default thresholds (see [`Strategy::auto_choice_with`]).
    pub fn auto_choice(peers: &PeerList, bytes: usize) -> Strategy {
        Strategy::auto_choice_with(peers, Root::Any, bytes, &AutoThresholds::default())
    }

    /// `AUTO`'s choice: a ring for large messages, as long as each worker's
    /// share is not tiny (bandwidth-optimal; the
    /// ring order keeps each host's workers adjacent so only one link per
    /// host crosses the network; rooted ops get a pipelined chain). For
    /// small messages: inside one host, recursive doubling (unrooted) or a
    /// star (rooted, up to 4 ranks) or a binary tree (rooted, more); across
    /// hosts, stars inside hosts joined by a binary tree.
    pub fn auto_choice_with(
        peers: &PeerList,
        root: Root,
        bytes: usize,
        th: &AutoThresholds,
    ) -> Strategy {
        let n = peers.len();
        let one_host = peers.hosts().len() <= 1;
        let share = bytes / n.max(1);
        if bytes >= th.large_bytes && share >= th.ring_min_share && (n > 2 || root == Root::Any) {
            Strategy::Ring
        } else if !one_host {
            Strategy::BinaryTreeStar
        } else if root == Root::Any {
            Strategy::RecursiveDoubling
        } else if n <= 4 {
            Strategy::Star
        } else {
            Strategy::BinaryTree
        }
    }

    /// Generates the topology for an op of `bytes` bytes (the size only
    /// matters to `AUTO`), with the default thresholds.
    ///
    /// Panics if `root` is not a rank of `peers` (callers validate roots).
    pub fn resolve(self, peers: &PeerList, root: Root, bytes: usize) -> Topology {
        self.resolve_with(peers, root, bytes, &AutoThresholds::default())
    }

    /// Generates the topology for an op of `bytes` bytes; `AUTO` chooses
    /// with `th`. Deterministic: every worker that calls this with the
    /// same arguments gets the same graphs and digest.
    ///
    /// Panics if `root` is not a rank of `peers` (callers validate roots).
    pub fn resolve_with(
        self,
        peers: &PeerList,
        root: Root,
        bytes: usize,
        th: &AutoThresholds,
    ) -> Topology {
        let n = peers.len();
        if let Root::At(r) = root {
            assert!(r.idx() < n, "root {r} outside a cluster of {n}");
        }
        let s = match self {
            Strategy::Auto => Strategy::auto_choice_with(peers, root, bytes, th),
            s => s,
        };
        let r0 = Rank(0);
        let pair = |g: fn(&PeerList, Rank) -> Graph, root: Rank| {
            GraphPair::from_reduce(root, g(peers, root))
        };
        let shape = match (s, root) {
            (Strategy::Star, Root::Any) => Shape::Trees(vec![pair(star, r0)]),
            (Strategy::Star | Strategy::Clique, Root::At(r)) => Shape::Trees(vec![pair(star, r)]),
            (Strategy::Ring, Root::Any) => Shape::Ring(ring_order(peers)),
            (Strategy::Ring, Root::At(r)) => Shape::Trees(vec![pair(chain, r)]),
            (Strategy::Tree, Root::Any) => Shape::Trees(vec![pair(binomial, r0)]),
            (Strategy::Tree, Root::At(r)) => Shape::Trees(vec![pair(binomial, r)]),
            (Strategy::BinaryTree, Root::Any) => Shape::Trees(vec![pair(binary, r0)]),
            (Strategy::BinaryTree, Root::At(r)) => Shape::Trees(vec![pair(binary, r)]),
            (Strategy::BinaryTreeStar, Root::Any) => Shape::Trees(vec![pair(binary_tree_star, r0)]),
            (Strategy::BinaryTreeStar | Strategy::MultiBinaryTreeStar, Root::At(r)) => {
                Shape::Trees(vec![pair(binary_tree_star, r)])
            }
            (Strategy::MultiBinaryTreeStar, Root::Any) => {
                let roots: Vec<Rank> = if peers.hosts().len() > 1 {
                    peers.hosts().iter().map(|h| h[0]).collect()
                } else {
                    peers.ranks().collect()
                };
                Shape::Trees(
                    roots
                        .into_iter()
                        .map(|r| pair(binary_tree_star, r))
                        .collect(),
                )
            }
            (Strategy::RecursiveDoubling, Root::Any) => Shape::Butterfly(ring_order(peers)),
            (Strategy::RecursiveDoubling, Root::At(r)) if n <= 4 => {
                Shape::Trees(vec![pair(star, r)])
            }
            (Strategy::RecursiveDoubling, Root::At(r)) => Shape::Trees(vec![pair(binomial, r)]),
            (Strategy::Clique, Root::Any) => {
                Shape::Trees(peers.ranks().map(|r| pair(star, r)).collect())
            }
            (Strategy::Auto, _) => unreachable!("AUTO resolved above"),
        };
        Topology::new(s, n, shape)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Strategy {
    type Err = StrategyParseError;

    /// Accepts the names of [`Strategy::name`], case-insensitively, with `-`
    /// for `_`.
    fn from_str(s: &str) -> Result<Strategy, StrategyParseError> {
        let norm = s.trim().to_ascii_uppercase().replace('-', "_");
        Strategy::ALL
            .into_iter()
            .find(|st| st.name() == norm)
            .ok_or_else(|| StrategyParseError(s.to_string()))
    }
}

/// Ranks host by host, so that a ring crosses each host boundary once.
fn ring_order(peers: &PeerList) -> Vec<Rank> {
    peers.hosts().iter().flatten().copied().collect()
}

/// All ranks, `root` first, then the rest in ascending order wrapping
/// around, so trees for different roots are rotations of each other.
fn rotated(n: usize, root: Rank) -> Vec<Rank> {
    (0..n)
        .map(|i| Rank(((root.idx() + i) % n) as u32))
        .collect()
}

/// Builds a reduce tree from `order` (order[0] is the root) and a parent
/// function on positions.
fn tree_from(n: usize, order: &[Rank], parent: impl Fn(usize) -> usize) -> Graph {
    let mut g = Graph::new(n);
    for i in 1..order.len() {
        g.add_edge(order[i], order[parent(i)]);
    }
    g
}

fn star(peers: &PeerList, root: Rank) -> Graph {
    tree_from(peers.len(), &rotated(peers.len(), root), |_| 0)
}

fn chain(peers: &PeerList, root: Rank) -> Graph {
    let mut order = ring_order(peers);
    let at = order.iter().position(|&r| r == root).expect("root in ring");
    order.rotate_left(at);
    tree_from(peers.len(), &order, |i| i - 1)
}

/// Binomial tree: position `i` hangs under `i` with its lowest set bit
/// cleared, so the root has children 1, 2, 4, ... and depth is log2(n).
fn binomial(peers: &PeerList, root: Rank) -> Graph {
    tree_from(peers.len(), &rotated(peers.len(), root), |i| i & (i - 1))
}

fn binary(peers: &PeerList, root: Rank) -> Graph {
    tree_from(peers.len(), &rotated(peers.len(), root), |i| (i - 1) / 2)
}

/// A star inside each host around its master (the root on the root's host,
/// the lowest rank elsewhere), and a binary tree across the masters.
fn binary_tree_star(peers: &PeerList, root: Rank) -> Graph {
    let n = peers.len();
    let root_host = peers.host_of(root);
    let mut g = Graph::new(n);
    let mut masters = vec![root];
    for (h, ranks) in peers.hosts().iter().enumerate() {
        let master = if h == root_host { root } else { ranks[0] };
        if h != root_host {
            masters.push(master);
        }
        for &r in ranks {
            if r != master {
                g.add_edge(r, master);
            }
        }
    }
    for i in 1..masters.len() {
        g.add_edge(masters[i], masters[(i - 1) / 2]);
    }
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layouts() -> Vec<PeerList> {
        let mut v: Vec<PeerList> = (1..=17).map(PeerList::local).collect();
        v.push(PeerList::with_hosts(&[2, 2]));
        v.push(PeerList::with_hosts(&[3, 1, 4]));
        v.push(PeerList::with_hosts(&[1, 1, 1, 1, 1]));
        v.push("b:1,a:1,b:2,a:2,c:1".parse().unwrap());
        v
    }

    #[test]
    fn every_strategy_is_valid_everywhere() {
        for peers in layouts() {
            for s in Strategy::ALL {
                for bytes in [0, AUTO_LARGE_BYTES] {
                    let t = s.resolve(&peers, Root::Any, bytes);
                    t.validate()
                        .unwrap_or_else(|e| panic!("{s} n={} : {e}", peers.len()));
                    for r in peers.ranks() {
                        let t = s.resolve(&peers, Root::At(r), bytes);
                        t.validate().unwrap_or_else(|e| panic!("{s} root {r}: {e}"));
                        match t.shape() {
                            Shape::Trees(p) => {
                                assert_eq!(p.len(), 1);
                                assert_eq!(p[0].root, r);
                            }
                            Shape::Ring(_) | Shape::Butterfly(_) => panic!("rooted ring"),
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ring_is_a_real_ring() {
        let t = Strategy::Ring.resolve(&PeerList::local(5), Root::Any, 0);
        assert_eq!(t.shape(), &Shape::Ring((0..5).map(Rank).collect()));
        let t = Strategy::Ring.resolve(&"b:1,a:1,b:2".parse().unwrap(), Root::Any, 0);
        assert_eq!(t.shape(), &Shape::Ring(vec![Rank(0), Rank(2), Rank(1)]));
    }

    #[test]
    fn binary_tree_star_crosses_hosts_only_between_masters() {
        let peers = PeerList::with_hosts(&[3, 3, 3]);
        let t = Strategy::BinaryTreeStar.resolve(&peers, Root::At(Rank(4)), 0);
        let Shape::Trees(p) = t.shape() else { panic!() };
        let g = &p[0].reduce;
        for r in peers.ranks() {
            for &next in g.nexts(r) {
                if peers.host_of(next) != peers.host_of(r) {
                    // only masters talk across hosts
                    assert!(r == Rank(0) || r == Rank(6), "{r} -> {next}");
                    assert_eq!(next, Rank(4));
                }
            }
        }
    }

    #[test]
    fn multi_and_clique_spread_roots() {
        let peers = PeerList::with_hosts(&[2, 2, 2]);
        let t = Strategy::MultiBinaryTreeStar.resolve(&peers, Root::Any, 0);
        let Shape::Trees(p) = t.shape() else { panic!() };
        let roots: Vec<Rank> = p.iter().map(|p| p.root).collect();
        assert_eq!(roots, vec![Rank(0), Rank(2), Rank(4)]);
        let t = Strategy::Clique.resolve(&peers, Root::Any, 0);
        let Shape::Trees(p) = t.shape() else { panic!() };
        assert_eq!(p.len(), 6);
    }

    #[test]
    fn auto_depends_on_size_and_layout() {
        let one = PeerList::local(8);
        let two = PeerList::with_hosts(&[4, 4]);
        assert_eq!(
            Strategy::Auto.resolve(&one, Root::Any, 10).strategy(),
            Strategy::RecursiveDoubling
        );
        assert_eq!(
            Strategy::Auto
                .resolve(&one, Root::At(Rank(3)), 10)
                .strategy(),
            Strategy::BinaryTree
        );
        let pair = PeerList::local(2);
        assert_eq!(
            Strategy::Auto.resolve(&pair, Root::Any, 1 << 30).strategy(),
            Strategy::Ring
        );
        // at scale, a share of 1 KiB is too small for a ring: a tree of
        // stars across hosts, as kungfu-sim found faster
        let big = PeerList::with_hosts(&[8; 128]);
        assert_eq!(
            Strategy::auto_choice(&big, 1 << 20),
            Strategy::BinaryTreeStar
        );
        assert_eq!(Strategy::auto_choice(&big, 2 << 20), Strategy::Ring);
        assert_eq!(Strategy::auto_choice(&two, 1 << 20), Strategy::Ring);
        let th = AutoThresholds {
            large_bytes: 100,
            ring_min_share: 0,
        };
        let at = |p: &PeerList, b| Strategy::Auto.resolve_with(p, Root::Any, b, &th).strategy();
        assert_eq!(at(&pair, 99), Strategy::RecursiveDoubling);
        assert_eq!(at(&pair, 100), Strategy::Ring);
        assert_eq!(at(&one, 99), Strategy::RecursiveDoubling);
        assert_eq!(at(&one, 100), Strategy::Ring);
        assert_eq!(
            Strategy::Auto.resolve(&two, Root::Any, 10).strategy(),
            Strategy::BinaryTreeStar
        );
        assert_eq!(
            Strategy::Auto.resolve(&one, Root::Any, 1 << 20).strategy(),
            Strategy::Ring
        );
        assert_eq!(
            Strategy::Auto.resolve(&one, Root::Any, 1 << 20).digest(),
            Strategy::Ring.resolve(&one, Root::Any, 0).digest()
        );
    }

    #[test]
    fn digests_differ_between_strategies_and_roots() {
        // Two hosts, so that BINARY_TREE_STAR is not just a star.
        let peers = PeerList::with_hosts(&[3, 3]);
        let mut seen = std::collections::HashSet::new();
        for s in &Strategy::ALL[..8] {
            assert!(seen.insert(s.resolve(&peers, Root::Any, 0).digest()), "{s}");
        }
        let a = Strategy::Tree
            .resolve(&peers, Root::At(Rank(1)), 0)
            .digest();
        let b = Strategy::Tree
            .resolve(&peers, Root::At(Rank(2)), 0)
            .digest();
        assert_ne!(a, b);
    }

    #[test]
    fn names_round_trip() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>(), Ok(s));
        }
        assert_eq!("binary-tree-star".parse(), Ok(Strategy::BinaryTreeStar));
        assert!("HYPERCUBE".parse::<Strategy>().is_err());
    }
}
