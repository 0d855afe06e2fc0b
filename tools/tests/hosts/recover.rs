//! `--on-failure shrink|replace` across hosts (ssh mode): a worker on the
//! second host (rank 2, the first there) exits at step 20; the survivors on both hosts recover
//! through the config server of the first host's launcher and train on
//! with exact values (kungfu-selftest checks them every step); with
//! `replace`, the launcher of the host that lost the worker asks for the
//! full size again and starts its replacement there.

use super::*;

/// 2 hosts x 2 kungfu-selftest workers for 60 steps, rank 2 (on host 2)
/// exiting 3 at step 20 (a replacement starts as rank 3, and goes on).
fn failing_job(on_failure: &str, extra: &[&str]) -> Option<String> {
    let mut c = cluster(2, &format!("recover_hosts_{on_failure}"))?;
    c.start_sshd(&[2]);
    let ssh = c.ssh();
    let mut args = vec![
        "--timeout",
        "100s",
        "--grace",
        "30s",
        "-np",
        "4",
        "-H",
        "198.18.0.1:2,198.18.0.2:2",
        "--ssh",
        &ssh,
        "--on-failure",
        on_failure,
        // the survivors must notice by themselves: no op deadline helps
        "-x",
        "KUNGFU_OP_TIMEOUT_MS=600000",
        SELFTEST,
        "--steps",
        "60",
        "--size",
        "1024",
        "--exit",
        "2:20:3",
        "--recover",
    ];
    args.extend_from_slice(extra);
    let out = run_bounded(c.on(1, RUN, &args), Duration::from_secs(120));
    let t = text(&out);
    if std::env::var_os("KUNGFU_TEST_SHOW").is_some() {
        eprintln!("{t}");
    }
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("rank 2 on 198.18.0.2 exited with status 3; the others go on without it"),
        "{t}"
    );
    assert_eq!(t.matches("exited with status").count(), 1, "{t}");
    // host 2's launcher followed the recovery's version
    assert!(
        t.contains("kungfu-run on 198.18.0.2: cluster version 1: 3 workers"),
        "{t}"
    );
    for h in 1..=2 {
        assert!(c.pids_of(h, "kungfu-selftest").is_empty(), "host {h}:\n{t}");
        assert!(c.pids_of(h, "kungfu-run").is_empty(), "host {h}:\n{t}");
    }
    Some(t)
}

/// The lines of `t` that start with `tag`.
fn of<'a>(t: &'a str, tag: &str) -> Vec<&'a str> {
    t.lines().filter(|l| l.starts_with(tag)).collect()
}

#[test]
fn shrink_across_hosts_the_survivors_of_both_go_on() {
    let Some(t) = failing_job("shrink", &[]) else {
        return;
    };
    // (a worker's prefix keeps its rank at start)
    for tag in ["[0@198.18.0.1] ", "[1@198.18.0.1] ", "[3@198.18.0.2] "] {
        let lines = of(&t, tag);
        assert!(
            lines.iter().any(|l| l.contains("at version 1")),
            "{tag}\n{t}"
        );
        assert!(lines.iter().any(|l| l.ends_with("] done")), "{tag}\n{t}");
    }
    assert_eq!(t.matches("] done").count(), 3, "{t}");
}

#[test]
fn replace_across_hosts_the_lost_worker_is_started_again_on_its_host() {
    // 30 ms a step: the survivors' 40 steps after the loss outlast the
    // launcher's ask for the full size and the replacement's start
    let Some(t) = failing_job("replace", &["--follow-config", "--step-ms", "30"]) else {
        return;
    };
    // the free slot is host 2's: its launcher starts the new worker, which
    // joins at the survivors' next look at the config (step 20 or later)
    assert!(
        t.contains("kungfu-run on 198.18.0.2: cluster version 2: 4 workers"),
        "{t}"
    );
    let new = of(&t, "[3@198.18.0.2] ");
    assert!(
        new.iter()
            .any(|l| l.contains("joined at step ") && l.ends_with(" as rank 3/4")),
        "{t}"
    );
    assert_eq!(t.matches("] done").count(), 4, "{t}");
}
