//! Connecting a worker's transport: the one `KUNGFU_TRANSPORT` asks for at
//! start and after a resize, or the one a transport swap moves to.

use std::sync::Arc;

use kungfu_collectives::{Session, SessionConfig};
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::any::{self, AnyTransport, TransportKind};
use kungfu_transport::endpoint::Liveness;
#[cfg(feature = "fabric")]
use kungfu_transport::fabric::FabricConfig;
use kungfu_transport::pool::BufferPool;
use kungfu_transport::quic::{QuicConfig, QuicTls};
use kungfu_transport::shm::ShmConfig;
use kungfu_transport::tcp::TcpConfig;
#[cfg(feature = "verbs")]
use kungfu_transport::verbs::VerbsConfig;
use kungfu_transport::{ClusterVersion, Epoch, Transport as _};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::{BootstrapError, WorkerEnv};

/// Connects the transport `env` asks for, its wires on `pool`, and starts
/// a session on it.
pub(crate) async fn connect(
    env: &WorkerEnv,
    peers: &PeerList,
    cluster_id: u64,
    pool: &Arc<BufferPool>,
    listener: TcpListener,
    deadline: Instant,
) -> Result<Session<AnyTransport>, BootstrapError> {
    let link = Link {
        env,
        peers,
        cluster_id,
        pool,
    };
    let transport = link
        .transport(env.transport, listener, Epoch(0), deadline)
        .await?;
    let timeline = timeline(env)?;
    let session = Session::new(
        transport,
        peers.clone(),
        SessionConfig {
            timeline,
            strategy: env.strategy,
            chunk_bytes: env.chunk_bytes,
            fast_max_bytes: env.fast_max_bytes,
            fast_large: env.fast_large,
            auto: env.auto,
            op_timeout: env.op_timeout,
            ..SessionConfig::default()
        },
    )?;
    session.watch_stalls(env.stall_timeout);
    Ok(session)
}

/// This process's timeline (`KUNGFU_TIMELINE`), made at its first
/// connect and kept across resizes: one file per worker process, named by
/// its rank then.
fn timeline(
    env: &WorkerEnv,
) -> Result<Option<Arc<kungfu_collectives::timeline::Timeline>>, BootstrapError> {
    use kungfu_collectives::timeline::{Timeline, TIMELINE_VAR};
    static MADE: std::sync::Mutex<Option<Arc<Timeline>>> = std::sync::Mutex::new(None);
    let Some(pattern) = env.timeline.as_deref() else {
        return Ok(None);
    };
    let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(t) = made.as_ref() {
        return Ok(Some(t.clone()));
    }
    let rank = kungfu_topology::Rank(env.rank as u32);
    let t = Timeline::create(pattern, rank, env.size).map_err(|e| BootstrapError::Env {
        var: TIMELINE_VAR.into(),
        reason: format!(
            "cannot write {}: {e}",
            kungfu_collectives::timeline::path_for(pattern, rank).display()
        ),
    })?;
    *made = Some(t.clone());
    Ok(Some(t))
}

/// What a worker connects a transport with.
pub(crate) struct Link<'a> {
    pub(crate) env: &'a WorkerEnv,
    pub(crate) peers: &'a PeerList,
    pub(crate) cluster_id: u64,
    pub(crate) pool: &'a Arc<BufferPool>,
}

impl Link<'_> {
    /// Whether `kind` can connect here (built in, the hosts and the
    /// certificates it needs), and if not, why.
    pub(crate) fn can(&self, kind: TransportKind) -> Result<(), BootstrapError> {
        if !kind.built() {
            return Err(BootstrapError::UnsupportedTransport(kind));
        }
        let kind = secure_kind(self.env, self.peers, kind)?;
        if kind == TransportKind::Shm && self.peers.hosts().len() > 1 {
            return Err(shm_across_hosts(self.peers));
        }
        match kind {
            TransportKind::Quic => {
                quic_tls(self.env)?;
            }
            #[cfg(feature = "fabric")]
            TransportKind::Fabric => {
                kungfu_transport::fabric::probe(self.env.fabric_provider.as_deref())?;
            }
            #[cfg(feature = "verbs")]
            TransportKind::Verbs => {
                kungfu_transport::verbs::probe(self.env.verbs_device.as_deref())?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Connects `kind` at `epoch`, its wires on the pool.
    pub(crate) async fn transport(
        &self,
        kind: TransportKind,
        listener: TcpListener,
        epoch: Epoch,
        deadline: Instant,
    ) -> Result<Arc<AnyTransport>, BootstrapError> {
        let Link {
            env,
            peers,
            cluster_id,
            pool,
        } = *self;
        let connect_timeout = deadline.saturating_duration_since(Instant::now());
        let one_host = peers.hosts().len() == 1;
        let kind = secure_kind(env, peers, kind)?;
        let me = Rank(env.rank as u32);
        // Every cluster version gets new connections, so its sessions start
        // at epoch 0: swaps count from there (a Generation orders the two); a
        // transport swap connects at the epoch it takes effect at.
        let version = ClusterVersion(u64::from(env.cluster_version));
        let shm_cfg = || {
            let mut c = ShmConfig::new(cluster_id, version, epoch, Rank(env.rank as u32), env.size);
            c.secret = env.secret.clone();
            c.connect_timeout = connect_timeout;
            c.pool = Some(pool.clone());
            if let Some(spin) = env.spin {
                c.spin = spin;
            }
            c
        };
        let tcp_cfg = || {
            let mut c = TcpConfig::new(
                cluster_id,
                version,
                epoch,
                Rank(env.rank as u32),
                peers.clone(),
            );
            c.secret = env.secret.clone();
            c.connect_timeout = connect_timeout;
            c.pool = Some(pool.clone());
            if let Some(spin) = env.spin {
                c.spin = spin;
            }
            c
        };
        let transport = match kind {
            TransportKind::Shm if !one_host => return Err(shm_across_hosts(peers)),
            TransportKind::Shm => {
                drop(listener);
                any::connect_shm(shm_cfg()).await?
            }
            TransportKind::Auto if one_host => {
                drop(listener);
                any::connect_shm(shm_cfg()).await?
            }
            TransportKind::Auto => any::connect_auto(tcp_cfg(), shm_cfg(), peers, listener).await?,
            TransportKind::Quic => {
                // UDP at the port of this rank's entry (reserved as TCP by the
                // launcher; UDP's ports are another space)
                drop(listener);
                let tls = quic_tls(env)?;
                let mut c = QuicConfig::new(cluster_id, version, epoch, me, peers.clone(), tls);
                c.secret = env.secret.clone();
                c.connect_timeout = connect_timeout;
                c.pool = Some(pool.clone());
                if let Some(spin) = env.spin {
                    c.spin = spin;
                }
                let socket = kungfu_transport::quic::bind_udp_until(peers, me, deadline).await?;
                any::connect_quic(c, socket).await?
            }
            TransportKind::Tcp => any::connect_tcp(tcp_cfg(), listener).await?,
            #[cfg(feature = "fabric")]
            TransportKind::Fabric => {
                let mut c = FabricConfig::new(
                    cluster_id,
                    version,
                    epoch,
                    me,
                    peers.clone(),
                    env.fabric_provider.clone(),
                );
                c.secret = env.secret.clone();
                c.connect_timeout = connect_timeout;
                c.pool = Some(pool.clone());
                if let Some(spin) = env.spin {
                    c.spin = spin;
                }
                // every worker on this machine's loopback: libfabric's tcp
                // provider stays on it too
                let loopback = peers
                    .peers()
                    .iter()
                    .all(|p| p.host.starts_with("127.") || p.host == "localhost");
                if loopback && c.provider.as_deref().is_some_and(|p| p.starts_with("tcp")) {
                    c.domain = Some("lo".into());
                }
                any::connect_fabric(c, listener).await?
            }
            #[cfg(feature = "verbs")]
            TransportKind::Verbs => {
                let mut c = VerbsConfig::new(
                    cluster_id,
                    version,
                    epoch,
                    me,
                    peers.clone(),
                    env.verbs_device.clone(),
                );
                c.secret = env.secret.clone();
                c.connect_timeout = connect_timeout;
                c.pool = Some(pool.clone());
                if let Some(spin) = env.spin {
                    c.spin = spin;
                }
                any::connect_verbs(c, listener).await?
            }
            // a wire this build does not have
            #[allow(unreachable_patterns)]
            _ => return Err(BootstrapError::UnsupportedTransport(kind)),
        };
        transport
            .matcher()
            .name_peers(peers.peers().iter().map(|p| p.to_string()));
        if !env.peer_timeout.is_zero() {
            transport.watch_peers(Liveness::with_timeout(env.peer_timeout));
        }
        Ok(transport)
    }
}

/// What `kind` becomes under `KUNGFU_SECURE=1` (see [`WorkerEnv::secure`]):
/// across hosts `auto` is `quic`, and a wire whose frames carry no MAC is
/// refused; on one host, or without it, `kind` itself.
fn secure_kind(
    env: &WorkerEnv,
    peers: &PeerList,
    kind: TransportKind,
) -> Result<TransportKind, BootstrapError> {
    if !env.secure || peers.hosts().len() < 2 {
        return Ok(kind);
    }
    match kind {
        TransportKind::Auto | TransportKind::Quic => Ok(TransportKind::Quic),
        other => Err(BootstrapError::Env {
            var: "KUNGFU_SECURE".into(),
            reason: format!(
                "KUNGFU_SECURE=1: {other}'s frames between hosts carry no MAC; a job across \
                 hosts runs on quic (or auto, which is then quic)"
            ),
        }),
    }
}

fn shm_across_hosts(peers: &PeerList) -> BootstrapError {
    BootstrapError::Env {
        var: "KUNGFU_TRANSPORT".into(),
        reason: format!(
            "shm needs every worker on one host; these are on {} hosts (use tcp or auto)",
            peers.hosts().len()
        ),
    }
}

/// This worker's QUIC certificates: from the files the environment names
/// (the user's PKI), else issued from the job's secret
/// ([`QuicTls::from_secret`]: every worker of the job trusts them, and no
/// one else's).
fn quic_tls(env: &WorkerEnv) -> Result<QuicTls, BootstrapError> {
    match (&env.quic_files, &env.secret) {
        (Some(f), _) => Ok(QuicTls::from_pem_files(&f.ca, &f.cert, &f.key)?),
        (None, Some(secret)) => Ok(QuicTls::from_secret(secret, &env.rank.to_string())?),
        (None, None) => Err(BootstrapError::Env {
            var: "KUNGFU_JOB_SECRET".into(),
            reason: "the quic transport needs the job's secret (KUNGFU_JOB_SECRET; kungfu-run \
                     sets it), from which each worker makes its certificate, or the user's \
                     PEM files in KUNGFU_QUIC_CA, KUNGFU_QUIC_CERT and KUNGFU_QUIC_KEY"
                .into(),
        }),
    }
}
