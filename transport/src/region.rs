//! Memory that an op, a wire, a NIC or a peer may touch, and the shares
//! that say who may touch which bytes, until when.
//!
//! A [`Region`] is one contiguous buffer: owned (a `Vec` or `Bytes`), or
//! the caller's (the C ABI's in-place ops), with a release hook. Every
//! access goes through a *share*: [`Mem`] to read a range (a send: the
//! wire reads it, maybe later, from another thread, or a NIC reads it by
//! DMA), [`MemMut`] to write one (a posted receive: the wire, the NIC or a
//! peer's RDMA write lands into it). The rules are checked, not assumed:
//! a read share may not overlap a write share, a write share no share at
//! all; a share that breaks them is refused with [`RegionError::Overlap`].
//!
//! Each share holds the region (`Arc`), so the buffer is freed (or the
//! caller's release hook runs) only when the op *and* every wire are done
//! with it: a dropped future never frees memory that a receive may still
//! write (the rule tokio-uring and io_uring live by).
//!
//! This is the only place outside the shared-memory ring and the C ABI
//! that turns raw pointers into slices; the invariant every `unsafe` block
//! cites is the share table: a `&mut [u8]` exists only inside a [`MemMut`],
//! which no other share overlaps.

use std::any::Any;
use std::mem::ManuallyDrop;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use bytes::Bytes;

use crate::pool::{BufferPool, PooledBuf};

/// A share the rules refuse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("range {range:?} outside a region of {len} bytes")]
    OutOfBounds { range: Range<usize>, len: usize },
    #[error("range {range:?} overlaps a live {} share of {with:?}", if *.write { "write" } else { "read" })]
    Overlap {
        range: Range<usize>,
        with: Range<usize>,
        /// Whether the live share is a write share.
        write: bool,
    },
    #[error("the region is read-only (it wraps immutable bytes)")]
    ReadOnly,
}

enum Owner {
    /// A vector's buffer, taken apart (rebuilt and dropped with the region).
    Vec {
        cap: usize,
        /// Where the vector goes when the region is dropped (if anywhere).
        pool: Weak<BufferPool>,
    },
    Bytes(#[allow(dead_code)] Bytes),
    /// The caller's memory; the hook runs when the region is dropped.
    Foreign(Option<Box<dyn FnOnce() + Send>>),
}

#[derive(Clone, Debug)]
struct Entry {
    id: u64,
    range: Range<usize>,
    write: bool,
}

/// Live shares inline before the table allocates (an op lends a few ranges
/// at once; most ops none).
const INLINE: usize = 4;

#[derive(Default)]
struct Table {
    /// The live shares: up to [`INLINE`] here, the rest in `more`.
    few: [Option<Entry>; INLINE],
    more: Vec<Entry>,
    next: u64,
}

impl Table {
    fn live(&self) -> impl Iterator<Item = &Entry> {
        self.few.iter().flatten().chain(&self.more)
    }

    fn insert(&mut self, e: Entry) {
        match self.few.iter_mut().find(|s| s.is_none()) {
            Some(slot) => *slot = Some(e),
            None => self.more.push(e),
        }
    }

    fn remove(&mut self, id: u64) {
        if let Some(slot) = self
            .few
            .iter_mut()
            .find(|s| s.as_ref().is_some_and(|e| e.id == id))
        {
            *slot = None;
        } else if let Some(i) = self.more.iter().position(|e| e.id == id) {
            self.more.swap_remove(i);
        }
    }
}

/// One contiguous buffer and its share table. See the module docs.
pub struct Region {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
    table: Mutex<Table>,
    /// What wires registered for this region (a verbs MR, a fabric mr),
    /// by wire: kept as long as the region.
    regs: Mutex<Vec<(usize, Arc<dyn Any + Send + Sync>)>>,
}

// SAFETY: the region owns its buffer (or the caller promised it stays
// valid until the release hook runs); all access to the bytes goes through
// shares, whose table (behind a mutex) keeps writers exclusive.
unsafe impl Send for Region {}
// SAFETY: as above: `&Region` gives access to bytes only through shares.
unsafe impl Sync for Region {}

impl Region {
    /// A region that owns `v`.
    pub fn from_vec(v: Vec<u8>) -> Arc<Region> {
        Region::vec_in(v, Weak::new())
    }

    /// A region that owns a pooled buffer: it goes back to its pool when
    /// the region is dropped, unless taken back with
    /// [`Region::into_pooled`].
    pub fn from_pooled(b: PooledBuf) -> Arc<Region> {
        let (v, pool) = b.into_parts();
        Region::vec_in(v, pool)
    }

    fn vec_in(v: Vec<u8>, pool: Weak<BufferPool>) -> Arc<Region> {
        let mut v = ManuallyDrop::new(v);
        let (len, cap) = (v.len(), v.capacity());
        let ptr = NonNull::new(v.as_mut_ptr()).expect("a vector's pointer is not null");
        Region::new(ptr, len, Owner::Vec { cap, pool })
    }

    /// A read-only region over `b` (write shares are refused).
    pub fn from_bytes(b: Bytes) -> Arc<Region> {
        let ptr = NonNull::new(b.as_ptr().cast_mut()).unwrap_or(NonNull::dangling());
        Region::new(ptr, b.len(), Owner::Bytes(b))
    }

    /// A region over the caller's memory; `release` runs once, when the
    /// last share and the region are gone.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and neither read
    /// nor written by anyone but this region's shares, until `release`
    /// runs.
    pub unsafe fn foreign(
        ptr: NonNull<u8>,
        len: usize,
        release: Box<dyn FnOnce() + Send>,
    ) -> Arc<Region> {
        Region::new(ptr, len, Owner::Foreign(Some(release)))
    }

    fn new(ptr: NonNull<u8>, len: usize, owner: Owner) -> Arc<Region> {
        Arc::new(Region {
            ptr,
            len,
            owner,
            table: Mutex::default(),
            regs: Mutex::default(),
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn share(self: &Arc<Self>, range: Range<usize>, write: bool) -> Result<u64, RegionError> {
        if range.start > range.end || range.end > self.len {
            return Err(RegionError::OutOfBounds {
                range,
                len: self.len,
            });
        }
        if write && matches!(self.owner, Owner::Bytes(_)) {
            return Err(RegionError::ReadOnly);
        }
        let mut t = self.table();
        // Empty ranges touch no byte and overlap nothing.
        if !range.is_empty() {
            if let Some(s) = t.live().find(|s| {
                (write || s.write) && s.range.start < range.end && range.start < s.range.end
            }) {
                return Err(RegionError::Overlap {
                    range,
                    with: s.range.clone(),
                    write: s.write,
                });
            }
        }
        let id = t.next;
        t.next += 1;
        t.insert(Entry { id, range, write });
        Ok(id)
    }

    fn unshare(&self, id: u64) {
        let mut t = self.table();
        t.remove(id);
    }

    /// A read share of `range`.
    pub fn read(self: &Arc<Self>, range: Range<usize>) -> Result<Mem, RegionError> {
        let id = self.share(range.clone(), false)?;
        Ok(Mem(Share {
            region: self.clone(),
            range,
            id,
        }))
    }

    /// A write share of `range`: no other share may overlap it.
    pub fn write(self: &Arc<Self>, range: Range<usize>) -> Result<MemMut, RegionError> {
        let id = self.share(range.clone(), true)?;
        Ok(MemMut(Share {
            region: self.clone(),
            range,
            id,
        }))
    }

    /// Where the buffer starts, for registering it with a NIC (never
    /// dereferenced here: every access goes through a share).
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// How many shares are live (for tests and leak checks).
    pub fn shares(&self) -> usize {
        self.table().live().count()
    }

    /// What wire `wire` registered for this region, if anything.
    pub fn registration(&self, wire: usize) -> Option<Arc<dyn Any + Send + Sync>> {
        let regs = self.regs.lock().unwrap_or_else(|e| e.into_inner());
        regs.iter()
            .find(|(w, _)| *w == wire)
            .map(|(_, r)| r.clone())
    }

    /// Keeps wire `wire`'s registration of this region (replacing one).
    pub fn set_registration(&self, wire: usize, reg: Arc<dyn Any + Send + Sync>) {
        let mut regs = self.regs.lock().unwrap_or_else(|e| e.into_inner());
        regs.retain(|(w, _)| *w != wire);
        regs.push((wire, reg));
    }

    /// The vector back, if `region` owns one and nothing else holds it.
    pub fn into_vec(region: Arc<Region>) -> Result<Vec<u8>, Arc<Region>> {
        Region::into_pooled(region).map(|b| b.into_parts().0)
    }

    /// The pooled buffer back (see [`Region::from_pooled`]; a region made
    /// by [`Region::from_vec`] gives a buffer of no pool), if `region`
    /// owns a vector and nothing else holds it.
    pub fn into_pooled(region: Arc<Region>) -> Result<PooledBuf, Arc<Region>> {
        if !matches!(region.owner, Owner::Vec { .. }) {
            return Err(region);
        }
        let mut r = Arc::try_unwrap(region)?;
        // Leave nothing for Drop to free.
        let Owner::Vec { cap, pool } = std::mem::replace(&mut r.owner, Owner::Foreign(None)) else {
            unreachable!("checked above")
        };
        // SAFETY: ptr, len and cap are those of the vector taken apart in
        // `vec_in`, whose buffer nothing else holds (no share is left:
        // each holds the Arc that try_unwrap found unique).
        let v = unsafe { Vec::from_raw_parts(r.ptr.as_ptr(), r.len, cap) };
        Ok(PooledBuf::from_parts(v, pool))
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        match &mut self.owner {
            Owner::Vec { cap, pool } => {
                // SAFETY: as in `into_pooled`: the vector taken apart in
                // `vec_in`, rebuilt once, here.
                let v = unsafe { Vec::from_raw_parts(self.ptr.as_ptr(), self.len, *cap) };
                drop(PooledBuf::from_parts(v, std::mem::take(pool)));
            }
            Owner::Bytes(_) => {}
            Owner::Foreign(release) => {
                if let Some(f) = release.take() {
                    f()
                }
            }
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.len)
            .field("shares", &self.table().live().collect::<Vec<_>>())
            .finish()
    }
}

/// A live entry of a region's share table; removed when dropped.
struct Share {
    region: Arc<Region>,
    range: Range<usize>,
    id: u64,
}

impl Share {
    /// The shared bytes.
    ///
    /// # Safety
    /// No `&mut` to them may be live: for a read share the table excludes
    /// writers; for a write share the caller holds `&self` of it.
    unsafe fn slice(&self) -> &[u8] {
        // SAFETY: in bounds (checked at share time), the buffer lives as
        // long as `self.region`, and no mutable slice is live (the
        // caller's promise).
        unsafe {
            std::slice::from_raw_parts(
                self.region.ptr.as_ptr().add(self.range.start),
                self.range.len(),
            )
        }
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        self.region.unshare(self.id);
    }
}

/// What both kinds of share tell about themselves.
macro_rules! share_accessors {
    ($t:ident) => {
        impl $t {
            pub fn range(&self) -> Range<usize> {
                self.0.range.clone()
            }

            pub fn len(&self) -> usize {
                self.0.range.len()
            }

            pub fn is_empty(&self) -> bool {
                self.0.range.is_empty()
            }

            pub fn region(&self) -> &Arc<Region> {
                &self.0.region
            }

            pub fn as_slice(&self) -> &[u8] {
                // SAFETY: a read share: the table excludes writers; a
                // write share: `&self` excludes its `as_mut_slice`.
                unsafe { self.0.slice() }
            }
        }

        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}({:?})", stringify!($t), self.0.range)
            }
        }
    };
}

/// A read share: `range` of a region, which no write share overlaps while
/// this lives.
pub struct Mem(Share);

/// A write share: `range` of a region, which no other share overlaps
/// while this lives.
pub struct MemMut(Share);

share_accessors!(Mem);
share_accessors!(MemMut);

impl Mem {
    /// A read share of all of `b` (no copy).
    pub fn from_bytes(b: Bytes) -> Mem {
        let len = b.len();
        Region::from_bytes(b)
            .read(0..len)
            .expect("a fresh region has no shares")
    }
}

impl AsRef<[u8]> for Mem {
    /// So a read share can be a frame's payload
    /// ([`Bytes::from_owner`]): the bytes stay shared until the payload is
    /// dropped.
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Clone for Mem {
    fn clone(&self) -> Mem {
        self.0
            .region
            .read(self.0.range.clone())
            .expect("a live read share excludes writers, so another read share is allowed")
    }
}

impl MemMut {
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let s = &self.0;
        // SAFETY: in bounds (checked at share time); no other share
        // overlaps the range while this lives (the table), and `&mut self`
        // makes this the only slice of it.
        unsafe {
            std::slice::from_raw_parts_mut(s.region.ptr.as_ptr().add(s.range.start), s.range.len())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn reads_share_writes_exclude() {
        let r = Region::from_vec((0u8..16).collect());
        let a = r.read(0..8).unwrap();
        let b = r.read(4..12).unwrap();
        assert_eq!(a.as_slice(), &[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(b.as_slice()[0], 4);
        assert_eq!(
            r.write(7..9).unwrap_err(),
            RegionError::Overlap {
                range: 7..9,
                with: 0..8,
                write: false
            }
        );
        let mut w = r.write(12..16).unwrap();
        w.as_mut_slice().copy_from_slice(&[9; 4]);
        assert!(matches!(
            r.read(15..17),
            Err(RegionError::OutOfBounds { len: 16, .. })
        ));
        assert!(matches!(
            r.read(15..16),
            Err(RegionError::Overlap { write: true, .. })
        ));
        // Empty ranges touch nothing.
        let _e = r.write(12..12).unwrap();
        assert_eq!(r.shares(), 4);
        drop((a, b, w));
        assert_eq!(r.shares(), 1);
        assert_eq!(
            &Region::into_vec(r)
                .unwrap_err()
                .read(12..16)
                .unwrap()
                .as_slice(),
            &[9; 4]
        );
    }

    #[test]
    fn the_buffer_outlives_the_region_handle_while_shared() {
        let r = Region::from_vec(vec![7; 8]);
        let m = r.read(2..6).unwrap();
        let mut w = r.write(6..8).unwrap();
        drop(r);
        w.as_mut_slice().fill(1);
        assert_eq!(m.as_slice(), &[7; 4]);
        assert_eq!(w.as_slice(), &[1; 2]);
    }

    #[test]
    fn a_foreign_region_is_released_once_after_the_last_share() {
        let mut buf = vec![0u8; 8];
        let released = Arc::new(AtomicUsize::new(0));
        let hook = released.clone();
        let ptr = NonNull::new(buf.as_mut_ptr()).unwrap();
        // SAFETY: `buf` outlives the region and is not touched until the
        // hook ran (checked below).
        let r = unsafe {
            Region::foreign(
                ptr,
                8,
                Box::new(move || {
                    hook.fetch_add(1, Ordering::SeqCst);
                }),
            )
        };
        let mut w = r.write(0..4).unwrap();
        drop(r);
        w.as_mut_slice().copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(released.load(Ordering::SeqCst), 0, "a share is live");
        drop(w);
        assert_eq!(released.load(Ordering::SeqCst), 1);
        assert_eq!(buf, [1, 2, 3, 4, 0, 0, 0, 0]);
    }

    #[test]
    fn bytes_are_read_only_and_vectors_come_back() {
        let m = Mem::from_bytes(Bytes::from_static(b"hello"));
        assert_eq!(m.as_slice(), b"hello");
        assert_eq!(m.region().write(0..1).unwrap_err(), RegionError::ReadOnly);
        let c = m.clone();
        assert_eq!(m.region().shares(), 2);
        drop((m, c));
        let r = Region::from_vec(vec![1, 2, 3]);
        let w = r.write(0..3).unwrap();
        let r = Region::into_vec(r).unwrap_err();
        drop(w);
        assert_eq!(Region::into_vec(r).unwrap(), [1, 2, 3]);
    }

    #[test]
    fn disjoint_write_shares_are_written_from_many_threads() {
        let r = Region::from_vec(vec![0; 64]);
        let shares: Vec<MemMut> = (0..4)
            .map(|i| r.write(i * 16..(i + 1) * 16).unwrap())
            .collect();
        std::thread::scope(|s| {
            for (i, mut w) in shares.into_iter().enumerate() {
                s.spawn(move || w.as_mut_slice().fill(i as u8 + 1));
            }
        });
        let v = Region::into_vec(r).unwrap();
        for (i, c) in v.chunks(16).enumerate() {
            assert!(c.iter().all(|&b| b == i as u8 + 1));
        }
    }

    #[test]
    fn registrations_are_kept_per_wire() {
        let r = Region::from_vec(vec![0; 4]);
        assert!(r.registration(1).is_none());
        r.set_registration(1, Arc::new(11u32));
        r.set_registration(2, Arc::new(22u32));
        r.set_registration(1, Arc::new(12u32));
        let got = r.registration(1).unwrap();
        assert_eq!(got.downcast_ref::<u32>(), Some(&12));
        assert_eq!(r.registration(2).unwrap().downcast_ref::<u32>(), Some(&22));
    }
}
