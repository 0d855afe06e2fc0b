//! Shared by the multi-process test binaries of kungfu-tools (included
//! with `#[path]`): running a command under a deadline.

use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Runs a command to completion within `limit`.
pub fn run_bounded(mut cmd: Command, limit: Duration) -> Output {
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
