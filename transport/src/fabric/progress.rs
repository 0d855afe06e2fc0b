//! Completions of a fabric wire: what each one does (a send resolves, an
//! eager frame is landed or queued and its slot posted again, a posted
//! receive is checked and landed), and the progress task that reads them.
//!
//! **Progress.** Both providers here progress manually: nothing moves
//! unless the CQ is read. A task per wire reads it, spinning briefly after
//! activity, then sleeping: on the CQ's file descriptor where the provider
//! has one (`tcp`, after `fi_trywait`), else with a pause that grows to a
//! millisecond (`shm`), so an idle job does not burn a core.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_fabric_sys::FI_ECANCELED;
use kungfu_topology::Rank;

use super::core::{lock, Core, Kind, Op};
use super::ofi::Cqe;
use crate::endpoint::RecvKey;
use crate::region::MemMut;
use crate::{Header, Instant, HEADER_LEN};

impl Core {
    /// Reads what completed and acts on it; how many completions.
    pub(super) fn progress(self: &Arc<Self>) -> Result<usize, String> {
        let mut cqes = Vec::new();
        let mut done = Vec::new();
        {
            let mut st = lock(&self.state);
            loop {
                let n = self.ofi.read_cq(&mut cqes, 64)?;
                if n == 0 || cqes.len() >= 256 {
                    break;
                }
            }
            for c in cqes.drain(..) {
                let ctx = match &c {
                    Cqe::Done { ctx, .. } | Cqe::Failed { ctx, .. } => *ctx,
                };
                if let Some(op) = st.pending.remove(&ctx) {
                    done.push((op, c));
                }
            }
        }
        let n = done.len();
        for (op, c) in done {
            self.complete(op, c);
        }
        Ok(n)
    }

    fn complete(self: &Arc<Self>, op: Op, c: Cqe) {
        match (op.kind, c) {
            (
                Kind::Send {
                    done,
                    header,
                    payload,
                    _mrs,
                },
                c,
            ) => {
                // libfabric is done with the memory: let go of it before
                // the sender hears (it may post a receive into that range
                // at once)
                drop((header, payload, _mrs));
                if let Some(d) = done {
                    let _ = d.send(match c {
                        Cqe::Done { .. } => Ok(()),
                        Cqe::Failed { why, .. } => Err(why),
                    });
                }
            }
            (Kind::Eager { slot }, Cqe::Done { len, src, .. }) => {
                self.eager_arrived(slot, len, src)
            }
            (Kind::Eager { slot }, Cqe::Failed { err, .. }) => {
                if err != FI_ECANCELED && !self.closing.load(Ordering::Acquire) {
                    let _ = self.repost(slot);
                }
            }
            (
                Kind::Posted {
                    key, header, mem, ..
                },
                Cqe::Done { len, src, .. },
            ) => {
                if self.stranger(src) {
                    // not the rank it was posted for: given back to the
                    // provider for the real frame (the stranger's bytes
                    // in it are overwritten by it)
                    if let Err(e) = self.post(key, mem) {
                        self.matcher.fail_peer(key.from, e.to_string());
                    }
                    return;
                }
                self.posted_arrived(key, &header, mem, len, src);
            }
            (Kind::Posted { key, cancelled, .. }, Cqe::Failed { err, why, .. }) => {
                if err != FI_ECANCELED && !cancelled {
                    self.matcher
                        .fail_peer(key.from, format!("receive failed: {why}"));
                }
            }
        }
    }

    /// An eager frame in slot `slot`: into a posted receive, or queued.
    fn eager_arrived(self: &Arc<Self>, slot: usize, len: usize, src: Option<u64>) {
        let (header, from) = {
            let st = lock(&self.state);
            let buf = &st.slots[slot].buf;
            let from = src.and_then(|s| u32::try_from(s).ok()).map(Rank);
            let header = Header::decode(
                buf[..HEADER_LEN].try_into().expect("header"),
                self.max_frame,
            );
            (header, from)
        };
        if self.stranger(src) {
            let _ = self.repost(slot);
            return;
        }
        let Some(from) = from else {
            let _ = self.repost(slot);
            return;
        };
        let header = match header {
            Ok(h) if len >= HEADER_LEN && h.len as usize == len - HEADER_LEN => h,
            Ok(_) => {
                self.matcher.fail_peer(
                    from,
                    "protocol violation: a frame's length differs from its header's",
                );
                let _ = self.repost(slot);
                return;
            }
            Err(e) => {
                self.matcher
                    .fail_peer(from, format!("protocol violation: {e}"));
                let _ = self.repost(slot);
                return;
            }
        };
        let plen = len - HEADER_LEN;
        let landed = {
            let st = lock(&self.state);
            let payload = &st.slots[slot].buf[HEADER_LEN..len];
            self.matcher.land_parts(from, &header, &[payload])
        };
        if landed || self.matcher.has_room(plen) {
            if !landed {
                let bytes = self.copy_out(slot, len);
                let _ = self.matcher.deliver_now(from, header, bytes);
            }
            self.received[from.idx()].fetch_add(1, Ordering::Relaxed);
            let _ = self.repost(slot);
            return;
        }
        // No room: the slot waits (unposted) until the frame fits, so the
        // provider holds the next ones (back pressure).
        let bytes = self.copy_out(slot, len);
        let core = self.clone();
        tokio::spawn(async move {
            let _ = core.matcher.deliver(from, header, bytes).await;
            core.received[from.idx()].fetch_add(1, Ordering::Relaxed);
            let _ = core.repost(slot);
        });
    }

    /// Whether a frame's source (`src`, from `FI_SOURCE`) is no rank: an
    /// address the authenticated bootstrap did not put in the address
    /// vector (`FI_ADDR_NOTAVAIL`). Such a frame is counted and dropped,
    /// and said so on standard error (the first and then every 2^k-th),
    /// never blamed on a rank.
    pub(super) fn stranger(&self, src: Option<u64>) -> bool {
        let rank = src
            .and_then(|s| usize::try_from(s).ok())
            .filter(|&s| s < self.received.len());
        if rank.is_some() {
            return false;
        }
        let n = self.strangers.fetch_add(1, Ordering::Relaxed) + 1;
        if n.is_power_of_two() {
            eprintln!(
                "kungfu: rank {}: fabric: dropped a frame from an address that is no rank's \
                 ({n} so far)",
                self.me.0
            );
        }
        true
    }

    fn copy_out(&self, slot: usize, len: usize) -> Bytes {
        let st = lock(&self.state);
        let mut b = self.pool.take(len - HEADER_LEN);
        b.as_mut()
            .copy_from_slice(&st.slots[slot].buf[HEADER_LEN..len]);
        b.freeze()
    }

    /// A frame in a receive posted for it: checked, then landed.
    fn posted_arrived(
        &self,
        key: RecvKey,
        header: &[u8; HEADER_LEN],
        mem: MemMut,
        len: usize,
        src: Option<u64>,
    ) {
        let from_ok = src.is_none_or(|s| s == u64::from(key.from.0));
        let ok = Header::decode(header, self.max_frame).ok().filter(|h| {
            from_ok
                && h.tag == key.tag
                && h.chunk == key.chunk
                && h.step == key.step
                && h.len as usize == mem.len()
                && len == HEADER_LEN + mem.len()
        });
        match ok {
            Some(h) => {
                self.received[key.from.idx()].fetch_add(1, Ordering::Relaxed);
                self.posted_landed.fetch_add(1, Ordering::Relaxed);
                self.matcher.landed(key.from, h, mem);
            }
            None => self.matcher.fail_peer(
                key.from,
                "protocol violation: a frame landed in a receive posted for another",
            ),
        }
    }
}

/// How long the progress task keeps polling a provider without a wait
/// object while transfers are in flight, after the last completion.
const BUSY_POLL: Duration = Duration::from_millis(2);

/// The progress task: reads completions until the wire closes.
pub(super) async fn run(core: Arc<Core>) {
    let fd = core.ofi.wait_fd.and_then(|fd| {
        // SAFETY: libfabric's CQ fd stays open until the CQ is closed,
        // which happens when the last `Core` goes: `Waiter` holds one,
        // dropped after its `AsyncFd` (fields drop in order).
        let afd = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(
                RawFd(fd),
                tokio::io::Interest::READABLE,
            )
        };
        afd.ok().map(|fd| Waiter {
            fd,
            _core: core.clone(),
        })
    });
    let min_pause = Duration::from_micros(20);
    let mut pause = min_pause;
    let mut active = Instant::now();
    let mut last_sweep = Instant::now();
    let mut errors = 0u32;
    loop {
        if core.closing.load(Ordering::Acquire) && !core.busy() {
            return;
        }
        match core.progress() {
            Ok(n) if n > 0 => {
                active = Instant::now();
                pause = min_pause;
                tokio::task::yield_now().await;
                continue;
            }
            Ok(_) => errors = 0,
            Err(why) => {
                // A CQ that keeps failing is beyond use; one failure may be
                // a peer's connection going (its sends fail on their own).
                errors += 1;
                if errors >= 100 {
                    for r in 0..core.received.len() {
                        core.matcher
                            .fail_peer(Rank(r as u32), format!("fabric: {why}"));
                    }
                    return;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
        }
        if last_sweep.elapsed() >= Duration::from_millis(10) {
            core.cancel_stale();
            last_sweep = Instant::now();
        }
        if active.elapsed() < core.spin {
            tokio::task::yield_now().await;
            continue;
        }
        let wake = core.wake.notified();
        match &fd {
            Some(w) if core.ofi.try_wait() => {
                tokio::select! {
                    r = w.fd.readable() => if let Ok(mut g) = r { g.clear_ready() },
                    () = wake => {}
                    () = tokio::time::sleep(Duration::from_millis(10)) => {}
                }
            }
            Some(_) => tokio::task::yield_now().await,
            // a transfer in flight on a provider without a wait object
            // (shm) moves only while someone reads the CQ: keep polling (a
            // timer cannot wait less than a millisecond) for a while after
            // the last completion; a peer slower than that is waited for
            // with the pauses below
            None if core.busy() && active.elapsed() < BUSY_POLL => tokio::task::yield_now().await,
            None => {
                // idle: a pause growing to a millisecond, so an idle job
                // does not burn a core; a receive going to sleep or a new
                // operation ends it
                tokio::select! {
                    () = wake => pause = min_pause,
                    () = tokio::time::sleep(pause) => pause = (pause * 2).min(Duration::from_millis(1)),
                }
            }
        }
    }
}

/// The CQ's fd, registered with the runtime, and the core whose CQ owns it.
struct Waiter {
    fd: tokio::io::unix::AsyncFd<RawFd>,
    _core: Arc<Core>,
}

/// libfabric's wait fd, watched (never closed) by the progress task.
struct RawFd(i32);

impl std::os::fd::AsRawFd for RawFd {
    fn as_raw_fd(&self) -> i32 {
        self.0
    }
}
