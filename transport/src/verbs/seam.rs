//! The seam between the wire's protocol and the device: every call the
//! wire makes into libibverbs is a method of [`Verbs`], so the protocol
//! (`core`) runs the same over the real device (`sys`, through sideway)
//! and over the in-process fake the tests use (`fake`).
//!
//! The data calls are `unsafe fn`s with one contract: the memory a work
//! request names stays valid (and a receive's memory unaliased) until its
//! completion has been polled, or its queue pair has been moved to the
//! error state and destroyed. The wire's pending table keeps that promise:
//! every buffer is held by the entry of its work request.

use std::any::Any;

use kungfu_topology::Rank;

use super::proto::{LocalPort, QpStep, RecvWr, SendWr, Wc};

/// A memory registration: its keys and range, and the handle that
/// deregisters it when dropped.
pub struct Reg {
    pub lkey: u32,
    pub rkey: u32,
    pub addr: u64,
    pub len: usize,
    /// Registered for peers' RDMA writes (and local writes).
    pub remote_write: bool,
    _handle: Box<dyn Any + Send + Sync>,
}

impl Reg {
    pub fn new(
        lkey: u32,
        rkey: u32,
        addr: u64,
        len: usize,
        remote_write: bool,
        handle: Box<dyn Any + Send + Sync>,
    ) -> Reg {
        Reg {
            lkey,
            rkey,
            addr,
            len,
            remote_write,
            _handle: handle,
        }
    }

    /// Whether `addr..addr + len` lies inside this registration.
    pub fn covers(&self, addr: u64, len: usize) -> bool {
        addr >= self.addr
            && (addr - self.addr)
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.len as u64)
    }
}

impl std::fmt::Debug for Reg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reg")
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}

/// One opened device: a protection domain, a completion queue with its
/// event channel, and an RC queue pair (in RESET) per peer.
pub trait Verbs: Send + Sync + 'static {
    /// What this rank's port is (LID, GID, MTU, link layer).
    fn port(&self) -> LocalPort;

    /// The device's name (`mlx5_0`, `rxe0`).
    fn device(&self) -> String;

    /// The queue pair number of the pair to `peer`.
    fn qp_num(&self, peer: Rank) -> u32;

    /// Registers `len` bytes at `ptr` (for sends and, if `remote_write`,
    /// for local and remote writes).
    ///
    /// # Safety
    /// The memory stays allocated while any work request that names it
    /// (through this registration's keys) is outstanding. (A region drops
    /// its registrations just after its buffer, when nothing can name it:
    /// every request holds a share of the region.)
    unsafe fn register(
        &self,
        ptr: *const u8,
        len: usize,
        remote_write: bool,
    ) -> Result<Reg, String>;

    /// Moves the queue pair to `peer` as `step` says.
    fn modify_qp(&self, peer: Rank, step: &QpStep) -> Result<(), String>;

    /// Posts `wrs`, in order, on the send queue of the pair to `peer`.
    ///
    /// # Safety
    /// The buffers named stay valid until the completion of the signaled
    /// request that ends the batch is polled (or the pair is in error and
    /// destroyed); the keys are those of live registrations covering them.
    unsafe fn post_send(&self, peer: Rank, wrs: &[SendWr]) -> Result<(), String>;

    /// Posts a receive on the pair to `peer`.
    ///
    /// # Safety
    /// As [`Verbs::post_send`], and nothing else reads or writes the buffer
    /// until the completion.
    unsafe fn post_recv(&self, peer: Rank, wr: &RecvWr) -> Result<(), String>;

    /// Appends the completions ready now (at most a batch) to `out`.
    fn poll_cq(&self, out: &mut Vec<Wc>) -> Result<(), String>;

    /// Asks for an event on [`Verbs::event_fd`] at the next completion
    /// (`ibv_req_notify_cq`).
    fn arm_cq(&self) -> Result<(), String>;

    /// A file descriptor that is readable once an armed completion queue
    /// has a completion (the completion channel), if there is one.
    fn event_fd(&self) -> Option<std::os::fd::RawFd>;

    /// Takes (and acknowledges) the events that made the fd readable.
    fn drain_events(&self);
}
