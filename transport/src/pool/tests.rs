use proptest::prelude::*;

use super::*;

/// The capacities of the idle buffers, checked against their homes.
fn idle_capacities(pool: &BufferPool) -> Vec<usize> {
    let idle = pool.lock();
    for (c, class) in idle.classes.iter().enumerate() {
        assert!(class.len() <= PER_CLASS);
        for v in class {
            assert_eq!(v.capacity(), BufferPool::class_bytes(c), "in class {c}");
        }
    }
    for v in &idle.large {
        assert!(v.capacity() > 1 << MAX_CLASS);
    }
    let caps: Vec<usize> = idle.iter().map(Vec::capacity).collect();
    assert_eq!(caps.iter().sum::<usize>(), idle.held, "held is the sum");
    caps
}

#[test]
fn size_classes() {
    assert_eq!(BufferPool::class(0), Some(0));
    assert_eq!(BufferPool::class(4096), Some(0));
    assert_eq!(BufferPool::class(4097), Some(1));
    assert_eq!(BufferPool::class(1 << MAX_CLASS), Some(CLASSES - 1));
    assert_eq!(BufferPool::class((1 << MAX_CLASS) + 1), None);
    assert_eq!(BufferPool::home(8192), Some(Home::Class(1)));
    assert_eq!(BufferPool::home(8000), None, "not a class size");
    assert_eq!(BufferPool::home(100), None);
    assert_eq!(BufferPool::home((1 << MAX_CLASS) + 1), Some(Home::Large));
}

#[test]
fn payload_buffers_come_back_when_the_last_clone_drops() {
    let pool = BufferPool::new(1 << 30);
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

#[test]
fn working_buffers_come_back_empty_and_are_reused() {
    let pool = BufferPool::new(1 << 20);
    let mut a = pool.take_vec(1000);
    a.vec_mut().resize(1000, 7);
    let p = a.as_ptr();
    drop(a);
    assert_eq!(pool.idle_bytes(), 4096);
    let b = pool.take_vec(900);
    assert_eq!(b.as_ptr(), p, "the idle buffer is reused");
    assert!(b.is_empty(), "reused buffers come back empty");
    // a small request does not take a larger class's buffer
    let big = pool.take_vec(512 << 10);
    let bp = big.capacity();
    drop(big);
    let small = pool.take_vec(8);
    assert!(small.capacity() < bp);
    assert_eq!(pool.idle_bytes(), bp);
}

/// A filled buffer keeps what its last use left and zeroes only past it.
#[test]
fn filled_buffers_skip_the_zeroing_they_can() {
    let pool = BufferPool::new(1 << 20);
    let fresh = pool.take_filled(3000);
    assert_eq!(&fresh[..], &[0u8; 3000][..], "a new buffer is zeros");
    drop(fresh);
    let mut a = pool.take_vec(1000);
    a.vec_mut().resize(1000, 7);
    let p = a.as_ptr();
    drop(a);
    // shorter than its last use: a prefix of it, no pass over the bytes
    let b = pool.take_filled(600);
    assert_eq!((b.as_ptr(), b.len()), (p, 600));
    assert!(b.iter().all(|&x| x == 7));
    drop(b);
    // longer: its old bytes, then zeros
    let c = pool.take_filled(4000);
    assert_eq!((c.as_ptr(), c.len()), (p, 4000));
    assert!(c[..600].iter().all(|&x| x == 7));
    assert!(c[600..].iter().all(|&x| x == 0));
}

/// Payloads and working buffers are one pool: either serves the other.
#[test]
fn one_kind_of_buffer_serves_the_other() {
    let pool = BufferPool::new(1 << 20);
    let mut w = pool.take_vec(5000);
    w.vec_mut().extend_from_slice(b"abc");
    let p = w.as_ptr();
    drop(w);
    let mut f = pool.take(6000);
    assert_eq!(f.as_ref().as_ptr(), p, "a working buffer becomes a payload");
    assert_eq!(
        f.as_mut().len(),
        6000,
        "initialised to the payload's length"
    );
    f.as_mut().fill(1);
    drop(f.freeze());
    let w = pool.take_vec(7000);
    assert_eq!(w.as_ptr(), p, "and back");
    assert!(w.is_empty());
}

#[test]
fn the_budget_holds_and_prefers_large_buffers() {
    let pool = BufferPool::new(100_000);
    let bufs: Vec<PooledBuf> = [10_000, 20_000, 60_000, 50_000]
        .iter()
        .map(|&n| pool.take_vec(n))
        .collect();
    drop(bufs);
    // 16 KiB + 32 KiB, then 64 KiB pushes out the 16 KiB one; the second
    // 64 KiB one cannot fit without dropping the first.
    let mut caps = idle_capacities(&pool);
    caps.sort_unstable();
    assert_eq!(caps, [32768, 65536]);
    // larger than the whole budget: not kept, nothing dropped for it
    drop(pool.take_vec(200_000));
    assert_eq!(pool.idle_bytes(), 32768 + 65536);
    let none = BufferPool::new(0);
    drop(none.take(10));
    drop(none.take_vec(10));
    assert_eq!(none.idle_bytes(), 0, "a zero budget keeps nothing");
}

/// Above the classes, buffers are found best fit, so the buffers of big
/// ops are reused rather than faulted in again.
#[test]
fn large_buffers_are_reused_best_fit() {
    let mib = 1 << 20;
    let pool = BufferPool::new(1 << 30);
    // capacity only: these pages are never touched
    let (a, b) = (pool.take_vec(65 * mib), pool.take_vec(300 * mib));
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    assert_eq!((a.capacity(), b.capacity()), (65 * mib, 300 * mib));
    drop((a, b));
    assert_eq!(pool.idle_bytes(), 365 * mib);
    let c = pool.take_vec(64 * mib + 1);
    assert_eq!(c.as_ptr(), pa, "the smallest that fits");
    let d = pool.take_vec(70 * mib);
    assert_ne!(d.as_ptr(), pb, "not more than 4 times larger");
    let e = pool.take_vec(100 * mib);
    assert_eq!(e.as_ptr(), pb);
    drop((c, d, e));
    let huge = pool.take(65 * mib);
    assert_eq!(
        huge.as_ref().len(),
        65 * mib,
        "payloads above the classes too"
    );
}

/// A buffer does not keep its pool alive (an endpoint drops its pool while
/// results are still held), stays usable, and is simply freed when dropped
/// after its pool.
#[test]
fn a_dropped_pool_lets_buffers_go() {
    let pool = BufferPool::new(1 << 20);
    let weak = Arc::downgrade(&pool);
    let mut f = pool.take(100);
    f.as_mut().fill(9);
    let bytes = f.freeze();
    let mut w = pool.take_vec(10);
    w.vec_mut().extend_from_slice(b"0123456789");
    drop(pool);
    assert!(
        weak.upgrade().is_none(),
        "a live buffer kept its pool alive"
    );
    assert!(bytes.iter().all(|&x| x == 9) && bytes.len() == 100);
    assert_eq!(&*w, b"0123456789");
    assert_eq!(w.clone(), w, "clones compare by contents");
    drop((bytes, w));
}

#[derive(Clone, Debug)]
enum Step {
    /// Take a payload buffer of this length, and keep it.
    Payload(usize),
    /// Take a working buffer with room for this length, fill it, keep it.
    Work(usize),
    /// Drop the kept buffer at this index (modulo how many are kept).
    Drop(usize),
}

fn step() -> impl Strategy<Value = Step> {
    let mib = 1usize << 20;
    let small = prop_oneof![0usize..5000, 4090usize..4100, 5000usize..300_000];
    // Working buffers up to 100 MiB: their pages are not touched beyond
    // what is filled, so large ones cost address space only.
    let work = prop_oneof![
        3 => small.clone(),
        1 => (0usize..4).prop_map(move |k| (16 << k) * mib + 1),
        1 => 64 * mib..100 * mib,
    ];
    prop_oneof![
        2 => small.prop_map(Step::Payload),
        2 => work.prop_map(Step::Work),
        3 => any::<usize>().prop_map(Step::Drop),
    ]
}

proptest! {
    /// However buffers of mixed sizes and kinds are taken and dropped, the
    /// pool never holds more idle bytes than its budget, and its count of
    /// them is right.
    #[test]
    fn never_more_idle_bytes_than_the_budget(
        budget in prop_oneof![
            Just(0usize), Just(5000), Just(64 << 10), Just(1 << 20), Just(40 << 20), Just(300 << 20)
        ],
        steps in proptest::collection::vec(step(), 1..80),
    ) {
        enum Kept { Payload(Bytes), Work(PooledBuf) }
        let pool = BufferPool::new(budget);
        let mut kept: Vec<Kept> = Vec::new();
        for s in steps {
            match s {
                Step::Payload(len) => {
                    let mut f = pool.take(len);
                    prop_assert_eq!(f.as_mut().len(), len);
                    f.as_mut().fill(0xa5);
                    kept.push(Kept::Payload(f.freeze()));
                }
                Step::Work(len) => {
                    let mut w = pool.take_vec(len);
                    prop_assert!(w.is_empty() && w.capacity() >= len);
                    let fill = len.min(1 << 16);
                    w.vec_mut().resize(fill, 1);
                    kept.push(Kept::Work(w));
                }
                Step::Drop(i) if !kept.is_empty() => {
                    let i = i % kept.len();
                    match kept.swap_remove(i) {
                        Kept::Payload(b) => prop_assert!(b.iter().all(|&x| x == 0xa5)),
                        Kept::Work(w) => prop_assert!(w.iter().all(|&x| x == 1)),
                    }
                }
                Step::Drop(_) => {}
            }
            idle_capacities(&pool);
            prop_assert!(pool.idle_bytes() <= budget, "{} > {budget}", pool.idle_bytes());
        }
        drop(kept);
        idle_capacities(&pool);
        prop_assert!(pool.idle_bytes() <= budget, "{} > {budget}", pool.idle_bytes());
    }
}
