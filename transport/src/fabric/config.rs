//! The settings of a fabric endpoint, and the identity they give it in
//! the handshake.

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{PeerList, Rank};

use crate::handshake::Identity;
use crate::pool::BufferPool;
use crate::{ClusterVersion, Epoch, TransportError};

/// Settings of a fabric endpoint.
#[derive(Clone)]
pub struct FabricConfig {
    pub cluster_id: u64,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub rank: Rank,
    pub peers: PeerList,
    /// The job's secret: every peer must prove it holds it (see
    /// [`crate::handshake`]); `None`: links are not authenticated.
    pub secret: Option<crate::auth::JobSecret>,
    /// The libfabric provider (`tcp;ofi_rxm`, `shm`, `verbs;ofi_rxm`,
    /// `efa`); `None`: libfabric's first choice (see `FI_PROVIDER`).
    pub provider: Option<String>,
    /// The provider's domain (for `tcp`, the network interface, e.g. `lo`);
    /// `None`: its first.
    pub domain: Option<String>,
    pub connect_timeout: Duration,
    pub max_frame: usize,
    pub mailbox_bytes: usize,
    pub pool: Option<Arc<BufferPool>>,
    /// How long the progress task keeps polling after activity before it
    /// sleeps.
    pub spin: Duration,
    /// Frames up to this size go eagerly into the wire's receive slots;
    /// larger ones only into receives posted for them. Every rank must
    /// use the same (checked at connect).
    pub eager_max: usize,
    /// Eager receive slots kept posted.
    pub eager_slots: usize,
    /// Register every buffer even where the provider does not ask for it.
    pub register_always: bool,
}

impl FabricConfig {
    /// This rank's identity, once its rank is checked against the peers.
    pub(super) fn identity_checked(&self) -> Result<Identity, TransportError> {
        Identity::of(
            self.cluster_id,
            self.version,
            self.epoch,
            self.rank,
            &self.peers,
            self.secret.as_ref(),
        )
    }

    /// Defaults: 30 s to connect, 64 MiB frames, a 256 MiB mailbox, 64 KiB
    /// eager frames into 64 slots, 50 us of polling after activity.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: PeerList,
        provider: Option<String>,
    ) -> FabricConfig {
        FabricConfig {
            cluster_id,
            version,
            epoch,
            rank,
            peers,
            secret: None,
            provider,
            domain: None,
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            pool: None,
            spin: Duration::from_micros(50),
            eager_max: 64 << 10,
            eager_slots: 64,
            register_always: false,
        }
    }

    pub(super) fn identity(&self) -> Identity {
        Identity::of(
            self.cluster_id,
            self.version,
            self.epoch,
            self.rank,
            &self.peers,
            self.secret.as_ref(),
        )
        .expect("the rank is checked at connect")
    }
}
