//! The elastic training example end to end: under `kungfu-run -w -np 2`
//! it grows to 3 workers, swaps to RING, shrinks back to 2, adapts its
//! batch size from the gradient noise scale, and must reach the accuracy
//! of the same training in one process, with identical parameters on
//! every worker.

use std::process::Command;
use std::time::Duration;

use kungfu_tests::{output_text, run_bounded, target_dir};

const TRAIN: &str = env!("CARGO_BIN_EXE_kungfu-train");

fn accuracy(line: &str) -> f64 {
    line.split("accuracy ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no accuracy in {line:?}"))
}

#[test]
fn elastic_adaptive_training_converges_like_one_process() {
    let base = run_bounded(
        {
            let mut c = Command::new(TRAIN);
            c.arg("--baseline");
            c
        },
        Duration::from_secs(60),
    );
    let bt = output_text(&base);
    assert!(base.status.success(), "{bt}");
    let base_acc = accuracy(
        bt.lines()
            .find(|l| l.starts_with("baseline:"))
            .expect("baseline line"),
    );
    assert!(base_acc > 0.85, "the task is learnable: {base_acc}");

    let run = target_dir().join("kungfu-run");
    assert!(
        run.exists(),
        "{} is missing: build the workspace first",
        run.display()
    );
    let mut c = Command::new(run);
    c.args(["-w", "-np", "2", "--timeout", "120s"]).arg(TRAIN);
    let out = run_bounded(c, Duration::from_secs(150));
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");

    // every epoch reports what the issue asks for
    for e in 1..=6 {
        let line = t
            .lines()
            .find(|l| l.starts_with(&format!("[0] epoch {e}: loss ")))
            .unwrap_or_else(|| panic!("no epoch {e} line in\n{t}"));
        for field in ["accuracy", "noise scale", "batch", "workers", "strategy"] {
            assert!(line.contains(field), "{line}");
        }
    }
    // the actions happened, in every worker's view
    assert!(t.contains("workers 2 -> 3"), "{t}");
    assert!(t.contains("strategy -> RING"), "{t}");
    assert!(t.contains("workers 3 -> 2"), "{t}");
    assert!(t.contains("rank 2: detached at step"), "{t}");
    assert!(t.contains(": batch size "), "the batch size adapted:\n{t}");

    // two workers finish, with the same parameters and the baseline's
    // accuracy
    let finals: Vec<&str> = t.lines().filter(|l| l.contains("final: rank")).collect();
    assert_eq!(finals.len(), 2, "{t}");
    let digest = |l: &str| l.split("params ").nth(1).map(|r| r[..16].to_string());
    assert_eq!(digest(finals[0]), digest(finals[1]), "{t}");
    for l in &finals {
        let acc = accuracy(l);
        assert!(
            (acc - base_acc).abs() < 0.02,
            "accuracy {acc} against {base_acc} in one process\n{t}"
        );
    }
}
