//! Unit tests of the C ABI layer that need no runtime (they also run
//! under Miri: scripts/miri-ffi.sh).

use kungfu_collectives::{DType, OpKind, OpSpec, ReduceOp};
use kungfu_topology::Rank;

use super::*;
use crate::handles::*;
use crate::request::*;

fn last_error() -> String {
    // SAFETY: kf_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(kf_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[test]
fn panics_become_internal_errors() {
    let s = guard(|| panic!("boom"));
    assert_eq!(s, KF_ERR_INTERNAL);
    assert!(last_error().contains("boom"), "{}", last_error());
    assert_eq!(guard(|| Err(invalid("bad thing"))), KF_ERR_INVALID_ARGUMENT);
    assert_eq!(last_error(), "bad thing");
}

#[test]
fn enums_from_c_are_checked() {
    for d in DType::ALL {
        assert_eq!(dtype_of(d as i32).ok(), Some(d));
    }
    assert!(dtype_of(0).is_err() && dtype_of(13).is_err() && dtype_of(-1).is_err());
    assert!(op_of(5).is_err() && op_of(-1).is_err());
    for s in 0..=8 {
        assert!(strategy_of(s).is_ok(), "{s}");
    }
    assert!(strategy_of(9).is_err());
    assert!(name_of(std::ptr::null()).is_err());
    assert!(root_of(-1, 4).is_err() && root_of(4, 4).is_err() && root_of(3, 4).is_ok());
}

#[test]
fn every_status_has_its_own_string() {
    let mut seen = std::collections::HashSet::new();
    for s in 0..=13 {
        // SAFETY: kf_status_string returns a static C string.
        let text = unsafe { CStr::from_ptr(kf_status_string(s)) };
        assert!(seen.insert(text.to_owned()), "{s}: {text:?}");
        assert_ne!(text.to_str().unwrap(), "unknown status", "{s}");
    }
}
// The tests below need no runtime (no tokio, no sockets, no shared
// memory), so they also run under Miri (scripts/miri-ffi.sh), which
// checks the raw-pointer work and the hand-over between threads. None
// calls kf_init or kf_finalize: the library stays uninitialized for
// every test of this process.

/// The (handle, status) of every call of `record`, in order.
#[derive(Default)]
struct Calls(Mutex<Vec<(kf_handle, kf_status)>>);

impl Calls {
    fn user(&self) -> *mut c_void {
        self as *const Calls as *mut c_void
    }

    fn seen(&self) -> Vec<(kf_handle, kf_status)> {
        lock(&self.0).clone()
    }
}

unsafe extern "C" fn record(h: kf_handle, s: kf_status, user: *mut c_void) {
    // SAFETY: the tests pass a `Calls` that outlives the op.
    let calls = unsafe { &*(user as *const Calls) };
    lock(&calls.0).push((h, s));
}

fn status_of_wait(h: kf_handle, timeout_ms: i64) -> kf_status {
    let slot = slot_of(h).unwrap_or_else(|Fail(_, d)| panic!("{d}"));
    match wait_slot(h, &slot, timeout_ms) {
        Ok(()) => KF_OK,
        Err(Fail(s, _)) => s,
    }
}

fn forget(h: kf_handle) {
    with_handles(|hs| hs.live.remove(&h));
}

#[test]
fn a_completion_calls_back_once_then_shows_done() {
    let calls = Calls::default();
    // the handle goes to an unaligned place, as C may pass
    let mut raw = [0u8; 1 + std::mem::size_of::<kf_handle>()];
    let out = raw[1..].as_mut_ptr() as *mut kf_handle;
    let c = Completion::new(Some(record), calls.user(), out);
    // SAFETY: `out` points into `raw`, which Completion::new wrote.
    let h = unsafe { out.read_unaligned() };
    assert_ne!(h, 0);
    assert_eq!(status_of_wait(h, 0), KF_PENDING);
    assert!(calls.seen().is_empty());
    c.finish(Ok(()));
    assert_eq!(calls.seen(), vec![(h, KF_OK)]);
    assert_eq!(status_of_wait(h, -1), KF_OK);
    assert_eq!(status_of_wait(h, 0), KF_OK, "a handle stays until released");
    forget(h);
    assert!(slot_of(h).is_err());
}

#[test]
fn a_completion_dropped_unfinished_fails_with_finalized_once() {
    let calls = Calls::default();
    let mut h: kf_handle = 0;
    let c = Completion::new(Some(record), calls.user(), &mut h);
    drop(c);
    assert_eq!(calls.seen(), vec![(h, KF_ERR_FINALIZED)]);
    assert_eq!(status_of_wait(h, 0), KF_ERR_FINALIZED);
    forget(h);
}

#[test]
fn an_op_without_a_handle_is_forgotten_once_complete() {
    let calls = Calls::default();
    let c = Completion::new(Some(record), calls.user(), std::ptr::null_mut());
    c.finish(Err(Fail(KF_ERR_MISMATCH, "ranks disagree".into())));
    let seen = calls.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].1, KF_ERR_MISMATCH);
    assert!(slot_of(seen[0].0).is_err(), "released on completion");
}

/// An op completed on a library thread: the output and what the
/// callback wrote are there once the wait returns (Miri checks that
/// nothing races).
#[test]
fn output_and_callback_of_another_thread_are_visible_after_the_wait() {
    struct Seen {
        calls: usize,
        first: u8,
        out: *const u8,
    }
    unsafe extern "C" fn peek(_h: kf_handle, s: kf_status, user: *mut c_void) {
        // SAFETY: the test's `Seen`, used by nobody else until the
        // wait returned.
        let seen = unsafe { &mut *(user as *mut Seen) };
        assert_eq!(s, KF_OK);
        seen.calls += 1;
        // SAFETY: the output, written before the callback runs.
        seen.first = unsafe { *seen.out };
    }
    let mut buf = [0u8; 13];
    let dst = buf[1..].as_mut_ptr(); // unaligned, as C may pass
    let mut seen = Seen {
        calls: 0,
        first: 0,
        out: dst,
    };
    let mut h: kf_handle = 0;
    let c = Completion::new(Some(peek), &mut seen as *mut Seen as *mut c_void, &mut h);
    let out = Some((OutPtr(dst), 12));
    let t = std::thread::spawn(move || {
        let got: Vec<u8> = (1..=12).collect();
        let r = deliver(out, Some(&got));
        c.finish(r);
    });
    assert_eq!(status_of_wait(h, -1), KF_OK);
    assert_eq!((seen.calls, seen.first), (1, 1));
    assert_eq!(&buf[1..], &(1..=12).collect::<Vec<u8>>()[..]);
    t.join().expect("the completing thread");
    forget(h);
}

#[test]
fn output_of_the_wrong_size_is_an_internal_error() {
    let mut buf = [0u8; 4];
    let out = Some((OutPtr(buf.as_mut_ptr()), 4));
    assert!(matches!(
        deliver(out, Some(&[1, 2, 3, 4, 5])),
        Err(Fail(KF_ERR_INTERNAL, _))
    ));
    assert_eq!(buf, [0; 4], "nothing written");
    assert!(deliver(out, None).is_ok(), "no output on this rank");
    assert!(deliver(None, Some(&[1])).is_ok());
}

#[test]
fn inputs_are_copied_from_any_alignment() {
    let raw: Vec<u8> = (0..16).collect();
    let p = raw[3..].as_ptr() as *const c_void;
    assert_eq!(read_input(p, 9, "x").ok(), Some(raw[3..12].to_vec()));
    assert_eq!(read_input(std::ptr::null(), 0, "x").ok(), Some(Vec::new()));
    assert!(matches!(
        read_input(std::ptr::null(), 3, "x"),
        Err(Fail(KF_ERR_INVALID_ARGUMENT, _))
    ));
}

fn allreduce_request(name: &str, out: *mut u8) -> Request {
    Request {
        group: crate::KF_GROUP_WORLD,
        name: name.into(),
        spec: OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count: 1,
            check: 0,
        },
        input: vec![0; 4],
        out: Some((OutPtr(out), 4)),
    }
}

#[test]
fn groups_hold_this_threads_allreduces_and_fail_them_without_a_runtime() {
    let calls = Calls::default();
    let mut out = [0u8; 8];
    let (mut h1, mut h2): (kf_handle, kf_handle) = (0, 0);
    assert!(matches!(
        group::end(),
        Err(Fail(KF_ERR_INVALID_ARGUMENT, _))
    ));
    group::start();
    group::start(); // nested
    let req = allreduce_request("a", out.as_mut_ptr());
    assert!(group::hold(req, Completion::new(Some(record), calls.user(), &mut h1)).is_none());
    // not an allreduce: given back
    let mut other = allreduce_request("b", out[4..].as_mut_ptr());
    other.spec.kind = OpKind::Broadcast { root: Rank(0) };
    let back = group::hold(other, Completion::new(Some(record), calls.user(), &mut h2));
    let (_, c2) = back.expect("a broadcast is not held");
    c2.finish(Ok(()));
    // another thread has no group open: nothing of it is held
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut h3: kf_handle = 0;
            let req = allreduce_request("c", std::ptr::null_mut());
            let c = Completion::new(None, std::ptr::null_mut(), &mut h3);
            assert!(group::hold(req, c).is_some());
            forget(h3);
        });
    });
    assert!(group::end().is_ok(), "inner level: nothing starts");
    assert_eq!(calls.seen(), vec![(h2, KF_OK)]);
    // the outer level starts the group, which needs kf_init: the held
    // op fails and calls back
    assert!(matches!(group::end(), Err(Fail(KF_ERR_NOT_INITIALIZED, _))));
    assert_eq!(
        calls.seen(),
        vec![(h2, KF_OK), (h1, KF_ERR_NOT_INITIALIZED)]
    );
    forget(h1);
    forget(h2);
}

#[test]
fn the_api_before_kf_init_fails_cleanly() {
    let x = [1.0f32; 2];
    let mut y = [0.0f32; 2];
    let mut h: kf_handle = 7;
    let name = c"early";
    let p = |v: &[f32; 2]| v.as_ptr() as *const c_void;
    // SAFETY: every call below gets valid pointers (or NULL where the
    // ABI allows it) and a NUL-terminated name.
    unsafe {
        let yp = y.as_mut_ptr() as *mut c_void;
        let s = kf_allreduce(
            p(&x),
            yp,
            2,
            KF_FLOAT32,
            KF_SUM,
            name.as_ptr(),
            None,
            std::ptr::null_mut(),
            &mut h,
        );
        assert_eq!(s, KF_ERR_NOT_INITIALIZED);
        assert!(last_error().contains("kf_init"), "{}", last_error());
        let (mut buf, mut len) = ([1 as c_char; 8], -1);
        let s = kf_stall_report(buf.as_mut_ptr(), 8, &mut len);
        assert_eq!((s, len, buf[0]), (KF_ERR_NOT_INITIALIZED, -1, 1));
        let s = kf_stall_report(buf.as_mut_ptr(), 8, std::ptr::null_mut());
        assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
        let s = kf_stall_report(std::ptr::null_mut(), 1, &mut len);
        assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
        // argument errors come first
        let s = kf_allreduce(
            p(&x),
            yp,
            2,
            99,
            KF_SUM,
            name.as_ptr(),
            None,
            std::ptr::null_mut(),
            &mut h,
        );
        assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("99"), "{}", last_error());
        let s = kf_allreduce(
            p(&x),
            yp,
            2,
            KF_FLOAT32,
            KF_SUM,
            std::ptr::null(),
            None,
            std::ptr::null_mut(),
            &mut h,
        );
        assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
        let bad = [0xffu8, 0];
        let s = kf_broadcast(
            p(&x),
            yp,
            2,
            KF_FLOAT32,
            0,
            bad.as_ptr() as *const c_char,
            None,
            std::ptr::null_mut(),
            &mut h,
        );
        assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
        assert!(last_error().contains("UTF-8"), "{}", last_error());
        let mut agreed = -1;
        let s = kf_consensus(
            p(&x),
            8,
            name.as_ptr(),
            std::ptr::null_mut(),
            None,
            std::ptr::null_mut(),
            &mut h,
        );
        assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
        let s = kf_consensus(
            p(&x),
            8,
            name.as_ptr(),
            &mut agreed,
            None,
            std::ptr::null_mut(),
            &mut h,
        );
        assert_eq!(s, KF_ERR_NOT_INITIALIZED);
        assert_eq!(agreed, -1);
        assert_eq!(
            kf_barrier(None, std::ptr::null_mut(), &mut h),
            KF_ERR_NOT_INITIALIZED
        );
        assert_eq!(kf_test(1, std::ptr::null_mut()), KF_ERR_INVALID_ARGUMENT);
        let mut done = -1;
        assert_eq!(kf_test(1, &mut done), KF_ERR_NOT_INITIALIZED);
        assert_eq!(done, -1);
    }
    assert_eq!(h, 7, "no handle written on failure");
    assert_eq!(y, [0.0; 2]);
    assert_eq!(kf_wait(1, 0), KF_ERR_NOT_INITIALIZED);
    assert_eq!(kf_release(1), KF_ERR_NOT_INITIALIZED);
    assert_eq!(kf_group_start(), KF_ERR_NOT_INITIALIZED);
    assert_eq!(kf_set_strategy(77), KF_ERR_INVALID_ARGUMENT);
    assert_eq!(kf_set_strategy(KF_STRATEGY_RING), KF_ERR_NOT_INITIALIZED);
    assert_eq!(kf_set_transport(77), KF_ERR_INVALID_ARGUMENT);
    assert_eq!(kf_set_transport(KF_TRANSPORT_QUIC), KF_ERR_NOT_INITIALIZED);
    assert_eq!(
        (kf_rank(), kf_size(), kf_local_rank(), kf_local_size()),
        (-1, -1, -1, -1)
    );
    assert_eq!(kf_cluster_version(), u64::MAX);
}

#[test]
fn the_last_error_is_per_thread() {
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let barrier = &barrier;
            s.spawn(move || {
                // both fail before either reads
                let s = guard(|| Err(invalid(format!("thread {t}"))));
                assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
                barrier.wait();
                assert_eq!(last_error(), format!("thread {t}"));
            });
        }
    });
}
