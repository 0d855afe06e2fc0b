//! The elastic loop of docs/adaptation.md (`kungfu-elastic-loop`) under
//! `kungfu-run -w -np 2`: the schedule's resizes happen at their steps, the
//! adaptive batch size acts only every 10 steps, and the workers end
//! agreeing.

use std::path::Path;
use std::time::Duration;

use kungfu_tests::kungfu_run_ok;

const LOOP: &str = env!("CARGO_BIN_EXE_kungfu-elastic-loop");

#[test]
fn the_readme_loop_feeds_its_policies() {
    let t = kungfu_run_ok(
        &["-w", "-np", "2"],
        Path::new(LOOP),
        Duration::from_secs(120),
    );

    let agreed = |rank: u32| -> Vec<(u64, String)> {
        t.lines()
            .filter_map(|l| l.strip_prefix(&format!("[{rank}] agreed at step ")))
            .map(|l| {
                let (s, a) = l.split_once(": ").expect("step: action");
                (s.parse().expect("step"), a.to_string())
            })
            .collect()
    };
    let h0 = agreed(0);
    assert_eq!(h0, agreed(1), "the workers agreed on other actions\n{t}");
    let resizes: Vec<_> = h0.iter().filter(|(_, a)| a.starts_with("Resize")).collect();
    assert_eq!(
        resizes,
        [
            &(100, "Resize(3)".to_string()),
            &(200, "Resize(2)".to_string())
        ],
        "ScaleSchedule fires at its steps\n{t}"
    );
    let batches: Vec<u64> = h0
        .iter()
        .filter(|(_, a)| a.starts_with("SetBatchSize"))
        .map(|(s, _)| *s)
        .collect();
    assert!(!batches.is_empty(), "the batch size adapted\n{t}");
    for w in batches.windows(2) {
        assert!(
            w[0] < w[1],
            "one batch size per agreement: {batches:?}\n{t}"
        );
    }
    for s in &batches {
        assert!(
            *s > 0 && s % 10 == 0,
            "AdaptiveBatchSize acts every 10 steps: {batches:?}\n{t}"
        );
    }
    let finals: Vec<&str> = t.lines().filter(|l| l.contains("] final: rank")).collect();
    assert_eq!(finals.len(), 2, "{t}");
    let tail = |l: &str| l.split(" step ").nth(1).map(str::to_string);
    assert_eq!(tail(finals[0]), tail(finals[1]), "{t}");
    assert!(finals[0].contains(" step 300 "), "{t}");
}
