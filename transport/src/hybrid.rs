//! Host-aware transport: shared memory to the ranks of this host, TCP to
//! the others, one matcher for both, so the layers above see one endpoint.
//! Hierarchical strategies (`BINARY_TREE_STAR`, ...) then use both at once:
//! the star inside a host over shared memory, the tree across hosts over
//! TCP.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use tokio::net::TcpListener;

use crate::endpoint::Matcher;
use crate::shm::{ShmConfig, ShmTransport};
use crate::tcp::{TcpConfig, TcpTransport};
use crate::{
    Capabilities, ClusterVersion, Frame, Header, Instant, OpTag, PeerSet, Transport, TransportError,
};

/// Shared memory inside the host, TCP across hosts.
pub struct HybridTransport {
    tcp: Arc<TcpTransport>,
    shm: Arc<ShmTransport>,
    local: PeerSet,
    matcher: Arc<Matcher>,
}

impl HybridTransport {
    /// Connects both backends: `tcp` and `shm` give every setting but the
    /// peer split and the matcher, which this fills in from `peers` (the
    /// ranks on the host of `tcp.rank` go through shared memory), and the
    /// cluster version and starting epoch, which are `tcp`'s for both (one
    /// matcher, one epoch).
    pub async fn connect(
        mut tcp: TcpConfig,
        mut shm: ShmConfig,
        peers: &PeerList,
        listener: TcpListener,
    ) -> Result<Arc<HybridTransport>, TransportError> {
        let me = tcp.rank;
        let local: PeerSet = peers.hosts()[peers.host_of(me)].iter().copied().collect();
        let matcher = Arc::new(Matcher::new(tcp.epoch, tcp.mailbox_bytes));
        shm.version = tcp.version;
        shm.epoch = tcp.epoch;
        tcp.skip = local.clone();
        tcp.matcher = Some(matcher.clone());
        shm.local = Some(local.clone());
        shm.matcher = Some(matcher.clone());
        let (t, s) = tokio::join!(
            TcpTransport::connect(tcp, listener),
            ShmTransport::connect(shm)
        );
        Ok(Arc::new(HybridTransport {
            tcp: t?,
            shm: s?,
            local,
            matcher,
        }))
    }
}

impl Transport for HybridTransport {
    fn rank(&self) -> Rank {
        self.tcp.rank()
    }

    fn size(&self) -> usize {
        self.tcp.size()
    }

    fn matcher(&self) -> &Matcher {
        &self.matcher
    }

    fn version(&self) -> ClusterVersion {
        self.tcp.version()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "shm+tcp",
            ..self.tcp.capabilities()
        }
    }

    async fn send(&self, to: Rank, header: Header, payload: Bytes) -> Result<(), TransportError> {
        if self.local.contains(to) {
            self.shm.send(to, header, payload).await
        } else {
            self.tcp.send(to, header, payload).await
        }
    }

    fn try_send_now(
        &self,
        to: Rank,
        header: Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        if self.local.contains(to) {
            self.shm.try_send_now(to, header, payload)
        } else {
            Ok(false)
        }
    }

    fn sends_in_place(&self, to: Rank) -> bool {
        self.local.contains(to)
    }

    fn recv<'a>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
    ) -> impl Future<Output = Result<Frame, TransportError>> + Send + 'a {
        // The shared matcher holds the frames of both backends; the shm
        // side also polls its rings while it waits.
        self.shm.recv(tag, from, deadline)
    }

    fn recv_in_place<'a, F>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
        apply: F,
    ) -> impl Future<Output = Result<Option<Frame>, TransportError>> + Send + 'a
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool + Send + 'a,
    {
        // Frames of the shm peers may be lent from their rings; tcp frames
        // arrive owned through the shared matcher.
        self.shm.recv_in_place(tag, from, deadline, apply)
    }

    async fn close(&self, linger: Duration) {
        tokio::join!(self.tcp.close(linger), self.shm.close(linger));
    }

    fn shutdown(&self) {
        self.tcp.shutdown();
        self.shm.shutdown();
    }
}
