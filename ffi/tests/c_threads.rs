//! The thread-safety claims of docs/c-api.md, from a C client with four
//! threads per rank (`ffi/tests/c/threads.c`): named ops issued, waited
//! for, tested and released across threads at once, per-thread last
//! errors and groups, callbacks, and kf_finalize while the other threads
//! keep starting ops (every accepted op calls back exactly once).
//!
//! No ThreadSanitizer build: libkungfu's Rust code is not instrumented, so
//! TSan sees none of its synchronisation and reports races that are not
//! there (hundreds per run: allocations freed by another thread after an
//! `Arc` handed them over, and the C data a callback reads, which the
//! library passed to its thread through a queue).
//!
//! Needs target/<profile>/libkungfu.so and kungfu-run (`cargo build -p
//! kungfu-ffi -p kungfu-tools`) and a C compiler.

mod common;
use common::{assert_lines, compile_c, kungfu_run, Scratch};

fn threads(transport: &str) {
    let dir = Scratch::new("threads");
    let exe = compile_c(&dir.0, "threads", &[]);
    let out = kungfu_run(
        2,
        &["--transport", transport, exe.to_str().expect("utf-8 path")],
    );
    assert_lines(
        &out,
        &[
            "[0] rank 0: threads: all checks passed".into(),
            "[1] rank 1: threads: all checks passed".into(),
        ],
    );
}

#[test]
fn several_threads_use_the_library_at_once_over_shm() {
    threads("shm");
}

#[test]
fn several_threads_use_the_library_at_once_over_tcp() {
    threads("tcp");
}
