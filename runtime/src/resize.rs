//! Elastic resizing of a started worker: proposing a size to the config
//! server, following its cluster to a new version (every worker takes the
//! config rank 0 read), and bringing the workers that joined to the
//! training state of the others.

use std::time::{Duration, SystemTime};

use kungfu_collectives::{CollectiveError, Element, ReduceOp, Session};
use kungfu_topology::{Rank, Strategy};
use kungfu_transport::any::AnyTransport;
use tokio::time::Instant;

use crate::{connect, elastic, listen, store};
use crate::{BootstrapError, Discovery, Worker, WorkerEnv};

/// What a resize did to this worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resized {
    /// The cluster changed (a new version).
    pub changed: bool,
    /// This worker is not in the new cluster: it should exit.
    pub detached: bool,
}

impl Worker {
    /// The config store `KUNGFU_CONFIG_SERVER` names.
    pub(crate) fn config_store(&self) -> Result<store::ConfigStore, BootstrapError> {
        let url = self.env.config_server.as_deref().ok_or_else(|| {
            BootstrapError::Elastic(
                "no config server (KUNGFU_CONFIG_SERVER; run with kungfu-run -w)".into(),
            )
        })?;
        store::ConfigStore::open(url, self.env.secret.as_ref()).map_err(BootstrapError::Elastic)
    }

    /// Asks the config server for a cluster of `n` workers (the first `n`
    /// kept when shrinking; new ones started by `kungfu-run -w` when
    /// growing). Workers switch at their next [`Worker::resize_from_config`].
    pub async fn propose_new_size(
        &self,
        n: usize,
    ) -> Result<elastic::ClusterConfig, BootstrapError> {
        self.config_store()?
            .put(
                &format!("size {n}"),
                Instant::now() + self.env.connect_timeout,
            )
            .await
            .map_err(|e| BootstrapError::Elastic(e.to_string()))
    }

    /// Resizes the cluster to `n` workers: rank 0 proposes, then every
    /// worker switches (see [`Worker::resize_from_config`]). A collective:
    /// every worker calls it at the same step with the same `n`.
    pub async fn resize(&mut self, n: usize) -> Result<Resized, BootstrapError> {
        let mut failed = None;
        if self.rank() == 0 && n != self.size() {
            if let Err(e) = self.propose_new_size(n).await {
                failed = Some(e.to_string());
            }
        }
        self.follow(failed).await
    }

    /// Switches to the config server's current cluster, if it is newer: a
    /// collective (every worker calls it at the same step). Rank 0 reads
    /// the config and broadcasts it, so every worker takes the same one.
    /// Workers in the new cluster connect at the new version (new
    /// connections, which the handshake checks, so no frame of the old one
    /// reaches them) and get a new session, at epoch 0; the others are
    /// detached, their connections closed.
    pub async fn resize_from_config(&mut self) -> Result<Resized, BootstrapError> {
        self.follow(None).await
    }

    /// The config server's current cluster, as rank 0 read it, on every
    /// worker (a collective; `failed`: rank 0's error to give everyone
    /// instead).
    pub(crate) async fn agreed_config(
        &self,
        failed: Option<String>,
    ) -> Result<elastic::ClusterConfig, BootstrapError> {
        if self.detached {
            return Err(BootstrapError::Elastic("this worker is detached".into()));
        }
        let store = self.config_store()?;
        let deadline = Instant::now() + self.env.connect_timeout;
        // Rank 0 reads; its text (or its error) goes to everyone, as the
        // maximum of an allreduce to which the others give zeros rather
        // than as a broadcast: every worker then needs every other, so a
        // worker lost anywhere fails this on all of them. Under a
        // broadcast, a worker whose path from rank 0 avoids the lost one
        // went on waiting here for a rank 0 that was recovering (the
        // launcher's chaos test caught it).
        let mut text = Vec::new();
        if self.rank() == 0 {
            let got = match failed {
                Some(e) => Err(e),
                None => store.get(deadline).await,
            };
            text = match got {
                Ok(c) => [b"+".as_slice(), c.encode().as_bytes()].concat(),
                Err(e) => [b"-".as_slice(), e.as_bytes()].concat(),
            };
        }
        let s = &self.session;
        let len = s
            .allreduce("kf/resize/len", &[text.len() as u64], ReduceOp::Max)
            .await
            .map_err(op_failed)?[0];
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= 1 << 24)
            .ok_or_else(|| BootstrapError::Elastic(format!("config of {len} bytes")))?;
        text.resize(len, 0);
        let text = s
            .allreduce("kf/resize/config", &text, ReduceOp::Max)
            .await
            .map_err(op_failed)?;
        let text = String::from_utf8_lossy(&text);
        let cfg = match text.split_at_checked(1) {
            Some(("+", c)) => elastic::ClusterConfig::parse(c).map_err(BootstrapError::Elastic)?,
            Some((_, why)) => return Err(BootstrapError::Elastic(format!("rank 0: {why}"))),
            None => return Err(BootstrapError::Elastic("empty config".into())),
        };
        Ok(cfg)
    }

    async fn follow(&mut self, failed: Option<String>) -> Result<Resized, BootstrapError> {
        let began = SystemTime::now();
        self.drop_pending();
        let cfg = self.agreed_config(failed).await?;
        let deadline = Instant::now() + self.env.connect_timeout;
        if cfg.version <= self.env.cluster_version {
            return Ok(Resized {
                changed: false,
                detached: false,
            });
        }
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank")
            .clone();
        let Some(rank) = cfg.peers.rank_of(&me).map(Rank::idx) else {
            return Ok(self.detach().await);
        };
        self.switch_to(rank, cfg, deadline).await?;
        self.joined = (began, SystemTime::now());
        Ok(Resized {
            changed: true,
            detached: false,
        })
    }

    /// Leaves the cluster: a new version does not hold this worker. Its
    /// member key goes and its connections close.
    pub(crate) async fn detach(&mut self) -> Resized {
        self.detached = true;
        self.leave_store().await;
        self.session.close(Duration::from_secs(2)).await;
        Resized {
            changed: true,
            detached: true,
        }
    }

    /// Connects this worker, as `rank`, to the cluster `cfg` (new
    /// connections at its version, which the handshake checks, so no frame
    /// of the old one reaches them) while the old session's close.
    pub(crate) async fn switch_to(
        &mut self,
        rank: usize,
        cfg: elastic::ClusterConfig,
        deadline: Instant,
    ) -> Result<(), BootstrapError> {
        let env = self.env_for(rank, &cfg);
        let old = self.session.clone();
        let (new, ()) = tokio::join!(
            self.connect_version(&env, &cfg, deadline),
            old.close(Duration::from_secs(2))
        );
        self.adopt(new?, env, cfg).await;
        Ok(())
    }

    /// This worker's environment as `rank` of `cfg`.
    pub(crate) fn env_for(&self, rank: usize, cfg: &elastic::ClusterConfig) -> WorkerEnv {
        let mut env = self.env.clone();
        // the transport in use, which a swap may have changed
        env.transport = self.transport_kind();
        env.rank = rank;
        env.size = cfg.peers.len();
        env.cluster_version = cfg.version;
        env.discovery = Discovery::Peers(cfg.peers.clone());
        env
    }

    /// Listens at this worker's address again and connects a session to
    /// the cluster `cfg` as `env` says.
    pub(crate) fn connect_version(
        &self,
        env: &WorkerEnv,
        cfg: &elastic::ClusterConfig,
        deadline: Instant,
    ) -> impl std::future::Future<Output = Result<Session<AnyTransport>, BootstrapError>> + Send + 'static
    {
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank")
            .clone();
        let (fd, env, peers) = (self.env.listen_fd, env.clone(), cfg.peers.clone());
        let (cluster_id, pool) = (self.cluster_id, self.pool.clone());
        // (owns what it needs: a connect in the background is spawned)
        async move {
            // the same address: with an inherited socket, a duplicate of it
            let listener = listen::listen(&me, fd).await?;
            connect::connect(&env, &peers, cluster_id, &pool, listener, deadline).await
        }
    }

    /// Takes `session`, connected to `cfg` as `env` says, as this
    /// worker's.
    pub(crate) async fn adopt(
        &mut self,
        session: Session<AnyTransport>,
        env: WorkerEnv,
        cfg: elastic::ClusterConfig,
    ) {
        // Every session of the new version starts on the launcher's
        // strategy (new workers know no other); the one in use here is
        // handed on by sync_state.
        self.carry = Some(self.session.strategy());
        self.session = session;
        self.env = env;
        self.peers = cfg.peers;
        self.auto_across_hosts().await;
    }

    /// Brings every worker to the same training state: the step counter,
    /// the strategy in use and the named buffers are broadcast from the
    /// lowest-ranked worker that has state (not [fresh](Worker::is_fresh)); returns the step.
    /// A collective: every worker passes the same names and lengths. Call
    /// it at start (new workers learn where training is) and after every
    /// resize that changed the cluster.
    pub async fn sync_state<E: Element>(
        &mut self,
        step: u64,
        buffers: &mut [(&str, &mut [E])],
    ) -> Result<u64, BootstrapError> {
        let s = &self.session;
        let mine = if self.fresh { u32::MAX } else { s.rank().0 };
        let root = s
            .allreduce("kf/state/root", &[mine], ReduceOp::Min)
            .await
            .map_err(op_failed)?[0];
        if root == u32::MAX {
            return Err(BootstrapError::Elastic(
                "no worker has state to share (every one joined late)".into(),
            ));
        }
        let root = Rank(root);
        let code = Strategy::ALL
            .iter()
            .position(|&x| x == self.carry.unwrap_or(s.strategy()))
            .expect("every strategy is in ALL") as u64;
        let got = s
            .broadcast("kf/state/step", &[step, code], root)
            .await
            .map_err(op_failed)?;
        let step = got[0];
        // new workers start with the launcher's strategy: take the root's
        let strategy = usize::try_from(got[1])
            .ok()
            .and_then(|i| Strategy::ALL.get(i).copied())
            .ok_or_else(|| BootstrapError::Elastic(format!("strategy code {}", got[1])))?;
        s.set_strategy(strategy);
        self.carry = None;
        // every buffer's broadcast at once (named ops, many in flight): a
        // model's tensors, large and small, go together rather than each
        // waiting for the one before
        let names: Vec<String> = buffers
            .iter()
            .map(|(n, _)| format!("kf/state/{n}"))
            .collect();
        let ops = buffers
            .iter_mut()
            .zip(&names)
            .map(|((_, buf), name)| s.broadcast_in_place(name, buf, root));
        all_ok(ops.collect()).await.map_err(op_failed)?;
        self.fresh = false;
        Ok(step)
    }
}

/// Runs `ops` at once and waits for all of them; the first error, if any.
async fn all_ok<F>(ops: Vec<F>) -> Result<(), CollectiveError>
where
    F: std::future::Future<Output = Result<(), CollectiveError>>,
{
    let mut ops: Vec<Option<std::pin::Pin<Box<F>>>> =
        ops.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut first_err = None;
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for slot in ops.iter_mut() {
            let Some(op) = slot else { continue };
            match op.as_mut().poll(cx) {
                std::task::Poll::Ready(r) => {
                    if let Err(e) = r {
                        first_err.get_or_insert(e);
                    }
                    *slot = None;
                }
                std::task::Poll::Pending => pending = true,
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    first_err.map_or(Ok(()), Err)
}

fn op_failed(e: CollectiveError) -> BootstrapError {
    BootstrapError::Op(e)
}
