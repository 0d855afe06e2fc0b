//! The scheduler over the in-memory transport: ops in flight in any order,
//! bad input, faults, and the API surfaces (async, blocking, callbacks).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use kungfu_collectives::{
    CollectiveError, DType, OpKind, OpSpec, ReduceOp, Session, SessionConfig,
};
use kungfu_topology::{PeerList, Rank, Strategy};
use kungfu_transport::mem::{MemConfig, MemNetwork, MemTransport, SeededRng};
use kungfu_transport::{Epoch, FrameKind, Header, OpTag};

mod failures;
mod group;
mod in_place;
mod ops;
mod pool;
mod sendrecv;
mod stall;
mod stats;
mod subgroup;
mod swap;

fn sessions(
    n: usize,
    strategy: Strategy,
    seed: u64,
    timeout: Duration,
) -> Vec<Session<MemTransport>> {
    sessions_with(n, strategy, seed, usize::MAX, timeout)
}

/// As [`sessions`], over a network whose payloads above `eager_max` wait
/// for their receive to be posted (a rendezvous).
fn sessions_with(
    n: usize,
    strategy: Strategy,
    seed: u64,
    eager_max: usize,
    timeout: Duration,
) -> Vec<Session<MemTransport>> {
    let mem = MemConfig {
        delay: Some((seed, Duration::from_micros(300))),
        eager_max,
        ..MemConfig::default()
    };
    let cfg = SessionConfig {
        strategy,
        chunk_bytes: 256,
        op_timeout: timeout,
        ..SessionConfig::default()
    };
    Session::local_cluster(n, mem, cfg)
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

const LONG: Duration = Duration::from_secs(30);

/// Every op of `pending` fails with `PeerLost` naming `peer` and the op
/// `name`, all within 5 s of `since` (when `peer` was killed).
async fn all_fail_losing<T: std::fmt::Debug>(
    pending: Vec<kungfu_collectives::OpHandle<T>>,
    peer: Rank,
    name: &str,
    since: std::time::Instant,
) {
    for h in pending {
        match h.await {
            Err(CollectiveError::PeerLost {
                peer: p, name: n, ..
            }) => {
                assert_eq!(p, peer);
                assert_eq!(&*n, name);
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(since.elapsed() < Duration::from_secs(5));
}
