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
use std::os::fd::AsRawFd;
use std::time::Duration;

use anyhow::Context;
use kungfu_topology::fnv1a64;
use nix::sys::signal::Signal;
use tokio::process::Command;
use tokio::signal::unix::{signal, SignalKind};
use tokio::time::Instant;

use crate::certs::job_tls;
use crate::procs::{
    control_channel, describe, report_live, signal_all, Control, Job, TERM_TO_KILL,
};
use crate::remote;
use crate::served::{config_server, listener_for, Pending};
use crate::{assign_ranks, is_local_host, job_ports, JobPorts};
use kungfu::elastic::ClusterConfig;
use kungfu::env::SECRET_VAR;
use kungfu::store::ConfigStore;
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::auth::JobSecret;

pub use crate::bind::cpu_for;
use crate::bind::{allowed_cpus, pin};
pub use crate::options::{Bind, LaunchOptions, OnFailure};

/// Hands `l` to the child `cmd` starts, as an inherited descriptor named
/// in `KUNGFU_LISTEN_FD` (the runtime adopts it; see `kungfu::listen`).
/// Rust opens every descriptor close-on-exec, so a worker inherits its own
/// socket and no other; the flag is cleared in the child alone, between
/// fork and exec. The launcher's copy closes with `cmd`, after the spawn.
fn pass_listener(cmd: &mut Command, l: std::net::TcpListener) -> anyhow::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    // 0-2 become the child's stdio: a duplicate lands at 3 or above
    let l = if l.as_raw_fd() < 3 {
        l.try_clone().context("duplicating a listening socket")?
    } else {
        l
    };
    cmd.env(kungfu::listen::LISTEN_FD_VAR, l.as_raw_fd().to_string());
    #[allow(unsafe_code)]
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: it makes one fcntl on a
    // descriptor the child inherited (the closure's `l` keeps it open in
    // the parent until the spawn is over), and allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            fcntl(&l, FcntlArg::F_SETFD(FdFlag::empty()))
                .map(drop)
                .map_err(std::io::Error::from)
        });
    }
    Ok(())
}

/// The identity of one worker of one cluster version.
struct WorkerSpec<'a> {
    rank: usize,
    size: usize,
    local_rank: usize,
    local_size: usize,
    peers: &'a PeerList,
    version: u32,
}

fn worker_cmd(
    opts: &LaunchOptions,
    allowed: &[usize],
    w: &WorkerSpec<'_>,
    job: &JobKeys,
    config_url: Option<&str>,
    listener: Option<std::net::TcpListener>,
) -> anyhow::Result<Command> {
    let mut cmd = Command::new(&opts.program[0]);
    if let Some(cpu) = cpu_for(opts.bind, allowed, w.local_rank, w.local_size) {
        pin(&mut cmd, cpu)?;
    }
    match listener {
        Some(l) => pass_listener(&mut cmd, l)?,
        // one inherited from whoever started kungfu-run names nothing here
        None => {
            cmd.env_remove(kungfu::listen::LISTEN_FD_VAR);
        }
    }
    cmd.args(&opts.program[1..])
        .env("KUNGFU_RANK", w.rank.to_string())
        .env("KUNGFU_SIZE", w.size.to_string())
        .env("KUNGFU_LOCAL_RANK", w.local_rank.to_string())
        .env("KUNGFU_LOCAL_SIZE", w.local_size.to_string())
        .env("KUNGFU_PEERS", w.peers.to_string())
        .env("KUNGFU_TRANSPORT", opts.transport.name())
        .env("KUNGFU_CLUSTER_VERSION", w.version.to_string())
        .env("KUNGFU_CLUSTER_ID", format!("{:x}", job.cluster_id))
        // the environment, not the command line, which every user can read
        .env(SECRET_VAR, &job.secret)
        // what torch.distributed's env:// init reads, so that a script
        // calls `init_process_group("kungfu")` (or any backend) as under
        // torchrun; KUNGFU_* stay the library's own
        .env("RANK", w.rank.to_string())
        .env("WORLD_SIZE", w.size.to_string())
        .env("LOCAL_RANK", w.local_rank.to_string())
        .env("LOCAL_WORLD_SIZE", w.local_size.to_string())
        .env("MASTER_PORT", job.torch_port.to_string());
    if let Some(first) = w.peers.peers().first() {
        cmd.env("MASTER_ADDR", &first.host);
    }
    if let Some(url) = config_url {
        cmd.env("KUNGFU_CONFIG_SERVER", url);
    }
    if let Some(st) = &opts.strategy {
        cmd.env("KUNGFU_STRATEGY", st);
    }
    for (k, v) in &opts.env {
        cmd.env(k, v);
    }
    Ok(cmd)
}

/// What identifies a job to its workers.
struct JobKeys {
    cluster_id: u64,
    /// The job secret, as the workers get it (`KUNGFU_JOB_SECRET`).
    secret: String,
    /// `MASTER_PORT`, for torch.distributed's store on rank 0's host.
    torch_port: u16,
}

/// A port that was free here a moment ago, for `MASTER_PORT` (rank 0's
/// torch store binds it; `-x MASTER_PORT=...` chooses another).
fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind(("0.0.0.0", 0)).context("finding a free port")?;
    Ok(l.local_addr()?.port())
}

/// The job's secret: `given`, else `KUNGFU_JOB_SECRET` from the
/// environment (so that launchers started apart on each host share one),
/// else 32 fresh random bytes in hex.
pub fn job_secret(given: Option<&str>) -> anyhow::Result<String> {
    let from_env = std::env::var(SECRET_VAR).ok().filter(|s| !s.is_empty());
    let secret = match given.map(str::to_string).or(from_env) {
        Some(s) => s,
        None => JobSecret::generate_hex()?,
    };
    // refused here rather than by every worker
    JobSecret::new(secret.as_bytes()).context(SECRET_VAR)?;
    Ok(secret)
}

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

/// A fresh cluster id: from the clock and the process id.
pub fn job_id() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    fnv1a64(
        fnv1a64(0xcbf2_9ce4_8422_2325, &now.to_le_bytes()),
        &std::process::id().to_le_bytes(),
    )
}

/// Removes this host's shared-memory ring files of the job when dropped.
/// A worker killed while connecting leaves rings behind that no process of
/// the job can remove any more (see `kungfu_transport::shm`, "Lifetime of
/// the files"); this runs once `run` has reaped every worker, however the
/// job ended: success, a failed or killed worker, the timeout, a signal to
/// kungfu-run, or an error of the launcher itself.
struct JobRings(u64);

impl Drop for JobRings {
    fn drop(&mut self) {
        let dir = std::path::Path::new(kungfu_transport::shm::RING_DIR);
        let msg = match kungfu_transport::shm::remove_cluster_files(dir, self.0) {
            Ok(names) if names.is_empty() => return,
            Ok(names) => format!(
                "kungfu-run: removed {} shared-memory ring file(s) the job left in {}: {}",
                names.len(),
                dir.display(),
                names.join(" ")
            ),
            Err(e) => format!(
                "kungfu-run: could not remove the job's ring files from {}: {e}",
                dir.display()
            ),
        };
        // stderr may be closed; a drop must not panic
        let _ = writeln!(std::io::stderr(), "{msg}");
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
    let mine = |host: &str| match &opts.self_host {
        Some(me) => host == me,
        None => is_local_host(host),
    };
    // per-node mode, elastic: every launcher makes or finds the job's keys
    // in etcd and follows them
    let per_node = opts.self_host.is_some() && !opts.controlled;
    anyhow::ensure!(
        opts.on_failure == OnFailure::Stop || !per_node || in_etcd,
        "--on-failure shrink|replace needs a config store, which no launcher serves in \
         per-node mode (--self, --rdzv): give --config-store etcd://..., or start the job \
         from one host (ssh mode)"
    );
    // The config server: for -w (the launcher that starts the job serves
    // it; those it starts on other hosts follow it), and for the
    // survivors' recovery.
    let elastic = opts.watch || opts.on_failure != OnFailure::Stop;
    let serves = elastic && opts.self_host.is_none();
    let follows = elastic && opts.self_host.is_some();
    let here = if serves && !all_local && !in_etcd {
        let h = opts.hosts.iter().find(|h| mine(&h.host)).with_context(|| {
            "-w or --on-failure across hosts: start kungfu-run on one of the hosts of -H \
             (its config server listens there, for the other hosts), or give --config-store"
        })?;
        Some(h.host.as_str())
    } else {
        None
    };
    let (server, pending) = if serves && !in_etcd {
        let (s, p) = config_server(&opts, &peers, &secret, here).await?;
        (Some(s), p)
    } else {
        (None, Pending::default())
    };
    // a per-node launcher that finds the job changed already starts the
    // workers of its current version, not of the first
    let mut late: Option<ClusterConfig> = None;
    let store = match (&server, &opts.config_server) {
        (Some(s), _) => Some(ConfigStore::Http(s.url())),
        (None, _) if serves || (follows && per_node && in_etcd) => {
            let (store, current) =
                crate::config_store::create(&opts, &peers, cluster_id, !all_local).await?;
            late = current;
            Some(store)
        }
        (None, Some(u)) if follows => Some(ConfigStore::open(u).map_err(anyhow::Error::msg)?),
        (None, _) if follows => {
            anyhow::bail!("-w or --on-failure with --self needs --config-server URL")
        }
        _ => None,
    };
    let url = store.as_ref().map(ConfigStore::url);
    // a job's keys in etcd go with it, however it ends
    let _keys = crate::config_store::RemoveOnDrop(match &store {
        Some(ConfigStore::Etcd(e)) if serves => Some(e.clone()),
        _ => None,
    });
    let mut node = match (&store, &opts.self_host) {
        (Some(ConfigStore::Etcd(e)), Some(me)) if per_node => {
            Some(crate::config_store::PerNode::start(e.clone(), me, &opts).await?)
        }
        _ => None,
    };
    let mut node_tick = tokio::time::interval(crate::config_store::PER_NODE_EVERY);
    let mut job_over = false;
    // every version of the config after the first, in order
    let mut versions = match (&server, &store) {
        (Some(s), _) => Some(s.versions(0)),
        (None, Some(st)) => {
            // from the current version on, for a launcher that comes late
            let after = late.as_ref().map_or(0, |c| c.version - 1);
            Some(st.follow(after, FOLLOW_EVERY, FOLLOW_GIVE_UP))
        }
        _ => None,
    };
    // the latest version handled
    let mut latest = versions.as_ref().map(|_| ClusterConfig {
        version: 0,
        peers: peers.clone(),
    });
    // Before `job`, so that it is dropped after it: the workers are gone
    // first (reaped when the loop below ends; on an early error, sent
    // SIGKILL by the job's drop, which does not wait for them).
    let _rings = JobRings(cluster_id);
    let one_host = all_local && opts.self_host.is_none();
    let tls = job_tls(opts.transport, opts.quic.as_ref(), one_host, cluster_id)?;
    let mut job = Job::default();
    let width = (opts.np - 1).to_string().len();
    // A worker's name in messages, and the prefix of its output lines: its
    // rank, and its host too when the job spans more than one.
    let many_hosts = opts.hosts.len() > 1;
    let tags = |rank: usize, host: &str| {
        if many_hosts {
            (
                format!("rank {rank} on {host}"),
                format!("[{rank:>width$}@{host}] "),
            )
        } else {
            (format!("rank {rank}"), format!("[{rank:>width$}] "))
        }
    };
    let allowed = allowed_cpus();
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
        let mut cmd = worker_cmd(&opts, &allowed, &w, &keys, url.as_deref(), listener)?;
        if let Some(t) = &tls {
            t.apply(&mut cmd, s.rank)?;
        }
        let addr = peers.peer(Rank(s.rank as u32)).map(|p| p.to_string());
        let (label, prefix) = tags(s.rank, &s.host);
        job.spawn(cmd, label, prefix, addr, None)?;
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
            let (ssh, ssh_args) = opts.ssh.split_first().context("--ssh: no command")?;
            let mut cmd = Command::new(ssh);
            // keepalives: a connection that dies silently ends the ssh,
            // and so the remote launcher's control channel
            cmd.args(ssh_args).args([
                "-o",
                "BatchMode=yes",
                "-o",
                "ServerAliveInterval=5",
                "-o",
                "ServerAliveCountMax=3",
                &h.host,
                &line,
            ]);
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
                    let shrunk = latest.as_ref().is_some_and(|c| c.peers.len() < opts.np);
                    if survived.to_replace > 0 && shrunk {
                        survived.to_replace = 0;
                        replace_lost(store.clone(), secret.clone(), opts.np);
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
                    if survived.to_replace > 0 && c.peers.len() < opts.np {
                        // the survivors shrank: grow back with new workers
                        survived.to_replace = 0;
                        replace_lost(store.clone(), secret.clone(), opts.np);
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
                        if !mine(&p.host) || job.running(&addr) {
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
                        let started = listener_for(&pending, p)
                            .and_then(|l| worker_cmd(&opts, &allowed, &w, &keys, url.as_deref(), Some(l)))
                            .and_then(|mut cmd| {
                                if let Some(t) = &tls {
                                    t.apply(&mut cmd, rank)?;
                                }
                                Ok(cmd)
                            })
                            .and_then(|cmd| {
                                let (_, prefix) = tags(rank, &p.host);
                                job.spawn(cmd, format!("worker {addr}"), prefix, Some(addr), None)
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

/// `--on-failure replace`: asks the config server for `np` workers again
/// (the launcher starts the new ones when the config changes).
fn replace_lost(store: Option<ConfigStore>, secret: JobSecret, np: usize) {
    let Some(store) = store else { return };
    tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(30);
        let body = format!("size {np}");
        match store.put(&body, Some(&secret), deadline).await {
            Ok(c) => say!(
                "kungfu-run: replacing the lost: version {} of {} workers",
                c.version,
                c.peers.len()
            ),
            Err(e) => say!("kungfu-run: could not start replacements: {e}"),
        }
    });
}

/// What `--on-failure shrink|replace` keeps track of.
#[derive(Default)]
struct Survived {
    /// The status of the first worker that failed.
    failed: Option<i32>,
    /// Failed workers a replacement is still to be started for.
    to_replace: usize,
}
