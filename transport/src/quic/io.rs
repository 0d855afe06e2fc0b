//! The tasks of each QUIC connection: a reader that accepts the peer's
//! streams (one frame each) and reads them concurrently, and a reaper that
//! waits until the peer has acknowledged every stream this side finished,
//! then says goodbye on the control stream.
//!
//! The control stream is the connection's first (bidirectional) stream:
//! the shared handshake runs on it, then each side writes one message on
//! it when it closes, `BYE` and the number of frame streams it finished.
//! A reader that has that number and has read that many frames is done
//! with the peer, as a TCP reader is at end of stream.

use std::sync::Arc;

use bytes::Bytes;
use kungfu_topology::Rank;
use quinn::{Connection, ConnectionError, ReadExactError, RecvStream, SendStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use crate::endpoint::{Matcher, CLOSED_BY_PEER};
use crate::pool::BufferPool;
use crate::{Header, TransportError, HEADER_LEN};

/// The goodbye on the control stream: this magic, then a u64 (LE), the
/// number of frame streams finished.
const BYE: [u8; 4] = *b"BYE!";

/// The application error code of a stream reset because its send was
/// cancelled (the receiver drops what it read of it).
pub(super) const CANCELLED: u32 = 1;

/// What a reaper is handed.
pub(super) enum Reap {
    /// A frame stream, finished: wait for the peer's acknowledgement.
    Stream(SendStream),
    /// Every stream before this one is handed over: once all are
    /// acknowledged, write the goodbye and say so.
    Bye(oneshot::Sender<()>),
}

/// Waits, in order, until the peer acknowledged each finished stream (so
/// that closing the connection cannot lose it: the peer can read streams
/// it holds even after the connection closed), and on [`Reap::Bye`]
/// writes the goodbye with the count of streams.
pub(super) async fn reap(mut rx: mpsc::UnboundedReceiver<Reap>, mut control: SendStream) {
    let mut finished: u64 = 0;
    while let Some(msg) = rx.recv().await {
        match msg {
            Reap::Stream(s) => {
                // Acknowledged, stopped or lost: either way nothing more
                // of it will move.
                let _ = s.stopped().await;
                finished += 1;
            }
            Reap::Bye(done) => {
                let mut bye = [0u8; 12];
                bye[..4].copy_from_slice(&BYE);
                bye[4..].copy_from_slice(&finished.to_le_bytes());
                if control.write_all(&bye).await.is_ok() && control.finish().is_ok() {
                    let _ = control.stopped().await;
                }
                let _ = done.send(());
                return;
            }
        }
    }
}

/// A send stream that is reset if dropped unfinished (a cancelled send):
/// quinn would otherwise finish it, and the peer would read half a frame.
pub(super) struct Sending(pub(super) Option<SendStream>);

impl Drop for Sending {
    fn drop(&mut self) {
        if let Some(mut s) = self.0.take() {
            let _ = s.reset(CANCELLED.into());
        }
    }
}

/// How one frame stream ended.
enum Read {
    /// A whole frame, delivered (or refused by the matcher, as on TCP).
    Frame,
    /// The sender reset it (a cancelled send): nothing delivered.
    Cancelled,
    /// The connection is gone.
    Lost(String),
    /// The peer broke the protocol: the connection cannot be trusted.
    Violation(String),
    /// The endpoint closed under the reader.
    Closed,
}

/// Reads the frames of `peer` until its goodbye (and every frame it
/// counted), or until the connection is lost; then tells the matcher the
/// peer is gone, after delivering everything that arrived.
pub(super) async fn read_conn(
    conn: Connection,
    mut control: RecvStream,
    peer: Rank,
    matcher: Arc<Matcher>,
    max_frame: usize,
    pool: Arc<BufferPool>,
) {
    let mut streams: JoinSet<Read> = JoinSet::new();
    let (mut bye, mut frames): (Option<u64>, u64) = (None, 0);
    let mut lost: Option<String> = None;
    let mut control_open = true;
    loop {
        if bye.is_some_and(|n| frames >= n) && streams.is_empty() {
            break;
        }
        if lost.is_some() && streams.is_empty() {
            break;
        }
        tokio::select! {
            s = conn.accept_uni(), if lost.is_none() => match s {
                Ok(s) => {
                    streams.spawn(read_stream(s, peer, matcher.clone(), max_frame, pool.clone()));
                }
                Err(e) => lost = Some(connection_lost(&e)),
            },
            b = read_bye(&mut control), if control_open && lost.is_none() => {
                control_open = false;
                match b {
                    Ok(n) => bye = Some(n),
                    Err(why) => {
                        conn.close(2u32.into(), b"protocol violation");
                        lost = Some(why);
                    }
                }
            }
            Some(done) = streams.join_next(), if !streams.is_empty() => match done {
                Ok(Read::Frame) => frames += 1,
                Ok(Read::Cancelled) => {}
                Ok(Read::Lost(why)) => {
                    lost.get_or_insert(why);
                }
                Ok(Read::Violation(why)) => {
                    conn.close(2u32.into(), b"protocol violation");
                    streams.abort_all();
                    matcher.fail_peer(peer, format!("protocol violation: {why}"));
                    return;
                }
                Ok(Read::Closed) | Err(_) => {
                    streams.abort_all();
                    return;
                }
            },
        }
    }
    let why = lost.unwrap_or_else(|| CLOSED_BY_PEER.to_string());
    matcher.fail_peer(peer, why);
}

/// Why a lost connection is lost, in the words the other wires use.
pub(super) fn connection_lost(e: &ConnectionError) -> String {
    match e {
        ConnectionError::ApplicationClosed(_) | ConnectionError::LocallyClosed => {
            CLOSED_BY_PEER.to_string()
        }
        other => format!("connection lost: {other}"),
    }
}

/// The peer's goodbye: the number of frame streams it finished.
async fn read_bye(control: &mut RecvStream) -> Result<u64, String> {
    let mut b = [0u8; 12];
    match control.read_exact(&mut b).await {
        Ok(()) if b[..4] == BYE => Ok(u64::from_le_bytes(b[4..].try_into().expect("8 bytes"))),
        Ok(()) => Err("bad goodbye on the control stream".into()),
        Err(ReadExactError::FinishedEarly(_)) => {
            Err("control stream ended without a goodbye".into())
        }
        Err(ReadExactError::ReadError(e)) => Err(read_failed(e).unwrap_or_else(|v| v)),
    }
}

/// A failed read: `Ok(why)` if the connection is lost, `Err(why)` if the
/// peer broke the protocol.
fn read_failed(e: quinn::ReadError) -> Result<String, String> {
    match e {
        quinn::ReadError::ConnectionLost(e) => Ok(connection_lost(&e)),
        other => Err(format!("read: {other}")),
    }
}

async fn read_stream(
    mut s: RecvStream,
    peer: Rank,
    matcher: Arc<Matcher>,
    max_frame: usize,
    pool: Arc<BufferPool>,
) -> Read {
    let mut hb = [0u8; HEADER_LEN];
    if let Err(e) = s.read_exact(&mut hb).await {
        return cut(e);
    }
    let header = match Header::decode(&hb, max_frame) {
        Ok(h) => h,
        Err(e) => return Read::Violation(e.to_string()),
    };
    // A posted receive: the payload goes straight into the op's memory.
    if let Some(mut mem) = matcher.claim(peer, &header) {
        if let Err(e) = s.read_exact(mem.as_mut_slice()).await {
            return cut(e);
        }
        if let Some(r) = at_end(&mut s).await {
            return r;
        }
        matcher.landed(peer, header, mem);
        return Read::Frame;
    }
    let len = header.len as usize; // checked against max_frame by decode
    let mut buf = pool.take(len);
    if let Err(e) = s.read_exact(buf.as_mut()).await {
        return cut(e);
    }
    if let Some(r) = at_end(&mut s).await {
        return r;
    }
    match matcher.deliver(peer, header, buf.freeze()).await {
        // Refused frames are counted by the matcher; the connection goes on.
        Ok(()) | Err(TransportError::StaleEpoch { .. }) => Read::Frame,
        Err(_) => Read::Closed,
    }
}

/// Checks that the frame's stream ends where the frame does.
async fn at_end(s: &mut RecvStream) -> Option<Read> {
    let mut extra = [0u8; 1];
    match s.read(&mut extra).await {
        Ok(None) => None,
        Ok(Some(_)) => Some(Read::Violation(
            "a frame stream goes on after its frame".into(),
        )),
        Err(quinn::ReadError::Reset(_)) => Some(Read::Cancelled),
        Err(e) => Some(read_failed(e).map_or_else(Read::Violation, Read::Lost)),
    }
}

/// How a stream that ended before its frame did ended.
fn cut(e: ReadExactError) -> Read {
    match e {
        ReadExactError::FinishedEarly(_) => {
            Read::Violation("a frame stream ended in the middle of its frame".into())
        }
        ReadExactError::ReadError(quinn::ReadError::Reset(_)) => Read::Cancelled,
        ReadExactError::ReadError(e) => read_failed(e).map_or_else(Read::Violation, Read::Lost),
    }
}

/// Writes one frame on a new stream of `conn` and finishes it; the stream
/// then goes to the reaper. quinn keeps the payload until the peer
/// acknowledges it: `Bytes` as they are, a borrowed slice as a copy (so
/// the caller's memory is free when this returns) in a buffer of `pool`.
/// quinn would copy a slice into a `Vec` of its own per write, up to
/// 512 KiB each: a fresh allocation every time, above malloc's mmap
/// threshold, whose pages fault in anew (26,000 faults per 64 MiB
/// allreduce at 2 ranks); the pool's buffers come back warm.
pub(super) async fn write_frame(
    conn: &Connection,
    header: [u8; HEADER_LEN],
    payload: Payload<'_>,
    pool: &Arc<BufferPool>,
) -> Result<SendStream, String> {
    let s = conn.open_uni().await.map_err(|e| connection_lost(&e))?;
    let mut guard = Sending(Some(s));
    let s = guard.0.as_mut().expect("just set");
    let res = match payload {
        Payload::Bytes(b) => {
            s.write_all_chunks(&mut [Bytes::copy_from_slice(&header), b])
                .await
        }
        Payload::Slice(p) => write_copied(s, &header, p, pool).await,
    };
    res.map_err(|e| match e {
        quinn::WriteError::ConnectionLost(e) => connection_lost(&e),
        other => format!("write: {other}"),
    })?;
    s.finish().map_err(|e| format!("finish: {e}"))?;
    Ok(guard.0.take().expect("still held"))
}

/// Writes `header` and a copy of `p`, a piece at a time, each piece
/// copied as quinn takes it: a large frame is not held twice whole while
/// flow control lets it out.
async fn write_copied(
    s: &mut SendStream,
    header: &[u8],
    p: &[u8],
    pool: &Arc<BufferPool>,
) -> Result<(), quinn::WriteError> {
    const PIECE: usize = 1 << 20;
    s.write_all_chunks(&mut [Bytes::copy_from_slice(header)])
        .await?;
    for piece in p.chunks(PIECE) {
        let mut copy = pool.take(piece.len());
        copy.as_mut().copy_from_slice(piece);
        s.write_all_chunks(&mut [copy.freeze()]).await?;
    }
    Ok(())
}

/// What [`write_frame`] sends.
pub(super) enum Payload<'a> {
    Bytes(Bytes),
    Slice(&'a [u8]),
}
