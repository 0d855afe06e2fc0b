//! The TCP transport on loopback: handshake refusals, hostile frames, and
//! lost peers.

use std::time::Duration;

use bytes::Bytes;
use kungfu_tests::{bind_loopback, poll_once, tcp_cluster, tcp_cluster_with};
use kungfu_topology::Rank;
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
use kungfu_transport::{
    ClusterVersion, Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport,
    TransportError,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn tag(epoch: u32, op: u64) -> OpTag {
    OpTag {
        epoch: Epoch(epoch),
        op: OpId(op),
        seq: 0,
    }
}

fn data(t: OpTag, len: usize) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: t,
        chunk: 0,
        step: 0,
        digest: 0,
        len: len as u64,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_flow_both_ways_in_any_order() {
    let (ts, _) = tcp_cluster(3, 7).await;
    let all = PeerSet::all(3);
    // many ops interleaved, received in the reverse order of sending
    for op in 0..50u64 {
        for (from, t) in ts.iter().enumerate() {
            let to = (from + 1) % 3;
            let payload = Bytes::from(vec![op as u8; (op as usize) * 1000]);
            t.send(Rank(to as u32), data(tag(0, op), 0), payload)
                .await
                .unwrap();
        }
    }
    for op in (0..50u64).rev() {
        for t in &ts {
            let f = t.recv(tag(0, op), &all, soon()).await.unwrap();
            assert_eq!(f.payload.len(), op as usize * 1000);
            assert!(f.payload.iter().all(|&b| b == op as u8));
            assert_eq!(f.header.len, f.payload.len() as u64);
        }
    }
}

/// Endpoints of another job (cluster id), another cluster version or
/// another epoch are refused, with an error that says what differs (both
/// values), on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshake_mismatches_are_refused() {
    // rank 0 (the acceptor) is at cluster 0x600d, version 2, epoch 0; rank
    // 1 dials it with one of them changed. `expect`: the dialer's error,
    // then the acceptor's; `not`: what neither may claim.
    for (what, id1, version1, epoch1, expect, not) in [
        (
            "cluster",
            0xbad,
            2,
            0,
            [
                "cluster id differs",
                "cluster id 0xbad differs from ours 0x600d",
            ],
            "version differs",
        ),
        (
            "version",
            0x600d,
            3,
            0,
            [
                "refused: cluster version differs (peer at version 2, we are at version 3)",
                "cluster version differs: peer is at version 3, we are at version 2",
            ],
            "epoch differs",
        ),
        (
            "epoch",
            0x600d,
            2,
            3,
            [
                "refused: epoch differs (peer at epoch 0, we are at epoch 3, both of version 2)",
                "epoch differs: peer is at epoch 3, we are at epoch 0 (of version 2)",
            ],
            "version differs",
        ),
    ] {
        let (ls, peers) = bind_loopback(2).await;
        let mut ls = ls.into_iter();
        let mut c0 = TcpConfig::new(0x600d, ClusterVersion(2), Epoch(0), Rank(0), peers.clone());
        c0.connect_timeout = Duration::from_millis(1500);
        let mut c1 = TcpConfig::new(
            id1,
            ClusterVersion(version1),
            Epoch(epoch1),
            Rank(1),
            peers.clone(),
        );
        c1.connect_timeout = Duration::from_millis(1500);
        let a = tokio::spawn(TcpTransport::connect(c0, ls.next().unwrap()));
        let b = tokio::spawn(TcpTransport::connect(c1, ls.next().unwrap()));
        let eb = b.await.unwrap().err().expect("dialer refused");
        assert!(eb.to_string().contains(expect[0]), "{what}: {eb}");
        assert!(!eb.to_string().contains(not), "{what}: {eb}");
        assert!(
            matches!(
                eb,
                TransportError::Handshake {
                    peer: Some(Rank(0)),
                    ..
                }
            ),
            "{eb:?}"
        );
        let ea = a.await.unwrap().err().expect("acceptor gives up");
        assert!(
            ea.to_string().contains("ranks [1] did not connect"),
            "{what}: {ea}"
        );
        assert!(ea.to_string().contains("refused"), "{what}: {ea}");
        assert!(ea.to_string().contains(expect[1]), "{what}: {ea}");
        assert!(!ea.to_string().contains(not), "{what}: {ea}");
    }
}

/// A peer that speaks hello version 1 (a shorter hello) is answered at
/// once, not left waiting for bytes it will never send, and both sides
/// say which versions differ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_hello_version_is_refused_at_once() {
    let (mut ls, peers) = bind_loopback(2).await;
    let mut cfg = TcpConfig::new(1, ClusterVersion(0), Epoch(0), Rank(0), peers.clone());
    cfg.connect_timeout = Duration::from_millis(1500);
    let server = tokio::spawn(TcpTransport::connect(cfg, ls.remove(0)));
    let p0 = peers.peer(Rank(0)).unwrap().clone();
    let mut s = TcpStream::connect((p0.host.as_str(), p0.port))
        .await
        .unwrap();
    let mut hello = [0u8; 32];
    hello[0..2].copy_from_slice(b"KH");
    hello[2] = 1;
    hello[3] = 1;
    hello[4..8].copy_from_slice(&1u32.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    let mut ack = [0u8; 96];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut ack))
        .await
        .expect("an answer before the deadline")
        .expect("an answer, not a closed stream");
    assert_eq!((&ack[0..4], ack[4]), (&b"KH\x03\x02"[..], 6), "malformed");
    let e = server.await.unwrap().err().expect("rank 1 never connected");
    assert!(
        e.to_string()
            .contains("hello version 1 (this build speaks 3)"),
        "{e}"
    );
}

/// Speaks the handshake as rank 1 of a 2-rank cluster whose rank 0 is a
/// real endpoint, and returns the raw stream.
async fn hostile_peer(epoch: u32, max_frame: usize) -> (std::sync::Arc<TcpTransport>, TcpStream) {
    let (mut ls, peers) = bind_loopback(2).await;
    let mut cfg = TcpConfig::new(1, ClusterVersion(0), Epoch(epoch), Rank(0), peers.clone());
    cfg.max_frame = max_frame;
    cfg.connect_timeout = Duration::from_secs(10);
    let l0 = ls.remove(0);
    let server = tokio::spawn(TcpTransport::connect(cfg, l0));
    let p0 = peers.peer(Rank(0)).unwrap().clone();
    let mut s = TcpStream::connect((p0.host.as_str(), p0.port))
        .await
        .unwrap();
    // hello version 3: from, to, epoch, cluster id, peer list digest,
    // cluster version, flags (0: no job secret), nonce (zeros, unused
    // without a secret)
    let mut hello = [0u8; 80];
    hello[0..2].copy_from_slice(b"KH");
    hello[2] = 3;
    hello[3] = 1;
    hello[4..8].copy_from_slice(&1u32.to_le_bytes());
    hello[8..12].copy_from_slice(&0u32.to_le_bytes());
    hello[12..16].copy_from_slice(&epoch.to_le_bytes());
    hello[16..24].copy_from_slice(&1u64.to_le_bytes());
    hello[24..32].copy_from_slice(&peers.digest().0.to_le_bytes());
    hello[32..40].copy_from_slice(&0u64.to_le_bytes());
    s.write_all(&hello).await.unwrap();
    let mut ack = [0u8; 96];
    s.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack[4], 0, "hello accepted");
    (server.await.unwrap().unwrap(), s)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_header_loses_the_peer_with_a_reason() {
    let (t, mut s) = hostile_peer(0, 1 << 20).await;
    let mut h = data(tag(0, 1), 0).encode();
    h[0] = b'X';
    s.write_all(&h).await.unwrap();
    let from: PeerSet = [Rank(1)].into_iter().collect();
    match t.recv(tag(0, 1), &from, soon()).await {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, Rank(1));
            assert!(reason.contains("protocol violation: bad magic"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    // sends to the lost peer fail too
    let r = t.send(Rank(1), data(tag(0, 2), 0), Bytes::new()).await;
    assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_frame_is_refused_before_allocation() {
    let (t, mut s) = hostile_peer(0, 1 << 20).await;
    // claims a 1 TiB payload; nothing of it follows
    let h = data(tag(0, 1), 1 << 40).encode();
    s.write_all(&h).await.unwrap();
    let from: PeerSet = [Rank(1)].into_iter().collect();
    match t.recv(tag(0, 1), &from, soon()).await {
        Err(TransportError::PeerLost { reason, .. }) => {
            assert!(reason.contains("exceeds the limit"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_epoch_frames_are_refused_and_the_stream_goes_on() {
    let (t, mut s) = hostile_peer(4, 1 << 20).await;
    let mut wire = Vec::new();
    wire.extend_from_slice(&data(tag(3, 1), 3).encode());
    wire.extend_from_slice(b"old");
    wire.extend_from_slice(&data(tag(4, 1), 3).encode());
    wire.extend_from_slice(b"new");
    s.write_all(&wire).await.unwrap();
    let from: PeerSet = [Rank(1)].into_iter().collect();
    let f = t.recv(tag(4, 1), &from, soon()).await.unwrap();
    assert_eq!(&f.payload[..], b"new");
    let (count, last) = t.refusals();
    assert_eq!(count, 1);
    assert!(
        matches!(
            last,
            Some(TransportError::StaleEpoch {
                frame: Epoch(3),
                current: Epoch(4),
                ..
            })
        ),
        "{last:?}"
    );
    // the old frame was not queued under its own tag either
    let r = t
        .recv(tag(3, 1), &from, Instant::now() + Duration::from_millis(50))
        .await;
    assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_endpoint_is_lost_to_the_others() {
    // no spin: a receive polled once is asleep, waiting for a wake-up
    let (ts, _) = tcp_cluster_with(3, 9, |c| c.spin = Duration::ZERO).await;
    let all = PeerSet::all(3);
    let mut waiter = Box::pin(ts[0].recv(tag(0, 5), &all, soon()));
    let first = poll_once(&mut waiter).await;
    assert!(first.is_pending(), "{first:?}");
    let started = std::time::Instant::now();
    ts[2].shutdown();
    match waiter.await {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, Rank(2));
            assert!(reason.contains("closed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5));
    // ranks 0 and 1 still talk
    ts[1]
        .send(Rank(0), data(tag(0, 6), 0), Bytes::from_static(b"ok"))
        .await
        .unwrap();
    let only1: PeerSet = [Rank(1)].into_iter().collect();
    assert_eq!(
        &ts[0].recv(tag(0, 6), &only1, soon()).await.unwrap().payload[..],
        b"ok"
    );
}
