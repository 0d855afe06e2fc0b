//! What completed ops did, per peer and per strategy: the C structs and
//! the calls that read and reset them.

use super::{strategy_code, write_list};
use crate::{ctx, guard, kf_status, kf_strategy};

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
