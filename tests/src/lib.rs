//! Helpers shared by the cross-crate tests in `tests/tests/suite/`, and the
//! transport conformance suite ([`conformance`]) that every wire runs.

pub mod conformance;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use kungfu_topology::{Peer, PeerList, Rank};
use kungfu_transport::shm::{ShmConfig, ShmTransport};
use kungfu_transport::tcp::{TcpConfig, TcpTransport};
use kungfu_transport::{ClusterVersion, Epoch, TransportError};
use tokio::net::TcpListener;

/// Binds `n` listeners on free loopback ports and returns them with the
/// peer list they form.
pub async fn bind_loopback(n: usize) -> (Vec<TcpListener>, PeerList) {
    let mut listeners = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..n {
        let l = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let a = l.local_addr().expect("local addr");
        peers.push(Peer {
            host: a.ip().to_string(),
            port: a.port(),
        });
        listeners.push(l);
    }
    (listeners, PeerList::new(peers).expect("distinct ports"))
}

/// `n` TCP endpoints in this process, fully connected over loopback.
pub async fn tcp_cluster(n: usize, cluster_id: u64) -> (Vec<Arc<TcpTransport>>, PeerList) {
    tcp_cluster_with(n, cluster_id, |_| {}).await
}

/// [`tcp_cluster`], with each endpoint's config adjusted by `tune`.
pub async fn tcp_cluster_with(
    n: usize,
    cluster_id: u64,
    tune: impl Fn(&mut TcpConfig),
) -> (Vec<Arc<TcpTransport>>, PeerList) {
    let (listeners, peers) = bind_loopback(n).await;
    let tasks: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(i, l)| {
            let mut cfg = TcpConfig::new(
                cluster_id,
                ClusterVersion(0),
                Epoch(0),
                Rank(i as u32),
                peers.clone(),
            );
            cfg.connect_timeout = Duration::from_secs(20);
            tune(&mut cfg);
            tokio::spawn(TcpTransport::connect(cfg, l))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        let r: Result<Arc<TcpTransport>, TransportError> = t.await.expect("connect task");
        out.push(r.expect("connect"));
    }
    (out, peers)
}

/// A cluster id no other test or job uses (ring files are named by it).
pub fn unique_cluster_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    kungfu_topology::fnv1a64(
        now,
        &[
            std::process::id().to_le_bytes().as_slice(),
            &NEXT.fetch_add(1, Ordering::Relaxed).to_le_bytes(),
        ]
        .concat(),
    )
}

/// `n` shared-memory endpoints in this process, with rings of `ring_bytes`.
pub async fn shm_cluster(n: usize, ring_bytes: usize) -> Vec<Arc<ShmTransport>> {
    let id = unique_cluster_id();
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut cfg = ShmConfig::new(id, ClusterVersion(0), Epoch(0), Rank(i as u32), n);
            cfg.ring_bytes = ring_bytes;
            cfg.connect_timeout = Duration::from_secs(20);
            tokio::spawn(ShmTransport::connect(cfg))
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("connect task").expect("shm connect"));
    }
    out
}

/// Runs `cmd` to completion within `limit`, capturing its output; past the
/// limit it is sent SIGTERM (kungfu-run forwards it to its workers), then
/// SIGKILL, and the caller panics.
pub fn run_bounded(mut cmd: std::process::Command, limit: Duration) -> std::process::Output {
    use std::process::Stdio;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let pid = child.id().to_string();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || drop(tx.send(child.wait_with_output())));
    match rx.recv_timeout(limit) {
        Ok(out) => out.expect("wait"),
        Err(_) => {
            let _ = std::process::Command::new("kill").arg(&pid).status();
            // kungfu-run stops its workers on SIGTERM; it gets a few
            // seconds for that, and SIGKILL if it is not done by then
            let out = match rx.recv_timeout(Duration::from_secs(3)) {
                Ok(Ok(out)) => output_text(&out),
                _ => {
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &pid])
                        .status();
                    "(killed)".into()
                }
            };
            panic!("{cmd:?} did not finish within {limit:?}\n{out}");
        }
    }
}

/// Polls `f` once. A receive polled once is under way (with no spin, it
/// is registered and asleep), so an event the test causes next happens
/// while it waits, with no sleep to make it likely.
pub async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
}

/// A process's stdout and stderr, for assertion messages.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "--- stdout\n{}--- stderr\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The directory of the workspace's binaries (`target/<profile>`), from the
/// running test binary's path (`target/<profile>/deps/<test>`).
pub fn target_dir() -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

/// Runs `program` under the workspace's `kungfu-run` with `args` and a job
/// `--timeout` of `limit`, bounded here by `limit` + 30 s; panics with the
/// output unless the job succeeded, and returns the output.
pub fn kungfu_run_ok(args: &[&str], program: &std::path::Path, limit: Duration) -> String {
    let run = target_dir().join("kungfu-run");
    assert!(
        run.exists(),
        "{} is missing: build the workspace first",
        run.display()
    );
    let mut c = std::process::Command::new(run);
    c.args(args)
        .arg("--timeout")
        .arg(format!("{}s", limit.as_secs()))
        .arg(program);
    let out = run_bounded(c, limit + Duration::from_secs(30));
    let t = output_text(&out);
    assert!(out.status.success(), "{t}");
    t
}

/// Runs `spec` under `name` on every session at once, each rank with its
/// input from [`reference::inputs`], checks every rank's output against
/// [`reference::expected`] (exact bytes), and returns the outputs in rank
/// order.
///
/// [`reference::inputs`]: kungfu_collectives::reference::inputs
/// [`reference::expected`]: kungfu_collectives::reference::expected
pub async fn run_exact<T: kungfu_transport::Transport>(
    ss: &[kungfu_collectives::Session<T>],
    name: &str,
    spec: kungfu_collectives::OpSpec,
) -> Vec<kungfu_collectives::OpOutput> {
    use kungfu_collectives::reference;
    let inputs = reference::inputs(&spec, ss.len());
    let hs: Vec<_> = ss
        .iter()
        .enumerate()
        .map(|(r, s)| s.submit(name, spec, &inputs[r]))
        .collect();
    let mut outs = Vec::new();
    for (r, h) in hs.into_iter().enumerate() {
        let out = h
            .await
            .unwrap_or_else(|e| panic!("{name} ({}): rank {r}: {e}", spec.describe()));
        assert!(
            out.bytes().map(<[u8]>::to_vec) == reference::expected(&spec, r, &inputs),
            "{name} ({}): rank {r} wrong",
            spec.describe()
        );
        outs.push(out);
    }
    outs
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Instant;

    fn message(e: Box<dyn std::any::Any + Send>) -> String {
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    }

    /// Past its limit a process gets SIGTERM and, if it stops, the caller
    /// panics at once with its output; one that ignores SIGTERM is killed.
    #[test]
    fn run_bounded_stops_what_runs_too_long() {
        let started = Instant::now();
        let mut c = Command::new("sleep");
        c.arg("30");
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_bounded(c, Duration::from_millis(200))
        }));
        let m = message(e.expect_err("sleep 30 outlives 200 ms"));
        assert!(
            m.contains("did not finish") && m.contains("--- stdout"),
            "{m}"
        );
        assert!(started.elapsed() < Duration::from_secs(3), "no grace wait");

        let started = Instant::now();
        let mut c = Command::new("sh");
        // an ignored signal stays ignored across exec
        c.args(["-c", "trap '' TERM; exec sleep 30"]);
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_bounded(c, Duration::from_millis(200))
        }));
        let m = message(e.expect_err("sleep 30 outlives 200 ms"));
        assert!(m.contains("(killed)"), "{m}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(3) && took < Duration::from_secs(20),
            "{took:?}"
        );
    }
}
