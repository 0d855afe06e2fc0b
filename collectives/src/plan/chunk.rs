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
        // i < n, so start <= count; `start + chunk_elems` could wrap for
        // counts near `usize::MAX`, the distance to the end cannot.
        let start = (i * chunk_elems).min(count);
        start..start + (count - start).min(chunk_elems)
    })
}

/// Part `k` of `n` near-equal parts of `r` (the first `len % n` parts are
/// one longer). Panics unless `k < n` (generators only ask for existing
/// parts; a wrong `k` would otherwise give a range outside `r`).
pub fn segment(r: &Range<usize>, n: usize, k: usize) -> Range<usize> {
    assert!(k < n, "segment {k} of {n}");
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

    mod props {
        use super::*;
        use proptest::prelude::*;
        use proptest::test_runner::RngSeed;

        fn config() -> ProptestConfig {
            ProptestConfig {
                cases: 1024,
                rng_seed: RngSeed::Fixed(0x4b46_0002),
                failure_persistence: None,
                ..ProptestConfig::default()
            }
        }

        /// (count, chunk_elems) with at most 300 chunks: small values, and
        /// values anywhere up to `usize::MAX` (where `start + chunk_elems`
        /// would wrap).
        fn cut() -> impl Strategy<Value = (usize, usize)> {
            prop_oneof![
                (0usize..3000, 1usize..100),
                (1usize..=300).prop_flat_map(|k| {
                    // k chunks: (k - 1) * ce < count <= min(k * ce, MAX)
                    let max_ce = (usize::MAX - 1) / (k - 1).max(1);
                    (1..=max_ce).prop_flat_map(move |ce| {
                        let lo = (k - 1) * ce + 1;
                        let hi = ce.saturating_mul(k);
                        (lo..=hi, Just(ce))
                    })
                }),
            ]
        }

        proptest! {
            #![proptest_config(config())]

            /// The chunks tile `0..count` exactly, in order, without overlap,
            /// all full but the last, as many as the iterator says.
            #[test]
            fn chunks_tile_exactly((count, ce) in cut()) {
                let cs: Vec<Range<usize>> = chunks(count, ce).collect();
                prop_assert_eq!(chunks(count, ce).len(), cs.len());
                prop_assert_eq!(cs.len(), count.div_ceil(ce).max(1));
                prop_assert_eq!(cs[0].start, 0);
                prop_assert_eq!(cs[cs.len() - 1].end, count);
                for w in cs.windows(2) {
                    prop_assert_eq!(w[0].end, w[1].start);
                    prop_assert_eq!(w[0].len(), ce, "only the last chunk is short");
                }
                for c in &cs {
                    prop_assert!(c.start <= c.end && c.len() <= ce);
                    prop_assert!(!c.is_empty() || count == 0);
                }
            }

            /// The `n` segments of a range tile it, the first `len % n` one
            /// longer, anywhere in the address space.
            #[test]
            fn segments_tile_exactly(
                start in prop_oneof![0usize..1000, any::<usize>()],
                len in prop_oneof![0usize..1000, any::<usize>()],
                n in 1usize..64,
            ) {
                let len = len.min(usize::MAX - start);
                let r = start..start + len;
                let segs: Vec<Range<usize>> = (0..n).map(|k| segment(&r, n, k)).collect();
                prop_assert_eq!(segs[0].start, r.start);
                prop_assert_eq!(segs[n - 1].end, r.end);
                for (k, s) in segs.iter().enumerate() {
                    prop_assert_eq!(s.len(), len / n + usize::from(k < len % n));
                }
                for w in segs.windows(2) {
                    prop_assert_eq!(w[0].end, w[1].start);
                }
            }

            /// Element ranges become byte ranges aligned to the element size
            /// and within the op's bytes, whatever the element size.
            #[test]
            fn byte_ranges_are_element_aligned(
                (count, ce) in cut(),
                esize in prop_oneof![Just(1usize), Just(2), Just(4), Just(8)],
                n in 1usize..17,
            ) {
                prop_assume!(count.checked_mul(esize).is_some());
                let total = count * esize;
                for c in chunks(count, ce).take(50) {
                    for k in 0..n {
                        let s = segment(&c, n, k);
                        let (a, b) = (s.start * esize, s.end * esize);
                        prop_assert!(a % esize == 0 && b % esize == 0 && a <= b && b <= total);
                    }
                }
            }
        }
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
