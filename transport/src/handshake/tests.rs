//! The handshake's unit tests: identity rules, and the challenge-response
//! with right, wrong and missing secrets, replays and truncated input.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{
    duplex, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream, ReadBuf,
};

use super::messages::{message, Ack, KIND_PROOF, KIND_VERDICT, PROOF_LEN, VERDICT_LEN};
use super::*;
use crate::auth::NONCE_LEN;

fn me() -> Identity {
    Identity {
        cluster_id: 0xfeed,
        version: ClusterVersion(5),
        epoch: Epoch(2),
        rank: Rank(1),
        size: 4,
        peers_digest: 77,
        secret: None,
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
        [9; NONCE_LEN],
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
    assert!(!ok.secret && ok.nonce == [9; NONCE_LEN]);
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
        // Refused on both sides, each naming what differs; worth another
        // attempt only when the peer is behind (it may yet move to ours).
        let (mut a, mut b) = tokio::io::duplex(256);
        let other = Identity {
            version: ClusterVersion(6),
            ..dialer.clone()
        };
        let (d, r) = tokio::join!(
            dial(&mut a, &other, Rank(1)),
            answer(&mut b, &answerer, |r| r > Rank(1))
        );
        let d = d.unwrap_err();
        assert!(d.retry, "a peer at an older version may yet move to ours");
        assert_eq!(
            d.reason,
            "refused: cluster version differs (peer at version 5, we are at version 6)"
        );
        assert!(r
            .unwrap_err()
            .contains("peer is at version 6, we are at version 5"));
        let (mut a, mut b) = tokio::io::duplex(256);
        let behind = Identity {
            version: ClusterVersion(4),
            ..dialer
        };
        let (d, _) = tokio::join!(
            dial(&mut a, &behind, Rank(1)),
            answer(&mut b, &answerer, |r| r > Rank(1))
        );
        assert!(!d.unwrap_err().retry, "this side is the one behind: final");
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

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(f)
}

fn with_secret(id: Identity, secret: &[u8]) -> Identity {
    Identity {
        secret: Some(JobSecret::new(secret).unwrap()),
        ..id
    }
}

/// Rank 2 dials rank 1 (`me()`), each with its own secret.
async fn run(
    dialer: Option<&[u8]>,
    answerer: Option<&[u8]>,
) -> (Result<(), DialError>, Result<Rank, String>) {
    let d = Identity {
        rank: Rank(2),
        ..me()
    };
    let d = dialer.map_or(d.clone(), |s| with_secret(d, s));
    let a = answerer.map_or(me(), |s| with_secret(me(), s));
    let (mut x, mut y) = duplex(1024);
    tokio::join!(
        dial(&mut x, &d, Rank(1)),
        answer(&mut y, &a, |r| r > Rank(1))
    )
}

#[test]
fn the_right_secret_is_accepted_a_wrong_one_refused_on_both_sides() {
    block_on(async {
        assert_eq!(
            run(Some(b"s3cret"), Some(b"s3cret")).await,
            (Ok(()), Ok(Rank(2)))
        );
        let (d, a) = run(Some(b"guess"), Some(b"s3cret")).await;
        let d = d.unwrap_err();
        assert!(!d.retry, "a bad credential is final");
        assert_eq!(
            d.reason,
            "refused: bad credential (the peer's proof of the job secret is wrong)"
        );
        let a = a.unwrap_err();
        assert!(
            a.starts_with("bad credential") && a.contains("claiming to be rank 2"),
            "{a}"
        );
    });
}

#[test]
fn a_secret_on_one_side_only_is_refused() {
    block_on(async {
        let (d, a) = run(None, Some(b"s3cret")).await;
        assert_eq!(
            d.unwrap_err().reason,
            "refused: bad credential: the peer holds a job secret (KUNGFU_JOB_SECRET), we do not"
        );
        assert!(a.unwrap_err().contains("the peer holds no job secret"));
        let (d, a) = run(Some(b"s3cret"), None).await;
        assert!(d
            .unwrap_err()
            .reason
            .contains("the peer holds no job secret"));
        assert!(a.unwrap_err().contains("the peer holds a job secret"));
        // without a secret on either side, links are not authenticated
        assert_eq!(run(None, None).await, (Ok(()), Ok(Rank(2))));
    });
}

/// A stream that keeps a copy of what was written to it.
struct Tap {
    inner: DuplexStream,
    written: Vec<u8>,
}

impl AsyncRead for Tap {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Tap {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        let n = std::task::ready!(Pin::new(&mut me.inner).poll_write(cx, buf))?;
        me.written.extend_from_slice(&buf[..n]);
        Poll::Ready(Ok(n))
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A recorded transcript, replayed to either side, is refused: the other
/// side's nonce is new, so the recorded MAC is wrong for it.
#[test]
fn a_replayed_transcript_is_refused() {
    block_on(async {
        let d = with_secret(
            Identity {
                rank: Rank(2),
                ..me()
            },
            b"s3cret",
        );
        let a = with_secret(me(), b"s3cret");
        let (x, y) = duplex(1024);
        let (mut x, mut y) = (
            Tap {
                inner: x,
                written: Vec::new(),
            },
            Tap {
                inner: y,
                written: Vec::new(),
            },
        );
        let (dd, aa) = tokio::join!(
            dial(&mut x, &d, Rank(1)),
            answer(&mut y, &a, |r| r > Rank(1))
        );
        assert_eq!((dd, aa), (Ok(()), Ok(Rank(2))));
        let (dialer_said, answerer_said) = (x.written, y.written);
        assert_eq!(dialer_said.len(), HELLO_LEN + PROOF_LEN);
        assert_eq!(answerer_said.len(), ACK_LEN + VERDICT_LEN);

        // The dialer's hello and proof, to a fresh answerer.
        let (mut x, mut y) = duplex(1024);
        let replay = async {
            x.write_all(&dialer_said[..HELLO_LEN]).await.unwrap();
            let mut ack = [0u8; ACK_LEN];
            x.read_exact(&mut ack).await.unwrap();
            x.write_all(&dialer_said[HELLO_LEN..]).await.unwrap();
            let mut v = [0u8; VERDICT_LEN];
            x.read_exact(&mut v).await.unwrap();
            (Ack::decode(&ack).unwrap(), v[4])
        };
        let (r, (ack, verdict)) = tokio::join!(answer(&mut y, &a, |r| r > Rank(1)), replay);
        assert!(r.unwrap_err().starts_with("bad credential"));
        assert_eq!(
            (ack.status, verdict),
            (Status::Ok, Status::Credential as u8)
        );

        // The answerer's answer and verdict, to a fresh dialer.
        let (mut x, mut y) = duplex(1024);
        let replay = async {
            let mut hello = [0u8; HELLO_LEN];
            y.read_exact(&mut hello).await.unwrap();
            y.write_all(&answerer_said).await.unwrap();
        };
        let (r, ()) = tokio::join!(dial(&mut x, &d, Rank(1)), replay);
        assert!(r.unwrap_err().reason.contains("bad credential"));
    });
}

/// Input that stops short fails the handshake with a reason, and does not
/// hang it.
#[test]
fn truncated_input_fails_and_does_not_hang() {
    block_on(async {
        let a = with_secret(me(), b"s3cret");
        let d = with_secret(
            Identity {
                rank: Rank(2),
                ..me()
            },
            b"s3cret",
        );
        let hello = Hello::of(&d, Rank(1), [7; NONCE_LEN]).encode();
        for cut in [2, PREFIX_LEN, HELLO_LEN - 1] {
            let (mut x, mut y) = duplex(1024);
            x.write_all(&hello[..cut]).await.unwrap();
            drop(x);
            let r = tokio::time::timeout(
                std::time::Duration::from_secs(5),
                answer(&mut y, &a, |_| true),
            );
            let e = r.await.expect("no hang").unwrap_err();
            assert!(e.contains("read hello"), "{cut}: {e}");
        }
        // a whole hello, then half a proof
        let (mut x, mut y) = duplex(1024);
        x.write_all(&hello).await.unwrap();
        x.write_all(&message::<PROOF_LEN>(KIND_PROOF, &[])[..10])
            .await
            .unwrap();
        let mut ack = [0u8; ACK_LEN];
        let (r, _) = tokio::join!(answer(&mut y, &a, |_| true), async {
            x.read_exact(&mut ack).await.unwrap();
            drop(x);
        });
        let e = r.unwrap_err();
        assert!(
            e.contains("read proof") && e.contains("did not prove"),
            "{e}"
        );
        // the dialer's side: an answer cut short
        let (mut x, mut y) = duplex(1024);
        let (r, ()) = tokio::join!(dial(&mut x, &d, Rank(1)), async {
            let mut h = [0u8; HELLO_LEN];
            y.read_exact(&mut h).await.unwrap();
            y.write_all(&Ack::of(&a, Status::Ok).encode()[..40])
                .await
                .unwrap();
            drop(y);
        });
        let e = r.unwrap_err();
        assert!(e.retry && e.reason.contains("read answer"), "{e:?}");
        // a proof of another kind is refused, not taken as one
        let (mut x, mut y) = duplex(1024);
        x.write_all(&hello).await.unwrap();
        x.write_all(&message::<VERDICT_LEN>(KIND_VERDICT, &[0]))
            .await
            .unwrap();
        let (r, _) = tokio::join!(answer(&mut y, &a, |_| true), async {
            x.read_exact(&mut ack).await.unwrap();
        });
        assert!(r.unwrap_err().contains("not a KungFu-rs proof"));
    });
}
