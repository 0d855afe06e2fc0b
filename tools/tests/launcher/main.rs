//! Multi-process tests over loopback: kungfu-run starting workers, every
//! strategy, two "hosts" (127.0.0.1 and 127.0.0.2), workers that fail or
//! are killed, and workers started by mpirun or with torchrun's variables.
//!
//! Every process is bounded: kungfu-run gets `--timeout`, and a guard stops
//! whatever a test started (SIGTERM, then SIGKILL) even when it fails.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kungfu_topology::Strategy;

const RUN: &str = env!("CARGO_BIN_EXE_kungfu-run");
const BENCH: &str = env!("CARGO_BIN_EXE_kungfu-bench");
const SELFTEST: &str = env!("CARGO_BIN_EXE_kungfu-selftest");

/// Kills a child (and the process group it leads, if any) when dropped.
struct Guard(Vec<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let pid = nix::unistd::Pid::from_raw(c.id() as i32);
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
                let t = Instant::now();
                while t.elapsed() < Duration::from_secs(8) {
                    if !matches!(c.try_wait(), Ok(None)) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Runs a command to completion within `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawn");
    let (tx, rx) = mpsc::channel();
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            // SIGTERM first: kungfu-run passes it on to its workers (and
            // kills them 3 s later), which SIGKILL would leave running
            let pid = nix::unistd::Pid::from_raw(pid as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            if rx.recv_timeout(Duration::from_secs(10)).is_err() {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
            panic!("command did not finish within {limit:?}: {cmd:?}");
        }
    }
}

fn text(o: &Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn kungfu_run(args: &[&str]) -> Command {
    let mut c = Command::new(RUN);
    c.args(["--timeout", "120s"]).args(args);
    c
}

/// kungfu-run for a job in which a worker fails and the others must notice
/// by themselves (a closed socket, a gone pid). The launcher gives them
/// 30 s to exit by themselves (`--grace`) and their op deadline is ten
/// minutes, so a survivor that did not notice shows as stopped by SIGTERM
/// whatever the load on the machine: no wall-clock bound is needed.
fn kungfu_run_failing(args: &[&str]) -> Command {
    let mut c = kungfu_run(&["--grace", "30s"]);
    c.args(args).env("KUNGFU_OP_TIMEOUT_MS", "600000");
    c
}

/// Every survivor of a job from `kungfu_run_failing` exited by itself.
fn assert_noticed(t: &str) {
    assert!(
        !t.contains("was killed by signal 15 (SIGTERM)"),
        "a survivor did not notice the failure and was stopped:\n{t}"
    );
}

#[test]
fn every_strategy_and_size_is_correct() {
    for (np, transport) in (1..=4).flat_map(|np| [(np, "tcp"), (np, "auto")]) {
        for s in Strategy::ALL {
            let np_s = np.to_string();
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--transport",
                transport,
                "--strategy",
                s.name(),
                BENCH,
                "allreduce",
                "-b",
                "0",
                "-e",
                "4M",
                "-f",
                "32",
                "-n",
                "2",
                "-w",
                "1",
                "-c",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(150));
            let t = text(&out);
            assert!(out.status.success(), "np={np} {s} {transport}:\n{t}");
            assert!(
                t.contains("# Out of bounds values : 0 OK"),
                "np={np} {s} {transport}:\n{t}"
            );
            // sizes 0 B .. 4 MiB all printed
            assert!(
                t.contains(&format!("{:>10} ", 4 << 20)),
                "np={np} {s}:\n{t}"
            );
        }
    }
}

#[test]
fn every_op_is_correct_under_the_launcher() {
    for op in [
        "broadcast",
        "allgather",
        "reduce-scatter",
        "reduce",
        "alltoall",
    ] {
        for (np, s) in [(3, "RING"), (4, "BINARY_TREE"), (2, "STAR")] {
            let np_s = np.to_string();
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--strategy",
                s,
                BENCH,
                op,
                "-b",
                "0",
                "-e",
                "1M",
                "-f",
                "64",
                "-n",
                "2",
                "-w",
                "1",
                "-r",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(150));
            let t = text(&out);
            assert!(out.status.success(), "{op} np={np} {s}:\n{t}");
            assert!(t.contains("# Out of bounds values : 0 OK"), "{op}:\n{t}");
        }
    }
}

/// A directory of this test's own, removed when dropped.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let d = std::env::temp_dir().join(format!("kungfu-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn bench_writes_json_and_a_plot() {
    let dir = TempDir::new("bench-files");
    let json = dir.0.join("r.json");
    let svg = dir.0.join("r.svg");
    let (j, p) = (json.to_str().unwrap(), svg.to_str().unwrap());
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "3",
            BENCH,
            "allgather",
            "-b",
            "12",
            "-e",
            "12K",
            "-f",
            "8",
            "-n",
            "2",
            "-w",
            "0",
            "-d",
            "half",
            "--json",
            j,
            "--plot",
            p,
        ]),
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", text(&out));
    let js = std::fs::read_to_string(&json).unwrap();
    assert!(js.starts_with(r#"{"op":"allgather","ranks":3"#), "{js}");
    assert_eq!(js.matches(r#""size":"#).count(), 4, "{js}");
    assert!(js.contains(r#""wrong":0}"#), "{js}");
    let plot = std::fs::read_to_string(&svg).unwrap();
    assert!(
        plot.starts_with("<svg") && plot.contains("polyline"),
        "{plot}"
    );
}

/// The in-place column checks the in-place buffer itself: a result
/// corrupted there (by a test-only switch of the bench) is counted in that
/// column's #wrong, not in the out-of-place one, and fails the run. Both
/// paths: allreduce (the session's in-place call) and allgather (the
/// nccl-tests layout, this rank's block inside the output buffer).
#[test]
fn bench_checks_the_in_place_buffer() {
    for op in ["allreduce", "allgather"] {
        let mut c = kungfu_run(&[
            "-np", "3", BENCH, op, "-b", "4K", "-e", "16K", "-f", "4", "-n", "2", "-w", "1",
        ]);
        c.env("KUNGFU_BENCH_CORRUPT_IN_PLACE", "1");
        let out = run_bounded(c, Duration::from_secs(60));
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{op}: {t}");
        // one corrupt element per rank and size
        assert!(t.contains("# Out of bounds values : 6 FAILED"), "{op}: {t}");
        let rows: Vec<Vec<&str>> = t
            .lines()
            .filter_map(|l| l.strip_prefix("[0] "))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .filter(|w| w.len() == 13 && w[0].parse::<usize>().is_ok())
            .collect();
        assert_eq!(rows.len(), 2, "{op}: {t}");
        for w in rows {
            assert_eq!(
                (w[8], w[12]),
                ("0", "3"),
                "{op} (#wrong out of place, in place): {t}"
            );
        }
    }
}

/// Ctrl-C reaches every worker, and the job ends promptly.
#[test]
fn sigint_reaches_every_worker() {
    let mut c = kungfu_run(&["-np", "3", SELFTEST, "--steps", "100000000", "--size", "64"]);
    c.stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = c.spawn().expect("spawn kungfu-run");
    let stdout = child.stdout.take().expect("piped");
    let mut guard = Guard(vec![child]);
    let (tx, rx) = mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut started = 0;
    while started < 3 && Instant::now() < deadline {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(200)) {
            started += usize::from(l.contains("step 0 ok"));
        }
    }
    assert_eq!(started, 3, "workers did not start");
    let pid = nix::unistd::Pid::from_raw(guard.0[0].id() as i32);
    let sent = Instant::now();
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).unwrap();
    let status = loop {
        if let Some(st) = guard.0[0].try_wait().unwrap() {
            break st;
        }
        // (the job's own --timeout is 120 s)
        assert!(
            sent.elapsed() < Duration::from_secs(30),
            "kungfu-run ignored SIGINT"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130));
    // the workers died of SIGINT themselves (not of the SIGKILL fallback)
    let mut err = String::new();
    std::io::Read::read_to_string(guard.0[0].stderr.as_mut().unwrap(), &mut err).unwrap();
    assert!(err.contains("forwarding SIGINT"), "{err}");
    assert_eq!(
        err.matches("killed by signal 2 (SIGINT)").count(),
        3,
        "{err}"
    );
}

/// The shared-memory transport under the launcher: every op correct, and a
/// worker killed mid-allreduce is noticed through its pid (no socket tells).
#[test]
fn shared_memory_transport() {
    for (np, s) in [(2, "STAR"), (3, "RING"), (4, "AUTO")] {
        for op in ["allreduce", "allgather", "broadcast"] {
            let np_s = np.to_string();
            let cmd = kungfu_run(&[
                "-np",
                &np_s,
                "--transport",
                "shm",
                "--strategy",
                s,
                BENCH,
                op,
                "-b",
                "0",
                "-e",
                "4M",
                "-f",
                "64",
                "-n",
                "2",
                "-w",
                "1",
            ]);
            let out = run_bounded(cmd, Duration::from_secs(120));
            assert!(out.status.success(), "{op} np={np} {s}:\n{}", text(&out));
        }
    }
    let out = run_bounded(
        kungfu_run_failing(&[
            "-np",
            "3",
            "--transport",
            "shm",
            SELFTEST,
            "--steps",
            "100000",
            "--size",
            "4096",
            "--exit",
            "1:30:9",
        ]),
        Duration::from_secs(90),
    );
    let t = text(&out);
    assert!(!out.status.success(), "{t}");
    assert_noticed(&t);
    assert!(t.contains("kungfu-run: rank 1 exited with status 9"), "{t}");
    // a survivor saw the pid gone (the other may hear it from that one)
    assert!(
        t.lines().any(|l| !l.starts_with("[1]")
            && l.contains("rank 1 is lost: ")
            && (l.contains("sending process") || l.contains("receiving process"))),
        "{t}"
    );
    // auto: shared memory inside each "host", TCP between them
    for s in ["BINARY_TREE_STAR", "RING", "CLIQUE"] {
        let cmd = kungfu_run(&[
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            "--transport",
            "auto",
            "--strategy",
            s,
            BENCH,
            "allreduce",
            "-b",
            "0",
            "-e",
            "4M",
            "-f",
            "64",
            "-n",
            "2",
            "-w",
            "1",
        ]);
        let out = run_bounded(cmd, Duration::from_secs(120));
        assert!(out.status.success(), "auto {s}:\n{}", text(&out));
    }
    // two hosts cannot share memory: a clear error, not a hang
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "2",
            "-H",
            "127.0.0.1:1,127.0.0.2:1",
            "--transport",
            "shm",
            SELFTEST,
        ]),
        Duration::from_secs(60),
    );
    assert!(
        text(&out).contains("shm needs every worker on one host"),
        "{}",
        text(&out)
    );
}

#[test]
fn two_hosts_on_loopback() {
    for s in ["BINARY_TREE_STAR", "MULTI_BINARY_TREE_STAR", "AUTO", "RING"] {
        let cmd = kungfu_run(&[
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            "--strategy",
            s,
            BENCH,
            "allreduce",
            "-b",
            "4",
            "-e",
            "1M",
            "-f",
            "16",
            "-n",
            "2",
            "-w",
            "1",
        ]);
        let out = run_bounded(cmd, Duration::from_secs(150));
        assert!(out.status.success(), "{s}:\n{}", text(&out));
    }
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "4",
            "-H",
            "127.0.0.1:2,127.0.0.2:2",
            SELFTEST,
            "--steps",
            "3",
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("rank 3/4 local 1/2"), "{t}");
    assert!(t.contains("rank 2/4 local 0/2"), "{t}");
}

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

fn kill_rank_two_mid_allreduce(transport: &str) {
    let mut c = kungfu_run_failing(&[
        "-np",
        "4",
        "--transport",
        transport,
        SELFTEST,
        "--steps",
        "1000000",
        "--size",
        "262144",
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
    let mut pid: Option<i32> = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    // wait until rank 2 is known and the job is well into its loop
    while Instant::now() < deadline {
        let Ok(l) = rx.recv_timeout(Duration::from_secs(1)) else {
            continue;
        };
        if l.starts_with("[2] pid ") {
            pid = l.split(' ').nth(2).and_then(|p| p.parse().ok());
        }
        let go = l.contains("step 10 ok") && pid.is_some();
        lines.push(l);
        if go {
            break;
        }
    }
    let pid = pid.unwrap_or_else(|| panic!("rank 2 never started:\n{}", lines.join("\n")));
    let killed_at = Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
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
    // the survivors' allreduce failed with an error naming rank 2
    let named = lines
        .iter()
        .filter(|l| !l.starts_with("[2]") && l.contains("error") && l.contains("rank 2"))
        .count();
    assert!(named >= 1, "no survivor named rank 2:\n{all}");
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
    assert!(help.contains("--in-place 0|1"), "{help}");
    let flat = help.split_whitespace().collect::<Vec<_>>().join(" ");
    assert!(
        flat.contains("\"Heap per op (rank 0)\" line gives"),
        "{help}"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Workers started the way torchrun starts them: only RANK, WORLD_SIZE,
/// LOCAL_RANK, MASTER_ADDR and MASTER_PORT (the runtime's rendezvous uses
/// MASTER_PORT + 1).
#[test]
fn torchrun_variables() {
    let n = 4;
    let port = free_port();
    let children: Vec<Child> = (0..n)
        .map(|r| {
            Command::new(SELFTEST)
                .args(["--steps", "3"])
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", (port - 1).to_string())
                .env("KUNGFU_CONNECT_TIMEOUT_MS", "30000")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut guard = Guard(children);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut outs = Vec::new();
    for mut c in guard.0.drain(..) {
        while c.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "torchrun-style worker hung");
            std::thread::sleep(Duration::from_millis(50));
        }
        outs.push(c.wait_with_output().unwrap());
    }
    for (r, o) in outs.iter().enumerate() {
        assert!(o.status.success(), "rank {r}:\n{}", text(o));
        let t = text(o);
        assert!(
            t.contains(&format!("rank {r}/4 local {r}/4 launcher Torchrun")),
            "{t}"
        );
        assert!(t.contains("done"), "{t}");
    }
}

/// The same job started by Open MPI's mpirun (Debian's openmpi-bin).
#[test]
fn mpirun_starts_a_job() {
    if Command::new("mpirun").arg("--version").output().is_err() {
        if std::env::var_os("KUNGFU_SKIP_MPI").is_some() {
            eprintln!("mpirun not installed; skipped because KUNGFU_SKIP_MPI is set");
            return;
        }
        panic!(
            "mpirun not found: install openmpi-bin (scripts/test.sh does) or set KUNGFU_SKIP_MPI=1"
        );
    }
    let port = free_port();
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        "4",
        "-x",
        "KUNGFU_RENDEZVOUS_PORT",
    ])
    .env("KUNGFU_RENDEZVOUS_PORT", port.to_string())
    .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    .args([SELFTEST, "--steps", "3"]);
    let out = run_bounded(c, Duration::from_secs(90));
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for r in 0..4 {
        assert!(
            t.contains(&format!("rank {r}/4 local {r}/4 launcher OpenMpi")),
            "{t}"
        );
    }
    assert_eq!(t.matches("done").count(), 4, "{t}");
}

/// `--bind-to core` pins each worker to one CPU (worker i to the i-th
/// allowed CPU, wrapping around); `--bind-to none` leaves the full set.
#[test]
fn workers_are_pinned_to_cores() {
    let script = "grep Cpus_allowed_list /proc/self/status";
    let out = run_bounded(
        kungfu_run(&["-np", "2", "--bind-to", "core", "sh", "-c", script]),
        Duration::from_secs(30),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    let allowed = std::fs::read_to_string("/proc/self/status").unwrap();
    let mine = allowed
        .lines()
        .find(|l| l.starts_with("Cpus_allowed_list"))
        .unwrap()
        .to_string();
    for rank in 0..2 {
        let line = t
            .lines()
            .find(|l| l.starts_with(&format!("[{rank}] Cpus_allowed_list")))
            .unwrap_or_else(|| panic!("no line of rank {rank}: {t}"));
        let list = line.rsplit(['\t', ' ']).next().unwrap();
        assert!(
            list.parse::<usize>().is_ok(),
            "rank {rank} is not pinned to one CPU: {line} (ours: {mine})"
        );
    }
    let out = run_bounded(
        kungfu_run(&["-np", "1", "--bind-to", "none", "sh", "-c", script]),
        Duration::from_secs(30),
    );
    let t = text(&out);
    let want = mine.rsplit(['\t', ' ']).next().unwrap();
    assert!(t.contains(want), "unbound worker: {t} (ours: {mine})");
}

/// `kungfu-bench swap` measures strategy swaps (and fails if a rank did not
/// switch); `--monitor` reports the monitors' overhead and refuses what it
/// cannot monitor.
#[test]
fn bench_measures_swaps_and_monitor_overhead() {
    let out = run_bounded(
        kungfu_run(&["-np", "3", BENCH, "swap", "-n", "6", "-w", "1"]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(
        t.contains("[0] # swap latency (agreement, drain, consensus on the digest, epoch advance; slowest rank): mean"),
        "{t}"
    );
    let out = run_bounded(
        kungfu_run(&[
            "-np",
            "2",
            BENCH,
            "allreduce",
            "-b",
            "1K",
            "-e",
            "4K",
            "-f",
            "4",
            "-n",
            "4",
            "-w",
            "1",
            "--monitor",
            "1",
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] # Monitors at        4K"), "{t}");
    assert!(t.contains("noise scale"), "{t}");
    let mut refused = Command::new(BENCH);
    refused.args(["allreduce", "-d", "int32", "--monitor", "1"]);
    let out = run_bounded(refused, Duration::from_secs(30));
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("--monitor measures allreduces of float"));
}

/// `kungfu-run -w`: a training loop that resizes 2 -> 4 -> 3 -> 1 -> 3.
/// New workers are started by the launcher and learn the step and the
/// model; removed workers are told they are detached and exit cleanly;
/// the model is checked on every worker at every step and after each
/// change; the resize latency is printed.
#[test]
fn elastic_job_resizes_2_4_3_1_3_and_keeps_the_model() {
    // shared memory (auto on one host) and TCP (every version accepts on
    // the socket the launcher passed down, which the worker keeps)
    for transport in ["auto", "tcp"] {
        elastic_job(transport);
    }
}

fn elastic_job(transport: &str) {
    let out = run_bounded(
        kungfu_run(&[
            "-w",
            "-np",
            "2",
            "--transport",
            transport,
            BENCH,
            "resize",
            "--sizes",
            "4,3,1,3",
            "-n",
            "4",
            "-b",
            "64K",
        ]),
        Duration::from_secs(120),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for (from, to, v) in [(2, 4, 1), (4, 3, 2), (3, 1, 3), (1, 3, 4)] {
        let line = format!("[0] # resize {from} -> {to} (version {v}): latency ");
        assert!(t.contains(&line), "no {line:?} in\n{t}");
        let launched = format!("kungfu-run: cluster version {v}: {to} workers");
        assert!(t.contains(&launched), "{t}");
    }
    // 4 -> 3 detaches one worker, 3 -> 1 two more
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

/// Watch mode stops the workers a new version leaves out if they do not
/// exit by themselves (here: shell workers that never resize), without
/// failing the job; the config server takes a plain HTTP PUT.
#[test]
fn watch_mode_stops_removed_workers_that_stay() {
    let dir = TempDir::new("watch-stop");
    // Rank 0 stays until the launcher has stopped the other two: had it
    // exited first, version 1 (rank 0 alone) would be started afresh.
    let script = r#"
if [ "$KUNGFU_RANK" = 0 ] && [ "$KUNGFU_CLUSTER_VERSION" = 0 ]; then
  a=${KUNGFU_CONFIG_SERVER#http://}; a=${a%%/*}
  exec 3<>/dev/tcp/${a%:*}/${a#*:}
  printf 'PUT /cluster HTTP/1.1\r\nContent-Length: 6\r\n\r\nsize 1' >&3
  head -c 12 <&3; echo
  for i in $(seq 600); do
    gone=0
    for r in 1 2; do
      [ -s "$DIR/$r.pid" ] && ! kill -0 "$(cat "$DIR/$r.pid")" 2>/dev/null && gone=$((gone + 1))
    done
    [ "$gone" = 2 ] && { echo "ranks 1 and 2 are gone"; exit 0; }
    sleep 0.05
  done
  echo "ranks 1 and 2 are still running"; exit 1
else
  echo $$ > "$DIR/$KUNGFU_RANK.pid.tmp" && mv "$DIR/$KUNGFU_RANK.pid.tmp" "$DIR/$KUNGFU_RANK.pid"
  exec sleep 60
fi
"#;
    let dir_var = format!("DIR={}", dir.0.display());
    let out = run_bounded(
        kungfu_run(&[
            "-w",
            "-np",
            "3",
            "--detach-timeout",
            "300ms",
            "-x",
            &dir_var,
            "bash",
            "-c",
            script,
        ]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] HTTP/1.1 200"), "{t}");
    assert!(t.contains("[0] ranks 1 and 2 are gone"), "{t}");
    assert!(
        t.contains("kungfu-run: cluster version 1: 1 workers"),
        "{t}"
    );
    for r in [1, 2] {
        assert!(
            t.contains(&format!(
                "rank {r} left the cluster 300ms ago and is still running; stopping it"
            )),
            "{t}"
        );
    }
}

/// A worker that watch mode starts for a new version gets its listening
/// socket from the launcher, as the first ones do: an inherited socket
/// listening at its own port (checked against /proc/net/tcp).
#[test]
fn watch_mode_passes_new_workers_their_sockets() {
    let dir = TempDir::new("watch-grow");
    let script = r#"
if [ "$KUNGFU_CLUSTER_VERSION" = 0 ]; then
  a=${KUNGFU_CONFIG_SERVER#http://}; a=${a%%/*}
  exec 3<>/dev/tcp/${a%:*}/${a#*:}
  printf 'PUT /cluster HTTP/1.1\r\nContent-Length: 6\r\n\r\nsize 2' >&3
  head -c 12 <&3; echo
  # stay until the new worker is done (else version 1 restarts rank 0)
  for i in $(seq 1200); do
    [ -e "$DIR/done" ] && exit 0
    sleep 0.05
  done
  echo "the new worker never finished"; exit 1
fi
fd=${KUNGFU_LISTEN_FD:?no KUNGFU_LISTEN_FD}
ino=$(readlink "/proc/self/fd/$fd"); ino=${ino#socket:[}; ino=${ino%]}
port=$(printf '%04X' "${KUNGFU_PEERS##*:}")
if awk -v p=":$port" -v i="$ino" '$2 ~ p"$" && $4 == "0A" && $10 == i { f = 1 } END { exit !f }' /proc/net/tcp; then
  echo "version $KUNGFU_CLUSTER_VERSION: fd $fd listens at my port"
else
  echo "version $KUNGFU_CLUSTER_VERSION: fd $fd ($ino) is not the socket of port $port"
fi
touch "$DIR/done"
"#;
    let dir_var = format!("DIR={}", dir.0.display());
    let out = run_bounded(
        kungfu_run(&["-w", "-np", "1", "-x", &dir_var, "bash", "-c", script]),
        Duration::from_secs(60),
    );
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("[0] HTTP/1.1 200"), "{t}");
    assert!(
        t.contains("kungfu-run: cluster version 1: 2 workers"),
        "{t}"
    );
    assert!(
        t.contains("] version 1: fd ") && t.contains(" listens at my port"),
        "{t}"
    );
}

/// Many jobs started at once on one machine never share a port, and no
/// port is ever free between the launcher choosing it and the worker
/// listening on it (each worker checks its own at start, with
/// `--check-port`). All workers of every job are alive at the same time
/// (held with `--wait-for`) when their addresses are compared. The old
/// launcher drew a port, checked that it bound and released it: two
/// workers could draw the same one (`peer 2 ("127.0.0.1:17500") appears
/// twice`), and any process could take it before the worker bound it.
#[test]
fn concurrent_jobs_never_share_a_port() {
    const JOBS: usize = 12;
    const NP: usize = 4;
    let dir = TempDir::new("ports");
    let go = dir.0.join("go");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut guard = Guard(Vec::new());
    let mut errs = Vec::new();
    for j in 0..JOBS {
        let mut c = kungfu_run(&[
            "-np",
            "4",
            "--transport",
            "tcp",
            SELFTEST,
            "--steps",
            "2",
            "--size",
            "64",
            "--check-port",
            "--wait-for",
            go.to_str().unwrap(),
        ]);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().expect("spawn kungfu-run");
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        guard.0.push(child);
        let tx = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send((j, l));
            }
        });
        errs.push(std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut BufReader::new(err), &mut s);
            s
        }));
    }
    drop(tx);
    // every worker of every job connected and waiting, with its address
    let mut addrs: Vec<(usize, String)> = Vec::new();
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while addrs.len() < JOBS * NP && Instant::now() < deadline {
        let Ok((j, l)) = rx.recv_timeout(Duration::from_millis(200)) else {
            if guard
                .0
                .iter_mut()
                .any(|c| !matches!(c.try_wait(), Ok(None)))
            {
                break; // a job ended before all were up: its stderr says why
            }
            continue;
        };
        if let Some(a) = l.split("] address ").nth(1) {
            addrs.push((j, a.split(':').take(2).collect::<Vec<_>>().join(":")));
        }
        lines.push(format!("job {j}: {l}"));
    }
    let report = |guard: &mut Guard, errs: Vec<std::thread::JoinHandle<String>>| {
        drop(std::mem::take(&mut guard.0));
        errs.into_iter()
            .enumerate()
            .map(|(j, e)| format!("--- job {j} stderr\n{}", e.join().unwrap_or_default()))
            .collect::<String>()
    };
    if addrs.len() < JOBS * NP {
        let e = report(&mut guard, errs);
        panic!(
            "{} of {} workers came up:\n{}\n{e}",
            addrs.len(),
            JOBS * NP,
            lines.join("\n")
        );
    }
    let mut seen = std::collections::HashMap::new();
    for (j, a) in &addrs {
        if let Some(other) = seen.insert(a.clone(), *j) {
            let e = report(&mut guard, errs);
            panic!("{a} was given to a worker of job {other} and one of job {j}\n{e}");
        }
    }
    std::fs::write(&go, b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut statuses = Vec::new();
    for c in &mut guard.0 {
        let st = loop {
            if let Some(st) = c.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        statuses.push(st);
    }
    let e = report(&mut guard, errs);
    for (j, st) in statuses.iter().enumerate() {
        assert!(
            st.is_some_and(|s| s.success()),
            "job {j} ended with {st:?}\n{e}"
        );
    }
    assert!(
        !e.contains("appears twice") && !e.contains("cannot listen"),
        "{e}"
    );
}
