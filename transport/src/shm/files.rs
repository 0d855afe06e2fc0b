//! The ring files: their names, creating, opening and removing them, and
//! setting up the rings of one endpoint (see "Lifetime of the files" in
//! the module docs).

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kungfu_topology::Rank;
use memmap2::MmapMut;

use super::hooks::{kill_point, Stage};
use super::ring::{file_len, Ring, RingIdentity, SEAL_LEN};
use super::ShmConfig;
use crate::handshake::{self, Hello};
use crate::{ClusterVersion, Epoch, TransportError};

/// Where ring files live unless [`ShmConfig::dir`] says otherwise.
pub const RING_DIR: &str = "/dev/shm";

/// The start of the names of every ring file of cluster `cluster_id`, of
/// every cluster version: `kungfu-<id, 16 hex digits>-`.
pub fn ring_file_prefix(cluster_id: u64) -> String {
    format!("kungfu-{cluster_id:016x}-")
}

/// `kungfu-<id>-<cluster version>-<from>-<to>`: the connections of each
/// version are new (a resize reconnects), so the version keeps its rings
/// apart from an older version's that a slow peer may still have.
fn ring_path(dir: &Path, cluster: u64, version: ClusterVersion, from: Rank, to: Rank) -> PathBuf {
    dir.join(format!(
        "{}{}-{}-{}",
        ring_file_prefix(cluster),
        version.0,
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

/// Allocates the file's pages now, so that a full tmpfs fails here with a
/// clear error instead of killing the process with SIGBUS at a later write
/// into a hole of the sparse file.
fn reserve(file: &std::fs::File, len: usize) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = libc::off_t::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: a valid open descriptor; posix_fallocate touches only its file.
    match unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) } {
        0 => Ok(()),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

fn create_inbound(
    cfg: &ShmConfig,
    cap: usize,
    from: Rank,
    created: &mut Created,
) -> Result<Ring, String> {
    let path = ring_path(&cfg.dir, cfg.cluster_id, cfg.version, from, cfg.rank);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| format!("create {}: {e}", path.display()))?;
    created.0.push(path.clone());
    file.set_len(file_len(cap) as u64)
        .map_err(|e| format!("size {}: {e}", path.display()))?;
    reserve(&file, file_len(cap)).map_err(|e| {
        format!(
            "reserve {} bytes for {} (every pair of workers on a host needs two such files: \
             is {} full? `df {}`): {e}",
            file_len(cap),
            path.display(),
            cfg.dir.display(),
            cfg.dir.display()
        )
    })?;
    let map = map_file(&file, file_len(cap)).map_err(|e| format!("map {}: {e}", path.display()))?;
    let ring = Ring::new(map, cap);
    let mut id = RingIdentity {
        cluster: cfg.cluster_id,
        version: cfg.version.0,
        epoch: cfg.epoch.0,
        from: from.0,
        to: cfg.rank.0,
        cap: cap as u32,
        seal: [0; SEAL_LEN],
    };
    if let Some(secret) = &cfg.secret {
        let nonce: [u8; 32] = crate::auth::random().map_err(|e| e.to_string())?;
        let mac = secret.mac(SEAL_LABEL, &[&sealed_bytes(&id), &nonce]);
        id.seal[..32].copy_from_slice(&nonce);
        id.seal[32..].copy_from_slice(&mac);
    }
    ring.init(&id);
    Ok(ring)
}

const SEAL_LABEL: &[u8] = b"kungfu shm ring v3: creator";

/// What a ring's seal covers: its identity (cluster id, version, epoch,
/// sender, receiver, size), little-endian.
fn sealed_bytes(id: &RingIdentity) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0..8].copy_from_slice(&id.cluster.to_le_bytes());
    b[8..16].copy_from_slice(&id.version.to_le_bytes());
    b[16..20].copy_from_slice(&id.epoch.to_le_bytes());
    b[20..24].copy_from_slice(&id.from.to_le_bytes());
    b[24..28].copy_from_slice(&id.to.to_le_bytes());
    b[28..32].copy_from_slice(&id.cap.to_le_bytes());
    b
}

/// Checks a ring's seal: made with the job's secret over this identity,
/// or absent in a job without one.
fn check_seal(cfg: &ShmConfig, id: &RingIdentity) -> Result<(), String> {
    let sealed = id.seal != [0; SEAL_LEN];
    match &cfg.secret {
        None if sealed => Err("bad credential: the ring is sealed with a job secret (KUNGFU_JOB_SECRET), we hold none".into()),
        None => Ok(()),
        Some(_) if !sealed => Err("bad credential: the ring is not sealed, we hold a job secret (KUNGFU_JOB_SECRET)".into()),
        Some(secret) => {
            let (nonce, mac) = id.seal.split_at(32);
            if secret.verify(SEAL_LABEL, &[&sealed_bytes(id), nonce], mac) {
                Ok(())
            } else {
                Err("bad credential: the ring's seal is not of this job's secret".into())
            }
        }
    }
}

/// Checks a peer's ring by the shared handshake's rules
/// ([`handshake::check`]), as if its receiver `to`, which made it, had
/// dialed us with what it wrote into it; then its size. Rings carry no
/// peer-list digest: every rank of a host names its rings from the cluster
/// id and version alone.
fn check_ring(cfg: &ShmConfig, cap: usize, to: Rank, id: &RingIdentity) -> Result<(), String> {
    let me = cfg.identity();
    let hello = Hello {
        from: Rank(id.to),
        to: Rank(id.from),
        version: ClusterVersion(id.version),
        epoch: Epoch(id.epoch),
        cluster_id: id.cluster,
        peers_digest: me.peers_digest,
        secret: me.secret.is_some(),
        nonce: [0; 32],
    };
    handshake::check(&me, &hello, |r| r == to)
        .map_err(|(_, why)| format!("ring refused: {why}"))?;
    check_seal(cfg, id).map_err(|why| format!("ring refused: {why}"))?;
    if id.cap as usize != cap {
        return Err(format!("ring size is {}, expected {cap}", id.cap));
    }
    Ok(())
}

fn open_outbound(
    cfg: &ShmConfig,
    cap: usize,
    to: Rank,
    deadline: std::time::Instant,
) -> Result<Ring, String> {
    let path = ring_path(&cfg.dir, cfg.cluster_id, cfg.version, cfg.rank, to);
    let mut nap = Duration::from_micros(250);
    loop {
        if let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) {
            let len = file.metadata().map(|m| m.len()).unwrap_or(0);
            if len == file_len(cap) as u64 {
                let map = map_file(&file, file_len(cap))
                    .map_err(|e| format!("map {}: {e}", path.display()))?;
                let ring = Ring::new(map, cap);
                let ours = match ring.identity() {
                    None => false,
                    Some(id) => {
                        check_ring(cfg, cap, to, &id)
                            .map_err(|e| format!("{}: {e}", path.display()))?;
                        true
                    }
                };
                if ours {
                    // Both sides have it mapped now: the name has done its
                    // job. Unlinking it here, at the earliest point, leaves
                    // a file behind only if a process dies between creating
                    // a ring and its peer mapping it (the launcher removes
                    // those). The receiver's `Created` guard may try again;
                    // the name is this ring's alone (cluster, version, pair),
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

pub(super) type Rings = Vec<Option<Arc<Ring>>>;

pub(super) fn setup(cfg: &ShmConfig, cap: usize) -> Result<(Rings, Rings), TransportError> {
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
    // This side's rings are faulted in while the peers' appear.
    let populated = populate_on_thread(inbound.iter().flatten().cloned().collect());
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
    for ring in outbound.iter().flatten() {
        ring.populate(POPULATE_PIECE);
    }
    // Bounded by the connect's deadline: past it the thread finishes on
    // its own, and the first laps fault what it has not reached.
    let _ = populated.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()));
    Ok((inbound, outbound))
}

/// Bytes faulted in per call: populating holds the process's memory-map
/// lock, which spawning a thread (its stack) also needs.
const POPULATE_PIECE: usize = 256 << 10;

/// Faults every page of `rings` in, writably, on a thread of its own; the
/// receiver hears when it is done. A fresh ring's pages are otherwise
/// allocated and zeroed one fault at a time during the first lap of
/// traffic (measured: the first ~50 allreduces of 64 KiB on 2 ranks took
/// 90-180 us instead of 15).
///
/// `setup` waits for it before it returns. It used to run in the
/// background, at the lowest priority, after connecting; with more
/// workers than cores it then took whole time slices from ranks that
/// poll by yielding the CPU (each yield pushes the poller's deadline
/// back), and every op stalled on the rank whose core it held: at 4
/// ranks on 2 cores, in about half the runs, the first size of a sweep
/// took 100-900 us per 1 KiB allreduce instead of 10-20
/// (`benches/peers/first_op.sh`, docs/speed.md). Here it overlaps the
/// wait for the peers' rings; an elastic resize 4 -> 3 -> 1 -> 3 from 2
/// then took 12-13 ms on average against 8-12.
fn populate_on_thread(rings: Vec<Arc<Ring>>) -> std::sync::mpsc::Receiver<()> {
    let (done, populated) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("kungfu-shm-populate".into())
        .spawn(move || {
            for ring in &rings {
                ring.populate(POPULATE_PIECE);
            }
            let _ = done.send(());
        });
    // No thread (out of resources): the first laps fault the pages in,
    // and the receiver hears at once (its sender is gone).
    drop(spawned);
    populated
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peers_ring_is_checked_by_the_handshake_rules() {
        // Rank 1 of 3 attaches to the ring rank 2 made for it.
        let cfg = ShmConfig::new(0xfeed, ClusterVersion(4), Epoch(0), Rank(1), 3);
        let good = RingIdentity {
            cluster: 0xfeed,
            version: 4,
            epoch: 0,
            from: 1,
            to: 2,
            cap: 4096,
            seal: [0; SEAL_LEN],
        };
        assert_eq!(check_ring(&cfg, 4096, Rank(2), &good), Ok(()));
        let refused = |id: RingIdentity| check_ring(&cfg, 4096, Rank(2), &id).unwrap_err();
        let e = refused(RingIdentity { cluster: 1, ..good });
        assert!(e.contains("cluster id 0x1 differs from ours 0xfeed"), "{e}");
        let e = refused(RingIdentity { version: 3, ..good });
        assert!(
            e.contains("peer is at version 3, we are at version 4"),
            "{e}"
        );
        let e = refused(RingIdentity { epoch: 1, ..good });
        assert!(e.contains("epoch differs"), "{e}");
        let e = refused(RingIdentity { from: 0, ..good });
        assert!(e.contains("peer wanted rank 0"), "{e}");
        let e = refused(RingIdentity { to: 0, ..good });
        assert!(e.contains("may not dial"), "{e}");
        let e = refused(RingIdentity { cap: 8192, ..good });
        assert_eq!(e, "ring size is 8192, expected 4096");
    }

    /// With a secret, a ring sealed by its creator with the job's secret
    /// is taken; one sealed with another, unsealed, or sealed over another
    /// identity is refused, as is a sealed one in a job without a secret.
    #[test]
    fn a_rings_seal_binds_it_to_the_job_secret() {
        let dir = std::env::temp_dir().join(format!("kungfu-seal-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = crate::auth::JobSecret::new(b"s3cret").unwrap();
        let made_by = |rank: u32, secret: Option<&crate::auth::JobSecret>| {
            let mut c = ShmConfig::new(0x5ea1, ClusterVersion(0), Epoch(0), Rank(rank), 2);
            c.secret = secret.cloned();
            c.dir = dir.clone();
            c
        };
        // rank 1 makes the ring from rank 0, which checks it
        let sealed_id = |secret: Option<&crate::auth::JobSecret>| {
            let mut created = Created(Vec::new());
            let ring = create_inbound(&made_by(1, secret), 4096, Rank(0), &mut created).unwrap();
            ring.identity().unwrap()
        };
        let theirs = crate::auth::JobSecret::new(b"guess").unwrap();
        let ours = made_by(0, Some(&secret));
        let check = |cfg: &ShmConfig, id: &RingIdentity| check_ring(cfg, 4096, Rank(1), id);
        let good = sealed_id(Some(&secret));
        assert_eq!(check(&ours, &good), Ok(()));
        let e = check(&ours, &sealed_id(Some(&theirs))).unwrap_err();
        assert!(e.contains("bad credential: the ring's seal is not"), "{e}");
        let e = check(&ours, &sealed_id(None)).unwrap_err();
        assert!(e.contains("not sealed"), "{e}");
        let e = check(&made_by(0, None), &good).unwrap_err();
        assert!(e.contains("we hold none"), "{e}");
        // the seal covers the identity: moved to another epoch, refused
        let moved = RingIdentity { epoch: 1, ..good };
        let e = check_seal(
            &ShmConfig {
                epoch: Epoch(1),
                ..ours.clone()
            },
            &moved,
        )
        .unwrap_err();
        assert!(e.contains("seal is not"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
