//! The settings of a verbs endpoint: what it is (its identity in the
//! handshake), how its core is sized ([`Layout`]), and the limits the
//! wire's encodings put on them.

use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::{PeerList, Rank};

use super::core::Layout;
use crate::handshake::Identity;
use crate::pool::BufferPool;
use crate::{ClusterVersion, Epoch};

/// Settings of a verbs endpoint.
#[derive(Clone)]
pub struct VerbsConfig {
    pub cluster_id: u64,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub rank: Rank,
    pub peers: PeerList,
    /// The job's secret: every peer must prove it holds it (see
    /// [`crate::handshake`]); `None`: links are not authenticated.
    pub secret: Option<crate::auth::JobSecret>,
    /// The RDMA device (`mlx5_0`, `rxe0`); `None`: the first.
    pub device: Option<String>,
    /// The GID index of port 1; `None`: a RoCE v2 GID (IPv4-mapped first),
    /// else 0.
    pub gid_index: Option<u8>,
    pub connect_timeout: Duration,
    pub max_frame: usize,
    pub mailbox_bytes: usize,
    pub pool: Option<Arc<BufferPool>>,
    /// How long the progress task keeps polling after activity before it
    /// sleeps on the completion channel.
    pub spin: Duration,
    /// Frames up to this size go eagerly into the receive slots; larger
    /// ones only into receives posted for them (rendezvous). Every rank
    /// must use the same (checked at connect).
    pub eager_max: usize,
    /// Receive slots kept posted per peer (of `eager_max` bytes and a
    /// header each); twice as many send slots are shared by all peers.
    pub eager_slots: usize,
}

impl VerbsConfig {
    /// Defaults: 30 s to connect, 64 MiB frames, a 256 MiB mailbox, 16 KiB
    /// eager frames into 32 slots per peer, 50 us of polling after
    /// activity.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: PeerList,
        device: Option<String>,
    ) -> VerbsConfig {
        VerbsConfig {
            cluster_id,
            version,
            epoch,
            rank,
            peers,
            secret: None,
            device,
            gid_index: None,
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            pool: None,
            spin: Duration::from_micros(50),
            eager_max: 16 << 10,
            eager_slots: 32,
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

    pub(super) fn layout(&self) -> Layout {
        Layout {
            me: self.rank,
            size: self.peers.len(),
            eager_max: self.eager_max,
            slots: self.eager_slots,
            send_slots: 2 * self.eager_slots,
            sq_depth: (2 * self.eager_slots).max(16),
            max_frame: self.max_frame,
            spin: self.spin,
        }
    }

    /// Limits the wire's encodings put on a config.
    pub(super) fn check(&self) -> Result<(), String> {
        if self.peers.len() >= 1 << 24 {
            return Err(format!("{} ranks: at most 2^24", self.peers.len()));
        }
        if self.max_frame > i32::MAX as usize {
            return Err(format!("max_frame {}: at most 2 GiB", self.max_frame));
        }
        if self.eager_max > 64 << 20 {
            return Err(format!("eager_max {}: at most 64 MiB", self.eager_max));
        }
        if self.eager_slots == 0 {
            return Err("eager_slots must be at least 1".into());
        }
        Ok(())
    }
}
