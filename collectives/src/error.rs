//! Errors of the collectives layer.

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::Rank;
use kungfu_transport::{Epoch, TransportError};

/// Why an op failed.
///
/// What stays usable after each:
/// - `InvalidArgument`, `NameCollision`: nothing was started; the session is
///   fine.
/// - `Mismatch`, `Protocol`, `Timeout`, `Aborted`: this op is failed; the
///   rank that noticed first tells all others (they report `Aborted`, or
///   `Mismatch` naming the disagreeing ranks); the session stays usable for
///   other ops.
/// - `PeerLost`: every op that needs that peer fails, now and later; ops
///   among the remaining peers still work. Without elastic recovery the
///   job should stop.
/// - `Closed`: the session is shut down.
#[derive(Clone, Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("op {name:?}: invalid argument: {reason}")]
    InvalidArgument { name: Arc<str>, reason: String },

    #[error(
        "op name {name:?} has the same 64-bit id {id:016x} as the live op {other:?}; rename one"
    )]
    NameCollision {
        name: Arc<str>,
        other: Arc<str>,
        id: u64,
    },

    #[error("op {name:?} ({epoch}): ranks {} disagree: {detail}", fmt_ranks(ranks))]
    Mismatch {
        name: Arc<str>,
        epoch: Epoch,
        /// The ranks whose specs differ (the detector first).
        ranks: Vec<Rank>,
        detail: String,
    },

    #[error("op {name:?} ({epoch}) needs {peer}")]
    PeerLost {
        name: Arc<str>,
        epoch: Epoch,
        peer: Rank,
        #[source]
        source: TransportError,
    },

    #[error(
        "op {name:?} ({epoch}): no progress for {after:?}; still waiting for ranks {}",
        fmt_ranks(waiting)
    )]
    Timeout {
        name: Arc<str>,
        epoch: Epoch,
        after: Duration,
        waiting: Vec<Rank>,
    },

    #[error("op {name:?} ({epoch}): protocol violation by {peer}: {reason}")]
    Protocol {
        name: Arc<str>,
        epoch: Epoch,
        peer: Rank,
        reason: String,
    },

    #[error("op {name:?} ({epoch}): transport failed")]
    Transport {
        name: Arc<str>,
        epoch: Epoch,
        #[source]
        source: TransportError,
    },

    #[error("op {name:?} ({epoch}): aborted by {by}: {reason}")]
    Aborted {
        name: Arc<str>,
        epoch: Epoch,
        /// The rank that failed the op first and told the others.
        by: Rank,
        reason: String,
    },

    #[error("the session is shut down")]
    Closed,
}

fn fmt_ranks(r: &[Rank]) -> String {
    let v: Vec<String> = r.iter().map(|r| r.0.to_string()).collect();
    format!("[{}]", v.join(", "))
}

impl CollectiveError {
    /// The op's name, where the error concerns one op.
    pub fn op_name(&self) -> Option<&str> {
        match self {
            CollectiveError::InvalidArgument { name, .. }
            | CollectiveError::NameCollision { name, .. }
            | CollectiveError::Mismatch { name, .. }
            | CollectiveError::PeerLost { name, .. }
            | CollectiveError::Timeout { name, .. }
            | CollectiveError::Protocol { name, .. }
            | CollectiveError::Transport { name, .. }
            | CollectiveError::Aborted { name, .. } => Some(name),
            CollectiveError::Closed => None,
        }
    }
}
