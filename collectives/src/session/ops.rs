//! The collectives a caller starts: typed ones (elements in, a vector
//! out), in place, on raw bytes, or in the caller's memory, and the
//! barrier. Each makes a [`Start`] and hands it to [`Session::start`].

use std::sync::Arc;

use kungfu_topology::Rank;
use kungfu_transport::Transport;

use super::output::{Memory, Start};
use super::{Callback, OpHandle, OpOutput, Session};
use crate::{CollectiveError, DType, Element, OpKind, OpSpec, ReduceOp};

impl<T: Transport> Session<T> {
    /// Starts an op on raw bytes; `input` must be `spec.input_len(size)`
    /// bytes (it is copied, so it may be reused at once).
    pub fn submit(&self, name: &str, spec: OpSpec, input: &[u8]) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        let done = Box::new(move |r| drop(tx.send(r)));
        let d = self.start(Start::new(name, spec, Memory::Input(input), done));
        h.driven(d)
    }

    /// Starts an op whose completion runs `callback` (once, with the final
    /// status) instead of completing a handle.
    pub fn submit_with_callback(&self, name: &str, spec: OpSpec, input: &[u8], callback: Callback) {
        self.start(Start::new(name, spec, Memory::Input(input), callback).unwaited());
    }

    /// Starts an op that works in `work` itself, with no copy in or out:
    /// `work` holds [`OpSpec::work_len`] bytes laid out by
    /// [`OpSpec::init_work`] (for allreduce, and broadcast at the root,
    /// that is the input itself), and the output is left in it at
    /// [`OpSpec::output_range`] (for allreduce, broadcast and allgather,
    /// all of it). Frames of posted receives land in it straight from the
    /// wire.
    ///
    /// The op holds `work` until it completes, and wires may hold ranges
    /// of it a while after a failure; the returned output shares its
    /// output range. A region over the caller's memory
    /// ([`Region::foreign`](kungfu_transport::Region::foreign)) learns
    /// that everyone is done with it from its release hook (the C ABI
    /// completes its in-place ops from there).
    pub fn submit_in(
        &self,
        name: &str,
        spec: OpSpec,
        work: Arc<kungfu_transport::Region>,
    ) -> OpHandle<OpOutput> {
        let (tx, h) = OpHandle::pair();
        let done = Box::new(move |r| drop(tx.send(r)));
        let d = self.start(Start::new(name, spec, Memory::Region(work), done));
        h.driven(d)
    }

    /// [`Session::submit_in`], completing with `callback`.
    pub fn submit_in_with_callback(
        &self,
        name: &str,
        spec: OpSpec,
        work: Arc<kungfu_transport::Region>,
        callback: Callback,
    ) {
        self.start(Start::new(name, spec, Memory::Region(work), callback).unwaited());
    }

    fn typed<E: Element>(
        &self,
        name: &str,
        kind: OpKind,
        count: usize,
        input: &[E],
    ) -> OpHandle<Vec<E>> {
        let (tx, h) = OpHandle::pair();
        let spec = OpSpec {
            kind,
            dtype: E::DTYPE,
            count,
            check: 0,
        };
        let cb: Callback = Box::new(move |r| drop(tx.send(r.map(|o| o.to_vec::<E>()))));
        let input = Memory::Input(bytemuck::cast_slice(input));
        let d = self.start(Start::new(name, spec, input, cb));
        h.driven(d)
    }

    /// Every rank gets the reduction of every rank's `input`.
    pub fn allreduce<E: Element>(&self, name: &str, input: &[E], op: ReduceOp) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Allreduce(op), input.len(), input)
    }

    /// Allreduces `buf` in place (its contents are the input and become
    /// the result).
    pub async fn allreduce_in_place<E: Element>(
        &self,
        name: &str,
        buf: &mut [E],
        op: ReduceOp,
    ) -> Result<(), CollectiveError> {
        self.in_place(name, OpKind::Allreduce(op), buf).await
    }

    /// Broadcasts `buf` in place from `root`.
    pub async fn broadcast_in_place<E: Element>(
        &self,
        name: &str,
        buf: &mut [E],
        root: Rank,
    ) -> Result<(), CollectiveError> {
        self.in_place(name, OpKind::Broadcast { root }, buf).await
    }

    /// Whether an allreduce of `spec` would compute the gradient monitors'
    /// squared norms inside its reduction if it started now
    /// ([`Session::allreduce_sum_with_norms`]): a sum of f32 on the host
    /// fast path (every rank on this host), except a split op whose slices
    /// fill a lane's slot. A swap of the transport may change it; the op
    /// itself decides when it starts, past the swap gate.
    pub fn fuses_norms(&self, spec: &OpSpec) -> bool {
        self.scope.is_none()
            && self.with_fast(|f| f.is_some_and(|f| f.takes(spec) && f.fuses_norms(spec)))
    }

    /// Sums `buf` across ranks in place, like
    /// [`Session::allreduce_in_place`] with [`ReduceOp::Sum`], and returns
    /// the gradient monitors' squared norms of what comes before its last
    /// element, the monitors' spare (its value on return is unspecified;
    /// the buffer must hold it). Where the op's way fuses them
    /// ([`Session::fuses_norms`], decided when the op starts, the same on
    /// every rank) its reduction sums the squares of what it reads and
    /// writes in the same pass (see `fast/norms.rs`); elsewhere the spare
    /// carries each rank's squared norm through the sum, and the result's
    /// is taken after it (two passes over the buffer).
    pub async fn allreduce_sum_with_norms(
        &self,
        name: &str,
        buf: &mut [f32],
    ) -> Result<crate::session::SqNorms, CollectiveError> {
        let Some(last) = buf.len().checked_sub(1) else {
            return Err(CollectiveError::InvalidArgument {
                name: name.into(),
                reason: "the buffer needs the gradient and one spare element".into(),
            });
        };
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Sum),
            dtype: DType::F32,
            count: buf.len(),
            check: 0,
        };
        let (tx, h) = OpHandle::pair();
        let done = Box::new(move |r| drop(tx.send(r)));
        let start = Start {
            norms: true,
            ..Start::new(name, spec, Memory::Input(bytemuck::cast_slice(buf)), done)
        };
        let d = self.start(start);
        let out = h.driven(d).await?;
        if let Some(o) = out.bytes() {
            bytemuck::cast_slice_mut::<f32, u8>(buf).copy_from_slice(o);
        }
        Ok(out.sq_norms().unwrap_or_else(|| crate::session::SqNorms {
            inputs: f64::from(buf[last]),
            result: crate::dtype::sq_norm_f32(&buf[..last]),
        }))
    }

    /// Runs `kind` on `buf` (count = its length) and copies the output
    /// (of the same length) back into it; the working buffer goes back to
    /// the pool.
    async fn in_place<E: Element>(
        &self,
        name: &str,
        kind: OpKind,
        buf: &mut [E],
    ) -> Result<(), CollectiveError> {
        let spec = OpSpec {
            kind,
            dtype: E::DTYPE,
            count: buf.len(),
            check: 0,
        };
        let out = self.submit(name, spec, bytemuck::cast_slice(buf)).await?;
        if let Some(o) = out.bytes() {
            bytemuck::cast_slice_mut::<E, u8>(buf).copy_from_slice(o);
        }
        Ok(())
    }

    /// `root` gets the reduction; other ranks get an empty vector.
    pub fn reduce<E: Element>(
        &self,
        name: &str,
        input: &[E],
        op: ReduceOp,
        root: Rank,
    ) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Reduce { op, root }, input.len(), input)
    }

    /// Every rank gets `root`'s `data`; other ranks pass a buffer of the
    /// same length (its contents are ignored).
    pub fn broadcast<E: Element>(&self, name: &str, data: &[E], root: Rank) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Broadcast { root }, data.len(), data)
    }

    /// Every rank gets every rank's `input`, concatenated in rank order.
    pub fn allgather<E: Element>(&self, name: &str, input: &[E]) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Allgather, input.len(), input)
    }

    /// `root` gets every rank's `input` in rank order; others get nothing.
    pub fn gather<E: Element>(&self, name: &str, input: &[E], root: Rank) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Gather { root }, input.len(), input)
    }

    /// Rank `r` gets block `r` of `root`'s `input`, `size` blocks of
    /// `count` elements; the other ranks pass an empty `input`.
    pub fn scatter<E: Element>(
        &self,
        name: &str,
        input: &[E],
        count: usize,
        root: Rank,
    ) -> OpHandle<Vec<E>> {
        self.typed(name, OpKind::Scatter { root }, count, input)
    }

    /// `input` is `size` blocks; rank `r` gets the reduction of block `r`.
    pub fn reduce_scatter<E: Element>(
        &self,
        name: &str,
        input: &[E],
        op: ReduceOp,
    ) -> OpHandle<Vec<E>> {
        self.blockwise(name, OpKind::ReduceScatter(op), input)
    }

    /// `input` is `size` blocks; rank `r` gets block `r` of every rank.
    pub fn alltoall<E: Element>(&self, name: &str, input: &[E]) -> OpHandle<Vec<E>> {
        self.blockwise(name, OpKind::Alltoall, input)
    }

    /// An op whose input is `size` equal blocks.
    fn blockwise<E: Element>(&self, name: &str, kind: OpKind, input: &[E]) -> OpHandle<Vec<E>> {
        let count = input.len() / self.size();
        if count * self.size() != input.len() {
            return self.invalid(
                name,
                format!(
                    "{} input of {} elements is not {} equal blocks",
                    kind.name(),
                    input.len(),
                    self.size()
                ),
            );
        }
        self.typed(name, kind, count, input)
    }

    /// Completes on every rank once every rank has called it (with the same
    /// name). Names let unrelated barriers overlap.
    pub fn barrier(&self, name: &str) -> OpHandle<()> {
        let (tx, h) = OpHandle::pair();
        let spec = OpSpec {
            kind: OpKind::Allreduce(ReduceOp::Max),
            dtype: DType::U8,
            count: 0,
            check: 0,
        };
        let done = Box::new(move |r: Result<OpOutput, _>| drop(tx.send(r.map(|_| ()))));
        let d = self.start(Start::new(name, spec, Memory::Input(&[]), done));
        h.driven(d)
    }

    pub(super) fn invalid_err(&self, name: &str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            name: name.into(),
            reason,
        }
    }

    fn invalid<O>(&self, name: &str, reason: String) -> OpHandle<O> {
        let (tx, h) = OpHandle::pair();
        drop(tx.send(Err(self.invalid_err(name, reason))));
        h
    }
}
