//! Chunk and segment arithmetic, in elements.
//!
//! An op of `count` elements is cut into chunks of at most `chunk_elems`;
//! chunks are independent (they pipeline, and tree strategies rotate them
//! over graph pairs). A ring further cuts each chunk into `n` segments.
//! There is always at least one chunk, possibly empty, so that even a
//! zero-count op exchanges frames: that is what makes it a barrier, and what
//! lets ranks notice they disagree on the count.

use std::ops::Range;

/// The chunks of `0..count`, each at most `chunk_elems` (>= 1) long; one
/// empty chunk when `count == 0`.
pub fn chunks(count: usize, chunk_elems: usize) -> impl ExactSizeIterator<Item = Range<usize>> {
    let chunk_elems = chunk_elems.max(1);
    let n = count.div_ceil(chunk_elems).max(1);
    (0..n).map(move |i| {
        let start = i * chunk_elems;
        start.min(count)..(start + chunk_elems).min(count)
    })
}

/// Part `k` of `n` near-equal parts of `r` (the first `len % n` parts are
/// one longer).
pub fn segment(r: &Range<usize>, n: usize, k: usize) -> Range<usize> {
    debug_assert!(k < n);
    let len = r.end - r.start;
    let (q, rem) = (len / n, len % n);
    let start = r.start + k * q + k.min(rem);
    let l = q + usize::from(k < rem);
    start..start + l
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_exactly() {
        for count in [0usize, 1, 7, 1000, 100_003] {
            for ce in [1usize, 3, 1024, 1 << 20] {
                let cs: Vec<_> = chunks(count, ce).collect();
                assert!(!cs.is_empty());
                assert_eq!(cs[0].start, 0);
                assert_eq!(cs.last().unwrap().end, count);
                for w in cs.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                }
                assert!(cs.iter().all(|c| c.len() <= ce));
            }
        }
    }

    #[test]
    fn more_than_four_gib_of_elements() {
        // 5 * 2^30 elements: offsets beyond u32 must not wrap.
        let count = 5usize << 30;
        let cs: Vec<_> = chunks(count, 1 << 28).collect();
        assert_eq!(cs.len(), 20);
        assert_eq!(cs[19], (19usize << 28)..count);
        let s = segment(&cs[19], 3, 2);
        assert_eq!(s.end, count);
    }

    #[test]
    fn segments_partition() {
        for len in [0usize, 1, 5, 16, 17] {
            for n in 1..=7 {
                let r = 100..100 + len;
                let segs: Vec<_> = (0..n).map(|k| segment(&r, n, k)).collect();
                assert_eq!(segs[0].start, 100);
                assert_eq!(segs[n - 1].end, 100 + len);
                for w in segs.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len());
                }
            }
        }
    }
}
