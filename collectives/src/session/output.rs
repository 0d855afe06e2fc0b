//! What an op gives back: its output (in a pooled buffer, or in the
//! caller's memory), the handle to await it, and the callback.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use kungfu_topology::Strategy;
use kungfu_transport::{ClusterVersion, Epoch, Generation, Mem, Region};
use tokio::sync::oneshot;

use crate::pool::PooledBuf;
use crate::{CollectiveError, Element, OpSpec};

/// Where an op's working memory comes from.
pub(super) enum Memory<'a> {
    /// Input bytes, laid out into a pooled buffer.
    Input(&'a [u8]),
    /// The caller's memory, laid out already ([`super::Session::submit_in`]).
    Region(Arc<Region>),
}

/// An op to start: what every path of [`super::Session::start`] takes.
pub(super) struct Start<'a> {
    pub(super) name: Arc<str>,
    pub(super) spec: OpSpec,
    pub(super) mem: Memory<'a>,
    pub(super) done: Callback,
    /// An internal name (not checked).
    pub(super) internal: bool,
    /// A handle will be waited on (an op on the fast path then returns
    /// what that handle drives); else a callback completes it.
    pub(super) waited: bool,
    /// The subgroup it runs in (None: the whole session); set by
    /// [`super::Session::start`] from the session that starts it.
    pub(super) scope: Option<Arc<super::scope::Scope>>,
    /// The gradient monitors' squared norms are wanted, computed in the
    /// reduction where its way can ([`super::Session::fuses_norms`]).
    pub(super) norms: bool,
}

impl<'a> Start<'a> {
    /// A caller's op under `name`, whose handle will be waited on.
    pub(super) fn new(name: &str, spec: OpSpec, mem: Memory<'a>, done: Callback) -> Start<'a> {
        Start {
            name: name.into(),
            spec,
            mem,
            done,
            internal: false,
            waited: true,
            scope: None,
            norms: false,
        }
    }

    /// Under an internal name.
    pub(super) fn internal(self) -> Start<'a> {
        Start {
            internal: true,
            ..self
        }
    }

    /// Completed by its callback alone.
    pub(super) fn unwaited(self) -> Start<'a> {
        Start {
            waited: false,
            ..self
        }
    }
}

/// [`Memory`], owned (an op held while a swap runs).
pub(super) enum HeldMemory {
    Input(Vec<u8>),
    Region(Arc<Region>),
}

impl HeldMemory {
    pub(super) fn of(m: Memory<'_>) -> HeldMemory {
        match m {
            Memory::Input(b) => HeldMemory::Input(b.to_vec()),
            Memory::Region(r) => HeldMemory::Region(r),
        }
    }

    pub(super) fn as_memory(&self) -> Memory<'_> {
        match self {
            HeldMemory::Input(b) => Memory::Input(b),
            HeldMemory::Region(r) => Memory::Region(r.clone()),
        }
    }
}

/// Where an op's output is.
#[derive(Clone, Debug)]
pub(super) enum Output {
    /// A pooled buffer, the output at a range of it.
    Owned(PooledBuf, Option<Range<usize>>),
    /// The caller's memory: a read share of the output range (or none,
    /// where this rank has no output).
    Shared(Option<Mem>),
}

/// The result of an op: the working memory and where this rank's output
/// lies in it (`None` for non-roots of reduce and gather), and where the op
/// ran: its generation (cluster version and epoch) and strategy.
#[derive(Clone, Debug)]
pub struct OpOutput {
    pub(super) out: Output,
    /// The session's (a session never changes version).
    pub(super) version: ClusterVersion,
    pub(super) epoch: Epoch,
    pub(super) strategy: Strategy,
    /// Squared norms computed in the reduction, if asked for and fused.
    pub(super) norms: Option<SqNorms>,
}

/// The squared L2 norms a gradient monitor needs, from an allreduce (sum
/// of f32, [`super::Session::allreduce_sum_with_norms`]). Every rank gets
/// the same bits: on the split and large ways each rank's share is
/// computed once and all add the same shares; on the direct way each rank
/// computes them all, alike where all run the same kernels
/// (`KUNGFU_KERNEL_ISA`: the vector kernels add the squares with fused
/// multiply-adds, the baseline does not); elsewhere they come from the
/// op's result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SqNorms {
    /// The sum over ranks of each rank's squared input norm, `sum_i |g_i|^2`.
    pub inputs: f64,
    /// The squared norm of the result, `|sum_i g_i|^2`.
    pub result: f64,
}

impl PartialEq for OpOutput {
    /// Same output bytes, generation and strategy.
    fn eq(&self, other: &OpOutput) -> bool {
        self.bytes() == other.bytes()
            && self.generation() == other.generation()
            && self.strategy == other.strategy
    }
}

impl Eq for OpOutput {}

impl OpOutput {
    /// The epoch the op ran at: ops started while a swap is under way wait
    /// for it and run at the new epoch.
    pub fn epoch(&self) -> Epoch {
        self.epoch
    }

    /// The cluster version and epoch the op ran at: later than those of
    /// every op that finished before a swap or a resize that this op
    /// followed.
    pub fn generation(&self) -> Generation {
        Generation {
            version: self.version,
            epoch: self.epoch,
        }
    }

    /// The strategy the op ran on (`AUTO` resolved to its choice).
    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    /// The squared norms the op's reduction computed, if they were asked
    /// for and its way computes them.
    pub fn sq_norms(&self) -> Option<SqNorms> {
        self.norms
    }

    /// This rank's output bytes, if it has an output. For an op on the
    /// caller's memory ([`super::Session::submit_in`]) they are that
    /// memory, shared (read-only) while this lives.
    pub fn bytes(&self) -> Option<&[u8]> {
        match &self.out {
            Output::Owned(work, range) => range.as_ref().map(|r| &work[r.clone()]),
            Output::Shared(mem) => mem.as_ref().map(Mem::as_slice),
        }
    }

    /// The output as elements; empty where the rank has no output.
    pub fn to_vec<E: Element>(&self) -> Vec<E> {
        self.bytes()
            .map(bytemuck::pod_collect_to_vec::<u8, E>)
            .unwrap_or_default()
    }
}

/// A completion callback: runs once, on a runtime thread, with the result.
/// Drives the fast path `d` until `rx` has the op's result (`None`: it
/// handed over to the progress thread first).
fn drive_until_done<O>(
    d: &dyn super::fast::Drive,
    rx: &mut oneshot::Receiver<Result<O, CollectiveError>>,
) -> Option<Result<O, CollectiveError>> {
    let mut got = None;
    d.drive(&mut || match rx.try_recv() {
        Ok(r) => {
            got = Some(r);
            true
        }
        Err(oneshot::error::TryRecvError::Empty) => false,
        Err(oneshot::error::TryRecvError::Closed) => {
            got = Some(Err(CollectiveError::Closed));
            true
        }
    });
    got
}

pub type Callback = Box<dyn FnOnce(Result<OpOutput, CollectiveError>) + Send + 'static>;

/// A pending op. Await it, or [`OpHandle::wait`] for it from a thread that
/// is not a runtime worker. Dropping the handle does not cancel the op (the
/// other ranks need this rank's part).
#[must_use = "an op handle does nothing unless awaited or waited on"]
pub struct OpHandle<O> {
    rx: oneshot::Receiver<Result<O, CollectiveError>>,
    /// The host fast path this op is on: waiting polls it (see
    /// `session/fast.rs`), once; then the progress thread completes it.
    fast: Option<Arc<dyn super::fast::Drive>>,
}

impl<O> OpHandle<O> {
    pub(crate) fn pair() -> (oneshot::Sender<Result<O, CollectiveError>>, OpHandle<O>) {
        let (tx, rx) = oneshot::channel();
        (tx, OpHandle { rx, fast: None })
    }

    /// The handle of an op on the fast path `d` (if it is).
    pub(super) fn driven(mut self, d: Option<Arc<dyn super::fast::Drive>>) -> OpHandle<O> {
        self.fast = d;
        self
    }

    /// Blocks the calling thread until the op completes. Panics if called
    /// on a thread that drives the tokio runtime (use `.await` there).
    pub fn wait(mut self) -> Result<O, CollectiveError> {
        if let Some(d) = self.fast.take() {
            if let Some(r) = drive_until_done(&*d, &mut self.rx) {
                return r;
            }
        }
        self.rx
            .blocking_recv()
            .unwrap_or(Err(CollectiveError::Closed))
    }

    /// The result, if the op has completed.
    pub fn try_result(&mut self) -> Option<Result<O, CollectiveError>> {
        match self.rx.try_recv() {
            Ok(r) => Some(r),
            Err(oneshot::error::TryRecvError::Empty) => None,
            Err(oneshot::error::TryRecvError::Closed) => Some(Err(CollectiveError::Closed)),
        }
    }
}

impl<O> Future for OpHandle<O> {
    type Output = Result<O, CollectiveError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if let Some(d) = this.fast.take() {
            // `try_recv`, not `poll`: a poll spends the task's cooperative
            // budget, and once it is spent it says Pending however ready
            // the value is, so the spin would run out its time for nothing.
            if let Some(r) = drive_until_done(&*d, &mut this.rx) {
                return Poll::Ready(r);
            }
        }
        Pin::new(&mut this.rx)
            .poll(cx)
            .map(|r| r.unwrap_or(Err(CollectiveError::Closed)))
    }
}
