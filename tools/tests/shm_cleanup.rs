//! Nothing of a shared-memory job is left in `/dev/shm`, however it ends:
//! a worker killed at each stage of connection set-up and after it, a
//! worker that hangs while the job times out, and a SIGINT to kungfu-run.
//!
//! The stages are reached deterministically: `KUNGFU_TEST_SHM_STOP`
//! (see `kungfu_transport::shm`, "Testing hooks") makes rank 1 kill itself
//! or hang at a named point, and prints a line there that the tests wait
//! for. Each job has a cluster id of its own, and only files of that id
//! are looked at, so the tests may run in parallel with anything.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kungfu_transport::shm::{remove_cluster_files, ring_file_prefix, RING_DIR, TEST_STOP_VAR};

const RUN: &str = env!("CARGO_BIN_EXE_kungfu-run");
const SELFTEST: &str = env!("CARGO_BIN_EXE_kungfu-selftest");

/// A cluster id no other job uses: ring files are named by it.
fn unique_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let salt = [
        std::process::id().to_le_bytes().as_slice(),
        &NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes(),
    ]
    .concat();
    kungfu_topology::fnv1a64(now, &salt)
}

/// This job's ring files in `/dev/shm`.
fn files_of(id: u64) -> Vec<String> {
    let prefix = ring_file_prefix(id);
    let mut v: Vec<String> = std::fs::read_dir(RING_DIR)
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Removes the job's files when the test ends, failed or not (after it
/// has looked at them), so a failing run leaves nothing either.
struct Sweep(u64);

impl Drop for Sweep {
    fn drop(&mut self) {
        let _ = remove_cluster_files(Path::new(RING_DIR), self.0);
    }
}

/// kungfu-run, stopped (SIGTERM, which it forwards to the workers, then
/// SIGKILL) if the test ends while it runs.
struct Job {
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Drop for Job {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let t = Instant::now();
            while t.elapsed() < Duration::from_secs(8) {
                if !matches!(self.child.try_wait(), Ok(None)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Job {
    /// Three shm workers of cluster `id`; rank 1 stops as `stop` says
    /// (`ACTION:STAGE:1`).
    fn start(id: u64, stop: &str, launcher: &[&str]) -> Job {
        let mut c = Command::new(RUN);
        let id_hex = format!("{id:x}");
        let stop_var = format!("{TEST_STOP_VAR}={stop}");
        c.args(["--cluster-id", &id_hex, "-np", "3", "--transport", "shm"])
            .args(launcher)
            .args(["-x", &stop_var])
            // the survivors wait in connect for longer than any test
            .args(["-x", "KUNGFU_CONNECT_TIMEOUT_MS=120000"])
            .args([SELFTEST, "--steps", "20", "--size", "1024"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().expect("start kungfu-run");
        let (tx, lines) = mpsc::channel();
        for pipe in [
            Box::new(child.stdout.take().expect("piped")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("piped")),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
        }
        Job {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    fn output(&self) -> String {
        self.seen.join("\n")
    }

    /// Waits for a line containing `what`.
    fn wait_for(&mut self, what: &str, deadline: Instant) {
        while !self.seen.iter().any(|l| l.contains(what)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!("no line with {what:?} in time:\n{}", self.output()),
            }
        }
    }

    /// Waits for kungfu-run to exit, then for the rest of its output.
    fn finish(&mut self, deadline: Instant) -> ExitStatus {
        let status = loop {
            if let Some(st) = self.child.try_wait().expect("wait") {
                break st;
            }
            assert!(
                Instant::now() < deadline,
                "kungfu-run still running:\n{}",
                self.output()
            );
            // the output is collected meanwhile
            if let Ok(l) = self.lines.recv_timeout(Duration::from_millis(50)) {
                self.seen.push(l);
            }
        };
        // the relay threads end with the pipes
        while let Ok(l) = self.lines.recv_timeout(Duration::from_secs(10)) {
            self.seen.push(l);
        }
        status
    }
}

fn marker(action: &str, stage: &str) -> String {
    format!("[1] kungfu-shm test hook: rank 1 {action} at {stage}")
}

/// Rank 1 kills itself (SIGKILL, no destructor runs) at `stage`; the job
/// fails, and nothing of it is left in /dev/shm.
fn killed_at(stage: &str) {
    let id = unique_id();
    let _sweep = Sweep(id);
    // Before connecting, the survivors wait in connect until kungfu-run
    // stops them (SIGTERM: they die without cleaning up); afterwards their
    // ops fail on the lost rank and they exit by themselves.
    let grace = if matches!(stage, "connected" | "sent") {
        "30s"
    } else {
        "1s"
    };
    let stop = format!("kill:{stage}:1");
    let mut job = Job::start(id, &stop, &["--timeout", "120s", "--grace", grace]);
    let status = job.finish(Instant::now() + Duration::from_secs(150));
    let out = job.output();
    assert!(!status.success(), "{out}");
    assert!(out.contains(&marker("is killed", stage)), "{out}");
    assert!(
        out.contains("kungfu-run: rank 1 was killed by signal 9 (SIGKILL)"),
        "{out}"
    );
    let left = files_of(id);
    assert!(left.is_empty(), "left behind: {left:?}\n{out}");
    if matches!(stage, "connected" | "sent") {
        // once connected the workers unlinked every ring themselves
        assert!(!out.contains("kungfu-run: removed"), "{out}");
    }
}

#[test]
fn a_worker_killed_before_connecting_leaves_nothing() {
    killed_at("start");
}

#[test]
fn a_worker_killed_while_creating_its_rings_leaves_nothing() {
    killed_at("created");
}

#[test]
fn a_worker_killed_while_attaching_leaves_nothing() {
    killed_at("opened");
}

#[test]
fn a_worker_killed_once_connected_leaves_nothing() {
    killed_at("connected");
}

#[test]
fn a_worker_killed_mid_op_leaves_nothing() {
    killed_at("sent");
}

/// Waits until rank 1 hangs at `stage`, and checks that the job's ring
/// files are there while it runs, under the name looked for after it (else
/// the test would check nothing).
fn hung_with_files(job: &mut Job, id: u64, stage: &str) {
    job.wait_for(
        &marker("hangs", stage),
        Instant::now() + Duration::from_secs(60),
    );
    let during = files_of(id);
    assert!(
        !during.is_empty(),
        "no ring file of the job while it runs\n{}",
        job.output()
    );
}

/// A worker hangs in set-up until the job's timeout stops everything.
#[test]
fn a_job_that_times_out_while_connecting_leaves_nothing() {
    let id = unique_id();
    let _sweep = Sweep(id);
    let mut job = Job::start(id, "hang:opened:1", &["--timeout", "5s"]);
    hung_with_files(&mut job, id, "opened");
    let status = job.finish(Instant::now() + Duration::from_secs(60));
    let out = job.output();
    assert_eq!(status.code(), Some(124), "{out}");
    assert!(out.contains(&marker("hangs", "opened")), "{out}");
    assert!(out.contains("the job did not finish within 5s"), "{out}");
    let left = files_of(id);
    assert!(left.is_empty(), "left behind: {left:?}\n{out}");
}

/// kungfu-run is interrupted while a worker hangs in set-up: it forwards
/// SIGINT, the workers die of it, and it cleans up after them.
#[test]
fn an_interrupted_job_leaves_nothing() {
    let id = unique_id();
    let _sweep = Sweep(id);
    let mut job = Job::start(id, "hang:created:1", &["--timeout", "120s"]);
    hung_with_files(&mut job, id, "created");
    let pid = nix::unistd::Pid::from_raw(job.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let status = job.finish(Instant::now() + Duration::from_secs(60));
    let out = job.output();
    assert_eq!(status.code(), Some(130), "{out}");
    assert!(out.contains("kungfu-run: interrupted"), "{out}");
    let left = files_of(id);
    assert!(left.is_empty(), "left behind: {left:?}\n{out}");
}
