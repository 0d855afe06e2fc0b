//! Named asynchronous collectives for KungFu-rs.
//!
//! Ops carry a name; ranks may issue them in any order and many at once,
//! and they are matched by name (plus a per-name sequence number), never by
//! issue order. Each op is planned by a sans-IO state machine
//! ([`plan::Plan`]) and driven by the [`Session`] over any
//! [`kungfu_transport::Transport`].
//!
//! # Quick start
//!
//! ```
//! use kungfu_collectives::{ReduceOp, Session, SessionConfig};
//! use kungfu_topology::PeerList;
//! use kungfu_transport::mem::{MemConfig, MemNetwork};
//!
//! # tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build().unwrap().block_on(async {
//! let n = 4;
//! let handles: Vec<_> = MemNetwork::new(n, MemConfig::default())
//!     .into_iter()
//!     .map(|t| {
//!         let s = Session::new(t, PeerList::local(n), SessionConfig::default()).unwrap();
//!         let x = vec![s.rank().0 as f32 + 1.0; 3];
//!         s.allreduce("grad/fc1", &x, ReduceOp::Sum)
//!     })
//!     .collect();
//! for h in handles {
//!     assert_eq!(h.await.unwrap(), vec![10.0; 3]); // 1 + 2 + 3 + 4
//! }
//! # });
//! ```
//!
//! # Features
//!
//! - Ops: allreduce, reduce, broadcast, allgather, gather, reduce-scatter,
//!   alltoall, barrier, consensus; out of place (a new vector) or in place
//!   ([`Session::allreduce_in_place`], and the blocking helpers of
//!   [`blocking`]).
//! - Types: u8, i8, u16, i16, u32, i32, u64, i64, f16, bf16, f32, f64;
//!   reductions sum, min, max, prod, and avg for floats.
//! - Every strategy of [`kungfu_topology::Strategy`]; large ops are cut
//!   into chunks ([`SessionConfig::chunk_bytes`]) that pipeline.
//! - Small allreduces fused into one per (type, operator), as Horovod
//!   fuses small tensors: [`Session::group`] (see [`group`]).
//! - Ranks that disagree on an op's count, type, reduction or root get a
//!   [`CollectiveError::Mismatch`] naming them, on every rank.
//!
//! # Thread safety
//!
//! A [`Session`] is `Send + Sync` and cheap to clone. Ops run as tasks on
//! the tokio runtime the session was created in; results arrive through an
//! [`OpHandle`] (a `Future`, or [`OpHandle::wait`] from a plain thread) or a
//! completion callback.
//!
//! # Resource cleanup
//!
//! An op's state is freed when it completes or fails; late frames of a
//! finished op are dropped by the transport. [`Session::shutdown`] closes
//! the transport and fails whatever is in flight.

mod abort;
pub mod blocking;
mod dtype;
mod error;
mod failure;
pub mod group;
pub mod names;
pub mod op;
pub mod p2p;
pub mod plan;
mod pool;
pub mod reference;
pub mod sendrecv;
mod session;
mod spec;
pub mod timeline;

pub use dtype::{
    kernel_isa, reduce_into, reduce_into_ordered, reduce_sum_sq, reduce_sum_sq_with_isa,
    reduce_with_isa, runnable_isas, scale_down, sq_norm_bytes, sq_norm_f32, sq_norm_with_isa,
    DType, Element, KernelIsa, Order, ReduceOp, SumSquares,
};
pub use error::CollectiveError;

/// Locks `m`, also if a thread panicked holding it: the guarded tables stay
/// consistent between statements, and a panic elsewhere must not take the
/// session down with it.
pub(crate) fn lock<X>(m: &std::sync::Mutex<X>) -> std::sync::MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
pub use group::{Group, MemberCallback};
pub use session::{
    Agreement, Callback, FastLarge, OpHandle, OpOutput, OpStats, PeerStats, Session, SessionConfig,
    Stall, SwapGate, SwapTo, DEFAULT_FAST_MAX_BYTES, DEFAULT_STALL_TIMEOUT, LARGE_ALLREDUCE_FROM,
};
pub use spec::{OpKind, OpSpec};
