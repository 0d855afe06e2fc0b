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
//! sealed with the secret by `shm` itself).

use kungfu_topology::Rank;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::auth::{JobSecret, MAC_LEN, NONCE_LEN};
use crate::{ClusterVersion, Epoch};

const HELLO_MAGIC: [u8; 2] = *b"KH";
/// 2: the hello and the answer carry the cluster version beside the epoch.
/// 3: nonces, MACs and the proof and verdict of the challenge-response.
pub const HELLO_VERSION: u8 = 3;
/// Bytes of a hello.
pub const HELLO_LEN: usize = 80;
/// Bytes of an answer.
pub const ACK_LEN: usize = 96;
const PROOF_LEN: usize = 8 + MAC_LEN;
const VERDICT_LEN: usize = 8;
/// Magic, hello version and kind: read and checked before the rest.
pub const PREFIX_LEN: usize = 4;
const KIND_HELLO: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_PROOF: u8 = 3;
const KIND_VERDICT: u8 = 4;
/// The flag of a side that holds a job secret.
const FLAG_SECRET: u8 = 1;
const LABEL_ANSWERER: &[u8] = b"kungfu handshake v3: answerer";
const LABEL_DIALER: &[u8] = b"kungfu handshake v3: dialer";

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
fn check_prefix(b: &[u8], kind: u8, what: &str) -> Result<(), String> {
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
    fn from_u8(v: u8) -> Option<Status> {
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
struct Ack {
    status: Status,
    version: ClusterVersion,
    epoch: Epoch,
    rank: Rank,
    cluster_id: u64,
    /// The answerer holds a job secret.
    secret: bool,
    nonce: [u8; NONCE_LEN],
    mac: [u8; MAC_LEN],
}

impl Ack {
    fn of(me: &Identity, status: Status) -> Ack {
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
    fn encode(&self) -> [u8; ACK_LEN] {
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

    fn decode(b: &[u8; ACK_LEN]) -> Option<Ack> {
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
fn message<const N: usize>(kind: u8, body: &[u8]) -> [u8; N] {
    let mut b = [0u8; N];
    b[0..2].copy_from_slice(&HELLO_MAGIC);
    b[2] = HELLO_VERSION;
    b[3] = kind;
    b[4..4 + body.len()].copy_from_slice(body);
    b
}

/// Reads a message of `kind` of `N` bytes: its prefix first, checked.
async fn read_message<S, const N: usize>(
    s: &mut S,
    kind: u8,
    what: &str,
) -> Result<[u8; N], Refusal>
where
    S: AsyncRead + Unpin,
{
    let mut b = [0u8; N];
    s.read_exact(&mut b[..PREFIX_LEN])
        .await
        .map_err(|e| Refusal::Link(format!("read {what}: {e}")))?;
    check_prefix(&b, kind, what).map_err(Refusal::Final)?;
    s.read_exact(&mut b[PREFIX_LEN..])
        .await
        .map_err(|e| Refusal::Link(format!("read {what}: {e}")))?;
    Ok(b)
}

/// Why a step of the handshake failed.
enum Refusal {
    /// The link failed (worth another attempt).
    Link(String),
    /// The peer said something this side refuses (final).
    Final(String),
}

impl Refusal {
    fn reason(self) -> String {
        match self {
            Refusal::Link(r) | Refusal::Final(r) => r,
        }
    }
}

/// A fresh nonce, if `secret` asks for one (zeros otherwise).
fn nonce(secret: &Option<JobSecret>) -> Result<[u8; NONCE_LEN], String> {
    match secret {
        Some(_) => crate::auth::random().map_err(|e| e.to_string()),
        None => Ok([0; NONCE_LEN]),
    }
}

/// Why the presence of secrets differs, if it does: `we` and `peer` hold
/// one or not.
fn secrets_differ(we: bool, peer: bool) -> Option<&'static str> {
    match (we, peer) {
        (true, false) => {
            Some("bad credential: the peer holds no job secret (KUNGFU_JOB_SECRET), we do")
        }
        (false, true) => {
            Some("bad credential: the peer holds a job secret (KUNGFU_JOB_SECRET), we do not")
        }
        _ => None,
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

fn refusal_text(ack: &Ack, me: &Identity) -> String {
    match ack.status {
        Status::Ok => "accepted".into(),
        Status::Cluster => format!(
            "refused: cluster id differs (peer {:#x}, ours {:#x})",
            ack.cluster_id, me.cluster_id
        ),
        Status::Version => format!(
            "refused: cluster version differs (peer at {}, we are at {})",
            ack.version, me.version
        ),
        Status::Epoch => format!(
            "refused: epoch differs (peer at {}, we are at {}, both of {})",
            ack.epoch, me.epoch, me.version
        ),
        Status::NotMe => format!(
            "refused: that address is {}, not the rank we dialed",
            ack.rank
        ),
        Status::PeerList => "refused: the peer lists differ".into(),
        Status::BadRank => format!("refused: {} may not dial that peer", me.rank),
        Status::Malformed => "refused: malformed hello".into(),
        Status::Credential => match secrets_differ(me.secret.is_some(), ack.secret) {
            Some(why) => format!("refused: {why}"),
            None => {
                "refused: bad credential (the peer does not accept our proof of the job secret)"
                    .into()
            }
        },
    }
}

/// Why [`dial`] failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DialError {
    /// The link failed (worth another attempt), rather than the peer
    /// refusing (final: retrying will not change its mind).
    pub retry: bool,
    pub reason: String,
}

/// The dialer's side: says hello to `to`, reads its answer, and with a
/// secret checks the answerer's proof and gives its own.
pub async fn dial<S>(s: &mut S, me: &Identity, to: Rank) -> Result<(), DialError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let link = |what: &str, e: std::io::Error| DialError {
        retry: true,
        reason: format!("{what}: {e}"),
    };
    let refused = |reason: String| DialError {
        retry: false,
        reason,
    };
    let from_step = |r: Refusal| match r {
        Refusal::Link(reason) => DialError {
            retry: true,
            reason,
        },
        Refusal::Final(reason) => refused(reason),
    };
    let hello = Hello::of(me, to, nonce(&me.secret).map_err(refused)?).encode();
    s.write_all(&hello)
        .await
        .map_err(|e| link("send hello", e))?;
    let b: [u8; ACK_LEN] = read_message(s, KIND_ACK, "answer to hello")
        .await
        .map_err(from_step)?;
    let ack = Ack::decode(&b).ok_or_else(|| refused("malformed answer to hello".into()))?;
    if ack.status != Status::Ok {
        // A peer at an older cluster version has not moved to ours yet:
        // worth another attempt until the deadline (a replacement that
        // `kungfu-run --on-failure replace` starts as soon as a recovery
        // is decided dials survivors still connecting the version before).
        // Every other refusal is final.
        let behind = ack.status == Status::Version && ack.version < me.version;
        return Err(DialError {
            retry: behind,
            reason: refusal_text(&ack, me),
        });
    }
    let Some(secret) = &me.secret else {
        return match ack.secret {
            true => Err(refused(format!(
                "refused: {}",
                secrets_differ(false, true).unwrap_or_default()
            ))),
            false => Ok(()),
        };
    };
    if !secret.verify(LABEL_ANSWERER, &[&hello, &ack.nonce], &ack.mac) {
        // Tell the answerer why (best effort), with no MAC of ours.
        let no: [u8; PROOF_LEN] = message(KIND_PROOF, &[Status::Credential as u8]);
        let _ = s.write_all(&no).await;
        return Err(refused(
            "refused: bad credential (the peer's proof of the job secret is wrong)".into(),
        ));
    }
    let mac = secret.mac(LABEL_DIALER, &[&hello, &ack.nonce]);
    let proof: [u8; PROOF_LEN] = message(KIND_PROOF, &[&[0u8; 4][..], &mac].concat());
    s.write_all(&proof)
        .await
        .map_err(|e| link("send proof", e))?;
    let v: [u8; VERDICT_LEN] = read_message(s, KIND_VERDICT, "verdict")
        .await
        .map_err(from_step)?;
    match Status::from_u8(v[4]) {
        Some(Status::Ok) => Ok(()),
        Some(status) => Err(refused(refusal_text(&Ack { status, ..ack }, me))),
        None => Err(refused("malformed verdict".into())),
    }
}

/// The answerer's side: reads a hello, checks it ([`check`]) and answers;
/// with a secret it proves it holds the secret and checks the dialer's
/// proof. The dialer's rank if accepted. A refusal is answered (best
/// effort) and returned as this side's error.
pub async fn answer<S>(
    s: &mut S,
    me: &Identity,
    may_dial: impl Fn(Rank) -> bool,
) -> Result<Rank, String>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut b = [0u8; HELLO_LEN];
    s.read_exact(&mut b[..PREFIX_LEN])
        .await
        .map_err(|e| format!("read hello: {e}"))?;
    if let Err(why) = check_prefix(&b, KIND_HELLO, "hello") {
        // The rest may never come (another hello version is another
        // length): answer now. Best effort, as below.
        let _ = s.write_all(&Ack::of(me, Status::Malformed).encode()).await;
        return Err(why);
    }
    s.read_exact(&mut b[PREFIX_LEN..])
        .await
        .map_err(|e| format!("read hello: {e}"))?;
    let verdict = Hello::decode(&b)
        .map_err(|e| (Status::Malformed, e))
        .and_then(|h| check(me, &h, may_dial).map(|()| h))
        .and_then(|h| match secrets_differ(me.secret.is_some(), h.secret) {
            Some(why) => Err((Status::Credential, why.to_string())),
            None => Ok(h),
        });
    let h = match verdict {
        Ok(h) => h,
        Err((status, why)) => {
            // Best effort: the refusal is reported here either way.
            let _ = s.write_all(&Ack::of(me, status).encode()).await;
            return Err(why);
        }
    };
    let mut ack = Ack::of(me, Status::Ok);
    if let Some(secret) = &me.secret {
        ack.nonce = nonce(&me.secret)?;
        ack.mac = secret.mac(LABEL_ANSWERER, &[&b, &ack.nonce]);
    }
    s.write_all(&ack.encode())
        .await
        .map_err(|e| format!("send answer: {e}"))?;
    let Some(secret) = &me.secret else {
        return Ok(h.from);
    };
    let proof: [u8; PROOF_LEN] = read_message(s, KIND_PROOF, "proof").await.map_err(|r| {
        format!(
            "{} (from {}, which did not prove the job secret)",
            r.reason(),
            h.from
        )
    })?;
    if proof[4] != Status::Ok as u8 {
        return Err(format!(
            "bad credential: a dialer claiming to be {} refused our proof of the job secret (the secrets differ)",
            h.from
        ));
    }
    if !secret.verify(LABEL_DIALER, &[&b, &ack.nonce], &proof[8..]) {
        let v: [u8; VERDICT_LEN] = message(KIND_VERDICT, &[Status::Credential as u8]);
        let _ = s.write_all(&v).await;
        return Err(format!(
            "bad credential: the proof of the job secret of a dialer claiming to be {} is wrong",
            h.from
        ));
    }
    let v: [u8; VERDICT_LEN] = message(KIND_VERDICT, &[Status::Ok as u8]);
    s.write_all(&v)
        .await
        .map_err(|e| format!("send verdict: {e}"))?;
    Ok(h.from)
}

#[cfg(test)]
mod tests;
