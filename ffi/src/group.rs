//! Fusion of small allreduces: between `kf_group_start` and
//! `kf_group_end`, a thread's allreduces are held and then run as one
//! allreduce per (type, operator), members in name order (so ranks that
//! issued them in different orders agree), whose result is scattered back.

use std::cell::RefCell;
use std::collections::HashMap;

use kungfu_collectives::{OpKind, OpSpec};
use kungfu_topology::{fnv1a64, Digest};

use crate::handles::Completion;
use crate::request::Request;
use crate::{ctx, fail_of, invalid, Ctx, Fail, Res, KF_ERR_INTERNAL};

#[derive(Default)]
struct Group {
    depth: u32,
    held: Vec<(Request, Completion)>,
}

thread_local! {
    static GROUP: RefCell<Group> = RefCell::new(Group::default());
}

/// Holds an allreduce if a group is open on this thread; gives back
/// anything else.
pub(super) fn hold(req: Request, done: Completion) -> Option<(Request, Completion)> {
    GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 || !matches!(req.spec.kind, OpKind::Allreduce(_)) {
            return Some((req, done));
        }
        g.held.push((req, done));
        None
    })
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
            for (_, c) in held {
                c.finish(Err(Fail(s, d.clone())));
            }
            return Err(Fail(s, d));
        }
    };
    // one fused op per (type, operator), members in name order
    let mut batches: HashMap<(u8, String), Vec<(Request, Completion)>> = HashMap::new();
    for (r, c) in held {
        let key = (r.spec.dtype as u8, format!("{:?}", r.spec.kind));
        batches.entry(key).or_default().push((r, c));
    }
    let mut keys: Vec<_> = batches.keys().cloned().collect();
    keys.sort();
    for key in keys {
        let mut batch = batches.remove(&key).expect("key from the map");
        batch.sort_by(|a, b| a.0.name.cmp(&b.0.name));
        fuse(&ctx, batch);
    }
    Ok(())
}

fn fuse(ctx: &Ctx, batch: Vec<(Request, Completion)>) {
    let first = batch[0].0.spec;
    let mut input = Vec::new();
    let mut names = String::new();
    for (r, _) in &batch {
        input.extend_from_slice(&r.input);
        names.push_str(&r.name);
        names.push('\0');
    }
    let spec = OpSpec {
        kind: first.kind,
        dtype: first.dtype,
        count: batch.iter().map(|(r, _)| r.spec.count).sum(),
    };
    let name = format!(
        "kf/group/{:016x}/{}",
        fnv1a64(Digest::EMPTY.0, names.as_bytes()),
        batch.len()
    );
    let h = ctx.session.submit(&name, spec, &input);
    ctx.rt.spawn(async move {
        match h.await {
            Ok(got) => {
                let bytes = got.bytes().unwrap_or_default();
                let mut at = 0;
                for (m, c) in batch {
                    let len = m.input.len();
                    let r = match (m.out, bytes.get(at..at + len)) {
                        (Some((p, want)), Some(part)) if want == len => {
                            // SAFETY: as in `deliver`: the caller's
                            // buffer of `len` bytes, valid until done.
                            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), p.get(), len) };
                            Ok(())
                        }
                        (None, _) if len == 0 => Ok(()),
                        _ => Err(Fail(
                            KF_ERR_INTERNAL,
                            "fused output of the wrong size".into(),
                        )),
                    };
                    at += len;
                    c.finish(r);
                }
            }
            Err(e) => {
                for (_, c) in batch {
                    c.finish(Err(fail_of(&e)));
                }
            }
        }
    });
}
