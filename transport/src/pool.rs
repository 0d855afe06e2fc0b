//! The buffer pool: one per process, so that the steady state allocates no
//! buffer and one budget bounds the idle memory.
//!
//! Three kinds of buffer are filled and thrown away over and over:
//! received payloads (a wire copies a frame out of a socket or a ring),
//! copies of frames that a wire sends later, and the collectives' working
//! buffers (one per op, of the op's size). Allocating each fresh costs an
//! allocator round trip, and for large buffers more than it seems: above
//! the allocator's mmap threshold (64 MiB always is) a buffer comes back as
//! new pages, and touching them page-faults once per 4 KiB, which on these
//! machines costs about as much as a memcpy of the buffer. The pool keeps
//! finished buffers and hands them to the next request that fits, so the
//! buffers of big ops are reused, not re-faulted.
//!
//! Every kind comes from the same [`BufferPool`]: an endpoint has one
//! ([`crate::Transport::pool`]), its wires fill payloads from it and the
//! collectives take their working buffers and send copies from it. The
//! runtime gives every endpoint of a process the same pool (a resize
//! connects a new endpoint), so a process has one pool and one budget.
//!
//! # Budget
//!
//! The pool never holds more idle bytes (capacities of buffers nobody
//! uses) than its budget ([`BufferPool::new`];
//! [`BufferPool::DEFAULT_BUDGET`] is 256 MiB; the runtime reads
//! `KUNGFU_BUFFER_POOL_BYTES`). A buffer given back that does not fit is
//! freed, after the pool has dropped smaller idle buffers if that makes
//! room (large ones are the expensive ones to make again). Buffers in use
//! are not idle: they are bounded where they are held (unmatched payloads
//! by the matcher's budget, send copies by an op's window, working buffers
//! by the ops in flight).
//!
//! # Sizes
//!
//! Up to 64 MiB (the default largest frame) buffers come in power-of-two
//! size classes from 4 KiB, one list per class, so a take is a pop. Above
//! that, idle buffers are searched best fit, at most 4 times larger than
//! asked for. Payloads ([`FrameBuf`]) are initialised bytes, so a wire
//! fills them through a plain `&mut [u8]`; working buffers ([`PooledBuf`])
//! are `Vec`s, cleared when taken.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytes::Bytes;

/// Smallest size class (smaller requests share it).
const MIN_CLASS: u32 = 12; // 4 KiB
/// Largest size class; above it, idle buffers are searched best fit.
const MAX_CLASS: u32 = 26; // 64 MiB
const CLASSES: usize = (MAX_CLASS - MIN_CLASS + 1) as usize;
/// Idle buffers kept per class (the budget usually binds first).
const PER_CLASS: usize = 256;
/// Above the classes, a buffer serves a request only if it is at most
/// this many times larger.
const MAX_WASTE_FACTOR: usize = 4;

/// The idle buffers of a pool and their total capacity.
struct Idle {
    /// `classes[c]`: buffers of capacity exactly `2^(MIN_CLASS + c)`.
    classes: [Vec<Vec<u8>>; CLASSES],
    /// Buffers larger than the largest class, any capacity.
    large: Vec<Vec<u8>>,
    /// The sum of the capacities above; at most the budget.
    held: usize,
}

/// Where an idle buffer of a given capacity is kept.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Home {
    Class(usize),
    Large,
}

/// Recycled buffers of every size, with a budget for idle bytes (see the
/// [module docs](self)). Shared through `Arc`; buffers hold it weakly, so
/// a buffer outlives its pool (it is then simply freed).
pub struct BufferPool {
    budget: usize,
    idle: Mutex<Idle>,
}

impl BufferPool {
    /// The budget of a pool that nobody sized: 256 MiB.
    pub const DEFAULT_BUDGET: usize = 256 << 20;

    /// A pool that keeps at most `budget` idle bytes (0: none, every take
    /// allocates).
    pub fn new(budget: usize) -> Arc<BufferPool> {
        Arc::new(BufferPool {
            budget,
            idle: Mutex::new(Idle {
                classes: std::array::from_fn(|_| Vec::new()),
                large: Vec::new(),
                held: 0,
            }),
        })
    }

    /// The most idle bytes this pool keeps.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Idle bytes held now (capacities of the buffers nobody uses).
    pub fn idle_bytes(&self) -> usize {
        self.lock().held
    }

    fn lock(&self) -> MutexGuard<'_, Idle> {
        // The lists stay consistent between statements; a panic elsewhere
        // must not take the pool down with it.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The class of requests of `len` bytes, if not above the classes.
    fn class(len: usize) -> Option<usize> {
        let bits = usize::BITS - len.saturating_sub(1).leading_zeros();
        let c = bits.max(MIN_CLASS);
        (c <= MAX_CLASS).then(|| (c - MIN_CLASS) as usize)
    }

    fn class_bytes(c: usize) -> usize {
        1 << (c as u32 + MIN_CLASS)
    }

    /// Where a buffer of capacity `cap` is kept, if anywhere.
    fn home(cap: usize) -> Option<Home> {
        if cap > Self::class_bytes(CLASSES - 1) {
            Some(Home::Large)
        } else {
            // Only exact class sizes: a class's buffers must all fit its
            // largest request.
            let c = Self::class(cap)?;
            (cap == Self::class_bytes(c)).then_some(Home::Class(c))
        }
    }

    /// The capacity a new buffer for `len` bytes gets.
    fn capacity_for(len: usize) -> usize {
        Self::class(len).map_or(len, Self::class_bytes)
    }

    /// An idle buffer with room for `len` bytes, if one fits.
    fn reuse(&self, len: usize) -> Option<Vec<u8>> {
        let mut idle = self.lock();
        let v = match Self::class(len) {
            Some(c) => idle.classes[c].pop()?,
            None => {
                let max = len.saturating_mul(MAX_WASTE_FACTOR);
                let i = (0..idle.large.len())
                    .filter(|&i| (len..=max).contains(&idle.large[i].capacity()))
                    .min_by_key(|&i| idle.large[i].capacity())?;
                idle.large.swap_remove(i)
            }
        };
        idle.held -= v.capacity();
        Some(v)
    }

    /// A payload buffer of exactly `len` bytes to fill (contents
    /// unspecified); [`FrameBuf::freeze`] makes it a payload.
    pub fn take(self: &Arc<Self>, len: usize) -> FrameBuf {
        let mut buf = self
            .reuse(len)
            .unwrap_or_else(|| vec![0; Self::capacity_for(len)]);
        if buf.len() < len {
            // A former working buffer: initialise what the payload needs.
            buf.resize(len, 0);
        }
        FrameBuf {
            buf,
            len,
            pool: Arc::downgrade(self),
        }
    }

    /// An empty working buffer with room for `len` bytes.
    pub fn take_vec(self: &Arc<Self>, len: usize) -> PooledBuf {
        let mut vec = self
            .reuse(len)
            .unwrap_or_else(|| Vec::with_capacity(Self::capacity_for(len)));
        vec.clear();
        PooledBuf {
            vec,
            pool: Arc::downgrade(self),
        }
    }

    /// A working buffer of `len` bytes whose contents are unspecified: the
    /// bytes of its last use where it had them (a buffer keeps its length
    /// in the pool), zeros past them. For an op that overwrites what it
    /// reads (a broadcast's receivers, an allgather's other blocks): no
    /// pass to zero it first.
    pub fn take_filled(self: &Arc<Self>, len: usize) -> PooledBuf {
        let mut vec = self
            .reuse(len)
            .unwrap_or_else(|| Vec::with_capacity(Self::capacity_for(len)));
        if vec.len() >= len {
            vec.truncate(len);
        } else {
            vec.resize(len, 0);
        }
        PooledBuf {
            vec,
            pool: Arc::downgrade(self),
        }
    }

    /// Keeps `buf` for reuse if it has a home and fits the budget.
    fn give(&self, buf: Vec<u8>) {
        let cap = buf.capacity();
        let Some(home) = Self::home(cap).filter(|_| cap <= self.budget) else {
            return;
        };
        // Freed after the lock is released (unmapping a large one is slow).
        let mut dropped = Vec::new();
        let mut idle = self.lock();
        if let Home::Class(c) = home {
            if idle.classes[c].len() >= PER_CLASS {
                return;
            }
        }
        if idle.held + cap > self.budget {
            // Make room by dropping smaller idle buffers, but only if that
            // suffices.
            let smaller: usize = idle.iter().map(Vec::capacity).filter(|&c| c < cap).sum();
            if idle.held - smaller + cap > self.budget {
                return;
            }
            while idle.held + cap > self.budget {
                let v = idle.pop_smallest().expect("smaller buffers remain");
                idle.held -= v.capacity();
                dropped.push(v);
            }
        }
        idle.held += cap;
        match home {
            Home::Class(c) => idle.classes[c].push(buf),
            Home::Large => idle.large.push(buf),
        }
        drop(idle);
        drop(dropped);
    }
}

impl Idle {
    fn iter(&self) -> impl Iterator<Item = &Vec<u8>> {
        self.classes.iter().flatten().chain(&self.large)
    }

    fn pop_smallest(&mut self) -> Option<Vec<u8>> {
        if let Some(class) = self.classes.iter_mut().find(|c| !c.is_empty()) {
            return class.pop();
        }
        let (i, _) = self
            .large
            .iter()
            .enumerate()
            .min_by_key(|(_, v)| v.capacity())?;
        Some(self.large.swap_remove(i))
    }
}

impl std::fmt::Debug for BufferPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufferPool")
            .field("budget", &self.budget)
            .field("idle_bytes", &self.idle_bytes())
            .finish()
    }
}

/// A pooled buffer being filled; [`FrameBuf::freeze`] makes it a payload.
pub struct FrameBuf {
    buf: Vec<u8>,
    len: usize,
    pool: Weak<BufferPool>,
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

/// A working buffer: a `Vec` that returns to its pool when dropped. Its
/// clones belong to no pool; it compares by contents.
pub struct PooledBuf {
    vec: Vec<u8>,
    pool: Weak<BufferPool>,
}

impl PooledBuf {
    /// A buffer that belongs to no pool.
    pub fn unpooled(vec: Vec<u8>) -> PooledBuf {
        PooledBuf {
            vec,
            pool: Weak::new(),
        }
    }

    /// The vector, to fill or resize (within its capacity, or it may not
    /// find its way back into the pool).
    pub fn vec_mut(&mut self) -> &mut Vec<u8> {
        &mut self.vec
    }

    /// Room without reallocating.
    pub fn capacity(&self) -> usize {
        self.vec.capacity()
    }

    /// The vector and the pool it goes back to (see
    /// [`Region::from_pooled`](crate::region::Region::from_pooled)).
    pub(crate) fn into_parts(mut self) -> (Vec<u8>, Weak<BufferPool>) {
        let pool = std::mem::take(&mut self.pool);
        (std::mem::take(&mut self.vec), pool)
    }

    pub(crate) fn from_parts(vec: Vec<u8>, pool: Weak<BufferPool>) -> PooledBuf {
        PooledBuf { vec, pool }
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
mod tests;
