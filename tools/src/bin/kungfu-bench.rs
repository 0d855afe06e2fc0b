//! `kungfu-bench`: the collective benchmark, in the manner of nccl-tests.
//! Run it under kungfu-run (or any launcher the runtime understands):
//!
//! ```text
//! kungfu-run -np 4 kungfu-bench allreduce -b 1K -e 64M -f 2 -n 20 -w 5 -c 1
//! ```
//!
//! `kungfu-bench --help` lists the options (`--completions SHELL` prints a
//! completion script).
//!
//! Rank 0 prints one row per size: `size count type redop root`, then
//! `time algbw busbw #wrong` out of place and in place. `time` is the
//! slowest rank's mean time per op. `algbw` = size / time; `busbw` scales
//! it by the nccl-tests factor of the op (2(n-1)/n for allreduce, (n-1)/n
//! for allgather, reduce-scatter and alltoall, 1 for broadcast and reduce),
//! where `size` is the per-rank buffer for allreduce, broadcast and reduce
//! and the whole (n-block) buffer for the others.
//!
//! Out of place, an op reads one buffer and its result is another. In
//! place (`--in-place 1`, the default), as in nccl-tests, one buffer is
//! both: allreduce and broadcast use the session's in-place calls;
//! allgather reads this rank's block of its output buffer; reduce-scatter
//! leaves its result in this rank's block of its input buffer; reduce and
//! alltoall read and write the whole buffer. The timed in-place ops each
//! work on the result of the one before.
//!
//! `-c 1` (the default) fills the buffers anew after the timed ops, runs
//! one more op of each column and checks every element of its output
//! exactly, in that column's own buffer; `#wrong` is the count of wrong
//! elements over all ranks, and any makes the exit status non-zero.
//!
//! The footer's `Heap per op (rank 0)` line is what one timed
//! out-of-place op allocated on the heap of rank 0's process (every
//! thread: the caller, the library and the runtime), as allocations and
//! bytes per op, at the largest size and, in parentheses, at the smallest.
//! A buffer allocated per op would show as a byte count near the op's
//! size.

// The benchmark is this binary's own, not the library's: it reads the
// allocation counter below.
#[path = "../bench/mod.rs"]
mod bench;

use bench::{bench, Args};

/// Counts heap allocations, so the bench can report what an op allocates
/// in the steady state (the JSON rows and the footer carry it).
mod heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    pub struct Counting;
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static BYTES: AtomicU64 = AtomicU64::new(0);

    #[allow(unsafe_code)]
    // SAFETY: every method forwards to the system allocator with the
    // caller's arguments unchanged; the counters have no effect on memory.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            CALLS.fetch_add(1, Relaxed);
            BYTES.fetch_add(layout.size() as u64, Relaxed);
            // SAFETY: the caller upholds `alloc`'s contract, passed on as is.
            unsafe { System.alloc(layout) }
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            CALLS.fetch_add(1, Relaxed);
            BYTES.fetch_add(layout.size() as u64, Relaxed);
            // SAFETY: as for `alloc`.
            unsafe { System.alloc_zeroed(layout) }
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            CALLS.fetch_add(1, Relaxed);
            BYTES.fetch_add(new_size as u64, Relaxed);
            // SAFETY: as for `alloc`; `ptr` came from this allocator.
            unsafe { System.realloc(ptr, layout, new_size) }
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: `ptr` came from this allocator with `layout`.
            unsafe { System.dealloc(ptr, layout) }
        }
    }

    /// (allocations, bytes allocated) so far, by every thread.
    pub fn snapshot() -> (u64, u64) {
        (CALLS.load(Relaxed), BYTES.load(Relaxed))
    }
}

#[global_allocator]
static HEAP: heap::Counting = heap::Counting;

fn main() {
    let args = Args::parse_checked(std::env::args_os()).unwrap_or_else(|e| e.exit());
    if let Some(shell) = args.completions {
        kungfu_tools::cli::print_completions::<Args>(shell);
        return;
    }
    let threads = std::env::var("KUNGFU_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("tokio runtime");
    // Run on a runtime worker, not on this thread: with the ops' tasks and
    // the IO driver on the same worker, an op completes without a
    // cross-thread wake-up (about 20 us each on a busy 2-core machine).
    let res = rt.block_on(async {
        tokio::spawn(bench(args))
            .await
            .unwrap_or_else(|e| Err(anyhow::anyhow!("benchmark task failed: {e}")))
    });
    match res {
        Ok(true) => {}
        Ok(false) => {
            eprintln!("kungfu-bench: wrong values found");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("kungfu-bench: error: {e:#}");
            std::process::exit(1);
        }
    }
}
