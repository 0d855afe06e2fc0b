use kungfu_topology::Rank;

use super::files::{setup, Rings};
use super::ring::{Ring, SENDER_CLOSED};
use super::ShmConfig;
use crate::TransportError;

pub struct RawPeer {
    rank: Rank,
    cap: usize,
    inbound: Rings,
    outbound: Rings,
}

impl RawPeer {
    /// Creates and maps this rank's rings, as `ShmTransport::connect`
    /// does, and starts no thread. It blocks until every peer has
    /// attached: run it beside the real endpoints' `connect`.
    pub fn connect(cfg: &ShmConfig) -> Result<RawPeer, TransportError> {
        let cap = cfg.ring_bytes.max(4096).next_power_of_two();
        let (inbound, outbound) = setup(cfg, cap)?;
        Ok(RawPeer {
            rank: cfg.rank,
            cap,
            inbound,
            outbound,
        })
    }

    pub fn rank(&self) -> Rank {
        self.rank
    }

    fn to(&self, peer: Rank) -> &Ring {
        self.outbound[peer.idx()].as_deref().expect("a peer")
    }

    fn from(&self, peer: Rank) -> &Ring {
        self.inbound[peer.idx()].as_deref().expect("a peer")
    }

    /// Data bytes of each ring.
    pub fn ring_bytes(&self) -> usize {
        self.cap
    }

    /// Appends `bytes` (anything: a frame, part of one, garbage) to the
    /// ring to `peer` and publishes them; false if they do not fit now.
    pub fn publish(&self, peer: Rank, bytes: &[&[u8]]) -> bool {
        self.to(peer).producer().try_write(bytes)
    }

    /// `(head, tail)` of the ring to `peer`.
    pub fn indices_to(&self, peer: Rank) -> (u64, u64) {
        self.to(peer).indices()
    }

    /// Overwrites the indices of the ring to `peer` (this side owns
    /// `head`; `tail` is the receiver's).
    pub fn set_indices_to(&self, peer: Rank, head: u64, tail: u64) {
        let ring = self.to(peer);
        ring.producer().set_indices(&ring.consumer(), head, tail)
    }

    /// `(head, tail)` of the ring from `peer`.
    pub fn indices_from(&self, peer: Rank) -> (u64, u64) {
        self.from(peer).indices()
    }

    /// Overwrites the indices of the ring from `peer` (this side owns
    /// `tail`; `head` is the sender's).
    pub fn set_indices_from(&self, peer: Rank, head: u64, tail: u64) {
        let ring = self.from(peer);
        ring.producer().set_indices(&ring.consumer(), head, tail)
    }

    /// Takes everything published in the ring from `peer`.
    pub fn take_from(&self, peer: Rank) -> Result<Vec<u8>, String> {
        let mut taking = self.from(peer).consumer();
        let p = taking.published()?;
        let mut out = vec![0u8; p.len()];
        if !(p.peek(0, &mut out) && p.consume(out.len())) {
            return Err("a snapshot did not hold its own length".into());
        }
        Ok(out)
    }

    /// Closes this side of the ring to `peer`, as the end of a stream.
    pub fn close_to(&self, peer: Rank) {
        self.to(peer).close(SENDER_CLOSED);
    }
}
