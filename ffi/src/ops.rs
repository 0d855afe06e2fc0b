//! The collectives of the C ABI (`kf_allreduce` .. `kf_barrier`: their
//! `kf_group_*` forms in `group_ops.rs` in [`KF_GROUP_WORLD`]), fused
//! allreduces (`kf_group_start`, `kf_group_end`) and `kf_set_strategy`.

use std::ffi::{c_char, c_int, c_void};

use crate::group_ops::*;
use crate::subgroup::KF_GROUP_WORLD;
use crate::{
    ctx, fail_of, group, guard, kf_callback, kf_dtype, kf_handle, kf_op, kf_status, kf_strategy,
    kf_transport, lock, ready, strategy_of, transport_of, PHASE,
};

/// Every rank gets the reduction of every rank's `count` elements.
/// `send == recv` is in place.
///
/// # Safety
/// `send` and `recv` hold `count` elements (any alignment); `recv` stays
/// valid until the op completes; `name` is a NUL-terminated string; `out`
/// is NULL or points to a `kf_handle`.
#[no_mangle]
pub unsafe extern "C" fn kf_allreduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: kf_dtype,
    op: kf_op,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_allreduce's.
    unsafe {
        kf_group_allreduce(
            KF_GROUP_WORLD,
            send,
            recv,
            count,
            dtype,
            op,
            name,
            cb,
            user,
            out,
        )
    }
}

/// `root` gets the reduction of every rank's `count` elements; `recv` may
/// be NULL on the other ranks.
///
/// # Safety
/// As [`kf_allreduce`].
#[no_mangle]
pub unsafe extern "C" fn kf_reduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: kf_dtype,
    op: kf_op,
    root: c_int,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_reduce's.
    unsafe {
        kf_group_reduce(
            KF_GROUP_WORLD,
            send,
            recv,
            count,
            dtype,
            op,
            root,
            name,
            cb,
            user,
            out,
        )
    }
}

/// Every rank gets `root`'s `count` elements; `send` may be NULL on the
/// other ranks.
///
/// # Safety
/// As [`kf_allreduce`].
#[no_mangle]
pub unsafe extern "C" fn kf_broadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: kf_dtype,
    root: c_int,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_broadcast's.
    unsafe {
        kf_group_broadcast(
            KF_GROUP_WORLD,
            send,
            recv,
            count,
            dtype,
            root,
            name,
            cb,
            user,
            out,
        )
    }
}

/// Every rank gets every rank's `count_per_rank` elements, in rank order
/// (`recv` holds `size * count_per_rank`).
///
/// # Safety
/// As [`kf_allreduce`], with the sizes above.
#[no_mangle]
pub unsafe extern "C" fn kf_allgather(
    send: *const c_void,
    recv: *mut c_void,
    count_per_rank: usize,
    dtype: kf_dtype,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_allgather's.
    unsafe {
        kf_group_allgather(
            KF_GROUP_WORLD,
            send,
            recv,
            count_per_rank,
            dtype,
            name,
            cb,
            user,
            out,
        )
    }
}

/// `root` gets every rank's `count_per_rank` elements, in rank order;
/// `recv` may be NULL on the other ranks.
///
/// # Safety
/// As [`kf_allgather`].
#[no_mangle]
pub unsafe extern "C" fn kf_gather(
    send: *const c_void,
    recv: *mut c_void,
    count_per_rank: usize,
    dtype: kf_dtype,
    root: c_int,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_gather's.
    unsafe {
        kf_group_gather(
            KF_GROUP_WORLD,
            send,
            recv,
            count_per_rank,
            dtype,
            root,
            name,
            cb,
            user,
            out,
        )
    }
}

/// Rank `r` gets block `r` of `root`'s `send`, `size` blocks of
/// `count_per_rank` elements, in `recv` (`count_per_rank` elements);
/// `send` may be NULL on the other ranks.
///
/// # Safety
/// As [`kf_allgather`], with the sizes above.
#[no_mangle]
pub unsafe extern "C" fn kf_scatter(
    send: *const c_void,
    recv: *mut c_void,
    count_per_rank: usize,
    dtype: kf_dtype,
    root: c_int,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_scatter's.
    unsafe {
        kf_group_scatter(
            KF_GROUP_WORLD,
            send,
            recv,
            count_per_rank,
            dtype,
            root,
            name,
            cb,
            user,
            out,
        )
    }
}

/// Each rank gives `size * count_per_rank` elements; rank `r` gets the
/// reduction of block `r` (`count_per_rank` elements).
///
/// # Safety
/// As [`kf_allreduce`], with the sizes above.
#[no_mangle]
pub unsafe extern "C" fn kf_reduce_scatter(
    send: *const c_void,
    recv: *mut c_void,
    count_per_rank: usize,
    dtype: kf_dtype,
    op: kf_op,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_reduce_scatter's.
    unsafe {
        kf_group_reduce_scatter(
            KF_GROUP_WORLD,
            send,
            recv,
            count_per_rank,
            dtype,
            op,
            name,
            cb,
            user,
            out,
        )
    }
}

/// Each rank gives `size` blocks of `count_per_rank` elements; rank `r`
/// gets block `r` of every rank, in rank order.
///
/// # Safety
/// As [`kf_allreduce`], with `size * count_per_rank` elements each way.
#[no_mangle]
pub unsafe extern "C" fn kf_alltoall(
    send: *const c_void,
    recv: *mut c_void,
    count_per_rank: usize,
    dtype: kf_dtype,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_alltoall's.
    unsafe {
        kf_group_alltoall(
            KF_GROUP_WORLD,
            send,
            recv,
            count_per_rank,
            dtype,
            name,
            cb,
            user,
            out,
        )
    }
}

/// Whether every rank passed the same `len` bytes: `*agreed` is set to 1
/// if so, 0 if not, before the op completes.
///
/// # Safety
/// `data` holds `len` bytes; `agreed` points to an int that stays valid
/// until the op completes; `name` is a NUL-terminated string; `out` is
/// NULL or points to a `kf_handle`.
#[no_mangle]
pub unsafe extern "C" fn kf_consensus(
    data: *const c_void,
    len: usize,
    name: *const c_char,
    agreed: *mut c_int,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_consensus's.
    unsafe { kf_group_consensus(KF_GROUP_WORLD, data, len, name, agreed, cb, user, out) }
}

/// Completes once every rank has called it (the n-th call on one rank
/// matches the n-th on the others).
///
/// # Safety
/// `out` is NULL or points to a `kf_handle`.
#[no_mangle]
pub unsafe extern "C" fn kf_barrier(
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    // SAFETY: the caller's contract is kf_group_barrier's.
    unsafe { kf_group_barrier(KF_GROUP_WORLD, cb, user, out) }
}

/// Opens a group on this thread: allreduces until the matching
/// `kf_group_end` are held, then fused into one allreduce per (type,
/// operator) (members in name order, so ranks may issue them in any
/// order). Their handles work as usual once the group ends. Groups nest.
#[no_mangle]
pub extern "C" fn kf_group_start() -> kf_status {
    guard(|| {
        ready(&mut lock(&PHASE))?;
        group::start();
        Ok(())
    })
}

/// Closes a group; at the outermost level, starts the fused ops.
#[no_mangle]
pub extern "C" fn kf_group_end() -> kf_status {
    guard(group::end)
}

/// Sets the check of the next data collective this thread starts
/// (`kf_allreduce` .. `kf_alltoall` and their `kf_group_*` forms; not
/// `kf_consensus`, `kf_barrier` or point-to-point), which takes it
/// whether it starts or fails. Every rank of the op must give the same
/// value, else the op fails on every rank with `KF_ERR_MISMATCH`, rather
/// than reducing buffers that only agree in length (a tensor of shape
/// [17, 1311] against one of [17, 23, 57]). 0 (the default) checks
/// nothing beyond the type, count, operator and root. A value can stand
/// for anything the caller wants checked: a hash of the shape, the scale
/// factors. A fused allreduce (`kf_group_start`) checks its members'.
/// Costs nothing on the wire: the value goes into the op's digest, which
/// every frame carries.
#[no_mangle]
pub extern "C" fn kf_set_check(check: u64) -> kf_status {
    crate::request::set_check(check);
    crate::KF_OK
}

/// Switches the transport of later ops on every rank, at a consistency
/// barrier that advances the epoch, without tearing the job down: ops in
/// flight finish on the old transport, the ranks agree on the new one and
/// connect it, later ops run on it. A collective, like `kf_set_strategy`.
/// A transport that is not available (not built in, no device, `shm`
/// across hosts, `quic` without certificates) returns an error status on
/// every rank and changes nothing.
#[no_mangle]
pub extern "C" fn kf_set_transport(t: kf_transport) -> kf_status {
    guard(|| {
        let kind = transport_of(t)?;
        let ctx = ctx()?;
        ctx.rt
            .block_on(ctx.swap.swap(kind))
            .map_err(|e| fail_of(&e))?;
        Ok(())
    })
}

/// Switches the strategy of later ops on every rank, at a consistency
/// barrier that advances the epoch. A collective: every rank calls it at
/// the same point of its sequence of ops, with the same strategy
/// (otherwise `KF_ERR_MISMATCH` and nothing changes); blocks until all
/// have. Ops in flight finish with the old strategy first; ops started by
/// other threads meanwhile start after the swap.
#[no_mangle]
pub extern "C" fn kf_set_strategy(s: kf_strategy) -> kf_status {
    guard(|| {
        let strategy = strategy_of(s)?;
        let ctx = ctx()?;
        ctx.rt
            .block_on(ctx.session.swap_strategy(strategy))
            .map_err(|e| fail_of(&e))?;
        Ok(())
    })
}
