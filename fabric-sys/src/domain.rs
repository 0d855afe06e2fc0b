//! The `static inline` calls of fi_domain.h on a domain, a memory region
//! and an address vector: `fi_endpoint` (of fi_endpoint.h, opened on a
//! domain), `fi_cq_open`, `fi_av_open`, `fi_mr_reg` & co., `fi_av_insert`
//! & co.

use std::os::raw::{c_char, c_int, c_void};

use crate::{
    fi_addr_t, fi_av_attr, fi_cq_attr, fi_info, fi_mr_attr, fid, fid_av, fid_cq, fid_domain,
    fid_ep, fid_mr, iovec, ops, ENOSYS, FI_ENABLE,
};

/// `fi_endpoint` of fi_endpoint.h: `domain->ops->endpoint(domain, info,
/// ep, context)`. Opens an endpoint of the type and capabilities of `info`
/// and writes it to `*ep`; it still has to be bound to an AV and CQs
/// (`fi_ep_bind`) and enabled (`fi_enable`).
///
/// # Safety
///
/// `domain` is an open domain, opened from this `info`; `info` is a live
/// `fi_info`; `ep` is writable; `context` is the caller's (returned in the
/// endpoint's `fid.context`).
#[inline]
pub unsafe fn fi_endpoint(
    domain: *mut fid_domain,
    info: *mut fi_info,
    ep: *mut *mut fid_ep,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is open (the caller's contract): its `ops` pointer
    // can be read, and the table outlives it.
    let open = unsafe { ops((*domain).ops) }.and_then(|ops| ops.endpoint);
    match open {
        // SAFETY: the provider's entry, called as fi_endpoint.h's
        // fi_endpoint calls it, with the caller's valid arguments.
        Some(open) => unsafe { open(domain, info, ep, context) },
        None => ENOSYS,
    }
}

/// `fi_cq_open` of fi_domain.h: `domain->ops->cq_open(domain, attr, cq,
/// context)`. Opens a completion queue as `attr` asks (`format`, `size`,
/// `wait_obj`, ...) and writes it to `*cq`.
///
/// # Safety
///
/// `domain` is an open domain; `attr` points to a valid `fi_cq_attr`
/// (zeroed fields mean "provider default"); `cq` is writable.
#[inline]
pub unsafe fn fi_cq_open(
    domain: *mut fid_domain,
    attr: *mut fi_cq_attr,
    cq: *mut *mut fid_cq,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is open (the caller's contract): its `ops` pointer
    // can be read, and the table outlives it.
    let open = unsafe { ops((*domain).ops) }.and_then(|ops| ops.cq_open);
    match open {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_cq_open
        // calls it, with the caller's valid arguments.
        Some(open) => unsafe { open(domain, attr, cq, context) },
        None => ENOSYS,
    }
}

/// `fi_av_open` of fi_domain.h: `domain->ops->av_open(domain, attr, av,
/// context)`. Opens an address vector and writes it to `*av`.
///
/// # Safety
///
/// `domain` is an open domain; `attr` points to a valid `fi_av_attr`;
/// `av` is writable.
#[inline]
pub unsafe fn fi_av_open(
    domain: *mut fid_domain,
    attr: *mut fi_av_attr,
    av: *mut *mut fid_av,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is open (the caller's contract): its `ops` pointer
    // can be read, and the table outlives it.
    let open = unsafe { ops((*domain).ops) }.and_then(|ops| ops.av_open);
    match open {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_av_open
        // calls it, with the caller's valid arguments.
        Some(open) => unsafe { open(domain, attr, av, context) },
        None => ENOSYS,
    }
}

/// `fi_mr_reg` of fi_domain.h: `domain->mr->reg(&domain->fid, buf, len,
/// acs, offset, requested_key, flags, mr, context)`. Registers
/// `buf[..len]` for the accesses `acs` (`FI_SEND | FI_RECV`, ...) and
/// writes the region to `*mr`; pass `fi_mr_desc(mr)` as the `desc` of the
/// transfers in it. Close it with `fi_close(&mut (*mr).fid)`.
///
/// # Safety
///
/// `domain` is an open domain; `buf[..len]` stays allocated until the
/// region is closed; `mr` is writable.
#[inline]
#[allow(clippy::too_many_arguments)] // the C signature
pub unsafe fn fi_mr_reg(
    domain: *mut fid_domain,
    buf: *const c_void,
    len: usize,
    acs: u64,
    offset: u64,
    requested_key: u64,
    flags: u64,
    mr: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is open (the caller's contract): its `mr` pointer
    // can be read, and the table outlives it.
    let reg = unsafe { ops((*domain).mr) }.and_then(|ops| ops.reg);
    match reg {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_mr_reg
        // calls it (on the domain's fid), with the caller's valid arguments.
        Some(reg) => unsafe {
            reg(
                &raw mut (*domain).fid,
                buf,
                len,
                acs,
                offset,
                requested_key,
                flags,
                mr,
                context,
            )
        },
        None => ENOSYS,
    }
}

/// `fi_mr_regv` of fi_domain.h: `fi_mr_reg` of the `count` buffers at
/// `iov` as one region.
///
/// # Safety
///
/// As [`fi_mr_reg`], for each of the `count` buffers at `iov`.
#[inline]
#[allow(clippy::too_many_arguments)] // the C signature
pub unsafe fn fi_mr_regv(
    domain: *mut fid_domain,
    iov: *const iovec,
    count: usize,
    acs: u64,
    offset: u64,
    requested_key: u64,
    flags: u64,
    mr: *mut *mut fid_mr,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `domain` is open (the caller's contract): its `mr` pointer
    // can be read, and the table outlives it.
    let regv = unsafe { ops((*domain).mr) }.and_then(|ops| ops.regv);
    match regv {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_mr_regv
        // calls it (on the domain's fid), with the caller's valid arguments.
        Some(regv) => unsafe {
            regv(
                &raw mut (*domain).fid,
                iov,
                count,
                acs,
                offset,
                requested_key,
                flags,
                mr,
                context,
            )
        },
        None => ENOSYS,
    }
}

/// `fi_mr_regattr` of fi_domain.h: `fi_mr_reg` described by a
/// `fi_mr_attr` (device memory, several buffers, ...).
///
/// # Safety
///
/// `domain` is an open domain; `attr` is a valid `fi_mr_attr` whose
/// buffers stay allocated until the region is closed; `mr` is writable.
#[inline]
pub unsafe fn fi_mr_regattr(
    domain: *mut fid_domain,
    attr: *const fi_mr_attr,
    flags: u64,
    mr: *mut *mut fid_mr,
) -> c_int {
    // SAFETY: `domain` is open (the caller's contract): its `mr` pointer
    // can be read, and the table outlives it.
    let regattr = unsafe { ops((*domain).mr) }.and_then(|ops| ops.regattr);
    match regattr {
        // SAFETY: the provider's entry, called as fi_domain.h's
        // fi_mr_regattr calls it, with the caller's valid arguments.
        Some(regattr) => unsafe { regattr(&raw mut (*domain).fid, attr, flags, mr) },
        None => ENOSYS,
    }
}

/// `fi_mr_desc` of fi_domain.h: `mr->mem_desc`, the `desc` argument of
/// the transfers in the region.
///
/// # Safety
///
/// `mr` is an open memory region.
#[inline]
pub unsafe fn fi_mr_desc(mr: *mut fid_mr) -> *mut c_void {
    // SAFETY: `mr` is open (the caller's contract), so its fields can be read.
    unsafe { (*mr).mem_desc }
}

/// `fi_mr_key` of fi_domain.h: `mr->key`, the key a peer uses for RMA to
/// the region (`FI_KEY_NOTAVAIL` before an `FI_MR_ENDPOINT` region is
/// enabled).
///
/// # Safety
///
/// `mr` is an open memory region.
#[inline]
pub unsafe fn fi_mr_key(mr: *mut fid_mr) -> u64 {
    // SAFETY: `mr` is open (the caller's contract), so its fields can be read.
    unsafe { (*mr).key }
}

/// `fi_mr_bind` of fi_domain.h: `mr->fid.ops->bind(&mr->fid, bfid,
/// flags)`. With `FI_MR_ENDPOINT` in the domain's `mr_mode`, a region is
/// bound to its endpoint and then enabled ([`fi_mr_enable`]) before use.
///
/// # Safety
///
/// `mr` is an open memory region, `bfid` an open object of its domain.
#[inline]
pub unsafe fn fi_mr_bind(mr: *mut fid_mr, bfid: *mut fid, flags: u64) -> c_int {
    // SAFETY: `mr` is open (the caller's contract): its fid's `ops` pointer
    // can be read, and the table outlives it.
    let bind = unsafe { ops((*mr).fid.ops) }.and_then(|ops| ops.bind);
    match bind {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_mr_bind
        // calls it, with the caller's valid arguments.
        Some(bind) => unsafe { bind(&raw mut (*mr).fid, bfid, flags) },
        None => ENOSYS,
    }
}

/// `fi_mr_enable` of fi_domain.h: `fi_control(&mr->fid, FI_ENABLE, NULL)`.
///
/// # Safety
///
/// `mr` is an open memory region.
#[inline]
pub unsafe fn fi_mr_enable(mr: *mut fid_mr) -> c_int {
    // SAFETY: `mr` is open (the caller's contract): its fid's `ops` pointer
    // can be read, and the table outlives it.
    let control = unsafe { ops((*mr).fid.ops) }.and_then(|ops| ops.control);
    match control {
        // SAFETY: the provider's entry, called as fi_domain.h's fi_mr_enable
        // calls it (FI_ENABLE takes no argument).
        Some(control) => unsafe { control(&raw mut (*mr).fid, FI_ENABLE, std::ptr::null_mut()) },
        None => ENOSYS,
    }
}

/// `fi_av_insert` of fi_domain.h: `av->ops->insert(av, addr, count,
/// fi_addr, flags, context)`. Inserts `count` addresses (each as
/// `fi_getname` returned it, packed back to back) and writes their
/// `fi_addr_t`s to `fi_addr[..count]` (`FI_ADDR_NOTAVAIL` for a failed
/// one). Returns the number inserted (a synchronous AV) or a negative
/// error.
///
/// # Safety
///
/// `av` is an open AV; `addr` holds `count` addresses of the AV's format;
/// `fi_addr` is writable for `count` entries (or null where the AV is
/// `FI_AV_TABLE` and the caller does not want them).
#[inline]
pub unsafe fn fi_av_insert(
    av: *mut fid_av,
    addr: *const c_void,
    count: usize,
    fi_addr: *mut fi_addr_t,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `av` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let insert = unsafe { ops((*av).ops) }.and_then(|ops| ops.insert);
    match insert {
        // SAFETY: the provider's entry, called as fi_domain.h's
        // fi_av_insert calls it, with the caller's valid arguments.
        Some(insert) => unsafe { insert(av, addr, count, fi_addr, flags, context) },
        None => ENOSYS,
    }
}

/// `fi_av_insertsvc` of fi_domain.h: inserts the address of `node` and
/// `service` (host and port for the socket providers).
///
/// # Safety
///
/// `av` is an open AV; `node` and `service` are NUL-terminated strings;
/// `fi_addr` is writable.
#[inline]
pub unsafe fn fi_av_insertsvc(
    av: *mut fid_av,
    node: *const c_char,
    service: *const c_char,
    fi_addr: *mut fi_addr_t,
    flags: u64,
    context: *mut c_void,
) -> c_int {
    // SAFETY: `av` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let insertsvc = unsafe { ops((*av).ops) }.and_then(|ops| ops.insertsvc);
    match insertsvc {
        // SAFETY: the provider's entry, called as fi_domain.h's
        // fi_av_insertsvc calls it, with the caller's valid arguments.
        Some(insertsvc) => unsafe { insertsvc(av, node, service, fi_addr, flags, context) },
        None => ENOSYS,
    }
}

/// `fi_av_remove` of fi_domain.h: removes `count` addresses from the AV.
///
/// # Safety
///
/// `av` is an open AV; `fi_addr` holds `count` addresses it returned, with
/// no transfer to them still in flight.
#[inline]
pub unsafe fn fi_av_remove(
    av: *mut fid_av,
    fi_addr: *mut fi_addr_t,
    count: usize,
    flags: u64,
) -> c_int {
    // SAFETY: `av` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let remove = unsafe { ops((*av).ops) }.and_then(|ops| ops.remove);
    match remove {
        // SAFETY: the provider's entry, called as fi_domain.h's
        // fi_av_remove calls it, with the caller's valid arguments.
        Some(remove) => unsafe { remove(av, fi_addr, count, flags) },
        None => ENOSYS,
    }
}

/// `fi_av_lookup` of fi_domain.h: writes the raw address of `fi_addr` to
/// `addr`, at most `*addrlen` bytes, and its real length to `*addrlen`
/// (`-FI_ETOOSMALL` when the buffer was too small).
///
/// # Safety
///
/// `av` is an open AV; `addr` is writable for `*addrlen` bytes.
#[inline]
pub unsafe fn fi_av_lookup(
    av: *mut fid_av,
    fi_addr: fi_addr_t,
    addr: *mut c_void,
    addrlen: *mut usize,
) -> c_int {
    // SAFETY: `av` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let lookup = unsafe { ops((*av).ops) }.and_then(|ops| ops.lookup);
    match lookup {
        // SAFETY: the provider's entry, called as fi_domain.h's
        // fi_av_lookup calls it, with the caller's valid arguments.
        Some(lookup) => unsafe { lookup(av, fi_addr, addr, addrlen) },
        None => ENOSYS,
    }
}

/// `fi_av_straddr` of fi_domain.h: writes the raw address `addr` as a
/// NUL-terminated string to `buf` (at most `*len` bytes; `*len` becomes
/// the length needed) and returns `buf`. Returns null where the provider
/// has no such entry.
///
/// # Safety
///
/// `av` is an open AV; `addr` is an address of its format; `buf` is
/// writable for `*len` bytes.
#[inline]
pub unsafe fn fi_av_straddr(
    av: *mut fid_av,
    addr: *const c_void,
    buf: *mut c_char,
    len: *mut usize,
) -> *const c_char {
    // SAFETY: `av` is open (the caller's contract): its `ops` pointer can
    // be read, and the table outlives it.
    let straddr = unsafe { ops((*av).ops) }.and_then(|ops| ops.straddr);
    match straddr {
        // SAFETY: the provider's entry, called as fi_domain.h's
        // fi_av_straddr calls it, with the caller's valid arguments.
        Some(straddr) => unsafe { straddr(av, addr, buf, len) },
        None => std::ptr::null(),
    }
}
