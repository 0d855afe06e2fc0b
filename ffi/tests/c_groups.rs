//! Groups of ranks from C (`ffi/tests/c/groups.c` under `-np 4`): a 2x2
//! mesh of row and column groups whose ops are issued in different orders
//! by different ranks, every collective in a group whose ranks are the
//! world's in reverse, fusion across groups, and what a group refuses.
//!
//! Needs target/<profile>/libkungfu.so and kungfu-run (`cargo build -p
//! kungfu-ffi -p kungfu-tools`) and a C compiler.

mod common;
use common::{assert_lines, compile_c, kungfu_run, Scratch};

fn groups(transport: &str) {
    let dir = Scratch::new("groups");
    let exe = compile_c(&dir.0, "groups", &[]);
    let out = kungfu_run(
        4,
        &["--transport", transport, exe.to_str().expect("utf-8 path")],
    );
    let want: Vec<String> = (0..4)
        .map(|r| format!("[{r}] rank {r}: groups: all checks passed"))
        .collect();
    assert_lines(&out, &want);
}

#[test]
fn groups_of_ranks_run_every_collective_over_shm() {
    groups("shm");
}

#[test]
fn groups_of_ranks_run_every_collective_over_tcp() {
    groups("tcp");
}
