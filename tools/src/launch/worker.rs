//! How this launcher starts one worker: the job's keys, the command and
//! environment of a worker of one cluster version (its rank, its peers,
//! the variables torch.distributed reads), its CPU, its inherited
//! listening socket, its certificates and the prefix of its output.

use std::os::fd::AsRawFd;

use anyhow::Context;
use kungfu::env::SECRET_VAR;
use kungfu_topology::{fnv1a64, PeerList};
use kungfu_transport::auth::JobSecret;
use kungfu_transport::shm::cma;
use tokio::process::Command;

use super::{cpu_for, LaunchOptions};
use crate::bind::pin;
use crate::certs::QuicFiles;
use crate::procs::Job;

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
pub(super) struct WorkerSpec<'a> {
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) local_rank: usize,
    pub(super) local_size: usize,
    pub(super) peers: &'a PeerList,
    pub(super) version: u32,
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
        // the workers' common ancestor on this host: under Yama's
        // ptrace_scope 1 they name it their ptracer, so that they may read
        // each other's buffers (kungfu_transport::shm::cma)
        .env(cma::LAUNCHER_PID_VAR, std::process::id().to_string())
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
    if one_omp_thread(opts, w.local_size) {
        cmd.env(OMP_THREADS_VAR, "1");
    }
    Ok(cmd)
}

/// The number of threads of an OpenMP runtime (torch's intra-op pool).
const OMP_THREADS_VAR: &str = "OMP_NUM_THREADS";

/// Whether workers get `OMP_NUM_THREADS=1`: when `local_size` of them
/// share a host and nobody chose a value (in this launcher's environment
/// or with `-x`). As torchrun does: each worker's torch would otherwise
/// start a thread per core, and the workers' pools then fight over the
/// same cores, and with the library's threads.
pub(super) fn one_omp_thread(opts: &LaunchOptions, local_size: usize) -> bool {
    local_size > 1
        && std::env::var_os(OMP_THREADS_VAR).is_none()
        && !opts.env.iter().any(|(k, _)| k == OMP_THREADS_VAR)
}

/// What identifies a job to its workers.
pub(super) struct JobKeys {
    pub(super) cluster_id: u64,
    /// The job secret, as the workers get it (`KUNGFU_JOB_SECRET`).
    pub(super) secret: String,
    /// `MASTER_PORT`, for torch.distributed's store on rank 0's host.
    pub(super) torch_port: u16,
}

/// A port that was free here a moment ago, for `MASTER_PORT` (rank 0's
/// torch store binds it; `-x MASTER_PORT=...` chooses another).
pub(super) fn free_port() -> anyhow::Result<u16> {
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

/// What every worker this launcher starts shares: the job's options and
/// keys, the CPUs it may pin them to, the config server's URL and the
/// certificates.
pub(super) struct Starter<'a> {
    pub(super) opts: &'a LaunchOptions,
    pub(super) allowed: &'a [usize],
    pub(super) keys: &'a JobKeys,
    pub(super) url: Option<&'a str>,
    pub(super) tls: Option<&'a QuicFiles>,
}

impl Starter<'_> {
    /// A worker's name in messages, and the prefix of its output lines: its
    /// rank, and its host too when the job spans more than one.
    fn tags(&self, rank: usize, host: &str) -> (String, String) {
        let width = (self.opts.np - 1).to_string().len();
        let many_hosts = self.opts.hosts.len() > 1;
        if many_hosts {
            (
                format!("rank {rank} on {host}"),
                format!("[{rank:>width$}@{host}] "),
            )
        } else {
            (format!("rank {rank}"), format!("[{rank:>width$}] "))
        }
    }

    /// Starts the worker `w` on `host` (one of this launcher's) as a
    /// process of `job`, known by `addr` (its address in the peer list),
    /// with its listening socket if it has one; named `label`, or by its
    /// rank.
    pub(super) fn start(
        &self,
        job: &mut Job,
        w: &WorkerSpec<'_>,
        host: &str,
        addr: Option<String>,
        listener: Option<std::net::TcpListener>,
        label: Option<String>,
    ) -> anyhow::Result<()> {
        let mut cmd = worker_cmd(self.opts, self.allowed, w, self.keys, self.url, listener)?;
        if let Some(t) = self.tls {
            t.apply(&mut cmd);
        }
        let (name, prefix) = self.tags(w.rank, host);
        job.spawn(cmd, label.unwrap_or(name), prefix, addr, None)
    }
}
