//! The crate's error, [`BootstrapError`]: why a worker could not start,
//! and why a resize, a state sync or a recovery failed.

use kungfu_collectives::CollectiveError;
use kungfu_transport::any::TransportKind;
use kungfu_transport::TransportError;

/// Why a worker could not start.
#[derive(Debug, thiserror::Error)]
pub enum BootstrapError {
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("rendezvous at {addr}: {reason}")]
    Rendezvous { addr: String, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("transport {0} is not available (this build has: {avail})", avail = TransportKind::available())]
    UnsupportedTransport(TransportKind),
    #[error("connecting to the peers: {0}")]
    Transport(#[from] TransportError),
    #[error("starting the session: {0}")]
    Session(#[from] CollectiveError),
    #[error("resizing: {0}")]
    Elastic(String),
    /// A collective of a resize or of [`Worker::sync_state`] failed, as
    /// any op may: after [`CollectiveError::PeerLost`] the session is as
    /// usable as after a failed op of the application's, and
    /// [`Worker::recover`] goes on without the lost worker.
    ///
    /// [`Worker::sync_state`]: crate::Worker::sync_state
    /// [`Worker::recover`]: crate::Worker::recover
    #[error("resizing: {0}")]
    Op(#[source] CollectiveError),
    /// The cluster went on at `version` without this worker (a recovery
    /// declared it lost): it should exit. Its session is closed.
    #[error("left out of the cluster at version {version}: {reason}")]
    Excluded { version: u32, reason: String },
}
