//! The handshake every wire opens a link with: one place for the rules of
//! who may talk to whom.
//!
//! The dialer sends a hello (cluster id, cluster version, epoch, both
//! ranks, the digest of the peer list, a fresh nonce); the answerer checks
//! it against its own [`Identity`] and answers with a status. A mismatch is
//! refused on both sides with an error that says what differs (a cluster
//! version and an epoch apart). The first [`PREFIX_LEN`] bytes (magic,
//! hello version, kind) are read and checked before the rest, so a peer
//! that speaks another hello version (of another length) is answered at
//! once instead of waiting for bytes that never come.
//!
//! # Authentication
//!
//! The cluster id is sent in clear and proves nothing: it only keeps
//! honest jobs apart. Membership is proven with the job's secret
//! ([`JobSecret`], `KUNGFU_JOB_SECRET`), by a mutual challenge-response
//! in which the secret never goes on the wire:
//!
//! ```text
//! dialer -> answerer  hello    identity, flags (holds a secret), nonce_d
//! answerer -> dialer  answer   status, nonce_a, mac_a
//! dialer -> answerer  proof    mac_d                   (with a secret only)
//! answerer -> dialer  verdict  status                  (with a secret only)
//!
//! mac_a = HMAC-SHA256(secret, "kungfu handshake v3: answerer" | hello | nonce_a)
//! mac_d = HMAC-SHA256(secret, "kungfu handshake v3: dialer"   | hello | nonce_a)
//! ```
//!
//! The hello holds both ranks, the cluster id, version, epoch, peer-list
//! digest and the dialer's nonce, so each MAC binds both nonces and the
//! whole identity; the labels tell the two directions apart, so neither
//! MAC can be reflected as the other. Each side draws its nonce afresh
//! (`ring`'s system RNG), so a recorded transcript replayed to either side
//! fails: the other side's nonce is new. MACs are compared in constant
//! time. A dialer checks `mac_a` before it sends its own proof; a wrong
//! MAC either way is refused as a *bad credential*, and the refusal is
//! logged by the acceptor (`kungfu: <rank>: refused a connection from
//! <addr>: bad credential ...`) while it goes on waiting for the real
//! peer.
//!
//! Both sides must agree on having a secret: one with and one without are
//! refused (a job half started by another launcher is a configuration
//! error, not a reason to drop authentication). Without a secret on
//! either side the links are not authenticated, as before version 3:
//! launchers other than `kungfu-run` that set no `KUNGFU_JOB_SECRET`.
//!
//! What this does not do: it authenticates the link when it opens; the
//! frames that follow are neither encrypted nor MACed, so an attacker who
//! can inject into an established TCP connection (on the path, not just
//! able to reach the port) is not kept out. QUIC has mutual TLS for that.
//!
//! [`dial`] and [`answer`] run over any byte stream (a TCP socket; a QUIC
//! stream); [`check`] is the identity rule alone, for links whose first
//! bytes are not a stream (a shared-memory ring's identity block, which is
//!
//! The parts: the messages and their encodings (`messages`), and the two
//! sides of the exchange over a byte stream (`exchange`).

use kungfu_topology::Rank;

use crate::auth::JobSecret;
use crate::{ClusterVersion, Epoch};

mod exchange;
mod messages;

pub use self::exchange::{answer, dial, DialError};
pub use self::messages::{Hello, Status, ACK_LEN, HELLO_LEN, HELLO_VERSION, PREFIX_LEN};

/// Who an endpoint is: what a peer's hello must match, and the secret it
/// must prove.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Identifies the job: workers of another job are refused.
    pub cluster_id: u64,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub rank: Rank,
    /// Ranks in the cluster.
    pub size: usize,
    /// The digest of the peer list: every rank must have the same.
    pub peers_digest: u64,
    /// The job's secret, which peers must prove they hold; `None`: links
    /// are not authenticated (and peers with a secret are refused).
    pub secret: Option<JobSecret>,
}

impl Identity {
    /// Rank `rank` of the cluster `peers`, for the handshake; refused with
    /// [`crate::TransportError::NoSuchPeer`] if `peers` has no such rank.
    pub fn of(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: &kungfu_topology::PeerList,
        secret: Option<&JobSecret>,
    ) -> Result<Identity, crate::TransportError> {
        if rank.idx() >= peers.len() {
            return Err(crate::TransportError::NoSuchPeer {
                peer: rank,
                size: peers.len(),
            });
        }
        Ok(Identity {
            cluster_id,
            version,
            epoch,
            rank,
            size: peers.len(),
            peers_digest: peers.digest().0,
            secret: secret.cloned(),
        })
    }
}

/// Checks a hello against `me`; `may_dial(from)` says whether that rank
/// may open a link to this one (tcp: only higher ranks dial, and none that
/// another wire reaches). `Err` carries the status to send back and a
/// message for this side's error.
pub fn check(
    me: &Identity,
    h: &Hello,
    may_dial: impl Fn(Rank) -> bool,
) -> Result<(), (Status, String)> {
    if h.cluster_id != me.cluster_id {
        return Err((
            Status::Cluster,
            format!(
                "cluster id {:#x} differs from ours {:#x}",
                h.cluster_id, me.cluster_id
            ),
        ));
    }
    if h.version != me.version {
        return Err((
            Status::Version,
            format!(
                "cluster version differs: peer is at {}, we are at {}",
                h.version, me.version
            ),
        ));
    }
    if h.epoch != me.epoch {
        return Err((
            Status::Epoch,
            format!(
                "epoch differs: peer is at {}, we are at {} (of {})",
                h.epoch, me.epoch, me.version
            ),
        ));
    }
    if h.to != me.rank {
        return Err((
            Status::NotMe,
            format!("peer wanted {}, this is {}", h.to, me.rank),
        ));
    }
    if h.peers_digest != me.peers_digest {
        return Err((Status::PeerList, "peer lists differ".to_string()));
    }
    if h.from.idx() >= me.size || h.from == me.rank || !may_dial(h.from) {
        return Err((
            Status::BadRank,
            format!(
                "{} may not dial {} in a cluster of {}",
                h.from, me.rank, me.size
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
