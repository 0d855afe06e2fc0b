//! Swapping a worker's transport at a consistency barrier, without tearing
//! the job down ([`TransportSwap`]): ops in flight finish on the old
//! transport, the workers agree on the new one, connect it, and the epoch
//! advances; later ops run on the new one (see
//! [`Session::swap_transport`]).

use std::sync::{Arc, Mutex};

use kungfu_collectives::{CollectiveError, Session};
use kungfu_topology::{PeerList, Rank};
use kungfu_transport::any::{AnyTransport, TransportKind};
use kungfu_transport::pool::BufferPool;
use kungfu_transport::{Epoch, TransportError};
use tokio::time::Instant;

use crate::connect::Link;
use crate::{listen, BootstrapError, WorkerEnv};

/// What swaps a worker's transport; cheap to clone (the C ABI keeps one
/// per call). A collective: every worker swaps to the same transport at the
/// same point of its sequence of ops.
#[derive(Clone)]
pub struct TransportSwap {
    pub(crate) env: WorkerEnv,
    pub(crate) peers: PeerList,
    pub(crate) cluster_id: u64,
    pub(crate) pool: Arc<BufferPool>,
    pub(crate) session: Session<AnyTransport>,
    /// The transport in use (the worker's too).
    pub(crate) current: Arc<Mutex<TransportKind>>,
}

impl TransportSwap {
    /// The name every worker must ask for alike: the kind, and for fabric
    /// the provider.
    fn name(&self, kind: TransportKind) -> String {
        match (kind, &self.env.fabric_provider) {
            (TransportKind::Fabric, Some(p)) => format!("fabric ({p})"),
            (k, _) => k.name().to_string(),
        }
    }

    /// Swaps to `kind`; returns the new epoch. If `kind` is not available
    /// on every worker (not built in, shared memory across hosts, QUIC
    /// without certificates, a provider or device missing), every worker
    /// gets an error (the one lacking it, why) and nothing changes.
    pub async fn swap(&self, kind: TransportKind) -> Result<Epoch, CollectiveError> {
        let epoch = self.swap_if(kind, self.link().can(kind)).await?;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) = kind;
        Ok(epoch)
    }

    fn link(&self) -> Link<'_> {
        Link {
            env: &self.env,
            peers: &self.peers,
            cluster_id: self.cluster_id,
            pool: &self.pool,
        }
    }

    /// Swaps to `kind` if every worker `can` (this one's answer).
    async fn swap_if(
        &self,
        kind: TransportKind,
        can: Result<(), BootstrapError>,
    ) -> Result<Epoch, CollectiveError> {
        let name = self.name(kind);
        let link = self.link();
        let me = self
            .peers
            .peer(Rank(self.env.rank as u32))
            .expect("own rank")
            .clone();
        let failed = |e: BootstrapError, epoch: Epoch| CollectiveError::Transport {
            name: "kf/swap-transport".into(),
            epoch,
            source: match e {
                BootstrapError::Transport(t) => t,
                BootstrapError::UnsupportedTransport(_) => TransportError::Unavailable {
                    transport: name.clone(),
                    reason: format!(
                        "not built in (this build has: {})",
                        TransportKind::available()
                    ),
                },
                other => TransportError::Unavailable {
                    transport: name.clone(),
                    reason: other.to_string(),
                },
            },
        };
        let connect = |epoch: Epoch| async move {
            let deadline = Instant::now() + self.env.connect_timeout;
            // the peer list's port: with an inherited socket, a duplicate
            let listener = listen::listen(&me, self.env.listen_fd)
                .await
                .map_err(|e| failed(e, epoch))?;
            link.transport(kind, listener, epoch, deadline)
                .await
                .map_err(|e| failed(e, epoch))
        };
        match self
            .session
            .swap_transport(&name, can.is_ok(), connect)
            .await
        {
            Ok(epoch) => Ok(epoch),
            // the worker that lacks it says why; the others that it is
            // not available on every worker
            Err(e) => Err(match can {
                Err(why) => failed(why, self.session.epoch()),
                Ok(()) => e,
            }),
        }
    }

    /// `auto` across hosts, once its TCP (and shared-memory) endpoint is
    /// up: moves the job onto RDMA if every worker has it (a collective,
    /// like [`swap`](Self::swap)). It tries libfabric with the provider
    /// `KUNGFU_FABRIC_PROVIDER` names, else with a hardware provider
    /// (`efa`, `verbs;ofi_rxm`) if libfabric offers one here; then, in a
    /// build with `verbs`, ibverbs. Every worker must get the same answer,
    /// else the job stays where it is. The transport kind stays `auto`.
    /// Returns whether it moved, and why not over each RDMA wire tried.
    // without an RDMA wire built in there is nothing to try or change
    #[cfg_attr(not(any(feature = "fabric", feature = "verbs")), allow(unused_mut))]
    pub(crate) async fn auto_across_hosts(mut self) -> (bool, Vec<String>) {
        let mut why = Vec::new();
        #[cfg(feature = "fabric")]
        {
            let found = match &self.env.fabric_provider {
                Some(p) => Ok(p.clone()),
                None => kungfu_transport::fabric::hardware_provider().map(String::from),
            };
            // a worker without one asks for a name no provider has, so
            // that the names disagree as well as the availability
            self.env.fabric_provider = Some(found.as_ref().map_or("none", |p| p).to_string());
            let can = match found {
                Ok(_) => self.link().can(TransportKind::Fabric),
                Err(e) => Err(e.into()),
            };
            match self.swap_if(TransportKind::Fabric, can).await {
                Ok(_) => return (true, why),
                Err(e) => why.push(causes(&e)),
            }
        }
        #[cfg(feature = "verbs")]
        {
            let can = self.link().can(TransportKind::Verbs);
            match self.swap_if(TransportKind::Verbs, can).await {
                Ok(_) => return (true, why),
                Err(e) => why.push(causes(&e)),
            }
        }
        (false, why)
    }
}

#[cfg(any(feature = "fabric", feature = "verbs"))]
/// An error and its causes, for a log line: the reason a wire was not
/// available is in the transport error under the collective's.
fn causes(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        let line = c.to_string();
        if !s.contains(&line) {
            s = format!("{s}: {line}");
        }
        next = c.source();
    }
    s
}
