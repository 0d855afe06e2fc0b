//! The shared-memory transport: frames of every size through small rings,
//! in any order, closing, and no files left behind.

use std::time::Duration;

use bytes::Bytes;
use kungfu_tests::{poll_once, shm_cluster, unique_cluster_id};
use kungfu_topology::Rank;
use kungfu_transport::shm::{ShmConfig, ShmTransport};
use kungfu_transport::{
    Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport, TransportError,
};

fn tag(op: u64) -> OpTag {
    OpTag {
        epoch: Epoch(0),
        op: OpId(op),
        seq: 0,
    }
}

fn data(t: OpTag) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: t,
        chunk: 0,
        step: 0,
        digest: 0,
        len: 0,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

fn leftover_files(id: u64) -> Vec<String> {
    let prefix = format!("kungfu-{id:016x}-");
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default()
}

/// Payloads from empty to many times the ring size, between every pair,
/// received in the reverse order of sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_larger_than_the_ring_flow_both_ways() {
    let ts = shm_cluster(3, 4096).await;
    let all = PeerSet::all(3);
    let sizes = [0usize, 1, 40, 4095, 4096, 4097, 100_000, 1 << 20];
    let mut sends = Vec::new();
    for (k, &len) in sizes.iter().enumerate() {
        for (from, t) in ts.iter().enumerate() {
            let t = t.clone();
            let payload = Bytes::from(
                (0..len)
                    .map(|i| (i * 31 + k + from) as u8)
                    .collect::<Vec<u8>>(),
            );
            let to = Rank(((from + 1) % 3) as u32);
            sends.push(tokio::spawn(async move {
                t.send(to, data(tag(k as u64)), payload).await
            }));
        }
    }
    for (k, &len) in sizes.iter().enumerate().rev() {
        for (r, t) in ts.iter().enumerate() {
            let f = t.recv(tag(k as u64), &all, soon()).await.unwrap();
            let from = (r + 2) % 3;
            assert_eq!(f.from, Rank(from as u32));
            assert_eq!(f.payload.len(), len);
            assert!(f
                .payload
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i * 31 + k + from) as u8));
        }
    }
    for s in sends {
        s.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rings_leave_no_files_and_closing_is_seen() {
    let id = unique_cluster_id();
    let tasks: Vec<_> = (0..2)
        .map(|i| {
            let mut cfg = ShmConfig::new(id, Epoch(0), Rank(i), 2);
            cfg.ring_bytes = 8192;
            // no spin: a receive polled once is asleep, waiting for a wake-up
            cfg.spin = Duration::ZERO;
            tokio::spawn(ShmTransport::connect(cfg))
        })
        .collect();
    let mut ts = Vec::new();
    for t in tasks {
        ts.push(t.await.unwrap().unwrap());
    }
    assert!(leftover_files(id).is_empty(), "{:?}", leftover_files(id));
    let from1: PeerSet = [Rank(1)].into_iter().collect();
    let mut waiter = Box::pin(ts[0].recv(tag(9), &from1, soon()));
    let first = poll_once(&mut waiter).await;
    assert!(first.is_pending(), "{first:?}");
    ts[1].shutdown();
    match waiter.await {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, Rank(1));
            assert!(reason.contains("closed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

/// A peer that never shows up: connect fails by its deadline, says which
/// ring is missing, and removes the files it created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_peer_fails_the_connect_cleanly() {
    let id = unique_cluster_id();
    let mut cfg = ShmConfig::new(id, Epoch(0), Rank(0), 2);
    cfg.connect_timeout = Duration::from_millis(300);
    let e = ShmTransport::connect(cfg).await.err().expect("no peer");
    assert!(e.to_string().contains("did not appear"), "{e}");
    assert!(leftover_files(id).is_empty(), "{:?}", leftover_files(id));
}

/// Frames that fit the ring go straight from the caller's bytes; larger
/// ones are refused by `try_send_now` (the caller falls back to `send`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_send_now_writes_what_fits() {
    let ts = shm_cluster(2, 4096).await;
    let from0: PeerSet = [Rank(0)].into_iter().collect();
    assert!(ts[0]
        .try_send_now(Rank(1), data(tag(1)), b"direct")
        .unwrap());
    let f = ts[1].recv(tag(1), &from0, soon()).await.unwrap();
    assert_eq!(&f.payload[..], b"direct");
    assert!(!ts[0]
        .try_send_now(Rank(1), data(tag(2)), &[0u8; 8192])
        .unwrap());
    assert!(matches!(
        ts[0].try_send_now(Rank(5), data(tag(3)), b"x"),
        Err(TransportError::NoSuchPeer { .. })
    ));
}
