//! Point-to-point messages ([`kungfu_collectives::sendrecv::Mailbox`]) over
//! the in-memory transport, frames delayed at random.

use super::*;
use kungfu_collectives::p2p::P2pError;
use kungfu_collectives::sendrecv::Mailbox;
use kungfu_transport::Instant;

/// `n` ranks with a mailbox each, frames of at most `max_frame` bytes.
fn mailboxes(
    rt: &tokio::runtime::Runtime,
    n: usize,
    seed: u64,
    max_frame: usize,
) -> Vec<Arc<Mailbox<MemTransport>>> {
    let mem = MemConfig {
        delay: Some((seed, Duration::from_micros(300))),
        max_frame,
        ..MemConfig::default()
    };
    let cfg = SessionConfig {
        op_timeout: LONG,
        ..SessionConfig::default()
    };
    let _g = rt.enter();
    Session::local_cluster(n, mem, cfg)
        .iter()
        .map(|s| Arc::new(Mailbox::new(s)))
        .collect()
}

fn soon(d: Duration) -> Instant {
    Instant::now() + d
}

fn bytes_of(from: usize, k: usize, len: usize) -> Bytes {
    (0..len)
        .map(|i| (from * 31 + k * 7 + i) as u8)
        .collect::<Vec<u8>>()
        .into()
}

#[test]
fn messages_arrive_whole_and_in_order_per_sender_and_tag() {
    let rt = rt();
    for seed in 0..4 {
        let m = mailboxes(&rt, 3, seed, 100);
        rt.block_on(async {
            // ranks 1 and 2 each send 5 messages under tag 9 and one
            // under tag 4 to rank 0 (several frames each), which receives
            // tag 4 first, then tag 9 from each in turn
            let mut sends = Vec::new();
            for (from, mb) in m.iter().enumerate().skip(1) {
                // issued in order (each takes its place at the call), then
                // run at once: a send ends only once its receive matched
                for k in 0..5 {
                    let d = bytes_of(from, k, 250 + k);
                    sends.push(tokio::spawn(mb.send(Rank(0), 9, d, soon(LONG))));
                }
                let d = bytes_of(from, 99, 3);
                sends.push(tokio::spawn(mb.send(Rank(0), 4, d, soon(LONG))));
            }
            for from in 1..3u32 {
                let (who, got) = m[0].recv(Some(Rank(from)), 4, 3, soon(LONG)).await.unwrap();
                assert_eq!((who, got), (Rank(from), bytes_of(from as usize, 99, 3)));
            }
            for k in 0..5 {
                for from in 1..3u32 {
                    let (who, got) = m[0]
                        .recv(Some(Rank(from)), 9, 250 + k, soon(LONG))
                        .await
                        .unwrap();
                    assert_eq!(who, Rank(from));
                    assert_eq!(got, bytes_of(from as usize, k, 250 + k), "seed {seed}");
                }
            }
            for s in sends {
                s.await.unwrap().unwrap();
            }
        });
    }
}

#[test]
fn a_receive_from_any_rank_names_the_sender() {
    let rt = rt();
    let m = mailboxes(&rt, 4, 7, 64);
    rt.block_on(async {
        let mut sends = Vec::new();
        for (from, mb) in m.iter().enumerate().skip(1) {
            let d = bytes_of(from, 0, 100);
            sends.push(tokio::spawn(mb.send(Rank(0), 5, d, soon(LONG))));
        }
        let mut seen = Vec::new();
        for _ in 1..4 {
            let (who, got) = m[0].recv(None, 5, 100, soon(LONG)).await.unwrap();
            assert_eq!(got, bytes_of(who.idx(), 0, 100));
            seen.push(who.0);
        }
        seen.sort_unstable();
        assert_eq!(seen, [1, 2, 3]);
        for s in sends {
            s.await.unwrap().unwrap();
        }
        // empty messages too
        let mb = m[2].clone();
        let s = tokio::spawn(async move { mb.send(Rank(1), 0, Bytes::new(), soon(LONG)).await });
        let (who, got) = m[1].recv(None, 0, 0, soon(LONG)).await.unwrap();
        assert_eq!((who, got.len()), (Rank(2), 0));
        s.await.unwrap().unwrap();
    });
}

#[test]
fn a_length_mismatch_fails_both_ends_and_the_next_message_goes_through() {
    let rt = rt();
    let m = mailboxes(&rt, 2, 3, 1 << 20);
    rt.block_on(async {
        let mb = m[1].clone();
        let s = tokio::spawn(async move {
            let first = mb
                .send(Rank(0), 1, Bytes::from(vec![1u8; 10]), soon(LONG))
                .await;
            let second = mb
                .send(Rank(0), 1, Bytes::from(vec![2u8; 8]), soon(LONG))
                .await;
            (first, second)
        });
        let e = m[0]
            .recv(Some(Rank(1)), 1, 8, soon(LONG))
            .await
            .unwrap_err();
        assert!(
            matches!(
                e,
                P2pError::Length {
                    sent: 10,
                    expected: 8,
                    ..
                }
            ),
            "{e}"
        );
        let (_, got) = m[0].recv(Some(Rank(1)), 1, 8, soon(LONG)).await.unwrap();
        assert_eq!(got, vec![2u8; 8]);
        let (first, second) = s.await.unwrap();
        let e = first.unwrap_err();
        assert!(
            e.to_string().contains("sent 10 bytes under tag 1")
                && e.to_string().contains("expected 8"),
            "{e}"
        );
        second.unwrap();
    });
}

#[test]
fn waits_end_at_their_deadline_and_bad_peers_are_refused() {
    let rt = rt();
    let m = mailboxes(&rt, 2, 1, 1 << 20);
    rt.block_on(async {
        let short = Duration::from_millis(200);
        let e = m[0]
            .recv(Some(Rank(1)), 3, 4, soon(short))
            .await
            .unwrap_err();
        assert!(matches!(e, P2pError::Timeout(_)), "{e}");
        let e = m[0].recv(None, 3, 4, soon(short)).await.unwrap_err();
        assert!(matches!(e, P2pError::Timeout(_)), "{e}");
        // nobody receives: the send waits for its clearance until then
        let e = m[0]
            .send(Rank(1), 3, Bytes::from_static(b"abcd"), soon(short))
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("timed out") || e.to_string().contains("timeout"),
            "{e}"
        );
        for bad in [Rank(0), Rank(2)] {
            let e = m[0]
                .send(bad, 0, Bytes::new(), soon(short))
                .await
                .unwrap_err();
            assert!(matches!(e, P2pError::InvalidArgument(_)), "{e}");
            let e = m[0].recv(Some(bad), 0, 0, soon(short)).await.unwrap_err();
            assert!(matches!(e, P2pError::InvalidArgument(_)), "{e}");
        }
    });
}

#[test]
fn receives_take_messages_in_the_order_they_were_posted() {
    let rt = rt();
    let m = mailboxes(&rt, 2, 5, 1 << 20);
    rt.block_on(async {
        // posted in this order (at the calls), awaited the other way
        let first = tokio::spawn(m[0].recv(Some(Rank(1)), 2, 4, soon(LONG)));
        let second = m[0].recv(None, 2, 4, soon(LONG));
        let a = tokio::spawn(m[1].send(Rank(0), 2, Bytes::from_static(b"one!"), soon(LONG)));
        let b = tokio::spawn(m[1].send(Rank(0), 2, Bytes::from_static(b"two!"), soon(LONG)));
        assert_eq!(
            second.await.unwrap(),
            (Rank(1), Bytes::from_static(b"two!"))
        );
        assert_eq!(
            first.await.unwrap().unwrap(),
            (Rank(1), Bytes::from_static(b"one!"))
        );
        a.await.unwrap().unwrap();
        b.await.unwrap().unwrap();
    });
}
