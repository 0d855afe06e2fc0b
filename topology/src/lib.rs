//! Peer lists and communication strategies as data.
//!
//! This crate does no IO. It describes *who talks to whom*: a [`PeerList`]
//! (rank, host, port), and for each collective a [`Topology`]: either a list
//! of (reduce, broadcast) tree pairs or a ring order, with a stable
//! [`Digest`] so that workers can check that they agree.
//!
//! # Quick start
//!
//! ```
//! use kungfu_topology::{PeerList, Rank, Root, Strategy, Shape};
//!
//! let peers: PeerList = "127.0.0.1:10000,127.0.0.1:10001,127.0.0.2:10000,127.0.0.2:10001"
//!     .parse()
//!     .unwrap();
//! assert_eq!(peers.len(), 4);
//! assert_eq!(peers.local_rank(Rank(3)), 1);
//!
//! // Every strategy is a generator: the same inputs give the same graphs and digest.
//! let topo = Strategy::BinaryTreeStar.resolve(&peers, Root::Any, 1 << 20);
//! topo.validate().unwrap();
//! match topo.shape() {
//!     Shape::Trees(pairs) => assert_eq!(pairs.len(), 1),
//!     Shape::Ring(_) | Shape::Butterfly(_) => unreachable!(),
//! }
//! let again = Strategy::BinaryTreeStar.resolve(&peers, Root::Any, 1 << 20);
//! assert_eq!(topo.digest(), again.digest());
//! ```
//!
//! # Strategies
//!
//! | name | unrooted ops (allreduce, allgather, ...) | rooted ops (reduce, broadcast, gather) |
//! |---|---|---|
//! | `STAR` | one star around rank 0 | a star around the root |
//! | `RING` | a ring: reduce-scatter then allgather | a chain from the root along the ring order |
//! | `TREE` | a binomial tree from rank 0 | a binomial tree from the root |
//! | `BINARY_TREE` | a binary tree from rank 0 | a binary tree from the root |
//! | `BINARY_TREE_STAR` | star inside each host, binary tree across host masters | the same, rooted at the root |
//! | `MULTI_BINARY_TREE_STAR` | one `BINARY_TREE_STAR` per host master (chunks rotate over them) | `BINARY_TREE_STAR` from the root |
//! | `CLIQUE` | one star per rank (chunks rotate, so every rank reduces a share) | a star around the root |
//! | `RECURSIVE_DOUBLING` | `log2 n` pairwise exchanges (extra ranks fold in first, get the result last) | a star up to 4 ranks, a binomial tree beyond |
//! | `AUTO` | chosen from the host layout and the message size ([`AutoThresholds`]) | likewise |

mod digest;
mod graph;
mod peers;
mod strategy;

pub use digest::{fnv1a64, Digest};
pub use graph::{Graph, GraphPair, TopologyError};
pub use peers::{Peer, PeerList, PeerListError, Rank};
pub use strategy::{
    AutoThresholds, Root, Shape, Strategy, StrategyParseError, Topology, AUTO_LARGE_BYTES,
    AUTO_RING_MIN_SHARE,
};
