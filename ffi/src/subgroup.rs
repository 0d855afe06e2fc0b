//! Subgroups of the C ABI (`kf_group_t`): made from a rank list by its
//! members (`kf_group_create`), run every collective (`kf_group_allreduce`
//! .. `kf_group_barrier`, in `group_ops.rs`), and destroyed
//! (`kf_group_destroy`). A group is a [`Session::subgroup`] of the running
//! session, named here by a number that is never reused in a process;
//! [`KF_GROUP_WORLD`] names every rank. Not to be confused with
//! `kf_group_start`/`kf_group_end`, which fuse a thread's allreduces (of
//! any group).

use std::collections::HashMap;
use std::ffi::c_int;
use std::sync::Mutex;

use kungfu_collectives::Session;
use kungfu_topology::Rank;
use kungfu_transport::any::AnyTransport;

use crate::KF_ERR_MEMBERSHIP_CHANGED;
use crate::{ctx, fail_of, guard, invalid, kf_status, lock, Ctx, Fail, Res};

/// A group of ranks: [`KF_GROUP_WORLD`], or one `kf_group_create` made.
#[allow(non_camel_case_types)]
pub type kf_group_t = u64;

/// The group of every rank: the one the ops without `group` in their name
/// run in.
pub const KF_GROUP_WORLD: kf_group_t = 0;

#[derive(Default)]
struct Groups {
    /// The last number given out.
    last: u64,
    live: HashMap<kf_group_t, Session<AnyTransport>>,
}

static GROUPS: Mutex<Option<Groups>> = Mutex::new(None);

/// The session group `g` runs in: the running session for
/// [`KF_GROUP_WORLD`], else the group's, if it is live and was made over
/// the running session (not before a resize or a recovery).
pub(crate) fn session_of(c: &Ctx, g: kf_group_t) -> Res<Session<AnyTransport>> {
    if g == KF_GROUP_WORLD {
        return Ok(c.session.clone());
    }
    let s = lock(&GROUPS)
        .as_ref()
        .and_then(|gs| gs.live.get(&g).cloned())
        .ok_or_else(|| invalid(format!("no group {g}: never made here, or destroyed")))?;
    if !s.whole().same(&c.session) {
        return Err(Fail(
            KF_ERR_MEMBERSHIP_CHANGED,
            format!(
                "group {g} was made over cluster version {}, and the cluster changed since \
                 (a resize or a recovery): destroy it and make it again",
                s.generation().version.0
            ),
        ));
    }
    Ok(s)
}

/// Makes a group of the `n` ranks at `ranks`, this rank among them: group
/// rank `i` is `ranks[i]`. A collective of the members only, which pass
/// the same list (in the same order: `KF_ERR_MISMATCH` on every member if
/// not); blocks until all have called it, or fails at the op timeout
/// (`KUNGFU_OP_TIMEOUT_MS`) if one never does. Members that make several
/// groups of one set of ranks make them in the same order. Ops of a group
/// meet only the same group's ops of the other members, so a rank may run
/// ops of many groups at once, in any order. `*out` is the group, valid in
/// every `kf_group_*` call until `kf_group_destroy`; a resize or a
/// recovery ends it (its calls then fail with
/// `KF_ERR_MEMBERSHIP_CHANGED`).
///
/// # Safety
/// `ranks` holds `n` ints; `out` points to a `kf_group_t`.
#[no_mangle]
pub unsafe extern "C" fn kf_group_create(
    ranks: *const c_int,
    n: c_int,
    out: *mut kf_group_t,
) -> kf_status {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let c = ctx()?;
        let size = c.session.size();
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| (1..=size).contains(&n))
            .ok_or_else(|| invalid(format!("n = {n}: a group has 1 to {size} ranks")))?;
        if ranks.is_null() {
            return Err(invalid("ranks is NULL"));
        }
        let list: Vec<Rank> = (0..n)
            .map(|i| {
                // SAFETY: the caller's `n` ints (any alignment: read
                // unaligned).
                let r = unsafe { ranks.add(i).read_unaligned() };
                u32::try_from(r)
                    .map(Rank)
                    .map_err(|_| invalid(format!("rank {r} at {i}: ranks are 0..{size}")))
            })
            .collect::<Res<_>>()?;
        let group =
            c.rt.block_on(c.session.subgroup(&list))
                .map_err(|e| fail_of(&e))?;
        let mut gs = lock(&GROUPS);
        let gs = gs.get_or_insert_with(Groups::default);
        gs.last += 1;
        gs.live.insert(gs.last, group);
        // SAFETY: checked not NULL; the caller's kf_group_t.
        unsafe { out.write_unaligned(gs.last) };
        Ok(())
    })
}

/// Ends group `g` here (ops of it in flight finish). Destroying
/// [`KF_GROUP_WORLD`], or a group that is not live, is an error.
#[no_mangle]
pub extern "C" fn kf_group_destroy(g: kf_group_t) -> kf_status {
    guard(|| {
        if g == KF_GROUP_WORLD {
            return Err(invalid("KF_GROUP_WORLD cannot be destroyed"));
        }
        let gone = lock(&GROUPS).as_mut().and_then(|gs| gs.live.remove(&g));
        match gone {
            Some(_) => Ok(()),
            None => Err(invalid(format!(
                "no group {g}: never made here, or destroyed"
            ))),
        }
    })
}

/// Reads one number of group `g` into `*out`.
fn read(
    g: kf_group_t,
    out: *mut c_int,
    world: impl FnOnce(&kungfu_runtime::WorkerEnv) -> usize,
    f: impl FnOnce(&Session<AnyTransport>) -> usize,
) -> kf_status {
    guard(|| {
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        // every rank's group: what the cluster is, without starting the
        // runtime (a worker that joins a running job connects at its
        // first op, when it is ready for it)
        let v = if g == KF_GROUP_WORLD {
            world(&crate::ready(&mut crate::lock(&crate::PHASE))?.env) as c_int
        } else {
            let c = ctx()?;
            f(&session_of(&c, g)?) as c_int
        };
        // SAFETY: checked not NULL; the caller's int.
        unsafe { out.write_unaligned(v) };
        Ok(())
    })
}

/// This rank's rank in group `g`, in `*rank`.
///
/// # Safety
/// `rank` points to an int.
#[no_mangle]
pub unsafe extern "C" fn kf_group_rank(g: kf_group_t, rank: *mut c_int) -> kf_status {
    read(g, rank, |e| e.rank, |s| s.rank().idx())
}

/// The number of ranks of group `g`, in `*size`.
///
/// # Safety
/// `size` points to an int.
#[no_mangle]
pub unsafe extern "C" fn kf_group_size(g: kf_group_t, size: *mut c_int) -> kf_status {
    read(g, size, |e| e.size, |s| s.size())
}
