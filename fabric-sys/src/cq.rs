//! The completion-queue calls of fi_eq.h: `cq->ops->...`.
//!
//! The read calls return the number of entries written (at least 1),
//! `-FI_EAGAIN` when the queue is empty, `-FI_EAVAIL` when the next entry
//! is an error (read it with [`fi_cq_readerr`]), or another negative error.
//! Each entry is of the CQ's `format` (`fi_cq_tagged_entry` for
//! `FI_CQ_FORMAT_TAGGED`). Reading a CQ is also what drives a
//! `FI_PROGRESS_MANUAL` provider's data transfers.

use std::os::raw::{c_char, c_int, c_void};

use crate::{fi_addr_t, fi_cq_err_entry, fid_cq, ops, ENOSYS, ENOSYS_SSIZE};

/// `fi_cq_read` of fi_eq.h: reads up to `count` completions into `buf`.
///
/// # Safety
///
/// `cq` is an open CQ; `buf` is writable for `count` entries of its format.
#[inline]
pub unsafe fn fi_cq_read(cq: *mut fid_cq, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let read = unsafe { ops((*cq).ops) }.and_then(|ops| ops.read);
    match read {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_read calls
        // it, with the caller's valid arguments.
        Some(read) => unsafe { read(cq, buf, count) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_cq_readfrom` of fi_eq.h: [`fi_cq_read`] that also writes each
/// completion's source address (receives on an endpoint with `FI_SOURCE`;
/// `FI_ADDR_NOTAVAIL` where the source is not in the AV) to
/// `src_addr[..count]`.
///
/// # Safety
///
/// As [`fi_cq_read`]; `src_addr` is writable for `count` addresses.
#[inline]
pub unsafe fn fi_cq_readfrom(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    src_addr: *mut fi_addr_t,
) -> isize {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let readfrom = unsafe { ops((*cq).ops) }.and_then(|ops| ops.readfrom);
    match readfrom {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_readfrom
        // calls it, with the caller's valid arguments.
        Some(readfrom) => unsafe { readfrom(cq, buf, count, src_addr) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_cq_readerr` of fi_eq.h: reads the error completion that made a read
/// return `-FI_EAVAIL` into `*buf` (`err` is the positive `FI_E*` code,
/// `prov_errno` the provider's, for [`fi_cq_strerror`]). Set
/// `buf.err_data_size` to 0 unless `err_data` points to a buffer of that
/// size for the provider's details.
///
/// # Safety
///
/// `cq` is an open CQ; `buf` is writable and its `err_data` and
/// `err_data_size` fields are set as above.
#[inline]
pub unsafe fn fi_cq_readerr(cq: *mut fid_cq, buf: *mut fi_cq_err_entry, flags: u64) -> isize {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let readerr = unsafe { ops((*cq).ops) }.and_then(|ops| ops.readerr);
    match readerr {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_readerr
        // calls it, with the caller's valid arguments.
        Some(readerr) => unsafe { readerr(cq, buf, flags) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_cq_sread` of fi_eq.h: [`fi_cq_read`] that blocks on the CQ's wait
/// object until a completion arrives or `timeout` milliseconds pass (-1:
/// no limit); `-FI_EAGAIN` on time-out. Needs a CQ opened with a wait
/// object (not `FI_WAIT_NONE`). `cond` is null, or with
/// `FI_CQ_COND_THRESHOLD` a `size_t *` count to wait for.
///
/// # Safety
///
/// As [`fi_cq_read`]; `cond` is null or points to what the CQ's
/// `wait_cond` expects.
#[inline]
pub unsafe fn fi_cq_sread(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    cond: *const c_void,
    timeout: c_int,
) -> isize {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let sread = unsafe { ops((*cq).ops) }.and_then(|ops| ops.sread);
    match sread {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_sread
        // calls it, with the caller's valid arguments.
        Some(sread) => unsafe { sread(cq, buf, count, cond, timeout) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_cq_sreadfrom` of fi_eq.h: [`fi_cq_sread`] with the source
/// addresses of [`fi_cq_readfrom`].
///
/// # Safety
///
/// As [`fi_cq_sread`]; `src_addr` is writable for `count` addresses.
#[inline]
pub unsafe fn fi_cq_sreadfrom(
    cq: *mut fid_cq,
    buf: *mut c_void,
    count: usize,
    src_addr: *mut fi_addr_t,
    cond: *const c_void,
    timeout: c_int,
) -> isize {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let sreadfrom = unsafe { ops((*cq).ops) }.and_then(|ops| ops.sreadfrom);
    match sreadfrom {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_sreadfrom
        // calls it, with the caller's valid arguments.
        Some(sreadfrom) => unsafe { sreadfrom(cq, buf, count, src_addr, cond, timeout) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_cq_signal` of fi_eq.h: wakes a thread blocked in [`fi_cq_sread`]
/// on this CQ (it returns `-FI_EAGAIN`).
///
/// # Safety
///
/// `cq` is an open CQ.
#[inline]
pub unsafe fn fi_cq_signal(cq: *mut fid_cq) -> c_int {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let signal = unsafe { ops((*cq).ops) }.and_then(|ops| ops.signal);
    match signal {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_signal
        // calls it.
        Some(signal) => unsafe { signal(cq) },
        None => ENOSYS,
    }
}

/// `fi_cq_strerror` of fi_eq.h: the provider's text for an error entry's
/// `prov_errno` (and `err_data`), written to `buf` (`len` bytes) when it
/// is not null, and returned. Null where the provider has no such entry.
///
/// # Safety
///
/// `cq` is an open CQ; `err_data` is the entry's (or null); `buf` is null
/// or writable for `len` bytes.
#[inline]
pub unsafe fn fi_cq_strerror(
    cq: *mut fid_cq,
    prov_errno: c_int,
    err_data: *const c_void,
    buf: *mut c_char,
    len: usize,
) -> *const c_char {
    // SAFETY: `cq` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let strerror = unsafe { ops((*cq).ops) }.and_then(|ops| ops.strerror);
    match strerror {
        // SAFETY: the provider's entry, called as fi_eq.h's fi_cq_strerror
        // calls it, with the caller's valid arguments.
        Some(strerror) => unsafe { strerror(cq, prov_errno, err_data, buf, len) },
        None => std::ptr::null(),
    }
}
