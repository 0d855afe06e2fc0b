//! Shared-memory backend, for ranks on one host.
//!
//! Every ordered pair of ranks `s -> r` has a single-producer,
//! single-consumer byte ring in a file under `/dev/shm`, created by the
//! receiver and mapped by both. Frames (the same [`Header`] + payload as
//! TCP) are streamed through it, so a frame may be larger than the ring.
//! A sender copies into the ring straight from the op's buffer
//! ([`Transport::try_send_now`](crate::Transport::try_send_now); a frame that does not fit waits in that
//! buffer, not in a copy: the wire declares `holds_sends`). A receiving
//! task that polls the rings takes a frame of its op in place
//! ([`Transport::recv_in_place`](crate::Transport::recv_in_place)): the plan reduces or copies it straight
//! out of the ring into the op's buffer, so a byte is copied once on its
//! way (the reduction reads it where the sender put it). Frames that
//! arrive while no task polls, or ahead of what the plan can take, are
//! copied out into owned buffers by a reader thread per ring, or by the
//! polling task, as before.
//!
//! Idle reader threads leave the rings to a task that polled them within
//! the last `DEFER_TO_POLLER`, and spin before sleeping only when every
//! rank has a core.
//!
//! # Waiting
//!
//! A side that finds the ring empty (or full) spins briefly, then yields,
//! then sleeps on a futex in the shared page; the other side wakes it only
//! when the sleeping flag is set, so a busy pipeline makes no system calls.
//! Sleeps are bounded (a few ms) so that a stop request, a closed ring, or a
//! peer process that died (its pid is in the ring header) is noticed.
//!
//! # Lifetime of the files
//!
//! A ring's file is named `kungfu-<cluster id>-<cluster version>-<from>-<to>` (see
//! [`ring_file_prefix`]). Its name is only how the sender finds it: the
//! sender unlinks it as soon as it has mapped it, before it tells the
//! receiver it attached, so once connected nothing of a job is left in
//! `/dev/shm`, however it ends later. A connect that fails removes the
//! files it created. What no process can remove is a file whose creator
//! was killed before its sender mapped it, or whose sender never came
//! while the creator was killed waiting; the launcher removes those when
//! the job ends ([`remove_cluster_files`]; `kungfu-run` does). Unlinking
//! earlier would need another way to pass the mapping (a memfd sent over a
//! Unix socket), which is not worth a second rendezvous.
//!
//! # Trust
//!
//! A peer process may write anything into a ring it shares: see
//! `ring.rs` for how indices, headers and lengths are checked, and
//! `testing` for the hook that tests it with a live ring.
//!
//! Ring files are created `0600`, so only the job's user opens them. With
//! a job secret ([`ShmConfig::secret`]) the creator seals each ring's
//! identity (cluster id, version, epoch, both ranks, size) with an
//! HMAC-SHA256 over a fresh nonce, keyed by the secret, and the sender
//! checks it before it attaches: a stale ring, or one made by a process of
//! another job (another secret), is refused as a bad credential. It does
//! not keep out another process of the same user, which could read the
//! workers' environment (the secret) and memory anyway; nor does it
//! authenticate the frames that follow.
//!
//! # Testing hooks
//!
//! `KUNGFU_TEST_SHM_STOP=ACTION:STAGE:RANK` ([`TEST_STOP_VAR`]), read
//! once per process, makes rank RANK stop at STAGE of its connection: it
//! prints a line naming the stage on stderr, then kills itself with
//! SIGKILL (`kill`) or blocks for ever (`hang`). The stages: `start`
//! (nothing created yet), `created` (the first of its inbound rings was
//! created), `opened` (an outbound ring was mapped and unlinked, its
//! receiver not yet told), `connected` (set-up done) and `sent` (its first
//! frame is in a ring). The launcher's tests use it to kill workers at each
//! stage of set-up without depending on timing. Unset, it costs a branch
//! per stage. Only builds with the `testing` feature read it (the
//! tests'; `cargo build`, release or not, does not), so an inherited
//! environment cannot stop a user's worker.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use tokio::sync::oneshot;

use self::files::setup;
use self::hooks::{kill_point, stop_here, stops_at, Stage};
use self::io::{read_loop, write_loop, PollClock, ReadPolicy, WriterMsg};
use self::ring::{Ring, RECEIVER_CLOSED, SENDER_CLOSED};
use crate::endpoint::{Endpoint, EndpointConfig};
use crate::endpoint::{Matcher, Pump};
use crate::pool::BufferPool;
use crate::wire::{Apply, Caps, Wire};
use crate::{ClusterVersion, Epoch, Header, Instant, OpTag, PeerSet, TransportError};

pub mod bell;
pub mod cma;
mod files;
mod hooks;
mod io;
pub mod lane;
mod ring;

pub use self::files::{remove_cluster_files, ring_file_prefix, RING_DIR};
pub use self::hooks::TEST_STOP_VAR;

/// Settings of a shared-memory endpoint.
#[derive(Clone)]
pub struct ShmConfig {
    pub cluster_id: u64,
    /// The cluster version: it names the ring files and is part of each
    /// ring's identity.
    pub version: ClusterVersion,
    /// The epoch this endpoint starts at (0 for a fresh version); checked
    /// with the ring's identity.
    pub epoch: Epoch,
    pub rank: Rank,
    /// The number of ranks in the cluster.
    pub size: usize,
    /// The job's secret: each ring's identity is sealed with it by its
    /// creator and checked by its sender, and the sender's seal by the
    /// creator (see "Trust" above); `None`: rings are not sealed.
    pub secret: Option<crate::auth::JobSecret>,
    /// The ranks reached through shared memory (this host's, this rank
    /// included); `None`: all of them.
    pub local: Option<PeerSet>,
    /// A matcher shared with another backend (see [`crate::any::connect_auto`]).
    pub matcher: Option<Arc<Matcher>>,
    /// The process's buffer pool, which frames copied out of the rings
    /// come from; `None`: a new one of [`BufferPool::DEFAULT_BUDGET`].
    pub pool: Option<Arc<BufferPool>>,
    /// Data bytes of each ring (rounded up to a power of two, at least 4 KiB).
    pub ring_bytes: usize,
    pub max_frame: usize,
    pub mailbox_bytes: usize,
    pub connect_timeout: Duration,
    /// Where the ring files live (`/dev/shm`).
    pub dir: PathBuf,
    /// How long a receive polls the rings itself (yielding to other tasks
    /// in between) before it sleeps until the reader thread wakes it.
    pub spin: Duration,
}

impl ShmConfig {
    /// Who this endpoint is, for the handshake's rules (no peer-list
    /// digest: see `files::check_ring`).
    pub(crate) fn identity(&self) -> crate::handshake::Identity {
        crate::handshake::Identity {
            cluster_id: self.cluster_id,
            version: self.version,
            epoch: self.epoch,
            rank: self.rank,
            size: self.size,
            peers_digest: 0,
            secret: self.secret.clone(),
        }
    }

    /// Defaults: 4 MiB rings in `/dev/shm`, 64 MiB frames, a 256 MiB
    /// mailbox, a new buffer pool, 30 s to connect.
    pub fn new(
        cluster_id: u64,
        version: ClusterVersion,
        epoch: Epoch,
        rank: Rank,
        size: usize,
    ) -> ShmConfig {
        ShmConfig {
            cluster_id,
            version,
            epoch,
            rank,
            size,
            secret: None,
            local: None,
            matcher: None,
            pool: None,
            ring_bytes: 4 << 20,
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            connect_timeout: Duration::from_secs(30),
            dir: PathBuf::from(RING_DIR),
            spin: Duration::from_micros(50),
        }
    }
}

/// A shared-memory endpoint: the generic [`Endpoint`] over one
/// [`ShmWire`]. Build with [`ShmTransport::connect`].
pub type ShmTransport = Endpoint<ShmWire>;

/// The shared-memory wire: a ring per ordered pair of ranks, a reader and
/// a writer thread per peer, and receivers that poll the rings themselves.
pub struct ShmWire {
    max_frame: usize,
    matcher: Arc<Matcher>,
    writers: Vec<Option<std_mpsc::Sender<WriterMsg>>>,
    inbound: Vec<Option<Arc<Ring>>>,
    outbound: Vec<Option<Arc<Ring>>>,
    /// Receiving tasks polling the inbound rings now (see
    /// `OFF_RECV_POLLING`).
    polling: std::sync::atomic::AtomicUsize,
    stop: Arc<AtomicBool>,
    readers_done: Vec<Arc<AtomicBool>>,
    /// Frames consumed in place (see [`Transport::recv_in_place`](crate::Transport::recv_in_place)).
    lent: AtomicU64,
    polled: Arc<PollClock>,
    /// Buffers for frames copied out of the rings.
    frames: Arc<BufferPool>,
    /// The testing hook stops this process after its first frame sent.
    stop_after_send: Option<ShmConfig>,
    /// The lanes beside the rings (the collectives' host fast path).
    lanes: Arc<lane::HostLanes>,
}

impl Endpoint<ShmWire> {
    /// Creates this rank's inbound rings, attaches to every peer's, and
    /// starts one reader and one writer thread per peer. Every rank of the
    /// cluster must be on this host and call this with the same cluster id,
    /// cluster version and epoch.
    pub async fn connect(cfg: ShmConfig) -> Result<Arc<ShmTransport>, TransportError> {
        let (rank, size, version) = (cfg.rank, cfg.size, cfg.version);
        let (wire, matcher, pool, ecfg) = ShmWire::connect(cfg).await?;
        let e = Endpoint::new(rank, size, version, "shm", matcher, pool, vec![wire], ecfg);
        Ok(Arc::new(e))
    }

    /// How many frames receivers consumed straight from the rings, with no
    /// copy into an owned buffer.
    pub fn frames_lent(&self) -> u64 {
        self.wires()[0].frames_lent()
    }
}

impl ShmWire {
    /// [`ShmTransport::connect`]'s wire, with the matcher its readers
    /// deliver into (`cfg.matcher`, or a new one), the pool their payloads
    /// come from (`cfg.pool`, or a new one) and how its endpoint should
    /// receive: polling the rings itself for `cfg.spin`, yielding to the
    /// OS when ranks outnumber cores.
    pub async fn connect(
        cfg: ShmConfig,
    ) -> Result<(ShmWire, Arc<Matcher>, Arc<BufferPool>, EndpointConfig), TransportError> {
        kill_point(&cfg, Stage::Start);
        let n = cfg.size;
        if cfg.rank.idx() >= n {
            return Err(TransportError::NoSuchPeer {
                peer: cfg.rank,
                size: n,
            });
        }
        let cap = cfg.ring_bytes.max(4096).next_power_of_two();
        if cap > u32::MAX as usize {
            return Err(TransportError::Handshake {
                peer: None,
                addr: cfg.dir.display().to_string(),
                reason: format!("ring of {cap} bytes is too large"),
            });
        }
        let cfg2 = cfg.clone();
        let (inbound, outbound) = tokio::task::spawn_blocking(move || setup(&cfg2, cap))
            .await
            .map_err(|e| TransportError::Handshake {
                peer: None,
                addr: cfg.dir.display().to_string(),
                reason: format!("setup task: {e}"),
            })??;
        let matcher = cfg
            .matcher
            .clone()
            .unwrap_or_else(|| Arc::new(Matcher::new(cfg.epoch, cfg.mailbox_bytes)));
        let stop = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::with_capacity(n);
        let mut readers_done = Vec::with_capacity(n);
        for (peer, ring) in outbound.iter().enumerate() {
            let Some(ring) = ring.clone() else {
                writers.push(None);
                continue;
            };
            let (tx, rx) = std_mpsc::channel();
            writers.push(Some(tx));
            let (m, stop) = (matcher.clone(), stop.clone());
            let peer = Rank(peer as u32);
            std::thread::Builder::new()
                .name(format!("kungfu-shm-w{}", peer.0))
                .spawn(move || write_loop(&ring, peer, &rx, &m, &stop))
                .map_err(|e| TransportError::Handshake {
                    peer: Some(peer),
                    addr: String::new(),
                    reason: format!("writer thread: {e}"),
                })?;
        }
        let oversubscribed =
            cfg.local.as_ref().map_or(n, |l| l.iter().count()) > crate::host_cpus();
        // An idle reader thread spins before it sleeps only when every
        // rank has a core: then a sleeping reader costs its sender a wake-up
        // system call per frame that arrives between ops (2 ranks, 4 bytes:
        // 3-8 us with spinning, 12-20 without), while with more ranks than
        // cores spinning readers take the cores the ranks need (4 ranks:
        // 45-100 us with, 21-59 without).
        let eager = !oversubscribed;
        let polled = Arc::new(PollClock::new());
        let frames = cfg
            .pool
            .clone()
            .unwrap_or_else(|| BufferPool::new(BufferPool::DEFAULT_BUDGET));
        for (peer, ring) in inbound.iter().enumerate() {
            let Some(ring) = ring.clone() else { continue };
            let done = Arc::new(AtomicBool::new(false));
            readers_done.push(done.clone());
            let (m, stop) = (matcher.clone(), stop.clone());
            let peer = Rank(peer as u32);
            let policy = ReadPolicy {
                max_frame: cfg.max_frame,
                frames: frames.clone(),
                eager,
                polled: polled.clone(),
            };
            std::thread::Builder::new()
                .name(format!("kungfu-shm-r{}", peer.0))
                .spawn(move || {
                    read_loop(&ring, peer, &m, &stop, &policy);
                    done.store(true, Ordering::Release);
                })
                .map_err(|e| TransportError::Handshake {
                    peer: Some(peer),
                    addr: String::new(),
                    reason: format!("reader thread: {e}"),
                })?;
        }
        kill_point(&cfg, Stage::Connected);
        // Poll the rings ourselves while spinning. With more ranks than
        // cores, yield to the OS between polls; measured on 2 cores, 4-byte
        // allreduce: 4 ranks 280 -> 80..120 us, while 2 ranks are fastest
        // without (5 us, against 30 us).
        let ecfg = EndpointConfig {
            spin: cfg.spin,
            oversubscribed,
        };
        let lanes = Arc::new(lane::HostLanes::new(cfg.rank, &outbound, &inbound));
        let wire = ShmWire {
            lanes,
            stop_after_send: stops_at(&cfg, Stage::Sent).then(|| cfg.clone()),
            max_frame: cfg.max_frame,
            matcher: matcher.clone(),
            writers,
            inbound,
            outbound,
            stop,
            readers_done,
            polling: std::sync::atomic::AtomicUsize::new(0),
            lent: AtomicU64::new(0),
            polled,
            frames: frames.clone(),
        };
        Ok((wire, matcher, frames, ecfg))
    }
}

impl ShmWire {
    /// The testing hook's last stage: a frame is in a ring.
    fn after_send(&self) {
        if let Some(cfg) = &self.stop_after_send {
            stop_here(cfg, Stage::Sent);
        }
    }

    /// A shut-down endpoint sends nothing: its rings may still have room,
    /// but the frame would be written after the end of its stream.
    fn check_open(&self) -> Result<(), TransportError> {
        if self.stop.load(Ordering::Acquire) {
            return Err(TransportError::Closed);
        }
        Ok(())
    }

    /// How many frames receivers consumed straight from the rings, with no
    /// copy into an owned buffer.
    pub fn frames_lent(&self) -> u64 {
        self.lent.load(Ordering::Relaxed)
    }
}

impl Wire for ShmWire {
    fn caps(&self) -> Caps {
        Caps {
            name: "shm",
            max_frame: self.max_frame,
            inject: true,
            holds_sends: true,
            polled: true,
            lends: true,
            needs_registration: false,
            borrows_sends: false,
            eager_max: self.max_frame,
        }
    }

    fn reaches(&self, peer: Rank) -> bool {
        self.outbound.get(peer.idx()).is_some_and(Option::is_some)
    }

    fn extension(&self, ty: std::any::TypeId) -> Option<crate::wire::Extension> {
        let lanes: crate::wire::Extension = self.lanes.clone();
        (ty == std::any::TypeId::of::<lane::HostLanes>()).then_some(lanes)
    }

    fn pump(&self, tag: OpTag, from: &PeerSet, apply: Option<Apply<'_>>) -> Pump {
        match apply {
            Some(apply) => self.pump_for(tag, from, apply),
            None => Pump::moved(self.pump_all()),
        }
    }

    fn set_polling(&self, on: bool) {
        if on {
            self.polling_started();
        } else {
            self.polling_stopped();
        }
    }

    fn going_to_sleep(&self) {
        self.sleeping();
    }

    fn inject(&self, to: Rank, mut header: Header, payload: &[u8]) -> Result<bool, TransportError> {
        self.check_open()?;
        let size = self.outbound.len();
        let route = self.outbound.get(to.idx()).and_then(Option::as_ref);
        let ring = route.ok_or(TransportError::NoSuchPeer { peer: to, size })?;
        header.len = payload.len() as u64;
        let h = header.encode();
        if h.len() + payload.len() > ring.capacity() {
            // It would never fit whole, so holding it for later would hold
            // it for ever: the writer thread streams a copy through the
            // ring (in order with the frames queued to it; frames are
            // matched by key, not position). Its failure means the peer
            // is gone, which the op hears of as a lost peer.
            let size = self.writers.len();
            let w = self.writers.get(to.idx()).and_then(Option::as_ref);
            let w = w.ok_or(TransportError::NoSuchPeer { peer: to, size })?;
            let mut copy = self.frames.take(payload.len());
            copy.as_mut().copy_from_slice(payload);
            let (done, _) = oneshot::channel();
            w.send(WriterMsg::Frame(h, copy.freeze(), done))
                .map_err(|_| TransportError::Closed)?;
            return Ok(true);
        }
        let Some(frame) = ring.try_producer() else {
            return Ok(false); // a frame is half written by the writer thread
        };
        let sent = ring.closed() & RECEIVER_CLOSED == 0 && frame.try_write(&[&h, payload]);
        if sent {
            self.after_send();
        }
        Ok(sent)
    }

    async fn send(
        &self,
        to: Rank,
        mut header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        self.check_open()?;
        let size = self.writers.len();
        let w = self.writers.get(to.idx()).and_then(Option::as_ref);
        let w = w.ok_or(TransportError::NoSuchPeer { peer: to, size })?;
        header.len = payload.len() as u64;
        let h = header.encode();
        // Fast path: the frame fits now and no frame is half written.
        if let Some(Some(ring)) = self.outbound.get(to.idx()) {
            let sent = ring.try_producer().is_some_and(|frame| {
                ring.closed() & RECEIVER_CLOSED == 0 && frame.try_write(&[&h, &payload])
            });
            if sent {
                self.after_send();
                return Ok(());
            }
        }
        let (done, wait) = oneshot::channel();
        w.send(WriterMsg::Frame(h, payload, done))
            .map_err(|_| TransportError::Closed)?;
        wait.await.map_err(|_| TransportError::Closed)??;
        self.after_send();
        Ok(())
    }

    async fn close(&self, linger: Duration) {
        let deadline = Instant::now() + linger;
        let mut acks = Vec::new();
        for w in self.writers.iter().flatten() {
            let (tx, rx) = oneshot::channel();
            if w.send(WriterMsg::Finish(tx)).is_ok() {
                acks.push(rx);
            }
        }
        for a in acks {
            let _ = tokio::time::timeout_at(deadline, a).await;
        }
        // Drain until every peer has closed its side too.
        while Instant::now() < deadline
            && !self.readers_done.iter().all(|d| d.load(Ordering::Acquire))
        {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.shutdown();
    }

    fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        for r in self.inbound.iter().flatten() {
            r.close(RECEIVER_CLOSED);
        }
        // Peers see the end of our stream at once, as with a reset socket.
        for r in self.outbound.iter().flatten() {
            r.close(SENDER_CLOSED);
        }
    }
}

impl Drop for ShmWire {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// For tests of the rings' defences only; not part of the API.
///
/// A [`testing::RawPeer`] takes one rank's place in a cluster and speaks
/// the ring protocol at the level of bytes and indices, so a test can
/// put into a live ring what a corrupt or hostile peer process could:
/// any header, any length, any index. The real endpoints on the other side
/// must report it as an error naming this peer, not panic, and not read
/// outside their mappings.
#[doc(hidden)]
pub mod testing;
