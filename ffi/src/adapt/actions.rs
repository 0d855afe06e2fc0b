//! Adaptation actions across the ABI: `kf_action` and its kinds, their
//! conversion to and from the library's `Action`, proposing one, and the
//! agreement point that decides them.

use kungfu_adaptation::Action;

use super::{strategy_code, with_adapt, write_list};
use crate::{ctx, guard, invalid, kf_status, strategy_of, Res};

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
            if !st.adapter.has_room_for(&a) {
                return Err(invalid(format!(
                    "{a:?}: {} custom kinds are proposed already for this agreement point \
                     (at most {})",
                    kungfu_adaptation::MAX_CUSTOM,
                    kungfu_adaptation::MAX_CUSTOM
                )));
            }
            st.adapter.propose(a);
            Ok(())
        })
    })
}

/// An agreement point at training step `step`: a collective (every worker
/// calls it at the same step). Gathers every worker's proposals; per kind
/// (and per custom kind) the value most workers proposed wins, a tie going
/// to the most senior proposer's (in the cluster since the earliest cluster
/// version, then the lowest rank), so every worker gets the same actions
/// and a worker that just joined cannot override the others.
/// Strategy changes are applied here (a swap at a consistency barrier);
/// the others are for the caller (resize with `kf_resize`). Writes up to
/// `cap` actions to `out` and their number (at most 8: one per kind and four
/// custom kinds) to `*n`.
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

#[cfg(test)]
mod tests {
    // No runtime needed: these also run under Miri (scripts/miri-ffi.sh).
    use super::*;
    use crate::{Fail, KF_ERR_INVALID_ARGUMENT, KF_STRATEGY_RING};

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
}
