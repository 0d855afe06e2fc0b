//! Sans-IO plans: what one rank does for one op.
//!
//! A plan is a small dependency graph of *actions* over byte ranges of the
//! op's working buffer: `Send { to, chunk, step, range }` and
//! `Recv { from, chunk, step, range, reduce|copy }`. An action becomes ready
//! when the actions it depends on are complete. The plan owns no buffer and
//! does no IO: the driver asks [`Plan::poll_transmit`] what to send, reports
//! with [`Plan::handle_sent`] when the bytes are taken, and feeds arriving
//! frames to [`Plan::handle_frame`], passing the working buffer each time.
//!
//! Frames may arrive in any order, also ahead of the actions they feed (a
//! ring neighbour can be a few steps ahead); such a frame is held (by
//! reference, no copy) until its dependencies complete. Each `(peer, chunk,
//! step)` is expected exactly once; anything else is a protocol error, so
//! memory per op is bounded by the op's own size.
//!
//! Every algorithm is a generator of these graphs ([`build`]), so one
//! engine runs all of them, in the real scheduler and in the deterministic
//! simulation alike.
//!
//! This file holds the types a plan speaks in; `graph.rs` builds the
//! graph ([`PlanBuilder`], [`PlanGraph`]), `run.rs` runs it ([`Plan`]).

use std::ops::Range;
use std::sync::Arc;

use kungfu_topology::Rank;

use crate::dtype::Order;

pub mod build;
mod chunk;
mod graph;
mod run;
#[cfg(test)]
mod tests;

pub use chunk::{chunks, segment};
pub use graph::{PlanBuilder, PlanGraph};
pub use run::Plan;

/// The op's working memory, as a plan writes it: one range at a time.
///
/// A plain slice for tests and the simulation; a
/// [`Region`](kungfu_transport::Region) when ranges of it may be lent to
/// wires (a posted receive holds its range until the frame lands, so the
/// plan may not write it meanwhile: such a write is refused, never racy).
pub trait Work {
    /// Runs `f` on `range`, writable; false (and `f` not run) if the range
    /// is lent out.
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool;
}

impl Work for [u8] {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        f(&mut self[range]);
        true
    }
}

impl Work for Vec<u8> {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        self.as_mut_slice().write(range, f)
    }
}

impl Work for Arc<kungfu_transport::Region> {
    fn write(&mut self, range: Range<usize>, f: &mut dyn FnMut(&mut [u8])) -> bool {
        match kungfu_transport::Region::write(self, range) {
            Ok(mut m) => {
                f(m.as_mut_slice());
                true
            }
            Err(_) => false,
        }
    }
}

/// Identifies an action of a plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ActionId(u32);

#[derive(Clone, Debug)]
enum Action {
    Send {
        to: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
    },
    Recv {
        from: Rank,
        chunk: u32,
        step: u16,
        range: Range<usize>,
        /// Reduce in this operand order, or (None) overwrite.
        reduce: Option<Order>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Waiting,
    /// A receive whose frame is here but whose dependencies are not done.
    Arrived,
    /// A send handed out by `poll_transmit`, not yet reported sent.
    InFlight,
    Done,
}

/// A frame the driver must send: the bytes of `range` of the working
/// buffer, to `to`, tagged `(chunk, step)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transmit {
    pub id: ActionId,
    pub to: Rank,
    pub chunk: u32,
    pub step: u16,
    pub range: Range<usize>,
}

/// A frame the plan cannot accept. Each is a protocol error of the sender.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("unexpected frame (chunk {chunk}, step {step}) from {from}")]
    Unexpected { from: Rank, chunk: u32, step: u16 },
    #[error("duplicate frame (chunk {chunk}, step {step}) from {from}")]
    Duplicate { from: Rank, chunk: u32, step: u16 },
    #[error("internal error: range {range:?} of the working buffer is lent out")]
    Busy { range: Range<usize> },
    #[error("frame (chunk {chunk}, step {step}) from {from} has {got} bytes, expected {want}")]
    Length {
        from: Rank,
        chunk: u32,
        step: u16,
        got: usize,
        want: usize,
    },
}

/// A receive the driver may post: see [`Plan::poll_recv`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvReady {
    pub from: Rank,
    pub chunk: u32,
    pub step: u16,
    pub range: Range<usize>,
    /// It reduces into `range` (post it into scratch memory, if at all).
    pub reduce: bool,
}
