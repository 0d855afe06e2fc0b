//! A live 3-rank TCP job under fire from raw sockets on loopback.
//!
//! While it connects: garbage, truncated hellos (one left open), hellos of
//! another job, of a rank that may not dial, and a replayed recording of a
//! real connection of an earlier job are thrown at its workers; each is
//! answered or dropped, and the job connects and allreduces exactly.
//! While it runs: forged frames are written into a real, handshaken
//! connection (a proxy sits between rank 2 and rank 0): whole frames of
//! ops nobody runs, with other digests or epochs, leave the job's
//! allreduces exact; frames that break the stream (a bad kind, version or
//! magic, a huge length, a cut header or payload) lose that link with a
//! named protocol error, and every rank's allreduce fails fast instead of
//! waiting. Every wait here is bounded.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kungfu_collectives::{ReduceOp, Session, SessionConfig};
use kungfu_tests::{bind_loopback, unique_cluster_id};
use kungfu_topology::{Peer, PeerList, Rank};
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
use kungfu_transport::{ClusterVersion, Epoch, FrameKind, Header, OpId, OpTag};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

/// The bound of every wait.
const LIMIT: Duration = Duration::from_secs(20);
/// An op's inactivity deadline: a rank that waits for it failed to hear.
const OP_TIMEOUT: Duration = Duration::from_secs(10);
const HELLO_LEN: usize = kungfu_transport::handshake::HELLO_LEN;
const ACK_LEN: usize = kungfu_transport::handshake::ACK_LEN;
/// A hello's status codes (transport/src/handshake/messages.rs).
const CLUSTER: u8 = 1;
const BAD_RANK: u8 = 5;
const MALFORMED: u8 = 6;

/// A hello as `from` dialing `to` in a job of `cluster` and `peers`
/// (version 0, epoch 0, no secret, a zero nonce), written out by hand
/// from the documented layout.
fn hello(cluster: u64, peers: &PeerList, from: u32, to: u32) -> [u8; HELLO_LEN] {
    let mut h = [0u8; HELLO_LEN];
    h[0..4].copy_from_slice(b"KH\x03\x01");
    h[4..8].copy_from_slice(&from.to_le_bytes());
    h[8..12].copy_from_slice(&to.to_le_bytes());
    h[16..24].copy_from_slice(&cluster.to_le_bytes());
    h[24..32].copy_from_slice(&peers.digest().0.to_le_bytes());
    h
}

/// Sends `bytes` to `addr`, closes, and returns the answer's status, if one comes.
async fn throw(addr: &Peer, bytes: &[u8]) -> Option<u8> {
    let mut s = TcpStream::connect((addr.host.as_str(), addr.port))
        .await
        .expect("connect to a worker");
    // a worker may answer and close before reading everything; then end
    // of stream (a truncated hello is not left waiting)
    let _ = s.write_all(bytes).await;
    let _ = s.shutdown().await;
    let mut ack = [0u8; ACK_LEN];
    match timeout(LIMIT, s.read_exact(&mut ack)).await {
        Ok(Ok(_)) => {
            assert_eq!(&ack[0..4], b"KH\x03\x02", "an answer");
            Some(ack[4])
        }
        Ok(Err(_)) => None,
        Err(_) => panic!("no answer and no close within {LIMIT:?}"),
    }
}

/// What the proxy in front of rank 0 does to the connection of the client
/// that dials it with `from`'s hello.
#[derive(Clone)]
struct Forge {
    from: u32,
    /// Written to rank 0 right after the client's hello, as if the client
    /// sent it.
    inject: Vec<u8>,
    /// Close the connection to rank 0 after the injection (a cut frame).
    cut: bool,
}

/// What each client sent through a proxy, by connection.
type Recording = Arc<Mutex<Vec<Vec<u8>>>>;

/// A proxy on a free loopback port forwarding each connection to `target`,
/// recording what each client sent (its first MiB) and forging per
/// `forge`.
async fn proxy(target: SocketAddr, forge: Option<Forge>) -> (Peer, Recording) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let me = l.local_addr().unwrap();
    let recorded: Recording = Arc::default();
    let rec = recorded.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = l.accept().await {
            let slot = {
                let mut r = rec.lock().unwrap();
                r.push(Vec::new());
                r.len() - 1
            };
            let (rec, forge) = (rec.clone(), forge.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(target).await else {
                    return;
                };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                // rank 0's answer goes back first, and is awaited before
                // forging: what is forged comes after the handshake
                let (answered, answer) = tokio::sync::oneshot::channel();
                let back = tokio::spawn(async move {
                    let mut ack = [0u8; ACK_LEN];
                    if sr.read_exact(&mut ack).await.is_ok() && cw.write_all(&ack).await.is_ok() {
                        let _ = answered.send(());
                        let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    }
                });
                let mut h = [0u8; HELLO_LEN];
                if cr.read_exact(&mut h).await.is_err() || sw.write_all(&h).await.is_err() {
                    return;
                }
                rec.lock().unwrap()[slot].extend_from_slice(&h);
                let from = u32::from_le_bytes(h[4..8].try_into().unwrap());
                if let Some(f) = forge.filter(|f| f.from == from) {
                    if timeout(LIMIT, answer).await.is_err() {
                        return;
                    }
                    let _ = sw.write_all(&f.inject).await;
                    if f.cut {
                        // the connection is cut: both ends see it end
                        back.abort();
                        return;
                    }
                }
                let mut buf = vec![0u8; 64 << 10];
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    let mut r = rec.lock().unwrap();
                    let room = (1usize << 20).saturating_sub(r[slot].len());
                    r[slot].extend_from_slice(&buf[..n.min(room)]);
                }
            });
        }
    });
    let p = Peer {
        host: me.ip().to_string(),
        port: me.port(),
    };
    (p, recorded)
}

/// A 3-rank job whose rank 0 is reached through a proxy (its peer-list
/// entry is the proxy's address). Ranks 0 and 1 start connecting at once;
/// rank 2 only when `go` is called, so that intruders can be thrown at the
/// acceptors first.
struct Job {
    cluster: u64,
    peers: PeerList,
    /// Where ranks 0 and 1 really listen.
    listening: Vec<Peer>,
    recorded: Recording,
    connecting: Vec<tokio::task::JoinHandle<Arc<TcpTransport>>>,
    rank2: Option<(TcpConfig, TcpListener)>,
}

impl Job {
    async fn start(forge: Option<Forge>) -> Job {
        let (ls, direct) = bind_loopback(3).await;
        let real0 = ls[0].local_addr().unwrap();
        let (front, recorded) = proxy(real0, forge).await;
        let mut entries = direct.peers().to_vec();
        entries[0] = front;
        let peers = PeerList::new(entries).unwrap();
        let cluster = unique_cluster_id();
        let mut ls = ls.into_iter();
        let mut connecting = Vec::new();
        let mut rank2 = None;
        for r in 0..3u32 {
            let mut c =
                TcpConfig::new(cluster, ClusterVersion(0), Epoch(0), Rank(r), peers.clone());
            c.connect_timeout = LIMIT;
            c.max_frame = 1 << 20;
            let l = ls.next().unwrap();
            if r == 2 {
                rank2 = Some((c, l));
            } else {
                connecting.push(tokio::spawn(async move {
                    TcpTransport::connect(c, l).await.expect("connect")
                }));
            }
        }
        Job {
            cluster,
            listening: direct.peers()[..2].to_vec(),
            peers,
            recorded,
            connecting,
            rank2,
        }
    }

    /// Starts rank 2 and returns the sessions of all three.
    async fn go(mut self) -> (Vec<Session<TcpTransport>>, Recording) {
        let (c, l) = self.rank2.take().unwrap();
        self.connecting.push(tokio::spawn(async move {
            TcpTransport::connect(c, l).await.expect("connect")
        }));
        let mut out = Vec::new();
        for t in self.connecting {
            let t = timeout(LIMIT, t).await.expect("connected in time").unwrap();
            let cfg = SessionConfig {
                op_timeout: OP_TIMEOUT,
                ..SessionConfig::default()
            };
            out.push(Session::new(t, self.peers.clone(), cfg).unwrap());
        }
        (out, self.recorded)
    }
}

/// `rounds` allreduces on every rank; each rank's results, or its first
/// error.
async fn allreduce(ss: &[Session<TcpTransport>], rounds: usize) -> Vec<Result<(), String>> {
    let tasks: Vec<_> = ss
        .iter()
        .enumerate()
        .map(|(r, s)| {
            let s = s.clone();
            tokio::spawn(async move {
                for i in 0..rounds {
                    // integer-valued, so the sum is exact in any order
                    let x: Vec<f32> = (0..1000).map(|j| (r * 1000 + j + i) as f32).collect();
                    let y = s
                        .allreduce(&format!("step{i}"), &x, ReduceOp::Sum)
                        .await
                        .map_err(|e| chain(&e))?;
                    let want: Vec<f32> = (0..1000).map(|j| (3 * j + 3000 + 3 * i) as f32).collect();
                    assert_eq!(y, want, "rank {r}, round {i}");
                }
                Ok(())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(timeout(LIMIT, t).await.expect("not stuck").unwrap());
    }
    out
}

/// An error and its causes, on one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

fn frame(kind: FrameKind, epoch: u32, op: u64, digest: u32, len: usize) -> Vec<u8> {
    let h = Header {
        kind,
        tag: OpTag {
            epoch: Epoch(epoch),
            op: OpId(op),
            seq: 0,
        },
        chunk: 0,
        step: 0,
        digest,
        len: len as u64,
    };
    let mut b = h.encode().to_vec();
    b.resize(b.len() + len, 0x5a);
    b
}

/// Intruders thrown at a connecting job (one of them replaying an earlier
/// job's connection) are answered or dropped; the job connects and its
/// allreduces are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intruders_while_connecting_do_not_stop_the_job() {
    // an earlier job, whose rank 2 -> rank 0 connection is recorded
    let (earlier, recorded) = Job::start(None).await.go().await;
    assert!(allreduce(&earlier, 3).await.iter().all(Result::is_ok));
    let replay = recorded
        .lock()
        .unwrap()
        .iter()
        .find(|c| c.len() > HELLO_LEN && c[4..8] == 2u32.to_le_bytes())
        .cloned()
        .expect("rank 2's connection recorded");
    drop(earlier);

    let job = Job::start(None).await;
    let (cluster, peers) = (job.cluster, job.peers.clone());
    for target in job.listening.clone() {
        let to = if target == job.listening[0] { 0 } else { 1 };
        let garbage: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect();
        assert_eq!(throw(&target, &garbage).await, Some(MALFORMED));
        assert_eq!(
            throw(&target, b"GET / HTTP/1.1\r\n\r\n").await,
            Some(MALFORMED)
        );
        let good = hello(cluster, &peers, 2, to);
        // cut short, then closed: no answer, nothing held
        assert_eq!(throw(&target, &good[..HELLO_LEN / 2]).await, None);
        let other_job = hello(cluster ^ 1, &peers, 2, to);
        assert_eq!(throw(&target, &other_job).await, Some(CLUSTER));
        // a lower rank (or the worker itself) may not dial
        assert_eq!(
            throw(&target, &hello(cluster, &peers, to, to)).await,
            Some(BAD_RANK)
        );
        assert_eq!(
            throw(&target, &hello(cluster, &peers, 7, to)).await,
            Some(BAD_RANK)
        );
        // the earlier job's real bytes: its hello is another job's
        assert_eq!(throw(&target, &replay).await, Some(CLUSTER));
    }
    // a truncated hello left open must not hold the job up
    let p0 = &job.listening[0];
    let mut silent = TcpStream::connect((p0.host.as_str(), p0.port))
        .await
        .unwrap();
    silent
        .write_all(&hello(cluster, &peers, 2, 0)[..7])
        .await
        .unwrap();

    let (ss, _) = job.go().await;
    let results = allreduce(&ss, 5).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    drop(silent);
}

/// Whole forged frames inside rank 2's real connection to rank 0, of ops
/// nobody runs (other digests, another epoch, an abort): the job's
/// allreduces stay exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_whole_frames_leave_the_job_exact() {
    let mut inject = Vec::new();
    for (i, digest) in [0u32, 0xdead_beef, u32::MAX].into_iter().enumerate() {
        inject.extend(frame(FrameKind::Data, 0, 0xf00 + i as u64, digest, 100));
    }
    inject.extend(frame(FrameKind::Data, 9, 0xf10, 0, 10));
    inject.extend(frame(FrameKind::Abort, 0, 0xf11, 0, 0));
    inject.extend(frame(FrameKind::Data, 0, 0xf12, 0, 0));
    let forge = Forge {
        from: 2,
        inject,
        cut: false,
    };
    let (ss, _) = Job::start(Some(forge)).await.go().await;
    let results = allreduce(&ss, 5).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

/// Forged headers that break rank 2's stream to rank 0: rank 0 loses rank
/// 2 with the protocol error named, and every rank's allreduce fails
/// within the limit instead of waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_headers_lose_the_link_fast() {
    let ok = frame(FrameKind::Data, 0, 0xf00, 0, 0);
    let with = |i: usize, v: u8| {
        let mut b = ok.clone();
        b[i] = v;
        b
    };
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        ("bad kind", with(3, 9), false, "unknown frame kind 9"),
        (
            "bad version",
            with(2, 7),
            false,
            "unsupported frame version 7",
        ),
        ("bad magic", with(0, b'X'), false, "bad magic"),
        ("flags", with(4, 1), false, "reserved flags"),
        (
            "huge length",
            frame(FrameKind::Data, 0, 0xf00, 0, 0)[..32]
                .iter()
                .copied()
                .chain((1u64 << 40).to_le_bytes())
                .collect(),
            false,
            "exceeds the limit",
        ),
        ("cut header", ok[..20].to_vec(), true, "closed"),
        (
            "cut payload",
            frame(FrameKind::Data, 0, 0xf00, 0, 100)[..60].to_vec(),
            true,
            "closed in the middle of a frame",
        ),
    ];
    for (what, inject, cut, says) in cases {
        let started = std::time::Instant::now();
        let forge = Forge {
            from: 2,
            inject,
            cut,
        };
        let (ss, _) = Job::start(Some(forge)).await.go().await;
        let results = allreduce(&ss, 3).await;
        let e0 = results[0].as_ref().expect_err(what);
        assert!(e0.contains("rank 2") && e0.contains(says), "{what}: {e0}");
        assert!(results.iter().all(Result::is_err), "{what}: {results:?}");
        // nobody waited for an op's deadline to find out
        let took = started.elapsed();
        assert!(took < OP_TIMEOUT / 2, "{what}: {took:?} {results:?}");
    }
}
