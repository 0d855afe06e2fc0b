//! A pool of working buffers, so ops in the steady state allocate none.
//!
//! Every op needs a working buffer of its own size. Allocating it fresh
//! each time costs more than it seems: a buffer above the allocator's mmap
//! threshold (64 MiB always is) comes back as new pages, and touching them
//! page-faults once per 4 KiB, which on these machines costs about as much
//! as a memcpy of the buffer. The pool keeps the buffers of finished ops
//! (up to a byte limit) and hands them to the next op that fits.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, Weak};

/// A buffer is reused for a request only if it is not much larger.
const MAX_WASTE_FACTOR: usize = 4;
const MIN_KEEP: usize = 64 << 10;

pub(crate) struct BufPool {
    limit: usize,
    free: Mutex<Vec<Vec<u8>>>,
}

impl BufPool {
    /// A pool that keeps at most `limit` bytes of idle buffers.
    pub(crate) fn new(limit: usize) -> Arc<BufPool> {
        Arc::new(BufPool {
            limit,
            free: Mutex::new(Vec::new()),
        })
    }

    /// An empty buffer with room for `len` bytes: the smallest idle one
    /// that fits (and is not wastefully large), else a new one.
    pub(crate) fn take(self: &Arc<Self>, len: usize) -> PooledBuf {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let fits = |v: &Vec<u8>| {
            v.capacity() >= len
                && v.capacity() <= len.saturating_mul(MAX_WASTE_FACTOR).max(MIN_KEEP)
        };
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| fits(v))
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        let vec = match best {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(len),
        };
        drop(free);
        PooledBuf {
            vec,
            pool: Arc::downgrade(self),
        }
    }

    fn give(&self, mut v: Vec<u8>) {
        if v.capacity() == 0 || v.capacity() > self.limit {
            return;
        }
        v.clear();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        let cap = v.capacity();
        let mut held: usize = free.iter().map(Vec::capacity).sum();
        // Make room by dropping smaller idle buffers (large ones are the
        // expensive ones to make again), but only if that suffices.
        let smaller: usize = free.iter().map(Vec::capacity).filter(|&c| c < cap).sum();
        if held - smaller + cap > self.limit {
            return;
        }
        while held + cap > self.limit {
            let (i, _) = free
                .iter()
                .enumerate()
                .min_by_key(|(_, b)| b.capacity())
                .expect("smaller buffers remain");
            held -= free.swap_remove(i).capacity();
        }
        free.push(v);
    }

    /// Idle bytes held (for tests).
    #[cfg(test)]
    fn idle_bytes(&self) -> usize {
        self.free.lock().unwrap().iter().map(Vec::capacity).sum()
    }
}

/// A buffer that returns to its pool when dropped.
pub(crate) struct PooledBuf {
    vec: Vec<u8>,
    pool: Weak<BufPool>,
}

impl PooledBuf {
    /// A buffer that belongs to no pool.
    pub(crate) fn unpooled(vec: Vec<u8>) -> PooledBuf {
        PooledBuf {
            vec,
            pool: Weak::new(),
        }
    }

    pub(crate) fn vec_mut(&mut self) -> &mut Vec<u8> {
        &mut self.vec
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.vec
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.vec
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.vec));
        }
    }
}

impl Clone for PooledBuf {
    /// A copy that belongs to no pool.
    fn clone(&self) -> PooledBuf {
        PooledBuf::unpooled(self.vec.clone())
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PooledBuf({} bytes)", self.vec.len())
    }
}

impl PartialEq for PooledBuf {
    fn eq(&self, other: &PooledBuf) -> bool {
        self.vec == other.vec
    }
}

impl Eq for PooledBuf {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_are_reused() {
        let pool = BufPool::new(1 << 20);
        let mut a = pool.take(1000);
        a.vec_mut().resize(1000, 7);
        let p = a.as_ptr();
        drop(a);
        assert_eq!(pool.idle_bytes(), 1000);
        let b = pool.take(900);
        assert_eq!(b.as_ptr(), p, "the idle buffer is reused");
        assert!(b.is_empty(), "reused buffers come back empty");
        // too small a request does not take a large buffer
        let big = pool.take(512 << 10);
        let bp = big.vec.capacity();
        drop(big);
        let small = pool.take(8);
        assert!(small.vec.capacity() < bp);
    }

    #[test]
    fn the_limit_holds_and_prefers_large_buffers() {
        let pool = BufPool::new(100_000);
        let bufs: Vec<PooledBuf> = [10_000, 20_000, 60_000, 50_000]
            .iter()
            .map(|&n| pool.take(n))
            .collect();
        drop(bufs);
        assert!(pool.idle_bytes() <= 100_000);
        let caps: Vec<usize> = pool
            .free
            .lock()
            .unwrap()
            .iter()
            .map(Vec::capacity)
            .collect();
        assert!(caps.contains(&60_000) && caps.contains(&20_000), "{caps:?}");
        // beyond the limit: not kept
        drop(pool.take(200_000));
        assert!(pool.idle_bytes() <= 100_000);
    }

    /// A buffer does not keep its pool alive (sessions drop their pool
    /// while results are still held), stays usable, and is simply freed
    /// when dropped after its pool.
    #[test]
    fn a_dropped_pool_lets_buffers_go() {
        let pool = BufPool::new(1 << 20);
        let weak = Arc::downgrade(&pool);
        let mut b = pool.take(10);
        b.vec_mut().extend_from_slice(b"0123456789");
        drop(pool);
        assert!(
            weak.upgrade().is_none(),
            "a live buffer kept its pool alive"
        );
        assert!(b.pool.upgrade().is_none());
        assert_eq!(&*b, b"0123456789");
        drop(b);
    }
}
