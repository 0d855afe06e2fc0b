//! Live transport swaps from C: `ffi/tests/c/swap.c` trains with exact
//! int32 gradients under `kungfu-run -np 3 --transport tcp`, swaps to
//! shared memory at step 10 and back to TCP at step 20 with
//! `kf_set_transport`, and at step 30 asks for libfabric, which rank 1
//! lacks: every rank must get an error (rank 1 `KF_ERR_TRANSPORT`, saying
//! why; the others `KF_ERR_MISMATCH`), and the training goes on exact.
//!
//! Needs target/<profile>/libkungfu.so and kungfu-run (`cargo build -p
//! kungfu-ffi -p kungfu-tools`), a C compiler and libfabric. The job is
//! bounded by kungfu-run's `--timeout` and a kill here.

mod common;
use common::{assert_lines, compile_c, kungfu_run, Scratch};

#[test]
fn a_c_training_loop_swaps_tcp_shm_tcp_and_a_missing_transport_is_refused_everywhere() {
    let dir = Scratch::new("swap");
    let exe = compile_c(&dir.0, "swap", &[]);
    let exe = exe.display().to_string();
    let out = kungfu_run(3, &["--transport", "tcp", &exe, "40"]);
    let mut want = Vec::new();
    for r in 0..3 {
        for (step, to) in [(10, "shm"), (20, "tcp")] {
            want.push(format!("[{r}] rank {r}: step {step}: swapped to {to}"));
        }
        // the ones that have it hear that it is not available everywhere
        let status = if r == 1 {
            "transport error"
        } else {
            "mismatch between ranks"
        };
        want.push(format!("[{r}] rank {r}: step 30: fabric refused: {status}"));
        want.push(format!(
            "[{r}] rank {r}: 40 steps, every value exact; all C checks passed"
        ));
    }
    assert_lines(&out, &want);
    let why = out
        .lines()
        .find_map(|l| l.strip_prefix("[1] rank 1: why: "))
        .unwrap_or_else(|| panic!("rank 1 does not say why:\n{out}"));
    assert!(why.contains("no-such-provider"), "{why}");
    // the two swaps before moved the epoch on twice
    assert!(why.contains("(epoch 2)"), "{why}");
}
