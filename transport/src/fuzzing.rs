//! Entry points of the fuzz targets (`fuzz/` at the repository root),
//! public so that a stable test can replay their corpus too. Each takes
//! arbitrary bytes and panics only on a broken invariant; none needs a
//! runtime: the streams they read are all there, so every future is
//! polled once, and one left pending is a finding (a hang).

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};

use kungfu_topology::Rank;
use tokio::io::{AsyncRead, ReadBuf};

use crate::handshake::{self, Hello, Identity};
use crate::{ClusterVersion, Epoch, Header, HEADER_LEN};

/// Runs `f`, whose input is all there, to its end in one poll; panics if
/// it waits (it would wait forever).
pub fn ready<F: Future>(f: F) -> F::Output {
    match pin!(f).poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("waits for bytes when all of its input is there"),
    }
}

/// A byte stream that gives `data` at most `chunk` bytes per read, then
/// end of stream, and takes (and keeps) whatever is written to it.
pub struct Chunks<'a> {
    data: &'a [u8],
    chunk: usize,
    pub written: Vec<u8>,
}

impl<'a> Chunks<'a> {
    pub fn new(data: &'a [u8], chunk: usize) -> Chunks<'a> {
        Chunks {
            data,
            chunk: chunk.max(1),
            written: Vec::new(),
        }
    }
}

impl AsyncRead for Chunks<'_> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let n = self.data.len().min(self.chunk).min(buf.remaining());
        let (now, later) = self.data.split_at(n);
        buf.put_slice(now);
        self.data = later;
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for Chunks<'_> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.written.extend_from_slice(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The frame header: the first byte picks the payload limit, the next
/// [`HEADER_LEN`] are a header. What decodes is within the limit and
/// encodes back to the same bytes.
pub fn header(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let Some(b) = rest.get(..HEADER_LEN) else {
        return;
    };
    let b: &[u8; HEADER_LEN] = b.try_into().expect("HEADER_LEN bytes");
    let max = match pick % 4 {
        0 => usize::MAX,
        1 => 0,
        2 => 64 << 20,
        _ => usize::from(pick) << 8,
    };
    match Header::decode(b, max) {
        Ok(h) => {
            assert!(h.len <= max as u64, "{} over the limit {max}", h.len);
            assert_eq!(&h.encode(), b, "decode then encode changed the header");
        }
        Err(e) => drop(e.to_string()),
    }
}

/// Who the handshake target is: rank 1 of 4, which ranks 2 and 3 dial.
fn me() -> Identity {
    Identity {
        cluster_id: 0x6b66,
        version: ClusterVersion(3),
        epoch: Epoch(2),
        rank: Rank(1),
        size: 4,
        peers_digest: 77,
        secret: None,
    }
}

/// The handshake, both sides, over a stream of `data` after its first
/// byte (which picks the side and the size of the reads). The answerer
/// accepts only a hello that [`handshake::check`] accepts, says so (status
/// 0) exactly when it does, and writes nothing or one answer; the dialer
/// writes its hello and nothing else, and accepts only an answer of
/// status 0.
pub fn handshake(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let me = me();
    let may_dial = |r: Rank| r > Rank(1);
    let mut s = Chunks::new(rest, usize::from(pick >> 1) + 1);
    let hello_len = Hello::of(&me, Rank(0), [0; 32]).encode().len();
    if pick & 1 == 0 {
        let r = ready(handshake::answer(&mut s, &me, may_dial));
        let hello = rest
            .get(..hello_len)
            .and_then(|b| Hello::decode(b.try_into().expect("a hello's length")).ok());
        let checked = hello.map(|h| handshake::check(&me, &h, may_dial).map(|()| h.from));
        match &r {
            Ok(from) => assert_eq!(checked, Some(Ok(*from))),
            Err(why) => assert!(!why.is_empty() && !matches!(checked, Some(Ok(_)))),
        }
        let w = &s.written;
        assert!(
            w.is_empty() || (w.starts_with(b"KH") && w.len() > 4),
            "{w:02x?}"
        );
        if let Some(&status) = w.get(4) {
            assert_eq!(status == 0, r.is_ok(), "answered {status}, returned {r:?}");
        } else {
            assert!(r.is_err());
        }
    } else {
        let r = ready(handshake::dial(&mut s, &me, Rank(0)));
        // its hello (with a fresh nonce) and, after an answer, nothing
        // more without a secret
        assert_eq!(s.written.len(), hello_len, "{:02x?}", s.written);
        assert!(s.written.starts_with(b"KH"));
        if r.is_ok() {
            assert!(
                rest.len() > 4 && rest[4] == 0,
                "accepted status {:?}",
                rest.get(4)
            );
        }
    }
    if let Some(b) = rest.get(..hello_len) {
        if let Ok(h) = Hello::decode(b.try_into().expect("a hello's length")) {
            assert_eq!(&h.encode()[..], b);
        }
    }
}
