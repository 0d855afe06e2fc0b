//! TCP backend: one connection per pair of ranks, `TCP_NODELAY`.
//!
//! Rank `i` dials every rank below it and accepts every rank above it,
//! each connection opened with the shared handshake ([`crate::handshake`]:
//! cluster id, cluster version, epoch, both ranks, the digest of the peer
//! list, and with [`TcpConfig::secret`] a mutual proof of the job secret;
//! a mismatch is refused on both sides, saying what differs). A
//! refused connection does not stop the acceptor from waiting for the right
//! peer until the connect deadline, so a stray process cannot break a job.
//!
//! After the handshake each connection has a reader task (frames into the
//! [`Matcher`]; it stops reading while the matcher is full) and a writer task
//! fed by a queue, so a cancelled send never leaves half a frame on the
//! wire, and frames queued together leave in one write.
//!
//! For chaos tests, `KUNGFU_FAULTS` makes the writers drop a connection or
//! hold their frames on a signal (see `faults.rs`; off when unset).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::endpoint::{Endpoint, EndpointConfig, Matcher};
use crate::pool::BufferPool;
use crate::wire::{Caps, Tasks, Wire};
use crate::{ClusterVersion, Epoch, Header, Instant, PeerSet, Transport, TransportError};

use self::io::{read_loop, write_loop, Outgoing, WriterMsg};
use crate::connect::{self, Incoming};
use crate::handshake::Identity;

mod faults;
mod io;

pub use self::faults::FAULTS_VAR;

/// Settings of a TCP endpoint.
#[derive(Clone)]
pub struct TcpConfig {
    /// Identifies the job: workers of another job are refused.
    pub cluster_id: u64,
    /// The cluster version: a peer of another version is refused.
    pub version: ClusterVersion,
    /// The epoch this endpoint starts at (0 for a fresh version): a peer
    /// at another epoch is refused.
    pub epoch: Epoch,
    pub rank: Rank,
    pub peers: PeerList,
    /// The job's secret: every peer must prove it holds it (see
    /// [`crate::handshake`]); `None`: links are not authenticated.
    pub secret: Option<crate::auth::JobSecret>,
    /// How long [`TcpTransport::connect`] waits for every peer.
    pub connect_timeout: Duration,
    /// The largest frame payload accepted; a larger one is a protocol error.
    pub max_frame: usize,
    /// Unmatched bytes held before the endpoint stops reading a peer.
    pub mailbox_bytes: usize,
    /// Ranks this endpoint does not connect to (another backend reaches
    /// them; see [`crate::any::connect_auto`]). Every rank must skip the same pairs.
    pub skip: PeerSet,
    /// A matcher shared with another backend.
    pub matcher: Option<Arc<Matcher>>,
    /// The process's buffer pool, which received payloads come from;
    /// `None`: a new one of [`BufferPool::DEFAULT_BUDGET`].
    pub pool: Option<Arc<BufferPool>>,
    /// How long a receive stays runnable (letting the runtime poll the
    /// sockets) before it sleeps. Measured on 2 cores, 4-byte allreduce:
    /// 2 ranks ~100 -> ~25 us; 4 ranks (more than cores, so the spin
    /// yields to the OS) ~150 -> ~100 us.
    pub spin: Duration,
}

impl TcpConfig {
    /// This rank's identity, once its rank is checked against the peers.
    fn identity_checked(&self) -> Result<Identity, TransportError> {
        Identity::of(
            self.cluster_id,
            self.version,
            self.epoch,
            self.rank,
            &self.peers,
            self.secret.as_ref(),
        )
    }

    /// Who this endpoint is, for the handshake.
    fn identity(&self) -> Identity {
        Identity::of(
            self.cluster_id,
            self.version,
            self.epoch,
            self.rank,
            &self.peers,
            self.secret.as_ref(),
        )
        .expect("the rank is checked at connect")
    }

    /// Defaults: 30 s to connect, 64 MiB frames, a 256 MiB mailbox, a
    /// new buffer pool, 50 us of spinning before a receive sleeps.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: PeerList,
    ) -> TcpConfig {
        TcpConfig {
            cluster_id,
            version,
            epoch,
            rank,
            peers,
            secret: None,
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            skip: PeerSet::new(),
            matcher: None,
            pool: None,
            spin: Duration::from_micros(50),
        }
    }
}

/// A TCP endpoint: the generic [`Endpoint`] over one [`TcpWire`]. Build
/// with [`TcpTransport::connect`].
pub type TcpTransport = Endpoint<TcpWire>;

/// The TCP wire: a connection per peer, each with a reader and a writer
/// task.
pub struct TcpWire {
    max_frame: usize,
    writers: Vec<Option<mpsc::Sender<WriterMsg>>>,
    /// Writer tasks (they end on their own after a `Finish`).
    tasks: Tasks,
    /// Reader tasks: they end when the peer closes its side.
    readers: Tasks,
}

impl Endpoint<TcpWire> {
    /// Connects to every peer of `config.peers`, accepting on `listener`
    /// (which must listen at this rank's entry of the peer list, or wherever
    /// the other ranks were told it is). Fails if a peer refuses the
    /// handshake, or if not every peer is connected by
    /// `config.connect_timeout`.
    pub async fn connect(
        config: TcpConfig,
        listener: TcpListener,
    ) -> Result<Arc<TcpTransport>, TransportError> {
        let (rank, size, version) = (config.rank, config.peers.len(), config.version);
        let (wire, matcher, pool, cfg) = TcpWire::connect(config, listener).await?;
        let e = Endpoint::new(rank, size, version, "tcp", matcher, pool, vec![wire], cfg);
        Ok(Arc::new(e))
    }

    /// How many frames were refused for carrying an older epoch, and the
    /// last such refusal.
    pub fn refusals(&self) -> (u64, Option<TransportError>) {
        (self.matcher().refused(), self.matcher().last_refusal())
    }
}

impl TcpWire {
    /// [`TcpTransport::connect`]'s wire, with the matcher its readers
    /// deliver into (`config.matcher`, or a new one), the pool their
    /// payloads come from (`config.pool`, or a new one) and how its
    /// endpoint should receive.
    pub async fn connect(
        config: TcpConfig,
        listener: TcpListener,
    ) -> Result<(TcpWire, Arc<Matcher>, Arc<BufferPool>, EndpointConfig), TransportError> {
        let n = config.peers.len();
        config.identity_checked()?;
        // with KUNGFU_FAULTS, hear the signals before any peer knows us
        let _ = faults::faults();
        let deadline = Instant::now() + config.connect_timeout;
        let cfg = Arc::new(config);
        let (dialed, accepted) = tokio::join!(
            dial_lower(cfg.clone(), deadline),
            accept_higher(cfg.clone(), listener, deadline)
        );
        let mut streams = dialed?;
        streams.extend(accepted?);

        let matcher = cfg
            .matcher
            .clone()
            .unwrap_or_else(|| Arc::new(Matcher::new(cfg.epoch, cfg.mailbox_bytes)));
        let mut writers = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        let mut readers = Vec::with_capacity(n);
        let pool = cfg
            .pool
            .clone()
            .unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
        for r in 0..n {
            let rank = Rank(r as u32);
            let Some(stream) = streams.remove(&rank) else {
                writers.push(None);
                continue;
            };
            let (rd, wr) = stream.into_split();
            let (tx, rx) = mpsc::channel(1024);
            writers.push(Some(tx));
            readers.push(tokio::spawn(read_loop(
                rd,
                rank,
                matcher.clone(),
                cfg.max_frame,
                pool.clone(),
            )));
            tasks.push(tokio::spawn(write_loop(wr, rank, rx, matcher.clone())));
        }
        let wire = TcpWire {
            max_frame: cfg.max_frame,
            writers,
            tasks: Tasks::new(tasks),
            readers: Tasks::new(readers),
        };
        let ecfg = EndpointConfig {
            spin: cfg.spin,
            oversubscribed: cfg.peers.local_size(cfg.rank) > crate::host_cpus(),
        };
        Ok((wire, matcher, pool, ecfg))
    }
}

async fn dial_lower(
    cfg: Arc<TcpConfig>,
    deadline: Instant,
) -> Result<HashMap<Rank, TcpStream>, TransportError> {
    let lower = (0..cfg.rank.0).map(Rank).filter(|&r| !cfg.skip.contains(r));
    connect::dial_all(lower, |peer| {
        let cfg = cfg.clone();
        async move { dial_one(&cfg, peer, deadline).await }
    })
    .await
}

async fn dial_one(
    cfg: &TcpConfig,
    peer: Rank,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    let p = cfg.peers.peer(peer).expect("peer below our rank");
    let me = cfg.identity();
    connect::dial(peer, p.to_string(), deadline, || {
        connect::tcp_hello(p, &me, peer)
    })
    .await
}

async fn accept_higher(
    cfg: Arc<TcpConfig>,
    listener: TcpListener,
    deadline: Instant,
) -> Result<HashMap<Rank, TcpStream>, TransportError> {
    let wanted: Vec<Rank> = (cfg.rank.0 + 1..cfg.peers.len() as u32)
        .map(Rank)
        .filter(|&r| !cfg.skip.contains(r))
        .collect();
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let incoming = || async {
        match listener.accept().await {
            Ok((s, addr)) => Incoming::Conn(s, addr.to_string()),
            Err(e) => Incoming::Failed(format!("accept: {e}")),
        }
    };
    let answer = |s: TcpStream| {
        let cfg = cfg.clone();
        async move { answer(&cfg, s).await }
    };
    connect::accept(&wanted, &local, deadline, Some(cfg.rank), incoming, answer).await
}

/// Answers a dialer's hello on `s` (the shared handshake): its rank, if
/// accepted.
async fn answer(cfg: &TcpConfig, mut s: TcpStream) -> Result<(Rank, TcpStream), String> {
    // Only higher ranks dial, and none that another wire reaches.
    let may_dial = |r: Rank| r > cfg.rank && !cfg.skip.contains(r);
    let from = connect::tcp_answer(&mut s, &cfg.identity(), may_dial).await?;
    Ok((from, s))
}

impl Wire for TcpWire {
    fn caps(&self) -> Caps {
        Caps::stream("tcp", self.max_frame)
    }

    fn reaches(&self, peer: Rank) -> bool {
        self.writers.get(peer.idx()).is_some_and(Option::is_some)
    }

    async fn send(
        &self,
        to: Rank,
        mut header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        let size = self.writers.len();
        let writer = self.writers.get(to.idx()).and_then(Option::as_ref);
        let writer = writer.ok_or(TransportError::NoSuchPeer { peer: to, size })?;
        header.len = payload.len() as u64;
        let (done, wait) = oneshot::channel();
        let msg = Outgoing {
            header: header.encode(),
            payload,
            done,
        };
        writer
            .send(WriterMsg::Frame(msg))
            .await
            .map_err(|_| TransportError::Closed)?;
        wait.await.map_err(|_| TransportError::Closed)?
    }

    async fn close(&self, linger: Duration) {
        let deadline = Instant::now() + linger;
        let mut acks = Vec::new();
        for w in self.writers.iter().flatten() {
            let (tx, rx) = oneshot::channel();
            if let Ok(Ok(())) =
                tokio::time::timeout_at(deadline, w.send(WriterMsg::Finish(tx))).await
            {
                acks.push(rx);
            }
        }
        for a in acks {
            let _ = tokio::time::timeout_at(deadline, a).await;
        }
        // Read (and deliver) until every peer has closed its side too, so
        // that no connection is torn down with data in flight.
        self.readers.join_until(deadline).await;
        self.shutdown();
    }

    fn shutdown(&self) {
        self.tasks.abort();
        self.readers.abort();
    }
}

impl Drop for TcpWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}
