//! The collectives of the C ABI (`kf_allreduce` .. `kf_barrier`), groups
//! of them (`kf_group_start`, `kf_group_end`) and `kf_set_strategy`.

use std::ffi::{c_char, c_int, c_void};

use kungfu_collectives::OpKind;

use crate::handles::{Completion, OutPtr};
use crate::request::{read_input, start_op};
use crate::{
    ctx, fail_of, group, guard, invalid, kf_callback, kf_dtype, kf_handle, kf_op, kf_status,
    kf_strategy, kf_transport, lock, name_of, op_of, ready, root_of, strategy_of, transport_of,
    PHASE,
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
    start_op(
        |_| Ok(OpKind::Allreduce(op_of(op)?)),
        dtype,
        count,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |n| {
            Ok(OpKind::Reduce {
                op: op_of(op)?,
                root: root_of(root, n)?,
            })
        },
        dtype,
        count,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |n| {
            Ok(OpKind::Broadcast {
                root: root_of(root, n)?,
            })
        },
        dtype,
        count,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |_| Ok(OpKind::Allgather),
        dtype,
        count_per_rank,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |n| {
            Ok(OpKind::Gather {
                root: root_of(root, n)?,
            })
        },
        dtype,
        count_per_rank,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |n| {
            Ok(OpKind::Scatter {
                root: root_of(root, n)?,
            })
        },
        dtype,
        count_per_rank,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |_| Ok(OpKind::ReduceScatter(op_of(op)?)),
        dtype,
        count_per_rank,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    start_op(
        |_| Ok(OpKind::Alltoall),
        dtype,
        count_per_rank,
        send,
        recv,
        name,
        cb,
        user,
        out,
    )
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
    guard(|| {
        let name = name_of(name)?;
        if agreed.is_null() {
            return Err(invalid("agreed is NULL"));
        }
        let data = read_input(data, len, "data")?;
        let ctx = ctx()?;
        let done = Completion::new(cb, user, out);
        let h = ctx.session.consensus(&name, &data);
        let agreed = OutPtr(agreed as *mut u8);
        ctx.rt.spawn(async move {
            let r = match h.await {
                Ok(same) => {
                    // SAFETY: the caller's int, valid until completion.
                    unsafe { (agreed.get() as *mut c_int).write_unaligned(c_int::from(same)) };
                    Ok(())
                }
                Err(e) => Err(fail_of(&e)),
            };
            done.finish(r);
        });
        Ok(())
    })
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
    guard(|| {
        let ctx = ctx()?;
        let done = Completion::new(cb, user, out);
        let h = ctx.session.barrier("kf/barrier");
        ctx.rt.spawn(async move {
            done.finish(h.await.map_err(|e| fail_of(&e)));
        });
        Ok(())
    })
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
