//! One machine, fed by hand on a clock the test moves.

use super::*;
use crate::abort::{Abort, AbortReason};
use crate::plan::PlanBuilder;
use crate::{DType, OpKind};
use kungfu_transport::{Epoch, OpId, TransportError};

const T: Duration = Duration::from_secs(10);
const DIGEST: u32 = 0xd1_9e57;

fn spec() -> OpSpec {
    OpSpec {
        kind: OpKind::Allreduce(ReduceOp::Sum),
        dtype: DType::F32,
        count: 4,
        check: 0,
    }
}

/// A broadcast from rank 1: rank 0's output depends on rank 1 only.
fn leaf_spec() -> OpSpec {
    OpSpec {
        kind: OpKind::Broadcast { root: Rank(1) },
        ..spec()
    }
}

fn instance() -> OpInstance {
    instance_of(spec())
}

fn instance_of(spec: OpSpec) -> OpInstance {
    OpInstance {
        name: "w".into(),
        spec,
        tag: OpTag {
            epoch: Epoch(1),
            op: OpId(7),
            seq: 0,
        },
        digest: DIGEST,
        strategy: Strategy::Star,
    }
}

/// Rank 0 of 3: sends its 16 bytes to rank 1 in `sends` frames, and
/// receives (reducing) 16 bytes from rank 1. Rank 2 takes no part.
fn machine(sends: usize, window: usize, now: Instant) -> OpMachine {
    machine_of(spec(), sends, window, now)
}

fn machine_of(spec: OpSpec, sends: usize, window: usize, now: Instant) -> OpMachine {
    let mut b = PlanBuilder::new();
    let per = 16 / sends;
    for i in 0..sends {
        b.send(Rank(1), i as u32, 0, i * per..(i + 1) * per, &[]);
    }
    b.recv(Rank(1), 0, 1, 0..16, true, &[]);
    let plan = b.finish(DType::F32, ReduceOp::Sum);
    let cfg = MachineConfig {
        timeout: T,
        max_inflight_bytes: window,
    };
    OpMachine::new(instance_of(spec), plan, Rank(0), 3, cfg, now)
}

fn data(chunk: u32, step: u16, digest: u32) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: instance().tag,
        chunk,
        step,
        digest,
        len: 16,
    }
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Sends every frame the machine hands out, at once.
fn send_all(m: &mut OpMachine, now: Instant, work: &mut [u8]) -> usize {
    let mut n = 0;
    while let Some(t) = m.poll_transmit() {
        let Transmit::Data { id, .. } = t else {
            panic!("unexpected {t:?}")
        };
        m.handle_sent(now, id, Ok(()), work);
        n += 1;
    }
    n
}

fn aborts(m: &mut OpMachine) -> Vec<(Rank, Abort)> {
    std::iter::from_fn(|| m.poll_transmit())
        .map(|t| match t {
            Transmit::Abort {
                to,
                header,
                payload,
            } => {
                assert_eq!(header.kind, FrameKind::Abort);
                assert_eq!(header.tag, instance().tag);
                (to, Abort::decode(&payload).unwrap())
            }
            t => panic!("a failed op sends only aborts, not {t:?}"),
        })
        .collect()
}

fn failed(m: &mut OpMachine, work: &mut [u8]) -> CollectiveError {
    match m.poll_event(work) {
        Some(OpEvent::Failed(e)) => e,
        e => panic!("expected a failure, got {e:?}"),
    }
}

#[test]
fn completes_once_the_plan_is_done_and_every_send_went_out() {
    let t0 = Instant::now();
    let mut m = machine(2, usize::MAX, t0);
    let mut work = f32s(&[1.0; 4]);
    let Some(Transmit::Data { id: a, .. }) = m.poll_transmit() else {
        panic!()
    };
    let Some(Transmit::Data { id: b, .. }) = m.poll_transmit() else {
        panic!()
    };
    m.handle_copied(a, &mut work);
    m.handle_sent(t0, b, Ok(()), &mut work);
    m.handle_frame(
        t0,
        Rank(1),
        &data(0, 1, DIGEST),
        f32s(&[2.0; 4]).into(),
        &mut work,
    );
    assert!(
        m.poll_event(&mut work).is_none(),
        "a copied send is still in flight"
    );
    m.handle_sent(t0, a, Ok(()), &mut work);
    assert!(matches!(m.poll_event(&mut work), Some(OpEvent::Done)));
    assert!(m.poll_event(&mut work).is_none(), "the end is polled once");
    assert_eq!(work, f32s(&[3.0; 4]));
    assert_eq!(m.arrivals()[1].frames, 1);
    assert_eq!(m.arrivals()[1].bytes, 16);
    assert!(!m.is_running() && m.poll_timeout().is_none());
}

#[test]
fn the_window_caps_bytes_in_flight_but_always_lets_one_frame_out() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    // Four frames of 4 bytes under a window of 9: three go (4, 8 < 9),
    // then none until one completes.
    let mut m = machine(4, 9, t0);
    let ids: Vec<ActionId> = std::iter::from_fn(|| m.poll_transmit())
        .map(|t| match t {
            Transmit::Data { id, .. } => id,
            t => panic!("{t:?}"),
        })
        .collect();
    assert_eq!(ids.len(), 3);
    m.handle_copied(ids[0], &mut work);
    assert!(
        m.poll_transmit().is_none(),
        "a copy does not free the window"
    );
    m.handle_sent(t0, ids[0], Ok(()), &mut work);
    assert!(m.poll_transmit().is_some());
    // Even with no window at all, one frame goes at a time.
    let mut m = machine(1, 0, t0);
    assert!(m.poll_transmit().is_some());
    assert!(m.poll_transmit().is_none());
}

#[test]
fn the_deadline_moves_only_on_progress() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(1, usize::MAX, t0);
    assert_eq!(m.poll_timeout(), Some(t0 + T));
    let Some(Transmit::Data { id, .. }) = m.poll_transmit() else {
        panic!()
    };
    // Handing out a frame is no progress; its completion is.
    assert_eq!(m.poll_timeout(), Some(t0 + T));
    m.handle_timeout(t0 + T - Duration::from_millis(1));
    assert!(m.is_running(), "not failed before the deadline");
    let t1 = t0 + Duration::from_secs(3);
    m.handle_sent(t1, id, Ok(()), &mut work);
    assert_eq!(m.poll_timeout(), Some(t1 + T));
    m.handle_timeout(t0 + T);
    assert!(m.is_running(), "the deadline moved");
    m.handle_timeout(t1 + T);
    match failed(&mut m, &mut work) {
        CollectiveError::Timeout { waiting, after, .. } => {
            assert_eq!(waiting, vec![Rank(1)]);
            assert_eq!(after, T);
        }
        e => panic!("{e}"),
    }
    // Ranks 1 and 2 are told, naming rank 1 as the one waited for.
    let a = aborts(&mut m);
    assert_eq!(
        a.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
        [Rank(1), Rank(2)]
    );
    assert_eq!(
        a[0].1,
        Abort::new(AbortReason::Timeout, Rank(0), Rank(1), &spec())
    );
}

#[test]
fn a_frame_for_another_spec_is_a_mismatch_told_to_every_rank_not_lost() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine_of(leaf_spec(), 1, usize::MAX, t0);
    m.handle_peer_lost(t0, Rank(2), lost(2));
    assert!(m.is_running(), "rank 2 takes no part");
    // In place, it is refused (comes back owned), then fails the op.
    let h = data(0, 1, DIGEST ^ 1);
    let payload = f32s(&[2.0; 4]);
    assert!(!m.try_apply(t0, Rank(1), &h, &[&payload], &mut work));
    m.handle_frame(t0, Rank(1), &h, payload.into(), &mut work);
    match failed(&mut m, &mut work) {
        CollectiveError::Mismatch { ranks, detail, .. } => {
            assert_eq!(ranks, vec![Rank(0), Rank(1)]);
            assert!(detail.contains(&format!("{:08x}", DIGEST ^ 1)), "{detail}");
        }
        e => panic!("{e}"),
    }
    let a = aborts(&mut m);
    assert_eq!(a.len(), 1, "rank 2 is lost: {a:?}");
    assert_eq!(
        a[0],
        (
            Rank(1),
            Abort::new(AbortReason::Mismatch, Rank(0), Rank(1), &leaf_spec())
        )
    );
    assert_eq!(
        work,
        f32s(&[1.0; 4]),
        "nothing of the bad frame was applied"
    );
}

#[test]
fn a_peers_abort_fails_the_op_and_is_not_echoed() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(1, usize::MAX, t0);
    let abort = Abort::new(AbortReason::Timeout, Rank(2), Rank(1), &spec());
    let h = Header {
        kind: FrameKind::Abort,
        ..data(0, 0, DIGEST)
    };
    assert!(!m.try_apply(t0, Rank(2), &h, &[&abort.encode()], &mut work));
    m.handle_frame(t0, Rank(2), &h, abort.encode(), &mut work);
    match failed(&mut m, &mut work) {
        CollectiveError::Aborted { by, reason, .. } => {
            assert_eq!(by, Rank(2));
            assert!(
                reason.contains("rank 2 timed out waiting for rank 1"),
                "{reason}"
            );
        }
        e => panic!("{e}"),
    }
    assert!(aborts(&mut m).is_empty(), "an abort is never echoed");

    // Nor is one that names a mismatch (an error that, found here, would
    // be told to everyone).
    let mut m = machine(1, usize::MAX, t0);
    let abort = Abort::new(AbortReason::Mismatch, Rank(2), Rank(1), &spec());
    m.handle_frame(t0, Rank(2), &h, abort.encode(), &mut work);
    match failed(&mut m, &mut work) {
        CollectiveError::Mismatch { ranks, .. } => assert_eq!(ranks, vec![Rank(2), Rank(1)]),
        e => panic!("{e}"),
    }
    assert!(aborts(&mut m).is_empty(), "an abort is never echoed");
}

#[test]
fn a_malformed_abort_is_a_protocol_violation_and_is_told() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(1, usize::MAX, t0);
    let h = Header {
        kind: FrameKind::Abort,
        ..data(0, 0, DIGEST)
    };
    m.handle_frame(t0, Rank(2), &h, Bytes::from_static(b"short"), &mut work);
    match failed(&mut m, &mut work) {
        CollectiveError::Protocol { peer, reason, .. } => {
            assert_eq!(peer, Rank(2));
            assert!(reason.contains("malformed abort frame"), "{reason}");
        }
        e => panic!("{e}"),
    }
    assert_eq!(aborts(&mut m).len(), 2);
}

#[test]
fn an_unexpected_or_duplicate_frame_is_a_protocol_violation() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(1, usize::MAX, t0);
    let p = f32s(&[2.0; 4]);
    assert!(m.try_apply(
        t0,
        Rank(1),
        &data(0, 1, DIGEST),
        &[&p[..4], &p[4..]],
        &mut work
    ));
    assert_eq!(work, f32s(&[3.0; 4]), "applied in place, in two pieces");
    // The same frame again: refused in place, then a protocol error.
    assert!(!m.try_apply(t0, Rank(1), &data(0, 1, DIGEST), &[&p], &mut work));
    m.handle_frame(
        t0,
        Rank(1),
        &data(0, 1, DIGEST),
        p.clone().into(),
        &mut work,
    );
    match failed(&mut m, &mut work) {
        CollectiveError::Protocol { peer, reason, .. } => {
            assert_eq!(peer, Rank(1));
            assert!(reason.contains("duplicate"), "{reason}");
        }
        e => panic!("{e}"),
    }
    let mut m = machine(1, usize::MAX, t0);
    m.handle_frame(t0, Rank(2), &data(0, 1, DIGEST), p.into(), &mut work);
    assert!(
        matches!(
            failed(&mut m, &mut work),
            CollectiveError::Protocol { peer: Rank(2), .. }
        ),
        "rank 2 sends nothing in this plan"
    );
}

fn lost(r: u32) -> TransportError {
    TransportError::PeerLost {
        peer: Rank(r),
        reason: "connection closed".into(),
    }
}

#[test]
fn a_lost_peer_fails_the_op_only_while_its_output_depends_on_it() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine_of(leaf_spec(), 1, usize::MAX, t0);
    assert!(
        m.listening().contains(Rank(2)),
        "aborts may come from anyone"
    );
    m.handle_peer_lost(t0, Rank(2), lost(2));
    assert!(m.is_running());
    assert!(!m.listening().contains(Rank(2)));
    m.handle_peer_lost(t0, Rank(1), lost(1));
    // it waited for rank 1, but rank 2 was lost first: the likelier
    // culprit, which rank 1 may have given up on
    match failed(&mut m, &mut work) {
        CollectiveError::PeerLost { peer, source, .. } => {
            assert_eq!(peer, Rank(2));
            assert!(source
                .to_string()
                .contains("rank 1, which this op waited for"));
        }
        e => panic!("{e}"),
    }
    let a = aborts(&mut m);
    assert!(a.is_empty(), "both other ranks are lost: {a:?}");

    // Everything rank 1 owed arrived before it left: the op completes.
    let mut m = machine(1, usize::MAX, t0);
    let mut work = f32s(&[1.0; 4]);
    m.handle_frame(
        t0,
        Rank(1),
        &data(0, 1, DIGEST),
        f32s(&[2.0; 4]).into(),
        &mut work,
    );
    m.handle_peer_lost(t0, Rank(1), lost(1));
    assert!(m.is_running());
    assert_eq!(send_all(&mut m, t0, &mut work), 1);
    assert!(matches!(m.poll_event(&mut work), Some(OpEvent::Done)));
}

#[test]
fn an_allreduce_fails_for_a_lost_rank_it_never_talks_to_and_names_it() {
    // Rank 0 waits for rank 1 only, but its sum needs rank 2's part too:
    // if rank 1 gives up on rank 2 and its abort does not come, waiting for
    // the op timeout would end in an error that blames rank 1.
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(1, usize::MAX, t0);
    m.handle_peer_lost(t0, Rank(2), lost(2));
    // What rank 2 sent before it went may still come through rank 1 (or
    // rank 1's abort): the op goes on, but only for the grace.
    assert!(m.is_running());
    assert_eq!(m.poll_timeout(), Some(t0 + LOST_GRACE));
    m.handle_timeout(t0 + LOST_GRACE);
    match failed(&mut m, &mut work) {
        CollectiveError::PeerLost { peer, source, .. } => {
            assert_eq!(peer, Rank(2));
            assert!(
                source.to_string().contains("no progress for 1s after"),
                "{source}"
            );
        }
        e => panic!("{e}"),
    }
    // rank 1 hears it from us, naming rank 2
    let a = aborts(&mut m);
    assert_eq!(
        a,
        [(
            Rank(1),
            Abort::new(AbortReason::PeerLost, Rank(0), Rank(2), &spec())
        )]
    );
}

#[test]
fn a_failed_send_fails_the_op_and_late_reports_are_ignored() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(2, usize::MAX, t0);
    let Some(Transmit::Data { id: a, .. }) = m.poll_transmit() else {
        panic!()
    };
    let Some(Transmit::Data { id: b, .. }) = m.poll_transmit() else {
        panic!()
    };
    m.handle_sent(t0, a, Err(lost(1)), &mut work);
    m.handle_sent(t0, b, Ok(()), &mut work);
    // the op waits out the grace (an abort with the cause may be on its
    // way), then fails naming the lost rank
    assert!(m.poll_event(&mut work).is_none());
    m.handle_timeout(t0 + LOST_GRACE / 2);
    assert!(m.poll_event(&mut work).is_none());
    m.handle_timeout(t0 + LOST_GRACE);
    assert!(matches!(
        failed(&mut m, &mut work),
        CollectiveError::PeerLost { peer: Rank(1), .. }
    ));
    m.handle_frame(
        t0,
        Rank(1),
        &data(0, 1, DIGEST),
        f32s(&[2.0; 4]).into(),
        &mut work,
    );
    assert_eq!(work, f32s(&[1.0; 4]), "a failed op applies nothing more");
}

/// The peer a send failed to gave up because another rank was lost: its
/// abort, which may arrive after the send's failure, names the culprit.
#[test]
fn after_a_failed_send_an_abort_that_follows_names_the_cause() {
    let t0 = Instant::now();
    let mut work = f32s(&[1.0; 4]);
    let mut m = machine(1, usize::MAX, t0);
    let Some(Transmit::Data { id, .. }) = m.poll_transmit() else {
        panic!()
    };
    m.handle_sent(t0, id, Err(lost(1)), &mut work);
    assert!(m.poll_event(&mut work).is_none());
    let abort = Abort::new(AbortReason::PeerLost, Rank(2), Rank(3), &spec());
    let h = Header {
        kind: FrameKind::Abort,
        ..data(0, 0, DIGEST)
    };
    m.handle_frame(t0, Rank(2), &h, abort.encode(), &mut work);
    match failed(&mut m, &mut work) {
        CollectiveError::PeerLost { peer, .. } => assert_eq!(peer, Rank(3)),
        e => panic!("{e}"),
    }
}

#[test]
fn an_average_is_scaled_once_at_the_end() {
    let t0 = Instant::now();
    let mut b = PlanBuilder::new();
    b.send(Rank(1), 0, 0, 0..16, &[]);
    b.recv(Rank(1), 0, 1, 0..16, true, &[]);
    let mut op = instance();
    op.spec.kind = OpKind::Allreduce(ReduceOp::Avg);
    let cfg = MachineConfig {
        timeout: T,
        max_inflight_bytes: usize::MAX,
    };
    let mut m = OpMachine::new(op, b.finish(DType::F32, ReduceOp::Avg), Rank(0), 2, cfg, t0);
    let mut work = f32s(&[1.0; 4]);
    m.handle_frame(
        t0,
        Rank(1),
        &data(0, 1, DIGEST),
        f32s(&[3.0; 4]).into(),
        &mut work,
    );
    assert!(m.poll_event(&mut work).is_none(), "its send is not out yet");
    send_all(&mut m, t0, &mut work);
    assert!(matches!(m.poll_event(&mut work), Some(OpEvent::Done)));
    assert_eq!(work, f32s(&[2.0; 4]));
}
