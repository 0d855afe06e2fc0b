//! QUIC's mutual TLS: a peer without a certificate of the job is refused,
//! and a refused intruder does not stop the real peer from connecting;
//! the job's secret alone is enough (certificates made from it), and a
//! certificate the job does not vouch for is refused.

use std::time::Duration;

use bytes::Bytes;
use kungfu_tests::conformance::clusters::{bind_udp, quic_config};
use kungfu_tests::conformance::ConformanceConfig;
use kungfu_tests::unique_cluster_id;
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::auth::JobSecret;
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

/// QUIC from the job's secret alone (no PKI of the user's): both ranks
/// make their certificates from the secret, prove it in the handshake, and
/// a frame passes both ways.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_job_secret_alone_is_enough() {
    let (mut sockets, peers) = bind_udp(2);
    let job = JobSecret::new(b"the job's secret").unwrap();
    let id = unique_cluster_id();
    let wait = Duration::from_secs(10);
    let s1 = sockets.pop().unwrap();
    let s0 = sockets.pop().unwrap();
    let keyed = |r: u32| {
        let mut c = config(
            id,
            r,
            &peers,
            QuicTls::from_secret(&job, &r.to_string()).unwrap(),
            wait,
        );
        c.secret = Some(job.clone());
        c
    };
    let (t0, t1) = tokio::join!(
        QuicTransport::connect(keyed(0), s0),
        QuicTransport::connect(keyed(1), s1)
    );
    let (t0, t1) = (t0.unwrap(), t1.unwrap());
    let (tag, header) = data_frame(t0.epoch(), 9);
    t1.send(Rank(0), header, Bytes::from_static(b"keyed"))
        .await
        .unwrap();
    let soon = tokio::time::Instant::now() + Duration::from_secs(10);
    let f = t0.recv(tag, &PeerSet::all(2), soon).await.unwrap();
    assert_eq!(&f.payload[..], b"keyed");
    tokio::join!(
        t0.close(Duration::from_secs(2)),
        t1.close(Duration::from_secs(2))
    );
}

/// What the job does not vouch for is refused: a certificate from another
/// secret's CA (at TLS), and a certificate of a CA every rank trusts (the
/// user's, say) held by a process without the job's secret (at the
/// handshake on the connection's first stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_the_job_does_not_vouch_for_is_refused() {
    let job = JobSecret::new(b"the job's secret").unwrap();
    let stranger = JobSecret::new(b"a guess").unwrap();
    let users = JobCa::new().unwrap();
    let wait = Duration::from_secs(2);
    // (what, rank 0's certificate, rank 1's certificate, rank 1's secret);
    // rank 0 holds the job's secret
    let cases = [
        (
            "another secret's CA",
            QuicTls::from_secret(&job, "0").unwrap(),
            QuicTls::from_secret(&stranger, "1").unwrap(),
            Some(stranger.clone()),
        ),
        (
            "the user's CA, no secret",
            users.issue("0").unwrap(),
            users.issue("1").unwrap(),
            None,
        ),
        (
            "the user's CA, another secret",
            users.issue("0").unwrap(),
            users.issue("1").unwrap(),
            Some(stranger.clone()),
        ),
    ];
    for (what, tls0, tls1, secret1) in cases {
        let (mut sockets, peers) = bind_udp(2);
        let id = unique_cluster_id();
        let s1 = sockets.pop().unwrap();
        let s0 = sockets.pop().unwrap();
        let mut c0 = config(id, 0, &peers, tls0, wait);
        c0.secret = Some(job.clone());
        let mut c1 = config(id, 1, &peers, tls1, wait);
        c1.secret = secret1;
        let (r0, r1) = tokio::join!(
            QuicTransport::connect(c0, s0),
            QuicTransport::connect(c1, s1)
        );
        assert!(r0.is_err(), "{what}: rank 0 connected");
        assert!(r1.is_err(), "{what}: rank 1 connected");
        let e0 = r0.err().unwrap().to_string();
        assert!(e0.contains("[1] did not connect"), "{what}: {e0}");
    }
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
