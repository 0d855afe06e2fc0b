//! The `static inline` calls of fi_endpoint.h for untagged messages:
//! `ep->msg->...`. Return values and the common contract of their
//! `# Safety` sections are those of the tagged calls (`tagged.rs`), with
//! `FI_MSG` for `FI_TAGGED`; an untagged message matches the oldest posted
//! untagged receive from its source.

use std::os::raw::c_void;

use crate::{fi_addr_t, fi_msg, fid_ep, iovec, ops, ENOSYS_SSIZE};

/// `fi_recv` of fi_endpoint.h: posts a receive of at most `len` bytes into
/// `buf` for a message from `src_addr`.
///
/// # Safety
///
/// The contract of the tagged calls (`fi_trecv`); `buf` is writable for
/// `len` bytes.
#[inline]
pub unsafe fn fi_recv(
    ep: *mut fid_ep,
    buf: *mut c_void,
    len: usize,
    desc: *mut c_void,
    src_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let recv = unsafe { ops((*ep).msg) }.and_then(|ops| ops.recv);
    match recv {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_recv
        // calls it, with the caller's valid arguments.
        Some(recv) => unsafe { recv(ep, buf, len, desc, src_addr, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_recvv` of fi_endpoint.h: [`fi_recv`] scattering into the `count`
/// buffers at `iov`.
///
/// # Safety
///
/// As [`fi_recv`], for each buffer of `iov`; `desc` is null or holds
/// `count` descriptors.
#[inline]
pub unsafe fn fi_recvv(
    ep: *mut fid_ep,
    iov: *const iovec,
    desc: *mut *mut c_void,
    count: usize,
    src_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let recvv = unsafe { ops((*ep).msg) }.and_then(|ops| ops.recvv);
    match recvv {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_recvv
        // calls it, with the caller's valid arguments.
        Some(recvv) => unsafe { recvv(ep, iov, desc, count, src_addr, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_recvmsg` of fi_endpoint.h: [`fi_recv`] described by a `fi_msg`,
/// with per-call `flags` (`FI_MULTI_RECV`, ...).
///
/// # Safety
///
/// As [`fi_recv`], for the buffers and context `msg` names; `msg` itself
/// need only live for the call.
#[inline]
pub unsafe fn fi_recvmsg(ep: *mut fid_ep, msg: *const fi_msg, flags: u64) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let recvmsg = unsafe { ops((*ep).msg) }.and_then(|ops| ops.recvmsg);
    match recvmsg {
        // SAFETY: the provider's entry, called as fi_endpoint.h's
        // fi_recvmsg calls it, with the caller's valid arguments.
        Some(recvmsg) => unsafe { recvmsg(ep, msg, flags) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_send` of fi_endpoint.h: sends `buf[..len]` to `dest_addr`.
///
/// # Safety
///
/// The contract of the tagged calls (`fi_tsend`); `buf` is readable for
/// `len` bytes.
#[inline]
pub unsafe fn fi_send(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    dest_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let send = unsafe { ops((*ep).msg) }.and_then(|ops| ops.send);
    match send {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_send
        // calls it, with the caller's valid arguments.
        Some(send) => unsafe { send(ep, buf, len, desc, dest_addr, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_sendv` of fi_endpoint.h: [`fi_send`] gathering the `count` buffers
/// at `iov`.
///
/// # Safety
///
/// As [`fi_send`], for each buffer of `iov`; `desc` is null or holds
/// `count` descriptors.
#[inline]
pub unsafe fn fi_sendv(
    ep: *mut fid_ep,
    iov: *const iovec,
    desc: *mut *mut c_void,
    count: usize,
    dest_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let sendv = unsafe { ops((*ep).msg) }.and_then(|ops| ops.sendv);
    match sendv {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_sendv
        // calls it, with the caller's valid arguments.
        Some(sendv) => unsafe { sendv(ep, iov, desc, count, dest_addr, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_sendmsg` of fi_endpoint.h: [`fi_send`] described by a `fi_msg`,
/// with per-call `flags`.
///
/// # Safety
///
/// As [`fi_send`], for the buffers and context `msg` names; `msg` itself
/// need only live for the call.
#[inline]
pub unsafe fn fi_sendmsg(ep: *mut fid_ep, msg: *const fi_msg, flags: u64) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let sendmsg = unsafe { ops((*ep).msg) }.and_then(|ops| ops.sendmsg);
    match sendmsg {
        // SAFETY: the provider's entry, called as fi_endpoint.h's
        // fi_sendmsg calls it, with the caller's valid arguments.
        Some(sendmsg) => unsafe { sendmsg(ep, msg, flags) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_inject` of fi_endpoint.h: sends `buf[..len]` (at most the info's
/// `tx_attr->inject_size`) to `dest_addr`, without a completion; the
/// buffer is free again when the call returns.
///
/// # Safety
///
/// `ep` is an open, enabled endpoint with `FI_MSG`; `buf` is readable for
/// `len` bytes during the call; `dest_addr` is from the endpoint's AV.
#[inline]
pub unsafe fn fi_inject(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    dest_addr: fi_addr_t,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let inject = unsafe { ops((*ep).msg) }.and_then(|ops| ops.inject);
    match inject {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_inject
        // calls it, with the caller's valid arguments.
        Some(inject) => unsafe { inject(ep, buf, len, dest_addr) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_senddata` of fi_endpoint.h: [`fi_send`] with remote CQ `data`.
///
/// # Safety
///
/// As [`fi_send`].
#[inline]
pub unsafe fn fi_senddata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    desc: *mut c_void,
    data: u64,
    dest_addr: fi_addr_t,
    context: *mut c_void,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let senddata = unsafe { ops((*ep).msg) }.and_then(|ops| ops.senddata);
    match senddata {
        // SAFETY: the provider's entry, called as fi_endpoint.h's
        // fi_senddata calls it, with the caller's valid arguments.
        Some(senddata) => unsafe { senddata(ep, buf, len, desc, data, dest_addr, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_injectdata` of fi_endpoint.h: [`fi_inject`] with remote CQ `data`.
///
/// # Safety
///
/// As [`fi_inject`].
#[inline]
pub unsafe fn fi_injectdata(
    ep: *mut fid_ep,
    buf: *const c_void,
    len: usize,
    data: u64,
    dest_addr: fi_addr_t,
) -> isize {
    // SAFETY: `ep` is open (the caller's contract): its `msg` pointer can
    // be read, and the table outlives it.
    let injectdata = unsafe { ops((*ep).msg) }.and_then(|ops| ops.injectdata);
    match injectdata {
        // SAFETY: the provider's entry, called as fi_endpoint.h's
        // fi_injectdata calls it, with the caller's valid arguments.
        Some(injectdata) => unsafe { injectdata(ep, buf, len, data, dest_addr) },
        None => ENOSYS_SSIZE,
    }
}
