//! The shared-memory transport: frames of every size through small rings,
//! in any order, closing, no files left behind, and a peer that writes
//! garbage into the rings it shares.

use std::time::Duration;

use bytes::Bytes;
use kungfu_tests::{poll_once, shm_cluster, unique_cluster_id};
use kungfu_topology::Rank;
use kungfu_transport::shm::testing::RawPeer;
use kungfu_transport::shm::{ring_file_prefix, ShmConfig, ShmTransport};
use kungfu_transport::{
    ClusterVersion, Epoch, FrameKind, Header, Instant, OpId, OpTag, PeerSet, Transport,
    TransportError, HEADER_LEN,
};

fn tag(op: u64) -> OpTag {
    OpTag {
        epoch: Epoch(0),
        op: OpId(op),
        seq: 0,
    }
}

fn data(t: OpTag) -> Header {
    Header {
        kind: FrameKind::Data,
        tag: t,
        chunk: 0,
        step: 0,
        digest: 0,
        len: 0,
    }
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// The ring files of cluster `id` that are left, removed (so that a failing
/// test leaves nothing either).
fn leftover_files(id: u64) -> Vec<String> {
    let prefix = ring_file_prefix(id);
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().into_string().ok())
                .filter(|n| n.starts_with(&prefix))
                .collect()
        })
        .unwrap_or_default();
    for n in &left {
        let _ = std::fs::remove_file(std::path::Path::new("/dev/shm").join(n));
    }
    left
}

/// Payloads from empty to many times the ring size, between every pair,
/// received in the reverse order of sending.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_larger_than_the_ring_flow_both_ways() {
    let ts = shm_cluster(3, 4096).await;
    let all = PeerSet::all(3);
    let sizes = [0usize, 1, 40, 4095, 4096, 4097, 100_000, 1 << 20];
    let mut sends = Vec::new();
    for (k, &len) in sizes.iter().enumerate() {
        for (from, t) in ts.iter().enumerate() {
            let t = t.clone();
            let payload = Bytes::from(
                (0..len)
                    .map(|i| (i * 31 + k + from) as u8)
                    .collect::<Vec<u8>>(),
            );
            let to = Rank(((from + 1) % 3) as u32);
            sends.push(tokio::spawn(async move {
                t.send(to, data(tag(k as u64)), payload).await
            }));
        }
    }
    for (k, &len) in sizes.iter().enumerate().rev() {
        for (r, t) in ts.iter().enumerate() {
            let f = t.recv(tag(k as u64), &all, soon()).await.unwrap();
            let from = (r + 2) % 3;
            assert_eq!(f.from, Rank(from as u32));
            assert_eq!(f.payload.len(), len);
            assert!(f
                .payload
                .iter()
                .enumerate()
                .all(|(i, &b)| b == (i * 31 + k + from) as u8));
        }
    }
    for s in sends {
        s.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rings_leave_no_files_and_closing_is_seen() {
    let id = unique_cluster_id();
    let tasks: Vec<_> = (0..2)
        .map(|i| {
            let mut cfg = ShmConfig::new(id, ClusterVersion(0), Epoch(0), Rank(i), 2);
            cfg.ring_bytes = 8192;
            // no spin: a receive polled once is asleep, waiting for a wake-up
            cfg.spin = Duration::ZERO;
            tokio::spawn(ShmTransport::connect(cfg))
        })
        .collect();
    let mut ts = Vec::new();
    for t in tasks {
        ts.push(t.await.unwrap().unwrap());
    }
    let left = leftover_files(id);
    assert!(left.is_empty(), "{left:?}");
    let from1: PeerSet = [Rank(1)].into_iter().collect();
    let mut waiter = Box::pin(ts[0].recv(tag(9), &from1, soon()));
    let first = poll_once(&mut waiter).await;
    assert!(first.is_pending(), "{first:?}");
    ts[1].shutdown();
    match waiter.await {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, Rank(1));
            assert!(reason.contains("closed"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
}

/// A peer that never shows up: connect fails by its deadline, says which
/// ring is missing, and removes the files it created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_peer_fails_the_connect_cleanly() {
    let id = unique_cluster_id();
    let mut cfg = ShmConfig::new(id, ClusterVersion(0), Epoch(0), Rank(0), 2);
    cfg.connect_timeout = Duration::from_millis(300);
    let e = ShmTransport::connect(cfg).await.err().expect("no peer");
    assert!(e.to_string().contains("did not appear"), "{e}");
    let left = leftover_files(id);
    assert!(left.is_empty(), "{left:?}");
}

/// A shared-memory directory too small for a ring: connect fails at once
/// with an error that names the directory, instead of a SIGBUS at a later
/// write into a hole of the sparse file (the files are reserved when made).
/// Needs root, to mount a 4 MiB tmpfs (CI runs as root); skipped
/// otherwise, unless `KUNGFU_REQUIRE_ROOT=1` (CI's test command sets it):
/// then not being root fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_shared_memory_directory_is_a_clear_error() {
    let uid = std::process::Command::new("id")
        .arg("-u")
        .output()
        .expect("id -u");
    if String::from_utf8_lossy(&uid.stdout).trim() != "0" {
        assert!(
            std::env::var("KUNGFU_REQUIRE_ROOT").as_deref() != Ok("1"),
            "KUNGFU_REQUIRE_ROOT=1 but not root: this test mounts a small tmpfs"
        );
        eprintln!("skipped: needs root to mount a small tmpfs");
        return;
    }
    let dir = std::env::temp_dir().join(format!("kf-small-shm-{}", unique_cluster_id()));
    std::fs::create_dir(&dir).unwrap();
    struct Mounted(std::path::PathBuf);
    impl Drop for Mounted {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
            let _ = std::fs::remove_dir(&self.0);
        }
    }
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(&dir)
        .status()
        .expect("mount");
    assert!(st.success(), "mount a tmpfs at {}", dir.display());
    let _m = Mounted(dir.clone());
    let mut cfg = ShmConfig::new(unique_cluster_id(), ClusterVersion(0), Epoch(0), Rank(0), 2);
    cfg.dir = dir.clone();
    cfg.ring_bytes = 4 << 20;
    cfg.connect_timeout = Duration::from_secs(5);
    let t = std::time::Instant::now();
    let e = ShmTransport::connect(cfg).await.err().expect("no room");
    let msg = e.to_string();
    assert!(
        msg.contains("reserve") && msg.contains(&*dir.to_string_lossy()),
        "{msg}"
    );
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "files left");
}

/// Frames that fit the ring go straight from the caller's bytes; larger
/// ones are refused by `try_send_now` (the caller falls back to `send`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_send_now_writes_what_fits_and_streams_what_never_fits() {
    let ts = shm_cluster(2, 4096).await;
    let from0: PeerSet = [Rank(0)].into_iter().collect();
    assert!(ts[0]
        .try_send_now(Rank(1), data(tag(1)), b"direct")
        .unwrap());
    let f = ts[1].recv(tag(1), &from0, soon()).await.unwrap();
    assert_eq!(&f.payload[..], b"direct");
    // a frame larger than the ring can never go whole: it is taken, and
    // streamed through the ring by the writer thread, not left waiting
    assert!(ts[0]
        .try_send_now(Rank(1), data(tag(2)), &[7u8; 8192])
        .unwrap());
    let f = ts[1].recv(tag(2), &from0, soon()).await.unwrap();
    assert_eq!(&f.payload[..], &[7u8; 8192][..]);
    assert!(matches!(
        ts[0].try_send_now(Rank(5), data(tag(3)), b"x"),
        Err(TransportError::NoSuchPeer { .. })
    ));
}

// ---- A peer that writes garbage into live rings ----------------------------
//
// Rank 0 is a real endpoint; rank 1 is a `RawPeer` that takes part in the
// set-up and then writes into the shared rings whatever a corrupt peer
// process could. Rank 0 must report it as rank 1 being lost, say why, and
// not panic (its reader and writer threads are watched for panics). That
// no copy reaches outside the mapping is checked by the same cases over a
// heap buffer under Miri (`transport/src/shm/ring.rs`,
// `scripts/miri-shm.sh`).

const RING: usize = 4096;
const MAX_FRAME: usize = 1 << 16;
const R0: Rank = Rank(0);
const R1: Rank = Rank(1);

/// Panics of the transport's threads (named `kungfu-shm-*`), in any test
/// of this binary.
fn shm_thread_panics() -> Vec<String> {
    use std::sync::{Mutex, OnceLock};
    static PANICS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let panics = PANICS.get_or_init(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let name = std::thread::current().name().unwrap_or("").to_string();
            if name.starts_with("kungfu-shm") {
                if let Some(p) = PANICS.get() {
                    let mut p = p.lock().unwrap_or_else(|e| e.into_inner());
                    p.push(format!("{name}: {info}"));
                }
            }
            prev(info)
        }));
        Mutex::new(Vec::new())
    });
    panics.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

async fn real_and_raw() -> (std::sync::Arc<ShmTransport>, RawPeer) {
    shm_thread_panics(); // installs the hook
    let id = unique_cluster_id();
    let cfg = move |r: u32| {
        let mut c = ShmConfig::new(id, ClusterVersion(0), Epoch(0), Rank(r), 2);
        c.ring_bytes = RING;
        c.max_frame = MAX_FRAME;
        c.connect_timeout = Duration::from_secs(20);
        c
    };
    let real = tokio::spawn(ShmTransport::connect(cfg(0)));
    let raw = tokio::task::spawn_blocking(move || RawPeer::connect(&cfg(1)));
    let (real, raw) = (real.await.unwrap(), raw.await.unwrap());
    let raw = raw.expect("raw peer connects");
    assert_eq!(raw.ring_bytes(), RING);
    (real.expect("real endpoint connects"), raw)
}

#[derive(Clone, Copy, Debug)]
enum Receive {
    /// The frame is copied out (by the reader thread or the poller).
    Copy,
    /// The frame is lent in place where it is whole.
    InPlace,
}

/// Receives from rank 1 after `corrupt` ran, expecting rank 1 to be lost;
/// returns the reason. An in-place receive must never have been lent
/// anything.
async fn lost_after(how: Receive, corrupt: impl FnOnce(&RawPeer)) -> String {
    let (t, raw) = real_and_raw().await;
    let from1: PeerSet = [R1].into_iter().collect();
    corrupt(&raw);
    let mut lent = 0usize;
    let r = match how {
        Receive::Copy => t.recv(tag(1), &from1, soon()).await.map(|_| ()),
        Receive::InPlace => t
            .recv_in_place(tag(1), &from1, soon(), |_, _, _| {
                lent += 1;
                true
            })
            .await
            .map(|_| ()),
    };
    assert_eq!(lent, 0, "{how:?}: nothing of a corrupt ring may be lent");
    let panics = shm_thread_panics();
    assert!(panics.is_empty(), "{how:?}: {panics:#?}");
    match r {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, R1, "{how:?}: {reason}");
            // and it stays lost, for sends too
            assert!(matches!(
                t.send(R1, data(tag(2)), Bytes::from_static(b"x")).await,
                Err(TransportError::PeerLost { peer: R1, .. })
            ));
            reason.to_string()
        }
        other => panic!("{how:?}: expected rank 1 lost, got {other:?}"),
    }
}

fn encoded(len: usize, patch: Option<(usize, u8)>) -> [u8; HEADER_LEN] {
    let mut h = data(tag(1));
    h.len = len as u64;
    let mut b = h.encode();
    if let Some((at, v)) = patch {
        b[at] = v;
    }
    b
}

/// A valid header for a frame larger than the ring, and a head that claims
/// all of it is there: taken at its word, the frame would be lent or copied
/// from beyond the end of the mapping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_beyond_the_ring_is_a_lost_peer() {
    for how in [Receive::Copy, Receive::InPlace] {
        let why = lost_after(how, |raw| {
            let (_, tail) = raw.indices_to(R0);
            assert!(raw.publish(R0, &[&encoded(2 * RING, None)]));
            raw.set_indices_to(R0, tail + (HEADER_LEN + 2 * RING) as u64, tail);
        })
        .await;
        assert!(why.contains("ring corrupted (head 8232, tail 0)"), "{why}");
    }
}

/// `head` behind `tail`: the published length wraps around to ~2^64.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_behind_the_tail_is_a_lost_peer() {
    for how in [Receive::Copy, Receive::InPlace] {
        let why = lost_after(how, |raw| {
            raw.publish(R0, &[&[0u8; 8]]);
            raw.set_indices_to(R0, 3, 8);
        })
        .await;
        assert!(why.contains("ring corrupted (head 3, tail 8)"), "{why}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frame_headers_are_protocol_violations() {
    let cases = [
        (0, b'X', "bad magic"),
        (2, 7, "unsupported frame version 7"),
        (3, 0, "unknown frame kind 0"),
        (4, 0x80, "reserved flags"),
    ];
    for (at, v, want) in cases {
        for how in [Receive::Copy, Receive::InPlace] {
            let why = lost_after(how, |raw| {
                assert!(raw.publish(R0, &[&encoded(16, Some((at, v))), &[7u8; 16]]));
            })
            .await;
            assert!(
                why.contains("protocol violation") && why.contains(want),
                "{how:?}: {why}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_beyond_the_frame_limit_is_a_lost_peer() {
    for len in [MAX_FRAME + 1, usize::MAX] {
        for how in [Receive::Copy, Receive::InPlace] {
            let why = lost_after(how, |raw| {
                assert!(raw.publish(R0, &[&encoded(len, None), &[1u8; 64]]));
            })
            .await;
            assert!(
                why.contains(&format!("{len} bytes exceeds the limit of {MAX_FRAME}")),
                "{how:?}: {why}"
            );
        }
    }
}

/// A length larger than the ring is legal (frames stream through), but
/// the frame can never be whole in the ring: it must not be lent, and a
/// sender that stops half-way through it is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_length_beyond_the_ring_cut_short_is_a_lost_peer() {
    for how in [Receive::Copy, Receive::InPlace] {
        let why = lost_after(how, |raw| {
            assert!(raw.publish(R0, &[&encoded(4 * RING, None), &[1u8; RING / 2]]));
            raw.close_to(R0);
        })
        .await;
        assert!(
            why.contains("closed in the middle of a frame"),
            "{how:?}: {why}"
        );
    }
}

/// The receiver claims to have consumed more than was ever written: the
/// sender must not take that as free space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_beyond_the_head_stops_the_sender() {
    let (t, raw) = real_and_raw().await;
    let (head, _) = raw.indices_from(R0);
    raw.set_indices_from(R0, head, head + RING as u64 + 1);
    assert!(
        !t.try_send_now(R1, data(tag(1)), b"x").unwrap(),
        "nothing written into a corrupt ring"
    );
    // `send` itself has no deadline: a sender that believed the ring full
    // would wait for space for ever
    let sent = tokio::time::timeout(
        Duration::from_secs(20),
        t.send(R1, data(tag(1)), Bytes::from_static(b"x")),
    );
    match sent.await.expect("the send ends") {
        Err(TransportError::PeerLost { peer, reason }) => {
            assert_eq!(peer, R1);
            assert!(reason.contains("ring corrupted"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        t.try_send_now(R1, data(tag(1)), b"x"),
        Err(TransportError::PeerLost { peer: R1, .. })
    ));
    let panics = shm_thread_panics();
    assert!(panics.is_empty(), "{panics:#?}");
}

/// Indices are stream offsets that wrap at 2^64: a peer that sets them
/// near the end (any value is possible from a peer) must not make the
/// sender's arithmetic overflow, and a frame across the wrap arrives whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn indices_that_wrap_at_2_pow_64_carry_frames() {
    let (t, raw) = real_and_raw().await;
    let start = u64::MAX - 9;
    raw.set_indices_from(R0, start, start);
    let body: Vec<u8> = (0..100u8).collect();
    // both send paths: in place from the caller's bytes, and `send`
    assert!(t.try_send_now(R1, data(tag(1)), &body).unwrap());
    t.send(R1, data(tag(2)), Bytes::from(body.clone()))
        .await
        .unwrap();
    let got = raw.take_from(R0).unwrap();
    let hl = HEADER_LEN;
    assert_eq!(got.len(), 2 * (hl + 100));
    for (k, frame) in got.chunks(hl + 100).enumerate() {
        let h = Header::decode(frame[..hl].try_into().unwrap(), MAX_FRAME).unwrap();
        assert_eq!((h.tag, h.len), (tag(k as u64 + 1), 100));
        assert_eq!(&frame[hl..], &body[..]);
    }
    assert_eq!(raw.indices_from(R0).0, start.wrapping_add(got.len() as u64));
    let panics = shm_thread_panics();
    assert!(panics.is_empty(), "{panics:#?}");
}
