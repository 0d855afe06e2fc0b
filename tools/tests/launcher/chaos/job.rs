//! The chaos test's view of its job: kungfu-run and its workers, every
//! line they print (parsed once), and the processes the driver may signal.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// One line of the job's output.
pub struct Line {
    /// The launcher's label of the worker that printed it (`2` of `[2] `),
    /// if a worker did. A replacement gets its rank's label, so labels
    /// collide: the stamp's pid tells workers apart.
    pub label: Option<String>,
    /// With kungfu-selftest's `--stamp`: its unix time in ms, and its pid.
    pub stamp: Option<(u64, i32)>,
    /// The text after label and stamp.
    pub msg: String,
}

impl Line {
    fn parse(raw: &str) -> Line {
        let (label, rest) = match raw.strip_prefix('[').and_then(|r| r.split_once("] ")) {
            Some((l, rest)) => (Some(l.trim().to_string()), rest),
            None => (None, raw),
        };
        let stamp = rest.split_once(" pid ").and_then(|(t, r)| {
            let (pid, msg) = r.split_once(": ")?;
            Some((t.parse().ok()?, pid.parse().ok()?, msg))
        });
        match stamp {
            Some((t, pid, msg)) => Line {
                label,
                stamp: Some((t, pid)),
                msg: msg.to_string(),
            },
            None => Line {
                label,
                stamp: None,
                msg: rest.to_string(),
            },
        }
    }

    pub fn pid(&self) -> Option<i32> {
        self.stamp.map(|s| s.1)
    }

    /// `N` of `step N ok`.
    fn ok_step(&self) -> Option<u64> {
        self.msg
            .strip_prefix("step ")?
            .strip_suffix(" ok")?
            .parse()
            .ok()
    }
}

/// A worker process the job started, as it said at start.
pub struct Worker {
    pub pid: i32,
    pub addr: String,
    pub label: String,
    /// Its start time (/proc), so that a pid the kernel gave to another
    /// process since is never signalled.
    start: u64,
}

impl Worker {
    pub fn alive(&self) -> bool {
        proc_start(self.pid) == Some(self.start)
    }

    /// Sends `sig` if this is still the process the job started.
    pub fn signal(&self, sig: Signal) -> bool {
        self.alive() && kill(Pid::from_raw(self.pid), sig).is_ok()
    }
}

/// The start time of a live (not zombie) process `pid`, from
/// /proc/PID/stat.
fn proc_start(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // the command may hold spaces and parentheses: fields after the last ')'
    let after = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // f[0] is field 3 (the state), f[19] field 22 (the start time)
    (f.first()? != &"Z").then_some(())?;
    f.get(19)?.parse().ok()
}

/// The unix time in milliseconds, as the workers stamp it.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// kungfu-run, its output, and what it says about the workers.
pub struct Job {
    child: Option<Child>,
    rx: mpsc::Receiver<String>,
    /// Every line but the `step N ok` ones.
    pub lines: Vec<Line>,
    pub workers: Vec<Worker>,
    /// The cluster size of the last config kungfu-run announced.
    pub size: usize,
    /// Per pid, where its last `step N ok` line came (the index the next
    /// kept line gets), and N.
    last_ok: HashMap<i32, (usize, u64)>,
}

impl Job {
    /// Starts `cmd` (kungfu-run) with its output read line by line.
    pub fn start(mut cmd: Command, size: usize) -> Job {
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn kungfu-run");
        let (tx, rx) = mpsc::channel();
        let out: [Box<dyn std::io::Read + Send>; 2] = [
            Box::new(child.stdout.take().expect("piped")),
            Box::new(child.stderr.take().expect("piped")),
        ];
        for s in out {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in BufReader::new(s).lines().map_while(Result::ok) {
                    let _ = tx.send(l);
                }
            });
        }
        Job {
            child: Some(child),
            rx,
            lines: Vec::new(),
            workers: Vec::new(),
            size,
            last_ok: HashMap::new(),
        }
    }

    /// Takes in what the job printed for up to `d`.
    pub fn pump(&mut self, d: Duration) {
        let end = Instant::now() + d;
        while let Ok(raw) = self
            .rx
            .recv_timeout(end.saturating_duration_since(Instant::now()))
        {
            self.take(Line::parse(&raw));
            if Instant::now() >= end {
                break;
            }
        }
    }

    fn take(&mut self, l: Line) {
        let i = self.lines.len();
        if let Some(n) = l
            .msg
            .strip_prefix("kungfu-run: cluster version ")
            .and_then(|r| r.split(": ").nth(1)?.strip_suffix(" workers")?.parse().ok())
        {
            self.size = n;
        }
        if let (Some(pid), Some(label)) = (l.pid(), &l.label) {
            if let Some(addr) = l
                .msg
                .split(" address ")
                .nth(1)
                .filter(|_| l.msg.starts_with("pid "))
            {
                if let Some(start) = proc_start(pid) {
                    self.workers.push(Worker {
                        pid,
                        addr: addr.to_string(),
                        label: label.clone(),
                        start,
                    });
                }
            }
            if let Some(step) = l.ok_step() {
                // not kept: most lines are these, and a soak runs for hours
                self.last_ok.insert(pid, (i, step));
                return;
            }
        }
        self.lines.push(l);
    }

    /// Pumps until `done` holds (true) or `limit` passes (false).
    pub fn wait(&mut self, limit: Duration, done: impl Fn(&Job) -> bool) -> bool {
        let end = Instant::now() + limit;
        loop {
            if done(self) {
                return true;
            }
            if Instant::now() >= end {
                return false;
            }
            self.pump(Duration::from_millis(50));
        }
    }

    /// The first line from index `from` on that `f` accepts.
    pub fn find(&self, from: usize, f: impl Fn(&Line) -> bool) -> Option<&Line> {
        self.lines[from.min(self.lines.len())..]
            .iter()
            .find(|l| f(l))
    }

    pub fn worker(&self, pid: i32) -> Option<&Worker> {
        self.workers.iter().rev().find(|w| w.pid == pid)
    }

    /// The live workers that finished a step (printed `step N ok`) after
    /// line `from`: the cluster's members, as far as one can tell.
    pub fn training_since(&self, from: usize) -> Vec<&Worker> {
        self.workers
            .iter()
            .filter(|w| self.last_ok.get(&w.pid).is_some_and(|&(i, _)| i >= from) && w.alive())
            .collect()
    }

    /// The cluster is whole and trains: kungfu-run's last config has
    /// `np` workers and `np` live workers finished a step after line
    /// `from`.
    pub fn healthy_since(&self, from: usize, np: usize) -> bool {
        self.size == np && self.training_since(from).len() >= np
    }

    /// The highest step any worker finished.
    pub fn step(&self) -> u64 {
        self.last_ok.values().map(|&(_, s)| s).max().unwrap_or(0)
    }

    /// Waits up to `limit` for kungfu-run to exit; its status.
    pub fn exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            self.pump(Duration::from_millis(100));
            let c = self.child.as_mut()?;
            if let Ok(Some(st)) = c.try_wait() {
                self.pump(Duration::from_millis(500));
                return Some(st);
            }
        }
        None
    }

    /// The last `n` lines (the steps that went well are not kept).
    pub fn story(&self, n: usize) -> String {
        let keep: Vec<String> = self
            .lines
            .iter()
            .map(|l| {
                let who = l
                    .label
                    .as_deref()
                    .map(|w| format!("[{w}] "))
                    .unwrap_or_default();
                let t = l
                    .stamp
                    .map(|(t, p)| format!("{t} pid {p}: "))
                    .unwrap_or_default();
                format!("{who}{t}{}", l.msg)
            })
            .collect();
        keep[keep.len().saturating_sub(n)..].join("\n")
    }
}

impl Drop for Job {
    /// Every process is gone, even when the test failed: stopped workers
    /// are continued (a stopped process does not act on SIGTERM),
    /// kungfu-run is stopped (SIGTERM, which it passes on to its workers
    /// and follows with SIGKILL 3 s later; SIGKILL after 8 s), and any
    /// worker still running is killed.
    fn drop(&mut self) {
        for w in &self.workers {
            w.signal(Signal::SIGCONT);
        }
        if let Some(c) = self.child.take() {
            drop(crate::Guard(vec![c]));
        }
        for w in &self.workers {
            w.signal(Signal::SIGKILL);
        }
    }
}
