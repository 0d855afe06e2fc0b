//! `kungfu-sim`'s engine: the library's own plans (the same builders and
//! the same strategy resolution a worker runs) driven over a model of a
//! cluster network, in virtual time.
//!
//! # The model
//!
//! Workers sit `per_host` to a host, in rank order. Every message is one
//! frame a plan hands out, of the bytes it names:
//! - the sender's CPU spends `overhead` on it (one worker sends one frame
//!   at a time), and the receiver's CPU `overhead` plus its bytes at
//!   `cpu_bw` (the copy or reduction into the working buffer);
//! - inside a host it crosses the host's memory (all of the host's frames
//!   in turn, at `intra_bw`) after `intra_latency`;
//! - between hosts it leaves through the sending host's link (egress, at
//!   `link_bw`), crosses the network after `latency` (plus, on a fat tree,
//!   the sending rack's uplink and the receiving rack's downlink, each of
//!   `rack` hosts' links' worth of bandwidth over `oversubscription`), and
//!   enters through the receiving host's link (ingress, at `link_bw`).
//!
//! Each of these is a first-come first-served server: a frame takes the
//! next free time of each in turn, cut through (it does not wait for its
//! last byte to leave a server before it enters the next). A send counts as
//! sent, for the plan's dependencies, when its last byte has left the
//! sender (its egress, or the host's memory). There is no loss, no
//! congestion control and no difference between a copy and a reduction.
//!
//! Plans move no bytes here: a frame's payload is a slice of one static
//! zero buffer and the working buffer is a [`Work`] that writes nothing, so
//! a 4096-worker run needs the plans' memory only.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;

use bytes::Bytes;
use kungfu_collectives::plan::build::{build, PlanInput};
use kungfu_collectives::plan::{ActionId, Plan, Work};
use kungfu_collectives::{DType, OpKind, OpSpec, ReduceOp};
use kungfu_topology::{Peer, PeerList, Rank, Root, Strategy};

/// The cluster network, in seconds and bytes per second.
#[derive(Clone, Debug)]
pub struct Model {
    pub per_host: usize,
    pub link_bw: f64,
    pub latency: f64,
    pub intra_bw: f64,
    pub intra_latency: f64,
    pub cpu_bw: f64,
    pub overhead: f64,
    /// `(hosts per rack, oversubscription)`: a two-level fat tree; `None`:
    /// one non-blocking switch.
    pub fat_tree: Option<(usize, f64)>,
    /// The largest frame a plan sends (`KUNGFU_CHUNK_BYTES`).
    pub chunk_bytes: usize,
    /// Every worker has a link of its own (as when each worker's traffic
    /// is shaped apart: `KUNGFU_FAULTS=rate_mb`), instead of one per host.
    pub link_per_worker: bool,
}

/// What one simulated op took and moved.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// From the start until the last worker's plan is done, in seconds.
    pub time: f64,
    /// Per host link (egress), the most bytes and frames any carried.
    pub link_bytes_max: u64,
    pub link_msgs_max: u64,
    /// Per worker (sent), the most bytes and frames.
    pub worker_bytes_max: u64,
    pub worker_msgs_max: u64,
    /// Every frame of the op.
    pub msgs: u64,
}

/// Writes nothing: the simulation needs the plans' bookkeeping only.
struct NoBytes;

impl Work for NoBytes {
    fn write(&mut self, _: std::ops::Range<usize>, _: &mut dyn FnMut(&mut [u8])) -> bool {
        true
    }
}

/// The payload of every frame: zeros, never read.
static ZEROS: [u8; MAX_FRAME] = [0; MAX_FRAME];
/// The largest frame the simulation carries.
pub const MAX_FRAME: usize = 16 << 20;

/// The peer list of `n` workers, `per_host` to a host.
pub fn peers(n: usize, per_host: usize) -> PeerList {
    let list = (0..n)
        .map(|r| {
            let h = r / per_host;
            Peer {
                host: format!("10.{}.{}.{}", h >> 16, (h >> 8) & 255, h & 255),
                port: 10000 + (r % per_host) as u16,
            }
        })
        .collect();
    PeerList::new(list).expect("distinct peers")
}

/// An allreduce (sum of f32) of `bytes` bytes per worker.
pub fn allreduce(bytes: usize) -> OpSpec {
    OpSpec {
        kind: OpKind::Allreduce(ReduceOp::Sum),
        dtype: DType::F32,
        count: bytes / 4,
        check: 0,
    }
}

/// Resolves `strategy`'s topologies for a cluster once per root, as a
/// worker's session caches them (every rank's plan asks for the same).
pub struct Topologies<'a> {
    peers: &'a PeerList,
    strategy: Strategy,
    bytes: usize,
    cache: std::cell::RefCell<std::collections::HashMap<Root, Arc<kungfu_topology::Topology>>>,
}

impl<'a> Topologies<'a> {
    pub fn new(peers: &'a PeerList, strategy: Strategy, spec: &OpSpec) -> Result<Self, String> {
        Ok(Topologies {
            peers,
            strategy,
            bytes: spec.block_bytes().ok_or("the op's size overflows")?,
            cache: Default::default(),
        })
    }

    fn get(&self, root: Root) -> Arc<kungfu_topology::Topology> {
        self.cache
            .borrow_mut()
            .entry(root)
            .or_insert_with(|| Arc::new(self.strategy.resolve(self.peers, root, self.bytes)))
            .clone()
    }

    /// Every worker's plan for `spec` (see [`Topologies::plan`]).
    pub fn plans(&self, spec: &OpSpec, chunk_bytes: usize) -> Result<Vec<Plan>, String> {
        (0..self.peers.len())
            .map(|r| self.plan(spec, chunk_bytes, r))
            .collect()
    }

    /// Worker `me`'s plan for `spec`, as the workers build it.
    pub fn plan(&self, spec: &OpSpec, chunk_bytes: usize, me: usize) -> Result<Plan, String> {
        build(&PlanInput {
            spec,
            me: Rank(me as u32),
            size: self.peers.len(),
            chunk_bytes,
            topology: &|root| self.get(root),
        })
    }
}

/// Every worker's plan for `spec` under `strategy`, as the workers of a
/// cluster of `peers` build them.
pub fn plans(
    peers: &PeerList,
    strategy: Strategy,
    spec: &OpSpec,
    chunk_bytes: usize,
) -> Result<Vec<Plan>, String> {
    Topologies::new(peers, strategy, spec)?.plans(spec, chunk_bytes)
}

/// A time, totally ordered (times are never NaN).
#[derive(Debug)]
struct At(f64);
impl PartialEq for At {
    fn eq(&self, other: &At) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for At {}
impl PartialOrd for At {
    fn partial_cmp(&self, other: &At) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for At {
    fn cmp(&self, other: &At) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

enum Event {
    /// A send of `rank` has left it.
    Sent { rank: u32, id: ActionId },
    /// A frame reaches `to`.
    Arrive {
        to: u32,
        from: u32,
        chunk: u32,
        step: u16,
        len: usize,
    },
}

/// Events by time, then in the order they were made.
#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<(At, usize)>>,
    events: Vec<Option<Event>>,
}

impl Queue {
    fn push(&mut self, t: f64, e: Event) {
        self.heap.push(Reverse((At(t), self.events.len())));
        self.events.push(Some(e));
    }

    fn pop(&mut self) -> Option<(f64, Event)> {
        let Reverse((At(t), k)) = self.heap.pop()?;
        Some((t, self.events[k].take().expect("each event once")))
    }
}

/// A first-come first-served server: the time it is next free.
#[derive(Clone, Copy, Default)]
struct Server(f64);

impl Server {
    /// Takes `len` bytes at `bw` from `t` on (or once free); returns when
    /// the first byte is through.
    fn take(&mut self, t: f64, len: usize, bw: f64) -> f64 {
        let start = t.max(self.0);
        self.0 = start + len as f64 / bw;
        start
    }
}

/// Runs `plans` (one per worker, as [`plans`] builds them) over `model`.
pub fn run(model: &Model, mut plans: Vec<Plan>) -> Result<Outcome, String> {
    let n = plans.len();
    let per_host = model.per_host.max(1);
    let hosts = n.div_ceil(per_host);
    let rack = model.fat_tree.map_or(hosts, |(r, _)| r.max(1));
    let racks = hosts.div_ceil(rack);
    let up_bw = model.fat_tree.map_or(f64::INFINITY, |(r, o)| {
        model.link_bw * r as f64 / o.max(1e-9)
    });
    let mut cpu = vec![0.0f64; n];
    let ports = if model.link_per_worker { n } else { hosts };
    let port = |w: usize| {
        if model.link_per_worker {
            w
        } else {
            w / per_host
        }
    };
    let mut egress = vec![Server::default(); ports];
    let mut ingress = vec![Server::default(); ports];
    let mut memory = vec![Server::default(); hosts];
    let mut up = vec![Server::default(); racks];
    let mut down = vec![Server::default(); racks];
    let mut link_bytes = vec![0u64; hosts];
    let mut link_msgs = vec![0u64; hosts];
    let mut sent_bytes = vec![0u64; n];
    let mut sent_msgs = vec![0u64; n];
    let mut out = Outcome::default();
    let mut queue = Queue::default();
    let mut done_at = vec![None::<f64>; n];
    let mut work = NoBytes;

    // Hands out what `rank`'s plan can send from `t` on.
    macro_rules! transmit {
        ($rank:expr, $t:expr) => {{
            let r: usize = $rank;
            let now: f64 = $t;
            while let Some(tx) = plans[r].poll_transmit() {
                let len = tx.range.len();
                if len > MAX_FRAME {
                    return Err(format!(
                        "a frame of {len} bytes: the simulation carries at most {MAX_FRAME}"
                    ));
                }
                let to = tx.to.idx();
                let start = now.max(cpu[r]) + model.overhead;
                cpu[r] = start;
                let (ha, hb) = (r / per_host, to / per_host);
                let (left, arrive) = if ha == hb {
                    let s = memory[ha].take(start, len, model.intra_bw);
                    let end = s + len as f64 / model.intra_bw;
                    (end, end + model.intra_latency)
                } else {
                    link_bytes[ha] += len as u64;
                    link_msgs[ha] += 1;
                    let s = egress[port(r)].take(start, len, model.link_bw);
                    let mut head = s + model.latency;
                    let (ra, rb) = (ha / rack, hb / rack);
                    if ra != rb {
                        head = up[ra].take(head, len, up_bw);
                        head = down[rb].take(head, len, up_bw);
                    }
                    let s_in = ingress[port(to)].take(head, len, model.link_bw);
                    (
                        s + len as f64 / model.link_bw,
                        s_in + len as f64 / model.link_bw,
                    )
                };
                out.msgs += 1;
                sent_bytes[r] += len as u64;
                sent_msgs[r] += 1;
                queue.push(
                    left,
                    Event::Sent {
                        rank: r as u32,
                        id: tx.id,
                    },
                );
                queue.push(
                    arrive,
                    Event::Arrive {
                        to: to as u32,
                        from: r as u32,
                        chunk: tx.chunk,
                        step: tx.step,
                        len,
                    },
                );
            }
            if done_at[r].is_none() && plans[r].is_done() {
                done_at[r] = Some(now.max(cpu[r]));
            }
        }};
    }

    for r in 0..n {
        transmit!(r, 0.0);
    }
    while let Some((t, e)) = queue.pop() {
        match e {
            Event::Sent { rank, id } => {
                let r = rank as usize;
                plans[r]
                    .handle_sent(id, &mut work)
                    .map_err(|e| format!("rank {r}: {e}"))?;
                transmit!(r, t);
            }
            Event::Arrive {
                to,
                from,
                chunk,
                step,
                len,
            } => {
                let r = to as usize;
                let t = t.max(cpu[r]) + model.overhead + len as f64 / model.cpu_bw;
                cpu[r] = t;
                let payload = Bytes::from_static(&ZEROS[..len]);
                plans[r]
                    .handle_frame(Rank(from), chunk, step, payload, &mut work)
                    .map_err(|e| format!("rank {r}: {e}"))?;
                transmit!(r, t);
            }
        }
    }
    if let Some(r) = (0..n).find(|&r| !plans[r].is_done()) {
        return Err(format!(
            "rank {r} never finished: it waits for {:?}",
            plans[r].waiting_for()
        ));
    }
    out.time = done_at.iter().map(|t| t.unwrap_or(0.0)).fold(0.0, f64::max);
    out.link_bytes_max = link_bytes.iter().copied().max().unwrap_or(0);
    out.link_msgs_max = link_msgs.iter().copied().max().unwrap_or(0);
    out.worker_bytes_max = sent_bytes.iter().copied().max().unwrap_or(0);
    out.worker_msgs_max = sent_msgs.iter().copied().max().unwrap_or(0);
    Ok(out)
}

/// nccl-tests' bus bandwidth of an allreduce of `bytes` taking `time`
/// seconds on `n` workers, in GB/s.
pub fn busbw(bytes: usize, n: usize, time: f64) -> f64 {
    if time <= 0.0 || n < 2 {
        return 0.0;
    }
    bytes as f64 / time * 2.0 * (n - 1) as f64 / n as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bandwidth only: links of 1 GB/s, nothing else costs.
    fn wire(per_host: usize) -> Model {
        Model {
            per_host,
            link_bw: 1e9,
            latency: 0.0,
            intra_bw: f64::INFINITY,
            intra_latency: 0.0,
            cpu_bw: f64::INFINITY,
            overhead: 0.0,
            fat_tree: None,
            chunk_bytes: 1 << 20,
            link_per_worker: false,
        }
    }

    fn time(model: &Model, strategy: Strategy, n: usize, bytes: usize) -> Outcome {
        let p = plans(
            &peers(n, model.per_host),
            strategy,
            &allreduce(bytes),
            model.chunk_bytes,
        );
        run(model, p.unwrap()).unwrap()
    }

    /// A ring allreduce moves 2(n-1)/n of the buffer through every link:
    /// at line rate, its bus bandwidth is the link's.
    #[test]
    fn a_ring_reaches_the_line_rate() {
        let m = wire(1);
        for n in [2, 4, 8] {
            let o = time(&m, Strategy::Ring, n, 8 << 20);
            let bw = busbw(8 << 20, n, o.time);
            assert!((0.9..=1.0001).contains(&bw), "n={n}: {bw} GB/s");
            assert_eq!(o.link_bytes_max as usize, 2 * (n - 1) * (8 << 20) / n);
        }
    }

    /// A star's root takes n-1 buffers in and sends n-1 out: its link is
    /// the bottleneck, (n-1) buffers at line rate each way, overlapped.
    #[test]
    fn a_star_is_bound_by_its_root() {
        let m = wire(1);
        let n = 5;
        let bytes = 4 << 20;
        let o = time(&m, Strategy::Star, n, bytes);
        let line = (n - 1) as f64 * bytes as f64 / 1e9;
        assert!(
            o.time >= line && o.time <= 2.0 * line + 1e-3,
            "{} s for {line}",
            o.time
        );
        assert_eq!(o.link_bytes_max as usize, (n - 1) * bytes);
    }

    /// Latency and overhead: an op of a few bytes costs what its longest
    /// chain of frames costs.
    #[test]
    fn small_ops_pay_latency_per_step() {
        let m = Model {
            latency: 10e-6,
            overhead: 1e-6,
            ..wire(1)
        };
        let o = time(&m, Strategy::Ring, 4, 16);
        // 2(n-1) steps one after another, each at least the latency
        assert!(o.time >= 6.0 * 10e-6, "{}", o.time);
        assert!(o.time < 6.0 * 10e-6 + 1e-4, "{}", o.time);
    }

    /// Every strategy finishes at several scales, hosts of several
    /// workers, and a fat tree.
    #[test]
    fn every_strategy_runs_to_the_end() {
        let m = Model {
            fat_tree: Some((2, 4.0)),
            latency: 2e-6,
            overhead: 1e-6,
            intra_bw: 20e9,
            cpu_bw: 10e9,
            ..wire(4)
        };
        for s in Strategy::ALL {
            for n in [2, 16, 33] {
                let o = time(&m, s, n, 1 << 20);
                assert!(o.time > 0.0 && o.msgs > 0, "{s} n={n}");
            }
        }
    }
}
