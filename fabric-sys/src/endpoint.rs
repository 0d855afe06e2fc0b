//! The `static inline` calls of fi_endpoint.h and fi_cm.h that set up an
//! endpoint: `fi_ep_bind`, `fi_enable`, `fi_cancel`, `fi_getopt`,
//! `fi_setopt`, `fi_getname`, `fi_setname`. The untagged transfers
//! (`fi_send`, `fi_recv`, ...) are in `msg.rs`.

use std::os::raw::{c_int, c_void};

use crate::{fid, fid_ep, fid_t, ops, ENOSYS, ENOSYS_SSIZE, FI_ENABLE};

/// `fi_ep_bind` of fi_endpoint.h: `ep->fid.ops->bind(&ep->fid, bfid,
/// flags)`. Binds an AV (flags 0) or a CQ (`FI_TRANSMIT`, `FI_RECV`, with
/// `FI_SELECTIVE_COMPLETION` to only report sends that ask for it) to the
/// endpoint, before `fi_enable`.
///
/// # Safety
///
/// `ep` is an open endpoint; `bfid` is the `fid` of an open AV or CQ of the
/// same domain, which outlives the endpoint.
#[inline]
pub unsafe fn fi_ep_bind(ep: *mut fid_ep, bfid: *mut fid, flags: u64) -> c_int {
    // SAFETY: `ep` is open (the caller's contract): its fid's `ops` pointer
    // can be read, and the table outlives it.
    let bind = unsafe { ops((*ep).fid.ops) }.and_then(|ops| ops.bind);
    match bind {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_ep_bind
        // calls it, with the caller's valid arguments.
        Some(bind) => unsafe { bind(&raw mut (*ep).fid, bfid, flags) },
        None => ENOSYS,
    }
}

/// `fi_enable` of fi_endpoint.h: `fi_control(&ep->fid, FI_ENABLE, NULL)`.
/// After it the endpoint has its address (`fi_getname`) and takes
/// transfers.
///
/// # Safety
///
/// `ep` is an open endpoint, bound to its AV and CQs.
#[inline]
pub unsafe fn fi_enable(ep: *mut fid_ep) -> c_int {
    // SAFETY: `ep` is open (the caller's contract): its fid's `ops` pointer
    // can be read, and the table outlives it.
    let control = unsafe { ops((*ep).fid.ops) }.and_then(|ops| ops.control);
    match control {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_enable
        // calls it (FI_ENABLE takes no argument).
        Some(control) => unsafe { control(&raw mut (*ep).fid, FI_ENABLE, std::ptr::null_mut()) },
        None => ENOSYS,
    }
}

/// `fi_cancel` of fi_endpoint.h: `ep->ops->cancel(fid, context)` for the
/// endpoint whose `fid` this is. Cancels the posted receive (or other
/// queued operation) with this `context`; it then completes with an error
/// entry (`FI_ECANCELED`) on the CQ. Returns 0 or a negative error.
///
/// # Safety
///
/// `fid` is the `fid` of an open endpoint (`&mut (*ep).fid`: `fid` is its
/// first field, as the C `container_of` assumes).
#[inline]
pub unsafe fn fi_cancel(fid: fid_t, context: *mut c_void) -> isize {
    let ep = fid.cast::<fid_ep>();
    // SAFETY: `fid` is the first field of an open endpoint (the caller's
    // contract), so `ep` is that endpoint: its `ops` pointer can be read,
    // and the table outlives it.
    let cancel = unsafe { ops((*ep).ops) }.and_then(|ops| ops.cancel);
    match cancel {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_cancel
        // calls it.
        Some(cancel) => unsafe { cancel(fid, context) },
        None => ENOSYS_SSIZE,
    }
}

/// `fi_getopt` of fi_endpoint.h: reads the endpoint option `optname` of
/// `level` (`FI_OPT_ENDPOINT`) into `optval`, `*optlen` bytes at most.
///
/// # Safety
///
/// `fid` is the `fid` of an open endpoint; `optval` is writable for
/// `*optlen` bytes, of the type the option has (fi_endpoint(3)).
#[inline]
pub unsafe fn fi_getopt(
    fid: fid_t,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut usize,
) -> c_int {
    let ep = fid.cast::<fid_ep>();
    // SAFETY: `fid` is the first field of an open endpoint (the caller's
    // contract): its `ops` pointer can be read, and the table outlives it.
    let getopt = unsafe { ops((*ep).ops) }.and_then(|ops| ops.getopt);
    match getopt {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_getopt
        // calls it, with the caller's valid arguments.
        Some(getopt) => unsafe { getopt(fid, level, optname, optval, optlen) },
        None => ENOSYS,
    }
}

/// `fi_setopt` of fi_endpoint.h: sets the endpoint option `optname` of
/// `level` (`FI_OPT_ENDPOINT`), e.g. `FI_OPT_MIN_MULTI_RECV`, before
/// `fi_enable`.
///
/// # Safety
///
/// `fid` is the `fid` of an open endpoint; `optval` points to `optlen`
/// bytes of the option's type (fi_endpoint(3)).
#[inline]
pub unsafe fn fi_setopt(
    fid: fid_t,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: usize,
) -> c_int {
    let ep = fid.cast::<fid_ep>();
    // SAFETY: `fid` is the first field of an open endpoint (the caller's
    // contract): its `ops` pointer can be read, and the table outlives it.
    let setopt = unsafe { ops((*ep).ops) }.and_then(|ops| ops.setopt);
    match setopt {
        // SAFETY: the provider's entry, called as fi_endpoint.h's fi_setopt
        // calls it, with the caller's valid arguments.
        Some(setopt) => unsafe { setopt(fid, level, optname, optval, optlen) },
        None => ENOSYS,
    }
}

/// `fi_getname` of fi_cm.h: `ep->cm->getname(fid, addr, addrlen)`. Writes
/// the endpoint's own address (what a peer passes to `fi_av_insert`) to
/// `addr`, at most `*addrlen` bytes, and its real length to `*addrlen`;
/// `-FI_ETOOSMALL` when the buffer was too small. Call it after
/// `fi_enable`.
///
/// # Safety
///
/// `fid` is the `fid` of an open endpoint; `addr` is writable for
/// `*addrlen` bytes.
#[inline]
pub unsafe fn fi_getname(fid: fid_t, addr: *mut c_void, addrlen: *mut usize) -> c_int {
    let ep = fid.cast::<fid_ep>();
    // SAFETY: `fid` is the first field of an open endpoint (the caller's
    // contract): its `cm` pointer can be read, and the table outlives it.
    let getname = unsafe { ops((*ep).cm) }.and_then(|ops| ops.getname);
    match getname {
        // SAFETY: the provider's entry, called as fi_cm.h's fi_getname
        // calls it, with the caller's valid arguments.
        Some(getname) => unsafe { getname(fid, addr, addrlen) },
        None => ENOSYS,
    }
}

/// `fi_setname` of fi_cm.h: sets the endpoint's own address before
/// `fi_enable` (where the provider allows it).
///
/// # Safety
///
/// `fid` is the `fid` of an open endpoint; `addr` holds `addrlen` bytes of
/// an address of the endpoint's format.
#[inline]
pub unsafe fn fi_setname(fid: fid_t, addr: *mut c_void, addrlen: usize) -> c_int {
    let ep = fid.cast::<fid_ep>();
    // SAFETY: `fid` is the first field of an open endpoint (the caller's
    // contract): its `cm` pointer can be read, and the table outlives it.
    let setname = unsafe { ops((*ep).cm) }.and_then(|ops| ops.setname);
    match setname {
        // SAFETY: the provider's entry, called as fi_cm.h's fi_setname
        // calls it, with the caller's valid arguments.
        Some(setname) => unsafe { setname(fid, addr, addrlen) },
        None => ENOSYS,
    }
}
