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

/// The unix time in milliseconds, as `kungfu-selftest --stamp` prints it.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A partition: host 2's link goes down (its port on the bridge; nothing
/// is closed, no reset or FIN reaches anyone) while a 2 x 2 job trains
/// under `--on-failure shrink`. Host 1's workers must notice by heartbeats
/// alone, within the bound (`KUNGFU_PEER_TIMEOUT_MS`, 1.5 s; here under
/// 3 s of the cut, on a busy 2-core machine), naming host 2's ranks, then
/// recover to the two of host 1, which lost exactly ranks 2 and 3, and go
/// on training with exact values until they are told to stop.
#[test]
fn a_partitioned_host_is_detected_by_heartbeats_and_its_ranks_named() {
    let Some(mut c) = cluster(2, "partition") else {
        return;
    };
    c.start_sshd(&[2]);
    let ssh = c.ssh();
    let stop = c.dir.join("stop");
    let stop_arg = stop.display().to_string();
    let args = [
        "--timeout",
        "90s",
        "--grace",
        "5s",
        "-np",
        "4",
        "-H",
        "198.18.0.1:2,198.18.0.2:2",
        "--ssh",
        &ssh,
        "--on-failure",
        "shrink",
        // the survivors must notice by themselves: no op deadline helps
        "-x",
        "KUNGFU_OP_TIMEOUT_MS=600000",
        SELFTEST,
        "--steps",
        "1000000",
        "--size",
        "1024",
        "--recover",
        "--stamp",
        "--step-ms",
        "10",
        "--stop-file",
        &stop_arg,
    ];
    let mut child = c
        .on(1, RUN, &args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = lines_of(&mut child);
    let mut seen: Vec<String> = Vec::new();
    // pumps lines until `done` holds, for at most `limit`
    let pump = |seen: &mut Vec<String>, limit: Duration, done: &dyn Fn(&[String]) -> bool| {
        let end = Instant::now() + limit;
        while !done(seen) {
            match lines.recv_timeout(end.saturating_duration_since(Instant::now())) {
                Ok(l) => seen.push(l),
                Err(_) => return false,
            }
        }
        true
    };
    let trained = |seen: &[String]| {
        (0..4).all(|r| {
            seen.iter()
                .any(|l| l.starts_with(&format!("[{r}@")) && l.ends_with("step 20 ok"))
        })
    };
    if !pump(&mut seen, Duration::from_secs(60), &trained) {
        let _ = child.kill();
        panic!("the job did not train:\n{}", seen.join("\n"));
    }
    // the partition
    let cut = unix_ms();
    let out = Command::new("ip")
        .args([
            "-n",
            &format!("{}-sw", c.prefix),
            "link",
            "set",
            "h2",
            "down",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out));
    let survivors = ["[0@198.18.0.1] ", "[1@198.18.0.1] "];
    let recovered = |seen: &[String]| {
        survivors.iter().all(|tag| {
            seen.iter()
                .any(|l| l.starts_with(tag) && l.contains(": recovered in "))
        })
    };
    let ok = pump(&mut seen, Duration::from_secs(30), &recovered);
    let story = seen.join("\n");
    if !ok {
        let _ = child.kill();
        panic!("the survivors did not recover:\n{story}");
    }
    for tag in survivors {
        // `TAG UNIX_MS pid P: step N: op ... needs rank R: ...; recovering`
        let first = seen
            .iter()
            .filter_map(|l| l.strip_prefix(tag))
            .find(|l| l.ends_with("; recovering"))
            .unwrap_or_else(|| panic!("{tag}: no loss reported:\n{story}"));
        let at: u64 = first.split(' ').next().unwrap().parse().unwrap();
        let after = at.saturating_sub(cut);
        println!("{tag}detected the partition {after} ms after the cut: {first}");
        assert!(
            after < 3000,
            "{tag}: detected {after} ms after the cut:\n{story}"
        );
        assert!(
            first.contains("needs rank 2") || first.contains("needs rank 3"),
            "{tag}: names another rank: {first}"
        );
        let rec = seen
            .iter()
            .filter_map(|l| l.strip_prefix(tag))
            .find(|l| l.contains(": recovered in "))
            .expect("checked");
        let lost = rec.split(": lost ").nth(1).unwrap_or_default();
        assert!(
            lost.starts_with("rank 2 (198.18.0.2:")
                && lost.contains(", rank 3 (198.18.0.2:")
                && lost.contains("); now rank ")
                && lost.contains("/2 at version"),
            "{tag}: {rec}"
        );
    }
    // they go on, and stop when told
    std::fs::write(&stop, b"").unwrap();
    let done = |seen: &[String]| {
        survivors.iter().all(|tag| {
            seen.iter()
                .any(|l| l.starts_with(tag) && l.ends_with(": done"))
        })
    };
    let finished = pump(&mut seen, Duration::from_secs(30), &done);
    // host 2's launcher is cut off: kungfu-run would wait for it until its
    // --timeout; the cluster's drop kills what is left
    let _ = child.kill();
    let _ = child.wait();
    assert!(
        finished,
        "the survivors did not finish:\n{}",
        seen.join("\n")
    );
}
