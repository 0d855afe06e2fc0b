//! The wire's core over the fake fabric, its pairs connected in memory
//! (no bootstrap): eager frames, the rendezvous both ways round, withdrawn
//! receives, back pressure, and what failures and violations do.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use crate::endpoint::{Arrival, Matcher, RecvKey};
use crate::pool::BufferPool;
use crate::region::Region;
use crate::verbs::core::{lock, Core, Hold, Layout};
use crate::verbs::fake::FakeNet;
use crate::verbs::progress;
use crate::verbs::proto::{Imm, Op, WrId};
use crate::{Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, TransportError};

const LIMIT: Duration = Duration::from_secs(20);

/// `n` cores on one fake fabric, pairs connected, progress tasks running.
struct Fabric {
    net: Arc<FakeNet>,
    cores: Vec<Arc<Core>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fabric {
    fn drop(&mut self) {
        for (t, c) in self.tasks.iter().zip(&self.cores) {
            t.abort();
            c.shutdown();
        }
    }
}

fn layout(me: usize, size: usize, eager_max: usize) -> Layout {
    Layout {
        me: Rank(me as u32),
        size,
        eager_max,
        slots: 4,
        send_slots: 8,
        sq_depth: 16,
        max_frame: 4 << 20,
        spin: Duration::from_micros(50),
    }
}

fn fabric(n: usize, eager_max: usize, budget: usize) -> Fabric {
    let net = FakeNet::new();
    let cores: Vec<Arc<Core>> = (0..n)
        .map(|i| {
            let verbs = Box::new(net.open(Rank(i as u32), n));
            let matcher = Arc::new(Matcher::new(Epoch(0), budget));
            let pool = BufferPool::new(1 << 20);
            Arc::new(Core::new(verbs, matcher, pool, layout(i, n, eager_max)).expect("core"))
        })
        .collect();
    let psn = |a: usize, b: usize| (a * 16 + b) as u32;
    for a in 0..n {
        for b in (0..n).filter(|&b| b != a) {
            let remote = cores[b].info(Rank(a as u32), psn(b, a));
            cores[a]
                .connect_qp(Rank(b as u32), psn(a, b), &remote)
                .expect("RTR, RTS");
        }
    }
    let tasks = cores
        .iter()
        .map(|c| tokio::spawn(progress::run(c.clone())))
        .collect();
    Fabric { net, cores, tasks }
}

fn tag(op: u64) -> OpTag {
    OpTag {
        epoch: Epoch(0),
        op: OpId(op),
        seq: 0,
    }
}

fn header(tag: OpTag, chunk: u32) -> Header {
    Header {
        kind: FrameKind::Data,
        tag,
        chunk,
        step: 0,
        digest: 0x5eed,
        len: 0,
    }
}

fn pattern(seed: u8, len: usize) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn one(r: usize) -> PeerSet {
    std::iter::once(Rank(r as u32)).collect()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Waits (bounded) until `f` holds.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn bounded<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("test took too long")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eager_frames_go_every_way_intact() {
    bounded(async {
        let f = fabric(3, 1024, 64 << 20);
        for a in 0..3 {
            for b in (0..3).filter(|&b| b != a) {
                for (k, len) in [0usize, 1, 1000, 1024].into_iter().enumerate() {
                    let data = pattern((a * 3 + b) as u8, len);
                    let h = header(tag(1), k as u32);
                    f.cores[a]
                        .send(Rank(b as u32), h, Hold::Bytes(data.clone()))
                        .await
                        .expect("send");
                    let got = f.cores[b].matcher.recv(tag(1), &one(a), soon()).await;
                    let got = got.expect("frame");
                    assert_eq!((got.from, got.header.chunk), (Rank(a as u32), k as u32));
                    assert_eq!(got.payload, data);
                }
            }
        }
        // every one an eager send, and every credit and slot back
        let posted = f.net.posted();
        assert!(posted
            .iter()
            .all(|(_, wr)| matches!(wr.op, Op::SendImm { imm } if imm == Imm::Eager.encode())));
        assert_eq!(posted.len(), 3 * 2 * 4);
        for c in &f.cores {
            let st = lock(&c.state);
            assert_eq!(st.free.len(), 8);
            assert!(c.peers().all(|p| st.credits[p.idx()] == 16));
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_frames_are_written_into_posted_receives_either_order() {
    bounded(async {
        let f = fabric(2, 64, 64 << 20);
        let (snd, rcv) = (f.cores[0].clone(), f.cores[1].clone());
        let region = Region::from_vec(vec![0xee; 3000]);
        let key = |chunk| RecvKey {
            tag: tag(2),
            from: Rank(0),
            chunk,
            step: 0,
        };
        let data: Vec<Bytes> = (0..3).map(|k| pattern(k as u8, 1000)).collect();
        // posted, then sent
        let mem = region.write(0..1000).unwrap();
        assert!(rcv.post(key(0), mem).unwrap().is_none());
        snd.send(Rank(1), header(tag(2), 0), Hold::Bytes(data[0].clone()))
            .await
            .unwrap();
        // sent (it waits for the Ready), then posted
        let s = snd.clone();
        let d = data[1].clone();
        let sending =
            tokio::spawn(async move { s.send(Rank(1), header(tag(2), 1), Hold::Bytes(d)).await });
        tokio::time::sleep(Duration::from_millis(30)).await;
        assert!(!sending.is_finished(), "a large frame waits for its receive");
        let mem = region.write(1000..2000).unwrap();
        assert!(rcv.post(key(1), mem).unwrap().is_none());
        sending.await.unwrap().unwrap();
        // from the op's own (registered) memory
        let src = Region::from_vec(data[2].to_vec());
        let mem = region.write(2000..3000).unwrap();
        assert!(rcv.post(key(2), mem).unwrap().is_none());
        let payload = src.read(0..1000).unwrap();
        snd.send(Rank(1), header(tag(2), 2), Hold::Mem(payload))
            .await
            .unwrap();
        let mut chunks = Vec::new();
        for _ in 0..3 {
            match rcv.matcher.recv_arrival(tag(2), &one(0), soon()).await {
                Ok(Arrival::Landed { from, header }) => {
                    assert_eq!((from, header.len, header.digest), (Rank(0), 1000, 0x5eed));
                    chunks.push(header.chunk);
                }
                other => panic!("{other:?}"),
            }
        }
        chunks.sort_unstable();
        assert_eq!(chunks, [0, 1, 2]);
        assert_eq!(region.shares(), 0, "every range is the op's again");
        let all = region.read(0..3000).unwrap();
        assert_eq!(all.as_slice(), &data.concat()[..]);
        assert_eq!(rcv.posted_landed.load(std::sync::atomic::Ordering::Relaxed), 3);
        // each a write, then the header as Done, on the sender's side
        let ops: Vec<Op> = f
            .net
            .posted()
            .into_iter()
            .filter(|(ep, _)| *ep == 0)
            .map(|(_, wr)| wr.op)
            .collect();
        assert_eq!(ops.len(), 6);
        for pair in ops.chunks(2) {
            assert!(matches!(pair[0], Op::Write { .. }), "{pair:?}");
            assert!(
                matches!(pair[1], Op::SendImm { imm } if matches!(Imm::decode(imm), Some(Imm::Done(_)))),
                "{pair:?}"
            );
        }
        assert!(lock(&rcv.state).rdv.is_empty() && lock(&snd.state).readies.is_empty());
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_of_another_length_than_posted_loses_its_sender() {
    bounded(async {
        let f = fabric(2, 64, 64 << 20);
        let region = Region::from_vec(vec![0; 1000]);
        let key = RecvKey {
            tag: tag(3),
            from: Rank(0),
            chunk: 0,
            step: 0,
        };
        assert!(f.cores[1]
            .post(key, region.write(0..1000).unwrap())
            .unwrap()
            .is_none());
        let h = header(tag(3), 0);
        f.cores[0]
            .send(Rank(1), h, Hold::Bytes(pattern(1, 900)))
            .await
            .expect("the sender did its part");
        let m = f.cores[1].matcher.clone();
        until("the sender is lost", || m.lost_reason(Rank(0)).is_some()).await;
        let why = m.lost_reason(Rank(0)).unwrap();
        assert!(
            why.contains("protocol violation") && why.contains("900"),
            "{why}"
        );
        assert_eq!(region.shares(), 0);
        assert_eq!(region.read(0..1000).unwrap().as_slice(), &[0; 1000][..]);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receives_of_ended_ops_are_withdrawn_and_released() {
    bounded(async {
        let f = fabric(2, 64, 64 << 20);
        let region = Region::from_vec(vec![0; 2000]);
        for chunk in 0..2 {
            let key = RecvKey {
                tag: tag(4),
                from: Rank(0),
                chunk,
                step: 0,
            };
            let range = chunk as usize * 1000..(chunk as usize + 1) * 1000;
            assert!(f.cores[1]
                .post(key, region.write(range).unwrap())
                .unwrap()
                .is_none());
        }
        let snd = f.cores[0].clone();
        until("both Readies arrived", || {
            lock(&snd.state)
                .readies
                .values()
                .map(|q| q.len())
                .sum::<usize>()
                == 2
        })
        .await;
        // one is used before the op ends, the other is withdrawn
        snd.send(Rank(1), header(tag(4), 1), Hold::Bytes(pattern(4, 1000)))
            .await
            .unwrap();
        f.cores[1].matcher.retire(tag(4));
        until("the ranges are released", || region.shares() == 0).await;
        assert!(lock(&snd.state).readies.is_empty());
        assert!(lock(&f.cores[1].state).rdv.is_empty());
        assert!(f.cores[1].matcher.lost_reason(Rank(0)).is_none());
        let sent: Vec<Option<Imm>> = f
            .net
            .posted()
            .into_iter()
            .filter_map(|(_, wr)| match wr.op {
                Op::SendImm { imm } => Some(Imm::decode(imm)),
                Op::Write { .. } => None,
            })
            .collect();
        assert!(sent.iter().any(|i| matches!(i, Some(Imm::Cancel(_)))));
        assert!(sent.iter().any(|i| matches!(i, Some(Imm::CancelAck(_)))));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_receiver_holds_its_slots_and_everything_still_arrives() {
    bounded(async {
        // room for about four frames; four slots; forty frames
        let f = fabric(2, 1024, 4096);
        let snd = f.cores[0].clone();
        let sends: Vec<_> = (0..40u32)
            .map(|k| {
                let s = snd.clone();
                tokio::spawn(async move {
                    let data = pattern(k as u8, 1000);
                    s.send(Rank(1), header(tag(5), k), Hold::Bytes(data)).await
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let done = sends.iter().filter(|s| s.is_finished()).count();
        assert!(
            done < 40,
            "sends wait for the receiver's slots ({done} done)"
        );
        let mut seen = [false; 40];
        for _ in 0..40 {
            let fr = f.cores[1]
                .matcher
                .recv(tag(5), &one(0), soon())
                .await
                .unwrap();
            let k = fr.header.chunk as usize;
            assert_eq!(fr.payload, pattern(k as u8, 1000));
            assert!(!std::mem::replace(&mut seen[k], true));
        }
        for s in sends {
            s.await.unwrap().unwrap();
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_link_fails_that_peer_only_and_flushes_its_requests() {
    bounded(async {
        let f = fabric(3, 64, 64 << 20);
        let region = Region::from_vec(vec![0; 1000]);
        let key = RecvKey {
            tag: tag(6),
            from: Rank(0),
            chunk: 0,
            step: 0,
        };
        assert!(f.cores[1]
            .post(key, region.write(0..1000).unwrap())
            .unwrap()
            .is_none());
        // a large send to rank 2 that waits for its receive when the link goes
        let s = f.cores[0].clone();
        let waiting = tokio::spawn(async move {
            s.send(Rank(2), header(tag(6), 0), Hold::Bytes(pattern(6, 1000)))
                .await
        });
        f.net.break_link(0, 1);
        let h = header(tag(6), 1);
        match f.cores[0]
            .send(Rank(1), h, Hold::Bytes(pattern(1, 10)))
            .await
        {
            Err(TransportError::PeerLost { peer, reason }) => {
                assert_eq!(peer, Rank(1), "{reason}")
            }
            other => panic!("{other:?}"),
        }
        match f.cores[1]
            .send(Rank(0), h, Hold::Bytes(pattern(1, 10)))
            .await
        {
            Err(TransportError::PeerLost { peer, .. }) => assert_eq!(peer, Rank(0)),
            other => panic!("{other:?}"),
        }
        // the posted receive from the lost peer is released, its pair's
        // slots are not posted again, and nothing of it is left in flight
        until("the receive is released", || region.shares() == 0).await;
        for (a, b) in [(0usize, 1usize), (1, 0)] {
            let c = f.cores[a].clone();
            until("the pair's requests are flushed", || {
                let st = lock(&c.state);
                st.dead[b]
                    && st
                        .pending
                        .keys()
                        .all(|&id| WrId::decode(id).map(|w| w.peer()) != Some(Rank(b as u32)))
            })
            .await;
        }
        // the others go on
        let d = pattern(2, 50);
        f.cores[0]
            .send(Rank(2), header(tag(7), 0), Hold::Bytes(d.clone()))
            .await
            .unwrap();
        let got = f.cores[2]
            .matcher
            .recv(tag(7), &one(0), soon())
            .await
            .unwrap();
        assert_eq!(got.payload, d);
        assert!(!waiting.is_finished());
        waiting.abort();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_the_protocol_does_not_know_lose_their_sender() {
    bounded(async {
        for imm in [
            0xf000_0001,
            Imm::Done(99).encode(),
            Imm::CancelAck(5).encode(),
        ] {
            let f = fabric(2, 64, 64 << 20);
            let buf = [0u8; 64];
            // SAFETY: `buf` outlives the registration and the send (waited
            // for below, before either is dropped).
            let reg = unsafe { f.cores[0].verbs.register(buf.as_ptr(), 64, false) }.unwrap();
            let wr = crate::verbs::proto::message(
                Rank(1),
                1,
                Imm::Eager,
                Some(crate::verbs::proto::Sge {
                    addr: buf.as_ptr() as u64,
                    len: 40,
                    lkey: reg.lkey,
                }),
            );
            let wr = crate::verbs::proto::SendWr {
                op: Op::SendImm { imm },
                ..wr
            };
            // SAFETY: as above.
            unsafe { f.cores[0].verbs.post_send(Rank(1), &[wr]) }.unwrap();
            let m = f.cores[1].matcher.clone();
            until("the sender is lost", || m.lost_reason(Rank(0)).is_some()).await;
            let why = m.lost_reason(Rank(0)).unwrap();
            assert!(why.contains("protocol violation"), "{imm:#x}: {why}");
            // (the fake executes a send as it is posted when a receive
            // waits, as one does here: `buf` is read by then)
            drop(f);
            drop(reg);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_the_sends_that_wait_and_releases_registrations() {
    bounded(async {
        let f = fabric(2, 64, 64 << 20);
        let s = f.cores[0].clone();
        let waiting = tokio::spawn(async move {
            s.send(Rank(1), header(tag(8), 0), Hold::Bytes(pattern(8, 500)))
                .await
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        f.cores[0].shutdown();
        match waiting.await.unwrap() {
            Err(TransportError::Closed) => {}
            other => panic!("{other:?}"),
        }
        let h = header(tag(8), 1);
        assert!(matches!(
            f.cores[0]
                .send(Rank(1), h, Hold::Bytes(pattern(1, 1)))
                .await,
            Err(TransportError::Closed)
        ));
        let net = f.net.clone();
        drop(f);
        // the cores (and with them every registration) are gone once their
        // tasks are
        until("registrations are released", || net.registrations() == 0).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receives_the_matcher_refuses_or_drops_are_left_to_it() {
    bounded(async {
        let f = fabric(2, 64, 64 << 20);
        let rcv = &f.cores[1];
        let region = Region::from_vec(vec![0; 3000]);
        let key = |tag| RecvKey {
            tag,
            from: Rank(0),
            chunk: 0,
            step: 0,
        };
        // small: the matcher's to match
        let small = rcv.post(key(tag(9)), region.write(0..64).unwrap()).unwrap();
        assert!(small.is_some());
        // a retired op, then an older epoch
        rcv.matcher.retire(tag(10));
        let retired = rcv.post(key(tag(10)), region.write(1000..2000).unwrap());
        assert!(retired.unwrap().is_some());
        rcv.matcher.advance_epoch(Epoch(1));
        let stale = rcv.post(key(tag(11)), region.write(2000..3000).unwrap());
        assert!(stale.unwrap().is_some());
        // a lost peer
        rcv.lose(Rank(0), "gone", true);
        let newer = OpTag {
            epoch: Epoch(1),
            ..tag(12)
        };
        let lost = rcv.post(key(newer), region.write(1000..2000).unwrap());
        assert!(lost.unwrap().is_some());
        // no Ready went out, nothing was registered for them
        assert!(f.net.posted().iter().all(|(ep, _)| *ep != 1));
        assert!(lock(&rcv.state).rdv.is_empty());
    })
    .await;
}
