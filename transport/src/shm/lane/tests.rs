//! The lane protocol over heap rings (Miri can run these).

use super::*;

const CAP: usize = 4096;

fn tag(seq: u32) -> OpTag {
    OpTag {
        epoch: Epoch(0),
        op: OpId(7),
        seq,
    }
}

/// Rank 0's lanes to rank 1 and rank 1's from rank 0, over one ring.
fn pair() -> (HostLanes, HostLanes, Arc<Ring>) {
    let ring = Arc::new(Ring::heap(CAP));
    let a = HostLanes::new(Rank(0), &[None, Some(ring.clone())], &[None, None]);
    let b = HostLanes::new(Rank(1), &[None, None], &[Some(ring.clone()), None]);
    (a, b, ring)
}

fn take(b: &HostLanes, t: OpTag) -> Option<(u32, Vec<u8>)> {
    let f = b.find(Rank(0), t).unwrap()?;
    let v = b.read(Rank(0), t, &f, <[u8]>::to_vec).unwrap();
    b.release(Rank(0), t, &f);
    Some((f.digest(), v))
}

#[test]
fn in_order_contributions_are_read_in_place() {
    let (a, b, _) = pair();
    for round in 0..3 * SLOTS as u32 {
        assert!(take(&b, tag(round)).is_none());
        assert!(a
            .post(Rank(1), tag(round), round, &round.to_le_bytes())
            .unwrap());
        assert_eq!(
            take(&b, tag(round)),
            Some((round, round.to_le_bytes().to_vec()))
        );
    }
}

#[test]
fn any_order_and_a_full_window_spill_into_the_stash() {
    let (a, b, _) = pair();
    // SLOTS fit; the next waits for the receiver
    for s in 0..SLOTS as u32 {
        assert!(a.post(Rank(1), tag(s), 0, &[s as u8; 3]).unwrap());
    }
    assert!(!a.post(Rank(1), tag(99), 0, &[1]).unwrap());
    // the receiver wants one not sent yet: the window spills, the sender goes on
    assert!(take(&b, tag(99)).is_none());
    assert!(a.post(Rank(1), tag(99), 5, &[1, 2]).unwrap());
    assert_eq!(take(&b, tag(99)), Some((5, vec![1, 2])));
    for s in (0..SLOTS as u32).rev() {
        assert_eq!(take(&b, tag(s)), Some((0, vec![s as u8; 3])));
    }
    // claimed slots are not spilled, nor found twice
    assert!(a.post(Rank(1), tag(100), 0, &[9]).unwrap());
    let f = b.find(Rank(0), tag(100)).unwrap().unwrap();
    assert!(b.find(Rank(0), tag(100)).unwrap().is_none());
    b.release(Rank(0), tag(100), &f);
}

#[test]
fn parts_are_one_contribution() {
    let (a, b, _) = pair();
    assert!(a
        .post_parts(Rank(1), tag(0), 3, &[&[1, 2], &[], &[3, 4, 5]])
        .unwrap());
    assert_eq!(take(&b, tag(0)), Some((3, vec![1, 2, 3, 4, 5])));
    // the total is bounded, not each part
    let half = vec![0u8; SLOT_BYTES / 2 + 1];
    assert!(matches!(
        a.post_parts(Rank(1), tag(1), 0, &[&half, &half]),
        Err(TransportError::FrameTooLarge { len, .. }) if len == 2 * half.len()
    ));
}

#[test]
fn oversized_and_corrupt_contributions_are_refused() {
    let (a, b, ring) = pair();
    assert!(matches!(
        a.post(Rank(1), tag(0), 0, &vec![0; SLOT_BYTES + 1]),
        Err(TransportError::FrameTooLarge { .. })
    ));
    assert!(a.post(Rank(1), tag(0), 0, &[1]).unwrap());
    let lane = Lane { ring: ring.clone() };
    // a length past the slot
    lane.u32_at(Lane::slot(0) + H_LEN)
        .store(SLOT_BYTES as u32 + 1, Ordering::Relaxed);
    assert!(matches!(
        b.find(Rank(0), tag(0)),
        Err(TransportError::PeerLost { .. })
    ));
    // a receiver that claims to have released more than was sent
    lane.u64_at(OFF_ACKED).store(50, Ordering::Relaxed);
    assert!(matches!(
        a.post(Rank(1), tag(1), 0, &[1]),
        Err(TransportError::PeerLost { .. })
    ));
    // the wrong sequence word: not published
    let (a, b, ring) = pair();
    assert!(a.post(Rank(1), tag(0), 0, &[1]).unwrap());
    Lane { ring }
        .u64_at(Lane::slot(0) + H_SEQ)
        .store(7, Ordering::Relaxed);
    assert!(b.find(Rank(0), tag(0)).unwrap().is_none());
}

#[test]
fn lanes_to_unknown_ranks_are_errors() {
    let (a, b, _) = pair();
    assert!(a.post(Rank(5), tag(0), 0, &[]).is_err());
    assert!(b.find(Rank(1), tag(0)).is_err());
    // one direction each: neither is a complete set of lanes
    assert!(!a.complete() && !b.complete());
}

/// Claimed contributions do not hold the window either: ops waiting for a
/// third rank must not keep this sender waiting (a cycle of three ranks
/// would deadlock). They move to the stash and stay readable there.
#[test]
fn claimed_contributions_spill_too() {
    let (a, b, _) = pair();
    let mut claims = Vec::new();
    for s in 0..SLOTS as u32 {
        assert!(a.post(Rank(1), tag(s), s, &[s as u8; 2]).unwrap());
        claims.push(b.find(Rank(0), tag(s)).unwrap().unwrap());
    }
    assert!(!a.post(Rank(1), tag(50), 0, &[1]).unwrap());
    assert!(b.find(Rank(0), tag(50)).unwrap().is_none()); // spills
    assert!(a.post(Rank(1), tag(50), 0, &[1]).unwrap());
    for (s, f) in claims.iter().enumerate() {
        let v = b.read(Rank(0), tag(s as u32), f, <[u8]>::to_vec).unwrap();
        assert_eq!(v, vec![s as u8; 2]);
        b.release(Rank(0), tag(s as u32), f);
    }
    assert_eq!(take(&b, tag(50)), Some((0, vec![1])));
    let rx = lock(b.rx(Rank(0)).unwrap());
    assert!(rx.stash.is_empty() && rx.stash_bytes == 0);
}

/// Sleeps on `armed` for up to `long`, which something must cut short.
fn woken(armed: &Armed<'_>, long: std::time::Duration) {
    let t = std::time::Instant::now();
    armed.sleep(None, long);
    // without futex_waitv (Miri) the sleep is a tenth of the timeout
    if !cfg!(miri) {
        assert!(t.elapsed() < long / 2, "{:?}", t.elapsed());
    }
}

/// A post or a release moves the activity count of the side that waits
/// for it, and wakes it from a sleep on the bells armed before.
#[test]
fn posts_and_releases_ring_the_bells() {
    let (a, b, _) = pair();
    let (a0, b0) = (a.activity(), b.activity());
    let long = std::time::Duration::from_secs(if cfg!(miri) { 1 } else { 20 });
    let armed = b.arm();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert!(a.post(Rank(1), tag(0), 0, &[1, 2, 3]).unwrap());
        });
        woken(&armed, long);
    });
    drop(armed);
    assert_ne!(b.activity(), b0, "the receiver heard the post");
    assert_eq!(a.activity(), a0, "nothing was released yet");
    let armed = a.arm();
    assert_eq!(take(&b, tag(0)), Some((0, vec![1, 2, 3])));
    // released after arming, before the sleep: it returns at once
    woken(&armed, long);
    drop(armed);
    assert_ne!(a.activity(), a0, "the sender heard the release");
}
