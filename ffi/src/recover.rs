//! The C ABI of fault tolerance: shrink and continue (`kf_recover`) and
//! the stall report (`kf_stall_report`).

use std::ffi::c_char;

use crate::adapt::with_worker;
use crate::{ctx, guard, invalid, kf_status, Fail, KF_ERR_BOOTSTRAP, KF_ERR_MEMBERSHIP_CHANGED};

/// After an op failed with `KF_ERR_PEER_LOST` (`kf_last_error()` names the
/// lost rank and where it ran): the survivors agree on who is left and go
/// on as a smaller cluster. A collective among the survivors (each calls
/// it once it saw a loss; no other call may run meanwhile). On `KF_OK`,
/// `kf_rank()`, `kf_size()` and `kf_version()` describe the new cluster;
/// call `kf_sync_state` next, then go on. A worker that the others
/// declared lost (it was frozen, or cut off) gets
/// `KF_ERR_MEMBERSHIP_CHANGED`: the cluster went on without it, so it
/// should finalize and exit. Needs the job's config server (`kungfu-run
/// --on-failure shrink|replace`, or `-w`); without one, `KF_ERR_BOOTSTRAP`.
#[no_mangle]
pub extern "C" fn kf_recover() -> kf_status {
    guard(|| {
        with_worker(|rt, w| {
            rt.block_on(w.recover()).map(drop).map_err(|e| {
                let code = match e {
                    kungfu_runtime::BootstrapError::Excluded { .. } => KF_ERR_MEMBERSHIP_CHANGED,
                    _ => KF_ERR_BOOTSTRAP,
                };
                Fail(code, crate::with_causes(&e))
            })
        })
    })
}

/// The stall report: one line (ending in `\n`) per op that some worker
/// has waited on for `KUNGFU_STALL_TIMEOUT_MS`, naming the ranks that have
/// not posted it, as every worker also logs it (`op "grad" (#3) waited
/// 10.3 s: rank 2 has not posted it (posted by 0, 1, 3)`); empty when
/// nothing stalls. Writes at most `cap - 1` bytes of it to `buf` and a
/// NUL after them (nothing when `cap` is 0), and its whole length (NUL
/// not counted) to `*len`: call again with a larger buffer when `*len >=
/// cap`.
///
/// # Safety
/// `buf` has room for `cap` bytes (it may be NULL when `cap` is 0); `len`
/// points to an int32.
#[no_mangle]
pub unsafe extern "C" fn kf_stall_report(buf: *mut c_char, cap: i32, len: *mut i32) -> kf_status {
    guard(|| {
        text_args(buf, cap, len)?;
        let text: String = ctx()?
            .session
            .stall_report()
            .iter()
            .map(|s| format!("{s}\n"))
            .collect();
        // SAFETY: the caller's buffer and int, as this function's contract
        // says.
        unsafe { write_text(&text, buf, cap, len) }
    })
}

/// Writes at most `cap - 1` bytes of `text` to `buf` and a NUL after them
/// (nothing when `cap` is 0), and `text`'s whole length (NUL not counted)
/// to `*len`, after [`text_args`].
///
/// # Safety
/// `buf` is NULL or has room for `cap` bytes; `len` is NULL or points to
/// an int32.
pub(crate) unsafe fn write_text(
    text: &str,
    buf: *mut c_char,
    cap: i32,
    len: *mut i32,
) -> crate::Res<()> {
    text_args(buf, cap, len)?;
    let b = text.as_bytes();
    if cap > 0 {
        let n = b.len().min(cap as usize - 1);
        // SAFETY: the caller's buffer has room for `cap` bytes, and
        // n + 1 <= cap.
        unsafe {
            std::ptr::copy_nonoverlapping(b.as_ptr().cast::<c_char>(), buf, n);
            buf.add(n).write(0);
        }
    }
    // SAFETY: the caller's int.
    unsafe { len.write_unaligned(b.len().min(i32::MAX as usize) as i32) };
    Ok(())
}

/// Refuses a NULL `len`, a NULL `buf` with `cap > 0` and a negative `cap`
/// (before anything else: argument errors come first).
pub(crate) fn text_args(buf: *mut c_char, cap: i32, len: *mut i32) -> crate::Res<()> {
    if len.is_null() || (buf.is_null() && cap > 0) || cap < 0 {
        return Err(invalid(
            "len is NULL, or buf is NULL with cap > 0, or cap < 0",
        ));
    }
    Ok(())
}
