//! One type for "whichever backend the job chose", so that the layers
//! above (the runtime, the C ABI) need not be generic over it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;

use crate::endpoint::Matcher;
use crate::hybrid::HybridTransport;
use crate::shm::ShmTransport;
use crate::tcp::TcpTransport;
use crate::{
    Capabilities, ClusterVersion, Frame, Header, Instant, OpTag, PeerSet, Transport, TransportError,
};

/// A TCP, shared-memory or hybrid endpoint.
pub enum AnyTransport {
    Tcp(Arc<TcpTransport>),
    Shm(Arc<ShmTransport>),
    Hybrid(Arc<HybridTransport>),
}

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

macro_rules! each {
    ($self:ident, $t:ident => $e:expr) => {
        match $self {
            AnyTransport::Tcp($t) => $e,
            AnyTransport::Shm($t) => $e,
            AnyTransport::Hybrid($t) => $e,
        }
    };
}

impl Transport for AnyTransport {
    fn rank(&self) -> Rank {
        each!(self, t => t.rank())
    }

    fn size(&self) -> usize {
        each!(self, t => t.size())
    }

    fn matcher(&self) -> &Matcher {
        each!(self, t => t.matcher())
    }

    fn version(&self) -> ClusterVersion {
        each!(self, t => t.version())
    }

    fn capabilities(&self) -> Capabilities {
        each!(self, t => t.capabilities())
    }

    fn send(
        &self,
        to: Rank,
        header: Header,
        payload: Bytes,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        let f: Boxed<'_, _> = each!(self, t => Box::pin(t.send(to, header, payload)));
        f
    }

    fn recv<'a>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
    ) -> impl Future<Output = Result<Frame, TransportError>> + Send + 'a {
        let f: Boxed<'a, _> = each!(self, t => Box::pin(t.recv(tag, from, deadline)));
        f
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
        let f: Boxed<'a, _> =
            each!(self, t => Box::pin(t.recv_in_place(tag, from, deadline, apply)));
        f
    }

    fn try_send_now(
        &self,
        to: Rank,
        header: Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        each!(self, t => t.try_send_now(to, header, payload))
    }

    fn sends_in_place(&self, to: Rank) -> bool {
        each!(self, t => t.sends_in_place(to))
    }

    fn close(&self, linger: Duration) -> impl Future<Output = ()> + Send + '_ {
        let f: Boxed<'_, _> = each!(self, t => Box::pin(t.close(linger)));
        f
    }

    fn shutdown(&self) {
        each!(self, t => t.shutdown())
    }
}
