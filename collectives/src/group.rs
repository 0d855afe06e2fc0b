//! Tensor fusion: many small allreduces run as one.
//!
//! A training step allreduces one gradient per layer, many of them a few
//! KiB (biases, norms), for which the fixed cost of an op dwarfs the bytes.
//! A [`Group`] collects such allreduces and runs them as one allreduce per
//! (type, operator), as Horovod fuses small tensors:
//!
//! ```
//! use kungfu_collectives::{ReduceOp, Session, SessionConfig};
//! use kungfu_transport::mem::MemConfig;
//!
//! # tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_time().build().unwrap().block_on(async {
//! let ss = Session::local_cluster(2, MemConfig::default(), SessionConfig::default());
//! let handles: Vec<_> = ss
//!     .iter()
//!     .map(|s| {
//!         let bias = [1.0f32, 2.0];
//!         let steps = [s.rank().0 as u64 + 5];
//!         let mut g = s.group();
//!         let b = g.allreduce("bias/fc1", &bias, ReduceOp::Sum);
//!         let t = g.allreduce("steps", &steps, ReduceOp::Max);
//!         g.submit(); // two fused allreduces: (f32, sum) and (u64, max)
//!         (b, t)
//!     })
//!     .collect();
//! for (b, t) in handles {
//!     assert_eq!(b.await.unwrap(), vec![2.0, 4.0]);
//!     assert_eq!(t.await.unwrap(), vec![6]);
//! }
//! # });
//! ```
//!
//! # How members are fused
//!
//! Members of one (type, operator) are laid end to end in the order of
//! their names (bytewise; members of the same name in the order they were
//! added), so ranks that added them in different orders build the same
//! buffer. The fused op is named `kf/group/{h:016x}/{k}`, where `k` is the
//! number of members and `h` the FNV-1a 64 hash (offset basis
//! `0xcbf29ce484222325`) of the member names, each followed by one NUL
//! byte. The fused ops start in the order of the type's code
//! ([`DType`] as `u8`), then the operator's name ([`ReduceOp::name`]).
//! The C ABI's `kf_group_start`/`kf_group_end` fuse through this
//! module, so C and Rust ranks, and ranks of older builds whose C ABI fused
//! by the same rule, fuse alike. Ranks must form their groups from the same
//! members (names, types, operators, counts, and the checks of
//! [`Group::allreduce_checked_with_callback`]): otherwise the fused ops do
//! not meet, or fail with a mismatch.
//!
//! Only allreduces are fused: other ops have no elementwise result to cut
//! back into members; start them on the [`Session`] as usual (they are
//! not held by a group).
//!
//! # Copies
//!
//! Each member's input is borrowed until [`Group::submit`], which copies it
//! once into the fused buffer; each member's result is its slice of the
//! fused output, copied once into the member's `Vec` (or lent to its
//! callback). The session copies the fused buffer into its working buffer,
//! as it does for every op.
//!
//! # Results and errors
//!
//! Each member completes once, with its own result or an error:
//! - a member refused when added (a bad name, a length that is not whole
//!   elements, an operator the type lacks) fails at once with
//!   [`CollectiveError::InvalidArgument`] naming it, and is not fused;
//! - when the fused op fails, every member of it gets that error (it names
//!   the fused op, `kf/group/...`);
//! - a group dropped without [`Group::submit`] (an early return, a panic)
//!   fails its members with [`CollectiveError::InvalidArgument`]: nothing
//!   was sent, the session is fine. Dropping does not submit, because a
//!   group abandoned half-built would start ops the other ranks never
//!   match, and those would end only at the op timeout.

use std::collections::BTreeMap;

use kungfu_topology::{fnv1a64, Digest, Rank};
use kungfu_transport::Transport;

use crate::names::check_name;
use crate::{
    CollectiveError, DType, Element, OpHandle, OpKind, OpOutput, OpSpec, ReduceOp, Session,
};

/// How a member added with [`Group::allreduce_with_callback`] completes:
/// with its slice of the fused output, or the error. Runs once: at once
/// if the member is refused or its group dropped, else when the fused op
/// completes (as a [`crate::Callback`] does, on a runtime thread).
pub type MemberCallback = Box<dyn FnOnce(Result<&[u8], CollectiveError>) + Send + 'static>;

/// Allreduces collected to run fused; see the [module docs](self).
/// Made by [`Session::group`]; borrows the members' inputs until
/// [`Group::submit`].
#[must_use = "a group starts nothing until submitted; dropped, its members fail"]
pub struct Group<'a, T: Transport> {
    session: Session<T>,
    members: Vec<Member<'a>>,
}

struct Member<'a> {
    name: String,
    dtype: DType,
    op: ReduceOp,
    check: u64,
    input: &'a [u8],
    done: MemberCallback,
}

impl<T: Transport> Session<T> {
    /// An empty group of allreduces to fuse (see [`Group`]).
    pub fn group<'a>(&self) -> Group<'a, T> {
        Group {
            session: self.clone(),
            members: Vec::new(),
        }
    }
}

impl<'a, T: Transport> Group<'a, T> {
    /// Adds the allreduce `name` of `input`; its handle completes after
    /// [`Group::submit`] with every rank's reduction of `input`, like
    /// [`Session::allreduce`]'s.
    pub fn allreduce<E: Element>(
        &mut self,
        name: &str,
        input: &'a [E],
        op: ReduceOp,
    ) -> OpHandle<Vec<E>> {
        let (tx, h) = OpHandle::pair();
        self.allreduce_with_callback(
            name,
            E::DTYPE,
            op,
            bytemuck::cast_slice(input),
            Box::new(move |r| drop(tx.send(r.map(bytemuck::pod_collect_to_vec::<u8, E>)))),
        );
        h
    }

    /// Adds the allreduce `name` of `input`, elements of `dtype` as raw
    /// bytes; `done` gets this rank's result (as many bytes as `input`).
    pub fn allreduce_with_callback(
        &mut self,
        name: &str,
        dtype: DType,
        op: ReduceOp,
        input: &'a [u8],
        done: MemberCallback,
    ) {
        self.allreduce_checked_with_callback(name, dtype, op, 0, input, done)
    }

    /// [`Group::allreduce_with_callback`] with a [check](OpSpec::check)
    /// that every rank must give this member alike: the fused op's check
    /// is the FNV-1a 64 hash of its members' checks (as little-endian
    /// bytes, in member order), 0 if they are all 0.
    pub fn allreduce_checked_with_callback(
        &mut self,
        name: &str,
        dtype: DType,
        op: ReduceOp,
        check: u64,
        input: &'a [u8],
        done: MemberCallback,
    ) {
        let count = input.len() / dtype.size();
        let spec = OpSpec {
            kind: OpKind::Allreduce(op),
            dtype,
            count,
            check,
        };
        let checked = check_name(name).and_then(|()| {
            if count * dtype.size() != input.len() {
                return Err(format!(
                    "{} bytes are not whole {dtype} elements",
                    input.len()
                ));
            }
            spec.validate(self.session.size())
        });
        if let Err(reason) = checked {
            return done(Err(CollectiveError::InvalidArgument {
                name: name.into(),
                reason,
            }));
        }
        self.members.push(Member {
            name: name.into(),
            dtype,
            op,
            check,
            input,
            done,
        });
    }

    /// Starts one fused allreduce per (type, operator) and returns; the
    /// members complete when theirs does.
    pub fn submit(mut self) {
        // Started in the order of (type code, operator name): the order
        // the C ABI always used. It matters when two fused ops have one
        // name (the same member names under two operators), as ops of one
        // name meet in the order they were started.
        let mut batches: BTreeMap<(u8, &str), Vec<Member<'a>>> = BTreeMap::new();
        for m in self.members.drain(..) {
            batches
                .entry((m.dtype as u8, m.op.name()))
                .or_default()
                .push(m);
        }
        for mut batch in batches.into_values() {
            // stable: members of the same name keep the order they came in
            batch.sort_by(|a, b| a.name.cmp(&b.name));
            fuse(&self.session, batch);
        }
    }
}

impl<T: Transport> Drop for Group<'_, T> {
    fn drop(&mut self) {
        for m in self.members.drain(..) {
            (m.done)(Err(CollectiveError::InvalidArgument {
                name: m.name.into(),
                reason: "its group was dropped before Group::submit; nothing was started".into(),
            }));
        }
    }
}

/// The fused op's name: see the module docs. `names` is the members'
/// names, each followed by a NUL.
fn fused_name(names: &[u8], members: usize) -> String {
    format!(
        "kf/group/{:016x}/{members}",
        fnv1a64(Digest::EMPTY.0, names)
    )
}

/// Starts the fused allreduce of `batch` (one type and operator, in name
/// order) and scatters its output back.
fn fuse<T: Transport>(session: &Session<T>, batch: Vec<Member<'_>>) {
    let (dtype, op) = (batch[0].dtype, batch[0].op);
    let mut names = Vec::new();
    let mut checks = Vec::new();
    for m in &batch {
        names.extend_from_slice(m.name.as_bytes());
        names.push(0);
        checks.extend_from_slice(&m.check.to_le_bytes());
    }
    let check = match batch.iter().all(|m| m.check == 0) {
        true => 0,
        false => fnv1a64(Digest::EMPTY.0, &checks),
    };
    let name = fused_name(&names, batch.len());
    let total = batch
        .iter()
        .try_fold(0usize, |t, m| t.checked_add(m.input.len()));
    let spec = OpSpec {
        kind: OpKind::Allreduce(op),
        dtype,
        count: total.unwrap_or(0) / dtype.size(),
        check,
    };
    let checked = match total {
        Some(_) => spec.validate(session.size()),
        None => Err("its members have more bytes than the address space".into()),
    };
    if let Err(reason) = checked {
        let e = CollectiveError::InvalidArgument {
            name: name.as_str().into(),
            reason,
        };
        for m in batch {
            (m.done)(Err(e.clone()));
        }
        return;
    }
    let mut input = Vec::with_capacity(total.unwrap_or(0));
    for m in &batch {
        input.extend_from_slice(m.input);
    }
    let parts: Vec<(usize, MemberCallback)> =
        batch.into_iter().map(|m| (m.input.len(), m.done)).collect();
    let me = session.rank();
    let fused = name.clone();
    session.submit_with_callback(
        &name,
        spec,
        &input,
        Box::new(move |r| scatter(r, parts, &fused, me)),
    );
}

/// Hands each member its slice of the fused output `r`, or its error.
fn scatter(
    r: Result<OpOutput, CollectiveError>,
    parts: Vec<(usize, MemberCallback)>,
    name: &str,
    me: Rank,
) {
    let fail = |parts: Vec<(usize, MemberCallback)>, e: CollectiveError| {
        for (_, done) in parts {
            done(Err(e.clone()));
        }
    };
    let out = match r {
        Ok(out) => out,
        Err(e) => return fail(parts, e),
    };
    let bytes = out.bytes().unwrap_or_default();
    let want: usize = parts.iter().map(|(len, _)| len).sum();
    if bytes.len() != want {
        // The session gives an allreduce an output as long as its input;
        // checked so that a broken invariant fails the members, not the
        // runtime thread.
        let e = CollectiveError::Protocol {
            name: name.into(),
            epoch: out.epoch(),
            peer: me,
            reason: format!(
                "internal error: the fused output has {} bytes, its members {want}",
                bytes.len()
            ),
        };
        return fail(parts, e);
    }
    let mut rest = bytes;
    for (len, done) in parts {
        let (mine, tail) = rest.split_at(len);
        rest = tail;
        done(Ok(mine));
    }
}
