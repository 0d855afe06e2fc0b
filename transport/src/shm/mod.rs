//! Shared-memory backend, for ranks on one host.
//!
//! Every ordered pair of ranks `s -> r` has a single-producer,
//! single-consumer byte ring in a file under `/dev/shm`, created by the
//! receiver and mapped by both. Frames (the same [`Header`] + payload as
//! TCP) are streamed through it, so a frame may be larger than the ring.
//! A sender copies into the ring straight from the op's buffer
//! ([`Transport::try_send_now`]; a frame that does not fit waits in that
//! buffer, not in a copy, see [`Transport::sends_in_place`]). A receiving
//! task that polls the rings takes a frame of its op in place
//! ([`Transport::recv_in_place`]): the plan reduces or copies it straight
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
//! A ring's file is named `kungfu-<cluster id>-<epoch>-<from>-<to>` (see
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
//! per stage.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc as std_mpsc, Arc};
use std::time::Duration;

use bytes::Bytes;
use kungfu_topology::Rank;
use memmap2::MmapMut;
use tokio::sync::oneshot;

use self::ring::{Ring, CTL, RECEIVER_CLOSED, SENDER_CLOSED};
use crate::mailbox::{Mailbox, Pump};
use crate::pool::FramePool;
use crate::{
    Capabilities, Epoch, Frame, Header, Instant, OpTag, PeerSet, Transport, TransportError,
    HEADER_LEN,
};

mod ring;

/// A reader thread leaves frames to the receiving tasks for this long after
/// they last polled the rings.
const DEFER_TO_POLLER: Duration = Duration::from_micros(300);
/// Idle receive buffers kept for reuse (see [`FramePool`]).
const FRAME_POOL_BYTES: usize = 256 << 20;
/// Settings of a shared-memory endpoint.
#[derive(Clone)]
pub struct ShmConfig {
    pub cluster_id: u64,
    pub epoch: Epoch,
    pub rank: Rank,
    /// The number of ranks in the cluster.
    pub size: usize,
    /// The ranks reached through shared memory (this host's, this rank
    /// included); `None`: all of them.
    pub local: Option<PeerSet>,
    /// A mailbox shared with another backend (see [`crate::hybrid`]).
    pub mailbox: Option<Arc<Mailbox>>,
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
    /// Defaults: 4 MiB rings in `/dev/shm`, 64 MiB frames, a 256 MiB
    /// mailbox, 30 s to connect.
    pub fn new(cluster_id: u64, epoch: Epoch, rank: Rank, size: usize) -> ShmConfig {
        ShmConfig {
            cluster_id,
            epoch,
            rank,
            size,
            local: None,
            mailbox: None,
            ring_bytes: 4 << 20,
            max_frame: 64 << 20,
            mailbox_bytes: 256 << 20,
            connect_timeout: Duration::from_secs(30),
            dir: PathBuf::from(RING_DIR),
            spin: Duration::from_micros(50),
        }
    }
}

/// When a receiving task of this process last polled the inbound rings.
struct PollClock {
    start: std::time::Instant,
    /// Nanoseconds after `start`.
    at: AtomicU64,
}

impl PollClock {
    fn new() -> PollClock {
        PollClock {
            start: std::time::Instant::now(),
            at: AtomicU64::new(0),
        }
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn touch(&self) {
        self.at.store(self.now(), Ordering::Relaxed);
    }

    /// No task polls any more (one went to sleep): readers take over now.
    fn clear(&self) {
        self.at.store(0, Ordering::Relaxed);
    }

    /// Time since the last poll (long if there was none).
    fn since(&self) -> Duration {
        match self.at.load(Ordering::Relaxed) {
            0 => Duration::MAX,
            at => Duration::from_nanos(self.now().saturating_sub(at)),
        }
    }
}

/// Where ring files live unless [`ShmConfig::dir`] says otherwise.
pub const RING_DIR: &str = "/dev/shm";

/// The start of the names of every ring file of cluster `cluster_id`, of
/// every epoch: `kungfu-<id, 16 hex digits>-`.
pub fn ring_file_prefix(cluster_id: u64) -> String {
    format!("kungfu-{cluster_id:016x}-")
}

fn ring_path(dir: &Path, cluster: u64, epoch: Epoch, from: Rank, to: Rank) -> PathBuf {
    dir.join(format!(
        "{}{}-{}-{}",
        ring_file_prefix(cluster),
        epoch.0,
        from.0,
        to.0
    ))
}

/// Removes every ring file of cluster `cluster_id` from `dir` and returns
/// their names. For a launcher, once every process of the job has exited:
/// a process killed while connecting leaves the rings it created, or that
/// were created for it, behind (see "Lifetime of the files"); removing
/// them while the job still connects would break its set-up.
pub fn remove_cluster_files(dir: &Path, cluster_id: u64) -> std::io::Result<Vec<String>> {
    let prefix = ring_file_prefix(cluster_id);
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        // no such directory: no rings either
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let Ok(name) = entry?.file_name().into_string() else {
            continue;
        };
        if !name.starts_with(&prefix) {
            continue;
        }
        match std::fs::remove_file(dir.join(&name)) {
            Ok(()) => removed.push(name),
            // gone in the meantime (unlinked by its sender)
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(removed)
}

/// Removes the ring files this endpoint created if connecting fails.
struct Created(Vec<PathBuf>);

impl Drop for Created {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn map_file(file: &std::fs::File, len: usize) -> std::io::Result<MmapMut> {
    // SAFETY: the file is a ring of this job, mapped shared by exactly two
    // processes that access it only through atomics and the SPSC protocol
    // (see `Ring`); nobody truncates it while mapped.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map_mut(file) }?;
    Ok(map)
}

fn create_inbound(
    cfg: &ShmConfig,
    cap: usize,
    from: Rank,
    created: &mut Created,
) -> Result<Ring, String> {
    let path = ring_path(&cfg.dir, cfg.cluster_id, cfg.epoch, from, cfg.rank);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("create {}: {e}", path.display()))?;
    created.0.push(path.clone());
    file.set_len((CTL + cap) as u64)
        .map_err(|e| format!("size {}: {e}", path.display()))?;
    let map = map_file(&file, CTL + cap).map_err(|e| format!("map {}: {e}", path.display()))?;
    let ring = Ring::new(map, cap);
    ring.init(cfg.cluster_id, cfg.epoch.0, from.0, cfg.rank.0);
    Ok(ring)
}

fn open_outbound(
    cfg: &ShmConfig,
    cap: usize,
    to: Rank,
    deadline: std::time::Instant,
) -> Result<Ring, String> {
    let path = ring_path(&cfg.dir, cfg.cluster_id, cfg.epoch, cfg.rank, to);
    let mut nap = Duration::from_micros(250);
    loop {
        if let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) {
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            if len == (CTL + cap) as u64 {
                let map = map_file(&file, CTL + cap)
                    .map_err(|e| format!("map {}: {e}", path.display()))?;
                let ring = Ring::new(map, cap);
                let ours = ring
                    .check_identity(cfg.cluster_id, cfg.epoch.0, cfg.rank.0, to.0)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                if ours {
                    // Both sides have it mapped now: the name has done its
                    // job. Unlinking it here, at the earliest point, leaves
                    // a file behind only if a process dies between creating
                    // a ring and its peer mapping it (the launcher removes
                    // those). The receiver's `Created` guard may try again;
                    // the name is this ring's alone (cluster, epoch, pair),
                    // so that removes nothing else.
                    let _ = std::fs::remove_file(&path);
                    kill_point(cfg, Stage::Opened);
                    ring.attach();
                    return Ok(ring);
                }
            }
        }
        if std::time::Instant::now() >= deadline {
            return Err(format!(
                "{} did not appear before the deadline",
                path.display()
            ));
        }
        std::thread::sleep(nap);
        // Short naps: a job that resizes waits here for its new peers, and
        // each nap is latency (an open that fails costs a few us).
        nap = (nap * 2).min(Duration::from_millis(2));
    }
}

/// The points of connection set-up where a test can stop a worker (see
/// "Testing hooks" above).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Connecting began; nothing created yet.
    Start,
    /// The first inbound ring was created (others may not be yet).
    Created,
    /// An outbound ring was mapped and its file unlinked, before the
    /// receiver is told (attached).
    Opened,
    /// `connect` is about to return.
    Connected,
    /// The first frame was written into a ring (an op is under way).
    Sent,
}

impl Stage {
    const ALL: [(Stage, &'static str); 5] = [
        (Stage::Start, "start"),
        (Stage::Created, "created"),
        (Stage::Opened, "opened"),
        (Stage::Connected, "connected"),
        (Stage::Sent, "sent"),
    ];

    fn name(self) -> &'static str {
        Stage::ALL
            .iter()
            .find(|(s, _)| *s == self)
            .map_or("?", |(_, n)| n)
    }
}

/// The variable of the testing hook.
pub const TEST_STOP_VAR: &str = "KUNGFU_TEST_SHM_STOP";

/// `KUNGFU_TEST_SHM_STOP=ACTION:STAGE:RANK`, parsed once per process.
fn test_stop() -> Option<(bool, Stage, u32)> {
    static PARSED: std::sync::OnceLock<Option<(bool, Stage, u32)>> = std::sync::OnceLock::new();
    *PARSED.get_or_init(|| {
        let v = std::env::var(TEST_STOP_VAR).ok()?;
        let mut it = v.split(':');
        let kill = match it.next()? {
            "kill" => true,
            "hang" => false,
            _ => return None,
        };
        let stage = it.next()?;
        let stage = Stage::ALL.iter().find(|(_, n)| *n == stage)?.0;
        let rank = it.next()?.parse().ok()?;
        Some((kill, stage, rank))
    })
}

/// The testing hook: stops this process at `stage` if asked to.
fn kill_point(cfg: &ShmConfig, stage: Stage) {
    if stops_at(cfg, stage) {
        stop_here(cfg, stage);
    }
}

fn stops_at(cfg: &ShmConfig, stage: Stage) -> bool {
    test_stop().is_some_and(|(_, at, rank)| at == stage && rank == cfg.rank.0)
}

#[cold]
fn stop_here(cfg: &ShmConfig, stage: Stage) {
    let Some((kill, _, rank)) = test_stop() else {
        return;
    };
    let what = if kill { "is killed" } else { "hangs" };
    eprintln!(
        "kungfu-shm test hook: rank {rank} {what} at {} (cluster {:016x})",
        stage.name(),
        cfg.cluster_id
    );
    if kill {
        // SAFETY: raise takes no pointers; SIGKILL ends the process here,
        // with no destructor run, as a kill from outside would.
        unsafe { libc::raise(libc::SIGKILL) };
    }
    loop {
        std::thread::park();
    }
}

enum WriterMsg {
    Frame(
        [u8; HEADER_LEN],
        Bytes,
        oneshot::Sender<Result<(), TransportError>>,
    ),
    Finish(oneshot::Sender<()>),
}

/// A shared-memory endpoint. Build with [`ShmTransport::connect`].
pub struct ShmTransport {
    rank: Rank,
    size: usize,
    max_frame: usize,
    mailbox: Arc<Mailbox>,
    writers: Vec<Option<std_mpsc::Sender<WriterMsg>>>,
    inbound: Vec<Option<Arc<Ring>>>,
    outbound: Vec<Option<Arc<Ring>>>,
    /// Held while a frame is being written into a ring: by the writer
    /// thread for a whole (possibly waiting) frame, or by a sender that
    /// writes a frame that fits at once, without a thread hand-off.
    out_locks: Vec<Arc<std::sync::Mutex<()>>>,
    /// Held while a frame is taken out of an inbound ring: by its reader
    /// thread, or by a receiving task that polls the rings itself.
    in_locks: Vec<Arc<std::sync::Mutex<()>>>,
    /// How long a receive polls the rings itself before it sleeps.
    spin: Duration,
    /// More ranks on this host than cores.
    oversubscribed: bool,
    /// Receiving tasks polling the inbound rings now (see
    /// `OFF_RECV_POLLING`).
    polling: std::sync::atomic::AtomicUsize,
    stop: Arc<AtomicBool>,
    readers_done: Vec<Arc<AtomicBool>>,
    /// Frames consumed in place (see [`Transport::recv_in_place`]).
    lent: AtomicU64,
    polled: Arc<PollClock>,
    /// Buffers for frames copied out of the rings.
    frames: Arc<FramePool>,
    /// The testing hook stops this process after its first frame sent.
    stop_after_send: Option<ShmConfig>,
}

impl ShmTransport {
    /// Creates this rank's inbound rings, attaches to every peer's, and
    /// starts one reader and one writer thread per peer. Every rank of the
    /// cluster must be on this host and call this with the same cluster id
    /// and epoch.
    pub async fn connect(cfg: ShmConfig) -> Result<Arc<ShmTransport>, TransportError> {
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
        let mailbox = cfg
            .mailbox
            .clone()
            .unwrap_or_else(|| Arc::new(Mailbox::new(cfg.epoch, cfg.mailbox_bytes)));
        let stop = Arc::new(AtomicBool::new(false));
        let mut writers = Vec::with_capacity(n);
        let mut readers_done = Vec::with_capacity(n);
        let out_locks: Vec<Arc<std::sync::Mutex<()>>> = (0..n)
            .map(|_| Arc::new(std::sync::Mutex::new(())))
            .collect();
        for (peer, ring) in outbound.iter().enumerate() {
            let Some(ring) = ring.clone() else {
                writers.push(None);
                continue;
            };
            let (tx, rx) = std_mpsc::channel();
            writers.push(Some(tx));
            let (mb, stop, lock) = (mailbox.clone(), stop.clone(), out_locks[peer].clone());
            let peer = Rank(peer as u32);
            std::thread::Builder::new()
                .name(format!("kungfu-shm-w{}", peer.0))
                .spawn(move || write_loop(&ring, &lock, peer, &rx, &mb, &stop))
                .map_err(|e| TransportError::Handshake {
                    peer: Some(peer),
                    addr: String::new(),
                    reason: format!("writer thread: {e}"),
                })?;
        }
        let in_locks: Vec<Arc<std::sync::Mutex<()>>> = (0..n)
            .map(|_| Arc::new(std::sync::Mutex::new(())))
            .collect();
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
        let frames = FramePool::new(FRAME_POOL_BYTES);
        for (peer, ring) in inbound.iter().enumerate() {
            let Some(ring) = ring.clone() else { continue };
            let done = Arc::new(AtomicBool::new(false));
            readers_done.push(done.clone());
            let (mb, stop, lock) = (mailbox.clone(), stop.clone(), in_locks[peer].clone());
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
                    read_loop(&ring, &lock, peer, &mb, &stop, &policy);
                    done.store(true, Ordering::Release);
                })
                .map_err(|e| TransportError::Handshake {
                    peer: Some(peer),
                    addr: String::new(),
                    reason: format!("reader thread: {e}"),
                })?;
        }
        kill_point(&cfg, Stage::Connected);
        Ok(Arc::new(ShmTransport {
            stop_after_send: stops_at(&cfg, Stage::Sent).then(|| cfg.clone()),
            rank: cfg.rank,
            size: n,
            max_frame: cfg.max_frame,
            mailbox,
            writers,
            inbound,
            outbound,
            out_locks,
            in_locks,
            spin: cfg.spin,
            oversubscribed,
            stop,
            readers_done,
            polling: std::sync::atomic::AtomicUsize::new(0),
            lent: AtomicU64::new(0),
            polled,
            frames,
        }))
    }
}

type Rings = Vec<Option<Arc<Ring>>>;

fn setup(cfg: &ShmConfig, cap: usize) -> Result<(Rings, Rings), TransportError> {
    let n = cfg.size;
    let deadline = std::time::Instant::now() + cfg.connect_timeout;
    let fail = |peer: Option<Rank>, reason: String| TransportError::Handshake {
        peer,
        addr: cfg.dir.display().to_string(),
        reason,
    };
    let mut created = Created(Vec::new());
    let peer = |j: usize| {
        j != cfg.rank.idx()
            && cfg
                .local
                .as_ref()
                .is_none_or(|l| l.contains(Rank(j as u32)))
    };
    let mut inbound: Rings = vec![None; n];
    for (j, slot) in inbound.iter_mut().enumerate().filter(|(j, _)| peer(*j)) {
        let ring = create_inbound(cfg, cap, Rank(j as u32), &mut created)
            .map_err(|e| fail(Some(Rank(j as u32)), e))?;
        *slot = Some(Arc::new(ring));
        if created.0.len() == 1 {
            kill_point(cfg, Stage::Created);
        }
    }
    let mut outbound: Rings = vec![None; n];
    for (j, slot) in outbound.iter_mut().enumerate().filter(|(j, _)| peer(*j)) {
        let ring = open_outbound(cfg, cap, Rank(j as u32), deadline)
            .map_err(|e| fail(Some(Rank(j as u32)), e))?;
        *slot = Some(Arc::new(ring));
    }
    for (j, ring) in inbound.iter().enumerate() {
        let Some(ring) = ring else { continue };
        while !ring.attached() {
            if std::time::Instant::now() >= deadline {
                return Err(fail(
                    Some(Rank(j as u32)),
                    "did not attach to its ring before the deadline".into(),
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    // Every sender unlinked its ring's file before attaching: nothing of
    // this endpoint is left to remove.
    created.0.clear();
    populate_in_background(inbound.iter().chain(&outbound).flatten().cloned().collect());
    Ok((inbound, outbound))
}

/// Faults every page of the rings in, writably, on a thread of its own:
/// a fresh ring's pages are otherwise allocated and zeroed one fault at a
/// time during the first lap of traffic (measured: the first ~50
/// allreduces of 64 KiB on 2 ranks took 90-180 us instead of 15), while
/// doing it before returning made connecting slow (4 ranks on 2 cores:
/// 15-20 ms to zero their 4 MiB rings, most of an elastic resize). Even
/// in the background it is most of what a resize costs here: 2 -> 4 -> 3
/// -> 1 -> 3 took 9-11 ms per resize on average with it, 2-3 ms without.
fn populate_in_background(rings: Vec<Arc<Ring>>) {
    let _ = std::thread::Builder::new()
        .name("kungfu-shm-populate".into())
        .spawn(move || {
            // Lowest priority: connecting and the first ops come first.
            // SAFETY: gettid and setpriority take no pointers; this only
            // changes this thread's nice value.
            unsafe {
                let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
                libc::setpriority(libc::PRIO_PROCESS, tid, 19);
            }
            // In pieces: populating holds the process's memory-map lock,
            // which spawning a thread (its stack) also needs.
            const PIECE: usize = 256 << 10;
            for map in rings.iter().filter_map(|r| r.map()) {
                let len = map.len();
                for off in (0..len).step_by(PIECE) {
                    let _ =
                        map.advise_range(memmap2::Advice::PopulateWrite, off, PIECE.min(len - off));
                }
            }
        });
}

/// Runs a future to completion on this (non-runtime) thread.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// How an idle reader thread behaves.
#[derive(Clone)]
struct ReadPolicy {
    max_frame: usize,
    frames: Arc<FramePool>,
    /// Spin before sleeping (ranks have a core each).
    eager: bool,
    polled: Arc<PollClock>,
}

fn read_loop(
    ring: &Ring,
    lock: &std::sync::Mutex<()>,
    peer: Rank,
    mailbox: &Mailbox,
    stop: &AtomicBool,
    policy: &ReadPolicy,
) {
    let (max_frame, eager, polled) = (policy.max_frame, policy.eager, &policy.polled);
    loop {
        // Wait without the lock, so receivers may take frames themselves.
        // The close flag before the data (see `Ring::read_exact`).
        let closed = ring.closed() & SENDER_CLOSED != 0;
        if !ring.has_data() {
            if closed {
                return mailbox.fail_peer(peer, "connection closed by peer");
            }
            if let Err(why) = ring.wait_data(stop, eager) {
                return mailbox.fail_peer(peer, why);
            }
            continue;
        }
        // A receiving task that polled the rings lately takes the frames
        // itself (applying them in place, with no copy): between two of its
        // receives it is busy reducing or sending, so leave them a while.
        let since = polled.since();
        if since < DEFER_TO_POLLER {
            if stop.load(Ordering::Acquire) {
                return;
            }
            ring.nap(DEFER_TO_POLLER - since);
            continue;
        }
        let frame = {
            let _taking = lock.lock().unwrap_or_else(|e| e.into_inner());
            if !ring.has_data() {
                continue; // a receiver took it
            }
            match ring.read_frame(max_frame, stop, |len| policy.frames.take(len)) {
                Ok(frame) => frame,
                Err(e) => {
                    return mailbox.fail_peer(
                        peer,
                        e.unwrap_or_else(|| "connection closed by peer".into()),
                    )
                }
            }
        };
        // The mailbox may make us wait for space (back-pressure): this
        // thread stops reading the ring, and the sender stops when it fills.
        match block_on(mailbox.deliver(peer, frame.0, frame.1.freeze())) {
            Ok(()) | Err(TransportError::StaleEpoch { .. }) => {}
            Err(_) => return,
        }
    }
}

/// Marks the inbound rings polled while a receiving task spins on them,
/// so senders skip waking the reader threads. A frame published while a
/// sender saw the flag set, and left in the ring when the poller stopped,
/// is taken by the next receive or by the reader thread after its bounded
/// nap (`DEFER_TO_POLLER`, at most `NAP`).
struct Polling<'a>(&'a ShmTransport);

impl<'a> Polling<'a> {
    fn start(t: &'a ShmTransport) -> Polling<'a> {
        t.polled.touch();
        if t.polling.fetch_add(1, Ordering::SeqCst) == 0 {
            t.set_polling(1);
        }
        Polling(t)
    }
}

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        // the clock counts from the end of a spin phase (a receive that
        // goes to sleep clears it afterwards)
        self.0.polled.touch();
        if self.0.polling.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.0.set_polling(0);
        }
    }
}

impl ShmTransport {
    /// The testing hook's last stage: a frame is in a ring.
    fn after_send(&self) {
        if let Some(cfg) = &self.stop_after_send {
            stop_here(cfg, Stage::Sent);
        }
    }

    /// How many frames receivers consumed straight from the rings, with no
    /// copy into an owned buffer.
    pub fn frames_lent(&self) -> u64 {
        self.lent.load(Ordering::Relaxed)
    }

    /// As [`ShmTransport::pump`], but a frame of `tag` from a rank in
    /// `from` is first lent in place to `apply`; if it consumes the frame,
    /// it leaves the ring with no copy, and this returns at once.
    fn pump_for<F>(&self, tag: OpTag, from: &PeerSet, apply: &mut F) -> Pump
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool,
    {
        let mut res = Pump::Idle;
        for (peer, ring) in self.inbound.iter().enumerate() {
            let Some(ring) = ring else { continue };
            if !ring.has_data() {
                continue;
            }
            let Ok(_taking) = self.in_locks[peer].try_lock() else {
                continue;
            };
            let sender = Rank(peer as u32);
            // A corrupt ring or a bad header is left for the reader thread
            // to report.
            while let Ok(Some((header, p))) = ring.peek_frame(self.max_frame) {
                let len = header.len as usize;
                let whole = HEADER_LEN + len; // len <= max_frame: no overflow
                if !p.holds(whole) {
                    break;
                }
                if header.tag == tag
                    && from.contains(sender)
                    && ring.lend(&p, HEADER_LEN, len, |parts| apply(sender, &header, parts))
                        == Some(true)
                {
                    ring.consume(&p, whole);
                    self.lent.fetch_add(1, Ordering::Relaxed);
                    return Pump::Consumed;
                }
                if !self.mailbox.has_room(len) {
                    break;
                }
                let mut payload = self.frames.take(len);
                if !ring.peek(&p, HEADER_LEN, payload.as_mut()) {
                    break;
                }
                ring.consume(&p, whole);
                match self.mailbox.deliver_now(sender, header, payload.freeze()) {
                    Ok(()) | Err(TransportError::StaleEpoch { .. }) => res = Pump::Moved,
                    Err(_) => return res,
                }
            }
        }
        res
    }

    /// A receiving task stops polling and will sleep until a reader thread
    /// delivers its frame: the readers must not wait for it any longer.
    fn going_to_sleep(&self) {
        self.polled.clear();
        for ring in self.inbound.iter().flatten() {
            if ring.has_data() {
                ring.wake_reader();
            }
        }
    }

    fn set_polling(&self, v: u32) {
        for ring in self.inbound.iter().flatten() {
            ring.set_polling(v);
        }
    }

    /// Moves every whole frame that is already in an inbound ring into the
    /// mailbox, without waiting and without the reader threads (a ring
    /// whose reader is busy is skipped). Returns whether it moved any.
    fn pump(&self) -> bool {
        let none = PeerSet::new();
        let tag = OpTag {
            epoch: self.mailbox.epoch(),
            op: crate::OpId(0),
            seq: 0,
        };
        self.pump_for(tag, &none, &mut |_, _, _| false) != Pump::Idle
    }
}

fn write_loop(
    ring: &Ring,
    lock: &std::sync::Mutex<()>,
    peer: Rank,
    rx: &std_mpsc::Receiver<WriterMsg>,
    mailbox: &Mailbox,
    stop: &AtomicBool,
) {
    let mut lost: Option<TransportError> = None;
    loop {
        let msg = match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(m) => m,
            Err(std_mpsc::RecvTimeoutError::Timeout) => {
                if stop.load(Ordering::Acquire) {
                    return;
                }
                continue;
            }
            Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
        };
        match msg {
            WriterMsg::Frame(h, payload, done) => {
                if lost.is_none() {
                    let _frame = lock.lock().unwrap_or_else(|e| e.into_inner());
                    let r = ring
                        .write_all(&h, stop)
                        .and_then(|()| ring.write_all(&payload, stop));
                    if let Err(why) = r {
                        lost = Some(mailbox.lose_writer(peer, why));
                    }
                }
                let _ = done.send(lost.clone().map_or(Ok(()), Err));
            }
            WriterMsg::Finish(done) => {
                ring.close(SENDER_CLOSED);
                let _ = done.send(());
                return;
            }
        }
    }
}

impl Transport for ShmTransport {
    fn rank(&self) -> Rank {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn epoch(&self) -> Epoch {
        self.mailbox.epoch()
    }

    fn advance_epoch(&self, epoch: Epoch) {
        self.mailbox.advance_epoch(epoch);
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "shm",
            max_frame: self.max_frame,
            zero_copy: false,
            needs_registration: false,
        }
    }

    fn try_send_now(
        &self,
        to: Rank,
        mut header: Header,
        payload: &[u8],
    ) -> Result<bool, TransportError> {
        let route = self.outbound.get(to.idx()).and_then(Option::as_ref);
        self.mailbox.check_send(
            to,
            self.size,
            route.is_some(),
            payload.len(),
            self.max_frame,
        )?;
        let ring = route.expect("checked");
        header.len = payload.len() as u64;
        let h = header.encode();
        let Ok(_frame) = self.out_locks[to.idx()].try_lock() else {
            return Ok(false); // a frame is half written by the writer thread
        };
        let sent = ring.closed() & RECEIVER_CLOSED == 0 && ring.try_write(&[&h, payload]);
        if sent {
            self.after_send();
        }
        Ok(sent)
    }

    fn sends_in_place(&self, to: Rank) -> bool {
        self.outbound.get(to.idx()).is_some_and(Option::is_some)
    }

    async fn send(
        &self,
        to: Rank,
        mut header: Header,
        payload: Bytes,
    ) -> Result<(), TransportError> {
        let w = self.writers.get(to.idx()).and_then(Option::as_ref);
        self.mailbox
            .check_send(to, self.size, w.is_some(), payload.len(), self.max_frame)?;
        let w = w.expect("checked");
        header.len = payload.len() as u64;
        let h = header.encode();
        // Fast path: the frame fits now and no frame is half written.
        if let (Some(Some(ring)), Ok(_frame)) = (
            self.outbound.get(to.idx()),
            self.out_locks[to.idx()].try_lock(),
        ) {
            if ring.closed() & RECEIVER_CLOSED == 0 && ring.try_write(&[&h, &payload]) {
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

    async fn recv(
        &self,
        tag: OpTag,
        from: &PeerSet,
        deadline: Instant,
    ) -> Result<Frame, TransportError> {
        // Poll the rings ourselves while spinning. With more ranks than
        // cores, yield to the OS between polls; measured on 2 cores, 4-byte
        // allreduce: 4 ranks 280 -> 80..120 us, while 2 ranks are fastest
        // without (5 us, against 30 us).
        {
            let _polling = Polling::start(self);
            let pump = || Pump::moved(self.pump());
            let spun = self
                .mailbox
                .spin_recv(tag, from, self.spin, self.oversubscribed, pump)
                .await;
            if let Some(r) = spun {
                return r.map(|f| f.expect("plain pumps consume nothing"));
            }
            // the guard clears the polling flags as it drops
        }
        self.going_to_sleep();
        self.mailbox.recv(tag, from, deadline).await
    }

    async fn recv_in_place<'a, F>(
        &'a self,
        tag: OpTag,
        from: &'a PeerSet,
        deadline: Instant,
        mut apply: F,
    ) -> Result<Option<Frame>, TransportError>
    where
        F: FnMut(Rank, &Header, &[&[u8]]) -> bool + Send + 'a,
    {
        {
            let _polling = Polling::start(self);
            let pump = || self.pump_for(tag, from, &mut apply);
            let spun = self
                .mailbox
                .spin_recv(tag, from, self.spin, self.oversubscribed, pump)
                .await;
            if let Some(r) = spun {
                return r;
            }
        }
        self.going_to_sleep();
        self.mailbox.recv(tag, from, deadline).await.map(Some)
    }

    fn recv_stray(
        &self,
        deadline: Instant,
    ) -> impl std::future::Future<Output = Result<Frame, TransportError>> + Send + '_ {
        self.mailbox.recv_stray(deadline)
    }

    fn retire(&self, tag: OpTag) {
        self.mailbox.retire(tag);
    }

    fn check_peers(&self, peers: &PeerSet) -> Result<(), TransportError> {
        self.mailbox.check_peers(peers)
    }

    fn check_peers_for(&self, tag: OpTag, peers: &PeerSet) -> Result<(), TransportError> {
        self.mailbox.check_peers_for(tag, peers)
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
        self.mailbox.close();
    }
}

impl Drop for ShmTransport {
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
pub mod testing {
    use super::*;

    pub struct RawPeer {
        rank: Rank,
        cap: usize,
        inbound: Rings,
        outbound: Rings,
    }

    impl RawPeer {
        /// Creates and maps this rank's rings, as `ShmTransport::connect`
        /// does, and starts no thread. It blocks until every peer has
        /// attached: run it beside the real endpoints' `connect`.
        pub fn connect(cfg: &ShmConfig) -> Result<RawPeer, TransportError> {
            let cap = cfg.ring_bytes.max(4096).next_power_of_two();
            let (inbound, outbound) = setup(cfg, cap)?;
            Ok(RawPeer {
                rank: cfg.rank,
                cap,
                inbound,
                outbound,
            })
        }

        pub fn rank(&self) -> Rank {
            self.rank
        }

        fn to(&self, peer: Rank) -> &Ring {
            self.outbound[peer.idx()].as_deref().expect("a peer")
        }

        fn from(&self, peer: Rank) -> &Ring {
            self.inbound[peer.idx()].as_deref().expect("a peer")
        }

        /// Data bytes of each ring.
        pub fn ring_bytes(&self) -> usize {
            self.cap
        }

        /// Appends `bytes` (anything: a frame, part of one, garbage) to the
        /// ring to `peer` and publishes them; false if they do not fit now.
        pub fn publish(&self, peer: Rank, bytes: &[&[u8]]) -> bool {
            self.to(peer).try_write(bytes)
        }

        /// `(head, tail)` of the ring to `peer`.
        pub fn indices_to(&self, peer: Rank) -> (u64, u64) {
            self.to(peer).indices()
        }

        /// Overwrites the indices of the ring to `peer` (this side owns
        /// `head`; `tail` is the receiver's).
        pub fn set_indices_to(&self, peer: Rank, head: u64, tail: u64) {
            self.to(peer).set_indices(head, tail)
        }

        /// `(head, tail)` of the ring from `peer`.
        pub fn indices_from(&self, peer: Rank) -> (u64, u64) {
            self.from(peer).indices()
        }

        /// Overwrites the indices of the ring from `peer` (this side owns
        /// `tail`; `head` is the sender's).
        pub fn set_indices_from(&self, peer: Rank, head: u64, tail: u64) {
            self.from(peer).set_indices(head, tail)
        }

        /// Takes everything published in the ring from `peer`.
        pub fn take_from(&self, peer: Rank) -> Result<Vec<u8>, String> {
            let ring = self.from(peer);
            let p = ring.published()?;
            let mut out = vec![0u8; p.len()];
            ring.peek(&p, 0, &mut out);
            ring.consume(&p, out.len());
            Ok(out)
        }

        /// Closes this side of the ring to `peer`, as the end of a stream.
        pub fn close_to(&self, peer: Rank) {
            self.to(peer).close(SENDER_CLOSED);
        }
    }
}
