//! Shrink and continue from C: `ffi/tests/c/recover.c` trains with exact
//! int32 gradients under `kungfu-run -np 4 --on-failure shrink`; the
//! worker that started as rank 2 exits at step 15, and the survivors see
//! `KF_ERR_PEER_LOST` naming it, call `kf_recover`, check that
//! `kf_rank`/`kf_size`/`kf_version` describe the cluster of 3, call
//! `kf_sync_state` and finish the 40 steps with every value exact.
//!
//! Needs target/<profile>/libkungfu.so and kungfu-run (`cargo build -p
//! kungfu-ffi -p kungfu-tools`) and a C compiler. The job is bounded by
//! kungfu-run's `--timeout` and a kill here.

mod common;
use common::{assert_lines, compile_c, kungfu_run, Scratch};

#[test]
fn the_survivors_recover_and_finish_with_exact_values() {
    let dir = Scratch::new("recover");
    let exe = compile_c(&dir.0, "recover", &[]);
    let exe = exe.display().to_string();
    let out = kungfu_run(4, &["--on-failure", "shrink", &exe, "2", "15", "40"]);
    assert!(
        out.contains("kungfu-run: rank 2 exited with status 3; the others go on without it"),
        "{out}"
    );
    let mut want = vec!["[2] start rank 2: exiting at step 15".to_string()];
    // renumbered in order: start rank 3 is rank 2 of 3
    for (start, now) in [(0, 0), (1, 1), (3, 2)] {
        want.push(format!(
            "[{start}] start rank {start}: recovered at step 15: rank {now}/3 at version 1"
        ));
        want.push(format!(
            "[{start}] start rank {start}: 40 steps, now rank {now}/3 at version 1; \
             all C checks passed"
        ));
        // kf_last_error() names the lost rank and where it ran
        let head = format!("[{start}] start rank {start}: step 15: KF_ERR_PEER_LOST: ");
        let detail = out
            .lines()
            .find_map(|l| l.strip_prefix(&head))
            .unwrap_or_else(|| panic!("no {head:?} in:\n{out}"));
        assert!(detail.contains("needs rank 2: rank 2 is lost"), "{detail}");
        assert!(detail.contains("(the worker at 127.0.0.1:"), "{detail}");
    }
    assert_lines(&out, &want);
    assert!(!out.contains("[2] start rank 2: 40 steps"), "{out}");
}
