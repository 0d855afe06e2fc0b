//! The elastic training example end to end: under `kungfu-run -w -np 2`
//! it grows to 3 workers, swaps to RING, shrinks back to 2 and adapts its
//! batch size from the gradient noise scale. Checked:
//!
//! - every worker alive at a synchronisation point, an epoch's end or a
//!   detach (the worker that joined included) holds the same parameters,
//!   bit for bit;
//! - the run follows, epoch by epoch, the loss of the same training in one
//!   process with the batch sizes the run agreed on (`kungfu-train
//!   --baseline --batch-schedule`), to within rounding. The task is not
//!   saturated (the loss still falls in the last epoch), so a lost,
//!   duplicated or misweighted gradient, or a worker that trained from
//!   parameters it should not have had, moves the loss far past that
//!   tolerance.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kungfu_tests::{kungfu_run_ok, output_text, run_bounded};

const TRAIN: &str = env!("CARGO_BIN_EXE_kungfu-train");

/// How far the distributed loss may be from the one-process replay: the
/// two sum the same gradients in another order, which moves the loss by
/// about 1e-6 here; a broken resize moves it by 1e-3 or more.
const LOSS_TOLERANCE: f64 = 1e-4;

/// The number after `key ` in `line`.
fn field<T: std::str::FromStr>(line: &str, key: &str) -> T {
    line.split(&format!("{key} "))
        .nth(1)
        .and_then(|r| r.split([' ', ':']).next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// (loss, accuracy) of each epoch's line starting with `prefix` + epoch.
fn epochs(text: &str, prefix: &str) -> BTreeMap<u64, (f64, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix(prefix))
        .map(|l| {
            let e = l.split(':').next().and_then(|e| e.parse().ok());
            let e = e.unwrap_or_else(|| panic!("no epoch in {l:?}"));
            (e, (field(l, "loss"), field(l, "accuracy")))
        })
        .collect()
}

/// Checks the `state` lines: every worker alive at a step printed the
/// same digest there. Returns the number of points checked that the
/// worker which joined (rank 2 of 3) took part in.
fn check_states(t: &str) -> usize {
    // step -> (why, rank, size, digest); at least the start and 6 epochs
    let mut at: BTreeMap<u64, Vec<(String, u64, u64, String)>> = BTreeMap::new();
    for l in t
        .lines()
        .filter_map(|l| l.split_once("] state ").map(|x| x.1))
    {
        let why = l.split(" step ").next().expect("why").to_string();
        let step: u64 = field(l, "step");
        let rank: u64 = field(l, "rank");
        let size: u64 = field(l, "of");
        let digest: String = field(l, "params");
        at.entry(step).or_default().push((why, rank, size, digest));
    }
    assert!(at.len() >= 7, "too few state lines:\n{t}");
    let mut joined = 0;
    for (step, views) in &at {
        let d0 = &views[0].3;
        for v in views {
            assert_eq!(&v.3, d0, "workers differ at step {step}: {views:?}\n{t}");
        }
        // per kind of point, every worker of the cluster is there
        let mut kinds: BTreeMap<(&str, u64), Vec<u64>> = BTreeMap::new();
        for (why, rank, size, _) in views {
            kinds.entry((why, *size)).or_default().push(*rank);
        }
        for ((why, size), mut ranks) in kinds {
            ranks.sort_unstable();
            let want: Vec<u64> = if why == "detached" {
                ranks.clone()
            } else {
                (0..size).collect()
            };
            assert_eq!(ranks, want, "{why} at step {step}, {size} workers\n{t}");
            if size == 3 && ranks.contains(&2) {
                joined += 1;
            }
        }
    }
    joined
}

#[test]
fn elastic_adaptive_training_matches_one_process() {
    let t = kungfu_run_ok(
        &["-w", "-np", "2"],
        Path::new(TRAIN),
        Duration::from_secs(120),
    );

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

    // identical parameters everywhere, the joined worker included: at the
    // grow's synchronisation, at the end of epochs 3 and 4 and when it is
    // detached
    let joined = check_states(&t);
    assert!(
        joined >= 3,
        "the joined worker was checked {joined} times\n{t}"
    );
    let finals: Vec<&str> = t.lines().filter(|l| l.contains("final: rank")).collect();
    assert_eq!(finals.len(), 2, "{t}");
    let digest = |l: &str| field::<String>(l, "params");
    assert_eq!(digest(finals[0]), digest(finals[1]), "{t}");

    // the batch sizes the workers agreed on, replayed in one process
    let schedule: Vec<String> = t
        .lines()
        .filter_map(|l| l.strip_prefix("[0] step "))
        .filter(|l| l.contains(": batch size "))
        .map(|l| {
            let step: u64 = l.split(':').next().unwrap().parse().unwrap();
            let to: u64 = field(l, "->");
            format!("{step}:{to}")
        })
        .collect();
    assert!(schedule.len() >= 3, "the batch size adapted:\n{t}");
    let base = run_bounded(
        {
            let mut c = Command::new(TRAIN);
            c.args(["--baseline", "--batch-schedule", &schedule.join(",")]);
            c
        },
        Duration::from_secs(60),
    );
    let bt = output_text(&base);
    assert!(base.status.success(), "{bt}");
    let want = epochs(&bt, "baseline epoch ");
    let got = epochs(&t, "[0] epoch ");
    assert_eq!(want.len(), 6, "{bt}");
    assert_eq!(
        got.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "{t}\n{bt}"
    );

    // the task is not saturated: a run that lost or misweighted updates
    // would end somewhere else
    let (l1, a1) = want[&1];
    let (l5, _) = want[&5];
    let (l6, a6) = want[&6];
    assert!(
        l6 < l1 - 0.1 && a6 > a1 + 0.02 && l6 < l5 - 50.0 * LOSS_TOLERANCE,
        "the loss must still fall in the last epoch:\n{bt}"
    );

    for (e, &(l, a)) in &got {
        let (wl, wa) = want[e];
        assert!(
            (l - wl).abs() < LOSS_TOLERANCE && (a - wa).abs() < 0.002,
            "epoch {e}: loss {l} accuracy {a}, one process {wl} {wa}\n{t}\n{bt}"
        );
    }
    for f in &finals {
        let (l, wl) = (field::<f64>(f, "loss"), want[&6].0);
        assert!((l - wl).abs() < LOSS_TOLERANCE, "{f}: one process {wl}");
    }
}
