//! Point to point (`kf_save`, `kf_request`): each worker publishes named
//! buffers in its store, and its peers fetch them without it taking part
//! (its store's server tasks answer). What pair averaging needs.
//!
//! The store is made on first use and made again over the new session
//! after a resize (empty: workers publish again).

use std::ffi::{c_char, c_void};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kungfu_collectives::p2p::{P2pError, PeerStore};
use kungfu_topology::Rank;
use kungfu_transport::any::AnyTransport;
use kungfu_transport::TransportError;

use crate::handles::{Completion, OutPtr};
use crate::request::read_input;
use crate::{
    ctx, guard, invalid, kf_callback, kf_handle, kf_status, lock, name_of, Ctx, Fail,
    KF_ERR_FINALIZED, KF_ERR_INVALID_ARGUMENT, KF_ERR_MEMBERSHIP_CHANGED, KF_ERR_MISMATCH,
    KF_ERR_PEER_LOST, KF_ERR_TIMEOUT, KF_ERR_TRANSPORT,
};

static STORE: Mutex<Option<Arc<PeerStore<AnyTransport>>>> = Mutex::new(None);

/// This worker's store over the session now.
fn store(c: &Ctx) -> Arc<PeerStore<AnyTransport>> {
    let mut s = lock(&STORE);
    match s.as_ref() {
        Some(st) if st.session().same(&c.session) => st.clone(),
        _ => {
            // its server tasks run on the library's runtime
            let _in = c.rt.enter();
            let st = Arc::new(PeerStore::new(&c.session));
            *s = Some(st.clone());
            st
        }
    }
}

pub(crate) fn fail_of(e: &P2pError) -> Fail {
    let status = match e {
        P2pError::NotSaved { .. } | P2pError::NoSuchVersion { .. } => KF_ERR_TIMEOUT,
        P2pError::InvalidArgument(_) => KF_ERR_INVALID_ARGUMENT,
        P2pError::Transport { source, .. } => match source {
            TransportError::PeerLost { .. } => KF_ERR_PEER_LOST,
            TransportError::Timeout { .. } => KF_ERR_TIMEOUT,
            TransportError::StaleEpoch { .. } => KF_ERR_MEMBERSHIP_CHANGED,
            TransportError::Closed => KF_ERR_FINALIZED,
            _ => KF_ERR_TRANSPORT,
        },
        P2pError::Protocol { .. } => KF_ERR_TRANSPORT,
        P2pError::Length { .. } => KF_ERR_MISMATCH,
        P2pError::Gone { .. } => KF_ERR_PEER_LOST,
        P2pError::Timeout(_) => KF_ERR_TIMEOUT,
    };
    Fail(status, e.to_string())
}

/// Publishes a copy of `len` bytes at `data` as this worker's latest
/// `name`, and writes its version (1 for the first) to `*version` unless
/// it is NULL. Peers fetch it with `kf_request`. A local call.
///
/// # Safety
/// `name` is a NUL-terminated string; `data` holds `len` bytes (NULL only
/// if `len` is 0); `version` is NULL or points to a `uint64_t`.
#[no_mangle]
pub unsafe extern "C" fn kf_save(
    name: *const c_char,
    data: *const c_void,
    len: usize,
    version: *mut u64,
) -> kf_status {
    guard(|| {
        let name = name_of(name)?;
        let data = read_input(data, len, "data")?;
        let c = ctx()?;
        let v = store(&c).save(&name, &data).map_err(|e| fail_of(&e))?;
        if !version.is_null() {
            // SAFETY: the caller's uint64_t.
            unsafe { version.write_unaligned(v) };
        }
        Ok(())
    })
}

/// How long to wait before asking again for a buffer the peer has not
/// published yet (doubling up to the last).
const RETRY: [Duration; 4] = [
    Duration::from_millis(1),
    Duration::from_millis(5),
    Duration::from_millis(20),
    Duration::from_millis(50),
];

/// Fetches `peer`'s latest `name` into `out`, which must hold exactly its
/// `len` bytes (another length fails with `KF_ERR_MISMATCH`), and writes
/// its version to `*version` unless NULL, before the op completes. The
/// peer does not take part. A name the peer has not published yet is
/// asked for again until it is, within the op timeout
/// (`KUNGFU_OP_TIMEOUT_MS`; then `KF_ERR_TIMEOUT`).
///
/// # Safety
/// `name` is a NUL-terminated string; `out` holds `len` bytes (NULL only
/// if `len` is 0) and, like `version` (NULL or a `uint64_t`), stays valid
/// until the op completes; `handle` is NULL or points to a `kf_handle`.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn kf_request(
    peer: i32,
    name: *const c_char,
    out: *mut c_void,
    len: usize,
    version: *mut u64,
    cb: kf_callback,
    user: *mut c_void,
    handle: *mut kf_handle,
) -> kf_status {
    guard(|| {
        let name = name_of(name)?;
        if out.is_null() && len > 0 {
            return Err(invalid("out is NULL"));
        }
        let c = ctx()?;
        let (me, n) = (c.session.rank(), c.session.size());
        let peer = u32::try_from(peer)
            .ok()
            .filter(|&p| (p as usize) < n && p != me.0)
            .ok_or_else(|| {
                invalid(format!(
                    "peer {peer}: another rank of 0..{n} (this is {me})"
                ))
            })?;
        let st = store(&c);
        let deadline = tokio::time::Instant::now() + c.session.config().op_timeout;
        let done = Completion::new(cb, user, handle);
        let (out, version) = (OutPtr(out as *mut u8), OutPtr(version as *mut u8));
        c.rt.spawn(async move {
            let mut tries = 0;
            let r = loop {
                match st.request(Rank(peer), &name).await {
                    Err(P2pError::NotSaved { .. }) if tokio::time::Instant::now() < deadline => {
                        tokio::time::sleep(RETRY[tries.min(RETRY.len() - 1)]).await;
                        tries += 1;
                    }
                    r => break r,
                }
            };
            let r = match r {
                Ok((_, bytes)) if bytes.len() != len => Err(Fail(
                    KF_ERR_MISMATCH,
                    format!(
                        "rank {peer}'s {name:?} has {} bytes; the buffer {len}",
                        bytes.len()
                    ),
                )),
                Ok((v, bytes)) => {
                    // SAFETY: the caller's buffers, valid until completion
                    // (the ABI's contract); `out` holds `len` bytes.
                    unsafe {
                        std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.get(), len);
                        if !version.get().is_null() {
                            (version.get() as *mut u64).write_unaligned(v);
                        }
                    }
                    Ok(())
                }
                Err(e) => Err(fail_of(&e)),
            };
            done.finish(r);
        });
        Ok(())
    })
}
