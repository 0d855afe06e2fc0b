//! kungfu-bench under the launcher: its files, the in-place check, and
//! swaps and monitor overhead.

use super::*;

#[test]
fn bench_writes_json_and_a_plot() {
    let dir = TempDir::new("bench-files");
    let json = dir.0.join("r.json");
    let svg = dir.0.join("r.svg");
    let (j, p) = (json.to_str().unwrap(), svg.to_str().unwrap());
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "3",
            BENCH,
            "allgather",
            "-b",
            "12",
            "-e",
            "12K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "0",
            "-d",
            "half",
            "--json",
            j,
            "--plot",
            p,
        ]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", text(&out));
    let js = std::fs::read_to_string(&json).unwrap();
    assert!(js.starts_with(r#"{"op":"allgather","ranks":3"#), "{js}");
    assert_eq!(js.matches(r#""size":"#).count(), 4, "{js}");
    assert!(js.contains(r#""wrong":0}"#), "{js}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("polyline"),
        "{plot}"
    );
}

/// The in-place column checks the in-place buffer itself: a result
/// corrupted there (by a test-only switch of the bench) is counted in that
/// column's #wrong, not in the out-of-place one, and fails the run. Both
/// paths: allreduce (the session's in-place call) and allgather (the
/// nccl-tests layout, this rank's block inside the output buffer).
#[test]
fn bench_checks_the_in_place_buffer() {
    for op in ["allreduce", "allgather"] {
        let mut c = kungfu_run(&[
            "-np", "3", BENCH, op, "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1",
        ]);
        c.env("KUNGFU_BENCH_CORRUPT_IN_PLACE", "1");
        let out = run_bounded(c, Duration::from_secs(60));
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{op}: {t}");
        // one corrupt element per rank and size
        assert!(t.contains("# Out of bounds values : 6 FAILED"), "{op}: {t}");
        let rows: Vec<Vec<&str>> = t
            .lines()
            .filter_map(|l| l.strip_prefix("[0] "))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|w| w.len() == 13 && w[0].parse::<usize>().is_ok())
            .collect();
        assert_eq!(rows.len(), 2, "{op}: {t}");
        for w in rows {
            assert_eq!(
                (w[8], w[12]),
                ("0", "3"),
                "{op} (#wrong out of place, in place): {t}"
            );
        }
    }
}

/// `kungfu-bench swap` measures strategy swaps (and fails if a rank did not
/// switch); `--monitor` reports the monitors' overhead and refuses what it
/// cannot monitor.
#[test]
fn bench_measures_swaps_and_monitor_overhead() {
    let out = run_bounded(
        kungfu_run(&["-np", "3", BENCH, "swap", "-n", "6", "-w", "1"]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("[0] # swap latency (agreement, drain, consensus on the digest, epoch advance; slowest rank): mean"),
        "{t}"
    );
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "2",
            BENCH,
            "allreduce",
            "-b",
            "1K",
            "-e",
            "4K",
            "-f",
            "4",
            "-n",
            "4",
            "-w",
            "1",
            "--monitor",
            "1",
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] # Monitors at        4K"), "{t}");
    assert!(t.contains("noise scale"), "{t}");
    let mut refused = Command::new(BENCH);
    refused.args(["allreduce", "-d", "int32", "--monitor", "1"]);
    let out = run_bounded(refused, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--monitor measures allreduces of float"));
}

/// `kungfu-bench swap-transport` times transport swaps through a list,
/// each followed by a checked allreduce on the new transport; a list of
/// one is refused.
#[test]
fn bench_measures_transport_swaps() {
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "3",
            "--transport",
            "tcp",
            "-x",
            "KUNGFU_FABRIC_PROVIDER=tcp;ofi_rxm",
            BENCH,
            "swap-transport",
            "--transports",
            "tcp,quic,fabric",
            "-n",
            "6",
            "-w",
            "1",
            "-b",
            "64K",
        ]),
        Duration::from_secs(120),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    // from tcp: quic first; 7 swaps, the first untimed: 2 to each
    let row = |to: &str| format!("[0] {to:>28} {:>6} ", 2);
    for want in [
        "[0] # kungfu-bench swap-transport: 3 ranks, 6 swaps (after 1 untimed) through tcp,quic,fabric, from tcp".to_string(),
        row("quic"),
        row("fabric (tcp;ofi_rxm)"),
        row("tcp"),
        "[0] # Out of bounds values : 0 OK".to_string(),
    ] {
        assert!(t.contains(&want), "{want:?} in\n{t}");
    }
    let out = run_bounded(
        kungfu_run(&["-np", "2", BENCH, "swap-transport", "--transports", "tcp"]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("needs --transports with at least two"), "{t}");
}
