//! Workers that fail, are killed or hang: the job stops, names the worker,
//! and nothing hangs.

use super::*;

#[test]
fn a_worker_that_exits_3_stops_the_job() {
    let out = run_bounded(
        kungfu_run_failing(&[
            "-np", "4", SELFTEST, "--steps", "100000", "--size", "1024", "--exit", "2:20:3",
        ]),
        Duration::from_secs(90),
    );
    let t = text(&out);
    // the survivors fail too (their allreduce needs rank 2), and which exit
    // the launcher reaps first is up to the kernel: any non-zero status
    assert!(!out.status.success(), "{t}");
    assert_noticed(&t);
    assert!(t.contains("kungfu-run: rank 2 exited with status 3"), "{t}");
    // every line of a worker is prefixed with its rank
    assert!(
        t.contains("[2] step 20: exiting with status 3 as asked"),
        "{t}"
    );
}

#[test]
fn a_worker_killed_during_allreduce_is_named_and_nothing_hangs_tcp() {
    kill_rank_two_mid_allreduce("tcp");
}

/// Over shared memory no socket reports the death: the rings carry the
/// peers' pids, and a waiting side checks them.
#[test]
fn a_worker_killed_during_allreduce_is_named_and_nothing_hangs_shm() {
    kill_rank_two_mid_allreduce("shm");
}

/// A worker frozen (SIGSTOP) mid-allreduce: no socket breaks, yet the
/// survivors fail within seconds (heartbeats; the op timeout is ten
/// minutes here), naming the frozen rank as silent.
#[test]
fn a_frozen_worker_is_named_within_seconds() {
    let (lines, pid, stopped) = start_and_signal_rank_two("tcp", nix::sys::signal::Signal::SIGSTOP);
    let deadline = stopped + Duration::from_secs(30);
    let (rx, mut lines, guard) = lines;
    // every survivor names rank 2, the one that froze
    let mut named = [None; 4];
    while named[0].is_none() || named[1].is_none() || named[3].is_none() {
        let Ok(l) = rx.recv_timeout(Duration::from_millis(100)) else {
            assert!(
                Instant::now() < deadline,
                "not everyone noticed ({named:?}):\n{}",
                lines.join("\n")
            );
            continue;
        };
        for r in [0, 1, 3] {
            if l.starts_with(&format!("[{r}]")) && l.contains("error") {
                assert!(l.contains("needs rank 2"), "rank {r} blamed another: {l}");
                named[r].get_or_insert(stopped.elapsed());
            }
        }
        lines.push(l);
    }
    let named = named.iter().flatten().max().copied().expect("named");
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    drop(guard);
    let all = lines.join("\n");
    assert!(all.contains("silent for"), "{all}");
    // detection is about 1.5 s; the bound is for a loaded machine
    assert!(named < Duration::from_secs(20), "{named:?}:\n{all}");
}

type Lines = (mpsc::Receiver<String>, Vec<String>, Guard);
type Started = (Lines, i32, Instant);

/// Starts a 4-worker training loop over `transport`, waits until it is
/// well into it, and sends rank 2 `sig`.
fn start_and_signal_rank_two(transport: &str, sig: nix::sys::signal::Signal) -> Started {
    let (lines, pids) = start_training(transport, "262144");
    let at = Instant::now();
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pids[2]), sig).unwrap();
    (lines, pids[2], at)
}

/// Starts a 4-worker training loop over `transport` with `size` floats
/// per allreduce and waits until it is well into it; returns its output so
/// far, the rest to come, and the workers' pids.
fn start_training(transport: &str, size: &str) -> (Lines, [i32; 4]) {
    let mut c = kungfu_run_failing(&[
        "-np",
        "4",
        "--transport",
        transport,
        SELFTEST,
        "--steps",
        "1000000",
        "--size",
        size,
    ]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn kungfu-run");
    let stdout = child.stdout.take().expect("piped");
    let stderr = child.stderr.take().expect("piped");
    let guard = Guard(vec![child]);
    let (tx, rx) = mpsc::channel::<String>();
    let tx2 = tx.clone();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    std::thread::spawn(move || {
        for l in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx2.send(l);
        }
    });
    let mut lines = Vec::new();
    let mut pids: [Option<i32>; 4] = [None; 4];
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let Ok(l) = rx.recv_timeout(Duration::from_secs(1)) else {
            continue;
        };
        for (r, pid) in pids.iter_mut().enumerate() {
            if let Some(p) = l.strip_prefix(&format!("[{r}] pid ")) {
                *pid = p.split(' ').next().and_then(|p| p.parse().ok());
            }
        }
        let go = l.contains("step 10 ok") && pids.iter().all(Option::is_some);
        lines.push(l);
        if go {
            break;
        }
    }
    let Some(pids) = pids.iter().copied().collect::<Option<Vec<i32>>>() else {
        panic!("not every rank started:\n{}", lines.join("\n"));
    };
    ((rx, lines, guard), [pids[0], pids[1], pids[2], pids[3]])
}

/// Stopped workers, continued when this is dropped (also when a test
/// fails, so that nothing stays stopped).
struct Stopped(Vec<i32>);

impl Stopped {
    fn stop(pids: &[i32]) -> Stopped {
        for &p in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGSTOP,
            );
        }
        Stopped(pids.to_vec())
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        for &p in &self.0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(p),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
    }
}

/// The whole job stops for a while, as when its host stalls (a busy shared
/// machine, a VM paused), then runs again: nobody is lost, whichever
/// worker's watchdog runs first. Once, a stall just under the peer timeout
/// had a worker whose heartbeat tick came just before it name a peer lost
/// whose last heartbeat came a little earlier. The ops are small (the
/// host fast path: no frames, so only heartbeats are heard).
#[test]
fn a_whole_job_stalled_for_a_while_carries_on() {
    let ((rx, mut lines, guard), pids) = start_training("shm", "256");
    for ms in [900, 1150, 1300, 1400, 1450, 2500] {
        let stopped = Stopped::stop(&pids);
        std::thread::sleep(Duration::from_millis(ms));
        drop(stopped);
        // a second to run again and to find (wrongly) someone lost
        let until = Instant::now() + Duration::from_secs(1);
        let mut steps = 0;
        while let Some(left) = until.checked_duration_since(Instant::now()) {
            let Ok(l) = rx.recv_timeout(left) else { break };
            steps += usize::from(l.contains(" ok"));
            let bad = l.contains("error") || l.contains("lost") || l.contains("exited");
            lines.push(l);
            assert!(!bad, "after a {ms} ms stall:\n{}", lines.join("\n"));
        }
        assert!(
            steps > 0,
            "no step after a {ms} ms stall:\n{}",
            lines.join("\n")
        );
    }
    drop(guard);
}

fn kill_rank_two_mid_allreduce(transport: &str) {
    let ((rx, mut lines, guard), _, killed_at) =
        start_and_signal_rank_two(transport, nix::sys::signal::Signal::SIGKILL);
    let mut guard = guard;
    let mut child = guard.0.pop().expect("child");
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        // past the 30 s grace: an unnoticed loss shows as a SIGTERM
        assert!(
            killed_at.elapsed() < Duration::from_secs(90),
            "kungfu-run still running"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    // drain the output
    while let Ok(l) = rx.recv_timeout(Duration::from_millis(500)) {
        lines.push(l);
    }
    let all = lines.join("\n");
    assert!(!status.success(), "{all}");
    assert_noticed(&all);
    assert!(
        all.contains("kungfu-run: rank 2 was killed by signal 9 (SIGKILL)"),
        "{all}"
    );
    // every survivor's allreduce failed with an error naming rank 2 (the
    // culprit, not a neighbour that gave up) and where it ran
    for r in [0, 1, 3] {
        let named = lines.iter().any(|l| {
            l.starts_with(&format!("[{r}]"))
                && l.contains("error")
                && l.contains("needs rank 2")
                && l.contains("the worker at 127.0.0.1:")
        });
        assert!(named, "rank {r} did not name rank 2:\n{all}");
        let blamed = lines.iter().any(|l| {
            l.starts_with(&format!("[{r}]"))
                && l.contains("error")
                && [0, 1, 3]
                    .iter()
                    .any(|o| l.contains(&format!("needs rank {o}")))
        });
        assert!(!blamed, "rank {r} blamed a survivor:\n{all}");
    }
}

#[test]
fn the_job_timeout_bounds_a_hung_worker() {
    let started = Instant::now();
    let mut c = Command::new(RUN);
    c.args([
        "--timeout",
        "3s",
        "-np",
        "2",
        SELFTEST,
        "--steps",
        "1000",
        "--hang",
        "1:2",
    ])
    .env("KUNGFU_OP_TIMEOUT_MS", "600000");
    let out = run_bounded(c, Duration::from_secs(90));
    assert_eq!(out.status.code(), Some(124), "{}", text(&out));
    assert!(
        text(&out).contains("did not finish within"),
        "{}",
        text(&out)
    );
    // 3 s, then SIGTERM and SIGKILL 3 s later; the hung op alone would
    // wait ten minutes: only the order of magnitude matters
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[test]
fn the_stall_report_names_the_worker_that_did_not_post() {
    let mut c = Command::new(RUN);
    c.args([
        "--timeout",
        "6s",
        "-np",
        "3",
        SELFTEST,
        "--steps",
        "1000",
        "--hang",
        "1:3",
    ])
    .env("KUNGFU_STALL_TIMEOUT_MS", "1000")
    .env("KUNGFU_OP_TIMEOUT_MS", "600000");
    let out = run_bounded(c, Duration::from_secs(90));
    let t = text(&out);
    assert_eq!(out.status.code(), Some(124), "{t}");
    // every worker, the hung one too (its runtime still runs), names it
    for r in 0..3 {
        let said = t.lines().any(|l| {
            l.starts_with(&format!("[{r}]"))
                && l.contains("stall: op \"")
                && l.contains("rank 1 has not posted it (posted by 0, 2)")
        });
        assert!(said, "rank {r} did not report rank 1:\n{t}");
    }
}
