//! `--on-failure shrink|replace`: a worker exits or freezes, the others
//! recover (`Worker::recover`) and keep training with exact values and
//! one model (kungfu-selftest checks both every step, and exits 4 on a
//! wrong value).

use super::*;

/// The lines of `t` that rank `r` (by its rank at start) wrote.
fn of(t: &str, r: usize) -> Vec<&str> {
    let p = format!("[{r}] ");
    t.lines().filter(|l| l.starts_with(&p)).collect()
}

/// kungfu-run of `np` kungfu-selftest workers for 60 steps with
/// `--on-failure on_failure`, rank `dies` exiting 3 at step 20, and the
/// selftest's `extra` flags.
fn job(np: &str, on_failure: &str, dies: &str, extra: &[&str]) -> Output {
    let exit = format!("{dies}:20:3");
    let mut args = vec![
        "-np",
        np,
        "--on-failure",
        on_failure,
        SELFTEST,
        "--steps",
        "60",
        "--size",
        "1024",
        "--exit",
        &exit,
    ];
    args.extend_from_slice(extra);
    run_bounded(kungfu_run_failing(&args), Duration::from_secs(100))
}

#[test]
fn shrink_the_survivors_name_the_lost_and_go_on() {
    let out = job("4", "shrink", "2", &["--recover"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("kungfu-run: rank 2 exited with status 3; the others go on without it"),
        "{t}"
    );
    for r in [0, 1, 3] {
        let lines = of(&t, r);
        let has = |s: &str| lines.iter().any(|l| l.contains(s));
        assert!(has("needs rank 2"), "rank {r} named another:\n{t}");
        assert!(has("lost rank 2 (127.0.0.1:"), "{t}");
        assert!(has("at version 1"), "{t}");
        assert!(has("done"), "{t}");
    }
    // renumbered in order: old rank 3 is rank 2 of 3
    assert!(t.contains("[3] step 20: recovered in"), "{t}");
    assert!(t.contains("now rank 2/3 at version 1"), "{t}");
}

#[test]
fn replace_a_new_worker_joins_and_the_job_ends_at_full_size() {
    let out = job("3", "replace", "1", &["--recover", "--follow-config"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("kungfu-run: cluster version 1: 2 workers"),
        "{t}"
    );
    assert!(
        t.contains("kungfu-run: cluster version 2: 3 workers"),
        "{t}"
    );
    assert!(t.contains("joined at step 20 as rank 2/3"), "{t}");
    // the two survivors and the new worker finish
    assert_eq!(t.matches("] done").count(), 3, "{t}");
}

/// A worker frozen (SIGSTOP) for longer than the peer timeout is left out;
/// when it runs again (SIGCONT) it is refused with a clear error and the
/// others finish without it.
#[test]
fn a_frozen_worker_is_left_out_and_refused_when_it_comes_back() {
    let mut c = kungfu_run_failing(&[
        "-np",
        "3",
        "--on-failure",
        "shrink",
        "--detach-timeout",
        "60s",
        SELFTEST,
        "--steps",
        "100000000",
        "--size",
        "1024",
        "--recover",
    ]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn kungfu-run");
    let (tx, rx) = mpsc::channel::<String>();
    for s in [
        Box::new(child.stdout.take().expect("piped")) as Box<dyn std::io::Read + Send>,
        Box::new(child.stderr.take().expect("piped")),
    ] {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(s).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
    }
    drop(tx);
    let guard = Guard(vec![child]);
    let mut lines = Vec::new();
    let mut wait_for = |what: &dyn Fn(&str) -> bool, limit: Duration| -> Option<String> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            if let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) {
                lines.push(l.clone());
                if what(&l) {
                    return Some(l);
                }
            }
        }
        None
    };
    let pid_line = wait_for(&|l| l.starts_with("[1] pid "), Duration::from_secs(60));
    let pid: i32 = pid_line
        .and_then(|l| l.split_whitespace().nth(2)?.parse().ok())
        .expect("rank 1's pid");
    let started = wait_for(
        &|l| l.starts_with("[0] step 100 ok"),
        Duration::from_secs(60),
    );
    assert!(started.is_some(), "no training");
    let pid = nix::unistd::Pid::from_raw(pid);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let frozen = Instant::now();
    let recovered = wait_for(
        &|l| l.starts_with("[2] ") && l.contains("recovered in"),
        Duration::from_secs(60),
    );
    let detected = frozen.elapsed();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    let refused = wait_for(
        &|l| l.starts_with("[1] ") && l.contains("left out of the cluster at version 1"),
        Duration::from_secs(60),
    );
    // the survivors go on after it exited
    let after = wait_for(
        &|l| l.starts_with("[0] step ") && l.ends_with("0 ok") && !l.contains("step 100 "),
        Duration::from_secs(30),
    );
    drop(guard);
    let all = lines.join("\n");
    let recovered = recovered.unwrap_or_else(|| panic!("no recovery:\n{all}"));
    assert!(recovered.contains("lost rank 1 (127.0.0.1:"), "{all}");
    assert!(
        refused.is_some(),
        "the frozen worker was not refused:\n{all}"
    );
    assert!(after.is_some(), "the survivors did not go on:\n{all}");
    // about 1.5 s; the bound is for a loaded machine
    assert!(detected < Duration::from_secs(30), "{detected:?}\n{all}");
}
