//! The thread-local groups of the C ABI: between `kf_group_start` and the
//! matching `kf_group_end`, a thread's allreduces are held; the outermost
//! `kf_group_end` hands them to a [`kungfu_collectives::Group`], which
//! fuses them (one allreduce per type and operator, members in name
//! order, so ranks that issued them in different orders agree) and gives
//! each its slice of the result, copied here into the caller's buffer.

use std::cell::RefCell;

use kungfu_collectives::{OpKind, ReduceOp};

use crate::handles::Completion;
use crate::request::{deliver, Request};
use crate::subgroup::{kf_group_t, session_of};
use crate::{ctx, fail_of, invalid, AnyTransport, Ctx, Fail, Res, Session};

/// An allreduce held by the thread's open group.
struct Held {
    req: Request,
    op: ReduceOp,
    done: Completion,
}

#[derive(Default)]
struct Open {
    depth: u32,
    held: Vec<Held>,
}

thread_local! {
    static GROUP: RefCell<Open> = RefCell::new(Open::default());
}

/// Holds an allreduce if a group is open on this thread; gives back
/// anything else.
pub(super) fn hold(req: Request, done: Completion) -> Option<(Request, Completion)> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        let OpKind::Allreduce(op) = req.spec.kind else {
            return Some((req, done));
        };
        if g.depth == 0 {
            return Some((req, done));
        }
        g.held.push(Held { req, op, done });
        None
    })
}

/// Whether a group is open on this thread (its allreduces are held).
pub(super) fn is_open() -> bool {
    GROUP.with(|g| g.borrow().depth > 0)
}

pub(super) fn start() {
    GROUP.with(|g| g.borrow_mut().depth += 1);
}

/// Closes one level; at the outermost, runs the fused ops.
pub(super) fn end() -> Res<()> {
    let held = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(invalid("kf_group_end without kf_group_start"));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(Vec::new());
        }
        Ok(std::mem::take(&mut g.held))
    })?;
    if held.is_empty() {
        return Ok(());
    }
    let ctx = match ctx() {
        Ok(c) => c,
        Err(Fail(s, d)) => {
            for h in held {
                h.done.finish(Err(Fail(s, d.clone())));
            }
            return Err(Fail(s, d));
        }
    };
    // one fusion per group of ranks, in the order their first op came
    let mut by_group: Vec<(kf_group_t, Vec<Held>)> = Vec::new();
    for h in held {
        match by_group.iter_mut().find(|(g, _)| *g == h.req.group) {
            Some((_, v)) => v.push(h),
            None => by_group.push((h.req.group, vec![h])),
        }
    }
    for (g, held) in by_group {
        match session_of(&ctx, g) {
            Ok(session) => fuse(&ctx, &session, held),
            Err(Fail(s, d)) => {
                for h in held {
                    h.done.finish(Err(Fail(s, d.clone())));
                }
            }
        }
    }
    Ok(())
}

/// Runs `held`, allreduces of `session`, fused.
fn fuse(ctx: &Ctx, session: &Session<AnyTransport>, held: Vec<Held>) {
    let (reqs, dones): (Vec<(Request, ReduceOp)>, Vec<Completion>) =
        held.into_iter().map(|h| ((h.req, h.op), h.done)).unzip();
    let mut group = session.group();
    for ((req, op), done) in reqs.iter().zip(dones) {
        let (out, rt) = (req.out, ctx.rt.clone());
        group.allreduce_checked_with_callback(
            &req.name,
            req.spec.dtype,
            *op,
            req.spec.check,
            &req.input,
            Box::new(move |r| {
                let r = match r {
                    Ok(part) => deliver(out, Some(part)),
                    Err(e) => Err(fail_of(&e)),
                };
                // The C callback runs in a task of its own, as an ungrouped
                // op's does, not inside the fused op's completion: a
                // callback that blocks, or starts a collective that waits
                // for ops in flight to drain, must not hold that up.
                rt.spawn(async move { done.finish(r) });
            }),
        );
    }
    group.submit();
}
