//! QUIC's mutual TLS: a peer without a certificate of the job is refused,
//! and a refused intruder does not stop the real peer from connecting.

use std::time::Duration;

use bytes::Bytes;
use kungfu_tests::conformance::clusters::{bind_udp, quic_config};
use kungfu_tests::conformance::ConformanceConfig;
use kungfu_tests::unique_cluster_id;
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::quic::{JobCa, QuicTls, QuicTransport};
use kungfu_transport::{FrameKind, Header, OpId, OpTag, PeerSet, Transport, TransportError};

fn config(
    id: u64,
    rank: u32,
    peers: &PeerList,
    tls: QuicTls,
    wait: Duration,
) -> kungfu_transport::quic::QuicConfig {
    let mut c = quic_config(&ConformanceConfig::default(), id, Rank(rank), peers, tls);
    c.connect_timeout = wait;
    c
}

/// The tag and header of a data frame of op `op`.
fn data_frame(epoch: kungfu_transport::Epoch, op: u64) -> (OpTag, Header) {
    let tag = OpTag {
        epoch,
        op: OpId(op),
        seq: 0,
    };
    let header = Header {
        kind: FrameKind::Data,
        tag,
        chunk: 0,
        step: 0,
        digest: 0,
        len: 0,
    };
    (tag, header)
}

/// Rank 1 holds a certificate of another CA: both sides fail, each saying
/// why (the acceptor lists the refusal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_of_another_ca_is_refused() {
    let (mut sockets, peers) = bind_udp(2);
    let (job, other) = (JobCa::new().unwrap(), JobCa::new().unwrap());
    let id = unique_cluster_id();
    let wait = Duration::from_secs(2);
    let s1 = sockets.pop().unwrap();
    let s0 = sockets.pop().unwrap();
    let c0 = config(id, 0, &peers, job.issue("0").unwrap(), wait);
    let c1 = config(id, 1, &peers, other.issue("1").unwrap(), wait);
    let (r0, r1) = tokio::join!(
        QuicTransport::connect(c0, s0),
        QuicTransport::connect(c1, s1)
    );
    let e0 = r0.err().expect("rank 0 must not connect");
    let e1 = r1.err().expect("rank 1 must not connect");
    assert!(matches!(e1, TransportError::Handshake { .. }), "{e1}");
    assert!(e1.to_string().contains("TLS"), "{e1}");
    let e0 = e0.to_string();
    assert!(
        e0.contains("[1] did not connect") && e0.contains("refused"),
        "{e0}"
    );
}

/// An intruder with a foreign certificate dials rank 0 first; rank 0
/// refuses it and goes on waiting, and the real rank 1 connects: a frame
/// passes both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_intruder_does_not_stop_the_real_peer() {
    let (mut sockets, peers) = bind_udp(2);
    let (job, other) = (JobCa::new().unwrap(), JobCa::new().unwrap());
    let id = unique_cluster_id();
    let wait = Duration::from_secs(10);
    let s1 = sockets.pop().unwrap();
    let s0 = sockets.pop().unwrap();
    let rank0 = tokio::spawn(QuicTransport::connect(
        config(id, 0, &peers, job.issue("0").unwrap(), wait),
        s0,
    ));
    let intruder_socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let intruder = config(
        id,
        1,
        &peers,
        other.issue("x").unwrap(),
        Duration::from_secs(2),
    );
    let refused = QuicTransport::connect(intruder, intruder_socket).await;
    assert!(refused.is_err(), "the intruder connected");
    let t1 = QuicTransport::connect(config(id, 1, &peers, job.issue("1").unwrap(), wait), s1)
        .await
        .unwrap();
    let t0 = rank0.await.unwrap().unwrap();
    let (tag, header) = data_frame(t0.epoch(), 7);
    t1.send(Rank(0), header, Bytes::from_static(b"hello"))
        .await
        .unwrap();
    t0.send(Rank(1), header, Bytes::from_static(b"back"))
        .await
        .unwrap();
    let soon = tokio::time::Instant::now() + Duration::from_secs(10);
    let f = t0.recv(tag, &PeerSet::all(2), soon).await.unwrap();
    assert_eq!(&f.payload[..], b"hello");
    let f = t1.recv(tag, &PeerSet::all(2), soon).await.unwrap();
    assert_eq!(&f.payload[..], b"back");
    tokio::join!(
        t0.close(Duration::from_secs(2)),
        t1.close(Duration::from_secs(2))
    );
}

/// Not a test: prints how fast 16 MiB frames go over one QUIC connection,
/// and quinn's view of the path (`cargo test --release -- --ignored
/// --nocapture quic_path_report`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a diagnostic report, not a check"]
async fn quic_path_report() {
    let ts =
        <kungfu_tests::conformance::clusters::Quic as kungfu_tests::conformance::Cluster>::connect(
            2,
            ConformanceConfig::default(),
        )
        .await;
    let payload = Bytes::from(vec![7u8; 16 << 20]);
    let (tag, header) = data_frame(ts[0].epoch(), 9);
    for round in 0..3 {
        let t = std::time::Instant::now();
        let (a, b) = (ts[0].clone(), payload.clone());
        let s = tokio::spawn(async move { a.send(Rank(1), header, b).await.unwrap() });
        let far = tokio::time::Instant::now() + Duration::from_secs(60);
        let f = ts[1].recv(tag, &PeerSet::all(2), far).await.unwrap();
        s.await.unwrap();
        let dt = t.elapsed();
        println!(
            "round {round}: {} MiB in {dt:?}: {:.2} GB/s",
            f.payload.len() >> 20,
            f.payload.len() as f64 / dt.as_secs_f64() / 1e9
        );
    }
    for (r, st) in ts[0].wires()[0].stats() {
        println!("to {r}: {st:?}");
    }
}
