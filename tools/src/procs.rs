//! The processes of a job: started with their output relayed line by
//! line under a prefix, waited for, and signalled; and the control channel
//! between a launcher and the launchers it starts on other hosts through
//! ssh (their standard input: the job secret, then the names of the
//! signals to forward, one per line; its end means the starting launcher
//! is gone).

use std::io::Write;
use std::os::unix::process::ExitStatusExt;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::Context;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::process::Command;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

pub(crate) const TERM_TO_KILL: Duration = Duration::from_secs(3);
/// Longest line relayed at once; longer lines are split.
const MAX_LINE: u64 = 64 * 1024;

pub(crate) struct Proc {
    pub label: String,
    pub pid: Option<i32>,
    pub alive: bool,
    /// The worker's address (watch mode tracks workers by it).
    pub addr: Option<String>,
    /// Left out of the cluster: when it is stopped if still running, and
    /// the signal it gets then.
    pub removed: Option<(Instant, Signal)>,
    /// Stopped for not leaving when removed: its exit is no failure.
    pub stopped: bool,
    /// Exited with status 0.
    pub succeeded: bool,
    /// The control channel of a launcher on another host (the standard
    /// input of its ssh): signals go there as lines, not to the ssh.
    control: Option<std::fs::File>,
    /// A launcher on another host: whether it is one, and how many
    /// workers it said run there (none said yet: `None`).
    remote: bool,
    /// (live workers, the latest config version it had seen).
    pub remote_live: Option<(usize, u32)>,
}

/// The processes of a job and the tasks that wait for them and relay
/// their output.
pub(crate) struct Job {
    pub procs: Vec<Proc>,
    pub waits: JoinSet<(usize, std::io::Result<ExitStatus>)>,
    pub relays: JoinSet<()>,
    /// What the launchers on other hosts report: (process, live workers).
    status: (Status, Option<mpsc::UnboundedReceiver<Report>>),
}

/// (process, (live workers, config version)), as a remote launcher reports.
type Report = (usize, (usize, u32));
type Status = mpsc::UnboundedSender<Report>;

impl Default for Job {
    fn default() -> Job {
        let (tx, rx) = mpsc::unbounded_channel();
        Job {
            procs: Vec::new(),
            waits: JoinSet::new(),
            relays: JoinSet::new(),
            status: (tx, Some(rx)),
        }
    }
}

impl Job {
    /// Starts `cmd` as a process of the job, its output relayed line by
    /// line under `prefix`. With `secret`, `cmd` is a launcher on another
    /// host (ssh): it gets the secret as the first line of its standard
    /// input, which then stays open as its control channel (see
    /// [`signal_all`]) until it exits.
    pub fn spawn(
        &mut self,
        mut cmd: Command,
        label: String,
        prefix: String,
        addr: Option<String>,
        secret: Option<&str>,
    ) -> anyhow::Result<()> {
        cmd.stdin(if secret.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
        let mut child = cmd.spawn().with_context(|| format!("starting {label}"))?;
        let control = match (secret, child.stdin.take()) {
            (Some(secret), Some(stdin)) => {
                let mut pipe = std::fs::File::from(
                    stdin
                        .into_owned_fd()
                        .context("the standard input of a remote launcher")?,
                );
                // a few bytes into an empty pipe: never blocks
                pipe.write_all(format!("{secret}\n").as_bytes())
                    .with_context(|| format!("writing to {label}"))?;
                Some(pipe)
            }
            _ => None,
        };
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let idx = self.procs.len();
        let status = secret.map(|_| (idx, self.status.0.clone()));
        self.relays.spawn(relay(out, prefix.clone(), false, status));
        self.relays.spawn(relay(err, prefix, true, None));
        self.procs.push(Proc {
            label,
            pid: child.id().map(|p| p as i32),
            alive: true,
            addr,
            removed: None,
            stopped: false,
            succeeded: false,
            remote: control.is_some(),
            control,
            remote_live: None,
        });
        self.waits.spawn(async move { (idx, child.wait().await) });
        Ok(())
    }

    /// When the next removed worker is due to be signalled.
    pub fn next_removal(&self) -> Option<Instant> {
        self.procs
            .iter()
            .filter(|p| p.alive)
            .filter_map(|p| p.removed.map(|(at, _)| at))
            .min()
    }

    /// What the launchers on other hosts report (once; see
    /// [`report_live`]).
    pub fn take_status(&mut self) -> mpsc::UnboundedReceiver<Report> {
        self.status.1.take().expect("taken once")
    }

    /// How many workers of this host run.
    pub fn live_workers(&self) -> usize {
        self.procs.iter().filter(|p| p.alive && !p.remote).count()
    }

    /// Whether some launcher of another host runs, and each that does has
    /// said that none of its workers runs, having seen config `version`
    /// (so that one about to start the workers of a new version is not
    /// taken for idle).
    pub fn remotes_idle(&self, version: u32) -> bool {
        let mut remotes = self.procs.iter().filter(|p| p.alive && p.remote).peekable();
        remotes.peek().is_some()
            && remotes.all(|p| p.remote_live.is_some_and(|(n, v)| n == 0 && v >= version))
    }

    /// Closes the control channels: the launchers of the other hosts stop
    /// (their workers too, if any still runs) and exit.
    /// Their exit is then no failure, whatever it is (their ssh may be
    /// killed if they take too long).
    pub fn close_controls(&mut self) {
        for p in self.procs.iter_mut().filter(|p| p.remote) {
            p.control = None;
            p.stopped = true;
        }
    }

    /// Whether the cluster `peers` names a worker of this launcher that
    /// has exited: a config the survivors decided before they knew of
    /// every loss (they recover from it again).
    pub fn has_exited_member(&self, peers: &kungfu_topology::PeerList) -> bool {
        peers.peers().iter().any(|peer| {
            let addr = peer.to_string();
            self.procs
                .iter()
                .any(|p| !p.alive && !p.remote && p.addr.as_deref() == Some(addr.as_str()))
        })
    }

    /// Whether process `idx` is a launcher of another host.
    pub fn is_remote(&self, idx: usize) -> bool {
        self.procs[idx].remote
    }

    /// Whether this launcher started a worker at `addr` in this job,
    /// running or ended. The config server and etcd never give an address
    /// to two workers of a job, so a listed address whose worker has ended
    /// is still that worker's: a launcher that sees a version only after
    /// its own worker there finished must not start another at it (that
    /// one would look for peers that are gone).
    pub fn started(&self, addr: &str) -> bool {
        self.procs.iter().any(|p| p.addr.as_deref() == Some(addr))
    }
}

pub(crate) fn describe(status: &ExitStatus) -> (String, i32) {
    if let Some(code) = status.code() {
        (format!("exited with status {code}"), code)
    } else if let Some(sig) = status.signal() {
        let name = Signal::try_from(sig)
            .map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_string());
        (format!("was killed by signal {sig} ({name})"), 128 + sig)
    } else {
        ("ended in an unknown way".into(), 1)
    }
}

/// The mark of a launcher's report line (see [`report_live`]): it starts
/// with a control character, so that no worker's line is taken for one.
const STATUS_MARK: &str = "\u{1}kungfu-run live ";

/// Says, on standard output (which reaches the launcher that started this
/// one through ssh), how many workers of this host run, and the latest
/// config version it has handled.
pub(crate) fn report_live(n: usize, version: u32) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{STATUS_MARK}{n} {version}").and_then(|_| o.flush());
}

/// Relays the lines of `pipe` under `prefix`; with `status`, a launcher's
/// output, whose reports go to `status` instead, with its index.
async fn relay<R: AsyncRead + Unpin>(
    pipe: R,
    prefix: String,
    to_stderr: bool,
    status: Option<(usize, Status)>,
) {
    let mut r = BufReader::new(pipe);
    let mut line = Vec::new();
    loop {
        line.clear();
        match (&mut r).take(MAX_LINE).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if let Some((idx, tx)) = &status {
                    let text = String::from_utf8_lossy(&line);
                    if let Some(report) = text.strip_prefix(STATUS_MARK) {
                        let mut f = report.split_whitespace().map(str::parse::<u64>);
                        if let (Some(Ok(n)), Some(Ok(v))) = (f.next(), f.next()) {
                            let v = u32::try_from(v).unwrap_or(u32::MAX);
                            let _ = tx.send((*idx, (n as usize, v)));
                        }
                        continue;
                    }
                }
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                let res = if to_stderr {
                    let mut e = std::io::stderr().lock();
                    e.write_all(prefix.as_bytes())
                        .and_then(|_| e.write_all(&line))
                } else {
                    let mut o = std::io::stdout().lock();
                    o.write_all(prefix.as_bytes())
                        .and_then(|_| o.write_all(&line))
                        .and_then(|_| o.flush())
                };
                if res.is_err() {
                    return;
                }
            }
        }
    }
}

/// Sends `sig` to every live process of `procs` (to its whole process
/// group: a worker's children get it too). A launcher on another host gets
/// it as a line on its control channel instead, and forwards it to its
/// own workers: signalling its ssh would only cut the connection. SIGKILL
/// alone goes to the ssh itself (the last resort must not depend on the
/// other host): the launcher there sees its channel close and stops its
/// workers in turn.
pub(crate) fn signal_all(procs: &[Proc], sig: Signal) {
    for p in procs.iter().filter(|p| p.alive) {
        if let (Some(mut c), true) = (p.control.as_ref(), sig != Signal::SIGKILL) {
            // the peer may be gone already: its exit is reported anyway
            let _ = c.write_all(format!("{}\n", sig.as_str()).as_bytes());
        } else if let Some(pid) = p.pid {
            // It may have exited in the meantime: ignore.
            let _ = killpg(Pid::from_raw(pid), sig);
        }
    }
}

/// What the control channel of a launcher started through ssh says.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Control {
    /// Forward this signal to the workers.
    Signal(Signal),
    /// The channel closed: the launcher that started this one is gone.
    Gone,
}

/// Parses a line of the control channel: the name of a signal the
/// launcher forwards (`SIGINT`, `SIGTERM` or `SIGHUP`).
pub(crate) fn control_line(line: &str) -> Option<Signal> {
    match line.trim() {
        "SIGINT" => Some(Signal::SIGINT),
        "SIGTERM" => Some(Signal::SIGTERM),
        "SIGHUP" => Some(Signal::SIGHUP),
        _ => None,
    }
}

/// Reads the control channel (this process's standard input, after the
/// secret line `--secret-stdin` took) on a thread of its own, as messages.
pub(crate) fn control_channel() -> tokio::sync::mpsc::UnboundedReceiver<Control> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let read = move || {
        use std::io::BufRead;
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { break };
            match control_line(&line) {
                Some(sig) => {
                    if tx.send(Control::Signal(sig)).is_err() {
                        return;
                    }
                }
                None => eprintln!("kungfu-run: ignoring {line:?} on the control channel"),
            }
        }
        let _ = tx.send(Control::Gone);
    };
    if let Err(e) = std::thread::Builder::new()
        .name("kungfu-run-control".into())
        .spawn(read)
    {
        eprintln!("kungfu-run: cannot read the control channel: {e}");
    }
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_lines() {
        assert_eq!(control_line("SIGTERM"), Some(Signal::SIGTERM));
        assert_eq!(control_line("SIGINT\r"), Some(Signal::SIGINT));
        assert_eq!(control_line(Signal::SIGHUP.as_str()), Some(Signal::SIGHUP));
        // no remote kill through the channel: that is the ssh's death
        assert_eq!(control_line("SIGKILL"), None);
        assert_eq!(control_line("rm -rf /"), None);
    }

    #[test]
    fn statuses() {
        assert_eq!(
            describe(&ExitStatus::from_raw(3 << 8)),
            ("exited with status 3".into(), 3)
        );
        let (what, code) = describe(&ExitStatus::from_raw(9));
        assert_eq!(code, 137);
        assert!(what.contains("SIGKILL"), "{what}");
    }
}
