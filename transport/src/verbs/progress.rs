//! The progress task of a verbs wire: reads the completion queue, spinning
//! briefly after activity, then sleeping on the completion channel (armed
//! with `ibv_req_notify_cq`, polled once more after arming, since a
//! completion that came just before raised no event), so an idle job does
//! not burn a core. Every 10 ms it also withdraws the rendezvous receives
//! of ops that ended.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use super::core::Core;
use crate::Instant;

/// How often stale rendezvous receives are looked for.
const SWEEP: Duration = Duration::from_millis(10);
/// The longest sleep without an event (a safety net, and the sweep).
const NAP: Duration = Duration::from_millis(10);

/// The completion channel's fd, registered with the runtime, and the core
/// that owns it (so that the fd outlives its registration: fields drop in
/// order).
struct Waiter {
    fd: AsyncFd<Fd>,
    _core: Arc<Core>,
}

/// A file descriptor watched, never closed, here.
struct Fd(RawFd);

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Reads completions until the wire closes.
pub(super) async fn run(core: Arc<Core>) {
    let waiter = core.verbs.event_fd().and_then(|fd| {
        // SAFETY: the completion channel's fd stays open until the core's
        // verbs are dropped, which the `Waiter` prevents while its
        // `AsyncFd` lives (fields drop in order).
        let afd = unsafe { AsyncFd::register_with_interest(Fd(fd), Interest::READABLE) };
        afd.ok().map(|fd| Waiter {
            fd,
            _core: core.clone(),
        })
    });
    let mut active = Instant::now();
    let mut last_sweep = Instant::now();
    let mut errors = 0u32;
    // until the wire's shutdown aborts it: a closing wire still reads
    // the frames its peers send before their goodbyes
    loop {
        match core.progress(true) {
            Ok(n) if n > 0 => {
                active = Instant::now();
                errors = 0;
                tokio::task::yield_now().await;
                continue;
            }
            Ok(_) => errors = 0,
            Err(why) => {
                // a completion queue that keeps failing is beyond use
                errors += 1;
                if errors >= 100 {
                    for peer in core.peers() {
                        core.lose(peer, format!("verbs: {why}"), true);
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        }
        if last_sweep.elapsed() >= SWEEP {
            core.cancel_stale();
            last_sweep = Instant::now();
        }
        if active.elapsed() < core.layout.spin {
            tokio::task::yield_now().await;
            continue;
        }
        let wake = core.wake.notified();
        match &waiter {
            Some(w) if core.verbs.arm_cq().is_ok() => {
                if core.progress(true).is_ok_and(|n| n > 0) {
                    active = Instant::now();
                    continue;
                }
                tokio::select! {
                    r = w.fd.readable() => if let Ok(mut g) = r {
                        core.verbs.drain_events();
                        g.clear_ready();
                    },
                    () = wake => {}
                    () = tokio::time::sleep(NAP) => {}
                }
            }
            _ => {
                tokio::select! {
                    () = wake => {}
                    () = tokio::time::sleep(Duration::from_millis(1)) => {}
                }
            }
        }
    }
}
