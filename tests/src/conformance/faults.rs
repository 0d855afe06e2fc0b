//! Cases of the matcher's rules as every backend must keep them:
//! cancelled receives, retired tags, epochs, the byte budget.

use std::task::Poll;
use std::time::Duration;

use super::{
    eventually, has_room, held, join_all, one, others, poll_once, queued, rank, receive, recv_ok,
    refused, send_ok, soon, spawn_sends, tag, Cluster, ConformanceConfig, Expect, How, Msg,
};
use kungfu_transport::mem::SeededRng;
use kungfu_transport::{Epoch, Header, PeerSet, Transport};

/// Rank 1 receives from the others while its receives are dropped.
///
/// First, one frame at a time: a receive is polled once (waiting), its
/// frame is sent, and the receive is dropped, either at once or after one
/// more poll that did not finish; the next receive must get the frame.
/// Then a stream of frames, each receive raced against a short timer (it
/// is dropped whenever the timer wins). Both through `recv` and
/// `recv_in_place`. Nothing may be lost or arrive twice, and nothing may
/// be left held.
///
/// All of it twice: with receives that sleep at once (no spin, so a
/// receive polled once is registered and asleep when it is dropped), and
/// with receives that spin a while first.
pub async fn cancel_safety<C: Cluster>() {
    for spin in [Duration::ZERO, Duration::from_micros(200)] {
        let cfg = ConformanceConfig {
            spin,
            ..ConformanceConfig::default()
        };
        cancel_safety_with::<C>(cfg).await;
    }
}

async fn cancel_safety_with<C: Cluster>(cfg: ConformanceConfig) {
    let n = 3;
    let ts = C::connect(n, cfg.clone()).await;
    let me = rank(1);
    let t = &*ts[1];
    let mut expect = Expect::new::<C>();
    let (mut dropped, mut rng) = (0, SeededRng::new(0xca5c));
    for k in 0..24u32 {
        for s in others(n, me) {
            let len = [0, 1, 333, 5000, 70_000][(k % 5) as usize];
            let m = Msg::new(s, me, tag(cfg.epoch, 7, k), s.0, len);
            expect.add(&m);
            let from = one(s);
            let how = if k % 4 < 2 {
                How::Owned
            } else {
                How::InPlace(true)
            };
            let done = {
                let mut fut = Box::pin(receive(t, how, m.header.tag, &from, soon()));
                let early = poll_once(&mut fut).await;
                assert!(
                    early.is_pending(),
                    "{}: {early:?} before the send",
                    C::name()
                );
                send_ok(C::name(), &*ts[s.idx()], &m).await;
                if k % 2 == 0 {
                    None // dropped while its frame is on the way or queued
                } else {
                    match poll_once(&mut fut).await {
                        Poll::Ready(r) => Some(r),
                        Poll::Pending => None,
                    }
                }
            };
            let got = match done {
                Some(r) => r,
                None => {
                    dropped += 1;
                    receive(t, how, m.header.tag, &from, soon()).await
                }
            };
            let got = got.unwrap_or_else(|e| panic!("{}: {e}", C::name()));
            expect.got::<C>(me, n, &got);
        }
    }
    assert!(expect.is_empty());
    assert!(
        dropped >= 24,
        "{}: only {dropped} receives dropped",
        C::name()
    );

    // A stream, each receive racing a timer of 0..2 ms.
    let count = 150u32;
    let mut sends = Vec::new();
    for s in others(n, me) {
        let msgs: Vec<Msg> = (0..count)
            .map(|c| Msg::new(s, me, tag(cfg.epoch, 8, 0), c, rng.below(6000) as usize))
            .collect();
        msgs.iter().for_each(|m| expect.add(m));
        sends.push(spawn_sends(C::name(), &ts[s.idx()], msgs));
    }
    let all = PeerSet::all(n);
    let (mut got_n, mut cut) = (0, 0);
    let deadline = soon();
    while got_n < count * (n as u32 - 1) {
        let how = if got_n % 2 == 0 {
            How::Owned
        } else {
            How::InPlace(true)
        };
        let timer = Duration::from_micros(rng.below(2000));
        tokio::select! {
            r = receive(t, how, tag(cfg.epoch, 8, 0), &all, deadline) => {
                let got = r.unwrap_or_else(|e| panic!("{}: {e} after {got_n} frames", C::name()));
                expect.got::<C>(me, n, &got);
                got_n += 1;
            }
            () = tokio::time::sleep(timer) => cut += 1,
        }
    }
    join_all(C::name(), sends).await;
    assert!(expect.is_empty());
    assert_eq!(queued(t), 0, "{}: bytes left held ({cut} cut)", C::name());
}

/// Rank 1 retires a tag while frames of it are queued: the bytes are freed
/// at once, and those frames and every later one of the tag become strays
/// (headers only, payload dropped, `len` 0), many times the budget of them,
/// none holding memory. The endpoint stays usable.
pub async fn retired_tags_become_strays<C: Cluster>() {
    let n = 3;
    let budget = 64 << 10;
    let cfg = ConformanceConfig::with_budget(budget);
    let ts = C::connect(n, cfg.clone()).await;
    let (me, t) = (rank(1), &*ts[1]);
    let x = tag(cfg.epoch, 11, 0);
    let mut strays = std::collections::HashMap::new();
    let mut first = 0;
    for s in others(n, me) {
        for c in 0..4 {
            let m = Msg::new(s, me, x, c, 1000 + c as usize);
            send_ok(C::name(), &*ts[s.idx()], &m).await;
            first += m.payload.len();
            strays.insert((s, c), m.header);
        }
    }
    eventually(C::name(), "the frames are queued", || queued(t) == first).await;
    t.retire(x);
    assert_eq!(queued(t), 0, "{}: retiring freed nothing", C::name());
    let mut sends = Vec::new();
    for s in others(n, me) {
        // more than the budget from each sender
        let msgs: Vec<Msg> = (100..132)
            .map(|c| Msg::new(s, me, x, c, 4096 + c as usize))
            .collect();
        msgs.iter()
            .for_each(|m| assert!(strays.insert((s, m.header.chunk), m.header).is_none()));
        sends.push(spawn_sends(C::name(), &ts[s.idx()], msgs));
    }
    while !strays.is_empty() {
        let f = t.recv_stray(soon()).await;
        let f = f.unwrap_or_else(|e| panic!("{}: {} strays missing: {e}", C::name(), strays.len()));
        let Some(h) = strays.remove(&(f.from, f.header.chunk)) else {
            panic!("{}: a stray nobody sent, or twice: {f:?}", C::name());
        };
        assert_eq!(f.header, Header { len: 0, ..h }, "{}", C::name());
        assert!(f.payload.is_empty(), "{}", C::name());
        assert_eq!(queued(t), 0, "{}: a stray holds bytes", C::name());
    }
    join_all(C::name(), sends).await;
    assert_eq!(queued(t), 0, "{}", C::name());
    // still usable
    let m = Msg::new(rank(0), me, tag(cfg.epoch, 12, 0), 0, 77);
    send_ok(C::name(), &*ts[0], &m).await;
    let f = recv_ok(C::name(), t, m.header.tag, &one(rank(0))).await;
    assert_eq!(f.payload, m.payload);
}

/// Endpoints connected at epoch 5; rank 0 sends to ranks 1 and 2 (in a
/// hybrid cluster, one across shared memory, one across TCP), each of
/// which: holds a frame of epoch 5 and an early one of epoch 6, advances
/// to 6 (the first is dropped, the early one kept), refuses and counts a
/// later frame of epoch 5, does not go back when asked to advance to 4,
/// and still takes frames of epoch 6.
pub async fn stale_epochs<C: Cluster>() {
    let n = 3;
    let (e5, e6) = (Epoch(5), Epoch(6));
    let cfg = ConformanceConfig {
        epoch: e5,
        ..ConformanceConfig::default()
    };
    let ts = C::connect(n, cfg.clone()).await;
    for t in &ts {
        assert_eq!(t.epoch(), e5, "{}: the epoch connected at", C::name());
    }
    let zero = one(rank(0));
    for r in [rank(1), rank(2)] {
        let t = &*ts[r.idx()];
        let send = |op: u64, epoch: Epoch, len: usize| {
            let m = Msg::new(rank(0), r, tag(epoch, op, r.0), 0, len);
            let s = ts[0].clone();
            async move {
                send_ok(C::name(), &*s, &m).await;
                m
            }
        };
        let old = send(1, e5, 100).await;
        eventually(C::name(), "the frame of epoch 5 is held", || {
            queued(t) == 100
        })
        .await;
        let early = send(2, e6, 50).await;
        eventually(C::name(), "the early frame is held", || queued(t) == 150).await;
        t.advance_epoch(e6);
        assert_eq!(t.epoch(), e6, "{}", C::name());
        assert_eq!(
            queued(t),
            50,
            "{}: advancing to 6 must drop the frame of 5 and keep the early one of 6",
            C::name()
        );
        assert!(held(t, old.header.tag, &zero).is_none(), "{}", C::name());

        let before = refused(t);
        let stale = send(3, e5, 60).await;
        let what = "the frame of epoch 5 is refused";
        eventually(C::name(), what, || refused(t) == before + 1).await;
        assert_eq!(queued(t), 50, "{}: a refused frame is held", C::name());
        assert!(held(t, stale.header.tag, &zero).is_none(), "{}", C::name());
        let f = recv_ok(C::name(), t, early.header.tag, &zero).await;
        assert_eq!((f.header, f.payload), (early.header, early.payload));

        t.advance_epoch(Epoch(4));
        assert_eq!(t.epoch(), e6, "{}: the epoch went back", C::name());
        let stale = send(4, e5, 10).await;
        eventually(C::name(), what, || refused(t) == before + 2).await;
        assert!(held(t, stale.header.tag, &zero).is_none(), "{}", C::name());
        t.advance_epoch(e6);
        assert_eq!(t.epoch(), e6, "{}", C::name());
        let fresh = send(5, e6, 10).await;
        let f = recv_ok(C::name(), t, fresh.header.tag, &zero).await;
        assert_eq!(f.payload, fresh.payload);
        assert_eq!(queued(t), 0, "{}", C::name());
    }
}

/// The others send rank 1, whose budget is 64 KiB, 4 KiB frames worth
/// many times the budget. Rank 1 first waits until it is full (so the
/// backend has stopped reading a sender), then takes everything, checking
/// that it never holds more than the budget plus one frame. Then a frame
/// four times the budget passes, alone and behind a held frame.
pub async fn back_pressure<C: Cluster>() {
    let n = 3;
    let budget = 64 << 10;
    let cfg = ConformanceConfig::with_budget(budget);
    let ts = C::connect(n, cfg.clone()).await;
    let (me, t) = (rank(1), &*ts[1]);
    let x = tag(cfg.epoch, 31, 0);
    let (frames, largest) = (64u32, 4096 + 7 * n + 2);
    let mut expect = Expect::new::<C>();
    let mut sends = Vec::new();
    for s in others(n, me) {
        let msgs: Vec<Msg> = (0..frames)
            .map(|c| Msg::new(s, me, x, c, 4096 + 7 * s.idx() + (c % 3) as usize))
            .collect();
        msgs.iter().for_each(|m| expect.add(m));
        sends.push(spawn_sends(C::name(), &ts[s.idx()], msgs));
    }
    let full = "the receiver is full";
    eventually(C::name(), full, || !has_room(t, largest)).await;
    let mut peak = queued(t);
    let all = PeerSet::all(n);
    for _ in 0..frames * (n as u32 - 1) {
        peak = peak.max(queued(t));
        let f = t.recv(x, &all, soon()).await;
        let f = f.unwrap_or_else(|e| panic!("{}: {e}", C::name()));
        expect.arrived(f.from, &f.header, &f.payload);
        peak = peak.max(queued(t));
    }
    join_all(C::name(), sends).await;
    assert!(expect.is_empty());
    assert!(
        peak <= budget + largest,
        "{}: held {peak} bytes, the budget is {budget}",
        C::name()
    );
    assert_eq!(queued(t), 0, "{}", C::name());

    let from0 = one(rank(0));
    let big = Msg::new(rank(0), me, tag(cfg.epoch, 32, 0), 0, 4 * budget);
    send_ok(C::name(), &*ts[0], &big).await;
    let f = recv_ok(C::name(), t, big.header.tag, &from0).await;
    assert_eq!(f.payload, big.payload, "{}", C::name());
    // behind a held frame, it waits for room, then passes
    let small = Msg::new(rank(0), me, tag(cfg.epoch, 33, 0), 0, 100);
    send_ok(C::name(), &*ts[0], &small).await;
    eventually(C::name(), "the small frame is held", || queued(t) == 100).await;
    let big = Msg::new(rank(0), me, tag(cfg.epoch, 34, 0), 0, 4 * budget);
    let sending = spawn_sends(C::name(), &ts[0], vec![big.clone()]);
    let f = recv_ok(C::name(), t, small.header.tag, &from0).await;
    assert_eq!(f.payload, small.payload, "{}", C::name());
    let f = recv_ok(C::name(), t, big.header.tag, &from0).await;
    assert_eq!(f.payload, big.payload, "{}", C::name());
    join_all(C::name(), vec![sending]).await;
}
