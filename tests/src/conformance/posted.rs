//! Cases of posted receives: frames land in ranges of the op's memory.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use super::{
    eventually, join_all, one, others, queued, rank, send_ok, soon, spawn_sends, tag, Cluster,
    ConformanceConfig, Msg, WAIT,
};
use kungfu_transport::region::Region;
use kungfu_transport::{
    Arrival, FrameKind, Instant, PeerSet, RecvKey, Transport, TransportError, HEADER_LEN,
};

/// What one receiver gets: each frame and its range, and the total.
type Inbox = (Vec<(Msg, std::ops::Range<usize>)>, usize);

fn key_of(m: &Msg) -> RecvKey {
    RecvKey {
        tag: m.header.tag,
        from: m.from,
        chunk: m.header.chunk,
        step: m.header.step,
    }
}

/// Data frames only (posted receives are for data; `Msg` makes every
/// fifth chunk an abort).
fn data_chunk(k: usize) -> u32 {
    let c = k as u32;
    c + c / 4
}

/// Takes arrivals of `tag` at `t` until every key in `due` has landed;
/// a lent frame or an owned one of those keys is a failure. Returns the
/// frames that came owned (keys not posted, or not landable).
async fn take_landed<T: Transport>(
    name: &str,
    t: &T,
    tag: kungfu_transport::OpTag,
    due: &mut HashMap<RecvKey, std::ops::Range<usize>>,
) -> Vec<kungfu_transport::Frame> {
    let mut owned = Vec::new();
    let all = PeerSet::all(t.size());
    while !due.is_empty() {
        let r = t
            .recv_in_place(tag, &all, soon(), |from, h, _| {
                let posted = RecvKey::of(from, h).is_some_and(|k| due.contains_key(&k));
                assert!(!posted, "{name}: a frame posted for was lent: {h:?}");
                false
            })
            .await;
        match r {
            Ok(Arrival::Landed { from, header }) => {
                let k = RecvKey::of(from, &header).expect("a data frame landed");
                let Some(range) = due.remove(&k) else {
                    panic!("{name}: landed twice or never posted: {k:?}");
                };
                assert_eq!(header.len as usize, range.len(), "{name}: landed length");
            }
            Ok(Arrival::Frame(f)) => {
                let k = RecvKey::of(f.from, &f.header);
                if let Some(k) = k.filter(|k| due.contains_key(k)) {
                    let want = due[&k].len();
                    assert_ne!(
                        f.payload.len(),
                        want,
                        "{name}: a frame posted for came owned: {k:?}"
                    );
                }
                owned.push(f);
            }
            Ok(Arrival::Applied) => panic!("{name}: applied, but the closure declined"),
            Err(e) => panic!("{name}: waiting for {} landings: {e}", due.len()),
        }
    }
    owned
}

/// Posted receives, between every ordered pair of three ranks, of every
/// size the other cases use (empty, odd, larger than a ring, so that a
/// frame lands from a ring that wraps, larger than a socket read):
///
/// - half are posted before their frames are sent: they land in place
///   (straight from the socket, the ring, or the sender's buffer) and
///   arrive as [`Arrival::Landed`]; none is lent or comes owned;
/// - half are sent first and posted once held: the post copies them in at
///   once and says so;
/// - the ranges are packed into one region per receiver, so a byte
///   written outside its range shows up in a neighbour's;
/// - a frame of another length than posted does not land (it comes owned,
///   the receive stays posted), and retiring the tag releases the range;
/// - at the end no byte is held unmatched and no share of a region is left.
pub async fn posted_receives<C: Cluster>() {
    let n = 3;
    let cfg = ConformanceConfig::polling();
    let ts = C::connect(n, cfg.clone()).await;
    let ring = cfg.ring_bytes;
    let sizes = [
        0,
        1,
        7,
        HEADER_LEN + 1,
        // fit a ring whole, and wrap its end now and then
        1000,
        1531,
        ring / 2 + 3,
        2047,
        ring - 1,
        ring + 3,
        3 * ring + 7,
        65_537,
        200_003,
    ];
    for (seq, early) in [(0u32, true), (1, false)] {
        let x = tag(cfg.epoch, 7, seq);
        // What each receiver gets, packed into one region per receiver.
        let mut plans: Vec<Inbox> = vec![(Vec::new(), 0); n];
        for i in 0..n {
            for (k, &len) in sizes.iter().enumerate() {
                for j in others(n, rank(i)) {
                    let m = Msg::new(rank(i), j, x, data_chunk(k), len);
                    assert_eq!(m.header.kind, FrameKind::Data);
                    let (list, at) = &mut plans[j.idx()];
                    list.push((m, *at..*at + len));
                    *at += len;
                }
            }
        }
        let regions: Vec<Arc<Region>> = plans
            .iter()
            .map(|(_, len)| Region::from_vec(vec![0xee; *len]))
            .collect();
        let post_all = |j: usize, expect_now: bool| {
            let mut due = HashMap::new();
            for (m, range) in &plans[j].0 {
                let mem = regions[j]
                    .write(range.clone())
                    .expect("ranges are disjoint");
                match ts[j].post_recv(key_of(m), mem) {
                    Ok(None) if !expect_now => {
                        due.insert(key_of(m), range.clone());
                    }
                    Ok(Some(h)) if expect_now => assert_eq!(h, m.header, "{}", C::name()),
                    other => panic!(
                        "{}: post {:?} ({} bytes), {}: {other:?}",
                        C::name(),
                        m.header,
                        range.len(),
                        if expect_now {
                            "held already"
                        } else {
                            "before it was sent"
                        }
                    ),
                }
            }
            due
        };
        let dues: Vec<_> = (0..n)
            .map(|j| post_all_if(early, || post_all(j, false)))
            .collect();
        // Receivers wait while the frames stream (so a polling receiver
        // lands frames straight from a ring, wrapped ones in two pieces).
        let mut recvs = Vec::new();
        for (j, mut due) in dues.into_iter().enumerate() {
            let t = ts[j].clone();
            recvs.push(tokio::spawn(async move {
                let owned = take_landed(C::name(), &*t, x, &mut due).await;
                assert!(owned.is_empty(), "{}: owned frames {owned:?}", C::name());
            }));
        }
        let mut sends = Vec::new();
        for (i, t) in ts.iter().enumerate() {
            let msgs: Vec<Msg> = plans
                .iter()
                .flat_map(|(list, _)| list.iter().map(|(m, _)| m.clone()))
                .filter(|m| m.from == rank(i))
                .collect();
            sends.push(spawn_sends(C::name(), t, msgs));
        }
        join_all(C::name(), sends).await;
        join_all(C::name(), recvs).await;
        for j in 0..n {
            if !early {
                let total: usize = plans[j].0.iter().map(|(m, _)| m.payload.len()).sum();
                let t = &*ts[j];
                eventually(C::name(), "every frame is held", || queued(t) == total).await;
                post_all(j, true);
            }
            assert_eq!(queued(&*ts[j]), 0, "{}: bytes left held", C::name());
            assert_eq!(regions[j].shares(), 0, "{}: shares left", C::name());
            let bytes = regions[j].read(0..regions[j].len()).unwrap();
            for (m, range) in &plans[j].0 {
                let got = &bytes.as_slice()[range.clone()];
                assert!(
                    got == &m.payload[..],
                    "{}: {:?} from {} did not land intact at {range:?}",
                    C::name(),
                    m.header,
                    m.from
                );
            }
        }
    }
    // Another length than posted: not landed; the post stays until the tag
    // retires, which releases its range.
    let y = tag(cfg.epoch, 8, 0);
    let region = Region::from_vec(vec![0; 64]);
    let m = Msg::new(rank(1), rank(0), y, 0, 65);
    ts[0]
        .post_recv(key_of(&m), region.write(0..64).unwrap())
        .unwrap();
    send_ok(C::name(), &*ts[1], &m).await;
    let all = PeerSet::all(n);
    match ts[0].recv_in_place(y, &all, soon(), |_, _, _| false).await {
        Ok(Arrival::Frame(f)) => assert_eq!(f.payload, m.payload, "{}", C::name()),
        other => panic!("{}: a frame of another length: {other:?}", C::name()),
    }
    assert_eq!(region.shares(), 1, "{}: still posted", C::name());
    ts[0].retire(y);
    assert_eq!(region.shares(), 0, "{}: retired, released", C::name());
    assert_eq!(Region::into_vec(region).unwrap(), vec![0; 64]);
}

fn post_all_if<X: Default>(cond: bool, f: impl FnOnce() -> X) -> X {
    if cond {
        f()
    } else {
        X::default()
    }
}

/// Posted receives and failures: a receive waiting on a posted frame is
/// dropped and the frame still lands for the next one (cancel-safety);
/// a retired op's posted range is never written, its frame becoming a
/// stray; a post for an older epoch is refused; a receive waiting on a
/// posted frame of a rank that vanishes fails naming it; after shutdown
/// a post fails with `Closed` and releases its range.
pub async fn posted_failures<C: Cluster>() {
    let n = 3;
    let cfg = ConformanceConfig {
        epoch: kungfu_transport::Epoch(2),
        spin: Duration::ZERO,
        ..ConformanceConfig::default()
    };
    let ts = C::connect(n, cfg.clone()).await;
    let (r0, r1, r2) = (rank(0), rank(1), rank(2));
    let region = Region::from_vec(vec![0; 300]);

    // Cancel-safety: the receive is dropped, the frame lands anyway.
    let a = Msg::new(r1, r0, tag(cfg.epoch, 1, 0), 0, 100);
    ts[0]
        .post_recv(key_of(&a), region.write(0..100).unwrap())
        .unwrap();
    let from1 = one(r1);
    let early = Instant::now() + Duration::from_millis(20);
    let r = ts[0]
        .recv_in_place(a.header.tag, &from1, early, |_, _, _| false)
        .await;
    assert!(
        matches!(r, Err(TransportError::Timeout { .. })),
        "{}: {r:?}",
        C::name()
    );
    send_ok(C::name(), &*ts[1], &a).await;
    let mut due = HashMap::from([(key_of(&a), 0..100)]);
    let owned = take_landed(C::name(), &*ts[0], a.header.tag, &mut due).await;
    assert!(owned.is_empty(), "{}", C::name());

    // Retired before its frame came: the range stays untouched.
    let b = Msg::new(r1, r0, tag(cfg.epoch, 2, 0), 0, 100);
    ts[0]
        .post_recv(key_of(&b), region.write(100..200).unwrap())
        .unwrap();
    ts[0].retire(b.header.tag);
    send_ok(C::name(), &*ts[1], &b).await;
    let stray = tokio::time::timeout(WAIT, ts[0].recv_stray(soon()))
        .await
        .expect("a stray");
    assert_eq!(stray.unwrap().header.tag, b.header.tag, "{}", C::name());

    // An older epoch.
    let old = Msg::new(r1, r0, tag(kungfu_transport::Epoch(1), 3, 0), 0, 10);
    let r = ts[0].post_recv(key_of(&old), region.write(200..210).unwrap());
    assert!(
        matches!(r, Err(TransportError::StaleEpoch { .. })),
        "{}: {r:?}",
        C::name()
    );

    // A rank that vanishes while a receive waits on its posted frame.
    let c = Msg::new(r2, r0, tag(cfg.epoch, 4, 0), 0, 50);
    ts[0]
        .post_recv(key_of(&c), region.write(200..250).unwrap())
        .unwrap();
    C::abandon(&ts[2]);
    let r = ts[0]
        .recv_in_place(c.header.tag, &one(r2), soon() + WAIT, |_, _, _| false)
        .await;
    assert!(
        matches!(r, Err(TransportError::PeerLost { peer, .. }) if peer == r2),
        "{}: {r:?}",
        C::name()
    );
    ts[0].retire(c.header.tag);

    // Closed.
    ts[0].shutdown();
    let d = Msg::new(r1, r0, tag(cfg.epoch, 5, 0), 0, 50);
    let r = ts[0].post_recv(key_of(&d), region.write(250..300).unwrap());
    assert!(
        matches!(r, Err(TransportError::Closed)),
        "{}: {r:?}",
        C::name()
    );
    assert_eq!(region.shares(), 0, "{}: shares left", C::name());
    let bytes = Region::into_vec(region).unwrap();
    assert_eq!(&bytes[..100], &a.payload[..], "{}", C::name());
    assert!(
        bytes[100..].iter().all(|&b| b == 0),
        "{}: written after retire",
        C::name()
    );
}
