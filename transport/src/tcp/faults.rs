//! Fault injection on the TCP wire, for chaos tests (the launcher's
//! `chaos` test, `scripts/chaos.sh`). Off unless `KUNGFU_FAULTS` is set:
//! then no signal handler is installed and each writer only reads an
//! empty [`OnceLock`].
//!
//! `KUNGFU_FAULTS=delay_ms=D` (`D` 500 if not given; the value `on` takes
//! the default) makes the process act on two signals, which a driver
//! sends to the worker it picks, when it likes, as it sends SIGKILL or
//! SIGSTOP:
//! - SIGUSR1 *drops a connection*: the next link of this process that
//!   writes a frame shuts its connection down both ways instead, so both
//!   ends see it end, as when a middlebox resets it. Each end then loses
//!   the other, and the recovery must still end with one membership.
//! - SIGUSR2 *delays the network*: every link of this process holds its
//!   outgoing frames, heartbeats included, for `D` ms from then, as a
//!   stalled link would. Below the peer timeout, the job must go on
//!   without any recovery.
//!
//! Each fault that takes effect is logged on standard error (`kungfu:
//! fault injection (pid P): ...`), so a test counts what was injected
//! rather than what it asked for. The signals are heard by a task on the
//! runtime of the first TCP wire of the process; a process that drops
//! that runtime hears no more (the worker and kungfu-selftest keep one for
//! their life).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once, OnceLock};
use std::time::Duration;

use crate::Instant;

/// The environment variable that turns fault injection on.
pub const FAULTS_VAR: &str = "KUNGFU_FAULTS";

/// What this process injects (see the module docs).
pub(super) struct Faults {
    delay: Duration,
    /// A drop asked for and not yet done.
    cut: AtomicBool,
    /// Outgoing frames wait until then.
    hold_until: Mutex<Option<Instant>>,
    listening: Once,
}

static FAULTS: OnceLock<Option<Faults>> = OnceLock::new();

impl Faults {
    fn parse(spec: &str) -> Result<Faults, String> {
        let mut delay = Duration::from_millis(500);
        for kv in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match kv.split_once('=') {
                Some(("delay_ms", v)) => {
                    let ms: u64 = v.parse().map_err(|_| format!("delay_ms={v:?}"))?;
                    delay = Duration::from_millis(ms);
                }
                None if kv == "on" => {}
                _ => {
                    return Err(format!(
                        "unknown setting {kv:?} (expected delay_ms=MS or on)"
                    ))
                }
            }
        }
        Ok(Faults {
            delay,
            cut: AtomicBool::new(false),
            hold_until: Mutex::new(None),
            listening: Once::new(),
        })
    }

    /// Waits while outgoing frames are held.
    pub(super) async fn hold(&self) {
        let until = *self.hold_until.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = until {
            tokio::time::sleep_until(t).await;
        }
    }

    /// Whether this writer is the one to drop its connection (once per
    /// SIGUSR1).
    pub(super) fn take_cut(&self) -> bool {
        self.cut.swap(false, Ordering::AcqRel)
    }

    fn delay_now(&self) {
        *self.hold_until.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Instant::now() + self.delay);
        log(&format!(
            "holding every outgoing frame for {} ms",
            self.delay.as_millis()
        ));
    }

    /// Starts hearing the signals (once per process; inside a runtime).
    fn listen(&'static self) {
        self.listening.call_once(|| {
            use tokio::signal::unix::{signal, SignalKind};
            let (usr1, usr2) = (
                signal(SignalKind::user_defined1()),
                signal(SignalKind::user_defined2()),
            );
            let (Ok(mut usr1), Ok(mut usr2)) = (usr1, usr2) else {
                log("cannot hear SIGUSR1/SIGUSR2; no faults injected");
                return;
            };
            tokio::spawn(async move {
                loop {
                    tokio::select! {
                        Some(()) = usr1.recv() => self.cut.store(true, Ordering::Release),
                        Some(()) = usr2.recv() => self.delay_now(),
                        else => return,
                    }
                }
            });
        });
    }
}

/// The process's fault injection if `KUNGFU_FAULTS` asks for it, hearing
/// its signals from the first call on (which must be inside a runtime).
pub(super) fn faults() -> Option<&'static Faults> {
    let f = FAULTS
        .get_or_init(|| {
            let spec = std::env::var(FAULTS_VAR).ok()?;
            Faults::parse(&spec)
                .map_err(|e| log(&format!("{FAULTS_VAR}={spec:?}: {e}; no faults injected")))
                .ok()
        })
        .as_ref()?;
    f.listen();
    Some(f)
}

pub(super) fn log(what: &str) {
    eprintln!(
        "kungfu: fault injection (pid {}): {what}",
        std::process::id()
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings() {
        assert_eq!(
            Faults::parse("on").unwrap().delay,
            Duration::from_millis(500)
        );
        assert_eq!(
            Faults::parse("delay_ms=700").unwrap().delay,
            Duration::from_millis(700)
        );
        assert!(Faults::parse("delay_ms=x").is_err());
        assert!(Faults::parse("cut_after=3").is_err());
    }

    #[tokio::test]
    async fn a_cut_is_taken_once_and_a_delay_holds() {
        let f = Faults::parse("delay_ms=50").unwrap();
        f.cut.store(true, Ordering::Release);
        assert!(f.take_cut());
        assert!(!f.take_cut(), "one drop per signal");
        let t0 = Instant::now();
        f.hold().await;
        assert!(t0.elapsed() < Duration::from_millis(50), "nothing held yet");
        f.delay_now();
        f.hold().await;
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }
}
