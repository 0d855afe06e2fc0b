//! The reader and writer task of each connection.

use std::io::IoSlice;
use std::sync::Arc;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::{mpsc, oneshot};

use crate::endpoint::{Matcher, CLOSED_BY_PEER};
use crate::pool::BufferPool;
use crate::{Header, TransportError, HEADER_LEN};

/// Frames a writer coalesces into one flush.
const WRITE_BATCH: usize = 64;
const IO_BUFFER: usize = 64 * 1024;

pub(super) enum WriterMsg {
    Frame(Outgoing),
    /// Flush, send FIN, and stop.
    Finish(oneshot::Sender<()>),
}

pub(super) struct Outgoing {
    pub(super) header: [u8; HEADER_LEN],
    pub(super) payload: Bytes,
    pub(super) done: oneshot::Sender<Result<(), TransportError>>,
}

pub(super) async fn read_loop(
    rd: OwnedReadHalf,
    peer: Rank,
    matcher: Arc<Matcher>,
    max_frame: usize,
    frames: Arc<BufferPool>,
) {
    let mut rd = BufReader::with_capacity(IO_BUFFER, rd);
    loop {
        let mut hb = [0u8; HEADER_LEN];
        if let Err(e) = rd.read_exact(&mut hb).await {
            let why = if e.kind() == std::io::ErrorKind::UnexpectedEof {
                CLOSED_BY_PEER.to_string()
            } else {
                format!("read: {e}")
            };
            matcher.fail_peer(peer, why);
            return;
        }
        let header = match Header::decode(&hb, max_frame) {
            Ok(h) => h,
            Err(e) => {
                // The stream cannot be resynchronised after a bad header.
                matcher.fail_peer(peer, format!("protocol violation: {e}"));
                return close_both(&rd);
            }
        };
        let len = header.len as usize; // checked against max_frame by decode
                                       // A posted receive: the payload goes straight into the op's memory.
        if let Some(mut mem) = matcher.claim(peer, &header) {
            if let Err(e) = read_payload(&mut rd, mem.as_mut_slice(), &matcher, peer).await {
                matcher.fail_peer(peer, cut_frame(e));
                return close_both(&rd);
            }
            matcher.landed(peer, header, mem);
            continue;
        }
        let mut buf = frames.take(len);
        if let Err(e) = read_payload(&mut rd, buf.as_mut(), &matcher, peer).await {
            matcher.fail_peer(peer, cut_frame(e));
            return close_both(&rd);
        }
        match matcher.deliver(peer, header, buf.freeze()).await {
            // Refused frames are counted by the matcher; the connection goes on.
            Ok(()) | Err(TransportError::StaleEpoch { .. }) => {}
            Err(_) => return,
        }
    }
}

/// Reads a payload; a long one in pieces, telling the matcher that the
/// peer is alive after each (a frame of many megabytes on a slow link
/// must not look like silence to the liveness watchdog).
async fn read_payload(
    rd: &mut BufReader<OwnedReadHalf>,
    buf: &mut [u8],
    matcher: &Matcher,
    peer: Rank,
) -> std::io::Result<()> {
    const PIECE: usize = 1 << 20;
    if buf.len() <= PIECE {
        return rd.read_exact(buf).await.map(drop);
    }
    for piece in buf.chunks_mut(PIECE) {
        rd.read_exact(piece).await?;
        matcher.heard(peer);
    }
    Ok(())
}

/// Closes a connection whose stream broke (a bad header, a frame cut
/// short) both ways, so that the peer learns at once (its reader sees the
/// end) instead of waiting for frames until its ops time out.
fn close_both(rd: &BufReader<OwnedReadHalf>) {
    let s: &tokio::net::TcpStream = rd.get_ref().as_ref();
    let _ = socket2::SockRef::from(s).shutdown(std::net::Shutdown::Both);
}

/// Drops this connection on purpose (fault injection, SIGUSR1 under
/// `KUNGFU_FAULTS`): shut down both ways, so that both ends see it end.
fn cut(wr: &BufWriter<OwnedWriteHalf>, peer: Rank, matcher: &Matcher) -> TransportError {
    super::faults::log(&format!("cut the connection to {peer}"));
    // Lost first, then shut down: the reader of this end, which sees the
    // end of the stream too, must not make it a clean close (which the
    // other peers are not told of).
    let lost = matcher.lose_writer(peer, "the connection was cut (fault injection)");
    let s: &tokio::net::TcpStream = wr.get_ref().as_ref();
    let _ = socket2::SockRef::from(s).shutdown(std::net::Shutdown::Both);
    lost
}

/// Why a connection that ended in the middle of a frame is lost.
fn cut_frame(e: std::io::Error) -> String {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        "connection closed in the middle of a frame".to_string()
    } else {
        format!("read: {e}")
    }
}

/// Writes one frame. Header and payload go to the socket in one
/// vectored write: a payload larger than the write buffer bypasses it,
/// and two writes would send the header as a packet of its own (the
/// socket does not delay), which the receiver wakes up for alone. Small
/// frames still gather in the buffer.
async fn write_frame<W: AsyncWrite + Unpin>(
    wr: &mut W,
    header: &[u8],
    payload: &[u8],
) -> std::io::Result<()> {
    let (mut header, mut payload) = (header, payload);
    while !header.is_empty() {
        let n = wr
            .write_vectored(&[IoSlice::new(header), IoSlice::new(payload)])
            .await?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        if n < header.len() {
            header = &header[n..];
        } else {
            payload = &payload[n - header.len()..];
            header = &[];
        }
    }
    wr.write_all(payload).await
}

pub(super) async fn write_loop(
    wr: OwnedWriteHalf,
    peer: Rank,
    mut rx: mpsc::Receiver<WriterMsg>,
    matcher: Arc<Matcher>,
) {
    let mut wr = BufWriter::with_capacity(IO_BUFFER, wr);
    let mut lost: Option<TransportError> = None;
    let mut batch: Vec<oneshot::Sender<Result<(), TransportError>>> = Vec::new();
    let mut finish: Option<oneshot::Sender<()>> = None;
    let faults = super::faults::faults();
    while let Some(first) = rx.recv().await {
        if let Some(f) = faults {
            f.hold().await;
            if lost.is_none() && f.take_cut() {
                lost = Some(cut(&wr, peer, &matcher));
            }
        }
        let mut next = Some(first);
        while let Some(msg) = next.take() {
            let msg = match msg {
                WriterMsg::Frame(m) => m,
                WriterMsg::Finish(done) => {
                    finish = Some(done);
                    break;
                }
            };
            if lost.is_none() {
                let began = crate::Instant::now();
                let res = write_frame(&mut wr, &msg.header, &msg.payload).await;
                if let Err(e) = res {
                    lost = Some(matcher.lose_writer(peer, e));
                }
                if let Some(f) = faults {
                    f.pace(msg.header.len() + msg.payload.len(), began).await;
                }
            }
            batch.push(msg.done);
            if batch.len() < WRITE_BATCH {
                next = rx.try_recv().ok();
            }
        }
        if lost.is_none() {
            if let Err(e) = wr.flush().await {
                lost = Some(matcher.lose_writer(peer, e));
            }
        }
        for done in batch.drain(..) {
            // The sender may have given up waiting; that is fine.
            let _ = done.send(match &lost {
                None => Ok(()),
                Some(e) => Err(e.clone()),
            });
        }
        if let Some(done) = finish.take() {
            // FIN after the last frame: the peer reads everything we sent,
            // then end of stream.
            let _ = wr.shutdown().await;
            let _ = done.send(());
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::task::{Context, Poll};

    use super::*;

    /// A writer that takes at most `most` bytes per call, from the first
    /// non-empty slice only (as a socket may).
    struct Trickle {
        out: Vec<u8>,
        most: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            let n = buf.len().min(self.most);
            self.out.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }

        fn poll_write_vectored(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let first = bufs.iter().find(|b| !b.is_empty()).map_or(&[][..], |b| b);
            self.poll_write(cx, first)
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    #[tokio::test]
    async fn a_frame_survives_short_writes() {
        let header: Vec<u8> = (0..HEADER_LEN as u8).collect();
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        for most in [1, 3, HEADER_LEN - 1, HEADER_LEN, HEADER_LEN + 5, 4096] {
            let mut w = Trickle {
                out: Vec::new(),
                most,
            };
            write_frame(&mut w, &header, &payload).await.unwrap();
            assert_eq!(w.out.len(), header.len() + payload.len(), "most {most}");
            assert_eq!(&w.out[..HEADER_LEN], &header[..], "most {most}");
            assert_eq!(&w.out[HEADER_LEN..], &payload[..], "most {most}");
        }
        let mut w = Trickle {
            out: Vec::new(),
            most: 0,
        };
        let e = write_frame(&mut w, &header, &payload).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::WriteZero);
    }
}
