//! Point-to-point messages: a rank sends bytes to another under a tag, and
//! that rank receives them from it, or from any rank, under the same tag.
//! Two messages from one rank to another under one tag are received in
//! the order they were sent (MPI's non-overtaking rule); messages under
//! other tags, or from other ranks, may be received in any order.
//!
//! Every message is a rendezvous, so that no message waits in the
//! receiver's memory for a receive that may never come, and both ends
//! learn of a disagreement on its length:
//!
//! ```text
//! sender                                     receiver
//! ANNOUNCE (k-th to this peer): tag, length  ->  queued until a receive
//!                                                 matches it (the peer's
//!                                                 server task reads them
//!                                                 in order)
//!        <-  CLEAR (k): 0 and the receiver's length, or 1: refused
//! DATA (k), chunk 0..                        ->  copied into the message
//! ```
//!
//! A send therefore ends once its receive has begun and the data is handed
//! to the transport, as MPI's standard mode may: two ranks that each send
//! to the other before they receive wait for each other until the
//! deadline (isend and irecv, or an order that pairs them, do not).
//! Frames are data frames of reserved op names (with a NUL, so no op's
//! name collides), as in [`crate::p2p`]. A message in flight across a
//! strategy swap (a new epoch) is lost: its frames of the old epoch are
//! dropped, and both ends time out. So is a message whose send timed out
//! before a receive took its announcement: the receive that takes it later
//! times out waiting for its data.
//!
//! A frame that does not parse is the peer's protocol error; nothing a peer
//! sends is trusted (a length is checked against the receiver's before any
//! byte is copied).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use kungfu_transport::{Epoch, Instant, PeerSet, Transport, TransportError};
use tokio::sync::oneshot;

use crate::lock;
use crate::p2p::{header, tag as tag_of, P2pError};
use crate::Session;

const ANNOUNCE: &str = "kf/msg/announce\0";
const CLEAR: &str = "kf/msg/clear\0";
const DATA: &str = "kf/msg/data\0";
/// An announcement: tag, length.
const ANNOUNCE_LEN: usize = 16;
/// A clearance: status (0 go, 1 refused), the receiver's length.
const CLEAR_LEN: usize = 9;
/// How often an idle server task wakes to see whether it should stop.
const IDLE_WAKE: Duration = Duration::from_millis(500);

/// A message announced to this rank and not received yet.
#[derive(Clone, Copy, Debug)]
struct Announced {
    from: Rank,
    /// The sender's count of messages to this rank before it.
    seq: u32,
    epoch: Epoch,
    tag: u64,
    len: u64,
}

struct Inner<T: Transport> {
    session: Session<T>,
    /// Messages sent to each peer so far.
    next_send: Vec<AtomicU32>,
    /// The matching of announcements to receives.
    book: Mutex<Book>,
    stop: AtomicBool,
}

/// A receive posted and not matched yet: it takes the first announcement
/// from `from` (any rank if `None`) under `tag`.
struct Posted {
    id: u64,
    from: Option<Rank>,
    tag: u64,
    done: oneshot::Sender<Result<Announced, P2pError>>,
}

/// MPI's two queues: receives posted and not matched, in the order they
/// were posted, and announcements that came before any receive matched
/// them, in the order they were read. An announcement goes to the first
/// posted receive it matches, a receive to the first announcement.
#[derive(Default)]
struct Book {
    posted: VecDeque<Posted>,
    unexpected: VecDeque<Announced>,
    next_id: u64,
    /// The peers whose server task ended (lost, or the transport closed),
    /// with why.
    gone: Vec<(Rank, String)>,
}

impl Book {
    /// Files an announcement read from its sender.
    fn announced(&mut self, a: Announced) {
        let hit = self
            .posted
            .iter()
            .position(|p| p.tag == a.tag && p.from.is_none_or(|f| f == a.from));
        match hit {
            Some(i) => {
                let p = self.posted.remove(i).expect("found");
                if let Err(Ok(a)) = p.done.send(Ok(a)) {
                    // its receiver was dropped: the next may take it
                    self.announced(a);
                }
            }
            None => self.unexpected.push_back(a),
        }
    }

    /// `peer` can send no more: the receives that wait on it alone fail,
    /// and so do those from any rank once every peer is gone.
    fn peer_gone(&mut self, peer: Rank, why: String, size: usize) {
        self.gone.push((peer, why.clone()));
        let all_gone = self.gone.len() + 1 >= size;
        let mut keep = VecDeque::new();
        for p in self.posted.drain(..) {
            match p.from {
                Some(f) if f == peer => {
                    let _ = p.done.send(Err(P2pError::Gone {
                        peer,
                        why: why.clone(),
                    }));
                }
                None if all_gone => {
                    let _ = p.done.send(Err(P2pError::Gone {
                        peer,
                        why: format!("every peer is gone; the last: {why}"),
                    }));
                }
                _ => keep.push_back(p),
            }
        }
        self.posted = keep;
    }
}

/// A rank's point-to-point messages over a session: it sends, and it runs a
/// server task per peer that reads the peer's announcements, so that a
/// receive can match them in order. Every rank that others send to must
/// have one; dropping it stops the tasks.
pub struct Mailbox<T: Transport> {
    inner: Arc<Inner<T>>,
}

impl<T: Transport> Drop for Mailbox<T> {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::SeqCst);
    }
}

impl<T: Transport> Mailbox<T> {
    /// A mailbox over `session`'s transport, among all of its ranks (a
    /// subgroup's session stands for its whole session here); starts a
    /// server task per peer on the current tokio runtime.
    pub fn new(session: &Session<T>) -> Mailbox<T> {
        let session = &session.whole();
        let n = session.size();
        let inner = Arc::new(Inner {
            session: session.clone(),
            next_send: (0..n).map(|_| AtomicU32::new(0)).collect(),
            book: Mutex::new(Book::default()),
            stop: AtomicBool::new(false),
        });
        let me = session.rank();
        for p in (0..n as u32).map(Rank).filter(|&p| p != me) {
            tokio::spawn(serve(Arc::downgrade(&inner), p));
        }
        Mailbox { inner }
    }

    /// The session the mailbox sends and receives over.
    pub fn session(&self) -> &Session<T> {
        &self.inner.session
    }

    fn check_peer(&self, peer: Rank) -> Result<(), P2pError> {
        let s = &self.inner.session;
        if peer.idx() >= s.size() || peer == s.rank() {
            return Err(P2pError::InvalidArgument(format!(
                "peer {peer} (this is {} of {})",
                s.rank(),
                s.size()
            )));
        }
        Ok(())
    }

    /// Sends `data` to `to` under `tag`; the future ends once `to`
    /// received it (its data handed to the transport), or fails at
    /// `deadline`. The message's place in the order of this rank's
    /// messages to `to` is taken by this call, not when the future first
    /// runs.
    pub fn send(
        &self,
        to: Rank,
        tag: u64,
        data: Bytes,
        deadline: Instant,
    ) -> impl std::future::Future<Output = Result<(), P2pError>> + Send + 'static {
        let checked = self.check_peer(to);
        let seq = checked
            .is_ok()
            .then(|| self.inner.next_send[to.idx()].fetch_add(1, Ordering::SeqCst));
        let inner = self.inner.clone();
        async move {
            checked?;
            send_seq(&inner, to, tag, data, deadline, seq.expect("checked")).await
        }
    }

    /// Receives the next message under `tag` from `from` (`None`: from any
    /// rank), which must be `len` bytes; the future returns its sender
    /// and bytes. Receives match messages in the order they were posted
    /// (by this call, not when the future first runs). Fails at
    /// `deadline`, or once `from` is gone (for any rank: once every peer
    /// is). A receive dropped before it matched a message leaves it to
    /// the next; one dropped after loses it.
    pub fn recv(
        &self,
        from: Option<Rank>,
        tag: u64,
        len: usize,
        deadline: Instant,
    ) -> impl std::future::Future<Output = Result<(Rank, Bytes), P2pError>> + Send + 'static {
        let checked = from.map_or(Ok(()), |p| self.check_peer(p));
        let inner = self.inner.clone();
        let posted = checked.is_ok().then(|| post(&inner, from, tag));
        async move {
            checked?;
            let a = match posted.expect("checked") {
                Ok(a) => a,
                Err((id, mut rx)) => match tokio::time::timeout_at(deadline, &mut rx).await {
                    Ok(Ok(r)) => r?,
                    Ok(Err(_)) => return Err(P2pError::Timeout("the mailbox closed".into())),
                    Err(_) => withdraw(&inner, id, from, tag, rx)?,
                },
            };
            receive(&inner, a, tag, len, deadline).await
        }
    }
}

/// A posted receive: an announcement already there, or its id and the
/// channel it will come on.
type PostResult = Result<Announced, (u64, oneshot::Receiver<Result<Announced, P2pError>>)>;

fn post<T: Transport>(inner: &Inner<T>, from: Option<Rank>, tag: u64) -> PostResult {
    let mut b = lock(&inner.book);
    let hit = b
        .unexpected
        .iter()
        .position(|a| a.tag == tag && from.is_none_or(|f| f == a.from));
    if let Some(i) = hit {
        return Ok(b.unexpected.remove(i).expect("found"));
    }
    let (tx, rx) = oneshot::channel();
    let id = b.next_id;
    b.next_id += 1;
    // a peer gone before this was posted: it fails at once
    let size = inner.session.size();
    let gone = match from {
        Some(f) => b.gone.iter().find(|(r, _)| *r == f).cloned(),
        None if b.gone.len() + 1 >= size => b.gone.last().cloned(),
        None => None,
    };
    match gone {
        Some((peer, why)) => {
            let _ = tx.send(Err(P2pError::Gone { peer, why }));
        }
        None => b.posted.push_back(Posted {
            id,
            from,
            tag,
            done: tx,
        }),
    }
    Err((id, rx))
}

/// A posted receive's wait ended at its deadline: withdrawn, or, if an
/// announcement matched it meanwhile, that announcement.
fn withdraw<T: Transport>(
    inner: &Inner<T>,
    id: u64,
    from: Option<Rank>,
    tag: u64,
    mut rx: oneshot::Receiver<Result<Announced, P2pError>>,
) -> Result<Announced, P2pError> {
    let mut b = lock(&inner.book);
    if let Some(i) = b.posted.iter().position(|p| p.id == id) {
        b.posted.remove(i);
        return Err(P2pError::Timeout(match from {
            Some(f) => format!("no message from {f} under tag {tag}"),
            None => format!("no message from any rank under tag {tag}"),
        }));
    }
    drop(b);
    rx.try_recv()
        .unwrap_or_else(|_| Err(P2pError::Timeout("the mailbox closed".into())))
}

/// The sender's side of message `seq` to `to`.
async fn send_seq<T: Transport>(
    inner: &Inner<T>,
    to: Rank,
    tag: u64,
    data: Bytes,
    deadline: Instant,
    seq: u32,
) -> Result<(), P2pError> {
    let s = &inner.session;
    let t = s.transport();
    let (me, epoch) = (s.rank(), s.epoch());
    let tr = |source| P2pError::Transport { peer: to, source };
    let mut a = Vec::with_capacity(ANNOUNCE_LEN);
    a.extend_from_slice(&tag.to_le_bytes());
    a.extend_from_slice(&(data.len() as u64).to_le_bytes());
    t.send(to, header(ANNOUNCE, me, epoch, seq, 0), Bytes::from(a))
        .await
        .map_err(tr)?;
    let from: PeerSet = [to].into_iter().collect();
    let clear = tag_of(CLEAR, to, epoch, seq);
    let f = t.recv(clear, &from, deadline).await;
    t.retire(clear);
    let f = f.map_err(tr)?;
    let p = &f.payload;
    if p.len() != CLEAR_LEN {
        return Err(P2pError::Protocol {
            peer: to,
            reason: format!("a clearance of {} bytes", p.len()),
        });
    }
    let theirs = u64::from_le_bytes(p[1..9].try_into().expect("8 bytes"));
    match p[0] {
        0 if theirs == data.len() as u64 => {}
        0 | 1 => {
            return Err(P2pError::Length {
                from: me,
                to,
                tag,
                sent: data.len() as u64,
                expected: theirs,
            })
        }
        x => {
            return Err(P2pError::Protocol {
                peer: to,
                reason: format!("a clearance of status {x}"),
            })
        }
    }
    let max = t.capabilities().max_frame.max(1);
    for (i, start) in (0..data.len()).step_by(max).enumerate() {
        let end = (start + max).min(data.len());
        let h = header(DATA, me, epoch, seq, i as u32);
        t.send(to, h, data.slice(start..end)).await.map_err(tr)?;
    }
    Ok(())
}

/// The receiver's side of announced message `a`, which a receive of `len`
/// bytes under `tag` matched: clears it (or refuses it, if the lengths
/// differ) and takes its data.
async fn receive<T: Transport>(
    inner: &Inner<T>,
    a: Announced,
    tag: u64,
    len: usize,
    deadline: Instant,
) -> Result<(Rank, Bytes), P2pError> {
    let s = &inner.session;
    let t = s.transport();
    let me = s.rank();
    let peer = a.from;
    let tr = |source| P2pError::Transport { peer, source };
    let fits = a.len == len as u64;
    let mut c = Vec::with_capacity(CLEAR_LEN);
    c.push(u8::from(!fits));
    c.extend_from_slice(&(len as u64).to_le_bytes());
    t.send(peer, header(CLEAR, me, a.epoch, a.seq, 0), Bytes::from(c))
        .await
        .map_err(tr)?;
    if !fits {
        return Err(P2pError::Length {
            from: peer,
            to: me,
            tag,
            sent: a.len,
            expected: len as u64,
        });
    }
    let max = t.capabilities().max_frame.max(1);
    let chunks = len.div_ceil(max);
    let mut out = vec![0u8; len];
    let mut got = vec![false; chunks];
    let data = tag_of(DATA, peer, a.epoch, a.seq);
    let one: PeerSet = [peer].into_iter().collect();
    let r = async {
        for _ in 0..chunks {
            let f = t.recv(data, &one, deadline).await.map_err(tr)?;
            let i = f.header.chunk as usize;
            let start = i.saturating_mul(max);
            let end = start.saturating_add(max).min(len);
            if i >= chunks || got[i] || f.payload.len() != end - start {
                return Err(P2pError::Protocol {
                    peer,
                    reason: format!(
                        "chunk {i} of {} bytes (a message of {len} bytes in {chunks})",
                        f.payload.len()
                    ),
                });
            }
            got[i] = true;
            out[start..end].copy_from_slice(&f.payload);
        }
        Ok(())
    }
    .await;
    t.retire(data);
    r.map(|()| (peer, Bytes::from(out)))
}

/// An announcement's (tag, length), if it parses.
fn parse_announce(p: &[u8]) -> Option<(u64, u64)> {
    if p.len() != ANNOUNCE_LEN {
        return None;
    }
    let u = |i: usize| u64::from_le_bytes(p[i..i + 8].try_into().expect("8 bytes"));
    Some((u(0), u(8)))
}

/// Reads `peer`'s announcements, in order, into the queue until the
/// mailbox is dropped or the peer is gone.
async fn serve<T: Transport>(weak: Weak<Inner<T>>, peer: Rank) {
    let from: PeerSet = [peer].into_iter().collect();
    let mut seq = 0u32;
    let why = loop {
        let Some(inner) = weak.upgrade() else { return };
        if inner.stop.load(Ordering::SeqCst) {
            return;
        }
        let t = inner.session.transport().clone();
        let epoch = inner.session.epoch();
        drop(inner);
        let tag = tag_of(ANNOUNCE, peer, epoch, seq);
        let f = match t.recv(tag, &from, Instant::now() + IDLE_WAKE).await {
            Ok(f) => f,
            Err(TransportError::Timeout { .. }) => continue,
            Err(e) => break e.to_string(),
        };
        t.retire(tag);
        let Some((tag, len)) = parse_announce(&f.payload) else {
            break format!(
                "protocol violation: an announcement of {} bytes",
                f.payload.len()
            );
        };
        let Some(inner) = weak.upgrade() else { return };
        lock(&inner.book).announced(Announced {
            from: peer,
            seq,
            epoch,
            tag,
            len,
        });
        seq = seq.wrapping_add(1);
    };
    if let Some(inner) = weak.upgrade() {
        let size = inner.session.size();
        lock(&inner.book).peer_gone(peer, why, size);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_parse_strictly() {
        let mut a = 7u64.to_le_bytes().to_vec();
        a.extend_from_slice(&9u64.to_le_bytes());
        assert_eq!(parse_announce(&a), Some((7, 9)));
        assert_eq!(parse_announce(&a[..15]), None);
        a.push(0);
        assert_eq!(parse_announce(&a), None);
    }
}
