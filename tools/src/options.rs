//! What `kungfu-run` is asked to do: its options, as `launch::run` takes
//! them.

use std::time::Duration;

use kungfu_transport::any::TransportKind;

use crate::certs::QuicFiles;
use crate::HostSlots;

/// What `kungfu-run` was asked to do.
#[derive(Clone, Debug)]
pub struct LaunchOptions {
    pub np: usize,
    pub hosts: Vec<HostSlots>,
    pub strategy: Option<String>,
    pub transport: TransportKind,
    /// The user's QUIC certificates (`--quic-ca`, `--quic-cert`,
    /// `--quic-key`); without them a QUIC job makes its own.
    pub quic: Option<QuicFiles>,
    /// Bounds the whole job.
    pub timeout: Option<Duration>,
    /// Ports on multi-machine layouts: `port_base + local rank`.
    pub port_base: u16,
    /// Set on the remote side of an ssh launch: only this host's workers.
    pub self_host: Option<String>,
    pub cluster_id: Option<u64>,
    /// The job secret (`KUNGFU_JOB_SECRET`): given (read from standard
    /// input on the remote side of an ssh launch), else this process's
    /// `KUNGFU_JOB_SECRET`, else a fresh random one ([`crate::launch::job_secret`]).
    pub secret: Option<String>,
    /// How long the other workers may take to exit by themselves after one
    /// failed, before they are sent SIGTERM.
    pub grace: Duration,
    /// Extra `NAME=VALUE` for every worker.
    pub env: Vec<(String, String)>,
    /// Pin each local worker to one CPU.
    pub bind: Bind,
    /// Watch mode (`-w`): serve the cluster config over HTTP and start the
    /// workers of new versions.
    pub watch: bool,
    /// The largest cluster a watched job may grow to.
    pub max_np: usize,
    /// How long a worker a new version left out may take to exit by
    /// itself (it learns it is detached at its next resize) before it is
    /// stopped.
    pub detach_timeout: Duration,
    /// What a worker's failure does to the others (`--on-failure`).
    pub on_failure: OnFailure,
    /// The command that reaches another host (`--ssh`, default `ssh`),
    /// with its options; the host and the remote command follow them.
    pub ssh: Vec<String>,
    /// Started through ssh by a launcher on another host
    /// (`--control-stdin`): after the secret, standard input is the
    /// control channel it sends signals on (see `procs`).
    pub controlled: bool,
    /// The config server a watched job's launcher on another host follows
    /// (`--config-server URL`, with `--self`).
    pub config_server: Option<String>,
    /// Keep the watched job's config in etcd rather than serve it
    /// (`--config-store etcd://HOST:PORT[/PREFIX]`; see
    /// [`crate::config_store`]).
    pub config_store: Option<String>,
    pub program: Vec<String>,
}

/// What kungfu-run does when a worker fails (`--on-failure`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnFailure {
    /// Stop the others (after `grace`) and exit with the failure's status.
    Stop,
    /// Let the others go on: they shrink the cluster to the survivors
    /// (`Worker::recover`, `kf_recover`). Serves the config server, as
    /// `-w` does.
    Shrink,
    /// Like `Shrink`, then grow the cluster back to `-np` with a new
    /// worker, which joins as in an elastic scale-out (the survivors pick
    /// it up at their next `resize_from_config`).
    Replace,
}

impl std::str::FromStr for OnFailure {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<OnFailure> {
        match s {
            "stop" => Ok(OnFailure::Stop),
            "shrink" => Ok(OnFailure::Shrink),
            "replace" => Ok(OnFailure::Replace),
            _ => anyhow::bail!("--on-failure {s:?}: expected stop, shrink or replace"),
        }
    }
}

/// Whether workers are pinned to CPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bind {
    /// Pin worker `i` of a host to its `i`-th allowed CPU when the host has
    /// at least as many allowed CPUs as workers (as `mpirun` binds to
    /// cores by default for small jobs); otherwise leave them free.
    Auto,
    Core,
    None,
}

impl std::str::FromStr for Bind {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Bind> {
        match s {
            "auto" => Ok(Bind::Auto),
            "core" => Ok(Bind::Core),
            "none" => Ok(Bind::None),
            _ => anyhow::bail!("--bind-to {s:?}: expected auto, core or none"),
        }
    }
}
