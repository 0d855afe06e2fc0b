//! The chaos test: a 4-worker training loop (kungfu-selftest: exact
//! integer sums checked every step, the model's digest agreed by
//! consensus every step, exit 4 on a wrong value) runs under
//! `kungfu-run --on-failure replace` over TCP while a driver with a
//! seeded RNG (the seed is printed; `CHAOS_SEED` replays one) does, one
//! at a time, in shuffled rounds:
//! - `kill`: SIGKILL a worker;
//! - `freeze`: SIGSTOP a worker until the others have recovered without
//!   it (longer than the peer timeout), then SIGCONT: it must be refused
//!   (`left out of the cluster`) and exit, never rejoin;
//! - `pause`: SIGSTOP for 200-600 ms, well under the peer timeout: a
//!   delay that must pass without any recovery;
//! - `delay`: hold every outgoing frame of a worker for 700 ms (SIGUSR2
//!   under `KUNGFU_FAULTS`, transport/src/tcp/faults.rs): a stalled
//!   network, which must also pass without any recovery;
//! - `drop`: drop one connection of a worker (SIGUSR1 under
//!   `KUNGFU_FAULTS`: shut down both ways, as a reset would): both ends
//!   lose each other (the end that cut tells the other peers, as it
//!   tells of any loss but a clean close), and the recovery must leave
//!   out exactly one of them (whichever end, or peer that heard of it,
//!   proposed first);
//! - `garbage`: connect to a worker's listening port and write random
//!   bytes, a truncated hello (left open) or a forged hello. A worker
//!   accepts only while it connects a cluster version, so these wait in
//!   its backlog and are read (and refused, with a log line) when it next
//!   connects one; meanwhile they must cost nothing. The other faults
//!   are aimed at workers holding none where possible, and before the
//!   end, if some is still unread, the driver kills a worker that holds
//!   none, so that the others connect a version and read theirs.
//!
//! Why replace rather than shrink: the cluster stays at 4, so any fault
//! may come at any time for as long as the test runs, and each recovery
//! is followed by a scale-out (the replacement joins), which is a
//! membership change of its own worth testing under fire. Why TCP: the
//! fault wrapper sits on its writer (shared memory, the default on one
//! host, is covered by the other launcher tests). Why signals and a
//! wrapper for delays and drops: peers dial the addresses in the cluster
//! config, so a proxy would have to be in the config (every replacement
//! too); the wrapper is off unless `KUNGFU_FAULTS` is set, and the driver
//! aims it at a process and a moment as it aims SIGKILL. A delay is all
//! of one worker's outgoing links stalling at once (its own host's
//! network); a drop is one link reset. Neither is a partition that lets
//! some bytes through, nor a link that goes silent without a reset (the
//! freeze stands for silence).
//!
//! Between two faults the driver waits until the cluster is whole again
//! (kungfu-run's config has 4 workers and 4 live workers finished a step
//! since), each wait bounded: one that runs out is a hang, and fails the
//! test. It counts faults injected (the signal was delivered; for delay
//! and drop, the worker logged that it acted), detected (kill, freeze,
//! drop: a survivor reported the loss; garbage: the worker logged the
//! refusal; pause and delay must not be detected) and survived (whole and
//! training again, with no recovery where none is due, and nothing else
//! failed meanwhile). Faults come one at a time: two at once (a kill
//! during a recovery) are not tried. At the end it
//! stops the run (`--stop-file`: the workers agree to stop at one step),
//! and checks that the workers finished and kungfu-run exited 0; that
//! every worker failure kungfu-run reported was a victim's (under
//! `replace` it exits 0 even if a survivor failed); that each recovery
//! names exactly its fault's victim; that every kind dealt was injected
//! at least once (past the run's time, the missing kinds are dealt, for
//! at most 90 s); that every garbage connection was refused (but those
//! to a worker that was a victim before it read them); that no op returned a wrong
//! value (no exit 4, no selftest message of one); and that after every
//! recovery the survivors' model digests at their first good step are
//! identical (the selftest prints them; the consensus of every step
//! checks them too). It prints the counts, the detection time after
//! SIGKILL and after SIGSTOP (from the signal to the first survivor's
//! report, median and max; the goal is under 2 s at default settings)
//! and the recovery time to the first good step after a shrink.
//!
//! `CHAOS_SECS` (default 30; at least one fault of each kind) is how long faults go on; `CHAOS_FAULTS`
//! (comma-separated names) picks the kinds; `CHAOS_LOG=PATH` keeps every
//! line but the good steps. `scripts/chaos.sh` runs a long soak. Every
//! process is bounded: waits have limits, kungfu-run has
//! `--timeout`, and [`job::Job`]'s drop continues, stops and kills
//! whatever the test started, even when it fails.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::TcpStream;

use nix::sys::signal::Signal;

use super::*;

mod checks;
mod job;
use job::{unix_ms, Job, Line};

const NP: usize = 4;
/// The default `KUNGFU_PEER_TIMEOUT_MS`, which the job runs with.
const PEER_TIMEOUT: Duration = Duration::from_millis(1500);
/// How long SIGUSR2 holds a worker's outgoing frames.
const DELAY: Duration = Duration::from_millis(700);
/// The bound of a wait for a loss to be reported.
const DETECT: Duration = Duration::from_secs(15);
/// The bound of a wait for the cluster to be whole and training again.
const HEAL: Duration = Duration::from_secs(45);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Kill,
    Freeze,
    Pause,
    Delay,
    Drop,
    Garbage,
}

impl Fault {
    const ALL: [Fault; 6] = [
        Fault::Kill,
        Fault::Freeze,
        Fault::Pause,
        Fault::Delay,
        Fault::Drop,
        Fault::Garbage,
    ];

    fn name(self) -> &'static str {
        match self {
            Fault::Kill => "kill",
            Fault::Freeze => "freeze",
            Fault::Pause => "pause",
            Fault::Delay => "delay",
            Fault::Drop => "drop",
            Fault::Garbage => "garbage",
        }
    }
}

/// SplitMix64: small, seeded, good enough to pick faults.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo + 1))
    }
}

#[derive(Default)]
struct Tally {
    injected: usize,
    detected: usize,
    survived: usize,
}

/// What the run measured.
#[derive(Default)]
struct Figures {
    tally: BTreeMap<Fault, Tally>,
    /// Signal to the first survivor's report of the loss, ms.
    detect: BTreeMap<Fault, Vec<u64>>,
    /// The loss seen to the first good step after the shrink (the
    /// slowest survivor's, as it measured), ms.
    recovery: Vec<u64>,
    /// Frozen workers refused when they ran again.
    refused: usize,
    /// The garbage connections: local port, the target's pid, and the
    /// line from which it was sent.
    garbage: Vec<(u16, i32, usize)>,
    /// Where each fault began (a line index), its kind, the address of
    /// the worker aimed at, and its victims: the aimed worker for kill and
    /// freeze; for a drop, whom its recovery lost (an end of the cut link,
    /// or both: each end loses the other); none for pause, delay and
    /// garbage.
    spans: Vec<(usize, Fault, String, Vec<String>)>,
    /// The kinds dealt.
    dealt: BTreeSet<Fault>,
    /// What went wrong; the test fails if anything did.
    failures: Vec<String>,
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} does not parse")),
        Err(_) => default,
    }
}

/// The faults of `CHAOS_FAULTS`, or `default`.
fn kinds(default: &[Fault]) -> Vec<Fault> {
    let Ok(v) = std::env::var("CHAOS_FAULTS") else {
        return default.to_vec();
    };
    v.split(',')
        .map(|n| {
            *Fault::ALL
                .iter()
                .find(|f| f.name() == n.trim())
                .unwrap_or_else(|| panic!("CHAOS_FAULTS: unknown fault {n:?}"))
        })
        .collect()
}

struct Driver {
    seed: u64,
    job: Job,
    rng: Rng,
    fig: Figures,
    /// The garbage connections, open until the end.
    sockets: Vec<TcpStream>,
    /// What the fault being injected did, printed after it.
    notes: Vec<String>,
    /// When the fault being injected began.
    began: Instant,
    /// How many failures there were when it began: it survived only if
    /// it added none.
    failed_before: usize,
    /// The line where the last fault began: a worker aimed at must have
    /// trained since (one the recovery left out may live on for a moment
    /// until it learns so, and is no member to aim at).
    last_fault: usize,
}

impl Driver {
    /// A worker to aim at: a member picked at random, among those that
    /// hold no unread garbage if there are any (so that garbage is read
    /// rather than lost with its worker).
    fn victim(&mut self, since: usize) -> Option<(i32, String, String)> {
        let pending = self.unread_garbage();
        let mut m: Vec<(i32, String, String)> = self
            .job
            .training_since(since)
            .iter()
            .map(|w| (w.pid, w.addr.clone(), w.label.clone()))
            .collect();
        if m.iter().any(|w| !pending.contains(&w.0)) {
            m.retain(|w| !pending.contains(&w.0));
        }
        let i = self.rng.below(m.len());
        m.into_iter().nth(i)
    }

    /// The workers holding garbage not read yet.
    fn unread_garbage(&self) -> BTreeSet<i32> {
        self.fig
            .garbage
            .iter()
            .filter(|g| !self.garbage_read(g) && !self.garbage_gone(g))
            .map(|g| g.1)
            .collect()
    }

    fn fail(&mut self, what: String) {
        eprintln!("chaos: FAILED: {what}");
        self.fig.failures.push(what);
    }

    /// Waits until the cluster is whole and trains again after line
    /// `from`; false (a failure) if it does not within [`HEAL`].
    fn heal(&mut self, f: Fault, from: usize) -> bool {
        if self.job.wait(HEAL, |j| j.healthy_since(from, NP)) {
            if self.fig.failures.len() == self.failed_before {
                self.fig.tally.entry(f).or_default().survived += 1;
            }
            let whole = self.began.elapsed().as_secs_f64();
            self.notes.push(format!(
                "{NP} workers training again {whole:.1} s after it began"
            ));
            return true;
        }
        let (size, n) = (self.job.size, self.job.training_since(from).len());
        self.fail(format!(
            "{}: not whole again within {HEAL:?} (a hang): the config has {size} workers, \
             {n} trained since",
            f.name()
        ));
        false
    }

    /// Watches for `d`: no survivor may start a recovery after line
    /// `from` (a pause, a delay or garbage must cost nothing).
    fn no_recovery(&mut self, f: Fault, from: usize, d: Duration) -> bool {
        self.job.pump(d);
        match self.job.find(from, |l| l.msg.ends_with("; recovering")) {
            Some(l) => {
                let what = format!("{}: a recovery that was not due: {}", f.name(), l.msg);
                self.fail(what);
                false
            }
            None => true,
        }
    }

    /// A survivor (not `victim`) reports the loss after line `from`;
    /// returns the ms from `sent` (unix ms) to its report.
    fn detected(&mut self, f: Fault, from: usize, victim: i32, sent: u64) -> Option<u64> {
        let reported = |l: &Line| l.pid() != Some(victim) && l.msg.ends_with("; recovering");
        if !self.job.wait(DETECT, |j| j.find(from, reported).is_some()) {
            self.fail(format!(
                "{}: no survivor reported the loss within {DETECT:?}",
                f.name()
            ));
            return None;
        }
        let t = self
            .job
            .find(from, reported)
            .and_then(|l| l.stamp)
            .map(|s| s.0)?;
        self.fig.tally.entry(f).or_default().detected += 1;
        let ms = t.saturating_sub(sent);
        self.notes
            .push(format!("loss reported {ms} ms after the fault"));
        Some(ms)
    }

    /// After a loss reported after line `from`: the survivors' recovery
    /// names `addr` among the lost (if given), and the slowest survivor's
    /// first good step since the loss is taken as the recovery time.
    fn recovered(&mut self, f: Fault, from: usize, addr: Option<&str>) {
        let names = |l: &Line| {
            l.msg.contains("recovered in") && addr.is_none_or(|a| l.msg.contains(&format!("({a})")))
        };
        if !self.job.wait(DETECT, |j| j.find(from, names).is_some()) {
            let what = format!(
                "{}: no recovery naming {addr:?} within {DETECT:?}",
                f.name()
            );
            self.fail(what);
            return;
        }
        let first_good = |j: &Job| {
            j.lines[from..]
                .iter()
                .filter_map(|l| first_good(&l.msg))
                .map(|(_, ms, _)| ms)
                .max()
        };
        if self.job.wait(DETECT, |j| first_good(j).is_some()) {
            // the others' lines, if any, within a moment
            self.job.pump(Duration::from_millis(300));
            if let Some(ms) = first_good(&self.job) {
                self.notes
                    .push(format!("first good step {ms} ms after the loss"));
                self.fig.recovery.push(ms);
            }
        }
    }

    /// Injects one fault of kind `f` at a worker picked at random; false
    /// if the cluster did not heal (the run cannot go on).
    fn inject(&mut self, f: Fault) -> bool {
        let since = self.last_fault;
        let Some(victim) = self.victim(since) else {
            self.fail(format!("{}: no worker to aim at", f.name()));
            return false;
        };
        self.inject_at(f, victim)
    }

    /// Garbage waits in a worker's backlog until it next connects a
    /// cluster version (it accepts only then). Before the end, if some
    /// has not been read yet, one kill of a worker that holds none makes
    /// the others recover (and resize when the replacement joins), so
    /// that every garbage connection to a live worker is read and must
    /// have been refused ([`Driver::check_garbage`]). False if the
    /// cluster did not heal.
    fn flush_garbage(&mut self) -> bool {
        let pending = self.unread_garbage();
        if pending.is_empty() {
            return true;
        }
        // a worker holding none if any (else one of them: its garbage
        // goes with it, and is counted as such)
        let Some(victim) = self.victim(self.last_fault) else {
            self.fail("garbage: no worker to kill to have it read".into());
            return false;
        };
        println!(
            "chaos: garbage to {} worker(s) not read yet: a kill to have it read",
            pending.len()
        );
        self.fig.dealt.insert(Fault::Kill);
        let ok = self.inject_at(Fault::Kill, victim);
        if !self.notes.is_empty() {
            println!("chaos:   {}", self.notes.join("; "));
            self.notes.clear();
        }
        ok
    }

    /// Injects one fault of kind `f` at `(pid, addr, label)`.
    fn inject_at(&mut self, f: Fault, (pid, addr, label): (i32, String, String)) -> bool {
        println!(
            "chaos: step {}: {} pid {pid} ({addr})",
            self.job.step(),
            f.name()
        );
        let from = self.job.lines.len();
        self.last_fault = from;
        let victims = match f {
            Fault::Kill | Fault::Freeze => vec![addr.clone()],
            _ => Vec::new(),
        };
        self.fig.spans.push((from, f, addr.clone(), victims));
        let sent = unix_ms();
        self.began = Instant::now();
        self.failed_before = self.fig.failures.len();
        let signal = |d: &Driver, sig| d.job.worker(pid).is_some_and(|w| w.signal(sig));
        let tally = |d: &mut Driver| d.fig.tally.entry(f).or_default().injected += 1;
        match f {
            Fault::Kill => {
                if !signal(self, Signal::SIGKILL) {
                    return true; // it exited meanwhile: nothing injected
                }
                tally(self);
                if let Some(ms) = self.detected(f, from, pid, sent) {
                    self.fig.detect.entry(f).or_default().push(ms);
                }
                self.recovered(f, from, Some(&addr));
                self.heal(f, from)
            }
            Fault::Freeze => {
                if !signal(self, Signal::SIGSTOP) {
                    return true;
                }
                tally(self);
                if let Some(ms) = self.detected(f, from, pid, sent) {
                    self.fig.detect.entry(f).or_default().push(ms);
                }
                self.recovered(f, from, Some(&addr));
                // frozen for longer than the peer timeout in any case
                let hold = PEER_TIMEOUT + self.rng.ms(500, 1500);
                let left = hold.saturating_sub(Duration::from_millis(unix_ms() - sent));
                self.job.pump(left);
                signal(self, Signal::SIGCONT);
                let back = self.job.lines.len();
                let refused = |j: &Job| {
                    j.find(back, |l| {
                        l.label.as_deref() == Some(label.as_str())
                            && l.msg.contains("left out of the cluster")
                    })
                    .is_some()
                };
                let gone = |j: &Job| j.worker(pid).is_none_or(|w| !w.alive());
                // (its last line may come after its exit is seen)
                self.job.wait(HEAL, |j| gone(j) && refused(j));
                let (gone, refused) = (gone(&self.job), refused(&self.job));
                match (gone, refused) {
                    (true, true) => self.fig.refused += 1,
                    _ => self.fail(format!(
                        "freeze: the frozen worker (pid {pid}) came back and was not refused \
                         (exited: {gone})"
                    )),
                }
                self.heal(f, back)
            }
            Fault::Pause => {
                let d = self.rng.ms(200, 600);
                if !signal(self, Signal::SIGSTOP) {
                    return true;
                }
                self.job.pump(d);
                signal(self, Signal::SIGCONT);
                tally(self);
                self.notes.push(format!("stopped for {} ms", d.as_millis()));
                let ok = self.no_recovery(f, from, PEER_TIMEOUT + Duration::from_secs(1));
                ok && self.heal(f, self.job.lines.len())
            }
            Fault::Delay | Fault::Drop => {
                let sig = if f == Fault::Delay {
                    Signal::SIGUSR2
                } else {
                    Signal::SIGUSR1
                };
                if !signal(self, sig) {
                    return true;
                }
                let acted = format!("fault injection (pid {pid}): ");
                if !self.job.wait(Duration::from_secs(5), |j| {
                    j.find(from, |l| l.msg.contains(&acted)).is_some()
                }) {
                    self.fail(format!("{}: pid {pid} did not act on the signal", f.name()));
                    return true;
                }
                tally(self);
                if let Some(l) = self.job.find(from, |l| l.msg.contains(&acted)) {
                    let what = l.msg.split(&acted).nth(1).unwrap_or_default().to_string();
                    self.notes.push(what);
                }
                if f == Fault::Delay {
                    let ok = self.no_recovery(f, from, DELAY + PEER_TIMEOUT);
                    return ok && self.heal(f, self.job.lines.len());
                }
                // either end may report first: the loss is of a link
                let _ = self.detected(f, from, -1, sent);
                self.recovered(f, from, None);
                let after = self.job.lines.len();
                self.heal(f, after)
            }
            Fault::Garbage => {
                match self.garbage(&addr) {
                    Ok(port) => self.fig.garbage.push((port, pid, from)),
                    Err(e) => {
                        // the worker may have just gone: not injected
                        eprintln!("chaos: garbage to {addr}: {e}");
                        return true;
                    }
                }
                tally(self);
                let ok = self.no_recovery(f, from, PEER_TIMEOUT);
                ok && self.heal(f, self.job.lines.len())
            }
        }
    }

    /// Writes one of random bytes, a truncated hello or a forged hello to
    /// `addr`; keeps the connection open; returns its local port.
    fn garbage(&mut self, addr: &str) -> std::io::Result<u16> {
        let a: std::net::SocketAddr = addr.parse().map_err(std::io::Error::other)?;
        let mut s = TcpStream::connect_timeout(&a, Duration::from_secs(2))?;
        s.set_write_timeout(Some(Duration::from_secs(2)))?;
        let mut bytes: Vec<u8> = (0..80).map(|_| self.rng.next() as u8).collect();
        match self.rng.below(3) {
            // random bytes of a random length
            0 => {
                bytes.truncate(1 + self.rng.below(80));
                self.notes.push(format!("{} random bytes", bytes.len()));
            }
            // a hello's magic and kind, and then nothing: left open
            1 => {
                bytes[..4].copy_from_slice(b"KH\x03\x01");
                bytes.truncate(4 + self.rng.below(60));
                self.notes
                    .push(format!("a hello cut at {} bytes, left open", bytes.len()));
            }
            // a whole hello from rank 1..3 to rank 0 of another job
            _ => {
                bytes[..4].copy_from_slice(b"KH\x03\x01");
                bytes[4..8].copy_from_slice(&(1 + self.rng.below(3) as u32).to_le_bytes());
                bytes[8..12].copy_from_slice(&0u32.to_le_bytes());
                self.notes.push("a forged hello of another job".into());
            }
        }
        s.write_all(&bytes)?;
        let port = s.local_addr()?.port();
        self.sockets.push(s);
        Ok(port)
    }
}

/// `(step, ms, digest)` of a selftest's line on its first good step since
/// a loss.
fn first_good(msg: &str) -> Option<(u64, u64, String)> {
    let (step, rest) = msg
        .strip_prefix("step ")?
        .split_once(": the first good step since")?;
    let ms = rest.split(", ").nth(1)?.split(" ms").next()?.parse().ok()?;
    let digest = rest.split("model ").nth(1)?.split(' ').next()?.to_string();
    Some((step.parse().ok()?, ms, digest))
}

fn median_max(v: &[u64]) -> String {
    if v.is_empty() {
        return "none measured".into();
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    format!(
        "median {} ms, max {} ms (n = {}: {s:?})",
        s[s.len() / 2],
        s[s.len() - 1],
        s.len()
    )
}

/// Every kind of fault, for 30 s and at least once each
/// (scripts/chaos.sh soaks for longer).
#[test]
fn chaos_training_survives_kills_freezes_pauses_delays_drops_and_garbage() {
    chaos("chaos", &Fault::ALL, 30);
}

/// The chaos run: faults of `default` kinds (or `CHAOS_FAULTS`) for
/// `default_secs` (or `CHAOS_SECS`), with a seed from the clock (or
/// `CHAOS_SEED`).
fn chaos(tag: &str, default: &[Fault], default_secs: u64) {
    let seed = env_or("CHAOS_SEED", unix_ms());
    let secs: u64 = env_or("CHAOS_SECS", default_secs);
    let kinds = kinds(default);
    println!(
        "chaos: seed {seed} (CHAOS_SEED={seed} replays it), {secs} s of faults {:?}, \
         {NP} workers, --on-failure replace, tcp",
        kinds.iter().map(|f| f.name()).collect::<Vec<_>>()
    );
    let dir = TempDir::new(tag);
    let stop = dir.0.join("stop");
    let mut cmd = Command::new(RUN);
    let timeout = format!("{}s", secs + 240);
    let faults = format!("KUNGFU_FAULTS=delay_ms={}", DELAY.as_millis());
    cmd.args(["-np", "4", "--on-failure", "replace", "--transport", "tcp"])
        .args(["--timeout", &timeout, "-x", &faults, SELFTEST])
        .args(["--steps", "1000000000", "--size", "4096"])
        .args(["--recover", "--follow-config", "--stamp", "--stop-file"])
        .arg(&stop);
    let mut d = Driver {
        seed,
        job: Job::start(cmd, NP),
        rng: Rng(seed),
        fig: Figures::default(),
        sockets: Vec::new(),
        notes: Vec::new(),
        began: Instant::now(),
        failed_before: 0,
        last_fault: 0,
    };
    assert!(
        d.job
            .wait(Duration::from_secs(60), |j| j.healthy_since(0, NP)),
        "the job did not start:\n{}",
        d.job.story(200)
    );
    let end = Instant::now() + Duration::from_secs(secs);
    // Past the end, only the kinds never injected yet are dealt (a fault
    // whose victim had just gone is not), for at most 90 s more: every
    // kind must be injected at least once.
    let hard_end = end + Duration::from_secs(90);
    let never = |d: &Driver| -> Vec<Fault> {
        kinds
            .iter()
            .copied()
            .filter(|k| d.fig.tally.get(k).is_none_or(|t| t.injected == 0))
            .collect()
    };
    let mut deck = Vec::new();
    'faults: while Instant::now() < hard_end && (Instant::now() < end || !never(&d).is_empty()) {
        let f = if Instant::now() < end {
            if deck.is_empty() {
                deck = kinds.clone();
            }
            deck.swap_remove(d.rng.below(deck.len()))
        } else {
            let left = never(&d);
            left[d.rng.below(left.len())]
        };
        d.fig.dealt.insert(f);
        let ok = d.inject(f);
        if !d.notes.is_empty() {
            println!("chaos:   {}", d.notes.join("; "));
            d.notes.clear();
        }
        if !ok {
            break 'faults;
        }
        let gap = d.rng.ms(200, 1200);
        d.job.pump(gap);
    }
    if d.fig.failures.is_empty() {
        d.flush_garbage();
    }
    d.finish(&stop);
}

impl Driver {
    /// Stops the run, checks what holds for the whole of it, prints the
    /// figures, and fails the test if anything went wrong.
    fn finish(mut self, stop: &std::path::Path) {
        let from = self.job.lines.len();
        std::fs::write(stop, b"").expect("the stop file");
        let done = |j: &Job| {
            let pids: BTreeSet<i32> = j.lines[from..]
                .iter()
                .filter(|l| l.msg == "done")
                .filter_map(Line::pid)
                .collect();
            pids.len() >= NP
        };
        if !self.job.wait(Duration::from_secs(60), done) {
            self.fail("the workers did not all stop and finish within 60 s".into());
        }
        match self.job.exit(Duration::from_secs(30)) {
            Some(st) if st.success() => {}
            st => self.fail(format!("kungfu-run ended with {st:?}")),
        }
        // every op's value: the selftest exits 4 on a wrong one
        let wrong: Vec<String> = self
            .job
            .lines
            .iter()
            .filter(|l| {
                l.msg.contains("exited with status 4")
                    || (l.msg.starts_with("kungfu-selftest: step ")
                        && (l.msg.contains("expected") || l.msg.contains("models differ")))
            })
            .map(|l| l.msg.clone())
            .collect();
        // the survivors' models after every recovery, at their first good
        // step: one digest per step
        let mut digests: BTreeMap<u64, BTreeSet<String>> = BTreeMap::new();
        for (step, _, digest) in self.job.lines.iter().filter_map(|l| first_good(&l.msg)) {
            digests.entry(step).or_default().insert(digest);
        }
        let split: Vec<_> = digests.iter().filter(|(_, d)| d.len() > 1).collect();
        if !split.is_empty() {
            let what = format!("survivors with different models after a recovery: {split:?}");
            self.fail(what);
        }
        for w in &wrong {
            self.fail(format!("a wrong value: {w}"));
        }
        for f in self.fig.dealt.clone() {
            if self.fig.tally.get(&f).is_none_or(|t| t.injected == 0) {
                self.fail(format!("{}: dealt, and never injected", f.name()));
            }
        }
        self.check_recoveries();
        self.check_failures();
        self.check_garbage();
        self.report(digests.len(), wrong.len());
        if let Ok(path) = std::env::var("CHAOS_LOG") {
            let all = self.job.story(usize::MAX);
            std::fs::write(&path, all).unwrap_or_else(|e| panic!("CHAOS_LOG={path}: {e}"));
        }
        let failures = std::mem::take(&mut self.fig.failures);
        assert!(
            failures.is_empty(),
            "chaos failed (CHAOS_SEED={}):\n{}\n--- the run, less its good steps:\n{}",
            self.seed,
            failures.join("\n"),
            self.job.story(600)
        );
        drop(self.sockets);
    }

    fn report(&self, compared: usize, wrong: usize) {
        println!("chaos: fault    injected detected survived");
        for (f, t) in &self.fig.tally {
            let detected = match f {
                Fault::Pause | Fault::Delay => "-".to_string(),
                _ => t.detected.to_string(),
            };
            println!(
                "chaos: {:<8} {:>8} {:>8} {:>8}",
                f.name(),
                t.injected,
                detected,
                t.survived
            );
        }
        for n in &self.notes {
            println!("chaos: {n}");
        }
        let d = |f| median_max(self.fig.detect.get(&f).map_or(&[][..], |v| v));
        println!("chaos: detection after SIGKILL: {}", d(Fault::Kill));
        println!("chaos: detection after SIGSTOP: {}", d(Fault::Freeze));
        println!(
            "chaos: recovery, the loss seen to the first good step after the shrink: {}",
            median_max(&self.fig.recovery)
        );
        let frozen = self.fig.tally.get(&Fault::Freeze).map_or(0, |t| t.injected);
        println!(
            "chaos: frozen workers refused when they ran again: {} of {frozen}",
            self.fig.refused
        );
        println!(
            "chaos: wrong values {wrong}; hangs {}; model digests compared at the first good \
             step after {compared} recoveries, all identical: {}",
            self.fig
                .failures
                .iter()
                .filter(|f| f.contains("a hang"))
                .count(),
            !self
                .fig
                .failures
                .iter()
                .any(|f| f.contains("different models"))
        );
    }
}
