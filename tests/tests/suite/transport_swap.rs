//! The runtime transport swap: a training loop of 4 ranks that moves from
//! TCP to QUIC to libfabric (tcp;ofi_rxm) and back to TCP between steps,
//! every allreduce checked exactly; and a transport one rank cannot
//! connect, which changes nothing on any rank.

use std::sync::Arc;
use std::time::Duration;

use kungfu_collectives::{CollectiveError, ReduceOp, Session, SessionConfig};
use kungfu_tests::{bind_loopback, unique_cluster_id};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::any::{self, AnyTransport};
use kungfu_transport::fabric::FabricConfig;
use kungfu_transport::quic::{bind_udp, JobCa, QuicConfig};
use kungfu_transport::tcp::TcpConfig;
use kungfu_transport::{ClusterVersion, Epoch, TransportError};
use tokio::net::TcpListener;

const N: usize = 4;

/// What rank `r` needs to connect any transport of the job.
#[derive(Clone)]
struct Job {
    id: u64,
    peers: PeerList,
    ca: Arc<JobCa>,
}

impl Job {
    async fn listener(&self, r: Rank) -> Result<TcpListener, CollectiveError> {
        let p = self.peers.peer(r).expect("a rank of the job");
        TcpListener::bind((p.host.as_str(), p.port))
            .await
            .map_err(|e| CollectiveError::Transport {
                name: "bind".into(),
                epoch: Epoch(0),
                source: TransportError::Handshake {
                    peer: Some(r),
                    addr: p.to_string(),
                    reason: e.to_string(),
                },
            })
    }

    /// Rank `r`'s endpoint of `kind` at `epoch`.
    async fn connect(
        &self,
        kind: &str,
        r: Rank,
        epoch: Epoch,
    ) -> Result<Arc<AnyTransport>, CollectiveError> {
        let wrap = |source: TransportError| CollectiveError::Transport {
            name: "connect".into(),
            epoch,
            source,
        };
        let (v, peers) = (ClusterVersion(0), self.peers.clone());
        let t = match kind {
            "tcp" => {
                let mut c = TcpConfig::new(self.id, v, epoch, r, peers);
                c.connect_timeout = Duration::from_secs(20);
                any::connect_tcp(c, self.listener(r).await?).await
            }
            "quic" => {
                let tls = self.ca.issue(&r.0.to_string()).map_err(wrap)?;
                let mut c = QuicConfig::new(self.id, v, epoch, r, peers.clone(), tls);
                c.connect_timeout = Duration::from_secs(20);
                any::connect_quic(c, bind_udp(&peers, r).map_err(wrap)?).await
            }
            "fabric" => {
                let provider = Some("tcp;ofi_rxm".into());
                let mut c = FabricConfig::new(self.id, v, epoch, r, peers, provider);
                c.domain = Some("lo".into());
                c.connect_timeout = Duration::from_secs(20);
                any::connect_fabric(c, self.listener(r).await?).await
            }
            other => panic!("no transport {other} in this test"),
        };
        t.map_err(wrap)
    }
}

async fn job() -> (Vec<Session<AnyTransport>>, Job) {
    let (listeners, peers) = bind_loopback(N).await;
    drop(listeners); // each transport binds the ports again
    let job = Job {
        id: unique_cluster_id(),
        peers: peers.clone(),
        ca: Arc::new(JobCa::new().unwrap()),
    };
    let tasks: Vec<_> = (0..N)
        .map(|i| {
            let job = job.clone();
            tokio::spawn(async move { job.connect("tcp", Rank(i as u32), Epoch(0)).await })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let t = t.await.unwrap().unwrap();
        let cfg = SessionConfig {
            strategy: Strategy::Ring,
            chunk_bytes: 64 << 10,
            op_timeout: Duration::from_secs(30),
            ..SessionConfig::default()
        };
        out.push(Session::new(t, peers.clone(), cfg).unwrap());
    }
    (out, job)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_training_loop_swaps_tcp_quic_fabric_tcp() {
    let (ss, job) = job().await;
    let tasks: Vec<_> =
        ss.into_iter()
            .map(|s| {
                let job = job.clone();
                tokio::spawn(async move {
                    let r = s.rank();
                    let mut names = vec![s.transport().name()];
                    for step in 0..12u32 {
                        if step % 3 == 0 && step > 0 {
                            let to = ["quic", "fabric", "tcp"][(step / 3 - 1) as usize];
                            let job = job.clone();
                            let epoch =
                                s.swap_transport(to, true, |e| async move {
                                    job.connect(to, r, e).await
                                })
                                .await
                                .unwrap_or_else(|e| panic!("rank {r}: swap to {to}: {e}"));
                            assert_eq!(epoch, Epoch(step / 3));
                            names.push(s.transport().name());
                        }
                        // a gradient of 200_003 floats: rendezvous-sized chunks on fabric
                        let g: Vec<f32> = (0..200_003)
                            .map(|i| ((i as u32 + step + r.0) % 11) as f32)
                            .collect();
                        let sum = s
                            .allreduce(&format!("grad{step}"), &g, ReduceOp::Sum)
                            .await
                            .unwrap();
                        let want: Vec<f32> = (0..200_003)
                            .map(|i| {
                                (0..N as u32)
                                    .map(|q| ((i as u32 + step + q) % 11) as f32)
                                    .sum()
                            })
                            .collect();
                        assert!(sum == want, "rank {r} step {step}: wrong sum");
                    }
                    assert_eq!(names, ["tcp", "quic", "fabric", "tcp"]);
                    s.barrier("end").await.unwrap();
                    s.close(Duration::from_secs(5)).await;
                })
            })
            .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(240), t)
            .await
            .expect("the loop ended")
            .unwrap();
    }
}

/// A swap that was refused changed nothing: rank `s` is on TCP at epoch 0,
/// and an allreduce after it is exact; then it ends its session.
async fn nothing_changed(s: Session<AnyTransport>) {
    let r = s.rank();
    assert_eq!((s.epoch(), s.transport().name()), (Epoch(0), "tcp"));
    let x = s
        .allreduce("after", &[r.0 as i32 + 1; 5], ReduceOp::Sum)
        .await
        .unwrap();
    assert_eq!(x, vec![10; 5]);
    s.barrier("end").await.unwrap();
    s.close(Duration::from_secs(5)).await;
}

/// Runs `f` for every rank's session at once, each bounded.
async fn on_every_rank<F, Fut>(ss: Vec<Session<AnyTransport>>, job: &Job, f: F)
where
    F: Fn(Session<AnyTransport>, Job) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let tasks: Vec<_> = ss
        .into_iter()
        .map(|s| tokio::spawn(f(s, job.clone())))
        .collect();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("ended")
            .unwrap();
    }
}

/// Rank 2 cannot connect the new transport (it says so): every rank gets
/// an error, the epoch stays, and the next allreduce runs on TCP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transport_one_rank_lacks_changes_nothing() {
    let (ss, job) = job().await;
    on_every_rank(ss, &job, |s, job| async move {
        let r = s.rank();
        let available = r != Rank(2);
        let connect = |e| async move { job.connect("quic", r, e).await };
        let err = s
            .swap_transport("quic", available, connect)
            .await
            .unwrap_err();
        assert!(
            matches!(err, CollectiveError::Mismatch { .. }),
            "rank {r}: {err}"
        );
        assert!(err.to_string().contains("not available"), "rank {r}: {err}");
        nothing_changed(s).await;
    })
    .await;
}

/// Every rank can connect the new transport and says so, and the swap is
/// agreed; then rank 2's connect fails (it connects QUIC, then gives up):
/// the other ranks, connected, hear of it at the second agreement
/// ("another rank could not connect it"), and every rank stays on TCP at
/// epoch 0, with an exact allreduce after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connect_that_fails_after_agreement_changes_nothing() {
    let (ss, job) = job().await;
    on_every_rank(ss, &job, |s, job| async move {
        let r = s.rank();
        // rank 2 keeps its connected endpoint until the end, so that the
        // others' connects all succeed: only its own answer at the second
        // agreement differs
        let kept = Arc::new(std::sync::Mutex::new(None));
        let keep = kept.clone();
        let connect = |e| async move {
            let t = job.connect("quic", r, e).await?;
            if r != Rank(2) {
                return Ok(t);
            }
            *keep.lock().unwrap() = Some(t);
            Err(CollectiveError::Transport {
                name: "connect".into(),
                epoch: e,
                source: TransportError::Unavailable {
                    transport: "quic".into(),
                    reason: "rank 2 gives up after connecting (the test)".into(),
                },
            })
        };
        let err = s.swap_transport("quic", true, connect).await.unwrap_err();
        let text = chain(&err);
        if r == Rank(2) {
            assert!(text.contains("gives up after connecting"), "{r}: {text}");
        } else {
            assert!(
                text.contains("another rank could not connect it"),
                "{r}: {text}"
            );
        }
        nothing_changed(s).await;
        drop(kept);
    })
    .await;
}

/// An error and its sources, as one line.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        out.push_str(": ");
        out.push_str(&s.to_string());
        next = s.source();
    }
    out
}
