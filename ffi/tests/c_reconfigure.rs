//! Reconfigure from C: `ffi/tests/c/reconfigure.c` under `kungfu-run -np
//! 3` trades handles, reconfigures to the reversed order, refuses a reused
//! uuid and a list without the caller, shrinks by the last worker (which
//! goes on alone), merges, aborts and comes back, checking every rank and
//! every sum; each worker prints one line, checked here.
//!
//! Needs target/<profile>/libkungfu.so and kungfu-run (`cargo build -p
//! kungfu-ffi -p kungfu-tools`) and a C compiler. The job is bounded by
//! kungfu-run's `--timeout` and a kill here.

mod common;
use common::{assert_lines, compile_c, kungfu_run, Scratch};

#[test]
fn workers_reconfigure_through_the_c_abi() {
    let dir = Scratch::new("reconfigure");
    let exe = compile_c(&dir.0, "reconfigure", &[]);
    let exe = exe.display().to_string();
    let out = kungfu_run(3, &[&exe]);
    let want: Vec<String> = (0..3)
        .map(|r| format!("[{r}] start rank {r}: now rank {r}/3; all C checks passed"))
        .collect();
    assert_lines(&out, &want);
}
