//! The error statuses a C caller meets only in a job of several processes:
//! `ffi/tests/c/errors.c` runs one scenario per job under kungfu-run and
//! prints, per rank, the status each call returned; these tests check
//! every line. Each scenario is built so that the status is certain (see
//! the comments in errors.c): no rank's outcome depends on timing.
//!
//! Needs target/<profile>/libkungfu.so and kungfu-run (`cargo build -p
//! kungfu-ffi -p kungfu-tools`) and a C compiler. Every job is bounded by
//! kungfu-run's `--timeout` and a kill here.

mod common;
use common::{assert_lines, compile_c, kungfu_run, Scratch};

/// Runs `errors SCENARIO` with `np` workers (and `--transport T` if
/// given); returns kungfu-run's output.
fn scenario(np: usize, name: &str, transport: Option<&str>) -> String {
    let dir = Scratch::new(&format!("errors-{name}"));
    let exe = compile_c(&dir.0, "errors", &[]);
    let exe = exe.display().to_string();
    let mut args: Vec<&str> = Vec::new();
    if let Some(t) = transport {
        args.extend(["--transport", t]);
    }
    args.extend([exe.as_str(), name]);
    kungfu_run(np, &args)
}

/// The line rank `r` prints for `what` returning `status`.
fn saw(r: usize, name: &str, what: &str, status: &str) -> String {
    format!("[{r}] rank {r}: {name}: {what} -> {status}")
}

fn done(r: usize, name: &str) -> String {
    format!("[{r}] rank {r}: {name}: done")
}

/// The detail line rank `r` printed for `what`, which must exist.
fn detail<'a>(out: &'a str, r: usize, name: &str, what: &str) -> &'a str {
    let head = format!("[{r}] rank {r}: {name}: {what}: detail: ");
    out.lines()
        .find_map(|l| l.strip_prefix(&head))
        .unwrap_or_else(|| panic!("no detail line {head:?} in:\n{out}"))
}

#[test]
fn ranks_that_disagree_see_mismatch() {
    let out = scenario(2, "mismatch", None);
    let mut want = Vec::new();
    for r in 0..2 {
        want.extend([
            saw(
                r,
                "mismatch",
                "allreduce with another count on each rank",
                "KF_ERR_MISMATCH",
            ),
            saw(
                r,
                "mismatch",
                "kf_set_strategy to another strategy on each rank",
                "KF_ERR_MISMATCH",
            ),
            saw(
                r,
                "mismatch",
                "allreduce with another check on each rank",
                "KF_ERR_MISMATCH",
            ),
            saw(r, "mismatch", "allreduce with the same check", "KF_OK"),
            saw(
                r,
                "mismatch",
                "allreduce after a refused call took the check",
                "KF_OK",
            ),
            saw(
                r,
                "mismatch",
                "fused allreduce whose member has another check on each rank",
                "KF_ERR_MISMATCH",
            ),
            saw(r, "mismatch", "allreduce after the mismatches", "KF_OK"),
            done(r, "mismatch"),
        ]);
    }
    assert_lines(&out, &want);
}

/// Rank 2 never joins; rank 0 (op timeout 2 s) times out and tells the
/// others; rank 1 (60 s) hears it long before its own timeout.
#[test]
fn a_rank_that_never_joins_times_out_and_the_others_see_it_aborted() {
    let out = scenario(3, "timeout", None);
    let what = "allreduce that rank 2 never joins";
    let mut want = vec![
        saw(0, "timeout", what, "KF_ERR_TIMEOUT"),
        saw(1, "timeout", what, "KF_ERR_ABORTED"),
    ];
    for r in 0..3 {
        want.push(saw(r, "timeout", "allreduce after the timeout", "KF_OK"));
        want.push(done(r, "timeout"));
    }
    assert_lines(&out, &want);
    let d = detail(&out, 1, "timeout", what);
    assert!(d.contains("rank 0 timed out waiting for rank 2"), "{d}");
}

fn peer_lost(transport: &str) {
    let out = scenario(2, "peer-lost", Some(transport));
    assert_lines(
        &out,
        &[
            "[1] rank 1: peer-lost: exiting without kf_finalize".into(),
            saw(
                0,
                "peer-lost",
                "allreduce that needs the lost rank",
                "KF_ERR_PEER_LOST",
            ),
            saw(
                0,
                "peer-lost",
                "a later allreduce that needs it",
                "KF_ERR_PEER_LOST",
            ),
            done(0, "peer-lost"),
        ],
    );
    assert!(!out.contains(&done(1, "peer-lost")), "{out}");
}

#[test]
fn a_rank_that_exits_without_finalizing_is_lost_over_shm() {
    peer_lost("shm");
}

#[test]
fn a_rank_that_exits_without_finalizing_is_lost_over_tcp() {
    peer_lost("tcp");
}

#[test]
fn live_ops_whose_names_hash_alike_are_refused() {
    let out = scenario(2, "duplicate-name", None);
    let name = "duplicate-name";
    let mut want = vec![saw(
        0,
        name,
        "allreduce while one whose name hashes alike runs",
        "KF_ERR_DUPLICATE_NAME",
    )];
    for r in 0..2 {
        want.extend([
            saw(r, name, "the first allreduce", "KF_OK"),
            saw(r, name, "the second name once the first completed", "KF_OK"),
            done(r, name),
        ]);
    }
    assert_lines(&out, &want);
    let d = detail(
        &out,
        0,
        name,
        "allreduce while one whose name hashes alike runs",
    );
    assert!(d.contains("\"dup/AABAQBABDHAA\""), "{d}");
}

#[test]
fn a_wait_whose_timeout_passes_is_pending() {
    let out = scenario(2, "pending", None);
    assert_lines(
        &out,
        &[
            saw(
                0,
                "pending",
                "kf_wait(h, 0) on an op rank 1 has not joined",
                "KF_PENDING",
            ),
            saw(0, "pending", "kf_wait(h, 100) on it", "KF_PENDING"),
            saw(0, "pending", "kf_test on it", "KF_OK"),
            saw(0, "pending", "kf_wait(h, -1) once rank 1 joined", "KF_OK"),
            saw(1, "pending", "the late allreduce", "KF_OK"),
            done(0, "pending"),
            done(1, "pending"),
        ],
    );
}

/// Rank 1 posts an op late: meanwhile both ranks' stall reports name it
/// (rank 0 waits on it, rank 1 hears so on rank 0's heartbeats).
#[test]
fn the_stall_report_names_the_rank_that_has_not_posted() {
    let out = scenario(2, "stall", None);
    let mut want = Vec::new();
    for r in 0..2 {
        want.extend([
            saw(
                r,
                "stall",
                "kf_stall_report while rank 1 has not posted",
                "KF_OK",
            ),
            saw(r, "stall", "kf_stall_report once the op is done", "KF_OK"),
            done(r, "stall"),
        ]);
    }
    want.push(saw(
        0,
        "stall",
        "the late op once rank 1 posted it",
        "KF_OK",
    ));
    want.push(saw(1, "stall", "the late op", "KF_OK"));
    assert_lines(&out, &want);
}

/// Rank 1 cuts a 64 KiB op into 4 KiB chunks, rank 0 into one: rank 0,
/// the centre of the star, receives frames its plan cannot take.
#[test]
fn a_protocol_violation_is_a_transport_error_and_aborts_the_op() {
    let out = scenario(2, "transport", None);
    let what = "allreduce cut into other chunks on rank 1";
    assert_lines(
        &out,
        &[
            saw(0, "transport", what, "KF_ERR_TRANSPORT"),
            saw(1, "transport", what, "KF_ERR_ABORTED"),
            done(0, "transport"),
            done(1, "transport"),
        ],
    );
    let d = detail(&out, 0, "transport", what);
    assert!(d.contains("protocol violation by rank 1"), "{d}");
}

#[test]
fn a_child_forked_after_the_runtime_started_gets_an_error() {
    let out = scenario(2, "fork", None);
    let mut want = Vec::new();
    for r in 0..2 {
        want.extend([
            saw(
                r,
                "fork",
                "allreduce after a fork before the runtime started",
                "KF_OK",
            ),
            saw(r, "fork", "child: allreduce", "KF_ERR_INVALID_ARGUMENT"),
            saw(r, "fork", "child: barrier", "KF_ERR_INVALID_ARGUMENT"),
            saw(r, "fork", "child: finalize", "KF_OK"),
            saw(r, "fork", "allreduce after the child", "KF_OK"),
            done(r, "fork"),
        ]);
    }
    assert_lines(&out, &want);
    let d = detail(&out, 0, "fork", "child: allreduce");
    assert!(d.contains("forked from process"), "{d}");
}

/// Rank 0 finalizes with three ops in flight that rank 1 never joins;
/// rank 1 waits in an op rank 0 never joins, until rank 0 has left.
fn finalize(transport: &str) {
    let out = scenario(2, "finalize", Some(transport));
    let name = "finalize";
    let mut want = vec![
        saw(0, name, "kf_wait(h, 0) before finalize", "KF_PENDING"),
        saw(0, name, "kf_finalize with three ops in flight", "KF_OK"),
        saw(
            0,
            name,
            "kf_wait on the op after finalize",
            "KF_ERR_FINALIZED",
        ),
        saw(0, name, "kf_finalize again", "KF_OK"),
        saw(
            1,
            name,
            "allreduce while rank 0 finalizes",
            "KF_ERR_PEER_LOST",
        ),
        done(0, name),
        done(1, name),
    ];
    for what in [
        "an op with a handle",
        "an op without a handle",
        "a grouped op",
        "an op with a handle, later",
    ] {
        want.push(format!(
            "[0] rank 0: {name}: callback of {what} -> KF_ERR_FINALIZED, 1 call(s)"
        ));
    }
    assert_lines(&out, &want);
}

#[test]
fn finalize_fails_ops_in_flight_and_runs_their_callbacks_over_shm() {
    finalize("shm");
}

#[test]
fn finalize_fails_ops_in_flight_and_runs_their_callbacks_over_tcp() {
    finalize("tcp");
}

/// Rank 0's kf_init refuses its environment (so it never listens); rank 1
/// cannot reach it, and its failure to start sticks.
#[test]
fn a_bad_environment_or_an_unreachable_peer_is_a_bootstrap_error() {
    let out = scenario(2, "bootstrap", None);
    let name = "bootstrap";
    assert_lines(
        &out,
        &[
            saw(
                0,
                name,
                "kf_init with KUNGFU_OP_TIMEOUT_MS=soon",
                "KF_ERR_BOOTSTRAP",
            ),
            saw(0, name, "allreduce after it", "KF_ERR_NOT_INITIALIZED"),
            saw(1, name, "kf_init", "KF_OK"),
            saw(
                1,
                name,
                "allreduce with a peer that never listens",
                "KF_ERR_BOOTSTRAP",
            ),
            saw(1, name, "allreduce again", "KF_ERR_BOOTSTRAP"),
            done(0, name),
            done(1, name),
        ],
    );
    let d = detail(&out, 0, name, "kf_init with KUNGFU_OP_TIMEOUT_MS=soon");
    assert!(d.contains("KUNGFU_OP_TIMEOUT_MS"), "{d}");
}
