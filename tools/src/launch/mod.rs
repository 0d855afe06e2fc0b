//! The launcher behind `kungfu-run`: start the workers, relay their output
//! with rank prefixes, forward signals, and stop everything when one worker
//! fails or the job's time runs out.
//!
//! Stopping goes in three phases, each bounded: the other workers get
//! `grace` to exit by themselves (they usually do, since their collectives
//! fail with an error naming the lost rank, and that error is worth
//! seeing), then SIGTERM, then SIGKILL three seconds later.

use std::collections::HashSet;
use std::io::Write;
use std::time::Duration;

use anyhow::Context;
use kungfu_topology::Rank;
use kungfu_transport::auth::JobSecret;
use nix::sys::signal::Signal;
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::bind::allowed_cpus;
use crate::procs::{
    control_channel, describe, report_live, signal_all, Control, Job, TERM_TO_KILL,
};
use crate::remote;
use crate::served::listener_for;
use crate::{assign_ranks, is_local_host, job_ports, JobPorts};

pub use crate::bind::cpu_for;
pub use crate::options::{Bind, LaunchOptions, OnFailure};

/// `eprintln!` that ignores a closed standard error: a launcher started
/// through ssh loses its output with the connection, and must still stop
/// its workers then.
macro_rules! say {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// How long the launchers of other hosts have, once the job is over, to
/// exit before their ssh is killed.
const ENDING_TO_KILL: Duration = Duration::from_secs(10);

/// How often a launcher that follows another's config server asks it for
/// the config, and how long it goes on when the server does not answer.
const FOLLOW_EVERY: Duration = Duration::from_millis(100);
const FOLLOW_GIVE_UP: Duration = Duration::from_secs(30);

mod elastic;
mod rings;
mod worker;

use elastic::{replace_lost, Elastic, Survived};
use rings::JobRings;
use worker::{free_port, one_omp_thread, JobKeys, Starter, WorkerSpec};
pub use worker::{job_id, job_secret};

/// Whether `host` is one this launcher starts workers on: the host of
/// `--self`, or else any local one.
fn is_mine(opts: &LaunchOptions, host: &str) -> bool {
    match &opts.self_host {
        Some(me) => host == me,
        None => is_local_host(host),
    }
}

/// Runs the job; returns the exit code for `kungfu-run`.
pub async fn run(opts: LaunchOptions) -> anyhow::Result<i32> {
    anyhow::ensure!(!opts.program.is_empty(), "no program to run");
    // Handle the signals before any worker starts: one that arrives while
    // the job starts is forwarded too, never the default death that would
    // leave the workers behind.
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sighup = signal(SignalKind::hangup())?;
    let slots = assign_ranks(opts.np, &opts.hosts)?;
    let all_local = opts.hosts.iter().all(|h| is_local_host(&h.host));
    // in etcd, the config is changed without this launcher, which then
    // cannot hold sockets for new workers: ports from --port-base, bound
    // when a worker starts
    let in_etcd = opts.config_store.is_some();
    let JobPorts {
        peers,
        mut listeners,
    } = job_ports(&slots, all_local && !in_etcd, opts.port_base)?;
    let cluster_id = opts.cluster_id.unwrap_or_else(job_id);
    let keys = JobKeys {
        cluster_id,
        secret: job_secret(opts.secret.as_deref())?,
        torch_port: free_port()?,
    };
    let secret = JobSecret::new(keys.secret.as_bytes())?;
    let mine = |host: &str| is_mine(&opts, host);
    // per-node mode, elastic: every launcher makes or finds the job's keys
    // in etcd and follows them
    let per_node = opts.self_host.is_some() && !opts.controlled;
    anyhow::ensure!(
        opts.on_failure == OnFailure::Stop || !per_node || in_etcd,
        "--on-failure shrink|replace needs a config store, which no launcher serves in \
         per-node mode (--self, --rdzv): give --config-store etcd://..., or start the job \
         from one host (ssh mode)"
    );
    // The config server and the job's keys in etcd (removed when
    // dropped) are held until the job is over.
    let Elastic {
        serves,
        follows,
        server: _server,
        pending,
        late,
        store,
        url,
        keys: _keys,
        mut node,
        mut versions,
        mut latest,
    } = Elastic::start(
        &opts, &peers, &secret, cluster_id, all_local, in_etcd, per_node,
    )
    .await?;
    let mut node_tick = tokio::time::interval(crate::config_store::PER_NODE_EVERY);
    let mut job_over = false;
    // Before `job`, so that it is dropped after it: the workers are gone
    // first (reaped when the loop below ends; on an early error, sent
    // SIGKILL by the job's drop, which does not wait for them).
    let _rings = JobRings(cluster_id);
    let mut job = Job::default();
    let allowed = allowed_cpus();
    let starter = Starter {
        opts: &opts,
        allowed: &allowed,
        keys: &keys,
        url: url.as_deref(),
        tls: opts.quic.as_ref(),
    };
    let most_here = slots
        .iter()
        .filter(|s| mine(&s.host))
        .map(|s| s.local_size)
        .max();
    if let Some(n) = most_here.filter(|&n| one_omp_thread(&opts, n)) {
        say!(
            "kungfu-run: OMP_NUM_THREADS=1 for every worker ({n} share a host, and it was \
             unset); set OMP_NUM_THREADS, or -x OMP_NUM_THREADS=N, to choose"
        );
    }
    for s in slots.iter().filter(|s| mine(&s.host) && late.is_none()) {
        let w = WorkerSpec {
            rank: s.rank,
            size: opts.np,
            local_rank: s.local_rank,
            local_size: s.local_size,
            peers: &peers,
            version: 0,
        };
        let listener = listeners[s.rank].take();
        let addr = peers.peer(Rank(s.rank as u32)).map(|p| p.to_string());
        starter.start(&mut job, &w, &s.host, addr, listener, None)?;
    }
    if opts.self_host.is_none() {
        // Workers of other machines: the same launcher there, through ssh
        // (in a watched job on every host, as any may get workers later).
        let exe = std::env::current_exe().context("locating kungfu-run")?;
        for h in opts.hosts.iter().filter(|h| !mine(&h.host)) {
            if !serves && !slots.iter().any(|s| s.host == h.host) {
                continue;
            }
            let line = remote::remote_command(&opts, &h.host, cluster_id, &exe, url.as_deref());
            let cmd = remote::ssh_command(&opts.ssh, &h.host, &line)?;
            // the secret on ssh's standard input (see `remote`)
            let secret = Some(keys.secret.as_str());
            job.spawn(
                cmd,
                format!("ssh to {}", h.host),
                String::new(),
                None,
                secret,
            )?;
        }
    }

    // started through ssh by a launcher on another host: its orders
    let mut control = opts.controlled.then(control_channel);
    let job_deadline = opts.timeout.map(|d| Instant::now() + d);
    let far = Instant::now() + Duration::from_secs(100 * 365 * 24 * 3600);
    // (when the next stop phase starts, the signal it sends)
    let mut next_phase: Option<(Instant, Signal)> = None;
    let mut exit_code: Option<i32> = None;
    let mut remaining = job.procs.len();
    let mut timed_out = false;
    let mut survived = Survived::default();

    // A launcher that follows another reports how many of its workers
    // run; the one it follows ends the job when none runs anywhere.
    let mut reported: Option<(usize, u32)> = None;
    let mut ending = false;
    let mut status = job.take_status();
    while remaining > 0
        || (follows && control.is_some() && exit_code.is_none())
        || (node.is_some() && !job_over && exit_code.is_none())
    {
        let live = job.live_workers();
        let version = latest.as_ref().map_or(0, |c| c.version);
        if follows && opts.controlled && reported != Some((live, version)) {
            report_live(live, version);
            reported = Some((live, version));
        }
        if serves && !ending && live == 0 && job.remotes_idle(version) {
            // every worker of every host has exited, none is to start:
            // the job is over; the other hosts' launchers get a bounded
            // time to see their channels close
            ending = true;
            job.close_controls();
            next_phase = Some((Instant::now() + ENDING_TO_KILL, Signal::SIGKILL));
        }
        let phase_at = next_phase.map_or(far, |(t, _)| t);
        let removal = job.next_removal();
        tokio::select! {
            Some(joined) = job.waits.join_next() => {
                let Ok((idx, status)) = joined else { continue };
                remaining -= 1;
                job.procs[idx].alive = false;
                let (what, code) = match status {
                    Ok(st) => describe(&st),
                    Err(e) => (format!("could not be waited for: {e}"), 1),
                };
                job.procs[idx].succeeded = code == 0;
                if job.procs[idx].stopped {
                    if !job.is_remote(idx) {
                        say!("kungfu-run: {} (removed from the cluster) {what}", job.procs[idx].label);
                        // A worker the others left out while it lived (a
                        // frozen one, which the recovery declared lost),
                        // stopped here: under `replace` it is replaced as a
                        // dead one is, once the cluster names no dead worker.
                        let shrunk = latest.as_ref().is_some_and(|c| {
                            c.peers.len() < opts.np && !job.has_exited_member(&c.peers)
                        });
                        if opts.on_failure == OnFailure::Replace && exit_code.is_none() && shrunk {
                            replace_lost(store.clone(), opts.np);
                        }
                    } else if code != 0 {
                        say!("kungfu-run: {} {what} after the job was over", job.procs[idx].label);
                    }
                } else if code != 0 && opts.on_failure != OnFailure::Stop && exit_code.is_none()
                    && job.is_remote(idx) && job.procs[idx].remote_live.is_some()
                {
                    // that host's launcher, which ran, gave up (its own
                    // output says why); its workers are gone, and the
                    // others recover as from any lost worker. Not
                    // replaced: its slots have no launcher any more. (One
                    // that never ran, its ssh refused, fails the job.)
                    say!("kungfu-run: {} {what}; the others go on without that host", job.procs[idx].label);
                    survived.failed.get_or_insert(code);
                } else if code != 0 && opts.on_failure != OnFailure::Stop && exit_code.is_none()
                    && !job.is_remote(idx)
                {
                    say!(
                        "kungfu-run: {} {what}; the others go on without it (--on-failure {})",
                        job.procs[idx].label,
                        if opts.on_failure == OnFailure::Shrink { "shrink" } else { "replace" },
                    );
                    survived.failed.get_or_insert(code);
                    survived.to_replace += usize::from(opts.on_failure == OnFailure::Replace);
                    // The survivors may have shrunk before this worker
                    // exited (a frozen one exits only once it runs again
                    // and learns it was left out): grow back now, as no
                    // later config change may come to do it.
                    let shrunk = latest.as_ref().is_some_and(|c| {
                        c.peers.len() < opts.np && !job.has_exited_member(&c.peers)
                    });
                    if survived.to_replace > 0 && shrunk {
                        survived.to_replace = 0;
                        replace_lost(store.clone(), opts.np);
                    }
                } else if code != 0 {
                    let msg = format!("{} {what}", job.procs[idx].label);
                    if exit_code.is_none() {
                        say!("kungfu-run: {msg}; stopping the other workers");
                        exit_code = Some(code);
                        next_phase = Some((Instant::now() + opts.grace, Signal::SIGTERM));
                    } else {
                        say!("kungfu-run: {msg}");
                    }
                }
            }
            // Every version, not only the latest: a version that added
            // workers and was replaced before this looked may still be the
            // one the workers connect (the resize model found that hang).
            Some(next) = async { versions.as_mut().expect("guarded").recv().await }, if versions.is_some() && exit_code.is_none() && !ending => {
                let c = match next {
                    Ok(c) => c,
                    Err(e) => {
                        say!("kungfu-run: {e}; stopping the workers");
                        versions = None;
                        exit_code = Some(1);
                        signal_all(&job.procs, Signal::SIGTERM);
                        next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
                        continue;
                    }
                };
                latest = Some(c.clone());
                {
                    let who = opts.self_host.as_ref().map_or_else(String::new, |h| format!(" on {h}"));
                    say!("kungfu-run{who}: cluster version {}: {} workers", c.version, c.peers.len());
                    // The survivors shrank: grow back with new workers. Not
                    // while the config still names a worker that exited
                    // (several lost at once, and the survivors knew only
                    // some when they decided): they recover again, and a
                    // grow of that config would hold the dead one too.
                    if survived.to_replace > 0 && c.peers.len() < opts.np && !job.has_exited_member(&c.peers) {
                        survived.to_replace = 0;
                        replace_lost(store.clone(), opts.np);
                    }
                    let members: HashSet<String> =
                        c.peers.peers().iter().map(|p| p.to_string()).collect();
                    for p in job.procs.iter_mut().filter(|p| p.alive && p.removed.is_none()) {
                        if p.addr.as_ref().is_some_and(|a| !members.contains(a)) {
                            p.removed = Some((Instant::now() + opts.detach_timeout, Signal::SIGTERM));
                        }
                    }
                    for (rank, p) in c.peers.peers().iter().enumerate() {
                        let addr = p.to_string();
                        if !mine(&p.host) || job.started(&addr) {
                            continue;
                        }
                        let r = Rank(rank as u32);
                        let w = WorkerSpec {
                            rank,
                            size: c.peers.len(),
                            local_rank: c.peers.local_rank(r),
                            local_size: c.peers.local_size(r),
                            peers: &c.peers,
                            version: c.version,
                        };
                        let started = listener_for(&pending, p).and_then(|l| {
                            let label = format!("worker {addr}");
                            starter.start(&mut job, &w, &p.host, Some(addr), Some(l), Some(label))
                        });
                        match started {
                            Ok(()) => remaining += 1,
                            Err(e) => {
                                say!("kungfu-run: {e:#}; stopping the workers");
                                exit_code = Some(1);
                                signal_all(&job.procs, Signal::SIGTERM);
                                next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
                            }
                        }
                    }
                }
            }
            _ = tokio::time::sleep_until(removal.unwrap_or(far)), if removal.is_some() => {
                let now = Instant::now();
                for p in job.procs.iter_mut().filter(|p| p.alive) {
                    let Some((at, sig)) = p.removed else { continue };
                    if at > now {
                        continue;
                    }
                    if sig == Signal::SIGTERM {
                        say!(
                            "kungfu-run: {} left the cluster {:?} ago and is still running; stopping it",
                            p.label, opts.detach_timeout
                        );
                    }
                    p.stopped = true;
                    signal_all(std::slice::from_ref(p), sig);
                    p.removed = (sig == Signal::SIGTERM).then(|| (now + TERM_TO_KILL, Signal::SIGKILL));
                }
            }
            Some(c) = async { control.as_mut().expect("guarded").recv().await }, if control.is_some() => {
                let me = opts.self_host.as_deref().unwrap_or("this host");
                let sig = match c {
                    Control::Signal(sig) => {
                        signal_all(&job.procs, sig);
                        say!("kungfu-run on {me}: {} from the launcher; forwarded it to the workers", sig.as_str());
                        sig
                    }
                    Control::Gone => {
                        control = None;
                        // none running (a watched job ends so): done
                        if exit_code.is_some() || job.live_workers() == 0 {
                            continue;
                        }
                        // signal first: this host's output may be gone
                        // with the connection
                        signal_all(&job.procs, Signal::SIGTERM);
                        say!("kungfu-run on {me}: the launcher that started this one is gone; stopped the workers");
                        Signal::SIGTERM
                    }
                };
                exit_code.get_or_insert(128 + sig as i32);
                next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
            }
            Some((idx, n)) = status.recv() => job.procs[idx].remote_live = Some(n),
            _ = node_tick.tick(), if node.is_some() && !job_over && exit_code.is_none() => {
                let version = latest.as_ref().map_or(0, |c| c.version);
                let live = job.live_workers();
                match node.as_mut().expect("guarded").over(live, version).await {
                    Ok(over) => job_over = over,
                    // the store's watch gives up on a store gone for good
                    Err(e) => say!("kungfu-run: telling etcd what this host runs: {e:#}"),
                }
            }
            _ = sigint.recv() => {
                say!("kungfu-run: interrupted; forwarding SIGINT to the workers");
                signal_all(&job.procs, Signal::SIGINT);
                exit_code.get_or_insert(130);
                next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
            }
            _ = sigterm.recv() => {
                say!("kungfu-run: terminated; forwarding SIGTERM to the workers");
                signal_all(&job.procs, Signal::SIGTERM);
                exit_code.get_or_insert(143);
                next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
            }
            _ = sighup.recv() => {
                signal_all(&job.procs, Signal::SIGHUP);
                exit_code.get_or_insert(129);
                next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
            }
            _ = tokio::time::sleep_until(job_deadline.unwrap_or(far)), if !timed_out && job_deadline.is_some() => {
                timed_out = true;
                say!(
                    "kungfu-run: the job did not finish within {:?}; stopping the workers",
                    opts.timeout.unwrap_or_default()
                );
                exit_code = Some(124);
                signal_all(&job.procs, Signal::SIGTERM);
                next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
            }
            _ = tokio::time::sleep_until(phase_at), if next_phase.is_some() => {
                let (_, sig) = next_phase.take().expect("guarded");
                signal_all(&job.procs, sig);
                if sig == Signal::SIGTERM {
                    next_phase = Some((Instant::now() + TERM_TO_KILL, Signal::SIGKILL));
                }
            }
        }
    }
    // a per-node launcher that stops the job says it is done, too
    if let Some(n) = node.as_mut() {
        n.finish().await;
    }
    // Let the relays print what the workers wrote last.
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while job.relays.join_next().await.is_some() {}
    })
    .await;
    // with --on-failure shrink|replace: the job failed only if no worker
    // finished well
    Ok(exit_code.unwrap_or(match survived.failed {
        Some(code) if job.procs.iter().all(|p| !p.succeeded) => code,
        _ => 0,
    }))
}
