//! The `static inline` calls of fi_tagged.h: `ep->tagged->...`.
//!
//! All return 0 when the operation was queued, `-FI_EAGAIN` when the
//! endpoint has no room now (read its CQs to make progress, then retry),
//! or another negative error. A queued operation completes with one CQ
//! entry carrying its `context` (sends only with `FI_COMPLETION` where the
//! CQ was bound with `FI_SELECTIVE_COMPLETION`); the inject calls never
//! produce one.
//!
//! The common contract of their `# Safety` sections: `ep` is an open,
//! enabled endpoint with `FI_TAGGED`; a buffer passed stays valid (and, for
//! a receive, unaliased) until its operation's completion has been read
//! from the CQ, or the call returned an error; `desc` is `fi_mr_desc` of a
//! region covering the buffer where the domain's `mr_mode` has
//! `FI_MR_LOCAL`, else may be null; `context` stays valid until the
//! completion (with `FI_CONTEXT` in the info's `mode`, it points to a
//! `fi_context` the provider may use until then); an `fi_addr_t` is one the
//! endpoint's AV returned, or `FI_ADDR_UNSPEC` for a receive from any peer.

use std::os::raw::c_void;

use crate::{fi_addr_t, fi_msg_tagged, fid_ep, iovec, ops, ENOSYS_SSIZE};

/// `fi_trecv` of fi_tagged.h: posts a receive of at most `len` bytes into
/// `buf` for a message from `src_addr` whose tag matches `tag` in the bits
/// not set in `ignore`.
///
/// # Safety
///
/// The module's contract; `buf` is writable for `len` bytes.
#[inline]
#[allow(clippy::too_many_arguments)] // the C signature
pub unsafe fn fi_trecv(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    src_addr: fi_addr_t,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let recv = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.recv);
    match recv {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_trecv
        // calls it, with arguments valid as the module's contract says.
        Some(recv) => unsafe { recv(ep, buf, len, desc, src_addr, tag, ignore, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_trecvv` of fi_tagged.h: [`fi_trecv`] scattering into the `count`
/// buffers at `iov`, with one `desc` each.
///
/// # Safety
///
/// The module's contract, for each buffer of `iov`; `desc` is null or
/// holds `count` descriptors.
#[inline]
#[allow(clippy::too_many_arguments)] // the C signature
pub unsafe fn fi_trecvv(
    ep: *mut fid_ep,
    iov: *const iovec,
    desc: *mut *mut c_void,
    count: usize,
    src_addr: fi_addr_t,
    tag: u64,
    ignore: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let recvv = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.recvv);
    match recvv {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_trecvv
        // calls it, with arguments valid as the module's contract says.
        Some(recvv) => unsafe { recvv(ep, iov, desc, count, src_addr, tag, ignore, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_trecvmsg` of fi_tagged.h: [`fi_trecv`] described by a
/// `fi_msg_tagged`, with per-call `flags` (`FI_PEEK`, `FI_CLAIM`, ...).
///
/// # Safety
///
/// The module's contract, for the buffers and context `msg` names; `msg`
/// itself need only live for the call.
#[inline]
pub unsafe fn fi_trecvmsg(ep: *mut fid_ep, msg: *const fi_msg_tagged, flags: u64) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let recvmsg = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.recvmsg);
    match recvmsg {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_trecvmsg
        // calls it, with arguments valid as the module's contract says.
        Some(recvmsg) => unsafe { recvmsg(ep, msg, flags) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_tsend` of fi_tagged.h: sends `buf[..len]` to `dest_addr` with the
/// tag `tag`.
///
/// # Safety
///
/// The module's contract; `buf` is readable for `len` bytes.
#[inline]
pub unsafe fn fi_tsend(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest_addr: fi_addr_t,
    tag: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let send = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.send);
    match send {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_tsend
        // calls it, with arguments valid as the module's contract says.
        Some(send) => unsafe { send(ep, buf, len, desc, dest_addr, tag, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_tsendv` of fi_tagged.h: [`fi_tsend`] gathering the `count` buffers
/// at `iov` (at most the info's `tx_attr->iov_limit`).
///
/// # Safety
///
/// The module's contract, for each buffer of `iov`; `desc` is null or
/// holds `count` descriptors.
#[inline]
pub unsafe fn fi_tsendv(
    ep: *mut fid_ep,
    iov: *const iovec,
    desc: *mut *mut c_void,
    count: usize,
    dest_addr: fi_addr_t,
    tag: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let sendv = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.sendv);
    match sendv {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_tsendv
        // calls it, with arguments valid as the module's contract says.
        Some(sendv) => unsafe { sendv(ep, iov, desc, count, dest_addr, tag, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_tsendmsg` of fi_tagged.h: [`fi_tsend`] described by a
/// `fi_msg_tagged`, with per-call `flags` (`FI_COMPLETION`,
/// `FI_INJECT`, `FI_REMOTE_CQ_DATA`, ...).
///
/// # Safety
///
/// The module's contract, for the buffers and context `msg` names; `msg`
/// itself need only live for the call.
#[inline]
pub unsafe fn fi_tsendmsg(ep: *mut fid_ep, msg: *const fi_msg_tagged, flags: u64) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let sendmsg = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.sendmsg);
    match sendmsg {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_tsendmsg
        // calls it, with arguments valid as the module's contract says.
        Some(sendmsg) => unsafe { sendmsg(ep, msg, flags) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_tinject` of fi_tagged.h: sends `buf[..len]` (at most the info's
/// `tx_attr->inject_size`) to `dest_addr` with the tag `tag`; the buffer
/// is free again when the call returns, and no completion is written.
///
/// # Safety
///
/// `ep` is an open, enabled endpoint with `FI_TAGGED`; `buf` is readable
/// for `len` bytes during the call; `dest_addr` is from the endpoint's AV.
#[inline]
pub unsafe fn fi_tinject(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    dest_addr: fi_addr_t,
    tag: u64,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let inject = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.inject);
    match inject {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_tinject
        // calls it, with the caller's valid arguments.
        Some(inject) => unsafe { inject(ep, buf, len, dest_addr, tag) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_tsenddata` of fi_tagged.h: [`fi_tsend`] that also delivers the
/// 64-bit `data` (at most the domain's `cq_data_size` bytes of it) in the
/// receiver's completion, flagged `FI_REMOTE_CQ_DATA`.
///
/// # Safety
///
/// The module's contract; `buf` is readable for `len` bytes.
#[inline]
#[allow(clippy::too_many_arguments)] // the C signature
pub unsafe fn fi_tsenddata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest_addr: fi_addr_t,
    tag: u64,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let senddata = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.senddata);
    match senddata {
        // SAFETY: the provider's entry, called as fi_tagged.h's fi_tsenddata
        // calls it, with arguments valid as the module's contract says.
        Some(senddata) => unsafe { senddata(ep, buf, len, desc, data, dest_addr, tag, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_tinjectdata` of fi_tagged.h: [`fi_tinject`] with remote CQ `data`,
/// as [`fi_tsenddata`].
///
/// # Safety
///
/// As [`fi_tinject`].
#[inline]
pub unsafe fn fi_tinjectdata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest_addr: fi_addr_t,
    tag: u64,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `tagged` pointer
    // can be read, and the table outlives it.
    let injectdata = unsafe { ops((*ep).tagged) }.and_then(|ops| ops.injectdata);
    match injectdata {
        // SAFETY: the provider's entry, called as fi_tagged.h's
        // fi_tinjectdata calls it, with the caller's valid arguments.
        Some(injectdata) => unsafe { injectdata(ep, buf, len, data, dest_addr, tag) },
        None => ENOSYS_SSIZE,
    }
}
