//! Recycled payload buffers, so that receiving frames allocates nothing in
//! the steady state.
//!
//! A received frame's payload is handed up as [`Bytes`], which the
//! collectives keep until they have applied it. Allocating a fresh buffer
//! per frame costs an allocator round trip, and for large frames fresh
//! pages that fault in one by one. A [`FramePool`] keeps buffers by size
//! class (powers of two); the `Bytes` it hands out own their buffer and
//! give it back when the last clone is dropped.

use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;

/// Smallest size class (smaller frames share it).
const MIN_CLASS: u32 = 12; // 4 KiB
/// Largest pooled size class; larger frames are allocated as before.
const MAX_CLASS: u32 = 26; // 64 MiB
/// Idle buffers kept per class (the byte limit usually binds first).
const PER_CLASS: usize = 256;

/// Buffers of `2^class` bytes, initialised (zeroed once when made), so
/// they can be filled through a plain `&mut [u8]`.
pub struct FramePool {
    classes: Vec<Mutex<Vec<Vec<u8>>>>,
    /// Idle bytes kept at most, over all classes.
    limit: usize,
    held: Mutex<usize>,
}

impl FramePool {
    /// A pool that keeps at most `limit` idle bytes.
    pub fn new(limit: usize) -> Arc<FramePool> {
        Arc::new(FramePool {
            classes: (MIN_CLASS..=MAX_CLASS)
                .map(|_| Mutex::new(Vec::new()))
                .collect(),
            limit,
            held: Mutex::new(0),
        })
    }

    fn class(len: usize) -> Option<usize> {
        let bits = usize::BITS - len.saturating_sub(1).leading_zeros();
        let c = bits.max(MIN_CLASS);
        (c <= MAX_CLASS).then(|| (c - MIN_CLASS) as usize)
    }

    /// A buffer of at least `len` bytes (contents unspecified).
    pub fn take(self: &Arc<Self>, len: usize) -> FrameBuf {
        let Some(c) = FramePool::class(len) else {
            return FrameBuf {
                buf: vec![0; len],
                len,
                pool: Weak::new(),
            };
        };
        let reused = self.classes[c]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop();
        let buf = match reused {
            Some(b) => {
                *self.held.lock().unwrap_or_else(|e| e.into_inner()) -= b.len();
                b
            }
            None => vec![0; 1 << (c as u32 + MIN_CLASS)],
        };
        FrameBuf {
            buf,
            len,
            pool: Arc::downgrade(self),
        }
    }

    fn give(&self, buf: Vec<u8>) {
        let Some(c) =
            FramePool::class(buf.len()).filter(|&c| buf.len() == 1 << (c as u32 + MIN_CLASS))
        else {
            return;
        };
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        if *held + buf.len() > self.limit {
            return;
        }
        let mut class = self.classes[c].lock().unwrap_or_else(|e| e.into_inner());
        if class.len() < PER_CLASS {
            *held += buf.len();
            class.push(buf);
        }
    }

    /// Idle bytes held (for tests).
    pub fn idle_bytes(&self) -> usize {
        *self.held.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A pooled buffer being filled; [`FrameBuf::freeze`] makes it a payload.
pub struct FrameBuf {
    buf: Vec<u8>,
    len: usize,
    pool: Weak<FramePool>,
}

impl FrameBuf {
    /// The filled payload; the buffer goes back to its pool when the last
    /// clone of it is dropped.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

/// The `len` bytes to fill.
impl AsMut<[u8]> for FrameBuf {
    fn as_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }
}

impl AsRef<[u8]> for FrameBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for FrameBuf {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.upgrade() {
            pool.give(std::mem::take(&mut self.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_when_the_payload_is_dropped() {
        let pool = FramePool::new(1 << 30);
        let mut b = pool.take(5000);
        b.as_mut().fill(7);
        let p = b.as_ref().as_ptr();
        let bytes = b.freeze();
        assert_eq!(bytes.len(), 5000);
        assert!(bytes.iter().all(|&x| x == 7));
        let clone = bytes.clone();
        drop(bytes);
        assert_eq!(pool.idle_bytes(), 0, "a clone still holds it");
        drop(clone);
        assert_eq!(pool.idle_bytes(), 8192);
        let again = pool.take(6000);
        assert_eq!(again.as_ref().as_ptr(), p, "reused");
        assert_eq!(again.as_ref().len(), 6000);
        assert_eq!(pool.idle_bytes(), 0);
    }

    /// A payload does not keep its pool alive, stays readable, and its
    /// buffer is simply freed when the last clone goes after the pool.
    #[test]
    fn a_dropped_pool_lets_payloads_go() {
        let pool = FramePool::new(1 << 20);
        let weak = Arc::downgrade(&pool);
        let mut b = pool.take(100);
        b.as_mut().fill(9);
        let bytes = b.freeze();
        drop(pool);
        assert!(
            weak.upgrade().is_none(),
            "a live payload kept its pool alive"
        );
        assert!(bytes.iter().all(|&x| x == 9) && bytes.len() == 100);
        drop(bytes);
    }

    #[test]
    fn limits_hold() {
        let pool = FramePool::new(10_000);
        let a = pool.take(8000);
        let b = pool.take(8000);
        drop(a.freeze());
        drop(b.freeze());
        assert_eq!(pool.idle_bytes(), 8192, "the second is over the limit");
        // beyond the largest class: plain allocations
        let huge = pool.take((1 << MAX_CLASS) + 1);
        assert_eq!(huge.as_ref().len(), (1 << MAX_CLASS) + 1);
        drop(huge);
        assert_eq!(pool.idle_bytes(), 8192);
        assert_eq!(FramePool::class(0), Some(0));
        assert_eq!(FramePool::class(4096), Some(0));
        assert_eq!(FramePool::class(4097), Some(1));
    }
}
