//! TCP backend: one connection per pair of ranks, `TCP_NODELAY`.
//!
//! Rank `i` dials every rank below it and accepts every rank above it,
//! each connection opened with the shared handshake ([`crate::handshake`]:
//! cluster id, cluster version, epoch, both ranks, the digest of the peer
//! list; a mismatch is refused on both sides, saying what differs). A
//! refused connection does not stop the acceptor from waiting for the right
//! peer until the connect deadline, so a stray process cannot break a job.
//!
//! After the handshake each connection has a reader task (frames into the
//! [`Matcher`]; it stops reading while the matcher is full) and a writer task
//! fed by a queue, so a cancelled send never leaves half a frame on the
//! wire, and frames queued together leave in one write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::endpoint::{Endpoint, EndpointConfig, Matcher};
use crate::pool::BufferPool;
use crate::wire::{Caps, Wire};
use crate::{ClusterVersion, Epoch, Header, Instant, PeerSet, Transport, TransportError};

use self::io::{read_loop, write_loop, Outgoing, WriterMsg};
use crate::handshake::{self, Identity};

mod io;

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
    /// Who this endpoint is, for the handshake.
    fn identity(&self) -> Identity {
        Identity {
            cluster_id: self.cluster_id,
            version: self.version,
            epoch: self.epoch,
            rank: self.rank,
            size: self.peers.len(),
            peers_digest: self.peers.digest().0,
        }
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
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Reader tasks: they end when the peer closes its side.
    readers: Mutex<Vec<JoinHandle<()>>>,
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
        if config.rank.idx() >= n {
            return Err(TransportError::NoSuchPeer {
                peer: config.rank,
                size: n,
            });
        }
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
            tasks: Mutex::new(tasks),
            readers: Mutex::new(readers),
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
    let mut set = tokio::task::JoinSet::new();
    for r in (0..cfg.rank.0).filter(|&r| !cfg.skip.contains(Rank(r))) {
        let cfg = cfg.clone();
        set.spawn(async move {
            let peer = Rank(r);
            dial_one(&cfg, peer, deadline).await.map(|s| (peer, s))
        });
    }
    let mut out = HashMap::new();
    while let Some(res) = set.join_next().await {
        let (peer, s) = res.map_err(|e| TransportError::Handshake {
            peer: None,
            addr: String::new(),
            reason: format!("dial task failed: {e}"),
        })??;
        out.insert(peer, s);
    }
    Ok(out)
}

async fn dial_one(
    cfg: &TcpConfig,
    peer: Rank,
    deadline: Instant,
) -> Result<TcpStream, TransportError> {
    let p = cfg.peers.peer(peer).expect("peer below our rank");
    let addr = p.to_string();
    let mut backoff = Duration::from_millis(5);
    let mut last_err = String::from("no attempt");
    loop {
        if Instant::now() >= deadline {
            return Err(TransportError::Handshake {
                peer: Some(peer),
                addr,
                reason: format!("could not connect before the deadline: {last_err}"),
            });
        }
        let attempt = tokio::time::timeout_at(deadline, async {
            let mut s = TcpStream::connect((p.host.as_str(), p.port))
                .await
                .map_err(|e| (true, format!("connect: {e}")))?;
            s.set_nodelay(true)
                .map_err(|e| (true, format!("nodelay: {e}")))?;
            handshake::dial(&mut s, &cfg.identity(), peer)
                .await
                .map_err(|e| (e.retry, e.reason))?;
            Ok(s)
        })
        .await;
        match attempt {
            Ok(Ok(s)) => return Ok(s),
            // A refusal is final: retrying will not change the peer's mind.
            Ok(Err((false, reason))) => {
                return Err(TransportError::Handshake {
                    peer: Some(peer),
                    addr,
                    reason,
                })
            }
            Ok(Err((true, e))) => last_err = e,
            Err(_) => last_err = "timed out".into(),
        }
        tokio::time::sleep(backoff.min(deadline.saturating_duration_since(Instant::now()))).await;
        backoff = (backoff * 2).min(Duration::from_millis(200));
    }
}

async fn accept_higher(
    cfg: Arc<TcpConfig>,
    listener: TcpListener,
    deadline: Instant,
) -> Result<HashMap<Rank, TcpStream>, TransportError> {
    let n = cfg.peers.len();
    let expected = (cfg.rank.0 + 1..n as u32)
        .filter(|&r| !cfg.skip.contains(Rank(r)))
        .count();
    let mut out: HashMap<Rank, TcpStream> = HashMap::new();
    let mut refusals: Vec<String> = Vec::new();
    let mut pending = tokio::task::JoinSet::new();
    while out.len() < expected {
        tokio::select! {
            acc = listener.accept() => {
                let (s, addr) = match acc {
                    Ok(x) => x,
                    Err(e) => { refusals.push(format!("accept: {e}")); continue; }
                };
                let cfg = cfg.clone();
                // Each handshake runs on its own so that a silent client
                // cannot hold up the others.
                pending.spawn(async move {
                    let r = tokio::time::timeout_at(deadline, answer(&cfg, s)).await;
                    (addr, r.unwrap_or_else(|_| Err("no hello before the deadline".into())))
                });
            }
            Some(done) = pending.join_next(), if !pending.is_empty() => {
                let Ok((addr, res)) = done else { continue };
                match res {
                    Ok((rank, s)) => {
                        match out.entry(rank) {
                            std::collections::hash_map::Entry::Occupied(_) => {
                                refusals.push(format!("{addr}: second connection from {rank}"));
                            }
                            std::collections::hash_map::Entry::Vacant(v) => {
                                v.insert(s);
                            }
                        }
                    }
                    Err(why) => refusals.push(format!("{addr}: {why}")),
                }
            }
            _ = tokio::time::sleep_until(deadline) => {
                let missing: Vec<String> = (cfg.rank.0 + 1..n as u32)
                    .map(Rank)
                    .filter(|r| !out.contains_key(r) && !cfg.skip.contains(*r))
                    .map(|r| r.0.to_string())
                    .collect();
                return Err(TransportError::Handshake {
                    peer: None,
                    addr: listener.local_addr().map(|a| a.to_string()).unwrap_or_default(),
                    reason: format!(
                        "ranks [{}] did not connect before the deadline{}",
                        missing.join(", "),
                        if refusals.is_empty() { String::new() } else {
                            format!("; refused: {}", refusals.join("; "))
                        }
                    ),
                });
            }
        }
    }
    Ok(out)
}

/// Answers a dialer's hello on `s` (the shared handshake): its rank, if
/// accepted.
async fn answer(cfg: &TcpConfig, mut s: TcpStream) -> Result<(Rank, TcpStream), String> {
    s.set_nodelay(true).map_err(|e| format!("nodelay: {e}"))?;
    // Only higher ranks dial, and none that another wire reaches.
    let may_dial = |r: Rank| r > cfg.rank && !cfg.skip.contains(r);
    let from = handshake::answer(&mut s, &cfg.identity(), may_dial).await?;
    Ok((from, s))
}

impl Wire for TcpWire {
    fn caps(&self) -> Caps {
        Caps {
            name: "tcp",
            max_frame: self.max_frame,
            inject: false,
            holds_sends: false,
            polled: false,
            lends: false,
            needs_registration: false,
            borrows_sends: true,
            eager_max: self.max_frame,
        }
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
        let readers = std::mem::take(&mut *self.readers.lock().unwrap_or_else(|e| e.into_inner()));
        for mut r in readers {
            if tokio::time::timeout_at(deadline, &mut r).await.is_err() {
                r.abort();
            }
        }
        self.shutdown();
    }

    fn shutdown(&self) {
        let tasks = std::mem::take(&mut *self.tasks.lock().unwrap_or_else(|e| e.into_inner()));
        let readers = std::mem::take(&mut *self.readers.lock().unwrap_or_else(|e| e.into_inner()));
        for t in tasks.into_iter().chain(readers) {
            t.abort();
        }
    }
}

impl Drop for TcpWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}
