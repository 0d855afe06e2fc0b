//! `kungfu-sim` at a small scale, as CI runs it: every strategy at a few
//! cluster sizes, its tables and its plot.

use std::process::Command;

const SIM: &str = env!("CARGO_BIN_EXE_kungfu-sim");

#[test]
fn the_simulator_predicts_every_strategy_and_draws_the_plot() {
    let dir = std::env::temp_dir().join(format!("kungfu-sim-{}", std::process::id()));
    let out = Command::new(SIM)
        .args([
            "--workers",
            "4,16,64",
            "--per-host",
            "4",
            "--sizes",
            "64K,4M",
        ])
        .arg("--plot")
        .arg(&dir)
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{t}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for s in kungfu_topology::Strategy::ALL {
        for n in [4, 16, 64] {
            let row = t
                .lines()
                .find(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    f.len() == 8 && f[0] == s.name() && f[1] == n.to_string()
                })
                .unwrap_or_else(|| panic!("no row for {s} at {n} workers:\n{t}"));
            let busbw: f64 = row.split_whitespace().nth(3).unwrap().parse().unwrap();
            // positive and below what a 100 Gbit/s link allows
            assert!(busbw > 0.0 && busbw <= 12.5 * 1.001, "{row}");
        }
    }
    assert!(t.contains("# fastest per cluster size (4M)"), "{t}");
    for size in ["64K", "4M"] {
        let svg = std::fs::read_to_string(dir.join(format!("sim-allreduce-{size}.svg"))).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains(">workers<"),
            "{size}"
        );
        assert_eq!(
            svg.matches("<polyline").count(),
            kungfu_topology::Strategy::ALL.len()
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    // bad input: a clear error, exit status 2
    let out = Command::new(SIM)
        .args(["--fat-tree", "8"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    // clap's form: invalid value '8' for '--fat-tree <R:O>': ...
    assert!(String::from_utf8_lossy(&out.stderr).contains("--fat-tree <R:O>"));
}
