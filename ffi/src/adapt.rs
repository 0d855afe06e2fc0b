//! The C ABI of adaptation: propose actions and read the agreed ones,
//! read the monitors, resize an elastic job and sync its state.

use std::collections::HashMap;
use std::ffi::{c_char, c_void};
use std::sync::Mutex;

use kungfu_adaptation::{gradient_variance, sq_norm, Action, Adapter, NoiseScale};
use kungfu_runtime::Resized;
use kungfu_topology::Strategy;
use kungfu_transport::any::AnyTransport;

use crate::{
    ctx, guard, invalid, kf_status, kf_strategy, lock, name_of, ready, strategy_of, Fail, Lib, Res,
    Running, KF_ERR_BOOTSTRAP, KF_ERR_INVALID_ARGUMENT, PHASE,
};

/// The kind of an adaptation action.
pub type kf_action_kind = i32;
/// `value` is a `kf_strategy`.
pub const KF_ACTION_SET_STRATEGY: kf_action_kind = 1;
/// `value` is the new number of workers.
pub const KF_ACTION_RESIZE: kf_action_kind = 2;
/// `value` is the new global batch size.
pub const KF_ACTION_SET_BATCH_SIZE: kf_action_kind = 3;
/// The application's own: `custom_kind` (0..65535) and `value`.
pub const KF_ACTION_CUSTOM: kf_action_kind = 4;
/// `value` is a `kf_transport`; the application applies it with
/// `kf_set_transport` (every rank, right after the agreement).
pub const KF_ACTION_SET_TRANSPORT: kf_action_kind = 5;

/// An action proposed by a worker or agreed by all.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kf_action {
    pub kind: kf_action_kind,
    pub custom_kind: u32,
    pub value: u64,
}

/// What completed ops received from one peer (see `kf_get_peer_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kf_peer_stats {
    pub ops: u64,
    pub frames: u64,
    pub bytes: u64,
    /// Bytes per second until each op's last frame from the peer.
    pub rate: f64,
    /// Mean seconds from an op's start to the peer's last frame (0 without
    /// ops).
    pub mean_latency: f64,
}

/// What completed ops did on one strategy (see `kf_get_strategy_stats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kf_strategy_stats {
    pub strategy: kf_strategy,
    pub ops: u64,
    pub bytes: u64,
    /// Seconds from start to completion, summed.
    pub busy: f64,
    /// Bytes per second of busy time.
    pub rate: f64,
}

struct AdaptState {
    adapter: Adapter<AnyTransport>,
    noise: HashMap<String, NoiseScale>,
}

static ADAPT: Mutex<Option<AdaptState>> = Mutex::new(None);

/// Runs `f` on the adaptation state, made on first use.
fn with_adapt<R>(f: impl FnOnce(&mut AdaptState) -> Res<R>) -> Res<R> {
    let session = ctx()?.session;
    let mut a = lock(&ADAPT);
    let st = a.get_or_insert_with(|| AdaptState {
        adapter: Adapter::new(session.clone(), Vec::new()),
        noise: HashMap::new(),
    });
    if !st.adapter.session().same(&session) {
        // a resize gave the worker a new session
        st.adapter.set_session(session);
    }
    f(st)
}

fn strategy_code(s: Strategy) -> kf_strategy {
    (0..=8)
        .find(|&c| strategy_of(c).ok() == Some(s))
        .unwrap_or(0)
}

fn action_of(a: &kf_action) -> Res<Action> {
    let too_big = || invalid(format!("action value {} out of range", a.value));
    Ok(match a.kind {
        KF_ACTION_SET_STRATEGY => {
            Action::SetStrategy(strategy_of(i32::try_from(a.value).map_err(|_| too_big())?)?)
        }
        KF_ACTION_RESIZE => Action::Resize(u32::try_from(a.value).map_err(|_| too_big())?),
        KF_ACTION_SET_BATCH_SIZE => {
            Action::SetBatchSize(u32::try_from(a.value).map_err(|_| too_big())?)
        }
        KF_ACTION_SET_TRANSPORT => Action::SetTransport(crate::transport_of(
            i32::try_from(a.value).map_err(|_| too_big())?,
        )?),
        KF_ACTION_CUSTOM => Action::Custom {
            kind: u16::try_from(a.custom_kind)
                .map_err(|_| invalid(format!("custom kind {} > 65535", a.custom_kind)))?,
            value: a.value,
        },
        k => return Err(invalid(format!("unknown kf_action_kind {k}"))),
    })
}

fn c_action(a: &Action) -> kf_action {
    match *a {
        Action::SetStrategy(s) => kf_action {
            kind: KF_ACTION_SET_STRATEGY,
            custom_kind: 0,
            value: strategy_code(s) as u64,
        },
        Action::Resize(n) => kf_action {
            kind: KF_ACTION_RESIZE,
            custom_kind: 0,
            value: u64::from(n),
        },
        Action::SetBatchSize(b) => kf_action {
            kind: KF_ACTION_SET_BATCH_SIZE,
            custom_kind: 0,
            value: u64::from(b),
        },
        Action::SetTransport(t) => kf_action {
            kind: KF_ACTION_SET_TRANSPORT,
            custom_kind: 0,
            value: crate::transport_code(t) as u64,
        },
        Action::Custom { kind, value } => kf_action {
            kind: KF_ACTION_CUSTOM,
            custom_kind: u32::from(kind),
            value,
        },
    }
}

/// Writes `items` to `out[0..cap]` and their number to `*n`.
fn write_list<T: Copy>(items: &[T], out: *mut T, cap: i32, n: *mut i32) -> Res<()> {
    if n.is_null() || (out.is_null() && cap > 0) || cap < 0 {
        return Err(invalid(
            "n is NULL, or out is NULL with cap > 0, or cap < 0",
        ));
    }
    for (i, x) in items.iter().take(cap as usize).enumerate() {
        // SAFETY: the caller's array has room for `cap` items, and i < cap.
        unsafe { out.add(i).write_unaligned(*x) };
    }
    // SAFETY: the caller's int.
    unsafe { n.write_unaligned(items.len() as i32) };
    Ok(())
}

/// Proposes an action for the next `kf_agree`. Proposals are local; the
/// agreement decides.
///
/// # Safety
/// `action` points to a `kf_action`.
#[no_mangle]
pub unsafe extern "C" fn kf_propose(action: *const kf_action) -> kf_status {
    guard(|| {
        if action.is_null() {
            return Err(invalid("action is NULL"));
        }
        // SAFETY: the caller's struct.
        let a = action_of(&unsafe { action.read_unaligned() })?;
        with_adapt(|st| {
            st.adapter.propose(a);
            Ok(())
        })
    })
}

/// An agreement point at training step `step`: a collective (every worker
/// calls it at the same step). Gathers every worker's proposals; per kind
/// the lowest-ranked proposer wins, so every worker gets the same actions.
/// Strategy changes are applied here (a swap at a consistency barrier);
/// the others are for the caller (resize with `kf_resize`). Writes up to
/// `cap` actions to `out` and their number (at most 4) to `*n`.
///
/// # Safety
/// `out` has room for `cap` actions; `n` points to an int32.
#[no_mangle]
pub unsafe extern "C" fn kf_agree(
    step: u64,
    out: *mut kf_action,
    cap: i32,
    n: *mut i32,
) -> kf_status {
    guard(|| {
        // bad pointers fail before the collective, on every rank alike
        write_list::<kf_action>(&[], out, cap, n)?;
        let rt = ctx()?.rt;
        let agreed = with_adapt(|st| {
            st.adapter.progress.step = step;
            rt.block_on(st.adapter.agree())
                .map_err(|e| crate::fail_of(&e))
        })?;
        let c: Vec<kf_action> = agreed.iter().map(c_action).collect();
        write_list(&c, out, cap, n)
    })
}

/// Per-peer statistics of the ops completed so far, indexed by rank (this
/// worker's own entry is zero): a slow link shows as a low rate, a
/// straggler as a long mean latency. Writes up to `cap` entries and the
/// cluster size to `*n`.
///
/// # Safety
/// `out` has room for `cap` entries; `n` points to an int32.
#[no_mangle]
pub unsafe extern "C" fn kf_get_peer_stats(
    out: *mut kf_peer_stats,
    cap: i32,
    n: *mut i32,
) -> kf_status {
    guard(|| {
        let ps: Vec<kf_peer_stats> = ctx()?
            .session
            .peer_stats()
            .iter()
            .map(|p| kf_peer_stats {
                ops: p.ops,
                frames: p.frames,
                bytes: p.bytes,
                rate: p.rate(),
                mean_latency: p.mean_latency().map_or(0.0, |d| d.as_secs_f64()),
            })
            .collect();
        write_list(&ps, out, cap, n)
    })
}

/// The ops completed so far by the strategy they ran on (`AUTO`
/// resolved): the rate of each strategy. Writes up to `cap` entries and
/// their number to `*n`.
///
/// # Safety
/// `out` has room for `cap` entries; `n` points to an int32.
#[no_mangle]
pub unsafe extern "C" fn kf_get_strategy_stats(
    out: *mut kf_strategy_stats,
    cap: i32,
    n: *mut i32,
) -> kf_status {
    guard(|| {
        let st: Vec<kf_strategy_stats> = ctx()?
            .session
            .op_stats()
            .iter()
            .map(|(s, o)| kf_strategy_stats {
                strategy: strategy_code(*s),
                ops: o.ops,
                bytes: o.bytes,
                busy: o.busy.as_secs_f64(),
                rate: o.rate(),
            })
            .collect();
        write_list(&st, out, cap, n)
    })
}

/// Forgets the per-strategy and per-peer statistics (a new window).
#[no_mangle]
pub extern "C" fn kf_reset_stats() -> kf_status {
    guard(|| {
        ctx()?.session.reset_op_stats();
        Ok(())
    })
}

/// The squared L2 norm of `count` floats, in `*out`.
///
/// # Safety
/// `x` points to `count` floats; `out` to a double.
#[no_mangle]
pub unsafe extern "C" fn kf_sq_norm(x: *const f32, count: u64, out: *mut f64) -> kf_status {
    guard(|| {
        if out.is_null() || (x.is_null() && count > 0) {
            return Err(invalid("x or out is NULL"));
        }
        let count = usize::try_from(count).map_err(|_| invalid("count too large"))?;
        let v = if count == 0 {
            0.0
        } else if x.align_offset(std::mem::align_of::<f32>()) == 0 {
            // SAFETY: the caller's `count` floats, aligned.
            sq_norm(unsafe { std::slice::from_raw_parts(x, count) })
        } else {
            // SAFETY: the caller's `count * 4` bytes.
            let b = unsafe { std::slice::from_raw_parts(x.cast::<u8>(), count * 4) };
            kungfu_adaptation::sq_norm_bytes(b)
        };
        // SAFETY: the caller's double.
        unsafe { out.write_unaligned(v) };
        Ok(())
    })
}

/// Feeds the gradient noise scale monitor `name` (made on first use with
/// EMA weight `alpha`) one step: `small_sq`, the squared norm of a worker's
/// gradient over `b_small` examples (best averaged over the workers), and
/// `big_sq`, that of the allreduced gradient over `b_big > b_small`.
/// Writes the smoothed `B_simple` to `*b_simple` (NaN while there is no
/// estimate).
///
/// # Safety
/// `name` is a NUL-terminated string; `b_simple` points to a double.
#[no_mangle]
pub unsafe extern "C" fn kf_noise_scale(
    name: *const c_char,
    alpha: f64,
    small_sq: f64,
    big_sq: f64,
    b_small: f64,
    b_big: f64,
    b_simple: *mut f64,
) -> kf_status {
    guard(|| {
        let name = name_of(name)?;
        if b_simple.is_null() {
            return Err(invalid("b_simple is NULL"));
        }
        if !(alpha > 0.0 && alpha <= 1.0) {
            return Err(invalid(format!("alpha {alpha} outside (0, 1]")));
        }
        if !(b_small > 0.0 && b_big > b_small) {
            return Err(invalid(format!(
                "batch sizes {b_small} and {b_big}: need 0 < b_small < b_big"
            )));
        }
        let est = with_adapt(|st| {
            Ok(st
                .noise
                .entry(name)
                .or_insert_with(|| NoiseScale::new(alpha))
                .update(small_sq, big_sq, b_small, b_big))
        })?;
        let v = est.and_then(|e| e.b_simple).unwrap_or(f64::NAN);
        // SAFETY: the caller's double.
        unsafe { b_simple.write_unaligned(v) };
        Ok(())
    })
}

/// The variance of the workers' gradients around their mean, from the
/// mean of their squared norms and the squared norm of the mean gradient.
#[no_mangle]
pub extern "C" fn kf_gradient_variance(mean_local_sq: f64, mean_grad_sq: f64) -> f64 {
    gradient_variance(mean_local_sq, mean_grad_sq)
}

/// Runs `f` on the started worker, with the library locked (no other call
/// proceeds meanwhile), then refreshes what the getters report.
pub(crate) fn with_worker<R>(
    f: impl FnOnce(&tokio::runtime::Runtime, &mut kungfu_runtime::Worker) -> Res<R>,
) -> Res<R> {
    ctx()?;
    let mut phase = lock(&PHASE);
    let lib: &mut Lib = ready(&mut phase)?;
    let Some(Ok(Running { rt, worker, .. })) = lib.running.as_mut() else {
        return Err(Fail(KF_ERR_BOOTSTRAP, "the worker is not running".into()));
    };
    let r = f(rt, worker);
    lib.env = worker.env().clone();
    r
}

/// A failed resize or state sync: a failed op of it keeps its own status
/// (`KF_ERR_PEER_LOST` when a peer was lost, so that the caller can
/// `kf_recover`); anything else is `KF_ERR_BOOTSTRAP`.
fn elastic(e: kungfu_runtime::BootstrapError) -> Fail {
    match e {
        kungfu_runtime::BootstrapError::Op(e) => crate::fail_of(&e),
        e => Fail(KF_ERR_BOOTSTRAP, crate::with_causes(&e)),
    }
}

fn write_resized(r: Resized, changed: *mut i32, detached: *mut i32) {
    if !changed.is_null() {
        // SAFETY: the caller's int32.
        unsafe { changed.write_unaligned(i32::from(r.changed)) };
    }
    if !detached.is_null() {
        // SAFETY: the caller's int32.
        unsafe { detached.write_unaligned(i32::from(r.detached)) };
    }
}

/// Asks the config server (`kungfu-run -w`) for a cluster of `size`
/// workers; every worker switches at its next `kf_resize_from_config`.
#[no_mangle]
pub extern "C" fn kf_propose_new_size(size: i32) -> kf_status {
    guard(|| {
        let size = usize::try_from(size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("size {size}")))?;
        with_worker(|rt, w| {
            rt.block_on(w.propose_new_size(size))
                .map(drop)
                .map_err(elastic)
        })
    })
}

/// Resizes an elastic job to `size` workers: a collective (every worker
/// calls it at the same step with the same size). `*changed` is 1 if the
/// cluster changed (then call `kf_sync_state`); `*detached` is 1 if this
/// worker is no longer part of it (it should finalize and exit). Rank,
/// size and later ops follow the new cluster. No other call may run
/// meanwhile. Either pointer may be NULL.
///
/// # Safety
/// `changed` and `detached` are NULL or point to int32s.
#[no_mangle]
pub unsafe extern "C" fn kf_resize(size: i32, changed: *mut i32, detached: *mut i32) -> kf_status {
    guard(|| {
        let size = usize::try_from(size)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| invalid(format!("size {size}")))?;
        let r = with_worker(|rt, w| rt.block_on(w.resize(size)).map_err(elastic))?;
        write_resized(r, changed, detached);
        Ok(())
    })
}

/// Like `kf_resize`, to whatever cluster the config server holds now.
///
/// # Safety
/// `changed` and `detached` are NULL or point to int32s.
#[no_mangle]
pub unsafe extern "C" fn kf_resize_from_config(changed: *mut i32, detached: *mut i32) -> kf_status {
    guard(|| {
        let r = with_worker(|rt, w| rt.block_on(w.resize_from_config()).map_err(elastic))?;
        write_resized(r, changed, detached);
        Ok(())
    })
}

/// The cluster version (0 at start, +1 per resize), or -1 before `kf_init`.
#[no_mangle]
pub extern "C" fn kf_version() -> i64 {
    crate::getter(|l| Some(i64::from(l.env.cluster_version)))
}

/// Brings every worker to the same state: the step `*step` and `n` named
/// byte buffers are broadcast from the lowest-ranked worker that has state
/// (workers that joined a running job have none); `*step` is overwritten.
/// A collective: call it at start and after every resize that changed the
/// cluster, with the same names and sizes everywhere.
///
/// # Safety
/// `step` points to a uint64; `names`, `bufs` and `bytes` to `n` entries;
/// each `bufs[i]` to `bytes[i]` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn kf_sync_state(
    step: *mut u64,
    names: *const *const c_char,
    bufs: *const *mut c_void,
    bytes: *const u64,
    n: i32,
) -> kf_status {
    guard(|| {
        if step.is_null()
            || n < 0
            || (n > 0 && (names.is_null() || bufs.is_null() || bytes.is_null()))
        {
            return Err(invalid("step, names, bufs or bytes is NULL, or n < 0"));
        }
        let n = n as usize;
        let mut owned: Vec<(String, &mut [u8])> = Vec::with_capacity(n);
        for i in 0..n {
            // SAFETY: the caller's arrays have `n` entries.
            let (name, buf, len) = unsafe { (*names.add(i), *bufs.add(i), *bytes.add(i)) };
            let len = usize::try_from(len).map_err(|_| invalid("buffer too large"))?;
            if buf.is_null() && len > 0 {
                return Err(Fail(KF_ERR_INVALID_ARGUMENT, format!("bufs[{i}] is NULL")));
            }
            let slice: &mut [u8] = if len == 0 {
                &mut []
            } else {
                // SAFETY: the caller's `len` writable bytes, not aliased by
                // another entry (the caller's contract).
                unsafe { std::slice::from_raw_parts_mut(buf.cast::<u8>(), len) }
            };
            owned.push((name_of(name)?, slice));
        }
        // SAFETY: the caller's uint64.
        let s = unsafe { step.read_unaligned() };
        let got = with_worker(|rt, w| {
            let mut named: Vec<(&str, &mut [u8])> = owned
                .iter_mut()
                .map(|(k, b)| (k.as_str(), &mut **b))
                .collect();
            rt.block_on(w.sync_state(s, &mut named)).map_err(elastic)
        })?;
        // SAFETY: the caller's uint64.
        unsafe { step.write_unaligned(got) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    // No runtime needed: these also run under Miri (scripts/miri-ffi.sh).
    use super::*;
    use crate::{KF_OK, KF_STRATEGY_RING};

    #[test]
    fn lists_and_actions_cross_the_abi() {
        let items = [
            kf_action {
                kind: KF_ACTION_SET_STRATEGY,
                custom_kind: 0,
                value: KF_STRATEGY_RING as u64,
            },
            kf_action {
                kind: KF_ACTION_RESIZE,
                custom_kind: 0,
                value: 3,
            },
            kf_action {
                kind: KF_ACTION_SET_BATCH_SIZE,
                custom_kind: 0,
                value: 512,
            },
            kf_action {
                kind: KF_ACTION_CUSTOM,
                custom_kind: 65535,
                value: u64::MAX,
            },
        ];
        for a in &items {
            let back = c_action(&action_of(a).unwrap_or_else(|Fail(_, d)| panic!("{d}")));
            assert_eq!(
                (back.kind, back.custom_kind, back.value),
                (a.kind, a.custom_kind, a.value)
            );
        }
        for bad in [
            kf_action {
                kind: KF_ACTION_CUSTOM,
                custom_kind: 65536,
                value: 0,
            },
            kf_action {
                kind: KF_ACTION_RESIZE,
                custom_kind: 0,
                value: u64::MAX,
            },
            kf_action {
                kind: KF_ACTION_SET_STRATEGY,
                custom_kind: 0,
                value: 9,
            },
            kf_action {
                kind: 99,
                custom_kind: 0,
                value: 0,
            },
        ] {
            assert!(matches!(
                action_of(&bad),
                Err(Fail(KF_ERR_INVALID_ARGUMENT, _))
            ));
        }
        // into an unaligned array with room for two of four
        let mut raw = vec![0u8; 1 + 2 * std::mem::size_of::<kf_action>() + 4];
        // both pointers from one borrow of `raw`, as C would hold them
        let base = raw.as_mut_ptr();
        let size = std::mem::size_of::<kf_action>();
        // SAFETY: both offsets lie inside `raw`.
        let (out, n) = unsafe {
            (
                base.add(1) as *mut kf_action,
                base.add(1 + 2 * size) as *mut i32,
            )
        };
        assert!(write_list(&items, out, 2, n).is_ok());
        // SAFETY: inside `raw`, written just above.
        unsafe {
            assert_eq!(n.read_unaligned(), 4);
            assert_eq!(out.add(1).read_unaligned().value, 3);
        }
        assert!(write_list(&items, std::ptr::null_mut(), 1, n).is_err());
        assert!(write_list(&items, out, -1, n).is_err());
        assert!(write_list(&items, out, 2, std::ptr::null_mut()).is_err());
    }

    #[test]
    fn squared_norms_of_any_alignment() {
        let v = [1.0f32, 2.0, 3.0, 4.5];
        let mut raw = [0u8; 1 + 16];
        for (i, x) in v.iter().enumerate() {
            raw[1 + 4 * i..5 + 4 * i].copy_from_slice(&x.to_ne_bytes());
        }
        let mut out = 0.0f64;
        // SAFETY: four floats (aligned, then not), a double.
        unsafe {
            assert_eq!(kf_sq_norm(v.as_ptr(), 4, &mut out), KF_OK);
            assert_eq!(out, 34.25);
            out = 0.0;
            assert_eq!(
                kf_sq_norm(raw[1..].as_ptr() as *const f32, 4, &mut out),
                KF_OK
            );
            assert_eq!(out, 34.25);
            assert_eq!(kf_sq_norm(std::ptr::null(), 0, &mut out), KF_OK);
            assert_eq!(out, 0.0);
            assert_eq!(
                kf_sq_norm(std::ptr::null(), 1, &mut out),
                KF_ERR_INVALID_ARGUMENT
            );
        }
    }
}
