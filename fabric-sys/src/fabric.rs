//! The `static inline` calls on any object and on a fabric: `fi_allocinfo`,
//! `fi_close` and `fi_control` (fabric.h), `fi_domain` (fi_domain.h) and
//! `fi_trywait` (fi_eq.h).

use std::os::raw::{c_int, c_void};

use crate::{fi_dupinfo, fi_info, fid, fid_domain, fid_fabric, ops, ENOSYS};

/// `fi_allocinfo` of fabric.h: `fi_dupinfo(NULL)`, a zeroed `fi_info` with
/// all its attribute structs allocated, for `fi_getinfo` hints. Free it
/// with `fi_freeinfo`, which also frees the strings set in it (so set them
/// with `libc::strdup`, never a Rust `CString`).
///
/// # Safety
///
/// None beyond an FFI call's: the returned pointer (null on no memory) is
/// the caller's to free.
#[inline]
pub unsafe fn fi_allocinfo() -> *mut fi_info {
    // SAFETY: fi_dupinfo(NULL) is documented (fi_getinfo(3)) to allocate a
    // new, zeroed fi_info.
    unsafe { fi_dupinfo(std::ptr::null()) }
}

/// `fi_close` of fabric.h: `fid->ops->close(fid)`. Closes any libfabric
/// object through its embedded `fid` (`&mut (*ep).fid`, `&mut (*cq).fid`,
/// ...).
///
/// # Safety
///
/// `fid` is an open object, not used again after this call (nor are the
/// objects bound to it closed after it: close endpoints before the CQs and
/// AVs bound to them, and those before their domain, then the fabric).
#[inline]
pub unsafe fn fi_close(fid: *mut fid) -> c_int {
    // SAFETY: `fid` is an open object (the caller's contract): its header
    // can be read, and its ops table outlives it.
    let close = unsafe { ops((*fid).ops) }.and_then(|ops| ops.close);
    match close {
        // SAFETY: the provider's entry for this object, called as fabric.h's
        // fi_close calls it.
        Some(close) => unsafe { close(fid) },
        None => ENOSYS,
    }
}

/// `fi_control` of fabric.h: `fid->ops->control(fid, command, arg)`. For
/// example `FI_GETWAIT` on a CQ opened with `FI_WAIT_FD` writes its file
/// descriptor to `arg` (an `int *`), to poll(2) on, after `fi_trywait`
/// said it is safe to block.
///
/// # Safety
///
/// `fid` is an open object; `arg` points to what `command` expects
/// (fi_control(3), fi_cq(3)), valid for the duration of the call.
#[inline]
pub unsafe fn fi_control(fid: *mut fid, command: c_int, arg: *mut c_void) -> c_int {
    // SAFETY: `fid` is an open object (the caller's contract): its header
    // can be read, and its ops table outlives it.
    let control = unsafe { ops((*fid).ops) }.and_then(|ops| ops.control);
    match control {
        // SAFETY: the provider's entry, called as fabric.h's fi_control
        // calls it, with the argument `command` expects (the caller's
        // contract).
        Some(control) => unsafe { control(fid, command, arg) },
        None => ENOSYS,
    }
}

/// `fi_domain` of fi_domain.h: `fabric->ops->domain(fabric, info, domain,
/// context)`. Opens the domain that `info` (an entry of `fi_getinfo`'s
/// list) names on `fabric`, and writes it to `*domain`.
///
/// # Safety
///
/// `fabric` is an open fabric (from `fi_fabric` with this `info`'s
/// `fabric_attr`), `info` a live `fi_info`, `domain` writable; `context`
/// is the caller's (stored, never read by the library).
#[inline]
pub unsafe fn fi_domain(
    fabric: *mut fid_fabric,
    info: *mut fi_info,
    domain: *mut *mut fid_domain,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `fabric` is open (the caller's contract): its `ops` pointer
    // can be read, and the table outlives it.
    let open = unsafe { ops((*fabric).ops) }.and_then(|ops| ops.domain);
    match open {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_domain
        // calls it, with the caller's valid arguments.
        Some(open) => unsafe { open(fabric, info, domain, context) },
        None => ENOSYS,
    }
}

/// `fi_trywait` of fi_eq.h: `fabric->ops->trywait(fabric, fids, count)`.
/// Returns 0 when the caller may block on the wait objects (the fds from
/// `FI_GETWAIT`) of the `count` objects at `fids` (CQs, counters, EQs),
/// `-FI_EAGAIN` when it must read them again first (completions are
/// pending or progress is needed).
///
/// # Safety
///
/// `fabric` is open; `fids` points to `count` open objects' `fid`s of that
/// fabric, each opened with a wait object.
#[inline]
pub unsafe fn fi_trywait(fabric: *mut fid_fabric, fids: *mut *mut fid, count: c_int) -> c_int {
    // SAFETY: `fabric` is open (the caller's contract): its `ops` pointer
    // can be read, and the table outlives it.
    let trywait = unsafe { ops((*fabric).ops) }.and_then(|ops| ops.trywait);
    match trywait {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_trywait calls
        // it, with the caller's valid arguments.
        Some(trywait) => unsafe { trywait(fabric, fids, count) },
        None => ENOSYS,
    }
}
