//! The hostile-input and concurrency tests of the ring, over heap buffers
//! so that they run under Miri too (`scripts/miri-shm.sh`): Miri reports
//! any access outside the buffer, any data race between the two sides, and
//! any use of memory the protocol has not handed over.

use super::*;
use crate::{Epoch, FrameKind, Header, OpId, OpTag, HEADER_LEN};
use std::sync::Arc;

/// Small enough for Miri, large enough for whole frames.
const CAP: usize = 256;

fn header(len: usize, seq: u32) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: OpTag {
            epoch: Epoch(3),
            op: OpId(7),
            seq,
        },
        chunk: 1,
        step: 2,
        digest: 9,
        len: len as u64,
    }
}

fn payload(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 7 + seed) as u8).collect()
}

/// Writes raw bytes at the head and publishes them, as a sender would.
fn publish(r: &Ring, bytes: &[u8]) {
    assert!(r.producer().try_write(&[bytes]), "fits");
}

/// Overwrites the indices, as a corrupt peer could.
fn set_indices(r: &Ring, head: u64, tail: u64) {
    r.producer().set_indices(&r.consumer(), head, tail);
}

fn read_err(r: &Ring) -> String {
    let stop = AtomicBool::new(false);
    match r.consumer().read_frame(1 << 20, &stop, |n| vec![0u8; n]) {
        Err(Some(why)) => why,
        other => panic!("expected an error, got {:?}", other.map(|(h, _)| h)),
    }
}

/// The header of the next frame, peeked in place, or why not.
fn peek_header(r: &Ring) -> Result<Option<Header>, String> {
    Ok(r.consumer().peek_frame(1 << 20)?.map(|(h, _)| h))
}

#[test]
fn frames_flow_through_a_small_ring_between_two_threads() {
    // Frames from empty to several times the ring, so that both the
    // in-place path (whole frames) and the streaming path (waits for
    // space and for data, futex wake-ups) run.
    let sizes = [0usize, 1, 40, 215, 216, 217, 300, 1000, 3];
    let ring = Arc::new(Ring::heap(CAP));
    let stop = Arc::new(AtomicBool::new(false));
    let tx = {
        let (ring, stop) = (ring.clone(), stop.clone());
        std::thread::spawn(move || {
            let tx = ring.producer();
            for (k, &len) in sizes.iter().enumerate() {
                let h = header(len, k as u32).encode();
                let body = payload(len, k);
                if !tx.try_write(&[&h, &body]) {
                    tx.write_all(&h, &stop).unwrap();
                    tx.write_all(&body, &stop).unwrap();
                }
            }
            ring.close(SENDER_CLOSED);
        })
    };
    let mut rx = ring.consumer();
    for (k, &len) in sizes.iter().enumerate() {
        // Odd frames through the in-place path where they are whole.
        if k % 2 == 1 {
            if let Ok(Some((h, p))) = rx.peek_frame(1 << 20) {
                if p.holds(HEADER_LEN + h.len as usize) {
                    let n = h.len as usize;
                    let body = p.lend(HEADER_LEN, n, |parts| parts.concat());
                    assert_eq!(h, header(len, k as u32));
                    assert_eq!(body.as_deref(), Some(&payload(len, k)[..]));
                    assert!(p.consume(HEADER_LEN + n));
                    continue;
                }
            }
        }
        let (h, body) = rx.read_frame(1 << 20, &stop, |n| vec![0u8; n]).unwrap();
        assert_eq!(h, header(len, k as u32));
        assert_eq!(body, payload(len, k), "frame {k}");
    }
    let end = rx.read_frame(1 << 20, &stop, |n| vec![0u8; n]);
    assert!(matches!(end, Err(None)), "a clean end of stream");
    tx.join().unwrap();
}

#[test]
fn try_write_is_all_or_nothing() {
    let ring = Ring::heap(CAP);
    let tx = ring.producer();
    assert!(tx.try_write(&[&[1; 200]]));
    assert!(!tx.try_write(&[&[2; 40], &[3; 17]]), "57 > 56 free");
    assert!(tx.try_write(&[&[2; 40], &[3; 16]]));
    let mut rx = ring.consumer();
    let p = rx.published().unwrap();
    assert!(p.holds(CAP) && !p.holds(CAP + 1));
    let mut all = vec![0u8; CAP];
    assert!(p.peek(0, &mut all));
    assert_eq!(all[199..202], [1, 2, 2]);
    assert_eq!(all[CAP - 1], 3);
}

#[test]
fn indices_that_wrap_at_2_pow_64_still_carry_frames() {
    // Stream offsets are not positions: a ring that has carried 2^64
    // bytes goes on. A frame that straddles the wrap must arrive whole.
    let ring = Ring::heap(CAP);
    let start = u64::MAX - 9;
    set_indices(&ring, start, start);
    let body = payload(100, 5);
    publish(&ring, &header(100, 1).encode());
    publish(&ring, &body);
    let stop = AtomicBool::new(false);
    let mut rx = ring.consumer();
    let (h, got) = rx.read_frame(1 << 20, &stop, |n| vec![0u8; n]).unwrap();
    assert_eq!((h, got), (header(100, 1), body));
    assert_eq!(rx.published().unwrap().len(), 0);
    assert_eq!(ring.u64_at(OFF_TAIL).load(Ordering::Relaxed), 130);
}

#[test]
fn a_head_beyond_the_ring_is_refused() {
    // A valid header for a frame larger than the ring, and a head that
    // claims all of it is there: taken at its word, the payload would
    // be lent or copied from beyond the end of the buffer.
    let ring = Ring::heap(CAP);
    publish(&ring, &header(2 * CAP, 0).encode());
    let claim = (HEADER_LEN + 2 * CAP) as u64;
    // the reader thread's path
    set_indices(&ring, claim, 0);
    assert!(ring.has_data(), "the reader looks, and reports it");
    let why = read_err(&ring);
    assert!(why.contains("ring corrupted"), "{why}");
    // the in-place path (the header is still in the buffer)
    set_indices(&ring, claim, 0);
    let peeked = peek_header(&ring);
    assert!(peeked.is_err(), "{peeked:?}");
    // as large as it gets
    set_indices(&ring, u64::MAX / 2, 3);
    assert!(read_err(&ring).contains("ring corrupted"));
}

#[test]
fn a_head_behind_the_tail_is_refused() {
    // head - tail wraps to a huge length
    let ring = Ring::heap(CAP);
    set_indices(&ring, 100, 140);
    let why = read_err(&ring);
    assert!(why.contains("ring corrupted (head 100, tail 140)"), "{why}");
}

#[test]
fn a_corrupt_tail_stops_the_sender() {
    let ring = Ring::heap(CAP);
    // A sender that took the ring for full would wait for space for
    // ever: a watchdog stops it after a deadline instead.
    let stop = Arc::new(AtomicBool::new(false));
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let watchdog = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let timed_out = matches!(
                finished.recv_timeout(Duration::from_secs(30)),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout)
            );
            stop.store(true, Ordering::Release);
            timed_out
        })
    };
    // the receiver claims to have consumed more than was written
    set_indices(&ring, 10, 10 + CAP as u64 + 5);
    assert!(!ring.producer().try_write(&[b"x"]));
    let first = ring.producer().write_all(b"x", &stop);
    // and behind: the sender would have overwritten unread bytes
    set_indices(&ring, CAP as u64 * 3, 0);
    let second = ring.producer().write_all(b"x", &stop);
    drop(done);
    let timed_out = watchdog.join().unwrap();
    assert!(!timed_out, "the sender waited: {first:?} {second:?}");
    let why = first.unwrap_err();
    assert!(why.contains("ring corrupted"), "{why}");
    assert!(second.is_err());
}

#[test]
fn bad_headers_are_protocol_violations() {
    let cases: [(usize, u8, &str); 4] = [
        (0, b'X', "bad magic"),
        (2, 9, "unsupported frame version 9"),
        (3, 77, "unknown frame kind 77"),
        (4, 1, "reserved flags"),
    ];
    for (at, byte, want) in cases {
        let ring = Ring::heap(CAP);
        let mut h = header(8, 0).encode();
        h[at] = byte;
        publish(&ring, &h);
        publish(&ring, &[0; 8]);
        // the in-place path sees it without consuming, then the reader
        let peeked = peek_header(&ring).unwrap_err();
        assert!(peeked.contains(want), "{peeked}");
        let why = read_err(&ring);
        assert!(
            why.contains("protocol violation") && why.contains(want),
            "{why}"
        );
    }
}

#[test]
fn a_length_beyond_the_frame_limit_is_refused_before_allocating() {
    let ring = Ring::heap(CAP);
    publish(&ring, &header(usize::MAX, 0).encode());
    let stop = AtomicBool::new(false);
    let mut allocated = false;
    let r = ring.consumer().read_frame(4096, &stop, |n| {
        allocated = true;
        vec![0u8; n]
    });
    match r {
        Err(Some(why)) => assert!(why.contains("exceeds the limit of 4096"), "{why}"),
        other => panic!("{:?}", other.map(|(h, _)| h)),
    }
    assert!(!allocated);
}

#[test]
fn a_length_beyond_the_ring_is_never_lent_and_a_cut_frame_is_an_error() {
    // Legal (frames stream through the ring), but it can never be
    // whole in the ring: the in-place path must not lend it, and a
    // sender that stops half-way is reported.
    let ring = Ring::heap(CAP);
    publish(&ring, &header(3 * CAP, 0).encode());
    publish(&ring, &[1; 100]);
    let mut rx = ring.consumer();
    let (h, p) = rx.peek_frame(1 << 20).unwrap().unwrap();
    assert_eq!(h.len, 3 * CAP as u64);
    assert!(!p.holds(HEADER_LEN + 3 * CAP));
    assert!(p.lend(HEADER_LEN, 3 * CAP, |_| unreachable!()).is_none());
    assert!(p.lend(usize::MAX, 2, |_| unreachable!()).is_none());
    assert!(!p.peek(1, &mut [0; CAP]));
    assert!(!p.consume(CAP + 1));
    assert_eq!(
        rx.published().unwrap().len(),
        HEADER_LEN + 100,
        "nothing consumed"
    );
    drop(rx);
    ring.close(SENDER_CLOSED);
    let why = read_err(&ring);
    assert!(why.contains("closed in the middle of a frame"), "{why}");
}

#[test]
fn a_sleeping_receiver_is_woken_and_a_stop_is_seen() {
    // Not eager: the receiver goes straight to the futex, so the
    // wake-up path (sleeping flag, sequence word) is what delivers.
    let ring = Arc::new(Ring::heap(CAP));
    let stop = Arc::new(AtomicBool::new(false));
    let (took, taken) = std::sync::mpsc::channel();
    let rx = {
        let (ring, stop) = (ring.clone(), stop.clone());
        std::thread::spawn(move || {
            ring.wait_data(&stop, false).unwrap();
            let mut rx = ring.consumer();
            let p = rx.published().unwrap();
            let mut b = [0u8; 5];
            assert!(p.peek(0, &mut b) && p.consume(5));
            took.send(b).unwrap();
            // now nothing comes: only the stop ends the wait
            ring.wait_data(&stop, false)
        })
    };
    assert!(ring.producer().try_write(&[b"hello"]));
    let got = taken.recv_timeout(Duration::from_secs(60));
    assert_eq!(got.as_ref().map(|b| &b[..]), Ok(&b"hello"[..]));
    stop.store(true, Ordering::Release);
    assert_eq!(rx.join().unwrap(), Err("endpoint stopped".into()));
}

#[test]
fn each_side_is_held_by_one_at_a_time() {
    // What makes the unsafe copies sound in this process: one consumer and
    // one producer per ring, each holding its side until dropped.
    let ring = Ring::heap(CAP);
    let rx = ring.try_consumer().expect("nobody holds it");
    assert!(ring.try_consumer().is_none(), "two consumers at once");
    let tx = ring.try_producer().expect("the sides are held apart");
    assert!(ring.try_producer().is_none(), "two producers at once");
    drop(rx);
    assert!(ring.try_consumer().is_some(), "free once dropped");
    drop(tx);
    assert!(ring.try_producer().is_some(), "free once dropped");
}

#[test]
fn a_side_dropped_in_a_panic_is_taken_again() {
    // The locks guard no data (a panic leaves the indices whole), so a
    // poisoned lock must not lock the polling tasks out for good.
    let ring = Arc::new(Ring::heap(CAP));
    let held = ring.clone();
    let died = std::thread::spawn(move || {
        let _rx = held.consumer();
        panic!("a consumer that panics");
    })
    .join();
    assert!(died.is_err());
    publish(&ring, b"abc");
    let mut rx = ring.try_consumer().expect("not locked out");
    let p = rx.published().unwrap();
    let mut b = [0u8; 3];
    assert!(p.peek(0, &mut b) && p.consume(3) && &b == b"abc");
}

#[test]
#[should_panic(expected = "both sides of one ring")]
fn indices_are_set_only_holding_both_sides_of_that_ring() {
    let (a, b) = (Ring::heap(CAP), Ring::heap(CAP));
    a.producer().set_indices(&b.consumer(), 1, 0);
}
