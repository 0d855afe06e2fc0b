//! The C ABI of adaptation: propose actions and read the agreed ones,
//! read the monitors, resize an elastic job and sync its state.
//!
//! The exported items live in the submodules (cbindgen reads them in the
//! order of their `mod` lines, and the header keeps that order): actions
//! and the agreement, the op statistics, the monitors, resizing. This
//! module holds what they share: the process's adaptation state and the
//! writing of C arrays.

use std::collections::HashMap;
use std::sync::Mutex;

use kungfu_adaptation::{Adapter, NoiseScale};
use kungfu_topology::Strategy;
use kungfu_transport::any::AnyTransport;

use crate::{ctx, invalid, kf_strategy, lock, strategy_of, Res};

// The order of the modules is the order of their items in the header.
mod actions;
pub use actions::*;
mod stats;
pub use stats::*;
mod monitors;
pub use monitors::*;
mod resize;
pub use resize::*;

struct AdaptState {
    adapter: Adapter<AnyTransport>,
    noise: HashMap<String, NoiseScale>,
}

static ADAPT: Mutex<Option<AdaptState>> = Mutex::new(None);

/// Runs `f` on the adaptation state, made on first use.
fn with_adapt<R>(f: impl FnOnce(&mut AdaptState) -> Res<R>) -> Res<R> {
    let c = ctx()?;
    let session = c.session;
    let mut a = lock(&ADAPT);
    let st = a.get_or_insert_with(|| {
        let mut adapter = Adapter::new(session.clone(), Vec::new());
        adapter.set_joined(c.joined);
        AdaptState {
            adapter,
            noise: HashMap::new(),
        }
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
