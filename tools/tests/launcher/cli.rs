//! Command lines: bad ones are refused, and `--help` says what it should.

use super::*;

#[test]
fn bad_command_lines_are_refused() {
    for args in [
        &["-np", "0", "x"][..],
        &["-np", "2"],
        &["-np", "3", "-H", "127.0.0.1:2", "x"],
        &["--strategy", "HYPERCUBE", "-np", "1", "x"],
    ] {
        let out = run_bounded(kungfu_run(args), Duration::from_secs(20));
        assert!(
            matches!(out.status.code(), Some(1 | 2)),
            "{args:?}: {}",
            text(&out)
        );
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("kungfu-run: "),
            "{args:?}: {}",
            text(&out)
        );
    }
}

/// `kungfu-run --help` names every strategy the library accepts.
#[test]
fn help_lists_every_strategy() {
    let out = run_bounded(kungfu_run(&["--help"]), Duration::from_secs(20));
    assert!(out.status.success(), "{}", text(&out));
    let help = String::from_utf8_lossy(&out.stdout);
    // whole words: STAR is also part of BINARY_TREE_STAR
    let words: std::collections::HashSet<&str> = help
        .split(|c: char| !(c.is_ascii_uppercase() || c == '_'))
        .collect();
    for s in Strategy::ALL {
        assert!(words.contains(s.name()), "--help omits {s}:\n{help}");
    }
}

/// `kungfu-bench --help` names `--in-place` and explains the footer's
/// heap line.
#[test]
fn bench_help_explains_in_place_and_the_heap_line() {
    let mut c = Command::new(BENCH);
    c.arg("--help");
    let out = run_bounded(c, Duration::from_secs(20));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{help}");
    // clap's form of `--in-place 0|1`
    assert!(help.contains("--in-place <0|1>"), "{help}");
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("\"Heap per op (rank 0)\" line gives"),
        "{help}"
    );
}
