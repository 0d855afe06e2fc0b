//! Authenticated links (the job secret, `kungfu_transport::handshake`) on
//! TCP, libfabric (tcp;ofi_rxm: its TCP bootstrap) and shared memory:
//! intruders without the secret, or replaying what they recorded, are
//! refused as a bad credential, and the job connects and works anyway.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_tests::{bind_loopback, unique_cluster_id};
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::auth::JobSecret;
use kungfu_transport::fabric::{FabricConfig, FabricTransport};
use kungfu_transport::handshake::{self, Identity, ACK_LEN, HELLO_LEN};
use kungfu_transport::shm::{ShmConfig, ShmTransport};
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
use kungfu_transport::{
    ClusterVersion, Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn secret(s: &str) -> JobSecret {
    JobSecret::new(s.as_bytes()).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// Rank 1 sends rank 0 a frame, which arrives.
async fn a_frame_flows<T: Transport>(t0: &T, t1: &T) {
    let tag = OpTag {
        epoch: Epoch(0),
        op: OpId(7),
        seq: 0,
    };
    let h = Header {
        kind: FrameKind::Data,
        tag,
        chunk: 0,
        step: 0,
        digest: 0,
        len: 0,
    };
    t1.send(Rank(0), h, Bytes::from_static(b"authentic"))
        .await
        .unwrap();
    let from: PeerSet = [Rank(1)].into_iter().collect();
    let f = t0.recv(tag, &from, soon()).await.unwrap();
    assert_eq!(&f.payload[..], b"authentic");
}

/// What rank 1 of cluster `id` says when it dials rank 0 with `secret`
/// (its hello and its proof), as an eavesdropper records it: the
/// handshake run in memory against a rank 0 that holds the secret.
async fn recorded_dial(id: u64, peers: &PeerList, secret: &JobSecret) -> Vec<u8> {
    let me = |r: u32| {
        Identity::of(
            id,
            ClusterVersion(0),
            Epoch(0),
            Rank(r),
            peers,
            Some(secret),
        )
        .unwrap()
    };
    let (mut d, m1) = tokio::io::duplex(4096);
    let (m2, mut a) = tokio::io::duplex(4096);
    let (mut m1r, mut m1w) = tokio::io::split(m1);
    let (mut m2r, mut m2w) = tokio::io::split(m2);
    let tap = tokio::spawn(async move {
        let mut said = Vec::new();
        let mut b = [0u8; 256];
        while let Ok(n @ 1..) = m1r.read(&mut b).await {
            said.extend_from_slice(&b[..n]);
            if m2w.write_all(&b[..n]).await.is_err() {
                break;
            }
        }
        said
    });
    let back = tokio::spawn(async move { tokio::io::copy(&mut m2r, &mut m1w).await });
    let (one, zero) = (me(1), me(0));
    let (dialed, answered) = tokio::join!(
        handshake::dial(&mut d, &one, Rank(0)),
        handshake::answer(&mut a, &zero, |r| r == Rank(1))
    );
    assert_eq!((dialed, answered), (Ok(()), Ok(Rank(1))));
    drop((d, a));
    let said = tap.await.unwrap();
    let _ = back.await;
    said
}

/// Intruders at rank 0's listening address `addr` while it waits for rank
/// 1: one dials with the wrong secret, one replays rank 1's recorded hello
/// and proof. Both are refused as a bad credential.
async fn intrude(addr: (String, u16), id: u64, peers: &PeerList, job: &JobSecret) {
    let wrong = Identity::of(
        id,
        ClusterVersion(0),
        Epoch(0),
        Rank(1),
        peers,
        Some(&secret("guess")),
    )
    .unwrap();
    let mut s = TcpStream::connect(addr.clone()).await.unwrap();
    let e = handshake::dial(&mut s, &wrong, Rank(0)).await.unwrap_err();
    assert!(!e.retry && e.reason.contains("bad credential"), "{e:?}");

    let said = recorded_dial(id, peers, job).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&said[..HELLO_LEN]).await.unwrap();
    let mut ack = vec![0u8; ACK_LEN];
    s.read_exact(&mut ack).await.unwrap();
    assert_eq!(ack[4], 0, "the hello itself is fine");
    s.write_all(&said[HELLO_LEN..]).await.unwrap();
    let mut verdict = [0u8; 8];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut verdict))
        .await
        .expect("a verdict, not a hang")
        .unwrap();
    assert_eq!(&verdict[..5], b"KH\x03\x04\x08", "refused: bad credential");
}

fn tcp_config(id: u64, rank: u32, peers: &PeerList, s: &JobSecret) -> TcpConfig {
    let mut c = TcpConfig::new(id, ClusterVersion(0), Epoch(0), Rank(rank), peers.clone());
    c.secret = Some(s.clone());
    c.connect_timeout = Duration::from_secs(20);
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_intruders_are_refused_and_the_job_connects() {
    let job = secret("the job's secret");
    let (mut ls, peers) = bind_loopback(2).await;
    let id = unique_cluster_id();
    let r0 = tokio::spawn(TcpTransport::connect(
        tcp_config(id, 0, &peers, &job),
        ls.remove(0),
    ));
    let p0 = peers.peer(Rank(0)).unwrap();
    intrude((p0.host.clone(), p0.port), id, &peers, &job).await;
    let t1 = TcpTransport::connect(tcp_config(id, 1, &peers, &job), ls.remove(0))
        .await
        .unwrap();
    let t0 = r0.await.unwrap().unwrap();
    a_frame_flows(&*t0, &*t1).await;
}

/// Rank 0 waits in vain: its error names the refused intruder's bad
/// credential; a rank without a secret is refused as well, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_refusals_name_the_bad_credential() {
    let job = secret("the job's secret");
    let (mut ls, peers) = bind_loopback(2).await;
    let id = unique_cluster_id();
    let mut c0 = tcp_config(id, 0, &peers, &job);
    c0.connect_timeout = Duration::from_millis(1500);
    let r0 = tokio::spawn(TcpTransport::connect(c0, ls.remove(0)));
    let mut c1 = tcp_config(id, 1, &peers, &job);
    c1.secret = None;
    c1.connect_timeout = Duration::from_millis(1500);
    let e1 = TcpTransport::connect(c1, ls.remove(0)).await.err().unwrap();
    assert!(
        e1.to_string()
            .contains("bad credential: the peer holds a job secret"),
        "{e1}"
    );
    let e0 = r0.await.unwrap().err().unwrap().to_string();
    assert!(e0.contains("ranks [1] did not connect"), "{e0}");
    assert!(
        e0.contains("bad credential: the peer holds no job secret"),
        "{e0}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fabric_intruders_are_refused_and_the_job_connects() {
    let job = secret("the job's secret");
    let (mut ls, peers) = bind_loopback(2).await;
    let id = unique_cluster_id();
    let config = |rank: u32| {
        let mut c = FabricConfig::new(
            id,
            ClusterVersion(0),
            Epoch(0),
            Rank(rank),
            peers.clone(),
            Some("tcp;ofi_rxm".into()),
        );
        c.domain = Some("lo".into());
        c.secret = Some(job.clone());
        c.connect_timeout = Duration::from_secs(20);
        c
    };
    let r0 = tokio::spawn(FabricTransport::connect(config(0), ls.remove(0)));
    let p0 = peers.peer(Rank(0)).unwrap();
    intrude((p0.host.clone(), p0.port), id, &peers, &job).await;
    let t1 = FabricTransport::connect(config(1), ls.remove(0))
        .await
        .unwrap();
    let t0: Arc<FabricTransport> = r0.await.unwrap().unwrap();
    a_frame_flows(&*t0, &*t1).await;
}

fn shm_config(id: u64, rank: u32, s: Option<&JobSecret>) -> ShmConfig {
    let mut c = ShmConfig::new(id, ClusterVersion(0), Epoch(0), Rank(rank), 2);
    c.secret = s.cloned();
    c.ring_bytes = 4096;
    c.connect_timeout = Duration::from_secs(10);
    c
}

/// Rings sealed with the job's secret connect; a rank with another secret,
/// or none, refuses its peer's ring (and the peer its ring) as a bad
/// credential, and the connect fails cleanly on both sides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_rings_are_sealed_with_the_job_secret() {
    let job = secret("the job's secret");
    let id = unique_cluster_id();
    let r0 = tokio::spawn(ShmTransport::connect(shm_config(id, 0, Some(&job))));
    let t1 = ShmTransport::connect(shm_config(id, 1, Some(&job)))
        .await
        .unwrap();
    let t0 = r0.await.unwrap().unwrap();
    a_frame_flows(&*t0, &*t1).await;

    for other in [Some(secret("guess")), None] {
        let id = unique_cluster_id();
        let quick = |rank, s| ShmConfig {
            connect_timeout: Duration::from_secs(3),
            ..shm_config(id, rank, s)
        };
        let r0 = tokio::spawn(ShmTransport::connect(quick(0, Some(&job))));
        let e1 = ShmTransport::connect(quick(1, other.as_ref()))
            .await
            .err()
            .expect("refused")
            .to_string();
        let e0 = r0.await.unwrap().err().expect("refused").to_string();
        // The first to refuse removes the ring it made, so the other may
        // find none to refuse before its deadline.
        assert!(
            [&e0, &e1]
                .iter()
                .any(|e| e.contains("ring refused: bad credential")),
            "{e0}\n{e1}"
        );
        let left: Vec<_> = std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.starts_with(&kungfu_transport::shm::ring_file_prefix(id)))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
}
