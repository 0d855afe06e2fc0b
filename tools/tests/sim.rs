//! `kungfu-sim` at a small scale, as CI runs it: every strategy at a few
//! cluster sizes, its tables and its plot.

use std::process::Command;

const SIM: &str = env!("CARGO_BIN_EXE_kungfu-sim");

/// Whether `row` (a line of `t`) is in the section of `size`.
fn row_is_of(t: &str, row: &str, size: &str) -> bool {
    let at = t.find(row).unwrap();
    t[..at]
        .rfind("## allreduce ")
        .map(|h| t[h..].starts_with(&format!("## allreduce {size} ")))
        == Some(true)
}

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
        .arg("--json")
        .arg(dir.join("sim.json"))
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{t}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // the tables the docs are rendered from: per size, a row per strategy
    // of the busbw printed above
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sim.json")).unwrap()).unwrap();
    let tables = doc["tables"].as_array().unwrap();
    let ids: Vec<&str> = tables.iter().map(|t| t["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["busbw-64K", "busbw-4M"]);
    let table = &tables[0];
    assert_eq!(
        table["columns"],
        serde_json::json!(["strategy", "4", "16", "64"])
    );
    for (i, s) in kungfu_topology::Strategy::ALL.iter().enumerate() {
        assert_eq!(table["rows"][i][0], s.name(), "{table}");
    }
    for s in kungfu_topology::Strategy::ALL {
        for (col, n) in [4, 16, 64].into_iter().enumerate() {
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
            // the first row found is of the first size's section
            assert!(row_is_of(&t, row, "64K"), "{row}");
            let i = kungfu_topology::Strategy::ALL
                .iter()
                .position(|x| *x == s)
                .unwrap();
            let json = tables[0]["rows"][i][col + 1].as_f64().unwrap();
            assert!(
                (json - busbw).abs() < 0.0005 + 1e-9,
                "{row}: {json} in the JSON"
            );
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
