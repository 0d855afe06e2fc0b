//! The monitors across the ABI: the squared norm of a gradient, the
//! gradient noise scale (one named monitor per `kf_noise_scale` name)
//! and the variance of the workers' gradients.

use std::ffi::c_char;

use kungfu_adaptation::{gradient_variance, sq_norm, NoiseScale};

use super::with_adapt;
use crate::{guard, invalid, kf_status, name_of};

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

#[cfg(test)]
mod tests {
    // No runtime needed: these also run under Miri (scripts/miri-ffi.sh).
    use super::*;
    use crate::{KF_ERR_INVALID_ARGUMENT, KF_OK};

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
