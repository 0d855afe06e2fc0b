//! QUIC backend (quinn, rustls with ring): one connection per pair of
//! ranks, mutual TLS ([`tls`]), and **one unidirectional stream per
//! frame**.
//!
//! Why a stream per frame rather than a stream per peer or per op: QUIC
//! streams are independent in flow control and in loss recovery, so a
//! large frame of one named op never holds up a small frame of another
//! (no head-of-line blocking between ops, which one stream per peer would
//! bring back), and a frame needs no length-prefixed framing inside a
//! shared stream. Opening a stream costs no round trip (a stream id in the
//! first STREAM frame) and the collectives never relied on order between
//! frames ([`crate::Transport`]), so frames arriving in any order is
//! fine. A stream per op would need the op's lifetime on the wire, for
//! nothing the per-frame stream does not already give. The number of
//! streams a peer may have open at once
//! ([`QuicConfig::max_streams`]) bounds the frames in flight per pair, as
//! the flow-control windows bound the bytes.
//!
//! Rank `i` dials every rank below it and accepts every rank above it; on
//! each connection the dialer opens the control stream and runs the shared
//! handshake on it ([`crate::handshake`]: cluster id, version, epoch,
//! ranks, peer-list digest), after TLS has proven both ends hold a
//! certificate of the job. A peer whose certificate fails is refused and
//! the refusal logged (standard error, with its address and why); like a
//! refused handshake, it does not stop the acceptor from waiting for the
//! right peer until the connect deadline.
//!
//! UDP listens on the same host and port as the rank's entry of the peer
//! list (UDP ports are separate from TCP's, so the launcher's reserved
//! TCP port names the QUIC endpoint too). quinn sends and receives with
//! GSO/GRO where the kernel has them, and discovers the path MTU (up to
//! Ethernet's); the socket buffers are raised to
//! [`QuicConfig::udp_buffer`] (the kernel caps them at
//! `net.core.rmem_max` / `wmem_max`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::{PeerList, Rank};
use quinn::{Connection, Endpoint as QuinnEndpoint, RecvStream, SendStream};
use tokio::sync::{mpsc, oneshot};

use crate::connect::{self, Incoming};
use crate::endpoint::{Endpoint, EndpointConfig, Matcher};
use crate::handshake::{self, Identity};
use crate::pool::BufferPool;
use crate::region::Mem;
use crate::wire::{Caps, Tasks, Wire};
use crate::{ClusterVersion, Epoch, Header, Instant, TransportError};

use self::io::{read_conn, reap, write_frame, Payload, Reap};
pub use self::tls::{JobCa, QuicTls};

mod io;
pub mod tls;

/// Settings of a QUIC endpoint.
#[derive(Clone)]
pub struct QuicConfig {
    /// Identifies the job: workers of another job are refused.
    pub cluster_id: u64,
    pub version: ClusterVersion,
    pub epoch: Epoch,
    pub rank: Rank,
    pub peers: PeerList,
    /// This worker's certificates (see [`tls`]).
    pub tls: QuicTls,
    /// The job's secret: with it, every peer must also prove it holds the
    /// secret in the handshake on the connection's first stream (as on
    /// TCP), so that a certificate the TLS layer accepts (one of the
    /// user's CA, say) is not enough to join. `None`: TLS alone.
    pub secret: Option<crate::auth::JobSecret>,
    /// How long [`QuicTransport::connect`] waits for every peer.
    pub connect_timeout: Duration,
    /// The largest frame payload accepted.
    pub max_frame: usize,
    /// Unmatched bytes held before the endpoint stops reading a peer.
    pub mailbox_bytes: usize,
    /// The buffer pool received payloads come from (`None`: a new one).
    pub pool: Option<Arc<BufferPool>>,
    /// How long a receive stays runnable before it sleeps.
    pub spin: Duration,
    /// Streams (frames) a peer may have open at once.
    pub max_streams: u32,
    /// Bytes a peer may have unread on one stream, and on the connection.
    pub stream_window: u32,
    pub connection_window: u32,
    /// A silent peer is lost after this long (keep-alives go every third
    /// of it).
    pub idle_timeout: Duration,
    /// The UDP socket buffers asked for.
    pub udp_buffer: usize,
}

impl QuicConfig {
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

    /// Defaults: 30 s to connect, 64 MiB frames, a 256 MiB mailbox, 1024
    /// streams in flight per peer, 16 MiB stream and 64 MiB connection
    /// windows, lost after 30 s of silence, 8 MiB socket buffers.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        peers: PeerList,
        tls: QuicTls,
    ) -> QuicConfig {
        QuicConfig {
            cluster_id,
            version,
            epoch,
            rank,
            peers,
            tls,
            secret: None,
            connect_timeout: Duration::from_secs(30),
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            pool: None,
            spin: Duration::from_micros(50),
            max_streams: 1024,
            stream_window: 16 << 20,
            connection_window: 64 << 20,
            idle_timeout: Duration::from_secs(30),
            udp_buffer: 8 << 20,
        }
    }

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

    fn transport_config(&self) -> Result<Arc<quinn::TransportConfig>, TransportError> {
        let mut t = quinn::TransportConfig::default();
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout)
            .map_err(|e| TransportError::Tls(format!("idle timeout: {e}")))?;
        t.max_idle_timeout(Some(idle))
            .keep_alive_interval(Some(self.idle_timeout / 3))
            .max_concurrent_uni_streams(self.max_streams.into())
            .max_concurrent_bidi_streams(1u8.into())
            .stream_receive_window(self.stream_window.into())
            .receive_window(self.connection_window.into())
            .send_window(u64::from(self.connection_window))
            // a datacenter's round trip, not the Internet's default 333 ms:
            // lost handshake packets are resent after ~50 ms, not 1 s
            .initial_rtt(Duration::from_millis(10));
        Ok(Arc::new(t))
    }
}

/// A QUIC endpoint: the generic [`Endpoint`] over one [`QuicWire`].
pub type QuicTransport = Endpoint<QuicWire>;

/// One peer's connection and the tasks that serve it.
struct Link {
    conn: Connection,
    reaper: mpsc::UnboundedSender<Reap>,
}

/// The QUIC wire.
pub struct QuicWire {
    me: Rank,
    max_frame: usize,
    endpoint: QuinnEndpoint,
    links: Vec<Option<Link>>,
    closing: AtomicBool,
    tasks: Tasks,
    readers: Tasks,
    /// Where a borrowed payload's copy comes from (see [`write_frame`]).
    pool: Arc<BufferPool>,
}

impl Endpoint<QuicWire> {
    /// Connects to every peer of `config.peers` over QUIC, receiving on
    /// `socket` (bound where the other ranks were told this rank is).
    pub async fn connect(
        config: QuicConfig,
        socket: std::net::UdpSocket,
    ) -> Result<Arc<QuicTransport>, TransportError> {
        let (rank, size, version) = (config.rank, config.peers.len(), config.version);
        let (wire, matcher, pool, cfg) = QuicWire::connect(config, socket).await?;
        let e = Endpoint::new(rank, size, version, "quic", matcher, pool, vec![wire], cfg);
        Ok(Arc::new(e))
    }
}

/// Binds the UDP socket of `rank` at its entry of `peers` (any address of
/// the host if the entry's address is not this host's).
pub fn bind_udp(peers: &PeerList, rank: Rank) -> Result<std::net::UdpSocket, TransportError> {
    let p = entry(peers, rank)?;
    try_bind(p).map_err(|e| bind_failed(p, rank, e))
}

/// [`bind_udp`], retrying while the port is still held (until `deadline`):
/// after a transport swap the QUIC endpoint of an earlier epoch may still
/// be closing on it (its connections draining) when the job swaps back.
pub async fn bind_udp_until(
    peers: &PeerList,
    rank: Rank,
    deadline: Instant,
) -> Result<std::net::UdpSocket, TransportError> {
    let p = entry(peers, rank)?;
    loop {
        match try_bind(p) {
            Ok(s) => return Ok(s),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            Err(e) => return Err(bind_failed(p, rank, e)),
        }
    }
}

fn entry(peers: &PeerList, rank: Rank) -> Result<&kungfu_topology::Peer, TransportError> {
    peers.peer(rank).ok_or(TransportError::NoSuchPeer {
        peer: rank,
        size: peers.len(),
    })
}

fn try_bind(p: &kungfu_topology::Peer) -> std::io::Result<std::net::UdpSocket> {
    match std::net::UdpSocket::bind((p.host.as_str(), p.port)) {
        Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
            std::net::UdpSocket::bind(("0.0.0.0", p.port))
        }
        other => other,
    }
}

fn bind_failed(p: &kungfu_topology::Peer, rank: Rank, e: std::io::Error) -> TransportError {
    TransportError::Handshake {
        peer: Some(rank),
        addr: p.to_string(),
        reason: format!("bind UDP: {e}"),
    }
}

impl QuicWire {
    /// [`QuicTransport::connect`]'s wire, with its matcher, pool and how
    /// its endpoint should receive.
    pub async fn connect(
        config: QuicConfig,
        socket: std::net::UdpSocket,
    ) -> Result<(QuicWire, Arc<Matcher>, Arc<BufferPool>, EndpointConfig), TransportError> {
        let n = config.peers.len();
        config.identity_checked()?;
        let deadline = Instant::now() + config.connect_timeout;
        let endpoint = quinn_endpoint(&config, socket)?;
        let cfg = Arc::new(config);
        let (dialed, accepted) = tokio::join!(
            dial_lower(&cfg, &endpoint, deadline),
            accept_higher(&cfg, &endpoint, deadline)
        );
        let mut conns = dialed?;
        conns.extend(accepted?);

        let matcher = Arc::new(Matcher::new(cfg.epoch, cfg.mailbox_bytes));
        let pool = cfg
            .pool
            .clone()
            .unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
        let (mut links, mut tasks, mut readers) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..n {
            let peer = Rank(r as u32);
            let Some((conn, send, recv)) = conns.remove(&peer) else {
                links.push(None);
                continue;
            };
            let (tx, rx) = mpsc::unbounded_channel();
            tasks.push(tokio::spawn(reap(rx, send)));
            readers.push(tokio::spawn(read_conn(
                conn.clone(),
                recv,
                peer,
                matcher.clone(),
                cfg.max_frame,
                pool.clone(),
            )));
            links.push(Some(Link { conn, reaper: tx }));
        }
        let wire = QuicWire {
            me: cfg.rank,
            max_frame: cfg.max_frame,
            endpoint,
            links,
            closing: AtomicBool::new(false),
            tasks: Tasks::new(tasks),
            readers: Tasks::new(readers),
            pool: pool.clone(),
        };
        let ecfg = EndpointConfig {
            spin: cfg.spin,
            oversubscribed: cfg.peers.local_size(cfg.rank) > crate::host_cpus(),
        };
        Ok((wire, matcher, pool, ecfg))
    }

    /// quinn's statistics of each connection (path MTU, congestion
    /// window, lost packets, round trip), for diagnosing speed.
    pub fn stats(&self) -> Vec<(Rank, quinn::ConnectionStats)> {
        let links = self.links.iter().enumerate();
        links
            .filter_map(|(r, l)| Some((Rank(r as u32), l.as_ref()?.conn.stats())))
            .collect()
    }

    fn link(&self, to: Rank) -> Result<&Link, TransportError> {
        let size = self.links.len();
        let link = self.links.get(to.idx()).and_then(Option::as_ref);
        link.ok_or(TransportError::NoSuchPeer { peer: to, size })
    }

    async fn send_frame(
        &self,
        to: Rank,
        mut header: Header,
        len: usize,
        payload: Payload<'_>,
    ) -> Result<(), TransportError> {
        let link = self.link(to)?;
        if self.closing.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        header.len = len as u64;
        let s = write_frame(&link.conn, header.encode(), payload, &self.pool)
            .await
            .map_err(|reason| TransportError::PeerLost {
                peer: to,
                reason: reason.into(),
            })?;
        link.reaper
            .send(Reap::Stream(s))
            .map_err(|_| TransportError::Closed)
    }
}

/// The quinn endpoint on `socket`: server and client, both with this
/// worker's certificate.
fn quinn_endpoint(
    cfg: &QuicConfig,
    socket: std::net::UdpSocket,
) -> Result<QuinnEndpoint, TransportError> {
    let sock = socket2::SockRef::from(&socket);
    // Best effort: the kernel caps these at net.core.{r,w}mem_max.
    let _ = sock.set_recv_buffer_size(cfg.udp_buffer);
    let _ = sock.set_send_buffer_size(cfg.udp_buffer);
    let transport = cfg.transport_config()?;
    let tls_err = |e: &dyn std::fmt::Display| TransportError::Tls(e.to_string());
    let server_tls = quinn::crypto::rustls::QuicServerConfig::try_from(cfg.tls.server_config()?)
        .map_err(|e| tls_err(&e))?;
    let mut server = quinn::ServerConfig::with_crypto(Arc::new(server_tls));
    server.transport_config(transport.clone());
    let client_tls = quinn::crypto::rustls::QuicClientConfig::try_from(cfg.tls.client_config()?)
        .map_err(|e| tls_err(&e))?;
    let mut client = quinn::ClientConfig::new(Arc::new(client_tls));
    client.transport_config(transport);
    let runtime = Arc::new(quinn::TokioRuntime);
    // quinn's default datagram limit (1472: Ethernet's MTU) stays: on
    // this kernel's loopback, datagrams of 9-64 KiB were dropped in bursts
    // under load (socket buffers capped at net.core.rmem_max), quinn took
    // that for a black hole and fell back to 1200 bytes.
    let mut ep = QuinnEndpoint::new(
        quinn::EndpointConfig::default(),
        Some(server),
        socket,
        runtime,
    )
    .map_err(|e| TransportError::Handshake {
        peer: Some(cfg.rank),
        addr: String::new(),
        reason: format!("QUIC endpoint: {e}"),
    })?;
    ep.set_default_client_config(client);
    Ok(ep)
}

type Conn = (Connection, SendStream, RecvStream);

async fn dial_lower(
    cfg: &Arc<QuicConfig>,
    ep: &QuinnEndpoint,
    deadline: Instant,
) -> Result<HashMap<Rank, Conn>, TransportError> {
    let lower = (0..cfg.rank.0).map(Rank);
    connect::dial_all(lower, |peer| {
        let (cfg, ep) = (cfg.clone(), ep.clone());
        async move { dial_one(&cfg, &ep, peer, deadline).await }
    })
    .await
}

async fn resolve(host: &str, port: u16) -> Result<SocketAddr, String> {
    let mut addrs = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| format!("resolve {host}: {e}"))?;
    addrs.next().ok_or_else(|| format!("{host} has no address"))
}

async fn dial_one(
    cfg: &QuicConfig,
    ep: &QuinnEndpoint,
    peer: Rank,
    deadline: Instant,
) -> Result<Conn, TransportError> {
    let p = cfg.peers.peer(peer).expect("peer below our rank");
    connect::dial(peer, p.to_string(), deadline, || async {
        let to = resolve(&p.host, p.port).await.map_err(|e| (true, e))?;
        let connecting = ep
            .connect(to, tls::SERVER_NAME)
            .map_err(|e| (false, format!("connect: {e}")))?;
        let conn = connecting.await.map_err(|e| dial_failed(&e))?;
        let (send, recv) = conn
            .open_bi()
            .await
            .map_err(|e| (true, format!("open control stream: {e}")))?;
        let mut control = tokio::io::join(recv, send);
        handshake::dial(&mut control, &cfg.identity(), peer)
            .await
            .map_err(|e| (e.retry, e.reason))?;
        let (recv, send) = control.into_inner();
        Ok((conn, send, recv))
    })
    .await
}

/// Whether a failed QUIC handshake is worth another attempt: not when TLS
/// refused (either side), which another attempt will not change.
fn dial_failed(e: &quinn::ConnectionError) -> (bool, String) {
    use quinn::ConnectionError as E;
    match e {
        E::TransportError(t) if t.code.to_string().contains("crypto") => {
            (false, format!("TLS: {e}"))
        }
        E::ConnectionClosed(c) if c.error_code.to_string().contains("crypto") => {
            (false, format!("TLS refused by the peer: {e}"))
        }
        E::TimedOut => (true, "no answer (timed out)".into()),
        other => (true, format!("connect: {other}")),
    }
}

async fn accept_higher(
    cfg: &Arc<QuicConfig>,
    ep: &QuinnEndpoint,
    deadline: Instant,
) -> Result<HashMap<Rank, Conn>, TransportError> {
    let wanted: Vec<Rank> = (cfg.rank.0 + 1..cfg.peers.len() as u32).map(Rank).collect();
    let local = ep.local_addr().map(|a| a.to_string()).unwrap_or_default();
    let incoming = || async {
        match ep.accept().await {
            Some(inc) => {
                let addr = inc.remote_address().to_string();
                Incoming::Conn(inc, addr)
            }
            None => Incoming::Closed,
        }
    };
    let answer = |inc: quinn::Incoming| {
        let cfg = cfg.clone();
        async move { answer(&cfg, inc).await }
    };
    // refusals logged: a peer without the job's certificate is news
    connect::accept(&wanted, &local, deadline, Some(cfg.rank), incoming, answer).await
}

/// Completes TLS with a dialer (which must hold a certificate of the job)
/// and answers its hello on the control stream: its rank, if accepted.
async fn answer(cfg: &QuicConfig, inc: quinn::Incoming) -> Result<(Rank, Conn), String> {
    let conn = inc
        .accept()
        .map_err(|e| format!("QUIC: {e}"))?
        .await
        .map_err(|e| format!("TLS or QUIC handshake: {e}"))?;
    let (send, recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("no control stream: {e}"))?;
    let mut control = tokio::io::join(recv, send);
    // Only higher ranks dial.
    let may_dial = |r: Rank| r > cfg.rank;
    let from = match handshake::answer(&mut control, &cfg.identity(), may_dial).await {
        Ok(from) => from,
        Err(why) => {
            // let the refusal reach the dialer before the connection goes
            let (_, mut send) = control.into_inner();
            let _ = send.finish();
            let _ = tokio::time::timeout(Duration::from_millis(100), send.stopped()).await;
            conn.close(4u32.into(), b"refused");
            return Err(why);
        }
    };
    let (recv, send) = control.into_inner();
    Ok((from, (conn, send, recv)))
}

impl Wire for QuicWire {
    fn caps(&self) -> Caps {
        // the payload is copied into quinn's buffers before a send resolves
        Caps::stream("quic", self.max_frame)
    }

    fn reaches(&self, peer: Rank) -> bool {
        peer != self.me && self.links.get(peer.idx()).is_some_and(Option::is_some)
    }

    async fn send(&self, to: Rank, header: Header, payload: Bytes) -> Result<(), TransportError> {
        let len = payload.len();
        self.send_frame(to, header, len, Payload::Bytes(payload))
            .await
    }

    async fn send_mem(&self, to: Rank, header: Header, payload: Mem) -> Result<(), TransportError> {
        let len = payload.len();
        self.send_frame(to, header, len, Payload::Slice(payload.as_slice()))
            .await
    }

    async fn close(&self, linger: Duration) {
        let deadline = Instant::now() + linger;
        self.closing.store(true, Ordering::Release);
        // every stream acknowledged, then the goodbye, on every link
        let mut byes = Vec::new();
        for link in self.links.iter().flatten() {
            let (tx, rx) = oneshot::channel();
            if link.reaper.send(Reap::Bye(tx)).is_ok() {
                byes.push(rx);
            }
        }
        for b in byes {
            let _ = tokio::time::timeout_at(deadline, b).await;
        }
        // read (and deliver) until every peer said goodbye too
        self.readers.join_until(deadline).await;
        for link in self.links.iter().flatten() {
            link.conn.close(0u32.into(), b"closed");
        }
        // the close frames out (bounded: a peer that is gone never answers)
        let _ = tokio::time::timeout_at(deadline, self.endpoint.wait_idle()).await;
        self.shutdown();
    }

    fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        for link in self.links.iter().flatten() {
            link.conn.close(1u32.into(), b"shut down");
        }
        self.tasks.abort();
        self.readers.abort();
    }
}

impl Drop for QuicWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}
