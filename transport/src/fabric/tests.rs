//! The fabric wire's own tests: the provider `auto` finds, and frames from
//! a stranger's endpoint (an address no rank has) over `tcp;ofi_rxm`.

use std::time::Duration;

use kungfu_topology::PeerList;

use super::ofi::{Cqe, Ofi, Posted};
use super::post::EAGER;
use super::*;
use crate::{ClusterVersion, Epoch, FrameKind, Header, OpId, OpTag, PeerSet};

/// What `auto` finds: a hardware provider, or a reason that names each
/// one tried (this machine has no RDMA device: the latter here).
#[test]
fn hardware_provider_names_what_it_found_or_each_reason() {
    match hardware_provider() {
        Ok(p) => assert!(HARDWARE_PROVIDERS.contains(&p)),
        Err(TransportError::Unavailable { transport, reason }) => {
            assert_eq!(transport, "fabric");
            // each provider's reason, or that libfabric did not load
            let each = HARDWARE_PROVIDERS.iter().all(|p| reason.contains(p));
            assert!(each || reason.contains("libfabric"), "{reason}");
        }
        Err(e) => panic!("{e}"),
    }
}

/// A stranger's endpoint sends frames to rank 0's fabric address (which it
/// learned some way: the port is open): random bytes, a well-formed header
/// and a header whose length lies, as eager frames; then a large frame with
/// the tag of a receive rank 0 posted for rank 1. Each is dropped and
/// counted, no rank is blamed (both stay reachable), the posted receive is
/// given back and rank 1's real frame lands in it, and a small real frame
/// arrives after. Before, the forged large frame was taken for rank 1's
/// (its source was not checked when the provider could not name one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strangers_frames_are_dropped_and_no_rank_is_blamed() {
    let ls: Vec<std::net::TcpListener> = (0..2)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let peers: PeerList = ls
        .iter()
        .map(|l| l.local_addr().unwrap().to_string())
        .collect::<Vec<_>>()
        .join(",")
        .parse()
        .unwrap();
    let connect = |r: u32, l: std::net::TcpListener| {
        let mut c = FabricConfig::new(
            0x5742_4e47 ^ u64::from(std::process::id()),
            ClusterVersion(1),
            Epoch(0),
            Rank(r),
            peers.clone(),
            Some("tcp;ofi_rxm".into()),
        );
        c.domain = Some("lo".into());
        c.connect_timeout = Duration::from_secs(20);
        l.set_nonblocking(true).unwrap();
        FabricWire::connect(c, TcpListener::from_std(l).unwrap())
    };
    let mut ls = ls.into_iter();
    let (l0, l1) = (ls.next().unwrap(), ls.next().unwrap());
    let (w0, w1) = tokio::join!(connect(0, l0), connect(1, l1));
    let ((w0, m0, ..), (w1, m1, ..)) = (w0.unwrap(), w1.unwrap());
    let victim = w0.core.ofi.name().unwrap();

    let stranger = Ofi::open(Some("tcp;ofi_rxm"), Some("lo"), 64).unwrap();
    stranger.insert_all(&[victim]).unwrap();
    let tag = OpTag {
        epoch: Epoch(0),
        op: OpId(7),
        seq: 0,
    };
    let header = |len: u64| Header {
        kind: FrameKind::Data,
        tag,
        chunk: 0,
        step: 0,
        digest: 0,
        len,
    };
    let mut honest = header(4).encode().to_vec();
    honest.extend_from_slice(b"evil");
    let mut lying = header(1 << 20).encode().to_vec();
    lying.extend_from_slice(b"evil");
    let frames = [vec![0xa5u8; 40], honest, lying];
    for f in &frames {
        send_raw(&stranger, f, EAGER).await;
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while w0.core.strangers.load(Ordering::Relaxed) < frames.len() as u64 {
        assert!(
            std::time::Instant::now() < deadline,
            "not every frame was seen"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        w0.core.strangers.load(Ordering::Relaxed),
        frames.len() as u64
    );
    // nobody blamed, and the real rank 1 still gets through
    m0.check_peers(&PeerSet::all(2)).unwrap();
    m1.check_peers(&PeerSet::all(2)).unwrap();
    // The rendezvous path: rank 0 posts a receive for a large frame of rank
    // 1; the stranger's frame with its tag lands in it first, and the
    // receive is posted again, so rank 1's real frame lands after it.
    let big = 256 << 10;
    let big_tag = OpTag { op: OpId(9), ..tag };
    let region = crate::Region::from_vec(vec![0u8; big]);
    let key = crate::endpoint::RecvKey {
        tag: big_tag,
        from: Rank(1),
        chunk: 0,
        step: 0,
    };
    assert!(w0
        .post_recv(key, region.write(0..big).unwrap())
        .unwrap()
        .is_none());
    let mut probe = header(big as u64);
    probe.tag = big_tag;
    let mut forged = probe.encode().to_vec();
    forged.extend(std::iter::repeat_n(0xeeu8, big));
    send_raw(
        &stranger,
        &forged,
        super::post::rendezvous_tag(Rank(1), &probe),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while w0.core.strangers.load(Ordering::Relaxed) < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the forged large frame was not seen"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    w1.send(Rank(0), probe, bytes::Bytes::from(vec![0x42u8; big]))
        .await
        .unwrap();
    let soon = crate::Instant::now() + Duration::from_secs(10);
    match m0
        .recv_arrival(big_tag, &PeerSet::all(2), soon)
        .await
        .unwrap()
    {
        crate::Arrival::Landed { from, .. } => assert_eq!(from, Rank(1)),
        _ => panic!("rank 1's large frame did not land in the receive"),
    }
    let got = region.read(0..big).unwrap();
    assert!(
        got.as_ref().iter().all(|&b| b == 0x42),
        "the real frame did not land"
    );
    m0.check_peers(&PeerSet::all(2)).unwrap();

    drop(stranger);
    let real = OpTag { op: OpId(8), ..tag };
    let mut h = header(0);
    h.tag = real;
    w1.send(Rank(0), h, bytes::Bytes::from_static(b"real"))
        .await
        .unwrap();
    let soon = crate::Instant::now() + Duration::from_secs(10);
    let f = m0.recv(real, &PeerSet::all(2), soon).await.unwrap();
    assert_eq!((f.from, &f.payload[..]), (Rank(1), &b"real"[..]));
}

/// Sends `frame` from the raw endpoint `ep` to its address 0 with `tag`,
/// and waits for the send to complete.
async fn send_raw(ep: &Ofi, frame: &[u8], tag: u64) {
    let mut ctx = Box::new(kungfu_fabric_sys::fi_context2::default());
    let iov = [libc::iovec {
        iov_base: frame.as_ptr() as *mut libc::c_void,
        iov_len: frame.len(),
    }];
    let mut desc = [std::ptr::null_mut(); 1];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // SAFETY: `frame` and `ctx` live until the completion read below.
    while let Posted::Again = unsafe { ep.tsend(&iov, &mut desc, 0, tag, &mut *ctx) }.unwrap() {
        let _ = ep.read_cq(&mut Vec::new(), 8);
        assert!(std::time::Instant::now() < deadline, "could not send");
    }
    let mut out = Vec::new();
    while !out.iter().any(|c| matches!(c, Cqe::Done { .. })) {
        ep.read_cq(&mut out, 8).unwrap();
        assert!(
            std::time::Instant::now() < deadline,
            "the send never completed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}
