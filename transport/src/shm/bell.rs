//! Door bells: futex words that a process waiting for the lanes sleeps on
//! and that whoever changes what it waits for rings.
//!
//! A bell is a counter and a count of sleepers beside it. The side that
//! changes something (publishes a contribution, releases a slot) does so
//! first, then [`ring()`]s: it bumps the counter and, only if somebody
//! sleeps on it, wakes them, so that a busy exchange makes no system call.
//! The side that waits [`arm`]s first (counts itself a sleeper), then
//! reads the counters, then looks at what it waits for once more, and
//! only then sleeps on the values it read ([`wait_any`]): a change after
//! the look either moved a counter before the sleep (the kernel refuses
//! to sleep on a changed value) or sees the sleeper and wakes it. Sleeps
//! are bounded all the same, so a peer that never rings (an older build,
//! a dead process) costs latency, never a hang.

use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::Duration;

/// Bumps `bell` and wakes its sleepers, if `sleepers` counts any. `shared`:
/// the word lies in memory other processes map.
pub fn ring(bell: &AtomicU32, sleepers: &AtomicU32, shared: bool) {
    // Both sequentially consistent, as the sleeper's count and read of the
    // bell are (`arm`, then the caller's read): one of the two sides sees
    // the other's write. The bump also releases what was published before.
    bell.fetch_add(1, Ordering::SeqCst);
    if sleepers.load(Ordering::SeqCst) != 0 {
        wake(bell, shared);
    }
}

/// Counts one more sleeper; undone by [`disarm`]. Read the bells after it
/// with `Ordering::SeqCst`.
pub fn arm(sleepers: &AtomicU32) {
    sleepers.fetch_add(1, Ordering::SeqCst);
    fence(Ordering::SeqCst);
}

pub fn disarm(sleepers: &AtomicU32) {
    sleepers.fetch_sub(1, Ordering::Release);
}

fn wake(word: &AtomicU32, shared: bool) {
    #[cfg(not(miri))]
    {
        let op = if shared {
            libc::FUTEX_WAKE
        } else {
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG
        };
        // SAFETY: `word` is a live, aligned 4-byte atomic for the call;
        // FUTEX_WAKE does not write it and takes no other pointer.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                word.as_ptr(),
                op,
                i32::MAX,
                0usize,
                0usize,
                0u32,
            );
        }
    }
    #[cfg(miri)]
    let _ = (word, shared);
}

/// One word to wait on: sleep while it still holds `value`.
pub struct Waiter<'a> {
    pub word: &'a AtomicU32,
    pub value: u32,
    /// In memory other processes map (else a private futex).
    pub shared: bool,
}

/// The kernel's `struct futex_waitv`.
#[repr(C)]
struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

const FUTEX2_SIZE_U32: u32 = 0x02;
const FUTEX2_PRIVATE: u32 = 128;
/// The most words one `futex_waitv` takes.
pub const MAX_WAITERS: usize = 128;

/// Sleeps until one of `waiters` no longer holds its value (or is woken),
/// or for `timeout` at most. Without `futex_waitv` (Linux before 5.16, or
/// more than [`MAX_WAITERS`] words) it sleeps a tenth of `timeout` instead,
/// so callers poll at that rate.
pub fn wait_any(waiters: &[Waiter<'_>], timeout: Duration) {
    if waiters.is_empty() || waiters.len() > MAX_WAITERS || !waitv(waiters, timeout) {
        std::thread::sleep(timeout / 10);
    }
}

/// `false`: nothing slept, since this kernel has no `futex_waitv` (before
/// Linux 5.16) or refuses it (a seccomp filter: `EPERM`); said once, and
/// the caller naps from then on. (64-bit only: there `libc::timespec` is
/// the kernel's `__kernel_timespec`.)
#[cfg(all(not(miri), target_pointer_width = "64"))]
fn waitv(waiters: &[Waiter<'_>], timeout: Duration) -> bool {
    use std::sync::atomic::AtomicBool;
    static MISSING: AtomicBool = AtomicBool::new(false);
    if MISSING.load(Ordering::Relaxed) {
        return false;
    }
    let v: Vec<FutexWaitv> = waiters
        .iter()
        .map(|w| FutexWaitv {
            val: u64::from(w.value),
            uaddr: w.word.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32 | if w.shared { 0 } else { FUTEX2_PRIVATE },
            reserved: 0,
        })
        .collect();
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `now` is a live timespec the call writes.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    let until = Duration::new(now.tv_sec as u64, now.tv_nsec as u32) + timeout;
    let until = libc::timespec {
        tv_sec: until.as_secs() as libc::time_t,
        tv_nsec: until.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `v` holds `v.len()` (<= MAX_WAITERS) initialised entries,
    // each naming a live, aligned 4-byte atomic (borrowed for the call);
    // the kernel only reads them. `until` is a live timespec.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex_waitv,
            v.as_ptr(),
            v.len() as libc::c_uint,
            0u32,
            &until as *const libc::timespec,
            libc::CLOCK_MONOTONIC,
        )
    };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        // woken, the value had changed, the time is up, or a signal
        let slept = [libc::EAGAIN, libc::ETIMEDOUT, libc::EINTR];
        if !e.raw_os_error().is_some_and(|c| slept.contains(&c)) {
            if !MISSING.swap(true, Ordering::Relaxed) {
                eprintln!("kungfu: futex_waitv failed ({e}); waiting threads nap instead");
            }
            return false;
        }
    }
    true
}

#[cfg(any(miri, not(target_pointer_width = "64")))]
fn waitv(_: &[Waiter<'_>], _: Duration) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;

    /// A changed value does not sleep; an unchanged one sleeps until rung,
    /// and no longer than its timeout.
    #[test]
    #[cfg_attr(miri, ignore = "futex_waitv is a system call")]
    fn a_ring_wakes_the_sleeper_and_a_timeout_ends_the_sleep() {
        let bell = Arc::new(AtomicU32::new(0));
        let sleepers = Arc::new(AtomicU32::new(0));
        // a stale value returns at once
        let t = Instant::now();
        wait_any(
            &[Waiter {
                word: &bell,
                value: 7,
                shared: false,
            }],
            Duration::from_secs(5),
        );
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
        // nobody rings: the timeout ends it
        let t = Instant::now();
        wait_any(
            &[Waiter {
                word: &bell,
                value: 0,
                shared: true,
            }],
            Duration::from_millis(30),
        );
        let slept = t.elapsed();
        assert!(slept >= Duration::from_millis(2), "{slept:?}");
        assert!(slept < Duration::from_secs(2), "{slept:?}");
        // a ring from another thread wakes a long sleep
        arm(&sleepers);
        let (b, s) = (bell.clone(), sleepers.clone());
        let ringer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            ring(&b, &s, false);
        });
        let t = Instant::now();
        let other = AtomicU32::new(3);
        wait_any(
            &[
                Waiter {
                    word: &other,
                    value: 3,
                    shared: false,
                },
                Waiter {
                    word: &bell,
                    value: 0,
                    shared: false,
                },
            ],
            Duration::from_secs(20),
        );
        disarm(&sleepers);
        ringer.join().unwrap();
        assert_eq!(bell.load(Ordering::SeqCst), 1);
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    }
}
