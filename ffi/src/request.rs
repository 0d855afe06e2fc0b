//! A data op from its C arguments to its completion: the checked buffers
//! and copied input (`Request`), starting it (or holding it in the
//! thread's open group), and writing its output to the caller's buffer.
//!
//! An op whose output is all of its working buffer (allreduce, broadcast,
//! allgather; reduce and gather at the root) runs in the caller's `recv`
//! buffer itself: the input is copied into it (or is there already, when
//! `send == recv`), frames land in it, and nothing is copied back. The
//! buffer is a [`Region`] over the caller's memory; the op completes (the
//! callback runs, the handle is done) from its release hook, so only when
//! neither the op nor any wire can touch it any more.

use std::ffi::{c_char, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use kungfu_collectives::{OpKind, OpSpec};
use kungfu_transport::Region;

use crate::handles::{Completion, OutPtr};
use crate::subgroup::{kf_group_t, session_of};
use crate::{
    ctx, dtype_of, fail_of, group, guard, invalid, kf_callback, kf_dtype, kf_handle, kf_status,
    name_of, AnyTransport, Ctx, Fail, Res, Session, KF_ERR_INTERNAL,
};

/// `len` bytes at `p`, copied (`p` may be unaligned; NULL only if empty).
pub(crate) fn read_input(p: *const c_void, len: usize, what: &str) -> Res<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: the caller passed a buffer of at least `len` bytes; u8 has
    // no alignment requirement.
    Ok(unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec())
}

/// A data op: what to start, and where its output goes.
pub(crate) struct Request {
    /// The group it runs in ([`crate::subgroup::KF_GROUP_WORLD`]: every
    /// rank).
    pub(crate) group: kf_group_t,
    pub(crate) name: String,
    pub(crate) spec: OpSpec,
    pub(crate) input: Vec<u8>,
    /// Where this rank's output goes, and its length (None: no output here).
    pub(crate) out: Option<(OutPtr, usize)>,
}

thread_local! {
    /// The check of the next data op this thread starts (`kf_set_check`).
    static CHECK: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

pub(crate) fn set_check(check: u64) {
    CHECK.set(check);
}

/// Checks the buffers of `spec` for this rank (of `session`, group `g`)
/// and copies the input.
fn request(
    (session, g): (&Session<AnyTransport>, kf_group_t),
    name: String,
    spec: OpSpec,
    send: *const c_void,
    recv: *mut c_void,
) -> Res<Request> {
    let n = session.size();
    let me = session.rank();
    spec.validate(n).map_err(invalid)?;
    let in_len = spec.input_len(me, n).expect("validated");
    let input = match spec.kind {
        // only the root's input matters; others may pass NULL
        OpKind::Broadcast { root } if root != me && send.is_null() => vec![0; in_len],
        _ => read_input(send, in_len, "send buffer")?,
    };
    let out = match spec.output_range(me, n) {
        Some(r) if !r.is_empty() => {
            if recv.is_null() {
                return Err(invalid("recv buffer is NULL"));
            }
            Some((OutPtr(recv as *mut u8), r.len()))
        }
        _ => None,
    };
    Ok(Request {
        group: g,
        name,
        spec,
        input,
        out,
    })
}

/// Writes an op's output (`got`, if this rank has one) to the caller's
/// buffer.
pub(crate) fn deliver(out: Option<(OutPtr, usize)>, got: Option<&[u8]>) -> Res<()> {
    if let (Some((p, len)), Some(bytes)) = (out, got) {
        if bytes.len() != len {
            return Err(Fail(
                KF_ERR_INTERNAL,
                format!("output of {} bytes, expected {len}", bytes.len()),
            ));
        }
        // SAFETY: the caller's recv buffer holds `len` bytes and stays
        // valid until completion (the ABI's contract); the source is ours.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.get(), len) };
    }
    Ok(())
}

/// Starts `req` on `session` (or holds it in the thread's open group) and
/// returns at once.
fn submit(ctx: &Ctx, session: &Session<AnyTransport>, req: Request, done: Completion) {
    let Some((req, done)) = group::hold(req, done) else {
        return;
    };
    let h = session.submit(&req.name, req.spec, &req.input);
    let out = req.out;
    ctx.rt.spawn(async move {
        let r = match h.await {
            Ok(got) => deliver(out, got.bytes()),
            Err(e) => Err(fail_of(&e)),
        };
        done.finish(r);
    });
}

/// Starts a data op of group `g` from its C arguments; `kind` makes the
/// op from the group's size.
#[allow(clippy::too_many_arguments)]
pub(crate) fn start_op(
    g: kf_group_t,
    kind: impl FnOnce(usize) -> Res<OpKind>,
    dtype: kf_dtype,
    count: usize,
    send: *const c_void,
    recv: *mut c_void,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    let check = CHECK.replace(0);
    guard(|| {
        let name = name_of(name)?;
        let dtype = dtype_of(dtype)?;
        let ctx = ctx()?;
        let session = session_of(&ctx, g)?;
        let kind = kind(session.size())?;
        let spec = OpSpec {
            kind,
            dtype,
            count,
            check,
        };
        // A call that fails makes no handle and runs no callback: what can
        // fail is checked before the handle exists, or the handle is
        // withdrawn (a caller that frees its callback's context on an
        // error status must not see the callback run too).
        spec.validate(session.size()).map_err(invalid)?;
        let done = Completion::new(cb, user, out);
        let Some(done) = start_in_place(&session, &name, spec, send, recv, done) else {
            return Ok(());
        };
        match request((&session, g), name, spec, send, recv) {
            Ok(req) => submit(&ctx, &session, req, done),
            Err(e) => {
                done.withdraw();
                return Err(e);
            }
        }
        Ok(())
    })
}

/// Starts `spec` in the caller's `recv` buffer (see the module docs) if it
/// can: its output is all of its working buffer, no group is open on this
/// thread, and `send` is `recv` with the input laid out as the working
/// buffer, or does not overlap it. Otherwise gives `done` back, for the
/// copying path (which also reports a bad buffer). `spec` is validated.
fn start_in_place(
    session: &Session<AnyTransport>,
    name: &str,
    spec: OpSpec,
    send: *const c_void,
    recv: *mut c_void,
    done: Completion,
) -> Option<Completion> {
    let n = session.size();
    let me = session.rank();
    let len = spec.work_len(n).expect("validated");
    let Some(recv) = NonNull::new(recv.cast::<u8>()) else {
        return Some(done);
    };
    if len == 0 || group::is_open() || spec.output_range(me, n) != Some(0..len) {
        return Some(done);
    }
    let in_len = spec.input_len(me, n).expect("validated");
    let needs_input = !matches!(spec.kind, OpKind::Broadcast { root } if root != me);
    let (s, r) = (send as usize, recv.as_ptr() as usize);
    let copy = if !needs_input {
        false
    } else if s == r {
        // The input is the working buffer already; not so for a gather,
        // whose input goes to this rank's block.
        if in_len != len || matches!(spec.kind, OpKind::Allgather | OpKind::Gather { .. }) {
            return Some(done);
        }
        false
    } else if send.is_null() || (s < r + len && r < s.saturating_add(in_len)) {
        return Some(done);
    } else {
        true
    };
    let result: Arc<Mutex<Option<Res<()>>>> = Arc::default();
    let ended = result.clone();
    let release = Box::new(move || {
        // The op never completed (the library stopped): `done` completes
        // as finalized when dropped.
        if let Some(r) = crate::lock(&ended).take() {
            done.finish(r);
        }
    });
    // SAFETY: the caller's recv buffer holds `len` bytes (the ABI's
    // contract for this op) and stays valid, and unused by the caller,
    // until the op completes: which is when this region is released.
    let region = unsafe { Region::foreign(recv, len, release) };
    if copy {
        // SAFETY: the caller's send buffer holds `in_len` bytes (checked
        // not NULL above, and not overlapping recv); u8 has no alignment.
        let input = unsafe { std::slice::from_raw_parts(send as *const u8, in_len) };
        let mut work = region.write(0..len).expect("a new region has no shares");
        spec.init_work_in(input, me, n, work.as_mut_slice());
    }
    let callback = Box::new(move |r: Result<kungfu_collectives::OpOutput, _>| {
        let status = match &r {
            Ok(_) => Ok(()),
            Err(e) => Err(fail_of(e)),
        };
        *crate::lock(&result) = Some(status);
        // The output shares the buffer: dropping it may release the
        // region, whose hook then completes the op with that status.
        drop(r);
    });
    session.submit_in_with_callback(name, spec, region, callback);
    None
}
