//! Whole endpoints: over the fake fabric with the real bootstrap, over a
//! real device when `KUNGFU_TEST_IB_DEVICE` names one, and the clear
//! error this machine gives without one.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{Peer, PeerList, Rank};
use tokio::net::TcpListener;

use crate::endpoint::{Arrival, RecvKey};
use crate::region::Region;
use crate::verbs::fake::FakeNet;
use crate::verbs::{probe, VerbsConfig, VerbsTransport};
use crate::{
    ClusterVersion, Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport,
    TransportError,
};

/// The variable that names the RDMA device of the device tests.
const DEVICE_VAR: &str = "KUNGFU_TEST_IB_DEVICE";
const LIMIT: Duration = Duration::from_secs(60);

async fn bind(n: usize) -> (Vec<TcpListener>, PeerList) {
    let mut listeners = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..n {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        peers.push(Peer {
            host: "127.0.0.1".into(),
            port: l.local_addr().expect("address").port(),
        });
        listeners.push(l);
    }
    (listeners, PeerList::new(peers).expect("distinct ports"))
}

fn config(rank: usize, peers: &PeerList, device: Option<String>, eager_max: usize) -> VerbsConfig {
    let mut c = VerbsConfig::new(
        0x7e57,
        ClusterVersion(1),
        Epoch(0),
        Rank(rank as u32),
        peers.clone(),
        device,
    );
    c.connect_timeout = Duration::from_secs(20);
    c.eager_max = eager_max;
    c.eager_slots = 8;
    c
}

/// `n` endpoints on the fake fabric (`eager_max` each, or as given).
async fn fake(eager: &[usize]) -> Result<Vec<Arc<VerbsTransport>>, TransportError> {
    let (listeners, peers) = bind(eager.len()).await;
    let net = FakeNet::new();
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let c = config(i, &peers, None, eager[i]);
            tokio::spawn(VerbsTransport::connect_fake(c, l, net.clone()))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("connect task")?);
    }
    Ok(out)
}

fn pattern(seed: usize, len: usize) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed as u8))
        .collect()
}

/// Every ordered pair exchanges an eager frame (sent from bytes) and a
/// rendezvous one (sent from a region, received into one), then all close.
async fn exchange(ts: &[Arc<VerbsTransport>], small: usize, large: usize) {
    let n = ts.len();
    let tag = OpTag {
        epoch: Epoch(0),
        op: OpId(0xface),
        seq: 0,
    };
    let h = move |chunk| Header {
        kind: FrameKind::Data,
        tag,
        chunk,
        step: 0,
        digest: 7,
        len: 0,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut tasks = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        let t = t.clone();
        tasks.push(tokio::spawn(async move {
            let others: Vec<usize> = (0..n).filter(|&j| j != i).collect();
            // receives of the large frames first, into one region
            let inbox = Region::from_vec(vec![0; large * others.len()]);
            for (k, &j) in others.iter().enumerate() {
                let key = RecvKey {
                    tag,
                    from: Rank(j as u32),
                    chunk: 1,
                    step: 0,
                };
                let mem = inbox.write(k * large..(k + 1) * large).unwrap();
                assert!(t.post_recv(key, mem).unwrap().is_none(), "posted");
            }
            let outbox = Region::from_vec(pattern(i, large).to_vec());
            for &j in &others {
                let to = Rank(j as u32);
                t.send(to, h(0), pattern(i * 8 + j, small)).await.unwrap();
                let mem = outbox.read(0..large).unwrap();
                t.send_mem(to, h(1), mem).await.unwrap();
            }
            let all = PeerSet::all(n);
            let (mut small_from, mut large_from) = (Vec::new(), Vec::new());
            while small_from.len() + large_from.len() < 2 * others.len() {
                match t.recv_in_place(tag, &all, deadline, |_, _, _| false).await {
                    Ok(Arrival::Frame(f)) => {
                        let j = f.from.idx();
                        assert_eq!((f.header.chunk, f.header.digest), (0, 7));
                        assert_eq!(f.payload, pattern(j * 8 + i, small));
                        small_from.push(j);
                    }
                    Ok(Arrival::Landed { from, header }) => {
                        assert_eq!((header.chunk, header.len), (1, large as u64));
                        large_from.push(from.idx());
                    }
                    other => panic!("rank {i}: {other:?}"),
                }
            }
            small_from.sort_unstable();
            large_from.sort_unstable();
            assert_eq!((&small_from, &large_from), (&others, &others));
            for (k, &j) in others.iter().enumerate() {
                let got = inbox.read(k * large..(k + 1) * large).unwrap();
                assert!(got.as_slice() == &pattern(j, large)[..], "from {j}");
            }
            assert_eq!(inbox.shares(), 0);
            t.wires()[0].frames_posted()
        }));
    }
    for t in tasks {
        assert_eq!(t.await.expect("rank task"), (n - 1) as u64);
    }
    let closes: Vec<_> = ts
        .iter()
        .map(|t| {
            let t = t.clone();
            tokio::spawn(async move { t.close(Duration::from_secs(5)).await })
        })
        .collect();
    for c in closes {
        c.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_over_the_fake_fabric_exchange_eager_and_rendezvous_frames() {
    tokio::time::timeout(LIMIT, async {
        let ts = fake(&[256, 256, 256]).await.expect("connect");
        assert_eq!(ts[0].wires()[0].device(), "fake0");
        let caps = ts[0].peer_caps(Rank(1)).unwrap();
        assert_eq!((caps.name, caps.eager_max), ("verbs", 256));
        assert!(caps.needs_registration && caps.borrows_sends && caps.polled);
        exchange(&ts, 200, 100_000).await;
    })
    .await
    .expect("bounded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_with_different_eager_limits_refuse_each_other() {
    tokio::time::timeout(LIMIT, async {
        match fake(&[256, 512]).await {
            Err(TransportError::Handshake { reason, .. }) => {
                assert!(reason.contains("eager limit"), "{reason}")
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("connected"),
        }
    })
    .await
    .expect("bounded");
}

/// Whether a reason says what is missing for RDMA here.
fn names_what_is_missing(reason: &str) -> bool {
    [
        "libibverbs.so.1",
        "/sys/class/infiniband_verbs",
        "no RDMA device",
    ]
    .iter()
    .any(|w| reason.contains(w))
}

#[tokio::test]
async fn without_the_device_connect_says_what_is_missing() {
    let (mut ls, peers) = bind(1).await;
    let wanted = "kungfu-no-such-device";
    let c = config(0, &peers, Some(wanted.into()), 1024);
    let e = VerbsTransport::connect(c, ls.remove(0)).await.err();
    match e {
        Some(TransportError::Unavailable { transport, reason }) => {
            assert_eq!(transport, "verbs");
            // this machine has no RDMA at all, or has some but not this
            assert!(
                names_what_is_missing(&reason) || reason.contains(wanted),
                "{reason}"
            );
            let shown = TransportError::Unavailable { transport, reason }.to_string();
            assert!(shown.starts_with("transport verbs is not available here: "));
        }
        Some(e) => panic!("{e}"),
        None => panic!("connected to a device that does not exist"),
    }
}

#[tokio::test]
#[cfg_attr(kungfu_ib_device, ignore = "KUNGFU_TEST_IB_DEVICE names a device here")]
async fn without_any_device_connect_and_probe_fail_clearly() {
    let (mut ls, peers) = bind(1).await;
    match VerbsTransport::connect(config(0, &peers, None, 1024), ls.remove(0)).await {
        Err(TransportError::Unavailable { transport, reason }) => {
            assert_eq!(transport, "verbs");
            assert!(names_what_is_missing(&reason), "{reason}");
        }
        Ok(_) => panic!("an RDMA device is present: set {DEVICE_VAR} to name it"),
        Err(e) => panic!("{e}"),
    }
    if let Err(e) = probe(None) {
        assert!(
            matches!(&e, TransportError::Unavailable { reason, .. } if names_what_is_missing(reason)),
            "{e}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    not(kungfu_ib_device),
    ignore = "needs an RDMA device: set KUNGFU_TEST_IB_DEVICE (the SoftRoCE recipe in kungfu_transport::verbs)"
)]
async fn on_the_device_three_ranks_exchange_eager_and_rendezvous_frames() {
    let dev = std::env::var(DEVICE_VAR).unwrap_or_else(|_| {
        panic!(
            "{DEVICE_VAR} is not set: name the RDMA device to test (see the SoftRoCE \
             recipe in the docs of kungfu_transport::verbs)"
        )
    });
    tokio::time::timeout(LIMIT, async {
        assert_eq!(probe(Some(&dev)).expect("probe"), dev);
        let (listeners, peers) = bind(3).await;
        let tasks: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(i, l)| {
                let c = config(i, &peers, Some(dev.clone()), 4096);
                tokio::spawn(VerbsTransport::connect(c, l))
            })
            .collect();
        let mut ts = Vec::new();
        for t in tasks {
            ts.push(t.await.expect("connect task").expect("connect"));
        }
        assert_eq!(ts[0].wires()[0].device(), dev);
        exchange(&ts, 4000, 1 << 20).await;
    })
    .await
    .expect("bounded");
}
