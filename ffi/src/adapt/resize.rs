//! Elastic jobs across the ABI: proposing a size, resizing (to a size or
//! to the config server's cluster), the cluster version, and bringing
//! every worker to the same state after a change.

use std::ffi::{c_char, c_void};

use kungfu_runtime::Resized;

use crate::{
    ctx_of, guard, invalid, kf_status, lock, name_of, ready, Fail, Lib, Res, Running,
    KF_ERR_BOOTSTRAP, KF_ERR_INVALID_ARGUMENT, PHASE,
};

/// Runs `f` on the started worker, with the library locked (no other call
/// proceeds meanwhile), then refreshes what the getters report.
pub(crate) fn with_worker<R>(
    f: impl FnOnce(&tokio::runtime::Runtime, &mut kungfu_runtime::Worker) -> Res<R>,
) -> Res<R> {
    with_running(|r| f(&r.rt, &mut r.worker))
}

/// Runs `f` on the started runtime (in a cluster or not), with the
/// library locked, then refreshes what the getters report.
pub(crate) fn with_running<R>(f: impl FnOnce(&mut Running) -> Res<R>) -> Res<R> {
    ctx_of(false)?;
    let mut phase = lock(&PHASE);
    let lib: &mut Lib = ready(&mut phase)?;
    let Some(Ok(running)) = lib.running.as_mut() else {
        return Err(Fail(KF_ERR_BOOTSTRAP, "the worker is not running".into()));
    };
    let r = f(running);
    lib.env = running.worker.env().clone();
    r
}

/// A failed resize or state sync: a failed op of it keeps its own status
/// (`KF_ERR_PEER_LOST` when a peer was lost, so that the caller can
/// `kf_recover`); anything else is `KF_ERR_BOOTSTRAP`.
fn elastic(e: kungfu_runtime::BootstrapError) -> Fail {
    match e {
        kungfu_runtime::BootstrapError::Op(e) => crate::fail_of(&e),
        e => Fail(KF_ERR_BOOTSTRAP, crate::with_causes(&e)),
    }
}

fn write_resized(r: Resized, changed: *mut i32, detached: *mut i32) {
    if !changed.is_null() {
        // SAFETY: the caller's int32.
        unsafe { changed.write_unaligned(i32::from(r.changed)) };
    }
    if !detached.is_null() {
        // SAFETY: the caller's int32.
        unsafe { detached.write_unaligned(i32::from(r.detached)) };
    }
}

/// Asks the config server (`kungfu-run -w`) for a cluster of `size`
/// workers; every worker switches at its next `kf_resize_from_config`.
#[no_mangle]
pub extern "C" fn kf_propose_new_size(size: i32) -> kf_status {
    guard(|| {
        let size = usize::try_from(size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("size {size}")))?;
        with_worker(|rt, w| {
            rt.block_on(w.propose_new_size(size))
                .map(drop)
                .map_err(elastic)
        })
    })
}

/// Resizes an elastic job to `size` workers: a collective (every worker
/// calls it at the same step with the same size). `*changed` is 1 if the
/// cluster changed (then call `kf_sync_state`); `*detached` is 1 if this
/// worker is no longer part of it (it should finalize and exit). Rank,
/// size and later ops follow the new cluster. No other call may run
/// meanwhile. Either pointer may be NULL.
///
/// # Safety
/// `changed` and `detached` are NULL or point to int32s.
#[no_mangle]
pub unsafe extern "C" fn kf_resize(size: i32, changed: *mut i32, detached: *mut i32) -> kf_status {
    guard(|| {
        let size = usize::try_from(size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("size {size}")))?;
        let r = with_worker(|rt, w| rt.block_on(w.resize(size)).map_err(elastic))?;
        write_resized(r, changed, detached);
        Ok(())
    })
}

/// Like `kf_resize`, to whatever cluster the config server holds now.
///
/// # Safety
/// `changed` and `detached` are NULL or point to int32s.
#[no_mangle]
pub unsafe extern "C" fn kf_resize_from_config(changed: *mut i32, detached: *mut i32) -> kf_status {
    guard(|| {
        let r = with_worker(|rt, w| rt.block_on(w.resize_from_config()).map_err(elastic))?;
        write_resized(r, changed, detached);
        Ok(())
    })
}

/// Like `kf_resize_from_config`, without waiting for new workers: a
/// newer config is connected in the background while the current cluster
/// goes on, and `*changed` stays 0 until the call at which every worker
/// has connected it, where all switch at once (then call
/// `kf_sync_state`). A collective, as `kf_resize_from_config`; call it at
/// each step (or commit). A new worker that never comes fails the call
/// (on every worker) after `KUNGFU_CONNECT_TIMEOUT_MS`; the cluster stays
/// as it was.
///
/// # Safety
/// `changed` and `detached` are NULL or point to int32s.
#[no_mangle]
pub unsafe extern "C" fn kf_poll_resize(changed: *mut i32, detached: *mut i32) -> kf_status {
    guard(|| {
        let r = with_worker(|rt, w| rt.block_on(w.poll_resize_from_config()).map_err(elastic))?;
        write_resized(r, changed, detached);
        Ok(())
    })
}

/// The cluster version (0 at start, +1 per resize), or -1 before `kf_init`.
#[no_mangle]
pub extern "C" fn kf_version() -> i64 {
    crate::getter(|l| Some(i64::from(l.env.cluster_version)))
}

/// Brings every worker to the same state: the step `*step` and `n` named
/// byte buffers are broadcast from the lowest-ranked worker that has state
/// (workers that joined a running job have none); `*step` is overwritten.
/// A collective: call it at start and after every resize that changed the
/// cluster, with the same names and sizes everywhere.
///
/// # Safety
/// `step` points to a uint64; `names`, `bufs` and `bytes` to `n` entries;
/// each `bufs[i]` to `bytes[i]` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn kf_sync_state(
    step: *mut u64,
    names: *const *const c_char,
    bufs: *const *mut c_void,
    bytes: *const u64,
    n: i32,
) -> kf_status {
    guard(|| {
        if step.is_null()
            || n < 0
            || (n > 0 && (names.is_null() || bufs.is_null() || bytes.is_null()))
        {
            return Err(invalid("step, names, bufs or bytes is NULL, or n < 0"));
        }
        let n = n as usize;
        let mut owned: Vec<(String, &mut [u8])> = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the caller's arrays have `n` entries.
            let (name, buf, len) = unsafe { (*names.add(i), *bufs.add(i), *bytes.add(i)) };
            let len = usize::try_from(len).map_err(|_| invalid("buffer too large"))?;
            if buf.is_null() && len > 0 {
                return Err(Fail(KF_ERR_INVALID_ARGUMENT, format!("bufs[{i}] is NULL")));
            }
            let slice: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: the caller's `len` writable bytes, not aliased by
                // another entry (the caller's contract).
                unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
            };
            owned.push((name_of(name)?, slice));
        }
        // SAFETY: the caller's uint64.
        let s = unsafe { step.read_unaligned() };
        let got = with_worker(|rt, w| {
            let mut named: Vec<(&str, &mut [u8])> = owned
                .iter_mut()
                .map(|(k, b)| (k.as_str(), &mut **b))
                .collect();
            rt.block_on(w.sync_state(s, &mut named)).map_err(elastic)
        })?;
        // SAFETY: the caller's uint64.
        unsafe { step.write_unaligned(got) };
        Ok(())
    })
}
