//! The messages of the handshake and their encodings: the dialer's hello,
//! the answerer's answer (status, nonce, MAC), and the proof and verdict
//! of the challenge-response; each begins with the same [`PREFIX_LEN`]
//! bytes (magic, hello version, kind), checked before the rest.

use kungfu_topology::Rank;

use super::Identity;
use crate::auth::{MAC_LEN, NONCE_LEN};
use crate::{ClusterVersion, Epoch};

const HELLO_MAGIC: [u8; 2] = *b"KH";
/// 2: the hello and the answer carry the cluster version beside the epoch.
/// 3: nonces, MACs and the proof and verdict of the challenge-response.
pub const HELLO_VERSION: u8 = 3;
/// Bytes of a hello.
pub const HELLO_LEN: usize = 80;
/// Bytes of an answer.
pub const ACK_LEN: usize = 96;
pub(super) const PROOF_LEN: usize = 8 + MAC_LEN;
pub(super) const VERDICT_LEN: usize = 8;
/// Magic, hello version and kind: read and checked before the rest.
pub const PREFIX_LEN: usize = 4;
pub(super) const KIND_HELLO: u8 = 1;
pub(super) const KIND_ACK: u8 = 2;
pub(super) const KIND_PROOF: u8 = 3;
pub(super) const KIND_VERDICT: u8 = 4;
/// The flag of a side that holds a job secret.
const FLAG_SECRET: u8 = 1;

/// What a dialer says first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    pub from: Rank,
    pub to: Rank,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub cluster_id: u64,
    pub peers_digest: u64,
    /// The dialer holds a job secret.
    pub secret: bool,
    /// The dialer's fresh nonce (zeros without a secret).
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    /// The hello of `me` to `to`, with `nonce`.
    pub fn of(me: &Identity, to: Rank, nonce: [u8; NONCE_LEN]) -> Hello {
        Hello {
            from: me.rank,
            to,
            version: me.version,
            epoch: me.epoch,
            cluster_id: me.cluster_id,
            peers_digest: me.peers_digest,
            secret: me.secret.is_some(),
            nonce,
        }
    }

    /// Layout (little-endian): magic "KH", hello version, kind 1, from (4),
    /// to (4), epoch (4), cluster id (8), peer list digest (8), cluster
    /// version (8), flags (1; bit 0: holds a secret), 7 bytes of zero,
    /// nonce (32). Version 1 was the first 32 bytes of this, version 2 the
    /// first 40.
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..2].copy_from_slice(&HELLO_MAGIC);
        b[2] = HELLO_VERSION;
        b[3] = KIND_HELLO;
        b[4..8].copy_from_slice(&self.from.0.to_le_bytes());
        b[8..12].copy_from_slice(&self.to.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.epoch.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.cluster_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.peers_digest.to_le_bytes());
        b[32..40].copy_from_slice(&self.version.0.to_le_bytes());
        b[40] = if self.secret { FLAG_SECRET } else { 0 };
        b[48..80].copy_from_slice(&self.nonce);
        b
    }

    pub fn decode(b: &[u8; HELLO_LEN]) -> Result<Hello, String> {
        check_prefix(b, KIND_HELLO, "hello")?;
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        Ok(Hello {
            from: Rank(u32_at(4)),
            to: Rank(u32_at(8)),
            epoch: Epoch(u32_at(12)),
            cluster_id: u64_at(16),
            peers_digest: u64_at(24),
            version: ClusterVersion(u64_at(32)),
            secret: b[40] & FLAG_SECRET != 0,
            nonce: b[48..80].try_into().expect("32 bytes"),
        })
    }
}

/// Checks the first [`PREFIX_LEN`] bytes of a hello (`kind` 1) or an
/// answer (`kind` 2).
pub(super) fn check_prefix(b: &[u8], kind: u8, what: &str) -> Result<(), String> {
    if b[0..2] != HELLO_MAGIC || b[3] != kind {
        return Err(format!(
            "not a KungFu-rs {what} (first bytes {:02x?})",
            &b[0..PREFIX_LEN]
        ));
    }
    if b[2] != HELLO_VERSION {
        return Err(format!(
            "hello version {} (this build speaks {HELLO_VERSION})",
            b[2]
        ));
    }
    Ok(())
}

/// The answerer's verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    Cluster = 1,
    Epoch = 2,
    NotMe = 3,
    PeerList = 4,
    BadRank = 5,
    Malformed = 6,
    /// Another cluster version (a code of its own, so that the refusal
    /// says which of version and epoch differs).
    Version = 7,
    /// A bad credential: a wrong proof of the job secret, or one side
    /// with a secret and the other without.
    Credential = 8,
}

impl Status {
    pub(super) fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::Cluster,
            2 => Status::Epoch,
            3 => Status::NotMe,
            4 => Status::PeerList,
            5 => Status::BadRank,
            6 => Status::Malformed,
            7 => Status::Version,
            8 => Status::Credential,
            _ => return None,
        })
    }
}

/// The answer: the verdict, who answered, and its half of the
/// challenge-response.
pub(super) struct Ack {
    pub(super) status: Status,
    pub(super) version: ClusterVersion,
    pub(super) epoch: Epoch,
    pub(super) rank: Rank,
    pub(super) cluster_id: u64,
    /// The answerer holds a job secret.
    pub(super) secret: bool,
    pub(super) nonce: [u8; NONCE_LEN],
    pub(super) mac: [u8; MAC_LEN],
}

impl Ack {
    pub(super) fn of(me: &Identity, status: Status) -> Ack {
        Ack {
            status,
            version: me.version,
            epoch: me.epoch,
            rank: me.rank,
            cluster_id: me.cluster_id,
            secret: me.secret.is_some(),
            nonce: [0; NONCE_LEN],
            mac: [0; MAC_LEN],
        }
    }

    /// Layout: magic "KH", hello version, kind 2, status (1), flags (1;
    /// bit 0: holds a secret), 2 bytes of zero, epoch (4), rank (4),
    /// cluster id (8), cluster version (8), nonce (32), MAC (32).
    pub(super) fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0..2].copy_from_slice(&HELLO_MAGIC);
        b[2] = HELLO_VERSION;
        b[3] = KIND_ACK;
        b[4] = self.status as u8;
        b[5] = if self.secret { FLAG_SECRET } else { 0 };
        b[8..12].copy_from_slice(&self.epoch.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.rank.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.cluster_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.version.0.to_le_bytes());
        b[32..64].copy_from_slice(&self.nonce);
        b[64..96].copy_from_slice(&self.mac);
        b
    }

    pub(super) fn decode(b: &[u8; ACK_LEN]) -> Option<Ack> {
        check_prefix(b, KIND_ACK, "answer").ok()?;
        Some(Ack {
            status: Status::from_u8(b[4])?,
            secret: b[5] & FLAG_SECRET != 0,
            epoch: Epoch(u32::from_le_bytes(b[8..12].try_into().ok()?)),
            rank: Rank(u32::from_le_bytes(b[12..16].try_into().ok()?)),
            cluster_id: u64::from_le_bytes(b[16..24].try_into().ok()?),
            version: ClusterVersion(u64::from_le_bytes(b[24..32].try_into().ok()?)),
            nonce: b[32..64].try_into().ok()?,
            mac: b[64..96].try_into().ok()?,
        })
    }
}

/// A message of the challenge-response: magic "KH", hello version,
/// `kind`, then `body` at offset 4.
pub(super) fn message<const N: usize>(kind: u8, body: &[u8]) -> [u8; N] {
    let mut b = [0u8; N];
    b[0..2].copy_from_slice(&HELLO_MAGIC);
    b[2] = HELLO_VERSION;
    b[3] = kind;
    b[4..4 + body.len()].copy_from_slice(body);
    b
}
