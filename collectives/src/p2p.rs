//! Point-to-point model exchange: every worker saves buffers under names,
//! each save a new version, and any worker can request a peer's saved
//! buffer without that peer taking part (a server task per peer answers).
//! The primitive under pair averaging (asynchronous decentralised SGD).
//!
//! On the wire, requests and replies are data frames of reserved op names
//! (with a NUL, so no caller's name collides) that include the sender's
//! rank; rank `r`'s `k`-th request to rank `p` has sequence number `k`, and
//! so has its reply. A server task per peer answers that peer's requests
//! in order. Requests do not straddle a strategy swap well: one sent at
//! the old epoch and not yet answered is dropped, and the requester times
//! out.
//!
//! ```text
//! request:  u32 name length | name | u64 version wanted (u64::MAX: latest)
//! reply:    u8 status (0 found, 1 no such name, 2 no such version)
//!           | u64 version | the saved bytes
//! ```
//! A request or reply that does not parse is answered with an error or
//! refused, never trusted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use kungfu_transport::{FrameKind, Header, Instant, OpTag, PeerSet, Transport, TransportError};

use crate::lock;
use crate::names::op_id;
use crate::Session;

const REQUEST: &str = "kf/p2p/request\0";
const REPLY: &str = "kf/p2p/reply\0";
/// The longest name accepted in a request.
const MAX_NAME: usize = 4096;
/// How often an idle server task wakes to see whether it should stop.
const IDLE_WAKE: Duration = Duration::from_millis(500);

/// Why a request failed.
#[derive(Debug, thiserror::Error)]
pub enum P2pError {
    #[error("{peer} has saved nothing under {name:?}")]
    NotSaved { name: String, peer: Rank },
    #[error("{peer} no longer has version {version} of {name:?}")]
    NoSuchVersion {
        name: String,
        peer: Rank,
        version: u64,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("request to {peer}: {source}")]
    Transport {
        peer: Rank,
        #[source]
        source: TransportError,
    },
    #[error("bad reply from {peer}: {reason}")]
    Protocol { peer: Rank, reason: String },
    /// A message's sender and receiver disagree on its length
    /// ([`crate::sendrecv`]): both ends fail.
    #[error(
        "mismatch: {from} sent {sent} bytes under tag {tag} to {to}, which expected {expected}"
    )]
    Length {
        from: Rank,
        to: Rank,
        tag: u64,
        sent: u64,
        expected: u64,
    },
    /// No message could come from `peer` any more: it is lost, or the
    /// transport closed.
    #[error("{peer} is gone: {why}")]
    Gone { peer: Rank, why: String },
    #[error("timed out: {0}")]
    Timeout(String),
}

#[derive(Default)]
struct Saved {
    /// name -> (version, bytes)
    map: HashMap<String, (u64, Bytes)>,
}

struct Inner<T: Transport> {
    session: Session<T>,
    saved: Mutex<Saved>,
    /// Requests issued to each peer so far.
    next_request: Vec<AtomicU32>,
    stop: AtomicBool,
}

/// A worker's store of saved buffers and its client for its peers'.
/// Every worker that others may request from must have one (it runs the
/// server tasks); dropping it stops them.
pub struct PeerStore<T: Transport> {
    inner: Arc<Inner<T>>,
}

impl<T: Transport> Drop for PeerStore<T> {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
    }
}

impl<T: Transport> PeerStore<T> {
    /// A store over `session`'s transport, among all of its ranks (a
    /// subgroup's session stands for its whole session here); starts a
    /// server task per peer on the current tokio runtime.
    pub fn new(session: &Session<T>) -> PeerStore<T> {
        let session = &session.whole();
        let n = session.size();
        let inner = Arc::new(Inner {
            session: session.clone(),
            saved: Mutex::new(Saved::default()),
            next_request: (0..n).map(|_| AtomicU32::new(0)).collect(),
            stop: AtomicBool::new(false),
        });
        let me = session.rank();
        for p in (0..n as u32).map(Rank).filter(|&p| p != me) {
            tokio::spawn(serve(Arc::downgrade(&inner), p));
        }
        PeerStore { inner }
    }

    /// Saves `data` under `name` as its next version (1 for the first);
    /// returns the version. Peers requesting `name` get it from now on.
    pub fn save(&self, name: &str, data: &[u8]) -> Result<u64, P2pError> {
        let max = self.inner.session.transport().capabilities().max_frame;
        if data.len() + 9 > max || name.len() > MAX_NAME {
            return Err(P2pError::InvalidArgument(format!(
                "{name:?} of {} bytes: a saved buffer must fit a frame ({max} bytes with 9 of header) and its name {MAX_NAME} bytes",
                data.len()
            )));
        }
        let mut s = lock(&self.inner.saved);
        let e = s.map.entry(name.to_string()).or_insert((0, Bytes::new()));
        e.0 += 1;
        e.1 = Bytes::copy_from_slice(data);
        Ok(e.0)
    }

    /// The session the store serves and requests over.
    pub fn session(&self) -> &Session<T> {
        &self.inner.session
    }

    /// This worker's saved `name`, if any: (version, bytes).
    pub fn saved(&self, name: &str) -> Option<(u64, Bytes)> {
        lock(&self.inner.saved).map.get(name).cloned()
    }

    /// Requests `peer`'s latest saved `name`: (version, bytes). The peer
    /// need not be doing anything (its server task answers). Bounded by
    /// the session's op timeout.
    pub async fn request(&self, peer: Rank, name: &str) -> Result<(u64, Bytes), P2pError> {
        self.request_version(peer, name, None).await
    }

    /// Like [`PeerStore::request`], for one version (`None`: the latest);
    /// only the latest is kept, so an older one is
    /// [`P2pError::NoSuchVersion`].
    pub async fn request_version(
        &self,
        peer: Rank,
        name: &str,
        version: Option<u64>,
    ) -> Result<(u64, Bytes), P2pError> {
        let s = &self.inner.session;
        if peer.idx() >= s.size() || peer == s.rank() {
            return Err(P2pError::InvalidArgument(format!(
                "peer {peer} (this is {} of {})",
                s.rank(),
                s.size()
            )));
        }
        if name.len() > MAX_NAME {
            return Err(P2pError::InvalidArgument(format!(
                "name of {} bytes; at most {MAX_NAME}",
                name.len()
            )));
        }
        let seq = self.inner.next_request[peer.idx()].fetch_add(1, Ordering::SeqCst);
        let mut req = Vec::with_capacity(12 + name.len());
        req.extend_from_slice(&(name.len() as u32).to_le_bytes());
        req.extend_from_slice(name.as_bytes());
        req.extend_from_slice(&version.unwrap_or(u64::MAX).to_le_bytes());
        let t = s.transport();
        let epoch = s.epoch();
        let tr = |source| P2pError::Transport { peer, source };
        t.send(
            peer,
            header(REQUEST, s.rank(), epoch, seq, 0),
            Bytes::from(req),
        )
        .await
        .map_err(tr)?;
        let from: PeerSet = [peer].into_iter().collect();
        let deadline = Instant::now() + s.config().op_timeout;
        let tag = tag(REPLY, peer, epoch, seq);
        let f = t.recv(tag, &from, deadline).await;
        // a reply that comes after a timeout is dropped on arrival
        t.retire(tag);
        let f = f.map_err(tr)?;
        let bad = |reason: &str| P2pError::Protocol {
            peer,
            reason: reason.into(),
        };
        let p = &f.payload;
        if p.len() < 9 {
            return Err(bad("shorter than its header"));
        }
        let v = u64::from_le_bytes(p[1..9].try_into().expect("8 bytes"));
        match p[0] {
            0 => Ok((v, p.slice(9..))),
            1 => Err(P2pError::NotSaved {
                name: name.into(),
                peer,
            }),
            2 => Err(P2pError::NoSuchVersion {
                name: name.into(),
                peer,
                version: version.unwrap_or(v),
            }),
            _ => Err(bad("unknown status")),
        }
    }
}

/// The tag of the `seq`-th frame of kind `name` sent by `sender` (to one
/// peer): unique per pair, so that a receiver can retire it (also
/// [`crate::sendrecv`]'s).
pub(crate) fn tag(name: &str, sender: Rank, epoch: kungfu_transport::Epoch, seq: u32) -> OpTag {
    OpTag {
        epoch,
        op: op_id(&format!("{name}{}", sender.0)),
        seq,
    }
}

/// The header of such a frame, piece `chunk` of what it carries.
pub(crate) fn header(
    name: &str,
    sender: Rank,
    epoch: kungfu_transport::Epoch,
    seq: u32,
    chunk: u32,
) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: tag(name, sender, epoch, seq),
        chunk,
        step: 0,
        digest: 0,
        len: 0,
    }
}

/// Parses a request: (name, version wanted).
fn parse_request(p: &[u8]) -> Option<(&str, Option<u64>)> {
    let len = u32::from_le_bytes(p.get(..4)?.try_into().ok()?) as usize;
    if len > MAX_NAME || p.len() != 4 + len + 8 {
        return None;
    }
    let name = std::str::from_utf8(&p[4..4 + len]).ok()?;
    let v = u64::from_le_bytes(p[4 + len..].try_into().ok()?);
    Some((name, (v != u64::MAX).then_some(v)))
}

/// Answers `peer`'s requests, in order, until the store is dropped.
async fn serve<T: Transport>(weak: Weak<Inner<T>>, peer: Rank) {
    let from: PeerSet = [peer].into_iter().collect();
    let mut seq = 0u32;
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.stop.load(Ordering::SeqCst) {
            return;
        }
        let t = inner.session.transport().clone();
        let epoch = inner.session.epoch();
        drop(inner);
        let tag = tag(REQUEST, peer, epoch, seq);
        let f = match t.recv(tag, &from, Instant::now() + IDLE_WAKE).await {
            Ok(f) => f,
            Err(TransportError::Timeout { .. }) => continue,
            // the peer is gone or the transport closed: nothing to serve
            // the peer is gone or the transport closed: nothing to serve
            Err(_) => return,
        };
        t.retire(tag);
        let Some(inner) = weak.upgrade() else { return };
        let mut reply = Vec::new();
        match parse_request(&f.payload) {
            None => reply.extend_from_slice(&[3u8; 9]),
            Some((name, want)) => match lock(&inner.saved).map.get(name) {
                None => {
                    reply.push(1);
                    reply.extend_from_slice(&0u64.to_le_bytes());
                }
                Some((v, _)) if want.is_some_and(|w| w != *v) => {
                    reply.push(2);
                    reply.extend_from_slice(&v.to_le_bytes());
                }
                Some((v, data)) => {
                    reply.reserve(9 + data.len());
                    reply.push(0);
                    reply.extend_from_slice(&v.to_le_bytes());
                    reply.extend_from_slice(data);
                }
            },
        }
        drop(inner);
        // A requester that left does not stop the service for the others.
        let me = t.rank();
        let _ = t
            .send(peer, header(REPLY, me, epoch, seq, 0), Bytes::from(reply))
            .await;
        seq = seq.wrapping_add(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse_strictly() {
        let mut r = Vec::new();
        r.extend_from_slice(&3u32.to_le_bytes());
        r.extend_from_slice(b"abc");
        r.extend_from_slice(&7u64.to_le_bytes());
        assert_eq!(parse_request(&r), Some(("abc", Some(7))));
        assert_eq!(parse_request(&r[..r.len() - 1]), None);
        let mut long = r.clone();
        long.push(0);
        assert_eq!(parse_request(&long), None);
        let mut huge = u32::MAX.to_le_bytes().to_vec();
        huge.extend_from_slice(&[0; 8]);
        assert_eq!(parse_request(&huge), None);
        assert_eq!(parse_request(&[]), None);
    }
}
