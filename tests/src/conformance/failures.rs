//! Cases of failure: a peer that vanishes, an endpoint that closes, input
//! a caller should not give.

use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use super::{
    eventually, join_all, one, others, queued, rank, receive, recv_ok, send_ok, soon, spawn_sends,
    tag, Cluster, ConformanceConfig, Expect, How, Msg, Waiting, WAIT,
};
use kungfu_transport::{Header, Instant, PeerSet, Transport, TransportError};

fn lost_is(name: &str, what: &str, r: Result<impl std::fmt::Debug, TransportError>, who: Rank) {
    match r {
        Err(TransportError::PeerLost { peer, .. }) if peer == who => {}
        other => panic!("{name}: {what}: expected {who} lost, got {other:?}"),
    }
}

fn closed_is(name: &str, what: &str, r: Result<impl std::fmt::Debug, TransportError>) {
    match r {
        Err(TransportError::Closed) => {}
        other => panic!("{name}: {what} after closing: expected Closed, got {other:?}"),
    }
}

/// Rank 3 of four leaves a frame queued at each of the others, which then
/// wait for another frame from it; rank 3 vanishes ([`Cluster::abandon`];
/// in a hybrid cluster one survivor shares its host, two do not). The
/// waiting receives fail naming it; the queued frame is still taken first
/// (`check_peers_for` agrees), then receives naming it fail, as do sends
/// to it; the survivors still exchange frames.
pub async fn lost_peer<C: Cluster>() {
    let n = 4;
    let cfg = ConformanceConfig {
        // a receive polled once is asleep: what ends it must wake it
        spin: Duration::ZERO,
        ..ConformanceConfig::default()
    };
    let ts = C::connect(n, cfg.clone()).await;
    let victim = rank(3);
    let survivors = others(n, victim);
    let gone = one(victim);
    let x = tag(cfg.epoch, 41, 0);
    let mut left = Vec::new();
    for &s in &survivors {
        let m = Msg::new(victim, s, x, s.0, 500 + s.idx());
        send_ok(C::name(), &*ts[victim.idx()], &m).await;
        left.push(m);
    }
    for m in &left {
        let t = &*ts[m.to.idx()];
        let len = m.payload.len();
        eventually(C::name(), "its frame is held", || queued(t) == len).await;
    }
    let y = tag(cfg.epoch, 42, 0);
    let what = "a receive waiting for the rank that is lost";
    let later = soon() + WAIT;
    let waiting: Vec<_> = survivors
        .iter()
        .map(|s| Waiting::start(C::name(), what, ts[s.idx()].recv(y, &gone, later)))
        .collect();

    C::abandon(&ts[victim.idx()]);
    for w in waiting {
        lost_is(C::name(), what, w.outcome(C::name(), what).await, victim);
    }
    for (m, &s) in left.iter().zip(&survivors) {
        let t = &*ts[s.idx()];
        lost_is(C::name(), "check_peers", t.check_peers(&gone), victim);
        let what = "check_peers_for a tag with a frame of it held";
        assert!(t.check_peers_for(x, &gone).is_ok(), "{}: {what}", C::name());
        let f = t.recv(x, &gone, soon()).await;
        let f = f.unwrap_or_else(|e| panic!("{}: its last frame: {e}", C::name()));
        assert_eq!((f.header, f.payload), (m.header, m.payload.clone()));
        lost_is(
            C::name(),
            "check_peers_for",
            t.check_peers_for(x, &gone),
            victim,
        );
        lost_is(
            C::name(),
            "a receive",
            t.recv(x, &gone, soon()).await,
            victim,
        );
        let sent =
            tokio::time::timeout(WAIT, t.send(victim, m.header, Bytes::from_static(b"late")));
        let sent = sent.await.expect("a send to a lost peer ends");
        lost_is(C::name(), "a send", sent, victim);
    }

    let alive: PeerSet = survivors.iter().copied().collect();
    let z = tag(cfg.epoch, 43, 0);
    for (i, &s) in survivors.iter().enumerate() {
        let next = survivors[(i + 1) % survivors.len()];
        let m = Msg::new(s, next, z, 0, 321);
        send_ok(C::name(), &*ts[s.idx()], &m).await;
        let t = &*ts[next.idx()];
        let f = t.recv(z, &one(s), soon()).await;
        let f = f.unwrap_or_else(|e| panic!("{}: between survivors: {e}", C::name()));
        assert_eq!(f.payload, m.payload);
        assert!(t.check_peers(&alive).is_ok(), "{}", C::name());
    }
}

/// Rank 0 sends ranks 1 and 2, whose budgets are small, more than they
/// have room for, and closes while they stay open: `close` returns by its
/// linger, the frames all arrive (those that waited in flight too), and
/// the peers see rank 0 gone. Afterwards every operation of rank 0 fails
/// with `Closed` (`try_send_now` may instead decline). Then rank 1 shuts
/// down with a receive and a stray receive pending: both fail with
/// `Closed`.
///
/// Where the backend holds sent frames in flight
/// ([`Cluster::holds_sent_frames`]) the sends finish before the receivers
/// take anything, so frames are still in a ring or socket when rank 0
/// closes. Where it does not, a send to a full receiver must wait, and
/// the receivers take the frames before rank 0 closes.
pub async fn closed_endpoint<C: Cluster>() {
    let n = 3;
    let budget = 2000;
    let cfg = ConformanceConfig {
        // a receive polled once is asleep: what ends it must wake it
        spin: Duration::ZERO,
        mailbox_bytes: budget,
        ..ConformanceConfig::default()
    };
    let ts = C::connect(n, cfg.clone()).await;
    let zero = rank(0);
    let x = tag(cfg.epoch, 51, 0);
    let (from0, first) = (one(zero), 3000);
    let mut sends = Vec::new();
    let mut expects = Vec::new();
    for r in others(n, zero) {
        let mut expect = Expect::new::<C>();
        // the first fills the receiver, the second waits for room, the
        // others wait behind it
        let msgs: Vec<Msg> = [first, 200_003, 1000, 0, 1, 17]
            .iter()
            .enumerate()
            .map(|(c, &len)| Msg::new(zero, r, x, c as u32, len))
            .collect();
        msgs.iter().for_each(|m| expect.add(m));
        expects.push((r, expect, msgs.len()));
        sends.push(spawn_sends(C::name(), &ts[0], msgs));
    }
    let receive_all = |expects: Vec<(Rank, Expect, usize)>| async {
        for (r, mut expect, count) in expects {
            let t = &*ts[r.idx()];
            for _ in 0..count {
                let f = t.recv(x, &from0, soon()).await;
                let f =
                    f.unwrap_or_else(|e| panic!("{}: a frame sent before close: {e}", C::name()));
                expect.arrived(f.from, &f.header, &f.payload);
            }
        }
    };
    let linger = Duration::from_millis(300);
    let close = || async {
        let closing = tokio::time::timeout(linger + WAIT, ts[0].close(linger));
        assert!(closing.await.is_ok(), "{}: close did not return", C::name());
    };
    if C::holds_sent_frames() {
        join_all(C::name(), sends).await;
        close().await;
        receive_all(expects).await;
    } else {
        for (r, _, _) in &expects {
            let t = &*ts[r.idx()];
            eventually(C::name(), "the receiver is full", || queued(t) == first).await;
        }
        let waiting = sends.iter().filter(|s| !s.is_finished()).count();
        assert_eq!(
            waiting,
            sends.len(),
            "{}: sends to a full receiver finished, but the backend declares it holds no frame in flight",
            C::name()
        );
        receive_all(expects).await;
        join_all(C::name(), sends).await;
        close().await;
    }
    for r in others(n, zero) {
        let after = ts[r.idx()]
            .recv(tag(cfg.epoch, 52, 0), &from0, soon())
            .await;
        lost_is(C::name(), "a receive from the closed rank", after, zero);
    }

    let t = &*ts[0];
    let h = Msg::new(zero, rank(1), tag(cfg.epoch, 53, 0), 0, 8).header;
    let all = PeerSet::all(n);
    let bytes = Bytes::from_static(b"after");
    closed_is(C::name(), "send", t.send(rank(1), h, bytes).await);
    closed_is(C::name(), "recv", t.recv(h.tag, &all, soon()).await);
    let r = receive(t, How::InPlace(true), h.tag, &all, soon()).await;
    closed_is(C::name(), "recv_in_place", r);
    closed_is(C::name(), "recv_stray", t.recv_stray(soon()).await);
    closed_is(C::name(), "check_peers", t.check_peers(&all));
    closed_is(C::name(), "check_peers_for", t.check_peers_for(h.tag, &all));
    match t.try_send_now(rank(1), h, b"after") {
        Ok(false) | Err(TransportError::Closed) => {}
        other => panic!("{}: try_send_now after closing: {other:?}", C::name()),
    }

    let t = &*ts[1];
    let two = one(rank(2));
    let later = soon() + WAIT;
    let (r, s) = ("a pending recv", "a pending recv_stray");
    let waiting = Waiting::start(C::name(), r, t.recv(tag(cfg.epoch, 54, 0), &two, later));
    let stray = Waiting::start(C::name(), s, t.recv_stray(later));
    t.shutdown();
    closed_is(C::name(), r, waiting.outcome(C::name(), r).await);
    closed_is(C::name(), s, stray.outcome(C::name(), s).await);
    let sent = t.send(rank(2), h, Bytes::from_static(b"x")).await;
    closed_is(C::name(), "send after shutdown", sent);
    ts[2].shutdown();
}

/// Sends to ranks out of range and to itself fail with `NoSuchPeer`, a
/// payload over the limit with `FrameTooLarge`, a header's `len` is set
/// from the payload whatever the caller put there, a receive naming only
/// a rank that does not exist just times out, and the endpoint stays
/// usable: a frame of exactly the limit passes.
pub async fn bad_input<C: Cluster>() {
    let n = 2;
    let max = 1 << 20;
    let cfg = ConformanceConfig {
        max_frame: max,
        ..ConformanceConfig::default()
    };
    let ts = C::connect(n, cfg.clone()).await;
    let t = &*ts[0];
    let h = Msg::new(rank(0), rank(1), tag(cfg.epoch, 61, 0), 0, 1).header;
    for to in [rank(2), rank(1000), Rank(u32::MAX), rank(0)] {
        match t.send(to, h, Bytes::from_static(b"x")).await {
            Err(TransportError::NoSuchPeer { peer, size }) if peer == to && size == n => {}
            other => panic!("{}: send to {to}: {other:?}", C::name()),
        }
        match t.try_send_now(to, h, b"x") {
            Ok(false) | Err(TransportError::NoSuchPeer { .. }) => {}
            other => panic!("{}: try_send_now to {to}: {other:?}", C::name()),
        }
    }
    match t.send(rank(1), h, Bytes::from(vec![0u8; max + 1])).await {
        Err(TransportError::FrameTooLarge { len, max: m }) if len == max + 1 && m == max => {}
        other => panic!("{}: a frame over the limit: {other:?}", C::name()),
    }
    let nobody = one(rank(5));
    let quick = Instant::now() + Duration::from_millis(50);
    match t.recv(h.tag, &nobody, quick).await {
        Err(TransportError::Timeout { .. }) => {}
        other => panic!("{}: a receive from no rank: {other:?}", C::name()),
    }

    let lying = Header { len: 999, ..h };
    let sent = t.send(rank(1), lying, Bytes::from_static(b"abc")).await;
    assert!(sent.is_ok(), "{}: {sent:?}", C::name());
    let f = recv_ok(C::name(), &*ts[1], h.tag, &one(rank(0))).await;
    assert_eq!(
        (f.header, &f.payload[..]),
        (Header { len: 3, ..h }, &b"abc"[..])
    );
    let m = Msg::new(rank(0), rank(1), tag(cfg.epoch, 62, 0), 0, max);
    send_ok(C::name(), t, &m).await;
    let f = recv_ok(C::name(), &*ts[1], m.header.tag, &one(rank(0))).await;
    assert_eq!(f.payload, m.payload);
    assert_eq!(queued(&*ts[1]), 0);
}
