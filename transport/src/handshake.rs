//! The handshake every wire opens a link with: one place for the rules of
//! who may talk to whom, so that hardening it (authentication, issue 14)
//! happens once.
//!
//! The dialer sends a hello (cluster id, cluster version, epoch, both
//! ranks, the digest of the peer list); the answerer checks it against
//! its own [`Identity`] and answers with a status. A mismatch is refused on
//! both sides with an error that says what differs (a cluster version and
//! an epoch apart). The first [`PREFIX_LEN`] bytes (magic, hello version,
//! kind) are read and checked before the rest, so a peer that speaks
//! another hello version (of another length) is answered at once instead of
//! waiting for bytes that never come.
//!
//! [`dial`] and [`answer`] run over any byte stream (a TCP socket; a QUIC
//! stream); [`check`] is the rule alone, for links whose first bytes are
//! not a stream (a shared-memory ring's identity block).

use kungfu_topology::Rank;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::{ClusterVersion, Epoch};

const HELLO_MAGIC: [u8; 2] = *b"KH";
/// 2: the hello and the answer carry the cluster version beside the epoch.
const HELLO_VERSION: u8 = 2;
const HELLO_LEN: usize = 40;
const ACK_LEN: usize = 32;
/// Magic, hello version and kind: read and checked before the rest.
pub const PREFIX_LEN: usize = 4;
const KIND_HELLO: u8 = 1;
const KIND_ACK: u8 = 2;

/// Who an endpoint is: what a peer's hello must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
}

impl Hello {
    /// The hello of `me` to `to`.
    pub fn of(me: &Identity, to: Rank) -> Hello {
        Hello {
            from: me.rank,
            to,
            version: me.version,
            epoch: me.epoch,
            cluster_id: me.cluster_id,
            peers_digest: me.peers_digest,
        }
    }

    /// Layout (little-endian): magic "KH", hello version, kind 1, from (4),
    /// to (4), epoch (4), cluster id (8), peer list digest (8), cluster
    /// version (8). Version 1 was the first 32 bytes of this.
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
            _ => return None,
        })
    }
}

/// The answer: the verdict and who answered.
struct Ack {
    status: Status,
    version: ClusterVersion,
    epoch: Epoch,
    rank: Rank,
    cluster_id: u64,
}

impl Ack {
    fn of(me: &Identity, status: Status) -> Ack {
        Ack {
            status,
            version: me.version,
            epoch: me.epoch,
            rank: me.rank,
            cluster_id: me.cluster_id,
        }
    }

    /// Layout: magic "KH", hello version, kind 2, status (1), 3 bytes of
    /// zero, epoch (4), rank (4), cluster id (8), cluster version (8).
    fn encode(&self) -> [u8; ACK_LEN] {
        let mut b = [0u8; ACK_LEN];
        b[0..2].copy_from_slice(&HELLO_MAGIC);
        b[2] = HELLO_VERSION;
        b[3] = KIND_ACK;
        b[4] = self.status as u8;
        b[8..12].copy_from_slice(&self.epoch.0.to_le_bytes());
        b[12..16].copy_from_slice(&self.rank.0.to_le_bytes());
        b[16..24].copy_from_slice(&self.cluster_id.to_le_bytes());
        b[24..32].copy_from_slice(&self.version.0.to_le_bytes());
        b
    }

    fn decode(b: &[u8; ACK_LEN]) -> Option<Ack> {
        check_prefix(b, KIND_ACK, "answer").ok()?;
        Some(Ack {
            status: Status::from_u8(b[4])?,
            epoch: Epoch(u32::from_le_bytes(b[8..12].try_into().ok()?)),
            rank: Rank(u32::from_le_bytes(b[12..16].try_into().ok()?)),
            cluster_id: u64::from_le_bytes(b[16..24].try_into().ok()?),
            version: ClusterVersion(u64::from_le_bytes(b[24..32].try_into().ok()?)),
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

/// The dialer's side: says hello to `to` and reads its answer.
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
    s.write_all(&Hello::of(me, to).encode())
        .await
        .map_err(|e| link("send hello", e))?;
    let mut b = [0u8; ACK_LEN];
    s.read_exact(&mut b[..PREFIX_LEN])
        .await
        .map_err(|e| link("read answer", e))?;
    check_prefix(&b, KIND_ACK, "answer to hello").map_err(refused)?;
    s.read_exact(&mut b[PREFIX_LEN..])
        .await
        .map_err(|e| link("read answer", e))?;
    let ack = Ack::decode(&b).ok_or_else(|| refused("malformed answer to hello".into()))?;
    if ack.status != Status::Ok {
        return Err(refused(refusal_text(&ack, me)));
    }
    Ok(())
}

/// The answerer's side: reads a hello, checks it ([`check`]) and answers;
/// the dialer's rank if accepted. A refusal is answered (best effort) and
/// returned as this side's error.
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
        .and_then(|h| check(me, &h, may_dial).map(|()| h));
    match verdict {
        Ok(h) => {
            s.write_all(&Ack::of(me, Status::Ok).encode())
                .await
                .map_err(|e| format!("send answer: {e}"))?;
            Ok(h.from)
        }
        Err((status, why)) => {
            // Best effort: the refusal is reported here either way.
            let _ = s.write_all(&Ack::of(me, status).encode()).await;
            Err(why)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Identity {
        Identity {
            cluster_id: 0xfeed,
            version: ClusterVersion(5),
            epoch: Epoch(2),
            rank: Rank(1),
            size: 4,
            peers_digest: 77,
        }
    }

    #[test]
    fn hello_round_trip_and_refusals() {
        let h = Hello::of(
            &Identity {
                rank: Rank(3),
                ..me()
            },
            Rank(1),
        );
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let mut bad = h.encode();
        bad[0] = 0;
        assert!(Hello::decode(&bad).is_err());
        let mut old = h.encode();
        old[2] = 1;
        assert!(Hello::decode(&old).unwrap_err().contains("hello version 1"));

        let higher = |r: Rank| r > Rank(1);
        let ok = h;
        assert_eq!(check(&me(), &ok, higher), Ok(()));
        let st = |h: Hello| check(&me(), &h, higher).unwrap_err().0;
        assert_eq!(
            st(Hello {
                cluster_id: 1,
                ..ok
            }),
            Status::Cluster
        );
        assert_eq!(
            st(Hello {
                version: ClusterVersion(4),
                ..ok
            }),
            Status::Version
        );
        assert_eq!(
            st(Hello {
                epoch: Epoch(1),
                ..ok
            }),
            Status::Epoch
        );
        assert_eq!(st(Hello { to: Rank(2), ..ok }), Status::NotMe);
        assert_eq!(
            st(Hello {
                peers_digest: 0,
                ..ok
            }),
            Status::PeerList
        );
        assert_eq!(
            st(Hello {
                from: Rank(0),
                ..ok
            }),
            Status::BadRank
        );
        assert_eq!(
            st(Hello {
                from: Rank(9),
                ..ok
            }),
            Status::BadRank
        );
        assert_eq!(
            st(Hello {
                from: Rank(1),
                ..ok
            }),
            Status::BadRank,
            "a rank does not dial itself"
        );
    }

    #[test]
    fn dial_and_answer_over_a_byte_stream() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        rt.block_on(async {
            let answerer = me();
            let dialer = Identity {
                rank: Rank(2),
                ..me()
            };
            // Accepted.
            let (mut a, mut b) = tokio::io::duplex(256);
            let (d, r) = tokio::join!(
                dial(&mut a, &dialer, Rank(1)),
                answer(&mut b, &answerer, |r| r > Rank(1))
            );
            assert_eq!((d, r), (Ok(()), Ok(Rank(2))));
            // Refused on both sides, each naming what differs.
            let (mut a, mut b) = tokio::io::duplex(256);
            let other = Identity {
                version: ClusterVersion(6),
                ..dialer
            };
            let (d, r) = tokio::join!(
                dial(&mut a, &other, Rank(1)),
                answer(&mut b, &answerer, |r| r > Rank(1))
            );
            let d = d.unwrap_err();
            assert!(!d.retry, "a refusal is final");
            assert_eq!(
                d.reason,
                "refused: cluster version differs (peer at version 5, we are at version 6)"
            );
            assert!(r
                .unwrap_err()
                .contains("peer is at version 6, we are at version 5"));
            // Garbage is answered at once, not waited on.
            let (mut a, mut b) = tokio::io::duplex(256);
            a.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
            let r = answer(&mut b, &me(), |_| true).await;
            assert!(r.unwrap_err().contains("not a KungFu-rs hello"));
            let mut ack = [0u8; ACK_LEN];
            a.read_exact(&mut ack).await.unwrap();
            assert_eq!(Ack::decode(&ack).unwrap().status, Status::Malformed);
        });
    }
}
