//! Following the config server without waiting for new workers
//! ([`Worker::poll_resize_from_config`]): the next cluster version is
//! connected in the background while the old one trains on, and every
//! worker switches at the first call after all of them connected it.
//!
//! A worker that a launcher starts for a grow (or to replace a lost one)
//! takes seconds to be ready (a new Python, torch); with
//! [`Worker::resize_from_config`] every other worker waits that long in
//! the connect. Here they only wait for the switch itself: the state sync
//! that follows it, over the new connections.

use std::time::{Duration, SystemTime};

use kungfu_collectives::{ReduceOp, Session};
use kungfu_topology::Rank;
use kungfu_transport::any::AnyTransport;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{elastic, BootstrapError, Resized, Worker, WorkerEnv};

/// A cluster version being connected in the background.
pub(crate) struct Pending {
    cfg: elastic::ClusterConfig,
    /// This worker's environment there, and its connect; `None`: this
    /// worker is not in `cfg` (it leaves when the others switch).
    joining: Option<(WorkerEnv, Connect)>,
    began: SystemTime,
}

/// A background connect: running, or its result.
enum Connect {
    Running(JoinHandle<Result<Session<AnyTransport>, BootstrapError>>),
    Done(Result<Session<AnyTransport>, BootstrapError>),
}

impl Connect {
    /// Takes the result of a task that finished.
    async fn settle(&mut self) {
        if let Connect::Running(task) = self {
            if task.is_finished() {
                let got = task.await.unwrap_or_else(|e| {
                    Err(BootstrapError::Elastic(format!("the connect task: {e}")))
                });
                *self = Connect::Done(got);
            }
        }
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // a connect nobody will adopt: its sockets close with it (a
        // finished one's session closes as it is dropped)
        if let Some((_, Connect::Running(task))) = &self.joining {
            task.abort();
        }
    }
}

impl Worker {
    /// Like [`Worker::resize_from_config`] (a collective: every worker
    /// calls it at the same step), but it never waits for a worker to
    /// come: a newer config is connected in the background, and this
    /// returns `changed: false` until every worker of the current cluster
    /// has connected it (or, for one it leaves out, has seen it); the
    /// call that finds them all done switches every worker to it at once
    /// (`changed`, or `detached` for those left out). A connect that
    /// fails (a new worker never came within `KUNGFU_CONNECT_TIMEOUT_MS`)
    /// fails that call on every worker, which stay on the current
    /// cluster. A newer config meanwhile replaces the one in the
    /// background; [`Worker::resize_from_config`], [`Worker::resize`] and
    /// [`Worker::recover`] drop it.
    pub async fn poll_resize_from_config(&mut self) -> Result<Resized, BootstrapError> {
        let cfg = self.agreed_config(None).await?;
        let unchanged = Resized {
            changed: false,
            detached: false,
        };
        if cfg.version <= self.env.cluster_version {
            self.drop_pending();
            return Ok(unchanged);
        }
        if self
            .pending
            .as_ref()
            .is_none_or(|p| p.cfg.version != cfg.version)
        {
            self.drop_pending();
            self.pending = Some(self.start_pending(cfg));
        }
        let p = self.pending.as_mut().expect("set above");
        let (not_ready, failed) = match &mut p.joining {
            None => (0u8, 0u8),
            Some((_, c)) => {
                c.settle().await;
                match c {
                    Connect::Running(_) => (1, 0),
                    Connect::Done(r) => (0, u8::from(r.is_err())),
                }
            }
        };
        let agreed = self
            .session
            .allreduce("kf/resize/ready", &[not_ready, failed], ReduceOp::Max)
            .await
            .map_err(BootstrapError::Op)?;
        if agreed[1] != 0 {
            let why = match self.pending.take().and_then(|mut p| p.joining.take()) {
                Some((_, Connect::Done(Err(e)))) => e.to_string(),
                _ => "another worker could not connect it".into(),
            };
            return Err(BootstrapError::Elastic(format!(
                "connecting the next cluster version: {why}"
            )));
        }
        if agreed[0] != 0 {
            return Ok(unchanged);
        }
        let mut p = self.pending.take().expect("still there");
        let Some((env, connect)) = p.joining.take() else {
            return Ok(self.detach().await);
        };
        // (this worker's own flags are in the maxima: its connect is done)
        let Connect::Done(Ok(session)) = connect else {
            return Err(BootstrapError::Elastic(
                "the next cluster version: the workers' readiness disagrees with this one's".into(),
            ));
        };
        let old = self.session.clone();
        self.adopt(session, env, p.cfg.clone()).await;
        // the old connections close in the background: every worker has
        // left them for the new ones, and nothing here waits on them
        tokio::spawn(async move { old.close(Duration::from_secs(2)).await });
        self.joined = (p.began, SystemTime::now());
        Ok(Resized {
            changed: true,
            detached: false,
        })
    }

    /// Starts connecting `cfg` in the background (nothing to connect for
    /// a worker it leaves out).
    fn start_pending(&self, cfg: elastic::ClusterConfig) -> Pending {
        let began = SystemTime::now();
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank")
            .clone();
        let joining = cfg.peers.rank_of(&me).map(Rank::idx).map(|rank| {
            let env = self.env_for(rank, &cfg);
            let deadline = Instant::now() + self.env.connect_timeout;
            let task = tokio::spawn(self.connect_version(&env, &cfg, deadline));
            (env, Connect::Running(task))
        });
        Pending {
            cfg,
            joining,
            began,
        }
    }

    /// Drops a cluster version being connected in the background.
    pub(crate) fn drop_pending(&mut self) {
        self.pending = None;
    }
}
