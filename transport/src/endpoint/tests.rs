//! The matcher's tests (they were the mailbox's), and the receive loop's.

use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use super::{recv_spinning, spin_recv, Arrival, Matcher, Pump};
use crate::{
    Capabilities, Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport,
    TransportError,
};

fn tag(op: u64) -> OpTag {
    OpTag {
        epoch: Epoch(1),
        op: OpId(op),
        seq: 0,
    }
}

fn header(t: OpTag, len: usize) -> Header {
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
    Instant::now() + Duration::from_secs(5)
}

#[tokio::test]
async fn early_frames_wait_for_their_receive() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    mb.deliver(Rank(1), header(tag(5), 3), Bytes::from_static(b"abc"))
        .await
        .unwrap();
    assert_eq!(mb.queued_bytes(), 3);
    let f = mb.recv(tag(5), &PeerSet::all(4), soon()).await.unwrap();
    assert_eq!(&f.payload[..], b"abc");
    assert_eq!(mb.queued_bytes(), 0);
}

#[tokio::test]
async fn receive_only_from_the_named_peers() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    mb.deliver(Rank(2), header(tag(5), 1), Bytes::from_static(b"x"))
        .await
        .unwrap();
    let only1: PeerSet = [Rank(1)].into_iter().collect();
    let r = mb
        .recv(tag(5), &only1, Instant::now() + Duration::from_millis(20))
        .await;
    assert!(matches!(r, Err(TransportError::Timeout { .. })));
    // the frame is still there for a receive that names rank 2
    assert!(mb.recv(tag(5), &PeerSet::all(3), soon()).await.is_ok());
}

#[tokio::test]
async fn stale_epoch_is_refused_and_counted() {
    let mb = Matcher::new(Epoch(3), 1 << 20);
    let old = OpTag {
        epoch: Epoch(2),
        ..tag(1)
    };
    let r = mb.deliver(Rank(0), header(old, 0), Bytes::new()).await;
    assert!(matches!(r, Err(TransportError::StaleEpoch { .. })));
    assert_eq!(mb.refused(), 1);
    assert_eq!(mb.queued_bytes(), 0);
}

#[tokio::test]
async fn advancing_the_epoch_drops_old_frames_and_keeps_early_ones() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    let next = OpTag {
        epoch: Epoch(2),
        ..tag(7)
    };
    mb.deliver(Rank(1), header(tag(5), 3), Bytes::from_static(b"old"))
        .await
        .unwrap();
    mb.deliver(Rank(1), header(next, 5), Bytes::from_static(b"early"))
        .await
        .unwrap();
    assert_eq!(mb.queued_bytes(), 8);
    mb.advance_epoch(Epoch(2));
    assert_eq!(mb.epoch(), Epoch(2));
    assert_eq!(mb.queued_bytes(), 5, "the old frame is gone");
    let f = mb.recv(next, &PeerSet::all(2), soon()).await.unwrap();
    assert_eq!(&f.payload[..], b"early");
    let r = mb.deliver(Rank(1), header(tag(5), 0), Bytes::new()).await;
    assert!(matches!(r, Err(TransportError::StaleEpoch { .. })));
    mb.advance_epoch(Epoch(1));
    assert_eq!(mb.epoch(), Epoch(2), "an epoch never goes back");
}

#[tokio::test]
async fn budget_applies_back_pressure() {
    let mb = Arc::new(Matcher::new(Epoch(1), 10));
    mb.deliver(Rank(0), header(tag(1), 8), Bytes::from(vec![0; 8]))
        .await
        .unwrap();
    let mb2 = mb.clone();
    let blocked = tokio::spawn(async move {
        mb2.deliver(Rank(0), header(tag(2), 8), Bytes::from(vec![0; 8]))
            .await
    });
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(!blocked.is_finished(), "over budget must wait");
    assert_eq!(mb.queued_bytes(), 8);
    mb.recv(tag(1), &PeerSet::all(1), soon()).await.unwrap();
    blocked.await.unwrap().unwrap();
    assert_eq!(mb.queued_bytes(), 8);
}

#[tokio::test]
async fn lost_peer_fails_waiting_receive() {
    let mb = Arc::new(Matcher::new(Epoch(1), 1 << 20));
    let mb2 = mb.clone();
    let waiter = tokio::spawn(async move { mb2.recv(tag(1), &PeerSet::all(3), soon()).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    mb.fail_peer(Rank(2), "connection reset");
    match waiter.await.unwrap() {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, Rank(2));
            assert_eq!(&*reason, "connection reset");
        }
        other => panic!("{other:?}"),
    }
    let only01: PeerSet = [Rank(0), Rank(1)].into_iter().collect();
    assert!(mb.check_peers(&only01).is_ok());
}

#[tokio::test]
async fn retired_frames_become_strays_without_payload() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    mb.deliver(Rank(0), header(tag(1), 4), Bytes::from(vec![0; 4]))
        .await
        .unwrap();
    mb.retire(tag(1));
    assert_eq!(mb.queued_bytes(), 0);
    mb.deliver(Rank(2), header(tag(1), 4), Bytes::from(vec![0; 4]))
        .await
        .unwrap();
    assert_eq!(mb.queued_bytes(), 0);
    for from in [Rank(0), Rank(2)] {
        let f = mb.recv_stray(soon()).await.unwrap();
        assert_eq!((f.from, f.header.tag, f.payload.len()), (from, tag(1), 0));
    }
    let none = mb
        .recv_stray(Instant::now() + Duration::from_millis(10))
        .await;
    assert!(matches!(none, Err(TransportError::Timeout { .. })));
}

#[tokio::test]
async fn non_waiting_paths() {
    let mb = Matcher::new(Epoch(1), 10);
    let all = PeerSet::all(2);
    assert!(mb.try_recv(tag(1), &all).is_none());
    assert!(mb.has_room(100), "an empty matcher admits any frame");
    mb.deliver_now(Rank(1), header(tag(1), 8), Bytes::from(vec![1; 8]))
        .unwrap();
    assert!(!mb.has_room(8));
    // forced past the budget
    mb.deliver_now(Rank(1), header(tag(1), 8), Bytes::from(vec![2; 8]))
        .unwrap();
    assert_eq!(mb.queued_bytes(), 16);
    assert_eq!(mb.try_recv(tag(1), &all).unwrap().unwrap().payload[0], 1);
    assert_eq!(mb.try_recv(tag(1), &all).unwrap().unwrap().payload[0], 2);
    mb.fail_peer(Rank(1), "gone");
    assert!(matches!(
        mb.try_recv(tag(1), &all),
        Some(Err(TransportError::PeerLost { .. }))
    ));
}

#[tokio::test]
async fn dropped_receive_loses_nothing() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    let from = PeerSet::all(1);
    {
        let fut = mb.recv(tag(1), &from, soon());
        tokio::pin!(fut);
        assert!(futures_poll_once(fut.as_mut()).await.is_none());
    }
    mb.deliver(Rank(0), header(tag(1), 1), Bytes::from_static(b"z"))
        .await
        .unwrap();
    assert_eq!(
        &mb.recv(tag(1), &from, soon()).await.unwrap().payload[..],
        b"z"
    );
}

async fn futures_poll_once<F: std::future::Future + Unpin>(mut f: F) -> Option<F::Output> {
    poll_fn(|cx| {
        Poll::Ready(match std::pin::Pin::new(&mut f).poll(cx) {
            Poll::Ready(v) => Some(v),
            Poll::Pending => None,
        })
    })
    .await
}

#[tokio::test]
async fn a_lost_peer_with_frames_of_the_tag_queued_fails_that_tag_last() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    let all = PeerSet::all(3);
    mb.deliver(Rank(2), header(tag(1), 1), Bytes::from_static(b"x"))
        .await
        .unwrap();
    mb.fail_peer(Rank(2), "gone");
    let lost2 = |r: Result<(), TransportError>| {
        matches!(r, Err(TransportError::PeerLost { peer: Rank(2), .. }))
    };
    assert!(lost2(mb.check_peers(&all)));
    // Its frame of tag 1 is still to be taken (a root that sent all and
    // left), so receiving tag 1 from it is no reason to fail yet...
    assert!(mb.check_peers_for(tag(1), &all).is_ok());
    // ...but any other tag is.
    assert!(lost2(mb.check_peers_for(tag(2), &all)));
    let f = mb.recv(tag(1), &all, soon()).await.unwrap();
    assert_eq!(f.from, Rank(2));
    assert!(
        lost2(mb.check_peers_for(tag(1), &all)),
        "nothing queued now"
    );
    let only01: PeerSet = [Rank(0), Rank(1)].into_iter().collect();
    assert!(mb.check_peers_for(tag(1), &only01).is_ok());
    mb.close();
    assert!(matches!(
        mb.check_peers_for(tag(1), &only01),
        Err(TransportError::Closed)
    ));
}

/// A backend that implements only what the trait requires: its sends go
/// to itself, other ranks' frames are delivered into its matcher by the
/// test as a reader task would.
struct Loopback {
    matcher: Matcher,
    pool: Arc<crate::pool::BufferPool>,
    size: usize,
}

impl Transport for Loopback {
    fn rank(&self) -> Rank {
        Rank(0)
    }

    fn size(&self) -> usize {
        self.size
    }

    fn matcher(&self) -> &Matcher {
        &self.matcher
    }

    fn pool(&self) -> &Arc<crate::pool::BufferPool> {
        &self.pool
    }

    fn version(&self) -> crate::ClusterVersion {
        crate::ClusterVersion(0)
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "loopback",
            max_frame: usize::MAX,
            zero_copy: false,
            needs_registration: false,
        }
    }

    async fn send(
        &self,
        to: Rank,
        mut header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        if to != self.rank() {
            return Err(TransportError::NoSuchPeer {
                peer: to,
                size: self.size,
            });
        }
        header.len = payload.len() as u64;
        self.matcher.deliver(to, header, payload).await
    }

    async fn close(&self, _linger: Duration) {
        self.shutdown();
    }

    fn shutdown(&self) {
        self.matcher.close();
    }
}

#[tokio::test]
async fn a_backend_gets_the_matcher_methods_provided() {
    let t = Loopback {
        matcher: Matcher::new(Epoch(1), 1 << 20),
        pool: crate::pool::BufferPool::new(0),
        size: 3,
    };
    provided_methods_act_on_the_matcher(&t).await;
}

/// Generic, so that only the trait's methods are called.
async fn provided_methods_act_on_the_matcher<T: Transport>(t: &T) {
    let all = PeerSet::all(t.size());
    t.send(Rank(0), header(tag(1), 0), Bytes::from_static(b"self"))
        .await
        .unwrap();
    let f = t.recv(tag(1), &all, soon()).await.unwrap();
    assert_eq!((f.from, &f.payload[..]), (Rank(0), &b"self"[..]));

    t.matcher()
        .deliver(Rank(2), header(tag(2), 1), Bytes::from_static(b"x"))
        .await
        .unwrap();
    t.matcher().fail_peer(Rank(2), "gone");
    let lost2 = |r: Result<(), TransportError>| {
        matches!(r, Err(TransportError::PeerLost { peer: Rank(2), .. }))
    };
    assert!(lost2(t.check_peers(&all)));
    assert!(t.check_peers_for(tag(2), &all).is_ok(), "tag 2 is queued");
    assert!(lost2(t.check_peers_for(tag(3), &all)));

    t.retire(tag(2));
    let s = t.recv_stray(soon()).await.unwrap();
    assert_eq!(
        (s.from, s.header.tag, s.payload.len()),
        (Rank(2), tag(2), 0)
    );
    assert!(
        lost2(t.check_peers_for(tag(2), &all)),
        "retired: none queued"
    );

    assert_eq!(t.epoch(), Epoch(1));
    t.advance_epoch(Epoch(2));
    assert_eq!(t.epoch(), Epoch(2));
    t.advance_epoch(Epoch(1));
    assert_eq!(t.epoch(), Epoch(2), "never goes back");
    let stale = t.send(Rank(0), header(tag(4), 0), Bytes::new()).await;
    assert!(matches!(stale, Err(TransportError::StaleEpoch { .. })));

    t.shutdown();
    assert!(matches!(t.check_peers(&all), Err(TransportError::Closed)));
}

#[tokio::test]
async fn a_spinning_receive_takes_what_the_pump_moves_in() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    let mut pumped = 0;
    let pump = || {
        pumped += 1;
        // The third poll of the backend's queues finds a frame.
        pumped == 3
            && mb
                .deliver_now(Rank(1), header(tag(1), 1), Bytes::from_static(b"p"))
                .is_ok()
    };
    let spin = Duration::from_secs(5);
    let f = recv_spinning(&mb, tag(1), &PeerSet::all(2), soon(), spin, false, pump)
        .await
        .unwrap();
    assert_eq!((f.from, &f.payload[..]), (Rank(1), &b"p"[..]));
    assert_eq!(pumped, 3, "taken in the poll after the pump moved it");
}

#[tokio::test]
async fn a_spin_ends_when_the_pump_consumes_a_peer_is_lost_or_time_is_up() {
    let mb = Matcher::new(Epoch(1), 1 << 20);
    let all = PeerSet::all(2);
    let long = Duration::from_secs(5);

    let mut calls = 0;
    let consume_second = || {
        calls += 1;
        if calls == 2 {
            Pump::Consumed
        } else {
            Pump::Idle
        }
    };
    let take = || mb.try_arrival(tag(1), &all);
    let r = spin_recv(take, long, false, consume_second).await;
    assert!(matches!(r, Some(Ok(Arrival::Applied))), "{r:?}");
    assert_eq!(calls, 2);

    let short = Duration::from_millis(2);
    let t0 = std::time::Instant::now();
    let r = spin_recv(take, short, true, || Pump::Idle).await;
    assert!(r.is_none(), "{r:?}");
    assert!(t0.elapsed() >= short);

    // After the spin the receive sleeps, until its deadline.
    let deadline = Instant::now() + Duration::from_millis(20);
    let r = recv_spinning(&mb, tag(1), &all, deadline, short, false, || false).await;
    assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");

    mb.fail_peer(Rank(1), "gone");
    let r = spin_recv(take, long, false, || Pump::Idle).await;
    assert!(
        matches!(r, Some(Err(TransportError::PeerLost { .. }))),
        "{r:?}"
    );
}

mod posted {
    use super::*;
    use crate::region::Region;
    use crate::RecvKey;

    fn key(t: OpTag, from: u32) -> RecvKey {
        RecvKey {
            tag: t,
            from: Rank(from),
            chunk: 0,
            step: 0,
        }
    }

    async fn arrival(mb: &Matcher, t: OpTag) -> Result<Arrival, TransportError> {
        mb.recv_arrival(
            t,
            &PeerSet::all(2),
            Instant::now() + Duration::from_millis(50),
        )
        .await
    }

    #[tokio::test]
    async fn a_posted_receive_lands_in_its_range_and_holds_no_budget() {
        let mb = Matcher::new(Epoch(1), 1 << 20);
        let region = Region::from_vec(vec![0u8; 8]);
        let posted = mb.post(key(tag(1), 1), region.write(2..6).unwrap());
        assert!(matches!(posted, Ok(None)), "{posted:?}");
        // Not a frame for plain receives, and not this key: queued as usual.
        mb.deliver(Rank(1), header(tag(2), 4), Bytes::from_static(b"else"))
            .await
            .unwrap();
        assert_eq!(mb.queued_bytes(), 4);
        mb.deliver(Rank(1), header(tag(1), 4), Bytes::from_static(b"abcd"))
            .await
            .unwrap();
        assert_eq!(mb.queued_bytes(), 4, "a landed frame holds no budget");
        assert_eq!((mb.posted(), region.shares()), (0, 0));
        match arrival(&mb, tag(1)).await {
            Ok(Arrival::Landed { from, header: h }) => {
                assert_eq!((from, h), (Rank(1), header(tag(1), 4)))
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            Region::into_vec(region).unwrap(),
            [0, 0, b'a', b'b', b'c', b'd', 0, 0]
        );
    }

    #[tokio::test]
    async fn a_frame_that_came_first_is_copied_in_when_posted() {
        let mb = Matcher::new(Epoch(1), 1 << 20);
        mb.deliver(Rank(1), header(tag(1), 3), Bytes::from_static(b"xyz"))
            .await
            .unwrap();
        let region = Region::from_vec(vec![0u8; 3]);
        let got = mb.post(key(tag(1), 1), region.write(0..3).unwrap());
        assert!(
            matches!(got, Ok(Some(h)) if h == header(tag(1), 3)),
            "{got:?}"
        );
        assert_eq!((mb.queued_bytes(), mb.posted()), (0, 0));
        assert_eq!(Region::into_vec(region).unwrap(), b"xyz");
        // Nothing more arrives for it.
        let r = arrival(&mb, tag(1)).await;
        assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");
    }

    #[tokio::test]
    async fn a_frame_of_another_length_is_not_landed() {
        let mb = Matcher::new(Epoch(1), 1 << 20);
        let region = Region::from_vec(vec![0u8; 4]);
        mb.post(key(tag(1), 1), region.write(0..4).unwrap())
            .unwrap();
        mb.deliver(Rank(1), header(tag(1), 5), Bytes::from_static(b"12345"))
            .await
            .unwrap();
        match arrival(&mb, tag(1)).await {
            Ok(Arrival::Frame(f)) => assert_eq!(&f.payload[..], b"12345"),
            other => panic!("{other:?}"),
        }
        assert_eq!(mb.posted(), 1, "the receive still waits for its frame");
        // A queued frame of another length is left queued by a post too.
        let (mb, other) = (
            Matcher::new(Epoch(1), 1 << 20),
            Region::from_vec(vec![0; 2]),
        );
        mb.deliver(Rank(1), header(tag(1), 5), Bytes::from_static(b"12345"))
            .await
            .unwrap();
        let r = mb.post(key(tag(1), 1), other.write(0..2).unwrap());
        assert!(matches!(r, Ok(None)), "{r:?}");
        assert_eq!(mb.queued_bytes(), 5);
    }

    #[tokio::test]
    async fn retiring_closing_or_advancing_releases_posted_memory() {
        let mb = Matcher::new(Epoch(1), 1 << 20);
        let region = Region::from_vec(vec![0u8; 4]);
        mb.post(key(tag(1), 1), region.write(0..2).unwrap())
            .unwrap();
        mb.post(key(tag(2), 1), region.write(2..4).unwrap())
            .unwrap();
        mb.retire(tag(1));
        assert_eq!((mb.posted(), region.shares()), (1, 1));
        // A late frame of the retired op is a stray, not a landing.
        mb.deliver(Rank(1), header(tag(1), 2), Bytes::from_static(b"no"))
            .await
            .unwrap();
        let stray = mb.recv_stray(soon()).await.unwrap();
        assert_eq!(stray.header.tag, tag(1));
        mb.advance_epoch(Epoch(2));
        assert_eq!((mb.posted(), region.shares()), (0, 0));
        let stale = mb.post(key(tag(2), 1), region.write(2..4).unwrap());
        assert!(
            matches!(stale, Err(TransportError::StaleEpoch { .. })),
            "{stale:?}"
        );
        assert_eq!(region.shares(), 0, "a refused post gives its share up");
        let t3 = OpTag {
            epoch: Epoch(2),
            ..tag(3)
        };
        mb.post(key(t3, 1), region.write(0..4).unwrap()).unwrap();
        mb.close();
        assert_eq!(region.shares(), 0);
        let closed = mb.post(key(t3, 1), region.write(0..4).unwrap());
        assert!(matches!(closed, Err(TransportError::Closed)), "{closed:?}");
        assert_eq!(Region::into_vec(region).unwrap(), [0; 4], "nothing landed");
    }

    #[tokio::test]
    async fn a_claimed_range_outlives_its_retired_op_and_lands_as_a_stray() {
        let mb = Matcher::new(Epoch(1), 1 << 20);
        let region = Region::from_vec(vec![0u8; 4]);
        mb.post(key(tag(1), 1), region.write(0..4).unwrap())
            .unwrap();
        let h = header(tag(1), 4);
        assert!(mb.claim(Rank(0), &h).is_none(), "another sender");
        assert!(
            mb.claim(Rank(1), &header(tag(1), 3)).is_none(),
            "another length"
        );
        let mut mem = mb.claim(Rank(1), &h).expect("posted for it");
        // The op gives up while a reader writes: the memory stays.
        mb.retire(tag(1));
        let region = Region::into_vec(region).expect_err("the reader still holds a share");
        mem.as_mut_slice().copy_from_slice(b"late");
        mb.landed(Rank(1), h, mem);
        assert_eq!(region.shares(), 0);
        assert_eq!(mb.recv_stray(soon()).await.unwrap().header.tag, tag(1));
        let r = arrival(&mb, tag(1)).await;
        assert!(matches!(r, Err(TransportError::Timeout { .. })), "{r:?}");
    }

    #[tokio::test]
    async fn plain_receives_leave_landed_arrivals_and_pieces_land_whole() {
        let mb = Matcher::new(Epoch(1), 1 << 20);
        let region = Region::from_vec(vec![0u8; 5]);
        mb.post(key(tag(1), 1), region.write(0..5).unwrap())
            .unwrap();
        assert!(!mb.land_parts(Rank(1), &header(tag(1), 5), &[b"ab", b"c"]));
        assert!(mb.land_parts(Rank(1), &header(tag(1), 5), &[b"ab", b"cde"]));
        assert!(mb.try_recv(tag(1), &PeerSet::all(2)).is_none());
        assert!(matches!(
            mb.try_arrival(tag(1), &PeerSet::all(2)),
            Some(Ok(Arrival::Landed { .. }))
        ));
        assert_eq!(Region::into_vec(region).unwrap(), b"abcde");
        // A lost peer fails a receive that waits on a posted frame of it.
        let region = Region::from_vec(vec![0u8; 1]);
        mb.post(key(tag(2), 1), region.write(0..1).unwrap())
            .unwrap();
        mb.fail_peer(Rank(1), "gone");
        let r = arrival(&mb, tag(2)).await;
        assert!(matches!(r, Err(TransportError::PeerLost { .. })), "{r:?}");
    }

    #[tokio::test]
    async fn a_rendezvous_waits_for_its_post_and_ends_with_the_op() {
        let mb = Arc::new(Matcher::new(Epoch(1), 1 << 20));
        let region = Region::from_vec(vec![0u8; 4]);
        let h = header(tag(1), 4);
        let sender = {
            let mb = mb.clone();
            tokio::spawn(async move { mb.rendezvous(Rank(1), h, b"rdv!").await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!sender.is_finished(), "it waits for the receive");
        assert_eq!(mb.queued_bytes(), 0, "and holds nothing here");
        mb.post(key(tag(1), 1), region.write(0..4).unwrap())
            .unwrap();
        sender.await.unwrap().unwrap();
        assert!(matches!(
            arrival(&mb, tag(1)).await,
            Ok(Arrival::Landed { .. })
        ));
        assert_eq!(Region::into_vec(region).unwrap(), b"rdv!");
        // The op ends first: the frame becomes a stray.
        let late = {
            let mb = mb.clone();
            tokio::spawn(async move { mb.rendezvous(Rank(1), header(tag(2), 1), b"x").await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        mb.retire(tag(2));
        late.await.unwrap().unwrap();
        assert_eq!(mb.recv_stray(soon()).await.unwrap().header.tag, tag(2));
        // Closing ends a waiting sender.
        let stuck = {
            let mb = mb.clone();
            tokio::spawn(async move { mb.rendezvous(Rank(1), header(tag(3), 1), b"y").await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        mb.close();
        let r = stuck.await.unwrap();
        assert!(matches!(r, Err(TransportError::Closed)), "{r:?}");
    }
}

/// A wire that needs registered memory (as verbs and libfabric's verbs
/// provider do): the endpoint registers a region before it posts into it
/// or sends from it, once per region.
mod registering {
    use std::sync::Mutex;

    use super::*;
    use crate::endpoint::{Endpoint, EndpointConfig, RecvKey};
    use crate::pool::BufferPool;
    use crate::region::{Mem, Region};
    use crate::wire::{Caps, Wire};
    use crate::ClusterVersion;

    #[derive(Default)]
    struct NeedsRegistration {
        /// Lengths of the regions registered, in order.
        registered: Mutex<Vec<usize>>,
        sent: Mutex<Vec<Vec<u8>>>,
    }

    impl Wire for NeedsRegistration {
        fn caps(&self) -> Caps {
            Caps {
                name: "needs-registration",
                max_frame: 1 << 20,
                inject: false,
                holds_sends: false,
                polled: false,
                lends: false,
                borrows_sends: true,
                eager_max: 1 << 20,
                needs_registration: true,
            }
        }

        fn reaches(&self, peer: Rank) -> bool {
            peer == Rank(1)
        }

        fn register(&self, region: &Arc<Region>) -> Result<(), TransportError> {
            if region.registration(0).is_none() {
                region.set_registration(0, Arc::new(region.len()));
                self.registered.lock().unwrap().push(region.len());
            }
            Ok(())
        }

        async fn send(&self, _: Rank, _: Header, _: Bytes) -> Result<(), TransportError> {
            Err(TransportError::Closed) // only registered memory goes out
        }

        async fn send_mem(&self, _: Rank, _: Header, payload: Mem) -> Result<(), TransportError> {
            if payload.region().registration(0).is_none() {
                return Err(TransportError::Closed);
            }
            self.sent.lock().unwrap().push(payload.as_slice().to_vec());
            Ok(())
        }

        async fn close(&self, _: Duration) {}

        fn shutdown(&self) {}
    }

    #[tokio::test]
    async fn memory_is_registered_once_before_it_is_posted_into_or_sent_from() {
        let e = Endpoint::new(
            Rank(0),
            2,
            ClusterVersion(0),
            "needs-registration",
            Arc::new(Matcher::new(Epoch(1), 1 << 20)),
            BufferPool::new(1 << 20),
            vec![NeedsRegistration::default()],
            EndpointConfig {
                spin: Duration::ZERO,
                oversubscribed: false,
            },
        );
        let region = Region::from_vec(vec![7u8; 64]);
        let key = RecvKey {
            tag: tag(1),
            from: Rank(1),
            chunk: 0,
            step: 0,
        };
        let r = e.post_recv(key, region.write(0..32).unwrap());
        assert!(matches!(r, Ok(None)), "{r:?}");
        e.send_mem(Rank(1), header(tag(1), 32), region.read(32..64).unwrap())
            .await
            .unwrap();
        let other = Region::from_vec(vec![1u8; 16]);
        e.send_mem(Rank(1), header(tag(2), 16), other.read(0..16).unwrap())
            .await
            .unwrap();
        let w = &e.wires()[0];
        assert_eq!(*w.registered.lock().unwrap(), [64, 16], "each region once");
        assert_eq!(*w.sent.lock().unwrap(), [vec![7u8; 32], vec![1u8; 16]]);
        // Where caps say sends borrow, the driver sends from the op's
        // memory; a plain send of a copy would be refused by this wire.
        let copy = e
            .send(Rank(1), header(tag(3), 1), Bytes::from_static(b"x"))
            .await;
        assert!(matches!(copy, Err(TransportError::Closed)), "{copy:?}");
    }
}
