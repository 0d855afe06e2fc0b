//! The C ABI of KungFu-rs: `libkungfu.so`, `libkungfu.a` and
//! `include/kungfu.h` (generated from this file by cbindgen, committed; a
//! test fails when it drifts).
//!
//! Named, asynchronous collectives for C and C++ trainers, in the manner of
//! Horovod's ops: each call copies its input, starts the op and returns a
//! handle at once; completion is reported through the handle
//! (`kf_wait`/`kf_test`) and, if given, a callback that runs once with the
//! op's final status. See `docs/c-api.md` for a complete example.
//!
//! # Safety rules of the ABI
//! - Every entry point catches panics and returns a status; nothing aborts
//!   the process. A NULL where a pointer is needed, an unknown enum value, a
//!   released or unknown handle, a call before `kf_init` or after
//!   `kf_finalize` return an error status, with the detail in
//!   `kf_last_error()`.
//! - Input buffers are copied before the call returns (they may be reused at
//!   once; `send == recv` is in place). Output buffers must stay valid until
//!   the op completes (even if its handle is released). Buffers may have any
//!   alignment.
//! - `kf_init` only reads the environment; the runtime (threads, sockets,
//!   shared memory) starts at the first call that needs it, so a process
//!   that forks before its first collective is fine. A child forked after
//!   that must not call the library (it gets an error).
//! - Callbacks run on a library thread: they must not block for long and
//!   must not throw.

#![allow(non_camel_case_types)]
// The C ABI is unsafe by nature (exported symbols, raw pointers); every
// unsafe block still says why it is sound.
#![allow(unsafe_code)]

mod adapt;
pub use adapt::*;

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use kungfu_collectives::{CollectiveError, DType, OpKind, OpSpec, ReduceOp, Session};
use kungfu_runtime::{Worker, WorkerEnv};
use kungfu_topology::{fnv1a64, Digest, Rank, Strategy};
use kungfu_transport::any::AnyTransport;
use kungfu_transport::TransportError;

/// The status of a call or of an op. `KF_OK` is 0; every error is positive.
pub type kf_status = i32;
pub const KF_OK: kf_status = 0;
/// A NULL pointer, an unknown enum value, a bad count or root, a name that
/// is not UTF-8, or buffers of the wrong size for the op.
pub const KF_ERR_INVALID_ARGUMENT: kf_status = 1;
/// `kf_init` was not called (or failed).
pub const KF_ERR_NOT_INITIALIZED: kf_status = 2;
/// The ranks disagree on an op of this name (count, type, op, root).
pub const KF_ERR_MISMATCH: kf_status = 3;
/// A peer process died or closed its connection.
pub const KF_ERR_PEER_LOST: kf_status = 4;
/// The op made no progress for the op timeout (`KUNGFU_OP_TIMEOUT_MS`).
pub const KF_ERR_TIMEOUT: kf_status = 5;
/// Another rank failed this op and told every rank.
pub const KF_ERR_ABORTED: kf_status = 6;
/// Two live ops have names that hash alike; rename one.
pub const KF_ERR_DUPLICATE_NAME: kf_status = 7;
/// The cluster changed (a frame of another cluster version).
pub const KF_ERR_MEMBERSHIP_CHANGED: kf_status = 8;
/// A bug or an unexpected failure inside the library (a caught panic).
pub const KF_ERR_INTERNAL: kf_status = 9;
/// `kf_finalize` was called.
pub const KF_ERR_FINALIZED: kf_status = 10;
/// The runtime could not start: bad environment, peers not reachable.
pub const KF_ERR_BOOTSTRAP: kf_status = 11;
/// A transport failure or a protocol violation by a peer.
pub const KF_ERR_TRANSPORT: kf_status = 12;
/// `kf_wait` returned before the op completed (its `timeout_ms` passed).
pub const KF_PENDING: kf_status = 13;

/// Element types (the same numbers as the wire format's).
pub type kf_dtype = i32;
pub const KF_UINT8: kf_dtype = 1;
pub const KF_INT8: kf_dtype = 2;
pub const KF_UINT16: kf_dtype = 3;
pub const KF_INT16: kf_dtype = 4;
pub const KF_UINT32: kf_dtype = 5;
pub const KF_INT32: kf_dtype = 6;
pub const KF_UINT64: kf_dtype = 7;
pub const KF_INT64: kf_dtype = 8;
pub const KF_FLOAT16: kf_dtype = 9;
pub const KF_BFLOAT16: kf_dtype = 10;
pub const KF_FLOAT32: kf_dtype = 11;
pub const KF_FLOAT64: kf_dtype = 12;

/// Reduction operators (`KF_AVG`: floating-point types only).
pub type kf_op = i32;
pub const KF_SUM: kf_op = 0;
pub const KF_MIN: kf_op = 1;
pub const KF_MAX: kf_op = 2;
pub const KF_PROD: kf_op = 3;
pub const KF_AVG: kf_op = 4;

/// Communication strategies (see the README's table).
pub type kf_strategy = i32;
pub const KF_STRATEGY_AUTO: kf_strategy = 0;
pub const KF_STRATEGY_STAR: kf_strategy = 1;
pub const KF_STRATEGY_RING: kf_strategy = 2;
pub const KF_STRATEGY_TREE: kf_strategy = 3;
pub const KF_STRATEGY_BINARY_TREE: kf_strategy = 4;
pub const KF_STRATEGY_BINARY_TREE_STAR: kf_strategy = 5;
pub const KF_STRATEGY_MULTI_BINARY_TREE_STAR: kf_strategy = 6;
pub const KF_STRATEGY_CLIQUE: kf_strategy = 7;
pub const KF_STRATEGY_RECURSIVE_DOUBLING: kf_strategy = 8;

/// An op in flight or completed, until `kf_release`. Never 0.
pub type kf_handle = u64;

/// Runs once per op, on a library thread, with the op's final status.
/// Output buffers are written before it runs, and `kf_wait`/`kf_test` see
/// the op complete only after it returned (so it must not wait on its own
/// handle).
pub type kf_callback =
    Option<unsafe extern "C" fn(handle: kf_handle, status: kf_status, user: *mut c_void)>;

// ---------------------------------------------------------------------------
// errors

/// A failed call: its status and the detail for `kf_last_error`.
struct Fail(kf_status, String);

type Res<T> = Result<T, Fail>;

fn invalid(msg: impl Into<String>) -> Fail {
    Fail(KF_ERR_INVALID_ARGUMENT, msg.into())
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

fn status_of(e: &CollectiveError) -> kf_status {
    match e {
        CollectiveError::InvalidArgument { .. } => KF_ERR_INVALID_ARGUMENT,
        CollectiveError::NameCollision { .. } => KF_ERR_DUPLICATE_NAME,
        CollectiveError::Mismatch { .. } => KF_ERR_MISMATCH,
        CollectiveError::PeerLost { .. } => KF_ERR_PEER_LOST,
        CollectiveError::Timeout { .. } => KF_ERR_TIMEOUT,
        CollectiveError::Aborted { .. } => KF_ERR_ABORTED,
        CollectiveError::Closed => KF_ERR_FINALIZED,
        CollectiveError::Transport {
            source: TransportError::StaleEpoch { .. },
            ..
        } => KF_ERR_MEMBERSHIP_CHANGED,
        CollectiveError::Protocol { .. } | CollectiveError::Transport { .. } => KF_ERR_TRANSPORT,
    }
}

fn fail_of(e: &CollectiveError) -> Fail {
    Fail(status_of(e), e.to_string())
}

/// Runs `f`, catching panics; a failure sets the thread's last error.
fn guard(f: impl FnOnce() -> Res<()>) -> kf_status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => KF_OK,
        Ok(Err(Fail(status, msg))) => {
            set_last_error(&msg);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".into());
            set_last_error(&format!("internal error (caught panic): {what}"));
            KF_ERR_INTERNAL
        }
    }
}

// ---------------------------------------------------------------------------
// global state

enum Phase {
    Uninit,
    Ready(Box<Lib>),
    Finalized,
}

struct Lib {
    env: WorkerEnv,
    /// Started at the first call that needs it; a failure sticks.
    running: Option<Result<Running, String>>,
}

struct Running {
    rt: tokio::runtime::Runtime,
    worker: Worker,
    /// The process that started the runtime (a forked child may not use it).
    pid: u32,
}

static PHASE: Mutex<Phase> = Mutex::new(Phase::Uninit);

/// Set once `kf_finalize` starts closing: ops that fail from then on fail
/// because of it.
static FINALIZING: AtomicBool = AtomicBool::new(false);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn ready(phase: &mut Phase) -> Res<&mut Lib> {
    match phase {
        Phase::Uninit => Err(Fail(
            KF_ERR_NOT_INITIALIZED,
            "kf_init has not been called".into(),
        )),
        Phase::Finalized => Err(Fail(KF_ERR_FINALIZED, "kf_finalize has been called".into())),
        Phase::Ready(lib) => Ok(lib),
    }
}

/// What an op needs from the runtime.
#[derive(Clone)]
struct Ctx {
    session: Session<AnyTransport>,
    rt: tokio::runtime::Handle,
}

/// The running session, started now if this is the first call needing it.
fn ctx() -> Res<Ctx> {
    let mut phase = lock(&PHASE);
    let lib = ready(&mut phase)?;
    if lib.running.is_none() {
        lib.running = Some(start(lib.env.clone()));
    }
    match lib.running.as_ref().expect("set above") {
        Err(why) => Err(Fail(KF_ERR_BOOTSTRAP, why.clone())),
        Ok(r) if r.pid != std::process::id() => Err(invalid(format!(
            "called in process {}, forked from process {} after the runtime started; \
             a forked child cannot use its parent's connections",
            std::process::id(),
            r.pid
        ))),
        Ok(r) => Ok(Ctx {
            session: r.worker.session().clone(),
            rt: r.rt.handle().clone(),
        }),
    }
}

fn start(env: WorkerEnv) -> Result<Running, String> {
    let threads = std::env::var("KUNGFU_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("kungfu-rt")
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    let worker = rt
        .block_on(Worker::start(env))
        .map_err(|e| format!("starting the worker: {e}"))?;
    Ok(Running {
        rt,
        worker,
        pid: std::process::id(),
    })
}

// ---------------------------------------------------------------------------
// handles

/// The completion record of one op.
struct Slot {
    done: Mutex<Option<(kf_status, String)>>,
    cv: Condvar,
}

struct Handles {
    next: u64,
    live: HashMap<kf_handle, Arc<Slot>>,
}

static HANDLES: Mutex<Option<Handles>> = Mutex::new(None);

fn with_handles<R>(f: impl FnOnce(&mut Handles) -> R) -> R {
    let mut h = lock(&HANDLES);
    let h = h.get_or_insert_with(|| Handles {
        next: 1,
        live: HashMap::new(),
    });
    f(h)
}

/// A user pointer carried to a library thread.
#[derive(Clone, Copy)]
struct UserPtr(*mut c_void);
// SAFETY: the pointer is only handed back to the caller's callback, which
// the caller wrote to be called from a library thread.
unsafe impl Send for UserPtr {}

/// An output buffer carried to a library thread.
#[derive(Clone, Copy)]
struct OutPtr(*mut u8);
// SAFETY: the caller guarantees that the buffer stays valid, and is not
// used by it, until the op completes (the ABI's documented contract); only
// the completing task writes it, once.
unsafe impl Send for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the Send wrapper).
    fn get(self) -> *mut u8 {
        self.0
    }
}

/// How an op completes: its handle, slot, callback. Dropped unfinished
/// (its task was dropped when the runtime stopped), it completes with
/// `KF_ERR_FINALIZED`, so the callback runs once whatever happens.
struct Completion {
    handle: kf_handle,
    slot: Arc<Slot>,
    cb: kf_callback,
    user: UserPtr,
    /// No handle was asked for: forget it once complete.
    auto_release: bool,
    finished: bool,
}

impl Drop for Completion {
    fn drop(&mut self) {
        if !self.finished {
            self.complete(Err(Fail(
                KF_ERR_FINALIZED,
                "the library stopped before the op completed".into(),
            )));
        }
    }
}

impl Completion {
    /// A new handle (written to `out` if not NULL).
    fn new(cb: kf_callback, user: *mut c_void, out: *mut kf_handle) -> Completion {
        let slot = Arc::new(Slot {
            done: Mutex::new(None),
            cv: Condvar::new(),
        });
        let handle = with_handles(|h| {
            let id = h.next;
            h.next += 1;
            h.live.insert(id, slot.clone());
            id
        });
        if !out.is_null() {
            // SAFETY: the caller passed a non-NULL pointer to a kf_handle.
            unsafe { out.write_unaligned(handle) };
        }
        Completion {
            handle,
            slot,
            cb,
            user: UserPtr(user),
            auto_release: out.is_null(),
            finished: false,
        }
    }

    fn finish(mut self, r: Result<(), Fail>) {
        self.complete(r);
    }

    fn complete(&mut self, r: Result<(), Fail>) {
        self.finished = true;
        let (status, detail) = match r {
            Ok(()) => (KF_OK, String::new()),
            // Closing the connections fails the ops in flight, and so does
            // each peer that leaves in turn (a lost peer): either way the
            // cause is this kf_finalize, and the caller is told so.
            Err(Fail(s, d)) if FINALIZING.load(Ordering::SeqCst) => (
                KF_ERR_FINALIZED,
                format!(
                    "kf_finalize was called before the op completed ({})",
                    status_text(s, &d)
                ),
            ),
            Err(Fail(s, d)) => (s, d),
        };
        // The callback runs even if kf_finalize already marked the slot
        // done: an op started on another thread while kf_finalize ran
        // completes only after it (its `finished` flag keeps it to once).
        // The callback runs before the handle shows the op complete, so
        // what it did is visible to whoever waits on the handle.
        if let Some(cb) = self.cb {
            let user = self.user;
            // SAFETY: the caller's callback, called once, with the handle,
            // status and user pointer it was registered with.
            let _ = catch_unwind(AssertUnwindSafe(|| unsafe {
                cb(self.handle, status, user.0)
            }));
        }
        {
            let mut done = lock(&self.slot.done);
            if done.is_none() {
                *done = Some((status, detail));
            }
            self.slot.cv.notify_all();
        }
        if self.auto_release {
            with_handles(|h| h.live.remove(&self.handle));
        }
    }
}

fn slot_of(h: kf_handle) -> Res<Arc<Slot>> {
    with_handles(|hs| hs.live.get(&h).cloned())
        .ok_or_else(|| invalid(format!("unknown or released handle {h}")))
}

// ---------------------------------------------------------------------------
// arguments

fn dtype_of(d: kf_dtype) -> Res<DType> {
    DType::ALL
        .into_iter()
        .find(|t| *t as i32 == d)
        .ok_or_else(|| invalid(format!("unknown kf_dtype {d}")))
}

fn op_of(o: kf_op) -> Res<ReduceOp> {
    Ok(match o {
        KF_SUM => ReduceOp::Sum,
        KF_MIN => ReduceOp::Min,
        KF_MAX => ReduceOp::Max,
        KF_PROD => ReduceOp::Prod,
        KF_AVG => ReduceOp::Avg,
        _ => return Err(invalid(format!("unknown kf_op {o}"))),
    })
}

fn strategy_of(s: kf_strategy) -> Res<Strategy> {
    Ok(match s {
        KF_STRATEGY_AUTO => Strategy::Auto,
        KF_STRATEGY_STAR => Strategy::Star,
        KF_STRATEGY_RING => Strategy::Ring,
        KF_STRATEGY_TREE => Strategy::Tree,
        KF_STRATEGY_BINARY_TREE => Strategy::BinaryTree,
        KF_STRATEGY_BINARY_TREE_STAR => Strategy::BinaryTreeStar,
        KF_STRATEGY_MULTI_BINARY_TREE_STAR => Strategy::MultiBinaryTreeStar,
        KF_STRATEGY_CLIQUE => Strategy::Clique,
        KF_STRATEGY_RECURSIVE_DOUBLING => Strategy::RecursiveDoubling,
        _ => return Err(invalid(format!("unknown kf_strategy {s}"))),
    })
}

fn name_of(name: *const c_char) -> Res<String> {
    if name.is_null() {
        return Err(invalid("name is NULL"));
    }
    // SAFETY: the caller passed a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(name) };
    s.to_str()
        .map(str::to_owned)
        .map_err(|_| invalid("name is not UTF-8"))
}

fn root_of(root: c_int, n: usize) -> Res<Rank> {
    if root < 0 || root as usize >= n {
        return Err(invalid(format!("root {root} outside a cluster of {n}")));
    }
    Ok(Rank(root as u32))
}

/// `len` bytes at `p`, copied (`p` may be unaligned; NULL only if empty).
fn read_input(p: *const c_void, len: usize, what: &str) -> Res<Vec<u8>> {
    if len == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: the caller passed a buffer of at least `len` bytes; u8 has
    // no alignment requirement.
    Ok(unsafe { std::slice::from_raw_parts(p as *const u8, len) }.to_vec())
}

// ---------------------------------------------------------------------------
// ops

/// A data op: what to start, and where its output goes.
struct Request {
    name: String,
    spec: OpSpec,
    input: Vec<u8>,
    /// Where this rank's output goes, and its length (None: no output here).
    out: Option<(OutPtr, usize)>,
}

/// Checks the buffers of `spec` for this rank and copies the input.
fn request(
    ctx: &Ctx,
    name: String,
    spec: OpSpec,
    send: *const c_void,
    recv: *mut c_void,
) -> Res<Request> {
    let n = ctx.session.size();
    let me = ctx.session.rank();
    spec.validate(n).map_err(invalid)?;
    let in_len = spec.input_len(n).expect("validated");
    let input = match spec.kind {
        // only the root's input matters; others may pass NULL
        OpKind::Broadcast { root } if root != me && send.is_null() => vec![0; in_len],
        _ => read_input(send, in_len, "send buffer")?,
    };
    let out = match spec.output_range(me, n) {
        Some(r) if !r.is_empty() => {
            if recv.is_null() {
                return Err(invalid("recv buffer is NULL"));
            }
            Some((OutPtr(recv as *mut u8), r.len()))
        }
        _ => None,
    };
    Ok(Request {
        name,
        spec,
        input,
        out,
    })
}

/// Writes an op's output (`got`, if this rank has one) to the caller's
/// buffer.
fn deliver(out: Option<(OutPtr, usize)>, got: Option<&[u8]>) -> Res<()> {
    if let (Some((p, len)), Some(bytes)) = (out, got) {
        if bytes.len() != len {
            return Err(Fail(
                KF_ERR_INTERNAL,
                format!("output of {} bytes, expected {len}", bytes.len()),
            ));
        }
        // SAFETY: the caller's recv buffer holds `len` bytes and stays
        // valid until completion (the ABI's contract); the source is ours.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), p.get(), len) };
    }
    Ok(())
}

/// Starts `req` (or holds it in the thread's open group) and returns at
/// once.
fn submit(ctx: &Ctx, req: Request, done: Completion) {
    let Some((req, done)) = group::hold(req, done) else {
        return;
    };
    let h = ctx.session.submit(&req.name, req.spec, &req.input);
    let out = req.out;
    ctx.rt.spawn(async move {
        let r = match h.await {
            Ok(got) => deliver(out, got.bytes()),
            Err(e) => Err(fail_of(&e)),
        };
        done.finish(r);
    });
}

/// Fusion of small allreduces: between `kf_group_start` and
/// `kf_group_end`, a thread's allreduces are held and then run as one
/// allreduce per (type, operator), members in name order (so ranks that
/// issued them in different orders agree), whose result is scattered back.
mod group {
    use super::*;

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
                                unsafe {
                                    std::ptr::copy_nonoverlapping(part.as_ptr(), p.get(), len)
                                };
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
}

// ---------------------------------------------------------------------------
// the API

/// Reads what the launcher set (kungfu-run, torchrun, srun or mpirun; see
/// the README). Idempotent. The runtime starts at the first call that
/// needs it. After `kf_finalize`: `KF_ERR_FINALIZED`.
#[no_mangle]
pub extern "C" fn kf_init() -> kf_status {
    guard(|| {
        let mut phase = lock(&PHASE);
        match &*phase {
            Phase::Ready(_) => Ok(()),
            Phase::Finalized => Err(Fail(
                KF_ERR_FINALIZED,
                "kf_finalize has been called; the library cannot start again".into(),
            )),
            Phase::Uninit => {
                let env =
                    WorkerEnv::from_env().map_err(|e| Fail(KF_ERR_BOOTSTRAP, e.to_string()))?;
                *phase = Phase::Ready(Box::new(Lib { env, running: None }));
                Ok(())
            }
        }
    })
}

/// Closes the connections (waiting a few seconds for the peers to finish
/// with this worker) and stops the runtime. Ops still running fail with
/// `KF_ERR_FINALIZED`; their callbacks have run when it returns.
/// Idempotent.
#[no_mangle]
pub extern "C" fn kf_finalize() -> kf_status {
    guard(|| {
        let old = std::mem::replace(&mut *lock(&PHASE), Phase::Finalized);
        if let Phase::Ready(lib) = old {
            if let Some(Ok(r)) = lib.running {
                if r.pid == std::process::id() {
                    FINALIZING.store(true, Ordering::SeqCst);
                    r.rt.block_on(r.worker.close(Duration::from_secs(5)));
                    r.rt.shutdown_timeout(Duration::from_secs(5));
                } else {
                    // a forked child: the threads are not ours to stop
                    std::mem::forget(r);
                }
            }
        }
        // whatever never completed now never will
        let slots: Vec<Arc<Slot>> = with_handles(|h| h.live.values().cloned().collect());
        for s in slots {
            let mut done = lock(&s.done);
            if done.is_none() {
                *done = Some((KF_ERR_FINALIZED, "finalized before the op completed".into()));
                s.cv.notify_all();
            }
        }
        Ok(())
    })
}

fn getter(f: impl FnOnce(&Lib) -> Option<i64>) -> i64 {
    catch_unwind(AssertUnwindSafe(|| {
        let mut phase = lock(&PHASE);
        match ready(&mut phase) {
            Ok(lib) => f(lib).unwrap_or(-1),
            Err(Fail(_, msg)) => {
                set_last_error(&msg);
                -1
            }
        }
    }))
    .unwrap_or(-1)
}

/// This worker's rank, or -1 before `kf_init`.
#[no_mangle]
pub extern "C" fn kf_rank() -> c_int {
    getter(|l| Some(l.env.rank as i64)) as c_int
}

/// The number of workers, or -1 before `kf_init`.
#[no_mangle]
pub extern "C" fn kf_size() -> c_int {
    getter(|l| Some(l.env.size as i64)) as c_int
}

fn local(f: impl FnOnce(&Worker) -> usize) -> c_int {
    match catch_unwind(AssertUnwindSafe(|| {
        ctx().map(|_| {
            let mut phase = lock(&PHASE);
            match ready(&mut phase) {
                Ok(Lib {
                    running: Some(Ok(r)),
                    ..
                }) => f(&r.worker) as c_int,
                _ => -1,
            }
        })
    })) {
        Ok(Ok(v)) => v,
        Ok(Err(Fail(_, msg))) => {
            set_last_error(&msg);
            -1
        }
        Err(_) => -1,
    }
}

/// This worker's position among the workers of its host, or -1 (starts
/// the runtime: the layout comes from the peers).
#[no_mangle]
pub extern "C" fn kf_local_rank() -> c_int {
    local(Worker::local_rank)
}

/// The number of workers on this worker's host, or -1 (starts the runtime).
#[no_mangle]
pub extern "C" fn kf_local_size() -> c_int {
    local(Worker::local_size)
}

/// The cluster version (0 until the cluster is resized), or `UINT64_MAX`
/// before `kf_init`.
#[no_mangle]
pub extern "C" fn kf_cluster_version() -> u64 {
    getter(|l| Some(i64::from(l.env.cluster_version))) as u64
}

/// The cluster size from the environment (no runtime needed).
fn size_now() -> Res<usize> {
    Ok(ready(&mut lock(&PHASE))?.env.size)
}

#[allow(clippy::too_many_arguments)]
fn start_op(
    kind: impl FnOnce(usize) -> Res<OpKind>,
    dtype: kf_dtype,
    count: usize,
    send: *const c_void,
    recv: *mut c_void,
    name: *const c_char,
    cb: kf_callback,
    user: *mut c_void,
    out: *mut kf_handle,
) -> kf_status {
    guard(|| {
        let name = name_of(name)?;
        let dtype = dtype_of(dtype)?;
        let kind = kind(size_now()?)?;
        let ctx = ctx()?;
        let spec = OpSpec { kind, dtype, count };
        let req = request(&ctx, name, spec, send, recv)?;
        submit(&ctx, req, Completion::new(cb, user, out));
        Ok(())
    })
}

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

/// Waits until the op completes or `timeout_ms` passes (negative: until it
/// completes, which the op timeout bounds). Returns the op's status, or
/// `KF_PENDING` if it is still running.
#[no_mangle]
pub extern "C" fn kf_wait(h: kf_handle, timeout_ms: i64) -> kf_status {
    guard(|| {
        ready(&mut lock(&PHASE))?;
        wait_slot(h, &*slot_of(h)?, timeout_ms)
    })
}

/// `kf_wait` once the library is up and the handle known.
fn wait_slot(h: kf_handle, slot: &Slot, timeout_ms: i64) -> Res<()> {
    let deadline =
        (timeout_ms >= 0).then(|| Instant::now() + Duration::from_millis(timeout_ms as u64));
    let mut done = lock(&slot.done);
    loop {
        if let Some((status, detail)) = &*done {
            return if *status == KF_OK {
                Ok(())
            } else {
                Err(Fail(*status, detail.clone()))
            };
        }
        let wait = match deadline {
            Some(d) => {
                let now = Instant::now();
                if now >= d {
                    return Err(Fail(KF_PENDING, format!("op {h} still running")));
                }
                d - now
            }
            None => Duration::from_millis(100),
        };
        done = slot
            .cv
            .wait_timeout(done, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Sets `*done` to 1 if the op completed (then returns its status), else
/// to 0 (and returns `KF_OK`).
///
/// # Safety
/// `done` points to an int.
#[no_mangle]
pub unsafe extern "C" fn kf_test(h: kf_handle, done: *mut c_int) -> kf_status {
    guard(|| {
        if done.is_null() {
            return Err(invalid("done is NULL"));
        }
        ready(&mut lock(&PHASE))?;
        let slot = slot_of(h)?;
        let state = lock(&slot.done).clone();
        // SAFETY: the caller's int.
        unsafe { done.write_unaligned(c_int::from(state.is_some())) };
        match state {
            Some((KF_OK, _)) | None => Ok(()),
            Some((status, detail)) => Err(Fail(status, detail)),
        }
    })
}

/// Forgets a handle. The op, if still running, completes anyway (its
/// callback runs, its output is written).
#[no_mangle]
pub extern "C" fn kf_release(h: kf_handle) -> kf_status {
    guard(|| {
        ready(&mut lock(&PHASE))?;
        with_handles(|hs| hs.live.remove(&h))
            .map(|_| ())
            .ok_or_else(|| invalid(format!("unknown or released handle {h}")))
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

/// A static description of a status.
#[no_mangle]
pub extern "C" fn kf_status_string(s: kf_status) -> *const c_char {
    status_str(s).as_ptr()
}

fn status_str(s: kf_status) -> &'static CStr {
    match s {
        KF_OK => c"ok",
        KF_ERR_INVALID_ARGUMENT => c"invalid argument",
        KF_ERR_NOT_INITIALIZED => c"not initialized",
        KF_ERR_MISMATCH => c"mismatch between ranks",
        KF_ERR_PEER_LOST => c"peer lost",
        KF_ERR_TIMEOUT => c"timeout",
        KF_ERR_ABORTED => c"aborted by another rank",
        KF_ERR_DUPLICATE_NAME => c"duplicate name",
        KF_ERR_MEMBERSHIP_CHANGED => c"membership changed",
        KF_ERR_INTERNAL => c"internal error",
        KF_ERR_FINALIZED => c"finalized",
        KF_ERR_BOOTSTRAP => c"runtime could not start",
        KF_ERR_TRANSPORT => c"transport error",
        KF_PENDING => c"pending",
        _ => c"unknown status",
    }
}

/// "STATUS: DETAIL", for a detail that wraps another.
fn status_text(s: kf_status, detail: &str) -> String {
    format!("{}: {detail}", status_str(s).to_string_lossy())
}

/// The detail of the last error on this thread ("" if none). Valid until
/// the next call on this thread.
#[no_mangle]
pub extern "C" fn kf_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: kf_last_error returns a valid NUL-terminated string.
        unsafe { CStr::from_ptr(kf_last_error()) }
            .to_string_lossy()
            .into_owned()
    }

    #[test]
    fn panics_become_internal_errors() {
        let s = guard(|| panic!("boom"));
        assert_eq!(s, KF_ERR_INTERNAL);
        assert!(last_error().contains("boom"), "{}", last_error());
        assert_eq!(guard(|| Err(invalid("bad thing"))), KF_ERR_INVALID_ARGUMENT);
        assert_eq!(last_error(), "bad thing");
    }

    #[test]
    fn enums_from_c_are_checked() {
        for d in DType::ALL {
            assert_eq!(dtype_of(d as i32).ok(), Some(d));
        }
        assert!(dtype_of(0).is_err() && dtype_of(13).is_err() && dtype_of(-1).is_err());
        assert!(op_of(5).is_err() && op_of(-1).is_err());
        for s in 0..=8 {
            assert!(strategy_of(s).is_ok(), "{s}");
        }
        assert!(strategy_of(9).is_err());
        assert!(name_of(std::ptr::null()).is_err());
        assert!(root_of(-1, 4).is_err() && root_of(4, 4).is_err() && root_of(3, 4).is_ok());
    }

    #[test]
    fn every_status_has_its_own_string() {
        let mut seen = std::collections::HashSet::new();
        for s in 0..=13 {
            // SAFETY: kf_status_string returns a static C string.
            let text = unsafe { CStr::from_ptr(kf_status_string(s)) };
            assert!(seen.insert(text.to_owned()), "{s}: {text:?}");
            assert_ne!(text.to_str().unwrap(), "unknown status", "{s}");
        }
    }
    // The tests below need no runtime (no tokio, no sockets, no shared
    // memory), so they also run under Miri (scripts/miri-ffi.sh), which
    // checks the raw-pointer work and the hand-over between threads. None
    // calls kf_init or kf_finalize: the library stays uninitialized for
    // every test of this process.

    /// The (handle, status) of every call of `record`, in order.
    #[derive(Default)]
    struct Calls(Mutex<Vec<(kf_handle, kf_status)>>);

    impl Calls {
        fn user(&self) -> *mut c_void {
            self as *const Calls as *mut c_void
        }

        fn seen(&self) -> Vec<(kf_handle, kf_status)> {
            lock(&self.0).clone()
        }
    }

    unsafe extern "C" fn record(h: kf_handle, s: kf_status, user: *mut c_void) {
        // SAFETY: the tests pass a `Calls` that outlives the op.
        let calls = unsafe { &*(user as *const Calls) };
        lock(&calls.0).push((h, s));
    }

    fn status_of_wait(h: kf_handle, timeout_ms: i64) -> kf_status {
        let slot = slot_of(h).unwrap_or_else(|Fail(_, d)| panic!("{d}"));
        match wait_slot(h, &slot, timeout_ms) {
            Ok(()) => KF_OK,
            Err(Fail(s, _)) => s,
        }
    }

    fn forget(h: kf_handle) {
        with_handles(|hs| hs.live.remove(&h));
    }

    #[test]
    fn a_completion_calls_back_once_then_shows_done() {
        let calls = Calls::default();
        // the handle goes to an unaligned place, as C may pass
        let mut raw = [0u8; 1 + std::mem::size_of::<kf_handle>()];
        let out = raw[1..].as_mut_ptr() as *mut kf_handle;
        let c = Completion::new(Some(record), calls.user(), out);
        // SAFETY: `out` points into `raw`, which Completion::new wrote.
        let h = unsafe { out.read_unaligned() };
        assert_ne!(h, 0);
        assert_eq!(status_of_wait(h, 0), KF_PENDING);
        assert!(calls.seen().is_empty());
        c.finish(Ok(()));
        assert_eq!(calls.seen(), vec![(h, KF_OK)]);
        assert_eq!(status_of_wait(h, -1), KF_OK);
        assert_eq!(status_of_wait(h, 0), KF_OK, "a handle stays until released");
        forget(h);
        assert!(slot_of(h).is_err());
    }

    #[test]
    fn a_completion_dropped_unfinished_fails_with_finalized_once() {
        let calls = Calls::default();
        let mut h: kf_handle = 0;
        let c = Completion::new(Some(record), calls.user(), &mut h);
        drop(c);
        assert_eq!(calls.seen(), vec![(h, KF_ERR_FINALIZED)]);
        assert_eq!(status_of_wait(h, 0), KF_ERR_FINALIZED);
        forget(h);
    }

    #[test]
    fn an_op_without_a_handle_is_forgotten_once_complete() {
        let calls = Calls::default();
        let c = Completion::new(Some(record), calls.user(), std::ptr::null_mut());
        c.finish(Err(Fail(KF_ERR_MISMATCH, "ranks disagree".into())));
        let seen = calls.seen();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].1, KF_ERR_MISMATCH);
        assert!(slot_of(seen[0].0).is_err(), "released on completion");
    }

    /// An op completed on a library thread: the output and what the
    /// callback wrote are there once the wait returns (Miri checks that
    /// nothing races).
    #[test]
    fn output_and_callback_of_another_thread_are_visible_after_the_wait() {
        struct Seen {
            calls: usize,
            first: u8,
            out: *const u8,
        }
        unsafe extern "C" fn peek(_h: kf_handle, s: kf_status, user: *mut c_void) {
            // SAFETY: the test's `Seen`, used by nobody else until the
            // wait returned.
            let seen = unsafe { &mut *(user as *mut Seen) };
            assert_eq!(s, KF_OK);
            seen.calls += 1;
            // SAFETY: the output, written before the callback runs.
            seen.first = unsafe { *seen.out };
        }
        let mut buf = [0u8; 13];
        let dst = buf[1..].as_mut_ptr(); // unaligned, as C may pass
        let mut seen = Seen {
            calls: 0,
            first: 0,
            out: dst,
        };
        let mut h: kf_handle = 0;
        let c = Completion::new(Some(peek), &mut seen as *mut Seen as *mut c_void, &mut h);
        let out = Some((OutPtr(dst), 12));
        let t = std::thread::spawn(move || {
            let got: Vec<u8> = (1..=12).collect();
            let r = deliver(out, Some(&got));
            c.finish(r);
        });
        assert_eq!(status_of_wait(h, -1), KF_OK);
        assert_eq!((seen.calls, seen.first), (1, 1));
        assert_eq!(&buf[1..], &(1..=12).collect::<Vec<u8>>()[..]);
        t.join().expect("the completing thread");
        forget(h);
    }

    #[test]
    fn output_of_the_wrong_size_is_an_internal_error() {
        let mut buf = [0u8; 4];
        let out = Some((OutPtr(buf.as_mut_ptr()), 4));
        assert!(matches!(
            deliver(out, Some(&[1, 2, 3, 4, 5])),
            Err(Fail(KF_ERR_INTERNAL, _))
        ));
        assert_eq!(buf, [0; 4], "nothing written");
        assert!(deliver(out, None).is_ok(), "no output on this rank");
        assert!(deliver(None, Some(&[1])).is_ok());
    }

    #[test]
    fn inputs_are_copied_from_any_alignment() {
        let raw: Vec<u8> = (0..16).collect();
        let p = raw[3..].as_ptr() as *const c_void;
        assert_eq!(read_input(p, 9, "x").ok(), Some(raw[3..12].to_vec()));
        assert_eq!(read_input(std::ptr::null(), 0, "x").ok(), Some(Vec::new()));
        assert!(matches!(
            read_input(std::ptr::null(), 3, "x"),
            Err(Fail(KF_ERR_INVALID_ARGUMENT, _))
        ));
    }

    fn allreduce_request(name: &str, out: *mut u8) -> Request {
        Request {
            name: name.into(),
            spec: OpSpec {
                kind: OpKind::Allreduce(ReduceOp::Sum),
                dtype: DType::F32,
                count: 1,
            },
            input: vec![0; 4],
            out: Some((OutPtr(out), 4)),
        }
    }

    #[test]
    fn groups_hold_this_threads_allreduces_and_fail_them_without_a_runtime() {
        let calls = Calls::default();
        let mut out = [0u8; 8];
        let (mut h1, mut h2): (kf_handle, kf_handle) = (0, 0);
        assert!(matches!(
            group::end(),
            Err(Fail(KF_ERR_INVALID_ARGUMENT, _))
        ));
        group::start();
        group::start(); // nested
        let req = allreduce_request("a", out.as_mut_ptr());
        assert!(group::hold(req, Completion::new(Some(record), calls.user(), &mut h1)).is_none());
        // not an allreduce: given back
        let mut other = allreduce_request("b", out[4..].as_mut_ptr());
        other.spec.kind = OpKind::Broadcast { root: Rank(0) };
        let back = group::hold(other, Completion::new(Some(record), calls.user(), &mut h2));
        let (_, c2) = back.expect("a broadcast is not held");
        c2.finish(Ok(()));
        // another thread has no group open: nothing of it is held
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut h3: kf_handle = 0;
                let req = allreduce_request("c", std::ptr::null_mut());
                let c = Completion::new(None, std::ptr::null_mut(), &mut h3);
                assert!(group::hold(req, c).is_some());
                forget(h3);
            });
        });
        assert!(group::end().is_ok(), "inner level: nothing starts");
        assert_eq!(calls.seen(), vec![(h2, KF_OK)]);
        // the outer level starts the group, which needs kf_init: the held
        // op fails and calls back
        assert!(matches!(group::end(), Err(Fail(KF_ERR_NOT_INITIALIZED, _))));
        assert_eq!(
            calls.seen(),
            vec![(h2, KF_OK), (h1, KF_ERR_NOT_INITIALIZED)]
        );
        forget(h1);
        forget(h2);
    }

    #[test]
    fn the_api_before_kf_init_fails_cleanly() {
        let x = [1.0f32; 2];
        let mut y = [0.0f32; 2];
        let mut h: kf_handle = 7;
        let name = c"early";
        let p = |v: &[f32; 2]| v.as_ptr() as *const c_void;
        // SAFETY: every call below gets valid pointers (or NULL where the
        // ABI allows it) and a NUL-terminated name.
        unsafe {
            let yp = y.as_mut_ptr() as *mut c_void;
            let s = kf_allreduce(
                p(&x),
                yp,
                2,
                KF_FLOAT32,
                KF_SUM,
                name.as_ptr(),
                None,
                std::ptr::null_mut(),
                &mut h,
            );
            assert_eq!(s, KF_ERR_NOT_INITIALIZED);
            assert!(last_error().contains("kf_init"), "{}", last_error());
            // argument errors come first
            let s = kf_allreduce(
                p(&x),
                yp,
                2,
                99,
                KF_SUM,
                name.as_ptr(),
                None,
                std::ptr::null_mut(),
                &mut h,
            );
            assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
            assert!(last_error().contains("99"), "{}", last_error());
            let s = kf_allreduce(
                p(&x),
                yp,
                2,
                KF_FLOAT32,
                KF_SUM,
                std::ptr::null(),
                None,
                std::ptr::null_mut(),
                &mut h,
            );
            assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
            let bad = [0xffu8, 0];
            let s = kf_broadcast(
                p(&x),
                yp,
                2,
                KF_FLOAT32,
                0,
                bad.as_ptr() as *const c_char,
                None,
                std::ptr::null_mut(),
                &mut h,
            );
            assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
            assert!(last_error().contains("UTF-8"), "{}", last_error());
            let mut agreed = -1;
            let s = kf_consensus(
                p(&x),
                8,
                name.as_ptr(),
                std::ptr::null_mut(),
                None,
                std::ptr::null_mut(),
                &mut h,
            );
            assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
            let s = kf_consensus(
                p(&x),
                8,
                name.as_ptr(),
                &mut agreed,
                None,
                std::ptr::null_mut(),
                &mut h,
            );
            assert_eq!(s, KF_ERR_NOT_INITIALIZED);
            assert_eq!(agreed, -1);
            assert_eq!(
                kf_barrier(None, std::ptr::null_mut(), &mut h),
                KF_ERR_NOT_INITIALIZED
            );
            assert_eq!(kf_test(1, std::ptr::null_mut()), KF_ERR_INVALID_ARGUMENT);
            let mut done = -1;
            assert_eq!(kf_test(1, &mut done), KF_ERR_NOT_INITIALIZED);
            assert_eq!(done, -1);
        }
        assert_eq!(h, 7, "no handle written on failure");
        assert_eq!(y, [0.0; 2]);
        assert_eq!(kf_wait(1, 0), KF_ERR_NOT_INITIALIZED);
        assert_eq!(kf_release(1), KF_ERR_NOT_INITIALIZED);
        assert_eq!(kf_group_start(), KF_ERR_NOT_INITIALIZED);
        assert_eq!(kf_set_strategy(77), KF_ERR_INVALID_ARGUMENT);
        assert_eq!(kf_set_strategy(KF_STRATEGY_RING), KF_ERR_NOT_INITIALIZED);
        assert_eq!(
            (kf_rank(), kf_size(), kf_local_rank(), kf_local_size()),
            (-1, -1, -1, -1)
        );
        assert_eq!(kf_cluster_version(), u64::MAX);
    }

    #[test]
    fn the_last_error_is_per_thread() {
        let barrier = std::sync::Barrier::new(2);
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let barrier = &barrier;
                s.spawn(move || {
                    // both fail before either reads
                    let s = guard(|| Err(invalid(format!("thread {t}"))));
                    assert_eq!(s, KF_ERR_INVALID_ARGUMENT);
                    barrier.wait();
                    assert_eq!(last_error(), format!("thread {t}"));
                });
            }
        });
    }
}
