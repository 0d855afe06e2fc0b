//! The collectives of a group (`kf_group_allreduce` .. `kf_group_barrier`):
//! the ops of `ops.rs` (which run them in [`KF_GROUP_WORLD`]) in a group
//! of `subgroup.rs`, in whose ranks their roots and blocks are counted.

use std::ffi::{c_char, c_int, c_void};

use kungfu_collectives::OpKind;

use crate::handles::{Completion, OutPtr};
use crate::request::{read_input, start_op};
#[cfg(doc)]
use crate::subgroup::KF_GROUP_WORLD;
use crate::subgroup::{kf_group_t, session_of};
use crate::{
    ctx, fail_of, guard, invalid, kf_callback, kf_dtype, kf_handle, kf_op, kf_status, name_of,
    op_of, root_of,
};

/// [`kf_allreduce`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_allreduce`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_allreduce(
    g: kf_group_t,
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
        g,
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

/// [`kf_reduce`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_reduce`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_reduce(
    g: kf_group_t,
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
        g,
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

/// [`kf_broadcast`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_broadcast`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_broadcast(
    g: kf_group_t,
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
        g,
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

/// [`kf_allgather`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_allgather`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_allgather(
    g: kf_group_t,
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
        g,
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

/// [`kf_gather`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_gather`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_gather(
    g: kf_group_t,
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
        g,
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

/// [`kf_scatter`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_scatter`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_scatter(
    g: kf_group_t,
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
        g,
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

/// [`kf_reduce_scatter`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_reduce_scatter`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_reduce_scatter(
    g: kf_group_t,
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
        g,
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

/// [`kf_alltoall`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_alltoall`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_alltoall(
    g: kf_group_t,
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
        g,
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

/// [`kf_consensus`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_consensus`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_consensus(
    g: kf_group_t,
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
        let session = session_of(&ctx, g)?;
        let done = Completion::new(cb, user, out);
        let h = session.consensus(&name, &data);
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

/// [`kf_barrier`] in group `g` ([`KF_GROUP_WORLD`]: every rank), whose
/// ranks (roots, blocks, counts per rank) it speaks in.
///
/// # Safety
/// As [`kf_barrier`].
#[no_mangle]
pub unsafe extern "C" fn kf_group_barrier(
    g: kf_group_t,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    guard(|| {
        let ctx = ctx()?;
        let session = session_of(&ctx, g)?;
        let done = Completion::new(cb, user, out);
        let h = session.barrier("kf/barrier");
        ctx.rt.spawn(async move {
            done.finish(h.await.map_err(|e| fail_of(&e)));
        });
        Ok(())
    })
}
