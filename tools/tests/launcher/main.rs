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

#[path = "../common/bounded.rs"]
mod bounded;
use bounded::run_bounded;
#[path = "../common/resize.rs"]
mod resize;
use resize::assert_resized_2_4_3_1_3;

mod auth;
mod bench;
mod chaos;
mod cli;
mod elastic;
mod failures;
mod jobs;
mod ports;
mod recover;

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
