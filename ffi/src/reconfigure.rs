//! The C ABI of reconfigure: a worker's handle, making the cluster exactly
//! the listed workers (`kf_reconfigure`, torch's process-group
//! reconfigure), aborting, and the job secret of a worker that no
//! launcher started.

use std::ffi::{c_char, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kungfu_runtime::ReconfigureError;
use kungfu_transport::auth::JobSecret;

use crate::adapt::with_running;
use crate::recover::{text_args, write_text};
use crate::{
    guard, invalid, kf_status, lock, ready, Fail, KF_ERR_BOOTSTRAP, KF_ERR_INVALID_ARGUMENT, PHASE,
};

/// How many times this process left its cluster on purpose (`kf_abort`,
/// `kf_reconfigure`), and why the last time: an op in flight then fails
/// because of it, and is told so.
static REVOKES: AtomicU64 = AtomicU64::new(0);
static REVOKED_BY: Mutex<String> = Mutex::new(String::new());

/// The count of revokes now (an op takes it when it starts).
pub(crate) fn revokes() -> u64 {
    REVOKES.load(Ordering::SeqCst)
}

/// Why an op that started at revoke count `at` failed, if a revoke came
/// since: the revoke's description.
pub(crate) fn revoked_since(at: u64) -> Option<String> {
    (revokes() != at).then(|| lock(&REVOKED_BY).clone())
}

/// Marks ops in flight as failing because of `why`.
fn revoke(why: String) {
    *lock(&REVOKED_BY) = why;
    REVOKES.fetch_add(1, Ordering::SeqCst);
}

/// Writes this worker's reconfigure handle: the string its peers pass to
/// `kf_reconfigure` to name it (its address, a random id of the process,
/// and a proof of the job's secret; the same for the life of the
/// process). Starts the runtime if it has not started: a worker that no
/// launcher placed starts alone, listening at a port the kernel picks on
/// `KUNGFU_SELF_HOST` (127.0.0.1 when unset). Writes at most `cap - 1`
/// bytes and a NUL, and the whole length to `*len` (call again with a
/// larger buffer when `*len >= cap`; 512 bytes always suffice).
///
/// # Safety
/// `buf` has room for `cap` bytes (it may be NULL when `cap` is 0); `len`
/// points to an int32.
#[no_mangle]
pub unsafe extern "C" fn kf_reconfigure_handle(
    buf: *mut c_char,
    cap: i32,
    len: *mut i32,
) -> kf_status {
    guard(|| {
        text_args(buf, cap, len)?;
        let text = with_running(|r| Ok(r.worker.handle().encode()))?;
        // SAFETY: the caller's buffer and int, as this function's contract
        // says.
        unsafe { write_text(&text, buf, cap, len) }
    })
}

/// Makes the cluster exactly the `n` workers whose handles
/// (`kf_reconfigure_handle`) are listed, in that order: this worker's rank
/// becomes the position of its own handle. A collective of the listed
/// workers, which pass the same `uuid` and list; bounded by `timeout_ms`
/// (0 or less: `KUNGFU_CONNECT_TIMEOUT_MS`). On `KF_OK`, `kf_rank()`,
/// `kf_size()` and every later op are the new cluster's; groups made
/// before fail with `KF_ERR_MEMBERSHIP_CHANGED`. Ops still in flight on
/// the old cluster fail with `KF_ERR_ABORTED`, naming this reconfigure.
///
/// Refused with `KF_ERR_INVALID_ARGUMENT`, nothing changed: a handle that
/// does not parse or is of another job (another `KUNGFU_JOB_SECRET`), a
/// list without this worker or naming one twice, a `uuid` this worker
/// reconfigured with before ("already used"). A member that never comes
/// or dies fails it with `KF_ERR_BOOTSTRAP` at the timeout: the worker is
/// then in no cluster (its ops fail with `KF_ERR_MEMBERSHIP_CHANGED`)
/// until a `kf_reconfigure` with a fresh uuid succeeds.
///
/// # Safety
/// `handles` points to `n` NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn kf_reconfigure(
    uuid: i64,
    handles: *const *const c_char,
    n: i32,
    timeout_ms: i64,
) -> kf_status {
    guard(|| {
        if handles.is_null() || n < 1 {
            return Err(invalid("handles is NULL, or n < 1"));
        }
        let mut list = Vec::with_capacity(n as usize);
        for i in 0..n as usize {
            // SAFETY: the caller's array has `n` entries.
            let h = unsafe { *handles.add(i) };
            if h.is_null() {
                return Err(invalid(format!("handles[{i}] is NULL")));
            }
            // SAFETY: the caller's NUL-terminated string.
            let h = unsafe { CStr::from_ptr(h) };
            let h = h
                .to_str()
                .map_err(|_| invalid(format!("handles[{i}] is not UTF-8")))?;
            list.push(h.to_string());
        }
        with_running(|r| {
            let timeout = if timeout_ms > 0 {
                Duration::from_millis(timeout_ms as u64)
            } else {
                r.worker.env().connect_timeout
            };
            let plan = r.worker.plan_reconfigure(uuid, &list).map_err(refused)?;
            revoke(format!("kf_reconfigure (uuid {uuid})"));
            match r.rt.block_on(r.worker.reconfigure_to(plan, timeout)) {
                Ok(_) => {
                    r.revoked = None;
                    Ok(())
                }
                Err(e) => {
                    let detail = crate::with_causes(&e);
                    r.revoked = Some(format!("the last kf_reconfigure failed ({detail})"));
                    Err(Fail(KF_ERR_BOOTSTRAP, detail))
                }
            }
        })
    })
}

/// A reconfigure refused before anything changed.
fn refused(e: ReconfigureError) -> Fail {
    Fail(KF_ERR_INVALID_ARGUMENT, crate::with_causes(&e))
}

/// Leaves the cluster at once: every op in flight fails with
/// `KF_ERR_ABORTED` (naming this abort) and every later one with
/// `KF_ERR_MEMBERSHIP_CHANGED`, until a `kf_reconfigure` with a fresh uuid
/// makes a cluster again. The peers see this worker lost. Does nothing
/// before the runtime started.
#[no_mangle]
pub extern "C" fn kf_abort() -> kf_status {
    guard(|| {
        let mut phase = lock(&PHASE);
        let lib = ready(&mut phase)?;
        if let Some(Ok(r)) = lib.running.as_mut() {
            revoke("kf_abort".into());
            r.revoked = Some("kf_abort was called".into());
            r.worker.abort();
        }
        Ok(())
    })
}

/// Sets the job's secret (what `KUNGFU_JOB_SECRET` sets) of a worker that
/// has not started its runtime: every link it makes proves it, and its
/// reconfigure handle too. For workers no launcher started, which share a
/// secret by their own means (the torch backend: through torch's store).
/// After the runtime started: `KF_OK` if it is the secret in use,
/// `KF_ERR_INVALID_ARGUMENT` if not. An empty secret is refused.
///
/// # Safety
/// `secret` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn kf_set_job_secret(secret: *const c_char) -> kf_status {
    guard(|| {
        if secret.is_null() {
            return Err(invalid("secret is NULL"));
        }
        // SAFETY: the caller's NUL-terminated string.
        let bytes = unsafe { CStr::from_ptr(secret) }.to_bytes();
        let s = JobSecret::new(bytes).map_err(|e| invalid(e.to_string()))?;
        let mut phase = lock(&PHASE);
        let lib = ready(&mut phase)?;
        match lib.running.as_ref() {
            None => {
                lib.env.secret = Some(s);
                Ok(())
            }
            Some(Ok(r)) if r.worker.env().secret.as_ref() == Some(&s) => Ok(()),
            Some(_) => Err(invalid(
                "the runtime already started with another job secret (or none): set it \
                 before the first call that starts the runtime",
            )),
        }
    })
}
