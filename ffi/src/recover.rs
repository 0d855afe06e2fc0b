//! The C ABI of shrink and continue: `kf_recover`.

use crate::adapt::with_worker;
use crate::{guard, kf_status, Fail, KF_ERR_BOOTSTRAP, KF_ERR_MEMBERSHIP_CHANGED};

/// After an op failed with `KF_ERR_PEER_LOST` (`kf_last_error()` names the
/// lost rank and where it ran): the survivors agree on who is left and go
/// on as a smaller cluster. A collective among the survivors (each calls
/// it once it saw a loss; no other call may run meanwhile). On `KF_OK`,
/// `kf_rank()`, `kf_size()` and `kf_version()` describe the new cluster;
/// call `kf_sync_state` next, then go on. A worker that the others
/// declared lost (it was frozen, or cut off) gets
/// `KF_ERR_MEMBERSHIP_CHANGED`: the cluster went on without it, so it
/// should finalize and exit. Needs the job's config server (`kungfu-run
/// --on-failure shrink|replace`, or `-w`); without one, `KF_ERR_BOOTSTRAP`.
#[no_mangle]
pub extern "C" fn kf_recover() -> kf_status {
    guard(|| {
        with_worker(|rt, w| {
            rt.block_on(w.recover()).map(drop).map_err(|e| {
                let code = match e {
                    kungfu_runtime::BootstrapError::Excluded { .. } => KF_ERR_MEMBERSHIP_CHANGED,
                    _ => KF_ERR_BOOTSTRAP,
                };
                Fail(code, e.to_string())
            })
        })
    })
}
