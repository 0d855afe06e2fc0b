//! What `kungfu-bench resize --sizes 4,3,1,3` started with `-np 2` under
//! `kungfu-run -w` prints when it went well (included with `#[path]` by the
//! elastic tests, whichever store holds the config).

/// Checks `t` (the job's output): every resize happened, with its latency;
/// the launcher started each version; 4 -> 3 detached one worker and
/// 3 -> 1 two more; the model was checked on every worker.
pub fn assert_resized_2_4_3_1_3(t: &str) {
    for (from, to, v) in [(2, 4, 1), (4, 3, 2), (3, 1, 3), (1, 3, 4)] {
        let line = format!("[0] # resize {from} -> {to} (version {v}): latency ");
        assert!(t.contains(&line), "no {line:?} in\n{t}");
        let launched = format!("kungfu-run: cluster version {v}: {to} workers");
        assert!(t.contains(&launched), "{t}");
    }
    assert_eq!(t.matches("# detached at step").count(), 3, "{t}");
    assert!(
        t.contains("steps, sizes [4, 3, 1, 3], model 65536 bytes, final size 3, version 4, model checked on every worker"),
        "{t}"
    );
    assert!(
        t.contains("# resize latency (process start excluded): mean"),
        "{t}"
    );
}
