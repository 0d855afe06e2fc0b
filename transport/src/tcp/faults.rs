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
//!
//! `rate_mb=R` (alone or beside `delay_ms`, comma-separated) also shapes the
//! process's egress: every frame it writes on any link takes its share of
//! `R` MB/s (10^6 bytes), as if the process sat behind one network
//! interface of that speed; the writer waits its turn after each frame.
//! This kernel has no netem, so bandwidth-bound algorithms (a broadcast's
//! root sending a tree's fan-out times the buffer, against a scatter's
//! `2 (n-1)/n`) are measured through this; loopback alone is bound by the
//! one CPU that moves every byte, not by links.
//!
//! `rate_after_ms=T` (with `rate_mb`) turns that shaping on only `T` ms
//! after the process's first TCP wire started, so that a run slows down
//! mid-way (a link degrading under interference), without a signal.
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
    /// Bytes per second of the process's egress (`rate_mb`), if shaped.
    rate: Option<f64>,
    /// When the egress is free again (the end of the last frame's turn).
    egress_free: Mutex<Option<Instant>>,
    /// The egress is shaped from then on (`rate_after_ms`; None: from the start).
    rate_from: Option<Instant>,
    /// Whether the start of the shaping was logged.
    rate_logged: AtomicBool,
    listening: Once,
}

static FAULTS: OnceLock<Option<Faults>> = OnceLock::new();

impl Faults {
    fn parse(spec: &str) -> Result<Faults, String> {
        let mut delay = Duration::from_millis(500);
        let mut rate = None;
        let mut rate_after = None;
        for kv in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match kv.split_once('=') {
                Some(("delay_ms", v)) => {
                    let ms: u64 = v.parse().map_err(|_| format!("delay_ms={v:?}"))?;
                    delay = Duration::from_millis(ms);
                }
                Some(("rate_after_ms", v)) => {
                    let ms: u64 = v.parse().map_err(|_| format!("rate_after_ms={v:?}"))?;
                    rate_after = Some(Duration::from_millis(ms));
                }
                Some(("rate_mb", v)) => match v.parse::<f64>() {
                    Ok(r) if r.is_finite() && r > 0.0 => rate = Some(r * 1e6),
                    _ => return Err(format!("rate_mb={v:?}: MB/s above 0")),
                },
                None if kv == "on" => {}
                _ => {
                    return Err(format!(
                        "unknown setting {kv:?} (expected delay_ms=MS, rate_mb=MB_PER_S, \
                         rate_after_ms=MS or on)"
                    ))
                }
            }
        }
        if rate_after.is_some() && rate.is_none() {
            return Err("rate_after_ms needs rate_mb".into());
        }
        Ok(Faults {
            delay,
            cut: AtomicBool::new(false),
            hold_until: Mutex::new(None),
            rate,
            egress_free: Mutex::new(None),
            rate_from: rate_after.map(|d| Instant::now() + d),
            rate_logged: AtomicBool::new(false),
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

    /// After a frame of `bytes` was written, the write begun at `began`:
    /// waits for the end of its turn on the shaped egress (at once if the
    /// egress is not shaped). The turn starts when the write began, or when
    /// the frame before it ended, so that the time of the write itself is
    /// not added to the line's.
    pub(super) async fn pace(&self, bytes: usize, began: Instant) {
        let Some(rate) = self.rate else { return };
        if let Some(from) = self.rate_from {
            if began < from {
                return;
            }
            if !self.rate_logged.swap(true, Ordering::AcqRel) {
                log(&format!(
                    "shaping the egress to {} MB/s from now",
                    rate / 1e6
                ));
            }
        }
        let until = {
            let mut free = self.egress_free.lock().unwrap_or_else(|e| e.into_inner());
            let start = free.filter(|&t| t > began).unwrap_or(began);
            let end = start + Duration::from_secs_f64(bytes as f64 / rate);
            *free = Some(end);
            end
        };
        tokio::time::sleep_until(until).await;
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
        assert_eq!(Faults::parse("on").unwrap().rate, None);
        assert_eq!(Faults::parse("rate_mb=2.5").unwrap().rate, Some(2.5e6));
        assert!(Faults::parse("rate_mb=0").is_err());
        assert!(Faults::parse("rate_mb=-1").is_err());
        assert!(Faults::parse("rate_mb=inf").is_err());
        let later = Faults::parse("rate_mb=5,rate_after_ms=2000").unwrap();
        assert!(later.rate_from.unwrap() > Instant::now() + Duration::from_millis(1500));
        assert!(Faults::parse("rate_mb=5").unwrap().rate_from.is_none());
        assert!(Faults::parse("rate_after_ms=20").is_err());
        assert!(Faults::parse("rate_mb=5,rate_after_ms=x").is_err());
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

    #[tokio::test]
    async fn a_shaped_egress_takes_its_time_for_every_link_together() {
        let f: &'static Faults = Box::leak(Box::new(Faults::parse("rate_mb=1").unwrap()));
        let t0 = Instant::now();
        // two writers sharing the egress: 4 x 10 KB at 1 MB/s is 40 ms
        let a = tokio::spawn(async move {
            for _ in 0..2 {
                f.pace(10_000, Instant::now()).await;
            }
        });
        for _ in 0..2 {
            f.pace(10_000, Instant::now()).await;
        }
        a.await.unwrap();
        assert!(
            t0.elapsed() >= Duration::from_millis(40),
            "{:?}",
            t0.elapsed()
        );
        let none = Faults::parse("on").unwrap();
        let t1 = Instant::now();
        none.pace(1 << 30, Instant::now()).await;
        assert!(t1.elapsed() < Duration::from_millis(40), "not shaped");
    }
}
