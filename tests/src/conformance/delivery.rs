//! Cases of delivery: every byte, in place, in any order.

use std::sync::{Arc, Mutex};

use super::{
    check_same, join_all, one, others, poll_once, queued, rank, receive, recv_ok, send_ok, shuffle,
    soon, spawn_sends, tag, Cluster, ConformanceConfig, Expect, How, Msg,
};
use kungfu_transport::mem::SeededRng;
use kungfu_transport::{PeerSet, Region, Transport, HEADER_LEN};

/// Payload sizes that find the edges: empty, one byte, odd, around the
/// ring's size and the header's, several rings (a frame that streams
/// through a ring and wraps it), more than one socket read (64 KiB).
fn sizes(cfg: &ConformanceConfig) -> Vec<usize> {
    let ring = cfg.ring_bytes;
    vec![
        0,
        1,
        2,
        3,
        5,
        HEADER_LEN - 1,
        HEADER_LEN,
        HEADER_LEN + 1,
        1023,
        ring - HEADER_LEN,
        ring - 1,
        ring,
        ring + 1,
        3 * ring + 7,
        65_537,
        200_003,
        1 << 20,
    ]
}

/// Frames of many sizes (empty, 1, odd, around a ring and a header, larger
/// than a ring, larger than a socket read) between every ordered pair of three
/// ranks arrive intact: first through `recv`, then through `recv_in_place`
/// (lent or owned, as the backend declares). Each receiver takes the
/// sizes in the reverse order of sending, so large frames wait queued.
pub async fn exact_delivery<C: Cluster>() {
    let n = 3;
    let cfg = ConformanceConfig::default();
    let ts = C::connect(n, cfg.clone()).await;
    let sizes = sizes(&cfg);
    for (seq, how) in [(0, How::Owned), (1, How::InPlace(true))] {
        let mut to_each: Vec<Vec<Msg>> = vec![Vec::new(); n];
        let mut sends = Vec::new();
        for (i, t) in ts.iter().enumerate() {
            let mut msgs = Vec::new();
            for (k, &len) in sizes.iter().enumerate() {
                for j in others(n, rank(i)) {
                    let m = Msg::new(rank(i), j, tag(cfg.epoch, k as u64, seq), 0, len);
                    to_each[j.idx()].push(m.clone());
                    msgs.push(m);
                }
            }
            sends.push(spawn_sends(C::name(), t, msgs));
        }
        let mut recvs = Vec::new();
        for (j, msgs) in to_each.into_iter().enumerate() {
            let t = ts[j].clone();
            let (sizes, epoch) = (sizes.clone(), cfg.epoch);
            recvs.push(tokio::spawn(async move {
                let mut expect = Expect::new::<C>();
                msgs.iter().for_each(|m| expect.add(m));
                let all = PeerSet::all(n);
                for k in (0..sizes.len()).rev() {
                    for _ in 0..n - 1 {
                        let tag = tag(epoch, k as u64, seq);
                        let got = receive(&*t, how, tag, &all, soon()).await;
                        let got = got.unwrap_or_else(|e| {
                            panic!("{}: {how:?} receive of size {}: {e}", C::name(), sizes[k])
                        });
                        expect.got::<C>(rank(j), n, &got);
                    }
                }
                assert!(expect.is_empty(), "{}: frames left", C::name());
            }));
        }
        join_all(C::name(), sends).await;
        join_all(C::name(), recvs).await;
    }
    for t in &ts {
        assert_eq!(queued(&**t), 0, "{}: bytes left held", C::name());
    }
}

/// Frames lent in place between every ordered pair of three ranks, one
/// frame at a time (a receive under way, then its frame sent): sizes
/// chosen so that frames fit a ring whole but wrap its end, and odd-sized
/// frames in between, so that a wrapped frame of 4-byte elements comes in
/// two pieces split inside an element. Every piece must be in order and
/// add up; every fourth frame is declined and must come back owned.
///
/// Where the backend declares lending, at least one frame must be lent in
/// pieces that split an element (rounds repeat until one is, at most 10:
/// the ring's reader may copy a frame out before the receive looks, and
/// that is allowed). Where it does not, nothing may be lent.
pub async fn in_place_delivery<C: Cluster>() {
    let n = 3;
    let cfg = ConformanceConfig::polling();
    let ts = C::connect(n, cfg.clone()).await;
    let ring = cfg.ring_bytes;
    let mut seq = 0;
    // Pairs one after the other: a receive polling for its tag moves other
    // tags' frames out of the ring, so concurrent pairs would lend less.
    for s in 0..n {
        for r in others(n, rank(s)) {
            let (s, lends) = (rank(s), C::lends(n, rank(s), r));
            let from = PeerSet::from_iter([s]);
            let mut rng = SeededRng::new(0x1e4d ^ ((s.0 as u64) << 8) ^ r.0 as u64);
            let (mut lent, mut split) = (0, 0);
            for _round in 0..if lends { 10 } else { 1 } {
                let mut expect = Expect::new::<C>();
                for i in 0..24u32 {
                    let len = if i % 2 == 0 {
                        // odd, so the next frame starts at an odd offset
                        2 * rng.below((ring / 6) as u64) as usize + 1
                    } else {
                        // elements of 4 bytes, the whole frame within a ring
                        4 * (1 + rng.below(((ring - HEADER_LEN) / 4 - 1) as u64) as usize)
                    };
                    seq += 1;
                    let m = Msg::new(s, r, tag(cfg.epoch, 3, seq), i, len);
                    expect.add(&m);
                    let how = How::InPlace(i % 4 != 3);
                    let t = &ts[r.idx()];
                    let mut fut = Box::pin(receive(&**t, how, m.header.tag, &from, soon()));
                    let early = poll_once(&mut fut).await;
                    assert!(
                        early.is_pending(),
                        "{}: {early:?} before the send",
                        C::name()
                    );
                    send_ok(C::name(), &*ts[s.idx()], &m).await;
                    let got = fut.await.unwrap_or_else(|e| {
                        panic!("{}: in-place receive {s} -> {r}: {e}", C::name())
                    });
                    expect.got::<C>(r, n, &got);
                    if let (None, Some(o)) = (&got.frame, got.offers.last()) {
                        lent += 1;
                        split += o.splits_an_element() as usize;
                    }
                }
                assert!(expect.is_empty());
                if split > 0 {
                    break;
                }
            }
            if lends {
                assert!(
                    lent > 0 && split > 0,
                    "{}: {s} -> {r} declares lending, but of its frames {lent} were lent, \
                     {split} in pieces that split an element",
                    C::name()
                );
            }
        }
    }
}

/// Three ranks send each other frames of 6 tags x 4 chunks in a shuffled
/// order; each receiver takes the tags in the reverse order, odd tags
/// peer by peer (and each frame must come from the peer named), even tags
/// from anyone. Then again with one task per tag receiving concurrently.
/// Nothing may be lost, duplicated or mixed up.
pub async fn out_of_order<C: Cluster>() {
    let n = 3;
    let (tags, chunks) = (6u64, 4u32);
    let cfg = ConformanceConfig::default();
    let ts = C::connect(n, cfg.clone()).await;
    let mut rng = SeededRng::new(0x0dd);
    for seq in 0..2u32 {
        let mut to_each: Vec<Vec<Msg>> = vec![Vec::new(); n];
        let mut sends = Vec::new();
        for (i, t) in ts.iter().enumerate() {
            let mut msgs = Vec::new();
            for j in others(n, rank(i)) {
                for k in 0..tags {
                    for c in 0..chunks {
                        let len = rng.below(3000) as usize;
                        let m = Msg::new(rank(i), j, tag(cfg.epoch, 100 + k, seq), c, len);
                        to_each[j.idx()].push(m.clone());
                        msgs.push(m);
                    }
                }
            }
            shuffle(&mut msgs, 7 + i as u64 + 10 * seq as u64);
            sends.push(spawn_sends(C::name(), t, msgs));
        }
        let mut recvs = Vec::new();
        for (j, msgs) in to_each.into_iter().enumerate() {
            let mut expect = Expect::new::<C>();
            msgs.iter().for_each(|m| expect.add(m));
            let expect = Arc::new(Mutex::new(expect));
            let t = ts[j].clone();
            let epoch = cfg.epoch;
            if seq == 0 {
                recvs.push(tokio::spawn(async move {
                    for k in (0..tags).rev() {
                        let tag = tag(epoch, 100 + k, seq);
                        let mut peers = others(n, rank(j));
                        peers.reverse();
                        let sets: Vec<PeerSet> = if k % 2 == 1 {
                            peers.iter().map(|&p| PeerSet::from_iter([p])).collect()
                        } else {
                            vec![PeerSet::all(n); n - 1]
                        };
                        for from in &sets {
                            for _ in 0..chunks {
                                let f = t.recv(tag, from, soon()).await;
                                let f = f.unwrap_or_else(|e| panic!("{}: {e}", C::name()));
                                let name = C::name();
                                let what = "a frame from a rank not asked for";
                                assert!(from.contains(f.from), "{name}: {what}: {}", f.from);
                                let mut e = expect.lock().unwrap_or_else(|e| e.into_inner());
                                e.arrived(f.from, &f.header, &f.payload);
                            }
                        }
                    }
                    let e = expect.lock().unwrap_or_else(|e| e.into_inner());
                    assert!(e.is_empty(), "{}: frames left", C::name());
                }));
            } else {
                for k in 0..tags {
                    let (t, expect) = (t.clone(), expect.clone());
                    recvs.push(tokio::spawn(async move {
                        let all = PeerSet::all(n);
                        for _ in 0..(n - 1) * chunks as usize {
                            let f = t.recv(tag(epoch, 100 + k, seq), &all, soon()).await;
                            let f = f.unwrap_or_else(|e| panic!("{}: {e}", C::name()));
                            let mut e = expect.lock().unwrap_or_else(|e| e.into_inner());
                            e.arrived(f.from, &f.header, &f.payload);
                        }
                    }));
                }
            }
        }
        join_all(C::name(), sends).await;
        join_all(C::name(), recvs).await;
    }
    for t in &ts {
        assert_eq!(queued(&**t), 0, "{}: bytes left held", C::name());
    }
}

/// Frames sent from a region's memory ([`Transport::send_mem`], as ops
/// send from their own buffers) between every ordered pair of three ranks,
/// of sizes from one byte to past the eager limits: each arrives exact,
/// and where the wire declares it borrows sends, the region holds no share
/// once the send resolved (an op may write that range again at once).
pub async fn borrowed_sends<C: Cluster>() {
    let n = 3;
    let cfg = ConformanceConfig::default();
    let ts = C::connect(n, cfg.clone()).await;
    let x = tag(cfg.epoch, 61, 0);
    for from in (0..n).map(rank) {
        let t = &*ts[from.idx()];
        for to in others(n, from) {
            for (c, len) in [1usize, 4096, 200_003].into_iter().enumerate() {
                let m = Msg::new(from, to, x, 3 * c as u32, len);
                let region = Region::from_vec(m.payload.to_vec());
                let mem = region.read(0..len).expect("a fresh region");
                let sent = t.send_mem(to, m.header, mem).await;
                sent.unwrap_or_else(|e| panic!("{}: send_mem: {e}", C::name()));
                let borrows = t.peer_caps(to).is_some_and(|c| c.borrows_sends);
                if borrows {
                    assert_eq!(
                        region.shares(),
                        0,
                        "{}: send_mem resolved while the wire still holds the region",
                        C::name()
                    );
                }
                let f = recv_ok(C::name(), &*ts[to.idx()], x, &one(from)).await;
                check_same(C::name(), &m, f.from, &f.header, &f.payload);
            }
        }
    }
}
